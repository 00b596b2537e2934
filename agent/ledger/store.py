"""The durable ledger: GPU cost and usage per hour in a SQLite file. The only module that talks to
sqlite3; nothing above it sees a sqlite3 exception (opening and reading raise `LedgerError`,
writing reports failure through `Ledger.flush()` returning False).

The agent calls `add()` after every poll (memory only: charges are summed into one pending row
per hour and key) and `flush()` every `ledger.flush_interval`. A flush is one transaction that
adds the pending sums to the stored ones, so a restarted agent simply keeps adding to the same
file, and a crash at any moment leaves either the whole flush or none of it on disk.

Schema (version 1; `schema_version` holds one row per applied version):

    workload_hours  hour, node, gpu, uuid, namespace, pod, container, job, user, model, team
                    | held_s, busy_s, dollars, joules
    gpu_hours       hour, node, uuid | gpu, model, dollars_per_hour (latest seen in the hour),
                    observed_s, dollars, idle_s, idle_dollars, unobserved_s, unobserved_dollars, joules,
                    idle_joules

`hour` is the unix time of the start of the UTC hour. Both tables are WITHOUT ROWID with a primary
key that starts with `hour`: the table itself is the index that reports scan by time range and
that retention deletes by, so no second index has to be kept in step.

Durability: WAL journal with `synchronous=FULL`. WAL makes every flush atomic and lets `report`
read while the agent writes; FULL makes each commit fsync the WAL, so a flush that returned True
survives a power cut or a kernel panic too (GPU nodes do hang hard: Xid 79). With NORMAL the WAL
is synced only at checkpoints, which at a few pages a minute come every few hours: a panic could
take hours of committed costs with it. One fsync per flush interval (60 s) costs nothing.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import closing, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from agent.errors import GpuledgerError
from agent.model import Charges, Workload

log = logging.getLogger("gpuledger.ledger")

SCHEMA_VERSION = 1
HOUR_S = 3600
DEFAULT_RETENTION_S = 400 * 86400
# An interval longer than this is a clock error upstream, not usage: splitting it into hours
# would make one pending row per hour back to 1970.
MAX_INTERVAL_S = 366 * 86400

_WORKLOAD_KEYS = ("hour", "node", "gpu", "uuid", "namespace", "pod", "container", "job", "user", "model", "team")
_WORKLOAD_MEASURES = ("held_s", "busy_s", "dollars", "joules")
_GPU_KEYS = ("hour", "node", "uuid")
_GPU_ATTRIBUTES = ("gpu", "model", "dollars_per_hour")
_GPU_MEASURES = (
    "observed_s", "dollars", "idle_s", "idle_dollars", "unobserved_s", "unobserved_dollars", "joules", "idle_joules",
)  # fmt: skip

_SCHEMA_V1 = (
    """CREATE TABLE workload_hours (
        hour INTEGER NOT NULL, node TEXT NOT NULL, gpu INTEGER NOT NULL, uuid TEXT NOT NULL,
        namespace TEXT NOT NULL, pod TEXT NOT NULL, container TEXT NOT NULL, job TEXT NOT NULL,
        user TEXT NOT NULL, model TEXT NOT NULL, team TEXT NOT NULL,
        held_s REAL NOT NULL, busy_s REAL NOT NULL, dollars REAL NOT NULL, joules REAL NOT NULL,
        PRIMARY KEY (hour, node, gpu, uuid, namespace, pod, container, job, user, model, team)
    ) WITHOUT ROWID""",
    """CREATE TABLE gpu_hours (
        hour INTEGER NOT NULL, node TEXT NOT NULL, uuid TEXT NOT NULL,
        gpu INTEGER NOT NULL, model TEXT NOT NULL, dollars_per_hour REAL NOT NULL,
        observed_s REAL NOT NULL, dollars REAL NOT NULL, idle_s REAL NOT NULL, idle_dollars REAL NOT NULL,
        unobserved_s REAL NOT NULL, unobserved_dollars REAL NOT NULL, joules REAL NOT NULL, idle_joules REAL NOT NULL,
        PRIMARY KEY (hour, node, uuid)
    ) WITHOUT ROWID""",
)


def _upsert(table: str, keys: Sequence[str], replaced: Sequence[str], summed: Sequence[str]) -> str:
    columns = (*keys, *replaced, *summed)
    updates = [f"{c} = excluded.{c}" for c in replaced] + [f"{c} = {c} + excluded.{c}" for c in summed]
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
        f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {', '.join(updates)}"
    )


_UPSERT_WORKLOAD = _upsert("workload_hours", _WORKLOAD_KEYS, (), _WORKLOAD_MEASURES)
_UPSERT_GPU = _upsert("gpu_hours", _GPU_KEYS, _GPU_ATTRIBUTES, _GPU_MEASURES)

_WorkloadKey = tuple[int, str, int, str, str, str, str, str, str, str, str]
_GpuKey = tuple[int, str, str]


class LedgerError(GpuledgerError):
    """The ledger file cannot be opened or read (or is closed); the message names the file."""


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One stored hour: a workload on one cost unit, or (`idle`) the part of a GPU nobody held.

    For an idle row `held_s` is the GPU's idle seconds, `dollars` and `joules` its idle cost and
    energy, `busy_s` 0 and the workload empty.
    """

    hour: int
    node: str
    gpu: int
    uuid: str
    workload: Workload
    held_s: float
    busy_s: float
    dollars: float
    joules: float
    idle: bool = False


@dataclass(slots=True)
class _PendingGpu:
    gpu: int
    model: str
    dollars_per_hour: float
    sums: list[float]


def hour_start(t: float) -> int:
    """The unix time of the start of the UTC hour holding `t`."""
    return int(t // HOUR_S) * HOUR_S


def hour_shares(start: float, end: float) -> list[tuple[int, float]]:
    """(hour, fraction of [start, end) that falls in it) for every hour the interval touches.

    A zero-length interval (a reading with nothing to integrate) belongs wholly to its hour.
    """
    if not end > start:
        return [(hour_start(start), 1.0)]
    span = end - start
    shares = []
    hour = hour_start(start)
    while hour < end:
        overlap = min(end, hour + HOUR_S) - max(start, hour)
        if overlap > 0:
            shares.append((hour, overlap / span))
        hour += HOUR_S
    return shares


def _finite(values: Sequence[float]) -> bool:
    return all(math.isfinite(v) for v in values)


class Ledger:
    """Hourly sums of `Charges`, kept in memory by `add()` and written by `flush()`.

    Safe to call from several threads (the poll adds while the flush job writes). A flush that
    fails (disk full, read-only, locked by another process) keeps every pending row for the next
    one, so nothing is lost while the process lives; `healthy` says whether the last flush worked.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        retention_s: float | None = DEFAULT_RETENTION_S,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = 5.0,
    ) -> None:
        self._path = Path(path)
        self._retention_s = retention_s
        self._clock = clock
        self._lock = threading.Lock()  # guards the pending rows
        self._flush_lock = threading.Lock()  # one writer at a time, and none after close
        self._workload_rows: dict[_WorkloadKey, list[float]] = {}
        self._gpu_rows: dict[_GpuKey, _PendingGpu] = {}
        self._healthy = True
        self._failed_flushes = 0
        self._last_flush_at: float | None = None
        self._retained_below: int | None = None
        self._rejected = 0
        self._closed = False
        self._conn = _open(self._path, busy_timeout_s)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def healthy(self) -> bool:
        """False from a failed flush until the next one that works."""
        return self._healthy

    @property
    def pending_rows(self) -> int:
        """Hourly rows summed in memory and not yet written."""
        with self._lock:
            return len(self._workload_rows) + len(self._gpu_rows)

    @property
    def last_flush_at(self) -> float | None:
        """The clock's time of the last flush that worked; None before the first."""
        return self._last_flush_at

    @property
    def rejected_charges(self) -> int:
        """Charges (or parts of them) refused for non-finite figures or an impossible interval."""
        return self._rejected

    def add(self, charges: Charges) -> None:
        """Sum one interval's charges into the pending rows of the hours it covers, pro rata."""
        if not (_finite((charges.start, charges.end)) and charges.end - charges.start <= MAX_INTERVAL_S):
            self._reject(f"interval {charges.start!r} to {charges.end!r}")
            return
        shares = hour_shares(charges.start, charges.end)
        node = charges.node
        with self._lock:
            if self._closed:
                raise LedgerError(f"ledger {self._path}: closed")
            for wc in charges.workloads:
                measures: tuple[float, ...] = tuple(getattr(wc, name) for name in _WORKLOAD_MEASURES)
                if not _finite(measures):
                    self._reject(f"workload charge {wc.workload.describe()} on {wc.uuid}: {measures}")
                    continue
                for hour, share in shares:
                    w = wc.workload
                    key = (hour, node, wc.gpu, wc.uuid, w.namespace, w.pod, w.container, w.job, w.user, w.model, w.team)
                    row = self._workload_rows.get(key)
                    if row is None:
                        self._workload_rows[key] = [m * share for m in measures]
                    else:
                        for i, m in enumerate(measures):
                            row[i] += m * share
            for gc in charges.gpus:
                gpu_measures: tuple[float, ...] = tuple(getattr(gc, name) for name in _GPU_MEASURES)
                if not _finite((*gpu_measures, gc.dollars_per_hour)):
                    self._reject(f"GPU charge on {gc.uuid}: {gpu_measures}")
                    continue
                for hour, share in shares:
                    gpu_key = (hour, node, gc.uuid)
                    pending = self._gpu_rows.get(gpu_key)
                    if pending is None:
                        self._gpu_rows[gpu_key] = _PendingGpu(
                            gc.gpu, gc.model, gc.dollars_per_hour, [m * share for m in gpu_measures]
                        )
                    else:
                        pending.gpu, pending.model, pending.dollars_per_hour = gc.gpu, gc.model, gc.dollars_per_hour
                        for i, m in enumerate(gpu_measures):
                            pending.sums[i] += m * share

    def flush(self) -> bool:
        """Write every pending row and apply retention in one transaction.

        True when it committed. False when SQLite refused (the rows stay pending for the next
        flush); one log line marks the ledger failing and one marks it writing again.
        """
        with self._flush_lock:
            if self._closed:
                raise LedgerError(f"ledger {self._path}: closed")
            return self._flush()

    def close(self) -> None:
        """Flush, then close the file. Rows that still cannot be written are logged as lost."""
        with self._flush_lock:
            if self._closed:
                return
            if not self._flush():
                with self._lock:
                    lost_rows = len(self._workload_rows) + len(self._gpu_rows)
                    lost_dollars = math.fsum(r[2] for r in self._workload_rows.values()) + math.fsum(
                        p.sums[3] for p in self._gpu_rows.values()
                    )
                log.error(
                    "ledger %s: closing with %d hourly rows ($%.2f) that could not be written",
                    self._path,
                    lost_rows,
                    lost_dollars,
                )
            with self._lock:
                self._closed = True
            self._conn.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _reject(self, what: str) -> None:
        self._rejected += 1
        if self._rejected == 1:
            log.warning(
                "ledger %s: refusing %s (not finite or too long); further refusals are only counted", self._path, what
            )

    def _retention_cutoff(self, now: float) -> int | None:
        if self._retention_s is None:
            return None
        return hour_start(now - self._retention_s)

    def _flush(self) -> bool:
        now = self._clock()
        cutoff = self._retention_cutoff(now)
        with self._lock:
            workload_rows, gpu_rows = self._workload_rows, self._gpu_rows
            self._workload_rows, self._gpu_rows = {}, {}
        if self._healthy and not workload_rows and not gpu_rows and cutoff == self._retained_below:
            self._last_flush_at = now
            return True
        committed = False
        try:
            self._write(workload_rows, gpu_rows, cutoff)
            committed = True
        except sqlite3.Error as exc:
            self._failed_flushes += 1
            if self._healthy:
                self._healthy = False
                log.warning(
                    "ledger %s: cannot write (%s); keeping the pending rows in memory and retrying at every flush",
                    self._path,
                    exc,
                )
            return False
        finally:
            if not committed:
                self._restore(workload_rows, gpu_rows)
        self._retained_below = cutoff
        self._last_flush_at = now
        if not self._healthy:
            log.info(
                "ledger %s: writing again after %d failed flushes; %d hourly rows written",
                self._path,
                self._failed_flushes,
                len(workload_rows) + len(gpu_rows),
            )
            self._healthy = True
            self._failed_flushes = 0
        return True

    def _write(
        self, workload_rows: dict[_WorkloadKey, list[float]], gpu_rows: dict[_GpuKey, _PendingGpu], cutoff: int | None
    ) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(_UPSERT_WORKLOAD, [(*key, *sums) for key, sums in workload_rows.items()])
            conn.executemany(
                _UPSERT_GPU,
                [(*key, p.gpu, p.model, p.dollars_per_hour, *p.sums) for key, p in gpu_rows.items()],
            )
            if cutoff is not None:
                conn.execute("DELETE FROM workload_hours WHERE hour < ?", (cutoff,))
                conn.execute("DELETE FROM gpu_hours WHERE hour < ?", (cutoff,))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                # SQLite may have rolled back already (after SQLITE_FULL); either way nothing committed.
                with suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise

    def _restore(self, workload_rows: dict[_WorkloadKey, list[float]], gpu_rows: dict[_GpuKey, _PendingGpu]) -> None:
        """Put rows a failed flush took back in front of whatever was added meanwhile."""
        with self._lock:
            for key, sums in self._workload_rows.items():
                old = workload_rows.get(key)
                if old is None:
                    workload_rows[key] = sums
                else:
                    for i, value in enumerate(sums):
                        old[i] += value
            for gpu_key, newer in self._gpu_rows.items():
                older = gpu_rows.get(gpu_key)
                if older is None:
                    gpu_rows[gpu_key] = newer
                else:
                    older.gpu, older.model, older.dollars_per_hour = newer.gpu, newer.model, newer.dollars_per_hour
                    for i, value in enumerate(newer.sums):
                        older.sums[i] += value
            self._workload_rows, self._gpu_rows = workload_rows, gpu_rows


def _open(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    """Open or create the ledger: WAL, synchronous=FULL, schema at SCHEMA_VERSION."""
    if not path.parent.is_dir():
        raise LedgerError(f"ledger {path}: directory {path.parent} does not exist")
    try:
        # isolation_level=None: transactions are the explicit BEGIN/COMMIT in this module only.
        conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot open: {exc}") from exc
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise LedgerError(f"ledger {path}: the filesystem does not support a WAL journal (got {mode})")
        conn.execute("PRAGMA synchronous=FULL")
        if _schema_version(conn, path) is None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                if _schema_version(conn, path) is None:  # another process may have created it meanwhile
                    _create_schema(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
    except sqlite3.Error as exc:
        conn.close()
        raise LedgerError(f"ledger {path}: cannot open: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _schema_version(conn: sqlite3.Connection, path: Path) -> int | None:
    """The file's schema version; None for an empty file. LedgerError for anything else."""
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    if "schema_version" not in tables:
        if tables:
            raise LedgerError(f"ledger {path}: not a gpuledger ledger (tables {', '.join(sorted(tables))})")
        return None
    (version,) = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    if version is None or version > SCHEMA_VERSION:
        raise LedgerError(
            f"ledger {path}: schema version {version} is not one this gpuledger reads (up to {SCHEMA_VERSION})"
        )
    return int(version)


def _create_schema(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
    for statement in _SCHEMA_V1:
        conn.execute(statement)
    conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (SCHEMA_VERSION, time.time()))


def _bounds(since: float | None, until: float | None) -> tuple[str, list[int | float]]:
    """WHERE clause for the hours that overlap [since, until)."""
    clauses = []
    params: list[int | float] = []
    if since is not None:
        clauses.append("hour >= ?")
        params.append(hour_start(since))
    if until is not None:
        clauses.append("hour < ?")
        params.append(until)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


def read_usage(path: str | Path, *, since: float | None = None, until: float | None = None) -> list[UsageRow]:
    """Every stored hour that overlaps [since, until): workload rows, then one idle row per GPU hour
    (those with idle time). Hours are the ledger's resolution, so a partly covered hour is read whole.

    Opens the file read-only (a missing file is an error, never created) and reads both tables in
    one transaction, so a flush committing meanwhile is seen wholly or not at all.
    """
    path = Path(path)
    if not path.is_file():
        raise LedgerError(f"ledger {path}: no such file")
    where, params = _bounds(since, until)
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot open: {exc}") from exc
    try:
        with closing(conn):
            _schema_version(conn, path)
            conn.execute("BEGIN")
            workload = conn.execute(
                f"SELECT {', '.join(_WORKLOAD_KEYS + _WORKLOAD_MEASURES)} FROM workload_hours{where} ORDER BY hour",
                params,
            ).fetchall()
            gpu = conn.execute(
                f"SELECT hour, node, gpu, uuid, idle_s, idle_dollars, idle_joules FROM gpu_hours{where} ORDER BY hour",
                params,
            ).fetchall()
            conn.execute("COMMIT")
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot read: {exc}") from exc
    rows = [
        UsageRow(
            hour=r[0],
            node=r[1],
            gpu=r[2],
            uuid=r[3],
            workload=Workload(*r[4:11]),
            held_s=r[11],
            busy_s=r[12],
            dollars=r[13],
            joules=r[14],
        )
        for r in workload
    ]
    rows.extend(
        UsageRow(hour, node, index, uuid, Workload(), idle_s, 0.0, idle_dollars, idle_joules, idle=True)
        for hour, node, index, uuid, idle_s, idle_dollars, idle_joules in gpu
        if idle_s or idle_dollars or idle_joules
    )
    return rows
