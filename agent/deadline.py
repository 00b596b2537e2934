"""Calls that cannot freeze the agent: into the driver, reads of /proc, writes of the textfile.

A driver call can hang: a GPU falling off the bus, an Xid storm, a wedged kernel module; so can
a read of a process's /proc files (its memory's lock held by a task stuck on NFS or FUSE), or a
write to a filesystem that stops answering. Python cannot interrupt a thread blocked in C, so
the agent never makes such a call on a thread it needs: `Worker.call` runs it on a worker
thread and waits at most a budget. A call that
overstays is left where it is (its thread is a daemon and is told, through `abandoned`, to
stop once the call returns) and the next call gets a fresh worker, so one stuck GPU costs one
parked thread, not the agent.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Threads parked in calls that never returned, at most. Each holds a little memory; past this
# many something is badly wrong with the driver and the hard deadline ends the process anyway.
MAX_PARKED = 32


class CallTimeout(Exception):
    """A call did not return within its budget; it may still be running, on `thread` (None: it
    was never started, too many threads being parked already)."""

    def __init__(self, budget_s: float, thread: threading.Thread | None = None) -> None:
        super().__init__(f"no answer within {budget_s:g}s")
        self.budget_s = budget_s
        self.thread = thread


class _Thread:
    """One worker: a daemon thread taking calls from its own queue until abandoned.

    It runs one call at a time, so the outcome of the call in hand has one place to wait in
    (`result` or `error`), and `done`, a lock held while a call is under way, is how the caller
    waits for it: released by the thread when the outcome is in. One lock for the thread's
    life rather than an Event per call, whose Condition costs the caller an extra wake-up
    (woken by the notify, it then waits for the notifier to let go of the Condition's lock).
    """

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self.abandoned = False
        self.done = threading.Lock()
        self.done.acquire()
        self.result: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.abandoned:
            work = self.jobs.get()
            if work is None:
                return
            try:
                self.result = work()
            except BaseException as exc:  # handed to the caller, who decides
                self.error = exc
            self.done.release()

    def outcome(self) -> tuple[object, BaseException | None]:
        """The finished call's result and error, which the thread then forgets."""
        result, error = self.result, self.error
        self.result = self.error = None
        return result, error


class Worker:
    """Runs calls one at a time on a thread of its own, each within a budget."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._current: _Thread | None = None
        self._parked: list[_Thread] = []
        self._started = 0

    @property
    def parked(self) -> int:
        """Threads still blocked in calls that overstayed their budget."""
        self._parked = [t for t in self._parked if t.thread.is_alive()]
        return len(self._parked)

    def call(self, work: Callable[[], T], budget_s: float) -> T:
        """`work()`'s result or exception, or CallTimeout once `budget_s` has passed (the call
        then goes on, on its own thread, and its result is dropped)."""
        if self._current is None:
            if self.parked >= MAX_PARKED:
                raise CallTimeout(0.0)
            self._started += 1
            self._current = _Thread(f"{self._name}-{self._started}")
        worker = self._current
        worker.jobs.put(work)
        if not worker.done.acquire(timeout=budget_s):
            worker.abandoned = True
            # The call may have returned between the timeout and the line above, its thread
            # already back waiting for the next job with `abandoned` read as False: without this
            # it would wait there for good, read as a call that never returned (the GPU stuck
            # until watchdog.exit_after). Still in the call, the thread ends at `abandoned`.
            worker.jobs.put(None)
            self._parked.append(worker)
            self._current = None
            raise CallTimeout(budget_s, worker.thread)
        result, error = worker.outcome()
        if error is not None:
            raise error
        return result  # type: ignore[return-value]  # the thread ran `work`, which returns a T

    def close(self) -> None:
        """Let the current worker end; parked ones end when their call returns."""
        if self._current is not None:
            self._current.jobs.put(None)
            self._current = None
