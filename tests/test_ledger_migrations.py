"""Ledger schema migrations, from every schema a release has shipped.

Version 1 (the first release) is rebuilt here with raw SQL, its DDL copied from that release,
so these tests keep describing the files people have on disk whatever the code becomes. Opening
one migrates it in one transaction; `report` reads it before and after with the same dollars;
a ledger from a newer gpuledger is refused in one line.
"""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import pytest

from agent.ledger.report import report_from_ledger
from agent.ledger.store import SCHEMA_VERSION, Ledger, LedgerError, read_usage
from agent.model import WORKLOAD_LABELS, Charges, GpuCharge, Workload, WorkloadCharge
from tests.test_cli import gpuledger

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


def rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(path) as conn:
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
    assert by_user.total.gpu_hours_held == 6.0  # 3 GPUs x 2 hours
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
    assert rows(v1_ledger, "SELECT version FROM schema_version ORDER BY version") == [(1,), (2,)]
    assert [r.getMessage() for r in caplog.records] == [f"ledger {v1_ledger}: schema migrated from version 1 to 2"]
    assert rows(v1_ledger, "SELECT gpu, hour, hpc_job, unit, user, dollars FROM workload_hours ORDER BY gpu, hour") == [
        (0, H0, "8812", "", "alice", 2.5),
        (0, H1, "9911_3", "", "bob", 2.5),  # an array task's id is a Slurm job id too
        (1, H0, "", "nginx.service", "www", 2.5),
        (1, H1, "", "", "carol", 2.5),
        (2, H0, "", "", "", 1.25),
    ]
    assert rows(v1_ledger, "SELECT COUNT(*) FROM workload_hours WHERE energy_dollars IS NOT NULL") == [(0,)]
    assert rows(v1_ledger, "SELECT COUNT(*) FROM gpu_hours WHERE energy_dollars IS NOT NULL") == [(0,)]
    check_report_matches_the_first_release(v1_ledger)
    Ledger(v1_ledger).close()  # opening it again changes nothing
    assert rows(v1_ledger, "SELECT COUNT(*) FROM schema_version") == [(2,)]


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
        "hour", "node", "gpu", "uuid", *WORKLOAD_LABELS, "held_s", "busy_s", "dollars", "joules", "energy_dollars",
    ]  # fmt: skip
    assert rows(path, "SELECT version FROM schema_version ORDER BY version") == [
        (v,) for v in range(1, SCHEMA_VERSION + 1)
    ]


def test_a_ledger_from_a_newer_gpuledger_is_refused_in_one_line(v1_ledger: Path) -> None:
    Ledger(v1_ledger).close()
    newer = SCHEMA_VERSION + 1
    with sqlite3.connect(v1_ledger) as conn:
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
