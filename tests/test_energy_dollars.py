"""Energy dollars are priced once, by accounting, and /metrics, the ledger and `report` show the
same figure: a case worked by hand, through the whole pipeline on a fake node."""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

import fake_nvml
from agent.ledger.report import render, report_from_ledger
from agent.ledger.sink import LedgerSink
from agent.model import AgentState, Price, Workload
from agent.pipeline import Costing
from exporters.prometheus import make_registry
from tests.helpers import Rig
from tests.test_cli import gpuledger

# One A100 from 18:00 UTC for an hour, ann's process keeping it 50% busy: the fake's power is
# idle + (limit - idle) x utilization = 100 + 300 x 0.5 = 250 W, so the energy counter grows
# 250 W x 3600 s = 900 kJ = 0.25 kWh, all of it ann's (she is the only holder). At $0.20/kWh
# that is 0.25 x 0.20 = $0.05, and nothing is idle.
SCENARIO = {
    "start": "2026-11-20T18:00:00Z",
    "gpus": [{"model": "A100-SXM4-80GB", "power_limit_w": 400, "idle_power_w": 100}],
    "processes": [{"pid": 1, "gpus": [0], "sm_util": 50, "memory_mib": 1000, "uid": 1001, "user": "ann"}],
}
PER_KWH = 0.20
KWH = 250 * 3600 / 3.6e6  # 0.25
DOLLARS = KWH * PER_KWH  # 0.05
ANN = Workload(user="ann")


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    fake_nvml.uninstall()


def run_an_hour(scenario: dict[str, object], path: Path) -> AgentState:
    """The pipeline on `scenario`, polling every minute over the hour at $3.60 per GPU-hour and
    PER_KWH, writing its charges to the ledger at `path`."""
    sink = LedgerSink(path, retention_s=None)
    costing = Costing(prices=lambda s: {g.uuid: Price(3.6, "test") for g in s.gpus}, energy_per_kwh=PER_KWH, sink=sink)
    rig = Rig(scenario, costing=costing)
    try:
        return rig.run(3600, 60)
    finally:
        rig.close()
        sink.close()


@pytest.fixture
def an_hour(tmp_path: Path) -> tuple[AgentState, Path]:
    """SCENARIO's hour, and its ledger."""
    path = tmp_path / "ledger.db"
    return run_an_hour(SCENARIO, path), path


def test_metrics_ledger_and_report_show_the_same_energy_dollars(an_hour: tuple[AgentState, Path]) -> None:
    state, path = an_hour
    assert state.snapshot is not None
    uuid = state.snapshot.gpus[0].uuid
    registry = make_registry(lambda: state)
    device = {"gpu": "0", "uuid": uuid}
    metrics_workload = registry.get_sample_value(
        "gpuledger_workload_energy_cost_dollars_total", device | ANN.label_dict()
    )
    metrics_gpu = registry.get_sample_value("gpuledger_gpu_energy_cost_dollars_total", device)
    assert registry.get_sample_value("gpuledger_workload_energy_joules_total", device | ANN.label_dict()) == (
        pytest.approx(900_000, rel=1e-12)
    )

    with closing(sqlite3.connect(path)) as conn, conn:
        ((ledger_workload, hours),) = conn.execute("SELECT SUM(energy_dollars), COUNT(*) FROM workload_hours")
        ((ledger_gpu, ledger_idle),) = conn.execute("SELECT energy_dollars, idle_energy_dollars FROM gpu_hours")
    assert hours == 1  # 18:00 to 19:00: one ledger hour

    report = report_from_ledger(path, by=["user"])
    (line,) = report.lines
    assert line.key == ("ann",)
    result = gpuledger("report", "--ledger", str(path), "--by", "user", "--format", "json")
    assert result.returncode == 0, result.stderr
    as_json = json.loads(result.stdout)

    # The ledger and report add up sixty one-minute charges, /metrics prices the hour's joules:
    # the same figure, to rounding.
    for figure in (metrics_workload, metrics_gpu, ledger_workload, ledger_gpu, line.energy_dollars):
        assert figure == pytest.approx(DOLLARS, rel=1e-12)
    assert line.energy_dollars == ledger_workload  # report sums the ledger's own figures
    assert as_json["rows"][0]["energy_dollars"] == line.energy_dollars
    assert as_json["rows"][0]["energy_kwh"] == pytest.approx(KWH, rel=1e-12)
    assert ledger_idle == 0.0
    assert report.idle.energy_dollars is None  # no idle hour: no idle row to price
    assert report.total.energy_dollars == pytest.approx(DOLLARS, rel=1e-12)
    assert math.isclose(report.total.energy_kwh, KWH, rel_tol=1e-12)


def test_the_table_shows_energy_columns_when_there_is_energy_and_a_price(an_hour: tuple[AgentState, Path]) -> None:
    _, path = an_hour
    table = render(report_from_ledger(path, by=["user"]), "table").splitlines()
    assert table[2].endswith("ENERGY KWH  ENERGY $")
    # ann: $3.60 (an hour at $3.60/h), 1 GPU-hour charged (the sole holder), 0.5 used, waste
    # $3.60 x (1 - 0.5) = $1.80, 0.25 kWh and $0.05 of it
    assert table[4].split() == ["ann", "3.60", "1.00", "0.50", "50.0%", "1.80", "0.25", "0.05"]


# ann's GPU has no energy counter (the driver answers NOT_SUPPORTED); a second A100 beside it,
# held by nobody, has one that reads 0 J all hour (its idle power is 0 W).
NO_COUNTER = {
    **SCENARIO,
    "gpus": [*SCENARIO["gpus"], {"model": "A100-SXM4-80GB", "idle_power_w": 0}],  # type: ignore[list-item]
    "faults": [{"gpu": 0, "call": "nvmlDeviceGetTotalEnergyConsumption", "error": "NOT_SUPPORTED"}],
}


def test_energy_no_counter_measured_is_unknown_and_a_counter_at_0_joules_is_0(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    state = run_an_hour(NO_COUNTER, path)
    assert state.snapshot is not None
    ann_gpu, idle_gpu = ({"gpu": str(g.index), "uuid": g.uuid} for g in state.snapshot.gpus)
    registry = make_registry(lambda: state)
    # No series for energy nothing measured, rather than 0 J and $0.00.
    for name in ("gpuledger_workload_energy_joules_total", "gpuledger_workload_energy_cost_dollars_total"):
        assert registry.get_sample_value(name, ann_gpu | ANN.label_dict()) is None
    for name in ("gpuledger_gpu_idle_energy_joules_total", "gpuledger_gpu_energy_cost_dollars_total"):
        assert registry.get_sample_value(name, ann_gpu) is None
        assert registry.get_sample_value(name, idle_gpu) == 0.0  # measured: 0 W x 3600 s = 0 J, $0.00
    with closing(sqlite3.connect(path)) as conn, conn:
        assert conn.execute("SELECT joules, energy_dollars FROM workload_hours").fetchall() == [(None, None)]
        assert conn.execute("SELECT gpu, joules, idle_joules FROM gpu_hours ORDER BY gpu").fetchall() == [
            (0, None, None),
            (1, 0.0, 0.0),
        ]
    result = gpuledger("report", "--ledger", str(path), "--by", "user", "--format", "json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    # ann: an hour at $3.60, energy unknown; the idle GPU: an hour at $3.60, 0 kWh at $0.20 = $0.00.
    (ann,) = document["rows"]
    assert (ann["dollars"], ann["energy_kwh"], ann["energy_dollars"]) == (pytest.approx(3.6, rel=1e-12), None, None)
    idle = document["idle"]
    assert (idle["dollars"], idle["energy_kwh"], idle["energy_dollars"]) == (pytest.approx(3.6, rel=1e-12), 0.0, 0.0)
    # TOTAL's energy is what the counters measured; its dollars are all the GPU time: 2 x $3.60.
    total = document["total"]
    assert (total["dollars"], total["energy_kwh"]) == (pytest.approx(7.2, rel=1e-12), 0.0)
