"""What one poll costs: gpuledger's sampler against nvitop and against bare pynvml calls.

    python bench/snapshot.py [--polls N] [--warmup N] [--scale-polls N]

All three read the same fake node (the built-in `demo` node, scaled to 8 GPUs x 64 processes,
no faults and so no injected latency) through the same real `pynvml` module:

  gpuledger  the agent's sampler, built by build_agent as the CLI builds it: its whole poll,
             snapshot included.
  nvitop     nvitop's Device API, one fresh read of every field per poll.
  floor      bare pynvml wrapper calls, one call per reading, handles obtained once: the least
             a poll of these fields can cost.

A scale section then polls two large nodes, each with the sampler alone and with attribution
(`Attributor` as the CLI wires it: procfs, passwd, Slurm map files, pod log directories), and
prints each figure beside its target:

  56 MIG     8 A100-SXM4-80GB x 7 MIG 1g.10gb instances, 1000 processes, one Slurm job per
             instance (the issue's "MIG x 1000" node)
  2048 proc  the demo node's 8 whole GPUs with 2048 processes, 256 per GPU, one Slurm job per GPU

Each round moves the fake clock 5 s, then polls all three (in a rotating order, so that no
reader always runs first or last) at the same scenario instant; every reader sees new
per-process utilization samples each round. Timings are wall time (`time.perf_counter`) of
the poll alone; NVML C-function calls are counted by the fake (`node.calls`). Only the
timings vary from run to run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

import pynvml
import yaml

import fake_nvml
from agent.attribution.sources.procfs import ProcessSource
from agent.cli.wiring import Agent, build_agent
from agent.config import ReadingsConfig, Settings
from agent.model import VIOLATION_CAUSES, Snapshot, Telemetry
from fake_nvml.scenario import SCENARIO_DIR

GPUS = 8
PROCESSES_PER_GPU = 8
STEP_S = 5.0
# Near the top of Linux's pid space (PID_MAX_LIMIT, 2**22, the most a scenario takes: a real
# driver reports no larger pid): a host hands out pids from the bottom and wraps at pid_max, so
# none of its processes has these in practice, and nvitop's psutil lookups of them
# (Device.processes() builds a host process per GPU process) behave the same on every machine.
# (5,000,000, above the limit, was refused by the scenario parser from b950ebb on: this bench
# stopped at its first scenario.)
PID_BASE = 4_100_000

TARGET_TIME_VS_NVITOP = 0.5
TARGET_TIME_VS_FLOOR = 1.3
TARGET_CALLS_VS_FLOOR = 1.0
TARGET_CALLS_PER_GPU = 10.0  # every default reading of `readings:` on
TARGET_SCALE_CALLS_PER_GPU = 10.0
TARGET_MIG_SAMPLER_AND_ATTRIBUTION_MS = 50.0


NOTES = (
    "nvitop 1.7 has no energy or NVLink-state method: both are read through Device.__getattr__'s"
    " pynvml pass-through, d.total_energy_consumption() and d.nv_link_state(link).",
    "nvitop's Device.processes() reads the per-process samples of the last second of wall time, with"
    " its clock put on the scenario's: 1 sample per process per poll; gpuledger and the floor read"
    " every sample since their previous poll (5).",
    "nvitop's time includes the psutil host-process objects Device.processes() builds (no NVML calls).",
    "Attribution: the whole pipeline poll (sampler + attribution) against the sampler alone. Steady: the"
    " same 64 processes every poll, so each costs one read of /proc/<pid>/stat; cold: the process cache"
    " emptied before every poll, so all 64 are read in full (stat, status, cmdline, cgroup, environ).",
    "Health readings (all three readers): clocks and their maxima, fan, performance state, clock-event"
    " reasons, violation time, ECC, retired pages, remapped rows, PCIe link and replays, NVLink errors and"
    " traffic, encoder, decoder, memory controller. gpuledger batches every counter NVML has a field id for into"
    " its one nvmlDeviceGetFieldValues call, reads the maxima once (and the memory clock of a board that"
    " supports one memory clock: HBM), and the rest (the SM clock, a GDDR board's memory clock,"
    " performance state, clock-event reasons, fan, PCIe link, encoder, decoder, and the counters)"
    " every readings.slow_interval (30s): with the clock moving 5s a poll, one poll in six (the fractional"
    " counts). nvitop reads those nvitop has no"
    " method for through Device.__getattr__'s pynvml pass-through, one call each (36 for the NVLink errors of a"
    " 12-link GPU).",
    "Scale: medians over --scale-polls polls; attribution steady (process cache warm), each device allocated to"
    " one Slurm job. Calls are per physical GPU (a MIG GPU's instances count toward their GPU); us/process is"
    " the sampler's time over the node's processes: flat from 512 to 2048 processes means linear growth.",
    "Calls per GPU per poll: a whole GPU makes 7 calls a poll (field values, memory, utilization, temperature,"
    " processes, process samples, device samples) and 7 more every slow interval (8 on a GDDR board,"
    " whose memory clock moves; an A100's or H100's HBM has one memory clock, read once), and its MPS-client"
    " and graphics process lists once a slow interval while both are empty (2); a MIG-enabled GPU"
    " makes 3 (field values, temperature, the process list of all its instances), reads an instance's memory"
    " where its processes' memory changed (else once a slow interval, 7 calls when fully split) and takes its"
    " 5 health calls on the slow rhythm. Averaged over whole slow intervals (30s, 6 polls at 5s).",
    "H100 (GPM on, its default): GPM adds a sample and a metrics call per device a poll; a whole H100 skips"
    " its device utilization samples (SM activity is its busy source), so 8 a poll and 7 + 2 slow: 9.50"
    " (10.33 while the SM clock was read every poll). A fully"
    " split H100 pays 2 per instance each time it reads their activity (NVML samples and computes one GPU"
    " instance per call): by default (readings.mig_activity slow) once a slow interval, with the GPU's own"
    " GPM, so 3 a poll and 12 + 2 + 14 slow: 7.67; 'every_poll' reads all of it each poll (21.00), 'off'"
    " no instance activity, the GPU's own each poll (7.00).",
)


# -- the node -------------------------------------------------------------------------------------


def scaled_demo() -> dict[str, Any]:
    """demo.yaml's node and GPUs with 64 processes, 8 per GPU, of varied load and memory."""
    demo = yaml.safe_load((SCENARIO_DIR / "demo.yaml").read_text())
    assert sum(g.get("count", 1) for g in demo["gpus"]) == GPUS, "demo.yaml no longer has 8 GPUs"
    processes = []
    for gpu in range(GPUS):
        for slot in range(PROCESSES_PER_GPU):
            n = gpu * PROCESSES_PER_GPU + slot
            processes.append(
                {
                    "pid": PID_BASE + n,
                    "gpus": [gpu],
                    "sm_util": 1 + (7 * slot + 3 * gpu) % 19,  # 1..19 %: never 0, so every pid has samples
                    "memory_mib": 2048 + 1024 * ((5 * n) % 9),  # 2..10 GiB: at most 80 GiB per GPU
                    "uid": 1000 + slot,
                    "cmdline": f"python worker.py --rank {n}",
                }
            )
    return {"start": demo["start"], "node": demo["node"], "gpus": demo["gpus"], "processes": processes}


def scale_node(*, mig: bool, processes: int, model: str = "A100-SXM4-80GB") -> dict[str, Any]:
    """The demo node's 8 GPUs, whole or each cut into 7 x 1g.10gb, with `processes` spread
    round-robin over the devices; each device is allocated to one Slurm job that its
    processes belong to, as on a batch node. `model` other than the demo's A100 replaces its
    GPUs (an H100 has GPM: activity sampled each poll)."""
    demo = yaml.safe_load((SCENARIO_DIR / "demo.yaml").read_text())
    if mig:
        gpus: list[dict[str, Any]] = [{"model": model, "count": GPUS, "mig": ["1g.10gb"] * 7}]
        devices = [f"{g}:{m}" for g in range(GPUS) for m in range(7)]
    else:
        gpus = demo["gpus"] if model == "A100-SXM4-80GB" else [{"model": model, "count": GPUS, "nvlink_links": 18}]
        devices = [str(g) for g in range(GPUS)]
    jobs = {device: str(70000 + n) for n, device in enumerate(devices)}
    return {
        "start": demo["start"],
        "node": demo["node"],
        "gpus": gpus,
        "processes": [
            {
                "pid": PID_BASE + n,
                "gpus": [_ref(devices[n % len(devices)])],
                "sm_util": 1 + (7 * n) % 19,
                "memory_mib": 16 + n % 8,  # 256 processes of at most 23 MiB fit a 10 GB instance
                "uid": 1000 + n % 16,
                "cmdline": f"python worker.py --rank {n}",
                "slurm_job": jobs[devices[n % len(devices)]],
            }
            for n in range(processes)
        ],
        "allocations": [
            {"gpus": [_ref(device)], "slurm_job": job, "user": f"user{n % 16}"}
            for n, (device, job) in enumerate(jobs.items())
        ],
    }


def _ref(device: str) -> int | str:
    return device if ":" in device else int(device)


# -- the readers ----------------------------------------------------------------------------------
#
# Each reader is a setup that runs once (not timed) and returns the poll to time, plus a
# function that turns one poll's result into the common form below, to check (outside the
# timing) that all three really read the same values.

# Per GPU: util %, memory used B, memory total B, temperature C, power mW, energy mJ, NVLink
# up per link, (pid, GPU memory B, SM util %) per process, and the health readings (HEALTH).
Reading = tuple[int, int, int, int, int, int, tuple[bool, ...], tuple[tuple[int, int, int], ...], tuple[object, ...]]

# The health readings every reader takes each poll, in the order of their tuple in a Reading:
# what gpuledger reads with every default group of `readings:` on. A reading the GPU does not
# have is None. NVLink traffic is MiB/s summed over links and directions since the last poll.
HEALTH = (
    "sm clock MHz", "memory clock MHz", "max sm clock MHz", "max memory clock MHz", "fan %",
    "performance state", "clock event reasons", "violation ns (8 policies)", "ECC errors (4 counters)",
    "retired pages (sbe, dbe, pending)", "remapped rows (corr, unc, pending, failure)", "PCIe gen", "PCIe width",
    "PCIe max gen", "PCIe max width", "PCIe replays", "NVLink errors (crc, replay, recovery per link)",
    "NVLink MiB/s", "encoder %", "decoder %", "memory controller %",
)  # fmt: skip
POLICIES = (0, 1, 2, 3, 4, 5, 10, 11)  # nvmlPerfPolicyType_t, in gpuledger's VIOLATION_CAUSES order
ECC_COUNTERS = ((0, 0), (1, 0), (0, 1), (1, 1))  # (error type, counter type) in Telemetry's order
NVLINK_COUNTERS = (2, 0, 1)  # DL_CRC_FLIT, DL_REPLAY, DL_RECOVERY: crc, replay, recovery


@dataclass
class Reader:
    name: str
    poll: Callable[[], Any]
    readings: Callable[[Any], list[Reading]]
    times_s: list[float] = field(default_factory=list)
    calls: Counter[str] = field(default_factory=Counter)
    last: Any = None


def gpuledger_reader(agent: Agent) -> Reader:
    sampler = agent.sampler

    def readings(snapshot: Snapshot) -> list[Reading]:
        return [
            (
                round((d.utilization or 0) * 100),
                d.memory_used_bytes or 0,
                d.memory_total_bytes or 0,
                round(d.temperature_c or 0),
                round((d.power_w or 0) * 1000),
                round((d.energy_j or 0) * 1000),
                tuple(link.up for link in d.nvlinks),
                tuple(sorted((p.pid, p.used_memory_bytes or 0, round((p.sm_util or 0) * 100)) for p in d.processes)),
                _gpuledger_health(d.telemetry),
            )
            for d in snapshot.devices
        ]

    return Reader("gpuledger", sampler.poll, readings)


def _mhz(hz: float | None) -> int | None:
    return None if hz is None else round(hz / 1e6)


def _pct(ratio: float | None) -> int | None:
    return None if ratio is None else round(ratio * 100)


def _gpuledger_health(t: Telemetry | None) -> tuple[object, ...]:
    assert t is not None
    violations = dict(t.violation_s)
    return (
        _mhz(t.sm_clock_hz),
        _mhz(t.memory_clock_hz),
        _mhz(t.sm_clock_max_hz),
        _mhz(t.memory_clock_max_hz),
        _pct(t.fan_speed_ratio),
        t.performance_state,
        t.clock_event_reasons,
        tuple(round(violations[cause] * 1e9) if cause in violations else None for cause in VIOLATION_CAUSES),
        (t.ecc_corrected_volatile, t.ecc_uncorrected_volatile, t.ecc_corrected_aggregate, t.ecc_uncorrected_aggregate),
        (t.retired_pages_single_bit, t.retired_pages_double_bit, t.retired_pages_pending),
        (t.remapped_rows_correctable, t.remapped_rows_uncorrectable, t.row_remap_pending, t.row_remap_failure),
        t.pcie_link_generation,
        t.pcie_link_width,
        t.pcie_link_generation_max,
        t.pcie_link_width_max,
        t.pcie_replays,
        tuple((link.crc_errors, link.replay_errors, link.recovery_errors) for link in t.nvlinks),
        None if t.nvlink_bytes_per_s is None else round(t.nvlink_bytes_per_s / 2**20),
        _pct(t.encoder_utilization),
        _pct(t.decoder_utilization),
        _pct(t.memory_utilization),
    )


class _ScenarioTime:
    """The `time` module as nvitop.api.device sees it, with `time_ns` on the scenario clock."""

    def __init__(self, wall_time: Callable[[], float]) -> None:
        self._wall_time = wall_time

    def time_ns(self) -> int:
        return round(self._wall_time() * 1e9)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def nvitop_reader(node: fake_nvml.InstalledNode) -> Reader:
    # Imported only now: nvitop's pynvml must find the fake already installed.
    import nvitop.api.device
    from nvitop import Device

    # Device.processes() asks NVML for the per-process samples of the last second of *wall*
    # time (time.time_ns() - 1 s), as a real node's driver stamps samples with the host clock.
    # The fake stamps them with the scenario clock, which does not run with real time, so point
    # nvitop's clock at the scenario's: it then sees what it would see on a real node (the
    # newest sample of each process) instead of none at all.
    nvitop.api.device.time = _ScenarioTime(node.clock.wall_time)  # type: ignore[assignment]

    # Caching, checked in nvitop 1.7: the API Device (nvitop.api) caches no reading across
    # calls; its `ttl_cache`s (5 s) sit only on the TUI's Device subclass (nvitop.tui), unused
    # here. oneshot() memoizes readings within one `with` block, i.e. within this one poll, and a
    # Device memoizes two static facts (memory total, NVLink link count), as gpuledger does at
    # discovery. So every poll below really reads NVML: no real time needs to pass between polls.
    devices = Device.all()
    for d in devices:
        d.nvlink_throughput()  # its first call waits 20 ms for a second reading: not in a timed poll

    def health(d: Any) -> tuple[object, ...]:
        # nvitop 1.7 reads clocks, fan, performance state, utilizations and NVLink traffic with
        # methods of its own; everything else through Device.__getattr__'s pynvml pass-through
        # (d.remapped_rows() is pynvml.nvmlDeviceGetRemappedRows), one call per reading, NA
        # where NVML answers NotSupported.
        links = d.nvlink_link_count()
        traffic = d.nvlink_throughput()
        return (
            d.sm_clock(),
            d.memory_clock(),
            d.max_sm_clock(),
            d.max_memory_clock(),
            d.fan_speed(),
            int(str(d.performance_state()).removeprefix("P")),  # nvitop says "P0"
            d.current_clocks_event_reasons(),
            tuple(_na(d.violation_status(policy)) for policy in POLICIES),
            tuple(d.total_ecc_errors(kind, counter) for kind, counter in ECC_COUNTERS),
            (_na(d.retired_pages(0)), _na(d.retired_pages(1)), _na(d.retired_pages_pending_status())),
            _na(d.remapped_rows()),
            d.curr_pcie_link_generation(),
            d.curr_pcie_link_width(),
            d.max_pcie_link_generation(),
            d.max_pcie_link_width(),
            d.pcie_replay_counter(),
            tuple(
                tuple(d.nv_link_error_counter(link, counter) for counter in NVLINK_COUNTERS) for link in range(links)
            ),
            round(sum(t.tx + t.rx for t in traffic) / 1024),  # nvitop rounds each link's KiB/s
            d.encoder_utilization(),
            d.decoder_utilization(),
            d.memory_utilization(),
        )

    def poll() -> list[tuple[Any, ...]]:
        rows = []
        for d in devices:
            with d.oneshot():
                rows.append(
                    (
                        d.gpu_utilization(),
                        d.memory_used(),
                        d.memory_total(),
                        d.temperature(),
                        d.power_usage(),
                        # nvitop 1.7 has no energy or NVLink-state method: Device.__getattr__
                        # forwards these names to pynvml.nvmlDeviceGetTotalEnergyConsumption and
                        # pynvml.nvmlDeviceGetNvLinkState (NotSupported becomes NA).
                        d.total_energy_consumption(),
                        [d.nv_link_state(link) for link in range(d.nvlink_link_count())],
                        {pid: (p.gpu_memory(), p.gpu_sm_utilization()) for pid, p in d.processes().items()},
                        health(d),
                    )
                )
        return rows

    def readings(rows: list[tuple[Any, ...]]) -> list[Reading]:
        result = []
        for util, used, total, temp, power, energy, links, procs, healths in rows:
            links_up = tuple(bool(s) for s in links)
            per_process = tuple(sorted((pid, memory, sm_util) for pid, (memory, sm_util) in procs.items()))
            result.append((util, used, total, temp, power, energy, links_up, per_process, _normalised(healths)))
        return result

    return Reader(f"nvitop {nvitop.__version__}", poll, readings)


def floor_reader(node: fake_nvml.InstalledNode) -> Reader:
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    links = [_count_links(h) for h in handles]
    traffic: dict[int, tuple[float, int]] = {}  # per GPU: (field timestamp, KiB) of the last poll
    # Per-process samples since the previous poll, as gpuledger asks for them (passing 0 instead
    # would re-read each process's whole sample buffer every poll and slow the floor down).
    last_seen = [0] * len(handles)
    # The device's own utilization samples since the previous poll, as gpuledger reads them too.
    device_seen = [0] * len(handles)

    # Each reading is taken out of its ctypes struct into a plain value, as any caller must to
    # use it; nothing more (no per-pid averaging, no objects): that is left to `readings`.
    def poll() -> list[tuple[Any, ...]]:
        rows = []
        for i, h in enumerate(handles):
            util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
            memory = pynvml.nvmlDeviceGetMemoryInfo(h)
            temperature = pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
            power = pynvml.nvmlDeviceGetPowerUsage(h)
            energy = pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
            nvlinks = [pynvml.nvmlDeviceGetNvLinkState(h, link) for link in range(links[i])]
            processes = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
            try:
                samples = [
                    (s.pid, s.timeStamp, s.smUtil) for s in pynvml.nvmlDeviceGetProcessUtilization(h, last_seen[i])
                ]
            except pynvml.NVMLError_NotFound:
                samples = []
            if samples:
                last_seen[i] = max(stamp for _, stamp, _ in samples)
            try:
                _kind, found = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, device_seen[i])
                device = [(s.timeStamp, s.sampleValue.uiVal) for s in found]
            except pynvml.NVMLError_NotFound:
                device = []
            if device:
                device_seen[i] = max(stamp for stamp, _ in device)
            health = _floor_health(h, links[i], traffic, i)
            rows.append(
                (util, memory.used, memory.total, temperature, power, energy, nvlinks, processes, samples, health)
            )
        return rows

    def readings(rows: list[tuple[Any, ...]]) -> list[Reading]:
        result = []
        for util, used, total, temperature, power, energy, nvlinks, processes, samples, health in rows:
            per_pid: dict[int, list[int]] = {}
            for pid, _, sm_util in samples:
                per_pid.setdefault(pid, []).append(sm_util)
            procs = tuple(
                sorted((pid, memory, round(statistics.fmean(per_pid.get(pid, [0])))) for pid, memory in processes)
            )
            links_up = tuple(bool(s) for s in nvlinks)
            result.append((util, used, total, temperature, power, energy, links_up, procs, _normalised(health)))
        return result

    return Reader("floor (bare pynvml)", poll, readings)


def _maybe(call: Callable[..., Any], *args: Any) -> Any:
    """A pynvml call's answer, or None where the GPU does not have the reading."""
    try:
        return call(*args)
    except pynvml.NVMLError_NotSupported:
        return None


def _floor_health(h: Any, links: int, traffic: dict[int, tuple[float, int]], gpu: int) -> tuple[object, ...]:
    """The health readings by bare pynvml calls, one per reading; NVLink traffic from the data
    counters (in one field-values call: there is no other) against the previous poll's."""
    fields = [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, n) for n in range(links)]
    fields += [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, n) for n in range(links)]
    values = pynvml.nvmlDeviceGetFieldValues(h, fields) if links else []
    kib = sum(v.value.ullVal for v in values)
    stamp = max((v.timestamp for v in values), default=0)
    previous, traffic[gpu] = traffic.get(gpu), (stamp, kib)
    rate = (
        None
        if previous is None or stamp <= previous[0]
        else round((kib - previous[1]) * 1e6 / (stamp - previous[0]) / 1024)
    )
    retired = (_maybe(pynvml.nvmlDeviceGetRetiredPages, h, 0), _maybe(pynvml.nvmlDeviceGetRetiredPages, h, 1))
    return (
        pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
        pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
        pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
        pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM),
        _maybe(pynvml.nvmlDeviceGetFanSpeed, h),
        pynvml.nvmlDeviceGetPerformanceState(h),
        pynvml.nvmlDeviceGetCurrentClocksEventReasons(h),
        tuple(pynvml.nvmlDeviceGetViolationStatus(h, policy).violationTime for policy in POLICIES),
        tuple(pynvml.nvmlDeviceGetTotalEccErrors(h, kind, counter) for kind, counter in ECC_COUNTERS),
        (*(None if r is None else len(r) for r in retired), _maybe(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h)),
        _maybe(pynvml.nvmlDeviceGetRemappedRows, h),
        pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
        pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
        pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
        pynvml.nvmlDeviceGetMaxPcieLinkWidth(h),
        pynvml.nvmlDeviceGetPcieReplayCounter(h),
        tuple(
            tuple(pynvml.nvmlDeviceGetNvLinkErrorCounter(h, link, counter) for counter in NVLINK_COUNTERS)
            for link in range(links)
        ),
        rate,
        pynvml.nvmlDeviceGetEncoderUtilization(h)[0],
        pynvml.nvmlDeviceGetDecoderUtilization(h)[0],
        pynvml.nvmlDeviceGetUtilizationRates(h).memory,
    )


def _na(value: Any) -> Any:
    """nvitop's NA as None; a violation-time struct as its nanoseconds."""
    from nvitop import NA

    if value is NA:
        return None
    if hasattr(value, "violationTime"):
        return value.violationTime
    if isinstance(value, list):  # nvmlDeviceGetRetiredPages: the pages retired
        return len(value)
    return value


def _normalised(health: tuple[object, ...]) -> tuple[object, ...]:
    """Booleans as 0/1 and nested sequences as tuples, so readers compare equal."""

    def norm(value: object) -> object:
        from nvitop import NA

        if value is NA:
            return None
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, (list, tuple)):
            return tuple(norm(v) for v in value)
        return value

    return tuple(norm(value) for value in health)


def _count_links(handle: Any) -> int:
    links = 0
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError:
            break
        links += 1
    return links


# -- measuring ------------------------------------------------------------------------------------


def run(node: fake_nvml.InstalledNode, readers: list[Reader], polls: int, warmup: int) -> None:
    """`warmup` untimed rounds, then `polls` timed ones; each round moves the clock STEP_S."""
    gc.collect()
    for round_ in range(warmup + polls):
        node.clock.advance(STEP_S)
        shift = round_ % len(readers)
        for reader in readers[shift:] + readers[:shift]:
            before = Counter(node.calls)
            started = time.perf_counter()
            result = reader.poll()
            elapsed = time.perf_counter() - started
            reader.last = result
            if round_ >= warmup:
                reader.times_s.append(elapsed)
                reader.calls.update(node.calls - before)


def disagreements(readers: list[Reader]) -> list[str]:
    """Where the last round's readings differ from the first reader's, one line each."""
    reference = readers[0].readings(readers[0].last)
    problems = []
    for reader in readers[1:]:
        readings = reader.readings(reader.last)
        if len(readings) != len(reference):
            problems.append(f"{reader.name}: {len(readings)} GPUs, {readers[0].name} {len(reference)}")
            continue
        names = ("util", "memory used", "memory total", "temperature", "power", "energy", "nvlink", "processes")
        for gpu, (ours, theirs) in enumerate(zip(reference, readings, strict=True)):
            problems.extend(
                f"GPU {gpu} {what}: {readers[0].name} {a!r}, {reader.name} {b!r}"
                for what, a, b in zip(names, ours[:-1], theirs[:-1], strict=True)
                if a != b
            )
            problems.extend(
                f"GPU {gpu} {what}: {readers[0].name} {a!r}, {reader.name} {b!r}"
                for what, a, b in zip(HEALTH, ours[-1], theirs[-1], strict=True)
                if a != b
            )
    return problems


# -- reporting ------------------------------------------------------------------------------------


def table(rows: Iterable[Iterable[object]], align: str) -> list[str]:
    """Rows as aligned text; `align` gives each column's alignment, "<" or ">"."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(align))]
    return ["  ".join(f"{c:{a}{w}}" for c, a, w in zip(row, align, widths, strict=True)).rstrip() for row in cells]


def poll_cost_section(readers: list[Reader], polls: int) -> list[str]:
    gl, nv, fl = readers
    ms = {r.name: statistics.median(r.times_s) * 1000 for r in readers}
    per_gpu = {r.name: sum(r.calls.values()) / polls / GPUS for r in readers}
    lines = table(
        [("reader", "median ms/poll", "NVML calls/GPU/poll")]
        + [(r.name, f"{ms[r.name]:.3f}", f"{per_gpu[r.name]:.1f}") for r in readers],
        "<>>",
    )

    def verdict(ratio: float, target: float | None) -> tuple[str, str]:
        if target is None:
            return "-", "-"
        return f"<= {target:.2f}x", "PASS" if ratio <= target else "MISS"

    checks = [
        ("time", nv, TARGET_TIME_VS_NVITOP),
        ("time", fl, TARGET_TIME_VS_FLOOR),
        ("calls/GPU", nv, None),
        ("calls/GPU", fl, TARGET_CALLS_VS_FLOOR),
    ]
    ratio_rows: list[tuple[str, ...]] = [("ratio", "", "value", "target", "result")]
    for what, other, target in checks:
        figures = ms if what == "time" else per_gpu
        ratio = figures[gl.name] / figures[other.name]
        ratio_rows.append((what, f"gpuledger / {other.name}", f"{ratio:.3f}x", *verdict(ratio, target)))
    calls = per_gpu[gl.name]
    ratio_rows.append(
        (
            "calls/GPU",
            "gpuledger, every default reading",
            f"{calls:.2f}",
            f"<= {TARGET_CALLS_PER_GPU:g}",
            "PASS" if calls <= TARGET_CALLS_PER_GPU else "MISS",
        )
    )
    lines += ["", *table(ratio_rows, "<<>>>")]

    functions = sorted(set().union(*(r.calls for r in readers)))
    breakdown = [("NVML calls/GPU/poll", *(r.name for r in readers))]
    breakdown += [(fn, *(f"{r.calls[fn] / polls / GPUS:.1f}" for r in readers)) for fn in functions]
    breakdown.append(("total", *(f"{per_gpu[r.name]:.1f}" for r in readers)))
    lines += ["", *table(breakdown, "<" + ">" * len(readers))]
    return lines


def attribution_section(agent: Agent, polls: int, warmup: int) -> list[str]:
    """Per-poll cost of sampling plus attribution, with the process cache warm and cold."""
    node, sampler, attributor = agent.node, agent.sampler, agent.attributor
    processes = attributor.source(ProcessSource)
    assert node is not None
    times: dict[str, list[float]] = {"sampler only": [], "steady (cached)": [], "cold (all new)": []}
    for i in range(warmup + polls):
        for name, samples in times.items():
            node.clock.advance(STEP_S)
            if name == "cold (all new)":
                processes.forget()
            gc.disable()
            started = time.perf_counter()
            snapshot = sampler.poll()
            if name != "sampler only":
                attribution = attributor.attribute(snapshot)
            elapsed = time.perf_counter() - started
            gc.enable()
            if i >= warmup:
                samples.append(elapsed)
    if {h.workload.user for h in attribution.holdings} != {str(1000 + slot) for slot in range(PROCESSES_PER_GPU)}:
        raise SystemExit("attribution did not find the processes' users: the measurement is void")
    base = statistics.median(times["sampler only"])
    rows: list[tuple[str, ...]] = [("poll with attribution", "median ms/poll", "vs sampler only")]
    for name, samples in times.items():
        ms = statistics.median(samples)
        rows.append((name, f"{ms * 1000:.3f}", f"{ms / base:.2f}x"))
    return table(rows, "<>>")


@dataclass
class ScaleCase:
    name: str
    scenario: dict[str, Any]
    target_ms: float | None  # sampler + attribution


SCALE_CASES = (
    ScaleCase("56 MIG x 1000 processes", scale_node(mig=True, processes=1000), TARGET_MIG_SAMPLER_AND_ATTRIBUTION_MS),
    ScaleCase("8 GPUs x 512 processes", scale_node(mig=False, processes=512), None),
    ScaleCase("8 GPUs x 2048 processes", scale_node(mig=False, processes=2048), None),
)


def measure_scale(case: ScaleCase, polls: int, warmup: int) -> tuple[float, float, float]:
    """Median ms of the sampler's poll, median ms of poll + attribution (process cache warm),
    and NVML calls per physical GPU per poll."""
    agent = build_agent(Settings(), fake=case.scenario, costing=False, rules=())
    node, sampler, attributor = agent.node, agent.sampler, agent.attributor
    assert node is not None
    try:
        sampler_s: list[float] = []
        both_s: list[float] = []
        calls = 0
        gc.collect()
        for i in range(warmup + polls):
            node.clock.advance(STEP_S)
            node.sync_host(node.now())  # the host's files move with the clock, outside the timing
            before = sum(node.calls.values())
            gc.disable()
            started = time.perf_counter()
            sampler.poll()
            elapsed = time.perf_counter() - started
            gc.enable()
            if i >= warmup:
                sampler_s.append(elapsed)
                calls += sum(node.calls.values()) - before
            node.clock.advance(STEP_S)
            node.sync_host(node.now())
            before = sum(node.calls.values())
            gc.disable()
            started = time.perf_counter()
            attribution = attributor.attribute(sampler.poll())
            elapsed = time.perf_counter() - started
            gc.enable()
            if i >= warmup:
                both_s.append(elapsed)
                # Both polls' calls count: the readings read every slow interval fall on either.
                calls += sum(node.calls.values()) - before
        held = {h.device_uuid for h in attribution.holdings if h.allocated and h.workload.hpc_job}
        devices = [d for d in sampler.poll().devices if d.processes]
        if len(held) != len(devices):
            raise SystemExit(f"{case.name}: attribution found {len(held)} Slurm jobs for {len(devices)} devices")
    finally:
        agent.close()
    return statistics.median(sampler_s) * 1000, statistics.median(both_s) * 1000, calls / (2 * polls) / GPUS


def scale_section(polls: int, warmup: int) -> list[str]:
    rows: list[tuple[str, ...]] = [
        (
            "scale",
            "sampler ms",
            "us/process",
            "sampler+attribution ms",
            "target",
            "NVML calls/GPU/poll",
            "target",
            "result",
        )
    ]
    for case in SCALE_CASES:
        sampler_ms, both_ms, per_gpu = measure_scale(case, polls, warmup)
        ok = per_gpu <= TARGET_SCALE_CALLS_PER_GPU and (case.target_ms is None or both_ms <= case.target_ms)
        rows.append(
            (
                case.name,
                f"{sampler_ms:.2f}",
                f"{sampler_ms * 1000 / len(case.scenario['processes']):.1f}",
                f"{both_ms:.2f}",
                "-" if case.target_ms is None else f"<= {case.target_ms:g}",
                f"{per_gpu:.1f}",
                f"<= {TARGET_SCALE_CALLS_PER_GPU:g}",
                "PASS" if ok else "MISS",
            )
        )
    return table(rows, "<>>>>>>>")


def scaled_demo_h100() -> dict[str, Any]:
    """scaled_demo's processes on 8 H100s (GPM on, as it is by default where the GPU has it)."""
    scenario = scaled_demo()
    scenario["gpus"] = [{"model": "H100-SXM5-80GB", "count": GPUS, "nvlink_links": 18}]
    return scenario


H100_MIG = scale_node(mig=True, processes=1000, model="H100-SXM5-80GB")
# (name, its column in the per-function table, scenario, `readings:` keys set otherwise than by
# default: none is the default configuration)
CALL_CASES: tuple[tuple[str, str, dict[str, Any], dict[str, Any]], ...] = (
    ("whole GPU (8 x A100, 64 processes)", "A100", scaled_demo(), {}),
    ("MIG GPU (8 x A100, 7 x 1g.10gb, 1000 processes)", "A100 MIG", scale_node(mig=True, processes=1000), {}),
    ("whole GPU (8 x H100, GPM, 64 processes)", "H100", scaled_demo_h100(), {}),
    ("MIG GPU (8 x H100, GPM, 7 x 1g.10gb, 1000 processes)", "H100 MIG", H100_MIG, {}),
    (
        "  the same, readings.mig_activity every_poll (not default)",
        "every_poll",
        H100_MIG,
        {"mig_activity": "every_poll"},
    ),
    ("  the same, readings.mig_activity off (not default)", "off", H100_MIG, {"mig_activity": "off"}),
)


def calls_per_gpu(
    scenario: dict[str, Any], slow_intervals: int, readings: dict[str, Any] | None = None
) -> tuple[float, Counter[str]]:
    """NVML calls per GPU per poll over whole slow intervals (the readings read every
    `readings.slow_interval` fall once in each), after two of warm-up (a meter on the slow rhythm
    allocates its second sample buffer at its second sample, one slow interval in); and per
    function. `readings`: keys of `readings:` set otherwise than by default (none: the defaults)."""
    settings = Settings(readings=ReadingsConfig(**(readings or {})))
    agent = build_agent(settings, fake=scenario, costing=False, rules=())
    node = agent.node
    assert node is not None
    try:
        per_interval = round(agent.settings.readings.slow_interval / STEP_S)
        for _ in range(2 * per_interval):
            node.clock.advance(STEP_S)
            agent.sampler.poll()
        before = Counter(node.calls)
        polls = per_interval * slow_intervals
        for _ in range(polls):
            node.clock.advance(STEP_S)
            agent.sampler.poll()
        calls = Counter(node.calls) - before
    finally:
        agent.close()
    gpus = len(node.scenario.gpus)
    return sum(calls.values()) / polls / gpus, Counter({fn: n / polls / gpus for fn, n in calls.items()})


def calls_section(slow_intervals: int = 4) -> list[str]:
    """Calls per GPU per poll for whole and MIG GPUs, every default reading on, against the target."""
    rows: list[tuple[str, ...]] = [("NVML calls per GPU per poll", "calls", "target", "result")]
    breakdowns = []
    for name, _column, scenario, readings in CALL_CASES:
        per_gpu, by_function = calls_per_gpu(scenario, slow_intervals, readings)
        # The target is the default configuration's: a mode a user opts into is shown with its
        # cost, over the target or not, and is not judged.
        verdict = "PASS" if per_gpu <= TARGET_CALLS_PER_GPU else "over, opt-in" if readings else "MISS"
        rows.append((name, f"{per_gpu:.2f}", f"<= {TARGET_CALLS_PER_GPU:g}", verdict))
        breakdowns.append(by_function)
    lines = table(rows, "<>>>")
    functions = sorted(set().union(*breakdowns))
    detail = [("per function", *(column for _name, column, _scenario, _readings in CALL_CASES))]
    detail += [(fn, *(f"{b[fn]:.3f}" for b in breakdowns)) for fn in functions]
    return [*lines, "", *table(detail, "<" + ">" * len(breakdowns))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--polls", type=int, default=200, help="timed polls per reader (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed polls first (default 20)")
    parser.add_argument("--scale-polls", type=int, default=30, help="timed polls per scale case (default 30)")
    parser.add_argument("--scale-only", action="store_true", help="run only the scale section")
    parser.add_argument("--calls-only", action="store_true", help="run only the calls-per-GPU section")
    args = parser.parse_args(argv)
    if args.polls < 1 or args.warmup < 1:
        parser.error("--polls and --warmup must be at least 1")

    if args.scale_only:
        print("\n".join(scale_section(args.scale_polls, warmup=3)))
        return 0
    if args.calls_only:
        print("\n".join(calls_section()))
        return 0
    # The agent as the CLI builds it; only its sampler and attribution are timed here.
    agent = build_agent(Settings(), fake=scaled_demo(), costing=False, rules=())
    node = agent.node
    assert node is not None
    try:
        readers = [gpuledger_reader(agent), nvitop_reader(node), floor_reader(node)]
        run(node, readers, args.polls, args.warmup)
        problems = disagreements(readers)
        attribution = attribution_section(agent, args.polls, args.warmup)
    finally:
        agent.close()
    scale = scale_section(args.scale_polls, warmup=3)

    print(
        f"One poll of {GPUS} GPUs x {GPUS * PROCESSES_PER_GPU} processes (the demo node, scaled; no faults), "
        f"median of {args.polls} polls after {args.warmup} warm-up, fake clock +{STEP_S:g}s per poll"
    )
    sections = [
        poll_cost_section(readers, args.polls),
        calls_section(),
        attribution,
        scale,
    ]
    for section in sections:
        print()
        print("\n".join(section))
    print()
    print(
        "Readings agree: all three read the same values on the last poll."
        if not problems
        else "Readings DISAGREE on the last poll:\n  " + "\n  ".join(problems)
    )
    print()
    print("Notes:")
    for note in NOTES:
        print(f"- {note}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
