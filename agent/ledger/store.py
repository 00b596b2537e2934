"""The durable ledger: GPU cost and usage per hour in a SQLite file. The only module that talks to
sqlite3; nothing above it sees a sqlite3 exception (opening and reading raise `LedgerError`,
writing reports failure through `Ledger.flush()` returning False).

The agent calls `add()` after every poll (memory only: charges are summed into one pending row
per hour and key) and `flush()` every `ledger.flush_interval`. A flush is one transaction that
adds the pending sums to the stored ones, so a restarted agent simply keeps adding to the same
file, and a crash at any moment leaves either the whole flush or none of it on disk.

Schema (version 2; `schema_version` holds one row per applied version):

    workload_hours  hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model, team
                    | held_s, busy_s, dollars, joules, energy_dollars
    gpu_hours       hour, node, uuid | gpu, model, dollars_per_hour (latest seen in the hour),
                    observed_s, dollars, idle_s, idle_dollars, unobserved_s, unobserved_dollars, joules,
                    idle_joules, energy_dollars, idle_energy_dollars

Opening a file applies, in one transaction, every migration step after its version (the steps
are listed below `_MIGRATIONS`); a file from a newer gpuledger is refused, never guessed at.
Version 1 (the first release) had `job` where version 2 has `hpc_job` and `unit`, and no energy
dollars: its rows keep NULL there (their price per kWh was never recorded).

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
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import closing, suppress
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

from agent.errors import GpuledgerError
from agent.model import WORKLOAD_LABELS, Charges, Workload

log = logging.getLogger("gpuledger.ledger")

HOUR_S = 3600
DEFAULT_RETENTION_S = 400 * 86400
# An interval longer than this is a clock error upstream, not usage: splitting it into hours
# would make one pending row per hour back to 1970.
MAX_INTERVAL_S = 366 * 86400

_WORKLOAD_KEYS = ("hour", "node", "gpu", "uuid", *WORKLOAD_LABELS)
_WORKLOAD_MEASURES = ("held_s", "busy_s", "dollars", "joules", "energy_dollars")
_GPU_KEYS = ("hour", "node", "uuid")
_GPU_ATTRIBUTES = ("gpu", "model", "dollars_per_hour")
_GPU_MEASURES = (
    "observed_s", "dollars", "idle_s", "idle_dollars", "unobserved_s", "unobserved_dollars", "joules", "idle_joules",
    "energy_dollars", "idle_energy_dollars",
)  # fmt: skip
# Energy dollars are NULL where no price per kWh was set: unknown, not free. A sum of them counts
# the priced parts only and stays NULL while nothing was priced.
_PRICED_MEASURES = frozenset({"energy_dollars", "idle_energy_dollars"})

# --- schema versions -------------------------------------------------------------------------
# Each step takes the file from the version before it to its own, inside the one transaction
# that opens the file; `schema_version` gets a row per step applied. The DDL is written out per
# version, never derived from the model: a step must do tomorrow exactly what it did the day it
# shipped. A new workload label (a new `Workload` field) therefore needs a new step.

_SCHEMA_V1 = (
    "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)",
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

# Version 2: the workload label `job` became `hpc_job` (Prometheus's own `job` label clashed with
# it) and systemd units moved to a label of their own, `unit`; energy dollars are stored.
_SCHEMA_V2 = (
    """CREATE TABLE workload_hours_v2 (
        hour INTEGER NOT NULL, node TEXT NOT NULL, gpu INTEGER NOT NULL, uuid TEXT NOT NULL,
        namespace TEXT NOT NULL, pod TEXT NOT NULL, container TEXT NOT NULL, hpc_job TEXT NOT NULL,
        unit TEXT NOT NULL, user TEXT NOT NULL, model TEXT NOT NULL, team TEXT NOT NULL,
        held_s REAL NOT NULL, busy_s REAL NOT NULL, dollars REAL NOT NULL, joules REAL NOT NULL,
        energy_dollars REAL,
        PRIMARY KEY (hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model, team)
    ) WITHOUT ROWID""",
    # Version 1 wrote a Slurm job id and a systemd unit name into the same `job` column; each value
    # goes to one of the two new ones. That split is one-to-one, so no two rows meet here; the
    # GROUP BY states the rule for every step that changes the key: rows whose new keys are equal
    # are summed, never dropped or refused by the primary key.
    """INSERT INTO workload_hours_v2 (
        hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model, team,
        held_s, busy_s, dollars, joules, energy_dollars
    )
    SELECT hour, node, gpu, uuid, namespace, pod, container,
        CASE WHEN gpuledger_is_hpc_job(job) THEN job ELSE '' END,
        CASE WHEN gpuledger_is_hpc_job(job) THEN '' ELSE job END,
        user, model, team, SUM(held_s), SUM(busy_s), SUM(dollars), SUM(joules), NULL
    FROM workload_hours
    GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12""",
    "DROP TABLE workload_hours",
    "ALTER TABLE workload_hours_v2 RENAME TO workload_hours",
    "ALTER TABLE gpu_hours ADD COLUMN energy_dollars REAL",
    "ALTER TABLE gpu_hours ADD COLUMN idle_energy_dollars REAL",
)

# A Slurm job id, or an array task's "<job>_<task>"; anything else version 1 kept in `job` came
# from a systemd unit ("nginx.service", "inference@0.service").
_SLURM_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?")


def _is_hpc_job(value: str) -> bool:
    return _SLURM_JOB_ID.fullmatch(value) is not None


def _run(statements: Iterable[str]) -> Callable[[sqlite3.Connection], None]:
    def step(conn: sqlite3.Connection) -> None:
        conn.create_function("gpuledger_is_hpc_job", 1, _is_hpc_job, deterministic=True)
        for statement in statements:
            conn.execute(statement)

    return step


# Step n (from 1) brings a file at version n - 1 (0: empty) to version n.
_MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_run(_SCHEMA_V1), _run(_SCHEMA_V2))
SCHEMA_VERSION = len(_MIGRATIONS)


def _upsert(table: str, keys: Sequence[str], replaced: Sequence[str], summed: Sequence[str]) -> str:
    columns = (*keys, *replaced, *summed)
    updates = [f"{c} = excluded.{c}" for c in replaced] + [
        # coalesce: a NULL (unpriced) side adds nothing; NULL + NULL stays NULL.
        f"{c} = coalesce({c} + excluded.{c}, {c}, excluded.{c})"
        if c in _PRICED_MEASURES
        else f"{c} = {c} + excluded.{c}"
        for c in summed
    ]
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(f':{c}' for c in columns)}) "
        f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {', '.join(updates)}"
    )


_UPSERT_WORKLOAD = _upsert("workload_hours", _WORKLOAD_KEYS, (), _WORKLOAD_MEASURES)
_UPSERT_GPU = _upsert("gpu_hours", _GPU_KEYS, _GPU_ATTRIBUTES, _GPU_MEASURES)


class LedgerError(GpuledgerError):
    """The ledger file cannot be opened or read (or is closed); the message names the file."""


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One stored hour: a workload on one cost unit, or (`idle`) the part of a GPU nobody held.

    For an idle row `held_s` is the GPU's idle seconds, `dollars`, `joules` and `energy_dollars`
    its idle cost and energy, `busy_s` 0 and the workload empty. `energy_dollars` is None where
    no price per kWh was set (and for hours written before the ledger stored it).
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
    energy_dollars: float | None = None
    idle: bool = False


class _WorkloadHour(NamedTuple):
    """The key of a pending workload row."""

    hour: int
    node: str
    gpu: int
    uuid: str
    workload: Workload

    def columns(self) -> dict[str, object]:
        return {"hour": self.hour, "node": self.node, "gpu": self.gpu, "uuid": self.uuid, **self.workload.label_dict()}


class _GpuHour(NamedTuple):
    """The key of a pending GPU row."""

    hour: int
    node: str
    uuid: str

    def columns(self) -> dict[str, object]:
        return {"hour": self.hour, "node": self.node, "uuid": self.uuid}


# Measure name -> the pending sum (None: a priced measure nothing priced has reached yet).
_Sums = dict[str, float | None]


def _add_sums(sums: _Sums, names: Iterable[str], values: Iterable[float | None], share: float = 1.0) -> None:
    for name, value in zip(names, values, strict=True):
        if value is None:
            continue
        old = sums.get(name)
        sums[name] = value * share if old is None else old + value * share


# The measures of a charge, in the order of the names above (attrgetter: this runs every poll).
_workload_measures = attrgetter(*_WORKLOAD_MEASURES)
_gpu_measures = attrgetter(*_GPU_MEASURES)


@dataclass(slots=True)
class _PendingGpu:
    gpu: int
    model: str
    dollars_per_hour: float
    sums: _Sums = field(default_factory=dict)

    def columns(self) -> dict[str, object]:
        return {"gpu": self.gpu, "model": self.model, "dollars_per_hour": self.dollars_per_hour}


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


def _finite(values: Sequence[float | None]) -> bool:
    return all(v is None or math.isfinite(v) for v in values)


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
        self._workload_rows: dict[_WorkloadHour, _Sums] = {}
        self._gpu_rows: dict[_GpuHour, _PendingGpu] = {}
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
                measures: tuple[float | None, ...] = _workload_measures(wc)
                if not _finite(measures):
                    self._reject(f"workload charge {wc.workload.describe()} on {wc.uuid}: {measures}")
                    continue
                for hour, share in shares:
                    key = _WorkloadHour(hour, node, wc.gpu, wc.uuid, wc.workload)
                    _add_sums(self._workload_rows.setdefault(key, {}), _WORKLOAD_MEASURES, measures, share)
            for gc in charges.gpus:
                gpu_measures: tuple[float | None, ...] = _gpu_measures(gc)
                if not _finite((*gpu_measures, gc.dollars_per_hour)):
                    self._reject(f"GPU charge on {gc.uuid}: {gpu_measures}")
                    continue
                for hour, share in shares:
                    gpu_key = _GpuHour(hour, node, gc.uuid)
                    pending = self._gpu_rows.get(gpu_key)
                    if pending is None:
                        pending = self._gpu_rows[gpu_key] = _PendingGpu(gc.gpu, gc.model, gc.dollars_per_hour)
                    else:
                        pending.gpu, pending.model, pending.dollars_per_hour = gc.gpu, gc.model, gc.dollars_per_hour
                    _add_sums(pending.sums, _GPU_MEASURES, gpu_measures, share)

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
                    lost_dollars = math.fsum(r.get("dollars") or 0.0 for r in self._workload_rows.values()) + math.fsum(
                        p.sums.get("idle_dollars") or 0.0 for p in self._gpu_rows.values()
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
        self, workload_rows: dict[_WorkloadHour, _Sums], gpu_rows: dict[_GpuHour, _PendingGpu], cutoff: int | None
    ) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(
                _UPSERT_WORKLOAD,
                [key.columns() | _measure_columns(sums, _WORKLOAD_MEASURES) for key, sums in workload_rows.items()],
            )
            conn.executemany(
                _UPSERT_GPU,
                [key.columns() | p.columns() | _measure_columns(p.sums, _GPU_MEASURES) for key, p in gpu_rows.items()],
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

    def _restore(self, workload_rows: dict[_WorkloadHour, _Sums], gpu_rows: dict[_GpuHour, _PendingGpu]) -> None:
        """Put rows a failed flush took back in front of whatever was added meanwhile."""
        with self._lock:
            for key, sums in self._workload_rows.items():
                old = workload_rows.get(key)
                if old is None:
                    workload_rows[key] = sums
                else:
                    _add_sums(old, sums.keys(), sums.values())
            for gpu_key, newer in self._gpu_rows.items():
                older = gpu_rows.get(gpu_key)
                if older is None:
                    gpu_rows[gpu_key] = newer
                else:
                    older.gpu, older.model, older.dollars_per_hour = newer.gpu, newer.model, newer.dollars_per_hour
                    _add_sums(older.sums, newer.sums.keys(), newer.sums.values())
            self._workload_rows, self._gpu_rows = workload_rows, gpu_rows


def _measure_columns(sums: _Sums, measures: Sequence[str]) -> dict[str, object]:
    # A measure no charge carried is 0 (a priced one NULL: nothing priced reached this row).
    return {name: sums.get(name, None if name in _PRICED_MEASURES else 0.0) for name in measures}


def _open(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    """Open or create the ledger: WAL, synchronous=FULL, schema migrated to SCHEMA_VERSION."""
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
        if _schema_version(conn, path) < SCHEMA_VERSION:
            conn.execute("BEGIN IMMEDIATE")
            try:
                # Read again under the write lock: another process may have migrated meanwhile.
                version = _schema_version(conn, path)
                _migrate(conn, version)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            if version > 0:
                log.info("ledger %s: schema migrated from version %d to %d", path, version, SCHEMA_VERSION)
    except sqlite3.Error as exc:
        conn.close()
        raise LedgerError(f"ledger {path}: cannot open: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _schema_version(conn: sqlite3.Connection, path: Path) -> int:
    """The file's schema version; 0 for an empty file. LedgerError for anything else."""
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    if "schema_version" not in tables:
        if tables:
            raise LedgerError(f"ledger {path}: not a gpuledger ledger (tables {', '.join(sorted(tables))})")
        return 0
    (version,) = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    if version is None:
        raise LedgerError(f"ledger {path}: not a gpuledger ledger (no schema version recorded)")
    if version > SCHEMA_VERSION:
        raise LedgerError(
            f"ledger {path}: schema version {version} is newer than this gpuledger reads "
            f"(versions 1 to {SCHEMA_VERSION}): upgrade gpuledger"
        )
    return int(version)


def _migrate(conn: sqlite3.Connection, version: int) -> None:
    """Apply every step after `version`, in order, recording each; the caller holds the transaction."""
    for step_version in range(version + 1, SCHEMA_VERSION + 1):
        _MIGRATIONS[step_version - 1](conn)
        conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (step_version, time.time()))


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
    one transaction, so a flush committing meanwhile is seen wholly or not at all. A file at an
    earlier schema version is copied into memory and migrated there: reading never writes, and
    the agent migrates the file itself the next time it opens it.
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
            version = _schema_version(conn, path)
            if version == 0:
                raise LedgerError(f"ledger {path}: empty, not a gpuledger ledger")
            if version < SCHEMA_VERSION:
                with closing(_migrated_copy(conn, path)) as copy:
                    return _read_rows(copy, where, params)
            return _read_rows(conn, where, params)
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot read: {exc}") from exc


def _migrated_copy(conn: sqlite3.Connection, path: Path) -> sqlite3.Connection:
    copy = sqlite3.connect(":memory:", isolation_level=None)
    try:
        conn.backup(copy)
        copy.execute("BEGIN")
        _migrate(copy, _schema_version(copy, path))  # the copy's own version: the agent may have migrated since
        copy.execute("COMMIT")
    except BaseException:
        copy.close()
        raise
    return copy


def _read_rows(conn: sqlite3.Connection, where: str, params: Sequence[int | float]) -> list[UsageRow]:
    conn.row_factory = sqlite3.Row
    conn.execute("BEGIN")
    workload = conn.execute(f"SELECT * FROM workload_hours{where} ORDER BY hour", params).fetchall()
    gpu = conn.execute(f"SELECT * FROM gpu_hours{where} ORDER BY hour", params).fetchall()
    conn.execute("COMMIT")
    rows = [
        UsageRow(
            hour=r["hour"],
            node=r["node"],
            gpu=r["gpu"],
            uuid=r["uuid"],
            workload=Workload.from_labels(r),
            held_s=r["held_s"],
            busy_s=r["busy_s"],
            dollars=r["dollars"],
            joules=r["joules"],
            energy_dollars=r["energy_dollars"],
        )
        for r in workload
    ]
    rows.extend(
        UsageRow(
            hour=r["hour"],
            node=r["node"],
            gpu=r["gpu"],
            uuid=r["uuid"],
            workload=Workload(),
            held_s=r["idle_s"],
            busy_s=0.0,
            dollars=r["idle_dollars"],
            joules=r["idle_joules"],
            energy_dollars=r["idle_energy_dollars"],
            idle=True,
        )
        for r in gpu
        if r["idle_s"] or r["idle_dollars"] or r["idle_joules"]
    )
    return rows
