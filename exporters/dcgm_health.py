"""dcgm-exporter's fields for clocks, throttling, memory errors and links, for exporters/dcgm.py.

Names, units and help texts as dcgm-exporter prints them: from `etc/default-counters.csv` where
it lists the field (the violation fields from `etc/dcp-metrics-included.csv`, whose "(in ns)" is
the unit DCGM delivers them in), else the field's comment in DCGM's `dcgm_fields.h`, which is
what a user listing the field in their own counters file would copy.
Values in DCGM's units: clocks in MHz, utilizations and fan speed in whole percent, violation
time in ns (as NVML counts it and DCGM passes it on), NVLink bandwidth as DCGM computes
DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL: KiB over the interval, per second, divided by 1000. The
counters are typed gauge for the reason exporters/dcgm.py gives for the energy counter.
"""

from __future__ import annotations

from collections.abc import Iterator

from agent.model import Telemetry
from exporters.catalogue import Kind, MetricSpec

MHZ = 1e6
_VIOLATION_FIELDS = {
    "power": ("DCGM_FI_DEV_POWER_VIOLATION", "Throttling duration due to power constraints (in ns)."),
    "thermal": ("DCGM_FI_DEV_THERMAL_VIOLATION", "Throttling duration due to thermal constraints (in ns)."),
    "sync_boost": ("DCGM_FI_DEV_SYNC_BOOST_VIOLATION", "Throttling duration due to sync-boost constraints (in ns)."),
    "board_limit": ("DCGM_FI_DEV_BOARD_LIMIT_VIOLATION", "Throttling duration due to board limit constraints (in ns)."),
    "low_utilization": ("DCGM_FI_DEV_LOW_UTIL_VIOLATION", "Throttling duration due to low utilization (in ns)."),
    "reliability": ("DCGM_FI_DEV_RELIABILITY_VIOLATION", "Throttling duration due to reliability constraints (in ns)."),
}


def _spec(name: str, help_text: str, unit: str = "", identity: tuple[str, ...] = ()) -> MetricSpec:
    # Labels are filled in by exporters/dcgm.py (identity, then the workload attributes).
    return MetricSpec(name, Kind.GAUGE, help_text, identity, unit)


DCGM_HEALTH_CATALOGUE: tuple[MetricSpec, ...] = (
    _spec("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "megahertz"),
    _spec("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", "megahertz"),
    _spec("DCGM_FI_DEV_MAX_SM_CLOCK", "Maximum supported SM clock for the device", "megahertz"),
    _spec("DCGM_FI_DEV_MAX_MEM_CLOCK", "Maximum supported Memory clock for the device", "megahertz"),
    _spec("DCGM_FI_DEV_FAN_SPEED", "Fan speed for the device in percent 0-100", "percent"),
    _spec("DCGM_FI_DEV_PSTATE", "Performance state (P-State) 0-15. 0=highest"),
    _spec("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Current clock event reasons (bitmask of DCGM_CLOCKS_EVENT_REASON_*)"),
    *(_spec(name, help_text, "nanoseconds") for name, help_text in _VIOLATION_FIELDS.values()),
    _spec("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors."),
    _spec("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors."),
    _spec("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "Total number of single-bit persistent ECC errors."),
    _spec("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Total number of double-bit persistent ECC errors."),
    _spec("DCGM_FI_DEV_RETIRED_SBE", "Total number of retired pages due to single-bit errors."),
    _spec("DCGM_FI_DEV_RETIRED_DBE", "Total number of retired pages due to double-bit errors."),
    _spec("DCGM_FI_DEV_RETIRED_PENDING", "Total number of pages pending retirement."),
    _spec("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for correctable errors"),
    _spec("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for uncorrectable errors"),
    _spec("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether remapping of rows has failed"),
    _spec("DCGM_FI_DEV_ROW_REMAP_PENDING", "Whether remapping of rows is pending"),
    _spec("DCGM_FI_DEV_PCIE_LINK_GEN", "PCIe Current Link Generation"),
    _spec("DCGM_FI_DEV_PCIE_LINK_WIDTH", "PCIe Current Link Width"),
    _spec("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", "PCIe Max Link Generation"),
    _spec("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", "PCIe Max Link Width"),
    _spec("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "Total number of PCIe retries."),
    _spec("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "Total number of NVLink flow-control CRC errors."),
    _spec("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "Total number of NVLink retries."),
    _spec("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "Total number of NVLink recovery errors."),
    _spec("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "Total number of NVLink bandwidth counters for all lanes"),
    _spec("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "percent"),
    _spec("DCGM_FI_DEV_ENC_UTIL", "Encoder utilization (in %).", "percent"),
    _spec("DCGM_FI_DEV_DEC_UTIL", "Decoder utilization (in %).", "percent"),
)


def _percent(ratio: float | None) -> float | None:
    return None if ratio is None else round(ratio * 100)


def _mhz(hz: float | None) -> float | None:
    return None if hz is None else round(hz / MHZ)


def _sum(counts: list[int | None]) -> int | None:
    """A total over links, only when every link counts it."""
    if not counts or None in counts:
        return None
    return sum(c for c in counts if c is not None)


def health_samples(t: Telemetry) -> Iterator[tuple[str, float]]:
    """(field name, value) of every DCGM field this telemetry has a value for."""
    violations = dict(t.violation_s)
    links = t.nvlinks
    candidates: tuple[tuple[str, float | int | bool | None], ...] = (
        ("DCGM_FI_DEV_SM_CLOCK", _mhz(t.sm_clock_hz)),
        ("DCGM_FI_DEV_MEM_CLOCK", _mhz(t.memory_clock_hz)),
        ("DCGM_FI_DEV_MAX_SM_CLOCK", _mhz(t.sm_clock_max_hz)),
        ("DCGM_FI_DEV_MAX_MEM_CLOCK", _mhz(t.memory_clock_max_hz)),
        ("DCGM_FI_DEV_FAN_SPEED", _percent(t.fan_speed_ratio)),
        ("DCGM_FI_DEV_PSTATE", t.performance_state),
        ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", t.clock_event_reasons),
        *(
            (name, None if cause not in violations else round(violations[cause] * 1e9))
            for cause, (name, _help) in _VIOLATION_FIELDS.items()
        ),
        ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", t.ecc_corrected_volatile),
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", t.ecc_uncorrected_volatile),
        ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", t.ecc_corrected_aggregate),
        ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", t.ecc_uncorrected_aggregate),
        ("DCGM_FI_DEV_RETIRED_SBE", t.retired_pages_single_bit),
        ("DCGM_FI_DEV_RETIRED_DBE", t.retired_pages_double_bit),
        ("DCGM_FI_DEV_RETIRED_PENDING", t.retired_pages_pending),
        ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", t.remapped_rows_correctable),
        ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", t.remapped_rows_uncorrectable),
        ("DCGM_FI_DEV_ROW_REMAP_FAILURE", t.row_remap_failure),
        ("DCGM_FI_DEV_ROW_REMAP_PENDING", t.row_remap_pending),
        ("DCGM_FI_DEV_PCIE_LINK_GEN", t.pcie_link_generation),
        ("DCGM_FI_DEV_PCIE_LINK_WIDTH", t.pcie_link_width),
        ("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", t.pcie_link_generation_max),
        ("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", t.pcie_link_width_max),
        ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", t.pcie_replays),
        ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", _sum([link.crc_errors for link in links])),
        ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", _sum([link.replay_errors for link in links])),
        ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", _sum([link.recovery_errors for link in links])),
        (
            "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
            None if t.nvlink_bytes_per_s is None else round(t.nvlink_bytes_per_s / 1024 / 1000),
        ),
        ("DCGM_FI_DEV_MEM_COPY_UTIL", _percent(t.memory_utilization)),
        ("DCGM_FI_DEV_ENC_UTIL", _percent(t.encoder_utilization)),
        ("DCGM_FI_DEV_DEC_UTIL", _percent(t.decoder_utilization)),
    )
    for name, value in candidates:
        if value is not None:
            yield name, float(value)
