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
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

import fake_nvml
from agent.cli.record import (
    _Flow,
    _FlowList,
    _styled,
    _TraceDumper,
    build_recording_agent,
    record,
    trace_text,
    write_trace,
)
from agent.cli.wiring import Agent, build_agent
from agent.config import ExportersConfig, PricingConfig, ReadingsConfig, Settings
from agent.devices.tap import tap
from agent.model import AgentState
from tests.test_cli import gpuledger

# One worker runs this module, so the recorded trace, a module fixture, is built once rather than once per
# xdist worker (pyproject: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("record")

STEP_S = 5.0
# libyaml's loader where PyYAML has it: the pure-Python one takes seconds over a recorded trace.
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
DURATION_S = 600.0

NODE: dict[str, Any] = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "trace-node", "driver_version": "550.54.15"},
    "gpus": [
        {"model": "A100-SXM4-80GB", "count": 2, "nvlink_links": 4},
        {"model": "H100-SXM5-80GB", "nvlink_links": 4},
        {"model": "H100-SXM5-80GB", "mig": ["3g.40gb", "3g.40gb"]},
        {"model": "V100-SXM2-32GB"},  # retires pages where later GPUs remap rows
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
        # Hardware trouble, one of each kind, for the health readings to carry.
        {"at": "1m", "until": "4m", "gpu": 0, "ecc": {"corrected": 30, "uncorrected": 1}},
        {"at": "2m", "until": "5m", "gpu": 1, "remap": {"correctable": 2, "uncorrectable": 1}},
        {"at": "3m", "until": "6m", "gpu": 2, "throttle": "hw_thermal"},
        {"at": "1m", "until": "3m", "gpu": 0, "pcie_downgrade": {"generation": 3, "width": 8, "replays": 50}},
        {"at": "1m", "until": "4m", "gpu": 2, "nvlink_errors": {"links": [1], "crc": 90, "replay": 9, "recovery": 1}},
        {"at": "4m", "gpu": 4, "ecc": {"uncorrected": 2}},
    ],
}


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    fake_nvml.uninstall()


def settings() -> Settings:
    # Every reading a poll takes, the opt-in PCIe throughput included: a trace carries them all.
    return Settings(
        node_name=None,
        pricing=PricingConfig(gpu_hourly=3.0, energy_per_kwh=0.12),
        readings=ReadingsConfig(pcie_throughput=True),
    )


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def series(agent: Agent, state: AgentState) -> Series:
    """Every series a scrape of `state` would show, read from the agent's registry (what the
    exposition text is rendered from, without rendering and parsing it)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in agent.registry(lambda: state).collect()
        for s in family.samples
    }


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


def record_node(
    scenario: Any, keep_cmdlines: bool = True, step_s: float = STEP_S, *, every_poll: bool = True
) -> tuple[dict[str, Any], list[Series]]:
    """Record `scenario` for 10 minutes; the trace, and the series at each poll (with
    `every_poll` False, at the last poll only: a test that compares only the end)."""
    agent, tap = build_recording_agent(settings(), scenario, step_s, monotonic=lambda: 0.0)
    polls: list[Series] = []
    last_state: list[AgentState] = []  # without every_poll: the latest poll's, read once recorded

    def on_poll(state: AgentState) -> None:
        if every_poll:
            polls.append(series(agent, state))
        else:
            last_state[:] = [state]

    try:
        trace = record(agent, tap, DURATION_S, step_s, keep_cmdlines=keep_cmdlines, on_poll=on_poll)
        polls += [series(agent, state) for state in last_state]
    finally:
        agent.close()
    return trace, polls


def replayed_series(
    trace: Any,
    with_settings: Settings | None = None,
    duration_s: float = DURATION_S,
    step_s: float = STEP_S,
    *,
    every_poll: bool = True,
) -> list[Series]:
    """`trace` replayed by an agent polling every step_s from 0 to duration_s: each poll's series
    (with `every_poll` False, the last poll's only)."""
    agent = build_agent(with_settings or settings(), fake=trace, poll_interval_s=step_s, monotonic=lambda: 0.0)
    assert agent.node is not None
    polls = []
    try:
        last = int(duration_s // step_s)
        for k in range(last + 1):
            if k:
                agent.node.clock.advance(step_s)
            agent.pipeline.refresh_allocations()
            state = agent.pipeline.poll_once()
            if every_poll or k == last:
                polls.append(series(agent, state))
    finally:
        agent.close()
    return polls


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Series]]:
    trace, polls = record_node(NODE)
    path = tmp_path_factory.mktemp("trace") / "trace.yaml"
    write_trace(trace, str(path), "# test trace\n")
    fake_nvml.uninstall()
    return path, polls


def test_a_replayed_trace_gives_every_series_the_recorded_node_gave_at_every_poll(
    recorded: tuple[Path, list[Series]],
) -> None:
    path, polls = recorded
    replayed = replayed_series(str(path))
    assert len(replayed) == len(polls) == 121
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        problems = same(original, again)
        assert not problems, f"poll {k} (t={k * STEP_S:g}s): " + "\n".join(problems[:20])
    # The comparison had something to compare: the whole node, events, GPM and costs included.
    last = polls[-1]
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
        # The health readings, every group of `readings:`.
        "gpuledger_gpu_sm_clock_hertz",
        "gpuledger_gpu_memory_clock_max_hertz",
        "gpuledger_gpu_performance_state",
        "gpuledger_gpu_clock_event_reason",
        "gpuledger_gpu_clock_violation_seconds_total",
        "gpuledger_gpu_ecc_errors_total",
        "gpuledger_gpu_ecc_aggregate_errors_total",
        "gpuledger_gpu_retired_pages_total",
        "gpuledger_gpu_remapped_rows_total",
        "gpuledger_gpu_row_remap_pending",
        "gpuledger_gpu_pcie_link_generation",
        "gpuledger_gpu_pcie_link_width_max",
        "gpuledger_gpu_pcie_replays_total",
        "gpuledger_gpu_pcie_transmit_bytes_per_second",
        "gpuledger_gpu_nvlink_errors_total",
        "gpuledger_gpu_nvlink_transmit_bytes_total",
        "gpuledger_gpu_encoder_utilization_ratio",
        "gpuledger_gpu_memory_controller_utilization_ratio",
    ):
        assert name in names, name


def test_the_trace_is_written_as_the_pure_python_emitter_writes_it(recorded: tuple[Path, list[Series]]) -> None:
    # The trace is emitted by libyaml (some times faster on a long recording): its text must be
    # the one PyYAML's own emitter gives, so traces do not change with how PyYAML was built.
    path, _ = recorded
    trace = yaml.load(path.read_text(), Loader=LOADER)
    for gpu in trace["gpus"]:  # every kind of row, fewer of each: the pure-Python emitter is slow
        gpu["readings"] = gpu["readings"][:8]

    class PurePython(yaml.SafeDumper):
        pass

    for kind in (_Flow, _FlowList, float):
        PurePython.add_representer(kind, _TraceDumper.yaml_representers[kind])
    text = yaml.dump(_styled(trace), Dumper=PurePython, sort_keys=False, default_flow_style=False, width=120)
    assert _TraceDumper.__mro__[1] is getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    assert trace_text(trace, "# test trace\n") == "# test trace\n" + text


def test_the_trace_is_a_scenario_with_readings_as_time_series(recorded: tuple[Path, list[Series]]) -> None:
    path, _ = recorded
    trace = yaml.load(path.read_text(), Loader=LOADER)
    loaded = fake_nvml.load_scenario(str(path))
    assert [g.model for g in loaded.gpus] == [
        "A100-SXM4-80GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H100-SXM5-80GB", "V100-SXM2-32GB"
    ]  # fmt: skip
    assert len(loaded.gpus[0].readings) == 121  # one row per poll
    # GPU 0's readings: its load fell at 2m13s (the poll at 2m15s reads 41%), memory likewise.
    rows = {row["at"]: row for row in trace["gpus"][0]["readings"]}
    assert rows[130]["utilization"] == 92
    assert rows[135]["utilization"] == 41
    assert rows[135]["memory_used_mib"] == 42000
    assert "temperature_c" not in rows[135]  # the GPU has no temperature reading
    assert rows[120]["nvlink_down"] == [1]
    # Health readings in the driver's units, the slow ones as the poll carried them (read at
    # 2m, the last 30 s mark): PCIe down to Gen3 x8 since 1m with 50 replays spread to 3m,
    # 50 x (120 - 60) / (180 - 60) = 25 by then; 30 corrected errors spread from 1m to 4m,
    # 30 x 60 / 180 = 10 of them.
    assert rows[135]["pcie"] == {
        "generation": 3, "width": 8, "generation_max": 4, "width_max": 16, "replays": 25,
        "tx_kib_s": 898438, "rx_kib_s": 1796875,
    }  # fmt: skip
    ecc = {"corrected": 10, "uncorrected": 0, "corrected_aggregate": 10, "uncorrected_aggregate": 0}
    assert rows[135]["ecc"] == ecc
    assert (rows[135]["sm_clock_mhz"], rows[135]["sm_clock_max_mhz"], rows[135]["performance_state"]) == (1410, 1410, 0)
    assert "retired_pages" not in rows[135]  # an A100 remaps rows instead
    remapped = {row["at"]: row for row in trace["gpus"][1]["readings"]}[135]["remapped_rows"]
    assert remapped == {"correctable": 2, "uncorrectable": 1, "pending": True, "failure": False}
    v100 = {row["at"]: row for row in trace["gpus"][4]["readings"]}
    assert v100[240]["retired_pages"] == {"single_bit": 0, "double_bit": 2, "pending": True}
    assert "remapped_rows" not in v100[240]
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


def test_a_slurm_array_task_replays_as_the_one_job_it_was_recorded_as() -> None:
    # Array task 1234_7 (its own job id 1235, its cgroup's) on GPU 0, and allocated GPU 1 too.
    task: dict[str, Any] = {
        "start": "2026-11-20T18:00:00Z",
        "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
        "processes": [
            {"pid": 800, "gpus": [0], "sm_util": 60, "memory_mib": 1000, "uid": 1010, "user": "alice",
             "cmdline": "python train.py", "cgroup": "/system.slice/slurmstepd.scope/job_1235/step_0/user/task_0"},
        ],
        "allocations": [{"gpus": [0, 1], "slurm_job": "1235=1234_7", "user": "alice"}],
    }  # fmt: skip
    trace, polls = record_node(task)
    fake_nvml.uninstall()
    held = {labels for name, labels in polls[-1] if name == "gpuledger_workload_cost_dollars_total"}
    assert {dict(labels)["hpc_job"] for labels in held} == {"1234_7"}
    replayed = replayed_series(trace)
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        problems = same(original, again)
        assert not problems, f"poll {k} (t={k * STEP_S:g}s): " + "\n".join(problems[:20])


def test_command_lines_are_anonymised_unless_kept_and_environments_never_recorded(
    recorded: tuple[Path, list[Series]],
) -> None:
    trace, polls = record_node(NODE, keep_cmdlines=False, every_poll=False)
    text = yaml.dump(trace, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper))
    by_pid = {p["pid"]: p for p in trace["processes"]}
    assert by_pid[4101]["cmdline"] == "torchrun --model llama-3-8b"  # the executable and its model
    assert by_pid[5200]["cmdline"] == "vllm --model meta-llama/Llama-3.1-8B-Instruct"
    assert "secret123" not in text
    assert "never-recorded" not in text
    assert "environ" not in text
    # What is left is what the labels need: the anonymised trace replays to the same series.
    assert not same(polls[-1], replayed_series(trace, every_poll=False)[-1])
    # The module's trace keeps command lines (record_node's default): kept whole, but scrubbed, as
    # the token went into every kept trace, which is made to be sent on.
    kept_text = recorded[0].read_text()
    kept = yaml.load(kept_text, Loader=LOADER)
    kept_cmdline = next(p for p in kept["processes"] if p["pid"] == 4101)["cmdline"]
    assert kept_cmdline == "torchrun --nproc_per_node 4 train.py --model llama-3-8b '--token=[redacted]'"
    assert "secret123" not in kept_text
    assert "never-recorded" not in kept_text


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


def test_a_process_that_starts_between_polls_without_samples_replays_from_its_start() -> None:
    # A notebook starts at 17 s holding memory at 0%, so the driver keeps no sample of it, and the
    # poll at 20 s is the first to list it. Its procfs start time says 17 s; the trace said 20 s,
    # and the replayed node charged it 3 s less.
    node = {
        "gpus": [{"model": "A100-SXM4-80GB"}],
        "processes": [{"pid": 12, "gpus": [0], "start": "17s", "sm_util": 0, "memory_mib": 2000, "user": "eve"}],
    }
    trace, polls = record_node(node)
    assert [(p["pid"], p["start"]) for p in trace["processes"]] == [(12, 17)]
    replayed = replayed_series(trace)
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        assert not same(original, again), f"poll {k}"
    # Held from 17 s to the last poll at 600 s: 583 s x $3/GPU-hour = $0.485833.
    cost = [v for (name, _labels), v in replayed[-1].items() if name == "gpuledger_workload_cost_dollars_total"]
    assert cost == [pytest.approx(583 * 3.0 / 3600)]


def test_a_reused_pid_replays_as_two_processes_each_with_its_own_samples() -> None:
    # pid 10 runs to 100 s; another process gets pid 10 at 200 s. The second took the first's
    # samples too, so the trace started it at 0 s, over the first: a trace the fake refused to
    # load ("pid 10 is already running then").
    node = {
        "gpus": [{"model": "A100-SXM4-80GB"}],
        "processes": [
            {"pid": 5, "gpus": [0], "sm_util": 10, "memory_mib": 1000, "user": "bob"},
            {
                "pid": 10,
                "gpus": [0],
                "end": "100s",
                "sm_util": [{"at": "0s", "sm_util": 50}, {"at": "80s", "sm_util": 0}],
            },
            {"pid": 10, "gpus": [0], "start": "200s", "sm_util": 30, "memory_mib": 2000, "user": "eve"},
        ],
    }
    trace, polls = record_node(node)
    assert [(p["pid"], p["start"], p.get("end")) for p in trace["processes"]] == [
        (5, 0, None),
        (10, 0, 100),
        (10, 200, None),
    ]
    assert [s["sm_util"] for s in trace["processes"][2]["sm_util"]] == [30]
    for k, (original, again) in enumerate(zip(polls, replayed_series(trace), strict=True)):
        assert not same(original, again), f"poll {k}"


def test_polls_further_apart_than_the_drivers_sample_ring_replay_the_gpus_busy_time() -> None:
    # Polls a minute apart; the driver keeps 32 samples per process. Ann runs at 50% all along,
    # eve at 60% from 17 s. The samples a full ring lost were written as periods at 0%, so the
    # replayed GPU's own samples (the processes' sum) read the first 28 s of each minute idle.
    node = {
        "gpus": [{"model": "A100-SXM4-80GB"}],
        "processes": [
            {"pid": 10, "gpus": [0], "sm_util": 50, "memory_mib": 1000, "user": "ann"},
            {"pid": 12, "gpus": [0], "start": "17s", "sm_util": 60, "memory_mib": 2000, "user": "eve"},
        ],
    }
    trace, polls = record_node(node, step_s=60)
    replayed = replayed_series(trace, step_s=60)
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        assert not same(original, again), f"poll {k}"
    busy = [v for (name, _labels), v in replayed[-1].items() if name == "gpuledger_gpu_busy_seconds_total"]
    # Samples at 1..600 s: 50% at 1..16 s, 100% from 17 s on (50 + 60, capped): 8 + 584 = 592 s.
    assert busy == [pytest.approx(16 * 0.50 + 584 * 1.00)]


def test_the_first_poll_replays_the_mean_of_the_samples_the_driver_kept_from_before_the_trace() -> None:
    # The recording starts at 100 s of a node whose process has run since 0 s: at 30% to 84 s,
    # 90% from 85 s. The first poll reads the driver's ring, 32 samples stamped before it (69 to
    # 100 s): 16 at 30%, 16 at 90%, mean (16 x 30 + 16 x 90) / 32 = 60%. The trace kept only the
    # sample within half a period of its start (90%), so the replay's first poll read 90% where
    # the node read 60%. On a real H200 (tests/traces), whose one sample lay 92 ms before the
    # first poll with no period learned yet, it kept none: the replay's first poll read 0%.
    node = {
        "gpus": [{"model": "A100-SXM4-80GB"}],
        "processes": [
            {"pid": 551, "gpus": [0], "memory_mib": 876, "user": "root",
             "sm_util": [{"at": "0s", "sm_util": 30}, {"at": "85s", "sm_util": 90}]},
        ],
    }  # fmt: skip
    agent, tap = build_recording_agent(settings(), node, STEP_S, monotonic=lambda: 0.0)
    assert agent.node is not None
    agent.node.clock.advance(100)
    polls: list[Series] = []
    try:
        trace = record(agent, tap, 30, STEP_S, on_poll=lambda state: polls.append(series(agent, state)))
    finally:
        agent.close()
    assert trace["processes"][0]["sm_util"][0] == {"at": 0, "sm_util": 60, "memory_mib": 876}
    replayed = replayed_series(trace, duration_s=30)
    first = [v for (name, _labels), v in replayed[0].items() if name == "gpuledger_workload_gpu_utilization_ratio"]
    assert first == [0.60]
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        assert not same(original, again), f"poll {k}"


def test_a_reading_the_gpu_lacks_stays_refused_all_through_the_replay_and_a_passing_refusal_does_not() -> None:
    # GPU 0's driver refuses fan speed (as the real H200's did): the agent learns it at the
    # first poll and never asks again, so the trace held `{at: 0, until: 5}`, and from 5 s on
    # the replayed GPU answered 30% to every other reader (nvitop, a fresh agent's snapshot):
    # a fan the recorded GPU never showed. GPU 1's fan, read before, is refused for 10 s only:
    # a passing failure, which must stay one.
    node = {
        "gpus": [{"model": "RTX A6000", "count": 2}],  # boards with a fan
        "processes": [{"pid": 5, "gpus": [0], "sm_util": 50, "memory_mib": 100}],
        "faults": [
            {"gpu": 0, "call": "nvmlDeviceGetFanSpeed", "error": "NOT_SUPPORTED"},
            {"at": "60s", "until": "70s", "gpu": 1, "call": "nvmlDeviceGetFanSpeed", "error": "NOT_SUPPORTED"},
        ],
    }
    trace, polls = record_node(node)
    fan = [f for f in trace["faults"] if f.get("call") == "nvmlDeviceGetFanSpeed"]
    assert fan == [
        {"gpu": 0, "call": "nvmlDeviceGetFanSpeed", "error": "NOT_SUPPORTED"},
        {"at": 60, "until": 70, "gpu": 1, "call": "nvmlDeviceGetFanSpeed", "error": "NOT_SUPPORTED"},
    ]
    for k, (original, again) in enumerate(zip(polls, replayed_series(trace), strict=True)):
        assert not same(original, again), f"poll {k}"
    # Another reader of the replay, through pynvml as nvitop reads it.
    replay = fake_nvml.install(trace, host=False)
    pynvml.nvmlInit()
    try:
        gpus = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
        for at_s, refused in ((30, {0}), (65, {0, 1}), (80, {0})):
            replay.clock.advance(at_s - replay.clock.now())
            for i, handle in enumerate(gpus):
                if i in refused:
                    with pytest.raises(pynvml.NVMLError_NotSupported):
                        pynvml.nvmlDeviceGetFanSpeed(handle)
                else:
                    assert pynvml.nvmlDeviceGetFanSpeed(handle) == 30, (at_s, i)
    finally:
        pynvml.nvmlShutdown()


def test_the_replay_gives_the_interval_utilization_the_device_samples_gave() -> None:
    # An A100 whose driver refuses per-process utilization (as some vGPU drivers do) while its
    # own utilization samples read: the job runs at 92%, then 41% from 2m13s. The agent books
    # NVML busy time from the device's samples; the replayed fake made them up from the
    # processes' segments, which held no samples at all: the replay booked the GPU idle.
    node = {
        "gpus": [{"model": "A100-SXM4-80GB"}],
        "processes": [
            {"pid": 5, "gpus": [0], "memory_mib": 100, "user": "ann",
             "sm_util": [{"at": "0s", "sm_util": 92}, {"at": "2m13s", "sm_util": 41}]},
        ],
        "faults": [{"gpu": 0, "call": "nvmlDeviceGetProcessUtilization", "error": "NOT_SUPPORTED"}],
    }  # fmt: skip
    trace, polls = record_node(node)
    assert [s["sm_util"] for s in trace["processes"][0]["sm_util"]] == [0]  # no per-process samples
    rows = {row["at"]: row for row in trace["gpus"][0]["readings"]}
    # The interval from 130 s to 135 s: samples at 131, 132 s at 92%, 133-135 s at 41%:
    # (2 x 92 + 3 x 41) / 5 = 61.4%, on the row at 130 s, whose interval it is.
    assert (rows[125]["interval_utilization"], rows[130]["interval_utilization"]) == (92, 61.4)
    assert "interval_utilization" not in rows[600]  # no poll read the interval after the last
    replayed = replayed_series(trace)
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        assert not same(original, again), f"poll {k}"
    busy = {name: v for (name, _labels), v in replayed[-1].items() if name.endswith("busy_seconds_total")}
    # Samples at 1-132 s at 92%, 133-600 s at 41%: 132 x 0.92 + 468 x 0.41 = 121.44 + 191.88 =
    # 313.32 s, all of it the one job's.
    assert busy == {
        "gpuledger_gpu_busy_seconds_total": pytest.approx(313.32),
        "gpuledger_workload_gpu_busy_seconds_total": pytest.approx(313.32),
    }


def test_a_failed_read_of_the_devices_own_samples_is_a_fault_of_the_trace() -> None:
    # The device's utilization samples time out at the polls at 60 and 65 s. The tap forwarded
    # that call unseen (through `__getattr__`), so the trace had no fault: the replayed agent read
    # samples the recorded one could not, counted no error, and booked other busy time.
    node = {
        "gpus": [{"model": "A100-SXM4-80GB"}],
        "processes": [
            {"pid": 5, "gpus": [0], "memory_mib": 100, "user": "ann",
             "sm_util": [{"at": "0s", "sm_util": 92}, {"at": "62s", "sm_util": 41}]},
        ],
        "faults": [{"at": "60s", "until": "70s", "gpu": 0, "call": "nvmlDeviceGetSamples", "error": "TIMEOUT"}],
    }  # fmt: skip
    trace, polls = record_node(node)
    assert {"at": 60, "until": 70, "gpu": 0, "call": "nvmlDeviceGetSamples", "error": "TIMEOUT"} in trace["faults"]
    replayed = replayed_series(trace)
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        assert not same(original, again), f"poll {k}"
    errors = {
        dict(labels)["call"]: v for (name, labels), v in replayed[-1].items() if name == "gpuledger_nvml_errors_total"
    }
    assert errors.get("nvmlDeviceGetSamples") == 2  # the polls at 60 and 65 s


def test_a_call_discovery_was_refused_is_refused_in_the_replay() -> None:
    # The driver refuses GPU 0's enforced power limit (read once, at discovery). The tap did not
    # see discovery's calls, so the trace held neither the limit nor the refusal, and the
    # replayed A100 answered its model's 400 W: a power-limit gauge the recorded node never had.
    node = {
        "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
        "processes": [{"pid": 5, "gpus": [0], "sm_util": 50, "memory_mib": 100}],
        "faults": [{"gpu": 0, "call": "nvmlDeviceGetEnforcedPowerLimit", "error": "NOT_SUPPORTED"}],
    }
    trace, polls = record_node(node)
    assert "power_limit_w" not in trace["gpus"][0]
    assert trace["gpus"][1]["power_limit_w"] == 400
    assert {"gpu": 0, "call": "nvmlDeviceGetEnforcedPowerLimit", "error": "NOT_SUPPORTED"} in trace["faults"]
    replayed = replayed_series(trace)
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        assert not same(original, again), f"poll {k}"
    limits = {
        dict(labels)["gpu"]: v for (name, labels), v in replayed[-1].items() if name.endswith("power_limit_watts")
    }
    assert limits == {"1": 400}


def test_a_driver_sampling_each_process_less_often_than_the_replay_replays_each_polls_figure() -> None:
    # A driver that hands out one sample per process every 2 s, stamped 92 ms before the poll,
    # as the real H200 did (tests/traces): this one thins the fake's own samples so. The sample
    # read at 32 s (50%) stands for the 2 s before it; written from its stamp on, it held over
    # the next 2 s, so each replayed poll read the mean of its sample and the one before:
    # 89.5% at 30 s where the recording read 79%, 64.5% at 32 s where it read 50%.
    def one_sample_each_poll(backend: Any) -> Any:
        every = backend.process_utilization

        def thinned(handle: Any, since_us: int) -> list[tuple[int, int, int]]:
            kept = []
            for pid, stamp_us, util in every(handle, since_us):
                second = round(stamp_us / 1_000_000)
                if second % 2 == 0 and second * 1_000_000 - 92_000 > since_us:
                    kept.append((pid, second * 1_000_000 - 92_000, util))
            return kept

        backend.process_utilization = thinned
        return backend

    taps: list[Any] = []

    def tapped(backend: Any) -> Any:
        taps.append(tap(one_sample_each_poll(backend)))
        return taps[-1]

    node = {
        "gpus": [{"model": "A100-SXM4-80GB"}],
        "processes": [
            {"pid": 551, "gpus": [0], "memory_mib": 876, "user": "root",
             "sm_util": [{"at": "0s", "sm_util": 100}, {"at": "29s", "sm_util": 79}, {"at": "31s", "sm_util": 50},
                         {"at": "41s", "sm_util": 51}]},
        ],
    }  # fmt: skip
    agent = build_agent(settings(), fake=node, poll_interval_s=2, monotonic=lambda: 0.0, wrap_backend=tapped)
    polls: list[Series] = []
    try:
        trace = record(agent, taps[0], 60, 2, on_poll=lambda state: polls.append(series(agent, state)))
    finally:
        agent.close()

    def process_util(poll: Series) -> float:
        [value] = [v for (name, _labels), v in poll.items() if name == "gpuledger_workload_gpu_utilization_ratio"]
        return value

    assert [process_util(polls[k]) for k in (14, 15, 16, 21)] == [1.0, 0.79, 0.50, 0.51]
    replayed = replayed_series(trace, duration_s=60, step_s=2)
    assert [process_util(replayed[k]) for k in (14, 15, 16, 21)] == [1.0, 0.79, 0.50, 0.51]
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        assert not same(original, again), f"poll {k}"


def test_a_driver_sampling_each_process_more_often_than_the_replay_replays_each_polls_figure() -> None:
    # A driver that samples each process every 1/6 s (as A100s do), here of a job at 80% for the
    # first half of every second and idle the second half: three samples a second, the idle
    # periods without one. The recording's figure is (3 x 80%) / 6 periods = 40% each poll. The
    # trace wrote every sample from its stamp, with 0 after each run, so the replayed driver's one
    # sample a second (at the second's end) always fell in the idle half: the replay read 0%.
    def six_a_second(backend: Any) -> Any:
        every = backend.process_utilization

        def dense(handle: Any, since_us: int) -> list[tuple[int, int, int]]:
            found = []
            for pid, stamp_us, util in every(handle, 0):
                for j in (1, 2, 3):  # 1/6, 2/6 and 3/6 s into the second the fake's sample ends
                    at_us = stamp_us - 1_000_000 + j * 1_000_000 // 6
                    if at_us > since_us:
                        found.append((pid, at_us, util))
            return sorted(found, key=lambda sample: sample[1])

        backend.process_utilization = dense
        return backend

    taps: list[Any] = []

    def tapped(backend: Any) -> Any:
        taps.append(tap(six_a_second(backend)))
        return taps[-1]

    node = {
        "gpus": [{"model": "A100-SXM4-80GB"}],
        "processes": [{"pid": 7, "gpus": [0], "memory_mib": 876, "user": "root", "sm_util": 80}],
    }
    agent = build_agent(settings(), fake=node, poll_interval_s=STEP_S, monotonic=lambda: 0.0, wrap_backend=tapped)
    polls: list[Series] = []
    try:
        trace = record(agent, taps[0], 60, STEP_S, on_poll=lambda state: polls.append(series(agent, state)))
    finally:
        agent.close()
    replayed = replayed_series(trace, duration_s=60)

    def workload(poll: Series, name: str) -> float:
        [value] = [v for (series_name, _labels), v in poll.items() if series_name == name]
        return value

    for k in range(1, 13):
        # The agent's period is 166,666 us, not 1/6 s: 40.00008% recorded, 40% replayed.
        for got in (polls[k], replayed[k]):
            assert workload(got, "gpuledger_workload_gpu_utilization_ratio") == pytest.approx(0.40, abs=1e-5), k
    # 12 intervals of 5 s at 40%: 24 busy seconds, recorded and replayed.
    for got in (polls[-1], replayed[-1]):
        assert workload(got, "gpuledger_workload_gpu_busy_seconds_total") == pytest.approx(24.0, abs=1e-3)


def test_memory_the_driver_reserves_is_reserved_in_the_replay() -> None:
    # A driver that keeps 600 MiB of the A100's 81,920 for itself: free is total - used - 600
    # (the v2 call's `reserved`), and dcgm's FB_FREE says so. The trace held only `used`, so the
    # replayed driver reserved nothing and FB_FREE read 600 MiB more than the node's.
    node = {
        "gpus": [{"model": "A100-SXM4-80GB", "readings": [
            {"at": "0s", "memory_used_mib": 1000, "memory_free_mib": 80320},
            {"at": "20s", "memory_used_mib": 5000, "memory_free_mib": 76320},
        ]}],
        "processes": [{"pid": 5, "gpus": [0], "sm_util": 50, "memory_mib": 1000}],
    }  # fmt: skip
    with_dcgm = settings().model_copy(update={"exporters": ExportersConfig(dcgm_compat=True)})
    agent, tapped = build_recording_agent(with_dcgm, node, STEP_S, monotonic=lambda: 0.0)
    polls: list[Series] = []
    try:
        trace = record(agent, tapped, 60, STEP_S, on_poll=lambda state: polls.append(series(agent, state)))
    finally:
        agent.close()
    rows = {row["at"]: row for row in trace["gpus"][0]["readings"]}
    assert (rows[15]["memory_free_mib"], rows[20]["memory_free_mib"]) == (80320, 76320)
    replayed = replayed_series(trace, with_dcgm, duration_s=60)
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        assert not same(original, again), f"poll {k}"
    # 81,920 MiB - 5,000 used - 600 reserved = 76,320 MiB free at the end.
    free = [v for (name, _labels), v in replayed[-1].items() if name == "DCGM_FI_DEV_FB_FREE"]
    assert free == [76320]


def test_a_hopper_without_gpm_replays_without_it() -> None:
    # An H100 whose driver says it has no GPM (isSupportedDevice 0, as under some vGPU drivers):
    # the agent's busy source is NVML. The trace did not say, and the fake gives every Hopper GPM:
    # the replayed agent's busy source was GPM, its busy time the fake's SM activity (25% of the
    # recorded 100%).
    node = {
        "gpus": [{"model": "H100-SXM5-80GB", "gpm": False}, {"model": "H100-SXM5-80GB"}],
        "processes": [{"pid": 5, "gpus": [0, 1], "sm_util": 100, "sm_active": 25, "memory_mib": 100}],
    }
    trace, polls = record_node(node)
    assert [gpu.get("gpm") for gpu in trace["gpus"]] == [False, True]
    replayed = replayed_series(trace)
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        assert not same(original, again), f"poll {k}"
    sources = {
        dict(labels)["gpu"]: dict(labels)["source"]
        for (name, labels), _v in replayed[-1].items()
        if name == "gpuledger_gpu_busy_source_info"
    }
    assert sources == {"0": "nvml", "1": "gpm"}
    # 600 s at 100% (NVML) on GPU 0, at 25% SM activity (GPM) on GPU 1.
    busy = {
        dict(labels)["gpu"]: v
        for (name, labels), v in replayed[-1].items()
        if name == "gpuledger_gpu_busy_seconds_total"
    }
    assert busy == {"0": pytest.approx(600.0), "1": pytest.approx(150.0)}


def test_the_driver_events_a_gpu_reports_are_the_replays() -> None:
    # GPU 0 reports no driver events (as a vGPU may), GPU 1 Xids only, GPU 2 every kind. The
    # trace did not say, and the fake reports every kind on every GPU: the replayed agent watched
    # GPU 0's events (events_up 1 where the node's was 0) and would have counted GPU 1's ECC
    # events. GPU 3's driver refuses the question (NOT_SUPPORTED), which the tap did not see.
    node = {
        "gpus": [
            {"model": "A100-SXM4-80GB", "events": []},
            {"model": "A100-SXM4-80GB", "events": ["xid"]},
            {"model": "A100-SXM4-80GB", "count": 2},
        ],
        "processes": [{"pid": 5, "gpus": [0], "memory_mib": 100, "sm_util": 50}],
        "faults": [
            {"gpu": 3, "call": "nvmlDeviceGetSupportedEventTypes", "error": "NOT_SUPPORTED"},
            {"at": "1m", "gpu": 1, "xid": 31},
            {"at": "2m", "gpu": 1, "event": "single_bit_ecc"},
            {"at": "2m", "gpu": 2, "event": "single_bit_ecc"},
        ],
    }
    trace, polls = record_node(node)
    assert [gpu.get("events") for gpu in trace["gpus"]] == [[], ["xid"], None, None]
    assert {"gpu": 3, "call": "nvmlDeviceGetSupportedEventTypes", "error": "NOT_SUPPORTED"} in trace["faults"]
    replayed = replayed_series(trace)
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        assert not same(original, again), f"poll {k}"
    up = {dict(labels)["gpu"]: v for (name, labels), v in replayed[-1].items() if name == "gpuledger_gpu_events_up"}
    assert up == {"0": 0, "1": 1, "2": 1, "3": 0}
    # GPU 1's Xid and GPU 2's ECC event; GPU 1's ECC event is not reported.
    events = {
        (dict(labels)["gpu"], dict(labels)["event"]): v
        for (name, labels), v in replayed[-1].items()
        if name == "gpuledger_gpu_events_total"
    }
    assert events == {("1", "xid"): 1, ("2", "single_bit_ecc"): 1}


def test_a_gpu_lost_all_through_the_recording_is_in_the_trace() -> None:
    # GPU 1 is lost from the start: never identified, its handle refused with GPU_IS_LOST. The
    # trace listed GPUs only up to the last one ever readable and dropped the failure (it named
    # no uuid), so the replayed node had one GPU, and GPU 1's unobserved dollars were gone.
    node = {
        "gpus": [{"model": "H100-SXM5-80GB", "count": 2}],
        "processes": [{"pid": 5, "gpus": [0], "sm_util": 50, "memory_mib": 100}],
        "faults": [{"gpu": 1, "error": "GPU_IS_LOST"}],
    }
    trace, polls = record_node(node)
    assert len(trace["gpus"]) == 2
    assert [f for f in trace["faults"] if f.get("error") == "GPU_IS_LOST"] == [
        {"at": 0, "gpu": 1, "error": "GPU_IS_LOST"}
    ]
    replayed = replayed_series(trace)
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        assert not same(original, again), f"poll {k}"
    unobserved = [
        v
        for (name, labels), v in replayed[-1].items()
        if name == "gpuledger_gpu_unobserved_cost_dollars_total" and ("gpu", "1") in labels
    ]
    assert sum(unobserved) == pytest.approx(600 * 3.0 / 3600)  # 600 s x $3/GPU-hour = $0.50


def test_a_gpu_still_lost_when_the_recording_ends_stays_lost_in_the_replay() -> None:
    # GPU 1 is lost at 1m for good. The sampler retries it with backoff, last (in 10 minutes) at
    # 375 s; the trace ended the outage at the poll after that (380 s), so the replayed GPU came
    # back: the event reader re-registered on it (events up 1, recorded 0) from then on.
    node = {
        "gpus": [{"model": "H100-SXM5-80GB", "count": 2}],
        "processes": [{"pid": 5, "gpus": [0, 1], "sm_util": 50, "memory_mib": 100}],
        "faults": [{"at": "1m", "gpu": 1, "error": "GPU_IS_LOST"}],
    }
    trace, polls = record_node(node)
    assert [f for f in trace["faults"] if f.get("error") == "GPU_IS_LOST"] == [
        {"at": 60, "gpu": 1, "error": "GPU_IS_LOST"}
    ]
    for k, (original, again) in enumerate(zip(polls, replayed_series(trace), strict=True)):
        assert not same(original, again), f"poll {k}"


def test_ctrl_c_ends_the_recording_and_the_trace_keeps_every_poll_taken() -> None:
    # Ctrl-C while the 5th poll (t=20 s) is being taken into the trace: the recording stops after
    # it, and the trace holds polls 0-20 s whole, replaying to the series they gave. Before, the
    # KeyboardInterrupt went through `record` and the command wrote nothing at all.
    before = signal.getsignal(signal.SIGINT)
    agent, tap = build_recording_agent(settings(), NODE, STEP_S, monotonic=lambda: 0.0)
    polls: list[Series] = []

    def on_poll(state: AgentState) -> None:
        polls.append(series(agent, state))
        if len(polls) == 5:
            os.kill(os.getpid(), signal.SIGINT)

    try:
        trace = record(agent, tap, DURATION_S, STEP_S, on_poll=on_poll)
    finally:
        agent.close()
    assert len(polls) == 5
    assert [row["at"] for row in trace["gpus"][0]["readings"]] == [0, 5, 10, 15, 20]
    for k, (original, again) in enumerate(zip(polls, replayed_series(trace, duration_s=20), strict=True)):
        assert not same(original, again), f"poll {k}"
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C is the caller's again


def test_an_out_that_cannot_be_written_is_refused_before_recording(tmp_path: Path) -> None:
    # A directory as --out was found only when the trace was written, after the whole recording
    # (up to a week of it), which was then lost: exit 1, "Is a directory". Now it is bad input,
    # refused before the first poll; a regular file already there is replaced whole.
    refused = gpuledger("record", "--fake", "--for", "1m", "--step", "5s", "--out", str(tmp_path))
    assert refused.returncode == 2, refused.stderr
    message = f"gpuledger: --out: {tmp_path} is a directory: name a file to write"
    assert refused.stderr.strip().splitlines()[-1] == message
    existing = tmp_path / "trace.yaml"
    existing.write_text("x" * 10_000_000)  # longer than the trace: no tail of it may survive
    done = gpuledger("record", "--fake", "--for", "10s", "--step", "5s", "--out", str(existing))
    assert done.returncode == 0, done.stderr
    assert fake_nvml.load_scenario(str(existing)).gpus
    assert [p.name for p in tmp_path.iterdir()] == ["trace.yaml"]  # no temporary file left beside it


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


def test_a_readings_row_stands_in_for_the_fakes_health_physics() -> None:
    import pynvml

    # A busy A100 whose recorded row says what a real board said: values the fake's own physics
    # would never give (a 1275 MHz clock on a busy GPU at P2, a Gen3 x8 link, a fan on a
    # passively cooled board), each served exactly, through single calls and field values alike.
    row = {
        "at": 0,
        "sm_clock_mhz": 1275, "memory_clock_mhz": 1215, "sm_clock_max_mhz": 1395, "memory_clock_max_mhz": 1215,
        "fan_percent": 47, "performance_state": 2, "clock_event_reasons": 0x20,
        "violation_ns": {"thermal": 7_000_000_123},
        "ecc": {"corrected": 5, "uncorrected": 1, "corrected_aggregate": 900, "uncorrected_aggregate": 3},
        "remapped_rows": {"correctable": 4, "uncorrectable": 1, "pending": True, "failure": False},
        "pcie": {"generation": 3, "width": 8, "generation_max": 4, "width_max": 16, "replays": 77,
                 "tx_kib_s": 1000, "rx_kib_s": 3000},
        "nvlinks": [{"crc": 9, "replay": 2, "recovery": 1, "tx_kib": 100, "rx_kib": 250}, None],
        "encoder_utilization": 12, "decoder_utilization": 34, "memory_utilization": 56,
    }  # fmt: skip
    node = fake_nvml.install(
        {"gpus": [{"nvlink_links": 2, "readings": [row]}], "processes": [{"pid": 1, "gpus": [0], "sm_util": 90}]}
    )
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1275
    assert pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM) == 1215
    assert pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM) == 1395
    assert pynvml.nvmlDeviceGetFanSpeed(h) == 47
    assert pynvml.nvmlDeviceGetPerformanceState(h) == 2
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) == 0x20
    assert pynvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_THERMAL).violationTime == 7_000_000_123
    errors = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    assert pynvml.nvmlDeviceGetTotalEccErrors(h, errors, pynvml.NVML_VOLATILE_ECC) == 1
    assert pynvml.nvmlDeviceGetTotalEccErrors(h, errors, pynvml.NVML_AGGREGATE_ECC) == 3
    assert tuple(pynvml.nvmlDeviceGetRemappedRows(h)) == (4, 1, 1, 0)
    assert (pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h), pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)) == (3, 8)
    assert (pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h), pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)) == (4, 16)
    assert pynvml.nvmlDeviceGetPcieReplayCounter(h) == 77
    assert pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES) == 3000
    assert pynvml.nvmlDeviceGetNvLinkErrorCounter(h, 0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT) == 9
    assert pynvml.nvmlDeviceGetEncoderUtilization(h)[0] == 12
    assert pynvml.nvmlDeviceGetDecoderUtilization(h)[0] == 34
    assert pynvml.nvmlDeviceGetUtilizationRates(h).memory == 56
    fields = pynvml.nvmlDeviceGetFieldValues(
        h, [pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL, (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 0), (163, 0)]
    )
    assert [f.value.ullVal for f in fields] == [900, 250, 9]
    # Link 1 has no recorded counters: the fake's physics counts its traffic, 90% busy for 10 s
    # at 20 GB/s a link: 0.9 x 20e9 x 10 / 1024 = 175781250 KiB.
    node.clock.advance(10)
    [link1] = pynvml.nvmlDeviceGetFieldValues(h, [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 1)])
    assert link1.value.ullVal == 175781250


def test_a_bad_health_reading_fails_at_load_naming_it() -> None:
    for row, message in (
        ({"at": 0, "fan_percent": 120}, r"readings\[0\]\.fan_percent: must be 0\.\.100"),
        ({"at": 0, "ecc": {"fixed": 1}}, r"readings\[0\]\.ecc\.fixed: unknown key"),
        ({"at": 0, "remapped_rows": {"correctable": 1}}, r"remapped_rows\.uncorrectable: required"),
        ({"at": 0, "violation_ns": {"power": -1}}, r"violation_ns\.power: must be at least 0"),
        ({"at": 0, "nvlinks": [{}, {}]}, r"readings\[0\]\.nvlinks: the GPU has 1 NVLink link"),
        ({"at": 0, "pcie": {"tx_kib_s": 5}}, r"readings\[0\]\.pcie: tx_kib_s and rx_kib_s go together"),
    ):
        with pytest.raises(fake_nvml.ScenarioError, match=message):
            fake_nvml.load_scenario({"gpus": [{"nvlink_links": 1, "readings": [row]}]})


def test_a_process_on_two_gpus_replays_each_gpus_own_memory_and_load() -> None:
    # One pid on GPUs 0 and 1 (a model split unevenly, device_map=auto): 60 GB and 90% busy on
    # GPU 0, 20 GB and 30% (then 10 GB and 50% from 4m) on GPU 1, beside another job on GPU 1.
    # The trace took the process's figures from GPU 0 alone, and the replay booked GPU 1 at
    # GPU 0's: the two jobs' shares of GPU 1, and so their dollars, came out wrong.
    node: dict[str, Any] = {
        "start": "2026-11-20T18:00:00Z",
        "node": {"hostname": "split-node", "driver_version": "550.54.15"},
        "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
        "processes": [
            {
                "pid": 4101, "gpus": [0, 1], "sm_util": 90, "memory_mib": 60000, "slurm_job": "7",
                "per_gpu": {1: {"sm_util": [{"at": 0, "sm_util": 30}, {"at": "4m", "sm_util": 50, "memory_mib": 10000}],
                                "memory_mib": 20000}},
            },
            {"pid": 4102, "gpus": [1], "sm_util": 20, "memory_mib": 1000, "slurm_job": "8"},
        ],
    }  # fmt: skip
    trace, polls = record_node(node)
    fake_nvml.uninstall()
    replayed = replayed_series(yaml.load(trace_text(trace, ""), Loader=LOADER))
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        problems = same(original, again)
        assert not problems, f"poll {k} (t={k * STEP_S:g}s): " + "\n".join(problems[:20])
    # GPU 0's figures are the process's, GPU 1's its own; a process on one GPU has none.
    split = next(p for p in trace["processes"] if p["pid"] == 4101)
    assert (split["gpus"], split["memory_mib"]) == (["0", "1"], 60000)
    assert split["per_gpu"]["1"]["memory_mib"] == 20000
    assert "per_gpu" not in next(p for p in trace["processes"] if p["pid"] == 4102)

    # The node booked GPU 1 by each job's share of the busy time: 30 / (30 + 20) = 0.6 of it to
    # job 7 before 4m. At $3.00 an hour, the minute from 2m to 3m (1/60 h) is $0.05 of GPU 1, and
    # job 7's share of it 0.6 x $0.05 = $0.03 (the replay gives the same, checked above).
    def cost(poll: Series) -> float:
        return sum(
            v
            for (name, labels), v in poll.items()
            if name == "gpuledger_workload_cost_dollars_total" and {("gpu", "1"), ("hpc_job", "7")} <= labels
        )

    assert cost(polls[36]) - cost(polls[24]) == pytest.approx(0.03)


@pytest.mark.parametrize(
    ("per_gpu", "message"),
    [
        ({2: {"memory_mib": 5}}, r"processes\[0\]\.per_gpu: GPU 2 does not exist"),
        ({"0:1": {"memory_mib": 5}}, r"processes\[0\]\.per_gpu: GPU 0 has no MIG instance 1"),
        ({1: {"memory_mib": 5}}, r"processes\[0\]\.per_gpu: GPU 1 is not one of its gpus"),
        ({0: {"power": 5}}, r"processes\[0\]\.per_gpu\[0\]\.power: unknown key"),
        ([0], r"processes\[0\]\.per_gpu: expected a mapping"),
    ],
)
def test_a_bad_per_gpu_fails_at_load_naming_it(per_gpu: Any, message: str) -> None:
    scenario = {
        "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
        "processes": [{"pid": 7, "gpus": [0], "per_gpu": per_gpu}],
    }
    with pytest.raises(fake_nvml.ScenarioError, match=message):
        fake_nvml.load_scenario(scenario)


def test_a_node_whose_event_api_failed_for_a_while_replays_with_it_failing_then() -> None:
    # The driver could not make an event set in the first minute, and could not wait on one from
    # 3m to 4m: the node's reader read no events then (events_up 0) and tried again later. The
    # tap kept no failure of the reader's own calls (making a set, waiting on it), so the trace
    # had no fault for them, and the replay read events all along: events_up 1 where it was 0.
    node = {
        "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
        "processes": [{"pid": 5, "gpus": [0], "memory_mib": 100, "sm_util": 50}],
        "faults": [
            {"until": "1m", "call": "nvmlEventSetCreate", "error": "UNKNOWN"},
            {"at": "3m", "until": "4m", "call": "nvmlEventSetWait_v2", "error": "UNKNOWN"},
            {"at": "5m", "gpu": 1, "xid": 31},
        ],
    }
    trace, polls = record_node(node)
    replayed = replayed_series(trace)
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        problems = same(original, again)
        assert not problems, f"poll {k} (t={k * STEP_S:g}s): " + "\n".join(problems[:20])

    def up(poll: Series) -> dict[str, float]:
        return {dict(labels)["gpu"]: v for (name, labels), v in poll.items() if name == "gpuledger_gpu_events_up"}

    # No GPU watched at first (no set, so none registered), all of them once a set was made, none
    # in the minute waits failed (the reader tries again every 30 s), all of them after.
    assert (up(polls[0]), up(polls[30]), up(polls[40]), up(polls[60])) == (
        {}, {"0": 1, "1": 1}, {"0": 0, "1": 0}, {"0": 1, "1": 1},
    )  # fmt: skip
    assert {"at": 0, "until": 5, "call": "nvmlEventSetCreate", "error": "UNKNOWN"} in trace["faults"]
