"""Who held a cost unit when, within one interval between two polls. Pure.

A poll sees who holds each unit at its own moment only. Between two polls:

  - a workload holding the unit at both ends held it throughout;
  - one holding it at the start only is gone by the end, and when it went is not known (NVML
    gives no end time): it held the first half (the midpoint rule);
  - one holding it at the end only began within the interval: from its start where that is
    known and falls within the interval (the earliest start of its processes, as procfs gives
    it, or its allocation's, as the Slurm map file's time gives it; at the later poll itself:
    none of it), else from the midpoint.

Wherever nobody held the unit it was idle, and each idle stretch is left by the workloads whose
part ended last before it; where none ended within the interval, by those that held the unit
last before it (`left_by`, carried from poll to poll by the caller).

Times here are seconds into the interval: 0 is the earlier poll, `dt` the later one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from agent.model import Holding, Workload


@dataclass(frozen=True, slots=True)
class Part:
    """One holding's share of the interval: from `start_s` to `end_s`.

    `util_scale` turns the holding's utilization reading into its utilization over this part:
    a reading taken at the end of the interval is the mean over the whole interval (periods
    without work count as 0), so a holder that began halfway did twice that while it held the
    unit. A reading from the start of the interval (a holder gone since) stands as it is."""

    holding: Holding
    start_s: float
    end_s: float
    util_scale: float = 1.0


@dataclass(frozen=True, slots=True)
class Stretch:
    """A stretch of the interval with one set of holders; idle where `parts` is empty, and then
    left by `left_by` (empty: nobody is known to have held the unit)."""

    start_s: float
    end_s: float
    parts: tuple[Part, ...] = ()
    left_by: tuple[Workload, ...] = ()

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


def stretches(
    start: float,
    dt: float,
    before: Sequence[Holding],
    after: Sequence[Holding],
    left_by: tuple[Workload, ...] = (),
) -> list[Stretch]:
    """The interval (start, start + dt] cut where its holders change, in time order.

    `before` are the unit's holdings at the earlier poll, `after` those at the later one;
    `left_by` the workloads that held the unit last before the interval. `start` and the
    holdings' `started_at` are on the same clock (wall clock, unix seconds)."""
    before_workloads = {h.workload for h in before}
    after_workloads = {h.workload for h in after}
    if before_workloads == after_workloads:
        if not after:
            return [Stretch(0.0, dt, (), left_by)]
        return [Stretch(0.0, dt, tuple(Part(h, 0.0, dt) for h in after))]
    midpoint = dt / 2
    parts: list[Part] = []
    for h in after:
        if h.workload in before_workloads:
            parts.append(Part(h, 0.0, dt))
            continue
        began = midpoint
        if h.started_at is not None and 0.0 <= h.started_at - start <= dt:
            began = h.started_at - start
        if began < dt:  # one that began at the later poll itself held none of the interval
            parts.append(Part(h, began, dt, dt / (dt - began)))
    parts.extend(Part(h, 0.0, midpoint) for h in before if h.workload not in after_workloads)
    cuts = sorted({0.0, dt, *(p.start_s for p in parts), *(p.end_s for p in parts)})
    found: list[Stretch] = []
    for lo, hi in itertools.pairwise(cuts):
        owners = tuple(p for p in parts if p.start_s <= lo and p.end_s >= hi)
        if owners:
            found.append(Stretch(lo, hi, owners))
            continue
        ended = [p for p in parts if p.end_s <= lo]
        left = left_by
        if ended:
            last = max(p.end_s for p in ended)
            left = tuple(sorted({p.holding.workload for p in ended if p.end_s == last}))
        found.append(Stretch(lo, hi, (), left))
    return found
