"""Driver events (Xid errors, ECC errors, clock changes), read on a thread of their own.

A driver reports an Xid once, when it happens: a poll every few seconds that reads counters
would never see it. So `EventReader` keeps an event set open on every GPU and waits on it,
each wait bounded (`wait_s`), on its own thread: the poll never waits for it and never takes a
lock it holds; it only picks up the reader's latest `DeviceEvents`, a frozen value the reader
swaps in by one assignment.

The reader survives what the driver does to event sets:

- a GPU that falls off the bus makes every wait on a set holding it fail (GPU_IS_LOST): the
  set is made again with the GPUs that still answer, and the lost one is registered again,
  every `retry_s`, once it answers;
- a driver that goes away (DRIVER_NOT_LOADED, a driver upgrade) leaves sets belonging to a
  driver instance that is gone: the set is dropped, NVML let go of, and everything opened
  again every `retry_s` until the driver answers;
- a GPU or a driver without events (NOT_SUPPORTED) is learned once and not asked again.

A driver call can also hang for good (the watchdog's case, README "When the driver hangs"):
a step of the thread (its wait, or opening the set) not done within its wait plus
`call_timeout_s` is stuck. `stuck_since` says so, for /healthz and the hard deadline, and
`events` then reads every GPU as not watched: nothing comes through a thread that waits in C.

Without a thread (`simulate`, `snapshot`, tests that move a fake clock by hand), the pipeline
calls `catch_up` at each poll: it takes what the driver has pending, without waiting.

Nothing here names a vendor library: the backend (`EventBackend`, implemented for NVIDIA in
agent/devices/nvml.py) turns the driver's events into `DeviceEvent`s.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from agent.devices.backend import (
    DeviceError,
    DeviceLost,
    DriverLibraryMissing,
    DriverUnavailable,
    Handle,
    ReadingNotSupported,
)
from agent.model import DeviceEvents, GpuEvents

log = logging.getLogger(__name__)

# Events a single catch-up takes at most: a storm of clock-change events must not hold up a poll.
CATCH_UP_MAX_EVENTS = 10_000
# Event sets a single catch-up makes again at most (a GPU lost, then another).
CATCH_UP_MAX_REOPENS = 3
RECENT_EVENTS_KEPT = 256


class EventKind(enum.StrEnum):
    """What a driver event says happened; the value is the `event` label of its series."""

    XID = "xid"
    SINGLE_BIT_ECC = "single_bit_ecc"
    DOUBLE_BIT_ECC = "double_bit_ecc"
    CLOCK_CHANGE = "clock_change"


ALL_EVENTS = frozenset(EventKind)
# What the agent listens for: the health events. Clock changes are left out: a real H200 under
# load sends about 40 a second (power capping moves its clocks), which the reader would drain
# and count for a series nobody alerts on, while the clock gauges and the clock-event reasons
# already say why clocks moved (scripts/realgpu). They can still be asked for (`kinds`).
DEFAULT_EVENTS = frozenset({EventKind.XID, EventKind.SINGLE_BIT_ECC, EventKind.DOUBLE_BIT_ECC})


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    """One event off the driver. `token` is what the device was registered with (None: a device
    this set does not know), `data` the Xid of an XID event and 0 otherwise."""

    token: int | None
    kind: EventKind
    data: int = 0


@runtime_checkable
class EventBackend(Protocol):
    """A device library that can report events. Raises only `DeviceError`s, as `DeviceBackend`."""

    clock: Callable[[], float]

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def device_count(self) -> int: ...
    def handle_by_index(self, index: int) -> Handle: ...
    def uuid(self, handle: Handle) -> str: ...
    def supported_events(self, handle: Handle) -> frozenset[EventKind]: ...
    def open_event_set(self) -> Any: ...
    def register_events(self, event_set: Any, handle: Handle, kinds: frozenset[EventKind], token: int) -> None: ...
    def wait_event(self, event_set: Any, timeout_s: float) -> DeviceEvent | None:
        """The next event, or None when none came within `timeout_s` (0: do not wait)."""
        ...

    def close_event_set(self, event_set: Any) -> None: ...


@dataclass
class _Gpu:
    index: int
    uuid: str
    handle: Handle
    kinds: frozenset[EventKind] = frozenset()
    watched: bool = False  # registered on the open set


class EventReader:
    """Waits for driver events and counts them per GPU; see the module docstring."""

    def __init__(
        self,
        backend: EventBackend,
        *,
        wait_s: float = 1.0,
        retry_s: float = 30.0,
        kinds: frozenset[EventKind] = DEFAULT_EVENTS,
        call_timeout_s: float = 15.0,
    ) -> None:
        self._backend = backend
        self.wait_s = wait_s
        self.retry_s = retry_s
        self.call_timeout_s = call_timeout_s
        self._step_began: float | None = None  # monotonic, while the thread is in a step
        self._kinds = kinds
        self._set: Any = None
        self._initialised = False
        self._gave_up = False  # no library, or no event API at all: nothing will ever come
        self._retry_at = 0.0  # backend clock: when to open again, or to register missing GPUs
        self._gpus: dict[int, _Gpu] = {}
        self._missing: set[int] = set()  # GPUs to register once they answer again
        self._counts: dict[tuple[int, str], Counter[tuple[EventKind, int]]] = {}
        self._last_xid: dict[tuple[int, str], tuple[int, float]] = {}
        # The latest events, oldest first: (backend time received, GPU index, event).
        self.recent: deque[tuple[float, int, DeviceEvent]] = deque(maxlen=RECENT_EVENTS_KEPT)
        self._published = DeviceEvents()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def events(self) -> DeviceEvents:
        """What the reader has counted so far: a frozen value, replaced whenever it changes.
        While the thread is stuck in a driver call, no GPU reads as watched."""
        published = self._published
        if self.stuck_since is None:
            return published
        return replace(published, gpus=tuple(replace(g, watched=False) for g in published.gpus), reading=False)

    @property
    def stuck_since(self) -> float | None:
        """When (monotonic) the thread's step began, while it has been in it longer than its wait
        plus `call_timeout_s`: a driver call that has not returned. None otherwise."""
        began = self._step_began
        if began is None or time.monotonic() - began <= self.wait_s + self.call_timeout_s:
            return None
        return began

    # -- running ------------------------------------------------------------------------------

    def start(self) -> None:
        """Wait for events on a daemon thread until `stop`."""
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="gpuledger-events", daemon=True)
        self._thread.start()

    def stop_soon(self) -> None:
        """Ask the thread to end after the wait it is in, without waiting for it: a shutdown
        that has other work (the ledger's flush) lets that wait run out meanwhile."""
        self._stopping.set()

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop the thread (it ends within one wait) and let go of the event set and NVML.
        False when the thread is still in a driver call: then nothing is freed under it."""
        thread = self._thread
        if thread is not None:
            self._stopping.set()
            thread.join(self.wait_s + 0.5 if timeout_s is None else timeout_s)
            if thread.is_alive():
                return False
            self._thread = None
        self._close()
        if self._initialised:
            self._backend.shutdown()
            self._initialised = False
        return True

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def catch_up(self) -> None:
        """Take every event the driver has pending now, without waiting (no thread running)."""
        if self._thread is not None:
            return
        reopens = 0
        for _ in range(CATCH_UP_MAX_EVENTS):
            outcome = self._step(0.0)
            if outcome == "reopened":
                reopens += 1
                if reopens > CATCH_UP_MAX_REOPENS:
                    return
            elif outcome != "event":
                return

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._step_began = time.monotonic()
            try:
                outcome = self._step(self.wait_s)
            except Exception:
                # A bug here must not end event reading for good: log it, wait, go on.
                log.exception("driver events: the reader failed; trying again")
                self._close()
                outcome = "idle"
            finally:
                self._step_began = None
            if outcome == "idle":
                self._stopping.wait(self.wait_s)
            elif outcome == "reopened":
                # A set made again that fails at once (a GPU lost between the two) must not spin.
                self._stopping.wait(min(self.wait_s, 0.1))

    def _step(self, timeout_s: float) -> str:
        """Open the set if due, then one wait. Returns "event", "none" (the wait timed out),
        "reopened" (the set was made again) or "idle" (no set to wait on)."""
        if self._gave_up:
            return "idle"
        now = self._backend.clock()
        if self._set is None:
            if now < self._retry_at:
                return "idle"
            self._open(now)
            if self._set is None:
                return "idle"
        elif self._missing and now >= self._retry_at:
            self._register_missing(now)
        try:
            event = self._backend.wait_event(self._set, timeout_s)
        except DeviceLost as exc:
            # Some GPU on the set is gone; which one, the driver does not say. A new set holds
            # the GPUs that still answer; the lost one is registered again once it does.
            log.warning("driver events: a GPU is lost (%s); watching the others", exc.error)
            self._close()
            self._open(now)
            return "reopened"
        except DriverUnavailable as exc:
            log.error("driver events: the driver went away (%s); opening again in %.0fs", exc.error, self.retry_s)
            self._lose_driver(now)
            return "idle"
        except ReadingNotSupported as exc:
            log.info("driver events: the driver cannot wait for events (%s); not reading them", exc.error)
            self._close()
            self._gave_up = True
            self._publish()
            return "idle"
        except DeviceError as exc:
            # UNINITIALIZED-like answers come as DriverUnavailable; anything else: a set the
            # driver no longer knows, most likely. Make it again, later.
            log.warning(
                "driver events: waiting failed (%s: %s); opening again in %.0fs", exc.call, exc.error, self.retry_s
            )
            self._close()
            self._retry_at = now + self.retry_s
            self._publish()
            return "idle"
        if event is None:
            return "none"
        self._record(event)
        return "event"

    # -- the event set ------------------------------------------------------------------------

    def _open(self, now: float) -> None:
        b = self._backend
        try:
            if not self._initialised:
                b.init()
                self._initialised = True
            self._set = b.open_event_set()
            count = b.device_count()
        except DriverLibraryMissing:
            log.error("driver events: no NVML library; not reading events")
            self._gave_up = True
            return
        except DriverUnavailable as exc:
            log.warning(
                "driver events: the driver is not answering (%s); trying again in %.0fs", exc.error, self.retry_s
            )
            self._lose_driver(now)
            return
        except ReadingNotSupported as exc:
            log.info("driver events: this driver has no event API (%s); not reading events", exc.error)
            self._close()
            self._gave_up = True
            self._publish()
            return
        except DeviceError as exc:
            log.warning("driver events: cannot open an event set (%s); trying again in %.0fs", exc.error, self.retry_s)
            self._close()
            self._retry_at = now + self.retry_s
            return
        self._missing = set(range(count))
        for gpu in self._gpus.values():
            gpu.watched = False
        self._register_missing(now)
        if self._set is not None and self._gpus:
            watched = sum(g.watched for g in self._gpus.values())
            log.info("driver events: watching %d of %d GPU(s)", watched, count)

    def _register_missing(self, now: float) -> None:
        """Register every GPU not yet on the set; those that do not answer wait for the next try."""
        b = self._backend
        for index in sorted(self._missing):
            try:
                gpu = self._gpus.get(index)
                if gpu is None or gpu.handle is None:
                    handle = b.handle_by_index(index)
                    gpu = self._gpus[index] = _Gpu(index, b.uuid(handle), handle)
                if not gpu.kinds:
                    gpu.kinds = b.supported_events(gpu.handle) & self._kinds
                if gpu.kinds:
                    b.register_events(self._set, gpu.handle, gpu.kinds, index)
            except DriverUnavailable as exc:
                log.warning("driver events: the driver went away (%s) while registering GPU %d", exc.error, index)
                self._lose_driver(now)
                return
            except ReadingNotSupported:
                log.info("driver events: GPU %d reports no events", index)
                self._missing.discard(index)
                continue
            except DeviceError as exc:
                log.debug("driver events: GPU %d not registered (%s); trying again later", index, exc.error)
                if index in self._gpus and isinstance(exc, DeviceLost):
                    self._gpus[index].handle = None  # looked up again: the driver may hand out a new one
                continue
            gpu.watched = bool(gpu.kinds)
            self._missing.discard(index)
        self._retry_at = now + self.retry_s
        self._publish()

    def _close(self) -> None:
        if self._set is not None:
            event_set, self._set = self._set, None
            self._backend.close_event_set(event_set)
        for gpu in self._gpus.values():
            gpu.watched = False

    def _lose_driver(self, now: float) -> None:
        self._close()
        if self._initialised:
            self._backend.shutdown()
            self._initialised = False
        for gpu in self._gpus.values():
            gpu.handle = None  # handles die with the driver instance that gave them
        self._retry_at = now + self.retry_s
        self._publish()

    # -- what was seen ------------------------------------------------------------------------

    def _record(self, event: DeviceEvent) -> None:
        gpu = self._gpus.get(event.token) if event.token is not None else None
        if gpu is None or event.kind not in self._kinds:
            return
        now = self._backend.clock()
        key = (gpu.index, gpu.uuid)
        value = event.data if event.kind is EventKind.XID else 0
        self._counts.setdefault(key, Counter())[(event.kind, value)] += 1
        self.recent.append((now, gpu.index, event))
        if event.kind is EventKind.XID:
            self._last_xid[key] = (event.data, now)
            log.warning(
                "GPU %d (%s): Xid %d", gpu.index, gpu.uuid, event.data,
                extra={"event": "xid", "gpu": gpu.index, "uuid": gpu.uuid, "xid": event.data},
            )  # fmt: skip
        elif event.kind is EventKind.CLOCK_CHANGE:
            log.debug("GPU %d (%s): clocks changed", gpu.index, gpu.uuid)
        else:
            log.warning("GPU %d (%s): %s error", gpu.index, gpu.uuid, event.kind.value.replace("_", "-"))
        self._publish()

    def _publish(self) -> None:
        keys = set(self._counts) | {(g.index, g.uuid) for g in self._gpus.values()}
        watched = {(g.index, g.uuid) for g in self._gpus.values() if g.watched and g.handle is not None}
        gpus = []
        for key in sorted(keys):
            counts = self._counts.get(key, Counter())
            last = self._last_xid.get(key)
            gpus.append(
                GpuEvents(
                    gpu=key[0],
                    uuid=key[1],
                    watched=key in watched,
                    counts=tuple((kind.value, value, n) for (kind, value), n in sorted(counts.items())),
                    last_xid=None if last is None else last[0],
                    last_xid_at=None if last is None else last[1],
                )
            )
        self._published = DeviceEvents(gpus=tuple(gpus), reading=self._set is not None)
