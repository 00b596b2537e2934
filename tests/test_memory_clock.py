"""The memory clock's rhythm (issue 11's call budget): a GPU that supports a single memory clock
(HBM: A100, H100) has its memory clock read once, with the maxima; a GPU with several (GDDR:
L4, T4), or one that cannot say, keeps it on the slow rhythm. Either way every poll shows it.
The fake's nvmlDeviceGetSupportedMemoryClocks is held to the C function's contract here too."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

import fake_nvml
from agent.devices.backend import Quantity, ReadingKey
from agent.devices.nvml import NvmlBackend
from agent.devices.sampler import Sampler
from agent.devices.telemetry import ReadingOptions, TelemetryReader
from agent.model import Snapshot

MHZ = 1e6
# fake_nvml/scenario/facts.py's data sheets: an A100 SXM4 80GB's HBM2e runs at 1593 MHz only;
# an L4's GDDR6 at 6251 MHz busy and 405 MHz idle.
A100_MEMORY_MHZ = 1593
L4_MEMORY_MHZ, L4_IDLE_MHZ = 6251, 405
MEMORY_CLOCK = ReadingKey(Quantity.MEMORY_CLOCK)
SUPPORTED = ReadingKey(Quantity.MEMORY_CLOCKS_SUPPORTED)


def test_the_fake_lists_one_memory_clock_for_hbm_and_several_for_gddr(install_fake: Any) -> None:
    install_fake({"gpus": [{"model": "A100-SXM4-80GB", "mig": ["3g.40gb"]}, {"model": "L4"}]})
    a100, l4 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
    # pynvml's wrapper sizes the list with a first call (count 0, no array), then fills it.
    assert pynvml.nvmlDeviceGetSupportedMemoryClocks(a100) == [A100_MEMORY_MHZ]
    assert pynvml.nvmlDeviceGetSupportedMemoryClocks(l4) == [L4_MEMORY_MHZ, L4_IDLE_MHZ]
    # Room for one clock on a board with two: INSUFFICIENT_SIZE, and the count it needs.
    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetSupportedMemoryClocks")
    count, clocks = ctypes.c_uint(1), (ctypes.c_uint * 1)()
    assert fn(l4, ctypes.byref(count), clocks) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 2
    # Room enough: SUCCESS, the clocks filled and the count set to those written.
    count, clocks = ctypes.c_uint(4), (ctypes.c_uint * 4)()
    assert fn(l4, ctypes.byref(count), clocks) == pynvml.NVML_SUCCESS
    assert (count.value, list(clocks)) == (2, [L4_MEMORY_MHZ, L4_IDLE_MHZ, 0, 0])
    # A MIG device has no clocks of its own.
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(a100, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetSupportedMemoryClocks(mig)


def test_a_recording_whose_memory_clock_moves_came_from_a_board_that_can_move_it(install_fake: Any) -> None:
    # A trace recorded on an A100 PCIe whose memory clock read 1215 then 810: whatever the data
    # sheet says, the replayed board supports both, so the agent keeps reading it.
    rows = [{"at": "0s", "memory_clock_mhz": 1215}, {"at": "1m", "memory_clock_mhz": 810}]
    install_fake({"gpus": [{"model": "A100-PCIE-40GB", "readings": rows}]})
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetSupportedMemoryClocks(handle) == [1215, 810]


@pytest.fixture
def sampled() -> Iterator[Any]:
    def _sampled(spec: Any) -> tuple[fake_nvml.InstalledNode, Sampler]:
        node = fake_nvml.install(spec, host=False)
        sampler = Sampler(NvmlBackend(clock=node.clock.wall_time), hostname="test-node")
        sampler.start()
        return node, sampler

    yield _sampled
    fake_nvml.uninstall()


def memory_clocks(snapshot: Snapshot) -> list[float | None]:
    return [None if g.telemetry is None else g.telemetry.memory_clock_hz for g in snapshot.gpus]


def polls(node: Any, sampler: Sampler, count: int) -> tuple[Any, list[list[float | None]]]:
    """`count` polls 5 s apart from the node's time now: the calls made and each poll's memory clocks."""
    before = node.calls.copy()
    shown = []
    for _ in range(count):
        shown.append(memory_clocks(sampler.poll()))
        node.clock.advance(5)
    return node.calls - before, shown


def test_hbm_reads_its_memory_clock_once_and_gddr_every_slow_interval(sampled: Any) -> None:
    # Both boards idle for the first 40 s, then busy: the L4's memory clock rises with the load,
    # the A100's cannot move.
    busy_at_40s = [{"at": "0s", "sm_util": 0}, {"at": "40s", "sm_util": 50}]
    spec = {
        "gpus": [{"model": "A100-SXM4-80GB"}, {"model": "L4"}],
        "processes": [{"pid": 1, "gpus": [0], "sm_util": busy_at_40s}, {"pid": 2, "gpus": [1], "sm_util": busy_at_40s}],
    }
    node, sampler = sampled(spec)
    calls, shown = polls(node, sampler, 13)  # t = 0, 5, .. 60: slow readings due at 0, 30, 60
    # Clock reads: each GPU's SM clock at the three slow polls; the memory clock, the A100's at
    # the first poll only, the L4's at the three slow polls: 3 x 2 + 1 + 3 = 10.
    assert calls["nvmlDeviceGetClockInfo"] == 3 * 2 + 1 + 3
    assert calls["nvmlDeviceGetSupportedMemoryClocks"] == 2  # once per GPU
    # Shown at every poll: the A100 always at its one clock; the L4 idle until the slow poll at
    # 60 s reads it busy (busy from 40 s: the polls at 40-55 s carry the idle value read at 30 s).
    assert [a100 for a100, _ in shown] == [A100_MEMORY_MHZ * MHZ] * 13
    assert [l4 for _, l4 in shown] == [L4_IDLE_MHZ * MHZ] * 12 + [L4_MEMORY_MHZ * MHZ]


@pytest.mark.parametrize(
    ("error", "asked"),
    [
        # Unsupported: asked once, never again; the memory clock stays slow.
        ("NOT_SUPPORTED", 1),
        # Failing: asked at each poll (a failed once-reading is retried at the next), still
        # failing at the three slow polls too: 13 polls, 13 asks.
        ("UNKNOWN", 13),
    ],
)
def test_a_gpu_that_cannot_say_keeps_its_memory_clock_slow(sampled: Any, error: str, asked: int) -> None:
    spec = {
        "gpus": [{"model": "A100-SXM4-80GB"}],
        "processes": [{"pid": 1, "gpus": [0], "sm_util": 50}],
        "faults": [{"at": "0s", "gpu": 0, "call": "nvmlDeviceGetSupportedMemoryClocks", "error": error}],
    }
    node, sampler = sampled(spec)
    calls, shown = polls(node, sampler, 13)
    assert calls["nvmlDeviceGetSupportedMemoryClocks"] == asked
    # The SM clock and the memory clock at the 3 slow polls, as before.
    assert calls["nvmlDeviceGetClockInfo"] == 3 + 3
    assert shown == [[A100_MEMORY_MHZ * MHZ]] * 13  # never lost


def test_a_memory_clock_that_failed_when_the_count_came_is_asked_until_it_answers() -> None:
    reader = TelemetryReader(ReadingOptions(groups=frozenset({"clocks"})), links=0)
    first = reader.keys(0.0)
    assert MEMORY_CLOCK in first
    assert SUPPORTED in first
    # The count says one clock, but the memory clock itself failed this poll.
    values = {k: 1.0 if k == SUPPORTED else 1e9 for k in first if k != MEMORY_CLOCK}
    assert reader.telemetry(0.0, first, values).memory_clock_hz is None
    # Asked again at the next poll (5 s on, not a slow poll) ...
    second = reader.keys(5.0)
    assert MEMORY_CLOCK in second
    assert SUPPORTED not in second
    assert reader.telemetry(5.0, second, {**dict.fromkeys(second, 2e9), MEMORY_CLOCK: 1593e6}).memory_clock_hz == 1593e6
    # ... and then never: not at the next poll, nor at the slow poll 30 s on, which carries it.
    assert MEMORY_CLOCK not in reader.keys(10.0)
    slow = reader.keys(30.0)
    assert MEMORY_CLOCK not in slow
    assert reader.telemetry(30.0, slow, dict.fromkeys(slow, 3e9)).memory_clock_hz == 1593e6


def test_several_memory_clocks_leave_it_slow() -> None:
    reader = TelemetryReader(ReadingOptions(groups=frozenset({"clocks"})), links=0)
    first = reader.keys(0.0)
    reader.telemetry(0.0, first, {**dict.fromkeys(first, 1e9), SUPPORTED: 2.0})
    assert MEMORY_CLOCK not in reader.keys(5.0)
    assert MEMORY_CLOCK in reader.keys(30.0)
