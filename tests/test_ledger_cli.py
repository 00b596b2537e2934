"""The ledger through the command line, on real files and real subprocesses: `simulate` refuses
a ledger that already holds charges unless --append, and one it cannot write, before it
simulates anything; `report` merges several ledgers (files or directories) and refuses to
count one node's time twice."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agent.ledger.store import Ledger, read_info
from tests.test_cli import gpuledger

H = 3600.0
START = 1_795_197_600.0  # 2026-11-20T18:00:00Z, the scenarios' start

# Two GPUs at $2.50 an hour: ann's job holds GPU 0 throughout, GPU 1 is idle.
SCENARIO = """
start: 2026-11-20T18:00:00Z
node: {hostname: %(node)s}
gpus:
  - {model: A100-SXM4-80GB, count: 2}
processes:
  - {pid: 4101, gpus: [0], sm_util: 50, memory_mib: 1000, uid: 1001, user: ann, cmdline: "python train.py"}
"""
CONFIG = "pricing: {gpu_hourly: 2.5}\n"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """A scenario per node name and the config that prices them."""
    out = {"config": tmp_path / "gpuledger.yml"}
    out["config"].write_text(CONFIG)
    for node in ("gpu-node-01", "gpu-node-02"):
        out[node] = tmp_path / f"{node}.yaml"
        out[node].write_text(SCENARIO % {"node": node})
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

    appended = simulate(files, ledger, "--append")
    assert appended.returncode == 0, appended.stderr
    # What --append asks for: the same two hours once more, $5.00 + $5.00 each for ann and idle.
    twice = report_json(ledger)
    assert dollars_by_user(twice) == pytest.approx({"ann": 10.0}, rel=1e-9)
    assert twice["total"]["dollars"] == pytest.approx(20.0, rel=1e-9)


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
