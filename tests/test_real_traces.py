"""Traces recorded on real GPUs (tests/traces/, scripts/realgpu/) replay what the GPU read.

h200-matmul-bursts.yaml: `gpuledger record --for 80s --step 2s` on an NVIDIA H200 (driver
580.159.04) beside an idle PyTorch process holding 6.7 GiB throughout and another running bf16
matrix products, back to back for 28 s and then in half-second bursts for 30 s; after 60 s only
the idle holder is left. scripts/realgpu/h200-2026-11-27/comparison.md compares the same run
with nvidia-smi and nvitop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.config import PricingConfig, Settings
from tests.helpers import Rig

TRACE = Path(__file__).parent / "traces" / "h200-matmul-bursts.yaml"
STEP_S = 2.0
POLLS = 41  # 0, 2, ... 80 s
PRICE = 3.60  # $/GPU-hour, set here so the dollars are easy to check by hand
MIB = 2**20
GAUGES = (
    "gpuledger_gpu_utilization_ratio",
    "gpuledger_gpu_memory_used_bytes",
    "gpuledger_gpu_memory_total_bytes",
    "gpuledger_gpu_temperature_celsius",
    "gpuledger_gpu_power_watts",
    "gpuledger_gpu_energy_joules_total",
    "gpuledger_gpu_sm_active_ratio",
    "gpuledger_gpu_tensor_active_ratio",
    "gpuledger_gpu_processes",
    "gpuledger_gpu_busy_source_info",
)
COUNTERS = (
    "gpuledger_workload_gpu_busy_seconds_total",
    "gpuledger_workload_gpu_charged_seconds_total",
    "gpuledger_workload_cost_dollars_total",
    "gpuledger_gpu_idle_cost_dollars_total",
    "gpuledger_gpu_unobserved_cost_dollars_total",
)

Polled = list[dict[str, float]]  # per poll: series name -> value (one GPU, one workload)


@pytest.fixture(scope="module")
def trace() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(TRACE.read_text())
    return loaded


@pytest.fixture(scope="module")
def replayed() -> tuple[Polled, dict[str, str]]:
    rig = Rig(str(TRACE), settings=Settings(poll_interval=STEP_S, pricing=PricingConfig(gpu_hourly=PRICE)))
    polled: Polled = []
    labels: dict[str, str] = {}
    try:
        for k in range(POLLS):
            state = rig.poll(STEP_S if k else 0.0)
            values: dict[str, float] = {}
            for name, series_labels, value in rig.samples(state, (*GAUGES, *COUNTERS)):
                if name == "gpuledger_gpu_busy_source_info":
                    labels["busy_source"] = series_labels["source"]
                if name == "gpuledger_workload_gpu_charged_seconds_total":
                    labels["user"] = series_labels["user"]
                values[name] = values.get(name, 0.0) + value
            polled.append(values)
    finally:
        rig.close()
    return polled, labels


def test_every_poll_replays_the_readings_the_h200_gave(trace: dict[str, Any], replayed: tuple[Polled, Any]) -> None:
    polled, _labels = replayed
    rows = trace["gpus"][0]["readings"]
    assert [row["at"] for row in rows] == [k * STEP_S for k in range(POLLS)]
    for k, (row, got) in enumerate(zip(rows, polled, strict=True)):
        assert got["gpuledger_gpu_utilization_ratio"] == row["utilization"] / 100, k
        assert got["gpuledger_gpu_memory_used_bytes"] == round(row["memory_used_mib"] * MIB), k
        assert got["gpuledger_gpu_memory_total_bytes"] == 143771 * MIB
        assert got["gpuledger_gpu_temperature_celsius"] == row["temperature_c"], k
        assert got["gpuledger_gpu_energy_joules_total"] == pytest.approx(row["energy_j"], abs=0.001), k


def test_power_is_the_mean_the_energy_counter_gives(trace: dict[str, Any], replayed: tuple[Polled, Any]) -> None:
    polled, _labels = replayed
    rows = trace["gpus"][0]["readings"]
    # The first poll has no interval: the driver's own (averaged) reading, 691.232 W.
    assert polled[0]["gpuledger_gpu_power_watts"] == rows[0]["power_w"] == 691.232
    for k in range(1, POLLS):
        mean = (rows[k]["energy_j"] - rows[k - 1]["energy_j"]) / STEP_S
        assert polled[k]["gpuledger_gpu_power_watts"] == pytest.approx(mean, abs=0.001), k
        # The H200's own polls were 2 s apart give or take a few ms, so what it read is within
        # half a percent of the mean over exactly 2 s.
        assert polled[k]["gpuledger_gpu_power_watts"] == pytest.approx(rows[k]["power_w"], rel=0.005), k
    # In the bursts (30-58 s) the board drew ~440 W on average; its instant swung between
    # ~125 W and ~780 W (comparison.md), which a poll used to report wherever it landed.
    bursts = [polled[k]["gpuledger_gpu_power_watts"] for k in range(16, 30)]
    assert min(bursts) > 430
    assert max(bursts) < 450


def test_busy_time_follows_gpm_and_the_dollars_add_up(trace: dict[str, Any], replayed: tuple[Polled, Any]) -> None:
    polled, labels = replayed
    rows = trace["gpus"][0]["readings"]
    assert labels == {"busy_source": "gpm", "user": "root"}  # one workload: both processes are root's
    # Each row's GPM figures are the interval that starts at it, which the poll at its end reads.
    for k in range(1, POLLS):
        assert polled[k]["gpuledger_gpu_sm_active_ratio"] == pytest.approx(rows[k - 1]["sm_active"] / 100), k
    # Busy seconds are SM activity x 2 s per interval: 14 intervals of products at ~96%
    # (26.9 s), one half-way (1.4 s), 14 of bursts at ~41% (11.5 s), the last bursts and the
    # tail (0.4 s), then idle: 40.17 s in all.
    busy = sum(row["sm_active"] / 100 * STEP_S for row in rows[:-1])
    assert busy == pytest.approx(40.1658, abs=0.0001)
    assert polled[-1]["gpuledger_workload_gpu_busy_seconds_total"] == pytest.approx(busy)
    # The whole 80 s is charged to the holder's owner: a process held the GPU throughout, so no
    # second of it was idle. 80 s x $3.60 / 3600 s = $0.08.
    assert polled[-1]["gpuledger_workload_gpu_charged_seconds_total"] == pytest.approx(80.0)
    charged = polled[-1]["gpuledger_workload_cost_dollars_total"]
    idle = polled[-1]["gpuledger_gpu_idle_cost_dollars_total"]
    unobserved = polled[-1]["gpuledger_gpu_unobserved_cost_dollars_total"]
    assert charged == pytest.approx(0.08)
    assert (idle, unobserved) == (0.0, 0.0)
    assert charged + idle + unobserved == pytest.approx(PRICE * 80 / 3600)


def test_the_products_process_leaves_at_60_s(trace: dict[str, Any], replayed: tuple[Polled, Any]) -> None:
    polled, _labels = replayed
    # pid 551 (876 MiB, the products) ended between the polls at 58 s and 60 s; the holder (6884
    # MiB) stays.
    assert [polled[k]["gpuledger_gpu_processes"] for k in (0, 29, 30, 40)] == [2, 2, 1, 1]
    assert {p["pid"]: p.get("end") for p in trace["processes"]} == {549: None, 551: 60}
