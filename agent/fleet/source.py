"""The exact growth of every series of a counter over [since, until], read from a Prometheus
query API (agent/fleet/counters.py says why not `increase()`).

Per counter, three instant queries answer for every series without a reset:

    last_over_time(m[until - since])           at until: its last value in the window
    last_over_time(m[lookback])                at since: its baseline (none: it started inside)
    resets(m[until - since + lookback]) > 0    at until: the series that fell somewhere

A series that never fell grew by last - baseline. The few that fell (an agent restart, a
workload that came back after it was forgotten), and every series of a node whose agent
restarted, are narrowed down: the window is cut into
parts, and for each part the store gives the last value, the smallest (which, in a part
without a reset, is its first) and the resets; a part with a reset is cut again until it is
short enough (RAW_WINDOW_S) to read its raw samples. So the work is three queries per counter
plus a few per restart, whatever the window's length, and no sample is read twice over HTTP.

A restart resets every counter of its node, but not every counter falls: the time the agent was
down, booked as unobserved (agent_down) as it starts, can exceed what the last run booked. So
restarts are read from a counter that does fall at each one, the polls since the agent started
(RESTART_COUNTER, narrowed down the same way), and a counter's samples after a restart count
from 0 whatever their value.

A node the store holds no sample of in the lookback before the window, yet one from earlier (the
store, or its scrapes of that node, were down across `since`), is no new node: its counters ran
on through the gap. Their baselines are looked for further back (GAP_REACH_S), on such nodes
only, so that the gap's growth is counted from the last sample before it (as an edge between
two samples is) and not each counter's whole history from 0.

Both halves of a window's edges follow the store's own convention: Prometheus 2 counts a sample
exactly at a range's start in the range, VictoriaMetrics and Prometheus 3 do not; either way a
sample is never counted twice (equal consecutive values grow by 0) and never missed.

Precision: a window edge falls between two samples of each series; what the counter grew by
between the last sample before the edge and the edge is counted on the wrong side of it. So
each series is off by at most what it grows in one scrape interval at each end of the window,
and exact where samples fall on the edges.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from agent.fleet.counters import Stretch, increase, was_reset
from agent.fleet.promapi import LabelSet, PrometheusAPI, Series, selector

DEFAULT_LOOKBACK_S = 3600.0
# How far before the window a node's last sample is looked for where the lookback holds none
# (see the module's docstring): past this, a node is taken as new and its counters grew from 0.
GAP_REACH_S = 31 * 86400.0
# A part at most this long is read as raw samples: 720 a series at a 30 s scrape, so that a month
# is one level of parts (a sixth of a day each) and each restart one raw read of its part.
RAW_WINDOW_S = 6 * 3600.0
MAX_PARTS = 200  # a part with a reset is cut into at most this many (a range query's points)
NODES_PER_QUERY = 40  # series to narrow down are selected by node, this many nodes per query
# Counts from 0 at every start of an agent, by one a poll: it falls at each restart.
RESTART_COUNTER = "gpuledger_polls_total"

Restarts = Mapping[str, Sequence[float]]  # node -> when its agent restarted (see agent_restarts)
# A part of a series' samples: all of them after `after` and at or before `upto`, and their stretch.
_Timed = tuple[float, float, Stretch]


@dataclass(frozen=True, slots=True)
class Window:
    """[since, until] in unix seconds (kept to the millisecond, the stores' resolution), and how
    far before `since` a series' last sample may lie and still be its baseline."""

    since: float
    until: float
    lookback_s: float = DEFAULT_LOOKBACK_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "since", round(self.since, 3))
        object.__setattr__(self, "until", round(self.until, 3))
        if not self.until > self.since:
            raise ValueError("the window must end after it starts")
        if not self.lookback_s > 0:
            raise ValueError("the lookback must be above 0")


def has_series(api: PrometheusAPI, metric: str, window: Window) -> bool:
    """Whether any series of `metric` has a sample in the window (one number comes back)."""
    return bool(api.instant(f"count(last_over_time({metric}[{_ms(window.until - window.since)}ms]))", window.until))


def unscraped_nodes(api: PrometheusAPI, window: Window, *, node_label: str) -> frozenset[str]:
    """The nodes with samples in the window whose last sample before it lies beyond the lookback
    but within GAP_REACH_S (the store has a gap across `since`): read from RESTART_COUNTER. A node
    the store first holds inside the window is not one."""
    span = _ms(window.until - window.since)
    in_window = {s.label(node_label) for s in api.instant(f"last_over_time({RESTART_COUNTER}[{span}ms])", window.until)}
    recent = {
        s.label(node_label)
        for s in api.instant(f"last_over_time({RESTART_COUNTER}[{_ms(window.lookback_s)}ms])", window.since)
    }
    older = _older_baselines(api, RESTART_COUNTER, in_window - recent, window, node_label)
    return frozenset(dict(labels).get(node_label, "") for labels in older)


def agent_restarts(
    api: PrometheusAPI, window: Window, *, node_label: str, gaps: Collection[str] = ()
) -> dict[str, tuple[float, ...]]:
    """Node -> each restart of its agent in the window, as the time of the node's last sample
    before it (`since` where that lies before the window): a sample after that time and at or
    before the next sample is the new run's. `gaps`: the nodes unscraped_nodes() names, whose
    last sample before the window is older than the lookback (a restart in the gap is at `since`)."""
    reach = _ms(window.until - window.since + window.lookback_s)
    older = _older_baselines(api, RESTART_COUNTER, gaps, window, node_label)
    fell_somewhere = {s.labels for s in api.instant(f"resets({RESTART_COUNTER}[{reach}ms]) > 0", window.until)}
    fell_somewhere |= older.keys()
    if not fell_somewhere:
        return {}
    baseline = older | {
        s.labels: s.value
        for s in api.instant(f"last_over_time({RESTART_COUNTER}[{_ms(window.lookback_s)}ms])", window.since)
    }
    parts = _Narrowing(api, RESTART_COUNTER, node_label).timed(fell_somewhere, window.since, window.until)
    found: dict[str, list[float]] = {}
    for labels, timed in parts.items():
        previous, previous_upto = baseline.get(labels), window.since
        for _, upto, stretch in timed:
            if math.isnan(stretch.first):
                continue
            if previous is not None and was_reset(previous, stretch.first):
                found.setdefault(dict(labels).get(node_label, ""), []).append(previous_upto)
            previous, previous_upto = stretch.last, upto
    return {node: tuple(sorted(times)) for node, times in found.items()}


def counter_growth(
    api: PrometheusAPI,
    metric: str,
    window: Window,
    *,
    node_label: str,
    restarts: Restarts | None = None,
    gaps: Collection[str] = (),
) -> dict[LabelSet, float]:
    """Every series of `metric` with a sample in the window -> its exact growth over it, where
    the agents of the nodes in `restarts` restarted then (agent_restarts) and the store has a
    gap across `since` on the nodes in `gaps` (unscraped_nodes)."""
    restarts = restarts or {}
    span = _ms(window.until - window.since)
    last = {s.labels: s.value for s in api.instant(f"last_over_time({metric}[{span}ms])", window.until)}
    if not last:
        return {}
    baseline = {
        s.labels: s.value for s in api.instant(f"last_over_time({metric}[{_ms(window.lookback_s)}ms])", window.since)
    }
    unseen = {dict(labels).get(node_label, "") for labels in last.keys() - baseline.keys()} & set(gaps)
    baseline = _older_baselines(api, metric, unseen, window, node_label) | baseline
    reach = _ms(window.until - window.since + window.lookback_s)
    fell = {s.labels for s in api.instant(f"resets({metric}[{reach}ms]) > 0", window.until)} & last.keys()
    fell |= {labels for labels in last if restarts.get(dict(labels).get(node_label, ""))}
    growth = {labels: increase(baseline.get(labels), [Stretch(value, value)]) for labels, value in last.items()}
    if fell:
        parts = _Narrowing(api, metric, node_label, restarts).timed(fell, window.since, window.until)
        for labels in fell:
            node_restarts = restarts.get(dict(labels).get(node_label, ""), ())
            stretches = _after_restarts(parts.get(labels, []), node_restarts, window.since)
            growth[labels] = increase(baseline.get(labels), stretches)
    return growth


def _older_baselines(
    api: PrometheusAPI, metric: str, nodes: Collection[str], window: Window, node_label: str
) -> dict[LabelSet, float]:
    """Series of `metric` on `nodes` -> its last value at or before `since`, within GAP_REACH_S."""
    found: dict[LabelSet, float] = {}
    for matchers in _node_matchers(nodes, node_label):
        query = f"last_over_time({metric}{matchers}[{_ms(GAP_REACH_S)}ms])"
        found.update((s.labels, s.value) for s in api.instant(query, window.since))
    return found


def _node_matchers(nodes: Iterable[str], node_label: str) -> list[str]:
    """Label matchers that select every series of `nodes`: a regex of at most NODES_PER_QUERY
    node names per query."""
    names = sorted(set(nodes))
    groups = []
    for i in range(0, len(names), NODES_PER_QUERY):
        pattern = "|".join(re.escape(node) for node in names[i : i + NODES_PER_QUERY])
        groups.append(selector("", [(node_label, "=~", pattern)]))
    return groups


def _after_restarts(timed: Sequence[_Timed], restarts: Sequence[float], since: float) -> list[Stretch]:
    """The stretches of one series, each marked where its node's agent restarted between the
    series' sample before it (the baseline: at or before `since`) and its first."""
    out = []
    previous_upto = since
    for after, upto, stretch in timed:
        out.append(stretch._replace(restarted=any(previous_upto <= r <= after for r in restarts)))
        previous_upto = upto
    return out


@dataclass
class _Narrowing:
    """Finds the stretches without a reset of some series of one counter over a window."""

    api: PrometheusAPI
    metric: str
    node_label: str
    restarts: Restarts = field(default_factory=dict)  # a part holding one is read down to its samples

    def timed(self, wanted: set[LabelSet], start: float, end: float) -> dict[LabelSet, list[_Timed]]:
        """Each series of `wanted` -> its stretches within (start, end], in time order, each with
        the span its samples lie in."""
        found: dict[LabelSet, list[_Timed]] = {labels: [] for labels in wanted}
        for matchers in self._groups(wanted):
            self._narrow(matchers, wanted, start, end, found)
        return {labels: sorted(timed, key=lambda part: part[1]) for labels, timed in found.items()}

    def _narrow(
        self,
        matchers: str,
        wanted: set[LabelSet],
        start: float,
        end: float,
        found: dict[LabelSet, list[_Timed]],
    ) -> None:
        """Add the stretches of `wanted` within (start, end] to `found`, each with the span its
        samples lie in (a raw sample at t: the millisecond ending at t)."""
        if end - start <= RAW_WINDOW_S:
            for series in self.api.instant(f"{self.metric}{matchers}[{_ms(end - start)}ms]", end):
                if series.labels in wanted:
                    # A sample at `start` belongs to the part before (Prometheus 2 counts a range's
                    # start in the range, VictoriaMetrics does not: this keeps the two alike).
                    found[series.labels].extend((t - 0.001, t, Stretch(v, v)) for t, v in series.samples if t > start)
            return
        # Parts of whole seconds whose edges are multiples of their length: query frontends
        # (VictoriaMetrics, Thanos, Mimir) may align a range query's steps that way anyway. The
        # parts at either end are shorter and asked for on their own.
        step = float(max(RAW_WINDOW_S, math.ceil((end - start) / MAX_PARTS)))
        first = (math.floor(start / step) + 1) * step
        edges = [first + k * step for k in range(math.ceil((end - first) / step)) if first + k * step < end]
        summaries: dict[LabelSet, dict[int, tuple[float, float, int]]] = {}
        bounds = list(zip([start, *edges], [*edges, end], strict=True))
        for labels, by_time in self._summaries_at(matchers, bounds[0]).items():
            summaries.setdefault(labels, {}).update(by_time)
        if len(edges) >= 2:
            for labels, by_time in self._summaries(matchers, step, edges[1], edges[-1]).items():
                summaries.setdefault(labels, {}).update(by_time)
        if len(bounds) >= 2:
            for labels, by_time in self._summaries_at(matchers, bounds[-1]).items():
                summaries.setdefault(labels, {}).update(by_time)
        again: dict[tuple[float, float], set[LabelSet]] = {}
        for labels in wanted:
            by_edge = summaries.get(labels, {})
            restarts = self.restarts.get(dict(labels).get(self.node_label, ""), ())
            for part_start, part_end in bounds:
                figures = by_edge.get(_key(part_end))
                if figures is None:
                    continue  # no sample in this part
                last, low, resets = figures
                if resets == 0 and not any(part_start < r < part_end for r in restarts):
                    found[labels].append((part_start, part_end, Stretch(low, last)))
                else:
                    again.setdefault((part_start, part_end), set()).add(labels)
        for (part_start, part_end), fell in sorted(again.items()):
            # Only the nodes whose series fell in this part: a restart is one node's.
            for narrower in self._groups(fell):
                self._narrow(narrower, fell, part_start, part_end, found)

    def _summaries(
        self, matchers: str, step: float, first_end: float, last_end: float
    ) -> dict[LabelSet, dict[int, tuple[float, float, int]]]:
        """Series -> part end (ms) -> (last, smallest, resets) for the parts of length `step`
        ending at first_end, first_end + step, ... last_end: one range query per figure."""
        sel = f"{self.metric}{matchers}[{_ms(step)}ms]"
        return _combine([self.api.range(f"{f}({sel})", first_end, last_end, step) for f in _FIGURES])

    def _summaries_at(
        self, matchers: str, part: tuple[float, float]
    ) -> dict[LabelSet, dict[int, tuple[float, float, int]]]:
        """Series -> {part end (ms): (last, smallest, resets)} for the one part (start, end]."""
        start, end = part
        sel = f"{self.metric}{matchers}[{_ms(end - start)}ms]"
        answers = _combine([self.api.instant(f"{f}({sel})", end) for f in _FIGURES])
        # An instant query's answer is stamped with its evaluation time: the part's end.
        return {labels: {_key(end): figures for figures in by_time.values()} for labels, by_time in answers.items()}

    def _groups(self, wanted: Iterable[LabelSet]) -> list[str]:
        """Label matchers that select every series of `wanted` (and few others): by node."""
        return _node_matchers((dict(labels).get(self.node_label, "") for labels in wanted), self.node_label)


# What the store is asked of each part: its last value, its smallest (in a part with no reset,
# its first) and how many times it fell.
_FIGURES = ("last_over_time", "min_over_time", "resets")


def _combine(figures: Sequence[Sequence[Series]]) -> dict[LabelSet, dict[int, tuple[float, float, int]]]:
    """The answers for _FIGURES, zipped: series -> evaluation time (ms) -> (last, smallest, resets)."""
    last, low, resets = ({s.labels: {_key(t): v for t, v in s.samples} for s in answer} for answer in figures)
    out: dict[LabelSet, dict[int, tuple[float, float, int]]] = {}
    for labels, values in last.items():
        for t, value in values.items():
            if math.isnan(value):
                continue
            lowest = low.get(labels, {}).get(t, value)
            count = resets.get(labels, {}).get(t, 0.0)
            out.setdefault(labels, {})[t] = (value, lowest, int(count))
    return out


def _key(t: float) -> int:
    """A time as whole milliseconds: the stores' answers are stamped to the millisecond."""
    return round(t * 1000)


def _ms(seconds: float) -> int:
    """A PromQL range in whole milliseconds (both Prometheus and VictoriaMetrics take `ms`)."""
    return max(1, round(seconds * 1000))
