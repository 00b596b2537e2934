"""A device backend that forwards to another and keeps what `gpuledger record` needs besides the
snapshots: the per-process utilization samples the driver handed out (a snapshot keeps only
their mean), and every call that failed, when, on which device and how.

It changes nothing it forwards: the sampler, the event reader and the activity meters see the
wrapped backend's answers and errors exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from agent.devices.activity import ActivityBackend
from agent.devices.backend import (
    DeviceBackend,
    DeviceError,
    DeviceLost,
    DriverUnavailable,
    Handle,
    ProcessInfo,
    ProcessSample,
    ReadingKey,
    ReadResult,
    UtilizationSample,
)
from agent.devices.events import DeviceEvent, EventBackend, EventKind
from agent.model import Activity

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Failure:
    """A call that failed: at (backend clock), on `uuid` ("" for the driver itself, or a GPU not
    identified yet: then `index`, where the call named one), the call and the library's error
    name; `lost` for a device gone, `driver` for the driver gone; `asked`, what it was asked for
    (the readings, or the backend method), as `TappedBackend.answered` keeps it."""

    at: float
    uuid: str
    call: str
    error: str
    lost: bool = False
    driver: bool = False
    index: int | None = None
    asked: tuple[object, ...] = ()


class TappedBackend:
    """`inner`, with its per-process samples and its failures kept (see the module docstring).
    Capabilities beyond `DeviceBackend` (events, activity) are forwarded as they are."""

    def __init__(self, inner: DeviceBackend) -> None:
        self._inner = inner
        self.clock = inner.clock
        self._uuids: dict[int, str] = {}  # id(handle) -> the uuid it answered
        self._indexes: dict[int, int] = {}  # id(handle) -> its GPU's index (a MIG device's: its GPU's)
        self.samples: dict[str, list[ProcessSample]] = {}  # GPU uuid -> every sample, in order
        self.failures: list[Failure] = []
        # GPU index -> each reading (a ReadingKey) and backend method (its name) that answered at
        # least once on it or its MIG devices: a reading refused as NOT_SUPPORTED that never
        # answered is one the GPU lacks, as the sampler takes it; one that answered failed a while.
        self.answered: dict[int, set[object]] = {}
        # GPU index -> whether it said it has GPM, where asked: a replay must not take a Hopper
        # without it (a vGPU) for one with it, nor a GPU the fake does not know for one without.
        self.gpm: dict[int, bool] = {}
        # GPU index -> the driver events it said it reports, where asked (a vGPU may report none).
        self.events: dict[int, frozenset[EventKind]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _uuid(self, handle: Handle | None) -> str:
        return "" if handle is None else self._uuids.get(id(handle), "")

    def _failed(
        self, handle: Handle | None, exc: DeviceError, index: int | None = None, asked: tuple[object, ...] = ()
    ) -> None:
        lost, driver = isinstance(exc, DeviceLost), isinstance(exc, DriverUnavailable)
        if index is None and handle is not None:
            index = self._indexes.get(id(handle))
        self.failures.append(Failure(self.clock(), self._uuid(handle), exc.call, exc.error, lost, driver, index, asked))

    def _answered(self, handle: Handle | None, what: Iterable[object]) -> None:
        index = None if handle is None else self._indexes.get(id(handle))
        if index is not None:
            self.answered.setdefault(index, set()).update(what)

    def _tapped(self, handle: Handle | None, call: Callable[[], T], index: int | None = None, what: str = "") -> T:
        try:
            result = call()
        except DeviceError as exc:
            self._failed(handle, exc, index, (what,) if what else ())
            raise
        if what:
            self._answered(handle, (what,))
        return result

    # -- the library and discovery: forwarded, errors kept ------------------------------------

    def init(self) -> None:
        self._tapped(None, self._inner.init)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def driver_version(self) -> str:
        return self._tapped(None, self._inner.driver_version)

    def cuda_driver_version(self) -> int:
        return self._tapped(None, self._inner.cuda_driver_version)

    def device_count(self) -> int:
        return self._tapped(None, self._inner.device_count)

    def handle_by_index(self, index: int) -> Handle:
        handle = self._tapped(None, lambda: self._inner.handle_by_index(index), index)
        self._indexes[id(handle)] = index
        return handle

    # Discovery's calls are tapped too: one the GPU refuses (a power limit, the SM count of a
    # whole H200) is a fault of the trace, or the replayed GPU answers it from the fake's model
    # (a power-limit gauge the recorded node never had).

    def name(self, handle: Handle) -> str:
        return self._tapped(handle, lambda: self._inner.name(handle), what="name")

    def uuid(self, handle: Handle) -> str:
        uuid = self._tapped(handle, lambda: self._inner.uuid(handle), what="uuid")
        self._uuids[id(handle)] = uuid
        return uuid

    def pci_bus_id(self, handle: Handle) -> str:
        return self._tapped(handle, lambda: self._inner.pci_bus_id(handle), what="pci_bus_id")

    def minor_number(self, handle: Handle) -> int:
        return self._tapped(handle, lambda: self._inner.minor_number(handle), what="minor_number")

    def power_limit_w(self, handle: Handle) -> float:
        return self._tapped(handle, lambda: self._inner.power_limit_w(handle), what="power_limit_w")

    def sm_count(self, handle: Handle) -> int:
        return self._tapped(handle, lambda: self._inner.sm_count(handle), what="sm_count")

    def nvlink_count(self, handle: Handle) -> int:
        return self._tapped(handle, lambda: self._inner.nvlink_count(handle), what="nvlink_count")

    def mig_enabled(self, handle: Handle) -> bool:
        return self._tapped(handle, lambda: self._inner.mig_enabled(handle), what="mig_enabled")

    def mig_handles(self, handle: Handle) -> list[tuple[int, Handle]]:
        found = self._tapped(handle, lambda: self._inner.mig_handles(handle), what="mig_handles")
        index = self._indexes.get(id(handle))
        if index is not None:
            for _slot, mig in found:
                self._indexes[id(mig)] = index  # a MIG device's failures are its GPU's
        return found

    def mig_profile(self, handle: Handle) -> str:
        return self._tapped(handle, lambda: self._inner.mig_profile(handle), what="mig_profile")

    def gpu_instance_id(self, handle: Handle) -> int:
        return self._tapped(handle, lambda: self._inner.gpu_instance_id(handle), what="gpu_instance_id")

    def compute_instance_id(self, handle: Handle) -> int:
        return self._tapped(handle, lambda: self._inner.compute_instance_id(handle), what="compute_instance_id")

    # -- every poll ---------------------------------------------------------------------------

    def read(self, handle: Handle, keys: Sequence[ReadingKey]) -> ReadResult:
        result = self._tapped(handle, lambda: self._inner.read(handle, keys))
        if result.values:
            self._answered(handle, result.values)
        # One failed call answering several keys is one failure, asked for all of them.
        asked: dict[int, tuple[DeviceError, list[object]]] = {}
        for key, failure in result.errors.items():
            asked.setdefault(id(failure), (failure, []))[1].append(key)
        for failure, keys_asked in asked.values():
            self._failed(handle, failure, asked=tuple(keys_asked))
        return result

    def running_processes(self, handle: Handle) -> list[ProcessInfo]:
        return self._tapped(handle, lambda: self._inner.running_processes(handle), what="running_processes")

    def mps_processes(self, handle: Handle) -> list[ProcessInfo]:
        return self._tapped(handle, lambda: self._inner.mps_processes(handle), what="mps_processes")

    def graphics_processes(self, handle: Handle) -> list[ProcessInfo]:
        return self._tapped(handle, lambda: self._inner.graphics_processes(handle), what="graphics_processes")

    def process_utilization(self, handle: Handle, since_us: int) -> list[ProcessSample]:
        samples = self._tapped(
            handle, lambda: self._inner.process_utilization(handle, since_us), what="process_utilization"
        )
        self.samples.setdefault(self._uuids.get(id(handle), ""), []).extend(samples)
        return samples

    def utilization_samples(self, handle: Handle, since_us: int) -> list[UtilizationSample]:
        # Its own method, not `__getattr__`'s forwarding: a failure of it (a TIMEOUT, say) is a
        # fault of the trace like any other call's, or the replay reads the samples the recorded
        # poll could not, and books another busy time.
        return self._tapped(
            handle, lambda: self._inner.utilization_samples(handle, since_us), what="utilization_samples"
        )


# The capabilities beyond `DeviceBackend`, forwarded by methods of their own, never through
# `__getattr__`: from Python 3.12, isinstance() against a runtime-checkable protocol looks
# attributes up statically (inspect.getattr_static), so a forwarded-on-demand method is not seen,
# and a tap of a GPM-capable driver was taken for one without GPM or driver events: `record` on
# Python 3.12 wrote no GPM rows and no Xids from a real H200 (scripts/realgpu). The tap is made
# with exactly the capabilities of what it wraps (`tap`).


class _TappedActivity(TappedBackend):
    def activity_supported(self, handle: Handle) -> bool:
        inner = cast(ActivityBackend, self._inner)
        supported = self._tapped(handle, lambda: inner.activity_supported(handle), what="activity_supported")
        index = self._indexes.get(id(handle))
        if index is not None:
            self.gpm[index] = supported
        return supported

    def new_activity_sample(self) -> Any:
        return cast(ActivityBackend, self._inner).new_activity_sample()

    def take_activity_sample(self, handle: Handle, sample: Any, gpu_instance_id: int | None) -> None:
        inner = cast(ActivityBackend, self._inner)
        self._tapped(handle, lambda: inner.take_activity_sample(handle, sample, gpu_instance_id), what="activity")

    def activity_between(self, earlier: Any, later: Any) -> Activity:
        return cast(ActivityBackend, self._inner).activity_between(earlier, later)

    def free_activity_sample(self, sample: Any) -> None:
        cast(ActivityBackend, self._inner).free_activity_sample(sample)


class _TappedEvents(TappedBackend):
    def supported_events(self, handle: Handle) -> frozenset[EventKind]:
        inner = cast(EventBackend, self._inner)
        kinds = self._tapped(handle, lambda: inner.supported_events(handle), what="supported_events")
        index = self._indexes.get(id(handle))
        if index is not None:
            self.events[index] = kinds
        return kinds

    # The reader's own calls are tapped as the others are: a driver that could not make an event
    # set, or wait on one, for a while is a fault of the trace, or the replayed reader watches the
    # GPUs all along (gpuledger_gpu_events_up 1 where the node's was 0). A wait that times out is
    # an answer (None), not a failure.

    def open_event_set(self) -> Any:
        inner = cast(EventBackend, self._inner)
        return self._tapped(None, inner.open_event_set)

    def register_events(self, event_set: Any, handle: Handle, kinds: frozenset[EventKind], token: int) -> None:
        inner = cast(EventBackend, self._inner)
        self._tapped(handle, lambda: inner.register_events(event_set, handle, kinds, token), what="events")

    def wait_event(self, event_set: Any, timeout_s: float) -> DeviceEvent | None:
        inner = cast(EventBackend, self._inner)
        return self._tapped(None, lambda: inner.wait_event(event_set, timeout_s))

    def close_event_set(self, event_set: Any) -> None:
        cast(EventBackend, self._inner).close_event_set(event_set)


class _TappedActivityAndEvents(_TappedActivity, _TappedEvents):
    pass


def tap(inner: DeviceBackend) -> TappedBackend:
    """A tap of `inner` that has the capabilities `inner` has (activity, driver events), no more."""
    kind = {
        (False, False): TappedBackend,
        (True, False): _TappedActivity,
        (False, True): _TappedEvents,
        (True, True): _TappedActivityAndEvents,
    }[isinstance(inner, ActivityBackend), isinstance(inner, EventBackend)]
    return kind(inner)
