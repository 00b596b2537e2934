"""The poll pipeline: atomic swaps, overruns, failures, health, and the real scheduler."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

import fake_nvml
from agent.devices.nvml import NvmlBackend
from agent.devices.sampler import Sampler
from agent.model import Snapshot
from agent.pipeline import Pipeline


class ManualClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def sampler() -> Iterator[Sampler]:
    node = fake_nvml.install("demo")
    s = Sampler(NvmlBackend(clock=node.clock.wall_time))
    s.start()
    yield s
    fake_nvml.uninstall()


class SlowSampler:
    """Wraps a sampler; each poll moves the injected monotonic clock by `cost` seconds."""

    def __init__(self, inner: Sampler, clock: ManualClock, cost: float) -> None:
        self.inner = inner
        self.clock = clock
        self.cost = cost
        self.errors = inner.errors
        self.fail_next = False

    def poll(self) -> Snapshot:
        self.clock.t += self.cost
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        return self.inner.poll()


def test_a_poll_longer_than_the_interval_is_counted(sampler: Sampler) -> None:
    clock = ManualClock()
    slow = SlowSampler(sampler, clock, cost=7.0)
    pipeline = Pipeline(slow, poll_interval_s=5.0, monotonic=clock)  # type: ignore[arg-type]
    state = pipeline.poll_once()
    assert state.health.polls_overran == 1
    assert state.snapshot is not None
    assert state.snapshot.poll_duration_s == 7.0
    slow.cost = 1.0
    assert pipeline.poll_once().health.polls_overran == 1


def test_a_failing_poll_keeps_the_last_good_snapshot(sampler: Sampler) -> None:
    clock = ManualClock()
    slow = SlowSampler(sampler, clock, cost=0.1)
    pipeline = Pipeline(slow, poll_interval_s=5.0, monotonic=clock)  # type: ignore[arg-type]
    good = pipeline.poll_once()
    slow.fail_next = True
    after = pipeline.poll_once()
    assert after.snapshot is good.snapshot
    assert after.health.polls_failed == 1
    assert after.health.polls_total == 2
    assert after.health.last_success_at == good.health.last_success_at


def test_health_needs_a_success_within_three_intervals(sampler: Sampler) -> None:
    clock = ManualClock()
    slow = SlowSampler(sampler, clock, cost=0.0)
    pipeline = Pipeline(slow, poll_interval_s=5.0, monotonic=clock)  # type: ignore[arg-type]
    assert not pipeline.healthy()
    pipeline.poll_once()
    assert pipeline.healthy()
    clock.t += 15.0
    assert pipeline.healthy()
    clock.t += 0.5
    assert not pipeline.healthy()


def test_the_scheduler_polls_on_its_interval(sampler: Sampler) -> None:
    pipeline = Pipeline(sampler, poll_interval_s=0.05)
    pipeline.start()
    try:
        deadline = time.monotonic() + 10
        while pipeline.state.health.polls_total < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        pipeline.stop()
    state: Any = pipeline.state
    assert state.health.polls_total >= 3
    assert state.snapshot is not None
    assert len(state.snapshot.gpus) == 8
    polls = state.health.polls_total
    time.sleep(0.2)
    assert pipeline.state.health.polls_total == polls  # stopped means stopped
