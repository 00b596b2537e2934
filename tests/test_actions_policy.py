"""The actions' policy on its own (agent/actions/policy.py, pure): episodes, cooldowns, a full
queue, restarts, and the lists, decided on hand-built states."""

from __future__ import annotations

from dataclasses import replace

from agent.actions.policy import (
    COOLDOWN,
    DEFERRED,
    DENIED,
    DRY_RUN,
    RUN,
    PolicyState,
    Selector,
    Trigger,
    changed,
    decide,
    dump_state,
    load_state,
    targets,
)
from agent.model import AgentState, Attribution, DeviceReading, Flag, Holding, NodeInfo, Snapshot, Workload

JOB = Workload(hpc_job="77", user="dee")
POD = Workload(namespace="research-cv", pod="nb-1", container="jupyter", user="eve")


def state(
    now: float, raised: dict[int, float], holders: dict[int, Workload] | None = None, gpus: int = 2
) -> AgentState:
    """A node of `gpus` GPUs at `now`; `raised` maps a GPU index to how long its flag has held
    (the allocated_idle rule), `holders` who holds each GPU."""
    devices = tuple(DeviceReading(i, f"GPU-{i}", "NVIDIA A100-SXM4-80GB", True, utilization=0.0) for i in range(gpus))
    holdings = tuple(Holding(f"GPU-{i}", w, allocated=True) for i, w in (holders or {}).items())
    flags = tuple(
        Flag(i, f"GPU-{i}", "allocated_idle", i in raised, raised.get(i, 0.0), (), 2.0 * raised.get(i, 0.0) / 3600)
        for i in range(gpus)
    )
    return AgentState(snapshot=Snapshot(now, NodeInfo("n1"), devices), attribution=Attribution(holdings), flags=flags)


def trigger(**kw: object) -> Trigger:
    base: dict[str, object] = {
        "name": "t",
        "flag": "allocated_idle",
        "scope": "workload",
        "after_s": 3600.0,
        "cooldown_s": 0.0,
        "dry_run": False,
    }
    base.update(kw)
    return Trigger(**base)  # type: ignore[arg-type]


def results(decisions: list[object]) -> list[str]:
    return [d.result for d in decisions]  # type: ignore[attr-defined]


def test_a_workload_is_a_target_only_when_every_gpu_it_holds_is_flagged() -> None:
    both = {0: JOB, 1: JOB}
    assert targets(state(0, {0: 100.0}, both), "allocated_idle", "workload") == []
    (target,) = targets(state(0, {0: 100.0, 1: 50.0}, both), "allocated_idle", "workload")
    assert target.workloads == (JOB,)
    assert target.gpus == ((0, "GPU-0"), (1, "GPU-1"))
    assert target.held_s == 50.0  # the shortest: all of them have held this long
    # $2/GPU-hour: 100 s + 50 s of it = 150 s x $2 / 3600 s.
    assert target.dollars == 150 * 2.0 / 3600


def test_a_workload_on_a_mig_instance_is_a_target_when_its_instance_is_flagged() -> None:
    # GPU 0 is split in two instances; the notebook holds instance 0:1 and leaves it idle, a busy
    # job holds 0:0. Flags are per instance (the GPU itself holds no condition): the notebook's
    # is raised for 2 h. Before, a workload's GPUs were looked up by the parent GPU, never
    # flagged, so no workload on a MIG instance was ever a target.
    mig = [
        DeviceReading(0, f"MIG-{i}", "NVIDIA A100-SXM4-80GB", True, parent_uuid="GPU-0", mig_index=i) for i in (0, 1)
    ]
    devices = (DeviceReading(0, "GPU-0", "NVIDIA A100-SXM4-80GB", True, mig_enabled=True), *mig)
    holdings = (Holding("MIG-0", JOB), Holding("MIG-1", POD, allocated=True))
    # The instance at $1/h (its share of the GPU's price): 7200 s x $1 / 3600 s = $2 so far.
    flags = (
        Flag(0, "MIG-0", "allocated_idle", False, 0.0, (JOB,), 0.0),
        Flag(0, "MIG-1", "allocated_idle", True, 7200.0, (POD,), 2.0),
    )
    now = AgentState(
        snapshot=Snapshot(0, NodeInfo("n1"), devices), attribution=Attribution(holdings), flags=flags
    )  # fmt: skip
    (target,) = targets(now, "allocated_idle", "workload")
    assert (target.workloads, target.gpus, target.held_s, target.dollars) == ((POD,), ((0, "MIG-1"),), 7200.0, 2.0)


def test_a_node_is_a_target_only_when_every_gpu_is_flagged() -> None:
    assert targets(state(0, {0: 10.0}), "allocated_idle", "node") == []
    (target,) = targets(state(0, {0: 10.0, 1: 20.0}), "allocated_idle", "node")
    assert target.key == "node:n1"
    assert target.held_s == 10.0


def test_an_episode_is_decided_once_and_a_new_one_again() -> None:
    t = trigger()
    s = PolicyState()
    s, d = decide(s, state(0, {0: 1800.0}, {0: JOB}), [t], capacity=4)
    assert d == []  # held 30m of the 1h
    s, d = decide(s, state(1800, {0: 3600.0}, {0: JOB}), [t], capacity=4)
    assert results(d) == [RUN]
    assert d[0].episode_since == -1800.0  # when the flag began holding: 1800 s before t=0
    s, d = decide(s, state(3600, {0: 5400.0}, {0: JOB}), [t], capacity=4)
    assert d == []
    s, d = decide(s, state(3660, {}, {0: JOB}), [t], capacity=4)  # cleared: the episode ends
    assert s.episodes == {}
    s, d = decide(s, state(7260, {0: 3600.0}, {0: JOB}), [t], capacity=4)
    assert results(d) == [RUN]


def test_a_cooldown_holds_a_new_episode_back_until_it_ends() -> None:
    t = trigger(cooldown_s=3 * 3600.0)
    s, d = decide(PolicyState(), state(3600, {0: 3600.0}, {0: JOB}), [t], capacity=4)
    assert results(d) == [RUN]
    s, d = decide(s, state(3660, {}, {0: JOB}), [t], capacity=4)
    s, d = decide(s, state(7260, {0: 3600.0}, {0: JOB}), [t], capacity=4)
    assert results(d) == [COOLDOWN]
    assert d[0].reason == "7140s left"  # ran at 3600, cooling down 3h: until 14400, 14400 - 7260 = 7140
    s, d = decide(s, state(7320, {0: 3660.0}, {0: JOB}), [t], capacity=4)
    assert d == []  # noted once per episode
    s, d = decide(s, state(14400, {0: 10740.0}, {0: JOB}), [t], capacity=4)
    assert results(d) == [RUN]  # the cooldown (until 3600 + 10800 = 14400) is over


def test_a_full_queue_defers_the_run_to_a_later_poll() -> None:
    t = trigger()
    s, d = decide(PolicyState(), state(3600, {0: 3600.0}, {0: JOB}), [t], capacity=0)
    assert results(d) == [DEFERRED]
    s, d = decide(s, state(3660, {0: 3660.0}, {0: JOB}), [t], capacity=0)
    assert d == []
    s, d = decide(s, state(3720, {0: 3720.0}, {0: JOB}), [t], capacity=1)
    assert results(d) == [RUN]


def test_runs_beyond_the_capacity_wait() -> None:
    t = trigger(scope="gpu")
    _, d = decide(PolicyState(), state(3600, {0: 3600.0, 1: 3600.0}, {0: JOB, 1: POD}), [t], capacity=1)
    assert results(d) == [RUN, DEFERRED]


def test_lists_deny_and_allow_by_any_name() -> None:
    on_jobs = trigger(deny=(Selector(hpc_jobs=("7*",)),))
    _, d = decide(PolicyState(), state(3600, {0: 3600.0}, {0: JOB}), [on_jobs], capacity=4)
    assert results(d) == [DENIED]
    assert d[0].reason == "denylist hpc_jobs=7*"
    only_research = trigger(allow=(Selector(), Selector(namespaces=("research-*",))))
    _, d = decide(PolicyState(), state(3600, {0: 3600.0, 1: 3600.0}, {0: JOB, 1: POD}), [only_research], 4)
    assert sorted(results(d)) == [DENIED, RUN]
    (ran,) = [x for x in d if x.result == RUN]
    assert ran.target.workloads == (POD,)


def test_a_job_claimed_in_a_processs_environment_admits_nothing() -> None:
    # GPU 0's holder names job 77 only in its own environment (self-reported): an allowlist of
    # jobs does not admit the GPU, and the claimed job is never a workload target itself. GPU 1's
    # holder is the same job as the map file names it: that one is acted on.
    claimed = replace(
        state(3600, {0: 3600.0}, gpus=1), attribution=Attribution((Holding("GPU-0", JOB, self_reported=True),))
    )
    on_jobs = trigger(scope="gpu", allow=(Selector(hpc_jobs=("*",)),))
    _, d = decide(PolicyState(), claimed, [on_jobs], capacity=4)
    assert results(d) == [DENIED]
    assert d[0].reason == "no allowlist entry names it"
    _, d = decide(PolicyState(), claimed, [trigger()], capacity=4)
    assert results(d) == [DENIED]
    assert d[0].reason == "its job is named only by its own processes' environment (self-reported)"
    _, d = decide(PolicyState(), state(3600, {0: 3600.0}, {0: JOB}), [on_jobs, trigger()], capacity=4)
    assert results(d) == [RUN, RUN]


def test_a_decided_run_is_checked_against_the_latest_poll() -> None:
    # Decided at 3600 on GPU 0 held by JOB; then the GPU changes hands (still flagged), the flag
    # clears, or it clears and raises again: each a reason not to run. Unchanged: still due.
    t = trigger(scope="gpu")
    s, d = decide(PolicyState(), state(3600, {0: 3600.0}, {0: JOB}), [t], capacity=4)
    (run,) = d
    assert run.result == RUN
    assert changed(run, 3600, state(3600, {0: 3600.0}, {0: JOB}), s) is None
    same = state(3660, {0: 3660.0}, {0: JOB})
    assert changed(run, 3600, same, decide(s, same, [t], 4)[0]) is None
    swapped = state(3660, {0: 3660.0}, {0: POD})
    assert changed(run, 3600, swapped, decide(s, swapped, [t], 4)[0]) == (
        "who holds its GPUs has changed since it was decided"
    )
    cleared = state(3660, {}, {0: JOB})
    s2 = decide(s, cleared, [t], 4)[0]
    assert changed(run, 3600, cleared, s2) == "its flag has cleared since it was decided"
    again = state(3720, {0: 0.0}, {0: JOB})
    assert changed(run, 3600, again, decide(s2, again, [t], 4)[0]) == "its flag has cleared since it was decided"


def test_dry_run_is_decided_once_like_a_run() -> None:
    t = trigger(dry_run=True)
    s, d = decide(PolicyState(), state(3600, {0: 3600.0}, {0: JOB}), [t], capacity=0)
    assert results(d) == [DRY_RUN]  # a dry run needs no room in the queue
    _, d = decide(s, state(3660, {0: 3660.0}, {0: JOB}), [t], capacity=0)
    assert d == []


def test_an_episode_survives_a_restart_within_its_window_only() -> None:
    t = trigger(resume_s=2100.0)
    s, d = decide(PolicyState(), state(3600, {0: 3600.0}, {0: JOB}), [t], capacity=4)
    assert results(d) == [RUN]
    saved = dump_state(s)
    # Restarted at 10000: the flag raises again 30m later, within the 35m window: no rerun.
    again = load_state(saved, [t])
    again, d = decide(again, state(10000, {}, {0: JOB}), [t], capacity=4)
    again, d = decide(again, state(11800, {0: 0.0}, {0: JOB}), [t], capacity=4)
    again, d = decide(again, state(15400, {0: 3600.0}, {0: JOB}), [t], capacity=4)
    assert d == []
    # Restarted again, and the flag stays down past the window: that episode is over.
    late = load_state(saved, [t])
    late, _ = decide(late, state(10000, {}, {0: JOB}), [t], capacity=4)
    late, _ = decide(late, state(12200, {}, {0: JOB}), [t], capacity=4)
    assert late.episodes == {}
    late, d = decide(late, state(15800, {0: 3600.0}, {0: JOB}), [t], capacity=4)
    assert results(d) == [RUN]


def test_a_dry_run_record_does_not_hold_back_a_trigger_turned_live() -> None:
    dry = trigger(dry_run=True, cooldown_s=86400.0)
    s, _ = decide(PolicyState(), state(3600, {0: 3600.0}, {0: JOB}), [dry], capacity=4)
    saved = dump_state(s)
    assert load_state(saved, [dry]).cooldowns  # still dry: the record stands
    live = trigger(dry_run=False, cooldown_s=86400.0)
    resumed = load_state(saved, [live])
    assert resumed.episodes == {}
    assert resumed.cooldowns == {}
    _, d = decide(resumed, state(3700, {0: 3700.0}, {0: JOB}), [live], capacity=4)
    assert results(d) == [RUN]
    assert load_state(saved, []) == PolicyState()  # a trigger no longer configured: forgotten
