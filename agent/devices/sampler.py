"""Reads every device once per poll into an immutable `Snapshot`.

Policy lives here, library calls live behind `agent.devices.backend.DeviceBackend`; the
sampler never names a vendor library. See `Sampler` for the policy.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import socket
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from agent.devices.activity import ActivityBackend, ActivityMeter
from agent.devices.backend import (
    DeviceBackend,
    DeviceError,
    DeviceLost,
    DriverLibraryMissing,
    DriverUnavailable,
    Handle,
    PermissionDenied,
    ProcessInfo,
    Quantity,
    ReadingKey,
    ReadingNoLongerSupported,
    ReadingNotSupported,
)
from agent.devices.telemetry import MIG_ACTIVITY_OFF, MIG_ACTIVITY_SLOW, ReadingOptions, TelemetryReader
from agent.model import (
    BUSY_GPM,
    BUSY_NVML,
    Activity,
    DeviceReading,
    NodeInfo,
    NvLinkReading,
    ProcessReading,
    Snapshot,
    Telemetry,
    provisional_uuid,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")


class PollAbandoned(Exception):
    """A poll went on after the caller gave up on it (see Sampler.abandon)."""


REINIT_BACKOFF_FIRST_S = 5.0
# The fewest per-process samples a driver's ring can plausibly hold: a process seen with fewer
# has not shown the ring's size yet (a job busy 5 s of every 15 s gives 5 a poll), so no
# sample of it is taken to be lost.
MIN_RING_SAMPLES = 20
REINIT_BACKOFF_MAX_S = 300.0
# What a device's "busy" figure is measured by (`accounting.busy_source`): GPM's SM activity where
# the device has it, else NVML's utilization ("auto"); only NVML's; or only GPM's.
BUSY_POLICIES = ("auto", "nvml", "gpm")

_UTILIZATION = ReadingKey(Quantity.UTILIZATION)
_MEMORY_USED = ReadingKey(Quantity.MEMORY_USED)
_MEMORY_TOTAL = ReadingKey(Quantity.MEMORY_TOTAL)
_MEMORY_FREE = ReadingKey(Quantity.MEMORY_FREE)
_TEMPERATURE = ReadingKey(Quantity.TEMPERATURE)
_POWER = ReadingKey(Quantity.POWER)
_ENERGY = ReadingKey(Quantity.ENERGY)
_MEMORY = (_MEMORY_USED, _MEMORY_TOTAL, _MEMORY_FREE)


# Lists of reading keys whose wanted part Unsupported keeps (a GPU's poll asks two or three).
_WANTED_KEPT = 16


# Learned per device: reading keys and call names ("processes", "process utilization").
class Unsupported(set[object]):
    """What one device has shown it does not have (NOT_SUPPORTED), learned and never asked for
    again; and, in `worked`, what it has answered at least once. NOT_SUPPORTED from something
    that once worked is a transient error (a driver mid-reset, a busy GPU), not a fact about
    the device: it is counted and asked again next poll."""

    def __init__(self) -> None:
        super().__init__()
        self.worked: set[object] = set()
        # Each list of reading keys asked for, less what the device does not have, and what it
        # had shown then: a poll asks one of the same few lists of dozens of keys every time,
        # and what it lacks is learned early and seldom changes after. By the list's identity
        # (the entry holds the list, so its id is not reused): the sampler hands the same tuple
        # objects every poll, and hashing one (a tuple does not keep its hash) costs a hash of
        # each of its dozens of keys.
        self._wanted: dict[int, tuple[tuple[ReadingKey, ...], set[object], tuple[ReadingKey, ...]]] = {}
        # Lists of reading keys (by identity, as above) every one of which has answered: reading
        # one of them again adds nothing to `worked`.
        self._all_worked: dict[int, tuple[ReadingKey, ...]] = {}

    def wanted(self, keys: tuple[ReadingKey, ...]) -> tuple[ReadingKey, ...]:
        """`keys` less those the device has shown it does not have, in their order."""
        if not self:
            return keys
        kept = self._wanted.get(id(keys))
        if kept is not None and kept[0] is keys and kept[1] == self:  # nothing learned (or forgotten) since
            return kept[2]
        if len(self._wanted) >= _WANTED_KEPT:
            self._wanted.clear()  # the lists vary only with the slow readings being retried
        wanted = tuple(k for k in keys if k not in self)
        self._wanted[id(keys)] = (keys, set(self), wanted)
        return wanted

    def answered(self, asked: tuple[ReadingKey, ...], values: Mapping[ReadingKey, float]) -> None:
        """Adds the readings in `values`, read for `asked`, to `worked`."""
        if self._all_worked.get(id(asked)) is asked:
            return
        self.worked.update(values)
        # Every key asked has answered (checked only at a poll where as many answered as asked).
        if len(values) == len(asked) and self.worked.issuperset(asked):
            if len(self._all_worked) >= _WANTED_KEPT:
                self._all_worked.clear()
            self._all_worked[id(asked)] = asked


@dataclass
class _Mig:
    slot: int
    handle: Handle
    uuid: str
    name: str
    profile: str
    gpu_instance_id: int | None
    compute_instance_id: int | None
    sm_count: int | None
    unsupported: Unsupported = field(default_factory=Unsupported)
    activity: ActivityMeter | None = None
    # The instance's memory as last read, the processes (pid, memory) it was read beside, and
    # when it is read again whatever they do (backend clock): see Sampler._mig_memory.
    memory: Mapping[ReadingKey, float] | None = None
    memory_beside: tuple[tuple[int, int], ...] | None = None
    memory_due_at: float = 0.0


@dataclass
class _Gpu:
    index: int
    handle: Handle | None  # None until discovery has completed for it
    uuid: str
    name: str
    discovered: bool = True
    pci_bus_id: str = ""
    minor_number: int | None = None
    power_limit_w: float | None = None
    sm_count: int | None = None
    mig_enabled: bool = False
    # What one poll asks `read` for (minus what the GPU has shown it does not have), and the
    # NVLink keys among them.
    keys: tuple[ReadingKey, ...] = ()
    links: tuple[tuple[ReadingKey, int], ...] = ()
    # `keys` with each list of health readings the poll adds, by the health list's id: (keys,
    # health, both). The same tuple object each poll, which `Unsupported` and the backend know
    # by identity (see `_poll_keys`).
    asked: dict[int, tuple[tuple[ReadingKey, ...], ...]] = field(default_factory=dict)
    # The NVLink readings of the last poll: (links, their keys, each key's value, the readings).
    nvlinks_seen: tuple[object, tuple[ReadingKey, ...], tuple[object, ...], tuple[NvLinkReading, ...]] | None = None
    # The process readings of the last poll, and what they were made from (`_process_readings`).
    processes_seen: tuple[list[ProcessInfo], dict[int, float] | None, tuple[ProcessReading, ...]] | None = None
    migs: list[_Mig] = field(default_factory=list)
    # MIG-enabled GPUs: the GPU's memory total (read at discovery; `used` is the instances' sum)
    # and which MIG device a process runs on, by (GPU instance, compute instance) id. None: the
    # parent's process list cannot be split, so each MIG device's list is read.
    memory_total_bytes: int | None = None
    mig_by_instance: dict[tuple[int, int], _Mig] | None = None
    last_seen_us: int = 0
    # When this poll and the one before read the GPU (backend clock), and the driver's
    # per-process sampling period as observed (the smallest gap between two samples of a process).
    poll_at: float | None = None
    previous_poll_at: float | None = None
    # The energy counter at the last poll that read it (poll time, joules): the power reading of
    # the next poll is the mean between the two (_mean_power).
    energy_seen: tuple[float, float] | None = None
    sample_period_us: int | None = None
    # The most samples one process has had in one poll: the driver's ring buffer holds at most
    # that many (as far as we have seen), so a process with that many may have lost older ones.
    samples_kept: int = 0
    # The pids the GPU's process list named at its last reading: a process named then ran all
    # the interval since; one that was not may have started at any point in it.
    listed_pids: frozenset[int] = frozenset()
    # The MPS-client and graphics process lists: whether they named a process when last asked
    # (then they are asked every poll), and when they are next due while they do not.
    other_lists_found: bool = False
    other_lists_due_at: float = 0.0
    # Pids the per-process samples named that no list did when the lists were last asked on
    # their account: they do not make the lists be asked again before they are due (a graphics
    # list the driver refuses, say, would otherwise cost the MPS list's call every poll).
    unlisted_pids: frozenset[int] = frozenset()
    # The device's own utilization samples: the newest one read, and the sampling period as
    # observed (the smallest gap between two of them).
    utilization_seen_us: int = 0
    utilization_period_us: int | None = None
    unsupported: Unsupported = field(default_factory=Unsupported)
    # Clocks, throttling, memory errors, links: what to ask each poll (None: no group is on).
    telemetry: TelemetryReader | None = None
    lost_reason: str | None = None
    retry_at: float = 0.0
    retry_backoff_s: float = REINIT_BACKOFF_FIRST_S
    activity: ActivityMeter | None = None  # GPM, where the GPU has it
    # Static facts that failed at discovery (other than NOT_SUPPORTED): read again, with
    # backoff, while the GPU is polled as usual.
    missing: set[str] = field(default_factory=set)
    facts_retry_at: float = 0.0
    facts_backoff_s: float = REINIT_BACKOFF_FIRST_S


class Sampler:
    """Polls every device through a `DeviceBackend` into one `Snapshot` per `poll()`.

    The policy, in the order it matters:

    - A reading a device does not have (`ReadingNotSupported`) is learned once per (device,
      reading), logged once at info, and never asked for again. Absent readings are None,
      never 0.
    - Any other failed reading is counted in `errors` by (call, error) and leaves that reading
      absent for this poll only; it is asked for again next poll.
    - A lost device (`DeviceLost`) is reported down with the reason, and retried with
      exponential backoff on the backend's clock; the other devices are read as usual.
    - A driver that goes away (`DriverUnavailable`) makes the whole poll a down snapshot; the
      library is re-initialised with exponential backoff. A missing library
      (`DriverLibraryMissing`) is raised: nothing can be sampled on this host.
    - Static facts (name, uuid, PCI bus, power limit, SMs, NVLink count, MIG layout) are read
      at discovery, not every poll.
    - Discovery errors are retried with backoff. A GPU whose handle, uuid, name or MIG layout
      cannot be read is down for that error (`discovered` False) while the others are polled;
      an optional fact that fails (PCI bus, power limit, SMs, NVLink count) is absent and read
      again later, the GPU polled meanwhile (an NVLink count read before keeps its value: an
      error is never taken for "no NVLink"). While the driver cannot list the GPUs at all, the
      down snapshot still names the GPUs the node has: those an earlier discovery found, else
      NVML's device count, else the NVIDIA GPUs on the PCI bus (`pci_gpus`), else those the
      ledger remembers (`remember`), so their time is booked, as unobserved, from the start.
    - Health readings (clocks, throttling, memory errors, PCIe, NVLink; the groups the config
      switches on) go into the same `read` as the rest: every poll, every slow interval or once,
      as agent/devices/telemetry.py decides, into `DeviceReading.telemetry`.
    - A MIG-enabled GPU is read as itself (temperature, power, energy, NVLink) plus a memory
      reading per MIG device where its processes' memory changed (else every slow interval);
      its processes come from one read of the GPU's process list, split over the MIG devices
      by instance ids, so a fully split GPU costs fewer calls than a whole one. Its memory is
      the sum of its MIG devices' (NVML documents the GPU's own figure in MIG mode as that
      aggregate). Its GPM activity, its instances' and its own, is read on the slow rhythm by
      default (`readings.mig_activity`), each figure the mean over the last slow span.

    Not thread-safe: the scheduler runs one poll at a time.
    """

    def __init__(
        self,
        backend: DeviceBackend,
        hostname: str | None = None,
        pci_gpus: Callable[[], Sequence[str]] | None = None,
        busy_source: str = "auto",
        readings: ReadingOptions | None = None,
    ) -> None:
        if busy_source not in BUSY_POLICIES:
            raise ValueError(f"busy_source must be one of {', '.join(BUSY_POLICIES)}, got {busy_source!r}")
        self.backend = backend
        self.busy_policy = busy_source
        self._activity_backend = backend if isinstance(backend, ActivityBackend) else None
        self.hostname = hostname or socket.gethostname()
        # Which health readings each poll asks for (agent/devices/telemetry.py): the defaults
        # unless the config (`readings:`) says otherwise.
        self.readings = readings or ReadingOptions()
        self.errors: Counter[tuple[str, str]] = Counter()
        self._gpus: list[_Gpu] = []
        # What discovery (or the ledger, through `remember`) has learned of each GPU index, kept
        # across re-discoveries: a GPU that cannot be identified now goes by what it was.
        self._known_uuids: dict[int, str] = {}
        self._known_names: dict[int, str] = {}
        self._known_links: dict[str, int] = {}  # GPU uuid -> its NVLink count
        self._device_count: int | None = None  # NVML's, once it has answered
        self._pci_gpus = pci_gpus
        self._initialised = False
        # The GPU being read right now (its uuid, provisional before it has one; "" while the
        # driver itself is being set up), so that whoever gave up waiting on a poll knows which
        # GPU's call is stuck.
        self.reading: str | None = None
        self._generation = 0  # bumped by abandon(): an abandoned poll stops at its next device
        self._next_init_at = 0.0
        self._driver_down_reason = "UNINITIALIZED"
        self._init_backoff_s = REINIT_BACKOFF_FIRST_S
        self._driver_version = ""
        self._cuda_version: int | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Initialise the library and discover devices. Raises DriverLibraryMissing when there
        is no library.

        A driver that is installed but not answering yet (still loading, mid-upgrade) is not
        fatal: polls report it down and initialisation is retried with backoff.
        """
        now = self.backend.clock()
        try:
            self._init(now)
        except DriverLibraryMissing:
            raise
        except DeviceError as exc:
            self._count(exc)
            self._driver_down_reason = exc.error
            log.error("the GPU driver is not answering (%s); retrying with backoff", exc.error)
            self._schedule_reinit(now)

    def close(self) -> None:
        if self._initialised:
            for meter in self._meters():
                meter.close()
            self.backend.shutdown()
            self._initialised = False

    def remember(self, gpus: Iterable[tuple[int, str, str]]) -> None:
        """GPUs (index, uuid, name) known from elsewhere (the ledger's record of this node): what
        a GPU goes by while the driver cannot identify it. Discovery's own findings win."""
        for index, uuid, name in gpus:
            self._known_uuids.setdefault(index, uuid)
            if name:
                self._known_names.setdefault(index, name)
        # The devices are opened before the ledger: a GPU discovery could not identify then goes
        # by what is remembered from now on, not from its next retry (the time before this
        # start, booked at the first poll, is its time too, at its model's price).
        for gpu in self._gpus:
            if not gpu.discovered:
                gpu.uuid = self._known_uuids.get(gpu.index) or gpu.uuid
                gpu.name = gpu.name or self._known_names.get(gpu.index, "")
        self._unshare(self._gpus)

    def _init(self, now: float) -> None:
        self.backend.init()
        self._initialised = True
        try:
            self._driver_version = self.backend.driver_version()
            self._cuda_version = self._optional("", "cuda_version", self.backend.cuda_driver_version)
            self._device_count = self.backend.device_count()
            earlier = {g.index: g for g in self._gpus}
            gpus = [self._discover(i, now, earlier.get(i)) for i in range(self._device_count)]
            self._unshare(gpus)
        except DeviceError:
            # Half a discovery is no discovery: the next attempt starts from scratch (what it
            # identified is remembered, and names the GPUs while the driver is down).
            self._initialised = False
            raise
        self._gpus = gpus
        self._init_backoff_s = REINIT_BACKOFF_FIRST_S
        log.info(
            "GPU driver initialised: driver %s, %d GPU(s)",
            self._driver_version,
            len(self._gpus),
            extra={"driver_version": self._driver_version, "gpus": len(self._gpus)},
        )

    def _discover(self, index: int, now: float, earlier: _Gpu | None = None) -> _Gpu:
        """GPU `index` as discovery finds it now; `earlier` is what it was before (its backoff
        and down reason carry over). Raises only when the driver itself is gone."""
        b = self.backend
        try:
            handle = b.handle_by_index(index)
            # Each identity call on its own: what one of them gives is kept when the other fails.
            failure: DeviceError | None = None
            for read, known in ((b.uuid, self._known_uuids), (b.name, self._known_names)):
                try:
                    known[index] = read(handle)
                except (DriverUnavailable, DriverLibraryMissing):
                    raise
                except DeviceError as exc:
                    failure = failure or exc
            if failure is not None:
                raise failure
            gpu = self._discover_identified(index, handle, self._known_uuids[index], self._known_names[index], now)
        except (DriverUnavailable, DriverLibraryMissing):
            raise  # the driver itself: discovery as a whole is retried
        except DeviceError as exc:
            # One GPU that cannot be identified (lost, NOT_READY at boot, a corrupted inforom)
            # must not hide the others: it reads as down for its error, and is looked up again
            # with backoff.
            return self._undiscovered(index, now, exc, earlier)
        if earlier is not None and not earlier.discovered and earlier.lost_reason is not None:
            log.warning("GPU %d (%s) is discovered at last", index, gpu.uuid, extra={"gpu": index, "uuid": gpu.uuid})
        return gpu

    def _undiscovered(self, index: int, now: float, exc: DeviceError, earlier: _Gpu | None) -> _Gpu:
        self._count(exc)
        gpu = self._placeholder(index)
        if earlier is not None and not earlier.discovered:
            gpu.retry_backoff_s = earlier.retry_backoff_s
        if earlier is None or earlier.lost_reason != exc.error:
            log.error(
                "GPU %d cannot be discovered (%s); reading it as down and retrying with backoff",
                index,
                exc,
                extra={"gpu": index, "uuid": gpu.uuid},
            )
        gpu.lost_reason = exc.error
        self._back_off(gpu, now)
        return gpu

    def _unshare(self, gpus: Sequence[_Gpu]) -> None:
        """Two GPUs never go by one uuid. A GPU not identified yet goes by the uuid its index had
        (an earlier discovery's, the ledger's); where another index's GPU is identified under
        it, the GPUs have moved since (renumbered, a board pulled or swapped across a restart),
        that memory is stale, and the GPU goes by its provisional uuid: sharing the uuid, the two
        would share one GPU's interval, price and ledger rows."""
        identified = {g.uuid: g.index for g in gpus if g.discovered}
        for index, uuid in list(self._known_uuids.items()):
            if identified.get(uuid, index) != index:
                del self._known_uuids[index]
        for gpu in gpus:
            if not gpu.discovered and identified.get(gpu.uuid, gpu.index) != gpu.index:
                gpu.uuid = provisional_uuid(gpu.index)

    def _placeholder(self, index: int, pci_bus_id: str = "") -> _Gpu:
        """GPU `index` before discovery has completed for it: as remembered, else provisional."""
        uuid = self._known_uuids.get(index) or provisional_uuid(index)
        return _Gpu(index, None, uuid, self._known_names.get(index, ""), discovered=False, pci_bus_id=pci_bus_id)

    def _listed(self) -> list[_Gpu]:
        """The GPUs the node has, as far as anything says: discovery's, else placeholders for
        NVML's device count, the PCI bus's NVIDIA GPUs or the remembered GPUs."""
        if self._gpus:
            return self._gpus
        bus_ids: Sequence[str] = ()
        count = self._device_count
        if count is None:
            bus_ids = self._pci_gpus() if self._pci_gpus is not None else ()
            count = len(bus_ids) or (max(self._known_uuids) + 1 if self._known_uuids else 0)
        return [self._placeholder(i, bus_ids[i] if i < len(bus_ids) else "") for i in range(count)]

    def _discover_identified(self, index: int, handle: Handle, uuid: str, name: str, now: float) -> _Gpu:
        b = self.backend
        gpu = _Gpu(index=index, handle=handle, uuid=uuid, name=name)
        gpu.mig_enabled = bool(self._optional(uuid, "mig_mode", lambda: b.mig_enabled(handle)))
        self._read_facts(gpu, now, ("pci", "minor", "power_limit", "sm_count", "nvlink_count"))
        gpu.activity = self._meter(gpu, handle, None)
        if gpu.mig_enabled:
            gpu.migs = [self._discover_mig(gpu, slot, mig_handle) for slot, mig_handle in b.mig_handles(handle)]
        if gpu.migs and gpu.activity is not None and self.readings.mig_activity == MIG_ACTIVITY_SLOW:
            # The GPU's own activity takes its instances' rhythm: under MIG it is no one's busy
            # measure (accounting and the rules take each instance's), only its exported series,
            # and over the same span it is its instances' SM-weighted mean, so the GPU's series
            # and its instances' describe the same span. Two more calls a poll saved.
            gpu.activity.every_s = self.readings.slow_interval_s
        if gpu.migs:
            total = self._optional(uuid, "memory", lambda: b.read(handle, [_MEMORY_TOTAL]).values.get(_MEMORY_TOTAL))
            gpu.memory_total_bytes = None if total is None else int(total)
            gpu.mig_by_instance = _by_instance(gpu.migs)
        _set_keys(gpu, self.readings.exposition)
        return gpu

    def _read_facts(self, gpu: _Gpu, now: float, facts: Iterable[str]) -> None:
        """Read the optional static `facts` of a GPU. One that fails (other than NOT_SUPPORTED)
        is counted, left absent and read again with backoff; a lost GPU or a gone driver
        raises."""
        b = self.backend
        handle = gpu.handle
        reads: dict[str, Callable[[], object]] = {
            "pci": lambda: b.pci_bus_id(handle),
            "minor": lambda: b.minor_number(handle),
            "power_limit": lambda: b.power_limit_w(handle),
            "sm_count": lambda: b.sm_count(handle),
            "nvlink_count": lambda: b.nvlink_count(handle),
        }
        for what in facts:
            try:
                value = self._optional(gpu.uuid, what, reads[what])
            except (DeviceLost, DriverUnavailable, DriverLibraryMissing):
                raise
            except DeviceError as exc:
                self._count(exc)
                if what == "nvlink_count" and gpu.uuid in self._known_links:
                    # Read before: the links are still there, whatever this call says.
                    gpu.links = _links(self._known_links[gpu.uuid])
                    gpu.missing.discard(what)
                    continue
                if what not in gpu.missing:
                    log.warning(
                        "GPU %d (%s): %s unreadable (%s); reading it again later", gpu.index, gpu.uuid, what, exc
                    )
                gpu.missing.add(what)
                continue
            gpu.missing.discard(what)
            if what == "pci":
                gpu.pci_bus_id = str(value or "")
            elif what == "minor":
                gpu.minor_number = value if isinstance(value, int) else None
            elif what == "power_limit":
                gpu.power_limit_w = float(value) if isinstance(value, int | float) else None
            elif what == "sm_count":
                gpu.sm_count = value if isinstance(value, int) else None
            else:
                count = value if isinstance(value, int) else 0
                self._known_links[gpu.uuid] = count
                gpu.links = _links(count)
        if gpu.missing:
            gpu.facts_retry_at = now + gpu.facts_backoff_s
            gpu.facts_backoff_s = min(gpu.facts_backoff_s * 2, REINIT_BACKOFF_MAX_S)

    def _discover_mig(self, gpu: _Gpu, slot: int, handle: Handle) -> _Mig:
        b = self.backend
        uuid = b.uuid(handle)
        mig = _Mig(
            slot=slot,
            handle=handle,
            uuid=uuid,
            name=self._optional(uuid, "name", lambda: b.name(handle)) or gpu.name,
            profile=self._optional(uuid, "profile", lambda: b.mig_profile(handle)) or "",
            gpu_instance_id=self._optional(uuid, "gpu instance", lambda: b.gpu_instance_id(handle)),
            compute_instance_id=self._optional(uuid, "compute instance", lambda: b.compute_instance_id(handle)),
            sm_count=self._optional(uuid, "sm_count", lambda: b.sm_count(handle)),
        )
        mode = self.readings.mig_activity
        if (
            gpu.activity is not None
            and mig.gpu_instance_id is not None
            and self._activity_backend is not None
            and mode != MIG_ACTIVITY_OFF
        ):
            # A MIG instance's activity is sampled through its GPU, naming the GPU instance: a
            # sample and a metrics call each time, as NVML has no call for several instances. So
            # by default (slow) once a slow interval, the span's mean carried into the polls
            # between, and with every_poll each poll (14 calls a poll for a fully split H100).
            every_s = self.readings.slow_interval_s if mode == MIG_ACTIVITY_SLOW else None
            mig.activity = ActivityMeter(self._activity_backend, gpu.handle, mig.gpu_instance_id, every_s)
        return mig

    def _meter(self, gpu: _Gpu, handle: Handle, gpu_instance_id: int | None) -> ActivityMeter | None:
        """An activity meter for a GPU that has GPM; None (logged once) for one that has not."""
        activity = self._activity_backend
        supported = activity is not None and self._optional(
            gpu.uuid, "activity (GPM)", lambda: activity.activity_supported(handle)
        )
        if not supported or activity is None:
            if self.busy_policy == "gpm":
                log.warning(
                    "GPU %d (%s) has no GPM activity (Hopper or later, driver R520 or later): with "
                    "busy_source gpm it has no busy figure", gpu.index, gpu.uuid,
                )  # fmt: skip
            return None
        return ActivityMeter(activity, handle, gpu_instance_id)

    def _meters(self) -> list[ActivityMeter]:
        meters = [g.activity for g in self._gpus] + [m.activity for g in self._gpus for m in g.migs]
        return [m for m in meters if m is not None]

    def _busy_source(self, unsupported: Unsupported, meter: ActivityMeter | None, nvml: bool) -> str:
        """Which figure is the device's "busy": SM activity where it has GPM and the policy allows,
        else NVML's utilization where it has that (whole GPUs) and the policy allows."""
        if meter is not None and "activity" not in unsupported and self.busy_policy != "nvml":
            return BUSY_GPM
        return BUSY_NVML if nvml and self.busy_policy != "gpm" else ""

    def _activity(
        self, where: str, unsupported: Unsupported, meter: ActivityMeter | None, now: float | None
    ) -> Activity | None:
        """The device's activity since the previous poll (on the slow rhythm: over the last slow
        span, carried): learned unsupported once, counted when it fails otherwise; None at a
        device's first poll (on the slow rhythm too: a first span is one poll long)."""
        if meter is None or "activity" in unsupported:
            return None

        def failed(exc: DeviceError) -> None:
            self._count(exc)
            log.debug("%s: reading activity failed: %s", where, exc)

        try:
            activity = meter.read(failed, now)
        except ReadingNotSupported as exc:
            if "activity" in unsupported.worked:
                self._count(exc)
                return None
            unsupported.add("activity")
            log.info("%s: activity (GPM) is not supported (%s); not asking again", where, exc.error)
            return None
        if activity is not None:
            unsupported.worked.add("activity")
        return activity

    def _optional(self, key: str, what: str, read: Callable[[], T]) -> T | None:
        """A discovery-time reading the device may not have: None, logged once, when it doesn't."""
        try:
            return read()
        except ReadingNotSupported:
            log.info("%s: %s not supported", key or "node", what)
            return None

    # -- polling ------------------------------------------------------------------------------

    def abandon(self) -> None:
        """The poll now running was given up on (a call in it is stuck): when that call returns,
        the poll stops without touching another device, and its result is dropped."""
        self._generation += 1

    def down_snapshot(self, reason: str) -> Snapshot:
        """A poll that read nothing, every GPU down for `reason` (the driver itself is stuck)."""
        return self._down_snapshot(self.backend.clock(), reason)

    def poll(self, skip: Mapping[str, str] | None = None) -> Snapshot:
        """Read every device once. GPUs in `skip` (uuid -> reason) are not asked at all and
        read as down for that reason: a call on them is still stuck from an earlier poll."""
        generation = self._generation
        now = self.backend.clock()
        if not self._initialised:
            if now < self._next_init_at:
                # Waiting to retry: down for the reason the driver last gave.
                return self._down_snapshot(now, self._driver_down_reason)
            try:
                self.reading = ""
                self._init(now)
                log.warning("the GPU driver is back after re-initialisation")
            except DriverLibraryMissing:
                raise
            except DeviceError as exc:
                self._count(exc)
                self._schedule_reinit(now)
                return self._down_snapshot(now, exc.error)
        devices: list[DeviceReading] = []
        for position, gpu in enumerate(self._gpus):
            if self._generation != generation:
                raise PollAbandoned
            key = gpu.uuid
            if skip and key in skip:
                devices.append(_down(gpu, skip[key]))
                continue
            self.reading = key
            try:
                devices.extend(self._read_gpu(position, gpu, now))
            except DriverUnavailable as exc:
                self._count(exc)
                log.error("the GPU driver went away (%s); re-initialising with backoff", exc.error)
                self.backend.shutdown()
                self._initialised = False
                self._schedule_reinit(now)
                return self._down_snapshot(now, exc.error)
        self.reading = None
        if self._generation != generation:
            raise PollAbandoned
        return Snapshot(
            taken_at=now,
            node=NodeInfo(self.hostname, self._driver_version, self._cuda_version),
            devices=tuple(devices),
        )

    def _schedule_reinit(self, now: float) -> None:
        self._next_init_at = now + self._init_backoff_s
        self._init_backoff_s = min(self._init_backoff_s * 2, REINIT_BACKOFF_MAX_S)

    def _down_snapshot(self, now: float, reason: str) -> Snapshot:
        self._driver_down_reason = reason
        devices = tuple(_down(g, reason) for g in self._listed())
        node = NodeInfo(self.hostname, self._driver_version, self._cuda_version)
        return Snapshot(now, node, devices, driver_up=False, down_reason=reason)

    def _count(self, exc: DeviceError) -> None:
        self.errors[(exc.call, exc.error)] += 1

    @staticmethod
    def _back_off(gpu: _Gpu, now: float) -> None:
        gpu.retry_at = now + gpu.retry_backoff_s
        gpu.retry_backoff_s = min(gpu.retry_backoff_s * 2, REINIT_BACKOFF_MAX_S)

    def _lost(self, gpu: _Gpu, now: float, exc: DeviceError) -> DeviceReading:
        if gpu.lost_reason is None:
            log.error(
                "GPU %d (%s) is lost: %s", gpu.index, gpu.uuid, exc.error, extra={"gpu": gpu.index, "uuid": gpu.uuid}
            )
        self._count(exc)
        gpu.lost_reason = exc.error
        self._back_off(gpu, now)
        # Activity and power resume with a fresh interval: the one spanning the loss is not measured.
        gpu.energy_seen = None
        for meter in (gpu.activity, *(m.activity for m in gpu.migs)):
            if meter is not None:
                meter.restart()
        for mig in gpu.migs:
            mig.memory = None  # read afresh when the GPU answers again
        return _down(gpu, exc.error)

    def _read_gpu(self, position: int, gpu: _Gpu, now: float) -> list[DeviceReading]:
        if gpu.lost_reason is not None:
            if now < gpu.retry_at:
                return [_down(gpu, gpu.lost_reason)]
            if not gpu.discovered:
                # Not discovered yet (lost, or unidentifiable, at discovery): look it up again.
                self._gpus[position] = gpu = self._discover(gpu.index, now, gpu)
                self._unshare(self._gpus)
                if not gpu.discovered:
                    return [_down(gpu, gpu.lost_reason or "UNKNOWN")]
        try:
            if gpu.missing and now >= gpu.facts_retry_at:
                self._read_facts(gpu, now, sorted(gpu.missing))
                _set_keys(gpu, self.readings.exposition)
            gpu.previous_poll_at, gpu.poll_at = gpu.poll_at, now
            readings = self._read_healthy(gpu)
        except DeviceLost as exc:
            return [self._lost(gpu, now, exc)]
        if gpu.lost_reason is not None:
            log.warning("GPU %d (%s) is readable again", gpu.index, gpu.uuid)
            gpu.lost_reason = None
            gpu.retry_backoff_s = REINIT_BACKOFF_FIRST_S
        return readings

    def _read(
        self, where: str, unsupported: Unsupported, handle: Handle, keys: Sequence[ReadingKey]
    ) -> Mapping[ReadingKey, float]:
        """The readings of `keys` the device has and gave this poll; learns and counts the rest."""
        wanted = unsupported.wanted(tuple(keys))
        if not wanted:
            return {}
        try:
            result = self.backend.read(handle, wanted)
        except (DeviceLost, DriverUnavailable):
            raise
        except DeviceError as exc:
            self._count(exc)
            return {}
        counted: set[int] = set()
        unsupported.answered(wanted, result.values)
        for key, failure in result.errors.items():
            if isinstance(failure, ReadingNotSupported) and (
                key not in unsupported.worked or isinstance(failure, ReadingNoLongerSupported)
            ):
                unsupported.add(key)
                log.info("%s: %s is not supported (%s); not asking again", where, key, failure.error)
            elif id(failure) not in counted:  # one failed call answering several keys counts once
                counted.add(id(failure))
                self._count(failure)
                log.debug("%s: reading %s failed: %s", where, key, failure)
        return result.values

    def _call(
        self, where: str, unsupported: Unsupported, what: str, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T | None:
        """`call(*args, **kwargs)`'s result, or None. Unsupported is learned (never asked again);
        a lost device or a driver that went away propagates; any other error counts and leaves
        this poll's result absent. The arguments are passed, not closed over in a lambda: a
        poll makes dozens of these calls, and a lambda costs one more Python call each."""
        if what in unsupported:
            return None
        try:
            result = call(*args, **kwargs)
        except ReadingNotSupported as exc:
            if what in unsupported.worked:  # it answered before: a transient failure
                self._count(exc)
                return None
            unsupported.add(what)
            log.info("%s: %s is not supported (%s); not asking again", where, what, exc.error)
            return None
        except (DeviceLost, DriverUnavailable):
            raise
        except DeviceError as exc:
            self._count(exc)
            log.debug("%s: reading %s failed: %s", where, what, exc)
            return None
        unsupported.worked.add(what)
        return result

    def _telemetry_reader(self, gpu: _Gpu) -> TelemetryReader | None:
        """The GPU's health reader, made anew when its NVLink count is (re)learned. A
        MIG-enabled GPU's health readings all take the slow rhythm: its instances' memory
        (a call each, 7 for a fully split A100) is read on it too where their processes hold
        still, so its steady polls are 3 calls and one in a slow interval carries the rest."""
        reader = gpu.telemetry
        if reader is None or reader.links != len(gpu.links):
            reader = gpu.telemetry = TelemetryReader(self.readings, len(gpu.links), all_slow=gpu.mig_enabled)
        return reader if reader.enabled else None

    def _read_healthy(self, gpu: _Gpu) -> list[DeviceReading]:
        where = f"GPU {gpu.index} ({gpu.uuid})"
        reader, now = self._telemetry_reader(gpu), gpu.poll_at or 0.0
        health = reader.keys(now) if reader is not None else ()
        values = self._read(where, gpu.unsupported, gpu.handle, _poll_keys(gpu, health))
        # Without an exposition no link state is asked (`_set_keys`): none to look for among the values.
        links = _nvlinks(gpu, values) if self.readings.exposition else ()
        telemetry = reader.telemetry(now, health, values, gpu.unsupported) if reader is not None else None
        if gpu.migs:
            return self._read_mig_gpu(gpu, where, values, links, telemetry)
        memory_used = values.get(_MEMORY_USED)
        memory_total = values.get(_MEMORY_TOTAL)
        memory_free = values.get(_MEMORY_FREE)
        processes = self._whole_gpu_processes(gpu, where)
        activity = self._activity(where, gpu.unsupported, gpu.activity, gpu.poll_at)
        busy_source = self._busy_source(gpu.unsupported, gpu.activity, nvml=True)
        if busy_source == BUSY_GPM:
            # GPM's graphics activity is the share of the interval in which a kernel ran: what the
            # device's own utilization samples average to, measured end to end. So where GPM is
            # the busy source the samples (a call a poll) buy nothing, and are not read.
            interval_utilization = activity.graphics_active if activity is not None else None
        else:
            interval_utilization = self._interval_utilization(gpu, where)
        return [
            DeviceReading(
                index=gpu.index,
                uuid=gpu.uuid,
                name=gpu.name,
                up=True,
                pci_bus_id=gpu.pci_bus_id,
                minor_number=gpu.minor_number,
                mig_enabled=gpu.mig_enabled,
                sm_count=gpu.sm_count,
                utilization=values.get(_UTILIZATION),
                memory_used_bytes=None if memory_used is None else int(memory_used),
                memory_total_bytes=None if memory_total is None else int(memory_total),
                memory_free_bytes=None if memory_free is None else int(memory_free),
                temperature_c=values.get(_TEMPERATURE),
                power_w=_mean_power(gpu, values),
                power_limit_w=gpu.power_limit_w,
                energy_j=values.get(_ENERGY),
                nvlinks=links,
                processes=processes or (),
                processes_known=processes is not None,
                interval_utilization=interval_utilization,
                activity=activity,
                busy_source=busy_source,
                telemetry=telemetry,
            )
        ]

    def _interval_utilization(self, gpu: _Gpu, where: str) -> float | None:
        """The GPU's utilization (0-1) time-weighted over its own samples since the last poll.

        The driver records one device sample every sampling period, 0% included, so unlike the
        per-process samples a missing period is missing data (a ring that wrapped, a driver that
        paused), not idleness: each sample stands for the time since the one before it, at most
        one sampling period, and the mean is over the time the samples cover. At a first poll,
        or with a single sample, each sample counts for one period. None where the samples
        could not be read (learned unsupported, or failed this poll: then the next poll reads
        from the last sample seen, so the mean covers both intervals) or none were new."""
        since = gpu.utilization_seen_us
        samples = self._call(
            where, gpu.unsupported, "utilization samples", self.backend.utilization_samples, gpu.handle, since
        )
        if not samples:
            return None
        # A column at a time (a poll reads a sample a second of every GPU). The driver answers
        # the samples newer than `since`, oldest first: they are filtered and sorted only where not.
        times, percents = zip(*samples, strict=True)
        if times[0] <= since or not all(map(operator.lt, times, times[1:])):
            stamps = sorted([(stamp, percent) for stamp, percent in samples if stamp > since])
            if not stamps:
                return None
            times, percents = zip(*stamps, strict=True)
        # The gaps before each sample (the first: since the last poll's last), worked out once
        # for the period learned from them and the spans below.
        gaps = list(map(operator.sub, times, (since, *times[:-1])))
        # `_shortest_gap(times)`, from the gaps already worked out: the shortest that is not zero.
        shortest = min(filter(None, gaps[1:]), default=None)
        if shortest is not None:
            gpu.utilization_period_us = min(shortest, gpu.utilization_period_us or shortest)
        period = gpu.utilization_period_us
        if period is not None and since:
            # Each sample spans the time since the one before, at most a period. The sums are
            # added up in order, as the loop below does.
            spans = [period if period < gap else gap for gap in gaps]
            weighted = functools.reduce(operator.add, map(operator.mul, percents, spans), 0.0)
            total = functools.reduce(operator.add, spans, 0.0)
        else:
            weighted = total = 0.0
            previous = since if since else None
            for stamp, percent in zip(times, percents, strict=True):
                span = period if period is not None else 1
                if previous is not None and period is not None:
                    span = min(stamp - previous, period)
                weighted += percent * span
                total += span
                previous = stamp
        gpu.utilization_seen_us = times[-1]
        return min(weighted / total / 100, 1.0) if total > 0 else None

    def _whole_gpu_processes(self, gpu: _Gpu, where: str) -> tuple[ProcessReading, ...] | None:
        """The GPU's processes; None when the list could not be read this poll (not "none")."""
        infos = self._call(where, gpu.unsupported, "processes", self.backend.running_processes, gpu.handle)
        if infos is None:
            return None
        asked = gpu.other_lists_found or gpu.poll_at is None or gpu.poll_at >= gpu.other_lists_due_at
        if asked:
            gpu.unlisted_pids = frozenset()
            infos = self._with_other_lists(gpu, where, infos)
            if infos is None:
                return None
        listed_before, gpu.listed_pids = gpu.listed_pids, frozenset([i.pid for i in infos])
        if not infos:
            return ()
        utils = self._process_utils(gpu, where, listed_before)
        if not asked and utils is not None and not utils.keys() <= gpu.listed_pids | gpu.unlisted_pids:
            # A pid at work that no list read this poll names: an MPS client or a graphics
            # process that started since the other lists were last asked.
            infos = self._with_other_lists(gpu, where, infos)
            if infos is None:
                return None
            gpu.listed_pids = frozenset([i.pid for i in infos])
            gpu.unlisted_pids = frozenset(utils.keys() - gpu.listed_pids)
        return _process_readings(gpu, infos, utils)

    def _read_mig_gpu(
        self,
        gpu: _Gpu,
        where: str,
        values: Mapping[ReadingKey, float],
        links: tuple[NvLinkReading, ...],
        telemetry: Telemetry | None = None,
    ) -> list[DeviceReading]:
        processes = self._mig_processes(gpu, where)
        memory = [self._mig_memory(f"{where} MIG {m.slot}", m, processes.get(m.slot), gpu.poll_at) for m in gpu.migs]
        activity = [self._activity(f"{where} MIG {m.slot}", m.unsupported, m.activity, gpu.poll_at) for m in gpu.migs]
        used = [m.get(_MEMORY_USED) for m in memory]
        parent = DeviceReading(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            up=True,
            pci_bus_id=gpu.pci_bus_id,
            minor_number=gpu.minor_number,
            mig_enabled=True,
            sm_count=gpu.sm_count,
            utilization=values.get(_UTILIZATION),
            memory_used_bytes=None if None in used else int(sum(u for u in used if u is not None)),
            memory_total_bytes=gpu.memory_total_bytes,
            temperature_c=values.get(_TEMPERATURE),
            power_w=_mean_power(gpu, values),
            power_limit_w=gpu.power_limit_w,
            energy_j=values.get(_ENERGY),
            nvlinks=links,
            activity=self._activity(where, gpu.unsupported, gpu.activity, gpu.poll_at),
            busy_source=self._busy_source(gpu.unsupported, gpu.activity, nvml=True),
            telemetry=telemetry,
        )
        readings = [parent]
        for mig, mig_memory, mig_activity in zip(gpu.migs, memory, activity, strict=True):
            mig_used = mig_memory.get(_MEMORY_USED)
            mig_total = mig_memory.get(_MEMORY_TOTAL)
            mig_free = mig_memory.get(_MEMORY_FREE)
            readings.append(
                DeviceReading(
                    index=gpu.index,
                    uuid=mig.uuid,
                    name=mig.name,
                    up=True,
                    parent_uuid=gpu.uuid,
                    mig_index=mig.slot,
                    mig_profile=mig.profile,
                    gpu_instance_id=mig.gpu_instance_id,
                    pci_bus_id=gpu.pci_bus_id,
                    minor_number=gpu.minor_number,
                    sm_count=mig.sm_count,
                    memory_used_bytes=None if mig_used is None else int(mig_used),
                    memory_total_bytes=None if mig_total is None else int(mig_total),
                    memory_free_bytes=None if mig_free is None else int(mig_free),
                    processes=processes.get(mig.slot) or (),
                    processes_known=processes.get(mig.slot) is not None,
                    activity=mig_activity,
                    # NVML has no utilization of a MIG instance: GPM's SM activity, or nothing.
                    busy_source=self._busy_source(mig.unsupported, mig.activity, nvml=False),
                )
            )
        return readings

    def _mig_memory(
        self, where: str, mig: _Mig, processes: tuple[ProcessReading, ...] | None, now: float | None
    ) -> Mapping[ReadingKey, float]:
        """A MIG instance's memory (used, total), read when something can have changed it.

        Memory is allocated by processes, and the GPU's process list, read every poll in one
        call, gives each process's memory: an instance whose processes and their memory are as
        they were at its last reading holds what it held then. So it is read again only when
        they change, when its last reading failed, and every `readings.slow_interval` (for what
        the driver holds beside the processes), not every poll: a fully split GPU would spend
        seven of its ten calls a poll on these. Where the list cannot tell (not read this poll,
        or a process's memory unknown), it is read."""
        beside = None
        if processes is not None and all(p.used_memory_bytes is not None for p in processes):
            beside = tuple(sorted((p.pid, p.used_memory_bytes or 0) for p in processes))
        if (
            mig.memory is not None
            and beside is not None
            and beside == mig.memory_beside
            and now is not None
            and now < mig.memory_due_at
        ):
            return mig.memory
        values = self._read(where, mig.unsupported, mig.handle, _MEMORY)
        if _MEMORY_USED in values and now is not None:
            mig.memory, mig.memory_beside = values, beside
            mig.memory_due_at = now + self.readings.slow_interval_s
        else:
            mig.memory = None
        return values

    def _mig_processes(self, gpu: _Gpu, where: str) -> dict[int, tuple[ProcessReading, ...] | None]:
        """Processes per MIG slot: the GPU's list split by instance ids where that works, else
        each MIG device's own list. SM utilization is None: NVML cannot sample it under MIG.
        A slot missing (or None) could not be read this poll."""
        if gpu.mig_by_instance is not None:
            try:
                infos = self.backend.running_processes(gpu.handle)
            except (ReadingNotSupported, PermissionDenied) as exc:
                log.info("%s: cannot list the MIG devices' processes at once (%s): asking each", where, exc.error)
                gpu.mig_by_instance = None
            except (DeviceLost, DriverUnavailable):
                raise
            except DeviceError as exc:
                self._count(exc)
                return {}
            else:
                split = _split_by_instance(infos, gpu.mig_by_instance)
                return {mig.slot: split.get(mig.slot, ()) for mig in gpu.migs}
        found: dict[int, tuple[ProcessReading, ...] | None] = {}
        for mig in gpu.migs:
            read = self.backend.running_processes
            mig_infos = self._call(f"{where} MIG {mig.slot}", mig.unsupported, "processes", read, mig.handle)
            found[mig.slot] = None if mig_infos is None else _readings(mig_infos)
        return found

    def _with_other_lists(self, gpu: _Gpu, where: str, infos: list[ProcessInfo]) -> list[ProcessInfo] | None:
        """The compute list with the MPS clients and graphics processes merged in; None where
        one of those lists failed this poll. While they name no process they are asked once a
        slow interval (and when a process sample names a pid no list does), not every poll:
        two calls a GPU a poll would take a busy GPU past its budget of ten."""
        # MPS clients run inside the MPS server's context, so the server is in the compute list
        # whenever there are any: on a GPU with no compute process the MPS list is not asked.
        mps = self._other_list(gpu, where, "mps processes", self.backend.mps_processes) if infos else []
        graphics = self._other_list(gpu, where, "graphics processes", self.backend.graphics_processes)
        if mps is None or graphics is None:
            return None
        gpu.other_lists_found = bool(mps or graphics)
        gpu.other_lists_due_at = (gpu.poll_at or 0.0) + self.readings.slow_interval_s
        return _merged(infos, mps, graphics) if gpu.other_lists_found else infos

    def _other_list(
        self, gpu: _Gpu, where: str, what: str, read: Callable[[Handle], list[ProcessInfo]]
    ) -> list[ProcessInfo] | None:
        """An MPS-client or graphics process list: [] where the driver has no such list (learned
        once), None where it failed this poll (the GPU's list is then incomplete, not read)."""
        found = self._call(where, gpu.unsupported, what, read, gpu.handle)
        if found is None:
            return [] if what in gpu.unsupported else None
        return found

    def _process_utils(self, gpu: _Gpu, where: str, listed_before: frozenset[int]) -> dict[int, float] | None:
        """SM utilization per pid, time-weighted over the interval since the previous poll.

        The driver keeps one sample per sampling period, and only for processes that did some
        work in it: a period with no sample is a period at 0%. So the sum of a process's samples
        is divided by the periods the interval holds, not by the samples present: a job at 90%
        for 5 s of every 15 s reads 30%, not 90%. The period is learned from the samples (the
        smallest gap between two samples of one process); until it is known, and at the first
        poll, the mean of the samples present is all there is (a driver that answers one sample
        per process, each stamped at its own time, gives no period: that sample is the figure).

        The driver keeps a short ring of samples per process. A process with fewer samples than
        the ring holds lost none; one with a full ring may have lost older ones. Where it was on
        the GPU's list at the previous poll (`listed_before`) it ran all the interval, so its
        figure is over the span its samples cover (its oldest to now), standing for the whole
        interval. One that was not may have started just before its oldest sample: its lost
        periods count as 0, as periods without a sample do, or its rate over the last few
        seconds would stand for the interval, and accounting, which scales a figure up to the
        part of the interval a new process held the GPU, would credit it with more busy time
        than it ran."""
        since = gpu.last_seen_us
        samples = self._call(
            where, gpu.unsupported, "process utilization", self.backend.process_utilization, gpu.handle, since
        )
        if samples is None:
            return None
        # A busy GPU gives thousands of samples a poll: one dict lookup per sample, and the
        # samples are filtered only where the driver answered some not newer than `since`.
        columns = tuple(zip(*samples, strict=True))
        if columns and min(columns[1]) <= since:
            columns = tuple(zip(*[sample for sample in samples if sample[1] > since], strict=True))
        if not columns:
            return {}  # no process did any work since the last poll
        pids, stamps_us, utils_of = columns
        gpu.last_seen_us = max(since, *stamps_us)
        by_pid: Mapping[int, Sequence[int]]
        stamps_by_pid: Mapping[int, Sequence[int]]
        if pids.count(pids[0]) == len(pids):
            # One process at work, the usual case: its samples are the columns as they are.
            by_pid, stamps_by_pid = {pids[0]: utils_of}, {pids[0]: stamps_us}
        else:
            utils_by_pid: defaultdict[int, list[int]] = defaultdict(list)
            stamps_of_pid: defaultdict[int, list[int]] = defaultdict(list)
            for pid, stamp_us, util in zip(*columns, strict=True):
                utils_by_pid[pid].append(util)
                stamps_of_pid[pid].append(stamp_us)
            by_pid, stamps_by_pid = utils_by_pid, stamps_of_pid
        # A period is the gap between two samples of one process. The driver stamps each
        # process's sample when it records that process, so two processes' stamps are any
        # distance apart (microseconds, on one GPU: NVIDIA/go-nvml issue 51), never a period.
        gaps = [gap for stamps in stamps_by_pid.values() if (gap := _shortest_gap(sorted(stamps))) is not None]
        if gaps:
            shortest = min(gaps)
            gpu.sample_period_us = min(shortest, gpu.sample_period_us or shortest)
        gpu.samples_kept = max(gpu.samples_kept, max(map(len, by_pid.values()), default=0))
        period_us, kept = gpu.sample_period_us, gpu.samples_kept
        if not period_us or gpu.previous_poll_at is None or gpu.poll_at is None:
            # Sum whole percents and divide once: a steady 92% reads 0.92, not 0.9200000000000002.
            return {pid: sum(utils) / len(utils) / 100 for pid, utils in by_pid.items()}
        now_us = gpu.poll_at * 1_000_000
        interval_periods = (gpu.poll_at - gpu.previous_poll_at) * 1_000_000 / period_us
        found: dict[int, float] = {}
        for pid, utils in by_pid.items():
            periods = interval_periods
            if kept >= MIN_RING_SAMPLES and len(utils) >= kept and interval_periods > kept and pid in listed_before:
                # A full ring over an interval longer than it, of a process that ran all of it:
                # older samples may be gone, so only the span its samples cover (oldest to now)
                # is known: whole periods, as the driver stamps each process at its own point of
                # a period, and the part of a period after that point is not sampled yet.
                oldest_us = min(stamps_by_pid[pid])
                periods = min(periods, (now_us - oldest_us) // period_us + 1)
            found[pid] = min(sum(utils) / max(periods, len(utils)) / 100, 1.0)
        return found


def _process_readings(
    gpu: _Gpu, infos: list[ProcessInfo], utils: dict[int, float] | None
) -> tuple[ProcessReading, ...]:
    """A whole GPU's processes with their SM utilization (None where it could not be read). The
    last poll's tuple where the processes and their utilization are as they were then: a job's
    memory, and its utilization over a poll, seldom change."""
    seen = gpu.processes_seen
    if seen is not None and seen[0] == infos and seen[1] == utils:
        return seen[2]
    if utils is None:
        readings = tuple(ProcessReading(i.pid, i.used_memory_bytes, None, i.gpu_instance_id) for i in infos)
    else:
        # A process with no sample since the last poll did no work: the driver only reports
        # processes with non-zero utilization.
        readings = tuple(
            ProcessReading(i.pid, i.used_memory_bytes, utils.get(i.pid, 0.0), i.gpu_instance_id) for i in infos
        )
    gpu.processes_seen = (infos, utils, readings)
    return readings


def _shortest_gap(stamps: Sequence[int]) -> int | None:
    """The shortest gap between two consecutive stamps (in order) that is not zero; None where
    there is none. All the periods are learned from: only the shortest is kept."""
    return min(filter(None, map(operator.sub, stamps[1:], stamps)), default=None)


def _poll_keys(gpu: _Gpu, health: tuple[ReadingKey, ...]) -> tuple[ReadingKey, ...]:
    """What a poll of `gpu` asks `read` for: its keys and the health readings. Made once for each
    health list `TelemetryReader.keys` hands out (a poll alternates between two or three), not
    concatenated every poll: `Unsupported.wanted` and the backend's read plans know it by
    identity, where an equal new tuple would have them hash its dozens of keys."""
    if not health:
        return gpu.keys
    known = gpu.asked.get(id(health))
    if known is not None and known[0] is gpu.keys and known[1] is health:
        return known[2]
    if len(gpu.asked) >= _WANTED_KEPT:
        gpu.asked.clear()  # the health lists vary only with the slow readings being retried
    keys = gpu.keys + health
    gpu.asked[id(health)] = (gpu.keys, health, keys)
    return keys


_ABSENT = object()  # a reading `values` lacks (`_nvlinks`)


def _nvlinks(gpu: _Gpu, values: Mapping[ReadingKey, float]) -> tuple[NvLinkReading, ...]:
    """The GPU's NVLink readings: each link whose state was read, up or down. The last poll's
    tuple where every link reads as it did then, as links seldom change state."""
    seen = gpu.nvlinks_seen
    if seen is None or seen[0] is not gpu.links:
        seen = (gpu.links, tuple([key for key, _link in gpu.links]), (), ())
    states = tuple(map(values.get, seen[1], itertools.repeat(_ABSENT)))
    if states == seen[2]:
        return seen[3]
    readings = tuple(
        [_nvlink(link, bool(up)) for (_key, link), up in zip(gpu.links, states, strict=True) if up is not _ABSENT]
    )
    gpu.nvlinks_seen = (gpu.links, seen[1], states, readings)
    return readings


@functools.cache
def _nvlink(link: int, up: bool) -> NvLinkReading:
    # A link reading is one of two values per link: shared, not rebuilt for every link of every
    # GPU every poll.
    return NvLinkReading(link, up)


def _readings(infos: Sequence[ProcessInfo]) -> tuple[ProcessReading, ...]:
    """Processes on a device that cannot sample per-process utilization: sm_util None."""
    return tuple(ProcessReading(i.pid, i.used_memory_bytes, None, i.gpu_instance_id) for i in infos)


def _by_instance(migs: Sequence[_Mig]) -> dict[tuple[int, int], _Mig] | None:
    """MIG devices by (GPU instance, compute instance) id; None when some id is unknown."""
    found: dict[tuple[int, int], _Mig] = {}
    for mig in migs:
        if mig.gpu_instance_id is None or mig.compute_instance_id is None:
            return None
        found[(mig.gpu_instance_id, mig.compute_instance_id)] = mig
    return found if len(found) == len(migs) else None


def _merged(*lists: list[ProcessInfo]) -> list[ProcessInfo]:
    """The process lists as one, each process once: a process with compute and graphics
    contexts is in both lists, with the same memory (the larger is kept where they differ)."""
    found: dict[tuple[int, int | None, int | None], ProcessInfo] = {}
    for infos in lists:
        for info in infos:
            key = (info.pid, info.gpu_instance_id, info.compute_instance_id)
            seen = found.get(key)
            if seen is None or (seen.used_memory_bytes or 0) < (info.used_memory_bytes or 0):
                found[key] = info
    return list(found.values())


def _split_by_instance(
    infos: Sequence[ProcessInfo], migs: Mapping[tuple[int, int], _Mig]
) -> dict[int, tuple[ProcessReading, ...]]:
    found: dict[int, list[ProcessReading]] = {mig.slot: [] for mig in migs.values()}
    for info in infos:
        if info.gpu_instance_id is None or info.compute_instance_id is None:
            continue
        mig = migs.get((info.gpu_instance_id, info.compute_instance_id))
        # A process on an instance created since discovery has no MIG device here to show it on.
        if mig is not None:
            found[mig.slot].append(ProcessReading(info.pid, info.used_memory_bytes, None, info.gpu_instance_id))
    return {slot: tuple(readings) for slot, readings in found.items()}


# The spans _mean_power takes a mean over. Shorter: the energy counter moves in steps, so at
# polls a tenth of a second apart a mean could jump between 0 and a multiple of the draw; the
# mean then spans the polls since the last one at least this long ago. Longer: a clock set forward
# (a year, say) would spread a few seconds' energy over it and read ~0 W.
MEAN_POWER_MIN_SPAN_S = 1.0
MEAN_POWER_MAX_SPAN_S = 3600.0


def _mean_power(gpu: _Gpu, values: Mapping[ReadingKey, float]) -> float | None:
    """The board's mean power since the previous poll, from the energy counter: what a gauge
    scraped every few seconds should say. The driver's own power reading is a 1 s average at best
    (NVML_FI_DEV_POWER_AVERAGE, and nvmlDeviceGetPowerUsage from Ampere on, GA100 aside) and an
    instant at worst, and either lands where it lands in a workload that pulses: on an H200
    running half-second bursts of matrix products, polls read 129 W where the board drew 448 W
    on average (scripts/realgpu). The driver's reading stands where there is no mean: a first poll,
    one after a loss, a GPU without the counter, a counter that went back (driver reload), a span
    under MEAN_POWER_MIN_SPAN_S (the mean then waits for one that long) or over MEAN_POWER_MAX_SPAN_S."""
    energy, now = values.get(_ENERGY), gpu.poll_at
    previous = gpu.energy_seen
    if energy is None or now is None:
        gpu.energy_seen = None
        return values.get(_POWER)
    if previous is None or now <= previous[0] or energy < previous[1]:
        gpu.energy_seen = (now, energy)
        return values.get(_POWER)
    since, before = previous
    if now - since < MEAN_POWER_MIN_SPAN_S:
        return values.get(_POWER)  # the anchor stays: the mean spans this poll's interval too
    gpu.energy_seen = (now, energy)
    if now - since > MEAN_POWER_MAX_SPAN_S:
        return values.get(_POWER)
    return round((energy - before) / (now - since), 3)  # the driver's own resolution: milliwatts


def _down(gpu: _Gpu, reason: str) -> DeviceReading:
    """A GPU that could not be read: its identity, up=0, and why; no readings."""
    return DeviceReading(
        index=gpu.index,
        uuid=gpu.uuid,
        name=gpu.name,
        up=False,
        pci_bus_id=gpu.pci_bus_id,
        minor_number=gpu.minor_number,
        down_reason=reason,
        discovered=gpu.discovered,
    )


def _links(count: int) -> tuple[tuple[ReadingKey, int], ...]:
    return tuple((ReadingKey(Quantity.NVLINK_UP, link), link) for link in range(count))


def _set_keys(gpu: _Gpu, exposition: bool) -> None:
    """What one poll asks `read` for: a MIG-enabled GPU's memory is its MIG devices'. The
    temperature and the NVLinks' states only where there is an `exposition` to show them."""
    temperature = (_TEMPERATURE,) if exposition else ()
    links = tuple(key for key, _link in gpu.links) if exposition else ()
    if gpu.migs:
        gpu.keys = (_UTILIZATION, *temperature, _POWER, _ENERGY, *links)
    else:
        gpu.keys = (*_MEMORY, _UTILIZATION, *temperature, _POWER, _ENERGY, *links)
