"""The fake NVML, specified through the real pynvml: what a scenario shows, how faults look,
which driver has which symbol, and how a bad scenario is reported.

Every reading here goes through pynvml's own wrappers, so the structs, versioned calls and
error classes are the ones production code sees.
"""

from __future__ import annotations

import ctypes
import re
import shlex
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import hypothesis
import pynvml
import pytest
from hypothesis import strategies as st

import fake_nvml
from fake_nvml.host import split_cmdline

InstallFake = Callable[..., fake_nvml.InstalledNode]  # the conftest fixture `install_fake`
MiB = 2**20
START = datetime(2026, 11, 20, 18, 0, tzinfo=UTC)
START_US = int(START.timestamp()) * 1_000_000

# A node whose readings are easy to work out by hand (power = idle + (limit - idle) * util):
#   GPU 0  pids 101 (70%) + 102 (60%): utilization capped at 100 -> 300 W, 90 C, 3000 MiB used
#   GPU 1  pid 201 at 25%: 100 + 200 * 0.25 = 150 W, 30 + 60 * 0.25 = 45 C, 4096 MiB used
#   GPU 2  an idle L4 (no NVLink, no MIG), the model's defaults: 16 W idle, 32 C
READINGS: dict[str, Any] = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "spec-node", "driver_version": "570.86.10", "cuda_driver_version": 12080},
    "gpus": [
        {
            "model": "A100-SXM4-80GB",
            "count": 2,
            "power_limit_w": 300,
            "idle_power_w": 100,
            "idle_temp_c": 30,
            "max_temp_c": 90,
            "nvlink_links": 4,
        },
        {"model": "L4"},
    ],
    "processes": [
        {"pid": 101, "gpus": [0], "sm_util": 70, "memory_mib": 1000, "cmdline": "python train.py --fast"},
        {"pid": 102, "gpus": [0], "sm_util": 60, "memory_mib": 2000, "cmdline": "/usr/bin/python3 eval.py"},
        {"pid": 201, "gpus": [1], "sm_util": 25, "memory_mib": 4096},
    ],
}

# A node whose health readings are easy to work out by hand, every fault in force from t=0:
#   GPU 0  A100, 4 NVLinks, pid 301 at 40% (193 W, 52.4 C: nothing holds its clocks down):
#          5 corrected and 2 uncorrected ECC errors; 1 correctable and 2 uncorrectable rows
#          remapped, pending; its PCIe link trained down to Gen2 x4 after 7 replays; link 1 with
#          11 CRC, 3 replay and 1 recovery errors
#   GPU 1  A100, idle: a row remap that failed, and sync-boost throttling
#   GPU 2  V100 (before Ampere: pages retire, rows are not remapped), idle: 3 uncorrected errors
#   GPU 3  RTX A6000 with a fan, pid 302 at 50% encoding at 45% and decoding at 30%
HARDWARE: dict[str, Any] = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "hw-node", "driver_version": "570.86.10", "cuda_driver_version": 12080},
    "gpus": [
        {"model": "A100-SXM4-80GB", "count": 2, "nvlink_links": 4},
        {"model": "V100-SXM2-32GB", "nvlink_links": 2},
        {"model": "RTX A6000"},
    ],
    "processes": [
        {"pid": 301, "gpus": [0], "sm_util": 40, "memory_mib": 1000},
        {"pid": 302, "gpus": [3], "sm_util": 50, "encoder_util": 45, "decoder_util": 30, "memory_mib": 500},
    ],
    "faults": [
        {"gpu": 0, "ecc": {"corrected": 5, "uncorrected": 2}},
        {"gpu": 0, "remap": {"correctable": 1, "uncorrectable": 2}},
        {"gpu": 0, "pcie_downgrade": {"generation": 2, "width": 4, "replays": 7}},
        {"gpu": 0, "nvlink_errors": {"links": [1], "crc": 11, "replay": 3, "recovery": 1}},
        {"gpu": 1, "remap": {"failure": True}},
        {"gpu": 1, "throttle": "sync_boost"},
        {"gpu": 2, "ecc": {"uncorrected": 3}},
    ],
}

# The built-in `mig` node: GPU 0 is split into two 3g.40gb instances (pid 800 on 0:0 at 70%
# with 20000 MiB, pid 801 on 0:1 idle with 8000 MiB); GPU 1 is whole (pid 802 at 40%).
# An H100 split in two 3g.40gb instances (48 of its 132 SMs each); pid 900 on 0:0 runs kernels
# 60% of the time that keep 30% of the instance's SMs busy: GPM's figures (tests/test_gpm.py).
HOPPER = {
    "gpus": [{"model": "H100-SXM5-80GB", "mig": ["3g.40gb", "3g.40gb"]}],
    "processes": [{"pid": 900, "gpus": ["0:0"], "sm_util": 60, "sm_active": 30}],
}
SCENARIOS = {
    "readings": fake_nvml.load_scenario(READINGS),
    "mig": fake_nvml.load_scenario("mig"),
    "hopper": fake_nvml.load_scenario(HOPPER),
    "hardware": fake_nvml.load_scenario(HARDWARE),
}


def node_with(*, gpus: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    """A small scenario: two A100s with four NVLink links each unless told otherwise."""
    return {
        "start": "2026-11-20T18:00:00Z",
        "gpus": gpus or [{"model": "A100-SXM4-80GB", "count": 2, "nvlink_links": 4}],
        **extra,
    }


class Devices:
    """Handles as a caller gets them: through pynvml, at the moment of the call."""

    @staticmethod
    def gpu(index: int) -> Any:
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def mig(self, index: int, instance: int) -> Any:
        return pynvml.nvmlDeviceGetMigDeviceHandleByIndex(self.gpu(index), instance)


def pids_and_memory(processes: Iterable[Any]) -> list[tuple[int, int]]:
    return [(p.pid, p.usedGpuMemory) for p in processes]


def uuid_of(handle: Any) -> str:
    return str(pynvml.nvmlDeviceGetUUID(handle))


def fields_of(struct: Any, *names: str) -> tuple[Any, ...]:
    return tuple(getattr(struct, name) for name in names)


# ---------------------------------------------------------------------------------------------
# 1. Readings through pynvml's wrappers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """One wrapper call, what it must return (or raise), and the C function it must reach."""

    c_function: str
    call: Callable[[Devices], object]
    expected: object
    scenario: str = "readings"


def _gpu_uuid(gpu: int) -> str:
    return SCENARIOS["readings"].gpus[gpu].uuid


def _mig_uuid(gpu: int, instance: int) -> str:
    return SCENARIOS["mig"].gpus[gpu].mig[instance].uuid


READING_TABLE: dict[str, Reading] = {
    # -- system ---------------------------------------------------------------------------------
    "driver version": Reading("nvmlSystemGetDriverVersion", lambda d: pynvml.nvmlSystemGetDriverVersion(), "570.86.10"),
    "NVML version is CUDA major + driver": Reading(
        "nvmlSystemGetNVMLVersion", lambda d: pynvml.nvmlSystemGetNVMLVersion(), "12.570.86.10"
    ),
    "CUDA driver version": Reading(
        "nvmlSystemGetCudaDriverVersion", lambda d: pynvml.nvmlSystemGetCudaDriverVersion(), 12080
    ),
    "CUDA driver version v2": Reading(
        "nvmlSystemGetCudaDriverVersion_v2", lambda d: pynvml.nvmlSystemGetCudaDriverVersion_v2(), 12080
    ),
    "process name is the command": Reading(
        "nvmlSystemGetProcessName", lambda d: pynvml.nvmlSystemGetProcessName(102), "/usr/bin/python3"
    ),
    "process name of an unknown pid": Reading(
        "nvmlSystemGetProcessName", lambda d: pynvml.nvmlSystemGetProcessName(4242), pynvml.NVMLError_NotFound
    ),
    "error string": Reading(
        "nvmlErrorString",
        lambda d: str(pynvml.nvmlErrorString(pynvml.NVML_ERROR_GPU_IS_LOST)).lower(),
        "gpu is lost",
    ),
    "device count": Reading("nvmlDeviceGetCount_v2", lambda d: pynvml.nvmlDeviceGetCount(), 3),
    # -- identity -------------------------------------------------------------------------------
    "handle by index names that GPU": Reading(
        "nvmlDeviceGetHandleByIndex_v2", lambda d: pynvml.nvmlDeviceGetIndex(d.gpu(2)), 2
    ),
    "handle by index out of range": Reading(
        "nvmlDeviceGetHandleByIndex_v2", lambda d: d.gpu(3), pynvml.NVMLError_InvalidArgument
    ),
    "name is NVIDIA + model": Reading(
        "nvmlDeviceGetName", lambda d: pynvml.nvmlDeviceGetName(d.gpu(0)), "NVIDIA A100-SXM4-80GB"
    ),
    "name of the L4": Reading("nvmlDeviceGetName", lambda d: pynvml.nvmlDeviceGetName(d.gpu(2)), "NVIDIA L4"),
    "UUID": Reading("nvmlDeviceGetUUID", lambda d: uuid_of(d.gpu(1)), _gpu_uuid(1)),
    "handle by UUID": Reading(
        "nvmlDeviceGetHandleByUUID",
        lambda d: pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(_gpu_uuid(1))),
        1,
    ),
    "handle by unknown UUID": Reading(
        "nvmlDeviceGetHandleByUUID",
        lambda d: pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000"),
        pynvml.NVMLError_NotFound,
    ),
    "PCI bus id": Reading(
        "nvmlDeviceGetPciInfo_v3", lambda d: pynvml.nvmlDeviceGetPciInfo(d.gpu(1)).busId, "00000000:20:00.0"
    ),
    "PCI device id of the model": Reading(
        "nvmlDeviceGetPciInfo_v3", lambda d: pynvml.nvmlDeviceGetPciInfo(d.gpu(2)).pciDeviceId, 0x27B810DE
    ),
    "handle by PCI bus id, any case": Reading(
        "nvmlDeviceGetHandleByPciBusId_v2",
        lambda d: pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId("00000000:30:00.0".lower())),
        2,
    ),
    "serial": Reading("nvmlDeviceGetSerial", lambda d: pynvml.nvmlDeviceGetSerial(d.gpu(1)), "1324000000001"),
    "index": Reading("nvmlDeviceGetIndex", lambda d: pynvml.nvmlDeviceGetIndex(d.gpu(1)), 1),
    "minor number": Reading("nvmlDeviceGetMinorNumber", lambda d: pynvml.nvmlDeviceGetMinorNumber(d.gpu(2)), 2),
    "brand": Reading("nvmlDeviceGetBrand", lambda d: pynvml.nvmlDeviceGetBrand(d.gpu(0)), pynvml.NVML_BRAND_NVIDIA),
    "architecture of an A100": Reading(
        "nvmlDeviceGetArchitecture",
        lambda d: pynvml.nvmlDeviceGetArchitecture(d.gpu(0)),
        pynvml.NVML_DEVICE_ARCH_AMPERE,
    ),
    "architecture of an L4": Reading(
        "nvmlDeviceGetArchitecture", lambda d: pynvml.nvmlDeviceGetArchitecture(d.gpu(2)), pynvml.NVML_DEVICE_ARCH_ADA
    ),
    "compute capability": Reading(
        "nvmlDeviceGetCudaComputeCapability", lambda d: pynvml.nvmlDeviceGetCudaComputeCapability(d.gpu(2)), (8, 9)
    ),
    "persistence mode on": Reading(
        "nvmlDeviceGetPersistenceMode", lambda d: pynvml.nvmlDeviceGetPersistenceMode(d.gpu(0)), 1
    ),
    "default compute mode": Reading(
        "nvmlDeviceGetComputeMode", lambda d: pynvml.nvmlDeviceGetComputeMode(d.gpu(0)), pynvml.NVML_COMPUTEMODE_DEFAULT
    ),
    "no display active": Reading(
        "nvmlDeviceGetDisplayActive", lambda d: pynvml.nvmlDeviceGetDisplayActive(d.gpu(0)), 0
    ),
    "no display mode": Reading("nvmlDeviceGetDisplayMode", lambda d: pynvml.nvmlDeviceGetDisplayMode(d.gpu(0)), 0),
    "SM count": Reading(
        "nvmlDeviceGetAttributes_v2", lambda d: pynvml.nvmlDeviceGetAttributes(d.gpu(0)).multiprocessorCount, 108
    ),
    "SM count of an L4": Reading(
        "nvmlDeviceGetAttributes_v2", lambda d: pynvml.nvmlDeviceGetAttributes(d.gpu(2)).multiprocessorCount, 58
    ),
    "accounting off": Reading("nvmlDeviceGetAccountingMode", lambda d: pynvml.nvmlDeviceGetAccountingMode(d.gpu(0)), 0),
    # -- MIG on a whole GPU -----------------------------------------------------------------------
    "MIG mode off on an unpartitioned A100": Reading(
        "nvmlDeviceGetMigMode", lambda d: pynvml.nvmlDeviceGetMigMode(d.gpu(0)), [0, 0]
    ),
    "no MIG on an L4": Reading(
        "nvmlDeviceGetMigMode", lambda d: pynvml.nvmlDeviceGetMigMode(d.gpu(2)), pynvml.NVMLError_NotSupported
    ),
    "a whole GPU is no MIG device": Reading(
        "nvmlDeviceIsMigDeviceHandle", lambda d: pynvml.nvmlDeviceIsMigDeviceHandle(d.gpu(0)).value, 0
    ),
    "no MIG slots on an unpartitioned GPU": Reading(
        "nvmlDeviceGetMaxMigDeviceCount", lambda d: pynvml.nvmlDeviceGetMaxMigDeviceCount(d.gpu(0)), 0
    ),
    # -- readings -------------------------------------------------------------------------------
    "utilization is the sum of sm_util, capped at 100": Reading(
        "nvmlDeviceGetUtilizationRates", lambda d: pynvml.nvmlDeviceGetUtilizationRates(d.gpu(0)).gpu, 100
    ),
    "utilization of one process": Reading(
        "nvmlDeviceGetUtilizationRates", lambda d: pynvml.nvmlDeviceGetUtilizationRates(d.gpu(1)).gpu, 25
    ),
    "utilization of an idle GPU": Reading(
        "nvmlDeviceGetUtilizationRates", lambda d: pynvml.nvmlDeviceGetUtilizationRates(d.gpu(2)).gpu, 0
    ),
    "memory total": Reading(
        "nvmlDeviceGetMemoryInfo", lambda d: pynvml.nvmlDeviceGetMemoryInfo(d.gpu(0)).total, 81920 * MiB
    ),
    "memory used is the processes' sum": Reading(
        "nvmlDeviceGetMemoryInfo", lambda d: pynvml.nvmlDeviceGetMemoryInfo(d.gpu(0)).used, 3000 * MiB
    ),
    "memory free": Reading(
        "nvmlDeviceGetMemoryInfo", lambda d: pynvml.nvmlDeviceGetMemoryInfo(d.gpu(1)).free, (81920 - 4096) * MiB
    ),
    "memory v2 total and used": Reading(
        "nvmlDeviceGetMemoryInfo_v2",
        lambda d: fields_of(
            pynvml.nvmlDeviceGetMemoryInfo(d.gpu(1), version=pynvml.nvmlMemory_v2), "total", "used", "reserved"
        ),
        (81920 * MiB, 4096 * MiB, 0),
    ),
    "memory of the L4 from its model": Reading(
        "nvmlDeviceGetMemoryInfo", lambda d: pynvml.nvmlDeviceGetMemoryInfo(d.gpu(2)).total, 23034 * MiB
    ),
    "BAR1 memory": Reading(
        "nvmlDeviceGetBAR1MemoryInfo", lambda d: pynvml.nvmlDeviceGetBAR1MemoryInfo(d.gpu(0)).bar1Total, 128 * 2**30
    ),
    "temperature at full load is max_temp_c": Reading(
        "nvmlDeviceGetTemperature", lambda d: pynvml.nvmlDeviceGetTemperature(d.gpu(0), pynvml.NVML_TEMPERATURE_GPU), 90
    ),
    "temperature rises with utilization": Reading(
        "nvmlDeviceGetTemperature", lambda d: pynvml.nvmlDeviceGetTemperature(d.gpu(1), pynvml.NVML_TEMPERATURE_GPU), 45
    ),
    "temperature V on a 565+ driver": Reading(
        "nvmlDeviceGetTemperatureV",
        lambda d: pynvml.nvmlDeviceGetTemperatureV(d.gpu(1), pynvml.NVML_TEMPERATURE_GPU),
        45,
    ),
    "temperature threshold": Reading(
        "nvmlDeviceGetTemperatureThreshold",
        lambda d: pynvml.nvmlDeviceGetTemperatureThreshold(d.gpu(0), pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
        92,
    ),
    "no fan": Reading(
        "nvmlDeviceGetFanSpeed", lambda d: pynvml.nvmlDeviceGetFanSpeed(d.gpu(0)), pynvml.NVMLError_NotSupported
    ),
    "no fan v2": Reading(
        "nvmlDeviceGetFanSpeed_v2",
        lambda d: pynvml.nvmlDeviceGetFanSpeed_v2(d.gpu(0), 0),
        pynvml.NVMLError_NotSupported,
    ),
    "zero fans": Reading("nvmlDeviceGetNumFans", lambda d: pynvml.nvmlDeviceGetNumFans(d.gpu(0)), 0),
    "power at full load is the limit, in mW": Reading(
        "nvmlDeviceGetPowerUsage", lambda d: pynvml.nvmlDeviceGetPowerUsage(d.gpu(0)), 300_000
    ),
    "power rises with utilization, in mW": Reading(
        "nvmlDeviceGetPowerUsage", lambda d: pynvml.nvmlDeviceGetPowerUsage(d.gpu(1)), 150_000
    ),
    "idle power from the model, in mW": Reading(
        "nvmlDeviceGetPowerUsage", lambda d: pynvml.nvmlDeviceGetPowerUsage(d.gpu(2)), 16_000
    ),
    "enforced power limit, in mW": Reading(
        "nvmlDeviceGetEnforcedPowerLimit", lambda d: pynvml.nvmlDeviceGetEnforcedPowerLimit(d.gpu(1)), 300_000
    ),
    "power management limit": Reading(
        "nvmlDeviceGetPowerManagementLimit", lambda d: pynvml.nvmlDeviceGetPowerManagementLimit(d.gpu(2)), 72_000
    ),
    "default power limit": Reading(
        "nvmlDeviceGetPowerManagementDefaultLimit",
        lambda d: pynvml.nvmlDeviceGetPowerManagementDefaultLimit(d.gpu(1)),
        300_000,
    ),
    "power limit constraints": Reading(
        "nvmlDeviceGetPowerManagementLimitConstraints",
        lambda d: pynvml.nvmlDeviceGetPowerManagementLimitConstraints(d.gpu(1)),
        [200_000, 300_000],
    ),
    "busy GPU in P0": Reading(
        "nvmlDeviceGetPerformanceState", lambda d: pynvml.nvmlDeviceGetPerformanceState(d.gpu(1)), 0
    ),
    "idle GPU in P8": Reading("nvmlDeviceGetPowerState", lambda d: pynvml.nvmlDeviceGetPowerState(d.gpu(2)), 8),
    "no energy at t=0": Reading(
        "nvmlDeviceGetTotalEnergyConsumption", lambda d: pynvml.nvmlDeviceGetTotalEnergyConsumption(d.gpu(0)), 0
    ),
    # GPU 1 (25% busy, 45 C, 150 W of 300): nothing holds its clocks down (GPU 0 is capped).
    "graphics clock": Reading(
        "nvmlDeviceGetClockInfo", lambda d: pynvml.nvmlDeviceGetClockInfo(d.gpu(1), pynvml.NVML_CLOCK_GRAPHICS), 1410
    ),
    "max memory clock": Reading(
        "nvmlDeviceGetMaxClockInfo", lambda d: pynvml.nvmlDeviceGetMaxClockInfo(d.gpu(0), pynvml.NVML_CLOCK_MEM), 1593
    ),
    "encoder idle": Reading(
        "nvmlDeviceGetEncoderUtilization", lambda d: pynvml.nvmlDeviceGetEncoderUtilization(d.gpu(0)), [0, 167000]
    ),
    "decoder idle": Reading(
        "nvmlDeviceGetDecoderUtilization", lambda d: pynvml.nvmlDeviceGetDecoderUtilization(d.gpu(0)), [0, 167000]
    ),
    "NVLink link up": Reading(
        "nvmlDeviceGetNvLinkState", lambda d: pynvml.nvmlDeviceGetNvLinkState(d.gpu(0), 3), pynvml.NVML_FEATURE_ENABLED
    ),
    "NVLink link beyond the GPU's links": Reading(
        "nvmlDeviceGetNvLinkState",
        lambda d: pynvml.nvmlDeviceGetNvLinkState(d.gpu(0), 4),
        pynvml.NVMLError_InvalidArgument,
    ),
    "no NVLink on an L4": Reading(
        "nvmlDeviceGetNvLinkState",
        lambda d: pynvml.nvmlDeviceGetNvLinkState(d.gpu(2), 0),
        pynvml.NVMLError_NotSupported,
    ),
    "field values answer": Reading(
        "nvmlDeviceGetFieldValues",
        lambda d: [f.nvmlReturn for f in pynvml.nvmlDeviceGetFieldValues(d.gpu(0), [pynvml.NVML_FI_DEV_POWER_INSTANT])],
        [pynvml.NVML_SUCCESS],
    ),
    # -- processes ------------------------------------------------------------------------------
    "compute processes (v3)": Reading(
        "nvmlDeviceGetComputeRunningProcesses_v3",
        lambda d: pids_and_memory(pynvml.nvmlDeviceGetComputeRunningProcesses(d.gpu(0))),
        [(101, 1000 * MiB), (102, 2000 * MiB)],
    ),
    "compute processes v2": Reading(
        "nvmlDeviceGetComputeRunningProcesses_v2",
        lambda d: pids_and_memory(pynvml.nvmlDeviceGetComputeRunningProcesses_v2(d.gpu(1))),
        [(201, 4096 * MiB)],
    ),
    "no compute processes on an idle GPU": Reading(
        "nvmlDeviceGetComputeRunningProcesses_v3",
        lambda d: pynvml.nvmlDeviceGetComputeRunningProcesses(d.gpu(2)),
        [],
    ),
    "no graphics processes (v3)": Reading(
        "nvmlDeviceGetGraphicsRunningProcesses_v3", lambda d: pynvml.nvmlDeviceGetGraphicsRunningProcesses(d.gpu(0)), []
    ),
    "no graphics processes v2": Reading(
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        lambda d: pynvml.nvmlDeviceGetGraphicsRunningProcesses_v2(d.gpu(0)),
        [],
    ),
    "no MPS processes (v3)": Reading(
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        lambda d: pynvml.nvmlDeviceGetMPSComputeRunningProcesses(d.gpu(0)),
        [],
    ),
    "no MPS processes v2": Reading(
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
        lambda d: pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v2(d.gpu(0)),
        [],
    ),
    "process utilization samples": Reading(
        "nvmlDeviceGetProcessUtilization",
        lambda d: [(s.pid, s.timeStamp, s.smUtil) for s in pynvml.nvmlDeviceGetProcessUtilization(d.gpu(1), 0)],
        [(201, START_US - 201 % fake_nvml.node.PROCESS_STAMP_SPREAD_US, 25)],
    ),
    "no process utilization samples on an idle GPU": Reading(
        "nvmlDeviceGetProcessUtilization",
        lambda d: pynvml.nvmlDeviceGetProcessUtilization(d.gpu(2), 0),
        pynvml.NVMLError_NotFound,
    ),
    "device utilization samples": Reading(
        "nvmlDeviceGetSamples",
        lambda d: device_samples(d.gpu(1), 0),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, [(START_US, 25)]),
    ),
    "an idle GPU's device samples are 0, not absent": Reading(
        "nvmlDeviceGetSamples",
        lambda d: device_samples(d.gpu(2), 0),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, [(START_US, 0)]),
    ),
    "no device samples newer than the last seen": Reading(
        "nvmlDeviceGetSamples", lambda d: device_samples(d.gpu(1), START_US), pynvml.NVMLError_NotFound
    ),
    # -- MIG ------------------------------------------------------------------------------------
    "MIG mode on a partitioned GPU": Reading(
        "nvmlDeviceGetMigMode", lambda d: pynvml.nvmlDeviceGetMigMode(d.gpu(0)), [1, 1], "mig"
    ),
    "MIG mode off beside it": Reading(
        "nvmlDeviceGetMigMode", lambda d: pynvml.nvmlDeviceGetMigMode(d.gpu(1)), [0, 0], "mig"
    ),
    "seven MIG slots on an A100": Reading(
        "nvmlDeviceGetMaxMigDeviceCount", lambda d: pynvml.nvmlDeviceGetMaxMigDeviceCount(d.gpu(0)), 7, "mig"
    ),
    "MIG handle by index": Reading(
        "nvmlDeviceGetMigDeviceHandleByIndex", lambda d: uuid_of(d.mig(0, 1)), _mig_uuid(0, 1), "mig"
    ),
    "empty MIG slot": Reading(
        "nvmlDeviceGetMigDeviceHandleByIndex", lambda d: d.mig(0, 2), pynvml.NVMLError_NotFound, "mig"
    ),
    "MIG slot on an unpartitioned GPU": Reading(
        "nvmlDeviceGetMigDeviceHandleByIndex", lambda d: d.mig(1, 0), pynvml.NVMLError_InvalidArgument, "mig"
    ),
    "a MIG instance is a MIG device": Reading(
        "nvmlDeviceIsMigDeviceHandle", lambda d: pynvml.nvmlDeviceIsMigDeviceHandle(d.mig(0, 0)).value, 1, "mig"
    ),
    "MIG UUID starts with MIG-": Reading("nvmlDeviceGetUUID", lambda d: uuid_of(d.mig(0, 0))[:4], "MIG-", "mig"),
    "MIG UUID differs from its GPU's": Reading(
        "nvmlDeviceGetUUID", lambda d: uuid_of(d.mig(0, 0)) != uuid_of(d.gpu(0)), True, "mig"
    ),
    "MIG name carries the profile": Reading(
        "nvmlDeviceGetName", lambda d: pynvml.nvmlDeviceGetName(d.mig(0, 1)), "NVIDIA A100-SXM4-80GB MIG 3g.40gb", "mig"
    ),
    "handle by MIG UUID": Reading(
        "nvmlDeviceGetHandleByUUID",
        lambda d: pynvml.nvmlDeviceGetGpuInstanceId(pynvml.nvmlDeviceGetHandleByUUID(_mig_uuid(0, 1))),
        2,
        "mig",
    ),
    "MIG memory is the profile's": Reading(
        "nvmlDeviceGetMemoryInfo",
        lambda d: fields_of(pynvml.nvmlDeviceGetMemoryInfo(d.mig(0, 0)), "total", "used"),
        (40 * 1024 * MiB, 20000 * MiB),
        "mig",
    ),
    "MIG GPU memory counts every instance": Reading(
        "nvmlDeviceGetMemoryInfo", lambda d: pynvml.nvmlDeviceGetMemoryInfo(d.gpu(0)).used, 28000 * MiB, "mig"
    ),
    "MIG processes are the instance's": Reading(
        "nvmlDeviceGetComputeRunningProcesses_v3",
        lambda d: pids_and_memory(pynvml.nvmlDeviceGetComputeRunningProcesses(d.mig(0, 1))),
        [(801, 8000 * MiB)],
        "mig",
    ),
    "MIG GPU processes carry their GPU instance id": Reading(
        "nvmlDeviceGetComputeRunningProcesses_v3",
        lambda d: [(p.pid, p.gpuInstanceId) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(d.gpu(0))],
        [(800, 1), (801, 2)],
        "mig",
    ),
    "GPU instance id": Reading(
        "nvmlDeviceGetGpuInstanceId", lambda d: pynvml.nvmlDeviceGetGpuInstanceId(d.mig(0, 1)), 2, "mig"
    ),
    "no GPU instance id on a whole GPU": Reading(
        "nvmlDeviceGetGpuInstanceId",
        lambda d: pynvml.nvmlDeviceGetGpuInstanceId(d.gpu(0)),
        pynvml.NVMLError_InvalidArgument,
        "mig",
    ),
    "compute instance id": Reading(
        "nvmlDeviceGetComputeInstanceId", lambda d: pynvml.nvmlDeviceGetComputeInstanceId(d.mig(0, 1)), 0, "mig"
    ),
    "parent handle of a MIG instance": Reading(
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        lambda d: uuid_of(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(d.mig(0, 1))),
        SCENARIOS["mig"].gpus[0].uuid,
        "mig",
    ),
    "MIG SM count is the profile's slices": Reading(
        "nvmlDeviceGetAttributes_v2",
        lambda d: fields_of(
            pynvml.nvmlDeviceGetAttributes(d.mig(0, 0)), "multiprocessorCount", "gpuInstanceSliceCount", "memorySizeMB"
        ),
        (3 * 14, 3, 40960),
        "mig",
    ),
    "no utilization on a MIG GPU": Reading(
        "nvmlDeviceGetUtilizationRates",
        lambda d: pynvml.nvmlDeviceGetUtilizationRates(d.gpu(0)),
        pynvml.NVMLError_NotSupported,
        "mig",
    ),
    "no utilization on a MIG instance": Reading(
        "nvmlDeviceGetUtilizationRates",
        lambda d: pynvml.nvmlDeviceGetUtilizationRates(d.mig(0, 0)),
        pynvml.NVMLError_NotSupported,
        "mig",
    ),
    "utilization on the whole GPU beside MIG": Reading(
        "nvmlDeviceGetUtilizationRates", lambda d: pynvml.nvmlDeviceGetUtilizationRates(d.gpu(1)).gpu, 40, "mig"
    ),
    "no process samples on a MIG GPU": Reading(
        "nvmlDeviceGetProcessUtilization",
        lambda d: pynvml.nvmlDeviceGetProcessUtilization(d.gpu(0), 0),
        pynvml.NVMLError_NotSupported,
        "mig",
    ),
    "no device samples on a MIG GPU": Reading(
        "nvmlDeviceGetSamples", lambda d: device_samples(d.gpu(0), 0), pynvml.NVMLError_NotSupported, "mig"
    ),
    "no power reading per MIG instance": Reading(
        "nvmlDeviceGetPowerUsage",
        lambda d: pynvml.nvmlDeviceGetPowerUsage(d.mig(0, 0)),
        pynvml.NVMLError_NotSupported,
        "mig",
    ),
    # -- driver events (tests/test_events.py specifies delivery) --------------------------------
    "a data-centre GPU's event types: ECC errors, P-state, Xids, clocks": Reading(
        "nvmlDeviceGetSupportedEventTypes", lambda d: pynvml.nvmlDeviceGetSupportedEventTypes(d.gpu(0)), 0x1F
    ),
    "an event set with nothing pending times out, and is freed": Reading(
        "nvmlEventSetWait_v2", lambda d: _wait_on_a_new_event_set(d.gpu(0)), "timed out"
    ),
    # -- GPM (tests/test_gpm.py specifies the figures) ------------------------------------------
    "no GPM before Hopper": Reading(
        "nvmlGpmQueryDeviceSupport", lambda d: pynvml.nvmlGpmQueryDeviceSupport(d.gpu(0)).isSupportedDevice, 0
    ),
    "GPM SM activity of a Hopper GPU and of its MIG instance": Reading(
        "nvmlGpmMetricsGet", lambda d: _sm_activity(d.gpu(0)), (1, round(30 * 48 / 132, 6), 30.0), "hopper"
    ),
    # -- clocks and throttling ------------------------------------------------------------------
    # GPU 0 of `readings` runs at 100% (300 W: its limit) and 90 C (past the 89 C slowdown
    # threshold): power-capped and slowed down by hardware to half its 1410 MHz.
    "SM clock held down": Reading(
        "nvmlDeviceGetClockInfo", lambda d: pynvml.nvmlDeviceGetClockInfo(d.gpu(0), pynvml.NVML_CLOCK_SM), 705
    ),
    "reasons of a capped, hot GPU": Reading(
        "nvmlDeviceGetCurrentClocksEventReasons",
        lambda d: pynvml.nvmlDeviceGetCurrentClocksEventReasons(d.gpu(0)),
        pynvml.nvmlClocksEventReasonSwPowerCap
        | pynvml.nvmlClocksEventReasonHwSlowdown
        | pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    ),
    "idle GPU's reason, by its pre-R535 name": Reading(
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        lambda d: pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(d.gpu(2)),
        pynvml.nvmlClocksThrottleReasonGpuIdle,
    ),
    "idle L4's SM clock": Reading(
        "nvmlDeviceGetClockInfo", lambda d: pynvml.nvmlDeviceGetClockInfo(d.gpu(2), pynvml.NVML_CLOCK_SM), 210
    ),
    "idle L4's GDDR memory clock drops": Reading(
        "nvmlDeviceGetClockInfo", lambda d: pynvml.nvmlDeviceGetClockInfo(d.gpu(2), pynvml.NVML_CLOCK_MEM), 405
    ),
    "L4's maximum SM clock": Reading(
        "nvmlDeviceGetMaxClockInfo", lambda d: pynvml.nvmlDeviceGetMaxClockInfo(d.gpu(2), pynvml.NVML_CLOCK_SM), 2040
    ),
    # HBM runs at one memory clock; GDDR lists its busy and idle ones (the fake's two).
    "A100's one HBM memory clock": Reading(
        "nvmlDeviceGetSupportedMemoryClocks", lambda d: pynvml.nvmlDeviceGetSupportedMemoryClocks(d.gpu(0)), [1593]
    ),
    "L4's GDDR memory clocks": Reading(
        "nvmlDeviceGetSupportedMemoryClocks", lambda d: pynvml.nvmlDeviceGetSupportedMemoryClocks(d.gpu(2)), [6251, 405]
    ),
    "supported reasons": Reading(
        "nvmlDeviceGetSupportedClocksEventReasons",
        lambda d: pynvml.nvmlDeviceGetSupportedClocksEventReasons(d.gpu(0)),
        0x1FF,
    ),
    "supported reasons, by their pre-R535 name": Reading(
        "nvmlDeviceGetSupportedClocksThrottleReasons",
        lambda d: pynvml.nvmlDeviceGetSupportedClocksThrottleReasons(d.gpu(0)),
        0x1FF,
    ),
    "idle, and held by sync boost": Reading(
        "nvmlDeviceGetCurrentClocksEventReasons",
        lambda d: pynvml.nvmlDeviceGetCurrentClocksEventReasons(d.gpu(1)),
        pynvml.nvmlClocksEventReasonGpuIdle | pynvml.nvmlClocksEventReasonSyncBoost,
        "hardware",
    ),
    "no violation time yet at t=0": Reading(
        "nvmlDeviceGetViolationStatus",
        lambda d: pynvml.nvmlDeviceGetViolationStatus(d.gpu(1), pynvml.NVML_PERF_POLICY_SYNC_BOOST).violationTime,
        0,
        "hardware",
    ),
    # RTX A6000 at 50%: 32 C idle + (83 - 32) x 0.5 = 57.5 C, half way up: 30% + 60% x 0.5
    "a fan follows temperature": Reading(
        "nvmlDeviceGetFanSpeed", lambda d: pynvml.nvmlDeviceGetFanSpeed(d.gpu(3)), 60, "hardware"
    ),
    "one fan's speed": Reading(
        "nvmlDeviceGetFanSpeed_v2", lambda d: pynvml.nvmlDeviceGetFanSpeed_v2(d.gpu(3), 0), 60, "hardware"
    ),
    "one fan": Reading("nvmlDeviceGetNumFans", lambda d: pynvml.nvmlDeviceGetNumFans(d.gpu(3)), 1, "hardware"),
    "the encoder's load": Reading(
        "nvmlDeviceGetEncoderUtilization",
        lambda d: pynvml.nvmlDeviceGetEncoderUtilization(d.gpu(3)),
        [45, 167000],
        "hardware",
    ),
    "the decoder's load": Reading(
        "nvmlDeviceGetDecoderUtilization",
        lambda d: pynvml.nvmlDeviceGetDecoderUtilization(d.gpu(3)),
        [30, 167000],
        "hardware",
    ),
    # -- memory errors --------------------------------------------------------------------------
    "ECC on": Reading("nvmlDeviceGetEccMode", lambda d: pynvml.nvmlDeviceGetEccMode(d.gpu(0)), [1, 1], "hardware"),
    "uncorrected ECC errors": Reading(
        "nvmlDeviceGetTotalEccErrors",
        lambda d: pynvml.nvmlDeviceGetTotalEccErrors(
            d.gpu(0), pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
        ),
        2,
        "hardware",
    ),
    "corrected ECC errors over the board's life": Reading(
        "nvmlDeviceGetTotalEccErrors",
        lambda d: pynvml.nvmlDeviceGetTotalEccErrors(
            d.gpu(0), pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC
        ),
        5,
        "hardware",
    ),
    "rows remapped, pending": Reading(
        "nvmlDeviceGetRemappedRows", lambda d: pynvml.nvmlDeviceGetRemappedRows(d.gpu(0)), (1, 2, 1, 0), "hardware"
    ),
    "a remap that failed": Reading(
        "nvmlDeviceGetRemappedRows", lambda d: pynvml.nvmlDeviceGetRemappedRows(d.gpu(1)), (0, 0, 0, 1), "hardware"
    ),
    "no row remapping before Ampere": Reading(
        "nvmlDeviceGetRemappedRows",
        lambda d: pynvml.nvmlDeviceGetRemappedRows(d.gpu(2)),
        pynvml.NVMLError_NotSupported,
        "hardware",
    ),
    "pages retired for double-bit errors": Reading(
        "nvmlDeviceGetRetiredPages",
        lambda d: len(
            pynvml.nvmlDeviceGetRetiredPages(d.gpu(2), pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        ),
        3,
        "hardware",
    ),
    "no page retired for single-bit errors": Reading(
        "nvmlDeviceGetRetiredPages_v2",
        lambda d: pynvml.nvmlDeviceGetRetiredPages_v2(
            d.gpu(2), pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
        ),
        [],
        "hardware",
    ),
    "page retirement pending": Reading(
        "nvmlDeviceGetRetiredPagesPendingStatus",
        lambda d: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(d.gpu(2)),
        1,
        "hardware",
    ),
    "no page retirement from Ampere on": Reading(
        "nvmlDeviceGetRetiredPagesPendingStatus",
        lambda d: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(d.gpu(0)),
        pynvml.NVMLError_NotSupported,
        "hardware",
    ),
    # -- PCIe -----------------------------------------------------------------------------------
    "a link trained down: generation": Reading(
        "nvmlDeviceGetCurrPcieLinkGeneration",
        lambda d: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(d.gpu(0)),
        2,
        "hardware",
    ),
    "a link trained down: width": Reading(
        "nvmlDeviceGetCurrPcieLinkWidth", lambda d: pynvml.nvmlDeviceGetCurrPcieLinkWidth(d.gpu(0)), 4, "hardware"
    ),
    "the link's maximum generation": Reading(
        "nvmlDeviceGetMaxPcieLinkGeneration",
        lambda d: pynvml.nvmlDeviceGetMaxPcieLinkGeneration(d.gpu(0)),
        4,
        "hardware",
    ),
    "the GPU's maximum generation": Reading(
        "nvmlDeviceGetGpuMaxPcieLinkGeneration",
        lambda d: pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration(d.gpu(2)),
        3,
        "hardware",
    ),
    "the link's maximum width": Reading(
        "nvmlDeviceGetMaxPcieLinkWidth", lambda d: pynvml.nvmlDeviceGetMaxPcieLinkWidth(d.gpu(0)), 16, "hardware"
    ),
    "PCIe replays": Reading(
        "nvmlDeviceGetPcieReplayCounter", lambda d: pynvml.nvmlDeviceGetPcieReplayCounter(d.gpu(0)), 7, "hardware"
    ),
    # 40% of 2 GB/s to the GPU, half that back: KiB/s
    "PCIe traffic to the GPU": Reading(
        "nvmlDeviceGetPcieThroughput",
        lambda d: pynvml.nvmlDeviceGetPcieThroughput(d.gpu(0), pynvml.NVML_PCIE_UTIL_RX_BYTES),
        round(0.4 * 2e9 / 1024),
        "hardware",
    ),
    # -- NVLink ---------------------------------------------------------------------------------
    "NVLink CRC errors": Reading(
        "nvmlDeviceGetNvLinkErrorCounter",
        lambda d: pynvml.nvmlDeviceGetNvLinkErrorCounter(d.gpu(0), 1, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
        11,
        "hardware",
    ),
    "NVLink replays and recoveries": Reading(
        "nvmlDeviceGetNvLinkErrorCounter",
        lambda d: [
            pynvml.nvmlDeviceGetNvLinkErrorCounter(d.gpu(0), link, counter)
            for link in (0, 1)
            for counter in (pynvml.NVML_NVLINK_ERROR_DL_REPLAY, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY)
        ],
        [0, 0, 3, 1],
        "hardware",
    ),
    "no NVLink error counter beyond the GPU's links": Reading(
        "nvmlDeviceGetNvLinkErrorCounter",
        lambda d: pynvml.nvmlDeviceGetNvLinkErrorCounter(d.gpu(0), 4, pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
        pynvml.NVMLError_InvalidArgument,
        "hardware",
    ),
    # The health counters as fields: ECC (3-6), PCIe replays (94), remapped rows (142-145), the
    # NVLink errors of link 1 scoped by link (163 CRC, 161 replay, 162 recovery) and by the
    # R4xx per-link ids (33, 47, 54), and retired pages (29), which an A100 does not have.
    "health fields": Reading(
        "nvmlDeviceGetFieldValues",
        lambda d: [
            (
                v.fieldId,
                v.nvmlReturn,
                v.value.ullVal if v.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG else v.value.uiVal,
            )
            for v in pynvml.nvmlDeviceGetFieldValues(
                d.gpu(0), [3, 4, 5, 6, 94, 142, 143, 144, 145, (163, 1), (161, 1), (162, 1), 33, 47, 54, 29]
            )
        ],
        [
            (3, 0, 5),
            (4, 0, 2),
            (5, 0, 5),
            (6, 0, 2),
            (94, 0, 7),
            (142, 0, 1),
            (143, 0, 2),
            (144, 0, 1),
            (145, 0, 0),
            (163, 0, 11),
            (161, 0, 3),
            (162, 0, 1),
            (33, 0, 11),
            (47, 0, 3),
            (54, 0, 1),
            (29, pynvml.NVML_ERROR_NOT_SUPPORTED, 0),
        ],
        "hardware",
    ),
}


def device_samples(handle: Any, last_seen_us: int) -> tuple[int, list[tuple[int, int]]]:
    """nvmlDeviceGetSamples of GPU utilization, as (value type, [(timestamp, percent)])."""
    kind, found = pynvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, last_seen_us)
    return kind, [(sample.timeStamp, sample.sampleValue.uiVal) for sample in found]


def _sm_activity(handle: Any) -> tuple[int, float, float]:
    """GPM support, then the SM activity of the GPU and of GPU instance 1, from two samples each."""
    supported = pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice
    found = []
    for instance in (None, 1):
        samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
        for sample in samples:
            if instance is None:
                pynvml.nvmlGpmSampleGet(handle, sample)
            else:
                pynvml.nvmlGpmMigSampleGet(handle, instance, sample)
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version, request.numMetrics = pynvml.NVML_GPM_METRICS_GET_VERSION, 1
        request.sample1, request.sample2 = samples
        request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
        pynvml.nvmlGpmMetricsGet(request)
        found.append(round(request.metrics[0].value, 6))
        for sample in samples:
            pynvml.nvmlGpmSampleFree(sample)
    return supported, found[0], found[1]


def _wait_on_a_new_event_set(handle: Any) -> str:
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    try:
        pynvml.nvmlEventSetWait_v2(event_set, 0)
    except pynvml.NVMLError_Timeout:
        return "timed out"
    finally:
        pynvml.nvmlEventSetFree(event_set)
    return "an event"


def _expects_error(expected: object) -> bool:
    return isinstance(expected, type) and issubclass(expected, pynvml.NVMLError)


def _check(reading: Reading) -> None:
    devices = Devices()
    if _expects_error(reading.expected):
        with pytest.raises(reading.expected):
            reading.call(devices)
    else:
        assert reading.call(devices) == reading.expected


@pytest.mark.parametrize("reading", READING_TABLE.values(), ids=READING_TABLE.keys())
def test_each_wrapper_returns_the_scenario_value(install_fake: InstallFake, reading: Reading) -> None:
    node = install_fake(SCENARIOS[reading.scenario])
    _check(reading)
    # The wrapper reached the C function the row names (and not some other route).
    assert node.calls[reading.c_function] >= 1


class ProcessInfoV1(ctypes.Structure):
    """nvmlProcessInfo_v1_t, which pynvml no longer defines: what the unversioned symbol fills."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


def call_symbols_without_wrappers() -> dict[str, object]:
    """Call the C symbols pynvml has no wrapper for, as a C caller would."""
    fn = pynvml._nvmlGetFunctionPointer
    device = pynvml.nvmlDeviceGetHandleByIndex(0)
    results: dict[str, object] = {"nvmlInit_v2": fn("nvmlInit_v2")()}
    count = ctypes.c_uint(0)
    first = fn("nvmlDeviceGetComputeRunningProcesses")(device, ctypes.byref(count), None)
    infos = (ProcessInfoV1 * 8)()
    count.value = 8
    second = fn("nvmlDeviceGetComputeRunningProcesses")(device, ctypes.byref(count), infos)
    results["nvmlDeviceGetComputeRunningProcesses"] = (
        first,
        second,
        [(infos[i].pid, infos[i].usedGpuMemory) for i in range(count.value)],
    )
    for name in ("nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
        other = ctypes.c_uint(9)
        results[name] = (fn(name)(device, ctypes.byref(other), None), other.value)
    return results


def test_symbols_pynvml_does_not_wrap_answer_like_the_c_library(install_fake: InstallFake) -> None:
    install_fake(SCENARIOS["readings"])
    assert call_symbols_without_wrappers() == {
        "nvmlInit_v2": pynvml.NVML_SUCCESS,
        # the size query says how many, then the filled array holds them
        "nvmlDeviceGetComputeRunningProcesses": (
            pynvml.NVML_ERROR_INSUFFICIENT_SIZE,
            pynvml.NVML_SUCCESS,
            [(101, 1000 * MiB), (102, 2000 * MiB)],
        ),
        "nvmlDeviceGetGraphicsRunningProcesses": (pynvml.NVML_SUCCESS, 0),
        "nvmlDeviceGetMPSComputeRunningProcesses": (pynvml.NVML_SUCCESS, 0),
    }


def test_every_implemented_function_is_exercised_by_this_suite() -> None:
    seen: Counter[str] = Counter()
    for scenario in sorted({r.scenario for r in READING_TABLE.values()}):
        node = fake_nvml.install(SCENARIOS[scenario])
        try:
            pynvml.nvmlInit()
            for reading in READING_TABLE.values():
                if reading.scenario == scenario:
                    _check(reading)
            call_symbols_without_wrappers()
            pynvml.nvmlShutdown()
            seen.update(node.calls)
        finally:
            fake_nvml.uninstall()
    assert sorted(set(fake_nvml.implemented_functions()) - set(seen)) == []


def test_a_handle_the_fake_did_not_make_is_an_invalid_argument(install_fake: InstallFake) -> None:
    install_fake(SCENARIOS["readings"])
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetName(pynvml.c_nvmlDevice_t())


def test_uuids_and_bus_ids_are_distinct_per_gpu(install_fake: InstallFake) -> None:
    install_fake("demo")
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    uuids = [uuid_of(h) for h in handles]
    bus_ids = [pynvml.nvmlDeviceGetPciInfo(h).busId for h in handles]
    assert len(set(uuids)) == len(set(bus_ids)) == 8
    assert all(re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", u) for u in uuids)


def test_energy_is_the_integral_of_power(install_fake: InstallFake) -> None:
    node = install_fake(
        node_with(
            gpus=[{"model": "A100-SXM4-80GB", "power_limit_w": 300, "idle_power_w": 100}],
            processes=[
                {"pid": 10, "gpus": [0], "sm_util": 10},
                {
                    "pid": 11,
                    "gpus": [0],
                    "start": "10s",
                    "end": "40s",
                    # segment times count from the process's start: 50% for 10..30 s, 25% for 30..40 s
                    "sm_util": [{"at": "0s", "sm_util": 50}, {"at": "20s", "sm_util": 25}],
                },
            ],
        )
    )
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    # power = 100 W + 200 W * util / 100:
    #    0..10 s  util 10       -> 120 W * 10 s = 1200 J
    #   10..30 s  util 10 + 50  -> 220 W * 20 s = 4400 J
    #   30..40 s  util 10 + 25  -> 170 W * 10 s = 1700 J
    #   40..60 s  util 10 (pid 11 ended) -> 120 W * 20 s = 2400 J
    # at 25 s: 1200 + 15 * 220 = 4500 J; at 60 s: 1200 + 4400 + 1700 + 2400 = 9700 J
    readings = []
    for step in (5, 10, 10, 5, 10, 20):  # t = 5, 15, 25, 30, 40, 60
        node.clock.advance(step)
        readings.append(
            (
                pynvml.nvmlDeviceGetUtilizationRates(gpu).gpu,
                pynvml.nvmlDeviceGetPowerUsage(gpu),
                pynvml.nvmlDeviceGetTotalEnergyConsumption(gpu),
            )
        )
    assert readings == [
        (10, 120_000, 600_000),  # 120 W * 5 s
        (60, 220_000, 2_300_000),  # 1200 + 220 * 5
        (60, 220_000, 4_500_000),
        (35, 170_000, 5_600_000),  # 1200 + 4400
        (10, 120_000, 7_300_000),  # 1200 + 4400 + 1700
        (10, 120_000, 9_700_000),
    ]
    (field,) = pynvml.nvmlDeviceGetFieldValues(gpu, [pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION])
    assert (field.nvmlReturn, field.value.ullVal) == (pynvml.NVML_SUCCESS, 9_700_000)


def test_energy_does_not_depend_on_how_often_it_was_read(install_fake: InstallFake) -> None:
    spec = node_with(
        processes=[{"pid": 1, "gpus": [0], "end": "90m", "sm_util": [{"sm_util": 80}, {"at": "1h", "sm_util": 30}]}]
    )
    node = install_fake(spec)
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    for _ in range(36):
        node.clock.advance(300)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(gpu)
    often = pynvml.nvmlDeviceGetTotalEnergyConsumption(gpu)
    fake_nvml.uninstall()

    node = install_fake(spec)
    node.clock.advance(3 * 3600)
    once = pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(0))
    # A100 defaults: 55 W idle, 400 W limit; 80% for 1 h, 30% for 30 min, idle for 1.5 h
    expected_j = (55 + 345 * 0.8) * 3600 + (55 + 345 * 0.3) * 1800 + 55 * 5400
    assert often == once == pytest.approx(expected_j * 1000, abs=1)


def test_field_values_carry_power_energy_and_nvlink_state(install_fake: InstallFake) -> None:
    node = install_fake(SCENARIOS["readings"])
    node.clock.advance(10)
    gpu = pynvml.nvmlDeviceGetHandleByIndex(1)
    fields = pynvml.nvmlDeviceGetFieldValues(
        gpu,
        [
            pynvml.NVML_FI_DEV_POWER_INSTANT,
            pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
            (pynvml.NVML_FI_DEV_NVLINK_GET_STATE, 3),
            pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT,
            (pynvml.NVML_FI_DEV_NVLINK_GET_STATE, 4),
            9999,
        ],
    )
    ok = pynvml.NVML_SUCCESS
    assert [(f.fieldId, f.nvmlReturn) for f in fields] == [
        (186, ok),
        (83, ok),
        (165, ok),
        (pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, ok),
        (165, pynvml.NVML_ERROR_INVALID_ARGUMENT),  # the GPU has links 0..3
        (9999, pynvml.NVML_ERROR_NOT_SUPPORTED),
    ]
    power, energy, link3, links = fields[0], fields[1], fields[2], fields[3]
    assert power.value.uiVal == 150_000  # mW
    assert energy.value.ullVal == 1_500_000  # 150 W * 10 s = 1500 J, in mJ
    assert (link3.scopeId, link3.value.uiVal) == (3, pynvml.NVML_FEATURE_ENABLED)
    assert links.value.uiVal == 4
    assert {f.timestamp for f in fields} == {START_US + 10_000_000}


def test_field_values_on_a_mig_instance_answer_only_what_an_instance_has(install_fake: InstallFake) -> None:
    install_fake(SCENARIOS["mig"])
    instance = Devices().mig(0, 0)
    fields = pynvml.nvmlDeviceGetFieldValues(instance, [186, 83, (165, 0)])
    assert [f.nvmlReturn for f in fields] == [pynvml.NVML_ERROR_NOT_SUPPORTED] * 3


# -- the device's own utilization samples -----------------------------------------------------


def test_device_samples_follow_the_processes_and_keep_the_periods_without_work(install_fake: InstallFake) -> None:
    # GPU 0 runs pid 1 at 40% from 2 s to 4 s and pid 2 at 70% from 3 s on; the poll is at 5 s.
    # One sample a second, 0% included, each the running processes' percents summed (capped
    # at 100): t=0,1 -> 0; 2 -> 40; 3 -> 40 + 70 = 110, capped 100; 4 -> 70 (pid 1 ended at 4 s,
    # yet its periods are still in the device's samples); 5 -> 70.
    node = install_fake(
        node_with(
            processes=[
                {"pid": 1, "gpus": [0], "start": "2s", "end": "4s", "sm_util": 40},
                {"pid": 2, "gpus": [0], "start": "3s", "sm_util": 70},
            ]
        )
    )
    node.clock.advance(5)
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    second = 1_000_000
    kind, found = device_samples(gpu, 0)
    assert kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert found == [(START_US + k * second, util) for k, util in enumerate([0, 0, 40, 100, 70, 70])]
    # Since the last one seen, as the per-process samples; none newer is NOT_FOUND.
    assert device_samples(gpu, START_US + 3 * second)[1] == [(START_US + 4 * second, 70), (START_US + 5 * second, 70)]
    with pytest.raises(pynvml.NVMLError_NotFound):
        device_samples(gpu, START_US + 5 * second)
    # The ring keeps the newest 120: an hour on, the oldest sample is 119 s back.
    node.clock.advance(3600)
    stamps = [stamp for stamp, _ in device_samples(gpu, 0)[1]]
    assert (len(stamps), stamps[0], stamps[-1]) == (120, START_US + 3486 * second, START_US + 3605 * second)


# -- per-process utilization samples ----------------------------------------------------------

SAMPLED = node_with(
    processes=[
        {"pid": 20, "gpus": [0], "sm_util": 30},
        # starts at 3 s; 50% for its first two seconds, then 80%
        {"pid": 21, "gpus": [0], "start": "3s", "sm_util": [{"at": "0s", "sm_util": 50}, {"at": "2s", "sm_util": 80}]},
        {"pid": 22, "gpus": [0], "sm_util": 0, "memory_mib": 100},  # idle: the driver keeps no sample
    ]
)


def samples(gpu: int, last_seen_us: int) -> set[tuple[int, int, int]]:
    found = pynvml.nvmlDeviceGetProcessUtilization(pynvml.nvmlDeviceGetHandleByIndex(gpu), last_seen_us)
    return {(s.pid, s.timeStamp, s.smUtil) for s in found}


def stamp(pid: int, second: int) -> int:
    """A process's sample at scenario second `second`: a whole second, less the process's own
    offset (each process is stamped when the driver records it, not at one shared instant)."""
    return START_US + second * 1_000_000 - pid % fake_nvml.node.PROCESS_STAMP_SPREAD_US


def test_process_samples_are_stamped_in_wall_clock_microseconds(install_fake: InstallFake) -> None:
    node = install_fake(SAMPLED)
    node.clock.advance(6)
    assert samples(0, 0) == {(20, stamp(20, k), 30) for k in range(7)} | {
        (21, stamp(21, 3), 50),
        (21, stamp(21, 4), 50),
        (21, stamp(21, 5), 80),
        (21, stamp(21, 6), 80),
    }
    # two processes' samples of one period are stamped apart, as on a real GPU
    assert stamp(20, 6) - stamp(21, 6) == 1


def test_process_samples_are_only_those_newer_than_last_seen(install_fake: InstallFake) -> None:
    node = install_fake(SAMPLED)
    node.clock.advance(6)
    assert samples(0, START_US + 4 * 1_000_000) == {
        (20, stamp(20, 5), 30),
        (20, stamp(20, 6), 30),
        (21, stamp(21, 5), 80),
        (21, stamp(21, 6), 80),
    }
    # Between two processes' stamps of one period: only the later of them is newer.
    assert samples(0, stamp(21, 6)) == {(20, stamp(20, 6), 30)}
    with pytest.raises(pynvml.NVMLError_NotFound):
        samples(0, stamp(20, 6))
    node.clock.advance(1)
    assert samples(0, stamp(20, 6)) == {(20, stamp(20, 7), 30), (21, stamp(21, 7), 80)}


def test_process_samples_not_found_on_a_gpu_without_processes(install_fake: InstallFake) -> None:
    install_fake(SAMPLED)
    with pytest.raises(pynvml.NVMLError_NotFound):
        samples(1, 0)


def test_the_driver_keeps_only_the_newest_process_samples(install_fake: InstallFake) -> None:
    node = install_fake(SAMPLED)
    node.clock.advance(100)
    stamps = sorted(stamp for pid, stamp, _ in samples(0, 0) if pid == 20)
    assert len(stamps) == fake_nvml.node.PROCESS_SAMPLES_KEPT
    assert stamps[-1] == stamp(20, 100)
    assert stamps[0] == stamp(20, 100 - fake_nvml.node.PROCESS_SAMPLES_KEPT + 1)


def test_processes_come_and_go_with_the_clock(install_fake: InstallFake) -> None:
    node = install_fake(
        node_with(
            processes=[
                {"pid": 30, "gpus": [0], "start": "1h", "end": "2h", "sm_util": 50, "memory_mib": 512},
                {"pid": 30, "gpus": [0], "start": "3h", "sm_util": 20, "memory_mib": 256},  # the pid, reused
            ]
        )
    )
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)

    def seen() -> tuple[list[tuple[int, int]], int, int]:
        return (
            pids_and_memory(pynvml.nvmlDeviceGetComputeRunningProcesses(gpu)),
            pynvml.nvmlDeviceGetMemoryInfo(gpu).used,
            pynvml.nvmlDeviceGetUtilizationRates(gpu).gpu,
        )

    timeline = []
    for step in (0, 3600, 3599, 1, 3600):  # t = 0, 1h, 2h - 1s, 2h, 3h
        node.clock.advance(step)
        timeline.append(seen())
    assert timeline == [
        ([], 0, 0),
        ([(30, 512 * MiB)], 512 * MiB, 50),
        ([(30, 512 * MiB)], 512 * MiB, 50),
        ([], 0, 0),  # `end` is exclusive
        ([(30, 256 * MiB)], 256 * MiB, 20),
    ]


# ---------------------------------------------------------------------------------------------
# 2. Faults
# ---------------------------------------------------------------------------------------------

ERROR_CLASSES = {
    "GPU_IS_LOST": pynvml.NVMLError_GpuIsLost,
    "NOT_SUPPORTED": pynvml.NVMLError_NotSupported,
    "TIMEOUT": pynvml.NVMLError_Timeout,
    "UNKNOWN": pynvml.NVMLError_Unknown,
    "NO_PERMISSION": pynvml.NVMLError_NoPermission,
    "DRIVER_NOT_LOADED": pynvml.NVMLError_DriverNotLoaded,
}


@pytest.mark.parametrize("error", ERROR_CLASSES)
def test_a_fault_raises_the_real_pynvml_error_class(install_fake: InstallFake, error: str) -> None:
    install_fake(node_with(faults=[{"gpu": 1, "call": "nvmlDeviceGetTemperature", "error": error}]))
    gpu0, gpu1 = Devices.gpu(0), Devices.gpu(1)
    with pytest.raises(ERROR_CLASSES[error]) as raised:
        pynvml.nvmlDeviceGetTemperature(gpu1, pynvml.NVML_TEMPERATURE_GPU)
    assert raised.value.value == getattr(pynvml, f"NVML_ERROR_{error}")
    # the fault names one call on one GPU: the same call elsewhere and other calls there work
    assert pynvml.nvmlDeviceGetTemperature(gpu0, pynvml.NVML_TEMPERATURE_GPU) == 32
    assert pynvml.nvmlDeviceGetPowerUsage(gpu1) == 55_000


def test_every_scenario_error_name_is_an_nvml_return_code() -> None:
    from fake_nvml.scenario import ERROR_CODES

    assert {name: getattr(pynvml, f"NVML_ERROR_{name}", None) for name in ERROR_CODES} == ERROR_CODES


def test_a_fault_holds_from_at_until_until(install_fake: InstallFake) -> None:
    node = install_fake(
        node_with(faults=[{"at": "1h", "until": "2h", "gpu": 0, "call": "nvmlDeviceGetPowerUsage", "error": "TIMEOUT"}])
    )
    gpu = Devices.gpu(0)

    def fails() -> bool:
        try:
            pynvml.nvmlDeviceGetPowerUsage(gpu)
        except pynvml.NVMLError_Timeout:
            return True
        return False

    timeline = []
    for step in (0, 3599, 1, 3599, 1, 86400):  # t = 0, 1h - 1s, 1h, 2h - 1s, 2h, 26h
        node.clock.advance(step)
        timeline.append(fails())
    assert timeline == [False, False, True, True, False, False]


def test_a_fault_on_an_unversioned_name_hits_every_version_on_every_gpu(install_fake: InstallFake) -> None:
    node = install_fake(
        node_with(
            faults=[{"at": "1h", "until": "2h", "call": "nvmlDeviceGetComputeRunningProcesses", "error": "TIMEOUT"}]
        )
    )
    gpus = [Devices.gpu(0), Devices.gpu(1)]
    assert [pynvml.nvmlDeviceGetComputeRunningProcesses(g) for g in gpus] == [[], []]
    node.clock.advance(3600)
    for gpu in gpus:
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlDeviceGetComputeRunningProcesses(gpu)
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlDeviceGetComputeRunningProcesses_v2(gpu)
        assert pynvml.nvmlDeviceGetMemoryInfo(gpu).used == 0


def test_a_fault_on_a_call_also_fails_the_matching_field(install_fake: InstallFake) -> None:
    install_fake(node_with(faults=[{"gpu": 0, "call": "nvmlDeviceGetPowerUsage", "error": "NOT_SUPPORTED"}]))
    power, energy = pynvml.nvmlDeviceGetFieldValues(Devices.gpu(0), [186, 83])
    assert (power.nvmlReturn, energy.nvmlReturn) == (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_SUCCESS)


LOST_GPU_CALLS: dict[str, Callable[[Any], object]] = {
    "name": pynvml.nvmlDeviceGetName,
    "uuid": pynvml.nvmlDeviceGetUUID,
    "memory": pynvml.nvmlDeviceGetMemoryInfo,
    "power": pynvml.nvmlDeviceGetPowerUsage,
    "energy": pynvml.nvmlDeviceGetTotalEnergyConsumption,
    "temperature": lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
    "utilization": pynvml.nvmlDeviceGetUtilizationRates,
    "processes": pynvml.nvmlDeviceGetComputeRunningProcesses,
    "nvlink": lambda h: pynvml.nvmlDeviceGetNvLinkState(h, 0),
    "fields": lambda h: pynvml.nvmlDeviceGetFieldValues(h, [186]),
}


def test_a_lost_gpu_stays_lost_and_the_others_keep_working(install_fake: InstallFake) -> None:
    node = install_fake("gpu-lost")  # GPU 1 lost at 10m
    gpus = [Devices.gpu(i) for i in range(4)]
    node.clock.advance(599)
    for call in LOST_GPU_CALLS.values():
        call(gpus[1])
    for step in (1, 100 * 3600):  # the moment it is lost, and long after
        node.clock.advance(step)
        for what, call in LOST_GPU_CALLS.items():
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                call(gpus[1])
            for other in (0, 2, 3):
                assert call(gpus[other]) is not None, what
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            Devices.gpu(1)
        assert pynvml.nvmlDeviceGetCount() == 4  # the driver still counts it
    assert node.xids(1, 0, 3600) == [(600.0, 79)]


def test_a_lost_gpu_with_until_comes_back(install_fake: InstallFake) -> None:
    node = install_fake(node_with(faults=[{"at": "10m", "until": "20m", "gpu": 1, "error": "GPU_IS_LOST"}]))
    gpu = Devices.gpu(1)
    node.clock.advance(600)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetPowerUsage(gpu)
    node.clock.advance(600)
    assert pynvml.nvmlDeviceGetPowerUsage(gpu) == 55_000


def test_nvlink_down_holds_for_its_window_on_its_links_only(install_fake: InstallFake) -> None:
    node = install_fake(node_with(faults=[{"at": "5h", "until": "6h", "gpu": 0, "nvlink_down": [3]}]))
    gpu0, gpu1 = Devices.gpu(0), Devices.gpu(1)

    def states() -> tuple[int, int, int, int]:
        (field,) = pynvml.nvmlDeviceGetFieldValues(gpu0, [(pynvml.NVML_FI_DEV_NVLINK_GET_STATE, 3)])
        return (
            pynvml.nvmlDeviceGetNvLinkState(gpu0, 3),
            field.value.uiVal,
            pynvml.nvmlDeviceGetNvLinkState(gpu0, 2),
            pynvml.nvmlDeviceGetNvLinkState(gpu1, 3),
        )

    timeline = []
    for step in (0, 5 * 3600, 3599, 1):  # t = 0, 5h, 6h - 1s, 6h
        node.clock.advance(step)
        timeline.append(states())
    up, down = pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_DISABLED
    assert timeline == [(up, up, up, up), (down, down, up, up), (down, down, up, up), (up, up, up, up)]


@pytest.mark.parametrize(
    ("fault", "call"),
    [
        pytest.param({"call": "*", "latency_ms": 30}, pynvml.nvmlDeviceGetCount, id="every call"),
        pytest.param(
            {"call": "nvmlDeviceGetPowerUsage", "latency_ms": 30},
            lambda: pynvml.nvmlDeviceGetPowerUsage(Devices.gpu(0)),
            id="one call",
        ),
    ],
)
def test_latency_makes_calls_take_at_least_that_long(
    install_fake: InstallFake, fault: dict[str, Any], call: Callable[[], object]
) -> None:
    install_fake(node_with(faults=[fault]))
    started = time.perf_counter()
    call()
    assert time.perf_counter() - started >= 0.030


def test_a_star_fault_without_a_gpu_fails_every_call(install_fake: InstallFake) -> None:
    node = install_fake(node_with(faults=[{"at": "1h", "call": "*", "error": "DRIVER_NOT_LOADED"}]))
    gpus = [Devices.gpu(0), Devices.gpu(1)]
    uuid = uuid_of(gpus[0])
    calls: list[Callable[[], object]] = [
        pynvml.nvmlDeviceGetCount,
        pynvml.nvmlSystemGetDriverVersion,
        lambda: Devices.gpu(0),
        lambda: pynvml.nvmlDeviceGetHandleByUUID(uuid),
        *[lambda g=g: pynvml.nvmlDeviceGetPowerUsage(g) for g in gpus],
        *[lambda g=g: pynvml.nvmlDeviceGetMemoryInfo(g) for g in gpus],
    ]
    for call in calls:
        call()
    node.clock.advance(3600)
    for call in calls:
        with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
            call()


def test_a_star_fault_on_a_gpu_fails_every_call_on_that_gpu_only(install_fake: InstallFake) -> None:
    install_fake(node_with(faults=[{"gpu": 1, "call": "*", "error": "UNKNOWN"}]))
    gpu0 = Devices.gpu(0)
    for call in LOST_GPU_CALLS.values():
        call(gpu0)
    with pytest.raises(pynvml.NVMLError_Unknown):
        Devices.gpu(1)
    assert pynvml.nvmlDeviceGetCount() == 2
    assert pynvml.nvmlSystemGetDriverVersion() == "550.54.15"


def test_a_fault_on_nvml_init_fails_init_like_a_missing_driver(install_fake: InstallFake) -> None:
    install_fake(node_with(faults=[{"call": "nvmlInit", "error": "DRIVER_NOT_LOADED"}]), init=False)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


# ---------------------------------------------------------------------------------------------
# 3. Driver profiles
# ---------------------------------------------------------------------------------------------


def test_an_r470_driver_has_no_v3_process_call_but_v2_works(install_fake: InstallFake) -> None:
    node = install_fake("old-driver")
    gpu = Devices.gpu(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetComputeRunningProcesses_v3(gpu)
    # pynvml's unversioned wrapper calls _v3 and reports the missing symbol as a library mismatch
    with pytest.raises(pynvml.NVMLLibraryMismatchError) as raised:
        pynvml.nvmlDeviceGetComputeRunningProcesses(gpu)
    assert isinstance(raised.value.__context__, pynvml.NVMLError_FunctionNotFound)
    assert pids_and_memory(pynvml.nvmlDeviceGetComputeRunningProcesses_v2(gpu)) == [(900, 12000 * MiB)]
    assert node.library.missing_lookups["nvmlDeviceGetComputeRunningProcesses_v3"] >= 1


def test_an_r470_driver_has_only_the_old_memory_temperature_and_field_calls(install_fake: InstallFake) -> None:
    install_fake("old-driver")
    gpu = Devices.gpu(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetMemoryInfo(gpu, version=pynvml.nvmlMemory_v2)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetTemperatureV(gpu, pynvml.NVML_TEMPERATURE_GPU)
    assert pynvml.nvmlDeviceGetMemoryInfo(gpu).used == 12000 * MiB
    assert pynvml.nvmlDeviceGetTemperature(gpu, pynvml.NVML_TEMPERATURE_GPU) == round(32 + (83 - 32) * 0.6)
    # instant power arrived with the R530 fields; total energy is older
    power, energy = pynvml.nvmlDeviceGetFieldValues(gpu, [186, 83])
    assert (power.nvmlReturn, energy.nvmlReturn) == (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_SUCCESS)


@pytest.mark.parametrize(
    ("call", "older", "newer"),
    [
        pytest.param(
            lambda g: pynvml.nvmlDeviceGetTemperatureV(g, pynvml.NVML_TEMPERATURE_GPU),
            "560.35.03",
            "565.57.01",
            id="temperature V from R565",
        ),
        pytest.param(
            lambda g: pynvml.nvmlDeviceGetMemoryInfo(g, version=pynvml.nvmlMemory_v2),
            "470.82.01",
            "510.47.03",
            id="memory info v2 from R510",
        ),
        pytest.param(
            pynvml.nvmlDeviceGetComputeRunningProcesses_v3, "470.82.01", "510.47.03", id="processes v3 from R510"
        ),
        pytest.param(
            pynvml.nvmlDeviceGetComputeRunningProcesses_v2, "460.32.03", "470.82.01", id="processes v2 from R470"
        ),
    ],
)
def test_a_versioned_symbol_exists_from_the_driver_that_shipped_it(
    install_fake: InstallFake, call: Callable[[Any], object], older: str, newer: str
) -> None:
    install_fake(node_with(node={"driver_version": older}))
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        call(Devices.gpu(0))
    fake_nvml.uninstall()
    install_fake(node_with(node={"driver_version": newer}))
    assert call(Devices.gpu(0)) is not None


def test_missing_functions_hides_any_named_function(install_fake: InstallFake) -> None:
    node = install_fake(node_with(node={"missing_functions": ["nvmlDeviceGetPowerUsage", "nvmlDeviceGetFieldValues"]}))
    gpu = Devices.gpu(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetPowerUsage(gpu)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetFieldValues(gpu, [186])
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(gpu) == 0
    assert node.library.missing_lookups["nvmlDeviceGetPowerUsage"] >= 1
    assert "nvmlDeviceGetPowerUsage" not in node.calls


# ---------------------------------------------------------------------------------------------
# 4. Initialisation
# ---------------------------------------------------------------------------------------------


def test_calls_before_nvml_init_are_uninitialized(install_fake: InstallFake) -> None:
    install_fake("demo", init=False)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlSystemGetDriverVersion()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlShutdown()
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 8


def test_calls_after_nvml_shutdown_are_uninitialized_again(install_fake: InstallFake) -> None:
    install_fake("demo")
    gpu = Devices.gpu(0)
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetPowerUsage(gpu)


def test_nvml_init_is_counted_like_the_real_library(install_fake: InstallFake) -> None:
    install_fake("demo")
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    assert pynvml.nvmlDeviceGetCount() == 8  # one init still outstanding
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


# ---------------------------------------------------------------------------------------------
# 5. The scenario clock
# ---------------------------------------------------------------------------------------------


class FakeMonotonic:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_clock_stands_still_until_advanced() -> None:
    clock = fake_nvml.ScenarioClock(START.timestamp(), monotonic=FakeMonotonic())
    assert (clock.now(), clock.wall_time()) == (0.0, START.timestamp())
    assert clock.advance(90) == 90.0
    assert clock.advance(30) == 120.0
    assert (clock.now(), clock.wall_time()) == (120.0, START.timestamp() + 120)


def test_the_clock_does_not_run_backwards() -> None:
    clock = fake_nvml.ScenarioClock(0.0)
    clock.advance(10)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1)
    assert clock.now() == 10.0


def test_the_clock_runs_at_speed_times_the_monotonic_clock() -> None:
    mono = FakeMonotonic(1000.0)
    clock = fake_nvml.ScenarioClock(START.timestamp(), speed=60, monotonic=mono)
    assert clock.now() == 0.0
    mono.now = 1002.0
    assert clock.now() == 120.0  # 2 s of real time at 60x
    assert clock.advance(10) == 130.0  # advancing still adds on top
    mono.now = 1003.0
    assert clock.now() == 190.0
    clock.set_speed(0)  # paused: real time passes, scenario time does not
    mono.now = 2000.0
    assert clock.now() == 190.0
    clock.set_speed(2)
    mono.now = 2005.0
    assert clock.now() == 200.0
    assert clock.wall_time() == START.timestamp() + 200


def test_an_installed_node_reads_its_clock_at_each_call(install_fake: InstallFake) -> None:
    mono = FakeMonotonic()
    clock = fake_nvml.ScenarioClock(SCENARIOS["readings"].start_epoch, speed=60, monotonic=mono)
    node = install_fake(SCENARIOS["readings"], clock=clock)
    assert node.clock is clock
    gpu = Devices.gpu(1)
    mono.now += 10  # 10 s real at 60x: 600 s of scenario time
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(gpu) == 150 * 600 * 1000  # 150 W for 600 s, in mJ


# ---------------------------------------------------------------------------------------------
# 6. Scenario validation
# ---------------------------------------------------------------------------------------------

ONE_GPU = [{"model": "A100-SXM4-80GB"}]
TWO_GPUS = [{"model": "A100-SXM4-80GB", "count": 2, "nvlink_links": 4}]


def process(**fields: Any) -> dict[str, Any]:
    return {"pid": 1, "gpus": [0], **fields}


BAD_SCENARIOS = [
    pytest.param({"processes": []}, "gpus:", id="gpus missing"),
    pytest.param({"gpus": []}, "gpus:", id="gpus empty"),
    pytest.param({"gpus": ONE_GPU, "proceses": []}, "proceses:", id="unknown top-level key"),
    pytest.param({"gpus": [{"colour": "green"}]}, "gpus[0].colour:", id="unknown GPU key"),
    pytest.param({"gpus": ["A100"]}, "gpus[0]:", id="GPU entry is not a mapping"),
    pytest.param(
        {"node": {"driver_version": "latest"}, "gpus": ONE_GPU}, "node.driver_version:", id="bad driver version"
    ),
    pytest.param({"start": "friday", "gpus": ONE_GPU}, "start:", id="bad start time"),
    pytest.param(
        {"gpus": TWO_GPUS, "processes": [process(), process(pid=2, gpus=[1, 2])]},
        "processes[1].gpus:",
        id="GPU index out of range",
    ),
    pytest.param({"gpus": ONE_GPU, "processes": [{"gpus": [0]}]}, "processes[0].pid:", id="pid missing"),
    pytest.param({"gpus": ONE_GPU, "processes": [{"pid": 1}]}, "processes[0].gpus:", id="process gpus missing"),
    pytest.param({"gpus": TWO_GPUS, "processes": [process(gpus=[0, 0])]}, "processes[0].gpus:", id="GPU listed twice"),
    pytest.param({"gpus": ONE_GPU, "processes": [process(start="soon")]}, "processes[0].start:", id="bad duration"),
    pytest.param(
        {"gpus": ONE_GPU, "processes": [process(start="2h", end="1h")]}, "processes[0].end:", id="end before start"
    ),
    pytest.param(
        {"gpus": ONE_GPU, "processes": [process(sm_util=150)]}, "processes[0].sm_util:", id="sm_util over 100"
    ),
    pytest.param(
        {"gpus": ONE_GPU, "processes": [process(sm_util=[{"sm_util": 50}, {"at": "1h", "sm_util": 101}])]},
        "processes[0].sm_util[1].sm_util:",
        id="segment sm_util over 100",
    ),
    pytest.param(
        {"gpus": ONE_GPU, "processes": [process(sm_util=[{"at": "2h", "sm_util": 50}, {"at": "1h", "sm_util": 5}])]},
        "processes[0].sm_util[1].at:",
        id="segments out of order",
    ),
    pytest.param(
        {"gpus": ONE_GPU, "processes": [process(pid=7, end="2h"), process(pid=7, start="1h")]},
        "processes[1].pid:",
        id="reused pid overlapping",
    ),
    pytest.param(
        {"gpus": ONE_GPU, "processes": [process(environ=["A=1"])]}, "processes[0].environ:", id="environ not a mapping"
    ),
    pytest.param(
        {"gpus": ONE_GPU, "processes": [process(pod={"namespace": "ml"})]},
        "processes[0].pod.name:",
        id="pod without name",
    ),
    pytest.param({"gpus": [{"mig": ["3g.40gb", "big"]}]}, "gpus[0].mig[1]:", id="bad MIG profile"),
    pytest.param({"gpus": [{"model": "L4", "mig": ["1g.10gb"]}]}, "gpus[0].mig:", id="MIG on a model without MIG"),
    pytest.param(
        {"gpus": [{"mig": ["3g.40gb", "3g.40gb", "2g.20gb"]}]}, "gpus[0].mig[2]:", id="MIG profiles over the slices"
    ),
    pytest.param(
        {"gpus": [{"mig": ["3g.40gb"]}], "processes": [process()]}, "processes[0].gpus:", id="whole MIG GPU named"
    ),
    pytest.param(
        {"gpus": [{"mig": ["3g.40gb"]}], "processes": [process(gpus=["0:1"])]},
        "processes[0].gpus:",
        id="MIG instance missing",
    ),
    pytest.param(
        {"gpus": ONE_GPU, "allocations": [{"gpus": [0]}]}, "allocations[0].pod:", id="allocation without owner"
    ),
    pytest.param(
        {"gpus": ONE_GPU, "faults": [{"gpu": 0, "error": "GPU_ON_FIRE"}]}, "faults[0].error:", id="unknown error name"
    ),
    pytest.param({"gpus": ONE_GPU, "faults": [{"gpu": 0}]}, "faults[0].error:", id="fault without effect"),
    pytest.param(
        {"gpus": ONE_GPU, "faults": [{"gpu": 3, "error": "UNKNOWN"}]}, "faults[0].gpu:", id="fault on missing GPU"
    ),
    pytest.param(
        {"gpus": ONE_GPU, "faults": [{"at": "2h", "until": "1h", "error": "UNKNOWN"}]},
        "faults[0].until:",
        id="fault until before at",
    ),
    pytest.param(
        {"gpus": ONE_GPU, "faults": [{"call": "GetTemperature", "error": "UNKNOWN"}]},
        "faults[0].call:",
        id="fault call not an NVML function",
    ),
    pytest.param(
        {"gpus": TWO_GPUS, "faults": [{"gpu": 1, "nvlink_down": [4]}]},
        "faults[0].nvlink_down:",
        id="nvlink_down link out of range",
    ),
    pytest.param({"gpus": TWO_GPUS, "faults": [{"nvlink_down": [0]}]}, "faults[0].gpu:", id="nvlink_down without GPU"),
    # Numbers past what the fake driver can report: each one crashed every poll (NaN, a pid over
    # 32 bits), hung the run (a hundred million GPUs or links), ran out of memory (10^12 ECC
    # errors) or wrapped silently (memory past 64 bits of bytes).
    pytest.param(
        {"gpus": ONE_GPU, "processes": [process(sm_util=float("nan"))]},
        "processes[0].sm_util: must be a finite number, got nan",
        id="NaN utilization",
    ),
    pytest.param(
        {"gpus": [{"power_limit_w": float("inf")}]},
        "gpus[0].power_limit_w: must be a finite number, got inf",
        id="infinite power limit",
    ),
    pytest.param(
        {"gpus": ONE_GPU, "processes": [process(pid=2**32 + 1)]},
        "processes[0].pid: must be at most 4194304, got 4294967297",
        id="pid past 32 bits",
    ),
    pytest.param(
        {"gpus": [{"count": 100_000_000}]}, "gpus[0].count: must be at most 64, got 100000000", id="GPU count"
    ),
    pytest.param(
        {"gpus": [{"count": 40}, {"count": 40}]},
        "gpus[1].count: a node has at most 64 GPUs; these would make 80",
        id="GPUs over all entries",
    ),
    pytest.param({"gpus": [{"nvlink_links": 10**12}]}, "gpus[0].nvlink_links: must be at most 18,", id="links"),
    pytest.param(
        {"gpus": ONE_GPU, "faults": [{"gpu": 0, "ecc": {"corrected": 10**12}}]},
        "faults[0].ecc.corrected: must be at most 1000000,",
        id="ECC errors",
    ),
    pytest.param(
        {"gpus": [{"memory_total_mib": 10**23}]}, "gpus[0].memory_total_mib: must be at most 16777216,", id="memory"
    ),
    pytest.param(
        {"gpus": ONE_GPU, "processes": [process(cmdline="x" * 5_000_000)]},
        "processes[0].cmdline: at most 131072 characters, got 5000000",
        id="a 5 MB command line",
    ),
    pytest.param(
        {"gpus": ONE_GPU, "faults": [{"call": "*", "latency_ms": 1e300}]},
        "faults[0].latency_ms: must be 0..8.64e+07, got 1e+300",
        id="latency",
    ),
    pytest.param(
        {"gpus": [{"minor": 1}, {}]}, "gpus[1].minor: /dev/nvidia1 is already GPU 0's", id="two GPUs, one minor"
    ),
    pytest.param(
        {"node": {"device_plugin": "amd"}, "gpus": ONE_GPU},
        "node.device_plugin: expected one of nvidia, gke, got 'amd'",
        id="device plugin",
    ),
    # A lone surrogate (YAML's "\\ud800") went on to the GPUs' UUIDs and the fake's files: a traceback.
    pytest.param({"node": {"hostname": "n\ud800"}, "gpus": ONE_GPU}, "node.hostname: not UTF-8 text", id="surrogate"),
    pytest.param(
        {"gpus": ONE_GPU, "processes": [process(environ={"A": "x\udc80"})]},
        "processes[0].environ.A: not UTF-8 text",
        id="surrogate in a process",
    ),
]


@pytest.mark.parametrize(("data", "names"), BAD_SCENARIOS)
def test_a_bad_scenario_fails_with_one_line_naming_the_key(data: object, names: str) -> None:
    with pytest.raises(fake_nvml.ScenarioError) as raised:
        fake_nvml.load_scenario(data)
    message = str(raised.value)
    assert names in message
    assert message.startswith("scenario: ")
    assert "\n" not in message


def test_a_bad_scenario_file_is_named_in_the_message(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("gpus:\n  - {model: A100-SXM4-80GB}\nprocesses:\n  - {pid: 1, gpus: [0, 9]}\n")
    with pytest.raises(fake_nvml.ScenarioError, match=r"^broken\.yaml: processes\[0\]\.gpus: GPU 9 does not exist"):
        fake_nvml.load_scenario(path)


@pytest.mark.parametrize(
    ("text", "got"),
    [
        pytest.param("- gpus\n- processes\n", "got a list", id="a list"),
        pytest.param("just some text\n", "got str 'just some text'", id="a string"),
        pytest.param("# nothing but a comment\n", "got nothing", id="empty"),
    ],
)
def test_a_scenario_file_that_is_not_a_mapping_says_what_it_is(tmp_path: Path, text: str, got: str) -> None:
    path = tmp_path / "flat.yaml"
    path.write_text(text)
    with pytest.raises(fake_nvml.ScenarioError) as raised:
        fake_nvml.load_scenario(path)
    message = str(raised.value)
    assert message.startswith("flat.yaml: ")
    assert "expected a mapping" in message
    assert got in message
    assert "\n" not in message


def test_invalid_yaml_fails_with_one_line_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("gpus:\n  - {model: A100\nprocesses: []\n")
    with pytest.raises(fake_nvml.ScenarioError) as raised:
        fake_nvml.load_scenario(path)
    assert str(raised.value).startswith(f"{path}: line ")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        pytest.param("no-such-scenario", "no such built-in scenario", id="unknown built-in name"),
        pytest.param("missing/scenario.yaml", "no such scenario file", id="missing file"),
    ],
)
def test_a_scenario_that_is_not_there_is_a_scenario_error(spec: str, says: str) -> None:
    with pytest.raises(fake_nvml.ScenarioError, match=says) as raised:
        fake_nvml.load_scenario(spec)
    assert "\n" not in str(raised.value)


def test_a_bad_scenario_leaves_the_installed_node_in_place(install_fake: InstallFake) -> None:
    node = install_fake("mig")
    with pytest.raises(fake_nvml.ScenarioError):
        fake_nvml.install({"gpus": []})
    assert pynvml.nvmlLib is node.library
    assert fake_nvml.installed() is node
    assert pynvml.nvmlDeviceGetCount() == 2


@pytest.mark.parametrize("name", fake_nvml.builtin_names())
def test_every_builtin_scenario_loads_and_serves_its_gpus(install_fake: InstallFake, name: str) -> None:
    node = install_fake(name)
    assert node.scenario.name == name
    count = pynvml.nvmlDeviceGetCount()
    assert count == len(node.scenario.gpus) > 0
    names = [pynvml.nvmlDeviceGetName(Devices.gpu(i)) for i in range(count)]
    assert names == [gpu.name for gpu in node.scenario.gpus]


def test_the_builtins_include_every_scenario_the_product_names() -> None:
    assert {"demo", "gpu-lost", "mig", "old-driver", "weekend-idle"} <= set(fake_nvml.builtin_names())


def test_install_without_a_scenario_serves_the_demo_node(install_fake: InstallFake) -> None:
    node = install_fake()
    assert node.scenario.name == "demo"
    assert pynvml.nvmlDeviceGetCount() == 8


# ---------------------------------------------------------------------------------------------
# 7. Install and uninstall
# ---------------------------------------------------------------------------------------------


def test_uninstall_leaves_pynvml_with_no_library_and_no_cached_symbols(install_fake: InstallFake) -> None:
    node = install_fake("demo")
    pynvml.nvmlDeviceGetPowerUsage(Devices.gpu(0))
    assert pynvml.nvmlLib is node.library
    assert fake_nvml.installed() is node
    assert pynvml._nvmlGetFunctionPointer_cache  # the calls above went through the cache
    fake_nvml.uninstall()
    assert pynvml.nvmlLib is None
    assert pynvml._nvmlGetFunctionPointer_cache == {}
    assert fake_nvml.installed() is None
    # with no library loaded, pynvml refuses calls rather than reaching a stale fake
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_installing_again_replaces_the_node_and_its_cached_symbols(install_fake: InstallFake) -> None:
    first = install_fake("demo")
    assert pynvml.nvmlDeviceGetCount() == 8
    second = install_fake("mig")
    assert pynvml.nvmlLib is second.library is not first.library
    assert pynvml.nvmlDeviceGetCount() == 2
    assert second.calls["nvmlDeviceGetCount_v2"] == 1
    assert first.calls["nvmlDeviceGetCount_v2"] == 1


@hypothesis.settings(max_examples=300)
@hypothesis.given(st.text(alphabet=" \t\r\n\x0b\x0cab=-/.#;|&$*?~é'\"\\", max_size=40))
def test_a_scenarios_command_line_splits_into_argv_as_shlex_splits_it(cmdline: str) -> None:
    # The fake host writes /proc/PID/cmdline from it; lines without quotes skip shlex's
    # character-by-character reader.
    try:
        expected = shlex.split(cmdline)
    except ValueError:  # an unclosed quote: the scenario's loader refuses it first
        return
    assert split_cmdline(cmdline) == expected
