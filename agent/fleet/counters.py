"""How much a counter grew over a window, exactly, from what the store says about it. Pure.

Prometheus's `increase()` is not the answer: it extrapolates the first and last samples out to
the window's edges, and a series that started or ended inside the window is stretched to the
edges too. gpuledger's counters are the ledger's figures summed since the agent started, so
the growth between two samples is exactly what the ledger recorded between them, and the only
imprecision left is where the window's edges fall between samples.

The growth of one series from a baseline (its last sample at or before the window's start; none
when it started inside the window, so it grew from 0) over the samples in the window is the sum
over consecutive samples of `later - earlier`, or `later` where the counter fell (a reset: the
agent restarted and counted from 0 again). The store is asked for that without sending every
sample: a stretch of samples with no reset in it is known by its first and last values (its
minimum and its last, server-side), so only stretches holding a reset are narrowed down until
their raw samples are few (see agent/fleet/source.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple


class Stretch(NamedTuple):
    """Consecutive samples of one series with no reset among them: the first and the last value
    (a single sample is a stretch with first == last). `restarted`: the agent restarted between
    the series' sample before and this stretch, so the counter counted from 0 again whether or
    not it fell (time an agent was down, booked as it starts, can outgrow the last run's)."""

    first: float
    last: float
    restarted: bool = False


# A store that keeps fewer digits than a float (VictoriaMetrics: about 12 significant ones) can
# give a counter that did not move back a hair below its last value (0.219356017477, then
# 0.21935601747699998). A fall that small is rounding, not a reset: a restarted agent counts from
# 0, so a real reset falls to a small fraction of the value before it.
ROUNDING = 1e-9


def growth(earlier: float | None, later: float) -> float:
    """What a counter grew by between two consecutive samples: the difference, or (the counter
    fell: it was reset and counted from 0 again) all of `later`; from no sample at all (the
    series started), all of `later` too."""
    if earlier is None or was_reset(earlier, later):
        return later
    return max(0.0, later - earlier)


def was_reset(earlier: float, later: float) -> bool:
    """Whether a counter was reset between two consecutive samples (by more than rounding)."""
    return earlier - later > ROUNDING * abs(earlier)


def increase(baseline: float | None, stretches: Iterable[Stretch]) -> float:
    """The growth of a series over a window: from `baseline` (its last value before the window;
    None when the series started inside it) through `stretches`, in time order. NaN samples
    (staleness markers) are skipped."""
    total = 0.0
    previous = baseline
    for stretch in stretches:
        if math.isnan(stretch.first) or math.isnan(stretch.last):
            continue
        start = None if stretch.restarted else previous
        total += growth(start, stretch.first) + (stretch.last - stretch.first)
        previous = stretch.last
    return total
