"""Real metrics stores for the tests and benchmarks: an agent's scrapes recorded on scenario time
and written into a real Prometheus (promtool's backfill) or a real VictoriaMetrics (its import
API), and the servers started on them.

Recording on scenario time, rather than scraping a sped-up agent, stamps every sample with the
scenario's own clock: a window of the store is then a window of the ledger, to the second, and
a sample can fall exactly on an hour's edge. The exposition is the agent's own (its registry,
collected as a scrape collects it); only the target labels a scrape adds are added here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_text
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

from agent.cli.wiring import Agent
from agent.pipeline import run_on_scenario_time
from tests.test_prometheus_e2e import Process, free_port, start, wait_http

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
VICTORIA_METRICS = shutil.which("victoria-metrics") or shutil.which("victoria-metrics-prod")


@dataclass
class Scrape:
    at: float  # unix seconds
    metrics: list[Metric]


def record(
    agent: Agent,
    *,
    duration_s: float,
    poll_s: float,
    scrape_every: int = 1,
    scrapes: list[Scrape] | None = None,
) -> list[Scrape]:
    """Run `agent` on its fake node's clock for `duration_s`, polling every `poll_s` (the
    daemon's jobs, ledger flushes included), and collect its registry after every
    `scrape_every`-th poll, stamped with the scenario's wall clock. Appends to `scrapes`."""
    node = agent.node
    assert node is not None
    registry = agent.registry()
    out = scrapes if scrapes is not None else []
    steps = 0

    def after_step() -> None:
        nonlocal steps
        steps += 1
        if steps % scrape_every == 0:
            out.append(Scrape(node.clock.wall_time(), list(registry.collect())))

    run_on_scenario_time(agent.pipeline.jobs(), node.clock.advance, duration_s, poll_s, on_step=after_step)
    return out


def with_target(
    scrapes: Iterable[Scrape], target: Mapping[str, str], keep: Collection[str] | None = None
) -> list[Metric]:
    """Every scrape's samples stamped with its time and labelled with `target` (the labels a
    scrape job adds: job, instance, ...), one family per metric name as OpenMetrics wants; only
    the samples named in `keep`, where given (a store holds everything; a test reads a few).
    As Prometheus does (honor_labels: false), a target label wins over the sample's own of the
    same name, which is kept as exported_<name> where it has a value."""
    families: dict[str, Metric] = {}
    for scrape in scrapes:
        for metric in scrape.metrics:
            if keep is not None and not any(s.name in keep for s in metric.samples[:1]):
                continue
            family = families.get(metric.name)
            if family is None:
                family = families[metric.name] = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            family.samples.extend(
                Sample(s.name, _scraped(s.labels, target), s.value, scrape.at) for s in metric.samples
            )
    return list(families.values())


def _scraped(labels: Mapping[str, str], target: Mapping[str, str]) -> dict[str, str]:
    own = {name: value for name, value in labels.items() if name not in target}
    own |= {f"exported_{name}": value for name, value in labels.items() if name in target and value}
    return {**own, **target}


class _Families(Collector):
    def __init__(self, metrics: Sequence[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self._metrics


def openmetrics(metrics: Sequence[Metric]) -> bytes:
    """One OpenMetrics document (with timestamps) holding `metrics`: what promtool backfills."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(metrics))
    return openmetrics_text(registry)


def backfill_prometheus(metrics: Sequence[Metric], data_dir: Path, work: Path) -> None:
    """Write `metrics` into a Prometheus TSDB at `data_dir` with `promtool tsdb
    create-blocks-from openmetrics`, as an operator backfills history."""
    assert PROMTOOL is not None
    source = work / "backfill.om"
    source.write_bytes(openmetrics(metrics))
    data_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", str(source), str(data_dir)],
        check=True,
        capture_output=True,
        timeout=120,
    )


@dataclass
class Server:
    url: str
    process: Process
    extra: list[Process] = field(default_factory=list)

    def stop(self) -> None:
        for process in (*self.extra, self.process):
            process.stop()


@contextmanager
def prometheus(
    data_dir: Path, work: Path, args: Sequence[str] = (), config: Mapping[str, object] | None = None
) -> Iterator[Server]:
    """A Prometheus server on `data_dir`, keeping everything in it (a backfill may be old)."""
    assert PROMETHEUS is not None
    config_file = work / "prometheus.yml"
    config_file.write_text(json.dumps(config or {"global": {"scrape_interval": "1m"}}), encoding="utf-8")
    web = f"127.0.0.1:{free_port()}"
    process = start(
        "prometheus",
        [
            PROMETHEUS,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={data_dir}",
            "--storage.tsdb.retention.time=100y",
            f"--web.listen-address={web}",
            "--log.level=warn",
            *args,
        ],
        work / "prometheus.log",
    )
    server = Server(f"http://{web}", process)
    try:
        wait_http(process, f"{server.url}/-/ready")
        yield server
    finally:
        server.stop()


@contextmanager
def victoria_metrics(work: Path, args: Sequence[str] = ()) -> Iterator[Server]:
    """A VictoriaMetrics single-node server keeping its data under `work`. Samples are visible to
    queries as soon as they are in (no 30 s latency offset) and nothing is cached between
    queries: the tests read what was just written."""
    assert VICTORIA_METRICS is not None
    web = f"127.0.0.1:{free_port()}"
    process = start(
        "victoria-metrics",
        [
            VICTORIA_METRICS,
            f"-storageDataPath={work / 'vm-data'}",
            f"-httpListenAddr={web}",
            "-retentionPeriod=100y",
            "-search.latencyOffset=0s",
            "-search.disableCache",
            "-loggerLevel=ERROR",
            *args,
        ],
        work / "victoria-metrics.log",
    )
    server = Server(f"http://{web}", process)
    try:
        wait_http(process, f"{server.url}/health")
        yield server
    finally:
        server.stop()


def import_victoria(url: str, lines: Iterable[bytes], *, chunk_bytes: int = 8 << 20) -> None:
    """POST JSON-lines series ({"metric": {...}, "values": [...], "timestamps": [ms, ...]}) to
    VictoriaMetrics's /api/v1/import, in chunks, then make them searchable at once."""
    with httpx.Client(timeout=600) as client:
        batch: list[bytes] = []
        size = 0

        def send() -> None:
            nonlocal batch, size
            if batch:
                client.post(f"{url}/api/v1/import", content=b"".join(batch)).raise_for_status()
            batch, size = [], 0

        for line in lines:
            batch.append(line)
            size += len(line)
            if size >= chunk_bytes:
                send()
        send()
        client.get(f"{url}/internal/force_flush").raise_for_status()


def json_lines(metrics: Sequence[Metric]) -> Iterator[bytes]:
    """`with_target`'s families as VictoriaMetrics import lines, one per series."""
    series: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[list[float], list[int]]] = {}
    for metric in metrics:
        for s in metric.samples:
            values, stamps = series.setdefault((s.name, tuple(sorted(s.labels.items()))), ([], []))
            values.append(s.value)
            stamps.append(round((s.timestamp or 0.0) * 1000))
    for (name, labels), (values, stamps) in series.items():
        document = {"metric": {"__name__": name, **dict(labels)}, "values": values, "timestamps": stamps}
        yield json.dumps(document).encode() + b"\n"
