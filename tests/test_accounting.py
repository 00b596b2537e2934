"""Cost arithmetic: conservation under random inputs, and small scenarios worked by hand."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fake_nvml
from agent.accounting.cost import account, accumulate, cost_units, energy_dollars
from agent.model import (
    Attribution,
    CostTotals,
    DeviceReading,
    Holding,
    NodeInfo,
    Price,
    Snapshot,
    Workload,
)
from agent.pipeline import Costing
from tests.helpers import Rig

MAX_INTERVAL_S = 300.0

# -- conservation, on random nodes ---------------------------------------------------------------

workloads = st.builds(Workload, hpc_job=st.sampled_from(["1", "2", "3"]), user=st.sampled_from(["a", "b"]))


@st.composite
def node_interval(draw: st.DrawFn) -> tuple[Snapshot, Snapshot, Attribution, dict[str, Price | None]]:
    """Two polls of a random node: whole and MIG GPUs, holders with and without measured use."""
    devices_prev: list[DeviceReading] = []
    devices: list[DeviceReading] = []
    holdings: list[Holding] = []
    prices: dict[str, Price | None] = {}
    for i in range(draw(st.integers(1, 4))):
        uuid = f"GPU-{i}"
        up = draw(st.booleans()) or draw(st.booleans())
        energy0 = draw(st.floats(0, 1e9))
        energy1 = energy0 + draw(st.floats(-10, 1e6))  # a negative step: the counter restarted
        migs = draw(st.integers(0, 3))
        gpu_sms = 108
        parent = DeviceReading(
            index=i,
            uuid=uuid,
            name="NVIDIA A100-SXM4-80GB",
            up=up,
            sm_count=gpu_sms,
            mig_enabled=migs > 0,
            utilization=None if migs else draw(st.none() | st.floats(0, 1)),
            energy_j=energy1,
        )
        devices_prev.append(DeviceReading(index=i, uuid=uuid, name=parent.name, up=True, energy_j=energy0))
        devices.append(parent)
        units = [uuid]
        for m in range(migs):
            mig_uuid = f"MIG-{i}-{m}"
            devices.append(
                DeviceReading(
                    index=i,
                    uuid=mig_uuid,
                    name=parent.name,
                    up=up,
                    parent_uuid=uuid,
                    mig_index=m,
                    sm_count=draw(st.sampled_from([14, 28, 42])) if draw(st.booleans()) else None,
                )
            )
            units.append(mig_uuid)
        if migs:
            units = units[1:]
        prices[uuid] = draw(st.none() | st.builds(lambda p: Price(p, "test"), st.floats(0, 100)))
        for unit in units:
            holdings.extend(
                Holding(
                    device_uuid=unit,
                    workload=workload,
                    sm_util=draw(st.none() | st.floats(0, 1)),
                    memory_bytes=draw(st.none() | st.integers(0, 2**36)),
                )
                for workload in draw(st.lists(workloads, max_size=3, unique=True))
            )
    t0 = 1_800_000_000.0
    dt = draw(st.floats(0.001, 2 * MAX_INTERVAL_S))
    node = NodeInfo("n")
    return (
        Snapshot(t0, node, tuple(devices_prev)),
        Snapshot(t0 + dt, node, tuple(devices)),
        Attribution(holdings=tuple(holdings)),
        prices,
    )


@settings(max_examples=400, deadline=None)
@given(node_interval())
def test_workload_plus_idle_dollars_and_joules_add_up_to_each_gpus_cost(case: Any) -> None:
    prev, curr, attribution, prices = case
    per_kwh = 0.15
    charges = account(prev, curr, attribution, prices, max_interval_s=MAX_INTERVAL_S, energy_per_kwh=per_kwh)
    dt = curr.taken_at - prev.taken_at
    whole = sum(
        (p.dollars_per_hour if (p := prices[g.uuid]) else 0.0) * dt / 3600 for g in curr.gpus
    )  # price x weight x wall time, the weights of one GPU's units summing to 1
    # Time is a partition: charged + idle + unobserved is all of it, in dollars and seconds.
    charged = sum(w.dollars for w in charges.workloads) + sum(g.idle_dollars for g in charges.gpus)
    unobserved = sum(g.unobserved_dollars for g in charges.gpus)
    assert charged + unobserved == pytest.approx(whole, rel=1e-9, abs=1e-12)
    assert sum(g.dollars for g in charges.gpus) == pytest.approx(charged, rel=1e-9, abs=1e-12)
    if dt > MAX_INTERVAL_S:
        assert charged == 0.0
    for g in charges.gpus:
        reading = next(d for d in curr.gpus if d.uuid == g.uuid)
        if not reading.up and dt <= MAX_INTERVAL_S:  # a GPU down at the end: nothing observed, none idle
            assert (g.observed_s, g.idle_s, g.unobserved_reason) == (0.0, 0.0, reading.down_reason or "unreadable")
    # Energy too, but for a GPU unobserved all the interval: what its counter counted is nobody's;
    # a counter that went backwards (it restarted) measured nothing: unknown all through.
    went_back = {g.uuid for g in curr.gpus if g.energy_j < next(d.energy_j for d in prev.gpus if d.uuid == g.uuid)}
    for g in charges.gpus:
        unknown = g.uuid in went_back
        assert (g.joules is None, g.idle_joules is None) == (unknown, unknown)
        assert all((w.joules is None) == unknown for w in charges.workloads if w.gpu == g.gpu)
    joules = sum(w.joules or 0.0 for w in charges.workloads) + sum(g.idle_joules or 0.0 for g in charges.gpus)
    observed = [g for g in charges.gpus if g.observed_s > 0]
    assert joules == pytest.approx(sum(g.joules or 0.0 for g in observed), rel=1e-9, abs=1e-9)
    assert all(g.joules is None or g.joules >= 0 for g in charges.gpus)
    # Energy dollars: each figure is its joules at the price, so they add up like the joules.
    for g in charges.gpus:
        assert g.energy_dollars == energy_dollars(g.joules, per_kwh)
        assert g.idle_energy_dollars == energy_dollars(g.idle_joules, per_kwh)
    for w in charges.workloads:
        assert w.energy_dollars == energy_dollars(w.joules, per_kwh)
    energy = sum(w.energy_dollars or 0.0 for w in charges.workloads) + sum(
        g.idle_energy_dollars or 0.0 for g in charges.gpus
    )
    assert energy == pytest.approx(sum(g.energy_dollars or 0.0 for g in observed), rel=1e-9, abs=1e-12)
    for w in charges.workloads:
        assert 0 <= w.busy_s <= w.held_s + 1e-9
        assert w.held_s <= dt + 1e-9
        assert 0 <= w.charged_s <= w.held_s + 1e-9
    for g in charges.gpus:
        assert g.observed_s + g.unobserved_s == pytest.approx(dt)
        assert g.idle_s <= g.observed_s + 1e-9
        # Charged seconds are shares: the holders' and the idle seconds are the observed seconds.
        charged_s = sum(w.charged_s for w in charges.workloads if w.gpu == g.gpu)
        assert charged_s + g.idle_s == pytest.approx(g.observed_s, rel=1e-9, abs=1e-9)


def test_mig_units_weigh_by_sm_share_and_the_rest_is_unassigned() -> None:
    gpu = DeviceReading(index=0, uuid="GPU-0", name="NVIDIA A100-SXM4-80GB", up=True, sm_count=108, mig_enabled=True)
    migs = [
        DeviceReading(index=0, uuid=f"MIG-{m}", name=gpu.name, up=True, parent_uuid="GPU-0", mig_index=m, sm_count=42)
        for m in range(2)
    ]
    units = cost_units(Snapshot(0, NodeInfo("n"), (gpu, *migs)), gpu)
    assert [(u.uuid, round(u.weight, 6)) for u in units] == [
        ("MIG-0", round(42 / 108, 6)),
        ("MIG-1", round(42 / 108, 6)),
        ("", round(24 / 108, 6)),  # SMs the 3g+3g layout leaves unassigned: nobody can hold them
    ]


def test_energy_is_priced_once_at_the_price_per_kwh_and_unpriced_without_one() -> None:
    gpu0 = DeviceReading(index=0, uuid="G", name="x", up=True, energy_j=1_000_000.0)
    gpu1 = DeviceReading(index=0, uuid="G", name="x", up=True, energy_j=1_000_000.0 + 720_000.0)
    prev, curr = Snapshot(0.0, NodeInfo("n"), (gpu0,)), Snapshot(60.0, NodeInfo("n"), (gpu1,))
    # ann uses 3/4 of the GPU, bob 1/4: they split its 720 kJ (0.2 kWh) 540 kJ / 180 kJ.
    attribution = Attribution(
        holdings=(Holding("G", Workload(user="ann"), sm_util=0.75), Holding("G", Workload(user="bob"), sm_util=0.25))
    )
    prices = {"G": Price(3.6, "t")}
    priced = account(prev, curr, attribution, prices, max_interval_s=MAX_INTERVAL_S, energy_per_kwh=0.25)
    # 540 kJ = 0.15 kWh x $0.25 = $0.0375; 180 kJ = 0.05 kWh x $0.25 = $0.0125; the GPU $0.05.
    assert {w.workload.user: w.energy_dollars for w in priced.workloads} == pytest.approx(
        {"ann": 0.0375, "bob": 0.0125}, rel=1e-12
    )
    (gpu,) = priced.gpus
    assert (gpu.energy_dollars, gpu.idle_energy_dollars) == (pytest.approx(0.05, rel=1e-12), 0.0)
    totals = accumulate(accumulate(CostTotals(), priced, forget_after_s=1e9), priced, forget_after_s=1e9)
    assert totals.gpus[(0, "G")].energy_dollars == pytest.approx(0.10, rel=1e-12)  # two such intervals
    unpriced = account(prev, curr, attribution, prices, max_interval_s=MAX_INTERVAL_S)
    assert [w.energy_dollars for w in unpriced.workloads] == [None, None]
    assert (unpriced.gpus[0].energy_dollars, unpriced.gpus[0].idle_energy_dollars) == (None, None)
    assert accumulate(CostTotals(), unpriced, forget_after_s=1e9).gpus[(0, "G")].energy_dollars is None


def test_an_energy_counter_that_went_backwards_measured_nothing_not_0_joules() -> None:
    # The driver reloaded (or the GPU reset) within the interval: the counter restarted from 0
    # and reads 3 kJ where it read 5 MJ. When it restarted, and what it counted before, no
    # reading says: the interval's energy is unknown, for the GPU, its holder and its idle time,
    # as for a GPU without a counter. The next interval counts from the restarted reading:
    # 3,000 J to 21,000 J, 18,000 J, all ann's. Dollars stay as they were: $3.60/h x 15 s = $0.015.
    before = DeviceReading(index=0, uuid="G", name="x", up=True, energy_j=5_000_000.0)
    restarted = replace(before, energy_j=3_000.0)
    later = replace(before, energy_j=21_000.0)
    node = NodeInfo("n")
    attribution = Attribution(holdings=(Holding("G", Workload(user="ann"), sm_util=0.5),))
    prices = {"G": Price(3.6, "t")}
    reset = account(
        Snapshot(0.0, node, (before,)), Snapshot(15.0, node, (restarted,)), attribution, prices,
        max_interval_s=MAX_INTERVAL_S, energy_per_kwh=0.12,
    )  # fmt: skip
    [gpu], [ann] = reset.gpus, reset.workloads
    assert (gpu.joules, gpu.idle_joules, gpu.energy_dollars) == (None, None, None)
    assert (ann.joules, ann.energy_dollars) == (None, None)
    assert ann.dollars == pytest.approx(0.015)
    after = account(
        Snapshot(15.0, node, (restarted,)), Snapshot(30.0, node, (later,)), attribution, prices,
        max_interval_s=MAX_INTERVAL_S,
    )  # fmt: skip
    assert (after.gpus[0].joules, after.workloads[0].joules) == (pytest.approx(18_000.0), pytest.approx(18_000.0))
    totals = accumulate(accumulate(CostTotals(), reset, forget_after_s=1e9), after, forget_after_s=1e9)
    assert totals.gpus[(0, "G")].joules == pytest.approx(18_000.0)  # the measured interval only


def test_finished_workloads_are_forgotten_after_the_horizon() -> None:
    prev = Snapshot(0.0, NodeInfo("n"), (DeviceReading(index=0, uuid="G", name="x", up=True),))
    curr = Snapshot(10.0, NodeInfo("n"), prev.devices)
    attribution = Attribution(holdings=(Holding("G", Workload(hpc_job="1"), sm_util=1.0),))
    charges = account(prev, curr, attribution, {"G": Price(36.0, "t")}, max_interval_s=60)
    totals = accumulate(CostTotals(), charges, forget_after_s=100)
    assert totals.workloads[(0, "G", Workload(hpc_job="1"))].dollars == pytest.approx(0.1)  # 36 $/h x 10 s
    later = account(
        Snapshot(200.0, NodeInfo("n"), prev.devices),
        Snapshot(210.0, NodeInfo("n"), prev.devices),
        Attribution(),
        {"G": Price(36.0, "t")},
        max_interval_s=60,
    )
    totals = accumulate(totals, later, forget_after_s=100)
    assert totals.workloads == {}
    assert totals.gpus[(0, "G")].dollars == pytest.approx(0.2)


# -- hand-computed scenarios, through the fake node and the whole pipeline ------------------------

PRICE = 3.6  # $/GPU-hour: $0.001 a second, which keeps the arithmetic readable


@pytest.fixture
def simulate() -> Iterator[Any]:
    rigs: list[Rig] = []

    def run(scenario: dict[str, Any], duration_s: float, step_s: float, prices: Any = None, **costing: Any) -> Any:
        price_of = prices or (lambda snapshot: {g.uuid: Price(PRICE, "test") for g in snapshot.gpus})
        rig = Rig(scenario, costing=Costing(prices=price_of, **costing))
        rigs.append(rig)
        return rig.run(duration_s, step_s)

    yield run
    for rig in rigs:
        rig.close()


def dollars_by_workload(state: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for (_gpu, _uuid, workload), totals in state.costs.workloads.items():
        out[workload.describe()] = out.get(workload.describe(), 0.0) + totals.dollars
    return out


def idle_dollars(state: Any) -> float:
    return sum(g.idle_dollars for g in state.costs.gpus.values())


def test_a_shared_gpu_splits_60_20_by_measured_sm_use(simulate: Any) -> None:
    state = simulate(
        {
            "gpus": [{"count": 1}],
            "processes": [
                {"pid": 1, "gpus": [0], "sm_util": 60, "memory_mib": 1000, "user": "ann", "uid": 1001},
                {"pid": 2, "gpus": [0], "sm_util": 20, "memory_mib": 9000, "user": "bob", "uid": 1002},
            ],
        },
        duration_s=3600,
        step_s=15,
    )
    # One hour of one GPU at $3.60/h = $3.60, split 60:20 by SM use (memory does not matter):
    #   ann 3.60 x 60/80 = $2.70, bob 3.60 x 20/80 = $0.90; nothing idle.
    assert dollars_by_workload(state) == pytest.approx({"user ann": 2.70, "user bob": 0.90})
    assert idle_dollars(state) == pytest.approx(0.0)
    busy = {w.user: t.busy_s for (_g, _u, w), t in state.costs.workloads.items()}
    assert busy == pytest.approx({"ann": 0.60 * 3600, "bob": 0.20 * 3600})  # held 3600 s each
    # Each held the GPU the whole hour, but the hour is charged once, split like the dollars:
    #   ann 3600 x 60/80 = 2700 s, bob 3600 x 20/80 = 900 s; together the GPU's 3600 s.
    charged = {w.user: t.charged_s for (_g, _u, w), t in state.costs.workloads.items()}
    assert charged == pytest.approx({"ann": 2700, "bob": 900})
    held = {w.user: t.held_s for (_g, _u, w), t in state.costs.workloads.items()}
    assert held == pytest.approx({"ann": 3600, "bob": 3600})


def test_a_notebook_holding_an_idle_gpu_pays_for_it_all(simulate: Any) -> None:
    state = simulate(
        {
            "gpus": [{"count": 2}],
            "allocations": [{"gpus": [0], "pod": {"namespace": "lab", "name": "nb-1", "container": "jupyter"}}],
        },
        duration_s=7200,
        step_s=60,
    )
    # GPU 0 is allocated to the notebook, which runs nothing for 2 h: its waste, not idle cost:
    #   nb-1 pays 2 h x $3.60 = $7.20 with 0 busy seconds.
    # GPU 1 nobody holds: 2 h x $3.60 = $7.20 of idle cost.
    assert dollars_by_workload(state) == pytest.approx({"lab/nb-1": 7.20})
    assert idle_dollars(state) == pytest.approx(7.20)
    (totals,) = state.costs.workloads.values()
    assert (totals.held_s, totals.busy_s) == (7200, 0)
    assert totals.charged_s == pytest.approx(7200)  # the sole holder: its share is the whole GPU


def test_a_job_whose_process_ran_between_polls_used_what_the_gpu_did(simulate: Any) -> None:
    job = {"slurm_job": "9911", "user": "erin"}
    state = simulate(
        {
            "gpus": [{"count": 1}],
            "processes": [{"pid": 1, "gpus": [0], "sm_util": 100, "uid": 1005, "start": "610s", "end": "640s", **job}],
            "allocations": [{"gpus": [0], **job}],
        },
        duration_s=3600,
        step_s=60,
    )
    # Job 9911 holds GPU 0 by its allocation all hour: 1 h x $3.60 = $3.60, nothing idle. Its one
    # process ran at 100% from 610 s to 640 s, between the polls at 600 s and 660 s, so no poll
    # saw it; the GPU's own samples did: 30 busy seconds. The job, the sole holder, used them
    # (it read 0 busy seconds, all $3.60 waste, when its allocation's 0 at the poll stood for
    # the interval): waste = 3.60 x (1 - 30/3600) = $3.57.
    (totals,) = state.costs.workloads.values()
    assert totals.dollars == pytest.approx(3.60)
    assert idle_dollars(state) == pytest.approx(0.0)
    (gpu,) = state.costs.gpus.values()
    assert gpu.busy_s == pytest.approx(30.0)
    assert totals.busy_s == pytest.approx(30.0)
    assert totals.dollars * (1 - totals.busy_s / totals.charged_s) == pytest.approx(3.57)
    assert gpu.dollars + gpu.unobserved_dollars == pytest.approx(3.60)  # price x time, all of it


@pytest.mark.parametrize("per_pid", [False, True])
def test_per_pid_series_split_and_measure_as_one_holding_per_workload(per_pid: bool) -> None:
    def hour(scenario: dict[str, Any]) -> dict[str, tuple[float, float]]:
        """Each workload's (dollars, busy seconds) over an hour polled every minute."""
        prices = Costing(prices=lambda snapshot: {g.uuid: Price(PRICE, "test") for g in snapshot.gpus})
        rig = Rig(scenario, per_pid=per_pid, costing=prices)
        try:
            state = rig.run(3600, 60)
        finally:
            rig.close()
        assert math.fsum(t.dollars for t in state.costs.workloads.values()) + idle_dollars(state) == pytest.approx(
            PRICE * len(state.costs.gpus)
        )  # an hour of each GPU, all of it
        found: dict[str, tuple[float, float]] = {}
        for (_g, _u, w), t in state.costs.workloads.items():
            dollars, busy = found.get(w.user, (0.0, 0.0))
            found[w.user] = (dollars + t.dollars, busy + t.busy_s)
        return found

    def proc(pid: int, user: str, uid: int, sm_util: int, memory_mib: int) -> dict[str, Any]:
        return {"pid": pid, "gpus": [0], "sm_util": sm_util, "memory_mib": memory_mib, "user": user, "uid": uid}

    # Nothing measured (0% leaves no samples) and no memory held: equal shares per workload,
    # whatever its processes: ann (two processes) and bob (one) $3.60 / 2 = $1.80 each, not
    # $2.40 and $1.20 as with one share per process.
    idle = hour({"gpus": [{"count": 1}], "processes": [proc(1, "ann", 1001, 0, 0), proc(2, "ann", 1001, 0, 0),
                                                       proc(3, "bob", 1002, 0, 0)]})  # fmt: skip
    assert idle == {"ann": (pytest.approx(1.80), 0.0), "bob": (pytest.approx(1.80), 0.0)}
    # No per-process utilization: ann, the sole holder, is as busy as the GPU (30% + 20% = 50%
    # of 3600 s = 1800 busy seconds) however many processes she runs, and pays the $3.60.
    unmeasured = hour(
        {
            "gpus": [{"count": 1}],
            "processes": [proc(1, "ann", 1001, 30, 100), proc(2, "ann", 1001, 20, 300)],
            "faults": [{"gpu": 0, "call": "nvmlDeviceGetProcessUtilization", "error": "NOT_SUPPORTED"}],
        }
    )
    assert unmeasured == {"ann": (pytest.approx(3.60), pytest.approx(1800.0))}


def test_mig_3g_3g_instances_pay_their_sm_share(simulate: Any) -> None:
    state = simulate(
        {
            "gpus": [{"model": "A100-SXM4-80GB", "mig": ["3g.40gb", "3g.40gb"]}],
            "processes": [
                {"pid": 1, "gpus": ["0:0"], "sm_util": 70, "memory_mib": 2000, "user": "ann", "uid": 1001},
                {"pid": 2, "gpus": ["0:1"], "sm_util": 5, "memory_mib": 2000, "user": "bob", "uid": 1002},
            ],
        },
        duration_s=3600,
        step_s=30,
    )
    # An A100 has 108 SMs; a 3g.40gb instance has 42 (3 slices x 14). Over one hour at $3.60:
    #   each instance holder pays 3.60 x 42/108 = $1.40, however busy (MIG cannot measure use);
    #   the 24 SMs the layout leaves unassigned are idle: 3.60 x 24/108 = $0.80.
    assert dollars_by_workload(state) == pytest.approx({"user ann": 1.40, "user bob": 1.40})
    assert idle_dollars(state) == pytest.approx(0.80)
    held = {w.user: t.held_s for (_g, _u, w), t in state.costs.workloads.items()}
    assert held == pytest.approx({"ann": 3600 * 42 / 108, "bob": 3600 * 42 / 108})


def test_a_price_override_changes_only_its_gpu(simulate: Any) -> None:
    def prices(snapshot: Snapshot) -> dict[str, Price | None]:
        # As if pricing.by_uuid gave GPU 1 its own price.
        return {g.uuid: Price(7.2 if g.index == 1 else PRICE, "test") for g in snapshot.gpus}

    state = simulate(
        {
            "gpus": [{"count": 2}],
            "processes": [{"pid": 1, "gpus": [0, 1], "sm_util": 50, "memory_mib": 10, "user": "ann", "uid": 1001}],
        },
        duration_s=1800,
        step_s=15,
        prices=prices,
    )
    # ann holds both GPUs for half an hour: GPU 0 at $3.60/h -> $1.80, GPU 1 at $7.20/h -> $3.60.
    per_gpu = {gpu: t.dollars for (gpu, _u, _w), t in state.costs.workloads.items()}
    assert per_gpu == pytest.approx({0: 1.80, 1: 3.60})
    assert idle_dollars(state) == 0


def test_an_agent_gap_is_unobserved_and_charged_to_nobody() -> None:
    rig = Rig(
        {"gpus": [{"count": 1}], "processes": [{"pid": 1, "gpus": [0], "sm_util": 90, "user": "ann", "uid": 1001}]},
        costing=Costing(prices=lambda s: {g.uuid: Price(PRICE, "test") for g in s.gpus}, max_interval_s=120),
    )
    try:
        rig.run(600, 60)  # 10 min observed: ann pays 600 s x $0.001 = $0.60
        rig.poll(3600)  # the agent was stopped for an hour: nobody pays for it
        state = rig.run(600, 60)  # 10 more minutes observed: $0.60 more
    finally:
        rig.close()
    assert dollars_by_workload(state) == pytest.approx({"user ann": 1.20})
    (gpu,) = state.costs.gpus.values()
    assert gpu.unobserved_s == 3600
    assert gpu.unobserved_dollars == pytest.approx(3.60)  # an hour at $3.60/h, charged to nobody
    assert gpu.observed_s == 1200
    assert gpu.dollars == pytest.approx(1.20)


def test_cost_metrics_are_exported_and_add_up(simulate: Any) -> None:
    state = simulate(
        {
            "gpus": [{"count": 2}],
            "processes": [{"pid": 1, "gpus": [0], "sm_util": 40, "memory_mib": 10, "user": "ann", "uid": 1001}],
        },
        duration_s=600,
        step_s=15,
        energy_per_kwh=0.12,
    )
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from exporters.prometheus import make_registry

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(make_registry(lambda: state)).decode()):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    total = values["gpuledger_gpu_cost_dollars_total"]
    assert total == pytest.approx(2 * 600 * 0.001)
    assert values["gpuledger_workload_cost_dollars_total"] + values["gpuledger_gpu_idle_cost_dollars_total"] == (
        pytest.approx(total)
    )
    assert values["gpuledger_gpu_price_dollars_per_hour"] == pytest.approx(2 * PRICE)
    # ann's 600 s on GPU 0 plus GPU 1's 600 idle seconds: both GPUs' observed time, 2 x 600 s.
    charged = values["gpuledger_workload_gpu_charged_seconds_total"] + values["gpuledger_gpu_idle_seconds_total"]
    assert charged == pytest.approx(2 * 600)
    assert values["gpuledger_gpu_observed_seconds_total"] == pytest.approx(2 * 600)
    joules = values["gpuledger_gpu_energy_joules_total"]  # the driver counters themselves
    assert values["gpuledger_workload_energy_cost_dollars_total"] + 0 > 0
    assert joules > 0
    fake_nvml.uninstall()


# -- conservation, through the whole pipeline on random fake nodes --------------------------------


@st.composite
def random_node(draw: st.DrawFn) -> tuple[dict[str, Any], list[float]]:
    """A random fake node: whole and MIG GPUs, processes coming and going, shared GPUs,
    allocations without processes; and the gaps between polls, some too long to charge."""
    gpus: list[dict[str, Any]] = []
    refs: list[str] = []
    for i in range(draw(st.integers(1, 3))):
        layout = draw(st.sampled_from([[], [], ["3g.40gb", "3g.40gb"], ["1g.10gb", "2g.20gb", "4g.40gb"]]))
        gpus.append({"model": "A100-SXM4-80GB", "mig": layout} if layout else {"model": "A100-SXM4-80GB"})
        refs += [f"{i}:{m}" for m in range(len(layout))] if layout else [str(i)]
    minutes = st.integers(0, 120).map(lambda m: f"{m}m")
    processes = []
    for pid in range(1, draw(st.integers(0, 5)) + 1):
        start = draw(st.integers(0, 100))
        processes.append(
            {
                "pid": 1000 + pid,
                "gpus": [draw(st.sampled_from(refs))],
                "start": f"{start}m",
                "end": f"{start + draw(st.integers(1, 60))}m",
                "sm_util": draw(st.integers(0, 100)),
                "memory_mib": draw(st.integers(0, 8000)),
                "uid": 1000 + draw(st.integers(0, 2)),
                "user": draw(st.sampled_from(["ann", "bob"])),
            }
        )
    allocations = [
        {"gpus": [draw(st.sampled_from(refs))], "slurm_job": str(job), "start": draw(minutes)}
        for job in range(draw(st.integers(0, 2)))
    ]
    gaps = draw(st.lists(st.sampled_from([15.0, 60.0, 60.0, 400.0]), min_size=3, max_size=40))
    return {"gpus": gpus, "processes": processes, "allocations": allocations}, gaps


@settings(max_examples=60, deadline=None)
@given(random_node())
def test_random_nodes_conserve_dollars_and_joules_through_the_pipeline(case: Any) -> None:
    scenario, gaps = case
    price = 2.5
    # Finished workloads must not be forgotten here: the totals are what is being added up.
    costing = Costing(prices=lambda s: {g.uuid: Price(price, "test") for g in s.gpus}, forget_after_s=1e9)
    rig = Rig(scenario, costing=costing)
    try:
        first = rig.poll()
        state = first
        for gap in gaps:
            state = rig.poll(gap)
    finally:
        rig.close()
    gpus = state.costs.gpus.values()
    observed = sum(g.observed_s for g in gpus)
    charged = sum(w.dollars for w in state.costs.workloads.values()) + sum(g.idle_dollars for g in gpus)
    assert charged == pytest.approx(price * observed / 3600, rel=1e-9, abs=1e-12)
    # The GPUs' joules are all their counters counted; the workloads' and idle joules are that
    # but for the gaps too long to charge, whose energy is nobody's (unobserved).
    assert first.snapshot is not None
    assert state.snapshot is not None
    pairs = zip(first.snapshot.gpus, state.snapshot.gpus, strict=True)
    counted = sum((b.energy_j or 0.0) - (a.energy_j or 0.0) for a, b in pairs)
    assert sum(g.joules for g in gpus) == pytest.approx(counted, rel=1e-9, abs=1e-6)
    joules = sum(w.joules for w in state.costs.workloads.values()) + sum(g.idle_joules for g in gpus)
    if all(gap <= MAX_INTERVAL_S for gap in gaps):
        assert joules == pytest.approx(counted, rel=1e-9, abs=1e-6)
    else:
        assert joules <= counted + 1e-6
    for g in gpus:
        assert g.observed_s + g.unobserved_s == pytest.approx(sum(gaps))
    for w in state.costs.workloads.values():
        assert w.held_s <= max(g.observed_s for g in gpus) + 1e-9
        assert 0 <= w.busy_s <= w.held_s + 1e-9
        assert 0 <= w.charged_s <= w.held_s + 1e-9
    for (index, uuid), g in state.costs.gpus.items():
        charged_s = sum(t.charged_s for (gpu, _u, _w), t in state.costs.workloads.items() if gpu == index)
        assert charged_s + g.idle_s == pytest.approx(g.observed_s, rel=1e-9, abs=1e-6), uuid
