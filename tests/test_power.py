"""The power gauge is the board's mean draw since the previous poll, from the energy counter: a
workload that pulses faster than the polls is not read at whatever instant a poll lands on.

On a real H200 running half-second bursts of matrix products, polls 2 s apart read 127-130 W
(the idle half) where the energy counter said 448 W (scripts/realgpu/README.md)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

import fake_nvml
from agent.devices.nvml import NvmlBackend
from agent.devices.sampler import Sampler


def _pulsing(model: str) -> dict[str, Any]:
    # Busy (sm_util 100) in even seconds, idle in odd ones. The fake's power is linear in
    # utilization: idle 100 W, busy 700 W.
    rows = [{"at": f"{s}s", "sm_util": 100 if s % 2 == 0 else 0} for s in range(12)]
    return {
        "gpus": [{"model": model, "idle_power_w": 100, "power_limit_w": 700}],
        "processes": [{"pid": 4100, "gpus": [0], "memory_mib": 1000, "sm_util": rows, "cmdline": "python pulse.py"}],
    }


@pytest.fixture
def h100() -> Iterator[fake_nvml.InstalledNode]:
    yield fake_nvml.install(_pulsing("H100-SXM5-80GB"), host=False)
    fake_nvml.uninstall()


def test_each_poll_reads_the_mean_power_since_the_one_before(h100: fake_nvml.InstalledNode) -> None:
    sampler = Sampler(NvmlBackend(clock=h100.clock.wall_time))
    sampler.start()
    # A first poll has no interval: the driver's 1 s average stands, at t=0 the power then, 700 W.
    assert sampler.poll().gpus[0].power_w == 700.0
    h100.clock.advance(3)
    # 0-3 s: busy, idle, busy: (700 + 100 + 700) J/s x 1 s each / 3 s = 500 W. The instant at 3 s
    # is 100 W (idle), the driver's 1 s average 700 W (2-3 s busy): neither is what the board drew.
    assert sampler.poll().gpus[0].power_w == 500.0
    h100.clock.advance(2.5)
    # 3-5.5 s: idle 1 s, busy 1 s, idle 0.5 s: (100 + 700 + 50) J / 2.5 s = 340 W.
    assert sampler.poll().gpus[0].power_w == 340.0
    sampler.close()


def test_a_counter_that_goes_back_leaves_the_drivers_reading(h100: fake_nvml.InstalledNode) -> None:
    sampler = Sampler(NvmlBackend(clock=h100.clock.wall_time))
    sampler.start()
    h100.clock.advance(1)
    sampler.poll()  # the counter at 1 s: 700 J
    h100.clock.advance(2.5)
    # A driver reload restarts the energy counter: 0 J now, below the reading at the last poll.
    # No mean can be taken; the driver's 1 s average at 3.5 s stands: 2.5-3 s busy, 3-3.5 s idle,
    # (350 + 50) J / 1 s = 400 W.
    original = h100.energy_mj
    h100.energy_mj = lambda gpu, t: 0  # type: ignore[method-assign]
    try:
        assert sampler.poll().gpus[0].power_w == 400.0
    finally:
        h100.energy_mj = original  # type: ignore[method-assign]
        sampler.close()


@pytest.mark.parametrize(
    ("model", "usage_mw", "average"),
    [
        # At 3.5 s the instant is 100 W (idle since 3 s); the mean over 2.5-3.5 s is 400 W.
        ("H100-SXM5-80GB", 400_000, 400_000),  # Hopper: both the call and the field average
        ("L4", 400_000, 400_000),  # Ada likewise
        ("GH200", 400_000, 400_000),  # Grace Hopper: Hopper
        ("A100-SXM4-80GB", 100_000, None),  # GA100: the instant, and no averaged field
    ],
)
def test_the_fake_driver_averages_power_where_the_architecture_does(
    model: str, usage_mw: int, average: int | None
) -> None:
    node = fake_nvml.install(_pulsing(model), host=False)
    try:
        node.clock.advance(3.5)
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetPowerUsage(handle) == usage_mw
        field = pynvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_POWER_AVERAGE])[0]
        if average is None:
            assert field.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
        else:
            assert (field.nvmlReturn, field.value.uiVal) == (pynvml.NVML_SUCCESS, average)
        instant = pynvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_POWER_INSTANT])[0]
        assert instant.value.uiVal == 100_000
        pynvml.nvmlShutdown()
    finally:
        fake_nvml.uninstall()


def test_polls_under_a_second_apart_take_the_mean_over_a_second_or_more(h100: fake_nvml.InstalledNode) -> None:
    sampler = Sampler(NvmlBackend(clock=h100.clock.wall_time))
    sampler.start()
    sampler.poll()  # t=0: the counter at 0 J
    h100.clock.advance(0.5)
    # 0.5 s since the counter was read: too short a span for its steps; the driver's 1 s average
    # (0-0.5 s busy: 700 W) stands, and the mean waits.
    assert sampler.poll().gpus[0].power_w == 700.0
    h100.clock.advance(1.0)
    # 1.5 s since t=0: busy 1 s (700 J) and idle 0.5 s (50 J): 750 J / 1.5 s = 500 W.
    assert sampler.poll().gpus[0].power_w == 500.0
    sampler.close()


def test_a_clock_set_a_day_forward_does_not_spread_seconds_of_energy_over_it(h100: fake_nvml.InstalledNode) -> None:
    clock = {"offset": 0.0}
    sampler = Sampler(NvmlBackend(clock=lambda: h100.clock.wall_time() + clock["offset"]))
    sampler.start()
    sampler.poll()
    h100.clock.advance(3.5)
    clock["offset"] = 86400.0  # the host's clock jumps a day; the board ran 3.5 s
    # 3.5 s of energy over a day would read ~0.02 W; the driver's 1 s average at 3.5 s stands:
    # 2.5-3 s busy, 3-3.5 s idle: (350 + 50) J / 1 s = 400 W.
    assert sampler.poll().gpus[0].power_w == 400.0
    sampler.close()
