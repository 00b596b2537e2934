"""The one module that talks to pynvml. Calls are thin; pynvml's exceptions become the agent's.

Everything above this module sees plain Python values and `agent.errors` exceptions, never a
ctypes struct or a `pynvml.NVMLError`.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pynvml

from agent.errors import (
    NvmlDriverUnavailable,
    NvmlError,
    NvmlFunctionMissing,
    NvmlGpuLost,
    NvmlLibraryMissing,
    NvmlNotFound,
    NvmlNotSupported,
)

T = TypeVar("T")
Handle = Any  # a pynvml c_nvmlDevice_t; opaque above this module

FI_TOTAL_ENERGY_CONSUMPTION = pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
FI_POWER_INSTANT = getattr(pynvml, "NVML_FI_DEV_POWER_INSTANT", 186)
FI_NVLINK_GET_STATE = getattr(pynvml, "NVML_FI_DEV_NVLINK_GET_STATE", 165)
FI_NVLINK_LINK_COUNT = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT
MAX_NVLINKS = getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)

_NAMES: dict[int, str] = {
    value: name.removeprefix("NVML_ERROR_")
    for name, value in vars(pynvml).items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}
_DRIVER_GONE = {"UNINITIALIZED", "DRIVER_NOT_LOADED", "LIB_RM_VERSION_MISMATCH"}
_GPU_GONE = {"GPU_IS_LOST", "GPU_NOT_FOUND", "RESET_REQUIRED"}


class _FieldValue(ctypes.Structure):
    """pynvml's c_nvmlFieldValue_t layout in a plain ctypes struct.

    pynvml's structs override __getattribute__/__setattr__ in Python to convert strings; for
    the two calls that move many structs per poll (field values, process samples) that costs
    more than the call itself, so this module hands the driver plain structs of the same layout.
    """

    _fields_ = pynvml.c_nvmlFieldValue_t._fields_


class _ProcessSample(ctypes.Structure):
    _fields_ = pynvml.c_nvmlProcessUtilizationSample_t._fields_


def _raw(call: str, name: str, *args: Any) -> int:
    """Calls the C function `name` the way pynvml's wrappers do; returns its return code."""
    try:
        fn = pynvml._nvmlGetFunctionPointer(name)
    except pynvml.NVMLError as exc:
        raise _translate(call, exc) from exc
    return int(fn(*args))


def _check(call: str, code: int) -> None:
    if code != pynvml.NVML_SUCCESS:
        raise _translate(call, pynvml.NVMLError(code))


def error_name(code: int) -> str:
    return _NAMES.get(code, f"ERROR_{code}")


def _translate(call: str, exc: pynvml.NVMLError) -> NvmlError:
    name = error_name(exc.value)
    if name == "NOT_SUPPORTED":
        return NvmlNotSupported(call, name)
    if name == "FUNCTION_NOT_FOUND":
        return NvmlFunctionMissing(call, name)
    if name == "NOT_FOUND":
        return NvmlNotFound(call, name)
    if name in _GPU_GONE:
        return NvmlGpuLost(call, name)
    if name in _DRIVER_GONE:
        return NvmlDriverUnavailable(call, name)
    if name == "LIBRARY_NOT_FOUND":
        return NvmlLibraryMissing(call, name, "libnvidia-ml.so.1 could not be loaded: is the NVIDIA driver installed?")
    return NvmlError(call, name)


def _call(call: str, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise _translate(call, exc) from exc


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    pid: int
    used_memory_bytes: int | None
    gpu_instance_id: int | None


@dataclass(frozen=True, slots=True)
class FieldResult:
    field_id: int
    scope_id: int
    value: float | None
    error: str | None


class NvmlBackend:
    """NVML as the sampler uses it. `clock` is the backend's clock in unix seconds.

    Versioned calls are tried newest first; the first that the driver has is remembered, so an
    old driver costs one FunctionNotFound per call family, not one per poll.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._memory_v2: bool | None = None
        self._temperature_v: bool | None = None
        self._processes_variant: str | None = None

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
        return _call("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index)

    # -- identity -----------------------------------------------------------------------------

    def name(self, handle: Handle) -> str:
        return str(_call("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, handle))

    def uuid(self, handle: Handle) -> str:
        return str(_call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, handle))

    def pci_bus_id(self, handle: Handle) -> str:
        info = _call("nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, handle)
        bus_id = info.busId
        return bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)

    def power_limit_w(self, handle: Handle) -> float:
        return float(_call("nvmlDeviceGetEnforcedPowerLimit", pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)) / 1000

    def sm_count(self, handle: Handle) -> int:
        return int(_call("nvmlDeviceGetAttributes", pynvml.nvmlDeviceGetAttributes, handle).multiprocessorCount)

    def mig_enabled(self, handle: Handle) -> bool:
        current, _pending = _call("nvmlDeviceGetMigMode", pynvml.nvmlDeviceGetMigMode, handle)
        return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)

    def mig_handles(self, handle: Handle) -> list[tuple[int, Handle]]:
        """(slot, handle) of each MIG device the GPU has now."""
        count = _call("nvmlDeviceGetMaxMigDeviceCount", pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)
        found = []
        for slot in range(count):
            try:
                found.append(
                    (
                        slot,
                        _call(
                            "nvmlDeviceGetMigDeviceHandleByIndex",
                            pynvml.nvmlDeviceGetMigDeviceHandleByIndex,
                            handle,
                            slot,
                        ),
                    )
                )
            except NvmlNotFound:
                continue  # an empty slot: MIG devices need not be contiguous
        return found

    def gpu_instance_id(self, handle: Handle) -> int:
        return int(_call("nvmlDeviceGetGpuInstanceId", pynvml.nvmlDeviceGetGpuInstanceId, handle))

    # -- readings -----------------------------------------------------------------------------

    def utilization(self, handle: Handle) -> float:
        rates = _call("nvmlDeviceGetUtilizationRates", pynvml.nvmlDeviceGetUtilizationRates, handle)
        return float(rates.gpu) / 100

    def memory(self, handle: Handle) -> tuple[int, int]:
        """(used, total) bytes. The v2 call counts driver-reserved memory apart, as `used` should."""
        if self._memory_v2 is not False:
            try:
                info = _call(
                    "nvmlDeviceGetMemoryInfo",
                    pynvml.nvmlDeviceGetMemoryInfo,
                    handle,
                    pynvml.nvmlMemory_v2,
                )
                self._memory_v2 = True
                return int(info.used), int(info.total)
            except NvmlFunctionMissing:
                self._memory_v2 = False
        info = _call("nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo, handle)
        return int(info.used), int(info.total)

    def temperature_c(self, handle: Handle) -> float:
        sensor = pynvml.NVML_TEMPERATURE_GPU
        if self._temperature_v is not False and hasattr(pynvml, "nvmlDeviceGetTemperatureV"):
            try:
                value = _call("nvmlDeviceGetTemperature", pynvml.nvmlDeviceGetTemperatureV, handle, sensor)
                self._temperature_v = True
                return float(value)
            except NvmlFunctionMissing:
                self._temperature_v = False
        return float(_call("nvmlDeviceGetTemperature", pynvml.nvmlDeviceGetTemperature, handle, sensor))

    def power_w(self, handle: Handle) -> float:
        return float(_call("nvmlDeviceGetPowerUsage", pynvml.nvmlDeviceGetPowerUsage, handle)) / 1000

    def energy_j(self, handle: Handle) -> float:
        millijoules = _call("nvmlDeviceGetTotalEnergyConsumption", pynvml.nvmlDeviceGetTotalEnergyConsumption, handle)
        return float(millijoules) / 1000

    def nvlink_up(self, handle: Handle, link: int) -> bool:
        state = _call("nvmlDeviceGetNvLinkState", pynvml.nvmlDeviceGetNvLinkState, handle, link)
        return bool(state == pynvml.NVML_FEATURE_ENABLED)

    def field_values(self, handle: Handle, fields: Sequence[int | tuple[int, int]]) -> list[FieldResult]:
        """Several readings in one call. Each result carries its own error name, or a value."""
        call = "nvmlDeviceGetFieldValues"
        values = (_FieldValue * len(fields))()
        for item, wanted in zip(values, fields, strict=True):
            if isinstance(wanted, tuple):
                item.fieldId, item.scopeId = wanted
            else:
                item.fieldId = wanted
        _check(call, _raw(call, call, handle, ctypes.c_int32(len(fields)), ctypes.byref(values)))
        results = []
        for item in values:
            if item.nvmlReturn != pynvml.NVML_SUCCESS:
                results.append(FieldResult(item.fieldId, item.scopeId, None, error_name(item.nvmlReturn)))
                continue
            value_type = item.valueType
            raw: float
            if value_type == pynvml.NVML_VALUE_TYPE_DOUBLE:
                raw = item.value.dVal
            elif value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
                raw = item.value.uiVal
            elif value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
                raw = item.value.ulVal
            elif value_type == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
                raw = item.value.sllVal
            elif value_type == pynvml.NVML_VALUE_TYPE_SIGNED_INT:
                raw = item.value.siVal
            else:
                raw = item.value.ullVal
            results.append(FieldResult(item.fieldId, item.scopeId, float(raw), None))
        return results

    def running_processes(self, handle: Handle) -> list[ProcessInfo]:
        """Compute processes with their memory, newest struct version the driver has."""
        variants: list[tuple[str, Callable[[Handle], Any]]] = [
            ("v3", pynvml.nvmlDeviceGetComputeRunningProcesses_v3),
            ("v2", pynvml.nvmlDeviceGetComputeRunningProcesses_v2),
        ]
        if self._processes_variant is not None:
            variants = [v for v in variants if v[0] == self._processes_variant]
        last: NvmlFunctionMissing | None = None
        for variant, fn in variants:
            try:
                infos = _call("nvmlDeviceGetComputeRunningProcesses", fn, handle)
            except NvmlFunctionMissing as exc:
                last = exc
                continue
            self._processes_variant = variant
            return [
                ProcessInfo(
                    pid=int(info.pid),
                    used_memory_bytes=None if info.usedGpuMemory is None else int(info.usedGpuMemory),
                    gpu_instance_id=(
                        None if getattr(info, "gpuInstanceId", 0xFFFFFFFF) == 0xFFFFFFFF else int(info.gpuInstanceId)
                    ),
                )
                for info in infos
            ]
        assert last is not None
        raise last

    def process_utilization(self, handle: Handle, last_seen_us: int) -> list[tuple[int, int, int]]:
        """(pid, timestamp_us, SM utilization percent) samples newer than `last_seen_us`; [] when none.

        As pynvml's wrapper does: ask for the count, then for the samples."""
        call = "nvmlDeviceGetProcessUtilization"
        count = ctypes.c_uint(0)
        since = ctypes.c_ulonglong(last_seen_us)
        code = _raw(call, call, handle, None, ctypes.byref(count), since)
        if code == pynvml.NVML_ERROR_NOT_FOUND or (code == pynvml.NVML_SUCCESS and count.value == 0):
            return []
        if code != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            _check(call, code)
        samples = (_ProcessSample * count.value)()
        code = _raw(call, call, handle, samples, ctypes.byref(count), since)
        if code == pynvml.NVML_ERROR_NOT_FOUND:
            return []
        _check(call, code)
        return [(s.pid, s.timeStamp, s.smUtil) for s in samples[: count.value]]
