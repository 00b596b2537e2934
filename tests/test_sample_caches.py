"""What the sample stage remembers from one poll to the next to keep polls cheap, and that each
memo lets go when what it was made from changes: a poll must read exactly what it would have
read without it."""

from __future__ import annotations

from agent.devices.backend import Quantity, ReadingKey
from agent.devices.sampler import Unsupported
from agent.devices.telemetry import ReadingOptions, TelemetryReader
from agent.model import Telemetry
from fake_nvml import FakeNode, ScenarioClock, load_scenario

Q = Quantity


def test_telemetry_is_handed_on_while_its_readings_hold_and_rebuilt_where_they_change() -> None:
    reader = TelemetryReader(ReadingOptions(), links=2)

    def poll(now: float, changed: dict[ReadingKey, float] | None = None) -> tuple[Telemetry, tuple[ReadingKey, ...]]:
        asked = reader.keys(now)
        values = dict.fromkeys(asked, 1.0) | {k: v for k, v in (changed or {}).items() if k in asked}
        return reader.telemetry(now, asked, values), asked

    poll(0.0)
    second, _ = poll(5.0)  # the first poll with an NVLink rate (0 B/s: the counters stood still)
    third, asked = poll(10.0)
    assert ReadingKey(Q.ECC_CORRECTED_VOLATILE) not in asked  # between slow polls
    assert third is second  # nothing changed: handed on
    # Link 1 carries 1 KiB more each way, and the memory controller's utilization moves; the SM
    # clock is a slow reading, so a new value for it is not asked.
    traffic = {ReadingKey(Q.NVLINK_TX_BYTES, 1): 1025.0, ReadingKey(Q.NVLINK_RX_BYTES, 1): 1025.0}
    fourth, asked = poll(15.0, {**traffic, ReadingKey(Q.MEMORY_UTILIZATION): 0.5, ReadingKey(Q.SM_CLOCK): 2.0})
    assert ReadingKey(Q.SM_CLOCK) not in asked
    assert fourth is not third
    assert fourth.memory_utilization == 0.5
    assert fourth.sm_clock_hz == 1.0  # as read at the first poll
    assert fourth.nvlinks[1].tx_bytes == 1025
    assert fourth.nvlinks[1].rx_bytes == 1025
    # 2 x 1024 bytes more over the 5 s since the previous poll
    assert fourth.nvlink_bytes_per_s == 2 * 1024 / 5
    assert fourth.nvlinks[0] == third.nvlinks[0]  # link 0 carried nothing more
    # A slow poll (30 s after the first) reads a new ECC count; the rest as before.
    fifth, asked = poll(30.0, {**traffic, ReadingKey(Q.SM_CLOCK): 2.0, ReadingKey(Q.ECC_CORRECTED_VOLATILE): 3.0})
    assert ReadingKey(Q.ECC_CORRECTED_VOLATILE) in asked
    assert fifth.ecc_corrected_volatile == 3
    assert fifth.sm_clock_hz == 2.0
    assert fifth.nvlink_bytes_per_s == 0.0
    # A link none of whose counters answers is left out (slow poll: its error counts are asked).
    asked = reader.keys(60.0)
    values = {key: 1.0 for key in asked if key.link != 0}
    values |= {**traffic, ReadingKey(Q.SM_CLOCK): 2.0, ReadingKey(Q.ECC_CORRECTED_VOLATILE): 3.0}
    sixth = reader.telemetry(60.0, asked, values)
    assert [c.link for c in sixth.nvlinks] == [1]
    assert sixth.nvlink_bytes_per_s is None  # link 0's traffic is unknown


# GPU 0's readings change at its edges: a process starts (1h), changes load and memory (2h) and
# ends (5h), a link is down from 2h30 to 3h, a thermal throttle holds from 3h30 to 4h. GPU 1
# replays a recording whose rows change what it shows at 1h and 2h.
EDGES_S = (3600.0, 7200.0, 9000.0, 10800.0, 12600.0, 14400.0, 18000.0)
CHANGING = {
    "gpus": [
        {"model": "A100-SXM4-80GB", "nvlink_links": 4},
        {
            "model": "A100-SXM4-80GB",
            "nvlink_links": 4,
            "readings": [
                {"at": "0s", "utilization": 10, "power_w": 90, "temperature_c": 40},
                {"at": "1h", "utilization": 70, "power_w": 300, "temperature_c": 88, "nvlink_down": [2]},
                {"at": "2h", "utilization": 0, "memory_used_mib": 100},
            ],
        },
    ],
    "processes": [
        {
            "pid": 7,
            "gpus": [0],
            "start": "1h",
            "end": "5h",
            "memory_mib": 500,
            "sm_util": [{"at": "0s", "sm_util": 50}, {"at": "1h", "sm_util": 100, "memory_mib": 1000}],
        }
    ],
    "faults": [
        {"at": "2h30m", "until": "3h", "gpu": 0, "nvlink_down": [1]},
        {"at": "3h30m", "until": "4h", "gpu": 0, "throttle": "thermal"},
    ],
}


def readings_at(node: FakeNode, gpu: int, t: float) -> tuple[object, ...]:
    health = node.health
    return (
        node.utilization(gpu, t),
        node.power_w(gpu, t),
        node.temperature_c(gpu, t),
        node.memory_used_bytes(gpu, None, t),
        node.memory_used_mib(gpu, None, t),
        node.nvlinks_down(gpu, t),
        tuple(p.pid for p in node.processes_on(gpu, None, t)),
        health.clock_event_reasons(gpu, t),
        health.sm_clock_mhz(gpu, t),
        health.performance_state(gpu, t),
    )


def test_the_fake_gpus_state_is_worked_out_again_at_every_edge() -> None:
    """One node asked along the timeline (as polls ask, and at and around each edge) answers
    what a node asked only at that time answers: nothing carried over an edge."""
    scenario = load_scenario(CHANGING)
    node = FakeNode(scenario, ScenarioClock(scenario.start_epoch))
    times = sorted(
        {450.0 * k for k in range(49)} | {edge + offset for edge in EDGES_S for offset in (-0.5, -1e-7, 0.0, 1e-7, 0.5)}
    )
    seen = set()
    for t in times:
        for gpu in (0, 1):
            fresh = FakeNode(scenario, ScenarioClock(scenario.start_epoch))
            assert readings_at(node, gpu, t) == readings_at(fresh, gpu, t), (gpu, t)
            seen.add(readings_at(node, gpu, t))
    # The timeline meets every state the scenario has (else it tests less than it says): GPU 0
    # idle, at 50%, at 100% (at the power cap), with a link down, throttled; GPU 1's three rows.
    assert len(seen) == 8


def test_what_a_device_is_asked_for_follows_what_it_has_shown_it_lacks() -> None:
    unsupported = Unsupported()
    keys = (ReadingKey(Q.TEMPERATURE), ReadingKey(Q.POWER), ReadingKey(Q.FAN_SPEED), ReadingKey(Q.SM_CLOCK))
    assert unsupported.wanted(keys) == keys
    unsupported.add(ReadingKey(Q.FAN_SPEED))
    assert unsupported.wanted(keys) == (ReadingKey(Q.TEMPERATURE), ReadingKey(Q.POWER), ReadingKey(Q.SM_CLOCK))
    assert unsupported.wanted(keys[:2]) == keys[:2]
    # Learned mid-run, after the list was asked for: not asked again from then on.
    unsupported.add(ReadingKey(Q.POWER))
    assert unsupported.wanted(keys) == (ReadingKey(Q.TEMPERATURE), ReadingKey(Q.SM_CLOCK))
    unsupported.add("processes")  # a call, not a reading: the lists are as they were
    assert unsupported.wanted(keys) == (ReadingKey(Q.TEMPERATURE), ReadingKey(Q.SM_CLOCK))
    unsupported.discard(ReadingKey(Q.FAN_SPEED))
    assert unsupported.wanted(keys) == (ReadingKey(Q.TEMPERATURE), ReadingKey(Q.FAN_SPEED), ReadingKey(Q.SM_CLOCK))


def test_the_fakes_counters_integrate_each_stretch_at_its_own_rate() -> None:
    """GPU 0's violation time and NVLink traffic, integrated poll by poll on one node, equal what
    a node asked only at that time integrates from the start (every figure here is a whole
    number of seconds and bytes, so the sums are exact whatever their order). GPU 1 is left
    out: the integrals do not stop at a recording's rows, so there they depend on the polls."""
    scenario = load_scenario(CHANGING)
    node = FakeNode(scenario, ScenarioClock(scenario.start_epoch))
    policies = range(12)  # nvmlPerfPolicyType_t; the fake keeps 0-5, 10 and 11

    def counters(node: FakeNode, t: float) -> list[int | None]:
        found = [node.health.violation_ns(0, policy, t) for policy in policies]
        return found + [node.health.nvlink_kib(0, link, t) for link in range(4)]

    for t in (450.0 * k for k in range(49)):
        assert counters(node, t) == counters(FakeNode(scenario, ScenarioClock(scenario.start_epoch)), t), t
    # GPU 0 at the end (6h): idle 1h and 1h (low utilization); at the power cap 3h; thermal 30m
    assert node.health.violation_ns(0, 4, 21600.0) == 7200 * 10**9
    assert node.health.violation_ns(0, 0, 21600.0) == 3 * 3600 * 10**9
    assert node.health.violation_ns(0, 1, 21600.0) == 1800 * 10**9
