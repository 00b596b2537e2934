"""The ledger as the daemon uses it: opened lazily, and never allowed to stop a poll.

A ledger that cannot be opened (no directory, read-only disk) or cannot flush (disk full) is
reported through `health()` (and so `gpuledger_ledger_up`), logged once per change of state,
and retried at the next flush; charges wait in memory meanwhile, so nothing is lost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from agent.ledger.store import Ledger, LedgerError
from agent.model import Charges, LedgerHealth

log = logging.getLogger(__name__)


class LedgerSink:
    def __init__(self, path: str | Path, *, retention_s: float | None, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.retention_s = retention_s
        self.clock = clock
        self._ledger: Ledger | None = None
        self._waiting: list[Charges] = []  # charges that arrived while the ledger could not open
        self._open_failed = False
        self._open()

    def _open(self) -> Ledger | None:
        if self._ledger is not None:
            return self._ledger
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._ledger = Ledger(self.path, retention_s=self.retention_s, clock=self.clock)
        except (OSError, LedgerError) as exc:
            if not self._open_failed:
                log.error("ledger %s cannot be opened (%s); charges are kept in memory and retried", self.path, exc)
            self._open_failed = True
            return None
        if self._open_failed:
            log.warning("ledger %s is open again", self.path)
        self._open_failed = False
        for charges in self._waiting:
            self._ledger.add(charges)
        self._waiting.clear()
        return self._ledger

    def add(self, charges: Charges) -> None:
        ledger = self._ledger
        if ledger is None:
            self._waiting.append(charges)
        else:
            ledger.add(charges)

    def flush(self) -> bool:
        ledger = self._open()
        return ledger.flush() if ledger is not None else False

    def health(self) -> LedgerHealth:
        ledger = self._ledger
        if ledger is None:
            return LedgerHealth(healthy=False, pending_rows=len(self._waiting), last_flush_at=None)
        return LedgerHealth(
            healthy=ledger.healthy, pending_rows=ledger.pending_rows, last_flush_at=ledger.last_flush_at
        )

    def close(self) -> None:
        ledger = self._open()
        if ledger is not None:
            ledger.close()
