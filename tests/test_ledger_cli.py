"""The ledger through the command line, on real files and real subprocesses: `simulate` refuses
a ledger that already holds charges unless --append, an --append that would count time twice,
and a ledger it cannot write, before it simulates anything; `report` merges several ledgers
(files or directories) and refuses to count one node's time twice."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from agent.ledger.read import read_info
from agent.ledger.report import ledger_files
from agent.ledger.store import Ledger
from tests.test_cli import Daemon, gpuledger, polls_at_least

H = 3600.0
START = 1_795_197_600.0  # 2026-11-20T18:00:00Z, the scenarios' start

# Two GPUs at $2.50 an hour: ann's job holds GPU 0 throughout, GPU 1 is idle.
SCENARIO = """
start: %(start)s
node: {hostname: %(node)s}
gpus:
  - {model: A100-SXM4-80GB, count: 2}
processes:
  - {pid: 4101, gpus: [0], sm_util: 50, memory_mib: 1000, uid: 1001, user: ann, cmdline: "python train.py"}
"""
CONFIG = "pricing: {gpu_hourly: 2.5}\n"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """A scenario per node name (from 18:00, and gpu-node-01 once more from 20:00, where the
    first one's two hours end) and the config that prices them."""
    out = {"config": tmp_path / "gpuledger.yml"}
    out["config"].write_text(CONFIG)
    for name, node, start in (
        ("gpu-node-01", "gpu-node-01", "2026-11-20T18:00:00Z"),
        ("gpu-node-02", "gpu-node-02", "2026-11-20T18:00:00Z"),
        ("gpu-node-01-later", "gpu-node-01", "2026-11-20T20:00:00Z"),
    ):
        out[name] = tmp_path / f"{name}.yaml"
        out[name].write_text(SCENARIO % {"node": node, "start": start})
    return out


def simulate(
    files: dict[str, Path], ledger: Path, *args: str, node: str = "gpu-node-01", duration: str = "2h"
) -> subprocess.CompletedProcess[str]:
    return gpuledger(
        "simulate", str(files[node]), "--for", duration, "--step", "60s", "--config", str(files["config"]),
        "--ledger", str(ledger), "--metrics-out", str(ledger.with_suffix(".prom")), *args,
    )  # fmt: skip


def report_json(*ledgers: Path, by: str = "user") -> dict[str, Any]:
    result = gpuledger("report", *(a for ledger in ledgers for a in ("--ledger", str(ledger))), "--by", by,
                       "--format", "json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def dollars_by_user(document: dict[str, Any]) -> dict[str, float]:
    return {row["user"]: row["dollars"] for row in document["rows"]}


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return gpuledger("report", "--by", "user", "--format", "json", *args)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# --- simulate ---


def test_simulate_twice_into_one_ledger_is_refused_unless_append(tmp_path: Path, files: dict[str, Path]) -> None:
    ledger = tmp_path / "sim.db"
    first = simulate(files, ledger)
    assert first.returncode == 0, first.stderr
    # 2 h of GPU 0 held by ann at $2.50/h = $5.00; GPU 1 idle for 2 h = $5.00.
    once = report_json(ledger)
    assert dollars_by_user(once) == pytest.approx({"ann": 5.0}, rel=1e-9)
    assert once["idle"]["dollars"] == pytest.approx(5.0, rel=1e-9)
    assert read_info(ledger).node == "gpu-node-01"  # the scenario's hostname: the agent's node
    before = ledger.read_bytes()

    again = simulate(files, ledger)
    assert again.returncode == 2
    assert one_line(again.stderr) == (
        f"gpuledger: --ledger: {ledger} already holds charges (2026-11-20T18:00:00Z to 2026-11-20T20:00:00Z); "
        "pass --append to add to them, or choose a new file"
    )
    assert ledger.read_bytes() == before  # not even opened for writing

    # --append continues the ledger; the same two hours again would be counted twice: refused.
    overlapping = simulate(files, ledger, "--append")
    assert overlapping.returncode == 2
    assert one_line(overlapping.stderr) == (
        f"gpuledger: --append: {ledger} records charges until 2026-11-20T20:00:00Z, after the scenario's start "
        "2026-11-20T18:00:00Z: that time would be counted twice; start the scenario at or after "
        "2026-11-20T20:00:00Z, or choose a new file"
    )
    assert ledger.read_bytes() == before

    appended = simulate(files, ledger, "--append", node="gpu-node-01-later")
    assert appended.returncode == 0, appended.stderr
    # The next two hours, 20:00 to 22:00: ann 4 h x $2.50 = $10.00, idle GPU 1 4 h x $2.50 = $10.00;
    # nothing unobserved (the second run starts where the first ended). 10 + 10 + 0 = $20.00 =
    # 2 GPUs x 4 h x $2.50.
    both = report_json(ledger)
    assert dollars_by_user(both) == pytest.approx({"ann": 10.0}, rel=1e-9)
    assert both["idle"]["dollars"] == pytest.approx(10.0, rel=1e-9)
    assert both["unobserved"]["dollars"] == pytest.approx(0.0, abs=1e-9)
    assert both["total"]["dollars"] == pytest.approx(20.0, rel=1e-9)
    after = ledger.read_bytes()

    # The 18:00 scenario once more, now that the ledger runs to 22:00: its hours are held already.
    earlier = simulate(files, ledger, "--append")
    assert earlier.returncode == 2
    assert "records charges until 2026-11-20T22:00:00Z" in one_line(earlier.stderr)
    assert ledger.read_bytes() == after


def test_a_duration_that_is_not_whole_steps_is_simulated_to_its_end(tmp_path: Path, files: dict[str, Path]) -> None:
    ledger = tmp_path / "odd.db"
    result = gpuledger(
        "simulate", str(files["gpu-node-01"]), "--for", "2h", "--step", "7m", "--config", str(files["config"]),
        "--ledger", str(ledger),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # 2 h in 7 min steps is 17 of them (1 h 59 min) and a last one of 1 min: 0 + 18 steps = 19 polls.
    assert f"simulated 2h of '{files['gpu-node-01']}' in 19 polls" in result.stdout
    # All of the 2 h is charged, as with whole steps: ann 2 h x $2.50 = $5.00, idle GPU 1 $5.00.
    document = report_json(ledger)
    assert dollars_by_user(document) == pytest.approx({"ann": 5.0}, rel=1e-9)
    assert document["idle"]["dollars"] == pytest.approx(5.0, rel=1e-9)
    assert document["unobserved"]["dollars"] == pytest.approx(0.0, abs=1e-9)
    assert document["total"]["dollars"] == pytest.approx(10.0, rel=1e-9)  # 2 GPUs x 2 h x $2.50


def test_run_on_a_fake_node_keeps_its_ledger_by_the_scenarios_clock(tmp_path: Path) -> None:
    # `run --fake` on a scenario that starts 2020-01-06T09:00:00Z, with the default retention
    # (400d): the charges are stamped with the scenario's clock, so they are the scenario's, and
    # retention counts back from that clock too. Before, it counted back from the host's real
    # clock: every hour of the scenario was older than 400 days, and each flush deleted them all,
    # so the ledger held nothing after the run.
    scenario, ledger = tmp_path / "2020.yaml", tmp_path / "run.db"
    scenario.write_text(SCENARIO % {"node": "gpu-node-01", "start": "2020-01-06T09:00:00Z"})
    (tmp_path / "gpuledger.yml").write_text(CONFIG)
    d = Daemon(
        tmp_path, "--fake", str(scenario), "--config", str(tmp_path / "gpuledger.yml"), "--ledger", str(ledger),
        env={"GPULEDGER_POLL_INTERVAL": "0.2s"},
    )  # fmt: skip
    try:
        d.wait_for(polls_at_least(5))
    finally:
        assert d.stop() == 0
    with closing(sqlite3.connect(ledger)) as db, db:
        rows = db.execute(
            "SELECT hour, gpu, observed_s, unobserved_s, dollars, unobserved_dollars FROM gpu_hours ORDER BY gpu"
        ).fetchall()
    # A few real seconds at 1x: both GPUs, in the scenario's first hour, 2020-01-06T09:00:00Z.
    assert [(hour, gpu) for hour, gpu, *_ in rows] == [(1_578_301_200, 0), (1_578_301_200, 1)]
    for _hour, _gpu, observed_s, unobserved_s, dollars, unobserved_dollars in rows:
        assert observed_s > 0  # charged, not deleted
        # Each GPU's seconds at $2.50 an hour: observed plus unobserved dollars = price x time.
        assert dollars + unobserved_dollars == pytest.approx((observed_s + unobserved_s) * 2.5 / H)


def test_an_empty_file_or_a_ledger_without_charges_is_a_new_ledger(tmp_path: Path, files: dict[str, Path]) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    assert simulate(files, empty).returncode == 0
    assert read_info(empty).node == "gpu-node-01"
    # A ledger that records nothing yet (opened, never charged): nothing to count twice.
    fresh = tmp_path / "fresh.db"
    Ledger(fresh).close()
    assert simulate(files, fresh).returncode == 0
    assert dollars_by_user(report_json(fresh)) == pytest.approx({"ann": 5.0}, rel=1e-9)  # 2 h x $2.50


def test_a_ledger_that_cannot_be_written_is_refused_before_simulating(tmp_path: Path, files: dict[str, Path]) -> None:
    """Another process holds the write lock (root ignores file modes; a held lock refuses every user)."""
    ledger = tmp_path / "locked.db"
    ledger.touch()
    holder = sqlite3.connect(ledger, isolation_level=None)
    try:
        holder.execute("PRAGMA journal_mode=WAL")
        holder.execute("BEGIN EXCLUSIVE")
        result = simulate(files, ledger)
    finally:
        holder.close()
    assert result.returncode == 2
    assert one_line(result.stderr) == f"gpuledger: --ledger: ledger {ledger}: cannot open: database is locked"
    assert not ledger.with_suffix(".prom").exists()  # nothing was simulated


def test_a_file_that_is_not_a_ledger_is_refused_and_left_alone(tmp_path: Path, files: dict[str, Path]) -> None:
    notes = tmp_path / "notes.db"
    notes.write_text("my notes, not a ledger\n" * 100)
    result = simulate(files, notes, "--append")
    assert result.returncode == 2
    assert one_line(result.stderr) == f"gpuledger: --ledger: ledger {notes}: cannot open: file is not a database"
    assert notes.read_text() == "my notes, not a ledger\n" * 100
    directory = tmp_path / "dir.db"
    directory.mkdir()
    result = simulate(files, directory)
    assert (result.returncode, one_line(result.stderr)) == (
        2,
        f"gpuledger: --ledger: ledger {directory}: is a directory",
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--for", "0s"), "gpuledger: --for: must be above 0, got 0s"),
        (
            ("--for", "30m", "--step", "1h"),
            "gpuledger: --step: 1h is longer than --for 30m: no interval would be simulated",
        ),
        (("--for", "1h", "--append"), "gpuledger: --append: only meaningful with --ledger"),
    ],
)
def test_simulate_that_would_charge_nothing_is_bad_input(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    out = tmp_path / "metrics.prom"
    result = gpuledger("simulate", "demo", *args, "--metrics-out", str(out))
    assert (result.returncode, one_line(result.stderr)) == (2, message)
    assert not out.exists()


# --- report over several ledgers ---


@pytest.fixture
def two_nodes(tmp_path: Path, files: dict[str, Path]) -> Path:
    """A directory with two hours of each node's ledger: gpu-node-01.db and gpu-node-02.db."""
    ledgers = tmp_path / "ledgers"
    ledgers.mkdir()
    for node in ("gpu-node-01", "gpu-node-02"):
        result = simulate(files, ledgers / f"{node}.db", node=node)
        assert result.returncode == 0, result.stderr
    for prom in ledgers.glob("*.prom"):
        prom.unlink()
    return ledgers


# Two nodes, two hours each, at $2.50 an hour per GPU: ann holds GPU 0 on each, $5.00 a node,
# $10.00 in all; GPU 1 of each is idle, $10.00 in all; TOTAL 2 nodes x 2 GPUs x 2 h x $2.50 = $20.00.
BOTH_NODES = {"ann": 10.0}
BOTH_IDLE = 10.0
BOTH_TOTAL = 20.0


def test_report_merges_every_ledger_flag(two_nodes: Path) -> None:
    a, b = two_nodes / "gpu-node-01.db", two_nodes / "gpu-node-02.db"
    document = report_json(a, b)  # two --ledger flags: the first used to be dropped
    assert dollars_by_user(document) == pytest.approx(BOTH_NODES, rel=1e-9)
    assert document["idle"]["dollars"] == pytest.approx(BOTH_IDLE, rel=1e-9)
    assert document["total"]["dollars"] == pytest.approx(BOTH_TOTAL, rel=1e-9)
    # 2 nodes x 2 GPUs x 2 h = 8 GPU-hours: ann's 2 x 2 h charged as sole holder, 2 x 2 h idle
    assert document["total"]["gpu_hours_charged"] == pytest.approx(8.0)
    by_node = report_json(a, b, by="node")
    assert {r["node"]: r["dollars"] for r in by_node["rows"]} == pytest.approx(
        {"gpu-node-01": 5.0, "gpu-node-02": 5.0}, rel=1e-9
    )
    table = gpuledger("report", "--ledger", str(a), "--ledger", str(b), "--by", "user")
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0] == (
        "GPU cost by user; ledger hours 2026-11-20T18:00:00Z to 2026-11-20T20:00:00Z from 2 ledgers"
    )


def test_report_reads_every_ledger_of_a_directory_once(two_nodes: Path) -> None:
    (two_nodes / "notes.txt").write_text("not a ledger, and not *.db: not read")
    document = report_json(two_nodes)
    assert dollars_by_user(document) == pytest.approx(BOTH_NODES, rel=1e-9)
    assert document["total"]["dollars"] == pytest.approx(BOTH_TOTAL, rel=1e-9)
    # The directory and one of its files: that file is read once.
    again = report_json(two_nodes, two_nodes / "gpu-node-01.db")
    assert again["total"]["dollars"] == pytest.approx(BOTH_TOTAL, rel=1e-9)


def test_an_empty_ledger_path_is_refused_not_read_as_the_working_directory(
    two_nodes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `--ledger "$LEDGER"` with LEDGER unset: Path("") is ".", and every *.db here was reported.
    monkeypatch.chdir(two_nodes)
    with pytest.raises(ValueError, match=r"^an empty path names no ledger file$"):
        ledger_files([""])
    assert len(ledger_files(["."])) == 2  # the directory named as such is still read


def test_a_ledger_copied_twice_is_refused(two_nodes: Path) -> None:
    a = two_nodes / "gpu-node-01.db"
    copy = two_nodes.parent / "gpu-node-01-backup.db"
    shutil.copyfile(a, copy)
    result = report("--ledger", str(two_nodes), "--ledger", str(copy))
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        f"gpuledger: report: {a} and {copy} both record node gpu-node-01 from 2026-11-20T18:00:00Z to "
        "2026-11-20T20:00:00Z (copies of one ledger): reading both would count that time twice"
    )
    assert result.stdout == ""


def test_one_simulation_written_to_two_files_is_refused(tmp_path: Path, files: dict[str, Path]) -> None:
    first, second = tmp_path / "first.db", tmp_path / "second.db"
    for ledger in (first, second):
        assert simulate(files, ledger).returncode == 0
    result = report("--ledger", str(first), "--ledger", str(second))
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        f"gpuledger: report: {first} and {second} both record node gpu-node-01 from 2026-11-20T18:00:00Z to "
        "2026-11-20T20:00:00Z: reading both would count that time twice"
    )


def test_one_nodes_successive_ledgers_are_merged(tmp_path: Path, files: dict[str, Path]) -> None:
    # 18:00-20:00 in one file, 20:00-22:00 in the next (a ledger rotated, or moved aside as
    # corrupt): periods that touch are not an overlap.
    early, late = tmp_path / "early.db", tmp_path / "late.db"
    assert simulate(files, early).returncode == 0
    assert simulate(files, late, node="gpu-node-01-later").returncode == 0
    assert read_info(late).first_at == read_info(early).last_at == START + 2 * H
    document = report_json(early, late)
    # ann: 4 h x $2.50 = $10.00; GPU 1 idle for 4 h = $10.00
    assert dollars_by_user(document) == pytest.approx({"ann": 10.0}, rel=1e-9)
    assert document["idle"]["dollars"] == pytest.approx(10.0, rel=1e-9)
    assert (document["since"], document["until"]) == ("2026-11-20T18:00:00Z", "2026-11-20T22:00:00Z")


def test_report_names_what_it_cannot_find(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = tmp_path / "missing.db"
    for target, message in (
        (empty, f"gpuledger: --ledger: no *.db ledger files in directory {empty}"),
        (missing, f"gpuledger: --ledger: no such ledger file {missing}"),
    ):
        result = report("--ledger", str(target))
        assert (result.returncode, one_line(result.stderr)) == (2, message)
