"""`gpuledger report --by hpc_job|pod --runs`: what a training run cost, and when and on how
many GPUs it ran. Dollars per run are the report's own (`--by hpc_job` gives them); `--runs`
adds the first and last hour each run was charged in and the GPUs it was charged for."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from agent.ledger.read import UsageRow
from agent.ledger.report import build_report, render
from agent.model import Workload
from tests.test_cli import gpuledger

# One worker runs this module, so its ledger, a module fixture, is built once rather than once per
# xdist worker (pyproject: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("report_runs")

T0 = 1_795_197_600.0  # 2026-11-20T18:00:00Z, the scenario's start
H = 3600.0

# 4 GPUs at $2/h. Slurm job 501 runs on GPUs 0-1 from 19:00 to 21:00 at 90%; pod ml/trainer-0
# on GPU 2 from 18:30 to 20:30 at 50%.
SCENARIO = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "runs-node"},
    "gpus": [{"model": "A100-SXM4-80GB", "count": 4}],
    "processes": [
        {
            "pid": 100,
            "gpus": [0, 1],
            "start": "1h",
            "end": "3h",
            "sm_util": 90,
            "memory_mib": 1000,
            "uid": 1001,
            "user": "alice",
            "slurm_job": "501",
            "cmdline": "python train.py",
        },
        {
            "pid": 200,
            "gpus": [2],
            "start": "30m",
            "end": "2h30m",
            "sm_util": 50,
            "memory_mib": 1000,
            "uid": 1002,
            "pod": {
                "namespace": "ml",
                "name": "trainer-0",
                "container": "pytorch",
                "uid": "0b6c2f4e-3c1d-4e8a-9f11-2a7d5c9e0b99",
            },
            "cmdline": "python train.py",
        },
    ],
}


@pytest.fixture(scope="module")
def runs_ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("runs")
    scenario, config, ledger = tmp / "runs.yaml", tmp / "config.yaml", tmp / "runs.db"
    scenario.write_text(yaml.safe_dump(SCENARIO), encoding="utf-8")
    config.write_text("pricing: {gpu_hourly: 2.0}\n", encoding="utf-8")
    result = gpuledger(
        "simulate", str(scenario), "--for", "4h", "--step", "60s", "--config", str(config), "--ledger", str(ledger)
    )
    assert result.returncode == 0, result.stderr
    return ledger


def test_each_run_shows_its_cost_its_hours_and_its_gpus(runs_ledger: Path) -> None:
    result = gpuledger("report", "--ledger", str(runs_ledger), "--by", "hpc_job,pod", "--runs", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = {(row["hpc_job"], row["pod"]): row for row in json.loads(result.stdout)["rows"]}
    job, pod = rows[("501", "")], rows[("", "trainer-0")]
    # Job 501 is charged from its process's start, 19:00:00 exactly (procfs gives it), to the
    # midpoint of the minute in which it ended (NVML gives no end time): 20:59:30, 7170 s.
    # 2 GPUs x 7170 s x $2/h = $7.966667, 2 x 7170 / 3600 = 3.983333 GPU-hours.
    assert job["dollars"] == pytest.approx(2 * 7170 * 2.0 / H)
    assert job["gpu_hours_charged"] == pytest.approx(2 * 7170 / H)
    assert (job["first_hour"], job["last_hour"], job["gpus"]) == ("2026-11-20T19:00:00Z", "2026-11-20T20:00:00Z", 2)
    # trainer-0 likewise from 18:30:00 to 20:29:30: 1 GPU x 7170 s x $2/h = $3.983333, from the
    # 18:00 hour to the 20:00 hour.
    assert pod["dollars"] == pytest.approx(1 * 7170 * 2.0 / H)
    assert (pod["first_hour"], pod["last_hour"], pod["gpus"]) == ("2026-11-20T18:00:00Z", "2026-11-20T20:00:00Z", 1)


def test_runs_columns_in_the_table_and_csv_and_only_with_runs(runs_ledger: Path) -> None:
    table = gpuledger("report", "--ledger", str(runs_ledger), "--by", "hpc_job", "--runs").stdout
    header = next(line for line in table.splitlines() if line.startswith("HPC_JOB"))
    assert header.split()[:6] == ["HPC_JOB", "FIRST", "HOUR", "LAST", "HOUR", "GPUS"]
    job = next(line for line in table.splitlines() if line.startswith("501"))
    assert job.split()[1:4] == ["2026-11-20T19:00:00Z", "2026-11-20T20:00:00Z", "2"]

    csv_text = gpuledger("report", "--ledger", str(runs_ledger), "--by", "pod", "--runs", "--format", "csv").stdout
    assert csv_text.splitlines()[0].startswith("kind,namespace,pod,first_hour,last_hour,gpus,dollars,")
    assert "group,ml,trainer-0,2026-11-20T18:00:00Z,2026-11-20T20:00:00Z,1,3.98333" in csv_text
    # The idle, unobserved and total lines are no runs: their run columns stay empty.
    assert any(line.startswith("idle,,,,,,") for line in csv_text.splitlines())

    plain = json.loads(gpuledger("report", "--ledger", str(runs_ledger), "--by", "hpc_job", "--format", "json").stdout)
    assert all("first_hour" not in row and "gpus" not in row for row in plain["rows"])


def test_runs_needs_a_run_key(runs_ledger: Path) -> None:
    result = gpuledger("report", "--ledger", str(runs_ledger), "--by", "team", "--runs")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpuledger: report: --runs: a run is a Slurm job or a pod: group --by hpc_job or --by pod"
    ]


def test_gpus_counts_cost_units_across_nodes_and_mig_instances() -> None:
    """A job on two nodes' GPU 0 and on two MIG instances of one GPU was charged for 4 units;
    hours it did not run in do not stretch its span."""
    job = Workload(hpc_job="77", user="bob")

    def row(hour: float, node: str, gpu: int, uuid: str) -> UsageRow:
        return UsageRow(int(T0 + hour * H), node, gpu, uuid, job, held_s=H, busy_s=H / 2, dollars=1.0, joules=0.0)

    rows = [
        row(1, "node-a", 0, "GPU-a0"),
        row(1, "node-b", 0, "GPU-b0"),
        row(2, "node-b", 1, "MIG-b1-1"),
        row(3, "node-b", 1, "MIG-b1-2"),
    ]
    report = build_report(rows, ["hpc_job"])
    (line,) = report.lines
    assert (line.first_hour, line.last_hour, line.gpus) == (T0 + H, T0 + 3 * H, 4)
    assert line.dollars == 4.0  # four rows of $1
    (shown,) = json.loads(render(replace(report, runs=True), "json"))["rows"]
    assert (shown["first_hour"], shown["last_hour"], shown["gpus"]) == (
        "2026-11-20T19:00:00Z",
        "2026-11-20T21:00:00Z",
        4,
    )
