"""The exact growth of a counter over a window, as `report --prometheus` reads it from a store's
query API: against a direct count over every sample, for any samples (resets, gaps, series that
start or end inside the window), with both range conventions stores use.

The store here is a small in-memory evaluator of the few PromQL forms the reader sends
(`last_over_time`, `min_over_time`, `resets`, `count`, `> 0`, raw range selectors), reached
through the real client over httpx's MockTransport: everything between the HTTP request and
the report is the code that runs against Prometheus and VictoriaMetrics.

    Prometheus 2      a range [t - r, t] holds samples at both ends
    VictoriaMetrics   a range (t - r, t]; `resets` also compares its first sample with the one
                      before the range
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import parse_qs

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agent.fleet import source
from agent.fleet.counters import Stretch, growth, increase
from agent.fleet.promapi import PrometheusAPI
from agent.fleet.source import RESTART_COUNTER, Window, agent_restarts, counter_growth

Samples = list[tuple[float, float]]


@dataclass
class MemoryStore:
    """Series of one counter, answering the reader's queries with one range convention."""

    series: dict[str, Samples]  # instance -> samples in time order
    victoria: bool = False  # VictoriaMetrics' convention, else Prometheus 2's
    others: dict[str, dict[str, Samples]] = field(default_factory=dict)  # other metrics' series
    queries: list[str] = field(default_factory=list)

    _SELECT = re.compile(r'(?P<metric>[a-z_]+)(?:\{instance=~"(?P<regex>(?:[^"\\]|\\.)*)"\})?\[(?P<ms>\d+)ms\]')

    def handle(self, request: httpx.Request) -> httpx.Response:
        form = {k: v[0] for k, v in parse_qs(request.content.decode()).items()}
        expr = form["query"]
        self.queries.append(expr)
        if "start" in form:
            start, end, step = float(form["start"]), float(form["end"]), float(form["step"])
            times = [start + i * step for i in range(round((end - start) / step) + 1)]
            return self._answer("matrix", self._evaluate(expr, times))
        result = self._evaluate(expr, [float(form["time"])])
        raw = self._SELECT.fullmatch(expr)
        return self._answer("matrix" if raw else "vector", result, vector=not raw)

    def _evaluate(self, expr: str, times: Sequence[float]) -> dict[str, Samples]:
        counted = expr.startswith("count(")
        inner = expr.removeprefix("count(").removesuffix(")") if counted else expr
        positive = inner.endswith(" > 0")
        inner = inner.removesuffix(" > 0")
        function, _, rest = inner.partition("(")
        if not rest:
            function, rest = "", inner + ")"
        match = self._SELECT.fullmatch(rest[:-1])
        assert match is not None, expr
        window_s = int(match["ms"]) / 1000
        # The matcher's value is a PromQL string: unquoted (as JSON unquotes) before it is a regex.
        pattern = re.compile(json.loads(f'"{match["regex"]}"') if match["regex"] else ".*")
        out: dict[str, Samples] = {}
        for instance, samples in self.others.get(match["metric"], self.series).items():
            if not pattern.fullmatch(instance):
                continue
            for t in times:
                inside = [(ts, v) for ts, v in samples if self._in_range(ts, t, window_s)]
                if function == "":
                    if inside:
                        out.setdefault(instance, []).extend(inside)
                    continue
                if not inside:
                    continue
                value = self._apply(function, inside, samples, t - window_s)
                if positive and not value > 0:
                    continue
                out.setdefault(instance, []).append((t, value))
        if counted:
            return {"": [(times[0], float(len(out)))]} if out else {}
        return out

    def _in_range(self, ts: float, t: float, window_s: float) -> bool:
        return (t - window_s < ts if self.victoria else t - window_s <= ts) and ts <= t

    def _apply(self, function: str, inside: Samples, every: Samples, start: float) -> float:
        values = [v for _, v in inside]
        if function == "last_over_time":
            return values[-1]
        if function == "min_over_time":
            return min(values)
        assert function == "resets", function
        if self.victoria:
            before = [v for ts, v in every if ts <= start]
            values = before[-1:] + values
        return float(sum(1 for a, b in itertools.pairwise(values) if b < a))

    def _answer(self, kind: str, result: dict[str, Samples], *, vector: bool = False) -> httpx.Response:
        def labels(instance: str) -> dict[str, str]:
            return {"instance": instance} if instance else {}

        if vector:
            items = [{"metric": labels(k), "value": [t, repr(v)]} for k, s in result.items() for t, v in s]
        else:
            items = [{"metric": labels(k), "values": [[t, repr(v)] for t, v in s]} for k, s in result.items()]
        body = {"status": "success", "data": {"resultType": kind, "result": items}}
        return httpx.Response(200, content=json.dumps(body).encode())


def exact(samples: Samples, window: Window, victoria: bool) -> float | None:
    """The growth over the window counted sample by sample (None: no sample in the window)."""
    early = [v for t, v in samples if (window.since - window.lookback_s < t if victoria
             else window.since - window.lookback_s <= t) and t <= window.since]  # fmt: skip
    inside = [v for t, v in samples if window.since < t <= window.until]
    if not inside and not any(t == window.since for t, _ in samples if not victoria):
        return None
    previous = early[-1] if early else None
    total = 0.0
    for value in inside:
        total += growth(previous, value)
        previous = value
    return total


@st.composite
def counters(draw: st.DrawFn) -> Samples:
    """A counter's samples: whole seconds apart with gaps, growing, now and then reset (the agent
    restarted, or a forgotten workload came back) to a smaller value."""
    times = sorted(draw(st.sets(st.integers(0, 300), min_size=1, max_size=40)))
    value = 0.0
    samples = []
    for t in times:
        if draw(st.integers(0, 9)) == 0:
            value = float(draw(st.integers(0, int(value)))) if value else 0.0  # a reset
        else:
            value += float(draw(st.integers(0, 50)))
        samples.append((float(t), value))
    return samples


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows of a few hundred seconds narrowed down the way a month is: several levels of parts
    before raw samples are read."""
    monkeypatch.setattr(source, "RAW_WINDOW_S", 7.0)
    monkeypatch.setattr(source, "MAX_PARTS", 3)


def growth_through_the_api(store: MemoryStore, window: Window) -> dict[str, float]:
    with PrometheusAPI("http://store:9090", transport=httpx.MockTransport(store.handle)) as api:
        found = counter_growth(api, "c_total", window, node_label="instance")
    return {dict(labels).get("instance", ""): value for labels, value in found.items()}


@pytest.mark.usefixtures("small_parts")
@settings(max_examples=300)
@given(
    series=st.lists(counters(), min_size=1, max_size=3),
    since=st.integers(0, 250),
    length=st.integers(1, 200),
    lookback=st.integers(1, 60),
    victoria=st.booleans(),
)
@example(series=[[(10.0, 5.0), (20.0, 2.0), (30.0, 9.0)]], since=15, length=20, lookback=10, victoria=False)
@example(series=[[(10.0, 5.0), (20.0, 7.0)]], since=10, length=10, lookback=5, victoria=False)
def test_growth_is_the_sum_over_every_sample(
    series: list[Samples], since: int, length: int, lookback: int, victoria: bool
) -> None:
    store = MemoryStore({f"node-{i}": s for i, s in enumerate(series)}, victoria=victoria)
    window = Window(float(since), float(since + length), float(lookback))
    expected = {k: v for k, s in store.series.items() if (v := exact(s, window, victoria)) is not None}
    found = growth_through_the_api(store, window)
    assert found.keys() == expected.keys()
    for instance, value in expected.items():
        assert found[instance] == pytest.approx(value, abs=1e-9), instance


def test_a_series_without_resets_costs_three_queries() -> None:
    # 0, 10, ... 600 s, growing by 1 each: over (100, 500] it grows 40.
    store = MemoryStore({"n": [(float(t), t / 10) for t in range(0, 601, 10)]})
    assert growth_through_the_api(store, Window(100.0, 500.0, 60.0)) == {"n": pytest.approx(40.0)}
    assert len(store.queries) == 3


def test_a_restart_is_found_and_counted_whole() -> None:
    # Sampled every 30 s, grows 1 a second to 3,000 at 3,000 s; restarts at 3,600 s and grows
    # again (30 at 3,630 s, 6,000 at 9,600 s). Over (990, 9,600]: 3,000 - 990 = 2,010 before the
    # restart, 6,000 from 0 after it: 8,010.
    before = [(float(t), float(t)) for t in range(0, 3001, 30)]
    after = [(float(t), float(t - 3600)) for t in range(3630, 9601, 30)]
    store = MemoryStore({"n": before + after})
    assert growth_through_the_api(store, Window(990.0, 9600.0)) == {"n": pytest.approx(8010.0)}
    # From 1,000 s, the last sample before the edge is still at 990 s: the 10 s between them
    # count in the window (a scrape interval's growth at most, as README says): 8,010 again.
    assert growth_through_the_api(store, Window(1000.0, 9600.0)) == {"n": pytest.approx(8010.0)}
    assert len(store.queries) > 3  # the reset was narrowed down


@st.composite
def restarting(draw: st.DrawFn) -> tuple[Samples, Samples]:
    """A node's counter and its polls since the agent started, scraped together, over runs of
    the agent: each run's counter starts anywhere (time the agent was down, booked as it starts,
    can exceed what the run before counted), its polls from 1 (scraped at least twice a run)."""
    times = sorted(draw(st.sets(st.integers(0, 300), min_size=2, max_size=40)))
    counter: Samples = []
    polls: Samples = []
    for t in times:
        restart = len(polls) >= 2 and polls[-1][1] >= 2 and draw(st.integers(0, 7)) == 0
        if not polls or restart:
            counter.append((float(t), float(draw(st.integers(0, 500)))))
            polls.append((float(t), 1.0))
        else:
            counter.append((float(t), counter[-1][1] + draw(st.integers(0, 50))))
            polls.append((float(t), polls[-1][1] + 1))
    return counter, polls


@pytest.mark.usefixtures("small_parts")
@settings(max_examples=300)
@given(
    nodes=st.lists(restarting(), min_size=1, max_size=3),
    since=st.integers(0, 250),
    length=st.integers(1, 200),
    lookback=st.integers(1, 60),
    victoria=st.booleans(),
)
@example(  # down longer before the second start than before the first: 5, then 12 from 0
    nodes=[([(0.0, 0.0), (10.0, 1.0), (20.0, 5.0), (30.0, 5.0), (40.0, 12.0), (50.0, 12.0)],
            [(0.0, 1.0), (10.0, 2.0), (20.0, 1.0), (30.0, 2.0), (40.0, 1.0), (50.0, 2.0)])],
    since=0, length=50, lookback=10, victoria=False,
)  # fmt: skip
def test_after_a_restart_a_counter_counts_from_0_whatever_its_value(
    nodes: list[tuple[Samples, Samples]], since: int, length: int, lookback: int, victoria: bool
) -> None:
    counters_of = {f"node-{i}": counter for i, (counter, _) in enumerate(nodes)}
    polls_of = {f"node-{i}": polls for i, (_, polls) in enumerate(nodes)}
    store = MemoryStore(counters_of, victoria=victoria, others={RESTART_COUNTER: polls_of})
    window = Window(float(since), float(since + length), float(lookback))
    starts = {k: {t for t, v in polls if v == 1.0} for k, polls in polls_of.items()}
    expected = {}
    for instance, samples in counters_of.items():
        # Sample by sample, as `exact` counts, but from 0 at each start of the agent.
        early = [(t, v) for t, v in samples if (window.since - window.lookback_s < t if victoria
                 else window.since - window.lookback_s <= t) and t <= window.since]  # fmt: skip
        inside = [(t, v) for t, v in samples if window.since < t <= window.until]
        if not inside and not any(t == window.since for t, _ in samples if not victoria):
            continue
        previous = early[-1][1] if early else None
        total = 0.0
        for t, value in inside:
            total += growth(None if t in starts[instance] else previous, value)
            previous = value
        expected[instance] = total
    with PrometheusAPI("http://store:9090", transport=httpx.MockTransport(store.handle)) as api:
        restarts = agent_restarts(api, window, node_label="instance")
        found = counter_growth(api, "c_total", window, node_label="instance", restarts=restarts)
    assert {dict(labels)["instance"]: value for labels, value in found.items()} == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(
    ("baseline", "stretches", "expected"),
    [
        (None, [Stretch(5, 9)], 9),  # born in the window: all of it
        (4, [Stretch(5, 9)], 5),
        (7, [Stretch(5, 9)], 9),  # fell from 7 to 5: reset, counted from 0
        (4, [Stretch(5, 9), Stretch(2, 3)], 8),  # 5 + (9 -> 2 is a reset) 3
        (4, [Stretch(math.nan, math.nan), Stretch(6, 6)], 2),  # a staleness marker is no sample
        # VictoriaMetrics keeps 12 significant digits: a counter that did not move can come back
        # a hair lower. Not a reset (that would count all 0.2193... again).
        (0.219356017477, [Stretch(0.21935601747699998, 0.21935601747699998)], 0.0),
    ],
)
def test_increase(baseline: float | None, stretches: list[Stretch], expected: float) -> None:
    assert increase(baseline, stretches) == expected
