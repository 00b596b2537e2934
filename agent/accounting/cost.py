"""GPU time into dollars and joules. Pure: two snapshots and an attribution in, charges out.

The arithmetic (PRODUCT.md, "Cost arithmetic"):
  - A cost unit is a whole GPU, or a MIG instance weighted by its share of the GPU's SMs; the
    SMs a MIG layout leaves unassigned form one more unit that nobody can hold.
  - Over the interval dt between two polls a unit costs price x weight x dt. Nobody holding it:
    all of that is idle cost. Otherwise it is split among its holders by measured SM
    utilization; where none was measured, by memory held; where neither, equally.
  - Held seconds are weight x dt; busy seconds are held seconds x the holder's utilization
    (where nothing measured it, the charged seconds are `unmeasured_s` instead: unknown use),
    and a unit's holders' busy seconds never add up to more than the GPU's own (its utilization
    averaged over its samples of the interval x dt): where they would, each is scaled down. Where
    the unit's busy source is GPM (`DeviceReading.busy_source`), its SM activity is how busy it
    was, split among its holders by the shares that split its cost: a kernel that keeps one SM
    busy is not a full GPU, whatever NVML's utilization says.
    Charged seconds are held seconds x the holder's share (the share that splits the dollars):
    a unit's charged seconds plus its idle seconds are its observed seconds, so they add up
    across holders where held seconds count a shared unit once per holder.
  - Energy comes from the GPU's own energy counter (not integrated power), split like cost.
    With a price per kWh it becomes dollars here, once (`energy_dollars`): /metrics, the ledger
    and `report` all show sums of these figures, so they cannot disagree.
  - Time is a partition: each unit-second is charged to workloads, idle (observed, held by
    nobody) or unobserved (charged to nobody, with the reason): the interval was longer than
    `max_interval_s` (no poll: the agent stopped, the node slept), the GPU could not be read at
    either end (its NVML error: GPU_IS_LOST, TIMEOUT, ...), the unit's process list failed
    and no allocation names a holder, or nobody runs on it and its allocations cannot be known
    (attribution_unavailable: the kubelet unreachable past attribution.kubelet_stale_after).
    Charged + idle + unobserved = price x weight x dt.
  - Boundaries (`agent.accounting.boundaries`): a holder at both polls held the whole
    interval; one gone by the later poll held its first half; one new at the later poll held it
    from its start where that is known (process or allocation start), else from the midpoint.
    Idle stretches carry who left the unit idle (`IdleCharge.left_by`).
The interval's per-process utilization is the mean of the driver's samples since the earlier
poll (read at the later one), its holders those seen at its two ends.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import TypeVar

from agent.accounting.boundaries import stretches
from agent.model import (
    BUSY_GPM,
    BUSY_NVML,
    UNOBSERVED_ATTRIBUTION,
    UNOBSERVED_NO_POLL,
    UNOBSERVED_PROCESSES,
    UNOBSERVED_UNREADABLE,
    Attribution,
    Charges,
    CostTotals,
    DeviceReading,
    GpuCharge,
    GpuTotals,
    Holding,
    IdleCharge,
    IdleTotals,
    Price,
    Snapshot,
    Workload,
    WorkloadCharge,
    WorkloadTotals,
)
from agent.units import add_known, joules_to_kwh, scaled

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

# Past this many keys a `Recent` starts over: workloads come and go, and each keeps one entry.
RECENT_LIMIT = 4096


def check_fields(made: type, *names: str) -> None:
    """Raise where the dataclass `made` does not have the fields `names`, in order: for code
    that makes it positionally (a keyword call costs twice as much through `_made_in_place`'s
    wrapper), so a field added or moved fails at import rather than shifting the figures."""
    if tuple(f.name for f in fields(made)) != names:
        raise TypeError(f"{made.__name__} has fields {[f.name for f in fields(made)]}, not {list(names)}")


class Recent(dict[K, tuple[tuple[object, ...], T]]):
    """The object last made for each key, and the fields it was made from, to hand it out again
    where a poll's figures are the last poll's.

    A steady node charges the same figures poll after poll: the same seconds, dollars and joules
    for each workload and GPU. Making a frozen dataclass costs about 0.7 us, several for one with
    many fields (each goes through object.__setattr__); comparing a tuple of its fields with the
    tuple it was made from last time costs a fraction of that. Equal fields make an equal object,
    so the one made last serves: floats that compare equal are the same float (but for the sign
    of a zero, which no charge carries: its sums start at +0.0), and a NaN never equals the last
    one, so it is made afresh."""

    def __init__(self, make: Callable[..., T], *names: str) -> None:
        """`make` takes `names`, in order, positionally: checked here against the dataclass's
        fields, so a field added or moved fails at import rather than shifting the figures."""
        super().__init__()
        if isinstance(make, type):
            check_fields(make, *names)
        self.make = make

    def get_or_make(self, key: K, values: tuple[object, ...]) -> T:
        """`make(*values)`, or the object made last for `key` where it was made from equal values."""
        last = self.get(key)
        if last is not None and last[0] == values:
            return last[1]
        made = self.make(*values)
        if len(self) >= RECENT_LIMIT:
            self.clear()
        self[key] = (values, made)
        return made


@dataclass(frozen=True, slots=True)
class CostUnit:
    gpu: DeviceReading  # the physical GPU
    uuid: str  # the unit: the GPU's own uuid, a MIG instance's, or "" for unassigned SMs
    weight: float
    device: DeviceReading | None  # the unit's own reading (None for unassigned SMs)


def cost_units(snapshot: Snapshot, gpu: DeviceReading, migs: tuple[DeviceReading, ...] | None = None) -> list[CostUnit]:
    """The GPU's cost units; `migs`, its MIG devices where the caller has them at hand."""
    if migs is None:
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


def device_busy_ratio(device: DeviceReading | None) -> float | None:
    """How busy the device was over the interval (0-1): its GPM SM activity where that is its busy
    source, else its utilization averaged over its own samples since the previous poll, else
    (those could not be read) its latest reading; None where it measures none."""
    if device is None:
        return None
    if device.busy_source == BUSY_GPM:
        return device.busy  # SM activity over the interval: GPM samples are interval means already
    return device.utilization_mean


def holder_utilization(
    holding: Holding, unit: CostUnit, holders: int, *, whole: bool = True, together: int = 1
) -> float | None:
    """The holder's measured share of the unit's SMs; None when the device cannot tell.

    `holders` counts the workloads holding the unit; `together`, a sole workload's holdings (one
    per process with per-pid series), which share what the unit measured of it.

    An allocation with no process at the poll reads 0 (`agent.attribution.resolve`): what it
    uses at that moment, not over the interval, as its job's processes may have run and ended
    between the polls. Where it held the unit alone all the interval (`whole`: the stretch is
    the whole interval), the unit's use is its own, as any sole holder's without samples."""
    runs_nothing = holding.allocated and not holding.pids
    if holding.sm_util is not None and not (runs_nothing and holders == 1 and whole):
        return holding.sm_util
    if holders == 1:
        ratio = device_busy_ratio(unit.device)  # a sole holder of a GPU that measures only as a whole
        return None if ratio is None else ratio / together
    return None


def holder_busy(unit: CostUnit, util: float | None, share: float) -> float | None:
    """How busy (0-1) a holder kept the unit: the unit's SM activity x the holder's share where
    its busy source is GPM; the holder's measured utilization where it is NVML. None where that
    was not measured: the unit has no busy measure (busy_source gpm on a GPU without GPM, or a MIG
    instance without it), its SM activity has no figure this poll, or the holder's share of the
    unit's use cannot be told. Unknown use is not idleness: it is no busy seconds and no waste."""
    device = unit.device
    source = device.busy_source if device is not None else ""
    if source == BUSY_GPM:
        busy = device.busy if device is not None else None
        return None if busy is None else min(busy, 1.0) * share
    if source == BUSY_NVML and util is not None:
        return min(util, 1.0)
    return None


def split_shares(holdings: tuple[Holding, ...], utils: list[float | None]) -> list[float]:
    """Fractions summing to 1: by measured SM use, else by memory held, else equally among the
    workloads (a workload's holdings, one per process with per-pid series, share its part)."""
    measured = sum(u for u in utils if u is not None)
    if measured > 0:
        return [(u or 0.0) / measured for u in utils]
    memory = [h.memory_bytes or 0 for h in holdings]
    total_memory = sum(memory)
    if total_memory > 0:
        return [m / total_memory for m in memory]
    per_workload = Counter(h.workload for h in holdings)
    return [1.0 / len(per_workload) / per_workload[h.workload] for h in holdings]


def energy_dollars(joules: float | None, per_kwh: float | None) -> float | None:
    """What `joules` cost at `per_kwh` dollars per kWh; None where no energy price is set or no
    counter measured the joules."""
    return None if per_kwh is None or joules is None else joules_to_kwh(joules) * per_kwh


def _charge(
    workloads: dict[tuple[int, str, Workload], _Acc],
    gpu_index: int,
    unit: CostUnit,
    holders: tuple[Holding, ...],
    util_scales: tuple[float, ...] | None,
    held: float,
    dollars: float,
    joules: float | None,
    *,
    whole: bool,
) -> None:
    """`held` unit-seconds costing `dollars` and `joules`, split among `holders`; `util_scales`,
    each holder's `Part.util_scale` (None: 1 for all, as for holders of the whole interval);
    `whole`: they held the unit all the interval."""
    together = len(holders)
    count = 1 if together == 1 else len({h.workload for h in holders})
    utils = [holder_utilization(h, unit, count, whole=whole, together=together) for h in holders]
    # Each holder's utilization over its own part of the interval (see Part.util_scale); a
    # scale of 1 is left out, x 1.0 being the same float.
    if util_scales is None:
        utils = [None if u is None else min(u, 1.0) for u in utils]
    else:
        utils = [None if u is None else min(u * k, 1.0) for u, k in zip(utils, util_scales, strict=True)]
    # A sole holding's share is all of it: split_shares gives one holding 1.0 by every rule
    # (u / u, m / m, 1 / 1), so it is not asked (this runs for nearly every unit, every poll).
    shares = _SOLE_SHARE if together == 1 else split_shares(holders, utils)
    uuid = unit.uuid
    seen: dict[Workload, float] = {}
    for holding, share, util in zip(holders, shares, utils, strict=True):
        workload = holding.workload
        acc = workloads.setdefault((gpu_index, uuid, workload), _Acc())
        acc.account = acc.account or holding.account
        # Per-pid holdings of one workload each held the unit: count its time once (per part).
        # (A sole holding needs no count, and so no lookups: a Workload hashes in a Python call.)
        counted = seen.get(workload, 0.0) if seen else 0.0
        if held > counted:
            acc.held_s += held - counted
            if together > 1:
                seen[workload] = held
        busy = holder_busy(unit, util, share)
        # Summed, unlike held: each of a workload's holdings is its own part of the share.
        acc.charged_s += held * share
        if busy is None:
            acc.unmeasured_s += held * share
        else:
            acc.busy_s += held * busy
        acc.dollars += dollars * share
        if joules is not None:  # add_known(acc.joules, scaled(joules, share)), inline
            acc.joules = joules * share if acc.joules is None else acc.joules + joules * share


_SOLE_SHARE = (1.0,)


# The charges made at the last poll, made again only where their figures changed (`Recent`):
# positional, in the order of the dataclasses' fields (checked at import).
_WORKLOAD_CHARGES: Recent[tuple[int, str, Workload], WorkloadCharge] = Recent(
    WorkloadCharge, "gpu", "uuid", "workload", "held_s", "busy_s", "dollars", "joules", "energy_dollars", "charged_s",
    "account", "unmeasured_s",
)  # fmt: skip
_GPU_CHARGES: Recent[str, GpuCharge] = Recent(
    GpuCharge, "gpu", "uuid", "model", "dollars_per_hour", "observed_s", "dollars", "idle_s", "idle_dollars",
    "unobserved_s", "joules", "idle_joules", "unobserved_dollars", "energy_dollars", "idle_energy_dollars",
    "unobserved_reason", "idle_by", "busy_s", "purchase", "price_source",
)  # fmt: skip
_IDLE_CHARGES: Recent[tuple[str, Workload], IdleCharge] = Recent(
    IdleCharge, "left_by", "idle_s", "idle_dollars", "idle_joules", "idle_energy_dollars"
)


def _first(item: tuple[Workload, _IdleSums]) -> Workload:
    return item[0]


class _HeldByDevice:
    """`Attribution.by_device()`, worked out once per attribution: a poll's attribution is asked
    again by `unit_usage`, and as the next poll's earlier one (the last two are kept). Callers
    must not change the dict."""

    def __init__(self) -> None:
        self._recent: tuple[tuple[Attribution, dict[str, tuple[Holding, ...]]], ...] = ()

    def __call__(self, attribution: Attribution) -> dict[str, tuple[Holding, ...]]:
        recent = self._recent  # read once: another thread may replace it meanwhile
        for known, found in recent:
            if known is attribution:
                return found
        found = attribution.by_device()
        self._recent = (*recent[-1:], (attribution, found))
        return found


held_by_device = _HeldByDevice()


def _by_index(index: int) -> str:
    """The key an undiscovered GPU's previous reading is also found by (no uuid looks like it)."""
    return f"#{index}"


def _unobserved(prev: DeviceReading | None, curr: DeviceReading, dt: float, max_interval_s: float) -> str | None:
    """Why the whole GPU goes unobserved over the interval, or None when it was observed: polls
    too far apart, or the GPU unreadable at either end (what it did in between is unknown)."""
    if dt > max_interval_s:
        return UNOBSERVED_NO_POLL
    if not curr.up:
        return curr.down_reason or UNOBSERVED_UNREADABLE
    if prev is None or not prev.up:
        return (prev.down_reason if prev is not None else None) or UNOBSERVED_UNREADABLE
    return None


def _energy_delta(
    prev: DeviceReading | None, curr: DeviceReading, start: float, end: float, last_known: LastEnergy | None
) -> tuple[float, float] | tuple[None, None]:
    """(joules, of which the interval's holders') since the previous reading of the counter:
    the interval's start (`start`, to `end`), or, where the counter could not be read then, the
    last time it could (`last_known`). The counter kept counting over such a gap; where the gap
    held unobserved time (nobody saw who used the GPU), that time's share of it, pro rata by
    time (the gap's mean power), is nobody's: the holders are charged the rest. (None, None)
    where the counter measured nothing: the GPU has none, or it has not been read at both ends
    (its energy is unknown, not 0; a later reading counts the gap), or it went backwards: it
    restarts from 0 when the driver reloads or the GPU resets, at a moment no reading tells, so
    the interval's energy is unknown too (0 J would read as measured)."""
    if curr.energy_j is None:
        return None, None
    if prev is not None and prev.energy_j is not None:
        delta = curr.energy_j - prev.energy_j
        unseen_s = span_s = 0.0
    elif last_known is not None:
        delta = curr.energy_j - last_known.joules
        unseen_s, span_s = last_known.unobserved_s, end - last_known.at
    else:
        return None, None
    if delta < 0:
        return None, None
    if unseen_s <= 0 or span_s <= 0:
        return delta, delta
    return delta, delta * max(0.0, 1.0 - unseen_s / span_s)


@dataclass(frozen=True, slots=True)
class LastEnergy:
    """A GPU's last energy counter reading, for the polls that cannot read it: the joules, when
    (`at`), and how much of the time since was unobserved (`unobserved_s`)."""

    joules: float
    at: float
    unobserved_s: float = 0.0


@dataclass
class _Acc:
    held_s: float = 0.0
    busy_s: float = 0.0
    charged_s: float = 0.0
    dollars: float = 0.0
    joules: float | None = None
    account: str = ""
    unmeasured_s: float = 0.0


def account(
    prev: Snapshot,
    curr: Snapshot,
    attribution: Attribution,
    prices: Mapping[str, Price | None],
    *,
    max_interval_s: float,
    energy_per_kwh: float | None = None,
    earlier: Attribution | None = None,
    energy_before: Mapping[str, LastEnergy] | None = None,
    left_by: Mapping[str, tuple[Workload, ...]] | None = None,
) -> Charges:
    """Charges for the interval (prev.taken_at, curr.taken_at]. `prices` is keyed by GPU uuid;
    with `energy_per_kwh` every charge's joules are priced too.

    `earlier` is the attribution at `prev`. Where a unit's holders changed between the two
    polls the interval is cut where they changed (`agent.accounting.boundaries`): a new holder
    pays from its start where that is known, else from the midpoint; a holder gone pays the
    first half (a job's last interval is not all idle, a new job does not pay for time before
    it started). `left_by` holds, per unit uuid, the workloads that held it last before `prev`:
    who left it idle, where it is idle before anyone holds it within the interval.

    `energy_before` holds each GPU's last energy counter reading (`LastEnergy`), for a counter
    that could not be read at `prev`: its difference across the gap is the gap's energy, not 0.
    The interval's holders are charged it but for the share of the gap's unobserved time; that
    share, like the energy of units whose holders could not be known, is in the GPU's joules and
    in no workload's or idle stretch's: its unobserved energy."""
    dt = curr.taken_at - prev.taken_at
    if dt <= 0:
        return Charges(start=prev.taken_at, end=curr.taken_at, node=curr.node.hostname, energy_per_kwh=energy_per_kwh)
    prev_gpus = prev.gpus
    previous = {d.uuid: d for d in prev_gpus}
    # A GPU discovered at this poll went by a remembered or provisional uuid at the last one:
    # that reading (down, for why it could not be identified) is where its interval starts.
    for d in prev_gpus:
        if not d.discovered:
            previous.setdefault(_by_index(d.index), d)
    prev_devices = {d.uuid: d for d in prev.devices}
    # Each unit's holders, now and at the start, in attribution order, and each GPU's MIG devices.
    holders_of = held_by_device(attribution)
    earlier_of = held_by_device(earlier) if earlier is not None else {}
    migs_of = curr.migs_by_parent()
    workloads: dict[tuple[int, str, Workload], _Acc] = {}
    gpus: list[GpuCharge] = []
    # Whether a unit nobody runs on is idle or of unknown holder, at each end of the interval.
    allocated = attribution.allocations_known
    allocated_before = earlier.allocations_known if earlier is not None else allocated
    last_energy = energy_before if energy_before is not None else {}
    last_held = left_by if left_by is not None else {}
    for gpu in curr.gpus:
        price = prices.get(gpu.uuid)
        # A price that changed within the interval charges each part at its own figure.
        gpu_dollars = price.dollars(prev.taken_at, curr.taken_at) if price is not None else 0.0
        in_force = price.during(prev.taken_at, curr.taken_at) if price is not None else None
        was_gpu = previous.get(gpu.uuid) or previous.get(_by_index(gpu.index))
        reason = _unobserved(was_gpu, gpu, dt, max_interval_s)
        gpu_joules, interval_joules = _energy_delta(
            previous.get(gpu.uuid), gpu, prev.taken_at, curr.taken_at, last_energy.get(gpu.uuid)
        )
        if reason is not None:
            # What the counter counted meanwhile (polls too far apart, the gap of an outage this
            # interval ends) is the GPU's, and no holder's: its unobserved energy.
            gpus.append(_unobserved_charge(gpu, in_force, gpu_dollars, dt, reason, energy_per_kwh, gpu_joules))
            continue
        idle_s = idle_dollars = 0.0
        idle_joules: float | None = None
        unobserved_s = unobserved_dollars = 0.0
        unobserved_reason = ""
        idle_by: dict[Workload, _IdleSums] = {}
        for unit in cost_units(curr, gpu, migs_of.get(gpu.uuid, ())):
            unit_dollars = gpu_dollars * unit.weight
            unit_joules = scaled(interval_joules, unit.weight)
            holders = holders_of.get(unit.uuid, ()) if unit.uuid else ()
            was = prev_devices.get(unit.uuid)
            # Who held it at the start, where that is known (its process list was read then).
            known = earlier is not None and was is not None and was.processes_known
            before = earlier_of.get(unit.uuid, ()) if known and unit.uuid else holders
            if unit.device is not None and not unit.device.processes_known and not holders:
                # Nobody is known to hold it, but its processes could not be listed: not idle.
                unobserved_s += dt * unit.weight
                unobserved_dollars += unit_dollars
                unobserved_reason = UNOBSERVED_PROCESSES
                continue
            last = last_held.get(unit.uuid, ()) if unit.uuid else ()
            charged: dict[tuple[int, str, Workload], _Acc] = {}
            cut: Iterable[tuple[float, float, tuple[Holding, ...], tuple[float, ...] | None, tuple[Workload, ...]]]
            if before is holders or {h.workload for h in before} == {h.workload for h in holders}:
                # The same workloads at both ends (most units at most polls): one stretch, the
                # whole interval, as `stretches` finds it, without making its Stretch and Parts.
                cut = ((0.0, dt, holders, None, last),)
            else:
                cut = (
                    (
                        st.start_s,
                        st.end_s,
                        tuple(p.holding for p in st.parts),
                        tuple(p.util_scale for p in st.parts),
                        st.left_by,
                    )
                    for st in stretches(prev.taken_at, dt, before, holders, last)
                )
            for start_s, end_s, held_by, util_scales, stretch_left_by in cut:
                part = (end_s - start_s) / dt
                # Whether the allocations were known at the end of the interval this stretch
                # belongs to (a stretch wholly in the first half: the earlier poll's).
                whole = start_s == 0.0 and end_s == dt
                allocations_known = allocated_before if not whole and end_s <= dt / 2 else allocated
                if not held_by and not allocations_known:
                    # Nobody runs on it, and whom the scheduler allocated it to cannot be known
                    # (the kubelet unreachable): not idle.
                    unobserved_s += dt * unit.weight * part
                    unobserved_dollars += unit_dollars * part
                    unobserved_reason = UNOBSERVED_ATTRIBUTION
                    continue
                if not held_by:
                    idle_s += dt * unit.weight * part
                    idle_dollars += unit_dollars * part
                    idle_joules = add_known(idle_joules, scaled(unit_joules, part))
                    _leave_idle(
                        idle_by,
                        stretch_left_by,
                        dt * unit.weight * part,
                        unit_dollars * part,
                        scaled(unit_joules, part),
                    )
                    continue
                _charge(
                    charged, gpu.index, unit, held_by, util_scales, dt * unit.weight * part, unit_dollars * part,
                    scaled(unit_joules, part), whole=whole,
                )  # fmt: skip
            _cap_busy(charged, device_busy_ratio(unit.device), dt * unit.weight)
            workloads.update(charged)
        if gpu_joules is not None and idle_joules is None:
            idle_joules = 0.0  # its counter measured the interval, and nobody left it idle
        idle_charges = tuple(
            _IDLE_CHARGES.get_or_make(
                (gpu.uuid, w), (w, i.seconds, i.dollars, i.joules, energy_dollars(i.joules, energy_per_kwh))
            )
            for w, i in (sorted(idle_by.items(), key=_first) if len(idle_by) > 1 else idle_by.items())
        )
        gpus.append(
            _GPU_CHARGES.get_or_make(
                gpu.uuid,
                (
                    gpu.index,
                    gpu.uuid,
                    gpu.model,
                    in_force.dollars_per_hour if in_force is not None else 0.0,
                    dt - unobserved_s,  # observed_s
                    gpu_dollars - unobserved_dollars,  # dollars
                    idle_s,
                    idle_dollars,
                    unobserved_s,
                    gpu_joules,
                    idle_joules,
                    unobserved_dollars,
                    energy_dollars(gpu_joules, energy_per_kwh),
                    energy_dollars(idle_joules, energy_per_kwh),
                    unobserved_reason,
                    idle_charges,
                    _gpu_busy_s(gpu, gpu.uuid in migs_of, dt - unobserved_s),
                    in_force.purchase if in_force is not None else "",
                    in_force.origin if in_force is not None else "",  # price_source
                ),
            )
        )
    return Charges(
        start=prev.taken_at,
        end=curr.taken_at,
        node=curr.node.hostname,
        energy_per_kwh=energy_per_kwh,
        workloads=tuple(
            _WORKLOAD_CHARGES.get_or_make(
                key,
                (
                    *key,  # gpu, uuid, workload
                    acc.held_s,
                    acc.busy_s,
                    acc.dollars,
                    acc.joules,
                    energy_dollars(acc.joules, energy_per_kwh),
                    acc.charged_s,
                    acc.account,
                    acc.unmeasured_s,
                ),
            )
            for key, acc in workloads.items()
        ),
        gpus=tuple(gpus),
    )


def _by_left(
    old: Mapping[Workload, IdleTotals], g: GpuCharge, end: float, horizon: float
) -> Mapping[Workload, IdleTotals]:
    """The idle totals by who left the GPU idle, plus `g`'s; those nothing has added to since
    `horizon` are dropped, as finished workloads' are, so that every job that ever left a GPU
    idle does not keep a series alive for good."""
    found = {w: t for w, t in old.items() if t.last_at >= horizon}
    for part in g.idle_by:
        was = found.get(part.left_by, _NO_IDLE_TOTALS)
        found[part.left_by] = IdleTotals(was.idle_s + part.idle_s, was.idle_dollars + part.idle_dollars, end)
    return found


def _leave_idle(
    idle_by: dict[Workload, _IdleSums],
    left_by: tuple[Workload, ...],
    seconds: float,
    dollars: float,
    joules: float | None,
) -> None:
    """Idle time left by `left_by`, in equal parts where several held the unit last together
    (nobody: Workload(), the empty labels)."""
    owners = left_by or _NOBODY
    for workload in owners:
        sums = idle_by.setdefault(workload, _IdleSums())
        sums.seconds += seconds / len(owners)
        sums.dollars += dollars / len(owners)
        sums.joules = add_known(sums.joules, scaled(joules, 1 / len(owners)))


# Nobody known, as the one owner of idle time: made once, not at each idle stretch (an idle GPU
# has one every poll), and its hash with it.
_NOBODY = (Workload(),)


@dataclass(slots=True)
class _IdleSums:
    """A unit's idle time over one interval that one workload left it in."""

    seconds: float = 0.0
    dollars: float = 0.0
    joules: float | None = None  # None where the GPU's energy counter measured nothing


def _cap_busy(charged: Mapping[tuple[int, str, Workload], _Acc], ratio: float | None, unit_s: float) -> None:
    """Scale the unit's holders' busy seconds down, in proportion, where they add up to more
    than the device was busy (`ratio` of `unit_s`): per-process readings of one interval can
    exceed the device's own (samples the process ring kept that the device's had rolled past,
    a holder gone at the midpoint carrying its previous reading). Dollars are untouched: the
    shares that split them are proportions and stay as measured."""
    if ratio is None:
        return
    device_busy_s = ratio * unit_s
    total = math.fsum(acc.busy_s for acc in charged.values())
    if total > device_busy_s and total > 0:
        scale = device_busy_s / total
        for acc in charged.values():
            acc.busy_s *= scale


def _gpu_busy_s(gpu: DeviceReading, has_migs: bool, observed_s: float) -> float | None:
    """The GPU's busy seconds over its observed time: None for a GPU with MIG instances (neither
    it nor its instances measure utilization) or one that measures none."""
    if has_migs:
        return None
    ratio = device_busy_ratio(gpu)
    return None if ratio is None else ratio * observed_s


def _by_reason(old: Mapping[str, tuple[float, float]], g: GpuCharge) -> Mapping[str, tuple[float, float]]:
    if not g.unobserved_s:
        return old
    seconds, dollars = old.get(g.unobserved_reason, (0.0, 0.0))
    return {**old, g.unobserved_reason: (seconds + g.unobserved_s, dollars + g.unobserved_dollars)}


def _unobserved_charge(
    gpu: DeviceReading,
    price: Price | None,
    dollars: float,
    seconds: float,
    reason: str,
    energy_per_kwh: float | None,
    joules: float | None = None,
) -> GpuCharge:
    """A GPU nobody could see for `seconds`, costing `dollars` at `price` (the one in force at its
    end) and using `joules` (where its counter says; None where it measured nothing): all of it
    unobserved, for `reason`."""
    idle_joules = None if joules is None else 0.0
    return GpuCharge(
        gpu=gpu.index,
        uuid=gpu.uuid,
        model=gpu.model,
        dollars_per_hour=price.dollars_per_hour if price is not None else 0.0,
        observed_s=0.0,
        dollars=0.0,
        idle_s=0.0,
        idle_dollars=0.0,
        unobserved_s=seconds,
        joules=joules,
        idle_joules=idle_joules,
        unobserved_dollars=dollars,
        energy_dollars=energy_dollars(joules, energy_per_kwh),
        idle_energy_dollars=energy_dollars(idle_joules, energy_per_kwh),
        unobserved_reason=reason,
        purchase=price.purchase if price is not None else "",
        price_source=price.origin if price is not None else "",
    )


def downtime(
    start: float,
    end: float,
    snapshot: Snapshot,
    prices: Mapping[str, Price | None],
    *,
    reason: str,
    energy_per_kwh: float | None = None,
) -> Charges:
    """Charges for (start, end], a stretch nobody watched (the agent was not running): every
    GPU of `snapshot` unobserved for all of it, at its price, for `reason`."""
    gpus = tuple(
        _unobserved_charge(
            gpu,
            p.during(start, end) if (p := prices.get(gpu.uuid)) else None,
            p.dollars(start, end) if p else 0.0,
            end - start,
            reason,
            energy_per_kwh,
        )
        for gpu in snapshot.gpus
    )
    return Charges(start=start, end=end, node=snapshot.node.hostname, energy_per_kwh=energy_per_kwh, gpus=gpus)


def spread_gap_energy(charges: Charges, counted_from: Mapping[str, float]) -> tuple[Charges, ...]:
    """`charges`, with the energy no holder was charged of each GPU whose counter counts from
    before their start (`counted_from`, by uuid: its last reading before an outage) moved into a
    charge of its own over that whole gap, so the ledger spreads it over the hours the gap spans,
    pro rata by time (the gap's mean power), as it does the gap's dollars, and not all into the
    hour that ends it. The holders' and idle joules stay in the interval. Only joules move: the
    pieces add up to `charges`."""
    moved: dict[str, float] = {}
    for g in charges.gpus:
        since = counted_from.get(g.uuid)
        if since is None or not since < charges.start or g.joules is None:
            continue
        held = sum(w.joules or 0.0 for w in charges.workloads if w.gpu == g.gpu) + (g.idle_joules or 0.0)
        if g.joules - held > 0:
            moved[g.uuid] = g.joules - held
    if not moved:
        return (charges,)
    per_kwh = charges.energy_per_kwh
    gpus = tuple(
        replace(g, joules=(j := g.joules - moved[g.uuid]), energy_dollars=energy_dollars(j, per_kwh))
        if g.uuid in moved and g.joules is not None
        else g
        for g in charges.gpus
    )
    gaps = tuple(
        Charges(
            start=counted_from[g.uuid],
            end=charges.end,
            node=charges.node,
            energy_per_kwh=per_kwh,
            gpus=(_joules_only(g, moved[g.uuid], per_kwh),),
        )
        for g in charges.gpus
        if g.uuid in moved
    )
    return (replace(charges, gpus=gpus), *gaps)


def _joules_only(g: GpuCharge, joules: float, per_kwh: float | None) -> GpuCharge:
    """`g` holding `joules` and no time, dollars or idle energy."""
    return replace(
        g, observed_s=0.0, dollars=0.0, idle_s=0.0, idle_dollars=0.0, unobserved_s=0.0, unobserved_dollars=0.0,
        joules=joules, idle_joules=0.0, energy_dollars=energy_dollars(joules, per_kwh),
        idle_energy_dollars=energy_dollars(0.0, per_kwh), idle_by=(), busy_s=None,
    )  # fmt: skip


def split_at_price_changes(charges: Charges, prices: Mapping[str, Price | None]) -> tuple[Charges, ...]:
    """`charges` cut at each price change that falls inside their interval: one piece per price.

    The ledger splits a charge over the hours it spans in proportion to time, which is right
    only while the price holds: an interval a change falls in (downtime booked at a start, a
    gap between polls, two polls that straddle both an hour and a change) would spread its
    dollars evenly over its hours, the later price's in the earlier hours. Each piece keeps the
    interval's split among holders; its seconds and joules are its share of the interval's
    time, its dollars its share of what the GPU cost (`Price.dollars`), its price the one in
    force within it. The pieces add up to `charges`, to rounding."""
    start, end = charges.start, charges.end
    by_gpu = {g.gpu: p for g in charges.gpus if (p := prices.get(g.uuid)) is not None}
    cuts = sorted({at for p in by_gpu.values() for at, _ in p.changes if start < at < end})
    if not cuts:
        return (charges,)
    whole = {gpu: p.dollars(start, end) for gpu, p in by_gpu.items()}
    pieces = []
    for a, b in itertools.pairwise([start, *cuts, end]):
        time_part = (b - a) / (end - start)
        dollar_part = {gpu: p.dollars(a, b) / whole[gpu] if whole[gpu] > 0 else time_part for gpu, p in by_gpu.items()}
        pieces.append(_price_piece(charges, a, b, time_part, dollar_part, by_gpu))
    return tuple(pieces)


def _price_piece(
    charges: Charges,
    start: float,
    end: float,
    time_part: float,
    dollar_part: Mapping[int, float],
    prices: Mapping[int, Price],
) -> Charges:
    """The part of `charges` from `start` to `end`: seconds and joules x `time_part`, each GPU's
    dollars x its `dollar_part`."""

    workloads = tuple(
        replace(
            w,
            held_s=w.held_s * time_part,
            busy_s=w.busy_s * time_part,
            charged_s=w.charged_s * time_part,
            unmeasured_s=w.unmeasured_s * time_part,
            dollars=w.dollars * dollar_part.get(w.gpu, time_part),
            joules=scaled(w.joules, time_part),
            energy_dollars=scaled(w.energy_dollars, time_part),
        )
        for w in charges.workloads
    )
    gpus = []
    for g in charges.gpus:
        part = dollar_part.get(g.gpu, time_part)
        in_force = prices[g.gpu].during(start, end) if g.gpu in prices else None
        price = (
            (in_force.dollars_per_hour, in_force.purchase, in_force.origin)
            if in_force is not None
            else (g.dollars_per_hour, g.purchase, g.price_source)
        )
        gpus.append(
            replace(
                g,
                observed_s=g.observed_s * time_part,
                dollars=g.dollars * part,
                idle_s=g.idle_s * time_part,
                idle_dollars=g.idle_dollars * part,
                unobserved_s=g.unobserved_s * time_part,
                unobserved_dollars=g.unobserved_dollars * part,
                joules=scaled(g.joules, time_part),
                idle_joules=scaled(g.idle_joules, time_part),
                energy_dollars=scaled(g.energy_dollars, time_part),
                idle_energy_dollars=scaled(g.idle_energy_dollars, time_part),
                busy_s=scaled(g.busy_s, time_part),
                idle_by=tuple(
                    replace(
                        i,
                        idle_s=i.idle_s * time_part,
                        idle_dollars=i.idle_dollars * part,
                        idle_joules=scaled(i.idle_joules, time_part),
                        idle_energy_dollars=scaled(i.idle_energy_dollars, time_part),
                    )
                    for i in g.idle_by
                ),
                dollars_per_hour=price[0],
                purchase=price[1],
                price_source=price[2],
            )
        )
    return replace(charges, start=start, end=end, workloads=workloads, gpus=tuple(gpus))


_NO_WORKLOAD_TOTALS = WorkloadTotals()
_NO_IDLE_TOTALS = IdleTotals()
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
        joules = add_known(old.joules, c.joules)
        workloads[key] = WorkloadTotals(
            old.held_s + c.held_s,
            old.busy_s + c.busy_s,
            old.charged_s + c.charged_s,
            old.dollars + c.dollars,
            joules,
            charges.end,  # last_charged_at
            energy_dollars(joules, per_kwh),
            old.unmeasured_s + c.unmeasured_s,
        )
    horizon = charges.end - forget_after_s
    if any(v.last_charged_at < horizon for v in workloads.values()):
        workloads = {k: v for k, v in workloads.items() if v.last_charged_at >= horizon}
    gpus = dict(totals.gpus)
    for g in charges.gpus:
        old_gpu = gpus.get((g.gpu, g.uuid), _NO_GPU_TOTALS)
        gpu_joules, idle_joules = add_known(old_gpu.joules, g.joules), add_known(old_gpu.idle_joules, g.idle_joules)
        gpus[(g.gpu, g.uuid)] = GpuTotals(
            old_gpu.dollars + g.dollars,
            old_gpu.idle_dollars + g.idle_dollars,
            old_gpu.idle_s + g.idle_s,
            old_gpu.observed_s + g.observed_s,
            old_gpu.unobserved_s + g.unobserved_s,
            gpu_joules,
            idle_joules,
            old_gpu.unobserved_dollars + g.unobserved_dollars,
            energy_dollars(gpu_joules, per_kwh),
            energy_dollars(idle_joules, per_kwh),  # idle_energy_dollars
            _by_reason(old_gpu.unobserved_by_reason, g),
            _by_left(old_gpu.idle_by_left, g, charges.end, horizon),
            old_gpu.busy_s if g.busy_s is None else (old_gpu.busy_s or 0.0) + g.busy_s,
        )
    return CostTotals(workloads, gpus)


# accumulate makes its totals positionally, in the order of their fields (checked here).
check_fields(IdleTotals, "idle_s", "idle_dollars", "last_at")
check_fields(
    WorkloadTotals, "held_s", "busy_s", "charged_s", "dollars", "joules", "last_charged_at", "energy_dollars",
    "unmeasured_s",
)  # fmt: skip
check_fields(
    GpuTotals, "dollars", "idle_dollars", "idle_s", "observed_s", "unobserved_s", "joules", "idle_joules",
    "unobserved_dollars", "energy_dollars", "idle_energy_dollars", "unobserved_by_reason", "idle_by_left", "busy_s",
)  # fmt: skip
