"""End to end with a real Prometheus server: `gpuledger run --fake demo --fake-speed 600` scraped
every second on loopback, both rule files of deploy/prometheus loaded and evaluated every second.

- Every PromQL expression of every shipped dashboard panel, every dashboard variable query and
  every recording rule runs against Prometheus's HTTP API; the test fails listing each one that
  errors or returns no data (the exceptions are listed below, each with its reason).
- Two recording rules are held to what the agent's own numbers imply: the cluster's cost rate
  is the sum of the GPUs' prices x the fake clock's speed, and the cluster has 8 GPUs up.
- The same Prometheus scrapes a second agent in dcgm-exporter compatible mode and runs the
  queries of NVIDIA's published dcgm-exporter dashboard against it.

Everything is started once per module; the processes are stopped by fixture finalizers.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import engines
from tests.test_cli import free_port
from tests.test_grafana import (
    label_values_query,
    load_dashboards,
    panel_queries,
    panels,
    substitute,
    variable_query,
    variables,
)

ROOT = Path(__file__).resolve().parent.parent
RULE_FILES = (
    ROOT / "deploy" / "prometheus" / "gpuledger-recording.rules.yml",
    ROOT / "deploy" / "prometheus" / "gpuledger-alerts.rules.yml",
    ROOT / "deploy" / "prometheus" / "gpuledger-fleet.rules.yml",
    ROOT / "deploy" / "prometheus" / "gpuledger-work.rules.yml",
)
PROMETHEUS = shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin")
pytestmark = [
    pytest.mark.skipif(
        PROMETHEUS is None, reason="the prometheus server is missing: apt-get install prometheus (Debian's package)"
    ),
    # One worker starts the stack (Prometheus and three agents) for the module: pyproject's
    # --dist loadgroup; without it each worker that runs one of these tests starts its own.
    pytest.mark.xdist_group("prometheus-e2e"),
]

SPEED = 600  # scenario seconds per real second
GPUS = 8  # the demo node: 8 x A100
CLUSTER = "e2e"  # target label of the agent in gpuledger's own mode
DCGM_CLUSTER = "e2e-dcgm"  # target label of the agent in dcgm-exporter compatible mode
# A second node, in a cluster of its own: the weekend-idle scenario's job ends 4 scenario hours
# in (24 s at 600x) and leaves its GPUs idle, so the idle-left-behind rules have a leaver.
WEEKEND_CLUSTER = "e2e-weekend"
# The serving engines and training job the work rules join with the demo's pods: vLLM and
# Triton (its vLLM backend exports both) in the vLLM pod, a step counter in a notebook.
ENGINES = (
    engines.vllm("serving", "vllm-llama-0", "meta-llama/Llama-3.1-8B-Instruct", tokens_per_s=1000),
    engines.triton("serving", "vllm-llama-0", "llama", inferences_per_s=50),
    engines.trainer("research-nlp", "notebook-7", steps_per_s=2),
)
SCRAPE_JOB = "gpuledger"
DEADLINE_S = 60.0  # how long to wait for every query to have data
STARTUP_S = 30.0  # how long a process may take to answer HTTP

AGENT_ENV = {
    # A sped-up fake node is polled every poll_interval of scenario time (agent/cli/wiring.py):
    # every 5 scenario minutes is twice a real second at 600x, as often as the 1 s scrapes need.
    # With the default 5 s it would poll every 20 real ms (FAKE_MIN_POLL_S), three agents at
    # 50 polls a second each, most of this module's CPU time.
    "GPULEDGER_POLL_INTERVAL": "300s",
    # Late polls on a busy machine stretch an interval past accounting.max_interval (default
    # 5m), which would leave it unobserved: the cost checks here are about the price and speed.
    "GPULEDGER_ACCOUNTING__MAX_INTERVAL": "1h",
}


# --- processes ----------------------------------------------------------------------------------


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(encoding="utf-8", errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


def start(name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> Process:
    with log.open("wb") as out:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
        )
    return Process(name, popen, log)


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        with exc:  # its body is an open response
            return exc.code, exc.read().decode("utf-8", errors="replace")


def wait_http(process: Process, url: str, timeout_s: float = STARTUP_S) -> None:
    """Wait until `url` answers 200; fail early, with the log, if the process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.tail()}")
        try:
            if http_get(url, timeout_s=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{process.name} did not answer {url} within {timeout_s:.0f}s:\n{process.tail()}")


# Teams come from attribution rules, as on a real cluster (the demo sets none of its own).
AGENT_CONFIG = {
    "attribution": {
        "rules": [
            {"match": {"namespace": "^research-"}, "set": {"team": "research"}},
            {"match": {"account": "^nlp$"}, "set": {"team": "nlp"}},
        ]
    }
}


def start_agent(
    name: str, tmp: Path, extra_env: Mapping[str, str], extra_args: Sequence[str] = (), scenario: str = "demo"
) -> tuple[Process, str]:
    port = free_port()
    target = f"127.0.0.1:{port}"
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump(AGENT_CONFIG), encoding="utf-8")
    argv = [sys.executable, "-m", "agent", "run", "--config", str(config), "--fake", scenario]
    argv += ["--fake-speed", str(SPEED), "--listen", target]
    process = start(name, [*argv, *extra_args], tmp / f"{name}.log", {**AGENT_ENV, **extra_env})
    return process, target


# --- the Prometheus HTTP API ------------------------------------------------------------------


class QueryError(Exception):
    """Prometheus refused a query (bad PromQL, evaluation error)."""


@dataclass
class PrometheusAPI:
    url: str

    def _get(self, path: str, params: Sequence[tuple[str, str]]) -> Any:
        status, body = http_get(f"{self.url}{path}?{urllib.parse.urlencode(params)}", timeout_s=10)
        try:
            payload = json.loads(body)
        except json.JSONDecodeError:
            raise QueryError(f"HTTP {status}: {body[:200]}") from None
        if payload.get("status") != "success":
            raise QueryError(f"{payload.get('errorType')}: {payload.get('error')}")
        return payload["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The result of an instant query: a vector's or a matrix's series (a scalar as one)."""
        params = [("query", expr)] + ([("time", f"{at:.3f}")] if at is not None else [])
        data = self._get("/api/v1/query", params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def value(self, expr: str, at: float | None = None) -> float:
        result = self.query(expr, at)
        assert len(result) == 1, f"{expr}: expected one series, got {result}"
        return float(result[0]["value"][1])

    def label_values(self, label: str, series: str) -> list[str]:
        params = [("match[]", series)] if series else []
        return list(self._get(f"/api/v1/label/{label}/values", params))

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self._get("/api/v1/rules", [])["groups"] for rule in group["rules"]]


def problems(api: PrometheusAPI, queries: Sequence[tuple[str, str]]) -> list[str]:
    """'where: expr -> what is wrong' for each query that errors or returns no data."""
    found = []
    for where, expr in queries:
        try:
            if not api.query(expr):
                found.append(f"{where}: {expr}\n    -> no data")
        except QueryError as exc:
            found.append(f"{where}: {expr}\n    -> {exc}")
    return found


def wait_for(check: Callable[[], list[str]], timeout_s: float = DEADLINE_S) -> list[str]:
    """Run `check` until it reports nothing or the deadline passes; its last report."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(1)


# --- the stack ---------------------------------------------------------------------------------


@dataclass
class Stack:
    api: PrometheusAPI
    target: str  # the agent in gpuledger's own mode
    dcgm_target: str
    dcgm_error: str | None  # why the dcgm-mode agent is not there, if it is not
    processes: list[Process] = field(default_factory=list)


def prometheus_config(path: Path, target: str, dcgm_target: str, weekend_target: str, serving: engines.Serving) -> None:
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in RULE_FILES],
        "scrape_configs": [
            {
                "job_name": SCRAPE_JOB,
                "static_configs": [
                    {"targets": [target], "labels": {"cluster": CLUSTER}},
                    {"targets": [dcgm_target], "labels": {"cluster": DCGM_CLUSTER}},
                    {"targets": [weekend_target], "labels": {"cluster": WEEKEND_CLUSTER}},
                ],
            },
            {
                # As Kubernetes discovery labels a pod's target (deploy/prometheus/README.md).
                "job_name": "engines",
                "static_configs": [
                    {"targets": [where], "labels": {"cluster": CLUSTER, "namespace": e.namespace, "pod": e.pod}}
                    for e, where in serving.targets
                ],
            },
        ],
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("e2e")
    processes: list[Process] = []
    serving = engines.serve(list(ENGINES))
    try:
        # Run as deployed, with a ledger, so gpuledger_ledger_up is there for the node view.
        agent, target = start_agent("agent", tmp, {}, ["--ledger", str(tmp / "ledger.db")])
        processes.append(agent)
        dcgm_agent, dcgm_target = start_agent("agent-dcgm", tmp, {"GPULEDGER_EXPORTERS__DCGM_COMPAT": "true"})
        processes.append(dcgm_agent)
        weekend_agent, weekend_target = start_agent("agent-weekend", tmp, {}, scenario="weekend-idle")
        processes.append(weekend_agent)
        wait_http(agent, f"http://{target}/metrics")
        wait_http(weekend_agent, f"http://{weekend_target}/metrics")
        dcgm_error = None
        try:
            wait_http(dcgm_agent, f"http://{dcgm_target}/metrics")
        except RuntimeError as exc:  # the dcgm mode is optional here: its own test reports it
            dcgm_error = str(exc)

        config = tmp / "prometheus.yml"
        prometheus_config(config, target, dcgm_target, weekend_target, serving)
        web = f"127.0.0.1:{free_port()}"
        assert PROMETHEUS is not None
        server = start(
            "prometheus",
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address={web}",
                "--log.level=warn",
            ],
            tmp / "prometheus.log",
        )
        processes.append(server)
        wait_http(server, f"http://{web}/-/ready")
        yield Stack(PrometheusAPI(f"http://{web}"), target, dcgm_target, dcgm_error, processes)
    finally:
        for process in reversed(processes):
            process.stop()
        serving.stop()


@pytest.fixture(scope="module")
def scraping(stack: Stack) -> Stack:
    """The stack once Prometheus holds a few scrapes of the agent and has evaluated the rules."""
    selector = f'{{cluster="{CLUSTER}"}}'
    ready = [
        ("scrapes", f"count_over_time(gpuledger_polls_total{selector}[1m]) >= 5"),
        ("rules", f"cluster:gpuledger_gpu_cost_dollars_per_hour:rate5m{selector}"),
    ]
    found = wait_for(lambda: problems(stack.api, ready))
    assert not found, "Prometheus has no data from the agent:\n" + "\n".join(found) + _logs(stack)
    return stack


def _logs(stack: Stack) -> str:
    return "".join(f"\n--- {p.name} log ---\n{p.tail()}" for p in stack.processes)


# --- dashboards ----------------------------------------------------------------------------------

GRAFANA_BUILTINS = {
    "__range": "1m",
    "__rate_interval": "30s",
    "__interval": "15s",
    "__interval_ms": "15000",
    "__range_s": "60",
}
FLEET_UID = "gpuledger-fleet"


def dashboard_values(dashboard: Mapping[str, Any], target: str) -> dict[str, str]:
    """What Grafana would put in for each variable with cluster=e2e, node=the agent, All elsewhere;
    the fleet view with every cluster (the weekend node's is the one with a leaver)."""
    values = dict(GRAFANA_BUILTINS)
    chosen = {"cluster": CLUSTER, "instance": target}
    if dashboard.get("uid") == FLEET_UID:
        chosen["cluster"] = ".*"
    for variable in variables(dashboard):
        name = variable["name"]
        values[name] = chosen.get(name, str(variable.get("allValue", ".*")))
    return values


def dashboard_queries(target: str) -> list[tuple[str, str]]:
    return [
        (f"{name} {where}", substitute(expr, dashboard_values(dashboard, target)))
        for name, dashboard in load_dashboards().items()
        for where, expr in panel_queries(dashboard)
    ]


def test_every_dashboard_panel_query_has_data(scraping: Stack) -> None:
    queries = dashboard_queries(scraping.target)
    assert len(queries) > 50
    found = wait_for(lambda: problems(scraping.api, queries))
    assert not found, f"{len(found)} of {len(queries)} dashboard queries failed:\n" + "\n".join(found)


_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def test_every_panel_legend_tells_its_series_apart(scraping: Stack) -> None:
    """Two series of one query that Grafana would draw under the same name (its legend, with each
    {{label}} put in) cannot be told apart. The fleet view shows three clusters here, two of them
    running the demo with its Slurm job 8812."""

    def check() -> list[str]:
        found = []
        for name, dashboard in load_dashboards().items():
            values = dashboard_values(dashboard, scraping.target)
            for panel in panels(dashboard):
                for target in panel.get("targets", []):
                    legend = target.get("legendFormat") or ""
                    if not _LEGEND_LABEL.search(legend):
                        continue
                    series = scraping.api.query(substitute(target["expr"], values))
                    drawn = [_LEGEND_LABEL.sub(lambda m, s=s: s["metric"].get(m.group(1), ""), legend) for s in series]
                    twice = sorted({text for text in drawn if drawn.count(text) > 1})
                    if twice:
                        found.append(f"{name} {panel['title']}/{target.get('refId')}: {twice} drawn more than once")
        return found

    found = wait_for(check)
    assert not found, "\n".join(found)


def test_a_slurm_job_is_shown_with_its_cluster(scraping: Stack) -> None:
    """Slurm numbers its jobs per cluster (the demo's job 8812 runs in two clusters here): with
    every cluster and node chosen, a series that names a job names its cluster too, so two
    clusters' jobs are never summed into one bar or row."""

    def check() -> list[str]:
        found, named = [], 0
        for name, dashboard in load_dashboards().items():
            whole = {v["name"]: ".*" for v in variables(dashboard) if v.get("includeAll")}
            if "instance" not in whole:
                continue  # a node's view: one node is in one cluster
            values = {**dashboard_values(dashboard, scraping.target), **whole}
            for where, expr in panel_queries(dashboard):
                jobs = [s["metric"] for s in scraping.api.query(substitute(expr, values)) if s["metric"].get("hpc_job")]
                named += len(jobs)
                found += [
                    f"{name} {where}: job {labels['hpc_job']} without its cluster"
                    for labels in jobs
                    if "cluster" not in labels
                ]
        return found if named else ["no panel names a job yet"]

    found = wait_for(check)
    assert not found, "\n".join(found)


def test_every_dashboard_variable_lists_values(scraping: Stack) -> None:
    expected = {"cluster": CLUSTER, "instance": scraping.target}

    def check() -> list[str]:
        found = []
        for name, dashboard in load_dashboards().items():
            values = dashboard_values(dashboard, scraping.target)
            for variable in variables(dashboard):
                if variable["type"] != "query":
                    continue
                series, label = label_values_query(substitute(variable_query(variable), values))
                try:
                    listed = scraping.api.label_values(label, series)
                except QueryError as exc:
                    found.append(f"{name} ${variable['name']}: {exc}")
                    continue
                if not listed:
                    found.append(f"{name} ${variable['name']}: label_values({series}, {label}) lists nothing")
                elif variable["name"] in expected and expected[variable["name"]] not in listed:
                    found.append(f"{name} ${variable['name']}: {expected[variable['name']]!r} not among {listed}")
        return found

    found = wait_for(check)
    assert not found, "\n".join(found)


# --- recording rules ---------------------------------------------------------------------------


def recording_rules() -> list[dict[str, Any]]:
    return [
        rule
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]
        for rule in group["rules"]
        if "record" in rule
    ]


WEEKEND_RULE = "cluster:gpuledger_gpu_idle_cost_dollars:sum_weekend_to_date"
# The rule that may rightly have no data during this test, and why. It is run all the same (it
# must not error), and must have data whenever the reason does not hold (see weekend_data_due).
MAY_BE_EMPTY = {
    WEEKEND_RULE: (
        "no series on weekdays (UTC) by design; on a weekend, none until its [2d:5m] subquery has a "
        "step (at a multiple of 5 minutes since the epoch, its 5m window inside the weekend) after "
        "Prometheus first recorded the idle-cost rate, which a one-minute test may not reach"
    )
}


def weekend_data_due(api: PrometheusAPI) -> bool:
    """Whether the weekend-to-date rule must have data now: see MAY_BE_EMPTY."""
    now = float(api.query("time()")[0]["value"][1])
    recorded = api.query(f'cluster:gpuledger_gpu_idle_cost_dollars_per_hour:rate5m{{cluster="{CLUSTER}"}}[10m]', now)
    if not recorded:
        return False
    first = float(recorded[0]["values"][0][0])

    def weekend(t: float) -> bool:
        return datetime.fromtimestamp(t, UTC).weekday() >= 5  # Saturday 5, Sunday 6

    steps = range(math.ceil(first / 300) * 300, math.floor(now / 300) * 300 + 1, 300)
    return weekend(now) and any(weekend(step - 300) for step in steps)


def test_every_recording_rule_expression_has_data(scraping: Stack) -> None:
    rules = recording_rules()
    queries = [(rule["record"], rule["expr"]) for rule in rules if rule["record"] not in MAY_BE_EMPTY]
    found = wait_for(lambda: problems(scraping.api, queries))
    assert not found, f"{len(found)} of {len(queries)} recording rule expressions failed:\n" + "\n".join(found)

    for rule in rules:
        if rule["record"] in MAY_BE_EMPTY:
            result = scraping.api.query(rule["expr"])  # errors raise
            if weekend_data_due(scraping.api):
                assert result, f"{rule['record']}: no data although it is due ({MAY_BE_EMPTY[rule['record']]})"
            assert all(float(series["value"][1]) >= 0 for series in result), result


def test_prometheus_evaluates_every_rule_without_error(scraping: Stack) -> None:
    def check() -> list[str]:
        rules = scraping.api.rules()
        loaded = {rule["name"] for rule in rules}
        expected = {str(rule.get("record") or rule["alert"]) for path in RULE_FILES for rule in _rules_in(path)}
        found = [f"{name}: not loaded" for name in sorted(expected - loaded)]
        found += [
            f"{r['name']}: health {r.get('health')} {r.get('lastError', '')}" for r in rules if r.get("health") != "ok"
        ]
        found += [
            f"{r['name']}: recorded nothing"
            for r in rules
            if r.get("type") == "recording" and r["name"] not in MAY_BE_EMPTY and not scraping.api.query(r["name"])
        ]
        return found

    found = wait_for(check)
    assert not found, "\n".join(found)


def _rules_in(path: Path) -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"] for rule in group["rules"]]


# --- the numbers -----------------------------------------------------------------------------------


def test_gpus_up_rule_counts_the_demo_nodes_gpus(scraping: Stack) -> None:
    assert scraping.api.value(f'cluster:gpuledger_gpus_up:sum{{cluster="{CLUSTER}"}}') == GPUS


def test_a_slurm_jobs_label_arrives_as_hpc_job_beside_the_scrape_jobs_own(scraping: Stack) -> None:
    # The demo's Slurm job 8812 holds GPUs 0-3. A workload label called `job` would clash with the
    # target's and arrive renamed `exported_job`; `hpc_job` arrives as the agent wrote it, in
    # both modes (dcgm-exporter's series carry the same name).
    api = scraping.api
    series = api.query(f'gpuledger_workload_gpu_seconds_total{{cluster="{CLUSTER}", hpc_job="8812"}}')
    assert sorted(s["metric"]["gpu"] for s in series) == ["0", "1", "2", "3"]
    assert {s["metric"]["job"] for s in series} == {SCRAPE_JOB}
    assert api.label_values("exported_job", "") == []
    if scraping.dcgm_error is None:
        dcgm = api.query(f'DCGM_FI_DEV_GPU_TEMP{{cluster="{DCGM_CLUSTER}", hpc_job="8812"}}')
        assert sorted(s["metric"]["gpu"] for s in dcgm) == ["0", "1", "2", "3"]


MIN_COVERAGE_S = 30.0  # seconds of samples behind the checked cost rate


def prometheus_rate(
    points: Sequence[tuple[int, float]], at_ms: int, range_ms: int, closure: str, late: int | None = None
) -> float:
    """What PromQL's rate() of one counter over `range_ms` reads at `at_ms`, from its raw samples
    (ms, value): the growth between the first and last sample in the range (a fall is a reset),
    extrapolated towards each end of the range by the gap there where that gap is under 1.1
    average sample intervals (else by half an interval), towards the start no further than where
    the counter would have been zero, per second of the range. Prometheus 2 takes the samples at
    both ends of the range ("closed"), 3 not the one at the start ("left-open"); `late`: a
    sample stamped then is left out (not stored yet at `at_ms`)."""
    start_ms = at_ms - range_ms
    inside = [
        (t, v)
        for t, v in points
        if (start_ms <= t if closure == "closed" else start_ms < t) and t <= at_ms and t != late
    ]
    if len(inside) < 2:
        return 0.0
    growth = inside[-1][1] - inside[0][1]
    previous = 0.0
    for _, value in inside:
        if value < previous:
            growth += previous
        previous = value
    sampled_s = (inside[-1][0] - inside[0][0]) / 1000
    to_start_s = (inside[0][0] - start_ms) / 1000
    to_end_s = (at_ms - inside[-1][0]) / 1000
    average_s = sampled_s / (len(inside) - 1)
    if growth > 0 and inside[0][1] >= 0:
        to_start_s = min(to_start_s, sampled_s * inside[0][1] / growth)
    threshold_s = average_s * 1.1
    covered_s = sampled_s
    covered_s += to_start_s if to_start_s < threshold_s else average_s / 2
    covered_s += to_end_s if to_end_s < threshold_s else average_s / 2
    return growth * covered_s / sampled_s / (range_ms / 1000)


def test_cost_rate_rule_is_the_gpu_prices_times_the_clock_speed(scraping: Stack) -> None:
    """The cost counters grow by each GPU's price per scenario hour, and scenario time runs at
    600x, so the $/h rule reads about sum(price) x 600.

    Two parts are exact: the rule's recorded sample is sum(rate()) x 3600 of the counters at its
    evaluation time, and a counter grows by exactly its GPU's price per scenario hour, measured
    against the scenario time each scrape reports (gpuledger_last_poll_timestamp_seconds, from the
    same scrape). One is not: the clock speed as Prometheus sees it, scenario time between the
    polls two scrapes saw over the real time between the scrapes. On a loaded machine a poll runs
    late and a scrape shows the one before, so the speed is checked to 10%, not the rule against
    sum(price) x 600 to 2% (which failed when a run shared two cores with other work).
    """
    api = scraping.api
    counter = f'gpuledger_gpu_cost_dollars_total{{cluster="{CLUSTER}", gpu="0"}}'
    polled = f'gpuledger_last_poll_timestamp_seconds{{cluster="{CLUSTER}"}}'
    rule = f'cluster:gpuledger_gpu_cost_dollars_per_hour:rate5m{{cluster="{CLUSTER}"}}'

    def young() -> list[str]:
        samples = api.query(f"{counter}[5m]")
        age = (time.time() - float(samples[0]["values"][0][0])) if samples else 0.0
        return [] if age >= MIN_COVERAGE_S else [f"cost counter {age:.0f}s old"]

    assert not wait_for(young)
    evaluated_at, recorded = (float(v) for v in api.query(f"{rule}[10s]")[0]["values"][-1])
    # The rule, worked out here from the raw samples of every GPU's counter. A scrape is stamped
    # when it starts and stored when the agent has answered: the scrape in flight as the rule was
    # evaluated (at most one per target) may be stamped before the evaluation and stored after
    # it. The rule saw the samples either with it or without it; PromQL asked now sees them all.
    raw = api.query(f'gpuledger_gpu_cost_dollars_total{{cluster="{CLUSTER}"}}[310s]', evaluated_at)
    series = [[(round(float(t) * 1000), float(v)) for t, v in s["values"]] for s in raw]
    assert len(series) == GPUS
    at_ms = round(evaluated_at * 1000)
    newest = max(t for points in series for t, _ in points if t <= at_ms)
    ways = {
        (closure, late): 3600 * math.fsum(prometheus_rate(points, at_ms, 300_000, closure, late) for points in series)
        for closure in ("closed", "left-open")  # Prometheus 2's range selector, and 3's
        for late in (None, newest)
    }
    assert any(recorded == pytest.approx(by_hand, rel=1e-9) for by_hand in ways.values()), (recorded, ways)

    # The same scrapes of GPU 0's cost and of the agent's scenario clock, by their timestamps.
    costs = {float(t): float(v) for t, v in api.query(f"{counter}[5m]", evaluated_at)[0]["values"]}
    clock = {float(t): float(v) for t, v in api.query(f"{polled}[5m]", evaluated_at)[0]["values"]}
    scrapes = sorted(costs.keys() & clock.keys())
    assert len(scrapes) >= 10, scrapes
    first, last = scrapes[0], scrapes[-1]
    scenario_s = clock[last] - clock[first]
    price = api.value(f'gpuledger_gpu_price_dollars_per_hour{{cluster="{CLUSTER}", gpu="0"}}', evaluated_at)
    assert price > 0
    # Dollars per scenario hour: the price, every scenario second priced once.
    assert (costs[last] - costs[first]) / scenario_s * 3600 == pytest.approx(price, rel=1e-6)
    assert scenario_s / (last - first) == pytest.approx(SPEED, rel=0.1)
    prices = api.value(f'sum(gpuledger_gpu_price_dollars_per_hour{{cluster="{CLUSTER}"}})', evaluated_at)
    assert recorded == pytest.approx(prices * SPEED * min(1.0, (evaluated_at - first) / 300), rel=0.1)
    # The agent's own invariant, through the rules: workload cost + idle cost = GPU cost.
    split = api.value(
        f'(sum(namespace:gpuledger_workload_cost_dollars_per_hour:rate5m{{cluster="{CLUSTER}"}})'
        f' + sum(cluster:gpuledger_gpu_idle_cost_dollars_per_hour:rate5m{{cluster="{CLUSTER}"}}))'
        f" / sum({rule})"
    )
    assert split == pytest.approx(1.0, rel=0.01)


# --- dcgm-exporter compatible mode ---------------------------------------------------------------

# The panel queries of NVIDIA's "NVIDIA DCGM Exporter Dashboard" (grafana.com dashboard 12239),
# quoted from its source, NVIDIA/dcgm-exporter, grafana/dcgm-exporter-dashboard.json, in the two
# revisions users have imported: the original one (Grafana 6.7; commit 1f7abdb7dc0f86f3cf78539
# 95b0d262fd3e80bc6), selecting by instance and gpu, and the current one (Grafana 9.1; commit
# 068798b0a1cb23d7764fa30f6f305d322ede87e2), selecting by Hostname and gpu. Title: expr.
DCGM_DASHBOARD_ORIGINAL = {
    "variables": {
        "instance": "label_values(DCGM_FI_DEV_GPU_TEMP, instance)",
        "gpu": "label_values(DCGM_FI_DEV_GPU_TEMP, gpu)",
    },
    "panels": {
        "GPU Temperature": 'DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"}',
        "GPU Avg. Temp": 'avg(DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"})',
        "GPU Power Usage": 'DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"}',
        "GPU Power Total": 'sum(DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"})',
        "GPU SM Clocks": 'DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000',
        "GPU Utilization": 'DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", gpu=~"$gpu"}',
        "GPU Framebuffer Mem Used": 'DCGM_FI_DEV_FB_USED{instance=~"$instance", gpu=~"$gpu"}',
        "Tensor Core Utilization": 'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}',
    },
}
DCGM_DASHBOARD_CURRENT = {
    "variables": {
        "Hostname": "label_values(DCGM_FI_DEV_FB_FREE, Hostname)",
        "gpu": 'label_values(DCGM_FI_DEV_FB_FREE{Hostname=~"$Hostname"}, gpu)',
    },
    "panels": {
        "GPU Temperature": 'max(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, uuid)',
        "GPU Avg. Temp": 'avg(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$Hostname", gpu=~"$gpu"})',
        "GPU Power Usage": 'max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, uuid)',
        "GPU Power Total": 'sum(max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (gpu))',
        "GPU SM Clocks": (
            'max(DCGM_FI_DEV_SM_CLOCK{Hostname=~"$Hostname", gpu=~"$gpu"} * 1000000) by (Hostname, UUID, gpu)'
        ),
        "GPU Utilization": (
            'max(DCGM_FI_PROF_GR_ENGINE_ACTIVE{Hostname=~"$Hostname", gpu=~"$gpu"})'
            " by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)"
        ),
        "Tensor Core Utilization": (
            'max(DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{Hostname=~"$Hostname", gpu=~"$gpu"})'
            " by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)"
        ),
        "GPU Framebuffer Mem Used": (
            'max(DCGM_FI_DEV_FB_USED{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)'
        ),
    },
}
# Fields those dashboards chart that gpuledger does not provide: their queries must run without
# error and return nothing. A query naming one of them is expected to be empty.
NOT_PROVIDED = {
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "a DCGM profiling (DCP) field; NVML has no equivalent",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": (
        "a DCGM profiling (DCP) field; NVML's coarser utilization is DCGM_FI_DEV_GPU_UTIL, which is provided"
    ),
}
# Not from that dashboard: the other fields and labels gpuledger's dcgm mode promises
# (exporters/dcgm.py), as dashboards and alerts written for dcgm-exporter use them.
DCGM_OTHER_QUERIES = {
    "energy counter, W": "sum by (Hostname, gpu) (rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[1m])) / 1000",
    "framebuffer total, MiB": "DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE",
    "identity labels": 'DCGM_FI_DEV_GPU_UTIL{gpu!="", UUID!="", device=~"nvidia[0-9]+", modelName!="", Hostname!=""}',
    "pod labels": 'DCGM_FI_DEV_GPU_UTIL{namespace!="", pod!="", container!=""}',
    "same utilization as gpuledger_gpu_utilization_ratio": (
        f'max(abs(sum by (gpu) (DCGM_FI_DEV_GPU_UTIL{{cluster="{DCGM_CLUSTER}"}})'
        f' - 100 * sum by (gpu) (gpuledger_gpu_utilization_ratio{{cluster="{DCGM_CLUSTER}"}}))) < 1'
    ),
    # Clocks, throttling, memory errors and links, as alerts and dashboards written for
    # dcgm-exporter read them.
    "same SM clock as gpuledger_gpu_sm_clock_hertz": (
        f'max(abs(sum by (gpu) (DCGM_FI_DEV_SM_CLOCK{{cluster="{DCGM_CLUSTER}"}}) * 1e6'
        f' - sum by (gpu) (gpuledger_gpu_sm_clock_hertz{{cluster="{DCGM_CLUSTER}"}}))) < 1e6'
    ),
    "memory clock, MHz": "DCGM_FI_DEV_MEM_CLOCK",
    "clock throttle reasons": "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
    "power and thermal violation, fraction of time": (
        "rate(DCGM_FI_DEV_POWER_VIOLATION[1m]) / 1e9 + rate(DCGM_FI_DEV_THERMAL_VIOLATION[1m]) / 1e9"
    ),
    "the demo's uncorrectable ECC error": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL > 0",
    "the demo's pending row remap": (
        "DCGM_FI_DEV_ROW_REMAP_PENDING == 1 and DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS > 0"
    ),
    "row remap failures": "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "PCIe replays a second": "rate(DCGM_FI_DEV_PCIE_REPLAY_COUNTER[1m])",
    "PCIe link below its maximum": "DCGM_FI_DEV_PCIE_LINK_WIDTH < bool DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH",
    "NVLink bandwidth": "sum by (Hostname, gpu) (DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL) > 0",
    "NVLink CRC errors a second": "rate(DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL[1m])",
    "memory copy, encoder, decoder utilization": (
        "DCGM_FI_DEV_MEM_COPY_UTIL + DCGM_FI_DEV_ENC_UTIL + DCGM_FI_DEV_DEC_UTIL"
    ),
}


_REGEX_SPECIALS = re.compile(r"[\\^$*+?.()|{}\[\]]")


def grafana_all(values: Sequence[str]) -> str:
    """A multi-value variable set to All without an allValue, as Grafana's Prometheus data source
    writes it: each value's regex metacharacters escaped (a doubled backslash inside a PromQL
    string), joined with |."""
    return "(" + "|".join(_REGEX_SPECIALS.sub(lambda m: "\\\\" + m.group(), value) for value in values) + ")"


def dcgm_dashboard_queries(api: PrometheusAPI, dashboard: Mapping[str, Any], revision: str) -> list[tuple[str, str]]:
    values: dict[str, str] = {}
    for name, query in dashboard["variables"].items():
        series, label = label_values_query(substitute(query, values))
        listed = api.label_values(label, series)
        assert listed, f"{revision} ${name}: {query} lists nothing"
        values[name] = grafana_all(listed)
    return [(f"{revision} {title}", substitute(expr, values)) for title, expr in dashboard["panels"].items()]


def test_dcgm_exporter_dashboard_queries_work_in_dcgm_mode(scraping: Stack) -> None:
    if scraping.dcgm_error:
        pytest.xfail(
            f"the agent does not start in dcgm-exporter mode yet (exporters.dcgm_compat): {scraping.dcgm_error}"
        )
    status, text = http_get(f"http://{scraping.dcgm_target}/metrics")
    if status != 200 or not re.search(r"^DCGM_FI_DEV_\w+\{", text, re.MULTILINE):
        pytest.xfail("the agent emits no DCGM_FI_* series with GPULEDGER_EXPORTERS__DCGM_COMPAT=true yet")
    api = scraping.api
    assert not wait_for(lambda: problems(api, [("up", "DCGM_FI_DEV_FB_FREE"), ("up", "DCGM_FI_DEV_GPU_TEMP")]))

    queries = dcgm_dashboard_queries(api, DCGM_DASHBOARD_ORIGINAL, "12239 original")
    queries += dcgm_dashboard_queries(api, DCGM_DASHBOARD_CURRENT, "12239 current")
    expected_empty = [(where, expr) for where, expr in queries if any(name in expr for name in NOT_PROVIDED)]
    provided = [q for q in queries if q not in expected_empty] + list(DCGM_OTHER_QUERIES.items())
    assert len(provided) >= 10
    found = wait_for(lambda: problems(api, provided))
    assert not found, f"{len(found)} of {len(provided)} dcgm-exporter dashboard queries failed:\n" + "\n".join(found)

    for where, expr in expected_empty:
        assert not api.query(expr), f"{where}: {expr} has data now: move it out of NOT_PROVIDED"
