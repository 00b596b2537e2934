"""The fake libnvidia-ml: C functions that fill ctypes arguments and return NVML return codes.

`pynvml` looks every function up with ``getattr(nvmlLib, name)``; `FakeNvmlLibrary` answers
with a callable that behaves like the C symbol: outputs are written into the ctypes objects
(or ``byref()`` wrappers) it is handed, and the result is an integer return code. A name the
node's driver does not have raises AttributeError, which pynvml turns into FunctionNotFound.

Device handles are ``c_nvmlDevice_t`` pointers whose value encodes the GPU and MIG instance,
so nothing has to be looked up in a table to know which device a handle names.
"""

from __future__ import annotations

import ctypes
import functools
import re
import struct
import sys
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fake_nvml.node import FakeNode
from fake_nvml.scenario import ERROR_CODES, MODEL_FACTS, Process

SUCCESS = 0
INVALID_ARGUMENT = ERROR_CODES["INVALID_ARGUMENT"]
NOT_SUPPORTED = ERROR_CODES["NOT_SUPPORTED"]
NOT_FOUND = ERROR_CODES["NOT_FOUND"]
INSUFFICIENT_SIZE = ERROR_CODES["INSUFFICIENT_SIZE"]
UNINITIALIZED = ERROR_CODES["UNINITIALIZED"]

_HANDLE_TAG = 0x6E760000  # "nv" in the high bytes: a handle this library made
_HANDLE_MASK = 0xFFFF0000
_DECODED_KEPT = 1024  # handle objects remembered (a node has a few dozen devices)

# Field ids (nvml.h) the fake answers in nvmlDeviceGetFieldValues, and the call each mirrors:
# a fault on the call hits the field too, as a sensor that is missing is missing either way.
FI_MEMORY_TEMP = 82
FI_TOTAL_ENERGY_CONSUMPTION = 83
FI_NVLINK_LINK_COUNT = 91
FI_NVLINK_GET_STATE = 165
FI_POWER_AVERAGE = 185
FI_POWER_INSTANT = 186
_FIELD_CALLS = {
    FI_POWER_AVERAGE: "nvmlDeviceGetPowerUsage",
    FI_TOTAL_ENERGY_CONSUMPTION: "nvmlDeviceGetTotalEnergyConsumption",
    FI_POWER_INSTANT: "nvmlDeviceGetPowerUsage",
    FI_NVLINK_GET_STATE: "nvmlDeviceGetNvLinkState",
    FI_NVLINK_LINK_COUNT: "nvmlDeviceGetNvLinkState",
    FI_MEMORY_TEMP: "nvmlDeviceGetTemperature",
}
_VALUE_TYPE_UINT = 1
_VALUE_TYPE_ULONGLONG = 3

# The driver branch that first shipped each versioned symbol (NVML API reference change log).
# A node whose driver is older does not have the symbol at all.
FUNCTION_SINCE_DRIVER: dict[str, int] = {
    "nvmlDeviceGetComputeRunningProcesses_v2": 470,
    "nvmlDeviceGetGraphicsRunningProcesses_v2": 470,
    "nvmlDeviceGetMPSComputeRunningProcesses_v2": 470,
    "nvmlDeviceGetComputeRunningProcesses_v3": 510,
    "nvmlDeviceGetGraphicsRunningProcesses_v3": 510,
    "nvmlDeviceGetMPSComputeRunningProcesses_v3": 510,
    "nvmlDeviceGetMemoryInfo_v2": 510,
    "nvmlDeviceGetTemperatureV": 565,
    # GPM: the R520 API reference has the group; the MIG sample call is first listed in R525's.
    "nvmlGpmQueryDeviceSupport": 520,
    "nvmlGpmSampleAlloc": 520,
    "nvmlGpmSampleFree": 520,
    "nvmlGpmSampleGet": 520,
    "nvmlGpmMetricsGet": 520,
    "nvmlGpmMigSampleGet": 525,
    # R535 renamed "clocks throttle reasons" to "clocks event reasons" (the old names remain).
    "nvmlDeviceGetCurrentClocksEventReasons": 535,
    "nvmlDeviceGetSupportedClocksEventReasons": 535,
}
# Fields newer than the field-values call itself (instant power arrived with the R530 fields,
# row remapping with R460, the per-link NVLink error fields scoped by link with R520).
FIELD_SINCE_DRIVER = {
    FI_POWER_AVERAGE: 530,
    FI_POWER_INSTANT: 530,
    **dict.fromkeys(range(142, 146), 460),
    **dict.fromkeys(range(161, 164), 520),
}

_VERSION_SUFFIX = re.compile(r"(_v\d+|V)$")


def family(name: str) -> str:
    """The unversioned name of a C function: nvmlDeviceGetMemoryInfo_v2 -> nvmlDeviceGetMemoryInfo."""
    return _VERSION_SUFFIX.sub("", name)


_FIELD_FAMILIES = {call: family(call) for call in _FIELD_CALLS.values()}


def _links_of(node: FakeNode, gpu: int, scope: int) -> range | int:
    """The links a link-scoped field names: one, or all of them (scope UINT_MAX); an NVML
    return code where there is no such link."""
    links = node.gpu(gpu).nvlink_links
    if links == 0:
        return NOT_SUPPORTED
    if scope == 0xFFFFFFFF:
        return range(links)
    return range(scope, scope + 1) if scope < links else INVALID_ARGUMENT


def _nvlink_error_field(kind: str, link: int | None) -> Callable[[FakeNode, int, int, float], Any]:
    """A field of one link's error count: `link` fixed by the field id (the R4xx per-link ids),
    or None for the field's scope (the R520 ids)."""

    def read(node: FakeNode, gpu: int, scope: int, t: float) -> Any:
        links = _links_of(node, gpu, scope if link is None else link)
        if isinstance(links, int):
            return links
        return _VALUE_TYPE_ULONGLONG, sum(node.health.nvlink_errors(gpu, n, kind, t) for n in links)

    return read


def _nvlink_traffic_field(overhead: float, receive: bool) -> Callable[[FakeNode, int, int, float], Any]:
    def read(node: FakeNode, gpu: int, scope: int, t: float) -> Any:
        links = _links_of(node, gpu, scope)
        if isinstance(links, int):
            return links
        return _VALUE_TYPE_ULONGLONG, round(sum(node.health.nvlink_kib(gpu, n, t, receive) for n in links) * overhead)

    return read


def _ecc_field(uncorrected: bool, aggregate: bool) -> Callable[[FakeNode, int, int, float], Any]:
    return lambda node, gpu, scope, t: (_VALUE_TYPE_ULONGLONG, node.health.ecc_errors(gpu, uncorrected, t, aggregate))


def _retired_field(which: int) -> Callable[[FakeNode, int, int, float], Any]:
    def read(node: FakeNode, gpu: int, scope: int, t: float) -> Any:
        retired = node.health.retired_pages(gpu, t)
        return NOT_SUPPORTED if retired is None else (_VALUE_TYPE_ULONGLONG, int(retired[which]))

    return read


def _remap_field(which: int) -> Callable[[FakeNode, int, int, float], Any]:
    def read(node: FakeNode, gpu: int, scope: int, t: float) -> Any:
        rows = node.health.remapped_rows(gpu, t)
        return NOT_SUPPORTED if rows is None else (_VALUE_TYPE_UINT, int(rows[which]))

    return read


def _violation_field(policy: int) -> Callable[[FakeNode, int, int, float], Any]:
    def read(node: FakeNode, gpu: int, scope: int, t: float) -> Any:
        ns = node.health.violation_ns(gpu, policy, t)
        return NOT_SUPPORTED if ns is None else (_VALUE_TYPE_ULONGLONG, ns)

    return read


# The health fields (nvml.h NVML_FI_DEV_*): field id -> (the call whose faults it shares, reader).
# A reader answers (value type, value) or an NVML return code.
_HEALTH_FIELDS: dict[int, tuple[str, Callable[[FakeNode, int, int, float], Any]]] = {
    3: ("nvmlDeviceGetTotalEccErrors", _ecc_field(False, False)),  # ECC_SBE_VOL_TOTAL
    4: ("nvmlDeviceGetTotalEccErrors", _ecc_field(True, False)),  # ECC_DBE_VOL_TOTAL
    5: ("nvmlDeviceGetTotalEccErrors", _ecc_field(False, True)),  # ECC_SBE_AGG_TOTAL
    6: ("nvmlDeviceGetTotalEccErrors", _ecc_field(True, True)),  # ECC_DBE_AGG_TOTAL
    29: ("nvmlDeviceGetRetiredPages", _retired_field(0)),  # RETIRED_SBE
    30: ("nvmlDeviceGetRetiredPages", _retired_field(1)),  # RETIRED_DBE
    31: ("nvmlDeviceGetRetiredPages", _retired_field(2)),  # RETIRED_PENDING
    **{
        base + n: ("nvmlDeviceGetNvLinkErrorCounter", _nvlink_error_field(kind, first + n))
        for kind, ranges in (
            ("crc", ((32, 0), (96, 6))),
            ("replay", ((46, 0), (108, 6))),
            ("recovery", ((53, 0), (114, 6))),
        )
        for base, first in ranges
        for n in range(6)
    },
    **{
        74 + i: ("nvmlDeviceGetViolationStatus", _violation_field(policy))  # PERF_POLICY_*
        for i, policy in enumerate((0, 1, 2, 3, 4, 5, 10, 11))
    },
    94: (
        "nvmlDeviceGetPcieReplayCounter",
        lambda node, gpu, scope, t: (_VALUE_TYPE_UINT, node.health.pcie_replays(gpu, t)),
    ),
    # NVLINK_THROUGHPUT_DATA_TX/RX and RAW_TX/RX (data plus protocol overhead), KiB, per link.
    138: ("nvmlDeviceGetFieldValues", _nvlink_traffic_field(1.0, receive=False)),
    139: ("nvmlDeviceGetFieldValues", _nvlink_traffic_field(1.0, receive=True)),
    140: ("nvmlDeviceGetFieldValues", _nvlink_traffic_field(1.1, receive=False)),
    141: ("nvmlDeviceGetFieldValues", _nvlink_traffic_field(1.1, receive=True)),
    142: ("nvmlDeviceGetRemappedRows", _remap_field(0)),  # REMAPPED_COR
    143: ("nvmlDeviceGetRemappedRows", _remap_field(1)),  # REMAPPED_UNC
    144: ("nvmlDeviceGetRemappedRows", _remap_field(2)),  # REMAPPED_PENDING
    145: ("nvmlDeviceGetRemappedRows", _remap_field(3)),  # REMAPPED_FAILURE
    161: ("nvmlDeviceGetNvLinkErrorCounter", _nvlink_error_field("replay", None)),  # NVLINK_ERROR_DL_REPLAY
    162: ("nvmlDeviceGetNvLinkErrorCounter", _nvlink_error_field("recovery", None)),  # .._DL_RECOVERY
    163: ("nvmlDeviceGetNvLinkErrorCounter", _nvlink_error_field("crc", None)),  # .._DL_CRC
}
_HEALTH_FAMILIES = {call: family(call) for call, _read in _HEALTH_FIELDS.values()}


def _obj(arg: Any) -> Any:
    """The ctypes object behind a ``byref()`` wrapper, or the argument itself."""
    return getattr(arg, "_obj", arg)


def _int(arg: Any) -> int:
    return int(getattr(arg, "value", arg))


def _write_str(buf: Any, length: Any, text: str) -> int:
    data = text.encode()
    if len(data) + 1 > _int(length):
        return INSUFFICIENT_SIZE
    buf.value = data
    return SUCCESS


@dataclass(frozen=True)
class Dev:
    gpu: int
    mig: int | None


@dataclass(frozen=True)
class _Spec:
    impl: Callable[..., Any]
    takes_device: bool


_REGISTRY: dict[str, _Spec] = {}


def _c(name: str, *, device: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(impl: Callable[..., Any]) -> Callable[..., Any]:
        _REGISTRY[name] = _Spec(impl, device)
        return impl

    return register


def implemented_functions() -> list[str]:
    return sorted(_REGISTRY)


class _CallState:
    """What every C function reads first: how many nvmlInit calls are not yet shut down, and the
    instant the host files were last synced to. Kept off the library, whose `__getattr__` (the
    symbol lookup) sends every attribute read on it down the interpreter's unspecialised path."""

    __slots__ = ("initialised", "synced_at")

    def __init__(self) -> None:
        self.initialised = 0
        self.synced_at: float | None = None


class FakeNvmlLibrary:
    """Stands where pynvml keeps its loaded ``CDLL``; attributes are the C symbols."""

    def __init__(self, node: FakeNode) -> None:
        self._node = node
        self._lock = threading.Lock()
        self._state = _CallState()
        self.missing_lookups: Counter[str] = Counter()
        major = int(node.scenario.node.driver_version.split(".")[0])
        self._driver_major = major
        self._hidden = set(node.scenario.node.missing_functions)
        self._hidden.update(n for n, since in FUNCTION_SINCE_DRIVER.items() if major < since)
        self._fields_hidden = {f for f, since in FIELD_SINCE_DRIVER.items() if major < since}
        self._devices: dict[int, Dev | None] = {}
        self._decoded: dict[int, tuple[Any, Dev | None]] = {}  # id(handle) -> (handle, device)
        # How each batch of fields is answered on each device (see _field_plan).
        self._field_plans: dict[tuple[int, int | None, bytes], list[_FieldGroup]] = {}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        spec = _REGISTRY.get(name)
        if spec is None or name in self._hidden:
            self.missing_lookups[name] += 1
            raise AttributeError(name)
        bound = self._make_symbol(name, spec)
        # Cache on the instance so the next lookup skips __getattr__, as dlsym's result would be.
        self.__dict__[name] = bound
        return bound

    def _make_symbol(self, name: str, spec: _Spec) -> Callable[..., Any]:
        if spec.takes_device:
            return self._device_symbol(name, spec.impl)
        node = self._node
        fam = family(name)
        impl = spec.impl
        calls = node.calls
        now = node.clock.now
        sync_host = node.sync_host
        state = self._state
        needs_init = name not in ("nvmlInit_v2", "nvmlInitWithFlags", "nvmlInit")
        # Node-wide faults that can touch this call, found once: the scenario's faults are fixed.
        node_errors, node_latencies = node.faults_for(name, fam, None)

        def symbol(*args: Any) -> Any:
            calls[name] += 1
            t = now()
            # Host files depend on scenario time alone: one sync per instant is enough, and a
            # poll makes dozens of calls at the same instant.
            if t != state.synced_at:
                sync_host(t)
                state.synced_at = t
            if node_latencies:
                latency = node.call_latency_s(name, fam, None, t)
                if latency:
                    time.sleep(latency)
            if name == "nvmlErrorString":
                return impl(self, t, *args)
            if needs_init and not state.initialised:
                return UNINITIALIZED
            if node_errors:
                error = node.fault_error(name, fam, None, t)
                if error is not None:
                    return ERROR_CODES[error]
            return impl(self, t, *args)

        symbol.__name__ = name
        return symbol

    def _device_symbol(self, name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
        """The symbol of a C function whose first argument is a device handle: the node-level
        symbol's steps, then the device's own faults, found per GPU when the symbol is made
        rather than at each call (a poll makes about ten of these calls per GPU)."""
        node = self._node
        fam = family(name)
        calls = node.calls
        now = node.clock.now
        sync_host = node.sync_host
        state = self._state
        decoded, decode = self._decoded, self._decode
        node_latencies = node.faults_for(name, fam, None)[1]
        # (error faults, latency faults) that can touch this call, per GPU.
        gpu_faults = [node.faults_for(name, fam, gpu) for gpu in range(len(node.scenario.gpus))]

        def symbol(*args: Any) -> Any:
            calls[name] += 1
            t = now()
            if t != state.synced_at:
                sync_host(t)
                state.synced_at = t
            if node_latencies:
                latency = node.call_latency_s(name, fam, None, t)
                if latency:
                    time.sleep(latency)
            if not state.initialised:
                return UNINITIALIZED
            handle = args[0]
            known = decoded.get(id(handle))  # `_decode`'s first step, inline
            dev = known[1] if known is not None and known[0] is handle else decode(handle)
            if dev is None:
                return INVALID_ARGUMENT
            gpu = dev.gpu
            errors, latencies = gpu_faults[gpu]
            if latencies:
                latency = node.call_latency_s(name, fam, gpu, t)
                if latency:
                    time.sleep(latency)
            if errors:
                error = node.fault_error(name, fam, gpu, t)
                if error is not None:
                    return ERROR_CODES[error]
            return impl(self, t, dev, *args[1:])

        def unfaulted(handle: Any, *args: Any) -> Any:
            # `symbol` for a call no fault of the scenario can touch on any GPU (every call, on
            # most scenarios): the same steps, less the fault checks, which cost about as much as
            # the rest of them, and a poll makes about ten of these calls per GPU.
            calls[name] += 1
            t = now()
            if t != state.synced_at:
                sync_host(t)
                state.synced_at = t
            if not state.initialised:
                return UNINITIALIZED
            known = decoded.get(id(handle))
            dev = known[1] if known is not None and known[0] is handle else decode(handle)
            if dev is None:
                return INVALID_ARGUMENT
            return impl(self, t, dev, *args)

        made = symbol if node_latencies or any(errors or latencies for errors, latencies in gpu_faults) else unfaulted
        made.__name__ = name
        return made

    def _quiet_links(self, gpu: int) -> bool:
        """Whether the GPU's NVLink error counters are zeros at all times: no fault gives its
        links errors and no recorded row gives their counts (`nvlink_errors_all`'s shortcut,
        which holds for the node's life, as its faults and rows are fixed)."""
        node = self._node
        return not node.health._nvlink_error_faults[gpu] and not node._rows[gpu][1]

    def _links_up(self, gpu: int) -> bool:
        """Whether every NVLink of the GPU is up at all times: no fault of its takes a link down
        and no recorded row says one is (the only ways `GpuState.nvlinks_down` gets a link)."""
        node = self._node
        return not node._nvlink_faults.get(gpu) and not node._rows[gpu][1]

    # -- handles ------------------------------------------------------------------------------

    def _decode(self, handle: Any) -> Dev | None:
        # The handles a caller keeps are asked about on every call: known by identity (the
        # object is held, so its id is not reused) until a handle lookup writes into one.
        known = self._decoded.get(id(handle))
        if known is not None and known[0] is handle:
            return known[1]
        dev = self._decode_handle(handle)
        if isinstance(handle, ctypes._Pointer):
            if len(self._decoded) >= _DECODED_KEPT:
                self._decoded.clear()
            self._decoded[id(handle)] = (handle, dev)
        return dev

    def _decode_handle(self, handle: Any) -> Dev | None:
        if isinstance(handle, ctypes._Pointer):
            # A pointer's bytes are its address: read them rather than cast, which costs five
            # times as much, and every device call decodes its handle.
            value: int | None = int.from_bytes(bytes(handle), sys.byteorder) or None
        else:
            value = ctypes.cast(handle, ctypes.c_void_p).value if handle is not None else None
        if value is None:
            return None
        # A handle names the same device for the node's whole life: decode each value once.
        if value not in self._devices:
            self._devices[value] = self._decode_value(value)
        return self._devices[value]

    def _decode_value(self, value: int) -> Dev | None:
        if value & _HANDLE_MASK != _HANDLE_TAG:
            return None
        gpu = ((value >> 8) & 0xFF) - 1
        mig_code = value & 0xFF
        gpus = self._node.scenario.gpus
        if not 0 <= gpu < len(gpus):
            return None
        mig = mig_code - 1 if mig_code else None
        if mig is not None and mig >= len(gpus[gpu].mig):
            return None
        return Dev(gpu, mig)

    def _store_handle(self, out: Any, gpu: int, mig: int | None = None) -> None:
        value = _HANDLE_TAG | ((gpu + 1) << 8) | (0 if mig is None else mig + 1)
        handle = _obj(out)
        ctypes.c_void_p.from_buffer(handle).value = value
        self._decoded.pop(id(handle), None)


# ---------------------------------------------------------------------------------------------
# Library and system
# ---------------------------------------------------------------------------------------------


@_c("nvmlInit_v2", device=False)
@_c("nvmlInitWithFlags", device=False)
def _init(lib: FakeNvmlLibrary, t: float, *flags: Any) -> int:
    error = lib._node.fault_error("nvmlInit_v2", "nvmlInit", None, t)
    if error is not None:
        return ERROR_CODES[error]
    with lib._lock:
        lib._state.initialised += 1
    return SUCCESS


@_c("nvmlShutdown", device=False)
def _shutdown(lib: FakeNvmlLibrary, t: float) -> int:
    with lib._lock:
        lib._state.initialised = max(0, lib._state.initialised - 1)
    return SUCCESS


@_c("nvmlErrorString", device=False)
def _error_string(lib: FakeNvmlLibrary, t: float, result: Any) -> bytes:
    code = _int(result)
    for name, value in ERROR_CODES.items():
        if value == code:
            return name.replace("_", " ").capitalize().encode()
    return b"Success" if code == SUCCESS else b"Unknown Error"


@_c("nvmlSystemGetDriverVersion", device=False)
def _driver_version(lib: FakeNvmlLibrary, t: float, buf: Any, length: Any) -> int:
    return _write_str(buf, length, lib._node.scenario.node.driver_version)


@_c("nvmlSystemGetNVMLVersion", device=False)
def _nvml_version(lib: FakeNvmlLibrary, t: float, buf: Any, length: Any) -> int:
    cuda = lib._node.scenario.node.cuda_driver_version
    return _write_str(buf, length, f"{cuda // 1000}.{lib._node.scenario.node.driver_version}")


@_c("nvmlSystemGetCudaDriverVersion", device=False)
@_c("nvmlSystemGetCudaDriverVersion_v2", device=False)
def _cuda_version(lib: FakeNvmlLibrary, t: float, out: Any) -> int:
    _obj(out).value = lib._node.scenario.node.cuda_driver_version
    return SUCCESS


@_c("nvmlSystemGetProcessName", device=False)
def _process_name(lib: FakeNvmlLibrary, t: float, pid: Any, buf: Any, length: Any) -> int:
    for process in lib._node.scenario.processes:
        if process.pid == _int(pid) and process.running_at(t):
            return _write_str(buf, length, process.cmdline.split(" ")[0])
    return NOT_FOUND


@_c("nvmlDeviceGetCount_v2", device=False)
def _count(lib: FakeNvmlLibrary, t: float, out: Any) -> int:
    _obj(out).value = len(lib._node.scenario.gpus)
    return SUCCESS


@_c("nvmlDeviceGetHandleByIndex_v2", device=False)
def _handle_by_index(lib: FakeNvmlLibrary, t: float, index: Any, out: Any) -> int:
    i = _int(index)
    if not 0 <= i < len(lib._node.scenario.gpus):
        return INVALID_ARGUMENT
    error = lib._node.fault_error("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex", i, t)
    if error is not None:
        return ERROR_CODES[error]
    lib._store_handle(out, i)
    return SUCCESS


def _find_by(lib: FakeNvmlLibrary, t: float, out: Any, match: Callable[[int], bool]) -> int:
    for gpu in lib._node.scenario.gpus:
        if match(gpu.index):
            error = lib._node.fault_error("nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByUUID", gpu.index, t)
            if error is not None:
                return ERROR_CODES[error]
            lib._store_handle(out, gpu.index)
            return SUCCESS
    return NOT_FOUND


@_c("nvmlDeviceGetHandleByUUID", device=False)
def _handle_by_uuid(lib: FakeNvmlLibrary, t: float, uuid: Any, out: Any) -> int:
    wanted = _obj(uuid).value
    gpus = lib._node.scenario.gpus
    for gpu in gpus:
        for j, mig in enumerate(gpu.mig):
            if mig.uuid.encode() == wanted:
                lib._store_handle(out, gpu.index, j)
                return SUCCESS
    return _find_by(lib, t, out, lambda i: gpus[i].uuid.encode() == wanted)


@_c("nvmlDeviceGetHandleByPciBusId_v2", device=False)
def _handle_by_pci(lib: FakeNvmlLibrary, t: float, bus_id: Any, out: Any) -> int:
    wanted = (_obj(bus_id).value or b"").decode().upper()
    gpus = lib._node.scenario.gpus
    return _find_by(lib, t, out, lambda i: gpus[i].pci_bus_id == wanted)


# ---------------------------------------------------------------------------------------------
# Identity
# ---------------------------------------------------------------------------------------------


@_c("nvmlDeviceGetName")
def _name(lib: FakeNvmlLibrary, t: float, dev: Dev, buf: Any, length: Any) -> int:
    gpu = lib._node.gpu(dev.gpu)
    name = gpu.name if dev.mig is None else f"{gpu.name} MIG {gpu.mig[dev.mig].profile}"
    return _write_str(buf, length, name)


@_c("nvmlDeviceGetUUID")
def _uuid(lib: FakeNvmlLibrary, t: float, dev: Dev, buf: Any, length: Any) -> int:
    gpu = lib._node.gpu(dev.gpu)
    return _write_str(buf, length, gpu.uuid if dev.mig is None else gpu.mig[dev.mig].uuid)


@_c("nvmlDeviceGetSerial")
def _serial(lib: FakeNvmlLibrary, t: float, dev: Dev, buf: Any, length: Any) -> int:
    return _write_str(buf, length, f"13240{dev.gpu:08d}")


@_c("nvmlDeviceGetIndex")
def _index(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = dev.gpu
    return SUCCESS


@_c("nvmlDeviceGetMinorNumber")
def _minor(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = lib._node.gpu(dev.gpu).minor
    return SUCCESS


@_c("nvmlDeviceGetBrand")
def _brand(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = 14  # NVML_BRAND_NVIDIA
    return SUCCESS


@_c("nvmlDeviceGetArchitecture")
def _architecture(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    model = lib._node.gpu(dev.gpu).model
    arch = {"A": 7, "H": 9, "B": 10, "L": 8, "T": 4}.get(model[:1], 7)  # NVML_DEVICE_ARCH_*
    _obj(out).value = arch
    return SUCCESS


@_c("nvmlDeviceGetCudaComputeCapability")
def _compute_capability(lib: FakeNvmlLibrary, t: float, dev: Dev, major: Any, minor: Any) -> int:
    model = lib._node.gpu(dev.gpu).model
    cc = {"A": (8, 0), "H": (9, 0), "B": (10, 0), "L": (8, 9), "T": (7, 5)}.get(model[:1], (8, 0))
    _obj(major).value, _obj(minor).value = cc
    return SUCCESS


@_c("nvmlDeviceGetPciInfo_v3")
def _pci_info(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    gpu = lib._node.gpu(dev.gpu)
    info = _obj(out)
    bus = int(gpu.pci_bus_id.split(":")[1], 16)
    info.busIdLegacy = gpu.pci_bus_id[4:].encode()
    info.busId = gpu.pci_bus_id.encode()
    info.domain = 0
    info.bus = bus
    info.device = 0
    info.pciDeviceId = gpu.pci_device_id
    info.pciSubSystemId = 0x147E10DE
    return SUCCESS


@_c("nvmlDeviceGetPersistenceMode")
def _persistence(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = 1
    return SUCCESS


@_c("nvmlDeviceGetComputeMode")
def _compute_mode(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = 0  # NVML_COMPUTEMODE_DEFAULT
    return SUCCESS


@_c("nvmlDeviceGetDisplayActive")
@_c("nvmlDeviceGetDisplayMode")
def _display(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = 0
    return SUCCESS


@_c("nvmlDeviceGetAttributes_v2")
def _attributes(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    gpu = lib._node.gpu(dev.gpu)
    attrs = _obj(out)
    if dev.mig is None:
        attrs.multiprocessorCount = gpu.sm_count
        attrs.gpuInstanceSliceCount = 7 if gpu.mig else 0
        attrs.computeInstanceSliceCount = 7 if gpu.mig else 0
        attrs.memorySizeMB = gpu.memory_total_mib
    else:
        mig = gpu.mig[dev.mig]
        attrs.multiprocessorCount = mig.sm_count
        attrs.gpuInstanceSliceCount = mig.slices
        attrs.computeInstanceSliceCount = mig.slices
        attrs.memorySizeMB = mig.memory_total_mib
    return SUCCESS


# ---------------------------------------------------------------------------------------------
# MIG
# ---------------------------------------------------------------------------------------------


@_c("nvmlDeviceGetMigMode")
def _mig_mode(lib: FakeNvmlLibrary, t: float, dev: Dev, current: Any, pending: Any) -> int:
    if dev.mig is not None:
        return INVALID_ARGUMENT
    gpu = lib._node.gpu(dev.gpu)
    facts = MODEL_FACTS.get(gpu.model)
    if facts is not None and facts.mig_slices == 0:
        return NOT_SUPPORTED
    mode = 1 if gpu.mig else 0
    _obj(current).value = mode
    _obj(pending).value = mode
    return SUCCESS


@_c("nvmlDeviceIsMigDeviceHandle")
def _is_mig(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = 1 if dev.mig is not None else 0
    return SUCCESS


@_c("nvmlDeviceGetMaxMigDeviceCount")
def _max_mig(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    if dev.mig is not None:
        return INVALID_ARGUMENT
    gpu = lib._node.gpu(dev.gpu)
    _obj(out).value = 7 if gpu.mig else 0
    return SUCCESS


@_c("nvmlDeviceGetMigDeviceHandleByIndex")
def _mig_handle(lib: FakeNvmlLibrary, t: float, dev: Dev, index: Any, out: Any) -> int:
    gpu = lib._node.gpu(dev.gpu)
    i = _int(index)
    if dev.mig is not None or not gpu.mig:
        return INVALID_ARGUMENT
    if i >= 7:
        return INVALID_ARGUMENT
    if i >= len(gpu.mig):
        return NOT_FOUND
    lib._store_handle(out, dev.gpu, i)
    return SUCCESS


@_c("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
def _parent_handle(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    if dev.mig is None:
        return INVALID_ARGUMENT
    lib._store_handle(out, dev.gpu)
    return SUCCESS


@_c("nvmlDeviceGetGpuInstanceId")
def _gi_id(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    if dev.mig is None:
        return INVALID_ARGUMENT
    _obj(out).value = lib._node.gpu(dev.gpu).mig[dev.mig].gpu_instance_id
    return SUCCESS


@_c("nvmlDeviceGetComputeInstanceId")
def _ci_id(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    if dev.mig is None:
        return INVALID_ARGUMENT
    _obj(out).value = 0
    return SUCCESS


# ---------------------------------------------------------------------------------------------
# Readings
# ---------------------------------------------------------------------------------------------


@_c("nvmlDeviceGetUtilizationRates")
def _utilization(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    # As on real drivers, neither a MIG-enabled GPU nor its instances report utilization.
    node = lib._node
    if node.gpu(dev.gpu).mig:
        return NOT_SUPPORTED
    util = _obj(out)
    util.gpu = round(node.state(dev.gpu, t).utilization)
    util.memory = node.health.memory_utilization_percent(dev.gpu, t)
    return SUCCESS


def _codec_utilization(lib: FakeNvmlLibrary, t: float, dev: Dev, util: Any, period: Any, encoder: bool) -> int:
    # A MIG-enabled GPU reports no engine utilization, as for the GPU's own.
    if dev.mig is not None or lib._node.gpu(dev.gpu).mig:
        return NOT_SUPPORTED
    _obj(util).value = lib._node.health.codec_percent(dev.gpu, t, encoder)
    _obj(period).value = 167000
    return SUCCESS


@_c("nvmlDeviceGetEncoderUtilization")
def _encoder_utilization(lib: FakeNvmlLibrary, t: float, dev: Dev, util: Any, period: Any) -> int:
    return _codec_utilization(lib, t, dev, util, period, encoder=True)


@_c("nvmlDeviceGetDecoderUtilization")
def _decoder_utilization(lib: FakeNvmlLibrary, t: float, dev: Dev, util: Any, period: Any) -> int:
    return _codec_utilization(lib, t, dev, util, period, encoder=False)


def _memory_bytes(lib: FakeNvmlLibrary, dev: Dev, t: float) -> tuple[int, int]:
    gpu = lib._node.gpu(dev.gpu)
    total_mib = gpu.memory_total_mib if dev.mig is None else gpu.mig[dev.mig].memory_total_mib
    total = total_mib * 2**20
    return total, min(total, lib._node.memory_used_bytes(dev.gpu, dev.mig, t))


@_c("nvmlDeviceGetMemoryInfo")
@_c("nvmlDeviceGetMemoryInfo_v2")
def _memory(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    total, used = _memory_bytes(lib, dev, t)
    memory = _obj(out)
    free = total - used
    # A recorded row's free figure: the recorded driver's reservation is in neither used nor free.
    row = lib._node.reading_row(dev.gpu, t) if dev.mig is None else None
    if row is not None and row.memory_free_bytes is not None:
        free = max(0, min(free, row.memory_free_bytes))
    if hasattr(memory, "version"):
        # The v2 struct separates the driver's reservation from what processes use.
        memory.reserved = total - used - free
    memory.total = total
    memory.used = used
    memory.free = free
    return SUCCESS


@_c("nvmlDeviceGetBAR1MemoryInfo")
def _bar1(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    bar1 = _obj(out)
    bar1.bar1Total = 128 * 2**30
    bar1.bar1Used = 2**21
    bar1.bar1Free = bar1.bar1Total - bar1.bar1Used
    return SUCCESS


def _gpu_only(dev: Dev) -> int:
    return NOT_SUPPORTED if dev.mig is not None else SUCCESS


@_c("nvmlDeviceGetTemperature")
def _temperature(lib: FakeNvmlLibrary, t: float, dev: Dev, sensor: Any, out: Any) -> int:
    if _gpu_only(dev) or _int(sensor) != 0:
        return NOT_SUPPORTED if dev.mig is not None else INVALID_ARGUMENT
    _obj(out).value = round(lib._node.temperature_c(dev.gpu, t))
    return SUCCESS


@_c("nvmlDeviceGetTemperatureV")
def _temperature_v(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    reading = _obj(out)
    if dev.mig is not None:
        return NOT_SUPPORTED
    if reading.sensorType != 0:
        return INVALID_ARGUMENT
    reading.temperature = round(lib._node.temperature_c(dev.gpu, t))
    return SUCCESS


@_c("nvmlDeviceGetTemperatureThreshold")
def _temperature_threshold(lib: FakeNvmlLibrary, t: float, dev: Dev, which: Any, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    # shutdown, slowdown, mem max, gpu max
    table = {0: 92, 1: 89, 2: 95, 3: 87}
    if _int(which) not in table:
        return NOT_SUPPORTED
    _obj(out).value = table[_int(which)]
    return SUCCESS


@_c("nvmlDeviceGetFanSpeed")
@_c("nvmlDeviceGetFanSpeed_v2")
def _fan(lib: FakeNvmlLibrary, t: float, dev: Dev, *args: Any) -> int:
    # Data-centre boards are passively cooled: the driver has no fan to read.
    percent = lib._node.health.fan_percent(dev.gpu, t) if dev.mig is None else None
    if percent is None:
        return NOT_SUPPORTED
    if len(args) == 2 and _int(args[0]) >= lib._node.health.board(dev.gpu).fans:  # _v2(fan, out)
        return INVALID_ARGUMENT
    _obj(args[-1]).value = percent
    return SUCCESS


@_c("nvmlDeviceGetNumFans")
def _num_fans(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = lib._node.health.board(dev.gpu).fans
    return SUCCESS


def power_averaged(model: str) -> bool:
    """Whether the board reports power averaged over a second (NVML_FI_DEV_POWER_AVERAGE, and
    nvmlDeviceGetPowerUsage): Ampere on, except GA100 (A100, A30), which, like the GPUs before
    Ampere (V100, T4), reports the instant power. Grace Hopper and Grace Blackwell (GH200, GB200)
    are Hopper and Blackwell, as for GPM (fake_nvml.gpm.gpm_supported)."""
    return model[:1] in ("H", "B", "L", "G") or (model[:1] == "A" and not model.startswith(("A100", "A30")))


@_c("nvmlDeviceGetPowerUsage")
def _power(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    node = lib._node
    watts = node.power_average_w(dev.gpu, t) if power_averaged(node.gpu(dev.gpu).model) else node.power_w(dev.gpu, t)
    _obj(out).value = round(watts * 1000)
    return SUCCESS


@_c("nvmlDeviceGetEnforcedPowerLimit")
@_c("nvmlDeviceGetPowerManagementLimit")
@_c("nvmlDeviceGetPowerManagementDefaultLimit")
def _power_limit(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    _obj(out).value = round(lib._node.gpu(dev.gpu).power_limit_w * 1000)
    return SUCCESS


@_c("nvmlDeviceGetPowerManagementLimitConstraints")
def _power_constraints(lib: FakeNvmlLibrary, t: float, dev: Dev, low: Any, high: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    gpu = lib._node.gpu(dev.gpu)
    _obj(low).value = round(gpu.idle_power_w * 2 * 1000)
    _obj(high).value = round(gpu.power_limit_w * 1000)
    return SUCCESS


@_c("nvmlDeviceGetPowerState")
@_c("nvmlDeviceGetPerformanceState")
def _pstate(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    _obj(out).value = lib._node.health.performance_state(dev.gpu, t)
    return SUCCESS


@_c("nvmlDeviceGetTotalEnergyConsumption")
def _energy(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    _obj(out).value = lib._node.energy_mj(dev.gpu, t)
    return SUCCESS


_CLOCK_GRAPHICS, _CLOCK_SM, _CLOCK_MEM, _CLOCK_VIDEO = 0, 1, 2, 3


@_c("nvmlDeviceGetClockInfo")
def _clock(lib: FakeNvmlLibrary, t: float, dev: Dev, which: Any, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    health, kind = lib._node.health, _int(which)
    if kind in (_CLOCK_GRAPHICS, _CLOCK_SM):
        mhz = health.sm_clock_mhz(dev.gpu, t)
    elif kind == _CLOCK_MEM:
        mhz = health.memory_clock_mhz(dev.gpu, t)
    elif kind == _CLOCK_VIDEO:
        mhz = round(health.sm_clock_mhz(dev.gpu, t) * 0.9)
    else:
        return INVALID_ARGUMENT
    _obj(out).value = mhz
    return SUCCESS


@_c("nvmlDeviceGetMaxClockInfo")
def _max_clock(lib: FakeNvmlLibrary, t: float, dev: Dev, which: Any, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    sm, memory = lib._node.health.clock_max_mhz(dev.gpu, t)
    kind = _int(which)
    table = {_CLOCK_GRAPHICS: sm, _CLOCK_SM: sm, _CLOCK_MEM: memory, _CLOCK_VIDEO: round(sm * 0.9)}
    if kind not in table:
        return INVALID_ARGUMENT
    _obj(out).value = table[kind]
    return SUCCESS


@_c("nvmlDeviceGetSupportedMemoryClocks")
def _supported_memory_clocks(lib: FakeNvmlLibrary, t: float, dev: Dev, count: Any, clocks: Any) -> int:
    """nvmlReturn_t (device, unsigned int *count, unsigned int *clocksMHz): `count` holds the
    room in `clocksMHz` and is set to the clocks the device has; too little room answers
    INSUFFICIENT_SIZE, filling nothing. A MIG device has no clocks of its own."""
    if dev.mig is not None:
        return NOT_SUPPORTED
    if count is None:
        return INVALID_ARGUMENT
    supported = lib._node.health.memory_clocks_mhz(dev.gpu, t)
    counter = _obj(count)
    room = counter.value
    counter.value = len(supported)
    if room < len(supported):
        return INSUFFICIENT_SIZE
    if clocks is None and supported:
        return INVALID_ARGUMENT  # room claimed for clocks, and nowhere to write them
    array = _obj(clocks)
    for i, mhz in enumerate(supported):
        array[i] = mhz
    return SUCCESS


@_c("nvmlDeviceGetNvLinkState")
def _nvlink_state(lib: FakeNvmlLibrary, t: float, dev: Dev, link: Any, out: Any) -> int:
    gpu = lib._node.gpu(dev.gpu)
    if dev.mig is not None or gpu.nvlink_links == 0:
        return NOT_SUPPORTED
    n = _int(link)
    if n >= gpu.nvlink_links:
        return INVALID_ARGUMENT
    _obj(out).value = 1 if lib._node.nvlink_up(dev.gpu, n, t) else 0
    return SUCCESS


# c_nvmlFieldValue_t is five 64-bit words: fieldId and scopeId, timestamp, latencyUsec,
# valueType and nvmlReturn, and the value union (a test holds this to pynvml's layout). A batch
# is read and written a word column at a time through a memoryview: dozens of fields per GPU
# every poll, and five ctypes attribute accesses per field cost more than the rest.
_FIELD_WORDS = 5
_LITTLE = sys.byteorder == "little"
_LOW32 = 0xFFFFFFFF
# A batch seen as 32-bit halves too (ten a field): nvmlReturn is the second half of word 3, and
# uiVal the first of word 4, in memory order on any byte order. Writing a half alone leaves the
# other as the caller had it, as the driver's 4-byte writes do.
_RETURN_HALF = 3 * 2 + 1
_UINT_HALF = 4 * 2


def _pair(first: int, second: int) -> int:
    """Two consecutive uint32 fields (fieldId and scopeId, valueType and nvmlReturn) as the
    word they make up."""
    return first | second << 32 if _LITTLE else first << 32 | second


# The (valueType, nvmlReturn) word of a field answered with each value type the fake gives.
_SUCCEEDED = {value_type: _pair(value_type, SUCCESS) for value_type in (_VALUE_TYPE_UINT, _VALUE_TYPE_ULONGLONG)}
_LOW64 = 0xFFFFFFFFFFFFFFFF


def _first(word: int) -> int:
    return word & _LOW32 if _LITTLE else word >> 32


def _second(word: int) -> int:
    return word >> 32 if _LITTLE else word & _LOW32


# A field's answer: (value type, value), or an NVML return code.
_Answer = tuple[int, int] | int
# The answers to one field id asked for several scopes: one return code for all of them, one
# value type with a value for each, or an answer each.
_Answers = int | tuple[int, list[int]] | list[_Answer]
# Answers one field id for each of the scopes given, at t: (node, gpu, scopes, t) -> answers.
_ManyReader = Callable[[FakeNode, int, tuple[int, ...], float], _Answers]


def _each(read: Callable[[FakeNode, int, int, float], Any]) -> _ManyReader:
    """A reader of one field and scope as a reader of many scopes."""

    def many(node: FakeNode, gpu: int, scopes: tuple[int, ...], t: float) -> _Answers:
        return [read(node, gpu, scope, t) for scope in scopes]

    _ONE_FIELD_READERS[many] = read
    return many


# The readers `_each` made, and the one-field reader behind each.
_ONE_FIELD_READERS: dict[_ManyReader, Callable[[FakeNode, int, int, float], Any]] = {}


def _per_link(counts: Callable[[FakeNode, int, float], tuple[int, ...]], overhead: float = 1.0) -> _ManyReader:
    """A link-scoped field of 64-bit counts for many scopes, from every link's count at t (a
    batch asks for each link, both ways): a link each, or all of them summed (UINT_MAX)."""

    def read(node: FakeNode, gpu: int, scopes: tuple[int, ...], t: float) -> _Answers:
        links = node.gpu(gpu).nvlink_links
        if links == 0:
            return NOT_SUPPORTED
        found = counts(node, gpu, t)
        if max(scopes) < links:
            if overhead == 1.0:  # whole counts as they are (round(n * 1.0) is n)
                return _VALUE_TYPE_ULONGLONG, list(map(found.__getitem__, scopes))
            return _VALUE_TYPE_ULONGLONG, [round(found[scope] * overhead) for scope in scopes]
        return [
            (_VALUE_TYPE_ULONGLONG, round((found[scope] if scope < links else sum(found)) * overhead))
            if scope < links or scope == 0xFFFFFFFF
            else INVALID_ARGUMENT
            for scope in scopes
        ]

    return read


def _nvlink_kib_tx(node: FakeNode, gpu: int, t: float) -> tuple[int, ...]:
    return node.health.nvlink_kib_all(gpu, t)


def _nvlink_kib_rx(node: FakeNode, gpu: int, t: float) -> tuple[int, ...]:
    return node.health.nvlink_kib_all(gpu, t, receive=True)


def _nvlink_errors(kind: str) -> Callable[[FakeNode, int, float], tuple[int, ...]]:
    return lambda node, gpu, t: node.health.nvlink_errors_all(gpu, kind, t)


def _nvlink_state_many(node: FakeNode, gpu: int, scopes: tuple[int, ...], t: float) -> _Answers:
    links = node.gpu(gpu).nvlink_links
    if links == 0:
        return NOT_SUPPORTED
    down = node.nvlinks_down(gpu, t)
    if max(scopes) < links:
        return _VALUE_TYPE_UINT, [0 if scope in down else 1 for scope in scopes]
    return [(_VALUE_TYPE_UINT, 0 if scope in down else 1) if scope < links else INVALID_ARGUMENT for scope in scopes]


def _power_many(node: FakeNode, gpu: int, scopes: tuple[int, ...], t: float) -> _Answers:
    return _VALUE_TYPE_UINT, [round(node.power_w(gpu, t) * 1000)] * len(scopes)


def _power_average_many(node: FakeNode, gpu: int, scopes: tuple[int, ...], t: float) -> _Answers:
    if not power_averaged(node.gpu(gpu).model):
        return [NOT_SUPPORTED] * len(scopes)
    return _VALUE_TYPE_UINT, [round(node.power_average_w(gpu, t) * 1000)] * len(scopes)


def _energy_many(node: FakeNode, gpu: int, scopes: tuple[int, ...], t: float) -> _Answers:
    return _VALUE_TYPE_ULONGLONG, [node.energy_mj(gpu, t)] * len(scopes)


def _link_count_many(node: FakeNode, gpu: int, scopes: tuple[int, ...], t: float) -> _Answers:
    return _VALUE_TYPE_UINT, [node.gpu(gpu).nvlink_links] * len(scopes)


def _mig_link_count(node: FakeNode, gpu: int, scopes: tuple[int, ...], t: float) -> _Answers:
    return _VALUE_TYPE_UINT, [0] * len(scopes)


_NVLINK_DATA_TX = _per_link(_nvlink_kib_tx)
_NVLINK_DATA_RX = _per_link(_nvlink_kib_rx)
_NVLINK_RAW_TX = _per_link(_nvlink_kib_tx, 1.1)  # data plus protocol overhead
_NVLINK_RAW_RX = _per_link(_nvlink_kib_rx, 1.1)
# The NVLink error counters (161-163) of a GPU whose links no fault or recorded row gives errors:
# zeros on every link, at any time, as `nvlink_errors_all` answers them. One reader for all three
# kinds, so a batch's three groups (each link's counters side by side) merge into one.
_NVLINK_ERROR_FIELDS = frozenset({161, 162, 163})
_NVLINK_NO_ERRORS = _per_link(lambda node, gpu, t: (0,) * node.gpu(gpu).nvlink_links)
# A GPU with no recorded rows carries as much each way on a link (`nvlink_kib_all`): there the
# receive fields take the transmit fields' reader, so a batch's two groups (each link's transmit
# and receive side by side) merge into one, read once.
_NVLINK_SAME_BOTH_WAYS = {_NVLINK_DATA_RX: _NVLINK_DATA_TX, _NVLINK_RAW_RX: _NVLINK_RAW_TX}


def _nvlink_all_up(node: FakeNode, gpu: int, scopes: tuple[int, ...], t: float) -> _Answers:
    """`_nvlink_state_many` for a GPU no fault or recorded row ever takes a link of down: every
    link up, at any time, with no state to look up."""
    links = node.gpu(gpu).nvlink_links
    if links == 0:
        return NOT_SUPPORTED
    if max(scopes) < links:
        return _VALUE_TYPE_UINT, [1] * len(scopes)
    return [(_VALUE_TYPE_UINT, 1) if scope < links else INVALID_ARGUMENT for scope in scopes]


# Each field id the fake answers, read for many scopes at once: the health fields (those a
# batch asks for every link of, for all the links in one go), then those of _FIELD_CALLS.
_MANY_READERS: dict[int, _ManyReader] = {
    **{fid: _each(read) for fid, (_call, read) in _HEALTH_FIELDS.items()},
    # Transmit and receive have a reader each (a recording's may differ), so a batch asking for
    # both, link by link, answers them as two groups, each one slice (as one group where no
    # recording can tell them apart: see _NVLINK_SAME_BOTH_WAYS).
    138: _NVLINK_DATA_TX,
    139: _NVLINK_DATA_RX,
    140: _NVLINK_RAW_TX,
    141: _NVLINK_RAW_RX,
    161: _per_link(_nvlink_errors("replay")),
    162: _per_link(_nvlink_errors("recovery")),
    163: _per_link(_nvlink_errors("crc")),
    FI_NVLINK_GET_STATE: _nvlink_state_many,
    FI_POWER_AVERAGE: _power_average_many,
    FI_POWER_INSTANT: _power_many,
    FI_TOTAL_ENERGY_CONSUMPTION: _energy_many,
    FI_NVLINK_LINK_COUNT: _link_count_many,
}


@dataclass(frozen=True, eq=False, slots=True)
class _Columns:
    """Where a group's evenly spaced fields lie in the batch, as slices of its words and of its
    32-bit halves: a group is answered a slice at a time there."""

    kinds: slice  # their (valueType, nvmlReturn) words
    numbers: slice  # their value words
    uints: slice  # their uiVal halves
    succeeded: dict[int, array[int]]  # their (valueType, nvmlReturn) words, for each value type


@dataclass(frozen=True, eq=False, slots=True)
class _FieldGroup:
    """The fields of one batch that share a field id: where they are in it, their scopes, and
    how they are answered: a fixed return code, or the call whose faults they share and the
    reader of their values; and where they are evenly spaced, where their words are."""

    positions: tuple[int, ...]
    scopes: tuple[int, ...]
    code: int | None = None  # answered with this return code, whatever the time
    call: str | None = None  # its faults, when it has any on this device, hit the field too
    read: _ManyReader | None = None
    field: int | None = None  # the field id, where the group has one alone
    columns: _Columns | None = None


def _field_plan(
    lib: FakeNvmlLibrary, dev: Dev, heads: tuple[int, ...], quiet: bool = False, up: bool = False
) -> list[_FieldGroup]:
    """How a batch of these fields (`heads`: each one's fieldId and scopeId word) is answered on
    `dev`, worked out once: a field's answer depends on the time, never on the fields beside it.
    `quiet`: the GPU's NVLink error counters are zeros at all times (`_quiet_links`, which
    holds only for a GPU with no recorded rows); `up`: its links are up at all times (`_links_up`)."""
    node, hidden, is_mig = lib._node, lib._fields_hidden, dev.mig is not None
    by_id: dict[int, tuple[list[int], list[int]]] = {}
    for position, head in enumerate(heads):
        where = by_id.setdefault(_first(head), ([], []))
        where[0].append(position)
        where[1].append(_second(head))
    plan = []
    for fid, (positions, scopes) in by_id.items():
        health = _HEALTH_FIELDS.get(fid)
        call = health[0] if health is not None else _FIELD_CALLS.get(fid)
        code: int | None = None
        if call is None or fid in hidden:
            call, code = None, NOT_SUPPORTED
        elif (is_mig and fid != FI_NVLINK_LINK_COUNT) or fid == FI_MEMORY_TEMP:
            # A MIG instance has only the link count, and the memory temperature is not modelled;
            # NOT_SUPPORTED only after the call's faults, which fail every field of the call.
            code = NOT_SUPPORTED
        faulted = call is not None and bool(node.faults_for(call, family(call), dev.gpu)[0])
        read = _MANY_READERS[fid] if code is None else None
        if read is not None and quiet and fid in _NVLINK_ERROR_FIELDS:
            read = _NVLINK_NO_ERRORS
        if read is not None and quiet:
            read = _NVLINK_SAME_BOTH_WAYS.get(read, read)
        if read is _nvlink_state_many and up:
            read = _nvlink_all_up
        if is_mig and fid == FI_NVLINK_LINK_COUNT:
            read = _mig_link_count
        plan.append(_group(positions, scopes, code, call if faulted else None, read, fid))
    return _merge_lone(_merge_alike(plan))


def _group(
    positions: list[int],
    scopes: list[int],
    code: int | None,
    call: str | None,
    read: _ManyReader | None,
    field: int | None = None,
) -> _FieldGroup:
    step = positions[1] - positions[0] if len(positions) > 1 else 1
    first, last = positions[0], positions[-1]
    if step <= 0 or positions != list(range(first, last + 1, step)):
        return _FieldGroup(tuple(positions), tuple(scopes), code, call, read, field)
    words, halves = step * _FIELD_WORDS, step * _FIELD_WORDS * 2
    columns = _Columns(
        slice(first * _FIELD_WORDS + 3, last * _FIELD_WORDS + 4, words),
        slice(first * _FIELD_WORDS + 4, last * _FIELD_WORDS + 5, words),
        slice(first * _FIELD_WORDS * 2 + _UINT_HALF, last * _FIELD_WORDS * 2 + _UINT_HALF + 1, halves),
        {value_type: array("Q", (kind,)) * len(positions) for value_type, kind in _SUCCEEDED.items()},
    )
    return _FieldGroup(tuple(positions), tuple(scopes), code, call, read, field, columns)


def _merge_alike(plan: list[_FieldGroup]) -> list[_FieldGroup]:
    """The plan with the groups that are answered alike (one reader, one fixed code, one call's
    faults: a reader is told the scopes, never the field id) as one group: a batch asks for
    each link's transmit and receive side by side, and as one group they are one slice."""
    alike: dict[tuple[object, int | None, str | None], list[_FieldGroup]] = {}
    for group in plan:
        alike.setdefault((group.read, group.code, group.call), []).append(group)
    merged = []
    for groups in alike.values():
        if len(groups) == 1:
            merged.append(groups[0])
            continue
        fields = sorted((p, s) for g in groups for p, s in zip(g.positions, g.scopes, strict=True))
        first = groups[0]
        merged.append(_group([p for p, _ in fields], [s for _, s in fields], first.code, first.call, first.read))
    return merged


# Readers of a whole family of health fields at once, (node, gpu, t) -> each field's answer: a
# batch asks for every ECC counter, every policy's violation time, ..., and each family's fields
# come from one reading (the faults gone through, or the recorded row looked up, once).
_FamilyReader = Callable[[FakeNode, int, float], tuple[Any, ...]]


def _ecc_family(node: FakeNode, gpu: int, t: float) -> tuple[Any, ...]:
    return tuple(zip(_ULONGLONG_TYPES, node.health.ecc_errors_all(gpu, t), strict=False))


def _retired_family(node: FakeNode, gpu: int, t: float) -> tuple[Any, ...]:
    retired = node.health.retired_pages(gpu, t)
    if retired is None:
        return (NOT_SUPPORTED,) * 3
    return tuple(zip(_ULONGLONG_TYPES, map(int, retired), strict=False))


def _remap_family(node: FakeNode, gpu: int, t: float) -> tuple[Any, ...]:
    rows = node.health.remapped_rows(gpu, t)
    if rows is None:
        return (NOT_SUPPORTED,) * 4
    return tuple(zip(_UINT_TYPES, map(int, rows), strict=False))


def _violation_family(node: FakeNode, gpu: int, t: float) -> tuple[Any, ...]:
    return tuple(zip(_ULONGLONG_TYPES, node.health.violation_ns_all(gpu, t), strict=False))


# A value type for each of a family's fields, zipped with their values (zip stops at the shorter).
_ULONGLONG_TYPES = (_VALUE_TYPE_ULONGLONG,) * 8
_UINT_TYPES = (_VALUE_TYPE_UINT,) * 8


# Field id -> (its family's reader, where its answer is among the family's): the same answers as
# the field's own reader in _HEALTH_FIELDS (fields 3-6 in ecc_errors_all's order, 74-81 in
# POLICIES', which is nvmlPerfPolicyType_t's).
_FAMILY_OF: dict[int, tuple[_FamilyReader, int]] = {
    **{3 + i: (_ecc_family, i) for i in range(4)},
    **{29 + i: (_retired_family, i) for i in range(3)},
    **{74 + i: (_violation_family, i) for i in range(8)},
    **{142 + i: (_remap_family, i) for i in range(4)},
}


_FAMILY_SIZES: dict[_FamilyReader, int] = {_ecc_family: 4, _retired_family: 3, _violation_family: 8, _remap_family: 4}


def _alone(one: Callable[[FakeNode, int, int, float], Any], scope: int) -> _FamilyReader:
    """A field with no family, as a family of one."""
    return lambda node, gpu, t: (one(node, gpu, scope, t),)


def _merge_lone(plan: list[_FieldGroup]) -> list[_FieldGroup]:
    """The plan with its lone fields that no fault can touch (ECC, violation time, ...: a field
    id each) read as one group, by one reader: a group costs more to answer than a field, and
    a field more than one reading of its family (_FAMILY_OF)."""
    lone = [
        g for g in plan if len(g.positions) == 1 and g.code is None and g.call is None and g.read in _ONE_FIELD_READERS
    ]
    if len(lone) < 2:
        return plan
    # The families to read, and each field's place among their answers laid end to end.
    families: list[_FamilyReader] = []
    offsets: dict[_FamilyReader, int] = {}
    places: list[int] = []
    size = 0
    for g in lone:
        assert g.read is not None
        family_of = _FAMILY_OF.get(g.field) if g.field is not None else None
        reader, index = family_of if family_of is not None else (_alone(_ONE_FIELD_READERS[g.read], g.scopes[0]), 0)
        if reader not in offsets:
            families.append(reader)
            offsets[reader] = size
            size += _FAMILY_SIZES.get(reader, 1)
        places.append(offsets[reader] + index)

    def read(node: FakeNode, gpu: int, scopes: tuple[int, ...], t: float) -> _Answers:
        found: tuple[Any, ...] = ()
        for family in families:
            found += family(node, gpu, t)
        return list(map(found.__getitem__, places))

    merged = _FieldGroup(tuple(g.positions[0] for g in lone), tuple(g.scopes[0] for g in lone), read=read)
    return [g for g in plan if g not in lone] + [merged]


_FIELD_PLANS_KEPT = 256  # batches' plans kept per library (a poll asks a few kinds per GPU)


@_c("nvmlDeviceGetFieldValues")
def _field_values(lib: FakeNvmlLibrary, t: float, dev: Dev, count: Any, values: Any) -> int:
    n = _int(count)
    batch = memoryview(_obj(values)).cast("B")[: n * _FIELD_WORDS * 8]
    words = batch.cast("Q")
    heads = words[0::_FIELD_WORDS]
    # A device's plan for a batch holds for the node's life (its faults and rows are fixed),
    # keyed by the ids' and scopes' bytes.
    key = (dev.gpu, dev.mig, heads.tobytes())
    plans = lib._field_plans
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= _FIELD_PLANS_KEPT:
            plans.clear()
        quiet, up = lib._quiet_links(dev.gpu), lib._links_up(dev.gpu)
        plan = plans[key] = _field_plan(lib, dev, tuple(heads.tolist()), quiet, up)
    node, gpu = lib._node, dev.gpu
    halves = batch.cast("I")
    # A batch asks for many fields of few calls (every NVLink's state is one call's): each
    # call's fault is looked up once per batch.
    errors: dict[str, str | None] = {}
    for group in plan:
        answers: _Answers | None = group.code
        call = group.call
        if call is not None:
            if call in errors:
                error = errors[call]
            else:
                error = errors[call] = node.fault_error(call, family(call), gpu, t)
            if error is not None:
                answers = ERROR_CODES[error]
        if answers is None:
            assert group.read is not None
            answers = group.read(node, gpu, group.scopes, t)
        _answer(group, answers, words, halves)
    stamp_us = int(node.clock.start_epoch * 1_000_000 + t * 1_000_000)
    words[1::_FIELD_WORDS] = array("Q", (stamp_us,)) * n
    words[2::_FIELD_WORDS] = array("Q", (0,)) * n  # latencyUsec
    return SUCCESS


def _answer(group: _FieldGroup, answers: _Answers, words: memoryview, halves: memoryview) -> None:
    """One group's answers into the batch, seen as words and as 32-bit halves: a slice at a time
    where its fields are evenly spaced and all answered alike (the usual batch: one field id for
    every link, side by side with another). A field that fails keeps the type and value the
    caller left, as the driver writes only its return code then."""
    columns = group.columns
    if isinstance(answers, tuple) and columns is not None:
        value_type, found = answers
        kinds = columns.succeeded.get(value_type)
        words[columns.kinds] = kinds or array("Q", (_pair(value_type, SUCCESS),)) * len(found)
        # A number is masked to the bytes its C type has: a no-op for the numbers that fit it
        # (all of them, but for a recording's odd value), which an array refuses to hold.
        if value_type == _VALUE_TYPE_ULONGLONG:
            try:
                words[columns.numbers] = array("Q", found)
            except OverflowError:
                words[columns.numbers] = array("Q", [number & _LOW64 for number in found])
        else:  # as ctypes writes a c_uint: its 4 bytes, truncated
            try:
                halves[columns.uints] = array("I", found)
            except OverflowError:
                halves[columns.uints] = array("I", [number & _LOW32 for number in found])
        return
    each: list[_Answer]
    if isinstance(answers, int):
        each = [answers] * len(group.positions)
    elif isinstance(answers, tuple):
        each = [(answers[0], number) for number in answers[1]]
    else:
        each = answers
    for position, answer in zip(group.positions, each, strict=True):
        if isinstance(answer, int):
            halves[position * _FIELD_WORDS * 2 + _RETURN_HALF] = answer
            continue
        value_type, number = answer
        words[position * _FIELD_WORDS + 3] = _SUCCEEDED.get(value_type) or _pair(value_type, SUCCESS)
        if value_type == _VALUE_TYPE_ULONGLONG:
            words[position * _FIELD_WORDS + 4] = number & _LOW64
        else:
            halves[position * _FIELD_WORDS * 2 + _UINT_HALF] = number & _LOW32


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------

_NO_INSTANCE = 0xFFFFFFFF


def _process_list(context: str) -> Callable[[FakeNvmlLibrary, float, Dev, Any, Any], int]:
    """One of NVML's process-list calls (compute, graphics, MPS clients): the running scenario
    processes holding that kind of context, with the C contract of all of them: `*count` in is
    the array's size; too small (or a NULL array with processes running) answers
    INSUFFICIENT_SIZE with the size needed in `*count`."""

    def running(lib: FakeNvmlLibrary, t: float, dev: Dev, count: Any, infos: Any) -> int:
        node = lib._node
        gpu = node.gpu(dev.gpu)
        entries: Sequence[tuple[Process, int | None]]
        if dev.mig is None:
            entries = node.context_entries(dev.gpu, context, t)
        else:
            entries = [(p, dev.mig) for p in node.processes_on(dev.gpu, dev.mig, t) if context in p.contexts]
        counter = _obj(count)
        if infos is None:
            counter.value = len(entries)
            return INSUFFICIENT_SIZE if entries else SUCCESS
        if counter.value < len(entries):
            counter.value = len(entries)
            return INSUFFICIENT_SIZE
        array = _obj(infos)
        for i, (process, mig) in enumerate(entries):
            info = array[i]
            info.pid = process.pid
            info.usedGpuMemory = process.memory_bytes_at(t - process.start_s)
            if hasattr(info, "gpuInstanceId"):
                info.gpuInstanceId = _NO_INSTANCE if mig is None else gpu.mig[mig].gpu_instance_id
                info.computeInstanceId = _NO_INSTANCE if mig is None else 0
        counter.value = len(entries)
        return SUCCESS

    return running


for _list_, _context_ in (
    ("nvmlDeviceGetComputeRunningProcesses", "compute"),
    ("nvmlDeviceGetGraphicsRunningProcesses", "graphics"),
    ("nvmlDeviceGetMPSComputeRunningProcesses", "mps"),
):
    for _suffix_ in ("", "_v2", "_v3"):
        _c(_list_ + _suffix_)(_process_list(_context_))


@_c("nvmlDeviceGetProcessUtilization")
def _process_utilization(lib: FakeNvmlLibrary, t: float, dev: Dev, samples: Any, count: Any, last_seen: Any) -> int:
    if lib._node.gpu(dev.gpu).mig:
        return NOT_SUPPORTED
    pids, stamps, utils = lib._node.process_sample_columns(dev.gpu, _int(last_seen), t)
    n = len(pids)
    counter = _obj(count)
    if not n:
        return NOT_FOUND
    if samples is None or counter.value < n:
        counter.value = n
        return INSUFFICIENT_SIZE
    # Packed in one go (memUtil, encUtil and decUtil 0): a busy GPU has dozens of samples a
    # poll, and six ctypes attribute writes each cost more. The columns go into their places
    # among the six a slice at a time.
    values = [0] * (_SAMPLE_FIELDS * n)
    values[0::_SAMPLE_FIELDS] = pids
    values[1::_SAMPLE_FIELDS] = stamps
    values[2::_SAMPLE_FIELDS] = utils
    _samples_layout(n).pack_into(_obj(samples), 0, *values)
    counter.value = n
    return SUCCESS


_SAMPLE_FIELDS = 6  # nvmlProcessUtilizationSample_t: pid, timeStamp, smUtil, memUtil, encUtil, decUtil


GPU_UTILIZATION_SAMPLES = 1  # nvmlSamplingType_t NVML_GPU_UTILIZATION_SAMPLES


@_c("nvmlDeviceGetSamples")
def _samples(
    lib: FakeNvmlLibrary, t: float, dev: Dev, kind: Any, last_seen: Any, value_type: Any, count: Any, samples: Any
) -> int:
    # GPU utilization samples only, and, like nvmlDeviceGetUtilizationRates, none under MIG.
    if _int(kind) != GPU_UTILIZATION_SAMPLES or dev.mig is not None or lib._node.gpu(dev.gpu).mig:
        return NOT_SUPPORTED
    stamps, percents = lib._node.device_sample_columns(dev.gpu, _int(last_seen), t)
    n = len(stamps)
    if not n:
        return NOT_FOUND
    _obj(value_type).value = _VALUE_TYPE_UINT
    counter = _obj(count)
    if samples is None:  # the size query pynvml's wrapper makes first
        counter.value = n
        return SUCCESS
    if counter.value < n:
        counter.value = n
        return INSUFFICIENT_SIZE
    # nvmlSample_t is two words, the time stamp and the value union: written a column at a time.
    buffer = memoryview(_obj(samples)).cast("B")
    buffer.cast("Q")[0 : 2 * n : 2] = array("Q", stamps)
    # uiVal: the union's first 4 bytes, the third uint32 of each sample whatever the byte order;
    # the union's others are left as they were.
    buffer.cast("I")[2 : 4 * n : 4] = array("I", percents)
    counter.value = n
    return SUCCESS


@functools.lru_cache(maxsize=64)
def _samples_layout(count: int) -> struct.Struct:
    """`count` nvmlProcessUtilizationSample_t: pid, timeStamp, smUtil, memUtil, encUtil, decUtil,
    aligned as the C struct is."""
    return struct.Struct("@" + "IQIIII" * count)


@_c("nvmlDeviceGetAccountingMode")
def _accounting_mode(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = 0
    return SUCCESS


# ---------------------------------------------------------------------------------------------
# Health: throttling, memory errors, PCIe and NVLink links (the node's side: fake_nvml/health.py)
# ---------------------------------------------------------------------------------------------

# Every reason bit the fake can report (nvmlClocksEventReason*, GPU idle to HW power brake).
_SUPPORTED_REASONS = 0x1FF


@_c("nvmlDeviceGetCurrentClocksEventReasons")
@_c("nvmlDeviceGetCurrentClocksThrottleReasons")
def _clock_event_reasons(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    _obj(out).value = lib._node.health.clock_event_reasons(dev.gpu, t)
    return SUCCESS


@_c("nvmlDeviceGetSupportedClocksEventReasons")
@_c("nvmlDeviceGetSupportedClocksThrottleReasons")
def _supported_reasons(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    _obj(out).value = _SUPPORTED_REASONS
    return SUCCESS


@_c("nvmlDeviceGetViolationStatus")
def _violation_status(lib: FakeNvmlLibrary, t: float, dev: Dev, policy: Any, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    ns = lib._node.health.violation_ns(dev.gpu, _int(policy), t)
    if ns is None:
        return INVALID_ARGUMENT
    violation = _obj(out)
    violation.referenceTime = int(lib._node.clock.start_epoch * 1_000_000 + t * 1_000_000)
    violation.violationTime = ns
    return SUCCESS


@_c("nvmlDeviceGetEccMode")
def _ecc_mode(lib: FakeNvmlLibrary, t: float, dev: Dev, current: Any, pending: Any) -> int:
    _obj(current).value = 1
    _obj(pending).value = 1
    return SUCCESS


@_c("nvmlDeviceGetTotalEccErrors")
def _total_ecc_errors(lib: FakeNvmlLibrary, t: float, dev: Dev, error_type: Any, counter_type: Any, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    if _int(error_type) not in (0, 1) or _int(counter_type) not in (0, 1):
        return INVALID_ARGUMENT
    _obj(out).value = lib._node.health.ecc_errors(dev.gpu, _int(error_type) == 1, t, _int(counter_type) == 1)
    return SUCCESS


def _retired_pages(
    lib: FakeNvmlLibrary, t: float, dev: Dev, cause: Any, count: Any, addresses: Any, *times: Any
) -> int:
    retired = lib._node.health.retired_pages(dev.gpu, t) if dev.mig is None else None
    if retired is None:
        return NOT_SUPPORTED
    which = _int(cause)
    if which not in (0, 1):
        return INVALID_ARGUMENT
    pages = retired[which]
    counter = _obj(count)
    if addresses is None or counter.value < pages:
        counter.value = pages
        return INSUFFICIENT_SIZE if pages and addresses is not None else SUCCESS
    array = _obj(addresses)
    for i in range(pages):
        # Page addresses as the driver gives them: page frame numbers, here made up per GPU.
        array[i] = (dev.gpu + 1) << 32 | (which << 16) | i
        if times and times[0] is not None:
            _obj(times[0])[i] = int(lib._node.clock.start_epoch)
    counter.value = pages
    return SUCCESS


_c("nvmlDeviceGetRetiredPages")(_retired_pages)
_c("nvmlDeviceGetRetiredPages_v2")(_retired_pages)


@_c("nvmlDeviceGetRetiredPagesPendingStatus")
def _retired_pending(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    retired = lib._node.health.retired_pages(dev.gpu, t) if dev.mig is None else None
    if retired is None:
        return NOT_SUPPORTED
    _obj(out).value = 1 if retired[2] else 0
    return SUCCESS


@_c("nvmlDeviceGetRemappedRows")
def _remapped_rows(lib: FakeNvmlLibrary, t: float, dev: Dev, corr: Any, unc: Any, pending: Any, failure: Any) -> int:
    rows = lib._node.health.remapped_rows(dev.gpu, t) if dev.mig is None else None
    if rows is None:
        return NOT_SUPPORTED
    for out, value in zip((corr, unc, pending, failure), rows, strict=True):
        _obj(out).value = int(value)
    return SUCCESS


@_c("nvmlDeviceGetCurrPcieLinkGeneration")
def _pcie_generation(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = lib._node.health.pcie_link(dev.gpu, t)[0]
    return SUCCESS


@_c("nvmlDeviceGetCurrPcieLinkWidth")
def _pcie_width(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = lib._node.health.pcie_link(dev.gpu, t)[1]
    return SUCCESS


@_c("nvmlDeviceGetMaxPcieLinkGeneration")
@_c("nvmlDeviceGetGpuMaxPcieLinkGeneration")
def _pcie_max_generation(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = lib._node.health.pcie_link_max(dev.gpu, t)[0]
    return SUCCESS


@_c("nvmlDeviceGetMaxPcieLinkWidth")
def _pcie_max_width(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    _obj(out).value = lib._node.health.pcie_link_max(dev.gpu, t)[1]
    return SUCCESS


@_c("nvmlDeviceGetPcieReplayCounter")
def _pcie_replays(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    _obj(out).value = lib._node.health.pcie_replays(dev.gpu, t)
    return SUCCESS


@_c("nvmlDeviceGetPcieThroughput")
def _pcie_throughput(lib: FakeNvmlLibrary, t: float, dev: Dev, counter: Any, out: Any) -> int:
    if dev.mig is not None:
        return NOT_SUPPORTED
    which = _int(counter)
    if which not in (0, 1):  # NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES
        return INVALID_ARGUMENT
    _obj(out).value = lib._node.health.pcie_throughput_kib_s(dev.gpu, t)[which]
    return SUCCESS


# nvmlNvLinkErrorCounter_t: what each counter counts here (CRC_DATA is counted with CRC_FLIT).
_NVLINK_COUNTERS = {0: "replay", 1: "recovery", 2: "crc", 3: "crc"}


@_c("nvmlDeviceGetNvLinkErrorCounter")
def _nvlink_error_counter(lib: FakeNvmlLibrary, t: float, dev: Dev, link: Any, counter: Any, out: Any) -> int:
    gpu = lib._node.gpu(dev.gpu)
    if dev.mig is not None or gpu.nvlink_links == 0:
        return NOT_SUPPORTED
    kind = _NVLINK_COUNTERS.get(_int(counter))
    if kind is None or _int(link) >= gpu.nvlink_links:
        return INVALID_ARGUMENT
    _obj(out).value = lib._node.health.nvlink_errors(dev.gpu, _int(link), kind, t)
    return SUCCESS
