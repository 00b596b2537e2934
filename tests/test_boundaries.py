"""Every GPU-second charged where it belongs: a workload from its start (the process's start time
procfs gives, or its allocation's) until it is gone (the midpoint, where only "between two polls"
is known); busy time never more than the device's own, averaged over the interval; idle time
named after whoever left the GPU idle. Hand-worked cases, each checking that charged + idle +
unobserved adds up to price x time."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.accounting.boundaries import Part, Stretch, stretches
from agent.accounting.cost import account
from agent.devices.sampler import Sampler
from agent.ledger.report import render, report_from_ledger
from agent.ledger.sink import LedgerSink
from agent.model import (
    AgentState,
    Attribution,
    Charges,
    DeviceReading,
    Holding,
    NodeInfo,
    Price,
    Snapshot,
    Workload,
)
from agent.pipeline import Costing
from rules.engine import RuleSpec
from tests.helpers import Rig
from tests.test_accounting import MAX_INTERVAL_S, node_interval
from tests.test_partition import bursty

PRICE = 3.6  # $/GPU-hour: $0.001 a second, so seconds read as thousandths of a dollar
T0 = 1_800_000_000.0
A = Workload(hpc_job="1", user="ann")
B = Workload(hpc_job="2", user="bob")
C = Workload(hpc_job="3", user="cy")


def conserved(charges: Charges, seconds: float, gpus: int = 1) -> None:
    """Charged + idle + unobserved dollars = price x GPUs x seconds, and the idle time by who left
    it adds up to the idle time, for one interval's charges."""
    charged = math.fsum(w.dollars for w in charges.workloads)
    idle = math.fsum(g.idle_dollars for g in charges.gpus)
    unobserved = math.fsum(g.unobserved_dollars for g in charges.gpus)
    assert charged + idle + unobserved == pytest.approx(PRICE * gpus * seconds / 3600, rel=1e-12)
    for g in charges.gpus:
        assert math.fsum(i.idle_s for i in g.idle_by) == pytest.approx(g.idle_s, rel=1e-12, abs=1e-12)
        assert math.fsum(i.idle_dollars for i in g.idle_by) == pytest.approx(g.idle_dollars, rel=1e-12, abs=1e-15)


def state_conserved(state: AgentState, seconds: float, gpus: int) -> None:
    """The same over an agent's totals since it started."""
    charged = math.fsum(w.dollars for w in state.costs.workloads.values())
    idle = math.fsum(g.idle_dollars for g in state.costs.gpus.values())
    unobserved = math.fsum(g.unobserved_dollars for g in state.costs.gpus.values())
    assert charged + idle + unobserved == pytest.approx(PRICE * gpus * seconds / 3600, rel=1e-9)
    for g in state.costs.gpus.values():
        assert math.fsum(t.idle_dollars for t in g.idle_by_left.values()) == pytest.approx(g.idle_dollars, rel=1e-9)


def one_gpu(t: float, utilization: float | None = None, interval_utilization: float | None = None) -> Snapshot:
    gpu = DeviceReading(
        0, "G", "NVIDIA A100-SXM4-80GB", True, utilization=utilization, interval_utilization=interval_utilization
    )
    return Snapshot(t, NodeInfo("n"), (gpu,))


PRICES = {"G": Price(PRICE, "test")}


# -- who held it when, within one interval (pure) ------------------------------------------------


def test_a_holder_at_both_polls_holds_the_whole_interval() -> None:
    a = Holding("G", A, sm_util=0.5, started_at=T0 + 10)  # its start inside does not matter: it was there at T0
    assert stretches(T0, 60.0, [a], [a]) == [Stretch(0.0, 60.0, (Part(a, 0.0, 60.0),))]


def test_nobody_at_either_poll_is_idle_left_by_the_last_holder_before() -> None:
    assert stretches(T0, 60.0, [], [], (A,)) == [Stretch(0.0, 60.0, (), (A,))]


def test_a_new_holder_is_charged_from_its_start_and_idle_before_it_is_left_by_the_last_holder() -> None:
    # Nobody at T0, C at T0 + 60, its process started at T0 + 45: idle 0-45 s (left by A, the
    # last holder before the interval), C 45-60 s. C's reading, the mean over all 60 s, is 4
    # times its mean over the 15 s it held the GPU.
    c = Holding("G", C, sm_util=0.2, started_at=T0 + 45)
    assert stretches(T0, 60.0, [], [c], (A,)) == [
        Stretch(0.0, 45.0, (), (A,)),
        Stretch(45.0, 60.0, (Part(c, 45.0, 60.0, 4.0),)),
    ]


@pytest.mark.parametrize("started_at", [None, T0 - 30, T0 + 90], ids=["unknown", "before", "after"])
def test_a_new_holder_with_no_start_in_the_interval_is_charged_from_the_midpoint(started_at: float | None) -> None:
    # A start before the earlier poll (a process that held no GPU then, or a map file written
    # before) or not inside the interval says only that the change fell between the polls.
    c = Holding("G", C, started_at=started_at)
    assert stretches(T0, 60.0, [], [c]) == [Stretch(0.0, 30.0), Stretch(30.0, 60.0, (Part(c, 30.0, 60.0, 2.0),))]


def test_a_new_holder_that_started_at_either_poll_is_charged_from_then() -> None:
    # Started at the earlier poll itself (it was not listed yet): all of the interval. Started
    # at the later poll itself (a job starting on the minute, polled on the minute): none of it.
    at_start, at_end = Holding("G", C, started_at=T0), Holding("G", C, started_at=T0 + 60)
    assert stretches(T0, 60.0, [], [at_start]) == [Stretch(0.0, 60.0, (Part(at_start, 0.0, 60.0, 1.0),))]
    assert stretches(T0, 60.0, [], [at_end], (A,)) == [Stretch(0.0, 60.0, (), (A,))]


def test_a_holder_gone_pays_to_the_midpoint_and_leaves_the_rest_idle_in_its_name() -> None:
    a = Holding("G", A, sm_util=0.9)
    assert stretches(T0, 60.0, [a], [], (B,)) == [
        Stretch(0.0, 30.0, (Part(a, 0.0, 30.0),)),
        Stretch(30.0, 60.0, (), (A,)),  # A left it idle, not B, who held it before A
    ]


def test_one_gone_and_one_new_with_a_start_before_the_midpoint_share_the_overlap() -> None:
    # A at T0 only (gone by the midpoint, 30 s), C at T0 + 60 only, started at T0 + 20: 0-20 s A,
    # 20-30 s both, 30-60 s C.
    a, c = Holding("G", A), Holding("G", C, started_at=T0 + 20)
    assert stretches(T0, 60.0, [a], [c]) == [
        Stretch(0.0, 20.0, (Part(a, 0.0, 30.0),)),
        Stretch(20.0, 30.0, (Part(c, 20.0, 60.0, 1.5), Part(a, 0.0, 30.0))),
        Stretch(30.0, 60.0, (Part(c, 20.0, 60.0, 1.5),)),
    ]


# -- the interval, priced (pure) ----------------------------------------------------------------------


def test_a_job_starting_mid_interval_pays_from_its_start_with_its_use_over_that_part() -> None:
    # 60 s at $3.60/h ($0.001/s). Nobody at T0; job C at T0 + 60, started at T0 + 45, its
    # process's samples averaging 20% over the whole minute: 80% over its 15 s. C pays 15 s,
    # $0.015, and used 0.8 x 15 = 12 busy seconds (the same 0.2 x 60 s the samples counted).
    # The 45 s before are idle, $0.045, left by job A, which held the GPU before T0.
    c = Holding("G", C, sm_util=0.2, started_at=T0 + 45)
    charges = account(
        one_gpu(T0), one_gpu(T0 + 60), Attribution((c,)), PRICES,
        max_interval_s=MAX_INTERVAL_S, earlier=Attribution(), left_by={"G": (A,)},
    )  # fmt: skip
    [charge] = charges.workloads
    assert (charge.workload, charge.held_s, charge.charged_s) == (C, 15.0, 15.0)
    assert (charge.dollars, charge.busy_s) == (pytest.approx(0.015), pytest.approx(12.0))
    [gpu] = charges.gpus
    assert (gpu.idle_s, gpu.idle_dollars) == (45.0, pytest.approx(0.045))
    assert [(i.left_by, i.idle_s) for i in gpu.idle_by] == [(A, 45.0)]
    conserved(charges, 60)


def test_a_process_that_started_before_the_earlier_poll_but_was_not_on_the_gpu_then_pays_from_the_midpoint() -> None:
    # C's process started at T0 - 600 yet held no GPU at T0 (it loaded data first): when it
    # opened the GPU is known only to lie between the polls. C pays 30 s, $0.030; 30 s idle.
    c = Holding("G", C, sm_util=0.5, started_at=T0 - 600)
    charges = account(
        one_gpu(T0), one_gpu(T0 + 60), Attribution((c,)), PRICES, max_interval_s=MAX_INTERVAL_S, earlier=Attribution()
    )
    assert [(w.workload, w.held_s, w.dollars) for w in charges.workloads] == [(C, 30.0, pytest.approx(0.030))]
    assert [(i.left_by, i.idle_s) for i in charges.gpus[0].idle_by] == [(Workload(), 30.0)]  # nobody known before
    conserved(charges, 60)


def test_idle_left_by_several_holders_is_split_between_them_equally() -> None:
    # A and B shared the GPU until the poll before; a whole idle minute, $0.060, is left by
    # both: $0.030 each.
    charges = account(
        one_gpu(T0), one_gpu(T0 + 60), Attribution(), PRICES,
        max_interval_s=MAX_INTERVAL_S, earlier=Attribution(), left_by={"G": (A, B)},
    )  # fmt: skip
    [gpu] = charges.gpus
    assert [(i.left_by, i.idle_s, i.idle_dollars) for i in gpu.idle_by] == [
        (A, 30.0, pytest.approx(0.030)),
        (B, 30.0, pytest.approx(0.030)),
    ]
    conserved(charges, 60)


def test_holders_busy_time_is_capped_by_the_devices_own_over_the_interval() -> None:
    # A reads 60% and B 50% over the minute, 110% together, while the device's own samples
    # averaged 80%: 48 busy seconds in all. Each is scaled by 0.8 / 1.1: A 36 x 8/11 = 26.18 s,
    # B 30 x 8/11 = 21.82 s, 48 s together. The dollars, $0.060, still split 60:50 (the shares
    # are proportions): A $0.0327, B $0.0273.
    holders = (Holding("G", A, sm_util=0.6), Holding("G", B, sm_util=0.5))
    charges = account(
        one_gpu(T0), one_gpu(T0 + 60, utilization=0.0, interval_utilization=0.8), Attribution(holders), PRICES,
        max_interval_s=MAX_INTERVAL_S,
    )  # fmt: skip
    busy = {w.workload: w.busy_s for w in charges.workloads}
    assert busy == {A: pytest.approx(36 * 8 / 11), B: pytest.approx(30 * 8 / 11)}
    assert math.fsum(busy.values()) == pytest.approx(48.0)
    assert charges.gpus[0].busy_s == pytest.approx(48.0)  # the GPU's own: 0.8 x 60 s
    dollars = {w.workload: w.dollars for w in charges.workloads}
    assert dollars == {A: pytest.approx(0.060 * 6 / 11), B: pytest.approx(0.060 * 5 / 11)}
    conserved(charges, 60)


def test_a_sole_holder_without_its_own_samples_uses_the_devices_interval_mean_not_its_last_sample() -> None:
    # No per-process samples (sm_util None): the sole holder's use is the device's, 30% over the
    # minute by its samples, though the last sample read 90%: 18 busy seconds, not 54.
    charges = account(
        one_gpu(T0), one_gpu(T0 + 60, utilization=0.9, interval_utilization=0.3),
        Attribution((Holding("G", A),)), PRICES, max_interval_s=MAX_INTERVAL_S,
    )  # fmt: skip
    assert [w.busy_s for w in charges.workloads] == [pytest.approx(18.0)]
    conserved(charges, 60)


def test_an_allocation_running_nothing_uses_the_devices_time_only_where_it_held_it_alone_throughout() -> None:
    # Job A's allocation, no process at either poll (sm_util 0), holds G all minute. Alone, the
    # device's 25% is its own (its processes ran between the polls): 0.25 x 60 = 15 busy
    # seconds. With B's process, started at T0 + 40 and reading 1/3 over the minute (100% over
    # its 20 s), the device's 1/3 (20 s) is B's: A 0 busy seconds, B 20. Dollars: A all of the
    # first minute, $0.060; in the second, A alone 40 s ($0.040), then B's measured use takes
    # the last 20 s whole ($0.020, A's 0 splitting nothing).
    job = Holding("G", A, sm_util=0.0, allocated=True)
    alone = account(
        one_gpu(T0), one_gpu(T0 + 60, interval_utilization=0.25), Attribution((job,)), PRICES,
        max_interval_s=MAX_INTERVAL_S, earlier=Attribution((job,)),
    )  # fmt: skip
    assert [(w.busy_s, w.dollars) for w in alone.workloads] == [(pytest.approx(15.0), pytest.approx(0.060))]
    conserved(alone, 60)
    b = Holding("G", B, pids=(7,), sm_util=1 / 3, started_at=T0 + 100)
    shared = account(
        one_gpu(T0 + 60), one_gpu(T0 + 120, interval_utilization=1 / 3), Attribution((job, b)), PRICES,
        max_interval_s=MAX_INTERVAL_S, earlier=Attribution((job,)),
    )  # fmt: skip
    by = {w.workload: (w.busy_s, w.dollars) for w in shared.workloads}
    assert by == {A: (0.0, pytest.approx(0.040)), B: (pytest.approx(20.0), pytest.approx(0.020))}
    conserved(shared, 60)


holders = st.lists(st.sampled_from([A, B, C]), max_size=3, unique=True)


@settings(max_examples=300, deadline=None)
@given(node_interval(), st.data())
def test_charges_add_up_and_busy_time_never_exceeds_the_devices_whatever_the_boundaries(
    case: Any, data: st.DataObject
) -> None:
    prev, curr, attribution, prices = case
    dt = curr.taken_at - prev.taken_at
    # Holders at the earlier poll, start times in and around the interval, device means, and
    # who held each unit last before it: all drawn.
    units = sorted({h.device_uuid for h in attribution.holdings} | {d.uuid for d in curr.devices})
    starts = st.none() | st.floats(prev.taken_at - dt, curr.taken_at + dt)
    earlier = Attribution(
        tuple(Holding(u, w, sm_util=data.draw(st.none() | st.floats(0, 1))) for u in units for w in data.draw(holders))
    )
    later = Attribution(tuple(replace(h, started_at=data.draw(starts)) for h in attribution.holdings))
    means = {d.uuid: data.draw(st.none() | st.floats(0, 1)) for d in curr.gpus}
    curr = replace(curr, devices=tuple(_with_mean(d, means.get(d.uuid)) for d in curr.devices))
    left_by = {u: tuple(data.draw(holders)) for u in units}
    charges = account(
        prev, curr, later, prices, max_interval_s=MAX_INTERVAL_S, earlier=earlier, left_by=left_by
    )  # fmt: skip
    whole = math.fsum((p.dollars_per_hour if (p := prices[g.uuid]) else 0.0) * dt / 3600 for g in curr.gpus)
    charged = math.fsum(w.dollars for w in charges.workloads)
    idle = math.fsum(g.idle_dollars for g in charges.gpus)
    unobserved = math.fsum(g.unobserved_dollars for g in charges.gpus)
    assert charged + idle + unobserved == pytest.approx(whole, rel=1e-9, abs=1e-12)
    for g in charges.gpus:
        assert math.fsum(i.idle_s for i in g.idle_by) == pytest.approx(g.idle_s, rel=1e-9, abs=1e-9)
        assert math.fsum(i.idle_dollars for i in g.idle_by) == pytest.approx(g.idle_dollars, rel=1e-9, abs=1e-12)
        charged_s = math.fsum(w.charged_s for w in charges.workloads if w.gpu == g.gpu)
        assert charged_s + g.idle_s + g.unobserved_s == pytest.approx(dt, rel=1e-9, abs=1e-9)
        if g.busy_s is not None:
            # The GPU's busy seconds bound its holders' together.
            busy = math.fsum(w.busy_s for w in charges.workloads if w.gpu == g.gpu)
            assert busy <= g.busy_s * (1 + 1e-9) + 1e-9
    for w in charges.workloads:
        assert 0 <= w.busy_s <= w.held_s + 1e-9
        assert 0 <= w.charged_s <= w.held_s + 1e-9


def _with_mean(device: DeviceReading, mean: float | None) -> DeviceReading:
    """A whole GPU's reading with its interval mean; MIG readings as they are (none measure it)."""
    return replace(device, interval_utilization=mean) if device.parent_uuid is None else device


# -- on the fake node, through the whole agent -------------------------------------------------------


@pytest.fixture
def run() -> Iterator[Any]:
    rigs: list[Rig] = []

    def simulate(
        scenario: dict[str, Any], duration_s: float, step_s: float = 60.0, **kwargs: Any
    ) -> tuple[Rig, AgentState]:
        prices = lambda snapshot: {g.uuid: Price(PRICE, "test") for g in snapshot.gpus}  # noqa: E731
        rig = Rig(scenario, costing=Costing(prices=prices, **({"max_interval_s": 300.0} | kwargs)))
        rigs.append(rig)
        return rig, rig.run(duration_s, step_s)

    yield simulate
    for rig in rigs:
        rig.close()


def by_job(state: AgentState) -> dict[str, tuple[float, float]]:
    """hpc_job -> (dollars, busy seconds)."""
    return {w.hpc_job: (t.dollars, t.busy_s) for (_gpu, _uuid, w), t in state.costs.workloads.items()}


def test_a_slurm_allocation_is_charged_from_when_its_prolog_wrote_the_map_file(run: Any) -> None:
    # Job 9911 is allocated GPU 0 at 2:10 (130 s) and runs nothing; polls every minute for 5
    # minutes. The map file's time is the allocation's start: the job pays 130-300 s, 170 s =
    # $0.170 (the midpoint, 150 s, would have charged it 150 s). Idle 0-130 s, $0.130, left by
    # nobody: nobody held the GPU before.
    scenario = {
        "gpus": [{"count": 1}],
        "allocations": [{"gpus": [0], "slurm_job": "9911", "user": "bob", "start": "130s"}],
    }
    _rig, state = run(scenario, 300)
    assert by_job(state) == {"9911": (pytest.approx(0.170), 0.0)}
    [gpu] = state.costs.gpus.values()
    assert gpu.idle_dollars == pytest.approx(0.130)
    assert {w: t.idle_s for w, t in gpu.idle_by_left.items()} == {Workload(): pytest.approx(130.0)}
    state_conserved(state, 300, gpus=1)


def test_a_process_is_charged_from_the_start_time_procfs_gives(run: Any) -> None:
    # A 4-hour job on 8 GPUs polled every 10 minutes (the 73.33 GPU-hours for a 72-hour
    # job came from charging each start from the poll before). The job starts at 0:07 and ends at
    # 4:07; polls at 0:00, 0:10, ... 5:00. Start: from 0:07 (procfs), not 0:05 (midpoint) or 0:00.
    # End: NVML gives no end time, so the midpoint of 4:00-4:10, 4:05. Charged 0:07-4:05 =
    # 14280 s a GPU, x 8 = 114240 s = $114.24; the truth is 8 x 4 h = $115.20 (the 2 minutes
    # lost at the end are the midpoint's error, at most half a poll). Idle: 8 x 18000 - 114240 =
    # 29760 s, $29.76.
    scenario = {
        "gpus": [{"count": 8}],
        "processes": [
            {"pid": 7, "gpus": list(range(8)), "start": "7m", "end": "247m", "sm_util": 90, "slurm_job": "72"}
        ],
    }
    # (Polls 10 minutes apart are the run's rhythm, not gaps; nothing forgotten in 5 hours.)
    _rig, state = run(scenario, 5 * 3600, step_s=600, max_interval_s=900.0, forget_after_s=86400.0)
    per_gpu = [t.dollars for (_gpu, _uuid, w), t in state.costs.workloads.items() if w.hpc_job == "72"]
    assert per_gpu == [pytest.approx(14.28)] * 8
    assert math.fsum(per_gpu) == pytest.approx(114.24)
    idle = math.fsum(g.idle_dollars for g in state.costs.gpus.values())
    assert idle == pytest.approx(29.76)
    state_conserved(state, 5 * 3600, gpus=8)


def test_bursty_work_reads_30_percent_on_the_device_too_and_busy_stays_under_it(run: Any) -> None:
    # 90% for 5 s of every 15 s: the device's own samples average 30% over each interval, though
    # its latest sample (the gauge) reads 0% or 90% depending on when the poll falls. An hour
    # at 30% is 1080 busy seconds for the GPU and for the job, never more.
    process = {"pid": 1, "gpus": [0], "sm_util": bursty(5, 15, 1.0), "slurm_job": "5"}
    _rig, state = run({"gpus": [{"count": 1}], "processes": [process]}, 3600, step_s=15)
    assert state.snapshot is not None
    assert state.snapshot.gpus[0].interval_utilization == pytest.approx(0.30, abs=0.01)
    [gpu] = state.costs.gpus.values()
    assert gpu.busy_s == pytest.approx(1080, rel=0.01)
    _dollars, busy = by_job(state)["5"]
    assert busy == pytest.approx(1080, rel=0.01)
    assert busy <= gpu.busy_s
    state_conserved(state, 3600, gpus=1)


def test_two_processes_reading_more_than_the_device_are_scaled_to_its_busy_time(run: Any) -> None:
    # pid 1 at 70% and pid 2 at 60% on one GPU: their samples add up to 130%, the device's to
    # 100% (it cannot be busier). Over 10 minutes the GPU was busy 600 s: job 1 is booked
    # 600 x 70/130 = 323.08 s, job 2 600 x 60/130 = 276.92 s (unscaled, 420 + 360 = 780 s). The
    # $0.600 splits 70:60 as measured: $0.3231 and $0.2769.
    scenario = {
        "gpus": [{"count": 1}],
        "processes": [
            {"pid": 1, "gpus": [0], "sm_util": 70, "slurm_job": "1"},
            {"pid": 2, "gpus": [0], "sm_util": 60, "slurm_job": "2"},
        ],
    }
    _rig, state = run(scenario, 600, step_s=15)
    jobs = by_job(state)
    assert jobs == {
        "1": (pytest.approx(0.600 * 70 / 130), pytest.approx(600 * 70 / 130)),
        "2": (pytest.approx(0.600 * 60 / 130), pytest.approx(600 * 60 / 130)),
    }
    [gpu] = state.costs.gpus.values()
    assert gpu.busy_s == pytest.approx(600.0)
    state_conserved(state, 600, gpus=1)


def test_device_samples_not_supported_are_learned_once_and_the_latest_reading_stands_in(run: Any) -> None:
    # A GPU without nvmlDeviceGetSamples: asked once, learned, never asked again; its holder's
    # busy time falls back to the latest utilization reading (a steady 70%: 0.7 x 300 = 210 s).
    scenario = {
        "gpus": [{"count": 1}],
        "processes": [{"pid": 1, "gpus": [0], "sm_util": 70, "slurm_job": "1"}],
        "faults": [{"call": "nvmlDeviceGetSamples", "error": "NOT_SUPPORTED"}],
    }
    rig, state = run(scenario, 300, step_s=15)
    assert rig.node.calls["nvmlDeviceGetSamples"] == 1
    assert state.snapshot is not None
    assert state.snapshot.gpus[0].interval_utilization is None
    [gpu] = state.costs.gpus.values()
    assert gpu.busy_s == pytest.approx(210.0)
    assert by_job(state)["1"][1] == pytest.approx(210.0)
    state_conserved(state, 300, gpus=1)


def test_a_transient_failure_of_the_device_samples_is_retried_and_the_next_poll_covers_the_gap(run: Any) -> None:
    # NOT_SUPPORTED from 1:00 to 2:00 after the call had worked: asked again every poll (20
    # polls over 5 minutes), counted as errors, and the first poll after reads every sample
    # since the last one seen.
    scenario = {
        "gpus": [{"count": 1}],
        "processes": [{"pid": 1, "gpus": [0], "sm_util": 40, "slurm_job": "1"}],
        "faults": [{"at": "1m", "until": "2m", "call": "nvmlDeviceGetSamples", "error": "NOT_SUPPORTED"}],
    }
    rig, state = run(scenario, 300, step_s=15)
    assert rig.node.calls["nvmlDeviceGetSamples"] == 21  # every poll, the first included
    errors = {(call, error): n for call, error, n in state.health.nvml_errors}
    assert errors[("nvmlDeviceGetSamples", "NOT_SUPPORTED")] == 4  # the polls at 1:00, 1:15, 1:30, 1:45
    assert state.snapshot is not None
    assert state.snapshot.gpus[0].interval_utilization == pytest.approx(0.40)
    assert by_job(state)["1"][1] == pytest.approx(0.4 * 300)
    state_conserved(state, 300, gpus=1)


def test_at_most_ten_nvml_calls_per_gpu_per_poll(run: Any) -> None:
    rig, _state = run({"gpus": [{"count": 2}], "processes": [{"pid": 1, "gpus": [0, 1], "sm_util": 50}]}, 60, 15)
    before = rig.node.calls.copy()
    rig.poll(15)
    calls = rig.node.calls - before
    # One wait on the node's event set (driver events, read in the poll where no reader thread
    # runs), and per GPU: memory, utilization, temperature, field values, processes, process
    # samples, device samples (the health readings, the SM clock among them, come every 30 s).
    assert calls.pop("nvmlEventSetWait_v2") == 1
    assert "nvmlDeviceGetClockInfo" not in calls
    per_gpu = sum(calls.values()) / 2
    assert per_gpu == 7, dict(calls)
    assert per_gpu + 1 / 2 <= 10


def test_steady_state_nvml_calls_per_gpu_per_poll_whole_and_mig(run: Any) -> None:
    # Over one slow interval (30 s: six polls 5 s apart), with every default reading on, a node
    # of one whole A100 and one fully split A100 (7 x 1g.10gb, a process on each instance whose
    # memory does not change). The event set's waits are the node's, not a GPU's.
    scenario = {
        "gpus": [{"model": "A100-SXM4-80GB", "nvlink_links": 12}, {"model": "A100-SXM4-80GB", "mig": ["1g.10gb"] * 7}],
        "processes": [{"pid": 10, "gpus": [0], "sm_util": 50, "memory_mib": 4000}]
        + [{"pid": 20 + m, "gpus": [f"1:{m}"], "sm_util": 30, "memory_mib": 1000 + m} for m in range(7)],
    }
    rig, _state = run(scenario, 60, 5)
    before = rig.node.calls.copy()
    for _ in range(6):
        state = rig.poll(5)
    calls = rig.node.calls - before
    calls.pop("nvmlEventSetWait_v2", None)
    # Per poll, each GPU: field values (power, energy, NVLinks, and the counters when due),
    # temperature, its process list. The whole GPU also: memory, utilization, its process
    # samples, its device samples: 7. The MIG GPU: its instances' memory only where their
    # processes' memory changed (here never), else every slow interval: 3.
    # Once in the six, the slow readings: the whole GPU's SM clock, performance state,
    # clock-event reasons, PCIe generation and width, encoder, decoder (7); the MIG GPU's SM
    # clock, performance state, reasons, PCIe generation and width (5) and the seven instances'
    # memory (7). An A100's HBM runs at one memory clock (its supported-clocks list has one
    # entry), so its memory clock was read once, at the first poll, and is not among them (slow,
    # it would make them 8 and 6: 8.67 and 5.17 a poll).
    # The whole GPU's MPS-client and graphics process lists, empty here, once in the slow
    # interval (2); a MIG GPU reads its compute lists only.
    whole = 7 * 6 + 7 + 2
    mig = 3 * 6 + 5 + 7
    assert sum(calls.values()) == whole + mig, dict(calls)
    assert calls["nvmlDeviceGetMemoryInfo_v2"] == 6 + 7
    assert calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 2 * 6
    # Each GPU's SM clock once, at the slow poll; no memory clock.
    assert calls["nvmlDeviceGetClockInfo"] == 1 + 1
    assert "nvmlDeviceGetSupportedMemoryClocks" not in calls
    assert whole / 6 == 51 / 6  # 8.5 a poll, within the budget of 10
    assert mig / 6 == 5
    # And the carried memory is the instances' own, as read.
    assert state.snapshot is not None
    # The memory clock read once is still shown every poll: both boards busy at the A100
    # SXM4 80GB's 1593 MHz.
    assert [g.telemetry.memory_clock_hz if g.telemetry else None for g in state.snapshot.gpus] == [1593e6] * 2
    instances = state.snapshot.mig_devices(state.snapshot.gpus[1].uuid)
    assert [d.memory_used_bytes for d in instances] == [(1000 + m) * 2**20 for m in range(7)]


def test_a_mig_instance_whose_processes_change_memory_is_read_at_that_poll(run: Any) -> None:
    # Instance 0's process grows from 1000 to 3000 MiB at 17 s; a process starts on instance 1
    # at 22 s. Each instance's memory is read at the first poll that sees its change (20 s and
    # 25 s), not at the next slow interval (30 s).
    scenario = {
        "gpus": [{"model": "A100-SXM4-80GB", "mig": ["3g.40gb", "3g.40gb"]}],
        "processes": [
            {"pid": 1, "gpus": ["0:0"], "sm_util": [{"at": "0s", "sm_util": 10}, {"at": "17s", "sm_util": 10,
                                                                                    "memory_mib": 3000}],
             "memory_mib": 1000},
            {"pid": 2, "gpus": ["0:1"], "start": "22s", "sm_util": 10, "memory_mib": 500},
        ],
    }  # fmt: skip
    rig, _state = run(scenario, 15, 5)  # polls at 0, 5, 10, 15
    memory_reads = []
    used = []
    for _ in range(2):  # polls at 20 and 25
        before = rig.node.calls["nvmlDeviceGetMemoryInfo_v2"]
        state = rig.poll(5)
        memory_reads.append(rig.node.calls["nvmlDeviceGetMemoryInfo_v2"] - before)
        assert state.snapshot is not None
        used.append([d.memory_used_bytes for d in state.snapshot.mig_devices(state.snapshot.gpus[0].uuid)])
    assert memory_reads == [1, 1]
    assert used == [[3000 * 2**20, 0], [3000 * 2**20, 500 * 2**20]]


# -- who left it idle ---------------------------------------------------------------------------------


LEFT = {
    "gpus": [{"count": 2}],
    "processes": [{"pid": 1, "gpus": [0], "sm_util": 80, "end": "620s", "slurm_job": "1", "uid": 1000, "user": "ann"}],
}


def test_idle_time_is_booked_to_whoever_left_the_gpu_idle(run: Any) -> None:
    # Job 1 runs on GPU 0 until 10:20; polls every minute for 30 minutes. It pays to the
    # midpoint of 10:00-11:00, 10:30: 630 s, $0.630. GPU 0 then idles 10:30-30:00, 1170 s,
    # $1.170, left by job 1; GPU 1 idles all 1800 s, $1.800, left by nobody (nobody held it).
    # All of it: 2 GPUs x 1800 s = $3.600.
    rig, state = run(LEFT, 1800)
    assert by_job(state)["1"][0] == pytest.approx(0.630)
    job = Workload(hpc_job="1", user="ann")
    by_gpu = {
        gpu: {w: (t.idle_s, t.idle_dollars) for w, t in g.idle_by_left.items()}
        for (gpu, _), g in state.costs.gpus.items()
    }
    assert by_gpu == {
        0: {job: (pytest.approx(1170.0), pytest.approx(1.170))},
        1: {Workload(): (pytest.approx(1800.0), pytest.approx(1.800))},
    }
    series = {
        (s[1]["gpu"], s[1]["hpc_job"]): s[2]
        for s in rig.samples(state, {"gpuledger_gpu_idle_left_by_cost_dollars_total"})
    }
    assert series == {("0", "1"): pytest.approx(1.170), ("1", ""): pytest.approx(1.800)}
    seconds = rig.samples(state, {"gpuledger_gpu_idle_left_by_seconds_total"})
    assert sorted((s[1]["gpu"], s[1]["user"], s[2]) for s in seconds) == [
        ("0", "ann", pytest.approx(1170.0)),
        ("1", "", pytest.approx(1800.0)),
    ]
    state_conserved(state, 1800, gpus=2)


def test_the_ledger_and_report_break_the_idle_row_down_by_who_left_it(tmp_path: Path) -> None:
    # The run above into a ledger: TOTAL $3.60 = job 1 $0.63 + idle left by job 1 $1.17 + idle
    # left by nobody known $1.80.
    ledger = tmp_path / "ledger.db"
    sink = LedgerSink(ledger, retention_s=None, clock=lambda: 1_795_300_000.0, node="rig")
    prices = lambda snapshot: {g.uuid: Price(PRICE, "test") for g in snapshot.gpus}  # noqa: E731
    rig = Rig(LEFT, costing=Costing(prices=prices, sink=sink, max_interval_s=300.0))
    try:
        state = rig.run(1800, 60)
    finally:
        rig.close()
        assert sink.close()
    state_conserved(state, 1800, gpus=2)
    report = report_from_ledger(ledger, by=["hpc_job"])
    assert [(line.key, round(line.dollars, 6)) for line in report.lines] == [(("1",), 0.63)]
    assert [(line.left_by, round(line.dollars, 6)) for line in report.idle_by] == [
        (Workload(), 1.8),
        (Workload(hpc_job="1", user="ann"), 1.17),
    ]
    assert report.total.dollars == pytest.approx(3.60)
    table = render(report, "table").splitlines()
    assert [line.split("  ")[0] for line in table[4:-2]] == [
        "1",
        "(idle) left by nobody known",
        "(idle) left by job 1 (ann)",
        "(unobserved)",
    ]
    # Used: job 1 at 80% for 600 s, 480 s, then its half of 10:00-11:00 at its last reading,
    # 30 s x 0.8 = 24 s, capped by the device's own samples of that minute: 19 one-second
    # samples at 80% (10:01-10:19; it ended at 10:20), 15.2 s. 495.2 s = 0.14 GPU-hours of the
    # 1.00 (2 GPUs x 30 min): 13.8%. Waste: job 1's $0.63 x (1 - 495.2/630) = $0.1348 and all
    # the idle $2.97: $3.10.
    assert table[-1].split()[:6] == ["TOTAL", "3.60", "1.00", "0.14", "13.8%", "3.10"]
    rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    idle_rows = [(r["left_by"], float(r["dollars"])) for r in rows if r["kind"] == "idle"]
    assert idle_rows == [("{}", pytest.approx(1.8)), ('{"hpc_job": "1", "user": "ann"}', pytest.approx(1.17))]
    # The column adds up to TOTAL, idle rows included.
    assert math.fsum(float(r["dollars"]) for r in rows if r["kind"] != "total") == pytest.approx(3.60)
    document = json.loads(render(report, "json"))
    assert document["idle"]["dollars"] == pytest.approx(2.97)
    assert [(e["workload"]["hpc_job"], e["dollars"]) for e in document["idle"]["left_by"]] == [
        ("", pytest.approx(1.8)),
        ("1", pytest.approx(1.17)),
    ]


def test_flag_lines_of_any_idle_rule_name_who_left_the_gpu_or_that_nobody_did(caplog: pytest.LogCaptureFixture) -> None:
    # A custom rule of the idle condition (weekend_idle, 5 min) names the last holder too; GPU 1,
    # never held, says so. Job 1 is last seen on GPU 0 by the poll at 10:00.
    rule = RuleSpec("weekend_idle", "idle", utilization_below=0.05, for_s=300)
    rig = Rig(LEFT, flag_rules=[rule])
    try:
        caplog.set_level(logging.WARNING, logger="agent.pipeline")
        rig.run(1800, 60)
    finally:
        rig.close()
    raised = [r.getMessage() for r in caplog.records if r.getMessage().startswith("flag raised: rule=weekend_idle")]
    assert len(raised) == 2
    [gpu0] = [line for line in raised if "gpu=0" in line]
    assert "left_by=job 1 left_at=" in gpu0
    [gpu1] = [line for line in raised if "gpu=1" in line]
    assert "left_by=(nobody since the agent started)" in gpu1


def test_the_sampler_reads_the_devices_samples_once_per_gpu_per_poll(install_fake: Any) -> None:
    from agent.devices.nvml import NvmlBackend

    node = install_fake({"gpus": [{"count": 3}]}, init=False)
    sampler = Sampler(NvmlBackend(node.clock.wall_time), hostname="n")
    sampler.start()
    for _ in range(4):
        node.clock.advance(5)
        sampler.poll()
    assert node.calls["nvmlDeviceGetSamples"] == 3 * 4
