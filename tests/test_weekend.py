"""The idle weekend, end to end: flags at the right moments, and the ledger's dollars to match.
Also: `report` on a week of the demo node agrees with the exporter's counters in every format."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.config import load_catalogue
from tests.helpers import WeekendIdleRun
from tests.test_cli import gpuledger as cli

REPO = Path(__file__).resolve().parent.parent
HOUR = 3600.0
# p4de.24xlarge (8 x A100 80GB) from the shipped catalogue, per GPU: what the weekend-idle node's GPUs cost.
P4DE = load_catalogue().instance_types["p4de.24xlarge"]
PRICE = P4DE.dollars_per_hour / P4DE.gpus


def gpuledger(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return cli(*args, env=env, timeout=600)


# The weekend's simulation is a session fixture: on one xdist worker (--dist loadgroup), it runs once.
@pytest.mark.xdist_group("weekend-idle")
def test_the_idle_weekend_is_flagged_and_priced(weekend_idle: WeekendIdleRun) -> None:
    ledger_path = weekend_idle.ledger_path
    transitions = weekend_idle.idle_transitions
    state = weekend_idle.last
    raised = sorted({t for t, _gpu, up in transitions if up})
    cleared = sorted({t for t, _gpu, up in transitions if not up})
    # The job dies at 4 h (Friday 22:00). The rules judge each poll's interval: the poll at 4 h
    # measures the minute before, when the job still ran, so the first poll that sees its GPUs
    # idle is at 4 h 1 min; `idle` raises on all eight 30 minutes later, stays up all weekend,
    # and clears at the first poll after Monday's job starts at 63 h (Monday 09:00): nobody-holds
    # is false from then.
    assert raised == [4 * HOUR + 60 + 1800]
    assert cleared == [63 * HOUR]
    assert sorted(gpu for _t, gpu, up in transitions if up) == list(range(8))
    assert not any(f.raised for f in state.flags if f.rule == "idle")  # Monday: busy again

    # The ledger: over Saturday and Sunday (2026-11-21T00:00Z to 11-23T00:00Z) all 8 GPUs sat
    # idle, 48 h each.
    result = gpuledger(
        "report", "--ledger", str(ledger_path), "--by", "job", "--format", "json",
        "--since", "2026-11-21T00:00", "--until", "2026-11-23T00:00",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["idle"]["dollars"] == pytest.approx(PRICE * 8 * 48, rel=1e-9)
    assert report["idle"]["gpu_hours_charged"] == pytest.approx(8 * 48)  # 8 GPUs x 48 h, all idle
    assert report["total"]["gpu_hours_charged"] == pytest.approx(8 * 48)  # GPUs x hours, not more
    assert report["rows"] == []  # nobody held a GPU all weekend
    whole = json.loads(gpuledger("report", "--ledger", str(ledger_path), "--by", "job", "--format", "json").stdout)
    # Friday 22:00 to Monday 09:00 is 59 idle hours on each GPU. Polled every minute then: job 9001's
    # end (22:00, unknown to NVML) is booked at the midpoint of 21:59-22:00, so its GPUs idle from
    # 21:59:30; job 9107's start is known (procfs: 09:00) and charged from then. 59 h + 30 s.
    assert whole["idle"]["dollars"] == pytest.approx(PRICE * 8 * (59 + 30 / 3600), rel=1e-9)
    # All of it left idle by job 9001.
    [left] = whole["idle"]["left_by"]
    assert (left["workload"]["hpc_job"], left["dollars"]) == ("9001", pytest.approx(whole["idle"]["dollars"]))


def prom_values(text: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    return sums


def test_report_on_a_week_of_the_demo_node_matches_the_counters(tmp_path: Path) -> None:
    ledger, metrics = tmp_path / "demo.db", tmp_path / "demo.prom"
    # Polled every 15 minutes; max_interval 1h, so that no interval is left unobserved.
    sim = gpuledger(
        "simulate", "demo", "--for", "7d", "--step", "15m", "--ledger", str(ledger), "--metrics-out", str(metrics),
        env={"GPULEDGER_ACCOUNTING__MAX_INTERVAL": "1h"},
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    counters = prom_values(metrics.read_text())
    total = counters["gpuledger_gpu_cost_dollars_total"]
    assert total == pytest.approx(PRICE * 8 * 7 * 24, rel=1e-9)  # 8 GPUs, a week, every hour priced
    workloads, idle = (
        counters["gpuledger_workload_cost_dollars_total"],
        counters["gpuledger_gpu_idle_cost_dollars_total"],
    )
    assert workloads + idle == pytest.approx(total, rel=1e-9)

    reports: dict[str, Any] = {}
    for fmt in ("table", "csv", "json"):
        result = gpuledger("report", "--ledger", str(ledger), "--by", "namespace,pod,job", "--format", fmt)
        assert result.returncode == 0, result.stderr
        reports[fmt] = result.stdout
    as_json = json.loads(reports["json"])
    assert as_json["total"]["dollars"] == pytest.approx(total, rel=1e-9)
    assert as_json["idle"]["dollars"] == pytest.approx(idle, rel=1e-9)
    assert sum(row["dollars"] for row in as_json["rows"]) == pytest.approx(workloads, rel=1e-9)
    # GPU 4 is shared (vllm and an embedding container): held hours count it twice, charged hours
    # once, so the rows add up to 8 GPUs x 168 h = 1344 GPU-hours, as the counters do.
    week_s = 8 * 7 * 24 * HOUR
    charged_s = counters["gpuledger_workload_gpu_charged_seconds_total"]
    assert charged_s + counters["gpuledger_gpu_idle_seconds_total"] == pytest.approx(week_s, rel=1e-9)
    assert sum(row["gpu_hours_charged"] for row in as_json["rows"]) == pytest.approx(charged_s / HOUR, rel=1e-9)
    assert as_json["total"]["gpu_hours_charged"] == pytest.approx(week_s / HOUR, rel=1e-9)
    assert as_json["unobserved"]["gpu_hours_charged"] == 0.0  # every poll 15 min apart, within 1h: all observed
    rows = list(csv.DictReader(io.StringIO(reports["csv"])))
    assert float(next(r for r in rows if r["kind"] == "total")["dollars"]) == pytest.approx(total, rel=1e-9)
    assert float(next(r for r in rows if r["kind"] == "idle")["dollars"]) == pytest.approx(idle, rel=1e-9)
    total_line = next(line for line in reports["table"].splitlines() if line.startswith("TOTAL"))
    shown = float(next(cell for cell in total_line.split()[1:] if "." in cell).replace(",", ""))
    assert shown == pytest.approx(total, abs=0.005)  # the table rounds to cents
