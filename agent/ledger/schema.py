"""The ledger's SQLite schema: its tables, and the ordered steps that bring a file written by any
earlier release to the current version.

Schema (version 9; `schema_version` holds one row per applied version):

    workload_hours  hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model, team,
                    account | held_s, busy_s, dollars, joules, energy_dollars, charged_s, unmeasured_s,
                    dollars_per_hour, purchase, price_source (the GPU's price, latest seen in the hour)
    gpu_hours       hour, node, uuid | gpu, model, dollars_per_hour, purchase, price_source (latest
                    seen in the hour), observed_s, dollars, idle_s, idle_dollars, unobserved_s,
                    unobserved_dollars, joules, idle_joules, energy_dollars, idle_energy_dollars
    idle_hours      hour, node, uuid, namespace, pod, container, hpc_job, unit, user, model, team
                    (the workload that left the GPU idle) | gpu, idle_s, idle_dollars, idle_joules,
                    idle_energy_dollars
    sizing_hours    hour, node, namespace, pod, container, hpc_job, unit, user, model, team, gpu_model,
                    mig_profile | memory_total_bytes, busy_source, held_s, busy_s, measured_s, memory_s,
                    peak_memory_bytes, max_units, busy_sketch, memory_sketch
    ledger_meta     one row: ledger_id, node, created_at, created_by, first_at, last_at

Opening a file applies, in one transaction, every migration step after its version (the steps
are listed below `MIGRATIONS`); a file from a newer gpuledger is refused, never guessed at.
Version 1 (the first release) had `job` where version 2 has `hpc_job` and `unit`, and no energy
dollars: its rows keep NULL there (their price per kWh was never recorded). Version 3 added
`ledger_meta`: which node the ledger belongs to and the period it records, so that `report`
can merge the ledgers of many nodes and refuse to count one node's time twice. Version 4 added
`charged_s`, a workload's share of the unit's time (held seconds count a shared GPU once per
holder, so only charged seconds add up to the GPU's hours); older rows get it from their dollars.
Version 5 added `idle_hours`: a GPU-hour's idle time broken down by who left the GPU idle.
Version 6 added the Slurm `account` to the workload key, and to every row the price it was
charged at: dollars per hour, the purchase option (on_demand, spot, ...) and where the price came
from (config, instance, catalogue); older rows keep '' for the account and NULL for what was not
recorded then (a GPU row's dollars_per_hour was).
Version 7 added `sizing_hours`: per workload and hour, what right-sizing reads (memory and busy
percentiles as fixed-bucket sketches, peaks, GPUs held at once).
Version 8 added `unmeasured_s` to workload_hours: the charged seconds over which nothing measured
how busy the workload kept its unit (a MIG instance without GPM, say), so that `report` shows
their use as unknown instead of idle. Older rows get 0: they were reported as measured.
Version 9 lets joules be NULL (workload_hours.joules, gpu_hours.joules and idle_joules,
idle_hours.idle_joules): energy no counter measured (a GPU without one) is unknown, not 0 J.
Older rows keep the 0 they were written with: a counter that read 0 cannot be told from none.

`hour` is the unix time of the start of the UTC hour. The hour tables are WITHOUT ROWID with a primary
key that starts with `hour`: the table itself is the index that reports scan by time range and
that retention deletes by, so no second index has to be kept in step.
"""

from __future__ import annotations

import logging
import re
import sqlite3
import uuid
from collections.abc import Callable, Iterable, Sequence

from agent.model import WORKLOAD_LABELS

log = logging.getLogger("gpuledger.ledger")


_WORKLOAD_KEYS = ("hour", "node", "gpu", "uuid", *WORKLOAD_LABELS, "account")
WORKLOAD_MEASURES = ("held_s", "busy_s", "dollars", "joules", "energy_dollars", "charged_s", "unmeasured_s")
# The price a row was charged at, as its GPU's row has it (the latest in the hour).
PRICE_ATTRIBUTES = ("dollars_per_hour", "purchase", "price_source")
_GPU_KEYS = ("hour", "node", "uuid")
_IDLE_KEYS = ("hour", "node", "uuid", *WORKLOAD_LABELS)
IDLE_MEASURES = ("idle_s", "idle_dollars", "idle_joules", "idle_energy_dollars")
_GPU_ATTRIBUTES = ("gpu", "model", *PRICE_ATTRIBUTES)
GPU_MEASURES = (
    "observed_s", "dollars", "idle_s", "idle_dollars", "unobserved_s", "unobserved_dollars", "joules", "idle_joules",
    "energy_dollars", "idle_energy_dollars",
)  # fmt: skip
# Energy dollars are NULL where no price per kWh was set: unknown, not free; joules (and so their
# dollars) are NULL where no energy counter measured them (a GPU without one: unknown, not 0 J).
# A sum of them counts the measured and priced parts only and stays NULL while there is none.
PRICED_MEASURES = frozenset({"energy_dollars", "idle_energy_dollars", "joules", "idle_joules"})

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
# from before version 3 gets the node most of its rows name, the time its first schema step was
# applied, '' for the release that created it (not recorded), and the hours its rows cover, up
# to where its last hour's charges end: that hour's start plus the most seconds (observed and
# unobserved) one GPU's row holds. Not the hour's end: an upgraded agent starting within that
# hour would take the rest for time already charged, and charge none of it.
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
        (SELECT min(hour) FROM gpu_hours),
        (SELECT hour + min(3600, max(observed_s + unobserved_s)) FROM gpu_hours
            WHERE hour = (SELECT max(hour) FROM gpu_hours))""",
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


# Version 5: idle time by who left the GPU idle. One row per hour, GPU and workload that held the
# GPU last before its idle stretches (the workload labels; all empty where nobody is known to
# have held it): its share of the GPU-hour's idle seconds, dollars, joules and energy dollars.
# A GPU-hour's rows add up to its idle figures in gpu_hours. Hours written before version 5 did
# not record who left a GPU idle: each gets one row with empty labels holding all its idle time.
_SCHEMA_V5 = (
    """CREATE TABLE idle_hours (
        hour INTEGER NOT NULL, node TEXT NOT NULL, uuid TEXT NOT NULL,
        namespace TEXT NOT NULL, pod TEXT NOT NULL, container TEXT NOT NULL, hpc_job TEXT NOT NULL,
        unit TEXT NOT NULL, user TEXT NOT NULL, model TEXT NOT NULL, team TEXT NOT NULL,
        gpu INTEGER NOT NULL,
        idle_s REAL NOT NULL, idle_dollars REAL NOT NULL, idle_joules REAL NOT NULL, idle_energy_dollars REAL,
        PRIMARY KEY (hour, node, uuid, namespace, pod, container, hpc_job, unit, user, model, team)
    ) WITHOUT ROWID""",
    """INSERT INTO idle_hours (
        hour, node, uuid, namespace, pod, container, hpc_job, unit, user, model, team,
        gpu, idle_s, idle_dollars, idle_joules, idle_energy_dollars
    )
    SELECT hour, node, uuid, '', '', '', '', '', '', '', '', gpu, idle_s, idle_dollars, idle_joules, idle_energy_dollars
    FROM gpu_hours
    WHERE idle_s != 0 OR idle_dollars != 0 OR idle_joules != 0""",
)


# Version 6: the Slurm account a job is billed to joins the workload key (`report --by account`;
# it is no metric label), and each row records the price it was charged at. The key changes, so
# the table is rebuilt; older rows get '' for the account (one row each: nothing meets) and
# NULL for the price they were not recorded with.
_SCHEMA_V6 = (
    """CREATE TABLE workload_hours_v6 (
        hour INTEGER NOT NULL, node TEXT NOT NULL, gpu INTEGER NOT NULL, uuid TEXT NOT NULL,
        namespace TEXT NOT NULL, pod TEXT NOT NULL, container TEXT NOT NULL, hpc_job TEXT NOT NULL,
        unit TEXT NOT NULL, user TEXT NOT NULL, model TEXT NOT NULL, team TEXT NOT NULL, account TEXT NOT NULL,
        held_s REAL NOT NULL, busy_s REAL NOT NULL, dollars REAL NOT NULL, joules REAL NOT NULL,
        energy_dollars REAL, charged_s REAL NOT NULL DEFAULT 0.0,
        dollars_per_hour REAL, purchase TEXT, price_source TEXT,
        PRIMARY KEY (hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model, team, account)
    ) WITHOUT ROWID""",
    """INSERT INTO workload_hours_v6 (
        hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model, team, account,
        held_s, busy_s, dollars, joules, energy_dollars, charged_s, dollars_per_hour, purchase, price_source
    )
    SELECT hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model, team, '',
        held_s, busy_s, dollars, joules, energy_dollars, charged_s, NULL, NULL, NULL
    FROM workload_hours""",
    "DROP TABLE workload_hours",
    "ALTER TABLE workload_hours_v6 RENAME TO workload_hours",
    "ALTER TABLE gpu_hours ADD COLUMN purchase TEXT",
    "ALTER TABLE gpu_hours ADD COLUMN price_source TEXT",
)


# Version 7: what right-sizing needs, per hour, node, workload and kind of unit held (GPU model
# and MIG profile; '' for a whole GPU). Seconds are unit-seconds: a workload holding two GPUs for
# an hour adds 7200 to held_s. busy_s and measured_s: busy unit-seconds and the unit-seconds a busy
# figure was read for (their ratio is the mean busy); memory_s: unit-seconds a memory reading
# covers. Peaks are the largest reading of one unit; max_units the most units held at once.
# busy_sketch and memory_sketch: fixed-bucket histograms of unit-seconds (agent/accounting/
# sketch.py), JSON, merged by adding. Older hours have no sizing rows: nothing recorded them.
_SCHEMA_V7 = (
    """CREATE TABLE sizing_hours (
        hour INTEGER NOT NULL, node TEXT NOT NULL,
        namespace TEXT NOT NULL, pod TEXT NOT NULL, container TEXT NOT NULL, hpc_job TEXT NOT NULL,
        unit TEXT NOT NULL, user TEXT NOT NULL, model TEXT NOT NULL, team TEXT NOT NULL,
        gpu_model TEXT NOT NULL, mig_profile TEXT NOT NULL,
        memory_total_bytes REAL, busy_source TEXT NOT NULL,
        held_s REAL NOT NULL, busy_s REAL NOT NULL, measured_s REAL NOT NULL, memory_s REAL NOT NULL,
        peak_memory_bytes REAL, max_units INTEGER NOT NULL,
        busy_sketch TEXT NOT NULL, memory_sketch TEXT NOT NULL,
        PRIMARY KEY (hour, node, namespace, pod, container, hpc_job, unit, user, model, team, gpu_model, mig_profile)
    ) WITHOUT ROWID""",
)


# Version 8: a workload's charged seconds whose use nothing measured (its unit had no busy figure:
# a MIG instance without GPM, busy_source gpm on a GPU without it, a shared unit whose holders'
# shares of use cannot be told). Their busy seconds were booked as 0 before, and what was not
# recorded cannot be told apart now: older rows keep 0, counted as measured, as `report` read them.
_SCHEMA_V8 = ("ALTER TABLE workload_hours ADD COLUMN unmeasured_s REAL NOT NULL DEFAULT 0.0",)


# Version 9: joules may be NULL: where no energy counter measured them (the GPU has none, or it
# could not be read), they are unknown, and so are their energy dollars. SQLite cannot drop a NOT
# NULL constraint, so the three tables are rebuilt, column for column, keys and all; every row
# keeps its figures (an older 0 J cannot be told from a GPU without a counter, so it stays 0).
_SCHEMA_V9 = (
    """CREATE TABLE workload_hours_v9 (
        hour INTEGER NOT NULL, node TEXT NOT NULL, gpu INTEGER NOT NULL, uuid TEXT NOT NULL,
        namespace TEXT NOT NULL, pod TEXT NOT NULL, container TEXT NOT NULL, hpc_job TEXT NOT NULL,
        unit TEXT NOT NULL, user TEXT NOT NULL, model TEXT NOT NULL, team TEXT NOT NULL, account TEXT NOT NULL,
        held_s REAL NOT NULL, busy_s REAL NOT NULL, dollars REAL NOT NULL, joules REAL,
        energy_dollars REAL, charged_s REAL NOT NULL DEFAULT 0.0,
        dollars_per_hour REAL, purchase TEXT, price_source TEXT, unmeasured_s REAL NOT NULL DEFAULT 0.0,
        PRIMARY KEY (hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model, team, account)
    ) WITHOUT ROWID""",
    """INSERT INTO workload_hours_v9 (
        hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model, team, account,
        held_s, busy_s, dollars, joules, energy_dollars, charged_s, dollars_per_hour, purchase, price_source,
        unmeasured_s
    )
    SELECT hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model, team, account,
        held_s, busy_s, dollars, joules, energy_dollars, charged_s, dollars_per_hour, purchase, price_source,
        unmeasured_s
    FROM workload_hours""",
    "DROP TABLE workload_hours",
    "ALTER TABLE workload_hours_v9 RENAME TO workload_hours",
    """CREATE TABLE gpu_hours_v9 (
        hour INTEGER NOT NULL, node TEXT NOT NULL, uuid TEXT NOT NULL,
        gpu INTEGER NOT NULL, model TEXT NOT NULL, dollars_per_hour REAL NOT NULL,
        observed_s REAL NOT NULL, dollars REAL NOT NULL, idle_s REAL NOT NULL, idle_dollars REAL NOT NULL,
        unobserved_s REAL NOT NULL, unobserved_dollars REAL NOT NULL, joules REAL, idle_joules REAL,
        energy_dollars REAL, idle_energy_dollars REAL, purchase TEXT, price_source TEXT,
        PRIMARY KEY (hour, node, uuid)
    ) WITHOUT ROWID""",
    """INSERT INTO gpu_hours_v9 (
        hour, node, uuid, gpu, model, dollars_per_hour, observed_s, dollars, idle_s, idle_dollars,
        unobserved_s, unobserved_dollars, joules, idle_joules, energy_dollars, idle_energy_dollars,
        purchase, price_source
    )
    SELECT hour, node, uuid, gpu, model, dollars_per_hour, observed_s, dollars, idle_s, idle_dollars,
        unobserved_s, unobserved_dollars, joules, idle_joules, energy_dollars, idle_energy_dollars,
        purchase, price_source
    FROM gpu_hours""",
    "DROP TABLE gpu_hours",
    "ALTER TABLE gpu_hours_v9 RENAME TO gpu_hours",
    """CREATE TABLE idle_hours_v9 (
        hour INTEGER NOT NULL, node TEXT NOT NULL, uuid TEXT NOT NULL,
        namespace TEXT NOT NULL, pod TEXT NOT NULL, container TEXT NOT NULL, hpc_job TEXT NOT NULL,
        unit TEXT NOT NULL, user TEXT NOT NULL, model TEXT NOT NULL, team TEXT NOT NULL,
        gpu INTEGER NOT NULL,
        idle_s REAL NOT NULL, idle_dollars REAL NOT NULL, idle_joules REAL, idle_energy_dollars REAL,
        PRIMARY KEY (hour, node, uuid, namespace, pod, container, hpc_job, unit, user, model, team)
    ) WITHOUT ROWID""",
    """INSERT INTO idle_hours_v9 (
        hour, node, uuid, namespace, pod, container, hpc_job, unit, user, model, team,
        gpu, idle_s, idle_dollars, idle_joules, idle_energy_dollars
    )
    SELECT hour, node, uuid, namespace, pod, container, hpc_job, unit, user, model, team,
        gpu, idle_s, idle_dollars, idle_joules, idle_energy_dollars
    FROM idle_hours""",
    "DROP TABLE idle_hours",
    "ALTER TABLE idle_hours_v9 RENAME TO idle_hours",
)


# Step n (from 1) brings a file at version n - 1 (0: empty) to version n.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (
    _run(_SCHEMA_V1),
    _run(_SCHEMA_V2),
    _run(_SCHEMA_V3),
    _run(_SCHEMA_V4),
    _run(_SCHEMA_V5),
    _run(_SCHEMA_V6),
    _run(_SCHEMA_V7),
    _run(_SCHEMA_V8),
    _run(_SCHEMA_V9),
)
SCHEMA_VERSION = len(MIGRATIONS)


# Each upsert binds its columns by position (?), in the order of its *_COLUMNS: by name (:col),
# sqlite3 makes a str and looks it up in the row's dict for every column of every row, which
# took half of a flush's upserts (measured: 13 us a row by name, 7 by position).
def _upsert(table: str, keys: Sequence[str], replaced: Sequence[str], summed: Sequence[str]) -> str:
    columns = (*keys, *replaced, *summed)
    updates = [f"{c} = excluded.{c}" for c in replaced] + [
        # coalesce: a NULL (unpriced) side adds nothing; NULL + NULL stays NULL.
        f"{c} = coalesce({c} + excluded.{c}, {c}, excluded.{c})"
        if c in PRICED_MEASURES
        else f"{c} = {c} + excluded.{c}"
        for c in summed
    ]
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' for _ in columns)}) "
        f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {', '.join(updates)}"
    )


UPSERT_WORKLOAD = _upsert("workload_hours", _WORKLOAD_KEYS, PRICE_ATTRIBUTES, WORKLOAD_MEASURES)
WORKLOAD_COLUMNS = (*_WORKLOAD_KEYS, *PRICE_ATTRIBUTES, *WORKLOAD_MEASURES)
UPSERT_GPU = _upsert("gpu_hours", _GPU_KEYS, _GPU_ATTRIBUTES, GPU_MEASURES)
GPU_COLUMNS = (*_GPU_KEYS, *_GPU_ATTRIBUTES, *GPU_MEASURES)
UPSERT_IDLE = _upsert("idle_hours", _IDLE_KEYS, ("gpu",), IDLE_MEASURES)
IDLE_COLUMNS = (*_IDLE_KEYS, "gpu", *IDLE_MEASURES)

SIZING_KEYS = ("hour", "node", *WORKLOAD_LABELS, "gpu_model", "mig_profile")
SIZING_MEASURES = ("held_s", "busy_s", "measured_s", "memory_s")
# Peaks keep the larger side (SQLite's two-argument max is NULL where either is: hence coalesce);
# sketches add bucket by bucket (the writer registers gpuledger_merge_sketch).
SIZING_COLUMNS = (
    *SIZING_KEYS, "memory_total_bytes", "busy_source", *SIZING_MEASURES, "peak_memory_bytes", "max_units",
    "busy_sketch", "memory_sketch",
)  # fmt: skip
UPSERT_SIZING = (
    f"INSERT INTO sizing_hours ({', '.join(SIZING_COLUMNS)})"
    f" VALUES ({', '.join('?' for _ in SIZING_COLUMNS)})"
    f" ON CONFLICT ({', '.join(SIZING_KEYS)}) DO UPDATE SET"
    " memory_total_bytes = coalesce(excluded.memory_total_bytes, memory_total_bytes),"
    " busy_source = CASE WHEN excluded.busy_source != '' THEN excluded.busy_source ELSE busy_source END,"
    f" {', '.join(f'{c} = {c} + excluded.{c}' for c in SIZING_MEASURES)},"
    " peak_memory_bytes = max(coalesce(peak_memory_bytes, excluded.peak_memory_bytes),"
    " coalesce(excluded.peak_memory_bytes, peak_memory_bytes)),"
    " max_units = max(max_units, excluded.max_units),"
    " busy_sketch = gpuledger_merge_sketch(busy_sketch, excluded.busy_sketch),"
    " memory_sketch = gpuledger_merge_sketch(memory_sketch, excluded.memory_sketch)"
)
