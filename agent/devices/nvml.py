"""The NVIDIA backend: the one module that talks to pynvml.

It implements `agent.devices.backend.DeviceBackend`. Everything above it sees plain Python
values in SI units and the backend's neutral exceptions, never a ctypes struct or a
`pynvml.NVMLError`. How readings are fetched is decided here, out of the sampler's sight:

- power, energy and NVLink states go in one `nvmlDeviceGetFieldValues` call per device; a
  field the batch lacks (R470 has no instant-power field) is read by its single call instead;
- process lists and process samples are read in one call into a buffer sized from the
  previous poll, not pynvml's two (ask the count, then the data);
- versioned calls are tried newest first and the first the driver has is remembered, so an old
  driver costs one FUNCTION_NOT_FOUND per call family, not one per poll.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import struct
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pynvml

from agent.devices.backend import (
    DeviceError,
    DeviceLost,
    DriverLibraryMissing,
    DriverUnavailable,
    Handle,
    PermissionDenied,
    ProcessInfo,
    ProcessSample,
    Quantity,
    ReadingKey,
    ReadingNotSupported,
    ReadResult,
    UtilizationSample,
)
from agent.devices.events import DeviceEvent, EventKind
from agent.model import Activity

log = logging.getLogger(__name__)
T = TypeVar("T")

_FI_TOTAL_ENERGY_CONSUMPTION = pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
_FI_POWER_INSTANT = getattr(pynvml, "NVML_FI_DEV_POWER_INSTANT", 186)
_FI_NVLINK_GET_STATE = getattr(pynvml, "NVML_FI_DEV_NVLINK_GET_STATE", 165)
_FI_NVLINK_LINK_COUNT = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT
_MAX_NVLINKS = getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)
# The quantities the field-values call can batch, by field id.
_FIELD_IDS = {
    Quantity.POWER: _FI_POWER_INSTANT,
    Quantity.ENERGY: _FI_TOTAL_ENERGY_CONSUMPTION,
    Quantity.NVLINK_UP: _FI_NVLINK_GET_STATE,
}
_MEMORY = (Quantity.MEMORY_USED, Quantity.MEMORY_TOTAL)
_NOT_AVAILABLE_U64 = 0xFFFFFFFFFFFFFFFF  # usedGpuMemory where the driver cannot tell (WDDM)
_NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of a process outside MIG
_SENSOR_GPU = pynvml.NVML_TEMPERATURE_GPU
_SENSOR = pynvml._nvmlTemperatureSensors_t(_SENSOR_GPU)

_NAMES: dict[int, str] = {
    value: name.removeprefix("NVML_ERROR_")
    for name, value in vars(pynvml).items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}
_DRIVER_GONE = {"UNINITIALIZED", "DRIVER_NOT_LOADED", "LIB_RM_VERSION_MISMATCH"}
# The one definition of a lost GPU: every path (single calls, field values, discovery) that
# sees one of these marks the GPU down.
_GPU_GONE = {"GPU_IS_LOST", "GPU_NOT_FOUND", "RESET_REQUIRED"}
# What a device without NVLink, or a link index past its last link, answers (an older driver
# lacks the call or the field altogether: FUNCTION_NOT_FOUND).
_NO_SUCH_LINK = {"NOT_SUPPORTED", "INVALID_ARGUMENT", "NOT_FOUND", "FUNCTION_NOT_FOUND"}


class _FunctionMissing(ReadingNotSupported):
    """The driver is older than the call. Above this module it is one more reading the device
    does not have; here it means: try the older variant."""


class _NotFound(DeviceError):
    """NVML's NOT_FOUND: nothing to report (an empty MIG slot, no samples yet)."""


# The most entries a process-list or sample buffer grows to: far beyond any real GPU's (a few
# thousand processes, a short ring of samples each), and a bound when a driver keeps answering
# INSUFFICIENT_SIZE without saying what would do.
MAX_PROCESSES = 4096
MAX_SAMPLES = 16384


def _from_milli(value: float) -> float:
    """NVML reports power in milliwatts and energy in millijoules; the seam carries W and J."""
    return float(value) / 1000


def _error_name(code: int) -> str:
    return _NAMES.get(code, f"ERROR_{code}")


def _error(call: str, code: int) -> DeviceError:
    """The neutral exception for an NVML return code."""
    name = _error_name(code)
    if name == "NOT_SUPPORTED":
        return ReadingNotSupported(call, name)
    if name == "FUNCTION_NOT_FOUND":
        return _FunctionMissing(call, name)
    if name == "NOT_FOUND":
        return _NotFound(call, name)
    if name == "NO_PERMISSION":
        return PermissionDenied(call, name)
    if name in _GPU_GONE:
        return DeviceLost(call, name)
    if name in _DRIVER_GONE:
        return DriverUnavailable(call, name)
    if name == "LIBRARY_NOT_FOUND" and call == "nvmlInit":
        # Only loading the library can find it missing; the same code from a device call, once
        # it is loaded, is that call's error (some other library it needs), not a missing driver.
        return DriverLibraryMissing(call, name, "the NVML library, libnvidia-ml.so.1: is the NVIDIA driver installed?")
    return DeviceError(call, name)


def _call(call: str, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise _error(call, exc.value) from exc


def _function(call: str, name: str) -> Callable[..., int]:
    """The C function `name`, looked up the way pynvml's wrappers do."""
    try:
        fn: Callable[..., int] = pynvml._nvmlGetFunctionPointer(name)
    except pynvml.NVMLError as exc:
        raise _error(call, exc.value) from exc
    return fn


def _check(call: str, code: int) -> None:
    if code != pynvml.NVML_SUCCESS:
        raise _error(call, code)


class _FieldValue(ctypes.Structure):
    """pynvml's c_nvmlFieldValue_t layout in a plain ctypes struct.

    pynvml's structs override __getattribute__/__setattr__ in Python to convert strings; for
    the calls that move many structs per poll (field values, processes, process samples) that
    costs more than the call itself, so this module hands the driver plain structs of the
    same layout.
    """

    _fields_ = pynvml.c_nvmlFieldValue_t._fields_


class _ProcessSample(ctypes.Structure):
    _fields_ = pynvml.c_nvmlProcessUtilizationSample_t._fields_


class _Sample(ctypes.Structure):
    _fields_ = pynvml.c_nvmlSample_t._fields_


# nvmlProcessUtilizationSample_t as struct sees it: pid, timeStamp, smUtil, memUtil, encUtil,
# decUtil, with the C struct's alignment (a test holds it to the ctypes layout).
_SAMPLE_FORMAT = "IQIIII"
_SAMPLE_FIELDS = len(_SAMPLE_FORMAT)


@functools.lru_cache(maxsize=64)
def _samples_layout(count: int) -> struct.Struct:
    return struct.Struct("@" + _SAMPLE_FORMAT * count)


class _ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_v2_t; v3 of the call returns the same struct.
    _fields_ = pynvml.c_nvmlProcessInfo_v2_t._fields_


class _Memory(ctypes.Structure):
    _fields_ = pynvml.c_nvmlMemory_t._fields_


class _MemoryV2(ctypes.Structure):
    _fields_ = pynvml.c_nvmlMemory_v2_t._fields_


class _Utilization(ctypes.Structure):
    _fields_ = pynvml.c_nvmlUtilization_t._fields_


# nvmlDeviceGetTemperatureV (R565) came with nvidia-ml-py 12.560: older bindings lack its struct,
# and then only the older call is made.
_TemperatureV1: type[ctypes.Structure] | None = (
    type("_TemperatureV1", (ctypes.Structure,), {"_fields_": pynvml.c_nvmlTemperature_v1_t._fields_})
    if hasattr(pynvml, "nvmlDeviceGetTemperatureV")
    else None
)


# The union member that holds a field's value, by its NVML_VALUE_TYPE_*.
_VALUE_MEMBERS = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
}


_WIDEST = "ullVal"


def _field_value(item: _FieldValue, value: ctypes.Union) -> float:
    """A field's value, from the union member its type names (an unknown type reads as
    unsigned long long, the widest)."""
    return float(getattr(value, _VALUE_MEMBERS.get(item.valueType, _WIDEST)))


class _FieldRequest:
    """One field-values request, built once and sent every poll: the driver writes only the
    outputs, so the ids stay; the outputs are reset from `template` before each call."""

    __slots__ = ("array", "items", "length", "template", "values")

    def __init__(self, fields: Sequence[tuple[int, int]]) -> None:
        self.array = (_FieldValue * len(fields))()
        for item, (field_id, scope_id) in zip(self.array, fields, strict=True):
            item.fieldId, item.scopeId = field_id, scope_id
        self.length = ctypes.c_int32(len(fields))
        self.template = bytes(self.array)
        # Views into `array`, made once: indexing a ctypes array builds a new object each time.
        self.items = tuple(self.array)
        self.values = tuple(item.value for item in self.items)


class _Plan:
    """How one list of keys is read from one device: which go in the field-values batch (with
    its request), which by single calls. Rebuilt when the backend learns something that
    changes the split (a field the batch lacks, or no field values at all)."""

    __slots__ = ("batched", "field_values", "request", "single", "unbatched")

    def __init__(self, backend: NvmlBackend, handle: _Device, keys: Sequence[ReadingKey]) -> None:
        self.field_values = backend._field_values
        self.unbatched = len(handle.unbatched)
        self.batched: list[ReadingKey] = []
        self.single: list[ReadingKey] = []
        for key in keys:
            batchable = self.field_values and key.quantity in _FIELD_IDS and key.quantity not in handle.unbatched
            (self.batched if batchable else self.single).append(key)
        self.request = _FieldRequest([(_FIELD_IDS[k.quantity], k.link or 0) for k in self.batched])

    def current(self, backend: NvmlBackend, handle: _Device) -> bool:
        return self.field_values == backend._field_values and self.unbatched == len(handle.unbatched)


class _Device:
    """A handle plus what this module has learned about reading that device."""

    __slots__ = (
        "celsius",
        "handle",
        "memory",
        "memory_v2",
        "plans",
        "processes",
        "samples",
        "temperature",
        "unbatched",
        "utilization",
        "utilization_samples",
    )

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        # Quantities the field-values call lacks on this device, but a single call may have.
        self.unbatched: set[Quantity] = set()
        # How each list of keys the sampler asks for is read, by that list.
        self.plans: dict[tuple[ReadingKey, ...], _Plan] = {}
        # Reused result buffers, grown when the driver says they are too small.
        self.processes: ctypes.Array[_ProcessInfo] = (_ProcessInfo * 32)()
        self.samples: ctypes.Array[_ProcessSample] = (_ProcessSample * 64)()
        self.utilization_samples: ctypes.Array[_Sample] = (_Sample * 128)()
        # Reused result structs of the single calls read every poll.
        self.memory = _Memory()
        self.memory_v2 = _MemoryV2()
        self.utilization = _Utilization()
        self.temperature: ctypes.Structure | None = None
        self.celsius = ctypes.c_uint()


class _EventData(ctypes.Structure):
    _fields_ = pynvml.c_nvmlEventData_t._fields_


class _EventSet:
    """An NVML event set, and the token each device on it was registered with, by the address
    of its handle (what an event's `device` holds)."""

    __slots__ = ("pointer", "tokens")

    def __init__(self, pointer: Any) -> None:
        self.pointer = pointer
        self.tokens: dict[int, int] = {}


# nvmlEventType* for each kind of event agent/devices/events.py reads.
_EVENT_TYPES = {
    EventKind.XID: pynvml.nvmlEventTypeXidCriticalError,
    EventKind.SINGLE_BIT_ECC: pynvml.nvmlEventTypeSingleBitEccError,
    EventKind.DOUBLE_BIT_ECC: pynvml.nvmlEventTypeDoubleBitEccError,
    EventKind.CLOCK_CHANGE: pynvml.nvmlEventTypeClock,
}


def _address(pointer: Any) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0


class _NvmlEvents:
    """The driver's event API, as `agent.devices.events.EventBackend` (the reader's thread)."""

    def supported_events(self, handle: Handle) -> frozenset[EventKind]:
        call = "nvmlDeviceGetSupportedEventTypes"
        mask = _call(call, pynvml.nvmlDeviceGetSupportedEventTypes, handle.handle)
        return frozenset(kind for kind, bit in _EVENT_TYPES.items() if mask & bit)

    def open_event_set(self) -> Any:
        return _EventSet(_call("nvmlEventSetCreate", pynvml.nvmlEventSetCreate))

    def register_events(self, event_set: Any, handle: Handle, kinds: frozenset[EventKind], token: int) -> None:
        mask = 0
        for kind in kinds:
            mask |= _EVENT_TYPES[kind]
        _call("nvmlDeviceRegisterEvents", pynvml.nvmlDeviceRegisterEvents, handle.handle, mask, event_set.pointer)
        event_set.tokens[_address(handle.handle)] = token

    def wait_event(self, event_set: Any, timeout_s: float) -> DeviceEvent | None:
        # As pynvml's nvmlEventSetWait_v2 calls it, but a timeout is an answer here, not an error.
        call = "nvmlEventSetWait"
        data = _EventData()
        timeout_ms = ctypes.c_uint(max(0, round(timeout_s * 1000)))
        code = _function(call, "nvmlEventSetWait_v2")(event_set.pointer, ctypes.byref(data), timeout_ms)
        if code == pynvml.NVML_ERROR_TIMEOUT:
            return None
        _check(call, code)
        kind = next((kind for kind, bit in _EVENT_TYPES.items() if data.eventType & bit), None)
        if kind is None:
            return None  # a type nobody asked for
        return DeviceEvent(event_set.tokens.get(_address(data.device)), kind, int(data.eventData))

    def close_event_set(self, event_set: Any) -> None:
        # Freeing a set of a driver that is gone is not worth reporting.
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlEventSetFree(event_set.pointer)


class _GpmMetricsGet(ctypes.Structure):
    """pynvml's c_nvmlGpmMetricsGet_t layout in a plain struct (see _FieldValue for why)."""

    _fields_ = pynvml.c_nvmlGpmMetricsGet_t._fields_


# The GPM metrics read, in Activity's field order (NVML_GPM_METRIC_*): graphics activity, SM
# activity, SM occupancy, tensor activity (any tensor op), DRAM bandwidth.
_GPM_METRICS = (
    getattr(pynvml, "NVML_GPM_METRIC_GRAPHICS_UTIL", 1),
    getattr(pynvml, "NVML_GPM_METRIC_SM_UTIL", 2),
    getattr(pynvml, "NVML_GPM_METRIC_SM_OCCUPANCY", 3),
    getattr(pynvml, "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 5),
    getattr(pynvml, "NVML_GPM_METRIC_DRAM_BW_UTIL", 10),
)


class _NvmlActivity:
    """GPU Performance Monitoring (Hopper and later, R520 drivers on), as
    `agent.devices.activity.ActivityBackend`: SM, tensor and DRAM activity between two samples."""

    _gpm_request: _GpmMetricsGet | None = None

    def activity_supported(self, handle: Handle) -> bool:
        support = _call("nvmlGpmQueryDeviceSupport", pynvml.nvmlGpmQueryDeviceSupport, handle.handle)
        return bool(support.isSupportedDevice)

    def new_activity_sample(self) -> Any:
        return _call("nvmlGpmSampleAlloc", pynvml.nvmlGpmSampleAlloc)

    def take_activity_sample(self, handle: Handle, sample: Any, gpu_instance_id: int | None) -> None:
        if gpu_instance_id is None:
            _call("nvmlGpmSampleGet", pynvml.nvmlGpmSampleGet, handle.handle, sample)
        else:
            _call("nvmlGpmMigSampleGet", pynvml.nvmlGpmMigSampleGet, handle.handle, gpu_instance_id, sample)

    def activity_between(self, earlier: Any, later: Any) -> Activity:
        call = "nvmlGpmMetricsGet"
        request = self._gpm_request
        if request is None:
            # One request struct, reused: it holds room for every metric NVML knows (tens of KB).
            request = self._gpm_request = _GpmMetricsGet()
            request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(_GPM_METRICS)
            for slot, metric_id in enumerate(_GPM_METRICS):
                request.metrics[slot].metricId = metric_id
        request.sample1, request.sample2 = earlier, later
        _check(call, _function(call, call)(ctypes.byref(request)))
        values: list[float | None] = []
        for slot in range(len(_GPM_METRICS)):
            metric = request.metrics[slot]
            # GPM reports percent; the seam carries fractions.
            values.append(metric.value / 100 if metric.nvmlReturn == pynvml.NVML_SUCCESS else None)
        return Activity(*values)

    def free_activity_sample(self, sample: Any) -> None:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlGpmSampleFree(sample)


def mig_profile_from_name(name: str) -> str:
    """NVML names a MIG device after its GPU and its profile: "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    -> "3g.40gb" (also "1c.3g.40gb" for a compute instance smaller than its GPU instance)."""
    _, sep, profile = name.rpartition(" MIG ")
    return profile if sep else ""


class NvmlBackend(_NvmlEvents, _NvmlActivity):
    """NVML as the sampler uses it, and as the event reader does (`_NvmlEvents`). `clock` is the
    backend's clock in unix seconds."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._memory_v2: bool | None = None
        self._temperature_v: bool | None = None
        self._processes_fn: str | None = None
        self._field_values = True

    # -- library ------------------------------------------------------------------------------

    def init(self) -> None:
        _call("nvmlInit", pynvml.nvmlInit)

    def shutdown(self) -> None:
        # Shutting down a library that is already gone is not worth reporting.
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()

    def driver_version(self) -> str:
        return str(_call("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion))

    def cuda_driver_version(self) -> int:
        return int(_call("nvmlSystemGetCudaDriverVersion", pynvml.nvmlSystemGetCudaDriverVersion))

    def device_count(self) -> int:
        return int(_call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount))

    def handle_by_index(self, index: int) -> Handle:
        return _Device(_call("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index))

    # -- identity -----------------------------------------------------------------------------

    def name(self, handle: Handle) -> str:
        return str(_call("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, handle.handle))

    def uuid(self, handle: Handle) -> str:
        return str(_call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, handle.handle))

    def pci_bus_id(self, handle: Handle) -> str:
        info = _call("nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, handle.handle)
        bus_id = info.busId
        return bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)

    def power_limit_w(self, handle: Handle) -> float:
        call = "nvmlDeviceGetEnforcedPowerLimit"
        return _from_milli(_call(call, pynvml.nvmlDeviceGetEnforcedPowerLimit, handle.handle))

    def sm_count(self, handle: Handle) -> int:
        return int(_call("nvmlDeviceGetAttributes", pynvml.nvmlDeviceGetAttributes, handle.handle).multiprocessorCount)

    def nvlink_count(self, handle: Handle) -> int:
        """The link-count field where the driver has it, else the links that answer a state query.

        Only "no such field" or "no such link" ends the count: any other error means the count
        cannot be read now, and is raised, never taken for "no NVLink". An error code on the
        field alone is the driver answering about that field, so it is raised as that field's
        error (`DeviceError`), not as the driver gone."""
        with contextlib.suppress(ReadingNotSupported):
            value, code = self._fields(handle, [(_FI_NVLINK_LINK_COUNT, 0)])[0]
            if code is None:
                return int(value)
            failure = _error("nvmlDeviceGetFieldValues", code)
            if isinstance(failure, DeviceLost):
                raise failure
            if failure.error not in _NO_SUCH_LINK:
                raise DeviceError(failure.call, failure.error)
        links = 0
        for link in range(_MAX_NVLINKS):
            try:
                self._nvlink_up(handle, link)
            except DeviceError as exc:
                if exc.error in _NO_SUCH_LINK:
                    break
                raise
            links += 1
        return links

    def mig_enabled(self, handle: Handle) -> bool:
        current, _pending = _call("nvmlDeviceGetMigMode", pynvml.nvmlDeviceGetMigMode, handle.handle)
        return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)

    def mig_handles(self, handle: Handle) -> list[tuple[int, Handle]]:
        count = _call("nvmlDeviceGetMaxMigDeviceCount", pynvml.nvmlDeviceGetMaxMigDeviceCount, handle.handle)
        found = []
        for slot in range(count):
            try:
                mig = _call(
                    "nvmlDeviceGetMigDeviceHandleByIndex",
                    pynvml.nvmlDeviceGetMigDeviceHandleByIndex,
                    handle.handle,
                    slot,
                )
            except _NotFound:
                continue  # an empty slot: MIG devices need not be contiguous
            found.append((slot, _Device(mig)))
        return found

    def mig_profile(self, handle: Handle) -> str:
        return mig_profile_from_name(self.name(handle))

    def gpu_instance_id(self, handle: Handle) -> int:
        return int(_call("nvmlDeviceGetGpuInstanceId", pynvml.nvmlDeviceGetGpuInstanceId, handle.handle))

    def compute_instance_id(self, handle: Handle) -> int:
        return int(_call("nvmlDeviceGetComputeInstanceId", pynvml.nvmlDeviceGetComputeInstanceId, handle.handle))

    # -- readings -----------------------------------------------------------------------------

    def read(self, handle: Handle, keys: Sequence[ReadingKey]) -> ReadResult:
        values: dict[ReadingKey, float] = {}
        errors: dict[ReadingKey, DeviceError] = {}
        wanted = tuple(keys)
        plan = handle.plans.get(wanted)
        if plan is None or not plan.current(self, handle):
            plan = handle.plans[wanted] = _Plan(self, handle, wanted)
        self._read_singles(handle, plan.single, values, errors)
        if plan.batched:
            self._read_singles(handle, self._read_batched(handle, plan, values, errors), values, errors)
        return ReadResult(values, errors)

    def _read_singles(
        self,
        handle: _Device,
        keys: list[ReadingKey],
        values: dict[ReadingKey, float],
        errors: dict[ReadingKey, DeviceError],
    ) -> None:
        """One call per key (memory used and total share theirs), in the order given."""
        memory: tuple[int, int] | DeviceError | None = None
        for key in keys:
            try:
                if key.quantity in _MEMORY:
                    if memory is None:
                        try:
                            memory = self._memory(handle)
                        except (DeviceLost, DriverUnavailable):
                            raise
                        except DeviceError as exc:
                            memory = exc
                    if isinstance(memory, DeviceError):
                        errors[key] = memory
                        continue
                    values[key] = float(memory[0] if key.quantity is Quantity.MEMORY_USED else memory[1])
                else:
                    values[key] = self._single(handle, key)
            except (DeviceLost, DriverUnavailable):
                raise
            except DeviceError as exc:
                errors[key] = exc

    def _read_batched(
        self,
        handle: _Device,
        plan: _Plan,
        values: dict[ReadingKey, float],
        errors: dict[ReadingKey, DeviceError],
    ) -> list[ReadingKey]:
        """Reads the plan's batched keys in one field-values call into `values`/`errors`;
        returns the keys left for single calls."""
        call = "nvmlDeviceGetFieldValues"
        keys = plan.batched
        request = plan.request
        try:
            self._send(handle, request)
        except ReadingNotSupported as exc:
            log.info("field values are not available (%s): reading one call per value", exc.error)
            self._field_values = False
            return keys
        except (DeviceLost, DriverUnavailable):
            raise
        except DeviceError as exc:
            errors.update(dict.fromkeys(keys, exc))
            return []
        left: list[ReadingKey] = []
        for key, item, value in zip(keys, request.items, request.values, strict=True):
            code = item.nvmlReturn
            if code == pynvml.NVML_SUCCESS:
                # `_field_value`, inline: a dozen fields per GPU every poll.
                raw = float(getattr(value, _VALUE_MEMBERS.get(item.valueType, _WIDEST)))
                values[key] = float(bool(raw)) if key.quantity is Quantity.NVLINK_UP else _from_milli(raw)
                continue
            failure = _error(call, code)
            if isinstance(failure, (DeviceLost, DriverUnavailable)):
                raise failure
            if failure.error in ("NOT_SUPPORTED", "INVALID_ARGUMENT"):
                # The batch lacks it; the single call may still have it (older drivers).
                handle.unbatched.add(key.quantity)
                left.append(key)
            else:
                errors[key] = failure
        return left

    def _single(self, handle: _Device, key: ReadingKey) -> float:
        quantity = key.quantity
        if quantity is Quantity.UTILIZATION:
            rates = handle.utilization
            self._struct_call("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetUtilizationRates", handle, rates)
            return float(rates.gpu) / 100
        if quantity is Quantity.TEMPERATURE:
            return self._temperature_c(handle)
        if quantity is Quantity.POWER:
            return _from_milli(_call("nvmlDeviceGetPowerUsage", pynvml.nvmlDeviceGetPowerUsage, handle.handle))
        if quantity is Quantity.ENERGY:
            call = "nvmlDeviceGetTotalEnergyConsumption"
            return _from_milli(_call(call, pynvml.nvmlDeviceGetTotalEnergyConsumption, handle.handle))
        if quantity is Quantity.NVLINK_UP:
            return float(self._nvlink_up(handle, key.link or 0))
        raise ValueError(f"NVML has no single call for {key}")

    @staticmethod
    def _struct_call(call: str, name: str, handle: _Device, out: ctypes.Structure) -> None:
        """The C function `name` filling `out`, as pynvml's wrapper of it calls it, but into the
        device's reused plain struct: pynvml's own structs convert every field through
        Python-level hooks, and these calls are made for every GPU every poll."""
        _check(call, _function(call, name)(handle.handle, ctypes.byref(out)))

    def _memory(self, handle: _Device) -> tuple[int, int]:
        """(used, total) bytes. The v2 call counts driver-reserved memory apart, as `used` should."""
        call = "nvmlDeviceGetMemoryInfo"
        if self._memory_v2 is not False:
            info_v2 = handle.memory_v2
            info_v2.version = pynvml.nvmlMemory_v2
            try:
                self._struct_call(call, "nvmlDeviceGetMemoryInfo_v2", handle, info_v2)
                self._memory_v2 = True
                return int(info_v2.used), int(info_v2.total)
            except _FunctionMissing:
                self._memory_v2 = False
        info = handle.memory
        self._struct_call(call, "nvmlDeviceGetMemoryInfo", handle, info)
        return int(info.used), int(info.total)

    def _temperature_c(self, handle: _Device) -> float:
        call = "nvmlDeviceGetTemperature"
        if self._temperature_v is not False and _TemperatureV1 is not None:
            reading = handle.temperature
            if reading is None:
                reading = handle.temperature = _TemperatureV1()
            reading.version, reading.sensorType = pynvml.nvmlTemperature_v1, _SENSOR_GPU
            try:
                self._struct_call(call, "nvmlDeviceGetTemperatureV", handle, reading)
                self._temperature_v = True
                return float(reading.temperature)
            except _FunctionMissing:
                self._temperature_v = False
        # As pynvml's nvmlDeviceGetTemperature calls it, into the device's reused output.
        celsius = handle.celsius
        _check(call, _function(call, call)(handle.handle, _SENSOR, ctypes.byref(celsius)))
        return float(celsius.value)

    def _nvlink_up(self, handle: _Device, link: int) -> bool:
        state = _call("nvmlDeviceGetNvLinkState", pynvml.nvmlDeviceGetNvLinkState, handle.handle, link)
        return bool(state == pynvml.NVML_FEATURE_ENABLED)

    def _fields(self, handle: _Device, fields: Sequence[tuple[int, int]]) -> list[tuple[float, int | None]]:
        """One field-values call: per field (value, None), or (0.0, its NVML return code)."""
        return self._request(handle, _FieldRequest(fields))

    @classmethod
    def _request(cls, handle: _Device, request: _FieldRequest) -> list[tuple[float, int | None]]:
        cls._send(handle, request)
        return [
            (_field_value(item, value), None) if item.nvmlReturn == pynvml.NVML_SUCCESS else (0.0, item.nvmlReturn)
            for item, value in zip(request.items, request.values, strict=True)
        ]

    @staticmethod
    def _send(handle: _Device, request: _FieldRequest) -> None:
        """One field-values call; each field's outcome is then in `request.items`."""
        call = "nvmlDeviceGetFieldValues"
        array = request.array
        ctypes.memmove(array, request.template, len(request.template))
        _check(call, _function(call, call)(handle.handle, request.length, ctypes.byref(array)))

    def running_processes(self, handle: Handle) -> list[ProcessInfo]:
        """Compute processes with their memory, through the newest call version the driver has."""
        variants: tuple[str, ...] = (
            ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
            if self._processes_fn is None
            else (self._processes_fn,)
        )
        missing: _FunctionMissing | None = None
        for variant in variants:
            try:
                infos = self._process_infos(handle, variant)
            except _FunctionMissing as exc:
                missing = exc
                continue
            self._processes_fn = variant
            return infos
        assert missing is not None
        raise missing

    def _process_infos(self, handle: _Device, variant: str) -> list[ProcessInfo]:
        call = "nvmlDeviceGetComputeRunningProcesses"
        fn = _function(call, variant)
        count = ctypes.c_uint(0)
        # Processes may start between a too-small call and the next: try a few times.
        for _attempt in range(3):
            buffer = handle.processes
            count.value = len(buffer)
            code = fn(handle.handle, ctypes.byref(count), buffer)
            if code == pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                if len(buffer) >= MAX_PROCESSES:
                    break  # a driver that never says enough: not a reason to grow without bound
                handle.processes = (_ProcessInfo * min(count.value * 2 + 5, MAX_PROCESSES))()
                continue
            _check(call, code)
            return [
                ProcessInfo(
                    pid=info.pid,
                    used_memory_bytes=None if info.usedGpuMemory == _NOT_AVAILABLE_U64 else info.usedGpuMemory,
                    gpu_instance_id=None if info.gpuInstanceId == _NO_INSTANCE else info.gpuInstanceId,
                    compute_instance_id=None if info.computeInstanceId == _NO_INSTANCE else info.computeInstanceId,
                )
                for info in buffer[: count.value]
            ]
        raise DeviceError(call, "INSUFFICIENT_SIZE", "the process list kept growing while it was read")

    def process_utilization(self, handle: Handle, since_us: int) -> list[ProcessSample]:
        call = "nvmlDeviceGetProcessUtilization"
        fn = _function(call, call)
        count = ctypes.c_uint(0)
        since = ctypes.c_ulonglong(since_us)
        for _attempt in range(3):
            buffer = handle.samples
            count.value = len(buffer)
            code = fn(handle.handle, buffer, ctypes.byref(count), since)
            if code == pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                if len(buffer) >= MAX_SAMPLES:
                    break
                handle.samples = (_ProcessSample * min(count.value * 2 + 5, MAX_SAMPLES))()
                continue
            if code == pynvml.NVML_ERROR_NOT_FOUND:
                return []
            _check(call, code)
            # The samples as one unpack of the buffer (pid, time stamp, SM utilization of each):
            # a busy GPU has dozens a poll, and three ctypes attribute reads each cost more.
            flat = _samples_layout(count.value).unpack_from(buffer)
            return list(zip(flat[0::_SAMPLE_FIELDS], flat[1::_SAMPLE_FIELDS], flat[2::_SAMPLE_FIELDS], strict=True))
        raise DeviceError(call, "INSUFFICIENT_SIZE", "the samples kept growing while they were read")

    def utilization_samples(self, handle: Handle, since_us: int) -> list[UtilizationSample]:
        """The GPU's utilization samples since `since_us` (nvmlDeviceGetSamples with
        NVML_GPU_UTILIZATION_SAMPLES), in one call into the device's buffer: pynvml's wrapper
        makes two (the size, then the samples)."""
        call = "nvmlDeviceGetSamples"
        fn = _function(call, call)
        kind = ctypes.c_uint(pynvml.NVML_GPU_UTILIZATION_SAMPLES)
        since = ctypes.c_ulonglong(since_us)
        value_type = ctypes.c_uint(0)
        count = ctypes.c_uint(0)
        for _attempt in range(3):
            buffer = handle.utilization_samples
            count.value = len(buffer)
            code = fn(handle.handle, kind, since, ctypes.byref(value_type), ctypes.byref(count), buffer)
            if code == pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                if len(buffer) >= MAX_SAMPLES:
                    break
                handle.utilization_samples = (_Sample * min(count.value * 2 + 5, MAX_SAMPLES))()
                continue
            if code == pynvml.NVML_ERROR_NOT_FOUND:
                return []  # nothing sampled since `since_us`
            _check(call, code)
            member = _VALUE_MEMBERS.get(value_type.value, "uiVal")
            return [(s.timeStamp, float(getattr(s.sampleValue, member))) for s in buffer[: count.value]]
        raise DeviceError(call, "INSUFFICIENT_SIZE", "the samples kept growing while they were read")
