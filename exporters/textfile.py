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
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from agent.model import AgentState

if TYPE_CHECKING:  # imported by `start`: a one-off write (simulate --textfile) never schedules
    from apscheduler.schedulers.background import BackgroundScheduler

log = logging.getLogger(__name__)

StateSource = Callable[[], AgentState]
Render = Callable[[AgentState], bytes]

# node_exporter usually runs as another user than the agent: the file must be world-readable.
FILE_MODE = 0o644


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


class TextfileWriter:
    """Writes `render(state)` to `path` once for each new state the pipeline swaps in."""

    def __init__(self, path: str | Path, state: StateSource, render: Render) -> None:
        self.path = Path(path)
        self._state = state
        self._render = render
        self._last: AgentState | None = None
        self._last_error: str | None = None
        self._lock = threading.Lock()
        self._scheduler: BackgroundScheduler | None = None
        self.writes = 0
        self.failures = 0

    def write_if_new(self) -> bool:
        """Write the latest state unless it was written already (or no poll has run yet)."""
        with self._lock:
            state = self._state()
            if state is self._last or state.health.polls_total == 0:
                return False
            try:
                write_atomic(self.path, self._render(state))
            except OSError as exc:
                self.failures += 1
                message = f"{self.path}: {exc.strerror or exc}"
                if message != self._last_error:  # one line per change, not one per poll
                    log.warning("textfile not written: %s", message)
                    self._last_error = message
                return False
            if self._last_error is not None:
                log.info("textfile %s written again", self.path)
                self._last_error = None
            self._last = state
            self.writes += 1
            return True

    def start(self, poll_interval_s: float) -> None:
        """Check for a new poll four times per poll interval, and at least once a second."""
        from apscheduler.schedulers.background import BackgroundScheduler  # noqa: PLC0415 - run only

        check_s = min(1.0, poll_interval_s / 4)
        scheduler = BackgroundScheduler(daemon=True)
        scheduler.add_job(self.write_if_new, "interval", seconds=check_s, max_instances=1, coalesce=True, id="textfile")
        scheduler.start()
        self._scheduler = scheduler

    def stop(self) -> None:
        """Stop checking, then write the final state if it is new (the daemon's last poll)."""
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
            self._scheduler = None
        self.write_if_new()
