"""The durable ledger: GPU cost and usage per hour in a SQLite file. The only module that talks to
sqlite3; nothing above it sees a sqlite3 exception (opening and reading raise `LedgerError`,
writing reports failure through `Ledger.flush()` returning False).

The agent calls `add()` after every poll (memory only: charges are summed into one pending row
per hour and key) and `flush()` every `ledger.flush_interval`. A flush is one transaction that
adds the pending sums to the stored ones, so a restarted agent simply keeps adding to the same
file, and a crash at any moment leaves either the whole flush or none of it on disk.

Schema (version 4; `schema_version` holds one row per applied version):

    workload_hours  hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model, team
                    | held_s, busy_s, dollars, joules, energy_dollars, charged_s
    gpu_hours       hour, node, uuid | gpu, model, dollars_per_hour (latest seen in the hour),
                    observed_s, dollars, idle_s, idle_dollars, unobserved_s, unobserved_dollars, joules,
                    idle_joules, energy_dollars, idle_energy_dollars
    ledger_meta     one row: ledger_id, node, created_at, created_by, first_at, last_at

Opening a file applies, in one transaction, every migration step after its version (the steps
are listed below `_MIGRATIONS`); a file from a newer gpuledger is refused, never guessed at.
Version 1 (the first release) had `job` where version 2 has `hpc_job` and `unit`, and no energy
dollars: its rows keep NULL there (their price per kWh was never recorded). Version 3 added
`ledger_meta`: which node the ledger belongs to and the period it records, so that `report`
can merge the ledgers of many nodes and refuse to count one node's time twice. Version 4 added
`charged_s`, a workload's share of the unit's time (held seconds count a shared GPU once per
holder, so only charged seconds add up to the GPU's hours); older rows get it from their dollars.

`hour` is the unix time of the start of the UTC hour. Both tables are WITHOUT ROWID with a primary
key that starts with `hour`: the table itself is the index that reports scan by time range and
that retention deletes by, so no second index has to be kept in step.

Durability: WAL journal with `synchronous=FULL`. WAL makes every flush atomic and lets `report`
read while the agent writes; FULL makes each commit fsync the WAL, so a flush that returned True
survives a power cut or a kernel panic too (GPU nodes do hang hard: Xid 79). With NORMAL the WAL
is synced only at checkpoints, which at a few pages a minute come every few hours: a panic could
take hours of committed costs with it. One fsync per flush interval (60 s) costs nothing.

Failure, bounded: while the file cannot be written, pending rows stay in memory, at most
`max_pending_rows` of them (`PendingCharges`); past that the oldest hours are dropped whole,
counted and logged. A file whose pages are corrupt (`PRAGMA quick_check` at open, or a flush
that meets a corrupt page) is renamed `<name>.corrupt-<UTC time>` with its WAL, and a fresh
ledger started in its place; nothing is deleted.

Reading (`read_ledger`, for `report`) never writes: the file is opened `mode=ro`, and where even
that needs to create the WAL's shared-memory file in a directory the reader may not write,
`immutable=1` (see `fallback_uri`).
"""

from __future__ import annotations

import logging
import math
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from contextlib import closing, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import attrgetter
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

from agent import __version__
from agent.errors import GpuledgerError
from agent.model import WORKLOAD_LABELS, Charges, Workload

log = logging.getLogger("gpuledger.ledger")

HOUR_S = 3600
DEFAULT_RETENTION_S = 400 * 86400
# An interval longer than this is a clock error upstream, not usage: splitting it into hours
# would make one pending row per hour back to 1970.
MAX_INTERVAL_S = 366 * 86400
# Pending rows kept in memory while the file cannot be written. A row takes about 750 bytes
# (measured with tracemalloc on eight GPUs' rows), so the default stays under 4 MB: about ten
# days of an 8-GPU node's hours (16 to 32 rows an hour).
DEFAULT_MAX_PENDING_ROWS = 5000

_WORKLOAD_KEYS = ("hour", "node", "gpu", "uuid", *WORKLOAD_LABELS)
_WORKLOAD_MEASURES = ("held_s", "busy_s", "dollars", "joules", "energy_dollars", "charged_s")
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


# Version 3: the ledger knows itself. One row: a random id (copies of a file share it), the node
# it belongs to, when and by which release it was created, and the period it records (the
# earliest charge start and latest charge end written; NULL while it records nothing). A file
# from before version 3 gets the node most of its rows name, the hours its rows cover, the time
# its first schema step was applied, and '' for the release that created it (not recorded).
_SCHEMA_V3 = (
    """CREATE TABLE ledger_meta (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        ledger_id TEXT NOT NULL, node TEXT NOT NULL, created_at REAL NOT NULL, created_by TEXT NOT NULL,
        first_at REAL, last_at REAL
    )""",
    """INSERT INTO ledger_meta (id, ledger_id, node, created_at, created_by, first_at, last_at)
    SELECT 1, gpuledger_new_ledger_id(),
        coalesce((SELECT node FROM gpu_hours GROUP BY node ORDER BY count(*) DESC, node LIMIT 1), ''),
        (SELECT min(applied_at) FROM schema_version), '',
        (SELECT min(hour) FROM gpu_hours), (SELECT max(hour) + 3600 FROM gpu_hours)""",
)


def _run(statements: Iterable[str]) -> Callable[[sqlite3.Connection], None]:
    def step(conn: sqlite3.Connection) -> None:
        conn.create_function("gpuledger_is_hpc_job", 1, _is_hpc_job, deterministic=True)
        conn.create_function("gpuledger_new_ledger_id", 0, _new_ledger_id)
        for statement in statements:
            conn.execute(statement)

    return step


def _new_ledger_id() -> str:
    return uuid.uuid4().hex


# Version 4: a workload's charged seconds, its share of the unit's time (held seconds x the
# share that split the dollars), which add up over a shared GPU's holders where held seconds
# count the GPU once per holder. Accounting split seconds and dollars by the same share, so an
# older row's charged seconds are its dollars over what the whole hour cost: dollars / the
# GPU-hour's dollars_per_hour x 3600 (a MIG instance's weight is already in its dollars). Where
# that price is not above 0 (unpriced GPUs, or no GPU row for the hour) the dollars say nothing
# and the row keeps its held seconds, as `report` counted it before. The price is the latest
# seen in the hour: where it changed within the hour the figure is approximate, so it is capped
# at the held seconds, the most a share can be.
_SCHEMA_V4 = (
    "ALTER TABLE workload_hours ADD COLUMN charged_s REAL NOT NULL DEFAULT 0.0",
    # The GPU-hour is found by the row's uuid (a whole GPU's), else by its GPU index (a MIG
    # instance's row names the instance; the first uuid where a GPU was swapped within the hour).
    """UPDATE workload_hours SET charged_s = coalesce(
        (SELECT min(workload_hours.held_s, workload_hours.dollars / g.dollars_per_hour * 3600)
         FROM gpu_hours AS g
         WHERE g.hour = workload_hours.hour AND g.node = workload_hours.node AND g.uuid = workload_hours.uuid
             AND g.dollars_per_hour > 0),
        (SELECT min(workload_hours.held_s, workload_hours.dollars / g.dollars_per_hour * 3600)
         FROM gpu_hours AS g
         WHERE g.hour = workload_hours.hour AND g.node = workload_hours.node AND g.gpu = workload_hours.gpu
             AND g.dollars_per_hour > 0
         ORDER BY g.uuid
         LIMIT 1),
        held_s)""",
)


# Step n (from 1) brings a file at version n - 1 (0: empty) to version n.
_MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (
    _run(_SCHEMA_V1),
    _run(_SCHEMA_V2),
    _run(_SCHEMA_V3),
    _run(_SCHEMA_V4),
)
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
    """One stored hour: a workload on one cost unit, (`idle`) the part of a GPU nobody held, or
    (`unobserved`) the part of a GPU nobody could see.

    `held_s` counts a shared unit once per holder; `charged_s` is the workload's share of it, so
    the charged seconds of every row of a GPU-hour add up to the hour. For an idle row both are
    the GPU's idle seconds, `dollars`, `joules` and `energy_dollars` its idle cost and energy,
    `busy_s` 0 and the workload empty; an unobserved row likewise carries the unobserved seconds
    and dollars, no energy (nobody read the counter) and no energy dollars. `energy_dollars` is
    None where no price per kWh was set (and for hours written before the ledger stored it).
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
    charged_s: float = 0.0
    unobserved: bool = False
    left_by: Workload | None = None  # an idle row's last holder, where known (Workload(): nobody yet)


@dataclass(frozen=True, slots=True)
class LedgerInfo:
    """What a ledger file records about itself (`ledger_meta`), and the nodes its rows name.

    `first_at` / `last_at` bound the period it records: the earliest start and the latest end
    of the charges written to it (None while it records nothing). A file written before
    schema version 3 is known only by its hours, so its period is whole hours.
    """

    path: Path
    ledger_id: str
    node: str  # the node it belongs to; '' until an agent that knew its node opened or wrote it
    created_at: float
    created_by: str  # "gpuledger <version>"; '' for a file an earlier release created
    first_at: float | None
    last_at: float | None
    nodes: frozenset[str] = frozenset()  # every node its rows name (one, unless a node was renamed)

    @property
    def recorded(self) -> bool:
        """Whether it holds any charges."""
        return self.first_at is not None


@dataclass(frozen=True, slots=True)
class LedgerContents:
    info: LedgerInfo
    rows: list[UsageRow]


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


@dataclass(slots=True)
class _Batch:
    """Hourly rows not yet written, and the period of the charges summed into them."""

    workload_rows: dict[_WorkloadHour, _Sums] = field(default_factory=dict)
    gpu_rows: dict[_GpuHour, _PendingGpu] = field(default_factory=dict)
    first_at: float | None = None
    last_at: float | None = None

    @property
    def rows(self) -> int:
        return len(self.workload_rows) + len(self.gpu_rows)

    def dollars(self) -> float:
        """What these rows would add to `report`'s TOTAL: workload dollars plus idle dollars."""
        return math.fsum(
            [s.get("dollars") or 0.0 for s in self.workload_rows.values()]
            + [p.sums.get("idle_dollars") or 0.0 for p in self.gpu_rows.values()]
        )

    def nodes(self) -> set[str]:
        return {key.node for key in self.gpu_rows} | {key.node for key in self.workload_rows}

    def cover(self, start: float, end: float) -> None:
        self.first_at = start if self.first_at is None else min(self.first_at, start)
        self.last_at = end if self.last_at is None else max(self.last_at, end)

    def absorb(self, newer: _Batch) -> None:
        """Add `newer`'s rows to these (these being the older: a newer GPU row's attributes win)."""
        for key, sums in newer.workload_rows.items():
            old = self.workload_rows.get(key)
            if old is None:
                self.workload_rows[key] = sums
            else:
                _add_sums(old, sums.keys(), sums.values())
        for gpu_key, later in newer.gpu_rows.items():
            earlier = self.gpu_rows.get(gpu_key)
            if earlier is None:
                self.gpu_rows[gpu_key] = later
            else:
                earlier.gpu, earlier.model, earlier.dollars_per_hour = later.gpu, later.model, later.dollars_per_hour
                _add_sums(earlier.sums, later.sums.keys(), later.sums.values())
        if newer.first_at is not None and newer.last_at is not None:
            self.cover(newer.first_at, newer.last_at)

    def take_hour(self, hour: int) -> _Batch:
        """Remove every row of `hour` and return them; the period then starts after that hour."""
        taken = _Batch(
            {k: v for k, v in self.workload_rows.items() if k.hour == hour},
            {k: v for k, v in self.gpu_rows.items() if k.hour == hour},
        )
        for key in taken.workload_rows:
            del self.workload_rows[key]
        for gpu_key in taken.gpu_rows:
            del self.gpu_rows[gpu_key]
        if not self.rows:
            self.first_at = self.last_at = None
        elif self.first_at is not None and self.last_at is not None:
            self.first_at = min(max(self.first_at, hour + HOUR_S), self.last_at)
        return taken


class PendingCharges:
    """Charges added and not yet written, summed into one row per hour and key: at most
    `max_rows` rows, so a ledger that cannot be written for days never exhausts memory.

    Past `max_rows` the oldest hours are dropped whole (never part of an hour, so a dropped
    hour's GPU rows and workload rows go together); the rows and dollars dropped are counted
    and the first drop of each outage is logged as an error. Safe to call from several threads.
    `LedgerSink` keeps one while the file cannot even be opened and hands it to the `Ledger`
    that opens it.
    """

    def __init__(self, path: str | Path, max_rows: int = DEFAULT_MAX_PENDING_ROWS) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be 1 or more, got {max_rows}")
        self._path = Path(path)
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._batch = _Batch()
        self._dropped_rows = 0
        self._dropped_dollars = 0.0
        self._dropping = False  # a drop has been logged since the last successful flush
        self._rejected = 0

    @property
    def rows(self) -> int:
        with self._lock:
            return self._batch.rows

    @property
    def dropped_rows(self) -> int:
        """Hourly rows dropped, since this started, because more than `max_rows` were pending."""
        return self._dropped_rows

    @property
    def dropped_dollars(self) -> float:
        """What the dropped rows held: workload dollars plus idle dollars."""
        return self._dropped_dollars

    @property
    def rejected(self) -> int:
        """Charges (or parts of them) refused for non-finite figures or an impossible interval."""
        return self._rejected

    def lost(self) -> tuple[int, float]:
        """(rows, dollars) pending now: what would be lost if nothing more could be written."""
        with self._lock:
            return self._batch.rows, self._batch.dollars()

    def add(self, charges: Charges) -> None:
        """Sum one interval's charges into the pending rows of the hours it covers, pro rata."""
        if not (_finite((charges.start, charges.end)) and charges.end - charges.start <= MAX_INTERVAL_S):
            self._reject(f"interval {charges.start!r} to {charges.end!r}")
            return
        shares = hour_shares(charges.start, charges.end)
        node = charges.node
        with self._lock:
            batch = self._batch
            for wc in charges.workloads:
                measures: tuple[float | None, ...] = _workload_measures(wc)
                if not _finite(measures):
                    self._reject(f"workload charge {wc.workload.describe()} on {wc.uuid}: {measures}")
                    continue
                for hour, share in shares:
                    key = _WorkloadHour(hour, node, wc.gpu, wc.uuid, wc.workload)
                    _add_sums(batch.workload_rows.setdefault(key, {}), _WORKLOAD_MEASURES, measures, share)
            for gc in charges.gpus:
                gpu_measures: tuple[float | None, ...] = _gpu_measures(gc)
                if not _finite((*gpu_measures, gc.dollars_per_hour)):
                    self._reject(f"GPU charge on {gc.uuid}: {gpu_measures}")
                    continue
                for hour, share in shares:
                    gpu_key = _GpuHour(hour, node, gc.uuid)
                    pending = batch.gpu_rows.get(gpu_key)
                    if pending is None:
                        pending = batch.gpu_rows[gpu_key] = _PendingGpu(gc.gpu, gc.model, gc.dollars_per_hour)
                    else:
                        pending.gpu, pending.model, pending.dollars_per_hour = gc.gpu, gc.model, gc.dollars_per_hour
                    _add_sums(pending.sums, _GPU_MEASURES, gpu_measures, share)
            if charges.workloads or charges.gpus:
                batch.cover(charges.start, charges.end)
            self._cap()

    def take(self) -> _Batch:
        """Everything pending, for a flush to write; `restore` it if the flush fails."""
        with self._lock:
            batch, self._batch = self._batch, _Batch()
        return batch

    def restore(self, batch: _Batch) -> None:
        """Put rows a failed flush took back in front of whatever was added meanwhile."""
        with self._lock:
            batch.absorb(self._batch)
            self._batch = batch
            self._cap()

    def written(self) -> None:
        """A flush worked: the next drop starts a new outage, logged again."""
        self._dropping = False

    def _cap(self) -> None:
        # Called with the lock held. Drops whole hours, oldest first, until the rows fit.
        batch = self._batch
        while batch.rows > self.max_rows:
            oldest = min([key.hour for key in batch.gpu_rows] + [key.hour for key in batch.workload_rows])
            dropped = batch.take_hour(oldest)
            dollars = dropped.dollars()
            self._dropped_rows += dropped.rows
            self._dropped_dollars += dollars
            if not self._dropping:
                self._dropping = True
                log.error(
                    "ledger %s: more than ledger.max_pending_rows (%d) hourly rows wait to be written; dropping "
                    "the oldest hours, starting with %s ($%.2f in %d rows); gpuledger_ledger_dropped_rows_total "
                    "counts every drop",
                    self._path,
                    self.max_rows,
                    iso_time(oldest),
                    dollars,
                    dropped.rows,
                )

    def _reject(self, what: str) -> None:
        self._rejected += 1
        if self._rejected == 1:
            log.warning(
                "ledger %s: refusing %s (not finite or too long); further refusals are only counted", self._path, what
            )


class Ledger:
    """Hourly sums of `Charges`, kept in memory by `add()` and written by `flush()`.

    Safe to call from several threads (the poll adds while the flush job writes). A flush that
    fails (disk full, read-only, locked by another process) keeps the pending rows for the next
    one, up to `max_pending_rows` (see `PendingCharges`); `healthy` says whether the last flush
    worked. A corrupt file is moved aside and a fresh one started, at open or at the flush that
    meets the corruption; `healthy` is False until the fresh file has taken a flush.

    `node` (the agent's node name) is recorded in the file the first time a ledger that knows
    it opens the file; `pending` lets a caller that collected charges before the file could be
    opened hand them over.
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
    ) -> None:
        self._path = Path(path)
        self._node = node
        self._retention_s = retention_s
        self._clock = clock
        self._busy_timeout_s = busy_timeout_s
        self._flush_lock = threading.Lock()  # one writer at a time, and none after close
        self._pending = pending if pending is not None else PendingCharges(self._path, max_pending_rows)
        self._failed_flushes = 0
        self._last_flush_at: float | None = None
        self._retained_below: int | None = None
        self._closed = False
        self._written_at_close = True
        self._moved_aside: list[Path] = []
        self._file_id: tuple[int, int] | None = None  # (device, inode) of the file opened
        self._conn: sqlite3.Connection | None = self._open()
        self._healthy = not self._moved_aside

    @property
    def path(self) -> Path:
        return self._path

    @property
    def healthy(self) -> bool:
        """False from a failed flush (or a corrupt file moved aside) until the next flush that works."""
        return self._healthy

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
        self._pending.add(charges)

    def flush(self) -> bool:
        """Write every pending row and apply retention in one transaction.

        True when it committed. False when SQLite refused (the rows stay pending for the next
        flush); one log line marks the ledger failing and one marks it writing again.
        """
        with self._flush_lock:
            if self._closed:
                raise LedgerError(f"ledger {self._path}: closed")
            return self._flush()

    def close(self) -> bool:
        """Flush, then close the file. True when every charge reached the file; otherwise the rows
        that still cannot be written are logged, with their dollars, as lost (one error line)."""
        with self._flush_lock:
            if self._closed:
                return self._written_at_close
            written = self._flush()
            if not written:
                rows, dollars = self._pending.lost()
                dropped = self._pending.dropped_rows
                earlier = (
                    f", besides {dropped} rows (${self._pending.dropped_dollars:.2f}) dropped earlier"
                    if dropped
                    else ""
                )
                log.error(
                    "ledger %s: closing with %d hourly rows ($%.2f) that could not be written%s",
                    self._path,
                    rows,
                    dollars,
                    earlier,
                )
            self._closed = True
            self._written_at_close = written
            if self._conn is not None:
                self._conn.close()
            return written

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
            conn = _open_file(self._path, self._busy_timeout_s, self._node)
        except _Corrupt as corrupt:
            self._move_aside(corrupt.detail)
            conn = _open_file(self._path, self._busy_timeout_s, self._node)
        self._file_id = _file_id(self._path)
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
        if self._healthy and not batch.rows and cutoff == self._retained_below:
            self._last_flush_at = now
            return True
        committed = False
        try:
            if self._conn is not None and self._file_id != _file_id(self._path):
                # Deleted or replaced under us (an rm -rf of the state directory): writing on
                # would go to a file nobody can read. Start a fresh one at the path.
                log.error(
                    "ledger %s: the file was deleted or replaced while open; starting a new one there", self._path
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
            if isinstance(exc, sqlite3.Error) and _is_corruption(exc) and self._conn is not None:
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

    def _write(self, conn: sqlite3.Connection, batch: _Batch, cutoff: int | None) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(
                _UPSERT_WORKLOAD,
                [
                    key.columns() | _measure_columns(sums, _WORKLOAD_MEASURES)
                    for key, sums in batch.workload_rows.items()
                ],
            )
            conn.executemany(
                _UPSERT_GPU,
                [
                    key.columns() | p.columns() | _measure_columns(p.sums, _GPU_MEASURES)
                    for key, p in batch.gpu_rows.items()
                ],
            )
            if batch.first_at is not None and batch.last_at is not None:
                conn.execute(_RECORD_PERIOD, {"first": batch.first_at, "last": batch.last_at})
            nodes = batch.nodes()
            if len(nodes) == 1:  # a ledger opened without its node learns it from what it writes
                conn.execute("UPDATE ledger_meta SET node = ? WHERE node = ''", (nodes.pop(),))
            if cutoff is not None:
                conn.execute("DELETE FROM workload_hours WHERE hour < ?", (cutoff,))
                conn.execute("DELETE FROM gpu_hours WHERE hour < ?", (cutoff,))
                conn.execute(_RETAIN_PERIOD, {"cutoff": cutoff})
            conn.execute("COMMIT")
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


def _measure_columns(sums: _Sums, measures: Sequence[str]) -> dict[str, object]:
    # A measure no charge carried is 0 (a priced one NULL: nothing priced reached this row).
    return {name: sums.get(name, None if name in _PRICED_MEASURES else 0.0) for name in measures}


# --- opening, and corruption ---------------------------------------------------------------------

# SQLite's result codes (sqlite3.h); an extended code keeps its primary code in the low byte.
_SQLITE_CANTOPEN = 14
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
_SQLITE_READONLY_DIRECTORY = 8 | (6 << 8)
_SQLITE_HEADER = b"SQLite format 3\x00"


class _Corrupt(Exception):
    """A SQLite file whose pages are damaged (never raised for a file that is not SQLite's)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def _errorcode(exc: sqlite3.Error) -> int:
    code: int | None = getattr(exc, "sqlite_errorcode", None)
    return code if code is not None else 0


def _is_corruption(exc: sqlite3.Error) -> bool:
    return _errorcode(exc) & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)


def _is_sqlite_file(path: Path) -> bool:
    """Whether `path` starts with SQLite's header: only such a file is ever moved aside as corrupt;
    anything else at the ledger's path (a mistyped --ledger README.md) is refused and left alone."""
    try:
        with path.open("rb") as f:
            return f.read(len(_SQLITE_HEADER)) == _SQLITE_HEADER
    except OSError:
        return False


def _file_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`; None where there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def move_aside(path: Path, now: float) -> Path:
    """Rename a corrupt ledger to `<name>.corrupt-<UTC time>`, its WAL and shared memory with it
    (a fresh file at `path` must never replay the old file's WAL); returns the new path."""
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%SZ")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    try:
        path.rename(aside)
        for suffix in ("-wal", "-shm"):
            companion = Path(f"{path}{suffix}")
            if companion.exists():
                companion.rename(f"{aside}{suffix}")
    except OSError as exc:
        raise LedgerError(f"ledger {path}: corrupt, and cannot be moved aside: {exc.strerror or exc}") from exc
    return aside


def _quick_check(conn: sqlite3.Connection) -> None:
    answer = [str(row) for (row,) in conn.execute("PRAGMA quick_check").fetchall()]
    if answer != ["ok"]:
        # One problem per line (a row may hold several), under a "*** in database main ***" heading.
        problems = [line for row in answer for line in row.splitlines() if line and not line.startswith("***")]
        more = f" and {len(problems) - 1} more problems" if len(problems) > 1 else ""
        raise _Corrupt(f"quick_check: {problems[0] if problems else 'no answer'}{more}")


def _open_file(path: Path, busy_timeout_s: float, node: str | None) -> sqlite3.Connection:
    """Open or create the ledger for writing: checked with quick_check, WAL, synchronous=FULL,
    schema migrated to SCHEMA_VERSION, and the node recorded, in one write transaction (so an
    unwritable file fails here, not at the first flush). `_Corrupt` for damaged pages."""
    existing = _is_sqlite_file(path)
    try:
        # isolation_level=None: transactions are the explicit BEGIN/COMMIT in this module only.
        conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot open: {exc}") from exc
    try:
        if existing:
            _quick_check(conn)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise LedgerError(f"ledger {path}: the filesystem does not support a WAL journal (got {mode})")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Read under the write lock: another process may have migrated meanwhile.
            version = _schema_version(conn, path)
            _migrate(conn, version)
            if version == 0:
                conn.execute("UPDATE ledger_meta SET created_by = ?", (f"gpuledger {__version__}",))
            if node:
                conn.execute("UPDATE ledger_meta SET node = ? WHERE node = ''", (node,))
            (recorded_node,) = conn.execute("SELECT node FROM ledger_meta").fetchone()
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        if 0 < version < SCHEMA_VERSION:
            log.info("ledger %s: schema migrated from version %d to %d", path, version, SCHEMA_VERSION)
        if node and recorded_node != node:
            log.warning(
                "ledger %s belongs to node %s; this agent is node %s and records its rows under that name",
                path,
                recorded_node,
                node,
            )
    except sqlite3.Error as exc:
        conn.close()
        if existing and _is_corruption(exc):
            raise _Corrupt(str(exc)) from exc
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


# --- reading (report) ----------------------------------------------------------------------------


def reader_uri(path: Path, *, immutable: bool = False) -> str:
    """The URI a reader opens `path` with: read-only, and `immutable=1` where asked (SQLite then
    takes no locks and creates no -shm file, and does not read the WAL)."""
    uri = f"{path.resolve().as_uri()}?mode=ro"
    return f"{uri}&immutable=1" if immutable else uri


def fallback_uri(path: Path, errorcode: int, wal_bytes: int) -> str | None:
    """The URI to read `path` with after `mode=ro` failed with SQLite's `errorcode`, or None where
    there is no safe other way.

    A WAL ledger read `mode=ro` still needs its -shm file, which SQLite creates beside it when
    absent: in a directory the reader may not write (the agent's, once the agent has stopped and
    removed it) that fails, SQLITE_READONLY_DIRECTORY or SQLITE_CANTOPEN. `immutable=1` reads the
    file without it, but also without the WAL: safe only while the WAL holds nothing
    (`wal_bytes` 0), which is how a cleanly stopped agent leaves it.
    """
    if errorcode != _SQLITE_READONLY_DIRECTORY and errorcode & 0xFF != _SQLITE_CANTOPEN:
        return None
    if wal_bytes > 0:
        return None
    return reader_uri(path, immutable=True)


def _connect_reader(uri: str) -> sqlite3.Connection:
    conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    try:
        conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()  # SQLite opens lazily: fail here
    except BaseException:
        conn.close()
        raise
    return conn


def open_read_only(path: str | Path) -> sqlite3.Connection:
    """A connection that cannot write `path`: `mode=ro`, else `immutable=1` where `fallback_uri`
    allows. LedgerError (naming the file) where neither opens it."""
    path = Path(path)
    try:
        return _connect_reader(reader_uri(path))
    except sqlite3.Error as exc:
        wal = Path(f"{path}-wal")
        try:
            wal_bytes = wal.stat().st_size
        except OSError:
            wal_bytes = 0
        uri = fallback_uri(path, _errorcode(exc), wal_bytes)
        if uri is None:
            if wal_bytes:
                raise LedgerError(
                    f"ledger {path}: cannot open read-only ({exc}) and {wal} holds charges not yet in the file: "
                    "read it as the user the agent runs as"
                ) from exc
            raise LedgerError(f"ledger {path}: cannot open: {exc}") from exc
        log.debug("ledger %s: %s read-only; reading it immutable", path, exc)
        try:
            return _connect_reader(uri)
        except sqlite3.Error as again:
            raise LedgerError(f"ledger {path}: cannot open: {again}") from again


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


def read_ledger(
    path: str | Path, *, since: float | None = None, until: float | None = None, rows: bool = True
) -> LedgerContents:
    """The ledger's own record (`LedgerInfo`) and every stored hour that overlaps [since, until):
    workload rows, then one idle row per GPU hour with idle time, then one unobserved row per GPU
    hour with unobserved time; no rows unless `rows`.
    Hours are the ledger's resolution, so a partly covered hour is read whole.

    Opens the file read-only (`open_read_only`; a missing file is an error, never created) and
    reads in one transaction, so a flush committing meanwhile is seen wholly or not at all. A
    file at an earlier schema version is copied into memory and migrated there: reading never
    writes, and the agent migrates the file itself the next time it opens it.
    """
    path = Path(path)
    if not path.is_file():
        raise LedgerError(f"ledger {path}: no such file")
    where, params = _bounds(since, until)
    try:
        with closing(open_read_only(path)) as conn:
            version = _schema_version(conn, path)
            if version == 0:
                raise LedgerError(f"ledger {path}: empty, not a gpuledger ledger")
            if version < SCHEMA_VERSION:
                with closing(_migrated_copy(conn, path)) as copy:
                    return _read(copy, path, where, params, rows)
            return _read(conn, path, where, params, rows)
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot read: {exc}") from exc


def read_usage(path: str | Path, *, since: float | None = None, until: float | None = None) -> list[UsageRow]:
    """The rows of `read_ledger`."""
    return read_ledger(path, since=since, until=until).rows


def read_info(path: str | Path) -> LedgerInfo:
    """The record `read_ledger` gives, without the rows."""
    return read_ledger(path, rows=False).info


def recorded_period(path: str | Path) -> tuple[float, float] | None:
    """The period a ledger file records (`LedgerInfo.first_at`, `last_at`); None where it records
    nothing: no file, an empty one, a SQLite file with no tables yet, a ledger with no charges.
    LedgerError for a file that is not a ledger."""
    path = Path(path)
    if not path.exists() or (path.is_file() and path.stat().st_size == 0):
        return None
    try:
        with closing(open_read_only(path)) as conn:
            if _schema_version(conn, path) == 0:
                return None
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot read: {exc}") from exc
    info = read_info(path)
    return (info.first_at, info.last_at) if info.first_at is not None and info.last_at is not None else None


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


def _read(
    conn: sqlite3.Connection, path: Path, where: str, params: Sequence[int | float], rows: bool
) -> LedgerContents:
    conn.row_factory = sqlite3.Row
    conn.execute("BEGIN")
    meta = conn.execute("SELECT * FROM ledger_meta").fetchone()
    nodes = frozenset(node for (node,) in conn.execute("SELECT DISTINCT node FROM gpu_hours"))
    workload = conn.execute(f"SELECT * FROM workload_hours{where} ORDER BY hour", params).fetchall() if rows else []
    gpu = conn.execute(f"SELECT * FROM gpu_hours{where} ORDER BY hour", params).fetchall() if rows else []
    conn.execute("COMMIT")
    if meta is None:
        raise LedgerError(f"ledger {path}: not a gpuledger ledger (no ledger_meta row)")
    info = LedgerInfo(
        path=path,
        ledger_id=meta["ledger_id"],
        node=meta["node"],
        created_at=meta["created_at"],
        created_by=meta["created_by"],
        first_at=meta["first_at"],
        last_at=meta["last_at"],
        nodes=nodes,
    )
    usage = [
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
            charged_s=r["charged_s"],
        )
        for r in workload
    ]
    usage.extend(
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
            charged_s=r["idle_s"],
        )
        for r in gpu
        if r["idle_s"] or r["idle_dollars"] or r["idle_joules"]
    )
    usage.extend(
        UsageRow(
            hour=r["hour"],
            node=r["node"],
            gpu=r["gpu"],
            uuid=r["uuid"],
            workload=Workload(),
            held_s=r["unobserved_s"],
            busy_s=0.0,
            dollars=r["unobserved_dollars"],
            joules=0.0,
            charged_s=r["unobserved_s"],
            unobserved=True,
        )
        for r in gpu
        if r["unobserved_s"] or r["unobserved_dollars"]
    )
    return LedgerContents(info, usage)


def iso_time(t: float) -> str:
    """`t` (unix seconds) as 2026-11-27T18:00:00Z."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
