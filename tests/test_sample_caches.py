"""What the sample stage remembers from one poll to the next to keep polls cheap, and that each
memo lets go when what it was made from changes: a poll must read exactly what it would have
read without it."""

from __future__ import annotations

from agent.devices.backend import Quantity, ReadingKey
from agent.devices.telemetry import ReadingOptions, TelemetryReader
from agent.model import Telemetry

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
    # Link 1 carries 1 KiB more each way, and the SM clock moves.
    traffic = {ReadingKey(Q.NVLINK_TX_BYTES, 1): 1025.0, ReadingKey(Q.NVLINK_RX_BYTES, 1): 1025.0}
    fourth, _ = poll(15.0, {**traffic, ReadingKey(Q.SM_CLOCK): 2.0})
    assert fourth is not third
    assert fourth.sm_clock_hz == 2.0
    assert fourth.nvlinks[1].tx_bytes == 1025
    assert fourth.nvlinks[1].rx_bytes == 1025
    # 2 x 1024 bytes more over the 5 s since the previous poll
    assert fourth.nvlink_bytes_per_s == 2 * 1024 / 5
    assert fourth.nvlinks[0] is third.nvlinks[0]  # link 0's counters did not change
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
