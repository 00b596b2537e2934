"""GPU activity (GPM): the fake's GPM calls through the real pynvml, the sampler's two samples
per interval, and accounting and the flag rules taking SM activity as "busy" where configured.

The case the feature exists for: a job whose kernels run all the time but keep a quarter of the
SMs busy reads 100% in NVML's utilization; GPM's SM activity reads 25%, and busy seconds follow
whichever source `accounting.busy_source` names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

import fake_nvml
from agent.config import AccountingConfig, PricingConfig, ReadingsConfig, Settings
from agent.model import AgentState
from exporters.prometheus import make_registry
from fake_nvml.scenario import ScenarioError
from tests.helpers import Rig

HOUR = 3600.0
MINUTE = 60.0
PRICE = 4.0  # $/GPU-hour, pricing.gpu_hourly


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    fake_nvml.uninstall()


def scenario(processes: list[dict[str, Any]], model: str = "H100-SXM5-80GB", **gpu: Any) -> dict[str, Any]:
    return {"node": {"hostname": "gpm"}, "gpus": [{"model": model, **gpu}], "processes": processes}


# The bursty-tensor job: kernels run all the time (sm_util 100) but keep a quarter of the SMs
# busy (sm_active 25), 80% of that on the tensor cores.
BURSTY = {"pid": 100, "gpus": [0], "sm_util": 100, "sm_active": 25, "tensor": 80, "memory_mib": 30000}


def settings(busy_source: str = "auto", mig_activity: str = "slow") -> Settings:
    return Settings(
        node_name="rig",
        pricing=PricingConfig(gpu_hourly=PRICE),
        accounting=AccountingConfig(busy_source=busy_source),  # type: ignore[arg-type]
        readings=ReadingsConfig(mig_activity=mig_activity),  # type: ignore[arg-type]
    )


def value(state: AgentState, name: str, **labels: str) -> float | None:
    return make_registry(lambda: state, dcgm_compat=True).get_sample_value(name, labels)


def run_hour(spec: dict[str, Any], busy_source: str = "auto", step_s: float = MINUTE) -> tuple[Rig, AgentState]:
    rig = Rig(spec, settings=settings(busy_source))
    return rig, rig.run(HOUR, step_s)


# -- the fake's GPM calls -------------------------------------------------------------------------


def metrics(first: Any, second: Any, ids: tuple[int, ...] = (1, 2, 3, 5, 10)) -> list[tuple[int, int, float]]:
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(ids)
    request.sample1, request.sample2 = first, second
    for slot, metric_id in enumerate(ids):
        request.metrics[slot].metricId = metric_id
    pynvml.nvmlGpmMetricsGet(request)
    return [
        (request.metrics[i].metricId, request.metrics[i].nvmlReturn, request.metrics[i].value) for i in range(len(ids))
    ]


def test_gpm_metrics_are_the_means_of_what_the_processes_did_between_two_samples() -> None:
    # 60 s: the bursty job throughout, a second one (sm_util 20) for the last 30 s.
    node = fake_nvml.install(scenario([BURSTY, {"pid": 101, "gpus": [0], "start": "30s", "sm_util": 20}]), host=False)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice == 1
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    pynvml.nvmlGpmSampleGet(handle, first)
    node.clock.advance(60)
    pynvml.nvmlGpmSampleGet(handle, second)
    ok = pynvml.NVML_SUCCESS
    assert metrics(first, second) == [
        (1, ok, 100.0),  # graphics: 100 + 20 capped at 100, what NVML utilization reads
        (2, ok, 35.0),  # SM activity: 25 all along + 20 for half the span = 25 + 10
        (3, ok, 17.5),  # occupancy: half the active SMs' warp slots, 35 x 0.5
        (5, ok, 20.0),  # tensor: 80% of the bursty job's 25
        (10, ok, 21.0),  # DRAM: 0.6 x 35
    ]
    assert pynvml.nvmlDeviceGetUtilizationRates(handle).gpu == 100
    pynvml.nvmlGpmSampleFree(first)
    pynvml.nvmlGpmSampleFree(second)


def test_gpm_exists_on_hopper_only_and_on_drivers_from_r520() -> None:
    fake_nvml.install(
        {"gpus": [{"model": "A100-SXM4-80GB"}, {"model": "H100-SXM5-80GB"}, {"model": "B200"}]}, host=False
    )
    pynvml.nvmlInit()
    supported = [
        pynvml.nvmlGpmQueryDeviceSupport(pynvml.nvmlDeviceGetHandleByIndex(i)).isSupportedDevice for i in range(3)
    ]
    assert supported == [0, 1, 1]
    sample = pynvml.nvmlGpmSampleAlloc()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlGpmSampleGet(pynvml.nvmlDeviceGetHandleByIndex(0), sample)
    fake_nvml.uninstall()
    fake_nvml.install({"node": {"driver_version": "470.223.02"}, "gpus": [{"model": "H100-SXM5-80GB"}]}, host=False)
    pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlGpmQueryDeviceSupport(pynvml.nvmlDeviceGetHandleByIndex(0))


def test_a_mig_instance_is_sampled_through_its_gpu_by_gpu_instance_id() -> None:
    node = fake_nvml.install(
        scenario(
            [
                {"pid": 1, "gpus": ["0:0"], "sm_util": 70, "sm_active": 35},
                {"pid": 2, "gpus": ["0:1"], "sm_util": 0, "memory_mib": 8000},
            ],
            mig=["3g.40gb", "3g.40gb"],
        ),
        host=False,
    )
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    samples = [pynvml.nvmlGpmSampleAlloc() for _ in range(6)]
    for sample, instance in zip(samples[:3], (1, 2, None), strict=True):
        (
            pynvml.nvmlGpmSampleGet(gpu, sample)
            if instance is None
            else pynvml.nvmlGpmMigSampleGet(gpu, instance, sample)
        )
    node.clock.advance(60)
    for sample, instance in zip(samples[3:], (1, 2, None), strict=True):
        (
            pynvml.nvmlGpmSampleGet(gpu, sample)
            if instance is None
            else pynvml.nvmlGpmMigSampleGet(gpu, instance, sample)
        )
    assert metrics(samples[0], samples[3], (2,))[0][2] == 35.0  # instance 1: over its own SMs
    assert metrics(samples[1], samples[4], (2,))[0][2] == 0.0
    # The whole GPU: 35% of one 48-SM instance of 132 SMs.
    assert metrics(samples[2], samples[5], (2,))[0][2] == pytest.approx(35 * 48 / 132)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        metrics(samples[0], samples[4])  # two samples of different devices
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlGpmMigSampleGet(gpu, 9, samples[0])


def test_the_scenario_keys_are_checked() -> None:
    with pytest.raises(ScenarioError, match=r"processes\[0\]\.sm_active: 50 is above sm_util 40"):
        fake_nvml.load_scenario(scenario([{"pid": 1, "gpus": [0], "sm_util": 40, "sm_active": 50}]))
    with pytest.raises(ScenarioError, match=r"processes\[0\]\.tensor: must be 0\.\.100"):
        fake_nvml.load_scenario(scenario([{"pid": 1, "gpus": [0], "sm_util": 40, "tensor": 120}]))
    segments = [{"at": "0s", "sm_util": 50, "sm_active": 10}, {"at": "1h", "sm_util": 90, "tensor": 50}]
    loaded = fake_nvml.load_scenario(scenario([{"pid": 1, "gpus": [0], "sm_util": segments}]))
    assert [(s.active, s.tensor) for s in loaded.processes[0].segments] == [(10, 0), (90, 50)]


# -- the agent --------------------------------------------------------------------------------------


def test_the_bursty_tensor_job_reads_100_percent_in_nvml_and_25_in_gpm() -> None:
    rig, state = run_hour(scenario([BURSTY]))
    try:
        gpu = state.snapshot.gpus[0] if state.snapshot else None
        assert gpu is not None
        ids = {"gpu": "0", "uuid": gpu.uuid}
        assert value(state, "gpuledger_gpu_utilization_ratio", **ids) == 1.0
        assert value(state, "gpuledger_gpu_sm_active_ratio", **ids) == 0.25
        assert value(state, "gpuledger_gpu_tensor_active_ratio", **ids) == 0.2  # 80% of 25%
        assert value(state, "gpuledger_gpu_sm_occupancy_ratio", **ids) == 0.125
        assert value(state, "gpuledger_gpu_dram_active_ratio", **ids) == 0.15
        assert value(state, "gpuledger_gpu_busy_source_info", **ids, source="gpm") == 1
        dcgm = {name: s.value for m in make_registry(lambda: state, dcgm_compat=True).collect() for s in m.samples
                if (name := s.name).startswith("DCGM_FI_PROF")}  # fmt: skip
        assert dcgm == {
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 1.0,
            "DCGM_FI_PROF_SM_ACTIVE": 0.25,
            "DCGM_FI_PROF_SM_OCCUPANCY": 0.125,
            "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.2,
            "DCGM_FI_PROF_DRAM_ACTIVE": 0.15,
        }
    finally:
        rig.close()


@pytest.mark.parametrize(
    ("busy_source", "busy_s"),
    [
        # GPM: the hour x SM activity 0.25 = 900 s of the 3600 s it held.
        ("auto", 3600 * 0.25),
        ("gpm", 3600 * 0.25),
        # NVML: its kernels ran all the time, so 3600 x 1.0.
        ("nvml", 3600 * 1.0),
    ],
)
def test_busy_seconds_follow_the_configured_source(busy_source: str, busy_s: float) -> None:
    rig, state = run_hour(scenario([BURSTY]), busy_source)
    try:
        (charged,) = state.costs.workloads.values()
        assert charged.held_s == pytest.approx(3600)
        assert charged.busy_s == pytest.approx(busy_s)
        # The whole hour is the job's, whichever source: $4/h x 1 h = $4, nothing idle.
        gpu = next(iter(state.costs.gpus.values()))
        assert charged.dollars == pytest.approx(PRICE)
        assert gpu.dollars == pytest.approx(PRICE)
        assert gpu.idle_dollars == 0.0
        source = state.snapshot.gpus[0].busy_source if state.snapshot else ""
        assert source == ("nvml" if busy_source == "nvml" else "gpm")
    finally:
        rig.close()


def test_two_holders_share_the_gpus_sm_activity_by_their_nvml_shares() -> None:
    # A: sm_util 60 (SM activity 30); B: sm_util 20 (SM activity 10). NVML utilization reads 80%,
    # GPM SM activity 40%. Cost splits by NVML's per-process shares, 60:20 = 0.75:0.25, either way.
    spec = scenario(
        [
            {"pid": 1, "gpus": [0], "sm_util": 60, "sm_active": 30, "memory_mib": 1000, "slurm_job": "1"},
            {"pid": 2, "gpus": [0], "sm_util": 20, "sm_active": 10, "memory_mib": 1000, "slurm_job": "2"},
        ]
    )
    for busy_source, a_busy, b_busy in (
        # GPM: 3600 x 0.40 x 0.75 = 1080 s and 3600 x 0.40 x 0.25 = 360 s; 1440 s in all, which is
        # the GPU's own busy time (3600 x 0.40): busy seconds never exceed the GPU's.
        ("gpm", 1080.0, 360.0),
        # NVML: each holder's own utilization, 3600 x 0.6 = 2160 s and 3600 x 0.2 = 720 s.
        ("nvml", 2160.0, 720.0),
    ):
        rig, state = run_hour(spec, busy_source)
        try:
            by_job = {w.hpc_job: t for (_, _, w), t in state.costs.workloads.items()}
            assert by_job["1"].busy_s == pytest.approx(a_busy)
            assert by_job["2"].busy_s == pytest.approx(b_busy)
            # $4 for the hour: 0.75 x $4 = $3 and 0.25 x $4 = $1; conserved, nothing idle.
            assert by_job["1"].dollars == pytest.approx(3.0)
            assert by_job["2"].dollars == pytest.approx(1.0)
            gpu = next(iter(state.costs.gpus.values()))
            assert by_job["1"].dollars + by_job["2"].dollars + gpu.idle_dollars == pytest.approx(gpu.dollars)
            assert gpu.dollars == pytest.approx(PRICE)
        finally:
            rig.close()


def test_mig_instances_get_activity_busy_seconds_and_flags() -> None:
    # An H100 split in two 3g.40gb instances (48 of its 132 SMs each): a server busy at 35% SM
    # activity on 0:0, a notebook holding memory and doing nothing on 0:1.
    spec = scenario(
        [
            {"pid": 1, "gpus": ["0:0"], "sm_util": 70, "sm_active": 35, "memory_mib": 20000, "slurm_job": "7"},
            {"pid": 2, "gpus": ["0:1"], "sm_util": 0, "memory_mib": 8000, "slurm_job": "8"},
        ],
        mig=["3g.40gb", "3g.40gb"],
    )
    rig, state = run_hour(spec)
    try:
        assert state.snapshot is not None
        parent, busy_mig, idle_mig = state.snapshot.devices
        ids = {"gpu": "0", "uuid": parent.uuid}
        assert value(state, "gpuledger_mig_sm_active_ratio", **ids, mig="0") == 0.35
        assert value(state, "gpuledger_mig_sm_active_ratio", **ids, mig="1") == 0.0
        assert value(state, "gpuledger_gpu_sm_active_ratio", **ids) == pytest.approx(0.35 * 48 / 132)
        assert value(state, "gpuledger_gpu_busy_source_info", gpu="0", uuid=busy_mig.uuid, source="gpm") == 1
        by_job = {w.hpc_job: t for (_, _, w), t in state.costs.workloads.items()}
        # Held: 3600 s x 48/132 of the GPU = 1309.09 s each; busy: x 0.35 = 458.18 s for job 7.
        weight = 48 / 132
        assert by_job["7"].held_s == pytest.approx(3600 * weight)
        assert by_job["7"].busy_s == pytest.approx(3600 * weight * 0.35)
        assert by_job["8"].busy_s == 0.0
        # The idle instance is flagged, as a unit of its own; the busy one and the GPU are not.
        raised = {(f.uuid, f.rule) for f in state.flags if f.raised}
        assert (idle_mig.uuid, "allocated_idle") in raised
        assert not {uuid for uuid, _ in raised} & {busy_mig.uuid, parent.uuid}
        assert value(state, "gpuledger_gpu_flag", gpu="0", uuid=idle_mig.uuid, rule="allocated_idle") == 1
    finally:
        rig.close()


def test_the_flags_of_a_lost_gpus_mig_instance_clear_with_a_line(caplog: pytest.LogCaptureFixture) -> None:
    # The H100 of two 3g.40gb instances is lost at 40:00; job 8 has left instance 0:1 idle since
    # its first GPM reading (the poll at 1:00), and both of its flags are up by then. A lost GPU
    # reads no MIG instances, and their flags went down with no line: each raise had no clear.
    spec = scenario(
        [
            {"pid": 1, "gpus": ["0:0"], "sm_util": 70, "sm_active": 35, "memory_mib": 20000, "slurm_job": "7"},
            {"pid": 2, "gpus": ["0:1"], "sm_util": 0, "memory_mib": 8000, "slurm_job": "8"},
        ],
        mig=["3g.40gb", "3g.40gb"],
    )
    spec["faults"] = [{"at": "40m", "gpu": 0, "error": "GPU_IS_LOST"}]
    caplog.set_level("WARNING", logger="agent.pipeline")
    rig, state = run_hour(spec)
    rig.close()
    assert not [f for f in state.flags if f.raised]
    cleared = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("flag cleared"))
    assert [line.split(" uuid=")[0] for line in cleared] == [
        "flag cleared: rule=allocated_idle gpu=0",
        "flag cleared: rule=stranded_memory gpu=0",
    ]
    # Held from 1:00 to 40:00, 39m; its cost counted to the last poll that saw it, 39:00: 38 min of
    # 48/132 of the GPU at $4/h = 4 x 48/132 x 38/60 = $0.9212.
    assert all(" workload=job 8 for=39m cost_so_far=$0.92" in line for line in cleared)


def test_the_idle_flag_of_a_mig_instance_names_who_left_it_idle(caplog: pytest.LogCaptureFixture) -> None:
    # Job 8 runs on instance 0:1 until 10:00 and is last seen on it by the poll at 9:00; the
    # instance's idle flag (30 min) raises at 40:00. Its line said nobody had held the instance
    # since the agent started: only whole GPUs were followed.
    spec = scenario(
        [
            {"pid": 1, "gpus": ["0:0"], "sm_util": 70, "sm_active": 35, "memory_mib": 20000, "slurm_job": "7"},
            {"pid": 2, "gpus": ["0:1"], "sm_util": 50, "sm_active": 40, "slurm_job": "8", "end": "10m"},
        ],
        mig=["3g.40gb", "3g.40gb"],
    )
    caplog.set_level("WARNING", logger="agent.pipeline")
    rig, _state = run_hour(spec)
    rig.close()
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("flag raised: rule=idle")]
    # Idle from 10:00 at $4/h x 48/132 of the GPU: 30 min of it = 4 x 48/132 / 2 = $0.7273.
    assert " for=30m cost_so_far=$0.73 left_by=job 8 left_at=2026-11-20T18:09:00+00:00" in line


def test_without_gpm_the_gpu_is_busy_by_nvml_or_by_nothing() -> None:
    a100 = scenario([{"pid": 1, "gpus": [0], "sm_util": 40}], model="A100-SXM4-80GB")
    for busy_source, expected in (("auto", "nvml"), ("gpm", "")):
        rig, state = run_hour(a100, busy_source)
        try:
            gpu = state.snapshot.gpus[0] if state.snapshot else None
            assert gpu is not None
            assert gpu.activity is None
            assert gpu.busy_source == expected
            (charged,) = state.costs.workloads.values()
            # nvml: 3600 x 0.40 = 1440 s; gpm only, and no GPM: no busy measure, 0 s.
            assert charged.busy_s == pytest.approx(1440.0 if expected else 0.0)
            assert value(state, "gpuledger_gpu_sm_active_ratio", gpu="0", uuid=gpu.uuid) is None
        finally:
            rig.close()


def test_activity_is_measured_between_consecutive_polls_and_restarts_after_a_lost_gpu() -> None:
    spec = scenario(
        [
            {
                "pid": 1,
                "gpus": [0],
                "sm_util": [{"at": "0s", "sm_util": 80, "sm_active": 20}, {"at": "5m", "sm_util": 80}],
            }
        ]
    )
    spec["faults"] = [{"at": "10m", "until": "15m", "gpu": 0, "error": "GPU_IS_LOST"}]
    rig = Rig(spec, settings=settings())
    try:
        first = rig.poll()
        assert first.snapshot is not None
        assert first.snapshot.gpus[0].activity is None  # one sample: no interval yet
        readings = []
        for _ in range(20):  # a poll a minute for 20 minutes
            state = rig.poll(MINUTE)
            gpu = state.snapshot.gpus[0] if state.snapshot else None
            assert gpu is not None
            readings.append(None if not gpu.up or gpu.activity is None else gpu.activity.sm_active)
        # Minutes 1-5 at 20%, 6-9 at 80%; lost from 10 to 14 (retried with backoff); back at
        # minute 15 or later with one poll that only starts an interval (None), then 80% again.
        assert readings[:9] == [0.2] * 5 + [0.8] * 4
        back = next(i for i in range(9, 20) if readings[i] is None and i + 1 < 20 and readings[i + 1] is not None)
        assert back >= 14
        assert readings[back + 1 :] == [0.8] * (19 - back)
    finally:
        rig.close()


def test_gpm_costs_two_nvml_calls_per_gpu_per_poll() -> None:
    rig = Rig(scenario([BURSTY], count=2), settings=settings())
    try:
        rig.poll()
        rig.poll(MINUTE)
        before = dict(rig.node.calls)
        rig.poll(MINUTE)
        gpm = {name: n - before.get(name, 0) for name, n in rig.node.calls.items() if name.startswith("nvmlGpm")}
        gpm = {name: n for name, n in gpm.items() if n}  # support and buffers: once, at discovery
        assert gpm == {"nvmlGpmSampleGet": 2, "nvmlGpmMetricsGet": 2}
    finally:
        rig.close()


# -- the NVML call budget (issue 11: 10 calls per GPU per poll in steady state) ------------------


def steady_calls(spec: dict[str, Any], settings_: Settings) -> Any:
    """NVML calls over one slow interval (30 s: six polls 5 s apart) after a minute of polls; the
    event set's waits are the node's, not a GPU's."""
    rig = Rig(spec, settings=settings_)
    try:
        rig.run(MINUTE, 5)
        before = rig.node.calls.copy()
        for _ in range(6):
            rig.poll(5)
        calls = rig.node.calls - before
    finally:
        rig.close()
    calls.pop("nvmlEventSetWait_v2", None)
    return calls


H100_WHOLE_AND_MIG = {
    "node": {"hostname": "gpm"},
    "gpus": [{"model": "H100-SXM5-80GB", "nvlink_links": 18}, {"model": "H100-SXM5-80GB", "mig": ["1g.10gb"] * 7}],
    "processes": [{"pid": 10, "gpus": [0], **{k: BURSTY[k] for k in ("sm_util", "sm_active", "tensor")}}]
    + [{"pid": 20 + m, "gpus": [f"1:{m}"], "sm_util": 30, "memory_mib": 1000 + m} for m in range(7)],
}


def test_steady_state_nvml_calls_per_gpu_per_poll_whole_and_mig_h100_reading_mig_activity_every_poll() -> None:
    # Not the default (slow: tests/test_mig_activity.py): the exact per-poll mode, and its cost.
    calls = steady_calls(H100_WHOLE_AND_MIG, settings(mig_activity="every_poll"))
    # The whole H100, each poll: field values, memory, utilization (and the memory controller's),
    # temperature, processes, process samples, and GPM's sample and metrics: 8.
    # Its device utilization samples are not read: GPM is its busy source. Once in the six, the
    # slow readings: SM clock, performance state, clock-event reasons, PCIe generation and width,
    # encoder, decoder (7). 8 x 6 + 7 = 55 calls. (The memory clock was slow too: an H100's HBM3
    # supports one memory clock, so it is read once, at the first poll. The SM clock was read
    # every poll, 10.33 a poll.)
    # Once in the six as well, the MPS-client and graphics process lists (2), empty here: 57.
    whole = 8 * 6 + 7 + 2
    # The fully split H100, each poll: field values, temperature, the process list (3), its own
    # GPM sample and metrics (2), and per instance a GPM sample and metrics (14): 19. Once in the
    # six: SM clock, performance state, reasons, PCIe generation and width (5), and the seven
    # instances' memory (7). 19 x 6 + 12 = 126 calls, 21.00 a poll (the memory clock, once: as above).
    mig = 19 * 6 + 5 + 7
    assert sum(calls.values()) == whole + mig, dict(calls)
    assert "nvmlDeviceGetSamples" not in calls
    assert calls["nvmlGpmSampleGet"] == 2 * 6
    assert calls["nvmlGpmMigSampleGet"] == 7 * 6
    assert calls["nvmlGpmMetricsGet"] == (1 + 1 + 7) * 6
    assert "nvmlDeviceGetSupportedMemoryClocks" not in calls
    assert whole / 6 == 9.5
    assert mig / 6 == 21


def test_without_mig_activity_a_fully_split_h100_keeps_to_the_budget_and_its_instances_have_no_busy_measure() -> None:
    off = settings(mig_activity="off")
    calls = steady_calls(H100_WHOLE_AND_MIG, off)
    # The MIG GPU: 3 + its own GPM (2) a poll, 12 once in the six: 5 x 6 + 12 = 42, 7.00 a poll
    # (13 and 7.17 before the memory clock of its HBM, which has one, was read once).
    assert sum(calls.values()) == (8 * 6 + 7 + 2) + (5 * 6 + 12), dict(calls)
    assert "nvmlGpmMigSampleGet" not in calls
    rig = Rig(H100_WHOLE_AND_MIG, settings=off)
    try:
        rig.poll()
        state = rig.poll(MINUTE)
        assert state.snapshot is not None
        instances = state.snapshot.mig_devices(state.snapshot.gpus[1].uuid)
        assert [(d.activity, d.busy_source) for d in instances] == [(None, "")] * 7
        assert state.snapshot.gpus[1].activity is not None  # the GPU's own is still read
    finally:
        rig.close()


def test_gpm_readings_are_the_same_whether_or_not_the_device_samples_are_read() -> None:
    # The bursty tensor job, its load changing every 7 minutes, over an hour of polls a minute:
    # with busy_source gpm the sampler skips the device samples; with nvml it reads them. The
    # GPM readings are the same at every poll, and the device samples' interval mean is what
    # GPM's graphics activity reads (which stands in for it where the samples are not read).
    bursty = {
        **{k: v for k, v in BURSTY.items() if k not in ("sm_active", "tensor")},
        "sm_util": [
            {"at": f"{7 * k}m", "sm_util": 100 - 10 * (k % 3), "sm_active": 25 + 5 * (k % 4), "tensor": 80}
            for k in range(9)
        ],
    }
    readings: dict[str, list[tuple[Any, Any]]] = {}
    for source in ("gpm", "nvml"):
        rig = Rig(scenario([bursty]), settings=settings(source))
        try:
            rig.poll()
            polls = []
            for _ in range(60):
                state = rig.poll(MINUTE)
                assert state.snapshot is not None
                gpu = state.snapshot.gpus[0]
                polls.append((gpu.activity, gpu.interval_utilization))
            readings[source] = polls
            calls = rig.node.calls["nvmlDeviceGetSamples"]
            assert calls == (0 if source == "gpm" else 61)
        finally:
            rig.close()
    assert [a for a, _ in readings["gpm"]] == [a for a, _ in readings["nvml"]]
    assert all(a is not None and a.sm_active is not None for a, _ in readings["gpm"])
    for (_, from_gpm), (_, from_samples) in zip(readings["gpm"], readings["nvml"], strict=True):
        # The samples come a sampling period apart, so where the load changes the period
        # straddling it reads one side: within a period's share of the minute (1/60 s here).
        assert from_gpm == pytest.approx(from_samples, abs=0.005)
