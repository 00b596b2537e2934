"""Running actions off the poll thread: a fixed number of worker threads take jobs from a
queue of bounded length, so a hanging command or a webhook that never answers holds one
worker, never a poll.

A command runs without a shell (argv as configured), in a session of its own, from `/`, with
the flag's context as JSON on stdin and an environment built from nothing: `BASE_ENV` and the
names the trigger passes through from the agent's environment, the trigger's fixed variables,
then the `GPULEDGER_*` context. Past its timeout its process group gets SIGTERM, then SIGKILL
`KILL_GRACE_S` later. A webhook is one POST, with the timeout on connecting and on each read.
Just before a job runs, the runner asks whether the latest poll still shows its target as it
was decided (`changed`); a job whose flag cleared or whose GPUs changed hands meanwhile is
`cancelled`, not run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from agent import __version__
from agent.actions.config import BASE_ENV
from agent.actions.context import alertmanager_body, chat_body, context, environment
from agent.actions.policy import Decision
from agent.scrub import scrub

log = logging.getLogger(__name__)

EXECUTED = "executed"
FAILED = "failed"
TIMEOUT = "timeout"
CANCELLED = "cancelled"  # its target changed while it waited for a worker: not run
KILL_GRACE_S = 2.0
# What a log line keeps of a command's output: its last line, this long at most.
OUTPUT_KEPT = 200


@dataclass(frozen=True, slots=True)
class Outcome:
    result: str  # EXECUTED, FAILED or TIMEOUT
    detail: str  # one line: "exited 0 in 1.2s", "HTTP 503", "killed after 1m"
    duration_s: float


@dataclass(frozen=True, slots=True)
class Job:
    decision: Decision
    now: float  # backend clock at the decision


def describe_how(decision: Decision) -> str:
    """What the action does, safe to log: the command's program, or the webhook's host (a chat
    webhook's path is its secret)."""
    trigger = decision.trigger
    if trigger.command:
        return trigger.command[0]
    parts = urlsplit(trigger.webhook_url)
    return f"POST {parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def child_environment(decision: Decision, now: float, environ: Mapping[str, str]) -> dict[str, str]:
    trigger = decision.trigger
    env = {name: environ[name] for name in (*BASE_ENV, *trigger.pass_env) if name in environ}
    env.setdefault("PATH", os.defpath)
    env.update(trigger.env)
    env.update(environment(decision, now))
    return env


def _last_line(output: bytes) -> str:
    lines = [line for line in output.decode(errors="replace").splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    return last if len(last) <= OUTPUT_KEPT else "..." + last[-OUTPUT_KEPT:]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the command's process group, SIGKILL once the grace is over."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(decision: Decision, now: float, environ: Mapping[str, str]) -> Outcome:
    trigger = decision.trigger
    started = time.monotonic()
    stdin = json.dumps(context(decision, now)).encode()
    try:
        proc = subprocess.Popen(
            list(trigger.command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_environment(decision, now, environ),
            cwd="/",
            start_new_session=True,  # its own process group: killed whole at the timeout
            close_fds=True,
        )
    except OSError as exc:
        return Outcome(FAILED, f"cannot start {trigger.command[0]}: {exc.strerror or exc}", 0.0)
    try:
        out, err = proc.communicate(stdin, timeout=trigger.timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        return Outcome(TIMEOUT, f"killed after {trigger.timeout_s:g}s", time.monotonic() - started)
    took = time.monotonic() - started
    said = _last_line(err) or _last_line(out)
    said = f": {said}" if said else ""
    if proc.returncode == 0:
        return Outcome(EXECUTED, f"exited 0 in {took:.1f}s{said}", took)
    how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited {proc.returncode}"
    return Outcome(FAILED, f"{how} in {took:.1f}s{said}", took)


def post_webhook(decision: Decision) -> Outcome:
    trigger = decision.trigger
    body = alertmanager_body(decision) if trigger.webhook_format == "alertmanager" else chat_body(decision)
    headers = {"Content-Type": "application/json", "User-Agent": f"gpuledger/{__version__}"}
    headers.update(trigger.webhook_headers)
    data = json.dumps(body).encode()
    request = urllib.request.Request(trigger.webhook_url, data=data, headers=headers, method="POST")
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=trigger.timeout_s) as response:
            response.read(65536)
            status = response.status
    except urllib.error.HTTPError as exc:
        return Outcome(FAILED, f"HTTP {exc.code}", time.monotonic() - started)
    except TimeoutError:
        return Outcome(TIMEOUT, f"no answer within {trigger.timeout_s:g}s", time.monotonic() - started)
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            return Outcome(TIMEOUT, f"no answer within {trigger.timeout_s:g}s", time.monotonic() - started)
        return Outcome(FAILED, f"{exc.reason}", time.monotonic() - started)
    except OSError as exc:  # a connection reset mid-answer
        return Outcome(FAILED, f"{exc.strerror or exc}", time.monotonic() - started)
    took = time.monotonic() - started
    return Outcome(EXECUTED, f"HTTP {status} in {took:.1f}s", took)


def execute(job: Job, environ: Mapping[str, str]) -> Outcome:
    if job.decision.trigger.command:
        return run_command(job.decision, job.now, environ)
    return post_webhook(job.decision)


class Runner:
    """`workers` threads running jobs; at most `workers + queue_size` jobs at once, running or
    waiting (`capacity`). `on_done` is called on the worker thread with each outcome."""

    def __init__(
        self,
        workers: int,
        queue_size: int,
        on_done: Callable[[Job, Outcome], None],
        environ: Mapping[str, str] | None = None,
        changed: Callable[[Job], str | None] = lambda job: None,
    ) -> None:
        self.limit = workers + queue_size
        self._on_done = on_done
        self._changed = changed  # why a job no longer fits the latest poll, asked just before it runs
        self._environ = dict(os.environ if environ is None else environ)
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        # Daemon threads: a command still running at exit must not hold the agent up (its
        # process group goes on by itself; the state file already says it ran).
        self._threads = [
            threading.Thread(target=self._work, name=f"gpuledger-action-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def capacity(self) -> int:
        with self._lock:
            return self.limit - self._in_flight

    def submit(self, job: Job) -> bool:
        with self._lock:
            if self._in_flight >= self.limit:
                return False
            self._in_flight += 1
        self._jobs.put(job)
        return True

    def idle(self) -> bool:
        with self._lock:
            return self._in_flight == 0

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                why = self._changed(job)
                outcome = Outcome(CANCELLED, why, 0.0) if why is not None else execute(job, self._environ)
            except Exception as exc:  # a bug here must not kill the worker
                log.exception("action %s: failed to run", job.decision.trigger.name)
                outcome = Outcome(FAILED, scrub(repr(exc)), 0.0)
            try:
                self._on_done(job, outcome)
            finally:
                # Only once its outcome is recorded: idle() then means every outcome is in.
                with self._lock:
                    self._in_flight -= 1

    def close(self, wait_s: float = 1.0) -> bool:
        """Stop the workers after the jobs already taken; wait up to `wait_s` for them. False
        when some are still running (they end with their timeout, or with the process)."""
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)
