"""The ledger as the daemon uses it: opened lazily, and never allowed to stop a poll.

A ledger that cannot be opened (no directory, read-only disk) or cannot flush (disk full) is
reported through `health()` (and so `gpuledger_ledger_up`), logged once per change of state,
and retried at the next flush. Charges wait in memory meanwhile, summed per hour and key, at
most `max_pending_rows` rows (the oldest hours are dropped beyond that, counted in
`gpuledger_ledger_dropped_rows_total` and `_dollars_total`). `close()` says whether every
charge reached the file; where some did not, one error line says how many rows and dollars.

One agent writes a ledger at a time (`WriterLock`): a sink on a ledger another process writes
is refused at once (`LedgerInUse`, from the constructor), since both would charge the same seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from agent.ledger.files import LedgerError, WriterLock
from agent.ledger.known import recorded_gpus
from agent.ledger.pending import DEFAULT_MAX_PENDING_ROWS, PendingCharges
from agent.ledger.read import recorded_period
from agent.ledger.store import Ledger
from agent.model import Charges, LedgerHealth

log = logging.getLogger(__name__)


class LedgerSink:
    def __init__(
        self,
        path: str | Path,
        *,
        retention_s: float | None,
        clock: Callable[[], float] = time.time,
        node: str | None = None,
        max_pending_rows: int = DEFAULT_MAX_PENDING_ROWS,
        fsync_each_flush: bool = True,
    ) -> None:
        self.path = Path(path)
        self.fsync_each_flush = fsync_each_flush
        self.retention_s = retention_s
        self.clock = clock
        self.node = node
        self._pending = PendingCharges(self.path, max_pending_rows)  # handed to the ledger once it opens
        self._ledger: Ledger | None = None
        self._open_failed = False
        self._lock: WriterLock | None = None
        try:
            period = recorded_period(self.path)
            # The GPUs it recorded last: what the node's GPUs go by while the driver cannot say.
            self.known_gpus = recorded_gpus(self.path, node)
        except LedgerError:
            period = None  # not a ledger: _open says so
            self.known_gpus = []
        # Where the ledger's record ended before this run: the time up to this run's first poll
        # went unwatched, and is booked as unobserved (agent_down).
        self.recorded_until: float | None = period[1] if period is not None else None
        # LedgerInUse: refused now, before any poll. OSError (no directory yet, or not writable):
        # taken with the file, when it opens.
        with suppress(OSError):
            self._lock = WriterLock(self.path)
        self._open()

    def _open(self) -> Ledger | None:
        if self._ledger is not None:
            return self._ledger
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._lock is None:
                self._lock = WriterLock(self.path)
            self._ledger = Ledger(
                self.path,
                node=self.node,
                retention_s=self.retention_s,
                clock=self.clock,
                pending=self._pending,
                fsync_each_flush=self.fsync_each_flush,
            )
        except (OSError, LedgerError) as exc:
            if not self._open_failed:
                log.error("ledger %s cannot be opened (%s); charges are kept in memory and retried", self.path, exc)
            self._open_failed = True
            return None
        if self._open_failed:
            log.warning("ledger %s is open again", self.path)
        self._open_failed = False
        return self._ledger

    def add(self, charges: Charges) -> None:
        ledger = self._ledger
        if ledger is None:
            self._pending.add(charges)
        else:
            ledger.add(charges)

    def flush(self) -> bool:
        """True when the pending charges were committed."""
        ledger = self._open()
        return ledger.flush() if ledger is not None else False

    def health(self) -> LedgerHealth:
        ledger = self._ledger
        pending = self._pending
        return LedgerHealth(
            healthy=ledger is not None and ledger.healthy,
            pending_rows=pending.rows,
            last_flush_at=ledger.last_flush_at if ledger is not None else None,
            dropped_rows=pending.dropped_rows,
            dropped_dollars=pending.dropped_dollars,
            corrupt_files=len(ledger.moved_aside) if ledger is not None else 0,
        )

    def close(self, within_s: float | None = None) -> bool:
        """Flush and close, waiting at most `within_s` on the file (see `Ledger.close`). True when
        every charge reached the file; otherwise one error line says how many hourly rows and
        dollars are lost."""
        try:
            return self._close(within_s)
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _close(self, within_s: float | None) -> bool:
        ledger = self._open()
        if ledger is not None:
            return ledger.close(within_s)
        if not self._pending.lost()[0]:
            return True
        log.error("ledger %s: cannot be opened; exiting with %s", self.path, self._pending.lost_text())
        return False
