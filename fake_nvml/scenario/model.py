"""A scenario once validated: frozen data the fake node reads on every call and never re-checks.

Kept apart from the YAML reader: the code that consults a scenario on every NVML call (the
node, the library, the host files) is written against these shapes alone, whatever the file
looked like, and the defaults and checks stay in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any


class ScenarioError(ValueError):
    """A scenario that cannot be loaded; the message is one line naming the key and entry."""


@dataclass(frozen=True)
class GpuRef:
    """A whole GPU (`mig` None) or one MIG instance of it (`mig` = position in its `mig:` list)."""

    gpu: int
    mig: int | None = None

    def __str__(self) -> str:
        return str(self.gpu) if self.mig is None else f"{self.gpu}:{self.mig}"


@dataclass(frozen=True)
class MigInstance:
    profile: str
    slices: int
    memory_total_mib: int
    sm_count: int
    gpu_instance_id: int
    uuid: str


@dataclass(frozen=True)
class ActivityRow:
    """GPM activity (percent) of a GPU or a MIG instance, from its row's time to the next row's."""

    graphics_active: float | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    tensor_active: float | None = None
    dram_active: float | None = None


@dataclass(frozen=True)
class HealthRow:
    """A GPU's hardware health readings as a recorded trace holds them, in the driver's own
    units (MHz, percent, nanoseconds, KiB), so a replayed reading is the recorded one exactly.
    None (or absent from a mapping) where the recording has no value: the fake's physics then
    answers. Maxima sit beside the current figures because a trace of a real board keeps the
    board's own, whatever the fake's data sheets say of its model."""

    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    memory_clock_max_mhz: int | None = None
    fan_percent: int | None = None
    performance_state: int | None = None
    clock_event_reasons: int | None = None
    violation_ns: Mapping[int, int] = field(default_factory=dict)  # NVML perf policy -> ns held down
    # "corrected", "uncorrected" (since the driver loaded), "corrected_aggregate",
    # "uncorrected_aggregate" (the board's life)
    ecc: Mapping[str, int] = field(default_factory=dict)
    retired_pages: tuple[int, int, bool] | None = None  # (single-bit, double-bit, pending)
    remapped_rows: tuple[int, int, bool, bool] | None = None  # (correctable, uncorrectable, pending, failure)
    pcie_generation: int | None = None
    pcie_width: int | None = None
    pcie_generation_max: int | None = None
    pcie_width_max: int | None = None
    pcie_replays: int | None = None
    pcie_kib_s: tuple[int, int] | None = None  # (transmit, receive)
    # Per NVLink link, by index: "crc", "replay", "recovery" error counts, "tx_kib", "rx_kib".
    nvlinks: tuple[Mapping[str, int], ...] = ()
    encoder_utilization: int | None = None  # percent
    decoder_utilization: int | None = None
    memory_utilization: int | None = None  # the memory controller's, percent


@dataclass(frozen=True)
class ReadingRow:
    """What a GPU read from `at_s` until the next row (a recorded trace's time series): each
    reading given here stands in for the one the fake would work out from its processes."""

    at_s: float
    utilization: float | None = None  # percent
    # Percent: the mean of the device's own utilization samples over the interval from this row
    # to the next (what the agent reads as the interval's utilization), which the samples the
    # fake hands out for that interval reproduce; None: they follow the processes.
    interval_utilization: float | None = None
    memory_used_bytes: int | None = None
    # What the driver said was free, where it reserves memory for itself: the reservation is then
    # total - used - free (nvmlDeviceGetMemoryInfo_v2's `reserved`). None: nothing reserved.
    memory_free_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    energy_mj: int | None = None  # the driver's own unit, so a replayed counter reads exactly
    nvlink_down: tuple[int, ...] | None = None
    activity: ActivityRow | None = None  # over the interval from this row to the next
    migs: tuple[ActivityRow | None, ...] = ()  # per MIG instance, in the GPU's `mig:` order
    health: HealthRow | None = None  # clocks, throttling, memory errors, links, codecs


@dataclass(frozen=True)
class Gpu:
    index: int
    model: str
    uuid: str
    pci_bus_id: str
    pci_device_id: int
    memory_total_mib: int
    power_limit_w: float
    idle_power_w: float
    idle_temp_c: float
    max_temp_c: float
    nvlink_links: int
    sm_count: int
    mig: tuple[MigInstance, ...]
    readings: tuple[ReadingRow, ...] = ()  # a recorded time series, in time order
    minor: int = 0  # its device node, /dev/nvidia<minor>: the index unless the scenario says
    # Whether it has GPM (nvmlGpmQueryDeviceSupport); None: as its model says (Hopper and later).
    # A recorded GPU's own answer: a Hopper under a vGPU driver may have none, a model the fake
    # does not know may have it.
    gpm: bool | None = None
    # The driver events it reports (names of DEVICE_EVENT_KINDS); None: every kind. A recorded
    # GPU's own answer (a vGPU may report none).
    events: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return "NVIDIA " + self.model


@dataclass(frozen=True)
class UtilSegment:
    at_s: float
    sm_util: float  # percent of time a kernel of the process ran: what NVML's utilization counts
    # Percent of the GPU's SMs its kernels kept busy, averaged over time (GPM's SM activity): at
    # most sm_util, less for kernels that fill few SMs. None: sm_util (kernels fill every SM).
    sm_active: float | None = None
    tensor: float = 0.0  # percent of its SM activity that ran on the tensor cores
    memory_mib: float | None = None  # memory it holds from this segment on (None: the process's)

    @property
    def active(self) -> float:
        return self.sm_util if self.sm_active is None else self.sm_active


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    container: str
    uid: str


@dataclass(frozen=True)
class Process:
    pid: int
    gpus: tuple[GpuRef, ...]
    start_s: float
    end_s: float | None
    segments: tuple[UtilSegment, ...]
    memory_mib: int
    uid: int
    user: str | None
    cmdline: str
    environ: Mapping[str, str]
    cgroup: str | None
    pod: PodRef | None
    slurm_job: str | None
    container_id: str | None
    # Percent of the GPU's video encoder / decoder the process keeps busy.
    encoder_util: float = 0.0
    decoder_util: float = 0.0
    # Its parent's pid (procfs's ppid); None: init's (1). A server's workers name the server.
    parent: int | None = None
    # Its figures on some of its GPUs where they differ from the ones above (`per_gpu:`): on each
    # GPU named here, its own load segments and memory (a model split over two GPUs unevenly).
    per_gpu: Mapping[GpuRef, tuple[tuple[UtilSegment, ...], int]] = field(default_factory=dict)
    # The kinds of GPU context it holds, which decide the NVML process lists it is in:
    # "compute" (nvmlDeviceGetComputeRunningProcesses), "graphics" (...GraphicsRunningProcesses),
    # "mps" (a CUDA MPS client: ...MPSComputeRunningProcesses, while its work runs in the MPS
    # server's compute context, which the scenario lists as a process of its own).
    contexts: frozenset[str] = frozenset({"compute"})

    def on(self, ref: GpuRef) -> Process:
        """The process as GPU `ref` sees it: its own figures there, where `per_gpu` gives some."""
        figures = self.per_gpu.get(ref)
        if figures is None:
            return self
        return replace(self, segments=figures[0], memory_mib=figures[1], per_gpu={})

    def running_at(self, t: float) -> bool:
        return self.start_s <= t and (self.end_s is None or t < self.end_s)

    def segment_at(self, t: float) -> UtilSegment | None:
        """The segment in force `t` seconds after the process started (None before the first)."""
        found = None
        for segment in self.segments:
            if segment.at_s <= t:
                found = segment
            else:
                break
        return found

    def memory_bytes_at(self, t: float) -> int:
        """The memory it holds `t` seconds after it started, in bytes (whole bytes, as NVML counts)."""
        mib: float = self.memory_mib
        for segment in self.segments:
            if segment.at_s > t:
                break
            if segment.memory_mib is not None:
                mib = segment.memory_mib
        return round(mib * 2**20)

    def sm_util_at(self, t: float) -> float:
        util = 0.0
        for segment in self.segments:
            if segment.at_s <= t:
                util = segment.sm_util
            else:
                break
        return util


@dataclass(frozen=True)
class Allocation:
    gpus: tuple[GpuRef, ...]
    start_s: float
    end_s: float | None
    pod: PodRef | None
    slurm_job: str | None
    user: str | None
    account: str | None = None  # the Slurm job's account, written to its map files after the user


@dataclass(frozen=True)
class EccErrors:
    corrected: int = 0  # single-bit errors, corrected by ECC
    uncorrected: int = 0  # double-bit errors


@dataclass(frozen=True)
class RowRemap:
    correctable: int = 0
    uncorrectable: int = 0
    pending: bool = False  # a remap waits for the GPU's next reset (cleared at the fault's `until`)
    failure: bool = False  # a bank ran out of spare rows


@dataclass(frozen=True)
class PcieDowngrade:
    generation: int | None = None  # the link trains down to this (None: unchanged)
    width: int | None = None
    replays: int = 0  # link-level retries while it is down


@dataclass(frozen=True)
class NvLinkErrors:
    links: tuple[int, ...] | None = None  # None: every link of the GPU
    crc: int = 0
    replay: int = 0
    recovery: int = 0


@dataclass(frozen=True)
class Fault:
    at_s: float
    until_s: float | None
    gpu: int | None
    call: str | None
    error: str | None
    nvlink_down: tuple[int, ...]
    xid: int | None
    latency_ms: float
    # A driver event other than an Xid that the GPU reports at `at_s` (`DRIVER_EVENTS`).
    event: str | None = None
    # Hardware health faults (fake_nvml/health.py moves the counters and states they name).
    ecc: EccErrors | None = None
    remap: RowRemap | None = None
    throttle: str | None = None  # a name of THROTTLE_KINDS (scenario/facts.py)
    pcie_downgrade: PcieDowngrade | None = None
    nvlink_errors: NvLinkErrors | None = None

    def active(self, t: float) -> bool:
        return self.at_s <= t and (self.until_s is None or t < self.until_s)

    def accrued(self, total: int, t: float) -> float:
        """How many of `total` events have happened by t: all of them at `at`, or with `until`
        spread evenly from `at` to `until`."""
        if t < self.at_s:
            return 0.0
        if self.until_s is None or t >= self.until_s:
            return float(total)
        return total * (t - self.at_s) / (self.until_s - self.at_s)


@dataclass(frozen=True)
class NodeFacts:
    hostname: str
    driver_version: str
    cuda_driver_version: int
    instance_type: str | None
    missing_functions: frozenset[str]
    # Whose device plugin the kubelet's allocations come from, which decides how they name a
    # device: "nvidia" (k8s-device-plugin: GPU and MIG UUIDs), "gke" (nvidia<minor>[/gi<id>]).
    device_plugin: str = "nvidia"


@dataclass(frozen=True)
class Scenario:
    name: str
    start: datetime
    node: NodeFacts
    gpus: tuple[Gpu, ...]
    processes: tuple[Process, ...]
    allocations: tuple[Allocation, ...]
    faults: tuple[Fault, ...]
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @property
    def start_epoch(self) -> float:
        return self.start.timestamp()
