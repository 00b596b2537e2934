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
# The kinds of driver event a GPU entry's `events:` may name (what it reports).
DEVICE_EVENT_KINDS = ("xid", "single_bit_ecc", "double_bit_ecc", "clock_change")
# The ECC events, each the event of one memory error of a kind (`EccErrors`' field): a scenario's
# `event: double_bit_ecc` is read as `ecc: {uncorrected: 1}`, so counters and events agree.
ECC_EVENTS = {"single_bit_ecc": "corrected", "double_bit_ecc": "uncorrected"}


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
    "V100-SXM2-32GB": GpuModelFacts(80, 0, 0, 32768, 300, 40, 0x1DB510DE),
    "RTX A6000": GpuModelFacts(84, 0, 0, 49140, 300, 20, 0x223010DE),
}
# A model the table does not know still gets a plausible GPU: an A100-SXM4-80GB's figures.
DEFAULT_FACTS = GpuModelFacts(108, 7, 14, 81920, 400, 55, 0x20B210DE)

# MIG profile names as the MIG user guide writes them: compute slices, then memory, e.g. 3g.40gb.
MIG_PROFILE = re.compile(r"^(\d)g\.(\d+)gb$")


@dataclass(frozen=True)
class BoardFacts:
    """What a board shows besides its size: architecture, clocks, PCIe link, cooling.

    `architecture` decides what the driver offers (row remapping replaced page retirement with
    Ampere). Clocks are MHz as NVML reports them: HBM boards keep their memory clock at idle,
    GDDR boards drop theirs. Data-centre boards are passively cooled (no fan for NVML to read).
    """

    architecture: str  # "volta", "turing", "ampere", "ada", "hopper", "blackwell"
    sm_clock_max_mhz: int
    sm_clock_idle_mhz: int
    memory_clock_max_mhz: int
    memory_clock_idle_mhz: int
    pcie_generation: int
    pcie_width: int
    fans: int = 0

    @property
    def remaps_rows(self) -> bool:
        return self.architecture not in ("volta", "turing")

    @property
    def memory_clocks_mhz(self) -> tuple[int, ...]:
        """The memory clocks the board supports, highest first, as
        nvmlDeviceGetSupportedMemoryClocks lists them: one on an HBM board (its clock never
        leaves the maximum), several on a GDDR board (the fake's two: busy and idle; a real one
        lists a few more in between)."""
        return tuple(sorted({self.memory_clock_max_mhz, self.memory_clock_idle_mhz}, reverse=True))


# Public spec-sheet clocks and links (NVIDIA data sheets; NVML's memory clock for GDDR6 is the
# data rate over two).
BOARD_FACTS: dict[str, BoardFacts] = {
    "A100-SXM4-80GB": BoardFacts("ampere", 1410, 210, 1593, 1593, 4, 16),
    "A100-SXM4-40GB": BoardFacts("ampere", 1410, 210, 1215, 1215, 4, 16),
    "A100-PCIE-40GB": BoardFacts("ampere", 1410, 210, 1215, 1215, 4, 16),
    "A100 80GB PCIe": BoardFacts("ampere", 1410, 210, 1512, 1512, 4, 16),
    "H100 80GB HBM3": BoardFacts("hopper", 1980, 345, 2619, 2619, 5, 16),
    "H100-SXM5-80GB": BoardFacts("hopper", 1980, 345, 2619, 2619, 5, 16),
    "H100 PCIe": BoardFacts("hopper", 1755, 345, 1593, 1593, 5, 16),
    "H200": BoardFacts("hopper", 1980, 345, 3201, 3201, 5, 16),
    "B200": BoardFacts("blackwell", 1965, 120, 3996, 3996, 6, 16),
    "A30": BoardFacts("ampere", 1440, 210, 1215, 1215, 4, 16),
    "L40S": BoardFacts("ada", 2520, 210, 9001, 405, 4, 16),
    "L4": BoardFacts("ada", 2040, 210, 6251, 405, 4, 16),
    "A10G": BoardFacts("ampere", 1710, 210, 6251, 405, 4, 16),
    "T4": BoardFacts("turing", 1590, 300, 5001, 405, 3, 16),
    "V100-SXM2-32GB": BoardFacts("volta", 1530, 135, 877, 877, 3, 16),
    "RTX A6000": BoardFacts("ampere", 1800, 210, 8001, 405, 4, 16, fans=1),
}
DEFAULT_BOARD = BOARD_FACTS["A100-SXM4-80GB"]


# NVML's clocks-event reason bits (nvml.h, nvmlClocksEventReason*), the ones the fake raises.
REASON_GPU_IDLE = 0x1
REASON_SW_POWER_CAP = 0x4
REASON_HW_SLOWDOWN = 0x8
REASON_SYNC_BOOST = 0x10
REASON_SW_THERMAL_SLOWDOWN = 0x20
REASON_HW_THERMAL_SLOWDOWN = 0x40
REASON_HW_POWER_BRAKE_SLOWDOWN = 0x80

# NVML's performance policies (nvmlPerfPolicyType_t), whose violation counters say how long the
# clocks were held down for each cause.
POLICY_POWER = 0
POLICY_THERMAL = 1
POLICY_SYNC_BOOST = 2
POLICY_BOARD_LIMIT = 3
POLICY_LOW_UTILIZATION = 4
POLICY_RELIABILITY = 5
POLICY_TOTAL_APP_CLOCKS = 10
POLICY_TOTAL_BASE_CLOCKS = 11
# Each policy by the name a trace's `violation_ns:` gives it (the agent's violation causes).
POLICY_NAMES: dict[str, int] = {
    "power": POLICY_POWER,
    "thermal": POLICY_THERMAL,
    "sync_boost": POLICY_SYNC_BOOST,
    "board_limit": POLICY_BOARD_LIMIT,
    "low_utilization": POLICY_LOW_UTILIZATION,
    "reliability": POLICY_RELIABILITY,
    "app_clocks": POLICY_TOTAL_APP_CLOCKS,
    "base_clocks": POLICY_TOTAL_BASE_CLOCKS,
}


@dataclass(frozen=True)
class ThrottleKind:
    """A cause a `throttle:` fault can name: the reason bits the driver then reports, the
    violation counter that runs, and what is left of the SM clock."""

    reasons: int
    policy: int
    clock_factor: float


THROTTLE_KINDS: dict[str, ThrottleKind] = {
    "power": ThrottleKind(REASON_SW_POWER_CAP, POLICY_POWER, 0.85),
    "thermal": ThrottleKind(REASON_SW_THERMAL_SLOWDOWN, POLICY_THERMAL, 0.75),
    "hw_thermal": ThrottleKind(REASON_HW_THERMAL_SLOWDOWN | REASON_HW_SLOWDOWN, POLICY_THERMAL, 0.5),
    "hw_power_brake": ThrottleKind(REASON_HW_POWER_BRAKE_SLOWDOWN | REASON_HW_SLOWDOWN, POLICY_BOARD_LIMIT, 0.5),
    "sync_boost": ThrottleKind(REASON_SYNC_BOOST, POLICY_SYNC_BOOST, 0.9),
    "reliability": ThrottleKind(0, POLICY_RELIABILITY, 0.9),
}
