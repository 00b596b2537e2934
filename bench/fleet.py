"""The fleet's figures, measured: what one node costs a metrics store, and how long
`report --prometheus` takes over a month of a 40-node fleet. README's sizing of a 500- and a
5,000-node fleet is made from this script's output.

    python bench/fleet.py [series] [ingest] [report] [--nodes 40] [--days 30] [--scrape-interval 30s]
                          [--restarts 1] [--ingest-seconds 90] [--work DIR]

  series   series per node for each built-in scenario, at the default settings and with
           attribution.per_pid_series on (and a node whose workloads run several processes per
           GPU, where per-pid series multiply), read from the agent's own registry after an hour
           of simulated time; and samples per second per node at the default poll interval (5 s:
           the most often a scrape sees anything new) and at the shipped scrape interval (30 s).
  ingest   the real pipeline: --nodes `gpuledger run --fake` nodes at real speed (the default
           settings: a poll every 5 s), scraped every 5 s by a Prometheus server that
           remote-writes to VictoriaMetrics, for --ingest-seconds: samples appended per second
           and active series per node, remote_write bytes per sample (Prometheus's own
           counters), Prometheus's heap per active series (its heap with the nodes less its heap
           before their first scrape, over their series).
  report   --nodes nodes x --days days of the counters `report --prometheus` reads, imported
           into VictoriaMetrics (its /api/v1/import), one sample per --scrape-interval per
           series; then `report --prometheus` over all of it, timed (best of 3), and the
           store's bytes on disk per sample. Each node is one of the five built-in scenarios,
           its counters those of a simulated day repeated (each node's own rate, within 10%),
           with --restarts agent restarts in the month (counters back to 0: the narrowing that
           `report` does for resets is in the time).

Nothing here is a test: it prints what it measured, with the machine's load average, so that
a reader can judge the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled

from agent.cli.wiring import build_agent  # noqa: E402
from agent.config import Settings  # noqa: E402
from agent.fleet.promapi import PrometheusAPI  # noqa: E402
from agent.fleet.report import ALL_COUNTERS, PROBE_COUNTER, StoreQuery, report_from_prometheus  # noqa: E402
from agent.fleet.source import RESTART_COUNTER  # noqa: E402
from agent.pipeline import run_on_scenario_time  # noqa: E402
from agent.units import parse_duration  # noqa: E402

SCENARIOS = ("demo", "weekend-idle", "mig", "old-driver", "gpu-lost")
READ = frozenset((PROBE_COUNTER, RESTART_COUNTER, *ALL_COUNTERS))
PROMETHEUS = shutil.which("prometheus")
VICTORIA_METRICS = shutil.which("victoria-metrics")
DAY_S = 86400.0


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


# --- series ------------------------------------------------------------------------------------


def multi_process() -> dict[str, Any]:
    """A node whose pods run four processes on each GPU (tensor-parallel workers, MPS clients):
    where per-pid series multiply."""
    processes = [
        {"pid": 6000 + 10 * gpu + k, "gpus": [gpu], "sm_util": 20, "memory_mib": 8000,
         "cmdline": "python -m vllm.entrypoints.openai.api_server --model meta-llama/Llama-3.1-70B-Instruct",
         "pod": {"namespace": "serving", "name": f"vllm-70b-{gpu // 4}", "container": "vllm",
                 "uid": f"0b6c2f4e-3c1d-4e8a-9f11-2a7d5c9e0b{gpu // 4:02d}"}}
        for gpu in range(8)
        for k in range(4)
    ]  # fmt: skip
    return {
        "node": {"hostname": "gpu-mp-01"},
        "gpus": [{"model": "A100-SXM4-80GB", "count": 8}],
        "processes": processes,
    }


def count_series(scenario: str | dict[str, Any], per_pid: bool) -> tuple[int, int]:
    """(series a scrape shows, of which `report --prometheus` reads) after an hour at 15 s."""
    settings = Settings.model_validate({"attribution": {"per_pid_series": per_pid}})
    agent = build_agent(settings, fake=scenario, poll_interval_s=15.0)
    try:
        assert agent.node is not None
        run_on_scenario_time(agent.pipeline.jobs(), agent.node.clock.advance, 3600.0, 15.0)
        samples = [s for m in agent.registry().collect() for s in m.samples]
    finally:
        agent.close()
    return len(samples), sum(1 for s in samples if s.name in READ)


def bench_series() -> dict[str, Any]:
    print("\n== series per node (an hour of simulated time, then one scrape) ==")
    print(f"{'scenario':<16} {'GPUs':>4} {'default':>8} {'per-pid':>8} {'read by report':>15}")
    rows = {}
    cases: list[tuple[str, str | dict[str, Any], int]] = [
        (name, name, {"demo": 8, "weekend-idle": 8, "mig": 2, "old-driver": 2, "gpu-lost": 4}[name])
        for name in SCENARIOS
    ]
    cases.append(("multi-process", multi_process(), 8))
    for label, scenario, gpus in cases:
        default, read = count_series(scenario, False)
        per_pid, _ = count_series(scenario, True)
        rows[label] = {"gpus": gpus, "default": default, "per_pid": per_pid, "read": read}
        print(f"{label:<16} {gpus:>4} {default:>8} {per_pid:>8} {read:>15}")
    demo = rows["demo"]["default"]
    print(
        f"samples/s per node (demo, {demo} series): {demo / 5:.1f} scraped every 5 s (the default poll"
        f" interval), {demo / 30:.1f} every 30 s (the shipped scrape configs)"
    )
    return rows


# --- processes ---------------------------------------------------------------------------------


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def spawn(argv: Sequence[str], log: Path) -> Proc:
    with log.open("wb") as out:
        return Proc(subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, cwd=REPO), log)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f}s")


def victoria(work: Path) -> tuple[Proc, str]:
    assert VICTORIA_METRICS is not None, "victoria-metrics is not installed (apt-get install victoria-metrics)"
    url = f"http://127.0.0.1:{free_port()}"
    proc = spawn(
        [VICTORIA_METRICS, f"-storageDataPath={work / 'vm-data'}", f"-httpListenAddr={url[7:]}",
         "-retentionPeriod=100y", "-search.latencyOffset=0s", "-search.disableCache", "-loggerLevel=ERROR"],
        work / "victoria-metrics.log",
    )  # fmt: skip
    wait_for(f"{url}/health")
    return proc, url


def metrics_of(url: str) -> dict[str, float]:
    """A server's own /metrics, summed by name (labels dropped)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return out


# --- ingest ------------------------------------------------------------------------------------


def bench_ingest(work: Path, nodes: int, seconds: float) -> dict[str, float]:
    print(f"\n== ingest: {nodes} nodes at real speed, scraped every 5 s, remote-written ({load()}) ==")
    assert PROMETHEUS is not None, "prometheus is not installed (apt-get install prometheus)"
    procs: list[Proc] = []
    try:
        vm, vm_url = victoria(work)
        procs.append(vm)
        specs = []
        for i in range(nodes):
            name = SCENARIOS[i % len(SCENARIOS)]
            scenario = yaml.safe_load((REPO / "fake_nvml" / "scenarios" / f"{name}.yaml").read_text(encoding="utf-8"))
            scenario["node"]["hostname"] = f"bench-{i:03d}"
            path = work / f"bench-{i:03d}.yaml"
            path.write_text(yaml.safe_dump(scenario), encoding="utf-8")
            specs.append({"argv": ["run", "--fake", str(path), "--listen", "127.0.0.1:0"],
                          "log": str(work / f"bench-{i:03d}.log")})  # fmt: skip
        (work / "nodes.json").write_text(json.dumps(specs), encoding="utf-8")
        launcher = subprocess.Popen(
            [sys.executable, "-m", "tests.fleet_launcher", str(work / "nodes.json")], stdout=subprocess.PIPE,
            text=True, cwd=REPO,
        )  # fmt: skip
        assert launcher.stdout is not None
        pids = json.loads(launcher.stdout.readline())["pids"]
        targets = []
        for spec in specs:
            deadline = time.monotonic() + 120
            while True:
                found = re.search(r"serving http://(127\.0\.0\.1:\d+)/", Path(str(spec["log"])).read_text())
                if found or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
            assert found, f"a node did not start: {spec['log']}"
            targets.append(found[1])
        config = {
            "global": {"scrape_interval": "5s", "scrape_timeout": "5s"},
            "scrape_configs": [{"job_name": "gpuledger", "static_configs": [{"targets": targets}]}],
            "remote_write": [{"url": f"{vm_url}/api/v1/write"}],
        }
        (work / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
        web = f"http://127.0.0.1:{free_port()}"
        prometheus = spawn(
            [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address={web[7:]}", "--log.level=warn"],
            work / "prometheus.log",
        )  # fmt: skip
        procs.append(prometheus)
        wait_for(f"{web}/-/ready")
        time.sleep(3)
        before = metrics_of(web)
        start = time.monotonic()
        time.sleep(seconds)
        after = metrics_of(web)
        elapsed = time.monotonic() - start
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        launcher.communicate(timeout=60)
    finally:
        for proc in reversed(procs):
            proc.stop()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    series = after["prometheus_tsdb_head_series"]
    appended = grew("prometheus_tsdb_head_samples_appended_total")
    sent = grew("prometheus_remote_storage_samples_total")
    sent_bytes = grew("prometheus_remote_storage_bytes_total")
    # Prometheus's own series (its self-scrape is not configured here) are none: head = nodes'.
    heap_per_series = (after["go_memstats_heap_inuse_bytes"] - before["go_memstats_heap_inuse_bytes"]) / series
    figures = {
        "series_per_node": series / nodes,
        "samples_per_second_per_node": appended / elapsed / nodes,
        "remote_write_bytes_per_sample": sent_bytes / sent if sent else math.nan,
        "heap_bytes_per_series": heap_per_series,
        "prometheus_rss_bytes": after["process_resident_memory_bytes"],
    }
    for name, value in figures.items():
        print(f"  {name:<32} {value:,.1f}")
    return figures


# --- report ------------------------------------------------------------------------------------


@dataclass
class Day:
    """One simulated day of a scenario: each series the report reads, its labels and values."""

    times: np.ndarray[Any, np.dtype[np.float64]]  # seconds from the day's start
    series: dict[tuple[str, tuple[tuple[str, str], ...]], np.ndarray[Any, np.dtype[np.float64]]]


def simulate_day(name: str, step_s: float) -> Day:
    agent = build_agent(Settings(), fake=name, poll_interval_s=step_s)
    registry = agent.registry()
    columns: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
    steps = 0

    def scrape() -> None:
        nonlocal steps
        for metric in registry.collect():
            for s in metric.samples:
                if s.name in READ:
                    columns.setdefault((s.name, tuple(sorted(s.labels.items()))), [math.nan] * steps).append(s.value)
        steps += 1
        for values in columns.values():
            if len(values) < steps:
                values.append(math.nan)

    try:
        assert agent.node is not None
        run_on_scenario_time(agent.pipeline.jobs(), agent.node.clock.advance, DAY_S, step_s, on_step=scrape)
    finally:
        agent.close()
    return Day(np.arange(1, steps + 1) * step_s, {k: np.array(v) for k, v in columns.items()})


def node_series(day: Day, days: int, node: int, restarts: int, rng: random.Random) -> Iterator[tuple[Any, ...]]:
    """Each series of one node over `days`: the day's growth repeated, counters reset at each
    restart. A workload's counters grow at the node's own rate (within 10%) and vary from one
    interval to the next (2%: utilization moves), as real ones do; a GPU's (its price x time)
    grow as they do in the day."""
    rate = rng.uniform(0.9, 1.1)
    noise = np.random.default_rng(node)
    restart_at = sorted(rng.uniform(1, days - 1) * DAY_S for _ in range(restarts))
    times = np.concatenate([day.times + d * DAY_S for d in range(days)])
    for key, values in day.series.items():
        filled = np.nan_to_num(values, nan=0.0)
        growth = np.tile(np.maximum(np.diff(filled, prepend=0.0), 0.0), days)
        if key[0].startswith("gpuledger_workload_"):
            growth = growth * rate * noise.normal(1.0, 0.02, growth.shape).clip(0.0)
        totals = np.cumsum(growth)
        for at in restart_at:
            cut = int(np.searchsorted(times, at))
            if cut < len(totals):
                totals[cut:] -= totals[cut - 1] if cut else 0.0
        present = ~np.isnan(np.tile(values, days))
        yield key, times[present], totals[present]


class CountingAPI(PrometheusAPI):
    """The query API client, counting the queries it sends."""

    queries = 0

    def _post(self, endpoint: str, form: dict[str, str]) -> Any:
        CountingAPI.queries += 1
        return super()._post(endpoint, form)


def build_store(work: Path, nodes: int, days: int, step_s: float, restarts: int) -> dict[str, float]:
    """Import `nodes` x `days` of the counters the report reads into VictoriaMetrics at
    work/vm-data; the month's window and the figures go to work/store.json."""
    print(f"\n== a store of {nodes} nodes x {days} days, a sample per {step_s:g} s ({load()}) ==")
    t0 = time.monotonic()
    day_of = {name: simulate_day(name, step_s) for name in SCENARIOS}
    print(f"  simulated a day of each scenario in {time.monotonic() - t0:.1f}s")
    end = math.floor(time.time() / DAY_S) * DAY_S - DAY_S  # the month ends at the last midnight but one
    start = end - days * DAY_S
    vm, url = victoria(work)
    try:
        rng = random.Random(12)
        samples = 0
        series = 0
        t1 = time.monotonic()
        with httpx.Client(timeout=600) as client:
            batch: list[bytes] = []
            size = 0
            for node in range(nodes):
                name = SCENARIOS[node % len(SCENARIOS)]
                offset = start + node * step_s / nodes  # nodes are scraped at different moments
                for (metric, labels), times, values in node_series(day_of[name], days, node, restarts, rng):
                    target = {"job": "gpuledger", "instance": f"node-{node:03d}"}
                    document = {
                        "metric": {"__name__": metric, **dict(labels), **target},
                        "values": values.tolist(),
                        "timestamps": np.round((times + offset) * 1000).astype(np.int64).tolist(),
                    }
                    line = json.dumps(document).encode() + b"\n"
                    batch.append(line)
                    size += len(line)
                    samples += len(values)
                    series += 1
                    if size > 32 << 20:
                        client.post(f"{url}/api/v1/import", content=b"".join(batch)).raise_for_status()
                        batch, size = [], 0
            if batch:
                client.post(f"{url}/api/v1/import", content=b"".join(batch)).raise_for_status()
            client.get(f"{url}/internal/force_flush").raise_for_status()
        print(f"  imported {series:,} series, {samples:,} samples in {time.monotonic() - t1:.0f}s")
    finally:
        vm.stop()  # a stopped VictoriaMetrics has written all it holds to disk
    disk = sum(f.stat().st_size for f in (work / "vm-data").rglob("*") if f.is_file())
    figures = {
        "start": start,
        "end": end,
        "nodes": float(nodes),
        "restarts_per_node": float(restarts),
        "series": float(series),
        "samples": float(samples),
        "store_bytes_on_disk": float(disk),
        "store_bytes_per_sample": disk / samples,
    }
    (work / "store.json").write_text(json.dumps(figures), encoding="utf-8")
    print(f"  VictoriaMetrics on disk: {disk / 1e6:,.1f} MB, {disk / samples:.2f} bytes per sample")
    return figures


def bench_report(work: Path) -> dict[str, float]:
    """`report --prometheus` over the month of work/vm-data, best of 3, and the queries it sent."""
    store = json.loads((work / "store.json").read_text(encoding="utf-8"))
    print(f"\n== report --prometheus over that month ({load()}) ==")
    vm, url = victoria(work)
    try:
        time.sleep(5)  # VictoriaMetrics opens its parts
        timings = []
        report = None
        for _ in range(3):
            CountingAPI.queries = 0
            with CountingAPI(url) as api:
                t0 = time.monotonic()
                report = report_from_prometheus(
                    api, StoreQuery(store["start"], store["end"] + 60), by=("namespace", "hpc_job")
                )
                timings.append(time.monotonic() - t0)
        assert report is not None
    finally:
        vm.stop()
    figures = {
        "report_seconds_best": min(timings),
        "report_seconds_median": statistics.median(timings),
        "queries": float(CountingAPI.queries),
        "report_total_dollars": report.total.dollars,
        "report_gpu_hours": report.total.gpu_hours_charged,
    }
    print(
        f"  report --prometheus: best {min(timings):.2f}s, median {statistics.median(timings):.2f}s of 3, "
        f"{CountingAPI.queries} queries ({len(report.lines)} groups, {report.total.gpu_hours_charged:,.0f} GPU-hours, "
        f"${report.total.dollars:,.2f})"
    )
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "sections", nargs="*", default=["series", "ingest", "report"], choices=["series", "ingest", "report"]
    )
    parser.add_argument("--nodes", type=int, default=40)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--scrape-interval", default="30s")
    parser.add_argument("--restarts", type=int, default=1, help="agent restarts per node in the month")
    parser.add_argument("--ingest-seconds", type=float, default=90.0)
    parser.add_argument("--work", help="keep the stores here (default: a temporary directory)")
    parser.add_argument(
        "--reuse", action="store_true", help="report: time the store a previous run left in --work, import nothing"
    )
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # the agents' flag lines are not the figures
    print(f"bench/fleet.py on {os.cpu_count()} CPUs, {load()}")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpuledger-fleet-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    try:
        if "series" in args.sections:
            results["series"] = bench_series()
        if "ingest" in args.sections:
            (work / "ingest").mkdir(exist_ok=True)
            results["ingest"] = bench_ingest(work / "ingest", args.nodes, args.ingest_seconds)
        if "report" in args.sections:
            (work / "report").mkdir(exist_ok=True)
            if not (args.reuse and (work / "report" / "store.json").exists()):
                step = parse_duration(args.scrape_interval)
                results["store"] = build_store(work / "report", args.nodes, args.days, step, args.restarts)
            results["report"] = bench_report(work / "report")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + json.dumps(results, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
