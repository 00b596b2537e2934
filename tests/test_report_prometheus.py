"""`gpuledger report --prometheus URL` against a real Prometheus equals `report --ledger` on the
same nodes, for windows that cut through workloads and across an agent restart.

The store holds what the agents exported, recorded on scenario time (tests/promstore.py) and
backfilled with promtool, so a window of the store is a window of the ledger to the second:

    gpu-node-01  demo           0-3h, agent down 3h-4h, restarted 4h-8h (every counter resets)
    gpu-node-07  weekend-idle   0-8h; its job ends at 4h and its series end an hour later
    gpu-node-03  demo           0-8h, in a store of its own, scraped every 35 minutes
    gpu-node-02  demo           0-3h, down 3h-4h, 4h-5h, down 5h-7h, 7h-8h, in a store of its own

Where samples fall on the hour (every 5 minutes, from the hour) the two reports are the same to
float rounding; where they do not (gpu-node-03), they differ by at most what a counter grows in
one scrape interval at each edge (the precision README states). The store's errors are one line
each, exit 2.
"""

from __future__ import annotations

import http.server
import json
import math
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.core import Metric

from agent.cli.wiring import build_agent
from agent.config import Settings
from agent.fleet.promapi import EmptyStore, PrometheusAPI
from agent.fleet.report import ALL_COUNTERS, PROBE_COUNTER, StoreQuery, report_from_prometheus
from agent.fleet.source import RESTART_COUNTER
from agent.ledger.report import Report, ReportLine, render, report_from_ledgers
from agent.model import Workload
from tests import promstore
from tests.promstore import Scrape
from tests.test_cli import gpuledger
from tests.test_prometheus_e2e import free_port
from tests.test_report_html import figures as page_figures
from tests.test_report_html import read_page
from tests.test_webconfig import Pki, _cryptography_pki

pytestmark = [
    pytest.mark.skipif(
        promstore.PROMETHEUS is None or promstore.PROMTOOL is None,
        reason="prometheus and promtool are missing: apt-get install prometheus (Debian's package)",
    ),
    # One worker starts its stores, whatever the others run (pyproject's --dist loadgroup).
    pytest.mark.xdist_group("prometheus-store"),
]

H = 3600.0
START = "2025-03-07T18:00:00+00:00"  # a Friday evening, in the past: Prometheus backfills history
T0 = datetime.fromisoformat(START).timestamp()
POLL_S = 300.0  # the agent polls, and is scraped, every 5 minutes of scenario time
PRICE = 2.5  # $/GPU-hour, every GPU (pricing.gpu_hourly)
GPUS = 8
SETTINGS = Settings.model_validate(
    {
        "pricing": {"gpu_hourly": PRICE, "energy_per_kwh": 0.12},
        # Polls 5 minutes apart are this run's rhythm, not a gap (the default limit is 5m).
        "accounting": {"max_interval": "10m"},
        "attribution": {
            "rules": [
                {"match": {"namespace": "^research-"}, "set": {"team": "research"}},
                {"match": {"account": "^nlp$"}, "set": {"team": "nlp"}},
                {"match": {"account": "^research$"}, "set": {"team": "research"}},
            ]
        },
    }
)
# The series `report --prometheus` reads: the store is given these only (the rest of a scrape is
# hundreds of series it never asks for, and would only slow the backfill down).
READ = frozenset((PROBE_COUNTER, RESTART_COUNTER, *ALL_COUNTERS))
FIGURES = ("dollars", "charged_s", "busy_s", "joules", "energy_dollars", "waste_dollars", "unmeasured_s", "efficiency")


def scenario(name: str, hostname: str) -> dict[str, Any]:
    path = Path(__file__).resolve().parent.parent / "fake_nvml" / "scenarios" / f"{name}.yaml"
    loaded: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    loaded["start"] = START
    loaded["node"]["hostname"] = hostname
    return loaded


def run_node(
    name: str, hostname: str, ledger: Path, spans: Sequence[tuple[float, float]], scrape_every: int = 1
) -> list[Scrape]:
    """The agent on a fake node, run over each (start, end) of scenario time in turn, each run a
    fresh agent on the same ledger (a restart: its counters start from 0)."""
    scrapes: list[Scrape] = []
    for start, end in spans:
        agent = build_agent(SETTINGS, fake=scenario(name, hostname), ledger_path=ledger, poll_interval_s=POLL_S)
        try:
            assert agent.node is not None
            agent.node.clock.advance(start)
            promstore.record(agent, duration_s=end - start, poll_s=POLL_S, scrape_every=scrape_every, scrapes=scrapes)
        finally:
            agent.close()
    return scrapes


@dataclass
class Store:
    api: PrometheusAPI
    ledgers: list[Path]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """gpu-node-01 (restarted) and gpu-node-07 (its job leaves its GPUs idle) in one store."""
    work = tmp_path_factory.mktemp("fleet")
    demo = run_node("demo", "gpu-node-01", work / "node-01.db", [(0.0, 3 * H), (4 * H, 8 * H)])
    weekend = run_node("weekend-idle", "gpu-node-07", work / "node-07.db", [(0.0, 8 * H)])
    metrics = promstore.with_target(demo, {"job": "gpuledger", "instance": "gpu-node-01"}, READ)
    metrics += promstore.with_target(weekend, {"job": "gpuledger", "instance": "gpu-node-07"}, READ)
    promstore.backfill_prometheus(metrics, work / "data", work)
    with promstore.prometheus(work / "data", work) as server, PrometheusAPI(server.url) as api:
        yield Store(api, [work / "node-01.db", work / "node-07.db"])


@pytest.fixture(scope="module")
def sparse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """gpu-node-03 scraped every 7th poll (35 minutes): no sample falls on 20:00 or 00:00."""
    work = tmp_path_factory.mktemp("sparse")
    scrapes = run_node("demo", "gpu-node-03", work / "node-03.db", [(0.0, 8 * H)], scrape_every=7)
    metrics = promstore.with_target(scrapes, {"instance": "gpu-node-03"}, READ)
    promstore.backfill_prometheus(metrics, work / "data", work)
    with promstore.prometheus(work / "data", work) as server, PrometheusAPI(server.url) as api:
        yield Store(api, [work / "node-03.db"])


@pytest.fixture(scope="module")
def restarted_twice(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """gpu-node-02, whose agent was down 3h-4h and again, longer, 5h-7h."""
    work = tmp_path_factory.mktemp("restarted-twice")
    spans = [(0.0, 3 * H), (4 * H, 5 * H), (7 * H, 8 * H)]
    scrapes = run_node("demo", "gpu-node-02", work / "node-02.db", spans)
    metrics = promstore.with_target(scrapes, {"instance": "gpu-node-02"}, READ)
    promstore.backfill_prometheus(metrics, work / "data", work)
    with promstore.prometheus(work / "data", work) as server, PrometheusAPI(server.url) as api:
        yield Store(api, [work / "node-02.db"])


@contextmanager
def backfilled(metrics: Sequence[Metric], work: Path) -> Iterator[PrometheusAPI]:
    """A Prometheus server holding `metrics`, backfilled under `work`, and its query API."""
    promstore.backfill_prometheus(metrics, work / "data", work)
    with promstore.prometheus(work / "data", work) as server, PrometheusAPI(server.url) as api:
        yield api


@pytest.fixture(scope="module")
def unscraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """gpu-node-05, its agent running 0-6h, with no scrape in the store after 1:00 until 3:30
    (the store was down): its counters ran on meanwhile."""
    work = tmp_path_factory.mktemp("unscraped")
    scrapes = run_node("demo", "gpu-node-05", work / "node-05.db", [(0.0, 6 * H)])
    kept = [s for s in scrapes if not T0 + 1 * H < s.at < T0 + 3.5 * H]
    with backfilled(promstore.with_target(kept, {"instance": "gpu-node-05"}, READ), work) as api:
        yield Store(api, [work / "node-05.db"])


@pytest.fixture(scope="module")
def pod_targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """gpu-node-01 (demo) and gpu-node-07 (weekend-idle) scraped as pods with the agent pod's own
    `namespace` and `pod` as target labels (what deploy/prometheus/README.md says to drop): they
    win, and a workload's own labels of those names arrive as exported_namespace, exported_pod."""
    work = tmp_path_factory.mktemp("pod-targets")
    target = {"job": "gpuledger", "namespace": "gpuledger", "pod": "gpuledger-x7k2p"}
    metrics = []
    for name, node in (("demo", "gpu-node-01"), ("weekend-idle", "gpu-node-07")):
        scrapes = run_node(name, node, work / f"{node}.db", [(0.0, 8 * H)])
        metrics += promstore.with_target(scrapes, {**target, "instance": node}, READ)
    with backfilled(metrics, work) as api:
        yield Store(api, [work / "gpu-node-01.db", work / "gpu-node-07.db"])


def both(store: Store, since_h: float, until_h: float, by: Sequence[str]) -> tuple[Report, Report]:
    since, until = T0 + since_h * H, T0 + until_h * H
    return (
        report_from_prometheus(store.api, StoreQuery(since, until), by=by),
        report_from_ledgers(store.ledgers, by=by, since=since, until=until),
    )


def figures(line: ReportLine) -> dict[str, float | None]:
    return {name: getattr(line, name) for name in FIGURES}


def assert_same(prometheus: Report, ledger: Report, rel: float = 1e-9) -> None:
    """Same groups, same figures (float sums in another order: to 1e-9)."""
    # Lines of equal dollars may come in either order (their sums differ in the last bit).
    theirs_by_key = {line.key: line for line in ledger.lines}
    assert sorted(line.key for line in prometheus.lines) == sorted(theirs_by_key)
    pairs = [*((line, theirs_by_key[line.key]) for line in prometheus.lines), (prometheus.idle, ledger.idle),
             (prometheus.unobserved, ledger.unobserved), (prometheus.total, ledger.total)]  # fmt: skip
    for ours, theirs in pairs:
        assert figures(ours) == {
            name: None if value is None else pytest.approx(value, rel=rel, abs=1e-9)
            for name, value in figures(theirs).items()
        }, ours.key
    # Who left GPUs idle: the same workloads, the same time and dollars. (Energy by last holder
    # is the GPU's idle energy split by idle seconds where the store is read: not compared.)
    theirs_left = {line.left_by: line for line in ledger.idle_by}
    assert sorted(map(str, (line.left_by for line in prometheus.idle_by))) == sorted(map(str, theirs_left))
    for line in prometheus.idle_by:
        other = theirs_left[line.left_by]
        assert (line.dollars, line.charged_s) == (
            pytest.approx(other.dollars, rel=rel, abs=1e-9),
            pytest.approx(other.charged_s, rel=rel, abs=1e-9),
        ), line.left_by


@pytest.mark.parametrize(
    ("since_h", "until_h", "by"),
    [
        (0, 8, ("namespace", "hpc_job")),  # everything: each series counted from its birth
        (1, 7, ("namespace", "hpc_job")),  # across the restart and the weekend job's end
        (2, 6, ("team",)),
        (1, 5, ("model",)),
        (2, 7, ("node", "gpu")),
        (3, 5, ("user", "hpc_job")),  # from the hour the agent was down (3h-4h) on
        (5, 8, ("pod",)),  # after the restart: the weekend job's series have ended
    ],
)
def test_report_from_prometheus_is_the_ledgers_report(
    fleet: Store, since_h: float, until_h: float, by: Sequence[str]
) -> None:
    prometheus, ledger = both(fleet, since_h, until_h, by)
    assert_same(prometheus, ledger)
    # TOTAL is every GPU-hour of the window, charged, idle or unobserved: 2 nodes x 8 GPUs x its
    # hours, at $2.50 each (from 1h to 7h: 2 x 8 x 6 h = 96 GPU-hours, $240.00).
    assert prometheus.total.gpu_hours_charged == pytest.approx(2 * GPUS * (until_h - since_h), rel=1e-9)
    assert prometheus.total.dollars == pytest.approx(2 * GPUS * (until_h - since_h) * PRICE, rel=1e-9)


def test_mig_instances_use_is_unknown_from_prometheus_as_from_the_ledger(tmp_path: Path) -> None:
    """gpu-mig-01 for 2 h: GPU 0's two 3g.40gb instances (an A100 has no GPM) have no busy figure."""
    scrapes = run_node("mig", "gpu-mig-01", tmp_path / "mig.db", [(0.0, 2 * H)])
    metrics = promstore.with_target(scrapes, {"instance": "gpu-mig-01"}, READ)
    promstore.backfill_prometheus(metrics, tmp_path / "data", tmp_path)
    with promstore.prometheus(tmp_path / "data", tmp_path) as server, PrometheusAPI(server.url) as api:
        prometheus, ledger = both(Store(api, [tmp_path / "mig.db"]), 0, 2, ("gpu",))
    assert_same(prometheus, ledger)
    mig = next(line for line in prometheus.lines if line.key == ("gpu-mig-01", "0"))
    # 2 h x 84/108 of the GPU, none of it measured: no efficiency, no waste.
    assert mig.unmeasured_s == pytest.approx(2 * H * 84 / 108, rel=1e-9)
    assert (mig.efficiency, mig.waste_dollars) == (None, None)


def test_the_restart_shows_as_unobserved_time(fleet: Store) -> None:
    prometheus, ledger = both(fleet, 2, 6, ("node",))
    # gpu-node-01's agent was down 3h-4h: 8 GPUs x 1 h x $2.50 = $20.00, unobserved, in both.
    assert prometheus.unobserved.dollars == pytest.approx(8 * 1 * 2.5, rel=1e-9)
    assert prometheus.unobserved.charged_s == pytest.approx(8 * H, rel=1e-9)
    assert ledger.unobserved.dollars == pytest.approx(prometheus.unobserved.dollars, rel=1e-9)


def test_downtime_is_counted_when_the_agent_books_it(fleet: Store) -> None:
    """The one figure that is not where the ledger has it: an agent books the time it was down
    when it starts again (as unobserved, reason agent_down), so its counter holds that time from
    the restart on, while the ledger puts it in the hours it covers. A window that begins while
    an agent was down counts all of that downtime."""
    prometheus, ledger = both(fleet, 4, 6, ("namespace", "hpc_job"))
    # gpu-node-01 was down 3h-4h, booked at 4h: 8 GPUs x 1 h x $2.50 = $20.00 more.
    assert prometheus.unobserved.dollars - ledger.unobserved.dollars == pytest.approx(20.0, rel=1e-9)
    assert prometheus.total.dollars - ledger.total.dollars == pytest.approx(20.0, rel=1e-9)
    assert_same(replace(prometheus, unobserved=ledger.unobserved, total=ledger.total), ledger)


def test_a_longer_downtime_after_a_restart_is_counted_whole(restarted_twice: Store) -> None:
    """Each restart books the time its agent was down as it starts (unobserved, agent_down): $2.50
    a GPU for 3h-4h, then $5.00 a GPU for 5h-7h. The second counter never falls below the first,
    yet it counted from 0: it is $5.00 a GPU of growth, not $5.00 - $2.50."""
    prometheus, ledger = both(restarted_twice, 0, 8, ("namespace", "hpc_job"))
    assert_same(prometheus, ledger)
    # Down 1 h + 2 h: 8 GPUs x 3 h x $2.50 = $60.00 unobserved, of 8 x 8 h x $2.50 = $160.00.
    assert prometheus.unobserved.dollars == pytest.approx(60.0, rel=1e-9)
    assert prometheus.total.dollars == pytest.approx(160.0, rel=1e-9)
    # From 4:30: 8 GPUs x 1.5 h observed (4:30-5:00, 7:00-8:00) x $2.50 = $30.00, and the 5h-7h
    # downtime booked at 7h, 8 x 2 h x $2.50 = $40.00.
    since, until = T0 + 4.5 * H, T0 + 8 * H
    late = report_from_prometheus(restarted_twice.api, StoreQuery(since, until), by=("node",))
    assert late.unobserved.dollars == pytest.approx(40.0, rel=1e-9)
    assert late.total.dollars == pytest.approx(70.0, rel=1e-9)


def test_idle_is_broken_down_by_who_left_it(fleet: Store) -> None:
    prometheus, ledger = both(fleet, 2, 8, ("hpc_job",))
    assert prometheus.idle.dollars == pytest.approx(ledger.idle.dollars, rel=1e-9)
    left = {(line.left_by or Workload()).hpc_job: line for line in prometheus.idle_by}
    # Job 9001 held gpu-node-07's 8 GPUs until 4h and left them idle until 8h. Its end is seen
    # between the polls at 3:55 and 4:00, so idle begins at the midpoint, 3:57:30: 8 GPUs x
    # (4 h + 2.5 min) x $2.50 = $80.83.
    assert left["9001"].dollars == pytest.approx(8 * (4 + 2.5 / 60) * 2.5, rel=1e-9)
    assert left["9001"].charged_s == pytest.approx(8 * (4 * H + 150), rel=1e-9)
    # gpu-node-01's GPU 6, which nobody ever held, idle from 2h to 8h but for the hour its agent
    # was down (3h-4h, unobserved): 1 GPU x 5 h x $2.50 = $12.50.
    assert left[""].dollars == pytest.approx(5 * 2.5, rel=1e-9)
    assert left[""].left_by == Workload()
    assert set(left) == {"9001", ""}
    # Every joule of idle energy is somewhere among them.
    assert math.fsum(line.joules for line in prometheus.idle_by) == pytest.approx(prometheus.idle.joules, rel=1e-9)
    assert "(idle) left by job 9001 (dave)" in render(prometheus)


def test_edges_between_samples_are_off_by_at_most_a_scrape_interval(sparse: Store) -> None:
    prometheus, ledger = both(sparse, 2, 6, ("namespace", "hpc_job"))
    assert [line.key for line in prometheus.lines] == [line.key for line in ledger.lines]
    # A window's edge falls between two samples 35 minutes apart, so what the node's 8 GPUs cost
    # in up to 35 minutes is counted on the wrong side of it: at most 8 x $2.50/h x 35/60 h =
    # $11.67 at each edge.
    bound = GPUS * PRICE * 35 / 60
    difference = prometheus.total.dollars - ledger.total.dollars
    assert abs(difference) <= 2 * bound
    # Samples every 35 minutes from 18:35: the last before 20:00 is at 19:45, so 15 minutes before
    # the window count in it; the last before 00:00 is at 23:50, so its last 10 minutes do not.
    # The node costs 8 GPUs x $2.50 = $20.00 an hour whoever holds it: +5 minutes, +$1.67.
    assert difference == pytest.approx(GPUS * PRICE * 5 / 60, rel=1e-6)


def test_a_gap_in_the_store_across_the_windows_start_counts_from_the_sample_before_it(unscraped: Store) -> None:
    """The last sample before 3:00 is at 1:00, further back than the lookback (1h): the counters
    grew from it, not from 0 (all they counted since the agent started at 0:00)."""
    since, until = T0 + 3 * H, T0 + 6 * H
    prometheus = report_from_prometheus(unscraped.api, StoreQuery(since, until), by=("namespace", "hpc_job"))
    # What grew in the gap, 1:00 to 3:30, counts inside the window, as at any edge between two
    # samples: the figures are the ledger's from 1:00, 8 GPUs x 5 h x $2.50 = $100.00 (not
    # 8 x 6 h x $2.50 = $120.00, 48 GPU-hours in a window of 24).
    assert_same(
        prometheus, report_from_ledgers(unscraped.ledgers, by=("namespace", "hpc_job"), since=T0 + 1 * H, until=until)
    )
    assert prometheus.total.dollars == pytest.approx(GPUS * 5 * PRICE, rel=1e-9)
    assert prometheus.total.gpu_hours_charged == pytest.approx(GPUS * 5, rel=1e-9)


def test_target_labels_named_like_workload_labels_are_not_the_workloads(pod_targets: Store) -> None:
    prometheus, ledger = both(pod_targets, 2, 8, ("namespace", "hpc_job"))
    assert_same(prometheus, ledger)
    # Slurm job 9001 has no namespace of its own: the agent pod's `gpuledger` is not its.
    jobs = {line.key: line for line in prometheus.lines}
    assert ("", "9001") in jobs
    assert not [key for key in jobs if key[0] == "gpuledger"]
    # Job 9001 left gpu-node-07's 8 GPUs idle at 3:57:30 (midway between the polls that saw it
    # end) until 8h: 8 x (4 h + 2.5 min) x $2.50 = $80.83, under its name, not the agent pod's;
    # and that idle time's energy is the job's too (none is left to "nobody known").
    holders = [line.left_by or Workload() for line in prometheus.idle_by]
    assert not [holder for holder in holders if "gpuledger" in (holder.namespace, holder.pod)]
    left = {(line.left_by or Workload()).hpc_job: line for line in prometheus.idle_by}
    assert left["9001"].dollars == pytest.approx(8 * (4 + 2.5 / 60) * 2.5, rel=1e-9)
    assert left["9001"].joules > 0


def test_a_window_the_store_has_no_series_for_is_an_empty_store(fleet: Store) -> None:
    with pytest.raises(EmptyStore, match="no gpuledger series"):
        report_from_prometheus(fleet.api, StoreQuery(T0 - 30 * 86400, T0 - 29 * 86400), by=("team",))


def test_the_cli_prints_the_report_from_prometheus(fleet: Store) -> None:
    since, until = T0 + 2 * H, T0 + 6 * H
    result = gpuledger(
        "report", "--prometheus", f"{fleet.api.url}/api/v1/", "--since", iso(since), "--until", iso(until),
        "--by", "team", "--format", "json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    ledger = report_from_ledgers(fleet.ledgers, by=("team",), since=since, until=until)
    document = json.loads(result.stdout)
    assert document["total"]["dollars"] == pytest.approx(ledger.total.dollars, rel=1e-9)
    assert {row["team"]: row["dollars"] for row in document["rows"]} == {
        line.key[0]: pytest.approx(line.dollars, rel=1e-9) for line in ledger.lines
    }
    assert document["since"] == "2025-03-07T20:00:00Z"


def test_the_html_page_from_prometheus_is_its_report_without_hours_or_advice(fleet: Store) -> None:
    since, until = T0 + 2 * H, T0 + 6 * H
    common = ("report", "--prometheus", fleet.api.url, "--since", iso(since), "--until", iso(until), "--by", "team")
    result = gpuledger(*common, "--format", "html")
    assert result.returncode == 0, result.stderr
    document = json.loads(gpuledger(*common, "--format", "json").stdout)
    page = read_page(result.stdout)
    # Two nodes x 8 GPUs x 4 h x $2.5 = $320: every GPU-hour of the window, the agent's downtime included.
    assert page.tiles["total_dollars"] == document["total"]["dollars"] == pytest.approx(2 * GPUS * 4 * PRICE)
    groups = [r for r in page.tables["rows"] if r["attrs"]["data-kind"] == "group"]
    assert {json.loads(r["attrs"]["data-key"])["team"]: page_figures(r)["dollars"] for r in groups} == {
        row["team"]: row["dollars"] for row in document["rows"]
    }
    # A store's report reads whole-window growth: no hours to chart; right-sizing reads ledgers.
    assert "over-time-table" not in page.tables
    assert "Spend over time comes from ledgers" in result.stdout
    assert "Right-sizing advice comes from ledgers" in result.stdout
    assert page.svgs == 3  # idle by left_by, waste, efficiency


def iso(t: float) -> str:
    return datetime.fromtimestamp(t).astimezone().isoformat()


# --- the store's errors: one line each, exit 2 ----------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    answer: Callable[[_Handler], None]
    seen: list[Mapping[str, str]]

    def do_POST(self) -> None:
        self.seen.append(dict(self.headers))
        self.answer()

    def do_GET(self) -> None:
        self.do_POST()

    def log_message(self, *_args: Any) -> None:
        pass

    def reply(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def http_server() -> Iterator[Callable[..., tuple[str, list[Mapping[str, str]]]]]:
    """Starts a server answering every request with `answer` (over TLS with `tls`); returns its
    URL and the headers of the requests it saw."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def serve(answer: Callable[[_Handler], None], tls: Pki | None = None) -> tuple[str, list[Mapping[str, str]]]:
        seen: list[Mapping[str, str]] = []
        handler = type("Handler", (_Handler,), {"answer": answer, "seen": seen})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls.server_cert, tls.server_key)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        scheme = "https" if tls is not None else "http"
        return f"{scheme}://127.0.0.1:{server.server_address[1]}", seen

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def one_line_exit_2(result: Any, *words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_an_unreachable_store_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    one_line_exit_2(gpuledger("report", "--prometheus", url), url, "cannot connect")


def test_a_store_url_is_named_without_its_credentials() -> None:
    # The message quoted the URL whole: its password and token went to stderr, and on to the log.
    port = free_port()
    result = gpuledger("report", "--prometheus", f"http://reader:s3cretpw@127.0.0.1:{port}/?token=abc123xyz")
    one_line_exit_2(result, f"http://127.0.0.1:{port}", "cannot connect")
    assert "s3cretpw" not in result.stderr
    assert "abc123xyz" not in result.stderr


def test_a_url_that_is_not_a_prometheus_api_is_one_line(http_server: Any) -> None:
    url, _ = http_server(lambda h: h.reply(200, "text/html", b"<html><body>Grafana</body></html>"))
    one_line_exit_2(gpuledger("report", "--prometheus", url), "not a Prometheus query API", "text/html")


def test_a_query_that_does_not_answer_in_time_is_one_line() -> None:
    with socket.socket() as listener:  # accepts, and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        result = gpuledger("report", "--prometheus", url, "--query-timeout", "1s")
    one_line_exit_2(result, "no answer within 1s", "--query-timeout")


def test_an_empty_store_is_one_line(fleet: Store) -> None:
    # The store holds nothing before 2025-03-07: for that window it is an empty store.
    result = gpuledger("report", "--prometheus", fleet.api.url, "--since", "2025-01-01", "--until", "2025-02-01")
    one_line_exit_2(result, "no gpuledger series from 2025-01-01T00:00:00Z to 2025-02-01T00:00:00Z")


def test_credentials_and_headers_go_with_every_query(http_server: Any, tmp_path: Path) -> None:
    empty = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
    url, seen = http_server(lambda h: h.reply(200, "application/json", empty))
    token = tmp_path / "token"
    token.write_text("s3cret\n", encoding="utf-8")
    result = gpuledger(
        "report", "--prometheus", url, "--bearer-token-file", str(token), "--header", "X-Scope-OrgID: team-a",
        "--header", "X-Other:b",
    )  # fmt: skip
    one_line_exit_2(result, "no gpuledger series")  # the store answered: it holds nothing
    assert seen, "no query reached the store"
    for headers in seen:
        assert headers["Authorization"] == "Bearer s3cret"
        assert (headers["X-Scope-OrgID"], headers["X-Other"]) == ("team-a", "b")


def test_a_store_that_wants_credentials_says_so(http_server: Any) -> None:
    url, _ = http_server(lambda h: h.reply(401, "text/plain", b"Unauthorized"))
    one_line_exit_2(gpuledger("report", "--prometheus", url), "HTTP 401", "--bearer-token-file")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--prometheus", "prometheus:9090"), ("expected an http:// or https:// URL",)),
        (("--prometheus", "http://x", "--header", "no colon"), ("--header", "Name: value")),
        (("--prometheus", "http://x", "--bearer-token-file", "/nonexistent/token"), ("--bearer-token-file",)),
        (("--prometheus", "http://x", "--query-timeout", "soon"), ("--query-timeout",)),
        (("--prometheus", "http://x", "--ledger", "x.db"), ("--ledger and --prometheus",)),
        (("--prometheus", "http://x", "--runs", "--by", "hpc_job"), ("--runs reads ledgers",)),
    ],
)
def test_bad_store_options_are_one_line(args: tuple[str, ...], words: tuple[str, ...]) -> None:
    one_line_exit_2(gpuledger("report", *args), *words)


def test_a_tls_store_is_verified_against_the_ca_file(http_server: Any, tmp_path: Path) -> None:
    pki = _cryptography_pki(tmp_path)  # a self-signed server certificate for 127.0.0.1
    empty = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
    url, seen = http_server(lambda h: h.reply(200, "application/json", empty), tls=pki)
    # Not trusted: one line naming the failure.
    one_line_exit_2(gpuledger("report", "--prometheus", url), "cannot connect", "CERTIFICATE_VERIFY_FAILED")
    assert not seen
    # Trusted through --ca-file, or not checked: the store answers (and holds nothing).
    one_line_exit_2(gpuledger("report", "--prometheus", url, "--ca-file", str(pki.server_cert)), "no gpuledger series")
    one_line_exit_2(gpuledger("report", "--prometheus", url, "--insecure-skip-verify"), "no gpuledger series")
    assert seen
    bogus = tmp_path / "ca.pem"
    bogus.write_text("not a certificate\n", encoding="utf-8")
    one_line_exit_2(gpuledger("report", "--prometheus", url, "--ca-file", str(bogus)), "--ca-file")
