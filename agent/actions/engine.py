"""The actions as the agent runs them: after each poll, `observe` asks the policy what is due,
logs and counts each decision (one line each), hands runs to the runner, and saves what a
restarted agent must know to the state file, off the poll thread.

Results counted in `gpuledger_actions_total{action,result}`:

    executed   ran and succeeded (exit 0, HTTP 2xx)
    failed     ran and failed (another exit status, a signal, an HTTP error, could not start)
    timeout    killed at its timeout (command) or no answer in time (webhook)
    dry_run    would have run: logged, nothing done
    denied     the target is on a denylist or on no allowlist: never acted on
    cooldown   the action ran on this target less than its cooldown ago (logged once per episode)
    deferred   the action queue is full; tried again at the next poll (logged once per episode)
    cancelled  decided, but by the time a worker was free its flag had cleared or its GPUs had
               changed hands (a job started on the idle node): not run
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.actions.context import summary
from agent.actions.policy import (
    COOLDOWN,
    DEFERRED,
    DENIED,
    DRY_RUN,
    RUN,
    Decision,
    PolicyState,
    Trigger,
    changed,
    decide,
    dump_state,
    load_state,
)
from agent.actions.runner import CANCELLED, EXECUTED, FAILED, TIMEOUT, Job, Outcome, Runner, describe_how
from agent.model import AgentState
from agent.units import format_duration

log = logging.getLogger("gpuledger.actions")

RESULTS = (EXECUTED, FAILED, TIMEOUT, DRY_RUN, DENIED, COOLDOWN, DEFERRED, CANCELLED)


class StateFile:
    """The policy's durable part as a small JSON file, replaced atomically (temp file, fsync,
    rename): a crash leaves the old file or the new one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self, triggers: Sequence[Trigger]) -> PolicyState:
        """What the file holds; an empty state where there is no file. A file that cannot be
        read or parsed is logged and ignored (cooldowns then start afresh)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return PolicyState()
        except OSError as exc:
            log.error("actions state %s: cannot read (%s); starting with no record", self.path, exc.strerror)
            return PolicyState()
        try:
            return load_state(json.loads(text), triggers)
        except ValueError as exc:
            log.error("actions state %s: %s; starting with no record", self.path, exc)
            return PolicyState()

    def save(self, data: Mapping[str, object]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class _Saver:
    """Writes the latest state handed to it on a thread of its own; a slow disk delays the file,
    never a poll. States handed over meanwhile are coalesced: only the newest is written."""

    def __init__(self, file: StateFile) -> None:
        self._file = file
        self._cond = threading.Condition()
        self._pending: Mapping[str, object] | None = None
        self._closed = False
        self._writing = False
        self._thread = threading.Thread(target=self._loop, name="gpuledger-actions-state", daemon=True)
        self._thread.start()

    def put(self, data: Mapping[str, object]) -> None:
        with self._cond:
            self._pending = data
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                data, self._pending = self._pending, None
                if data is None:
                    return
                self._writing = True
            try:
                self._file.save(data)
            except OSError as exc:
                log.error("actions state %s: cannot write (%s)", self._file.path, exc.strerror or exc)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def flush(self, wait_s: float) -> bool:
        """Wait up to `wait_s` for the newest state to be written."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._writing, wait_s)

    def close(self, wait_s: float) -> None:
        if not self.flush(wait_s):
            log.error(
                "actions state %s: the latest decisions were not written within %gs (its filesystem does not "
                "answer); a restarted agent may act on them again",
                self._file.path, wait_s,
            )  # fmt: skip
        with self._cond:
            self._closed = True
            self._cond.notify()


class Actions:
    """The configured triggers, run against each poll's published state."""

    def __init__(
        self,
        triggers: Sequence[Trigger],
        *,
        workers: int = 2,
        queue_size: int = 16,
        state_file: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.triggers = tuple(triggers)
        self._lock = threading.Lock()
        self._counts = {(t.name, result): 0 for t in self.triggers for result in RESULTS}
        self._file = StateFile(state_file) if state_file else None
        self._state = self._file.load(self.triggers) if self._file is not None else PolicyState()
        self._saved = dump_state(self._state)
        self._saver = _Saver(self._file) if self._file is not None else None
        # The latest poll and the policy's state after it, replaced together (one assignment):
        # what a worker checks a job against just before running it.
        self._latest: tuple[AgentState, PolicyState] | None = None
        self._runner = Runner(workers, queue_size, self._done, environ, self._changed)

    def observe(self, state: AgentState) -> None:
        """Decide on the latest poll's state; never waits for an action to run."""
        if state.snapshot is None or not self.triggers:
            return
        self._state, decisions = decide(self._state, state, self.triggers, self._runner.capacity())
        self._latest = (state, self._state)
        for decision in decisions:
            if decision.result == RUN:
                if not self._runner.submit(Job(decision, state.snapshot.taken_at)):
                    # capacity() said there was room; a race with nothing else submitting cannot
                    # happen, but a run must never be lost silently.
                    self._record(decision, FAILED, "the action queue is full")
            else:
                self._record(decision, decision.result, _why(decision))
        if self._saver is not None:
            data = dump_state(self._state)
            if data != self._saved:
                self._saved = data
                self._saver.put(data)

    def counts(self) -> tuple[tuple[str, str, int], ...]:
        """(action, result, count) for every configured action and every result."""
        with self._lock:
            return tuple((name, result, n) for (name, result), n in sorted(self._counts.items()))

    def idle(self) -> bool:
        """No action running or waiting to run."""
        return self._runner.idle()

    def flush(self, wait_s: float = 5.0) -> bool:
        """Wait up to `wait_s` for the state file to hold the latest decisions."""
        return self._saver.flush(wait_s) if self._saver is not None else True

    def close(self, wait_s: float = 1.0) -> None:
        self._runner.close(wait_s)
        if self._saver is not None:
            self._saver.close(wait_s)

    def _changed(self, job: Job) -> str | None:
        latest = self._latest
        return changed(job.decision, job.now, *latest) if latest is not None else None

    def _done(self, job: Job, outcome: Outcome) -> None:
        self._record(job.decision, outcome.result, outcome.detail)

    def _record(self, decision: Decision, result: str, detail: str) -> None:
        with self._lock:
            self._counts[(decision.trigger.name, result)] = self._counts.get((decision.trigger.name, result), 0) + 1
        level = logging.WARNING if result in (FAILED, TIMEOUT) else logging.INFO
        log.log(
            level,
            "action %s %s: %s; %s%s",
            decision.trigger.name,
            result,
            summary(decision),
            describe_how(decision),
            f": {detail}" if detail else "",
            extra={
                "event": "action",
                "action": decision.trigger.name,
                "result": result,
                "rule": decision.target.rule,
                "scope": decision.target.scope,
                "target": decision.target.key,
                "held_s": decision.target.held_s,
                "cost_dollars": decision.target.dollars,
            },
        )


def _why(decision: Decision) -> str:
    if decision.result == DRY_RUN:
        return "dry run, nothing done"
    if decision.result == DENIED:
        return f"not acted on: {decision.reason}"
    if decision.result == COOLDOWN:
        return f"ran on it less than {format_duration(decision.trigger.cooldown_s)} ago ({decision.reason})"
    if decision.result == DEFERRED:
        return decision.reason
    return ""
