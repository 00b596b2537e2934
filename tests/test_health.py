"""The health readings through the agent: clocks, throttling, memory errors, PCIe and NVLink, as
the sampler reads them from the fake (fake_nvml/scenarios/health.yaml's figures worked out by
hand), how they fall back and what they cost, and the series they become."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import fake_nvml
from agent.config import ExportersConfig, ReadingsConfig, Settings, check_config
from agent.devices.backend import Quantity, ReadingKey
from agent.devices.nvml import NvmlBackend
from agent.devices.sampler import Sampler
from agent.devices.telemetry import GROUPS, ReadingOptions
from agent.model import CLOCK_EVENT_REASONS, Snapshot, Telemetry
from exporters.prometheus import make_registry
from tests.helpers import Rig
from tests.test_cli import gpuledger

MHZ = 1e6
A100_SM_MHZ, A100_MEMORY_MHZ = 1410, 1593
NVLINK_BYTES_PER_S = 20e9  # fake_nvml/health.py: per link and direction at 100%
AT_S = 9000  # 2h30m into the health node

REASON_SW_THERMAL = 0x20


@pytest.fixture
def install() -> Iterator[Any]:
    def _install(spec: Any, readings: ReadingOptions | None = None) -> tuple[fake_nvml.InstalledNode, Sampler]:
        node = fake_nvml.install(spec, host=False)
        sampler = Sampler(NvmlBackend(clock=node.clock.wall_time), hostname="test-node", readings=readings)
        sampler.start()
        return node, sampler

    yield _install
    fake_nvml.uninstall()


def health_of(snapshot: Snapshot, gpu: int) -> Telemetry:
    telemetry = {d.label: d for d in snapshot.devices}[str(gpu)].telemetry
    assert telemetry is not None
    return telemetry


def polled_at(install: Any, spec: Any, at_s: float, readings: ReadingOptions | None = None) -> Snapshot:
    """A poll at t=0 and one at at_s (each reads the slow readings: 30 s have passed)."""
    node, sampler = install(spec, readings)
    sampler.poll()
    node.clock.advance(at_s)
    return sampler.poll()


# --- each reading, supported ----------------------------------------------------------------------


def test_a_healthy_busy_gpu_reads_every_reading(install: Any) -> None:
    t = health_of(polled_at(install, "health", AT_S), 0)
    # GPU 0 at 80%: 55 + 345 x 0.8 = 331 W of 400 and 32 + 51 x 0.8 = 72.8 C: nothing holds it down
    assert (t.sm_clock_hz, t.memory_clock_hz) == (A100_SM_MHZ * MHZ, A100_MEMORY_MHZ * MHZ)
    assert (t.sm_clock_max_hz, t.memory_clock_max_hz) == (A100_SM_MHZ * MHZ, A100_MEMORY_MHZ * MHZ)
    assert t.performance_state == 0
    assert t.clock_event_reasons == 0
    assert t.reasons() == ()
    assert dict(t.violation_s) == dict.fromkeys(
        (
            "power",
            "thermal",
            "sync_boost",
            "board_limit",
            "low_utilization",
            "reliability",
            "app_clocks",
            "base_clocks",
        ),
        0.0,
    )
    assert t.fan_speed_ratio is None  # passively cooled
    assert (t.ecc_corrected_volatile, t.ecc_uncorrected_volatile) == (0, 0)
    assert (t.ecc_corrected_aggregate, t.ecc_uncorrected_aggregate) == (0, 0)
    assert (t.retired_pages_single_bit, t.retired_pages_double_bit, t.retired_pages_pending) == (None, None, None)
    assert (t.remapped_rows_correctable, t.remapped_rows_uncorrectable) == (0, 0)
    assert (t.row_remap_pending, t.row_remap_failure) == (False, False)
    assert (t.pcie_link_generation, t.pcie_link_width, t.pcie_link_generation_max, t.pcie_link_width_max) == (
        4,
        16,
        4,
        16,
    )
    assert t.pcie_replays == 0
    assert (t.pcie_tx_bytes_per_s, t.pcie_rx_bytes_per_s) == (None, None)  # opt-in, off
    # 12 links, each way 0.8 x 20 GB/s for 9000 s, counted by the driver in whole KiB
    kib = int(0.8 * NVLINK_BYTES_PER_S * AT_S / 1024)
    assert [(n.link, n.crc_errors, n.replay_errors, n.recovery_errors) for n in t.nvlinks] == [
        (link, 0, 0, 0) for link in range(12)
    ]
    assert {(n.tx_bytes, n.rx_bytes) for n in t.nvlinks} == {(kib * 1024, kib * 1024)}
    assert (t.encoder_utilization, t.decoder_utilization) == (0.0, 0.0)
    assert t.memory_utilization == 0.48  # the fake's memory controller: 0.6 x 80%


def test_memory_errors_throttling_and_links_in_trouble(install: Any) -> None:
    snapshot = polled_at(install, "health", AT_S)
    # GPU 1: 40 corrected errors over the first hour, one uncorrected at 2h; its row remap pending
    # until the reset at 3h.
    t = health_of(snapshot, 1)
    assert (t.ecc_corrected_volatile, t.ecc_uncorrected_volatile) == (40, 1)
    assert (t.ecc_corrected_aggregate, t.ecc_uncorrected_aggregate) == (40, 1)
    assert (t.remapped_rows_uncorrectable, t.row_remap_pending, t.row_remap_failure) == (1, True, False)
    # GPU 2 at 95%: 32 + 59 x 0.95 = 88.05 C (past 87 C): software thermal slowdown all along, at
    # 75% of 1410 MHz; the power brake held it at half from 1h to 1h30.
    t = health_of(snapshot, 2)
    assert t.clock_event_reasons == REASON_SW_THERMAL
    assert t.reasons() == ("sw_thermal_slowdown",)
    assert t.sm_clock_hz == round(A100_SM_MHZ * 0.75) * MHZ
    violations = dict(t.violation_s)
    assert violations["thermal"] == AT_S
    assert violations["board_limit"] == 1800
    assert violations["app_clocks"] == AT_S  # below the application clocks all along
    assert violations["base_clocks"] == 1800  # at half: below the base clock during the brake
    assert violations["power"] == 0  # 55 + 345 x 0.95 = 382.75 W: under 97% of 400 W
    # GPU 3: Gen3 x8 since 30m, after 600 replays
    t = health_of(snapshot, 3)
    assert (t.pcie_link_generation, t.pcie_link_width, t.pcie_replays) == (3, 8, 600)
    # GPU 4: link 2's errors
    t = health_of(snapshot, 4)
    errors = {n.link: (n.crc_errors, n.replay_errors, n.recovery_errors) for n in t.nvlinks}
    assert errors[2] == (3600, 360, 1)
    assert all(errors[link] == (0, 0, 0) for link in errors if link != 2)
    # GPU 6: a V100 retires the page an uncorrected error hit, pending the driver's reload
    t = health_of(snapshot, 6)
    assert t.ecc_uncorrected_volatile == 1
    assert (t.retired_pages_single_bit, t.retired_pages_double_bit, t.retired_pages_pending) == (0, 1, True)
    assert (t.remapped_rows_correctable, t.row_remap_pending) == (None, None)
    assert t.pcie_link_generation_max == 3
    # GPU 7: an RTX A6000 at 20%: 32 + 51 x 0.2 = 42.2 C, a fifth of the way up: 30% + 60% x 0.2
    t = health_of(snapshot, 7)
    assert t.fan_speed_ratio == 0.42
    assert (t.encoder_utilization, t.decoder_utilization) == (0.45, 0.30)


def test_a_failed_remap_stays(install: Any) -> None:
    t = health_of(polled_at(install, "health", 4.5 * 3600), 5)
    assert (t.remapped_rows_correctable, t.row_remap_failure, t.row_remap_pending) == (2, True, False)


def test_nvlink_bandwidth_is_the_traffic_counters_over_the_poll_interval(install: Any) -> None:
    node, sampler = install("demo")
    sampler.poll()
    node.clock.advance(60)
    sampler.poll()
    node.clock.advance(5)
    t = health_of(sampler.poll(), 0)
    # GPU 0 at 92%: 12 links x 2 directions x 0.92 x 20 GB/s
    assert t.nvlink_bytes_per_s == pytest.approx(12 * 2 * 0.92 * NVLINK_BYTES_PER_S, rel=1e-6)
    assert health_of(sampler.poll(), 6).nvlink_bytes_per_s is None  # no time has passed


# --- what it costs: slow readings, unsupported ones, the call budget ------------------------------


def test_slow_readings_are_read_every_slow_interval_and_carried_between(install: Any) -> None:
    node, sampler = install(
        {"gpus": [{"model": "A100-SXM4-80GB"}], "processes": [{"pid": 1, "gpus": [0], "sm_util": 50}]}
    )
    states, clocks = [], []
    before = node.calls.copy()
    for _ in range(13):  # t = 0, 5, .. 60: slow readings due at 0, 30, 60
        telemetry = health_of(sampler.poll(), 0)
        states.append(telemetry.performance_state)
        clocks.append(telemetry.sm_clock_hz)
        node.clock.advance(5)
    calls = node.calls - before
    assert calls["nvmlDeviceGetPerformanceState"] == 3
    assert calls["nvmlDeviceGetCurrPcieLinkGeneration"] == 3
    # The SM clock slow too (with the clock-event reasons it explains; it was read every poll,
    # 13 here); the memory clock once, with the maxima: an A100's HBM2e supports one memory
    # clock (it was slow, 3 more, before that was asked; a GDDR board's still is).
    assert calls["nvmlDeviceGetClockInfo"] == 3 + 1
    assert clocks == [A100_SM_MHZ * MHZ] * 13  # read at 0, 30, 60 and carried between
    assert calls["nvmlDeviceGetMaxClockInfo"] == 2  # once
    assert calls["nvmlDeviceGetSupportedMemoryClocks"] == 1  # once
    assert states == [0] * 13  # carried into the polls between


def test_a_reading_the_gpu_lacks_is_asked_once(install: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.devices.sampler")
    node, sampler = install("health")
    for _ in range(10):
        sampler.poll()
        node.clock.advance(30)
    # Every poll was a slow one: the fan is asked on the one board that has it, after the first
    # poll; the A100s' (and the V100's) retired-page and remapped-row fields likewise.
    assert node.calls["nvmlDeviceGetFanSpeed"] == 7 + 10
    lines = [r.getMessage() for r in caplog.records if "fan speed is not supported" in r.getMessage()]
    assert len(lines) == 7
    assert sampler.errors == {}


def test_a_default_poll_costs_at_most_ten_calls_per_gpu_in_steady_state(install: Any) -> None:
    node, sampler = install("demo")
    for _ in range(3):
        sampler.poll()
        node.clock.advance(5)
    before = node.calls.copy()
    polls = 24  # two minutes at 5 s: four slow polls
    for _ in range(polls):
        sampler.poll()
        node.clock.advance(5)
    calls = sum((node.calls - before).values())
    # 8 GPUs; busy ones: field values, memory, utilization, the device's utilization samples,
    # temperature, processes, process samples (7), and every sixth poll the SM clock,
    # performance state, clock-event reasons, PCIe generation and width, encoder and decoder (7).
    # The two idle GPUs read no process samples. The demo's boards are all HBM (A100, H100): one
    # memory clock each, read once before these polls (slow, it would make the sixth-poll calls 8).
    # Every sixth poll too, the MPS-client and graphics process lists, empty here: 2 on a busy
    # GPU, 1 on an idle one (no compute process, so no MPS server and no MPS client).
    assert calls / polls / 8 <= 10
    assert calls == polls * (6 * 7 + 2 * 6) + 4 * 8 * 7 + 4 * (6 * 2 + 2 * 1)


# --- fallbacks that fall back ---------------------------------------------------------------------


def test_a_versioned_call_the_device_refuses_falls_back_to_the_older_one(install: Any) -> None:
    node, sampler = install(
        {
            "node": {"driver_version": "565.57.01"},  # has nvmlDeviceGetTemperatureV
            "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
            "faults": [{"gpu": 0, "call": "nvmlDeviceGetTemperatureV", "error": "NOT_SUPPORTED"}],
        }
    )
    for _ in range(3):
        snapshot = sampler.poll()
        node.clock.advance(5)
    assert [d.temperature_c for d in snapshot.devices] == [32, 32]
    # GPU 0: the versioned call refused once, then the older call every poll; GPU 1: versioned
    assert node.calls["nvmlDeviceGetTemperatureV"] == 1 + 3
    assert node.calls["nvmlDeviceGetTemperature"] == 3
    assert sampler.errors == {}


def test_unsupported_only_when_every_path_refuses(install: Any) -> None:
    node, sampler = install(
        {
            "node": {"driver_version": "565.57.01"},
            "gpus": [{"model": "A100-SXM4-80GB"}],
            # the family's name: the versioned call and the older one both refuse
            "faults": [{"gpu": 0, "call": "nvmlDeviceGetTemperature", "error": "NOT_SUPPORTED"}],
        }
    )
    for _ in range(3):
        snapshot = sampler.poll()
        node.clock.advance(5)
    assert snapshot.devices[0].temperature_c is None
    assert (node.calls["nvmlDeviceGetTemperatureV"], node.calls["nvmlDeviceGetTemperature"]) == (1, 1)


def test_not_supported_from_a_call_that_answered_before_is_transient(install: Any) -> None:
    node, sampler = install(
        {
            "node": {"driver_version": "565.57.01"},
            "gpus": [{"model": "A100-SXM4-80GB"}],
            "faults": [
                {"at": "10s", "until": "20s", "gpu": 0, "call": "nvmlDeviceGetTemperatureV", "error": "NOT_SUPPORTED"}
            ],
        }
    )
    temperatures = []
    for _ in range(6):  # t = 0, 5, .. 25
        temperatures.append(sampler.poll().devices[0].temperature_c)
        node.clock.advance(5)
    assert temperatures == [32, 32, None, None, 32, 32]
    assert node.calls["nvmlDeviceGetTemperature"] == 0  # never switched to the older call
    assert sampler.errors == {("nvmlDeviceGetTemperature", "NOT_SUPPORTED"): 2}


def test_clock_event_reasons_fall_back_to_the_throttle_reasons_call(install: Any) -> None:
    node, sampler = install(
        {
            "gpus": [{"model": "A100-SXM4-80GB"}],
            "faults": [{"gpu": 0, "call": "nvmlDeviceGetCurrentClocksEventReasons", "error": "NOT_SUPPORTED"}],
        }
    )
    for _ in range(3):  # every 35 s: the reasons are read at each poll
        snapshot = sampler.poll()
        node.clock.advance(35)
    assert health_of(snapshot, 0).reasons() == ("gpu_idle",)
    assert node.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1
    assert node.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 3


def test_an_old_driver_reads_through_the_calls_and_fields_it_has(install: Any) -> None:
    node, sampler = install(
        {
            "node": {"driver_version": "470.82.01"},
            "gpus": [{"model": "A100-SXM4-40GB", "nvlink_links": 12}],
            "processes": [{"pid": 1, "gpus": [0], "sm_util": 60}],
            "faults": [{"at": "1s", "gpu": 0, "nvlink_errors": {"links": [7], "crc": 5, "replay": 2}}],
        }
    )
    sampler.poll()
    node.clock.advance(60)
    before = node.calls.copy()
    t = health_of(sampler.poll(), 0)
    calls = node.calls - before
    # R470 has no clocks-event-reasons call (R535): one lookup, then the throttle-reasons call
    assert node.library.missing_lookups["nvmlDeviceGetCurrentClocksEventReasons"] == 1
    assert t.clock_event_reasons == 0
    # ...nor the link-scoped NVLink error fields (R520): the per-link field ids of R4xx serve,
    # still in the one field-values call.
    assert {n.link: (n.crc_errors, n.replay_errors) for n in t.nvlinks if n.crc_errors} == {7: (5, 2)}
    assert calls["nvmlDeviceGetFieldValues"] == 1
    assert calls["nvmlDeviceGetNvLinkErrorCounter"] == 0
    assert (t.remapped_rows_uncorrectable, t.memory_clock_hz) == (0, 1215 * MHZ)  # an A100 40GB's HBM2


def test_without_field_values_every_counter_comes_from_its_own_call(install: Any) -> None:
    spec = {
        "gpus": [{"model": "A100-SXM4-80GB", "nvlink_links": 2}],
        "processes": [{"pid": 1, "gpus": [0], "sm_util": 60}],
        "faults": [
            {"at": "1s", "gpu": 0, "ecc": {"corrected": 3, "uncorrected": 1}},
            {"at": "1s", "gpu": 0, "remap": {"correctable": 2}},
            {"at": "1s", "gpu": 0, "nvlink_errors": {"links": [1], "recovery": 4}},
        ],
    }
    with_fields = health_of(polled_at(install, spec, 60), 0)
    fake_nvml.uninstall()
    faulted = {**spec, "faults": [*spec["faults"], {"call": "nvmlDeviceGetFieldValues", "error": "NOT_SUPPORTED"}]}
    without = health_of(polled_at(install, faulted, 60), 0)
    node = fake_nvml.installed()
    assert node is not None
    # The same figures, through nvmlDeviceGetTotalEccErrors, ..GetRemappedRows,
    # ..GetViolationStatus, ..GetPcieReplayCounter and ..GetNvLinkErrorCounter.
    assert (without.ecc_corrected_volatile, without.ecc_uncorrected_aggregate) == (3, 1)
    assert without.remapped_rows_correctable == 2
    assert [n.recovery_errors for n in without.nvlinks] == [0, 4]
    for name in (
        "ecc_corrected_volatile",
        "remapped_rows_correctable",
        "pcie_replays",
        "violation_s",
        "clock_event_reasons",
    ):
        assert getattr(without, name) == getattr(with_fields, name), name
    assert node.calls["nvmlDeviceGetTotalEccErrors"] >= 4
    assert node.calls["nvmlDeviceGetNvLinkErrorCounter"] >= 6
    # NVLink traffic has no call of its own: without fields, the GPU does not have it.
    assert [n.tx_bytes for n in without.nvlinks] == [None, None]
    assert [n.tx_bytes is not None for n in with_fields.nvlinks] == [True, True]


def test_a_driver_without_either_reasons_call_has_no_reasons(install: Any) -> None:
    node, sampler = install(
        {
            "node": {
                "driver_version": "550.54.15",
                "missing_functions": [
                    "nvmlDeviceGetCurrentClocksEventReasons",
                    "nvmlDeviceGetCurrentClocksThrottleReasons",
                ],
            },
            "gpus": [{"model": "A100-SXM4-80GB"}],
        }
    )
    for _ in range(3):
        snapshot = sampler.poll()
        node.clock.advance(5)
    assert health_of(snapshot, 0).clock_event_reasons is None
    assert node.library.missing_lookups["nvmlDeviceGetCurrentClocksEventReasons"] == 1
    assert node.library.missing_lookups["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1
    assert sampler.errors == {}


# --- MIG, a lost GPU, a transient error -----------------------------------------------------------


def test_a_mig_gpu_reads_its_own_health_on_the_slow_rhythm(install: Any) -> None:
    node, sampler = install("mig")
    first = sampler.poll()
    node.clock.advance(5)
    before = node.calls.copy()
    second = sampler.poll()
    between = node.calls - before
    parent, instances = second.gpus[0], second.mig_devices(second.gpus[0].uuid)
    t = parent.telemetry
    assert t is not None
    assert t.sm_clock_hz == A100_SM_MHZ * MHZ  # read at t=0 and carried: the GPU is busy (pid 800)
    assert (t.encoder_utilization, t.memory_utilization) == (None, None)  # none in MIG mode
    assert all(d.telemetry is None for d in instances)
    # Between slow polls the parent asks nothing for its health: its instances fill the poll.
    assert between["nvmlDeviceGetClockInfo"] == 0  # the SM clock is slow on every GPU
    assert between["nvmlDeviceGetCurrentClocksEventReasons"] == 0  # slow on every GPU
    assert health_of(first, 1).sm_clock_hz == A100_SM_MHZ * MHZ


def test_a_lost_gpu_has_no_health_and_the_others_keep_theirs(install: Any) -> None:
    node, sampler = install("gpu-lost")
    sampler.poll()
    node.clock.advance(3600)
    snapshot = sampler.poll()
    lost = [d for d in snapshot.gpus if not d.up]
    assert [d.index for d in lost] == [1]
    assert lost[0].telemetry is None
    assert all(d.telemetry is not None and d.telemetry.sm_clock_hz for d in snapshot.gpus if d.up)


def test_a_failed_slow_reading_is_asked_again_at_the_next_poll(install: Any) -> None:
    node, sampler = install(
        {
            "gpus": [{"model": "A100-SXM4-80GB"}],
            "faults": [
                {
                    "at": "25s",
                    "until": "35s",
                    "gpu": 0,
                    "call": "nvmlDeviceGetCurrPcieLinkGeneration",
                    "error": "TIMEOUT",
                }
            ],
        }
    )
    generations, calls = [], []
    for _ in range(9):  # t = 0, 5, .. 40: slow at 0 and 30
        before = node.calls["nvmlDeviceGetCurrPcieLinkGeneration"]
        generations.append(health_of(sampler.poll(), 0).pcie_link_generation)
        calls.append(node.calls["nvmlDeviceGetCurrPcieLinkGeneration"] - before)
        node.clock.advance(5)
    assert generations == [4, 4, 4, 4, 4, 4, None, 4, 4]
    assert calls == [1, 0, 0, 0, 0, 0, 1, 1, 0]  # 30 s failed: asked at 35 s, not at 60 s
    assert sampler.errors == {("nvmlDeviceGetCurrPcieLinkGeneration", "TIMEOUT"): 1}


# --- configuration ----------------------------------------------------------------------------------


def test_every_group_can_be_switched_off(install: Any) -> None:
    node, sampler = install("demo", ReadingOptions(groups=frozenset()))
    sampler.poll()
    assert all(d.telemetry is None for d in sampler.poll().devices)
    health_calls = {
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetMaxClockInfo",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetPerformanceState",
        "nvmlDeviceGetCurrPcieLinkGeneration",
        "nvmlDeviceGetEncoderUtilization",
    }
    assert health_calls.isdisjoint(node.calls)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_one_group_off_leaves_its_readings_out_and_only_those(group: str) -> None:
    on = dict.fromkeys(GROUPS, True)  # the opt-in PCIe throughput too
    rig_on = Rig("health", settings=Settings(readings=ReadingsConfig(**on)))
    try:
        full = names(rig_on.poll())
    finally:
        rig_on.close()
    rig_off = Rig("health", settings=Settings(readings=ReadingsConfig(**{**on, group: False})))
    try:
        less = names(rig_off.poll())
    finally:
        rig_off.close()
    missing = full - less
    assert missing, group
    assert missing <= GROUP_SERIES[group], (group, missing - GROUP_SERIES[group])


# Each group's series (gpuledger's own).
GROUP_SERIES = {
    "clocks": {
        "gpuledger_gpu_sm_clock_hertz",
        "gpuledger_gpu_memory_clock_hertz",
        "gpuledger_gpu_sm_clock_max_hertz",
        "gpuledger_gpu_memory_clock_max_hertz",
        "gpuledger_gpu_performance_state",
    },
    "fan": {"gpuledger_gpu_fan_speed_ratio"},
    "throttle": {"gpuledger_gpu_clock_event_reason", "gpuledger_gpu_clock_violation_seconds_total"},
    "memory_errors": {
        "gpuledger_gpu_ecc_errors_total",
        "gpuledger_gpu_ecc_aggregate_errors_total",
        "gpuledger_gpu_retired_pages_total",
        "gpuledger_gpu_retired_pages_pending",
        "gpuledger_gpu_remapped_rows_total",
        "gpuledger_gpu_row_remap_pending",
        "gpuledger_gpu_row_remap_failure",
    },
    "pcie": {
        "gpuledger_gpu_pcie_link_generation",
        "gpuledger_gpu_pcie_link_generation_max",
        "gpuledger_gpu_pcie_link_width",
        "gpuledger_gpu_pcie_link_width_max",
        "gpuledger_gpu_pcie_replays_total",
    },
    "pcie_throughput": {
        "gpuledger_gpu_pcie_transmit_bytes_per_second",
        "gpuledger_gpu_pcie_receive_bytes_per_second",
    },
    "nvlink_errors": {"gpuledger_gpu_nvlink_errors_total"},
    "nvlink_throughput": {"gpuledger_gpu_nvlink_transmit_bytes_total", "gpuledger_gpu_nvlink_receive_bytes_total"},
    "codecs": {"gpuledger_gpu_encoder_utilization_ratio", "gpuledger_gpu_decoder_utilization_ratio"},
    "memory_utilization": {"gpuledger_gpu_memory_controller_utilization_ratio"},
}


def names(state: Any) -> set[str]:
    text = generate_latest(make_registry(lambda: state)).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_pcie_throughput_is_opt_in_by_config_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().readings.pcie_throughput is False
    monkeypatch.setenv("GPULEDGER_READINGS__PCIE_THROUGHPUT", "true")
    monkeypatch.setenv("GPULEDGER_READINGS__SLOW_INTERVAL", "1m")
    settings = Settings()
    assert settings.readings.options() == ReadingOptions(frozenset(GROUPS), 60.0)
    rig = Rig("health", settings=settings)
    try:
        rig.poll()
        snapshot = rig.poll(60).snapshot
    finally:
        rig.close()
    assert snapshot is not None
    t = health_of(snapshot, 0)
    # GPU 0 at 80% of the fake's 2 GB/s to the GPU, half that back, in whole KiB/s
    assert (t.pcie_tx_bytes_per_s, t.pcie_rx_bytes_per_s) == (round(0.8e9 / 1024) * 1024, round(1.6e9 / 1024) * 1024)


def test_a_bad_readings_key_is_named(tmp_path: Any) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("readings:\n  fans: false\n  slow_interval: 0s\n")
    _settings, problems = check_config(config)
    assert sorted(problems) == [
        f"{config}: readings.fans: unknown key",
        f"{config}: readings.slow_interval: Input should be greater than 0",
    ]


def test_snapshot_shows_what_is_wrong_with_each_gpu() -> None:
    result = gpuledger("snapshot", "--fake", "health", "--at", "150m")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "NVLINK DOWN  SM MHZ" in lines[1]
    rows = {line.split()[0]: line for line in lines[2 : lines.index("")]}
    # after GPU, model, up, util, memory, busy (two words: "80% nvml"), temp, power, procs, NVLink
    assert rows["0"].split()[11] == "1410"
    assert "ecc-uncorrected:1,remap-pending" in rows["1"]
    assert "throttled:sw_thermal_slowdown" in rows["2"]
    assert "pcie:gen3x8<gen4x16" in rows["3"]
    assert "nvlink-errors:3961" in rows["4"]
    assert "ecc-uncorrected:1,page-retirement-pending" in rows["6"]


def test_snapshot_json_carries_the_telemetry() -> None:
    import json

    result = gpuledger("snapshot", "--fake", "health", "--at", "150m", "--json")
    assert result.returncode == 0, result.stderr
    devices = json.loads(result.stdout)["devices"]
    assert devices[3]["telemetry"]["pcie_link_width"] == 8
    assert devices[1]["telemetry"]["row_remap_pending"] is True


# --- the series -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def health_samples() -> list[tuple[str, dict[str, str], float]]:
    rig = Rig("health", settings=Settings(exporters=ExportersConfig(dcgm_compat=True)))
    try:
        rig.poll()
        state = rig.poll(AT_S)  # the slow readings are read now: AT_S - 0 is past 30 s
        text = rig.metrics(state)
    finally:
        rig.close()
    return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def value(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_gpuledger_series_carry_the_readings_in_base_units(health_samples: Any) -> None:
    s = health_samples
    assert value(s, "gpuledger_gpu_sm_clock_hertz", gpu="2") == round(A100_SM_MHZ * 0.75) * MHZ
    assert value(s, "gpuledger_gpu_clock_violation_seconds_total", gpu="2", cause="thermal") == AT_S
    reasons = {lab["reason"]: v for n, lab, v in s if n == "gpuledger_gpu_clock_event_reason" and lab["gpu"] == "2"}
    assert {r for r, v in reasons.items() if v == 1} == {"sw_thermal_slowdown"}
    assert len(reasons) == 11  # every named reason, 0 or 1
    assert value(s, "gpuledger_gpu_ecc_errors_total", gpu="1", type="uncorrected") == 1
    assert value(s, "gpuledger_gpu_ecc_aggregate_errors_total", gpu="1", type="corrected") == 40
    assert value(s, "gpuledger_gpu_row_remap_pending", gpu="1") == 1
    assert value(s, "gpuledger_gpu_remapped_rows_total", gpu="1", cause="uncorrectable") == 1
    assert value(s, "gpuledger_gpu_retired_pages_total", gpu="6", cause="double_bit") == 1
    assert value(s, "gpuledger_gpu_retired_pages_pending", gpu="6") == 1
    assert value(s, "gpuledger_gpu_pcie_link_width", gpu="3") == 8
    assert value(s, "gpuledger_gpu_pcie_link_width_max", gpu="3") == 16
    assert value(s, "gpuledger_gpu_pcie_replays_total", gpu="3") == 600
    assert value(s, "gpuledger_gpu_nvlink_errors_total", gpu="4", link="2", type="crc") == 3600
    assert value(s, "gpuledger_gpu_fan_speed_ratio", gpu="7") == 0.42
    assert value(s, "gpuledger_gpu_encoder_utilization_ratio", gpu="7") == 0.45
    # none of what a GPU does not have: no fan on an A100, no remapped rows on the V100
    assert not [n for n, lab, _ in s if n == "gpuledger_gpu_fan_speed_ratio" and lab["gpu"] != "7"]
    assert not [n for n, lab, _ in s if n == "gpuledger_gpu_remapped_rows_total" and lab["gpu"] == "6"]


# Each health field of dcgm-exporter, as the gpuledger series of the same GPU it must equal in
# DCGM's units: (series, labels, factor), or a sum over NVLink links of one error type.
DCGM_EQUALS = {
    "DCGM_FI_DEV_SM_CLOCK": ("gpuledger_gpu_sm_clock_hertz", {}, 1e-6),
    "DCGM_FI_DEV_MEM_CLOCK": ("gpuledger_gpu_memory_clock_hertz", {}, 1e-6),
    "DCGM_FI_DEV_MAX_SM_CLOCK": ("gpuledger_gpu_sm_clock_max_hertz", {}, 1e-6),
    "DCGM_FI_DEV_MAX_MEM_CLOCK": ("gpuledger_gpu_memory_clock_max_hertz", {}, 1e-6),
    "DCGM_FI_DEV_FAN_SPEED": ("gpuledger_gpu_fan_speed_ratio", {}, 100),
    "DCGM_FI_DEV_PSTATE": ("gpuledger_gpu_performance_state", {}, 1),
    "DCGM_FI_DEV_POWER_VIOLATION": ("gpuledger_gpu_clock_violation_seconds_total", {"cause": "power"}, 1e9),
    "DCGM_FI_DEV_THERMAL_VIOLATION": ("gpuledger_gpu_clock_violation_seconds_total", {"cause": "thermal"}, 1e9),
    "DCGM_FI_DEV_SYNC_BOOST_VIOLATION": ("gpuledger_gpu_clock_violation_seconds_total", {"cause": "sync_boost"}, 1e9),
    "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION": ("gpuledger_gpu_clock_violation_seconds_total", {"cause": "board_limit"}, 1e9),
    "DCGM_FI_DEV_LOW_UTIL_VIOLATION": (
        "gpuledger_gpu_clock_violation_seconds_total",
        {"cause": "low_utilization"},
        1e9,
    ),
    "DCGM_FI_DEV_RELIABILITY_VIOLATION": ("gpuledger_gpu_clock_violation_seconds_total", {"cause": "reliability"}, 1e9),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("gpuledger_gpu_ecc_errors_total", {"type": "corrected"}, 1),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("gpuledger_gpu_ecc_errors_total", {"type": "uncorrected"}, 1),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": ("gpuledger_gpu_ecc_aggregate_errors_total", {"type": "corrected"}, 1),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": ("gpuledger_gpu_ecc_aggregate_errors_total", {"type": "uncorrected"}, 1),
    "DCGM_FI_DEV_RETIRED_SBE": ("gpuledger_gpu_retired_pages_total", {"cause": "single_bit"}, 1),
    "DCGM_FI_DEV_RETIRED_DBE": ("gpuledger_gpu_retired_pages_total", {"cause": "double_bit"}, 1),
    "DCGM_FI_DEV_RETIRED_PENDING": ("gpuledger_gpu_retired_pages_pending", {}, 1),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("gpuledger_gpu_remapped_rows_total", {"cause": "correctable"}, 1),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("gpuledger_gpu_remapped_rows_total", {"cause": "uncorrectable"}, 1),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("gpuledger_gpu_row_remap_failure", {}, 1),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": ("gpuledger_gpu_row_remap_pending", {}, 1),
    "DCGM_FI_DEV_PCIE_LINK_GEN": ("gpuledger_gpu_pcie_link_generation", {}, 1),
    "DCGM_FI_DEV_PCIE_LINK_WIDTH": ("gpuledger_gpu_pcie_link_width", {}, 1),
    "DCGM_FI_DEV_PCIE_MAX_LINK_GEN": ("gpuledger_gpu_pcie_link_generation_max", {}, 1),
    "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH": ("gpuledger_gpu_pcie_link_width_max", {}, 1),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("gpuledger_gpu_pcie_replays_total", {}, 1),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": ("gpuledger_gpu_nvlink_errors_total", {"type": "crc"}, 1),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": ("gpuledger_gpu_nvlink_errors_total", {"type": "replay"}, 1),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": ("gpuledger_gpu_nvlink_errors_total", {"type": "recovery"}, 1),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("gpuledger_gpu_memory_controller_utilization_ratio", {}, 100),
    "DCGM_FI_DEV_ENC_UTIL": ("gpuledger_gpu_encoder_utilization_ratio", {}, 100),
    "DCGM_FI_DEV_DEC_UTIL": ("gpuledger_gpu_decoder_utilization_ratio", {}, 100),
}


def test_each_dcgm_health_field_equals_gpuledgers_reading_of_the_same_gpu(health_samples: Any) -> None:
    s = health_samples
    checked = 0
    for name, (ours, labels, factor) in DCGM_EQUALS.items():
        for dcgm_labels, dcgm_value in [(lab, v) for n, lab, v in s if n == name]:
            gpu = dcgm_labels["gpu"]
            # summed over links for the NVLink totals; a single series otherwise
            total = sum(v for n, lab, v in s if n == ours and lab["gpu"] == gpu and labels.items() <= lab.items())
            assert dcgm_value == round(total * factor), (name, gpu)
            checked += 1
    assert checked >= 8 * 25
    # The clock-event bitmask is the sum of the reason bits gpuledger decodes as raised.
    bits = {name: bit for bit, name in CLOCK_EVENT_REASONS}
    for gpu in map(str, range(8)):
        raised = [
            lab["reason"] for n, lab, v in s if n == "gpuledger_gpu_clock_event_reason" and lab["gpu"] == gpu and v
        ]
        assert value(s, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", gpu=gpu) == sum(bits[r] for r in raised)
    # NVLink bandwidth as DCGM computes it: KiB per second over the interval, / 1000.
    # GPU 0: 12 links x 2 directions x 0.8 x 20 GB/s, steady since t=0
    assert value(s, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu="0") == pytest.approx(
        12 * 2 * 0.8 * NVLINK_BYTES_PER_S / 1024 / 1000, abs=1
    )


def test_the_read_plans_kept_per_device_stay_bounded(install: Any) -> None:
    """The lists of readings a poll asks for vary with what is being retried; the backend keeps
    a read plan per list, and no more than a few."""
    _node, sampler = install({"gpus": [{"model": "A100-SXM4-80GB"}]})
    backend = sampler.backend
    handle = backend.handle_by_index(0)
    q = Quantity
    quantities = (q.POWER, q.ENERGY, q.SM_CLOCK, q.PCIE_REPLAYS, q.ECC_CORRECTED_VOLATILE, q.TEMPERATURE)
    for size in range(1, len(quantities) + 1):
        for subset in itertools.combinations(quantities, size):  # 63 different lists
            result = backend.read(handle, [ReadingKey(x) for x in subset])
            assert set(result.values) == {ReadingKey(x) for x in subset}
    assert 1 <= len(handle.plans) <= 16


def test_a_gpu_whose_field_values_stop_loses_only_what_has_no_other_call(install: Any) -> None:
    node, sampler = install(
        {
            "gpus": [{"model": "A100-SXM4-80GB", "count": 2, "nvlink_links": 2}],
            "processes": [{"pid": 1, "gpus": [0, 1], "sm_util": 50}],
            "faults": [{"at": "30s", "gpu": 1, "call": "nvmlDeviceGetFieldValues", "error": "NOT_SUPPORTED"}],
        }
    )
    for _ in range(10):  # t = 0 .. 45
        snapshot = sampler.poll()
        node.clock.advance(5)
    ok, refused = health_of(snapshot, 0), health_of(snapshot, 1)
    # GPU 1 reads power, energy, NVLink state and the counters through their own calls; its
    # NVLink traffic, which has no call of its own, is learned gone, not counted every poll.
    assert snapshot.devices[1].power_w == snapshot.devices[0].power_w
    assert [link.up for link in snapshot.devices[1].nvlinks] == [True, True]
    assert refused.pcie_replays == ok.pcie_replays == 0
    assert [n.tx_bytes for n in refused.nvlinks] == [None, None]
    assert all(n.tx_bytes for n in ok.nvlinks)  # GPU 0 still batches, traffic and all
    assert sampler.errors == {}


# Each reading, and the NVML call whose refusal (NOT_SUPPORTED, sticky) takes it away: for the
# counters NVML batches as fields, the fake refuses the field and the call together, so every
# path the agent has is refused.
NOT_SUPPORTED_CASES = {
    "SM clock": ("nvmlDeviceGetClockInfo", "sm_clock_hz"),
    "maximum SM clock": ("nvmlDeviceGetMaxClockInfo", "sm_clock_max_hz"),
    "performance state": ("nvmlDeviceGetPerformanceState", "performance_state"),
    "PCIe generation": ("nvmlDeviceGetCurrPcieLinkGeneration", "pcie_link_generation"),
    "PCIe width": ("nvmlDeviceGetCurrPcieLinkWidth", "pcie_link_width"),
    "PCIe maximum generation": ("nvmlDeviceGetMaxPcieLinkGeneration", "pcie_link_generation_max"),
    "PCIe maximum width": ("nvmlDeviceGetMaxPcieLinkWidth", "pcie_link_width_max"),
    "encoder": ("nvmlDeviceGetEncoderUtilization", "encoder_utilization"),
    "decoder": ("nvmlDeviceGetDecoderUtilization", "decoder_utilization"),
    "memory controller": ("nvmlDeviceGetUtilizationRates", "memory_utilization"),
    "ECC errors (field, then call)": ("nvmlDeviceGetTotalEccErrors", "ecc_uncorrected_volatile"),
    "remapped rows (field, then call)": ("nvmlDeviceGetRemappedRows", "row_remap_pending"),
    "PCIe replays (field, then call)": ("nvmlDeviceGetPcieReplayCounter", "pcie_replays"),
    "violation time (field, then call)": ("nvmlDeviceGetViolationStatus", "violation_s"),
}


@pytest.mark.parametrize(("call", "attribute"), NOT_SUPPORTED_CASES.values(), ids=NOT_SUPPORTED_CASES.keys())
def test_a_reading_every_path_refuses_is_absent_and_asked_no_more(install: Any, call: str, attribute: str) -> None:
    node, sampler = install(
        {
            "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
            "processes": [{"pid": 1, "gpus": [0, 1], "sm_util": 50}],
            "faults": [{"gpu": 1, "call": call, "error": "NOT_SUPPORTED"}],
        }
    )
    asked = []
    for _ in range(4):  # every 35 s: each poll a slow one
        before = node.calls[call]
        snapshot = sampler.poll()
        asked.append(node.calls[call] - before)
        node.clock.advance(35)
    healthy, refused = health_of(snapshot, 0), health_of(snapshot, 1)
    assert getattr(refused, attribute) in (None, ())
    assert getattr(healthy, attribute) not in (None, ())
    # learned at the first poll: from then on only GPU 0 is asked (if anything asks the call:
    # where GPU 0 reads a field, nobody does)
    assert asked[1] == asked[2] == asked[3] <= asked[0] - 1
    assert sampler.errors == {}
