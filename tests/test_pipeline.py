"""The poll pipeline: atomic swaps, overruns, failures, health, its stages and their metrics, and
the periodic jobs the daemon's scheduler and `simulate` share."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta, tzinfo
from pathlib import Path
from typing import Any

import apscheduler.executors.base
import apscheduler.schedulers.base
import pytest

import agent.pipeline
import agent.schedule
import fake_nvml
from agent.cli.wiring import build_agent
from agent.config import AttributionConfig, LedgerConfig, Settings
from agent.devices.nvml import NvmlBackend
from agent.devices.sampler import Sampler
from agent.model import AgentState, Attribution, Charges, LedgerHealth, Price, Snapshot, StageHealth
from agent.pipeline import STAGES, Costing, PeriodicJob, Pipeline, run_on_scenario_time
from exporters.prometheus import make_registry
from rules.engine import RuleSpec
from tests.helpers import WAITS_ON_REAL_TIME, Rig

pytestmark = WAITS_ON_REAL_TIME


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

    def poll(self, skip: Mapping[str, str] | None = None) -> Snapshot:
        self.clock.t += self.cost
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        return self.inner.poll(skip)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # the rest of the sampler, as it is


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


class SteppedDatetime(datetime):
    """`datetime` whose `now` is the real wall clock plus `step_s`: a clock stepped by NTP."""

    step_s = 0.0

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> SteppedDatetime:
        return super().now(tz) + timedelta(seconds=cls.step_s)


@pytest.fixture
def wall_clock(monkeypatch: pytest.MonkeyPatch) -> type[SteppedDatetime]:
    """The wall clock that APScheduler (its scheduler and its executors) and the agent's
    schedule read, all through `datetime.now`; set its `step_s` to step it."""
    for module in (apscheduler.schedulers.base, apscheduler.executors.base, agent.schedule):
        monkeypatch.setattr(module, "datetime", SteppedDatetime)
    monkeypatch.setattr(SteppedDatetime, "step_s", 0.0)
    return SteppedDatetime


@pytest.mark.parametrize(("step_s", "said"), [(-3600.0, "back by 1h"), (30 * 86400.0, "forward by 30d")])
def test_a_stepped_wall_clock_neither_stops_nor_bunches_the_polls(
    sampler: Sampler,
    wall_clock: type[SteppedDatetime],
    caplog: pytest.LogCaptureFixture,
    step_s: float,
    said: str,
) -> None:
    pipeline = Pipeline(sampler, poll_interval_s=0.2)
    pipeline.start()
    try:
        time.sleep(0.5)
        wall_clock.step_s = step_s
        before = pipeline.state.health.polls_total
        time.sleep(3.0)
        after = pipeline.state.health.polls_total
    finally:
        pipeline.stop()
    # Back on the interval within the second that sees the step (about ten polls in the 2s left)...
    assert after - before >= 4
    assert pipeline.healthy()
    # ...and no burst of the runs the step skipped.
    assert after - before <= 3.0 / 0.2 + 2
    steps = [r.getMessage() for r in caplog.records if r.name == "agent.schedule"]
    assert len(steps) == 1
    assert said in steps[0]


# -- stages -------------------------------------------------------------------------------------

PRICE = Price(3.6, "test")  # $3.60 per GPU-hour: $0.001 a second
ONE_BUSY_GPU = {
    "gpus": [{"count": 1}],
    "processes": [{"pid": 1, "gpus": [0], "sm_util": 50, "user": "ann", "uid": 1001}],
}


def stage(state: AgentState, name: str) -> StageHealth:
    (found,) = [s for s in state.health.stages if s.stage == name]
    return found


def scraped(state: AgentState, name: str, stage_name: str) -> float | None:
    return make_registry(lambda: state).get_sample_value(name, {"stage": stage_name})


def test_the_stages_run_in_order_and_each_reports_itself(sampler: Sampler) -> None:
    clock = ManualClock()
    slow = SlowSampler(sampler, clock, cost=0.25)
    pipeline = Pipeline(slow, poll_interval_s=5.0, monotonic=clock)  # type: ignore[arg-type]
    state = pipeline.poll_once()
    assert [s.stage for s in state.health.stages] == ["sample", "attribute", "account", "rules", "publish"]
    assert state.snapshot is not None
    assert stage(state, "sample").duration_s == 0.25  # the sampler moved the clock 0.25 s
    assert stage(state, "attribute").duration_s == 0.0
    for name in STAGES:
        assert scraped(state, "gpuledger_stage_failures_total", name) == 0
        assert scraped(state, "gpuledger_stage_duration_seconds", name) == stage(state, name).duration_s
        assert scraped(state, "gpuledger_stage_last_success_timestamp_seconds", name) == state.snapshot.taken_at


def test_a_failing_sample_stage_is_counted_and_the_others_wait(sampler: Sampler) -> None:
    clock = ManualClock()
    slow = SlowSampler(sampler, clock, cost=0.1)
    pipeline = Pipeline(slow, poll_interval_s=5.0, monotonic=clock)  # type: ignore[arg-type]
    good = pipeline.poll_once()
    slow.fail_next = True
    after = pipeline.poll_once()
    assert stage(after, "sample").failures == 1
    assert scraped(after, "gpuledger_stage_failures_total", "sample") == 1
    # Nothing to attribute, price or judge: those stages neither ran nor failed.
    assert stage(after, "attribute") == stage(good, "attribute")
    assert stage(after, "sample").last_success_at == stage(good, "sample").last_success_at


def test_a_failing_attribution_keeps_the_last_attribution(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(ONE_BUSY_GPU)
    try:
        first = rig.poll()
        assert [h.workload.user for h in first.attribution.holdings] == ["ann"]

        def broken(snapshot: Snapshot) -> Attribution:
            raise RuntimeError("a bug in attribution")

        monkeypatch.setattr(rig.attributor, "attribute", broken)
        after = rig.poll(60)
    finally:
        rig.close()
    assert after.attribution is first.attribution  # not an empty one: ann still holds the GPU
    assert after.snapshot is not None
    assert first.snapshot is not None
    assert after.snapshot.taken_at == first.snapshot.taken_at + 60  # the readings are new
    assert stage(after, "attribute").failures == 1
    assert stage(after, "attribute").last_success_at == first.snapshot.taken_at
    assert stage(after, "account").last_success_at == after.snapshot.taken_at


class FlakySink:
    """A ledger that fails to take one interval's charges, and keeps the rest."""

    def __init__(self, fail_on: int) -> None:
        self.added: list[Charges] = []
        self.calls = 0
        self.fail_on = fail_on
        self.recorded_until: float | None = None  # a new ledger: no downtime to book

    def add(self, charges: Charges) -> None:
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("a bug on the way to the ledger")
        self.added.append(charges)

    def flush(self) -> bool:
        return True

    def health(self) -> LedgerHealth:
        return LedgerHealth(healthy=True, pending_rows=0, last_flush_at=None)

    def close(self, within_s: float | None = None) -> bool:
        return True


def test_a_failing_accounting_charges_nothing_for_its_interval_and_is_counted() -> None:
    sink = FlakySink(fail_on=2)
    rig = Rig(ONE_BUSY_GPU, costing=Costing(prices=lambda s: {g.uuid: PRICE for g in s.gpus}, sink=sink))
    try:
        state = rig.run(180, 60)  # polls at 0, 60, 120, 180: three intervals of 60 s
    finally:
        rig.close()
    # The second interval (60 s to 120 s) failed: ann pays for the other two, 120 s x $0.001.
    ((workload, totals),) = state.costs.workloads.items()
    assert workload[2].user == "ann"
    assert totals.dollars == pytest.approx(0.12)
    assert totals.held_s == pytest.approx(120)
    # The counters and the ledger agree: neither has the failed interval.
    first = sink.added[0].start
    assert [(c.start - first, c.end - first) for c in sink.added] == [(0, 60), (120, 180)]
    assert sum(w.dollars for c in sink.added for w in c.workloads) == pytest.approx(0.12)
    assert stage(state, "account").failures == 1
    assert scraped(state, "gpuledger_stage_failures_total", "account") == 1


def test_failing_rules_keep_the_last_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(
        {"gpus": [{"count": 1}]},
        flag_rules=[RuleSpec("idle", "idle", utilization_below=0.05, for_s=60)],
    )
    try:
        rig.run(120, 60)
        raised = rig.poll(60)
        assert [(f.rule, f.raised, f.held_s) for f in raised.flags] == [("idle", True, 180)]

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("a bug in the rules")

        monkeypatch.setattr(agent.pipeline, "evaluate", broken)
        after = rig.poll(60)
    finally:
        rig.close()
    assert after.flags == raised.flags  # still raised, as last judged
    assert stage(after, "rules").failures == 1
    assert stage(after, "publish").failures == 0


def test_a_flag_counts_its_duration_only_over_time_the_agent_saw(caplog: pytest.LogCaptureFixture) -> None:
    # One GPU nobody holds, $3.60/h ($0.001 a second), polled every minute; the node sleeps for
    # an hour (a gap past accounting.max_interval, 5 min: unobserved, charged to nobody). Before,
    # the idle flag went on counting through the hour nobody saw.
    rig = Rig(
        {"gpus": [{"count": 1}]},
        costing=Costing(prices=lambda s: {g.uuid: PRICE for g in s.gpus}, max_interval_s=300),
        flag_rules=[RuleSpec("idle", "idle", utilization_below=0.05, for_s=1800)],
    )
    caplog.set_level("WARNING", logger="agent.pipeline")
    try:
        before = rig.run(2400, 60)  # 0:00 to 0:40
        after = rig.poll(3600)  # 1:40, after the hour asleep
        fresh = rig.run(1800, 60)  # 1:40 to 2:10
    finally:
        rig.close()
    assert [(f.raised, f.held_s, f.dollars) for f in before.flags] == [(True, 2400, pytest.approx(2.40))]
    # Seen idle from 0:00 to 0:40: 2400 s x $0.001 = $2.40 so far. It holds again from 1:40 on.
    assert [(f.raised, f.held_s) for f in after.flags] == [(False, 0.0)]
    assert [(f.raised, f.held_s, f.dollars) for f in fresh.flags] == [(True, 1800, pytest.approx(1.80))]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("flag ")]
    assert [line.split(" uuid=")[0] for line in lines] == [
        "flag raised: rule=idle gpu=0",
        "flag cleared: rule=idle gpu=0",
        "flag raised: rule=idle gpu=0",
    ]
    assert "for=40m cost_so_far=$2.40" in lines[1]
    # 1800 s x $0.001 = $1.80 at each raise: the hour asleep adds neither time nor dollars.
    assert "for=30m cost_so_far=$1.80" in lines[0]
    assert "for=30m cost_so_far=$1.80" in lines[2]


# -- periodic jobs ------------------------------------------------------------------------------


def test_the_daemon_and_simulate_share_one_description_of_the_periodic_jobs(tmp_path: Path) -> None:
    settings = Settings(attribution=AttributionConfig(kubelet_interval=10.0), ledger=LedgerConfig(flush_interval=60.0))
    agent = build_agent(settings, fake="demo", ledger_path=tmp_path / "ledger.db", poll_interval_s=15.0)
    try:
        jobs = {job.name: job for job in agent.pipeline.jobs()}
    finally:
        agent.close()
    assert list(jobs) == ["kubelet", "poll", "ledger"]  # allocations before the poll, the flush after
    assert [(j.interval_s, j.at_start) for j in jobs.values()] == [(10.0, True), (15.0, True), (60.0, False)]


def test_scenario_time_runs_each_job_at_the_daemons_rhythm() -> None:
    now = [0.0]
    ran: list[tuple[float, str]] = []

    def job(name: str, interval_s: float, at_start: bool = True) -> PeriodicJob:
        return PeriodicJob(name, interval_s, lambda: ran.append((now[0], name)), at_start=at_start)

    def advance(seconds: float) -> None:
        now[0] += seconds

    steps = run_on_scenario_time(
        [job("kubelet", 10), job("poll", 15), job("ledger", 60, at_start=False)], advance, 120, 15
    )
    assert steps == 8
    assert [t for t, name in ran if name == "poll"] == [0, 15, 30, 45, 60, 75, 90, 105, 120]
    # Due at 10, 20, 30, ...: the runs a step skips over collapse into one (APScheduler's
    # coalescing), so a 10 s job runs once per 15 s step, and never before its time.
    assert [t for t, name in ran if name == "kubelet"] == [0, 15, 30, 45, 60, 75, 90, 105, 120]
    assert [t for t, name in ran if name == "ledger"] == [60, 120]  # first due a flush interval in
    # Jobs due together run in the order given.
    assert [name for t, name in ran if t == 60] == ["kubelet", "poll", "ledger"]


def test_a_job_slower_than_the_step_keeps_its_own_beat() -> None:
    now = [0.0]
    ran: list[float] = []
    run_on_scenario_time(
        [PeriodicJob("ledger", 60, lambda: ran.append(now[0]), at_start=False)],
        lambda s: now.__setitem__(0, now[0] + s),
        300,
        45,
    )
    # Due at 60, 120, 180, 240, 300: seen at the first step on or after each (90, 135, 180, 270),
    # and at 300, where the last, shorter step (270 + 30) ends the run at its duration.
    assert ran == [90, 135, 180, 270, 300]


def test_a_duration_that_is_not_whole_steps_ends_with_a_shorter_step_and_a_poll() -> None:
    now = [0.0]
    ran: list[tuple[float, str]] = []

    def job(name: str, interval_s: float, **kw: bool) -> PeriodicJob:
        return PeriodicJob(name, interval_s, lambda: ran.append((now[0], name)), **kw)

    steps = run_on_scenario_time(
        [job("kubelet", 10), job("poll", 7, at_end=True), job("ledger", 60, at_start=False)],
        lambda s: now.__setitem__(0, now[0] + s),
        30,
        7,
    )
    # Steps of 7 s to 28, then one of 2 s to 30: five steps, and the poll runs at 30 though its
    # next beat is 35, so its intervals cover all 30 s (7 + 7 + 7 + 7 + 2).
    assert steps == 5
    assert [t for t, name in ran if name == "poll"] == [0, 7, 14, 21, 28, 30]
    # A job without at_end keeps its beat: the kubelet, due at 10, 20 and 30, runs at the first
    # step on or after each (14, 21, 30); the ledger, due at 60, not at all.
    assert [t for t, name in ran if name == "kubelet"] == [0, 14, 21, 30]
    assert [name for _t, name in ran].count("ledger") == 0
