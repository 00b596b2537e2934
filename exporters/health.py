"""A GPU's clocks, throttling, memory errors and links as gpuledger's series (catalogue HEALTH).

Rendered from `DeviceReading.telemetry` like every other series: a reading the GPU does not
have (None) emits nothing, so a dashboard shows "no data", never a made-up 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from agent.model import CLOCK_EVENT_REASONS, Telemetry


class SeriesSink(Protocol):
    def add(self, name: str, labels: Sequence[str], value: float) -> None: ...


def _gauges(t: Telemetry) -> tuple[tuple[str, float | int | bool | None], ...]:
    return (
        ("gpuledger_gpu_sm_clock_hertz", t.sm_clock_hz),
        ("gpuledger_gpu_memory_clock_hertz", t.memory_clock_hz),
        ("gpuledger_gpu_sm_clock_max_hertz", t.sm_clock_max_hz),
        ("gpuledger_gpu_memory_clock_max_hertz", t.memory_clock_max_hz),
        ("gpuledger_gpu_fan_speed_ratio", t.fan_speed_ratio),
        ("gpuledger_gpu_performance_state", t.performance_state),
        ("gpuledger_gpu_retired_pages_pending", t.retired_pages_pending),
        ("gpuledger_gpu_row_remap_pending", t.row_remap_pending),
        ("gpuledger_gpu_row_remap_failure", t.row_remap_failure),
        ("gpuledger_gpu_pcie_link_generation", t.pcie_link_generation),
        ("gpuledger_gpu_pcie_link_generation_max", t.pcie_link_generation_max),
        ("gpuledger_gpu_pcie_link_width", t.pcie_link_width),
        ("gpuledger_gpu_pcie_link_width_max", t.pcie_link_width_max),
        ("gpuledger_gpu_pcie_replays_total", t.pcie_replays),
        ("gpuledger_gpu_pcie_transmit_bytes_per_second", t.pcie_tx_bytes_per_s),
        ("gpuledger_gpu_pcie_receive_bytes_per_second", t.pcie_rx_bytes_per_s),
        ("gpuledger_gpu_encoder_utilization_ratio", t.encoder_utilization),
        ("gpuledger_gpu_decoder_utilization_ratio", t.decoder_utilization),
        ("gpuledger_gpu_memory_controller_utilization_ratio", t.memory_utilization),
    )


def health_series(out: SeriesSink, ids: tuple[str, str], t: Telemetry) -> None:
    """The series of one GPU's telemetry; `ids` are its (gpu, uuid) labels."""
    for name, value in _gauges(t):
        if value is not None:
            out.add(name, ids, float(value))
    if t.clock_event_reasons is not None:
        for bit, reason in CLOCK_EVENT_REASONS:
            out.add("gpuledger_gpu_clock_event_reason", (*ids, reason), 1.0 if t.clock_event_reasons & bit else 0.0)
    for cause, seconds in t.violation_s:
        out.add("gpuledger_gpu_clock_violation_seconds_total", (*ids, cause), seconds)
    for name, kind, count in (
        ("gpuledger_gpu_ecc_errors_total", "corrected", t.ecc_corrected_volatile),
        ("gpuledger_gpu_ecc_errors_total", "uncorrected", t.ecc_uncorrected_volatile),
        ("gpuledger_gpu_ecc_aggregate_errors_total", "corrected", t.ecc_corrected_aggregate),
        ("gpuledger_gpu_ecc_aggregate_errors_total", "uncorrected", t.ecc_uncorrected_aggregate),
        ("gpuledger_gpu_retired_pages_total", "single_bit", t.retired_pages_single_bit),
        ("gpuledger_gpu_retired_pages_total", "double_bit", t.retired_pages_double_bit),
        ("gpuledger_gpu_remapped_rows_total", "correctable", t.remapped_rows_correctable),
        ("gpuledger_gpu_remapped_rows_total", "uncorrectable", t.remapped_rows_uncorrectable),
    ):
        if count is not None:
            out.add(name, (*ids, kind), float(count))
    for link in t.nvlinks:
        labels = (*ids, str(link.link))
        for kind, errors in (
            ("crc", link.crc_errors),
            ("replay", link.replay_errors),
            ("recovery", link.recovery_errors),
        ):
            if errors is not None:
                out.add("gpuledger_gpu_nvlink_errors_total", (*labels, kind), float(errors))
        if link.tx_bytes is not None:
            out.add("gpuledger_gpu_nvlink_transmit_bytes_total", labels, float(link.tx_bytes))
        if link.rx_bytes is not None:
            out.add("gpuledger_gpu_nvlink_receive_bytes_total", labels, float(link.rx_bytes))
