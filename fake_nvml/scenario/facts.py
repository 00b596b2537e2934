"""Facts about real NVIDIA hardware and NVML that scenarios lean on but never state.

They live apart from the scenario reader because the fake library answers from them too
(error codes it returns, whether a model can be MIG-partitioned), and a fact kept in one
place cannot drift between the two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# NVML return-code names without the NVML_ERROR_ prefix, as scenarios write them.
ERROR_CODES: dict[str, int] = {
    "UNINITIALIZED": 1,
    "INVALID_ARGUMENT": 2,
    "NOT_SUPPORTED": 3,
    "NO_PERMISSION": 4,
    "ALREADY_INITIALIZED": 5,
    "NOT_FOUND": 6,
    "INSUFFICIENT_SIZE": 7,
    "INSUFFICIENT_POWER": 8,
    "DRIVER_NOT_LOADED": 9,
    "TIMEOUT": 10,
    "IRQ_ISSUE": 11,
    "LIBRARY_NOT_FOUND": 12,
    "FUNCTION_NOT_FOUND": 13,
    "CORRUPTED_INFOROM": 14,
    "GPU_IS_LOST": 15,
    "RESET_REQUIRED": 16,
    "OPERATING_SYSTEM": 17,
    "LIB_RM_VERSION_MISMATCH": 18,
    "IN_USE": 19,
    "MEMORY": 20,
    "NO_DATA": 21,
    "INSUFFICIENT_RESOURCES": 23,
    "ARGUMENT_VERSION_MISMATCH": 25,
    "NOT_READY": 27,
    "GPU_NOT_FOUND": 28,
    "INVALID_STATE": 29,
    "UNKNOWN": 999,
}


# Driver events a scenario fault can raise besides an Xid (`event:`), as NVML's event API names
# them: nvmlEventTypeSingleBitEccError, nvmlEventTypeDoubleBitEccError, nvmlEventTypeClock.
DRIVER_EVENTS = ("single_bit_ecc", "double_bit_ecc", "clock_change")


@dataclass(frozen=True)
class GpuModelFacts:
    """What a GPU model looks like to NVML: SMs, and how MIG carves them up."""

    sm_count: int
    mig_slices: int  # compute slices a full MIG layout has; 0 when the model has no MIG
    sms_per_slice: int
    memory_total_mib: int
    power_limit_w: int
    idle_power_w: int
    pci_device_id: int


# Public spec-sheet facts (NVIDIA data sheets and the MIG user guide's profile tables).
MODEL_FACTS: dict[str, GpuModelFacts] = {
    "A100-SXM4-80GB": GpuModelFacts(108, 7, 14, 81920, 400, 55, 0x20B210DE),
    "A100-SXM4-40GB": GpuModelFacts(108, 7, 14, 40960, 400, 52, 0x20B010DE),
    "A100-PCIE-40GB": GpuModelFacts(108, 7, 14, 40960, 250, 35, 0x20F110DE),
    "A100 80GB PCIe": GpuModelFacts(108, 7, 14, 81920, 300, 45, 0x20B510DE),
    "H100 80GB HBM3": GpuModelFacts(132, 7, 16, 81559, 700, 70, 0x233010DE),
    "H100-SXM5-80GB": GpuModelFacts(132, 7, 16, 81559, 700, 70, 0x233010DE),
    "H100 PCIe": GpuModelFacts(114, 7, 14, 81559, 350, 50, 0x233110DE),
    "H200": GpuModelFacts(132, 7, 16, 143771, 700, 75, 0x233510DE),
    "B200": GpuModelFacts(148, 7, 18, 183359, 1000, 110, 0x290110DE),
    "A30": GpuModelFacts(56, 4, 14, 24576, 165, 30, 0x20B710DE),
    "L40S": GpuModelFacts(142, 0, 0, 46068, 350, 35, 0x26B910DE),
    "L4": GpuModelFacts(58, 0, 0, 23034, 72, 16, 0x27B810DE),
    "A10G": GpuModelFacts(80, 0, 0, 23028, 300, 25, 0x223710DE),
    "T4": GpuModelFacts(40, 0, 0, 15360, 70, 10, 0x1EB810DE),
}
# A model the table does not know still gets a plausible GPU: an A100-SXM4-80GB's figures.
DEFAULT_FACTS = GpuModelFacts(108, 7, 14, 81920, 400, 55, 0x20B210DE)

# MIG profile names as the MIG user guide writes them: compute slices, then memory, e.g. 3g.40gb.
MIG_PROFILE = re.compile(r"^(\d)g\.(\d+)gb$")
