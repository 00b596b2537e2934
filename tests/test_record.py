"""Record and replay: `gpuledger record` writes what the driver said as a scenario, and the fake
replaying it gives the metrics the recorded node gave, series for series.

The round trip records a node that exercises every part of a trace (readings that change, GPM
activity per GPU and per MIG instance, processes that start, end and change their load and
memory, pods, Slurm jobs, a container, an allocation without a process, an Xid and an ECC event,
a GPU that is lost and comes back, a reading the GPU does not have, a failing process list),
replays it, and compares the two agents' expositions at every poll.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import fake_nvml
from agent.cli.record import build_recording_agent, record, write_trace
from agent.cli.wiring import build_agent
from agent.config import PricingConfig, ReadingsConfig, Settings

STEP_S = 5.0
DURATION_S = 600.0

NODE: dict[str, Any] = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "trace-node", "driver_version": "550.54.15"},
    "gpus": [
        {"model": "A100-SXM4-80GB", "count": 2, "nvlink_links": 4},
        {"model": "H100-SXM5-80GB", "nvlink_links": 4},
        {"model": "H100-SXM5-80GB", "mig": ["3g.40gb", "3g.40gb"]},
    ],
    "processes": [
        {
            "pid": 4101,
            "gpus": [0],
            "sm_util": [
                {"at": "0s", "sm_util": 92},
                {"at": "2m13s", "sm_util": 41, "memory_mib": 42000},
                {"at": "5m", "sm_util": 0},
                {"at": "5m40s", "sm_util": 77},
            ],
            "memory_mib": 61000,
            "uid": 1001,
            "user": "alice",
            "cmdline": "torchrun --nproc_per_node 4 train.py --model llama-3-8b --token=secret123",
            "environ": {"SLURM_JOB_ID": "8812", "HF_TOKEN": "never-recorded"},
            "slurm_job": "8812",
        },
        {
            "pid": 5200,
            "gpus": [1],
            "start": "1m30s",
            "end": "7m",
            "sm_util": 40,
            "memory_mib": 20000,
            "cmdline": "vllm serve meta-llama/Llama-3.1-8B-Instruct",
            "pod": {"namespace": "serving", "name": "vllm-0", "container": "vllm"},
        },
        {
            "pid": 6310,
            "gpus": [1],
            "sm_util": 20,
            "memory_mib": 6000,
            "uid": 1002,
            "user": "carol",
            "cmdline": "python embed.py --model BAAI/bge-large-en-v1.5",
            "container_id": "9f2b7c1d4e5a6b8c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c",
        },
        {
            "pid": 7000,
            "gpus": [2],
            "sm_util": 100,
            "sm_active": 25,
            "tensor": 80,
            "memory_mib": 30000,
            "cmdline": "python bursty.py",
            "pod": {"namespace": "research", "name": "tensor-1", "container": "main"},
        },
        {"pid": 8000, "gpus": ["3:0"], "sm_util": 70, "sm_active": 35, "memory_mib": 20000, "slurm_job": "9001"},
        {"pid": 8001, "gpus": ["3:1"], "sm_util": 0, "memory_mib": 8000, "start": "2m", "cmdline": "python nb.py"},
    ],
    "allocations": [
        {"gpus": [1], "pod": {"namespace": "serving", "name": "vllm-0", "container": "vllm"}, "end": "8m"},
    ],
    "faults": [
        {"at": "3m", "gpu": 0, "xid": 48},
        {"at": "4m", "gpu": 2, "event": "single_bit_ecc"},
        {"at": "6m", "gpu": 1, "xid": 79},
        {"at": "6m", "until": "7m30s", "gpu": 1, "error": "GPU_IS_LOST"},
        {"gpu": 0, "call": "nvmlDeviceGetTemperature", "error": "NOT_SUPPORTED"},
        {"at": "2m", "until": "3m", "gpu": 0, "nvlink_down": [1]},
        {"at": "8m", "until": "8m10s", "gpu": 2, "call": "nvmlDeviceGetComputeRunningProcesses", "error": "TIMEOUT"},
    ],
}


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    fake_nvml.uninstall()


def settings() -> Settings:
    # Health readings off: a trace does not carry them yet (the README says so); a replay serves
    # the fake's own physics for them, which follows its load model, not the recorded node.
    return Settings(
        node_name=None,
        pricing=PricingConfig(gpu_hourly=3.0, energy_per_kwh=0.12),
        readings=ReadingsConfig(
            clocks=False,
            fan=False,
            throttle=False,
            memory_errors=False,
            pcie=False,
            nvlink_errors=False,
            nvlink_throughput=False,
            codecs=False,
            memory_utilization=False,
        ),
    )


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def series(text: str) -> Series:
    found: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, frozenset(s.labels.items()))] = s.value
    return found


def same(a: Series, b: Series) -> list[str]:
    """What differs between two expositions: a series one has and the other lacks, or a value
    that differs beyond the last bits of a double (GPM percent -> ratio -> percent)."""
    problems = [f"only recorded: {key}" for key in a.keys() - b.keys()]
    problems += [f"only replayed: {key}" for key in b.keys() - a.keys()]
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if not (x == y or (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)):
            problems.append(f"{key}: recorded {x!r}, replayed {y!r}")
    return sorted(problems)


def record_node(scenario: Any, keep_cmdlines: bool = True) -> tuple[dict[str, Any], list[str]]:
    """Record `scenario` for 10 minutes; the trace, and the exposition at each poll."""
    agent, tap = build_recording_agent(settings(), scenario, STEP_S, monotonic=lambda: 0.0)
    texts: list[str] = []
    try:
        trace = record(
            agent,
            tap,
            DURATION_S,
            STEP_S,
            keep_cmdlines=keep_cmdlines,
            on_poll=lambda state: texts.append(agent.exposition(state).decode()),
        )
    finally:
        agent.close()
    return trace, texts


def replayed_texts(trace: Any) -> list[str]:
    agent = build_agent(settings(), fake=trace, poll_interval_s=STEP_S, monotonic=lambda: 0.0)
    assert agent.node is not None
    texts = []
    try:
        for k in range(int(DURATION_S // STEP_S) + 1):
            if k:
                agent.node.clock.advance(STEP_S)
            agent.pipeline.refresh_allocations()
            texts.append(agent.exposition(agent.pipeline.poll_once()).decode())
    finally:
        agent.close()
    return texts


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    trace, texts = record_node(NODE)
    path = tmp_path_factory.mktemp("trace") / "trace.yaml"
    write_trace(trace, str(path), "# test trace\n")
    fake_nvml.uninstall()
    return path, texts


def test_a_replayed_trace_gives_every_series_the_recorded_node_gave_at_every_poll(
    recorded: tuple[Path, list[str]],
) -> None:
    path, texts = recorded
    replayed = replayed_texts(str(path))
    assert len(replayed) == len(texts) == 121
    for k, (original, again) in enumerate(zip(texts, replayed, strict=True)):
        problems = same(series(original), series(again))
        assert not problems, f"poll {k} (t={k * STEP_S:g}s): " + "\n".join(problems[:20])
    # The comparison had something to compare: the whole node, events, GPM and costs included.
    last = series(texts[-1])
    names = {name for name, _ in last}
    for name in (
        "gpuledger_gpu_xid_errors_total",
        "gpuledger_gpu_events_total",
        "gpuledger_gpu_sm_active_ratio",
        "gpuledger_mig_sm_active_ratio",
        "gpuledger_workload_gpu_busy_seconds_total",
        "gpuledger_workload_cost_dollars_total",
        "gpuledger_gpu_unobserved_seconds_total",
        "gpuledger_nvml_errors_total",
        "gpuledger_workload_gpu_allocated",
    ):
        assert name in names, name


def test_the_trace_is_a_scenario_with_readings_as_time_series(recorded: tuple[Path, list[str]]) -> None:
    path, _ = recorded
    trace = yaml.safe_load(path.read_text())
    loaded = fake_nvml.load_scenario(str(path))
    assert [g.model for g in loaded.gpus] == ["A100-SXM4-80GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H100-SXM5-80GB"]
    assert len(loaded.gpus[0].readings) == 121  # one row per poll
    # GPU 0's readings: its load fell at 2m13s (the poll at 2m15s reads 41%), memory likewise.
    rows = {row["at"]: row for row in trace["gpus"][0]["readings"]}
    assert rows[130]["utilization"] == 92
    assert rows[135]["utilization"] == 41
    assert rows[135]["memory_used_mib"] == 42000
    assert "temperature_c" not in rows[135]  # the GPU has no temperature reading
    assert rows[120]["nvlink_down"] == [1]
    # GPM activity of the interval that starts at the row, per MIG instance too.
    assert trace["gpus"][2]["readings"][0]["sm_active"] == 25
    assert trace["gpus"][3]["readings"][0]["migs"][0]["sm_active"] == 35
    faults = trace["faults"]
    assert {"at": 180, "gpu": 0, "xid": 48} in faults
    assert {"at": 240, "gpu": 2, "event": "single_bit_ecc"} in faults
    # Lost from 6m: the last call that failed was the sampler's retry at 7m15s (it backs off), the
    # next that asked, the event reader's at 7m30s, succeeded. The fault spans the failures.
    lost = [f for f in faults if f.get("error") == "GPU_IS_LOST"]
    assert lost == [{"at": 360, "until": 440, "gpu": 1, "error": "GPU_IS_LOST"}]
    # The pod's process, with its lifetime: it started at 1m30s, and ended (at 7m) while its GPU
    # was lost, so the trace ends it at the earliest it may have: the poll after the last that
    # listed it (6m). The allocation holds the GPU for the pod through the rest.
    vllm = next(p for p in trace["processes"] if p["pid"] == 5200)
    assert (vllm["start"], vllm["end"]) == (90, 360)
    assert vllm["pod"]["name"] == "vllm-0"
    assert any(a.get("pod", {}).get("name") == "vllm-0" for a in trace.get("allocations", []))


def test_command_lines_are_anonymised_unless_kept_and_environments_never_recorded() -> None:
    trace, texts = record_node(NODE, keep_cmdlines=False)
    text = yaml.safe_dump(trace)
    by_pid = {p["pid"]: p for p in trace["processes"]}
    assert by_pid[4101]["cmdline"] == "torchrun --model llama-3-8b"  # the executable and its model
    assert by_pid[5200]["cmdline"] == "vllm --model meta-llama/Llama-3.1-8B-Instruct"
    assert "secret123" not in text
    assert "never-recorded" not in text
    assert "environ" not in text
    # What is left is what the labels need: the anonymised trace replays to the same series.
    assert not same(series(texts[-1]), series(replayed_texts(trace)[-1]))
    kept, _ = record_node(NODE, keep_cmdlines=True)
    assert next(p for p in kept["processes"] if p["pid"] == 4101)["cmdline"].endswith("--token=secret123")
    assert "never-recorded" not in yaml.safe_dump(kept)


def test_record_command_writes_a_trace_that_simulate_replays(tmp_path: Path) -> None:
    out = tmp_path / "demo-trace.yaml"
    env_path = str(Path(__file__).resolve().parent.parent)
    run = [sys.executable, "-m", "agent"]
    env = {"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}
    recorded = subprocess.run(
        [*run, "record", "--fake", "--for", "1m", "--step", "5s", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert recorded.returncode == 0, recorded.stderr
    assert "recorded 13 polls of 8 GPU(s)" in recorded.stderr
    assert out.read_text().startswith("# Recorded by gpuledger record from fake node 'demo'")
    metrics = tmp_path / "replayed.prom"
    replayed = subprocess.run(
        [*run, "simulate", str(out), "--for", "1m", "--step", "5s", "--metrics-out", str(metrics)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    assert 'gpuledger_gpu_utilization_ratio{gpu="0"' in metrics.read_text()
    bad = subprocess.run(
        [*run, "record", "--fake", "--for", "5s", "--step", "10s"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "--step: 10s is longer than --for 5s" in bad.stderr


@pytest.mark.parametrize(
    ("gpu", "message"),
    [
        ({"count": 2, "readings": [{"at": 0}]}, r"gpus\[0\]\.count: uuid, pci_bus_id and readings belong to one GPU"),
        ({"readings": [{"at": 5}, {"at": 5}]}, r"gpus\[0\]\.readings\[1\]\.at: rows must be in time order"),
        ({"readings": [{"utilization": 5}]}, r"gpus\[0\]\.readings\[0\]\.at: required"),
        ({"nvlink_links": 2, "readings": [{"at": 0, "nvlink_down": [2]}]}, r"nvlink_down: expected links of this GPU"),
        ({"readings": [{"at": 0, "migs": [{"sm_active": 5}]}]}, r"readings\[0\]\.migs: the GPU has 0 MIG instance"),
        ({"readings": [{"at": 0, "sm_active": 120}]}, r"readings\[0\]\.sm_active: must be 0\.\.100"),
    ],
)
def test_a_bad_readings_series_fails_at_load_naming_the_row(gpu: dict[str, Any], message: str) -> None:
    with pytest.raises(fake_nvml.ScenarioError, match=message):
        fake_nvml.load_scenario({"gpus": [gpu]})


def test_a_readings_series_stands_in_for_the_fakes_physics_from_its_first_row() -> None:
    import pynvml

    rows = [{"at": 60, "utilization": 37, "power_w": 123.456, "energy_j": 5000.001, "temperature_c": 41}]
    node = fake_nvml.install({"gpus": [{"readings": rows}], "processes": [{"pid": 1, "gpus": [0], "sm_util": 90}]})
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetUtilizationRates(handle).gpu == 90  # before the first row: physics
    node.clock.advance(60)
    assert pynvml.nvmlDeviceGetUtilizationRates(handle).gpu == 37
    assert pynvml.nvmlDeviceGetPowerUsage(handle) == 123456  # mW, exactly
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) == 5000001  # mJ, exactly
    assert pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == 41
