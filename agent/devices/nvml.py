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
import operator
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pynvml

from agent.devices.backend import (
    VIOLATION_QUANTITIES,
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
    ReadingNoLongerSupported,
    ReadingNotSupported,
    ReadResult,
    UtilizationSample,
)
from agent.devices.events import DeviceEvent, EventKind
from agent.model import Activity

log = logging.getLogger(__name__)
T = TypeVar("T")

_FI_TOTAL_ENERGY_CONSUMPTION = pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
_FI_POWER_AVERAGE = getattr(pynvml, "NVML_FI_DEV_POWER_AVERAGE", 185)
_FI_POWER_INSTANT = getattr(pynvml, "NVML_FI_DEV_POWER_INSTANT", 186)
_FI_NVLINK_GET_STATE = getattr(pynvml, "NVML_FI_DEV_NVLINK_GET_STATE", 165)
_FI_NVLINK_LINK_COUNT = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT
_MAX_NVLINKS = getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)
Q = Quantity
# The quantities the field-values call can batch: field ids (nvml.h NVML_FI_DEV_*), the preferred
# first. A field the driver refuses on a device is replaced by the next, and the last by the
# quantity's single call (or, where it has none, it is not supported).
_FIELD_IDS: dict[Quantity, tuple[int, ...]] = {
    # The 1 s average (Ampere on, GA100 aside), else the instant; the sampler reports the mean
    # since the previous poll from the energy counter where it can (sampler._mean_power).
    Q.POWER: (_FI_POWER_AVERAGE, _FI_POWER_INSTANT),
    Q.ENERGY: (_FI_TOTAL_ENERGY_CONSUMPTION,),
    # Perf-policy counters (74-81): nvmlDeviceGetViolationStatus is deprecated in their favour.
    Q.VIOLATION_POWER: (74,),
    Q.VIOLATION_THERMAL: (75,),
    Q.VIOLATION_SYNC_BOOST: (76,),
    Q.VIOLATION_BOARD_LIMIT: (77,),
    Q.VIOLATION_LOW_UTILIZATION: (78,),
    Q.VIOLATION_RELIABILITY: (79,),
    Q.VIOLATION_APP_CLOCKS: (80,),
    Q.VIOLATION_BASE_CLOCKS: (81,),
    Q.ECC_CORRECTED_VOLATILE: (3,),
    Q.ECC_UNCORRECTED_VOLATILE: (4,),
    Q.ECC_CORRECTED_AGGREGATE: (5,),
    Q.ECC_UNCORRECTED_AGGREGATE: (6,),
    Q.RETIRED_PAGES_SINGLE_BIT: (29,),
    Q.RETIRED_PAGES_DOUBLE_BIT: (30,),
    Q.RETIRED_PAGES_PENDING: (31,),
    Q.PCIE_REPLAYS: (94,),
    Q.REMAPPED_ROWS_CORRECTABLE: (142,),
    Q.REMAPPED_ROWS_UNCORRECTABLE: (143,),
    Q.ROW_REMAP_PENDING: (144,),
    Q.ROW_REMAP_FAILURE: (145,),
}
# Per-link quantities: the field ids scoped by link (scopeId = the link)...
_LINK_FIELD_IDS: dict[Quantity, int] = {
    Q.NVLINK_UP: _FI_NVLINK_GET_STATE,
    Q.NVLINK_REPLAY_ERRORS: 161,  # NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY (R520)
    Q.NVLINK_RECOVERY_ERRORS: 162,  # .._DL_RECOVERY
    Q.NVLINK_CRC_ERRORS: 163,  # .._DL_CRC
    Q.NVLINK_TX_BYTES: 138,  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, KiB
    Q.NVLINK_RX_BYTES: 139,  # .._DATA_RX
}
# ...and, before R520, one field id per link for links 0-5 and 6-11 (the L0..L11 ids).
_PER_LINK_FIELD_IDS: dict[Quantity, tuple[int, int]] = {
    Q.NVLINK_CRC_ERRORS: (32, 96),  # NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L0 / _L6
    Q.NVLINK_REPLAY_ERRORS: (46, 108),  # .._REPLAY_ERROR_COUNT_L0 / _L6
    Q.NVLINK_RECOVERY_ERRORS: (53, 114),  # .._RECOVERY_ERROR_COUNT_L0 / _L6
}
# What a field's raw value is divided by to reach the seam's units (a division, as the single
# calls convert, so that both paths give the same float).
_FIELD_DIVISORS: dict[Quantity, float] = {
    Q.POWER: 1000.0,  # mW
    Q.ENERGY: 1000.0,  # mJ
    **dict.fromkeys(VIOLATION_QUANTITIES, 1e9),  # ns
    Q.NVLINK_TX_BYTES: 1 / 1024,  # KiB (a power of two: the division is exact)
    Q.NVLINK_RX_BYTES: 1 / 1024,
}


@functools.cache
def _field_ids(key: ReadingKey) -> tuple[tuple[int, int], ...]:
    """The (field id, scope id) pairs that can read `key`, the preferred first."""
    quantity = key.quantity
    if quantity in _FIELD_IDS:
        return tuple((field_id, 0) for field_id in _FIELD_IDS[quantity])
    link = key.link or 0
    found: list[tuple[int, int]] = []
    if quantity in _LINK_FIELD_IDS:
        found.append((_LINK_FIELD_IDS[quantity], link))
    if quantity in _PER_LINK_FIELD_IDS and link < 12:
        first, seventh = _PER_LINK_FIELD_IDS[quantity]
        found.append((first + link if link < 6 else seventh + link - 6, 0))
    return tuple(found)


_MEMORY = (Quantity.MEMORY_USED, Quantity.MEMORY_TOTAL, Quantity.MEMORY_FREE)
_NOT_AVAILABLE_U64 = 0xFFFFFFFFFFFFFFFF  # usedGpuMemory where the driver cannot tell (WDDM)
_NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of a process outside MIG
_SENSOR_GPU = pynvml.NVML_TEMPERATURE_GPU
_SENSOR = pynvml._nvmlTemperatureSensors_t(_SENSOR_GPU)
_PSTATE_UNKNOWN = getattr(pynvml, "NVML_PSTATE_UNKNOWN", 32)
_GPU_UTILIZATION_SAMPLES = ctypes.c_uint(pynvml.NVML_GPU_UTILIZATION_SAMPLES)  # passed by value

# Quantities one single call answers together: within one `read` it is made once, for whichever
# of them is asked first.
_SHARED: dict[Quantity, str] = {
    Q.MEMORY_USED: "memory",
    Q.MEMORY_TOTAL: "memory",
    Q.MEMORY_FREE: "memory",
    Q.UTILIZATION: "utilization",
    Q.MEMORY_UTILIZATION: "utilization",
    Q.REMAPPED_ROWS_CORRECTABLE: "remapped rows",
    Q.REMAPPED_ROWS_UNCORRECTABLE: "remapped rows",
    Q.ROW_REMAP_PENDING: "remapped rows",
    Q.ROW_REMAP_FAILURE: "remapped rows",
}
# Arguments of the single calls, as the C functions take them.
_CLOCKS = {
    Q.SM_CLOCK: ("nvmlDeviceGetClockInfo", ctypes.c_uint(pynvml.NVML_CLOCK_SM)),
    Q.MEMORY_CLOCK: ("nvmlDeviceGetClockInfo", ctypes.c_uint(pynvml.NVML_CLOCK_MEM)),
    Q.SM_CLOCK_MAX: ("nvmlDeviceGetMaxClockInfo", ctypes.c_uint(pynvml.NVML_CLOCK_SM)),
    Q.MEMORY_CLOCK_MAX: ("nvmlDeviceGetMaxClockInfo", ctypes.c_uint(pynvml.NVML_CLOCK_MEM)),
}
_PCIE_LINK = {
    Q.PCIE_LINK_GENERATION: "nvmlDeviceGetCurrPcieLinkGeneration",
    Q.PCIE_LINK_WIDTH: "nvmlDeviceGetCurrPcieLinkWidth",
    Q.PCIE_LINK_GENERATION_MAX: "nvmlDeviceGetMaxPcieLinkGeneration",
    Q.PCIE_LINK_WIDTH_MAX: "nvmlDeviceGetMaxPcieLinkWidth",
}
_PCIE_THROUGHPUT = {
    Q.PCIE_TX_RATE: ctypes.c_uint(pynvml.NVML_PCIE_UTIL_TX_BYTES),
    Q.PCIE_RX_RATE: ctypes.c_uint(pynvml.NVML_PCIE_UTIL_RX_BYTES),
}
_CODECS = {
    Q.ENCODER_UTILIZATION: "nvmlDeviceGetEncoderUtilization",
    Q.DECODER_UTILIZATION: "nvmlDeviceGetDecoderUtilization",
}
_POLICIES = {
    Q.VIOLATION_POWER: pynvml.NVML_PERF_POLICY_POWER,
    Q.VIOLATION_THERMAL: pynvml.NVML_PERF_POLICY_THERMAL,
    Q.VIOLATION_SYNC_BOOST: pynvml.NVML_PERF_POLICY_SYNC_BOOST,
    Q.VIOLATION_BOARD_LIMIT: pynvml.NVML_PERF_POLICY_BOARD_LIMIT,
    Q.VIOLATION_LOW_UTILIZATION: pynvml.NVML_PERF_POLICY_LOW_UTILIZATION,
    Q.VIOLATION_RELIABILITY: pynvml.NVML_PERF_POLICY_RELIABILITY,
    Q.VIOLATION_APP_CLOCKS: pynvml.NVML_PERF_POLICY_TOTAL_APP_CLOCKS,
    Q.VIOLATION_BASE_CLOCKS: pynvml.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS,
}
_ECC = {
    Q.ECC_CORRECTED_VOLATILE: (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
    Q.ECC_UNCORRECTED_VOLATILE: (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
    Q.ECC_CORRECTED_AGGREGATE: (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC),
    Q.ECC_UNCORRECTED_AGGREGATE: (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC),
}
_RETIREMENT_CAUSES = {
    Q.RETIRED_PAGES_SINGLE_BIT: pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
    Q.RETIRED_PAGES_DOUBLE_BIT: pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
}
_NVLINK_COUNTERS = {
    Q.NVLINK_REPLAY_ERRORS: pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
    Q.NVLINK_RECOVERY_ERRORS: pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
    Q.NVLINK_CRC_ERRORS: pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
}

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
# Read plans kept per device: a poll asks one of a few lists (every poll, slow, first).
_MAX_PLANS = 16


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
    """The C function `name`, looked up the way pynvml's wrappers do. The calls made for every
    GPU every poll look in pynvml's cache first (`_cached`), inline: a hit there is what this
    would return, for a dict lookup where this costs two Python calls (a poll makes dozens)."""
    try:
        fn: Callable[..., int] = pynvml._nvmlGetFunctionPointer(name)
    except pynvml.NVMLError as exc:
        raise _error(call, exc.value) from exc
    return fn


# A lookup in pynvml's cache of the library's functions, filled by `_function` (pynvml's own
# lookup): the dict is emptied, never replaced, when the library is unloaded.
_cached: Callable[[str], Callable[..., int] | None] = pynvml._nvmlGetFunctionPointer_cache.get


def _check(call: str, code: int) -> None:
    """Raises what a C function's return `code` means. The calls made for every GPU every poll
    test their code inline instead, as they look up their function (`_cached`)."""
    if code != pynvml.NVML_SUCCESS:
        raise _error(call, code)


# A key read by its single call, with what reads it; None where one call answers its quantity
# together with others (`_SHARED`).
_SingleRead = tuple[ReadingKey, Callable[[], float] | None]


def _output_reader(
    call: str,
    name: str,
    arguments: tuple[Any, ...],
    out: ctypes.c_uint | ctypes.c_ulonglong,
    convert: Callable[[int], float],
) -> Callable[[], float]:
    """A reading of the C function `name` (reported as `call`) called as pynvml's wrapper calls it,
    with `arguments` made once and `out` among them: the device's reused output, so that no
    pynvml object is made for a value read every poll. The function is looked up at the first
    read and kept, as pynvml keeps it for the life of the library."""
    function: Callable[..., int] | None = None

    def read() -> float:
        nonlocal function
        if function is None:
            function = _function(call, name)
        code = function(*arguments)
        if code != pynvml.NVML_SUCCESS:
            raise _error(call, code)
        return convert(out.value)

    return read


def _hz(mhz: int) -> float:
    return mhz * 1e6


def _percent(value: int) -> float:
    return value / 100


def _from_kib(kib: int) -> float:
    return kib * 1024.0


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


_PROCESS_INFO_BYTES = ctypes.sizeof(_ProcessInfo)


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


# Decoding a whole batch at once (`_FieldRequest.unsigned`): a field is five 64-bit words, the
# fourth holding valueType and nvmlReturn (in that order in memory), the fifth the value union.
_FIELD_WORDS = 5
_LITTLE_ENDIAN = sys.byteorder == "little"
_UINT = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
# The unsigned types whose value fills the union's word (unsigned long is 64 bits on Linux).
_WORD_TYPES = frozenset(
    {pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG}
    | ({pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG} if ctypes.sizeof(ctypes.c_ulong) == 8 else set())
)
_UNSIGNED_TYPES = _WORD_TYPES | {_UINT}


# What a field's raw value is divided by, per quantity, in the batch decoded whole (1.0:
# nothing; 0.0: a link state, read as up or down).
_SCALES: dict[Quantity, float] = {q: 0.0 if q is Q.NVLINK_UP else _FIELD_DIVISORS.get(q, 1.0) for q in Quantity}


class _FieldRequest:
    """One field-values request, built once and sent every poll: the driver writes only the
    outputs, so the ids stay; the outputs are reset from `template` before each call."""

    __slots__ = ("_kinds", "_narrow", "_views", "_words", "array", "length", "reference", "template")

    def __init__(self, fields: Sequence[tuple[int, int]]) -> None:
        self.array = (_FieldValue * len(fields))()
        for item, (field_id, scope_id) in zip(self.array, fields, strict=True):
            item.fieldId, item.scopeId = field_id, scope_id
        self.length = ctypes.c_int32(len(fields))
        self.reference = ctypes.byref(self.array)
        self.template = bytes(self.array)
        self._views: tuple[tuple[_FieldValue, ...], tuple[ctypes.Union, ...]] | None = None
        # For `unsigned`: the array as 64-bit words (made once), the value types of the last
        # answer it decoded, and the fields among them whose value is 32 bits wide.
        self._words: memoryview | None = None
        self._kinds: list[int] | None = None
        self._narrow: list[int] = []

    def views(self) -> tuple[tuple[_FieldValue, ...], tuple[ctypes.Union, ...]]:
        """Each field, and its value union, as ctypes views into `array`: made once, at the first
        answer that is read field by field (indexing a ctypes array builds a new object each
        time), and never for a request whose answers are all read whole (`unsigned`)."""
        if self._views is None:
            items = tuple(self.array)
            self._views = items, tuple(item.value for item in items)
        return self._views

    def unsigned(self) -> list[int] | None:
        """Every field's value, when every field succeeded with an unsigned integer type (the
        usual answer): read a word column at a time, not a ctypes attribute per field. None
        otherwise, and on a big-endian host: the caller then reads field by field."""
        if not _LITTLE_ENDIAN:
            return None
        words = self._words
        if words is None:
            words = self._words = memoryview(self.array).cast("B").cast("Q")
        kinds = words[3::_FIELD_WORDS].tolist()
        # A driver answers each field with the same type every poll: the types are checked, and
        # the 32-bit fields found, when they differ from the last answer's.
        if kinds != self._kinds:
            # Little-endian: valueType in the low half of the word, nvmlReturn (0: success) above it.
            if not kinds or max(kinds) > 0xFFFFFFFF or not _UNSIGNED_TYPES.issuperset(kinds):
                return None
            self._kinds = kinds
            self._narrow = [field for field, kind in enumerate(kinds) if kind not in _WORD_TYPES]
        raw = words[4::_FIELD_WORDS].tolist()
        for field in self._narrow:
            raw[field] &= 0xFFFFFFFF
        return raw


class _Plan:
    """How one list of keys is read from one device: which go in the field-values batch (with
    its request), which by single calls. Rebuilt when the backend learns something that
    changes the split (a field the device refuses, or no field values at all)."""

    __slots__ = ("batched", "divisors", "field_values", "learned", "link_states", "request", "single")

    def __init__(self, backend: NvmlBackend, handle: _Device, keys: Sequence[ReadingKey]) -> None:
        self.field_values = backend._field_values and not handle.no_fields
        self.learned = handle.learned
        self.batched: list[ReadingKey] = []
        single: list[ReadingKey] = []
        fields: list[tuple[int, int]] = []
        for key in keys:
            ids = _field_ids(key) if self.field_values else ()
            level = handle.field_level.get(key.quantity, 0)
            if level < len(ids):
                self.batched.append(key)
                fields.append(ids[level])
            else:
                single.append(key)
        self.single = backend._single_reads(handle, single)
        self.request = _FieldRequest(fields)
        # What each batched field's raw value is divided by (see _SCALES), 1.0 for the link
        # states, which are read as up or down instead: which fields those are.
        scales = [_SCALES[key.quantity] for key in self.batched]
        self.divisors = [by or 1.0 for by in scales]
        self.link_states = [field for field, by in enumerate(scales) if not by]

    def current(self, backend: NvmlBackend, handle: _Device) -> bool:
        fields = backend._field_values and not handle.no_fields
        return self.field_values == fields and self.learned == handle.learned


class _Device:
    """A handle plus what this module has learned about reading that device."""

    __slots__ = (
        "celsius",
        "count",
        "field_level",
        "graphics_processes",
        "handle",
        "infos_seen",
        "learned",
        "memory",
        "memory_v2",
        "mps_processes",
        "no_fields",
        "older",
        "out_u64",
        "out_uint",
        "out_uint2",
        "plan_by_id",
        "plans",
        "processes",
        "readers",
        "samples",
        "since",
        "temperature",
        "utilization",
        "utilization_samples",
        "value_type",
        "words",
        "worked",
    )

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        # Per quantity, how many of its field ids this device has refused (the next one is tried;
        # past the last, its single call), and how many refusals in all (plans follow it).
        self.field_level: dict[Quantity, int] = {}
        self.learned = 0
        self.no_fields = False  # the device refused the field-values call itself
        # Versioned calls this device refused (NOT_SUPPORTED) without ever answering: it is read
        # through the older call instead. And the versioned calls it has answered.
        self.older: set[str] = set()
        self.worked: set[str] = set()
        # How each list of keys the sampler asks for is read, by that list; and by the list's
        # identity, (the list, its plan): the sampler hands the same tuple objects every poll,
        # and a tuple of dozens of keys hashes each key every time it is looked up.
        self.plans: dict[tuple[ReadingKey, ...], _Plan] = {}
        self.plan_by_id: dict[int, tuple[tuple[ReadingKey, ...], _Plan]] = {}
        # What reads each key by its single call (`NvmlBackend._reader`), made at its first read.
        self.readers: dict[ReadingKey, Callable[[], float]] = {}
        # Reused result buffers, grown when the driver says they are too small.
        self.processes: ctypes.Array[_ProcessInfo] = (_ProcessInfo * 32)()
        # Per process-list buffer, the bytes of its last answer and the ProcessInfos they made:
        # a GPU's processes and their memory seldom change from one poll to the next.
        self.infos_seen: dict[str, tuple[bytes, list[ProcessInfo]]] = {}
        self.mps_processes: ctypes.Array[_ProcessInfo] = (_ProcessInfo * 8)()
        self.graphics_processes: ctypes.Array[_ProcessInfo] = (_ProcessInfo * 8)()
        self.samples: ctypes.Array[_ProcessSample] = (_ProcessSample * 64)()
        self.utilization_samples: ctypes.Array[_Sample] = (_Sample * 128)()
        # Reused result structs of the single calls read every poll.
        self.memory = _Memory()
        self.memory_v2 = _MemoryV2()
        self.utilization = _Utilization()
        self.temperature: ctypes.Structure | None = None
        self.celsius = ctypes.c_uint()
        self.out_uint = ctypes.c_uint()
        self.out_uint2 = ctypes.c_uint()
        self.out_u64 = ctypes.c_ulonglong()
        # The in-and-out arguments of the list and sample calls, made once rather than per call.
        self.count = ctypes.c_uint()
        self.since = ctypes.c_ulonglong()
        self.value_type = ctypes.c_uint()
        # The utilization-sample buffer as 64-bit words and as 32-bit halves: (the buffer, the
        # views), made again when the buffer is grown.
        self.words: tuple[ctypes.Array[_Sample], memoryview, memoryview] | None = None


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
        # Versioned C functions this driver lacks (FUNCTION_NOT_FOUND): the older one is read.
        self._missing: set[str] = set()
        # Per process-list call (compute, MPS, graphics), the version this driver answered.
        self._list_fns: dict[str, str] = {}
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

    def minor_number(self, handle: Handle) -> int:
        return int(_call("nvmlDeviceGetMinorNumber", pynvml.nvmlDeviceGetMinorNumber, handle.handle))

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
        known = handle.plan_by_id.get(id(wanted))
        if known is not None and known[0] is wanted and known[1].current(self, handle):
            plan = known[1]
        else:
            plan = self._plan(handle, wanted)
        self._read_singles(handle, plan.single, values, errors)
        if plan.batched:
            left = self._read_batched(handle, plan, values, errors)
            if left:  # fields the batch could not read, by their single calls
                self._read_singles(handle, self._single_reads(handle, left), values, errors)
        return ReadResult(values, errors)

    def _plan(self, handle: _Device, wanted: tuple[ReadingKey, ...]) -> _Plan:
        """The plan for reading `wanted`, made where there is none or it is out of date."""
        plan = handle.plans.get(wanted)
        if plan is None or not plan.current(self, handle):
            if len(handle.plans) >= _MAX_PLANS:
                # The lists asked for vary with the readings being retried after a failure: a
                # bound, so that a long run of varied failures cannot grow this without end.
                handle.plans.clear()
            plan = handle.plans[wanted] = _Plan(self, handle, wanted)
        if len(handle.plan_by_id) >= _MAX_PLANS:
            handle.plan_by_id.clear()
        handle.plan_by_id[id(wanted)] = (wanted, plan)
        return plan

    def _single_reads(self, handle: _Device, keys: Sequence[ReadingKey]) -> list[_SingleRead]:
        """Each key with what reads it alone (`_reader`, made at the device's first read of it)."""
        readers = handle.readers
        found: list[_SingleRead] = []
        for key in keys:
            read = None
            if key.quantity not in _SHARED:
                read = readers.get(key)
                if read is None:
                    read = readers[key] = self._reader(handle, key)
            found.append((key, read))
        return found

    def _read_singles(
        self,
        handle: _Device,
        reads: list[_SingleRead],
        values: dict[ReadingKey, float],
        errors: dict[ReadingKey, DeviceError],
    ) -> None:
        """One call per key (keys whose quantities one call answers share it), in the order given."""
        shared: dict[str, dict[Quantity, float] | DeviceError] = {}
        for key, read in reads:
            try:
                if read is not None:
                    values[key] = read()
                    continue
                group = _SHARED[key.quantity]
                answer = shared.get(group)
                if answer is None:
                    try:
                        answer = shared[group] = self._read_shared(handle, group)
                    except (DeviceLost, DriverUnavailable):
                        raise
                    except DeviceError as exc:
                        answer = shared[group] = exc
                if isinstance(answer, DeviceError):
                    errors[key] = answer
                else:
                    values[key] = answer[key.quantity]
            except (DeviceLost, DriverUnavailable):
                raise
            except DeviceError as exc:
                errors[key] = exc

    def _read_shared(self, handle: _Device, group: str) -> dict[Quantity, float]:
        if group == "memory":
            used, total, free = self._memory(handle)
            return {Q.MEMORY_USED: float(used), Q.MEMORY_TOTAL: float(total), Q.MEMORY_FREE: float(free)}
        if group == "utilization":
            rates = handle.utilization
            self._struct_call("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetUtilizationRates", handle, rates)
            return {Q.UTILIZATION: float(rates.gpu) / 100, Q.MEMORY_UTILIZATION: float(rates.memory) / 100}
        call = "nvmlDeviceGetRemappedRows"
        correctable, uncorrectable, pending, failure = _call(call, pynvml.nvmlDeviceGetRemappedRows, handle.handle)
        return {
            Q.REMAPPED_ROWS_CORRECTABLE: float(correctable),
            Q.REMAPPED_ROWS_UNCORRECTABLE: float(uncorrectable),
            Q.ROW_REMAP_PENDING: float(bool(pending)),
            Q.ROW_REMAP_FAILURE: float(bool(failure)),
        }

    def _read_batched(
        self,
        handle: _Device,
        plan: _Plan,
        values: dict[ReadingKey, float],
        errors: dict[ReadingKey, DeviceError],
    ) -> list[ReadingKey]:
        """Reads the plan's batched keys in one field-values call into `values`/`errors`;
        returns the keys left for single calls.

        A field the device refuses (NOT_SUPPORTED, or INVALID_ARGUMENT from a driver that does
        not know the id) is learned: the quantity's next field id is asked at once, in one more
        call (only while learning), and past its last one the quantity goes to its single call."""
        call = "nvmlDeviceGetFieldValues"
        keys, request = plan.batched, plan.request
        left: list[ReadingKey] = []
        while keys:
            try:
                self._send(handle, request)
            except _FunctionMissing as exc:
                log.info("field values are not available (%s): reading one call per value", exc.error)
                self._field_values = False  # the driver lacks the call: every device
                return left + keys
            except ReadingNotSupported as exc:
                log.info("field values are not available on this GPU (%s): reading one call per value", exc.error)
                handle.no_fields = True
                return left + keys
            except (DeviceLost, DriverUnavailable):
                raise
            except DeviceError as exc:
                errors.update(dict.fromkeys(keys, exc))
                return left
            if request is plan.request and (numbers := request.unsigned()) is not None:
                # Every field answered: the same floats as the loop below, a column at a time.
                scaled = list(map(operator.truediv, numbers, plan.divisors))
                for field in plan.link_states:
                    scaled[field] = float(numbers[field] != 0)
                values.update(zip(keys, scaled, strict=True))
                return left
            retry: list[ReadingKey] = []
            refused: set[Quantity] = set()
            for key, item, value in zip(keys, *request.views(), strict=True):
                code = item.nvmlReturn
                quantity = key.quantity
                if code == pynvml.NVML_SUCCESS:
                    # `_field_value`, inline: dozens of fields per GPU every poll.
                    raw = float(getattr(value, _VALUE_MEMBERS.get(item.valueType, _WIDEST)))
                    if quantity is Q.NVLINK_UP:
                        values[key] = float(bool(raw))
                    else:
                        divisor = _FIELD_DIVISORS.get(quantity)
                        values[key] = raw / divisor if divisor else raw
                    continue
                failure = _error(call, code)
                if isinstance(failure, (DeviceLost, DriverUnavailable)):
                    raise failure
                if failure.error not in ("NOT_SUPPORTED", "INVALID_ARGUMENT"):
                    errors[key] = failure
                    continue
                if quantity not in refused:  # one refusal per quantity, whatever its links
                    refused.add(quantity)
                    handle.field_level[quantity] = handle.field_level.get(quantity, 0) + 1
                    handle.learned += 1
                # The batch lacks it; the next field id, or the single call, may still have it.
                (retry if handle.field_level[quantity] < len(_field_ids(key)) else left).append(key)
            keys = retry
            if keys:
                request = _FieldRequest([_field_ids(k)[handle.field_level[k.quantity]] for k in keys])
        return left

    def _reader(self, handle: _Device, key: ReadingKey) -> Callable[[], float]:
        """What reads `key` from the device by its single call: the call, its arguments and its
        output are chosen once per device and key, not at every read (a poll makes dozens)."""
        quantity, device = key.quantity, handle.handle
        out, out_u64 = handle.out_uint, handle.out_u64
        if quantity in _CLOCKS:
            call, clock_type = _CLOCKS[quantity]
            return _output_reader(call, call, (device, clock_type, ctypes.byref(out)), out, _hz)
        if quantity in _PCIE_LINK:
            call = _PCIE_LINK[quantity]
            return _output_reader(call, call, (device, ctypes.byref(out)), out, float)
        if quantity in _CODECS:
            call = _CODECS[quantity]
            period = handle.out_uint2
            return _output_reader(call, call, (device, ctypes.byref(out), ctypes.byref(period)), out, _percent)
        if quantity is Q.TEMPERATURE:
            return self._temperature_reader(handle)
        if quantity is Q.PERFORMANCE_STATE:
            call = "nvmlDeviceGetPerformanceState"
            read_pstate = _output_reader(call, call, (device, ctypes.byref(out)), out, float)

            def pstate() -> float:
                value = read_pstate()
                if value == _PSTATE_UNKNOWN:
                    raise DeviceError(call, "UNKNOWN", "the driver does not know the performance state now")
                return value

            return pstate
        if quantity is Q.CLOCK_EVENT_REASONS:
            call = "nvmlDeviceGetCurrentClocksEventReasons"  # nvmlDeviceGetCurrentClocksThrottleReasons before R535
            newer, older = (
                _output_reader(call, name, (device, ctypes.byref(out_u64)), out_u64, float)
                for name in (call, "nvmlDeviceGetCurrentClocksThrottleReasons")
            )
            return functools.partial(self._versioned, handle, call, newer, older)
        if quantity is Q.POWER:
            return lambda: _from_milli(_call("nvmlDeviceGetPowerUsage", pynvml.nvmlDeviceGetPowerUsage, device))
        if quantity is Q.ENERGY:
            call = "nvmlDeviceGetTotalEnergyConsumption"
            return lambda: _from_milli(_call(call, pynvml.nvmlDeviceGetTotalEnergyConsumption, device))
        if quantity is Q.NVLINK_UP:
            link = key.link or 0
            return lambda: float(self._nvlink_up(handle, link))
        if quantity is Q.MEMORY_CLOCKS_SUPPORTED:
            return lambda: float(self._memory_clock_count(handle))
        if quantity is Q.FAN_SPEED:
            call = "nvmlDeviceGetFanSpeed"
            return _output_reader(call, call, (device, ctypes.byref(out)), out, _percent)
        if quantity is Q.PCIE_REPLAYS:
            call = "nvmlDeviceGetPcieReplayCounter"
            return _output_reader(call, call, (device, ctypes.byref(out)), out, float)
        if quantity in _PCIE_THROUGHPUT:
            call = "nvmlDeviceGetPcieThroughput"
            counter = _PCIE_THROUGHPUT[quantity]
            return _output_reader(call, call, (device, counter, ctypes.byref(out)), out, _from_kib)
        if quantity in _POLICIES:
            call = "nvmlDeviceGetViolationStatus"
            policy = _POLICIES[quantity]
            return lambda: int(_call(call, pynvml.nvmlDeviceGetViolationStatus, device, policy).violationTime) / 1e9
        if quantity in _ECC:
            call = "nvmlDeviceGetTotalEccErrors"
            ecc = _ECC[quantity]
            return lambda: float(_call(call, pynvml.nvmlDeviceGetTotalEccErrors, device, *ecc))
        if quantity in _RETIREMENT_CAUSES:
            call = "nvmlDeviceGetRetiredPages"
            cause = _RETIREMENT_CAUSES[quantity]
            return lambda: float(len(_call(call, pynvml.nvmlDeviceGetRetiredPages, device, cause)))
        if quantity is Q.RETIRED_PAGES_PENDING:
            call = "nvmlDeviceGetRetiredPagesPendingStatus"
            return lambda: float(bool(_call(call, pynvml.nvmlDeviceGetRetiredPagesPendingStatus, device)))
        if quantity in _NVLINK_COUNTERS:
            call = "nvmlDeviceGetNvLinkErrorCounter"
            link, counter = key.link or 0, _NVLINK_COUNTERS[quantity]
            return lambda: float(_call(call, pynvml.nvmlDeviceGetNvLinkErrorCounter, device, link, counter))

        # NVLink traffic has no single call left (nvmlDeviceGetNvLinkUtilizationCounter is gone
        # from current drivers): without its field, the device does not have it, whether or not
        # the field answered before the field-values call stopped serving the device.
        def no_call() -> float:
            raise ReadingNoLongerSupported("nvmlDeviceGetFieldValues", "NOT_SUPPORTED", f"no field or call reads {key}")

        return no_call

    def _versioned(self, handle: _Device, newer: str, read_newer: Callable[[], T], read_older: Callable[[], T]) -> T:
        """A reading through the versioned call `newer` where it serves, else the older call.

        A driver without `newer` is remembered for every device. A device that answers
        NOT_SUPPORTED to it, having never answered it, is read through the older call from then
        on (seen with nvmlDeviceGetTemperatureV on some R565 boards): only when that refuses
        too is the reading unsupported. NOT_SUPPORTED from a call that answered before is a
        transient failure, passed on as it is."""
        if newer not in self._missing and newer not in handle.older:
            try:
                result = read_newer()
            except _FunctionMissing:
                self._missing.add(newer)
            except ReadingNotSupported:
                if newer in handle.worked:
                    raise
                handle.older.add(newer)
                log.info("%s refuses this device: reading it through the older call", newer)
            else:
                handle.worked.add(newer)
                return result
        return read_older()

    def _memory_clock_count(self, handle: _Device) -> int:
        """How many memory clocks the device supports, in one call: room for one clock is given,
        and a device with more answers INSUFFICIENT_SIZE with the count it needs (pynvml's
        wrapper makes two calls, the first to size the list; only the count matters here)."""
        call = "nvmlDeviceGetSupportedMemoryClocks"
        count, clocks_mhz = ctypes.c_uint(1), (ctypes.c_uint * 1)()
        code = _function(call, call)(handle.handle, ctypes.byref(count), clocks_mhz)
        if code != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            _check(call, code)
        return int(count.value)

    @staticmethod
    def _struct_call(call: str, name: str, handle: _Device, out: ctypes.Structure) -> None:
        """The C function `name` filling `out`, as pynvml's wrapper of it calls it, but into the
        device's reused plain struct: pynvml's own structs convert every field through
        Python-level hooks, and these calls are made for every GPU every poll."""
        code = (_cached(name) or _function(call, name))(handle.handle, ctypes.byref(out))
        if code != pynvml.NVML_SUCCESS:
            raise _error(call, code)

    def _memory(self, handle: _Device) -> tuple[int, int, int]:
        """(used, total, free) bytes. The v2 call counts driver-reserved memory apart, as `used`
        should: it is then in neither `used` nor `free`."""
        call = "nvmlDeviceGetMemoryInfo"

        def v2() -> tuple[int, int, int]:
            info_v2 = handle.memory_v2
            info_v2.version = pynvml.nvmlMemory_v2
            self._struct_call(call, "nvmlDeviceGetMemoryInfo_v2", handle, info_v2)
            return int(info_v2.used), int(info_v2.total), int(info_v2.free)

        def v1() -> tuple[int, int, int]:
            info = handle.memory
            self._struct_call(call, "nvmlDeviceGetMemoryInfo", handle, info)
            return int(info.used), int(info.total), int(info.free)

        return self._versioned(handle, "nvmlDeviceGetMemoryInfo_v2", v2, v1)

    def _temperature_reader(self, handle: _Device) -> Callable[[], float]:
        call = "nvmlDeviceGetTemperature"
        # As pynvml's nvmlDeviceGetTemperature calls it, into the device's reused output.
        celsius = handle.celsius
        unversioned = _output_reader(call, call, (handle.handle, _SENSOR, ctypes.byref(celsius)), celsius, float)
        if _TemperatureV1 is None:
            return unversioned

        def versioned() -> float:
            reading = handle.temperature
            if reading is None:
                reading = handle.temperature = _TemperatureV1()
            reading.version, reading.sensorType = pynvml.nvmlTemperature_v1, _SENSOR_GPU
            self._struct_call(call, "nvmlDeviceGetTemperatureV", handle, reading)
            return float(reading.temperature)

        return functools.partial(self._versioned, handle, "nvmlDeviceGetTemperatureV", versioned, unversioned)

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
            for item, value in zip(*request.views(), strict=True)
        ]

    @staticmethod
    def _send(handle: _Device, request: _FieldRequest) -> None:
        """One field-values call; each field's outcome is then in `request.array`."""
        call = "nvmlDeviceGetFieldValues"
        ctypes.memmove(request.array, request.template, len(request.template))
        code = (_cached(call) or _function(call, call))(handle.handle, request.length, request.reference)
        if code != pynvml.NVML_SUCCESS:
            raise _error(call, code)

    def running_processes(self, handle: Handle) -> list[ProcessInfo]:
        """Compute processes with their memory, through the newest call version the driver has."""
        return self._process_list(handle, "nvmlDeviceGetComputeRunningProcesses", "processes")

    def mps_processes(self, handle: Handle) -> list[ProcessInfo]:
        """CUDA MPS clients: under MPS the compute list holds the MPS server, and the processes
        that run the work are only in this list (v2 from R470, v3 from R510)."""
        return self._process_list(handle, "nvmlDeviceGetMPSComputeRunningProcesses", "mps_processes")

    def graphics_processes(self, handle: Handle) -> list[ProcessInfo]:
        """Processes with a graphics context (rendering, Vulkan), absent from the compute list
        unless they hold a compute context too."""
        return self._process_list(handle, "nvmlDeviceGetGraphicsRunningProcesses", "graphics_processes")

    def _process_list(self, handle: _Device, call: str, buffer: str) -> list[ProcessInfo]:
        known = self._list_fns.get(call)
        variants = (f"{call}_v3", f"{call}_v2") if known is None else (known,)
        missing: _FunctionMissing | None = None
        for variant in variants:
            try:
                infos = self._process_infos(handle, call, variant, buffer)
            except _FunctionMissing as exc:
                missing = exc
                continue
            self._list_fns[call] = variant
            return infos
        assert missing is not None
        raise missing

    @staticmethod
    def _process_infos(handle: _Device, call: str, variant: str, buffer_name: str) -> list[ProcessInfo]:
        fn = _cached(variant) or _function(call, variant)
        count = handle.count
        # Processes may start between a too-small call and the next: try a few times.
        for _attempt in range(3):
            buffer: ctypes.Array[_ProcessInfo] = getattr(handle, buffer_name)
            count.value = len(buffer)
            code = fn(handle.handle, ctypes.byref(count), buffer)
            if code == pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                if len(buffer) >= MAX_PROCESSES:
                    break  # a driver that never says enough: not a reason to grow without bound
                setattr(handle, buffer_name, (_ProcessInfo * min(count.value * 2 + 5, MAX_PROCESSES))())
                continue
            if code != pynvml.NVML_SUCCESS:
                raise _error(call, code)
            if not count.value:
                return []  # most lists asked are empty (the MPS and graphics ones): nothing to decode
            answer = bytes(memoryview(buffer).cast("B")[: count.value * _PROCESS_INFO_BYTES])
            seen = handle.infos_seen.get(buffer_name)
            if seen is not None and seen[0] == answer:
                return list(seen[1])  # the same processes as last time: their ProcessInfos again
            infos = [
                ProcessInfo(
                    pid=info.pid,
                    used_memory_bytes=None if info.usedGpuMemory == _NOT_AVAILABLE_U64 else info.usedGpuMemory,
                    gpu_instance_id=None if info.gpuInstanceId == _NO_INSTANCE else info.gpuInstanceId,
                    compute_instance_id=None if info.computeInstanceId == _NO_INSTANCE else info.computeInstanceId,
                )
                for info in buffer[: count.value]
            ]
            handle.infos_seen[buffer_name] = (answer, infos)
            return list(infos)
        raise DeviceError(call, "INSUFFICIENT_SIZE", "the process list kept growing while it was read")

    def process_utilization(self, handle: Handle, since_us: int) -> list[ProcessSample]:
        call = "nvmlDeviceGetProcessUtilization"
        fn = _cached(call) or _function(call, call)
        count, since = handle.count, handle.since
        since.value = since_us
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
            if code != pynvml.NVML_SUCCESS:
                raise _error(call, code)
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
        fn = _cached(call) or _function(call, call)
        kind = _GPU_UTILIZATION_SAMPLES
        since, value_type, count = handle.since, handle.value_type, handle.count
        since.value, value_type.value = since_us, 0
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
            if code != pynvml.NVML_SUCCESS:
                raise _error(call, code)
            taken, value_kind = count.value, value_type.value
            if _LITTLE_ENDIAN and value_kind in _UNSIGNED_TYPES:
                # nvmlSample_t is two words, the time stamp and the value: read a column at a time
                # (a poll reads a sample a second of every GPU).
                if handle.words is None or handle.words[0] is not buffer:
                    in_bytes = memoryview(buffer).cast("B")
                    handle.words = (buffer, in_bytes.cast("Q"), in_bytes.cast("I"))
                _buffer, words, halves = handle.words
                # A 32-bit value is the low half of its word: the first, on a little-endian host.
                values = (words[1 : 2 * taken : 2] if value_kind in _WORD_TYPES else halves[2 : 4 * taken : 4]).tolist()
                return list(zip(words[0 : 2 * taken : 2].tolist(), map(float, values), strict=True))
            member = _VALUE_MEMBERS.get(value_kind, "uiVal")
            return [(s.timeStamp, float(getattr(s.sampleValue, member))) for s in buffer[:taken]]
        raise DeviceError(call, "INSUFFICIENT_SIZE", "the samples kept growing while they were read")
