"""The durable ledger: GPU cost and usage per hour in a SQLite file. This package is the only one
that talks to sqlite3; nothing above it sees a sqlite3 exception (opening and reading raise
`LedgerError`, writing reports failure through `Ledger.flush()` returning False).

The agent calls `add()` after every poll (memory only: charges are summed into one pending row
per hour and key) and `flush()` every `ledger.flush_interval`. A flush is one transaction that
adds the pending sums to the stored ones, so a restarted agent simply keeps adding to the same
file, and a crash at any moment leaves either the whole flush or none of it on disk.

Durability: WAL journal with `synchronous=FULL`. WAL makes every flush atomic and lets `report`
read while the agent writes; FULL makes each commit fsync the WAL, so a flush that returned True
survives a power cut or a kernel panic too (GPU nodes do hang hard: Xid 79). With NORMAL the WAL
is synced only at checkpoints, which at a few pages a minute come every few hours: a panic could
take hours of committed costs with it. One fsync per flush interval (60 s) costs nothing.
`simulate` is the exception (`fsync_each_flush=False`): it flushes every scenario minute, many
times a second, and an fsync there can take as long as a poll; its flushes stay atomic, and the
checkpoint at close syncs the file, but a power cut mid-run may lose its last flushes, which a
rerun rebuilds.

Failure, bounded: while the file cannot be written, pending rows stay in memory, at most
`max_pending_rows` of them (`PendingCharges`); past that the oldest hours are dropped whole,
counted and logged. A file whose pages are corrupt (`PRAGMA quick_check` at open, or a flush
that meets a corrupt page) is renamed `<name>.corrupt-<UTC time>` with its WAL, and a fresh
ledger started in its place; nothing is deleted.

Layout: schema.py (tables and migrations), pending.py (charges in memory), files.py (opening,
migrating, corruption), store.py (the writer), read.py (the readers).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from types import TracebackType

from agent.accounting.sketch import merge_encoded
from agent.ledger.files import CorruptLedger, LedgerError, file_id, is_corruption, move_aside, open_file
from agent.ledger.pending import DEFAULT_MAX_PENDING_ROWS, Batch, PendingCharges, hour_start
from agent.ledger.schema import (
    GPU_COLUMNS,
    GPU_MEASURES,
    IDLE_COLUMNS,
    PRICE_ATTRIBUTES,
    PRICED_MEASURES,
    SIZING_COLUMNS,
    UPSERT_GPU,
    UPSERT_IDLE,
    UPSERT_SIZING,
    UPSERT_WORKLOAD,
    WORKLOAD_COLUMNS,
    WORKLOAD_MEASURES,
)
from agent.model import WORKLOAD_LABELS, Charges

log = logging.getLogger("gpuledger.ledger")


DEFAULT_RETENTION_S = 400 * 86400
# A flush waits at most its busy timeout for another writer; one still under way this long after
# it began is blocked in the filesystem (a hung NFS mount, a dead disk) and may never return.
FLUSH_STUCK_AFTER_S = 30.0


class Ledger:
    """Hourly sums of `Charges`, kept in memory by `add()` and written by `flush()`.

    Safe to call from several threads (the poll adds while the flush job writes). A flush that
    fails (disk full, read-only, locked by another process) keeps the pending rows for the next
    one, up to `max_pending_rows` (see `PendingCharges`); `healthy` says whether the last flush
    worked. A corrupt file is moved aside and a fresh one started, at open or at the flush that
    meets the corruption; `healthy` is False until the fresh file has taken a flush.

    `node` (the agent's node name) is recorded in the file the first time a ledger that knows
    it opens the file; `pending` lets a caller that collected charges before the file could be
    opened hand them over. `fsync_each_flush=False` (for `simulate`) leaves syncing to the
    checkpoints; each flush still commits atomically.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        node: str | None = None,
        retention_s: float | None = DEFAULT_RETENTION_S,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = 5.0,
        max_pending_rows: int = DEFAULT_MAX_PENDING_ROWS,
        pending: PendingCharges | None = None,
        fsync_each_flush: bool = True,
        stuck_after_s: float = FLUSH_STUCK_AFTER_S,
    ) -> None:
        self._path = Path(path)
        self._fsync_each_flush = fsync_each_flush
        self._node = node
        self._retention_s = retention_s
        self._clock = clock
        self._busy_timeout_s = busy_timeout_s
        self._flush_lock = threading.Lock()  # one writer at a time, and none after close
        self._stuck_after_s = stuck_after_s
        self._flushing_since: float | None = None  # monotonic start of the flush under way
        self._said_stuck = False  # the flush under way has been logged as stuck
        self._pending = pending if pending is not None else PendingCharges(self._path, max_pending_rows)
        self._failed_flushes = 0
        self._last_flush_at: float | None = None
        self._retained_below: int | None = None
        # The connection that last committed retention at `_pruned_below`, and the one that
        # recorded the node: what a flush need not do again on it (see `_write`).
        self._pruned: tuple[sqlite3.Connection, int] | None = None
        self._node_recorded: sqlite3.Connection | None = None
        self._closed = False
        self._written_at_close = True
        self._moved_aside: list[Path] = []
        self.file_id: tuple[int, int] | None = None  # (device, inode) of the file opened
        self._conn: sqlite3.Connection | None = self._open()
        self._healthy = not self._moved_aside

    @property
    def path(self) -> Path:
        return self._path

    @property
    def healthy(self) -> bool:
        """False from a failed flush (or a corrupt file moved aside) until the next flush that works,
        and while a flush has been under way for over `stuck_after_s`: one that never returns
        never fails either, and would otherwise read as healthy for good (logged once)."""
        return self._healthy and not self._flush_stuck()

    def _flush_stuck(self) -> bool:
        since = self._flushing_since
        if since is None or time.monotonic() - since <= self._stuck_after_s:
            return False
        if not self._said_stuck:
            self._said_stuck = True
            log.error(
                "ledger %s: a flush has not returned in %gs (the filesystem does not answer); charges are kept "
                "in memory, the oldest hours dropped past ledger.max_pending_rows",
                self._path,
                self._stuck_after_s,
            )
        return True

    @property
    def pending_rows(self) -> int:
        """Hourly rows summed in memory and not yet written."""
        return self._pending.rows

    @property
    def last_flush_at(self) -> float | None:
        """The clock's time of the last flush that worked; None before the first."""
        return self._last_flush_at

    @property
    def rejected_charges(self) -> int:
        """Charges (or parts of them) refused for non-finite figures or an impossible interval."""
        return self._pending.rejected

    @property
    def dropped_rows(self) -> int:
        """Pending rows dropped because more than `max_pending_rows` waited (see `PendingCharges`)."""
        return self._pending.dropped_rows

    @property
    def dropped_dollars(self) -> float:
        return self._pending.dropped_dollars

    @property
    def moved_aside(self) -> tuple[Path, ...]:
        """Where corrupt files found at this ledger's path were moved, oldest first."""
        return tuple(self._moved_aside)

    def add(self, charges: Charges) -> None:
        """Sum one interval's charges into the pending rows of the hours it covers, pro rata."""
        if self._closed:
            raise LedgerError(f"ledger {self._path}: closed")
        # A charge over more hours than may wait in memory is written as it is summed, while
        # the file takes writes (past that, the oldest hours go, as in any outage; a poll never
        # waits behind a stuck flush for the lock).
        self._pending.add(charges, make_room=self.flush if self.healthy else None)

    def flush(self) -> bool:
        """Write every pending row and apply retention in one transaction.

        True when it committed. False when SQLite refused (the rows stay pending for the next
        flush); one log line marks the ledger failing and one marks it writing again.
        """
        with self._flush_lock:
            if self._closed:
                raise LedgerError(f"ledger {self._path}: closed")
            self._flushing_since = started = time.monotonic()
            try:
                return self._flush()
            finally:
                self._flushing_since = None
                if self._said_stuck:
                    self._said_stuck = False
                    took_s = time.monotonic() - started
                    log.warning("ledger %s: the stuck flush returned after %.0fs", self._path, took_s)

    def close(self, within_s: float | None = None) -> bool:
        """Flush, then close the file. True when every charge reached the file; otherwise the rows
        that still cannot be written are logged, with their dollars, as lost (one error line).

        `within_s` bounds the wait for another writer (the busy timeout) and for a flush already
        under way: the daemon's shutdown grace is shorter than the busy timeout, and a close that
        outlived it would be cut off before the lost rows were logged."""
        if not self._flush_lock.acquire(timeout=-1 if within_s is None else max(0.0, within_s)):
            # A flush still waits on the file: its rows are not pending, so they are not counted.
            rows, dollars = self._pending.lost()
            log.error(
                "ledger %s: closing while a flush has not returned in %.1fs (the file is locked by another "
                "process or the filesystem does not answer); %d more hourly rows ($%.2f) could not be written",
                self._path,
                max(0.0, within_s or 0.0),
                rows,
                dollars,
            )
            return False
        try:
            if self._closed:
                return self._written_at_close
            if within_s is not None:
                self._bound_busy_timeout(within_s)
            written = self._flush()
            if not written:
                self._log_lost()
            self._closed = True
            self._written_at_close = written
            if self._conn is not None:
                self._conn.close()
            return written
        finally:
            self._flush_lock.release()

    def _bound_busy_timeout(self, within_s: float) -> None:
        # Called with the flush lock held. The connection's busy handler reads the timeout at
        # each retry, so lowering it here bounds the flush's BEGIN IMMEDIATE.
        self._busy_timeout_s = min(self._busy_timeout_s, max(0.0, within_s))
        if self._conn is not None:
            with suppress(sqlite3.Error):
                self._conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")

    def _log_lost(self) -> None:
        log.error("ledger %s: closing with %s", self._path, self._pending.lost_text())

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _open(self) -> sqlite3.Connection:
        """Open the file; a corrupt one is moved aside (logged) and a fresh one opened instead."""
        if not self._path.parent.is_dir():
            raise LedgerError(f"ledger {self._path}: directory {self._path.parent} does not exist")
        try:
            conn = open_file(self._path, self._busy_timeout_s, self._node, fsync_each_flush=self._fsync_each_flush)
        except CorruptLedger as corrupt:
            self._move_aside(corrupt.detail)
            conn = open_file(self._path, self._busy_timeout_s, self._node, fsync_each_flush=self._fsync_each_flush)
        # Registered once per connection, not at each flush: SQLite expires every prepared
        # statement when a function is (re)registered, so each flush prepared its upserts anew.
        conn.create_function("gpuledger_merge_sketch", 2, merge_encoded, deterministic=True)
        self.file_id = file_id(self._path)
        return conn

    def _move_aside(self, detail: str) -> None:
        aside = move_aside(self._path, time.time())  # the operator's time, as in the log, not the scenario's
        self._moved_aside.append(aside)
        log.error(
            "ledger %s is corrupt (%s); moved it aside to %s and started a fresh ledger", self._path, detail, aside
        )

    def _retention_cutoff(self, now: float) -> int | None:
        if self._retention_s is None:
            return None
        return hour_start(now - self._retention_s)

    def _flush(self) -> bool:
        now = self._clock()
        cutoff = self._retention_cutoff(now)
        batch = self._pending.take()
        if self._healthy and not batch.rows and not batch.sizing_rows and cutoff == self._retained_below:
            self._last_flush_at = now
            return True
        committed = False
        try:
            if self._conn is not None and self.file_id != file_id(self._path):
                # Deleted or replaced under us (an rm -rf of the state directory, a restored copy):
                # writing on would go to a file nobody can read. Write to what is at the path now,
                # a fresh ledger where nothing is.
                log.error(
                    "ledger %s: the file was deleted or replaced while open; writing to the file at that path now"
                    " (a new ledger if there is none)",
                    self._path,
                )
                self._conn.close()
                self._conn = None
                self._path.parent.mkdir(parents=True, exist_ok=True)
            if self._conn is None:  # the fresh file after a corrupt one could not be opened yet
                self._conn = self._open()
            self._write(self._conn, batch, cutoff)
            committed = True
        except (sqlite3.Error, LedgerError) as exc:
            self._failed_flushes += 1
            if isinstance(exc, sqlite3.Error) and is_corruption(exc) and self._conn is not None:
                self._start_afresh(str(exc))
            elif self._healthy:
                log.warning(
                    "ledger %s: cannot write (%s); keeping the pending rows in memory and retrying at every flush",
                    self._path,
                    exc,
                )
            self._healthy = False
            return False
        finally:
            if not committed:
                self._pending.restore(batch)
        self._retained_below = cutoff
        self._last_flush_at = now
        self._pending.written()
        if not self._healthy:
            if self._failed_flushes:
                log.info(
                    "ledger %s: writing again after %d failed flushes; %d hourly rows written",
                    self._path,
                    self._failed_flushes,
                    batch.rows,
                )
            self._healthy = True
            self._failed_flushes = 0
        return True

    def _start_afresh(self, detail: str) -> None:
        """A flush met a corrupt page: move the file aside now; the next flush writes a fresh one."""
        assert self._conn is not None
        self._conn.close()
        self._conn = None
        try:
            self._move_aside(detail)
        except LedgerError as exc:
            log.error("%s", exc)

    def _write(self, conn: sqlite3.Connection, batch: Batch, cutoff: int | None) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Each workload row at its GPU's price in the same hour (a GPU's row and its workloads'
            # rows are added, dropped and restored together); unpriced where the batch has no GPU row.
            prices = {(k.hour, k.node, p.gpu): p.price_values() for k, p in batch.gpu_rows.items()}
            unpriced = (None,) * len(PRICE_ATTRIBUTES)
            conn.executemany(
                UPSERT_WORKLOAD,
                [
                    (
                        *key[:4],  # hour, node, gpu, uuid
                        *key.workload.labels(),
                        key.account,
                        *prices.get((key.hour, key.node, key.gpu), unpriced),
                        *map(sums.get, WORKLOAD_MEASURES, _WORKLOAD_DEFAULTS),
                    )
                    for key, sums in batch.workload_rows.items()
                ],
            )
            conn.executemany(
                UPSERT_GPU,
                [
                    (*key, p.gpu, p.model, *p.price_values(), *map(p.sums.get, GPU_MEASURES, _GPU_DEFAULTS))
                    for key, p in batch.gpu_rows.items()
                ],
            )
            conn.executemany(UPSERT_IDLE, [_in_order(row, IDLE_COLUMNS) for row in batch.idle_columns()])
            conn.executemany(UPSERT_SIZING, [_in_order(row, SIZING_COLUMNS) for row in batch.sizing_columns()])
            if batch.first_at is not None and batch.last_at is not None:
                conn.execute(_RECORD_PERIOD, {"first": batch.first_at, "last": batch.last_at})
            # A ledger opened without its node learns it from what it writes; once recorded (through
            # this connection: a file replaced under us is another), the UPDATE would change nothing.
            recorded = False
            if self._node_recorded is not conn:
                nodes = batch.nodes()
                if len(nodes) == 1:
                    node = nodes.pop()
                    conn.execute("UPDATE ledger_meta SET node = ? WHERE node = ''", (node,))
                    recorded = node != ""
            # Retention: four DELETEs and an UPDATE, a third of a flush's statements. Once they have
            # committed at this cutoff through this connection, nothing older than it is left, and
            # only this writer adds rows (`WriterLock`): they are run again when the cutoff moves (at
            # each hour), the file is another, or this batch holds rows older than it (downtime).
            pruned = cutoff is not None and self._pruned == (conn, cutoff) and not batch.holds_before(cutoff)
            if cutoff is not None and not pruned:
                conn.execute("DELETE FROM workload_hours WHERE hour < ?", (cutoff,))
                conn.execute("DELETE FROM gpu_hours WHERE hour < ?", (cutoff,))
                conn.execute("DELETE FROM idle_hours WHERE hour < ?", (cutoff,))
                conn.execute("DELETE FROM sizing_hours WHERE hour < ?", (cutoff,))
                conn.execute(_RETAIN_PERIOD, {"cutoff": cutoff})
            conn.execute("COMMIT")
            if recorded:
                self._node_recorded = conn
            self._pruned = (conn, cutoff) if cutoff is not None else None
        except BaseException:
            if conn.in_transaction:
                # SQLite may have rolled back already (after SQLITE_FULL); either way nothing committed.
                with suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise


# The period grows to take in what a flush wrote (SQLite's two-argument min/max are NULL when
# either side is, hence the coalesce), and starts no earlier than what retention kept.
_RECORD_PERIOD = (
    "UPDATE ledger_meta SET first_at = min(coalesce(first_at, :first), :first),"
    " last_at = max(coalesce(last_at, :last), :last)"
)
_RETAIN_PERIOD = (
    "UPDATE ledger_meta SET"
    " first_at = CASE WHEN last_at <= :cutoff THEN NULL ELSE :cutoff END,"
    " last_at = CASE WHEN last_at <= :cutoff THEN NULL ELSE last_at END"
    " WHERE first_at < :cutoff"
)


# The workload and GPU upserts' parameters are made as tuples, straight from the pending rows
# (a flush writes tens, every scenario minute in simulate): in these columns' order, checked here.
_WORKLOAD_ROW = ("hour", "node", "gpu", "uuid", *WORKLOAD_LABELS, "account", *PRICE_ATTRIBUTES, *WORKLOAD_MEASURES)
_GPU_ROW = ("hour", "node", "uuid", "gpu", "model", *PRICE_ATTRIBUTES, *GPU_MEASURES)
if _WORKLOAD_ROW != WORKLOAD_COLUMNS or _GPU_ROW != GPU_COLUMNS:
    raise ImportError("the workload_hours or gpu_hours upsert columns changed: update Ledger._write")
# A measure no charge carried is 0 (a priced one NULL: nothing priced reached this row).
_WORKLOAD_DEFAULTS = tuple(None if name in PRICED_MEASURES else 0.0 for name in WORKLOAD_MEASURES)
_GPU_DEFAULTS = tuple(None if name in PRICED_MEASURES else 0.0 for name in GPU_MEASURES)


def _in_order(row: dict[str, object], columns: Sequence[str]) -> tuple[object, ...]:
    """`row`'s values in the order of `columns`: an upsert's parameters, bound by position."""
    return tuple(map(row.__getitem__, columns))
