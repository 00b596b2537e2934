"""GPU time into dollars and joules. Pure: two snapshots and an attribution in, charges out.

The arithmetic (PRODUCT.md, "Cost arithmetic"):
  - A cost unit is a whole GPU, or a MIG instance weighted by its share of the GPU's SMs; the
    SMs a MIG layout leaves unassigned form one more unit that nobody can hold.
  - Over the interval dt between two polls a unit costs price x weight x dt. Nobody holding it:
    all of that is idle cost. Otherwise it is split among its holders by measured SM
    utilization; where none was measured, by memory held; where neither, equally.
  - Held seconds are weight x dt; busy seconds are held seconds x the holder's utilization.
  - Energy comes from the GPU's own energy counter (not integrated power), split like cost.
    With a price per kWh it becomes dollars here, once (`energy_dollars`): /metrics, the ledger
    and `report` all show sums of these figures, so they cannot disagree.
  - An interval longer than `max_interval_s` is charged to nobody: it is unobserved time.
The interval is described by the later poll: its per-process utilization is the mean of the
driver's samples since the earlier poll, and its holders are those seen at its end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agent.model import (
    Attribution,
    Charges,
    CostTotals,
    DeviceReading,
    GpuCharge,
    GpuTotals,
    Holding,
    Price,
    Snapshot,
    Workload,
    WorkloadCharge,
    WorkloadTotals,
)
from agent.units import joules_to_kwh


@dataclass(frozen=True, slots=True)
class CostUnit:
    gpu: DeviceReading  # the physical GPU
    uuid: str  # the unit: the GPU's own uuid, a MIG instance's, or "" for unassigned SMs
    weight: float
    device: DeviceReading | None  # the unit's own reading (None for unassigned SMs)


def cost_units(snapshot: Snapshot, gpu: DeviceReading) -> list[CostUnit]:
    migs = snapshot.mig_devices(gpu.uuid)
    if not migs:
        return [CostUnit(gpu, gpu.uuid, 1.0, gpu)]
    if gpu.sm_count and all(m.sm_count for m in migs):
        weights = [(m.sm_count or 0) / gpu.sm_count for m in migs]
        total = sum(weights)
        if total > 1.0:  # SM counts that add up to more than the GPU: trust the proportions only
            weights = [w / total for w in weights]
    else:
        weights = [1.0 / len(migs)] * len(migs)  # SM counts unknown: instances share equally
    units = [CostUnit(gpu, m.uuid, w, m) for m, w in zip(migs, weights, strict=True)]
    unassigned = 1.0 - sum(weights)
    if unassigned > 1e-12:
        units.append(CostUnit(gpu, "", unassigned, None))
    return units


def holder_utilization(holding: Holding, unit: CostUnit, holders: int) -> float | None:
    """The holder's measured share of the unit's SMs; None when the device cannot tell."""
    if holding.sm_util is not None:
        return holding.sm_util
    if holders == 1 and unit.device is not None and unit.device.utilization is not None:
        return unit.device.utilization  # a sole holder of a GPU that measures only as a whole
    return None


def split_shares(holdings: tuple[Holding, ...], utils: list[float | None]) -> list[float]:
    """Fractions summing to 1: by measured SM use, else by memory held, else equally."""
    measured = sum(u for u in utils if u is not None)
    if measured > 0:
        return [(u or 0.0) / measured for u in utils]
    memory = [h.memory_bytes or 0 for h in holdings]
    total_memory = sum(memory)
    if total_memory > 0:
        return [m / total_memory for m in memory]
    return [1.0 / len(holdings)] * len(holdings)


def energy_dollars(joules: float, per_kwh: float | None) -> float | None:
    """What `joules` cost at `per_kwh` dollars per kWh; None where no energy price is set."""
    return None if per_kwh is None else joules_to_kwh(joules) * per_kwh


def _energy_delta(prev: DeviceReading | None, curr: DeviceReading) -> float:
    if prev is None or prev.energy_j is None or curr.energy_j is None:
        return 0.0
    delta = curr.energy_j - prev.energy_j
    return delta if delta >= 0 else 0.0  # the counter restarts with the driver: skip, never go negative


@dataclass
class _Acc:
    held_s: float = 0.0
    busy_s: float = 0.0
    dollars: float = 0.0
    joules: float = 0.0


def account(
    prev: Snapshot,
    curr: Snapshot,
    attribution: Attribution,
    prices: Mapping[str, Price | None],
    *,
    max_interval_s: float,
    energy_per_kwh: float | None = None,
) -> Charges:
    """Charges for the interval (prev.taken_at, curr.taken_at]. `prices` is keyed by GPU uuid;
    with `energy_per_kwh` every charge's joules are priced too."""
    dt = curr.taken_at - prev.taken_at
    charges = Charges(start=prev.taken_at, end=curr.taken_at, node=curr.node.hostname, energy_per_kwh=energy_per_kwh)
    if dt <= 0:
        return charges
    previous = {d.uuid: d for d in prev.gpus}
    # Each unit's holders, in attribution order (`Attribution.for_device`, found in one pass).
    holders_of: dict[str, list[Holding]] = {}
    for h in attribution.holdings:
        holders_of.setdefault(h.device_uuid, []).append(h)
    workloads: dict[tuple[int, str, Workload], _Acc] = {}
    gpus: list[GpuCharge] = []
    for gpu in curr.gpus:
        price = prices.get(gpu.uuid)
        hourly = price.dollars_per_hour if price is not None else 0.0
        if dt > max_interval_s:
            gpus.append(
                GpuCharge(
                    gpu=gpu.index,
                    uuid=gpu.uuid,
                    model=gpu.model,
                    dollars_per_hour=hourly,
                    observed_s=0.0,
                    dollars=0.0,
                    idle_s=0.0,
                    idle_dollars=0.0,
                    unobserved_s=dt,
                    joules=0.0,
                    idle_joules=0.0,
                    unobserved_dollars=hourly * dt / 3600,
                    energy_dollars=energy_dollars(0.0, energy_per_kwh),
                    idle_energy_dollars=energy_dollars(0.0, energy_per_kwh),
                )
            )
            continue
        gpu_dollars = hourly * dt / 3600
        gpu_joules = _energy_delta(previous.get(gpu.uuid), gpu) if gpu.up else 0.0
        idle_s = idle_dollars = idle_joules = 0.0
        for unit in cost_units(curr, gpu):
            unit_dollars = gpu_dollars * unit.weight
            unit_joules = gpu_joules * unit.weight
            holders = tuple(holders_of.get(unit.uuid, ())) if gpu.up and unit.uuid else ()
            if not holders:
                idle_s += dt * unit.weight
                idle_dollars += unit_dollars
                idle_joules += unit_joules
                continue
            utils = [holder_utilization(h, unit, len(holders)) for h in holders]
            for holding, share, util in zip(holders, split_shares(holders, utils), utils, strict=True):
                acc = workloads.setdefault((gpu.index, unit.uuid, holding.workload), _Acc())
                held = dt * unit.weight
                # Per-pid holdings of one workload each held the unit: count its time once.
                acc.held_s = max(acc.held_s, held)
                acc.busy_s += held * min(util or 0.0, 1.0)
                acc.dollars += unit_dollars * share
                acc.joules += unit_joules * share
        gpus.append(
            GpuCharge(
                gpu=gpu.index,
                uuid=gpu.uuid,
                model=gpu.model,
                dollars_per_hour=hourly,
                observed_s=dt,
                dollars=gpu_dollars,
                idle_s=idle_s,
                idle_dollars=idle_dollars,
                unobserved_s=0.0,
                joules=gpu_joules,
                idle_joules=idle_joules,
                energy_dollars=energy_dollars(gpu_joules, energy_per_kwh),
                idle_energy_dollars=energy_dollars(idle_joules, energy_per_kwh),
            )
        )
    return Charges(
        start=charges.start,
        end=charges.end,
        node=charges.node,
        energy_per_kwh=energy_per_kwh,
        workloads=tuple(
            WorkloadCharge(
                gpu=gpu,
                uuid=uuid,
                workload=workload,
                held_s=acc.held_s,
                busy_s=acc.busy_s,
                dollars=acc.dollars,
                joules=acc.joules,
                energy_dollars=energy_dollars(acc.joules, energy_per_kwh),
            )
            for (gpu, uuid, workload), acc in workloads.items()
        ),
        gpus=tuple(gpus),
    )


_NO_WORKLOAD_TOTALS = WorkloadTotals()
_NO_GPU_TOTALS = GpuTotals()


def accumulate(totals: CostTotals, charges: Charges, *, forget_after_s: float) -> CostTotals:
    """Totals plus one interval's charges. A workload not charged for `forget_after_s` is
    dropped, so finished jobs do not keep series alive forever (their dollars stay in the
    ledger and in Prometheus's history).

    Energy dollars are the running joules priced by `energy_dollars` at the charges' price (one
    price per agent run): the sum of the charges' own energy dollars, to rounding, without the
    rounding of thousands of small additions."""
    per_kwh = charges.energy_per_kwh
    workloads = dict(totals.workloads)
    for c in charges.workloads:
        key = (c.gpu, c.uuid, c.workload)
        old = workloads.get(key, _NO_WORKLOAD_TOTALS)
        joules = old.joules + c.joules
        workloads[key] = WorkloadTotals(
            held_s=old.held_s + c.held_s,
            busy_s=old.busy_s + c.busy_s,
            dollars=old.dollars + c.dollars,
            joules=joules,
            last_charged_at=charges.end,
            energy_dollars=energy_dollars(joules, per_kwh),
        )
    horizon = charges.end - forget_after_s
    workloads = {k: v for k, v in workloads.items() if v.last_charged_at >= horizon}
    gpus = dict(totals.gpus)
    for g in charges.gpus:
        old_gpu = gpus.get((g.gpu, g.uuid), _NO_GPU_TOTALS)
        gpu_joules, idle_joules = old_gpu.joules + g.joules, old_gpu.idle_joules + g.idle_joules
        gpus[(g.gpu, g.uuid)] = GpuTotals(
            dollars=old_gpu.dollars + g.dollars,
            idle_dollars=old_gpu.idle_dollars + g.idle_dollars,
            idle_s=old_gpu.idle_s + g.idle_s,
            observed_s=old_gpu.observed_s + g.observed_s,
            unobserved_s=old_gpu.unobserved_s + g.unobserved_s,
            joules=gpu_joules,
            idle_joules=idle_joules,
            unobserved_dollars=old_gpu.unobserved_dollars + g.unobserved_dollars,
            energy_dollars=energy_dollars(gpu_joules, per_kwh),
            idle_energy_dollars=energy_dollars(idle_joules, per_kwh),
        )
    return CostTotals(workloads, gpus)
