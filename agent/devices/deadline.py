"""Calls into the driver that cannot freeze the agent.

A driver call can hang: a GPU falling off the bus, an Xid storm, a wedged kernel module. Python
cannot interrupt a thread blocked in C, so the agent never makes such a call on a thread it
needs: `Worker.call` runs it on a worker thread and waits at most a budget. A call that
overstays is left where it is (its thread is a daemon and is told, through `abandoned`, to
stop once the call returns) and the next call gets a fresh worker, so one stuck GPU costs one
parked thread, not the agent.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# Threads parked in calls that never returned, at most. Each holds a little memory; past this
# many something is badly wrong with the driver and the hard deadline ends the process anyway.
MAX_PARKED = 32


class CallTimeout(Exception):
    """A call did not return within its budget; it may still be running."""

    def __init__(self, budget_s: float) -> None:
        super().__init__(f"no answer within {budget_s:g}s")
        self.budget_s = budget_s


class _Pending(Generic[T]):
    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


class _Thread:
    """One worker: a daemon thread taking calls from its own queue until abandoned."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], object], _Pending[object]] | None] = queue.SimpleQueue()
        self.abandoned = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.abandoned:
            job = self.jobs.get()
            if job is None:
                return
            work, pending = job
            try:
                pending.result = work()
            except BaseException as exc:  # handed to the caller, who decides
                pending.error = exc
            pending.done.set()


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
        pending: _Pending[T] = _Pending()
        worker.jobs.put((work, pending))  # type: ignore[arg-type]  # one queue carries every T
        if not pending.done.wait(budget_s):
            worker.abandoned = True
            self._parked.append(worker)
            self._current = None
            raise CallTimeout(budget_s)
        if pending.error is not None:
            raise pending.error
        return pending.result  # type: ignore[return-value]  # set when no error was

    def close(self) -> None:
        """Let the current worker end; parked ones end when their call returns."""
        if self._current is not None:
            self._current.jobs.put(None)
            self._current = None
