"""Plain frozen data passed between the stages: sampler -> attribution -> accounting -> rules
-> exporters. Nothing here does I/O; every stage may import this module and nothing else of
another stage."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from operator import attrgetter
from typing import Any, Protocol, TypeVar

_T = TypeVar("_T")
_new = object.__new__


def _made_in_place(cls: type[_T]) -> type[_T]:
    """`cls`, a frozen dataclass with slots (and no __post_init__), made at a quarter to three
    fifths of the cost (a DeviceReading 0.9 against 3.8 us, a ProcessReading 0.4 against 0.7).

    A frozen dataclass's __init__ sets each field through object.__setattr__, past the
    __setattr__ that freezes it: a wrapped C call of about 1,000 instructions where a slot store
    costs 150 (a Telemetry cost 45,000 to make), and a poll of an 8-GPU node makes about 130 of
    this module's objects. Here the object wears a mutable twin's class (the same slots) while an
    __init__ of `cls`'s own signature, written here as dataclasses writes theirs, stores the
    fields, and is a `cls` from then on, frozen as before. One call with the caller's arguments
    as they come: a wrapper handing *args and **kwargs on to the twin's own __init__ cost 3.4% of
    a poll (of the demo node, 7.69 M instructions with it, 7.43 M without)."""
    assert "__slots__" in vars(cls), cls  # the twin's slots must be the object's
    assert not hasattr(cls, "__post_init__"), cls  # the generated __init__ calls none
    draft = type(f"{cls.__name__}Draft", (), {"__slots__": vars(cls)["__slots__"]})
    names: dict[str, Any] = {
        "_made_set_class": object.__setattr__,
        "_made_draft": draft,
        "_made_cls": cls,
        "_made_missing": MISSING,
    }
    params, stores = [], []
    for f in fields(cls):  # type: ignore[arg-type]  # each caller is a dataclass
        value = f.name
        if f.default is not MISSING:
            names[f"_made_default_{f.name}"] = f.default
            value = f"_made_default_{f.name}"
            if f.init:
                params.append(f"{f.name}=_made_default_{f.name}")
                value = f.name
        elif f.default_factory is not MISSING:
            names[f"_made_factory_{f.name}"] = f.default_factory
            value = f"_made_factory_{f.name}()"
            if f.init:
                params.append(f"{f.name}=_made_missing")
                value = f"{value} if {f.name} is _made_missing else {f.name}"
        else:
            assert f.init, (cls, f.name)  # a field nothing sets
            params.append(f.name)
        stores.append(f"    self.{f.name} = {value}\n")
    source = (
        f"def __init__(self, {', '.join(params)}):\n"
        "    _made_set_class(self, '__class__', _made_draft)  # past cls's frozen __setattr__, once\n"
        f"{''.join(stores)}"
        "    self.__class__ = _made_cls\n"
    )
    exec(source, names)  # source written above from the fields' names alone
    init = functools.wraps(vars(cls)["__init__"])(names["__init__"])  # its signature, for inspect
    setattr(cls, "__init__", init)  # noqa: B010  # mypy refuses to assign to a method
    return cls


@_made_in_place
@dataclass(frozen=True, slots=True)
class ProcessReading:
    pid: int
    used_memory_bytes: int | None
    # Mean SM utilization (0-1) over the driver's samples since the previous poll; None when the
    # device cannot measure it (MIG, old GPUs). A process with no sample on a device that
    # measures is 0: the driver only reports processes that did some work.
    sm_util: float | None
    gpu_instance_id: int | None = None


@_made_in_place
@dataclass(frozen=True, slots=True)
class NvLinkReading:
    link: int
    up: bool


# NVML's clocks-event reason bits (nvmlClocksEventReason*, and the two only the older throttle
# call reports), by the name each is exported under.
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
    (0x200, "board_limit"),
    (0x400, "reliability"),
)
# The causes the driver keeps violation time for (nvmlPerfPolicyType_t), as exported.
VIOLATION_CAUSES: tuple[str, ...] = (
    "power",
    "thermal",
    "sync_boost",
    "board_limit",
    "low_utilization",
    "reliability",
    "app_clocks",
    "base_clocks",
)


@_made_in_place
@dataclass(frozen=True, slots=True)
class NvLinkCounters:
    """One NVLink link's counters since the driver loaded; None where the driver has none."""

    link: int
    crc_errors: int | None = None
    replay_errors: int | None = None
    recovery_errors: int | None = None
    tx_bytes: int | None = None
    rx_bytes: int | None = None


class _NvLinkCountersDraft:
    """NvLinkCounters' slots, stored without its frozen __setattr__ (see `_made_in_place`)."""

    # In NvLinkCounters' order, for an object to change from one class to the other.
    __slots__ = ("link", "crc_errors", "replay_errors", "recovery_errors", "tx_bytes", "rx_bytes")  # noqa: RUF023
    link: int
    crc_errors: int | None
    replay_errors: int | None
    recovery_errors: int | None
    tx_bytes: int | None
    rx_bytes: int | None


assert _NvLinkCountersDraft.__slots__ == tuple(f.name for f in fields(NvLinkCounters))


def nvlink_counters(counts: Sequence[int | None]) -> tuple[NvLinkCounters, ...]:
    """The NvLinkCounters of every link from its counters after the link (crc, replay, recovery
    errors, transmitted and received bytes), link by link: `counts[5 * k : 5 * k + 5]` is link
    k's. A busy GPU's 12 links' counters change every poll: made here, without a call and its
    argument passing each, they cost half as much as NvLinkCounters(...) makes them."""
    made: list[Any] = []
    for link in range(len(counts) // 5):
        draft = _new(_NvLinkCountersDraft)
        draft.link = link
        draft.crc_errors, draft.replay_errors, draft.recovery_errors, draft.tx_bytes, draft.rx_bytes = counts[
            link * 5 : link * 5 + 5
        ]
        draft.__class__ = NvLinkCounters  # type: ignore[assignment]  # the same slots, now frozen
        made.append(draft)
    return tuple(made)


@_made_in_place
@dataclass(frozen=True, slots=True)
class Telemetry:
    """A GPU's clocks, throttling, memory errors and links, read in the same poll as the rest.

    Readings that change slowly or only count (performance state, fan, violation time, memory
    errors, PCIe link and replays, NVLink errors, encoder and decoder) are read every
    `readings.slow_interval` and carried into the polls between, so they are at most that old.
    None (or empty) where the GPU has no such reading, it failed this poll, or its group of
    readings is switched off.
    """

    sm_clock_hz: float | None = None
    memory_clock_hz: float | None = None
    sm_clock_max_hz: float | None = None
    memory_clock_max_hz: float | None = None
    fan_speed_ratio: float | None = None
    performance_state: int | None = None  # 0 (P0, the most performance) to 15
    clock_event_reasons: int | None = None  # bitmask; CLOCK_EVENT_REASONS names its bits
    violation_s: tuple[tuple[str, float], ...] = ()  # (cause, seconds held down since the driver loaded)
    ecc_corrected_volatile: int | None = None  # since the driver loaded
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None  # over the board's life
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    pcie_link_generation: int | None = None
    pcie_link_generation_max: int | None = None
    pcie_link_width: int | None = None
    pcie_link_width_max: int | None = None
    pcie_replays: int | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    nvlinks: tuple[NvLinkCounters, ...] = ()
    # Both directions of every link, over the interval since the previous poll.
    nvlink_bytes_per_s: float | None = None
    encoder_utilization: float | None = None
    decoder_utilization: float | None = None
    memory_utilization: float | None = None  # the memory controller's busy fraction

    def reasons(self) -> tuple[str, ...]:
        """The names of the clock-event reasons active now."""
        mask = self.clock_event_reasons or 0
        return tuple(name for bit, name in CLOCK_EVENT_REASONS if mask & bit)


@_made_in_place
@dataclass(frozen=True, slots=True)
class Activity:
    """What a GPU's (or MIG instance's) SMs did between two polls (`since` to `until`: the
    previous poll and this one, or on the slow rhythm the last slow span), as GPU Performance
    Monitoring measures it (Hopper and later): fractions 0-1, None where not read.

    NVML's utilization counts time in which any kernel ran, so one small kernel reads 100%;
    `sm_active` is the share of the SMs that had work, the measure of "busy" that tells the truth.
    """

    graphics_active: float | None = None  # time any kernel or graphics work ran (the GR engine)
    sm_active: float | None = None  # SMs with at least one warp assigned
    sm_occupancy: float | None = None  # warps resident over the SMs' maximum
    tensor_active: float | None = None  # cycles the tensor pipes were active
    dram_active: float | None = None  # cycles the memory interface moved data
    # The span the means are over (backend clock, unix seconds): the polls that took its two
    # samples. Where the activity is read on the slow rhythm (`readings.mig_activity: slow`) a
    # poll carries the last span's figures, so `until` can be up to `slow_interval` before it.
    since: float | None = None
    until: float | None = None


# Where a device's "busy" figure comes from (`DeviceReading.busy_source`).
BUSY_GPM = "gpm"  # Activity.sm_active
BUSY_NVML = "nvml"  # DeviceReading.utilization


@_made_in_place
@dataclass(frozen=True, slots=True)
class DeviceReading:
    """One GPU, or one MIG instance of a GPU (then `parent_uuid` is set), as read in one poll.

    Readings the device does not have, or that failed this poll, are None, never 0.
    """

    index: int
    uuid: str
    name: str
    up: bool
    parent_uuid: str | None = None
    mig_index: int | None = None
    mig_profile: str = ""  # a MIG instance's profile as the MIG user guide names it, e.g. "3g.40gb"
    gpu_instance_id: int | None = None
    pci_bus_id: str = ""
    # The GPU's device node, /dev/nvidia<minor> (a MIG instance: its GPU's); not its index, and
    # how GKE's device plugin names it to the kubelet. None where the driver did not say.
    minor_number: int | None = None
    down_reason: str | None = None
    mig_enabled: bool = False
    sm_count: int | None = None
    utilization: float | None = None  # the driver's latest sample (one sampling period)
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    # What the driver reports free: not `total - used` where it reserves memory for itself.
    memory_free_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    energy_j: float | None = None
    nvlinks: tuple[NvLinkReading, ...] = ()
    processes: tuple[ProcessReading, ...] = ()
    # False when the process list could not be read this poll: `processes` is then unknown,
    # not empty, and the time is not idle (accounting books it as unobserved).
    processes_known: bool = True
    # False while discovery has not completed for this GPU in this run (the driver is down, or
    # its handle, uuid or name could not be read): its uuid is then as remembered (from this
    # run's earlier discovery, or the ledger) or provisional (`provisional_uuid`), and its name
    # may be empty. Retried with backoff; the agent is degraded meanwhile.
    discovered: bool = True
    # The device's own utilization (0-1) time-weighted over its samples since the previous poll:
    # what accounting caps its holders' busy time by. None where the samples could not be read.
    interval_utilization: float | None = None
    activity: Activity | None = None  # GPM, over the interval since the previous poll (or slow span)
    busy_source: str = BUSY_NVML  # BUSY_GPM, BUSY_NVML, or "" where the device has no busy measure

    @property
    def utilization_mean(self) -> float | None:
        """The share (0-1) of the interval since the previous poll in which a kernel ran: the
        device's own samples averaged over it (GPM's graphics activity, the same share measured
        end to end, where GPM is the busy source), else the driver's latest reading (a first poll,
        samples that could not be read). The latest reading alone is one sample period, 1/6 s to
        1 s: a real H200 in half-second bursts read 0% at every poll while it was busy half the
        time (scripts/realgpu/README.md)."""
        return self.interval_utilization if self.interval_utilization is not None else self.utilization

    @property
    def busy(self) -> float | None:
        """How busy the device was (0-1) over the interval since the previous poll, by its busy
        source: what accounting's busy seconds and the flag rules measure (NVML's: the interval's
        utilization, `utilization_mean`; the latest reading alone flagged a GPU busy half the time
        idle where its work pulsed in step with the polls). None where the source has no figure
        this poll."""
        if self.busy_source == BUSY_GPM:
            return self.activity.sm_active if self.activity is not None else None
        if self.busy_source == BUSY_NVML:
            return self.utilization_mean
        return None

    # Clocks, throttling, memory errors, links (a whole GPU's; None on a MIG instance or down GPU).
    telemetry: Telemetry | None = None

    @property
    def model(self) -> str:
        """The GPU model as scenarios and pricing name it: the name minus "NVIDIA " (and, for a
        MIG instance, minus the " MIG <profile>" the driver appends)."""
        model = self.name.removeprefix("NVIDIA ")
        return model.removesuffix(f" MIG {self.mig_profile}") if self.mig_profile else model

    @property
    def is_mig(self) -> bool:
        return self.parent_uuid is not None

    @property
    def label(self) -> str:
        """The `gpu` label: the index, or "index:mig" for a MIG instance."""
        return str(self.index) if self.mig_index is None else f"{self.index}:{self.mig_index}"


@_made_in_place
@dataclass(frozen=True, slots=True)
class NodeInfo:
    hostname: str
    driver_version: str = ""
    cuda_driver_version: int | None = None


@_made_in_place
@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one poll read, stamped with the backend's clock (unix seconds)."""

    taken_at: float
    node: NodeInfo
    devices: tuple[DeviceReading, ...]
    poll_duration_s: float = 0.0
    driver_up: bool = True
    down_reason: str = ""  # why the driver is down (driver_up False): its NVML error, or TIMEOUT

    @property
    def gpus(self) -> tuple[DeviceReading, ...]:
        return tuple(d for d in self.devices if d.parent_uuid is None)

    def mig_devices(self, parent_uuid: str) -> tuple[DeviceReading, ...]:
        return tuple(d for d in self.devices if d.parent_uuid == parent_uuid)

    def migs_by_parent(self) -> dict[str, tuple[DeviceReading, ...]]:
        """`mig_devices` of every GPU that has some, found in one pass (for readers that ask
        about every GPU)."""
        found: dict[str, list[DeviceReading]] = {}
        for d in self.devices:
            if d.parent_uuid is not None:
                found.setdefault(d.parent_uuid, []).append(d)
        return {parent: tuple(migs) for parent, migs in found.items()}


# The uuid a GPU goes by while discovery cannot read its own (and nothing remembers it): the
# node's index, marked so that no reader takes it for a GPU's uuid. Charges are booked under it
# (never under an empty uuid, which would merge GPUs in the ledger), and its GPU index.
PROVISIONAL_UUID_PREFIX = "unidentified-"


def provisional_uuid(index: int) -> str:
    return f"{PROVISIONAL_UUID_PREFIX}{index}"


@_made_in_place
@dataclass(frozen=True, slots=True, order=True)
class ProcessIdentity:
    """A process as procfs knows it: a pid alone may be reused, (pid, start time) is not."""

    pid: int
    start_ticks: int


@_made_in_place
@dataclass(frozen=True, slots=True)
class ProcessFacts:
    identity: ProcessIdentity
    uid: int | None
    cmdline: tuple[str, ...]
    cgroup: str
    env: tuple[tuple[str, str], ...] = ()  # allowlisted keys only
    # When the process started, wall clock (unix seconds): boot time + its start ticks, as psutil's
    # create_time() computes it. None where procfs could not tell.
    started_at: float | None = None
    # The model its nearest ancestor's command line names (same cgroup and uid, a few levels up),
    # where its own names none: a server's renamed workers (`VLLM::Worker_TP0`). None: no such
    # ancestor, or its own command line names a model.
    inherited_model: str | None = None

    @property
    def pid(self) -> int:
        return self.identity.pid

    def env_value(self, key: str) -> str | None:
        for name, value in self.env:
            if name == key:
                return value
        return None


class _ByName(Protocol):
    def __getitem__(self, name: str, /) -> Any: ...


@_made_in_place
@dataclass(frozen=True, slots=True, order=True)
class Workload:
    """Who holds a GPU, as the workload labels name it; empty strings where unknown.

    A pod sets namespace/pod/container, a Slurm job sets `hpc_job` to its id (dcgm-exporter's
    name: a label called `job` would clash with Prometheus's own target label), a systemd service
    sets `unit`, a plain container sets `container`. The field order is the label order of every
    output (`WORKLOAD_LABELS`, below), so a new label is one new field here.
    """

    namespace: str = ""
    pod: str = ""
    container: str = ""
    hpc_job: str = ""  # a Slurm (or other batch scheduler) job id
    unit: str = ""  # a systemd unit (service) name
    user: str = ""
    model: str = ""
    team: str = ""
    # The labels' hash, worked out at the first lookup (`__hash__`); not a label. Typed object,
    # not int | None, so that mypy still takes replace(w, **labels) with str values.
    _hash: object = field(default=None, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        # A workload keys dicts and sets all the way from attribution to the ledger, over a
        # hundred lookups a poll: its eight strings are hashed once, not at every lookup.
        found = self._hash
        if not isinstance(found, int):
            found = hash(_label_values(self))
            object.__setattr__(self, "_hash", found)
        return found

    def __reduce__(self) -> tuple[type[Workload], tuple[str, ...]]:
        # Pickled (or copied) by its labels alone: a string's hash differs between processes.
        return Workload, self.labels()

    def labels(self) -> tuple[str, ...]:
        """The label values in `WORKLOAD_LABELS` order."""
        values: tuple[str, ...] = _label_values(self)
        return values

    def label_dict(self) -> dict[str, str]:
        """Label name -> value, every label present (empty where unknown)."""
        return dict(zip(WORKLOAD_LABELS, _label_values(self), strict=True))

    @classmethod
    def from_labels(cls, values: Mapping[str, str] | _ByName) -> Workload:
        """The workload whose labels are `values`: anything indexed by label name (a dict, a
        sqlite3.Row) that holds every one."""
        return cls(**{name: values[name] for name in WORKLOAD_LABELS})

    def describe(self) -> str:
        """A short human name: "serving/vllm-llama-0", "job 8812", "nginx.service",
        "container 9f2b7c1d4e5a", "user alice"."""
        if self.pod:
            return f"{self.namespace}/{self.pod}"
        if self.hpc_job:
            return f"job {self.hpc_job}"
        if self.unit:
            return self.unit
        if self.container:
            return f"container {self.container}"
        if self.user:
            return f"user {self.user}"
        return "(unknown)"


# The workload label names, in order: every exporter, the ledger, the report and the rules
# read them from here, never from a list of their own.
WORKLOAD_LABELS: tuple[str, ...] = tuple(f.name for f in fields(Workload) if f.compare)
_label_values = attrgetter(*WORKLOAD_LABELS)


@_made_in_place
@dataclass(frozen=True, slots=True)
class Holding:
    """One workload holding one device (a GPU, or a MIG instance) in one poll."""

    device_uuid: str
    workload: Workload
    pids: tuple[int, ...] = ()
    sm_util: float | None = None  # summed over its processes; None where the device cannot tell
    memory_bytes: int | None = None
    allocated: bool = False  # the scheduler (kubelet, Slurm) handed it this device
    pid: int | None = None  # set only when per-pid series are on
    # Named only by what its processes say of themselves (SLURM_JOB_ID in their environment),
    # which nothing trusted (cgroup, kubelet, the prolog's map file) confirmed.
    self_reported: bool = False
    # When it began to hold the device, wall clock (unix seconds), where known: the earliest
    # start of its processes, or of its allocation (a Slurm map file's time). Accounting
    # charges a new holder from then rather than from the midpoint of the interval.
    started_at: float | None = None
    # The Slurm account a job's holding is billed to (the prolog's map file, else the process's
    # SLURM_JOB_ACCOUNT); not a metric label: the ledger and `report --by account` carry it.
    account: str = ""


@_made_in_place
@dataclass(frozen=True, slots=True)
class Attribution:
    holdings: tuple[Holding, ...] = ()
    unresolved: tuple[tuple[str, int], ...] = ()  # device uuid -> processes procfs could not resolve
    kubelet_up: bool | None = None  # None: no kubelet socket configured or present
    # Device ids the kubelet allocated that no device here goes by (a form the agent cannot
    # read, a GPU not discovered): their pods hold nothing through them, so this is never silent.
    unmatched_devices: tuple[str, ...] = ()
    # False while the scheduler's allocations cannot be known (the kubelet unreachable past
    # attribution.kubelet_stale_after): a unit no process holds may still be allocated, so its
    # time is unobserved (attribution_unavailable), not idle.
    allocations_known: bool = True

    def for_device(self, uuid: str) -> tuple[Holding, ...]:
        return tuple(h for h in self.holdings if h.device_uuid == uuid)

    def by_device(self) -> dict[str, tuple[Holding, ...]]:
        """`for_device` of every device held, found in one pass (holdings in attribution order)."""
        found: dict[str, list[Holding]] = {}
        for h in self.holdings:
            found.setdefault(h.device_uuid, []).append(h)
        return {uuid: tuple(held) for uuid, held in found.items()}


@_made_in_place
@dataclass(frozen=True, slots=True)
class Flag:
    """One flag rule's verdict on one GPU at the latest poll: the rules stage's output."""

    gpu: int
    uuid: str
    rule: str
    raised: bool
    held_s: float  # how long the condition has held (while raised); 0 otherwise
    holders: tuple[Workload, ...]
    dollars: float


@_made_in_place
@dataclass(frozen=True, slots=True)
class LeftBy:
    """A GPU nobody holds now, and who left it so: the workloads that held it at the last poll
    that saw it held, and that poll's time (the stretch of idle began after it)."""

    gpu: int
    uuid: str
    workloads: tuple[Workload, ...]
    at: float

    def describe(self) -> str:
        return ", ".join(w.describe() for w in self.workloads)


@_made_in_place
@dataclass(frozen=True, slots=True)
class StageHealth:
    """How one pipeline stage fared: its latest run's duration, its failures since the agent
    started, and when it last succeeded (backend clock: the time of the poll it ran for)."""

    stage: str
    duration_s: float = 0.0
    failures: int = 0
    last_success_at: float | None = None


@_made_in_place
@dataclass(frozen=True, slots=True)
class AgentHealth:
    """The agent's own counters as of the latest poll, swapped in with the snapshot."""

    polls_total: int = 0
    polls_failed: int = 0
    polls_overran: int = 0
    last_success_at: float | None = None  # backend clock
    nvml_errors: tuple[tuple[str, str, int], ...] = ()  # (call, error, count)
    stages: tuple[StageHealth, ...] = ()  # in the order the pipeline runs them


@_made_in_place
@dataclass(frozen=True, slots=True)
class WorkloadTotals:
    held_s: float = 0.0
    busy_s: float = 0.0
    charged_s: float = 0.0  # its share of the unit's time (see WorkloadCharge.charged_s)
    dollars: float = 0.0
    joules: float | None = None  # None while no energy counter measured any of it
    last_charged_at: float = 0.0
    energy_dollars: float | None = None  # None where no energy price is set
    unmeasured_s: float = 0.0  # charged time whose use nothing measured (WorkloadCharge.unmeasured_s)


@_made_in_place
@dataclass(frozen=True, slots=True)
class IdleTotals:
    """A GPU's idle time and cost since the agent started that one workload left it in."""

    idle_s: float = 0.0
    idle_dollars: float = 0.0
    last_at: float = 0.0  # the end of the last interval that added to it (backend clock)


@_made_in_place
@dataclass(frozen=True, slots=True)
class GpuTotals:
    dollars: float = 0.0
    idle_dollars: float = 0.0
    idle_s: float = 0.0
    observed_s: float = 0.0
    unobserved_s: float = 0.0
    joules: float | None = None  # None while its energy counter has measured nothing (none, or unread)
    idle_joules: float | None = None
    unobserved_dollars: float = 0.0
    energy_dollars: float | None = None  # None where no energy price is set
    idle_energy_dollars: float | None = None
    # reason -> (seconds, dollars): the unobserved time and cost, by why
    unobserved_by_reason: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # The idle time and cost by who left the GPU idle (its last holder; Workload() where
    # nobody has held it since the agent started): they add up to idle_s and idle_dollars.
    idle_by_left: Mapping[Workload, IdleTotals] = field(default_factory=dict)
    busy_s: float | None = None  # the GPU's own busy time (see GpuCharge.busy_s); None: never known


@dataclass(frozen=True)
class CostTotals:
    """Counters since the agent started, as the exporter renders them."""

    workloads: Mapping[tuple[int, str, Workload], WorkloadTotals] = field(default_factory=dict)
    gpus: Mapping[tuple[int, str], GpuTotals] = field(default_factory=dict)


@_made_in_place
@dataclass(frozen=True, slots=True)
class LedgerHealth:
    healthy: bool
    pending_rows: int
    last_flush_at: float | None  # wall clock of the last successful flush
    dropped_rows: int = 0  # pending rows dropped, oldest hours first, past ledger.max_pending_rows
    dropped_dollars: float = 0.0  # what they held (workload, idle and unobserved dollars)
    corrupt_files: int = 0  # corrupt ledger files moved aside for a fresh one


@_made_in_place
@dataclass(frozen=True, slots=True)
class GpuEvents:
    """The driver events one GPU reported since the agent started (agent/devices/events.py)."""

    gpu: int
    uuid: str
    watched: bool  # registered for its events right now (False: lost, or the driver is away)
    counts: tuple[tuple[str, int, int], ...] = ()  # (event kind, Xid or 0, how many)
    last_xid: int | None = None
    last_xid_at: float | None = None  # backend clock, when the agent received it


@_made_in_place
@dataclass(frozen=True, slots=True)
class DeviceEvents:
    """What the driver-event reader has seen: per GPU, and whether it has an event set open."""

    gpus: tuple[GpuEvents, ...] = ()
    reading: bool = False


@_made_in_place
@dataclass(frozen=True, slots=True)
class AgentState:
    snapshot: Snapshot | None = None
    attribution: Attribution = field(default_factory=Attribution)
    costs: CostTotals = field(default_factory=CostTotals)
    prices: tuple[tuple[str, Price | None], ...] = ()  # GPU uuid -> price (None: no price known)
    ledger: LedgerHealth | None = None
    flags: tuple[Flag, ...] = ()  # the rules stage's output, rendered as is
    left_by: tuple[LeftBy, ...] = ()  # GPUs nobody holds now, and who held them last
    health: AgentHealth = field(default_factory=AgentHealth)
    actions: tuple[tuple[str, str, int], ...] = ()  # (action, result, count) since the agent started
    events: DeviceEvents | None = None  # None: no event reader (events off, or no event API)


@_made_in_place
@dataclass(frozen=True, slots=True)
class Price:
    """What one GPU costs per hour, and why that figure (shown in `snapshot`).

    A price that changes later (config `pricing.changes`) carries its later prices in `changes`,
    each from its time on: `at(t)` is the price in force at t, `dollars(start, end)` what the
    GPU costs over that span. The fields after `source` do not take part in equality: two
    prices are the same figure for the same reason.
    """

    dollars_per_hour: float
    source: str  # e.g. "config pricing.gpu_hourly", "instance p4d.24xlarge / 8 GPUs (AWS, read 2026-11-01)"
    # Where the figure comes from, in one stable word: config, instance or catalogue.
    origin: str = field(default="config", compare=False)
    # How the node is bought: on_demand, spot, reserved, savings_plan or committed.
    purchase: str = field(default="on_demand", compare=False)
    # Set where the instance type's GPU model is not the GPU's: why the instance was not used.
    mismatch: str = field(default="", compare=False)
    changes: tuple[tuple[float, Price], ...] = field(default=(), compare=False)  # (from, price), in time order

    def at(self, t: float) -> Price:
        """The price in force at `t` (backend clock, unix seconds)."""
        current = self
        for start, later in self.changes:
            if start > t:
                break
            current = later
        return current

    def during(self, start: float, end: float) -> Price:
        """The price that applied last within [start, end): a change at `end` is the next
        interval's, not this one's (what the ledger records for the interval's hour)."""
        current = self
        for at, later in self.changes:
            if at > end or (at == end and end > start):
                break
            current = later
        return current

    def dollars(self, start: float, end: float) -> float:
        """What the GPU costs from `start` to `end`: each part at the price in force then."""
        if not self.changes:
            return self.dollars_per_hour * (end - start) / 3600
        total = 0.0
        t, rate = start, self.dollars_per_hour
        for at, later in self.changes:
            if at >= end:
                break
            if at > t:
                total += rate * (at - t) / 3600
                t = at
            rate = later.dollars_per_hour
        return total + rate * (end - t) / 3600


@_made_in_place
@dataclass(frozen=True, slots=True)
class WorkloadCharge:
    """What one workload ran up on one cost unit (a GPU or a MIG instance) over one interval."""

    gpu: int  # index of the physical GPU
    uuid: str  # the unit's uuid: the GPU's, or the MIG instance's
    workload: Workload
    held_s: float  # how long it held the unit, whoever held it besides (shared units count twice)
    busy_s: float
    dollars: float
    joules: float | None  # its share of the GPU's energy counter; None where that measured nothing
    energy_dollars: float | None = None  # joules at the energy price; None where none is set
    # Its share of the unit's time: held seconds x the share that splits the dollars. A unit's
    # holders' charged seconds plus its idle seconds are its observed seconds, so these add up
    # across workloads where held seconds count a shared GPU once per holder.
    charged_s: float = 0.0
    account: str = ""  # the Slurm account (Holding.account), "" where none
    # The part of `charged_s` over which nothing measured how busy it kept the unit (a MIG
    # instance without GPM, busy_source gpm on a GPU without it, a shared unit whose holders'
    # shares of use cannot be told): its use there is unknown, not 0, so busy_s covers the rest.
    unmeasured_s: float = 0.0


@_made_in_place
@dataclass(frozen=True, slots=True)
class IdleCharge:
    """Part of a GPU's idle time over one interval, by who left it idle: the workload that held
    the unit last before the idle stretch (`left_by`; Workload() where nobody has held it since
    the agent started). Where several held it last together, each is charged an equal part."""

    left_by: Workload
    idle_s: float
    idle_dollars: float
    idle_joules: float | None = 0.0  # None where the GPU's energy counter measured nothing
    idle_energy_dollars: float | None = None


@_made_in_place
@dataclass(frozen=True, slots=True)
class GpuCharge:
    """What one physical GPU cost over one interval, and how much of it nobody held."""

    gpu: int
    uuid: str
    model: str
    dollars_per_hour: float
    observed_s: float
    dollars: float
    idle_s: float  # seconds no workload held the whole GPU (MIG: weighted by unheld slices)
    idle_dollars: float
    unobserved_s: float  # interval too long to charge anyone (agent stopped, node suspended)
    # From the GPU's energy counter; None where it measured nothing over the interval (the GPU
    # has none, or it could not be read): unknown, not 0.
    joules: float | None
    idle_joules: float | None
    unobserved_dollars: float = 0.0  # what the GPU cost over unobserved time, charged to nobody
    energy_dollars: float | None = None  # joules at the energy price; None where none is set
    idle_energy_dollars: float | None = None
    unobserved_reason: str = ""  # why, when unobserved_s > 0 (UNOBSERVED_* or the NVML error)
    # The idle time and cost by who left the GPU idle; they add up to idle_s, idle_dollars and
    # idle_joules.
    idle_by: tuple[IdleCharge, ...] = ()
    # The GPU's own busy time over its observed time: its utilization averaged over its samples
    # of the interval (its latest reading where those could not be read) x the observed seconds.
    # Its holders' busy seconds never add up to more. None where the GPU measures no utilization.
    busy_s: float | None = None
    purchase: str = ""  # how the GPU is bought (Price.purchase), the last price within the interval
    price_source: str = ""  # where its price comes from (Price.origin); "" where unpriced


# Why time was not observed (besides a GPU's own NVML error, such as GPU_IS_LOST or TIMEOUT).
UNOBSERVED_NO_POLL = "no_poll"  # polls too far apart: the agent stopped, the node slept
UNOBSERVED_AGENT_DOWN = "agent_down"  # between the ledger's last record and this run's first poll
UNOBSERVED_PROCESSES = "processes_unreadable"  # the process list failed: who held it is unknown
UNOBSERVED_UNREADABLE = "unreadable"  # the GPU could not be read, no error given
# Nobody runs on the unit and who it is allocated to cannot be known (the kubelet unreachable).
UNOBSERVED_ATTRIBUTION = "attribution_unavailable"


@_made_in_place
@dataclass(frozen=True, slots=True)
class UnitUsage:
    """What one workload used of one cost unit (a GPU or a MIG instance) at the poll that ends an
    interval: what right-sizing needs (agent/accounting/usage.py builds it, the ledger keeps it
    per hour in `sizing_hours`). None where the reading is missing."""

    workload: Workload
    uuid: str
    gpu_model: str  # the physical GPU's model, as pricing names it
    mig_profile: str  # "" for a whole GPU
    memory_bytes: int | None
    memory_total_bytes: int | None  # the unit's capacity
    busy: float | None  # 0-1: SM activity where GPM measures it, else NVML utilization
    busy_source: str = ""  # "gpm", "nvml", "process" (the workload's own processes' SM share)


@_made_in_place
@dataclass(frozen=True, slots=True)
class Charges:
    """One interval's accounting: from `start` to `end` (backend clock, unix seconds)."""

    start: float
    end: float
    node: str
    workloads: tuple[WorkloadCharge, ...] = ()
    gpus: tuple[GpuCharge, ...] = ()
    energy_per_kwh: float | None = None  # the price the charges' energy dollars are at
    usage: tuple[UnitUsage, ...] = ()  # who used how much of each unit, for right-sizing
