"""dcgm-exporter compatibility: the DCGM_FI_DEV_* series carry the same readings as gpuledger's
own series for the same GPU, under dcgm-exporter's names, units, help texts and labels."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

import fake_nvml
from agent.config import Settings
from agent.model import (
    AgentState,
    Attribution,
    DeviceEvents,
    DeviceReading,
    GpuEvents,
    Holding,
    NodeInfo,
    Snapshot,
    Workload,
)
from exporters.dcgm import DCGM_BY_NAME, DCGM_CATALOGUE
from exporters.prometheus import make_registry
from tests.helpers import Rig
from tests.test_cli import Daemon, value

MIB = 2**20

# dcgm-exporter's HELP texts, verbatim from NVIDIA/dcgm-exporter etc/default-counters.csv
# (also etc/dcp-metrics-included.csv, the container image's default).
DCGM_HELP = {
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "Total energy consumption since boot (in mJ).",
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_XID_ERRORS": "Value of the last XID error encountered.",
}
# The DCP fields, from GPM on Hopper and later: etc/dcp-metrics-included.csv (SM_ACTIVE and
# SM_OCCUPANCY are commented out there, with these texts).
DCGM_PROFILING_HELP = {
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "Ratio of time the graphics engine is active.",
    "DCGM_FI_PROF_SM_ACTIVE": "The ratio of cycles an SM has at least 1 warp assigned.",
    "DCGM_FI_PROF_SM_OCCUPANCY": "The ratio of number of warps resident on an SM.",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "Ratio of cycles the tensor (HMMA) pipe is active.",
    "DCGM_FI_PROF_DRAM_ACTIVE": "Ratio of cycles the device memory interface is active sending or receiving data.",
}
# A Hopper node (GPM: the DCP fields), one GPU whole and one split in MIG instances.
HOPPER = {
    "node": {"hostname": "gpu-hopper-01"},
    "gpus": [{"model": "H100-SXM5-80GB"}, {"model": "H100-SXM5-80GB", "mig": ["3g.40gb", "3g.40gb"]}],
    "processes": [
        {"pid": 10, "gpus": [0], "sm_util": 90, "sm_active": 45, "tensor": 50, "memory_mib": 1000},
        {"pid": 11, "gpus": ["1:0"], "sm_util": 60, "sm_active": 30, "memory_mib": 1000},
    ],
}
# The health fields' HELP texts: verbatim from etc/default-counters.csv where it lists the field
# (the violation fields from etc/dcp-metrics-included.csv, in ns as DCGM delivers them), else the
# field's comment in DCGM's dcgmlib/dcgm_fields.h (DCGM 4.6).
DCGM_HEALTH_HELP = {
    "DCGM_FI_DEV_SM_CLOCK": "SM clock frequency (in MHz).",
    "DCGM_FI_DEV_MEM_CLOCK": "Memory clock frequency (in MHz).",
    "DCGM_FI_DEV_MAX_SM_CLOCK": "Maximum supported SM clock for the device",
    "DCGM_FI_DEV_MAX_MEM_CLOCK": "Maximum supported Memory clock for the device",
    "DCGM_FI_DEV_FAN_SPEED": "Fan speed for the device in percent 0-100",
    "DCGM_FI_DEV_PSTATE": "Performance state (P-State) 0-15. 0=highest",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "Current clock event reasons (bitmask of DCGM_CLOCKS_EVENT_REASON_*)",
    "DCGM_FI_DEV_POWER_VIOLATION": "Throttling duration due to power constraints (in ns).",
    "DCGM_FI_DEV_THERMAL_VIOLATION": "Throttling duration due to thermal constraints (in ns).",
    "DCGM_FI_DEV_SYNC_BOOST_VIOLATION": "Throttling duration due to sync-boost constraints (in ns).",
    "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION": "Throttling duration due to board limit constraints (in ns).",
    "DCGM_FI_DEV_LOW_UTIL_VIOLATION": "Throttling duration due to low utilization (in ns).",
    "DCGM_FI_DEV_RELIABILITY_VIOLATION": "Throttling duration due to reliability constraints (in ns).",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "Total number of single-bit volatile ECC errors.",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "Total number of double-bit volatile ECC errors.",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": "Total number of single-bit persistent ECC errors.",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": "Total number of double-bit persistent ECC errors.",
    "DCGM_FI_DEV_RETIRED_SBE": "Total number of retired pages due to single-bit errors.",
    "DCGM_FI_DEV_RETIRED_DBE": "Total number of retired pages due to double-bit errors.",
    "DCGM_FI_DEV_RETIRED_PENDING": "Total number of pages pending retirement.",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "Number of remapped rows for correctable errors",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "Number of remapped rows for uncorrectable errors",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "Whether remapping of rows has failed",
    "DCGM_FI_DEV_ROW_REMAP_PENDING": "Whether remapping of rows is pending",
    "DCGM_FI_DEV_PCIE_LINK_GEN": "PCIe Current Link Generation",
    "DCGM_FI_DEV_PCIE_LINK_WIDTH": "PCIe Current Link Width",
    "DCGM_FI_DEV_PCIE_MAX_LINK_GEN": "PCIe Max Link Generation",
    "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH": "PCIe Max Link Width",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "Total number of PCIe retries.",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": "Total number of NVLink flow-control CRC errors.",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": "Total number of NVLink retries.",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": "Total number of NVLink recovery errors.",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "Total number of NVLink bandwidth counters for all lanes",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "Memory utilization (in %).",
    "DCGM_FI_DEV_ENC_UTIL": "Encoder utilization (in %).",
    "DCGM_FI_DEV_DEC_UTIL": "Decoder utilization (in %).",
}
# The label set of internal/pkg/rendermetrics/render_metrics.go (gpuMetricsFormat) with the
# DCGM_FI_DRIVER_VERSION label field of dcp-metrics-included.csv.
IDENTITY = {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION"}
POD = {"namespace", "pod", "container"}
WORKLOAD = {*POD, "hpc_job"}  # dcgm-exporter's attributes: kubernetes.go and hpc.go
MIG = {"GPU_I_PROFILE", "GPU_I_ID"}

Samples = list[tuple[str, dict[str, str], float]]


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    fake_nvml.uninstall()


def run_rig(scenario: Any, duration_s: float = 120, step_s: float = 15) -> AgentState:
    rig = Rig(scenario)
    try:
        return rig.run(duration_s, step_s)
    finally:
        rig.close()


def exposition(state: AgentState, dcgm_compat: bool = True) -> str:
    return generate_latest(make_registry(lambda: state, dcgm_compat=dcgm_compat)).decode()


def parse(text: str) -> Samples:
    return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def find(samples: Samples, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    return [(lab, v) for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]


def one(samples: Samples, name: str, **labels: str) -> tuple[dict[str, str], float]:
    found = find(samples, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture(scope="module")
def demo() -> Samples:
    state = run_rig("demo")
    fake_nvml.uninstall()
    return parse(exposition(state))


def test_each_dcgm_reading_equals_gpuledgers_reading_of_the_same_gpu(demo: Samples) -> None:
    gpus = find(demo, "gpuledger_gpu_info")
    assert len(gpus) == 8
    for info, _ in gpus:
        ids = {"gpu": info["gpu"], "UUID": info["uuid"]}
        ours = {"gpu": info["gpu"], "uuid": info["uuid"]}

        def gpuledger(name: str) -> float:
            return one(demo, name, **ours)[1]  # noqa: B023 - called inside this iteration only

        util_labels, util = one(demo, "DCGM_FI_DEV_GPU_UTIL", **ids)
        assert util == pytest.approx(100 * gpuledger("gpuledger_gpu_utilization_ratio"))
        used = gpuledger("gpuledger_gpu_memory_used_bytes")
        total = gpuledger("gpuledger_gpu_memory_total_bytes")
        assert one(demo, "DCGM_FI_DEV_FB_USED", **ids)[1] == used // MIB
        assert one(demo, "DCGM_FI_DEV_FB_FREE", **ids)[1] == (total - used) // MIB
        assert one(demo, "DCGM_FI_DEV_GPU_TEMP", **ids)[1] == gpuledger("gpuledger_gpu_temperature_celsius")
        assert one(demo, "DCGM_FI_DEV_POWER_USAGE", **ids)[1] == pytest.approx(gpuledger("gpuledger_gpu_power_watts"))
        energy_mj = one(demo, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", **ids)[1]
        assert energy_mj == pytest.approx(1000 * gpuledger("gpuledger_gpu_energy_joules_total"))

        # Identity labels as dcgm-exporter prints them, from the same facts as gpuledger_gpu_info.
        assert util_labels["device"] == f"nvidia{info['gpu']}"
        assert util_labels["modelName"] == info["model_name"] == "NVIDIA A100-SXM4-80GB"
        assert util_labels["pci_bus_id"] == info["pci_bus_id"]
        assert util_labels["DCGM_FI_DRIVER_VERSION"] == info["driver_version"] == "550.54.15"
        assert util_labels["Hostname"] == "rig"  # the hostname tests.helpers.Rig gives the sampler


def test_demo_values_are_the_scenarios_figures(demo: Samples) -> None:
    # GPU 0: the training rank at 92% holding 61000 MiB of 81920; GPU 6: idle at 32 C and 55 W.
    assert one(demo, "DCGM_FI_DEV_GPU_UTIL", gpu="0")[1] == 92
    assert one(demo, "DCGM_FI_DEV_FB_USED", gpu="0")[1] == 61000
    assert one(demo, "DCGM_FI_DEV_FB_FREE", gpu="0")[1] == 81920 - 61000
    assert one(demo, "DCGM_FI_DEV_GPU_UTIL", gpu="6")[1] == 0
    assert one(demo, "DCGM_FI_DEV_GPU_TEMP", gpu="6")[1] == 32
    assert one(demo, "DCGM_FI_DEV_POWER_USAGE", gpu="6")[1] == 55


def test_pods_label_the_gpus_they_hold_and_nothing_else(demo: Samples) -> None:
    expected = {
        "4": ("serving", "vllm-llama-0", "vllm"),  # shared with a plain container: the pod names it
        "5": ("research-nlp", "notebook-7", "jupyter"),
        "7": ("research-cv", "notebook-3", "jupyter"),  # allocated, no process: still its pod
    }
    for name in DCGM_HELP:
        for labels, _ in find(demo, name):
            pod = expected.get(labels["gpu"])
            if pod is None:  # the Slurm job's GPUs 0-3 and idle GPU 6
                assert POD.isdisjoint(labels), (name, labels)
            else:
                assert (labels["namespace"], labels["pod"], labels["container"]) == pod


def test_the_slurm_jobs_gpus_carry_dcgm_exporters_hpc_job_label_and_no_others_do(demo: Samples) -> None:
    # demo: Slurm job 8812 holds GPUs 0-3 (its map files and its processes' cgroup); no other GPU
    # is held by a batch job.
    for name in DCGM_HELP:
        jobs = {labels["gpu"]: labels.get("hpc_job") for labels, _ in find(demo, name)}
        assert jobs == {"0": "8812", "1": "8812", "2": "8812", "3": "8812"} | dict.fromkeys("4567"), name


def test_every_series_carries_the_dcgm_label_set_and_one_series_per_gpu(demo: Samples) -> None:
    for name in DCGM_HELP:
        series = find(demo, name)
        assert sorted(labels["gpu"] for labels, _ in series) == [str(i) for i in range(8)], name
        for labels, _ in series:
            xid = {"err_code"} if name == "DCGM_FI_DEV_XID_ERRORS" else set()
            assert IDENTITY | xid <= set(labels) <= IDENTITY | WORKLOAD | xid, (name, labels)


def gpu(index: int, uuid: str, **readings: Any) -> DeviceReading:
    return DeviceReading(
        index, uuid, "NVIDIA H100 80GB HBM3", True, pci_bus_id=f"00000000:{index:02x}:00.0", **readings
    )


def test_a_shared_gpu_is_one_series_named_for_the_allocated_pod_then_by_name() -> None:
    snapshot = Snapshot(
        1.0, NodeInfo("node-9", "560.35.03"), (gpu(0, "GPU-a", utilization=0.5), gpu(1, "GPU-b", utilization=0.25))
    )
    sidecar = Workload(namespace="alpha", pod="sidecar", container="probe")
    main = Workload(namespace="zeta", pod="main", container="trainer")
    holdings = (
        Holding("GPU-a", sidecar, pids=(10,), sm_util=0.4),  # runs there, not allocated to it
        Holding("GPU-a", main, pids=(11,), sm_util=0.1, allocated=True),
        Holding("GPU-b", Workload(namespace="ml", pod="b-pod", container="c"), pids=(12,), allocated=True),
        Holding("GPU-b", Workload(namespace="ml", pod="a-pod", container="c"), pids=(13,), allocated=True),
        Holding("GPU-b", Workload(hpc_job="8812", user="alice"), pids=(14,)),
    )
    state = AgentState(snapshot=snapshot, attribution=Attribution(holdings=holdings))
    samples = parse(exposition(state))
    (a_labels, a_util), (b_labels, b_util) = (one(samples, "DCGM_FI_DEV_GPU_UTIL", gpu=g) for g in ("0", "1"))
    assert (a_labels["namespace"], a_labels["pod"], a_labels["container"], a_util) == ("zeta", "main", "trainer", 50)
    assert (b_labels["namespace"], b_labels["pod"], b_util) == ("ml", "a-pod", 25)
    assert a_labels["Hostname"] == "node-9"
    assert a_labels["modelName"] == "NVIDIA H100 80GB HBM3"


def test_fb_free_is_what_the_driver_reports_free_not_total_less_used() -> None:
    # DCGM's FB_FREE is nvmlDeviceGetMemoryInfo_v2's `free` in MiB; the driver's reservation is
    # neither used nor free (DCGM dcgmlib/src/DcgmCacheManager.cpp, ReadAndCacheFBMemoryInfo).
    # An H100 80GB: 81559 MiB total, 531 MiB reserved, 1000 used, 80028 free.
    reading = gpu(
        0, "GPU-a", memory_used_bytes=1000 * MIB, memory_total_bytes=81559 * MIB, memory_free_bytes=80028 * MIB
    )
    samples = parse(exposition(AgentState(snapshot=Snapshot(1.0, NodeInfo("node-9", "560.35.03"), (reading,)))))
    assert one(samples, "DCGM_FI_DEV_FB_USED", gpu="0")[1] == 1000
    assert one(samples, "DCGM_FI_DEV_FB_FREE", gpu="0")[1] == 80028
    # Where the driver gives no free figure, there is no series (not total - used).
    reading = gpu(0, "GPU-a", memory_used_bytes=1000 * MIB, memory_total_bytes=81559 * MIB)
    samples = parse(exposition(AgentState(snapshot=Snapshot(1.0, NodeInfo("node-9", "560.35.03"), (reading,)))))
    assert find(samples, "DCGM_FI_DEV_FB_FREE") == []


def test_the_xid_gauge_carries_its_code_as_dcgm_exporters_err_code_label() -> None:
    # dcgm-exporter's toMetric (internal/pkg/collector/gpu_collector.go) adds the value as the
    # `err_code` label (0 on a GPU without one), so alerts select {err_code="79"}. Its `err_msg`
    # text table is dcgm-exporter's own prose, not copied here: that label is left out.
    gpus = (gpu(0, "GPU-a"), gpu(1, "GPU-b"), gpu(2, "GPU-c"))
    events = DeviceEvents(
        (
            GpuEvents(0, "GPU-a", True),
            GpuEvents(1, "GPU-b", True, last_xid=79),
            GpuEvents(2, "GPU-c", True, last_xid=999),
        ),
        reading=True,
    )
    state = AgentState(snapshot=Snapshot(1.0, NodeInfo("node-9", "560.35.03"), gpus), events=events)
    found = {
        labels["gpu"]: (labels["err_code"], v) for labels, v in find(parse(exposition(state)), "DCGM_FI_DEV_XID_ERRORS")
    }
    assert found == {"0": ("0", 0), "1": ("79", 79), "2": ("999", 999)}


def test_mig_framebuffer_is_per_instance_and_board_readings_are_per_gpu() -> None:
    samples = parse(exposition(run_rig("mig")))
    parent = one(samples, "gpuledger_gpu_info", gpu="0")[0]["uuid"]
    instances = find(samples, "gpuledger_mig_info", gpu="0")
    assert len(instances) == 2
    for info, _ in instances:
        labels, used_mib = one(samples, "DCGM_FI_DEV_FB_USED", gpu="0", GPU_I_ID=info["gpu_instance_id"])
        assert labels["GPU_I_PROFILE"] == info["profile"] == "3g.40gb"
        assert labels["UUID"] == parent  # the parent GPU's, as dcgm-exporter prints it
        mig = {"gpu": "0", "mig": info["mig"]}
        assert used_mib == one(samples, "gpuledger_mig_memory_used_bytes", **mig)[1] // MIB
        total = one(samples, "gpuledger_mig_memory_total_bytes", **mig)[1]
        free_mib = one(samples, "DCGM_FI_DEV_FB_FREE", gpu="0", GPU_I_ID=info["gpu_instance_id"])[1]
        assert free_mib == (total - used_mib * MIB) // MIB
    # 20000 and 8000 MiB held on the two instances (fake_nvml/scenarios/mig.yaml)
    assert sorted(v for _, v in find(samples, "DCGM_FI_DEV_FB_USED", gpu="0")) == [8000, 20000]
    # Board readings once per GPU, without instance labels; no whole-GPU framebuffer beside the
    # instances' (a sum over the node would count it twice); MIG GPUs report no utilization.
    for name in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"):
        labels, _ = one(samples, name, gpu="0")
        assert MIG.isdisjoint(labels)
    assert all(set(labels) >= MIG for labels, _ in find(samples, "DCGM_FI_DEV_FB_USED", gpu="0"))
    assert find(samples, "DCGM_FI_DEV_GPU_UTIL", gpu="0") == []
    assert one(samples, "DCGM_FI_DEV_GPU_UTIL", gpu="1")[1] == 40
    assert MIG.isdisjoint(one(samples, "DCGM_FI_DEV_FB_USED", gpu="1")[0])


def test_profiling_fields_come_from_gpm_per_gpu_and_per_mig_instance() -> None:
    samples = parse(exposition(run_rig(HOPPER)))
    # GPU 0, whole: SM activity 45%, half of it on the tensor cores; kernels ran 90% of the time.
    assert one(samples, "DCGM_FI_PROF_SM_ACTIVE", gpu="0")[1] == 0.45
    assert one(samples, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", gpu="0")[1] == 0.225
    assert one(samples, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", gpu="0")[1] == 0.9
    assert MIG.isdisjoint(one(samples, "DCGM_FI_PROF_SM_ACTIVE", gpu="0")[0])
    # GPU 1 in MIG mode: one series per instance (30% on GPU instance 1, nothing on 2), none
    # for the board.
    by_instance = {labels["GPU_I_ID"]: v for labels, v in find(samples, "DCGM_FI_PROF_SM_ACTIVE", gpu="1")}
    assert by_instance == {"1": 0.3, "2": 0.0}
    # The agent's own series carry the same figures.
    assert one(samples, "gpuledger_gpu_sm_active_ratio", gpu="0")[1] == 0.45
    assert one(samples, "gpuledger_mig_sm_active_ratio", gpu="1", mig="0")[1] == 0.3


def test_a_lost_gpu_has_no_dcgm_readings() -> None:
    samples = parse(exposition(run_rig("gpu-lost", duration_s=900, step_s=60)))
    assert one(samples, "gpuledger_gpu_up", gpu="1")[1] == 0
    for name in DCGM_HELP:
        assert find(samples, name, gpu="1") == [], name
        assert len(find(samples, name, gpu="0")) == 1, name


def test_help_and_type_lines_are_dcgm_exporters() -> None:
    text = exposition(run_rig("demo", duration_s=15)) + exposition(run_rig(HOPPER, duration_s=15))
    for name, help_text in {**DCGM_HELP, **DCGM_PROFILING_HELP}.items():
        assert f"# HELP {name} {help_text}\n" in text
        # All gauges; dcgm-exporter types the energy field a counter without `_total`, which
        # prometheus_client and OpenMetrics cannot express (see exporters/dcgm.py).
        assert f"# TYPE {name} gauge\n" in text


def test_the_catalogue_holds_exactly_what_is_emitted() -> None:
    emitted: dict[str, set[str]] = {}
    # `health`: the boards with a fan and with retired pages, and its faults; HOPPER: GPM.
    for scenario in ("demo", "mig", "health", HOPPER):
        for name, labels, _ in parse(exposition(run_rig(scenario, duration_s=15))):
            if name.startswith("DCGM_"):
                emitted.setdefault(name, set()).update(labels)
    every_help = DCGM_HELP | DCGM_PROFILING_HELP | DCGM_HEALTH_HELP
    assert set(emitted) == {spec.name for spec in DCGM_CATALOGUE} == set(every_help)
    for name, labels in emitted.items():
        spec = DCGM_BY_NAME[name]
        assert spec.help == every_help[name]
        assert labels <= {*spec.labels, *spec.optional_labels}, name


def test_off_by_default_and_switched_on_by_config_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    state = run_rig("demo", duration_s=15)
    assert "DCGM_" not in exposition(state, dcgm_compat=False)
    assert Settings().exporters.dcgm_compat is False
    assert Settings(exporters={"dcgm_compat": True}).exporters.dcgm_compat is True
    monkeypatch.setenv("GPULEDGER_EXPORTERS__DCGM_COMPAT", "true")
    assert Settings().exporters.dcgm_compat is True


def test_openmetrics_output_with_dcgm_series_parses() -> None:
    # Prometheus asks for OpenMetrics first; a counter without `_total` would fail the scrape.
    state = run_rig("demo", duration_s=15)
    text = generate_openmetrics(make_registry(lambda: state, dcgm_compat=True)).decode()
    names = {f.name for f in parse_openmetrics(text)}
    assert set(DCGM_HELP) <= names


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (scripts/check installs it)")
def test_promtool_finds_only_dcgm_exporters_own_label_names() -> None:
    state = run_rig("mig", duration_s=15)

    def promtool(text: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False)

    ours = promtool(exposition(state, dcgm_compat=False))
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert (ours.stdout + ours.stderr).strip() == ""
    combined = promtool(exposition(state))
    # Exit 3 is "lint findings" (a parse error is 1). dcgm-exporter's own output draws the same
    # findings: its `modelName` label is camelCase, and DCGM_FI_DEV_PCIE_REPLAY_COUNTER (one of its
    # default counters) names a type. Nothing else may be found.
    assert combined.returncode == 3, combined.stdout + combined.stderr
    findings = (combined.stdout + combined.stderr).strip().splitlines()
    camel = re.compile(r"^DCGM_FI_DEV_\w+ label names should be written in 'snake_case' not 'camelCase'$")
    replay = "DCGM_FI_DEV_PCIE_REPLAY_COUNTER metric name should not include type 'counter'"
    assert findings
    assert all(camel.match(line) or line == replay for line in findings), findings


def test_run_serves_dcgm_series_when_the_environment_switches_them_on(tmp_path: Any) -> None:
    daemon = Daemon(
        tmp_path, "--fake", env={"GPULEDGER_POLL_INTERVAL": "0.2s", "GPULEDGER_EXPORTERS__DCGM_COMPAT": "1"}
    )
    try:
        text = daemon.wait_for(lambda t: "DCGM_FI_DEV_GPU_UTIL" in t)
        assert value(text, "DCGM_FI_DEV_GPU_UTIL", gpu="0", device="nvidia0") == 92
        assert value(text, "DCGM_FI_DEV_FB_USED", gpu="5", pod="notebook-7") == 30000
        assert value(text, "gpuledger_gpu_utilization_ratio", gpu="0") == pytest.approx(0.92)
    finally:
        assert daemon.stop() == 0
