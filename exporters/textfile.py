"""node_exporter textfile-collector output: the full exposition in a .prom file, rewritten
after each poll.

node_exporter's textfile collector reads every `*.prom` file in its directory on each of its
own scrapes, so the file must never be seen half-written: each version is written to a
hidden temporary file in the same directory (never `*.prom`, so the collector skips it),
flushed and fsynced, then renamed over the old one with `os.replace`, which is atomic on
POSIX within one filesystem. A reader sees the old file or the new one, nothing between.

The writer runs on its own schedule thread and only renders the pipeline's latest state, so
no scrape of /metrics ever waits on, or causes, a disk write. It checks for a new poll a few
times per poll interval (a cheap identity comparison) and writes once per poll.

A write can hang (a filesystem that stops answering: NFS, a full or failing disk), and a thread
blocked in one cannot be freed. So the write runs on a worker thread (`agent.deadline`) and
each check waits for it a moment only; one still under way is left to finish while the checks
go on, and no other write starts until it has; its outcome counts once it is in. One not done
within `WRITE_STUCK_AFTER_S` is stuck: logged once and counted in `failures`; once it returns,
the latest state is written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from agent.deadline import CallTimeout, Worker
from agent.model import AgentState

if TYPE_CHECKING:  # imported by `start`: a one-off write (simulate --textfile) never schedules
    from agent.schedule import Schedule

log = logging.getLogger(__name__)

StateSource = Callable[[], AgentState]
Render = Callable[[AgentState], bytes]

# node_exporter usually runs as another user than the agent: the file must be world-readable.
FILE_MODE = 0o644
# A write not done after this long is stuck (logged and counted once); `stop` waits this long at
# most for the last one.
WRITE_STUCK_AFTER_S = 10.0


def write_atomic(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Replace `path` with `data` so that no reader ever sees a partial file."""
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fchmod(tmp.fileno(), mode)
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    # The rename itself reaches the disk only with the directory: without this a crash could
    # bring back the previous version (or no file) after the poll that wrote the new one. Some
    # filesystems cannot sync a directory (EINVAL), or the directory cannot be opened to read:
    # the new version is in place all the same, so that is no failed write (one that the writer
    # would log as "not written" and do again at each check, forever).
    with contextlib.suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _or_default(wait_s: float | None) -> float:
    return WRITE_STUCK_AFTER_S if wait_s is None else wait_s


@dataclass
class _Write:
    """One write of `state`, begun at `began` (monotonic); `outcome` is filled on the thread that
    writes when it ends (None: written), whether or not anyone still waits for it."""

    state: AgentState
    began: float
    outcome: list[OSError | None] = field(default_factory=list)

    def run(self, path: Path, data: bytes) -> None:
        try:
            write_atomic(path, data)
        except OSError as exc:
            self.outcome.append(exc)
            raise
        self.outcome.append(None)


class TextfileWriter:
    """Writes `render(state)` to `path` once for each new state the pipeline swaps in."""

    def __init__(self, path: str | Path, state: StateSource, render: Render) -> None:
        self.path = Path(path)
        self._state = state
        self._render = render
        self._last: AgentState | None = None
        self._last_error: str | None = None
        self._lock = threading.Lock()
        self._scheduler: Schedule | None = None
        self._worker = Worker("gpuledger-textfile")
        # A write still under way after its check stopped waiting: its thread, and the write.
        self._writing: tuple[threading.Thread, _Write] | None = None
        self._said_stuck = False
        self.writes = 0
        self.failures = 0

    def write_if_new(self, wait_s: float | None = None) -> bool:
        """Write the latest state unless it was written already (or no poll has run yet), waiting
        at most `wait_s` (None: WRITE_STUCK_AFTER_S) for the write: one still under way then
        goes on on its own, and no other starts until it is done."""
        with self._lock:
            if self._still_writing():
                return False
            state = self._state()
            if state is self._last or state.health.polls_total == 0:
                return False
            write = _Write(state, time.monotonic())
            try:
                self._worker.call(partial(write.run, self.path, self._render(state)), _or_default(wait_s))
            except CallTimeout as exc:
                if exc.thread is not None:
                    self._writing = (exc.thread, write)
                    self._still_writing()  # stuck already, where `wait_s` is that long
                return False
            except OSError as exc:
                self._failed(exc)
                return False
            self._written(state)
            return True

    def _written(self, state: AgentState) -> None:
        if self._last_error is not None:
            log.info("textfile %s written again", self.path)
            self._last_error = None
        self._last = state
        self.writes += 1

    def _failed(self, exc: OSError) -> None:
        self.failures += 1
        message = f"{self.path}: {exc.strerror or exc}"
        if message != self._last_error:  # one line per change, not one per poll
            log.warning("textfile not written: %s", message)
            self._last_error = message

    def _still_writing(self) -> bool:
        """Whether a write left under way is still going, said (once) when it is stuck; once it
        has ended, its outcome is taken as a write's that returned in time."""
        if self._writing is None:
            return False
        thread, write = self._writing
        if thread.is_alive():
            stuck_s = time.monotonic() - write.began
            if not self._said_stuck and stuck_s >= WRITE_STUCK_AFTER_S:
                self._said_stuck = True
                self.failures += 1
                log.warning(
                    "textfile not written: %s: a write has not returned in %.0fs (its filesystem does not answer); "
                    "nothing more is written until it does",
                    self.path, stuck_s,
                )  # fmt: skip
            return True
        self._writing = None
        if self._said_stuck:
            self._said_stuck = False
            log.info("textfile %s: the stuck write returned", self.path)
        if write.outcome:
            error = write.outcome[0]
            if error is None:
                self._written(write.state)
            else:
                self._failed(error)
        return False

    def start(self, poll_interval_s: float) -> None:
        """Check for a new poll four times per poll interval, and at least once a second."""
        from agent.schedule import Schedule  # noqa: PLC0415 - run only

        check_s = min(1.0, poll_interval_s / 4)
        scheduler = Schedule("textfile", says_steps=False)  # the poll's schedule says it
        # Each check waits on the write for one check interval at most: a hung filesystem must
        # not hold the schedule's thread (APScheduler would warn at every check it skipped).
        write = partial(self.write_if_new, check_s)
        scheduler.add("textfile", write, check_s)
        scheduler.start()
        self._scheduler = scheduler

    def stop(self, wait_s: float | None = None) -> None:
        """Stop checking, then write the final state if it is new (the daemon's last poll),
        waiting `wait_s` at most (None: WRITE_STUCK_AFTER_S), and not at all while a write is
        stuck."""
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
            self._scheduler = None
        self.write_if_new(wait_s)
        self._worker.close()
