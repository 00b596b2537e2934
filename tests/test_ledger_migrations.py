"""Ledger schema migrations, from every schema a release has shipped.

Versions 1 (the first release) to 4 are rebuilt here with raw SQL, their DDL copied from those
releases, so these tests keep describing the files people have on disk whatever the code
becomes. Opening one migrates it in one transaction; `report` reads it before and after with the
same dollars; a ledger from a newer gpuledger is refused in one line.
"""

from __future__ import annotations

import math
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from agent import __version__
from agent.ledger.files import LedgerError
from agent.ledger.read import read_info, read_usage, recorded_period
from agent.ledger.report import report_from_ledger
from agent.ledger.schema import MIGRATIONS, SCHEMA_VERSION
from agent.ledger.store import Ledger
from agent.model import WORKLOAD_LABELS, Charges, GpuCharge, IdleCharge, Workload, WorkloadCharge
from tests.test_cli import gpuledger
from tests.test_partition import PRICE, _stepped_agent, _watch

H = 3600
H0 = 1_795_802_400  # 2026-11-27T18:00:00Z
H1 = H0 + H

# --- the first release's ledger, as it wrote it (agent/ledger/store.py at version 1) -------------

V1_DDL = (
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

# Two hours of three GPUs at $2.50/h on node-a. `job` held a Slurm job id (8812, array task
# 9911_3) and a systemd unit name (nginx.service) alike.
#   (hour, gpu, namespace, pod, container, job, user, model, team, held_s, busy_s, dollars, joules)
V1_WORKLOADS = [
    (H0, 0, "", "", "", "8812", "alice", "llama-3-8b", "research", 3600.0, 2700.0, 2.5, 900_000.0),
    (H0, 1, "", "", "", "nginx.service", "www", "", "", 3600.0, 360.0, 2.5, 360_000.0),
    (H0, 2, "serving", "vllm-0", "vllm", "", "", "llama-3.1-8b", "", 1800.0, 900.0, 1.25, 450_000.0),
    (H1, 0, "", "", "", "9911_3", "bob", "", "", 3600.0, 3600.0, 2.5, 1_080_000.0),
    (H1, 1, "", "", "", "", "carol", "", "", 3600.0, 0.0, 2.5, 180_000.0),
]
#   (hour, gpu, observed_s, dollars, idle_s, idle_dollars, joules, idle_joules)
V1_GPUS = [
    (H0, 0, 3600.0, 2.5, 0.0, 0.0, 900_000.0, 0.0),
    (H0, 1, 3600.0, 2.5, 0.0, 0.0, 360_000.0, 0.0),
    (H0, 2, 3600.0, 2.5, 1800.0, 1.25, 540_000.0, 90_000.0),  # vllm-0 left half the hour
    (H1, 0, 3600.0, 2.5, 0.0, 0.0, 1_080_000.0, 0.0),
    (H1, 1, 3600.0, 2.5, 0.0, 0.0, 180_000.0, 0.0),
    (H1, 2, 3600.0, 2.5, 3600.0, 2.5, 180_000.0, 180_000.0),
]


def write_v1_ledger(path: Path) -> None:
    """A ledger as the first release left it: WAL, its schema, version 1, rows upserted by name."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("BEGIN IMMEDIATE")
        for statement in V1_DDL:
            conn.execute(statement)
        conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (1, 1_795_000_000.0))
        conn.executemany(
            "INSERT INTO workload_hours (hour, node, gpu, uuid, namespace, pod, container, job, user, model, team,"
            " held_s, busy_s, dollars, joules) VALUES (?, 'node-a', ?, 'GPU-' || ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(hour, gpu, gpu, *rest) for hour, gpu, *rest in V1_WORKLOADS],
        )
        conn.executemany(
            "INSERT INTO gpu_hours (hour, node, uuid, gpu, model, dollars_per_hour, observed_s, dollars, idle_s,"
            " idle_dollars, unobserved_s, unobserved_dollars, joules, idle_joules)"
            " VALUES (?, 'node-a', 'GPU-' || ?, ?, 'A100-SXM4-80GB', 2.5, ?, ?, ?, ?, 0.0, 0.0, ?, ?)",
            [(hour, gpu, gpu, *rest) for hour, gpu, *rest in V1_GPUS],
        )
        conn.execute("COMMIT")
    finally:
        conn.close()


# --- version 2, as that release wrote it: `job` split into `hpc_job` and `unit`, energy dollars ---

V2_DDL = (
    "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)",
    """CREATE TABLE workload_hours (
        hour INTEGER NOT NULL, node TEXT NOT NULL, gpu INTEGER NOT NULL, uuid TEXT NOT NULL,
        namespace TEXT NOT NULL, pod TEXT NOT NULL, container TEXT NOT NULL, hpc_job TEXT NOT NULL,
        unit TEXT NOT NULL, user TEXT NOT NULL, model TEXT NOT NULL, team TEXT NOT NULL,
        held_s REAL NOT NULL, busy_s REAL NOT NULL, dollars REAL NOT NULL, joules REAL NOT NULL,
        energy_dollars REAL,
        PRIMARY KEY (hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model, team)
    ) WITHOUT ROWID""",
    """CREATE TABLE gpu_hours (
        hour INTEGER NOT NULL, node TEXT NOT NULL, uuid TEXT NOT NULL,
        gpu INTEGER NOT NULL, model TEXT NOT NULL, dollars_per_hour REAL NOT NULL,
        observed_s REAL NOT NULL, dollars REAL NOT NULL, idle_s REAL NOT NULL, idle_dollars REAL NOT NULL,
        unobserved_s REAL NOT NULL, unobserved_dollars REAL NOT NULL, joules REAL NOT NULL, idle_joules REAL NOT NULL,
        energy_dollars REAL, idle_energy_dollars REAL,
        PRIMARY KEY (hour, node, uuid)
    ) WITHOUT ROWID""",
)


def write_v2_ledger(path: Path) -> None:
    """The same two hours as a version-2 agent left them (created at version 1, then migrated:
    both steps recorded), job ids in `hpc_job`, unit names in `unit`, no energy price."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("BEGIN IMMEDIATE")
        for statement in V2_DDL:
            conn.execute(statement)
        conn.executemany(
            "INSERT INTO schema_version (version, applied_at) VALUES (?, ?)",
            [(1, 1_795_000_000.0), (2, 1_795_100_000.0)],
        )
        conn.executemany(
            "INSERT INTO workload_hours (hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model,"
            " team, held_s, busy_s, dollars, joules, energy_dollars)"
            " VALUES (?, 'node-a', ?, 'GPU-' || ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
            [
                (hour, gpu, gpu, ns, pod, ctr, *((job, "") if job[:1].isdigit() else ("", job)), *rest)
                for hour, gpu, ns, pod, ctr, job, *rest in V1_WORKLOADS
            ],
        )
        conn.executemany(
            "INSERT INTO gpu_hours (hour, node, uuid, gpu, model, dollars_per_hour, observed_s, dollars, idle_s,"
            " idle_dollars, unobserved_s, unobserved_dollars, joules, idle_joules, energy_dollars, idle_energy_dollars)"
            " VALUES (?, 'node-a', 'GPU-' || ?, ?, 'A100-SXM4-80GB', 2.5, ?, ?, ?, ?, 0.0, 0.0, ?, ?, NULL, NULL)",
            [(hour, gpu, gpu, *rest) for hour, gpu, *rest in V1_GPUS],
        )
        conn.execute("COMMIT")
    finally:
        conn.close()


# --- version 3, as that release wrote it: version 2's tables and `ledger_meta` -------------------

V3_DDL = (
    *V2_DDL,
    """CREATE TABLE ledger_meta (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        ledger_id TEXT NOT NULL, node TEXT NOT NULL, created_at REAL NOT NULL, created_by TEXT NOT NULL,
        first_at REAL, last_at REAL
    )""",
)


def write_v3_ledger(path: Path) -> None:
    """The same two hours as a version-3 agent left them (created at version 1, migrated through
    both later steps): version 2's rows, and the `ledger_meta` row that version 3 learnt from them."""
    write_v2_ledger(path)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(V3_DDL[-1])
        conn.execute(
            "INSERT INTO ledger_meta (id, ledger_id, node, created_at, created_by, first_at, last_at)"
            " VALUES (1, ?, 'node-a', ?, '', ?, ?)",
            ("5f0c2a9e" * 4, 1_795_000_000.0, float(H0), float(H1 + H)),
        )
        conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (3, ?)", (1_795_200_000.0,))
        conn.execute("COMMIT")
    finally:
        conn.close()


# --- version 4, as that release wrote it: version 3's tables and each workload's charged seconds ---


def write_v4_ledger(path: Path) -> None:
    """The same two hours as a version-4 agent left them (created at version 1, migrated through
    every later step): version 3's rows, each workload row with its charged seconds (every GPU
    had one holder at a time, so its held seconds), and no record of who left GPU 2 idle."""
    write_v3_ledger(path)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ALTER TABLE workload_hours ADD COLUMN charged_s REAL NOT NULL DEFAULT 0.0")
        conn.execute("UPDATE workload_hours SET charged_s = held_s")
        conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (4, ?)", (1_795_300_000.0,))
        conn.execute("COMMIT")
    finally:
        conn.close()


def write_v5_ledger(path: Path) -> None:
    """The same two hours as a version-5 agent left them: version 4's file with `idle_hours`,
    whose rows (one per idle GPU-hour, left by nobody known) hold GPU 2's idle time."""
    write_v4_ledger(path)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            """CREATE TABLE idle_hours (
                hour INTEGER NOT NULL, node TEXT NOT NULL, uuid TEXT NOT NULL,
                namespace TEXT NOT NULL, pod TEXT NOT NULL, container TEXT NOT NULL, hpc_job TEXT NOT NULL,
                unit TEXT NOT NULL, user TEXT NOT NULL, model TEXT NOT NULL, team TEXT NOT NULL,
                gpu INTEGER NOT NULL,
                idle_s REAL NOT NULL, idle_dollars REAL NOT NULL, idle_joules REAL NOT NULL, idle_energy_dollars REAL,
                PRIMARY KEY (hour, node, uuid, namespace, pod, container, hpc_job, unit, user, model, team)
            ) WITHOUT ROWID"""
        )
        conn.execute(
            """INSERT INTO idle_hours SELECT hour, node, uuid, '', '', '', '', '', '', '', '', gpu, idle_s,
            idle_dollars, idle_joules, idle_energy_dollars FROM gpu_hours WHERE idle_s != 0"""
        )
        conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (5, ?)", (1_795_400_000.0,))
        conn.execute("COMMIT")
    finally:
        conn.close()


def take_step(path: Path, version: int, applied_at: float) -> None:
    """Migration step `version` as it shipped, applied to the file at `path` at `applied_at`."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        MIGRATIONS[version - 1](conn)
        conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (version, applied_at))
        conn.execute("COMMIT")
    finally:
        conn.close()


def write_v6_ledger(path: Path) -> None:
    """The same two hours as a version-6 agent left them: version 5's file taken through step 6
    as it shipped (the Slurm account in the workload key, each row's price columns)."""
    write_v5_ledger(path)
    take_step(path, 6, 1_795_500_000.0)


def write_v7_ledger(path: Path) -> None:
    """The same two hours as a version-7 agent left them: version 6's file taken through step 7
    as it shipped (`sizing_hours`, empty: nothing recorded sizing before it)."""
    write_v6_ledger(path)
    take_step(path, 7, 1_795_600_000.0)


def write_v8_ledger(path: Path) -> None:
    """The same two hours as a version-8 agent left them: version 7's file taken through step 8
    as it shipped (each workload row's unmeasured seconds, 0)."""
    write_v7_ledger(path)
    take_step(path, 8, 1_795_700_000.0)


# One writer per schema a release shipped before the current one: a new schema version must add
# the writer of the one it replaces (the test below fails until it does).
WRITERS = {
    1: write_v1_ledger, 2: write_v2_ledger, 3: write_v3_ledger, 4: write_v4_ledger, 5: write_v5_ledger,
    6: write_v6_ledger, 7: write_v7_ledger, 8: write_v8_ledger,
}  # fmt: skip


def rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    with closing(sqlite3.connect(path)) as conn, conn:
        return conn.execute(sql).fetchall()


@pytest.fixture
def v1_ledger(tmp_path: Path) -> Path:
    path = tmp_path / "ledger.db"
    write_v1_ledger(path)
    return path


# What the first release's `report --by job` printed for that file, worked by hand:
#   8812           $2.50  (H0 GPU 0)
#   9911_3         $2.50  (H1 GPU 0)
#   nginx.service  $2.50  (H0 GPU 1)
#   (none)         $3.75  (vllm-0 $1.25 at H0 GPU 2 + carol $2.50 at H1 GPU 1)
#   (idle)         $3.75  (GPU 2: half of H0, $1.25, and all of H1, $2.50)
#   TOTAL         $15.00  (3 GPUs x 2 hours x $2.50)
BEFORE_BY_JOB = {"8812": 2.5, "9911_3": 2.5, "nginx.service": 2.5, "": 3.75}
# and `--by user`, a key the migration does not touch:
BEFORE_BY_USER = {"alice": 2.5, "www": 2.5, "": 1.25, "bob": 2.5, "carol": 2.5}
IDLE = 1.25 + 2.5
TOTAL = 3 * 2 * 2.5


def check_report_matches_the_first_release(path: Path) -> None:
    # The job ids are now hpc_job and the unit names unit: each old `job` value's dollars are
    # found again under one of the two, the others empty.
    by_job_and_unit = {line.key: line.dollars for line in report_from_ledger(path, by=["hpc_job", "unit"]).lines}
    assert by_job_and_unit == {
        ("8812", ""): BEFORE_BY_JOB["8812"],
        ("9911_3", ""): BEFORE_BY_JOB["9911_3"],
        ("", "nginx.service"): BEFORE_BY_JOB["nginx.service"],
        ("", ""): BEFORE_BY_JOB[""],
    }
    by_user = report_from_ledger(path, by=["user"])
    assert {line.key[0]: line.dollars for line in by_user.lines} == BEFORE_BY_USER
    assert by_user.idle.dollars == IDLE
    assert by_user.total.dollars == TOTAL
    # 3 GPUs x 2 hours; each GPU had one holder at a time, whose charged seconds the migration
    # reads from its dollars: 4 x 3600 s + 1800 s of workloads + 1800 s + 3600 s idle = 21600 s.
    assert by_user.total.gpu_hours_charged == 6.0
    # Energy: 900k + 360k + 450k + 1.08M + 180k J of workloads = 2.97 MJ = 0.825 kWh; idle
    # 90k + 180k J = 0.075 kWh. The first release stored no energy price: no energy dollars.
    assert by_user.total.energy_kwh == pytest.approx((2_970_000 + 270_000) / 3.6e6, rel=1e-12)
    assert by_user.idle.energy_kwh == pytest.approx(0.075, rel=1e-12)
    assert by_user.total.energy_dollars is None


def test_report_reads_a_first_release_ledger_without_writing_it(v1_ledger: Path) -> None:
    before = v1_ledger.read_bytes()
    check_report_matches_the_first_release(v1_ledger)
    assert v1_ledger.read_bytes() == before  # migrated in memory only
    assert rows(v1_ledger, "SELECT version FROM schema_version") == [(1,)]


def test_opening_a_first_release_ledger_migrates_it_in_place(v1_ledger: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="gpuledger.ledger")
    Ledger(v1_ledger).close()
    assert rows(v1_ledger, "SELECT version FROM schema_version ORDER BY version") == [
        (v,) for v in range(1, SCHEMA_VERSION + 1)
    ]
    assert [r.getMessage() for r in caplog.records] == [
        f"ledger {v1_ledger}: schema migrated from version 1 to {SCHEMA_VERSION}"
    ]
    assert rows(v1_ledger, "SELECT gpu, hour, hpc_job, unit, user, dollars FROM workload_hours ORDER BY gpu, hour") == [
        (0, H0, "8812", "", "alice", 2.5),
        (0, H1, "9911_3", "", "bob", 2.5),  # an array task's id is a Slurm job id too
        (1, H0, "", "nginx.service", "www", 2.5),
        (1, H1, "", "", "carol", 2.5),
        (2, H0, "", "", "", 1.25),
    ]
    assert rows(v1_ledger, "SELECT COUNT(*) FROM workload_hours WHERE energy_dollars IS NOT NULL") == [(0,)]
    assert rows(v1_ledger, "SELECT COUNT(*) FROM gpu_hours WHERE energy_dollars IS NOT NULL") == [(0,)]
    # Charged seconds from the dollars at the hour's $2.50: $2.50 / 2.50 x 3600 = 3600 s each
    # (every GPU had one holder), and vllm-0's $1.25 / 2.50 x 3600 = 1800 s, its held half hour.
    assert rows(v1_ledger, "SELECT gpu, hour, held_s, charged_s FROM workload_hours ORDER BY gpu, hour") == [
        (0, H0, 3600.0, 3600.0),
        (0, H1, 3600.0, 3600.0),
        (1, H0, 3600.0, 3600.0),
        (1, H1, 3600.0, 3600.0),
        (2, H0, 1800.0, 1800.0),
    ]
    check_report_matches_the_first_release(v1_ledger)
    Ledger(v1_ledger).close()  # opening it again changes nothing
    assert rows(v1_ledger, "SELECT COUNT(*) FROM schema_version") == [(SCHEMA_VERSION,)]


def test_the_agent_keeps_adding_to_migrated_rows(v1_ledger: Path) -> None:
    # Upgraded mid-hour: the new agent's charges for job 8812 (once `job`, now `hpc_job`) land
    # on the row the first release wrote, not beside it.
    alice = Workload(hpc_job="8812", user="alice", model="llama-3-8b", team="research")
    charge = WorkloadCharge(
        gpu=0, uuid="GPU-0", workload=alice, held_s=60.0, busy_s=45.0, dollars=0.25, joules=15_000.0,
        energy_dollars=0.0005,
    )  # fmt: skip
    gpu = GpuCharge(
        gpu=0, uuid="GPU-0", model="A100-SXM4-80GB", dollars_per_hour=2.5, observed_s=60.0, dollars=0.25,
        idle_s=0.0, idle_dollars=0.0, unobserved_s=0.0, joules=15_000.0, idle_joules=0.0,
        energy_dollars=0.0005, idle_energy_dollars=0.0,
    )  # fmt: skip
    with Ledger(v1_ledger, retention_s=None) as ledger:
        ledger.add(Charges(H0 + 1800.0, H0 + 1860.0, "node-a", (charge,), (gpu,)))
    assert rows(
        v1_ledger, "SELECT held_s, dollars, joules, energy_dollars FROM workload_hours WHERE hpc_job = '8812'"
    ) == [
        (3660.0, 2.75, 915_000.0, 0.0005)  # 3600 + 60 s, $2.50 + $0.25, 900k + 15k J; priced from now on
    ]
    by_job = report_from_ledger(v1_ledger, by=["hpc_job"])
    assert {line.key: line.dollars for line in by_job.lines}[("8812",)] == 2.75
    assert by_job.total.dollars == TOTAL + 0.25


def test_the_latest_schema_has_a_column_for_every_workload_label(tmp_path: Path) -> None:
    # A new Workload field needs a new migration step; this fails until it has one.
    path = tmp_path / "ledger.db"
    Ledger(path).close()
    columns = [name for _cid, name, *_ in rows(path, "PRAGMA table_info(workload_hours)")]
    assert columns == [
        "hour", "node", "gpu", "uuid", *WORKLOAD_LABELS, "account", "held_s", "busy_s", "dollars", "joules",
        "energy_dollars", "charged_s", "dollars_per_hour", "purchase", "price_source", "unmeasured_s",
    ]  # fmt: skip
    assert rows(path, "SELECT version FROM schema_version ORDER BY version") == [
        (v,) for v in range(1, SCHEMA_VERSION + 1)
    ]


def test_a_ledger_from_a_newer_gpuledger_is_refused_in_one_line(v1_ledger: Path) -> None:
    Ledger(v1_ledger).close()
    newer = SCHEMA_VERSION + 1
    with closing(sqlite3.connect(v1_ledger)) as conn, conn:
        conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, 0)", (newer,))
    expected = (
        f"ledger {v1_ledger}: schema version {newer} is newer than this gpuledger reads "
        f"(versions 1 to {SCHEMA_VERSION}): upgrade gpuledger"
    )
    with pytest.raises(LedgerError) as opened:
        Ledger(v1_ledger)
    assert str(opened.value) == expected
    with pytest.raises(LedgerError) as read:
        read_usage(v1_ledger)
    assert str(read.value) == expected
    result = gpuledger("report", "--ledger", str(v1_ledger))
    assert (result.returncode, result.stderr) == (1, f"gpuledger: {expected}\n")


def test_report_by_job_is_report_by_hpc_job(v1_ledger: Path) -> None:
    by_alias, by_name = (report_from_ledger(v1_ledger, by=[key, "user"]) for key in ("job", "hpc_job"))
    assert by_alias == by_name
    assert by_alias.by == ("hpc_job", "user")
    assert math.fsum(line.dollars for line in by_alias.lines) + by_alias.idle.dollars == TOTAL


# --- version 3: the ledger knows its node and period ---


def test_there_is_a_writer_for_every_earlier_schema() -> None:
    assert sorted(WRITERS) == list(range(1, SCHEMA_VERSION))


@pytest.mark.parametrize("version", sorted(WRITERS))
def test_every_earlier_schema_migrates_to_the_latest_keeping_its_dollars(
    tmp_path: Path, version: int, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / f"v{version}.db"
    WRITERS[version](path)
    check_report_matches_the_first_release(path)  # read before: migrated in memory, file untouched
    before = read_info(path)
    assert rows(path, "SELECT MAX(version) FROM schema_version") == [(version,)]

    caplog.set_level("INFO", logger="gpuledger.ledger")
    Ledger(path).close()
    assert [r.getMessage() for r in caplog.records] == [
        f"ledger {path}: schema migrated from version {version} to {SCHEMA_VERSION}"
    ]
    assert [v for (v,) in rows(path, "SELECT version FROM schema_version ORDER BY version")] == list(
        range(1, SCHEMA_VERSION + 1)
    )
    check_report_matches_the_first_release(path)
    # What version 3 learns of an older file (and a version-3 file recorded, having learnt it
    # so): its node from its rows, the hours they cover as its period (18:00 to 20:00: hours H0
    # and H1), its creation from the first step's time, and that the release which created it is
    # unknown.
    meta = rows(path, "SELECT node, created_at, created_by, first_at, last_at, length(ledger_id) FROM ledger_meta")
    assert meta == [("node-a", 1_795_000_000.0, "", float(H0), float(H1 + H), 32)]
    after = read_info(path)
    assert (after.node, after.created_at, after.created_by, after.first_at, after.last_at, after.nodes) == (
        before.node, before.created_at, before.created_by, before.first_at, before.last_at, before.nodes,
    ) == ("node-a", 1_795_000_000.0, "", float(H0), float(H1 + H), frozenset({"node-a"}))  # fmt: skip


# --- version 4: charged seconds, a workload's share of the unit's time ---


def test_version_4_fills_charged_seconds_from_dollars_or_else_held_seconds(tmp_path: Path) -> None:
    path = tmp_path / "v3.db"
    write_v3_ledger(path)
    workload_sql = (
        "INSERT INTO workload_hours (hour, node, gpu, uuid, namespace, pod, container, hpc_job, unit, user, model,"
        " team, held_s, busy_s, dollars, joules, energy_dollars)"
        " VALUES (?, 'node-a', ?, ?, '', '', '', '', '', ?, '', '', ?, ?, ?, 0.0, NULL)"
    )
    gpu_sql = (
        "INSERT INTO gpu_hours (hour, node, uuid, gpu, model, dollars_per_hour, observed_s, dollars, idle_s,"
        " idle_dollars, unobserved_s, unobserved_dollars, joules, idle_joules, energy_dollars, idle_energy_dollars)"
        " VALUES (?, 'node-a', ?, ?, 'A100-SXM4-80GB', ?, 3600.0, ?, ?, ?, 0.0, 0.0, 0.0, 0.0, NULL, NULL)"
    )
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.executemany(
            workload_sql,
            [
                # GPU 3 at $3.60/h, shared all of H0 by ann at 60% and bob at 20%: each held it
                # 3600 s; the dollars were split 60:20, ann $2.70, bob $0.90.
                (H0, 3, "GPU-3", "ann", 3600.0, 2160.0, 2.70),
                (H0, 3, "GPU-3", "bob", 3600.0, 720.0, 0.90),
                # GPU 4 has no price: its $0 says nothing of the share.
                (H0, 4, "GPU-4", "carol", 3600.0, 1800.0, 0.0),
                # GPU 5 at $3.60/h split 3g+3g: dave held MIG instance 0 (42 of 108 SMs) all hour
                # for 3.60 x 42/108 = $1.40; its row names the instance, found by the GPU index.
                (H0, 5, "MIG-5-0", "dave", 3600.0 * 42 / 108, 0.0, 1.40),
                # GPU 6 at H1 has no GPU row at all (no price to read).
                (H1, 6, "GPU-6", "erin", 1200.0, 600.0, 1.0),
            ],
        )
        conn.executemany(
            gpu_sql,
            [
                (H0, "GPU-3", 3, 3.6, 3.6, 0.0, 0.0),
                (H0, "GPU-4", 4, 0.0, 0.0, 0.0, 0.0),
                # the 24 SMs nobody could hold are idle: 3600 x 24/108 s, 3.60 x 24/108 = $0.80
                (H0, "GPU-5", 5, 3.6, 3.6, 3600.0 * 24 / 108, 0.80),
            ],
        )
    Ledger(path).close()
    stored = rows(path, "SELECT user, held_s, charged_s FROM workload_hours WHERE gpu >= 3")
    charged = {user: (held, charged) for user, held, charged in stored}
    assert charged == {
        "ann": (3600.0, pytest.approx(2700.0, rel=1e-12)),  # $2.70 / $3.60 x 3600 s
        "bob": (3600.0, pytest.approx(900.0, rel=1e-12)),  # $0.90 / $3.60 x 3600 s: 2700 + 900 = the hour
        "carol": (3600.0, 3600.0),  # unpriced: its held seconds
        "dave": (pytest.approx(1400.0), pytest.approx(1400.0, rel=1e-12)),  # $1.40 / $3.60 x 3600 s
        "erin": (1200.0, 1200.0),  # no GPU-hour: its held seconds
    }


def test_a_renamed_node_is_known_by_the_name_most_of_its_rows_carry(v1_ledger: Path) -> None:
    with closing(sqlite3.connect(v1_ledger)) as conn, conn:
        conn.execute(
            "INSERT INTO gpu_hours VALUES (?, 'old-name', 'GPU-0', 0, 'A100-SXM4-80GB', 2.5,"
            " 3600.0, 2.5, 3600.0, 2.5, 0.0, 0.0, 0.0, 0.0)",
            (H0 - H,),
        )
    info = read_info(v1_ledger)
    assert info.node == "node-a"  # six GPU-hours against one
    assert info.nodes == frozenset({"node-a", "old-name"})
    assert (info.first_at, info.last_at) == (H0 - H, H1 + H)  # the old name's hour counts too


def test_an_upgraded_agent_charges_from_where_the_first_releases_record_ended(v1_ledger: Path) -> None:
    # The first release stopped at 19:15: its 19:00 hour holds a quarter of each GPU's 3600 s.
    # Before version 3 a ledger does not say where its charges end; the migration read the end
    # of its last hour (20:00), so an upgraded agent starting at 19:20 took its clock for one
    # set back and charged nothing until 20:00. Read from the last hour's seconds, the record
    # ends at 19:15 (H1 + 900 s): the agent books 19:15 to 19:20 unobserved (agent_down, 300 s,
    # $0.300 at $0.001 a second) and charges ann 19:20 to 19:30 (600 s, $0.600); 0.300 + 0.600
    # = 900 s x $0.001.
    with closing(sqlite3.connect(v1_ledger)) as conn, conn:
        conn.execute(
            "UPDATE gpu_hours SET observed_s = observed_s / 4, dollars = dollars / 4, idle_s = idle_s / 4,"
            " idle_dollars = idle_dollars / 4 WHERE hour = ?",
            (H1,),
        )
        conn.execute("UPDATE workload_hours SET held_s = held_s / 4, dollars = dollars / 4 WHERE hour = ?", (H1,))
    assert recorded_period(v1_ledger) == (H0, H1 + 900)
    offset = [0.0]
    agent = _stepped_agent(v1_ledger, offset)
    try:
        offset[0] = H1 + 1200 - agent.node.clock.wall_time()  # the agent's clock reads 19:20
        _watch(agent, 40)  # to 19:30
    finally:
        agent.close()
    assert rows(
        v1_ledger,
        "SELECT sum(observed_s), sum(dollars), sum(unobserved_s), sum(unobserved_dollars) FROM gpu_hours"
        " WHERE node = 'n1'",
    ) == [
        (
            pytest.approx(600.0),
            pytest.approx(600 * PRICE / 3600),
            pytest.approx(300.0),
            pytest.approx(300 * PRICE / 3600),
        )
    ]


def test_a_new_ledger_records_its_node_creator_and_the_period_it_writes(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with Ledger(path, node="gpu-node-01", retention_s=None) as ledger:
        info = read_info(path)
        assert (info.node, info.created_by, info.first_at, info.last_at) == (
            "gpu-node-01", f"gpuledger {__version__}", None, None,
        )  # fmt: skip
        assert not info.recorded
        # Two intervals, 18:30:00.5 to 18:31 and 18:31 to 19:02: the period is their union.
        ledger.add(Charges(H0 + 1800.5, H0 + 1860.0, "gpu-node-01", (), (gpu_charge(59.5),)))
        ledger.add(Charges(H0 + 1860.0, H1 + 120.0, "gpu-node-01", (), (gpu_charge(1860.0),)))
    info = read_info(path)
    assert (info.first_at, info.last_at, info.nodes) == (H0 + 1800.5, H1 + 120.0, frozenset({"gpu-node-01"}))
    assert info.recorded
    # A restart adds earlier and later charges (a clock set back, then the next poll): it widens.
    with Ledger(path, node="gpu-node-01", retention_s=None) as ledger:
        ledger.add(Charges(H0 - 60.0, H0, "gpu-node-01", (), (gpu_charge(60.0),)))
        ledger.add(Charges(H1 + 120.0, H1 + 180.0, "gpu-node-01", (), (gpu_charge(60.0),)))
    assert (read_info(path).first_at, read_info(path).last_at) == (H0 - 60.0, H1 + 180.0)
    assert read_info(path).created_at == info.created_at


def test_a_ledger_opened_without_its_node_learns_it_from_its_first_write(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with Ledger(path, retention_s=None) as ledger:
        assert read_info(path).node == ""
        ledger.add(Charges(H0, H0 + 60.0, "gpu-node-07", (), (gpu_charge(60.0),)))
    assert read_info(path).node == "gpu-node-07"


def test_another_node_opening_a_ledger_is_logged_and_the_ledger_keeps_its_node(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ledger.db"
    Ledger(path, node="gpu-node-01").close()
    Ledger(path, node="gpu-node-02").close()
    assert read_info(path).node == "gpu-node-01"
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"ledger {path} belongs to node gpu-node-01; this agent is node gpu-node-02 and records its rows under "
        "that name"
    ]


def test_retention_moves_the_start_of_the_period_to_what_it_keeps(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    now = [H0 + 10 * H]
    with Ledger(path, retention_s=5 * H, clock=lambda: now[0]) as ledger:
        ledger.add(Charges(H0, H0 + H, "n", (), (gpu_charge(H),)))
        ledger.add(Charges(H0 + 6 * H, H0 + 7 * H, "n", (), (gpu_charge(H),)))
        assert ledger.flush()
        # now - 5 h = H0 + 5 h: the hour H0 goes, and the period starts where what is kept may.
        assert (read_info(path).first_at, read_info(path).last_at) == (H0 + 5 * H, H0 + 7 * H)
        now[0] = H0 + 20 * H  # everything ages out: the ledger records nothing
        assert ledger.flush()
    assert (read_info(path).first_at, read_info(path).last_at, read_info(path).recorded) == (None, None, False)


def gpu_charge(seconds: float) -> GpuCharge:
    """GPU 0 idle at $3.60 an hour (a tenth of a cent a second) for `seconds`."""
    return GpuCharge(
        gpu=0, uuid="GPU-0", model="A100-SXM4-80GB", dollars_per_hour=3.6, observed_s=seconds, dollars=seconds / 1000,
        idle_s=seconds, idle_dollars=seconds / 1000, unobserved_s=0.0, joules=0.0, idle_joules=0.0,
    )  # fmt: skip


# --- version 5: idle time by who left the GPU idle ---


def test_version_5_books_the_idle_time_of_older_hours_to_nobody_known(tmp_path: Path) -> None:
    # A version-4 file recorded GPU 2 idle for 1800 s ($1.25, 90 kJ) of H0 and all of H1
    # (3600 s, $2.50, 180 kJ), and not who left it so: each GPU-hour gets one idle_hours row with
    # empty labels holding all of its idle time, so the rows add up to gpu_hours' idle figures.
    path = tmp_path / "v4.db"
    write_v4_ledger(path)
    Ledger(path, retention_s=None).close()
    labels = ", ".join(WORKLOAD_LABELS)
    assert rows(path, f"SELECT hour, uuid, gpu, {labels}, idle_s, idle_dollars, idle_joules FROM idle_hours") == [
        (H0, "GPU-2", 2, *[""] * len(WORKLOAD_LABELS), 1800.0, 1.25, 90_000.0),
        (H1, "GPU-2", 2, *[""] * len(WORKLOAD_LABELS), 3600.0, 2.5, 180_000.0),
    ]
    # The agent, upgraded, then books a minute of the next hour, H2, to job 8812, which left
    # GPU 2 idle: a row of its own. 60 s at $2.50/h = $0.041666...
    h2 = H1 + H
    left = Workload(hpc_job="8812", user="alice")
    minute = 60 * 2.5 / H
    gpu = GpuCharge(
        gpu=2, uuid="GPU-2", model="A100-SXM4-80GB", dollars_per_hour=2.5, observed_s=60.0, dollars=minute,
        idle_s=60.0, idle_dollars=minute, unobserved_s=0.0, joules=3000.0, idle_joules=3000.0,
        idle_by=(IdleCharge(left, 60.0, minute, 3000.0),),
    )  # fmt: skip
    with Ledger(path, retention_s=None) as ledger:
        ledger.add(Charges(h2, h2 + 60.0, "node-a", (), (gpu,)))
    assert rows(path, "SELECT hour, hpc_job, user, idle_s, idle_dollars FROM idle_hours ORDER BY hour") == [
        (H0, "", "", 1800.0, 1.25),
        (H1, "", "", 3600.0, 2.5),
        (h2, "8812", "alice", 60.0, minute),
    ]
    # Per GPU-hour the idle rows add up to the GPU row's idle figures.
    assert rows(
        path,
        "SELECT g.hour, g.idle_s, g.idle_dollars, sum(i.idle_s), sum(i.idle_dollars) FROM gpu_hours g"
        " JOIN idle_hours i USING (hour, node, uuid) GROUP BY g.hour, g.uuid ORDER BY g.hour",
    ) == [(H0, 1800.0, 1.25, 1800.0, 1.25), (H1, 3600.0, 2.5, 3600.0, 2.5), (h2, 60.0, minute, 60.0, minute)]
    report = report_from_ledger(path, by=["hpc_job"])
    assert [(line.left_by, line.dollars) for line in report.idle_by] == [
        (Workload(), 3.75),  # H0's $1.25 and H1's $2.50, left by nobody known
        (left, minute),
    ]
    assert report.idle.dollars == IDLE + minute
    assert report.total.dollars == TOTAL + minute  # 3 GPUs x 2 h x $2.50, and the minute


# --- version 6: the Slurm account in the key, the price each row was charged at ---


def test_version_4_rows_get_no_account_and_no_recorded_purchase(tmp_path: Path) -> None:
    path = tmp_path / "v4.db"
    write_v4_ledger(path)
    Ledger(path).close()
    assert rows(path, "SELECT DISTINCT account, dollars_per_hour, purchase, price_source FROM workload_hours") == [
        ("", None, None, None)
    ]
    # GPU rows had their price; how it was bought and where it came from were not recorded.
    assert rows(path, "SELECT DISTINCT dollars_per_hour, purchase, price_source FROM gpu_hours") == [(2.5, None, None)]
    check_report_matches_the_first_release(path)
    assert {line.key: line.dollars for line in report_from_ledger(path, by=["account"]).lines} == {("",): 15.0 - IDLE}


def test_after_version_6_a_job_is_kept_by_its_account_with_its_price(tmp_path: Path) -> None:
    path = tmp_path / "v4.db"
    write_v4_ledger(path)
    alice = Workload(hpc_job="8812", user="alice", model="llama-3-8b", team="research")

    def charge(account: str, dollars: float) -> WorkloadCharge:
        return WorkloadCharge(0, "GPU-0", alice, 60.0, 45.0, dollars, 0.0, charged_s=60.0, account=account)

    gpu = GpuCharge(
        gpu=0, uuid="GPU-0", model="A100-SXM4-80GB", dollars_per_hour=1.5, observed_s=60.0, dollars=0.025,
        idle_s=0.0, idle_dollars=0.0, unobserved_s=0.0, joules=0.0, idle_joules=0.0, purchase="spot",
        price_source="instance",
    )  # fmt: skip
    with Ledger(path, retention_s=None) as ledger:
        # Upgraded mid-hour: the job without an account lands on the row version 4 wrote ...
        ledger.add(Charges(H0 + 1800.0, H0 + 1860.0, "node-a", (charge("", 0.025),), (gpu,)))
        # ... and with one, beside it: $1.50/h spot x 60 s = $0.025.
        ledger.add(Charges(H0 + 1860.0, H0 + 1920.0, "node-a", (charge("nlp", 0.025),), (gpu,)))
    stored = rows(
        path,
        "SELECT account, held_s, dollars, dollars_per_hour, purchase, price_source FROM workload_hours"
        " WHERE hpc_job = '8812' ORDER BY account",
    )
    assert stored == [
        ("", 3660.0, 2.525, 1.5, "spot", "instance"),  # 3600 + 60 s, $2.50 + $0.025; the hour's latest price
        ("nlp", 60.0, 0.025, 1.5, "spot", "instance"),
    ]
    by_account = {line.key: line.dollars for line in report_from_ledger(path, by=["account"]).lines}
    assert by_account == {("",): pytest.approx(15.0 - IDLE + 0.025), ("nlp",): pytest.approx(0.025)}


def test_version_8_counts_older_rows_as_measured_and_adds_unmeasured_time_to_them(tmp_path: Path) -> None:
    path = tmp_path / "v7.db"
    write_v7_ledger(path)
    alice = Workload(hpc_job="8812", user="alice", model="llama-3-8b", team="research")
    before = {line.key: (line.efficiency, line.waste_dollars) for line in report_from_ledger(path, by=["user"]).lines}
    # alice, hour H0: 2700 busy of 3600 s charged for $2.50: efficiency 0.75, waste 2.50 x 0.25.
    assert before[("alice",)] == (0.75, 0.625)
    Ledger(path).close()
    assert rows(path, "SELECT DISTINCT unmeasured_s FROM workload_hours") == [(0.0,)]
    after = report_from_ledger(path, by=["user"])
    assert {line.key: (line.efficiency, line.waste_dollars) for line in after.lines} == before
    assert after.total.dollars == TOTAL
    gpu = GpuCharge(
        gpu=0, uuid="GPU-0", model="A100-SXM4-80GB", dollars_per_hour=2.5, observed_s=1800.0, dollars=1.25,
        idle_s=0.0, idle_dollars=0.0, unobserved_s=0.0, joules=0.0, idle_joules=0.0,
    )  # fmt: skip
    # Half an hour more on alice's migrated row, with no busy figure: 1800 s unmeasured, $1.25.
    unmeasured = WorkloadCharge(0, "GPU-0", alice, 1800.0, 0.0, 1.25, 0.0, charged_s=1800.0, unmeasured_s=1800.0)
    with Ledger(path, retention_s=None) as ledger:
        ledger.add(Charges(H0 + 3600.0, H0 + 5400.0, "node-a", (unmeasured,), (gpu,)))
    stored = rows(path, "SELECT charged_s, busy_s, unmeasured_s, dollars FROM workload_hours WHERE user = 'alice'")
    assert stored == [(3600.0, 2700.0, 0.0, 2.5), (1800.0, 0.0, 1800.0, 1.25)]
    line = next(ln for ln in report_from_ledger(path, by=["user"]).lines if ln.key == ("alice",))
    # Efficiency over the measured 3600 s: 2700 / 3600; waste only the measured hour's $0.625,
    # the unmeasured half hour's is unknown, not $1.25 more.
    assert (line.efficiency, line.waste_dollars, line.dollars) == (0.75, 0.625, 3.75)


def test_version_9_keeps_older_joules_and_takes_energy_no_counter_measured_as_null(tmp_path: Path) -> None:
    path = tmp_path / "v8.db"
    write_v8_ledger(path)
    Ledger(path).close()
    # Older rows keep their joules (version 1's 900 kJ for alice in H0), and their dollars.
    assert rows(path, "SELECT joules FROM workload_hours WHERE user = 'alice'") == [(900_000.0,)]
    check_report_matches_the_first_release(path)
    bob = Workload(hpc_job="9911_3", user="bob")
    gpu = GpuCharge(
        gpu=2, uuid="GPU-2", model="A100-SXM4-80GB", dollars_per_hour=2.5, observed_s=1800.0, dollars=1.25,
        idle_s=0.0, idle_dollars=0.0, unobserved_s=0.0, joules=None, idle_joules=None,
    )  # fmt: skip
    # Half an hour at $2.50/h = $1.25 on GPU 2 after the ledger's hours, with no energy counter.
    with Ledger(path, retention_s=None) as ledger:
        charge = WorkloadCharge(2, "GPU-2", bob, 1800.0, 0.0, 1.25, None, charged_s=1800.0)
        ledger.add(Charges(H1 + H, H1 + H + 1800.0, "node-a", (charge,), (gpu,)))
    assert rows(path, f"SELECT joules, energy_dollars FROM workload_hours WHERE hour = {H1 + H}") == [(None, None)]
    assert rows(path, f"SELECT joules, idle_joules FROM gpu_hours WHERE hour = {H1 + H}") == [(None, None)]
    line = next(ln for ln in report_from_ledger(path, by=["user"]).lines if ln.key == ("bob",))
    # bob's H1 hour: 1.08 MJ = 0.3 kWh measured; the new half hour's energy is unknown, not 0.
    assert line.energy_kwh == pytest.approx(0.3, rel=1e-12)
    assert line.dollars == pytest.approx(2.5 + 1.25, rel=1e-12)
