"""The fake's hardware health over time: clocks and throttling follow load, temperature and
`throttle:` faults; counters move with `ecc:`, `remap:`, `pcie_downgrade:` and `nvlink_errors:`
faults; the driver decides which calls and fields exist; bad fault keys fail at load."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

import fake_nvml
from fake_nvml.scenario import ScenarioError

NS = 10**9


@pytest.fixture
def node() -> Iterator[Any]:
    def _install(scenario: dict[str, Any]) -> fake_nvml.InstalledNode:
        installed = fake_nvml.install({"start": "2026-11-20T18:00:00Z", **scenario}, host=False)
        pynvml.nvmlInit()
        return installed

    yield _install
    fake_nvml.uninstall()


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def violation_ns(gpu: int, policy: int) -> int:
    return int(pynvml.nvmlDeviceGetViolationStatus(handle(gpu), policy).violationTime)


def test_violation_time_integrates_each_cause_over_scenario_time(node: Any) -> None:
    installed = node(
        {
            "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
            # GPU 0 idle for 100 s, then at 50% from 100 s; GPU 1 at 100%: its power is the limit
            "processes": [
                {"pid": 1, "gpus": [0], "start": "100s", "sm_util": 50},
                {"pid": 2, "gpus": [1], "sm_util": 100},
            ],
            "faults": [{"at": "50s", "until": "80s", "gpu": 0, "throttle": "thermal"}],
        }
    )
    installed.clock.advance(300)
    # GPU 0: idle (low utilization) 0-100 s; the thermal fault 50-80 s holds clocks below the
    # application clocks then too.
    assert violation_ns(0, pynvml.NVML_PERF_POLICY_LOW_UTILIZATION) == 100 * NS
    assert violation_ns(0, pynvml.NVML_PERF_POLICY_THERMAL) == 30 * NS
    assert violation_ns(0, pynvml.NVML_PERF_POLICY_TOTAL_APP_CLOCKS) == 30 * NS
    assert violation_ns(0, pynvml.NVML_PERF_POLICY_POWER) == 0
    # GPU 1: at its power limit all 300 s
    assert violation_ns(1, pynvml.NVML_PERF_POLICY_POWER) == 300 * NS
    assert violation_ns(1, pynvml.NVML_PERF_POLICY_LOW_UTILIZATION) == 0
    # The same counters as fields (perf-policy ids 74-81), in ns.
    fields = pynvml.nvmlDeviceGetFieldValues(handle(1), [74, 78])
    assert [f.value.ullVal for f in fields] == [300 * NS, 0]


def test_clocks_and_reasons_follow_load_temperature_and_throttle_faults(node: Any) -> None:
    installed = node(
        {
            # idle 32 C, 88 C at full load: past the 87 C maximum operating temperature at 95%
            "gpus": [{"model": "H100-SXM5-80GB", "max_temp_c": 91}],
            "processes": [
                {"pid": 1, "gpus": [0], "sm_util": [{"at": "0s", "sm_util": 50}, {"at": "1h", "sm_util": 95}]}
            ],
            "faults": [{"at": "2h", "until": "3h", "gpu": 0, "throttle": "hw_power_brake"}],
        }
    )
    h = handle(0)

    def state() -> tuple[int, int]:
        return (
            pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            pynvml.nvmlDeviceGetCurrentClocksEventReasons(h),
        )

    # 50%: 32 + 59 x 0.5 = 61.5 C, 70 + 630 x 0.5 = 385 W of 700: the H100's full 1980 MHz
    assert state() == (1980, 0)
    installed.clock.advance(3600)
    # 95%: 32 + 59 x 0.95 = 88.05 C: software thermal slowdown, clocks at 75%
    assert state() == (round(1980 * 0.75), pynvml.nvmlClocksEventReasonSwThermalSlowdown)
    installed.clock.advance(3600)
    # the power brake on top: hardware slowdown, clocks at half
    assert state() == (
        1980 // 2,
        pynvml.nvmlClocksEventReasonSwThermalSlowdown
        | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
        | pynvml.nvmlClocksEventReasonHwSlowdown,
    )
    installed.clock.advance(3600)
    assert state() == (round(1980 * 0.75), pynvml.nvmlClocksEventReasonSwThermalSlowdown)
    assert pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980


def test_counts_arrive_at_once_or_spread_to_until(node: Any) -> None:
    installed = node(
        {
            "gpus": [{"model": "A100-SXM4-80GB", "nvlink_links": 4}],
            "faults": [
                {"at": "10m", "gpu": 0, "ecc": {"uncorrected": 1}},
                {"at": "0s", "until": "1h", "gpu": 0, "ecc": {"corrected": 60}},
                {"at": "0s", "until": "100s", "gpu": 0, "nvlink_errors": {"links": [2], "crc": 1000}},
                {"at": "30m", "until": "40m", "gpu": 0, "pcie_downgrade": {"generation": 3, "replays": 100}},
            ],
        }
    )
    h = handle(0)
    installed.clock.advance(600)  # 10 m: the uncorrected error has happened; 10 of 60 corrected
    uncorrected, corrected = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    assert pynvml.nvmlDeviceGetTotalEccErrors(h, uncorrected, pynvml.NVML_VOLATILE_ECC) == 1
    assert pynvml.nvmlDeviceGetTotalEccErrors(h, corrected, pynvml.NVML_VOLATILE_ECC) == 10
    # 1000 CRC errors spread over 100 s were all counted by 10 m; other links counted none
    crc = pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT
    assert [pynvml.nvmlDeviceGetNvLinkErrorCounter(h, link, crc) for link in range(4)] == [0, 0, 1000, 0]
    assert pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h) == 4
    installed.clock.advance(1500)  # 35 m: half way through the downgrade's 100 replays
    assert pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h) == 3
    assert pynvml.nvmlDeviceGetCurrPcieLinkWidth(h) == 16  # the fault names no width
    assert pynvml.nvmlDeviceGetPcieReplayCounter(h) == 50
    installed.clock.advance(600)  # 45 m: the link has trained back up; the replays stay counted
    assert pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h) == 4
    assert pynvml.nvmlDeviceGetPcieReplayCounter(h) == 100


def test_a_pending_remap_is_applied_at_the_reset_and_a_failure_stays(node: Any) -> None:
    installed = node(
        {
            "gpus": [{"model": "A100-SXM4-80GB"}],
            "faults": [
                {"at": "1h", "until": "2h", "gpu": 0, "remap": {"uncorrectable": 1}},
                {"at": "3h", "gpu": 0, "remap": {"correctable": 1, "failure": True}},
            ],
        }
    )
    h = handle(0)
    assert pynvml.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 0)
    installed.clock.advance(3600)
    assert pynvml.nvmlDeviceGetRemappedRows(h) == (0, 1, 1, 0)  # pending until the reset
    installed.clock.advance(3600)
    assert pynvml.nvmlDeviceGetRemappedRows(h) == (0, 1, 0, 0)
    installed.clock.advance(3600)
    assert pynvml.nvmlDeviceGetRemappedRows(h) == (1, 1, 0, 1)


def test_nvlink_traffic_follows_load_and_stops_on_a_link_that_is_down(node: Any) -> None:
    installed = node(
        {
            "gpus": [{"model": "A100-SXM4-80GB", "nvlink_links": 2}],
            "processes": [{"pid": 1, "gpus": [0], "sm_util": 50}],
            "faults": [{"at": "10s", "until": "20s", "gpu": 0, "nvlink_down": [1]}],
        }
    )
    installed.clock.advance(30)
    fields = pynvml.nvmlDeviceGetFieldValues(
        handle(0),
        [
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0),
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 1),
        ],
    )
    # 50% of 20 GB/s per link and direction: link 0 for 30 s, link 1 for the 20 s it was up (KiB)
    assert [f.value.ullVal for f in fields] == [int(0.5 * 20e9 * 30 / 1024), int(0.5 * 20e9 * 20 / 1024)]


@pytest.mark.parametrize(
    ("driver", "event_reasons", "dl_fields", "remap_fields"),
    [("470.82.01", False, False, True), ("515.65.01", False, False, True), ("535.104.05", True, True, True)],
)
def test_the_driver_decides_which_calls_and_fields_exist(
    node: Any, driver: str, event_reasons: bool, dl_fields: bool, remap_fields: bool
) -> None:
    node({"node": {"driver_version": driver}, "gpus": [{"model": "A100-SXM4-80GB", "nvlink_links": 2}]})
    h = handle(0)
    # R535 renamed the throttle-reasons call; the old name stays.
    assert pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h) == pynvml.nvmlClocksThrottleReasonGpuIdle
    if event_reasons:
        assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) == pynvml.nvmlClocksEventReasonGpuIdle
    else:
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
    codes = {
        f.fieldId: f.nvmlReturn
        for f in pynvml.nvmlDeviceGetFieldValues(h, [(163, 0), 142, pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L0])
    }
    ok, refused = pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED
    assert codes == {163: ok if dl_fields else refused, 142: ok if remap_fields else refused, 32: ok}


def test_a_mig_instance_has_no_health_readings_of_its_own(node: Any) -> None:
    node({"gpus": [{"model": "A100-SXM4-80GB", "mig": ["3g.40gb"]}]})
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle(0), 0)
    for read in (
        lambda: pynvml.nvmlDeviceGetClockInfo(mig, pynvml.NVML_CLOCK_SM),
        lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(mig),
        lambda: pynvml.nvmlDeviceGetRemappedRows(mig),
        lambda: pynvml.nvmlDeviceGetEncoderUtilization(handle(0)),  # nor the MIG-enabled GPU's engines
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            read()
    assert pynvml.nvmlDeviceGetClockInfo(handle(0), pynvml.NVML_CLOCK_SM) == 210  # the GPU's own: idle


def test_a_memory_error_moves_the_counters_and_sends_the_event_whichever_way_the_scenario_says_it(
    node: Any,
) -> None:
    # One model of a memory error: an `ecc:` fault sends an ECC event for each error, when its
    # counter steps up, and an ECC `event:` is one error that moves the counters too.
    installed = node(
        {
            "gpus": [{"model": "A100-SXM4-80GB"}, {"model": "V100-SXM2-32GB"}],
            "faults": [
                {"at": "1h", "until": "2h", "gpu": 0, "ecc": {"corrected": 4}},  # one each 15 min
                {"at": "90m", "gpu": 0, "ecc": {"uncorrected": 1}},
                {"at": "3h", "gpu": 1, "event": "double_bit_ecc"},
                {"at": "3h", "gpu": 0, "event": "single_bit_ecc"},
            ],
        }
    )
    event_set = pynvml.nvmlEventSetCreate()
    ecc_events = pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError
    for gpu in (0, 1):
        pynvml.nvmlDeviceRegisterEvents(handle(gpu), ecc_events, event_set)

    def counts(gpu: int) -> tuple[int, ...]:
        return tuple(
            pynvml.nvmlDeviceGetTotalEccErrors(handle(gpu), kind, counter)
            for kind in (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
            for counter in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC)
        )

    def delivered() -> list[tuple[int, int]]:
        got = []
        while True:
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, 0)
            except pynvml.NVMLError_Timeout:
                return got
            got.append((pynvml.nvmlDeviceGetIndex(data.device), data.eventType))

    sbe, dbe = pynvml.nvmlEventTypeSingleBitEccError, pynvml.nvmlEventTypeDoubleBitEccError
    installed.clock.advance(3600 + 30 * 60)  # 1h30m: two corrected errors (1h15m, 1h30m), one uncorrected
    assert counts(0) == (2, 2, 1, 1)
    assert delivered() == [(0, sbe), (0, sbe), (0, dbe)]  # in scenario time order
    installed.clock.advance(30 * 60 - 1)  # just before 2h: the fourth corrected error is still to come
    assert counts(0) == (3, 3, 1, 1)
    assert delivered() == [(0, sbe)]
    installed.clock.advance(3600 + 1)  # 3h: the last corrected error at 2h, then the two ECC events
    assert counts(0) == (5, 5, 1, 1)
    assert counts(1) == (0, 0, 1, 1)
    # The V100's double-bit error retires its page, as any uncorrected error on a pre-Ampere GPU.
    assert len(pynvml.nvmlDeviceGetRetiredPages(handle(1), 1)) == 1
    assert delivered() == [(0, sbe), (1, dbe), (0, sbe)]


def test_an_uncorrectable_memory_error_sends_the_xid_its_architecture_logs_beside_the_ecc_event(node: Any) -> None:
    # One double-bit error on each of a V100 (page retirement: Xid 48), an A100 and an H100 (row
    # remapping, the error contained: Xid 94); a corrected one on the A100 sends no Xid.
    installed = node(
        {
            "gpus": [{"model": "V100-SXM2-32GB"}, {"model": "A100-SXM4-80GB"}, {"model": "H100-SXM5-80GB"}],
            "faults": [
                {"at": "10m", "gpu": 0, "ecc": {"uncorrected": 1}},
                {"at": "20m", "gpu": 1, "ecc": {"uncorrected": 1, "corrected": 1}},
                {"at": "30m", "gpu": 2, "event": "double_bit_ecc"},
            ],
        }
    )
    event_set = pynvml.nvmlEventSetCreate()
    wanted = (
        pynvml.nvmlEventTypeSingleBitEccError
        | pynvml.nvmlEventTypeDoubleBitEccError
        | pynvml.nvmlEventTypeXidCriticalError
    )
    for gpu in range(3):
        pynvml.nvmlDeviceRegisterEvents(handle(gpu), wanted, event_set)
    installed.clock.advance(3600)
    got = []
    while True:
        try:
            data = pynvml.nvmlEventSetWait_v2(event_set, 0)
        except pynvml.NVMLError_Timeout:
            break
        got.append((pynvml.nvmlDeviceGetIndex(data.device), data.eventType, data.eventData))
    sbe, dbe = pynvml.nvmlEventTypeSingleBitEccError, pynvml.nvmlEventTypeDoubleBitEccError
    xid = pynvml.nvmlEventTypeXidCriticalError
    assert got == [
        (0, dbe, 0), (0, xid, 48),
        (1, sbe, 0), (1, dbe, 0), (1, xid, 94),
        (2, dbe, 0), (2, xid, 94),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ({"ecc": {"corrected": 1}}, "faults[0].gpu: ecc needs the GPU it happens on"),
        ({"gpu": 0, "ecc": {"single": 1}}, "faults[0].ecc.single: unknown key"),
        ({"gpu": 0, "throttle": "cosmic"}, "faults[0].throttle: unknown cause 'cosmic'"),
        ({"gpu": 1, "remap": {"uncorrectable": 1}}, "faults[0].remap: a T4 retires pages instead"),
        ({"gpu": 0, "remap": {"pending": "yes"}}, "faults[0].remap.pending: expected true or false"),
        ({"gpu": 0, "pcie_downgrade": {"generation": 5}}, "faults[0].pcie_downgrade.generation: the A100-SXM4-80GB's"),
        ({"gpu": 1, "nvlink_errors": {"crc": 1}}, "faults[0].nvlink_errors: GPU 1 has no NVLink links"),
        (
            {"gpu": 0, "nvlink_errors": {"links": [7], "crc": 1}},
            "faults[0].nvlink_errors.links: GPU 0 has no NVLink link 7",
        ),
        (
            {"gpu": 0, "event": "double_bit_ecc", "ecc": {"uncorrected": 2}},
            "faults[0].event: double_bit_ecc is an ecc fault of one error: give ecc or event, not both",
        ),
    ],
)
def test_a_bad_health_fault_fails_at_load_naming_its_key(fault: dict[str, Any], message: str) -> None:
    scenario = {"gpus": [{"model": "A100-SXM4-80GB", "nvlink_links": 4}, {"model": "T4"}], "faults": [fault]}
    with pytest.raises(ScenarioError, match=r"^scenario: " + message.replace("(", r"\(").replace("[", r"\[")):
        fake_nvml.load_scenario(scenario)
