"""The ledger as the daemon uses it: opened lazily, and never allowed to stop a poll.

A ledger that cannot be opened (no directory, read-only disk) or cannot flush (disk full) is
reported through `health()` (and so `gpuledger_ledger_up`), logged once per change of state,
and retried at the next flush. Charges wait in memory meanwhile, summed per hour and key, at
most `max_pending_rows` rows (the oldest hours are dropped beyond that, counted in
`gpuledger_ledger_dropped_rows_total` and `_dollars_total`). `close()` says whether every
charge reached the file; where some did not, one error line says how many rows and dollars.

With `write_behind` (what `simulate` uses), a flush's transaction and fsync run on a worker
thread while the caller goes on; the next `health`, `flush` or `close` waits for it first, and
charges added meanwhile wait in order and reach the ledger once it is done. The ledger
therefore sees exactly the calls, in exactly the order, that it would see without it (the
flush even reads the clock at the moment it was asked for), so the file and every published
health are the same: only the wait for the disk overlaps other work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from agent.ledger.files import LedgerError
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
        write_behind: bool = False,
    ) -> None:
        self.path = Path(path)
        self.retention_s = retention_s
        self.clock = clock
        self.node = node
        self._pending = PendingCharges(self.path, max_pending_rows)  # handed to the ledger once it opens
        self._ledger: Ledger | None = None
        self._open_failed = False
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
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-flush") if write_behind else None
        self._in_flight: Future[bool] | None = None
        self._asked_at: float | None = None  # the clock when the flush in flight was asked for
        self._queued: list[Charges] = []  # added while that flush was writing, for after it
        self._open()

    def _ledger_clock(self) -> float:
        asked_at = self._asked_at
        return self.clock() if asked_at is None else asked_at

    def _settle(self) -> None:
        """Wait for the flush in flight, if any (its outcome is in the ledger's health), then
        hand the ledger the charges added meanwhile."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            try:
                in_flight.result()
            finally:
                self._asked_at = None
        queued, self._queued = self._queued, []
        for charges in queued:
            self._add(charges)

    def _open(self) -> Ledger | None:
        if self._ledger is not None:
            return self._ledger
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._ledger = Ledger(
                self.path, node=self.node, retention_s=self.retention_s, clock=self._ledger_clock, pending=self._pending
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
        in_flight = self._in_flight
        if in_flight is not None and not in_flight.done():
            # After the flush, as without write-behind; and the poll need not wait for the disk
            # here, only at the health it publishes at its end, by when the flush is often done.
            self._queued.append(charges)
            return
        self._settle()
        self._add(charges)

    def _add(self, charges: Charges) -> None:
        ledger = self._ledger
        if ledger is None:
            self._pending.add(charges)
        else:
            ledger.add(charges)

    def flush(self) -> bool:
        """True when the pending charges were committed; with `write_behind`, when the flush is
        under way (whether it committed shows in `health()`, which waits for it)."""
        self._settle()
        ledger = self._open()
        if ledger is None:
            return False
        if self._writer is None:
            return ledger.flush()
        self._asked_at = self.clock()
        self._in_flight = self._writer.submit(ledger.flush)
        return True

    def health(self) -> LedgerHealth:
        self._settle()
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

    def close(self) -> bool:
        """Flush and close. True when every charge reached the file; otherwise one error line
        says how many hourly rows and dollars are lost."""
        try:
            self._settle()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
        ledger = self._open()
        if ledger is not None:
            return ledger.close()
        rows, dollars = self._pending.lost()
        if not rows:
            return True
        dropped = self._pending.dropped_rows
        earlier = f", besides {dropped} rows (${self._pending.dropped_dollars:.2f}) dropped earlier" if dropped else ""
        log.error(
            "ledger %s: cannot be opened; exiting with %d hourly rows ($%.2f) that could not be written%s",
            self.path,
            rows,
            dollars,
            earlier,
        )
        return False
