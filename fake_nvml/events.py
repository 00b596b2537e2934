"""The fake driver's event API: event sets that deliver a scenario's Xids and driver events.

The C functions pynvml wraps, with its signatures:

    nvmlEventSetCreate(nvmlEventSet_t *set)
    nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
    nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
    nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
    nvmlEventSetFree(nvmlEventSet_t set)

A set delivers the events of the devices registered on it that happen after it was created
(scenario `xid:` and `event:` faults, and an ECC event for each error of an `ecc:` fault, at the
moment its counter moves), one per wait, in scenario-time order. A wait
blocks in real time for up to its timeout, looking at the scenario clock as it goes, so a
clock that a test advances by hand, or one running at a speed, delivers events when scenario
time reaches them. As the real driver does, a wait on a set holding a GPU that has fallen off
the bus answers GPU_IS_LOST once that GPU's pending events are out, and a set made before the
driver went away (a node-wide DRIVER_NOT_LOADED-like fault that has since ended) answers
UNINITIALIZED: it belongs to a driver instance that is gone, and must be made again.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from fake_nvml.health import NodeHealth
from fake_nvml.lib import INVALID_ARGUMENT, NOT_SUPPORTED, SUCCESS, Dev, FakeNvmlLibrary, _c, _int, _obj
from fake_nvml.scenario import ERROR_CODES, Fault
from fake_nvml.scenario.facts import BoardFacts

# nvmlEventType* (nvml.h)
SINGLE_BIT_ECC = 0x1
DOUBLE_BIT_ECC = 0x2
PSTATE = 0x4
XID_CRITICAL_ERROR = 0x8
CLOCK = 0x10
# What a data-centre GPU offers; a MIG device handle offers Xids only (nvml.h: "On MIG-enabled
# GPUs, only XID events are supported for MIG device handles").
GPU_EVENTS = SINGLE_BIT_ECC | DOUBLE_BIT_ECC | PSTATE | XID_CRITICAL_ERROR | CLOCK
MIG_EVENTS = XID_CRITICAL_ERROR
# Events a scenario names with `event:` (the ECC ones arrive as `ecc:` faults: `_fault_events`).
EVENT_TYPES = {"clock_change": CLOCK}

TIMEOUT = ERROR_CODES["TIMEOUT"]
GPU_IS_LOST = ERROR_CODES["GPU_IS_LOST"]
UNINITIALIZED = ERROR_CODES["UNINITIALIZED"]
_NO_INSTANCE = 0xFFFFFFFF
# The errors of a driver that went away: a set made before one of them struck is stale after.
_DRIVER_GONE = frozenset({"DRIVER_NOT_LOADED", "UNINITIALIZED", "LIB_RM_VERSION_MISMATCH"})
_SET_TAG = 0x65760000  # "ev" in the high bytes: an event set this library made
# How often a waiting call looks at the scenario clock again (real seconds): an event arrives
# within a tick of scenario time reaching it, and a waiting thread (a Python loop here, where the
# real driver blocks in C) takes too little of the interpreter to slow a poll beside it. That is
# the tick of a clock moved by hand. A clock running at a speed is looked at again when the next
# thing a wait answers (an event, the driver going, a GPU lost) is due, a tick at the soonest and
# WAIT_NAP_MAX_S at the latest (a device registered meanwhile may bring an event due sooner): an
# agent's reader waiting on a quiet node wakes twice a second, not a hundred times.
WAIT_TICK_S = 0.01
WAIT_NAP_MAX_S = 0.5
_WAIT, _WAIT_FAMILY = "nvmlEventSetWait_v2", "nvmlEventSetWait"  # the call and its family


@dataclass(order=True)
class _Pending:
    at_s: float
    order: tuple[int, int]
    gpu: int = field(compare=False)
    event_type: int = field(compare=False)
    data: int = field(compare=False)
    mig: int | None = field(compare=False, default=None)


@dataclass
class _EventSet:
    created_s: float
    pending: list[_Pending] = field(default_factory=list)  # a heap, soonest first
    registered: dict[int, int] = field(default_factory=dict)  # GPU index -> event types


class _Sets:
    """One library's event sets, by the id their handle carries."""

    def __init__(self, lib: FakeNvmlLibrary) -> None:
        self.lock = threading.Lock()
        self.sets: dict[int, _EventSet] = {}
        self.ids = itertools.count(1)
        self.waiters = 0  # calls blocked in a wait right now (tests look)
        # What a wait looks at on every pass, from faults fixed for the node's life, found once
        # (a poll waits with a zero timeout, and going through every fault cost it ~44 us):
        # when each node-wide fault that takes the driver away strikes (`_stale`), and the GPUs
        # some fault can make a wait fail on (`_lost`: on any other GPU no fault error applies).
        node = lib._node
        self.driver_gone_at = tuple(
            f.at_s
            for f in node.scenario.faults
            if f.gpu is None and f.error in _DRIVER_GONE and f.call in (None, "*", _WAIT, _WAIT_FAMILY)
        )
        failing = {gpu: node.faults_for(_WAIT, _WAIT_FAMILY, gpu)[0] for gpu in range(len(node.scenario.gpus))}
        self.lossy = frozenset(gpu for gpu, faults in failing.items() if faults)
        # When either can change a wait's answer, soonest first: a driver gone, and the start of a
        # fault on a GPU a wait can fail on.
        starts = {fault.at_s for faults in failing.values() for fault in faults}
        self.changes_at = tuple(sorted({*self.driver_gone_at, *starts}))


_STATE: weakref.WeakKeyDictionary[FakeNvmlLibrary, _Sets] = weakref.WeakKeyDictionary()
_STATE_LOCK = threading.Lock()


def _sets(lib: FakeNvmlLibrary) -> _Sets:
    with _STATE_LOCK:
        state = _STATE.get(lib)
        if state is None:
            state = _STATE[lib] = _Sets(lib)
        return state


def waiting(lib: FakeNvmlLibrary) -> int:
    """How many calls are blocked in nvmlEventSetWait_v2 on this library right now."""
    return _sets(lib).waiters


def _pointer_value(arg: Any) -> int | None:
    obj = _obj(arg)
    if isinstance(obj, ctypes._Pointer):
        return int.from_bytes(bytes(obj), "little") or None
    value: int | None = ctypes.cast(obj, ctypes.c_void_p).value if obj is not None else None
    return value


def _event_set(lib: FakeNvmlLibrary, arg: Any) -> tuple[int, _EventSet] | None:
    value = _pointer_value(arg)
    if value is None or value & 0xFFFF0000 != _SET_TAG:
        return None
    set_id = value & 0xFFFF
    found = _sets(lib).sets.get(set_id)
    return None if found is None else (set_id, found)


_KIND_BITS = {
    "xid": XID_CRITICAL_ERROR,
    "single_bit_ecc": SINGLE_BIT_ECC,
    "double_bit_ecc": DOUBLE_BIT_ECC,
    "clock_change": CLOCK,
}


def _supported(lib: FakeNvmlLibrary, dev: Dev) -> int:
    if dev.mig is not None:
        return MIG_EVENTS
    kinds = lib._node.gpu(dev.gpu).events  # a recorded GPU's own answer, where the scenario gives it
    return GPU_EVENTS if kinds is None else sum(_KIND_BITS[kind] for kind in set(kinds))


@_c("nvmlEventSetCreate", device=False)
def _create(lib: FakeNvmlLibrary, t: float, out: Any) -> int:
    state = _sets(lib)
    with state.lock:
        set_id = next(state.ids)
        state.sets[set_id] = _EventSet(created_s=t)
    ctypes.c_void_p.from_buffer(_obj(out)).value = _SET_TAG | set_id
    return SUCCESS


@_c("nvmlEventSetFree", device=False)
def _free(lib: FakeNvmlLibrary, t: float, event_set: Any) -> int:
    found = _event_set(lib, event_set)
    if found is None:
        return INVALID_ARGUMENT
    state = _sets(lib)
    with state.lock:
        state.sets.pop(found[0], None)
    return SUCCESS


@_c("nvmlDeviceGetSupportedEventTypes")
def _supported_types(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = _supported(lib, dev)
    return SUCCESS


@_c("nvmlDeviceRegisterEvents")
def _register(lib: FakeNvmlLibrary, t: float, dev: Dev, types: Any, event_set: Any) -> int:
    found = _event_set(lib, event_set)
    if found is None:
        return INVALID_ARGUMENT
    wanted = _int(types)
    if wanted & ~_supported(lib, dev):
        return NOT_SUPPORTED  # as the driver answers a request for a type the device lacks
    _, events = found
    gpu = dev.gpu
    with _sets(lib).lock:
        already = events.registered.get(gpu, 0)
        new = wanted & ~already
        events.registered[gpu] = already | wanted
        # Only what happens from now on: a device registered later misses what came before.
        for order, fault in enumerate(lib._node.scenario.faults):
            if fault.gpu != gpu:
                continue
            # (fault, event): the scenario's order among events at one instant, and within a
            # fault, its own (an ECC event before the Xid that comes with it).
            for k, (at_s, event_type, data) in enumerate(_fault_events(fault, lib._node.health.board(gpu))):
                if at_s > t and new & event_type:
                    heapq.heappush(events.pending, _Pending(at_s, (order, k), gpu, event_type, data, dev.mig))
    return SUCCESS


def uncorrectable_ecc_xid(board: BoardFacts) -> int:
    """The Xid a driver logs beside the ECC event of an uncorrectable (double-bit) error.

    Before Ampere, Xid 48 (DBE, with page retirement). From Ampere on, where rows are remapped
    instead, the driver reports whether it contained the error to the processes using the
    memory: Xid 94 (contained: they are stopped, the GPU keeps serving others) or 95
    (uncontained: every process on the GPU is affected, and it needs a reset). A scenario's
    `ecc:` fault does not say which, and containment is the usual outcome on these boards, so
    the fake sends 94; a scenario that wants the uncontained case gives the `ecc:` fault
    `xid: 95`. (NVIDIA's Xid catalogue, "Xid 48", "Xid 94", "Xid 95".)"""
    return 94 if board.remaps_rows else 48


def _fault_events(fault: Fault, board: BoardFacts) -> list[tuple[float, int, int]]:
    """The events a fault makes the driver send: (when, nvmlEventType*, event data). An
    uncorrectable ECC error sends its ECC event and, as a real driver does, an Xid."""
    found: list[tuple[float, int, int]] = []
    # An `xid:` on a fault with uncorrectable errors names the Xid they log (95: uncontained; a
    # recording's, as the driver sent it), in place of the architecture's.
    ecc_xid = fault.xid if fault.ecc is not None and fault.ecc.uncorrected else None
    for at_s, uncorrected in NodeHealth.ecc_error_times(fault):
        found.append((at_s, DOUBLE_BIT_ECC if uncorrected else SINGLE_BIT_ECC, 0))
        if uncorrected:
            found.append((at_s, XID_CRITICAL_ERROR, ecc_xid or uncorrectable_ecc_xid(board)))
    if fault.xid is not None and ecc_xid is None:
        found.append((fault.at_s, XID_CRITICAL_ERROR, fault.xid))
    if fault.event is not None:
        found.append((fault.at_s, EVENT_TYPES[fault.event], 0))
    return found


def _stale(state: _Sets, events: _EventSet, now: float) -> bool:
    """Whether the driver went away (and came back) since the set was made."""
    return any(events.created_s < at_s <= now for at_s in state.driver_gone_at)


def _lost(lib: FakeNvmlLibrary, state: _Sets, events: _EventSet, now: float) -> bool:
    lossy = state.lossy
    if not lossy:
        return False
    node = lib._node
    return any(
        node.fault_error(_WAIT, _WAIT_FAMILY, gpu, now) in ("GPU_IS_LOST", "GPU_NOT_FOUND")
        for gpu in events.registered
        if gpu in lossy
    )


def _nap_s(speed: float, state: _Sets, events: _EventSet, now: float) -> float:
    """How long a wait may sleep before it looks again (real seconds): WAIT_TICK_S on a clock
    moved by hand, else until the next event or change is due at `speed` (WAIT_TICK_S to
    WAIT_NAP_MAX_S)."""
    if not speed:
        return WAIT_TICK_S
    due = [at_s for at_s in state.changes_at if at_s > now][:1]
    with state.lock:
        if events.pending:
            due.append(events.pending[0].at_s)
    if not due:
        return WAIT_NAP_MAX_S
    return min(max((min(due) - now) / speed, WAIT_TICK_S), WAIT_NAP_MAX_S)


def _fill(lib: FakeNvmlLibrary, data: Any, pending: _Pending) -> None:
    # The handle of the device the event happened on, as the library hands handles out.
    lib._store_handle(ctypes.c_void_p.from_buffer(data, type(data).device.offset), pending.gpu, pending.mig)
    data.eventType = pending.event_type
    data.eventData = pending.data
    data.gpuInstanceId = _NO_INSTANCE
    data.computeInstanceId = _NO_INSTANCE


@_c("nvmlEventSetWait_v2", device=False)
def _wait(lib: FakeNvmlLibrary, t: float, event_set: Any, data: Any, timeout_ms: Any) -> int:
    found = _event_set(lib, event_set)
    if found is None:
        return INVALID_ARGUMENT
    _, events = found
    state = _sets(lib)
    node = lib._node
    deadline = time.monotonic() + _int(timeout_ms) / 1000
    with state.lock:
        state.waiters += 1
    try:
        while True:
            now = node.now()
            if _stale(state, events, now):
                return UNINITIALIZED
            with state.lock:
                if events.pending and events.pending[0].at_s <= now:
                    _fill(lib, _obj(data), heapq.heappop(events.pending))
                    return SUCCESS
            if _lost(lib, state, events, now):
                return GPU_IS_LOST
            left = deadline - time.monotonic()
            if left <= 0:
                return TIMEOUT
            time.sleep(min(_nap_s(node.clock.speed, state, events, now), left))
    finally:
        with state.lock:
            state.waiters -= 1
