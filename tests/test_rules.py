"""The rule engine: flags raise exactly at their duration and clear at once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.model import Flag, Workload
from rules.engine import Evaluation, GpuObservation, RuleSpec, RuleState, Window, _slide, evaluate

IDLE = RuleSpec("idle", "idle", 0.05, 1800)
ALLOCATED_IDLE = RuleSpec("allocated_idle", "allocated_idle", 0.05, 1800)
UNDERUSED = RuleSpec("underused", "underused", 0.40, 7200, window_s=7200)
STRANDED = RuleSpec("stranded_memory", "stranded_memory", 0.01, 900, memory_above_bytes=2**30)
DEFAULTS = (IDLE, ALLOCATED_IDLE, UNDERUSED, STRANDED)
NOTEBOOK = Workload(namespace="lab", pod="nb-1")
STEP = 15.0


def obs(
    util: float | None, *, holders: Sequence[Workload] = (), memory: int = 0, up: bool = True, **kw: object
) -> GpuObservation:
    return GpuObservation(
        gpu=0, uuid="GPU-0", model=str(kw.get("model", "A100-SXM4-80GB")), node=str(kw.get("node", "n1")), up=up,
        utilization=util, memory_used_bytes=memory, holders=tuple(holders), interval_s=STEP,
        dollars=0.001 * STEP, idle_dollars=0.0 if holders else 0.001 * STEP,
    )  # fmt: skip


def run(timeline: Iterable[GpuObservation], specs: Sequence[RuleSpec] = DEFAULTS) -> list[tuple[float, Evaluation]]:
    """Evaluates one observation per STEP seconds; returns (time, evaluation) for each poll."""
    states: dict[tuple[str, str], RuleState] = {}
    out = []
    for i, o in enumerate(timeline):
        now = 1000.0 + i * STEP
        result = evaluate(states, [o], specs, now)
        states = dict(result.states)
        out.append((now, result))
    return out


def raised(result: Evaluation, rule: str) -> bool:
    return any(f.raised for f in result.flags if f.rule == rule)


def first_raise(history: list[tuple[float, Evaluation]], rule: str) -> float | None:
    return next((now for now, r in history if raised(r, rule)), None)


def polls(seconds: float) -> int:
    return int(seconds // STEP)


@pytest.mark.parametrize(
    ("spec", "holding", "not_holding"),
    [
        (IDLE, obs(0.02), obs(0.50)),
        (ALLOCATED_IDLE, obs(0.0, holders=[NOTEBOOK]), obs(0.30, holders=[NOTEBOOK])),
        (STRANDED, obs(0.0, holders=[NOTEBOOK], memory=30 * 2**30), obs(0.0, holders=[NOTEBOOK], memory=2**29)),
    ],
    ids=["idle", "allocated_idle", "stranded_memory"],
)
def test_a_flag_raises_exactly_at_its_duration_and_clears_at_once(
    spec: RuleSpec, holding: GpuObservation, not_holding: GpuObservation
) -> None:
    n = polls(spec.for_s)
    history = run([holding] * (n + 5) + [not_holding] * 2, [spec])
    start = history[0][0]
    # The condition is first seen at `start`: the flag is down until for_s has passed, up from then.
    assert [raised(r, spec.name) for _, r in history[: n + 1]] == [False] * n + [True]
    assert first_raise(history, spec.name) == start + spec.for_s
    flag = next(f for f in history[n + 4][1].flags if f.rule == spec.name)
    assert flag.held_s == (n + 4) * STEP
    # It clears at the first poll where the condition no longer holds.
    assert not raised(history[n + 5][1], spec.name)
    transitions = [t for _, r in history for t in r.transitions]
    assert [(t.rule, t.raised) for t in transitions] == [(spec.name, True), (spec.name, False)]


@pytest.mark.parametrize("spec", [IDLE, ALLOCATED_IDLE, STRANDED], ids=lambda s: s.name)
def test_a_dip_shorter_than_the_duration_never_raises(spec: RuleSpec) -> None:
    holders = [] if spec is IDLE else [NOTEBOOK]
    low = obs(0.0, holders=holders, memory=30 * 2**30)
    high = obs(0.9, holders=holders, memory=30 * 2**30)
    n = polls(spec.for_s)
    # Low for just under the duration, one busy poll, low again just under: never raised.
    history = run([low] * n + [high] + [low] * n, [spec])
    assert first_raise(history, spec.name) is None


def test_idle_is_only_for_gpus_nobody_holds() -> None:
    history = run([obs(0.0, holders=[NOTEBOOK])] * polls(3600))
    assert first_raise(history, "idle") is None
    assert first_raise(history, "allocated_idle") is not None


def test_underuse_is_judged_on_the_mean_over_the_window() -> None:
    # Alternating 70% and 0% every poll: each sample swings across 40%, the mean is 35%.
    swinging = [obs(0.70, holders=[NOTEBOOK]), obs(0.0, holders=[NOTEBOOK])] * polls(3 * 3600)
    history = run(swinging, [UNDERUSED])
    start = history[0][0]
    # With 2m+1 samples (m+1 at 70%) the mean is 0.7(m+1)/(2m+1), below 0.4 only once m > 3: from
    # the 8th sample on (index 7) every mean is below 40% (the 7th is exactly 0.4). The flag
    # raises 2 h (the `for`) after that.
    assert first_raise(history, "underused") == start + 7 * STEP + 7200
    # Alternating 90% and 0%: a 45% mean never raises, though half the samples are at 0%.
    busy_enough = [obs(0.90, holders=[NOTEBOOK]), obs(0.0, holders=[NOTEBOOK])] * polls(3 * 3600)
    assert first_raise(run(busy_enough, [UNDERUSED]), "underused") is None


def test_underuse_after_busy_hours_needs_the_window_mean_to_fall() -> None:
    busy = [obs(0.9, holders=[NOTEBOOK])] * polls(7200)
    quiet = [obs(0.1, holders=[NOTEBOOK])] * polls(6 * 3600)
    history = run(busy + quiet, [UNDERUSED])
    quiet_start = history[len(busy)][0]
    # Over a 2 h window, the mean of 0.9 for (7200 - x) s and 0.1 for x s drops below 0.4 once
    # 0.9 - 0.8 x / 7200 < 0.4, i.e. x > 4500 s; the flag then needs its 2 h `for`.
    crossing = quiet_start + 4500
    raise_at = first_raise(history, "underused")
    assert raise_at is not None
    assert crossing + 7200 <= raise_at <= crossing + 7200 + 2 * STEP


def test_a_gpu_that_is_down_or_cannot_measure_holds_no_condition() -> None:
    assert first_raise(run([obs(0.0, up=False)] * polls(3600)), "idle") is None
    assert first_raise(run([obs(None)] * polls(3600)), "idle") is None


def test_selectors_limit_a_rule_to_gpu_models_and_nodes() -> None:
    only_h100 = RuleSpec("idle_h100", "idle", 0.05, 60, models=("H100*",))
    only_lab = RuleSpec("idle_lab", "idle", 0.05, 60, nodes=("lab-*",))
    history = run([obs(0.0, model="H100-SXM5-80GB", node="prod-1")] * 10, [only_h100, only_lab])
    assert first_raise(history, "idle_h100") is not None
    assert all(f.rule != "idle_lab" for _, r in history for f in r.flags)


def test_flags_name_the_holders_and_count_the_cost_while_they_hold() -> None:
    history = run([obs(0.0, holders=[NOTEBOOK])] * (polls(1800) + 41), [ALLOCATED_IDLE])
    flag = history[-1][1].flags[0]
    assert flag.holders == (NOTEBOOK,)
    # The condition held for 1800 + 41 x 15 s; cost counts from the interval after it began.
    assert flag.dollars == pytest.approx((polls(1800) + 40) * STEP * 0.001)
    idle_flag = run([obs(0.0)] * (polls(1800) + 1), [IDLE])[-1][1].flags[0]
    assert idle_flag.holders == ()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(1, 900), st.floats(0, 1)), min_size=1, max_size=60),
    st.floats(60, 7200),
)
def test_the_running_window_mean_equals_the_mean_recomputed_from_scratch(
    samples: list[tuple[float, float]], window_s: float
) -> None:
    state = RuleState()
    now = 0.0
    seen: list[tuple[float, float, float]] = []
    for dt, util in samples:
        now += dt
        seen.append((now, dt, util))
        window, seconds, weighted, mean = _slide(state, (now, dt, util), now, window_s)
        state = RuleState(window=window, window_seconds=seconds, window_weighted=weighted)
        # from scratch: each sample's overlap with (now - window_s, now]
        start = now - window_s
        overlaps = [(min(d, end - start), u) for end, d, u in seen if end > start]
        expected = sum(o * u for o, u in overlaps) / sum(o for o, _ in overlaps)
        assert mean == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_a_window_slid_on_from_an_earlier_state_leaves_every_other_state_as_it_was() -> None:
    # The states that follow one another share their samples (rules.engine.Window): sliding any
    # of them, the latest or an earlier one judged again, must leave the others' windows alone.
    def samples(window: Window) -> list[tuple[float, float, float]]:
        return window.samples[window.start : window.end]

    sampled = [(i * STEP, STEP, util) for i, util in enumerate((0.1, 0.2, 0.3, 0.9), start=1)]
    states = [RuleState()]
    for sample in sampled[:3]:
        window, seconds, weighted, _ = _slide(states[-1], sample, sample[0], 7200)
        states.append(RuleState(window=window, window_seconds=seconds, window_weighted=weighted))
    _, first, earlier, latest = states
    later = _slide(latest, sampled[3], sampled[3][0], 7200)[0]
    branched = _slide(earlier, sampled[3], sampled[3][0], 7200)[0]
    assert samples(first.window) == sampled[:1]
    assert samples(earlier.window) == sampled[:2]
    assert samples(latest.window) == sampled[:3]
    assert samples(later) == sampled
    assert samples(branched) == [*sampled[:2], sampled[3]]


def test_a_lowered_flag_names_its_holders_as_they_change() -> None:
    busy, other = obs(0.9, holders=[NOTEBOOK], memory=2**31), Workload(namespace="lab", pod="nb-2")
    history = run([busy, busy, obs(0.9, holders=[other], memory=2**31)])
    (_, first), _, (_, third) = history
    assert [f.raised for f in first.flags] == [False] * len(DEFAULTS)
    # A lowered flag that names its holders follows them.
    stranded = {f.rule: f for f in third.flags}["stranded_memory"]
    assert stranded == Flag(0, "GPU-0", "stranded_memory", False, 0.0, (other,), 0.0)


@pytest.mark.parametrize("spec", [ALLOCATED_IDLE, STRANDED, UNDERUSED], ids=lambda s: s.name)
def test_a_gpu_handed_to_another_job_between_polls_starts_a_flag_of_its_own(spec: RuleSpec) -> None:
    first, second = Workload(hpc_job="100", user="alice"), Workload(hpc_job="200", user="bob")
    before = [obs(0.0, holders=[first], memory=30 * 2**30)] * (polls(spec.for_s) + 10)
    after = [obs(0.0, holders=[second], memory=30 * 2**30)] * (polls(spec.for_s) + 1)
    history = run(before + after, [spec])
    handed_at = history[len(before)][0]
    # The flag on the first job's idling clears when the next job takes the GPU: the next job
    # has left it idle for no time at all, and an action on its flag would hit it at once.
    assert raised(history[len(before) - 1][1], spec.name)
    assert not raised(history[len(before)][1], spec.name)
    assert first_raise(history[len(before) :], spec.name) == handed_at + spec.for_s
    transitions = [(t.raised, t.holders, t.at) for _, r in history for t in r.transitions]
    assert transitions[1:] == [(False, (first,), handed_at), (True, (second,), handed_at + spec.for_s)]


def test_a_job_whose_labels_grow_is_the_same_holder() -> None:
    # Its allocation alone, then its process, whose command line names a model: the same job.
    allocation, process = Workload(hpc_job="100"), Workload(hpc_job="100", model="llama")
    timeline = [obs(0.0, holders=[allocation])] * 60 + [obs(0.0, holders=[process])] * (polls(1800) - 60 + 1)
    assert first_raise(run(timeline, [ALLOCATED_IDLE]), "allocated_idle") == 1000.0 + 1800


@pytest.mark.parametrize("spec", [ALLOCATED_IDLE, STRANDED, UNDERUSED], ids=lambda s: s.name)
def test_a_flag_cleared_by_its_holder_leaving_names_that_holder(spec: RuleSpec) -> None:
    # The notebook holds the GPU idle with 30 GiB until its flag is up, then ends: the GPU is
    # nobody's and empty. The clearing line named the holders after the change, "(nobody)";
    # it is the notebook's flag that clears, and its line says so, with its cost so far.
    held = [obs(0.0, holders=[NOTEBOOK], memory=30 * 2**30)] * (polls(spec.for_s) + 2)
    history = run([*held, obs(0.0)], [spec])
    transitions = [(t.raised, t.holders, t.held_s, t.dollars) for _, r in history for t in r.transitions]
    # Held from the first poll to the one before the last, for_s + 15 s, at $0.001 a second
    # (obs's price): the dollars of the intervals after it began, (for_s + 15) x $0.001.
    dollars = pytest.approx((spec.for_s + STEP) * 0.001)
    assert transitions[-1] == (False, (NOTEBOOK,), spec.for_s + 2 * STEP, dollars)


def test_underuse_judges_a_workload_on_its_own_time_on_the_gpu() -> None:
    # Underused over 2 h, raised after 30 min of it. The GPU sits idle and unheld for 1.5 h, then
    # a job keeps it 100% busy. Over the last 2 h the GPU's mean is 25% at 2:00 (1.5 h at 0%,
    # 0.5 h at 100%), and the job was flagged underused 30 min after it came; its own mean is
    # 100%, and it is never flagged.
    spec = replace(UNDERUSED, for_s=1800)
    job = Workload(hpc_job="300", user="cy")
    timeline = [obs(0.0)] * polls(5400) + [obs(1.0, holders=[job])] * polls(7200)
    assert first_raise(run(timeline, [spec]), "underused") is None
    # A job that arrives and idles is flagged 30 min after it came, on its own mean of 0%.
    idling = [obs(0.9)] * polls(5400) + [obs(0.0, holders=[job])] * (polls(1800) + 1)
    history = run(idling, [spec])
    assert first_raise(history, "underused") == history[polls(5400)][0] + 1800
