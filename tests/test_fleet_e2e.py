"""The fleet end to end, real components only: 40 `gpuledger run --fake` nodes (five scenarios,
each node with its own name, at 1440x), and a fake vLLM or Triton /metrics for each serving pod,
scraped every 2 seconds by a real Prometheus in agent mode that remote-writes to a real
VictoriaMetrics, where vmalert evaluates every shipped recording rule. Then `report --prometheus`
against VictoriaMetrics is held to the sum of the nodes' own ledgers, and every recording rule
must have data.

What can differ, and by how much: each node's agent goes on polling after Prometheus's last
scrape of it until it is stopped, so its ledger holds a little more than the store: exactly its
price x its GPUs x the scenario time between the last poll booked that the store saw (the
accounting stage's last success, gpuledger_stage_last_success_timestamp_seconds{stage="account"})
and the last poll the ledger recorded. Not the last successful poll: a poll that finds the driver
down still books its time (unobserved); CI once saw a node's store equal to its ledger while its
last-poll timestamp lagged two polls, cause unknown (a failure prints what the store last saw of
the node's polls and stages). Per node the test
checks that figure to the cent's fraction; per team, model and job, that the store is never
above the ledgers and below them by at most that tail, for the GPUs the group held.

Recording rules are found in deploy/prometheus (RECORDING_RULE_FILES; the few that cannot have
data here are in NO_DATA, each with why); other queries go in FLEET_QUERIES: each must return
data from VictoriaMetrics at a moment every node was up.

Budgets: `gpuledger rules --budgets` renders a budgets file summed by 2 s (render_budgets) for the same
vmalert, with one budget the fleet passes within seconds and one it never reaches; vmalert must
report GPUBudgetExceeded firing for the first, to its notifier too, and never for the second.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from agent.fleet.promapi import PrometheusAPI
from agent.fleet.report import StoreQuery, read_counters, report_from_prometheus, usage_rows
from agent.fleet.source import Window
from agent.ledger.read import read_info, read_usage
from agent.ledger.report import report_from_ledgers
from tests import promstore
from tests.fake_engines import Engine, Engines
from tests.test_prometheus_e2e import ROOT, free_port, start, wait_http

VMALERT = shutil.which("vmalert")  # victoria-metrics' rule evaluator: the shipped recording rules, run

pytestmark = [
    pytest.mark.skipif(
        promstore.PROMETHEUS is None or promstore.VICTORIA_METRICS is None or VMALERT is None,
        reason="the fleet test needs Debian's prometheus and victoria-metrics (with vmalert): apt-get install "
        "prometheus victoria-metrics (scripts/check installs both)",
    ),
    # One worker starts its stores, whatever the others run (pyproject's --dist loadgroup).
    pytest.mark.xdist_group("fleet-e2e"),
]

NODES = 40
SCENARIOS = ("demo", "weekend-idle", "mig", "old-driver", "gpu-lost")
GPUS = {"demo": 8, "weekend-idle": 8, "mig": 2, "old-driver": 2, "gpu-lost": 4}
SPEED = 1440  # a scenario day per real minute
PRICE = 2.5  # $/GPU-hour, every GPU of every node (pricing.gpu_hourly)
SCRAPE_INTERVAL = "2s"
RUN_S = 2.0  # how long every node is scraped, at least, once all are in the store
STARTUP_S = 60.0  # how long the fleet may take to answer (40 agents building at once on two cores)
AGENT_CONFIG = {
    "pricing": {"gpu_hourly": PRICE},
    # One poll per 20 scenario minutes: 0.83 s of real time at 1440x (the default 5 s would be
    # a poll every 20 ms on each of 40 nodes).
    "poll_interval": "1200s",
    # A finished workload's series stay exported this long (default 1h: 2.5 real seconds at
    # 1440x, when a busy runner may skip scrapes): its last value must reach the store.
    "accounting": {"forget_after": "30d"},
    "attribution": {
        "rules": [
            {"match": {"namespace": "^research-"}, "set": {"team": "research"}},
            {"match": {"namespace": "^serving$"}, "set": {"team": "inference"}},
            {"match": {"account": "^nlp$"}, "set": {"team": "nlp"}},
            {"match": {"account": "^research$"}, "set": {"team": "research"}},
        ]
    },
}
GROUPINGS = (("team",), ("model",), ("hpc_job",), ("namespace", "pod"))

# Queries that must return data from VictoriaMetrics at the end of the run: (what, PromQL), for
# queries that are not recording rules (every shipped recording rule is checked on its own:
# RECORDING_RULE_FILES, evaluated by vmalert during the run).
FLEET_QUERIES: list[tuple[str, str]] = [
    ("every node's cost", "count(sum by (instance) (rate(gpuledger_gpu_cost_dollars_total[30s]))) == 40"),
    (
        "dollars per generated token (vLLM), joined by pod",
        "sum by (namespace, pod) (rate(gpuledger_workload_cost_dollars_total[30s]))"
        " / on (namespace, pod) sum by (namespace, pod) (rate(vllm:generation_tokens_total[30s]))",
    ),
    (
        "dollars per inference (Triton), joined by pod",
        "sum by (namespace, pod) (rate(gpuledger_workload_cost_dollars_total[30s]))"
        " / on (namespace, pod) sum by (namespace, pod) (rate(nv_inference_count[30s]))",
    ),
]


# Every rules file of deploy/prometheus that holds recording rules only (alerting rules need an
# Alertmanager, and promtool tests cover them): vmalert evaluates them during the run and writes
# the results into VictoriaMetrics, as a Prometheus server would into its own store.
RECORDING_RULE_FILES = sorted(
    path
    for path in (ROOT / "deploy" / "prometheus").glob("*.rules.yml")
    if all(
        "record" in rule
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]
        for rule in group["rules"]
    )
)
# Recording rules that have no data in this fleet, and why.
NO_DATA = {
    "cluster:gpuledger_gpu_idle_cost_dollars:sum_weekend_to_date": "only has data on a Saturday or Sunday",
    **dict.fromkeys(
        (
            "namespace_pod:gpuledger_work_training_steps:rate5m",
            "namespace_pod:gpuledger_training_steps_cost_dollars_each:ratio_rate5m",
            "model:gpuledger_work_training_steps:rate5m",
            "model:gpuledger_training_steps_cost_dollars_each:ratio_rate5m",
        ),
        "no pod of the fleet exports a training step counter (its training runs are Slurm jobs)",
    ),
}


# Budgets summed by 2 s, so that the month-to-date grows within the run (the default hour tile
# would hold nothing yet: the store holds about two real minutes), evaluated every 2 s, so that
# the alert fires while the recording rules are still being waited for. team research holds GPUs
# 5 and 7 of each of the 8 demo nodes the whole run (notebook pods in research-nlp and
# research-cv): 16 GPUs x $2.50/h x 1440 (scenario hours per real hour) = $57600 a real hour,
# or 57600 x 2 / 3600 = $32 in each 2 s tile (the weekend-idle nodes' research job adds to it
# for its first 10 real seconds). Its $10 is passed by the first tile read at a third of that
# rate. namespace serving (a share of one GPU on 16 of the nodes) spends less than the whole
# fleet, 192 GPUs x $2.50 x 1440 = $691200 a real hour: its $1e12 is out of reach.
BUDGET_RESOLUTION = "2s"
EXCEEDED = ("team", "research", 10.0)
NOT_EXCEEDED = ("namespace", "serving", 1e12)


def budgets_zone(now: float) -> str:
    """UTC, or +12:00 where UTC's month turns within 2 hours of `now`: the budgets' month must
    not restart (and the alert resolve) during the run."""
    for zone, offset_s in (("UTC", 0), ("+12:00", 12 * 3600)):
        local = dt.datetime.fromtimestamp(now + offset_s, dt.UTC)
        start = local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = (start + dt.timedelta(days=32)).replace(day=1)
        if min(local - start, end - local) > dt.timedelta(hours=2):
            return zone
    raise AssertionError("unreachable: UTC and +12:00 cannot both be near a month's turn")


def render_budgets(work: Path) -> Path:
    """The budget rules, rendered through the real command from a budgets file."""
    budgets = work / "budgets.yaml"
    entries = [{kind: value, "monthly_dollars": dollars} for kind, value, dollars in (EXCEEDED, NOT_EXCEEDED)]
    budgets.write_text(
        yaml.safe_dump({"timezone": budgets_zone(time.time()), "resolution": BUDGET_RESOLUTION, "budgets": entries}),
        encoding="utf-8",
    )
    from tests.test_cli import gpuledger

    out = work / "gpuledger-budgets.rules.yml"
    result = gpuledger("rules", "--budgets", str(budgets), "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


@dataclass
class Notifier:
    """An Alertmanager's alert API as far as vmalert uses it: POST /api/v2/alerts, a JSON list
    of alerts, each with its labels. It keeps every alert it was sent."""

    url: str = ""
    received: list[dict[str, Any]] = field(default_factory=list)

    def __enter__(self) -> Notifier:
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.endswith("/api/v2/alerts"):
                    received.extend(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def firing_budgets(vmalert_url: str) -> set[tuple[str, str]]:
    """The budgets vmalert reports GPUBudgetExceeded firing for, as (kind, value)."""
    answer = httpx.get(f"{vmalert_url}/api/v1/alerts", timeout=10).raise_for_status().json()
    alerts: list[dict[str, Any]] = answer["data"]["alerts"] or []  # null while none is active
    return {
        (kind, alert["labels"][kind])
        for alert in alerts
        if alert["name"] == "GPUBudgetExceeded" and alert["state"] == "firing"
        for kind in ("team", "namespace", "model")
        if kind in alert["labels"]
    }


def recorded_names() -> list[str]:
    return sorted(
        rule["record"]
        for path in RECORDING_RULE_FILES
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]
        for rule in group["rules"]
    )


def rules_without_data(api: PrometheusAPI, at: float, among: Sequence[str] | None = None) -> list[str]:
    """The recording rules expected to have data that have none at `at` (the last 5 minutes);
    `among`: only those of them."""
    weekend = time.gmtime(at).tm_wday >= 5
    expected = [name for name in recorded_names() if name not in NO_DATA or (weekend and "weekend" in name)]
    asked = expected if among is None else [name for name in expected if name in among]
    return [name for name in asked if not api.instant(f"last_over_time({name}[5m])", at)]


def node_scenario(index: int) -> tuple[str, dict[str, Any], list[Engine]]:
    """The scenario of node `index` (a built-in one, named for the node, its pods' names made
    unique in the fleet) and the engines of its serving pods."""
    name = SCENARIOS[index % len(SCENARIOS)]
    path = ROOT / "fake_nvml" / "scenarios" / f"{name}.yaml"
    scenario: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    scenario["node"]["hostname"] = f"fleet-{index:02d}"
    if name == "mig":  # a Triton pod beside the training run on the whole GPU
        pod = {
            "namespace": "serving",
            "name": "triton",
            "container": "triton",
            "uid": "7a1b2c3d-0000-4000-8000-000000000001",
        }
        triton = {"pid": 803, "gpus": [1], "sm_util": 30, "memory_mib": 12000, "pod": pod}
        scenario["processes"].append({**triton, "cmdline": "tritonserver --model-repository=/models"})
    serving: dict[str, Engine] = {}
    for entry in [*scenario.get("processes", ()), *scenario.get("allocations", ())]:
        pod = entry.get("pod")
        if pod is None:
            continue
        pod = entry["pod"] = {**pod, "name": f"{pod['name']}-{index:02d}", "uid": f"{pod['uid'][:-2]}{index:02d}"}
        if pod["container"] in ("vllm", "triton"):
            model = "meta-llama/Llama-3.1-8B-Instruct" if pod["container"] == "vllm" else "resnet50"
            serving[pod["name"]] = Engine(pod["container"], pod["namespace"], pod["name"], model)
    return name, scenario, list(serving.values())


@dataclass
class Node:
    name: str
    scenario: str
    ledger: Path
    log: Path
    pid: int = 0
    target: str = ""  # host:port, once it serves (it binds a free port of its own choosing)

    @property
    def dollars_per_hour(self) -> float:
        return GPUS[self.scenario] * PRICE

    def tail(self, lines: int = 20) -> str:
        text = self.log.read_text(encoding="utf-8", errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Fleet:
    api: PrometheusAPI
    nodes: list[Node]
    engines: list[Engine]
    since: float
    until: float
    running_at: float  # a moment every node was up and scraped: what dashboards and rules see live
    budgets_firing: set[tuple[str, str]]  # GPUBudgetExceeded firing in vmalert, once it was
    notified: list[dict[str, Any]]  # every alert vmalert sent its notifier


def agent_mode_flag() -> str:
    """Prometheus 3 has --agent; Prometheus 2 (Debian 12's 2.42) has the feature flag."""
    assert promstore.PROMETHEUS is not None
    help_text = subprocess.run([promstore.PROMETHEUS, "--help"], check=False, capture_output=True, text=True).stderr
    return "--agent" if re.search(r"--(\[no-\])?agent\b", help_text) else "--enable-feature=agent"


def prometheus_config(nodes: Sequence[Node], engines: Sequence[Engine], write_url: str) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
        "scrape_configs": [
            {
                "job_name": "gpuledger",
                # instance = the node's name, as the shipped scrape configs set it
                "static_configs": [{"targets": [n.target], "labels": {"instance": n.name}} for n in nodes],
            },
            *(
                {
                    "job_name": kind,
                    # As Kubernetes service discovery labels a pod's targets.
                    "static_configs": [
                        {"targets": [f"127.0.0.1:{e.port}"], "labels": {"namespace": e.namespace, "pod": e.pod}}
                        for e in engines
                        if e.kind == kind
                    ],
                }
                for kind in ("vllm", "triton")
            ),
        ],
        "remote_write": [{"url": write_url, "queue_config": {"batch_send_deadline": "1s", "max_backoff": "1s"}}],
    }


def wait_settled(api: PrometheusAPI, since: float, timeout_s: float = 30.0) -> None:
    """Until the store shows as many gpuledger samples as half a second before (and some):
    everything it was sent is searchable."""
    window = f"{math.ceil(time.time() - since) + 60}s"
    query = f'sum(count_over_time({{__name__=~"gpuledger_.+"}}[{window}]))'
    before = -1.0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = api.instant(query, time.time())
        count = answer[0].value if answer else 0.0
        if count > 0 and count == before:
            return
        before = count
        time.sleep(0.5)
    raise AssertionError("VictoriaMetrics kept changing: not every sample it was sent is searchable")


def nodes_scraped(api: PrometheusAPI, url: str) -> int:
    """How many nodes the store has two scrapes or more of (what it was sent made searchable
    first: VictoriaMetrics takes seconds to index new series on its own)."""
    httpx.get(f"{url}/internal/force_flush", timeout=10).raise_for_status()
    answer = api.instant("count(count_over_time(gpuledger_polls_total[1m]) >= 2)", time.time())
    return int(answer[0].value) if answer else 0


def wait(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


_SERVING = re.compile(r"serving http://(127\.0\.0\.1:\d+)/metrics")


def serving(node: Node) -> bool:
    """Whether the node's agent serves, learning its address from its log line saying so."""
    if not node.target:
        found = _SERVING.search(node.log.read_text(encoding="utf-8", errors="replace")) if node.log.exists() else None
        if found is None:
            return False
        node.target = found[1]
    try:
        return httpx.get(f"http://{node.target}/metrics", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("fleet")
    log = _Timer(work / "timing.log")
    config = work / "agent.yaml"
    config.write_text(yaml.safe_dump(AGENT_CONFIG), encoding="utf-8")
    nodes: list[Node] = []
    engines: list[Engine] = []
    for i in range(NODES):
        scenario_name, scenario, pods = node_scenario(i)
        engines += pods
        scenario_file = work / f"fleet-{i:02d}.yaml"
        scenario_file.write_text(yaml.safe_dump(scenario), encoding="utf-8")
        name = f"fleet-{i:02d}"
        nodes.append(Node(name, scenario_name, work / f"{name}.db", work / f"{name}.log"))
    budget_rules = render_budgets(work)
    with contextlib.ExitStack() as stack:
        vm = stack.enter_context(promstore.victoria_metrics(work))
        notifier = stack.enter_context(Notifier())
        assert VMALERT is not None
        vmalert_url = f"http://127.0.0.1:{free_port()}"
        vmalert = start(
            "vmalert",
            [VMALERT, *(f"-rule={path}" for path in (*RECORDING_RULE_FILES, budget_rules)),
             f"-datasource.url={vm.url}", f"-remoteWrite.url={vm.url}", f"-notifier.url={notifier.url}",
             "-evaluationInterval=1s", "-remoteWrite.flushInterval=1s", f"-httpListenAddr={vmalert_url[7:]}",
             "-loggerLevel=ERROR"],
            work / "vmalert.log",
        )  # fmt: skip
        stack.callback(vmalert.stop)
        served = Engines(engines)
        served.start()
        stack.callback(served.close)
        since = time.time() - 5
        launcher = start_nodes(nodes, config, work)
        stack.callback(stop_nodes, nodes, launcher)
        for node in nodes:
            wait(lambda n=node: serving(n), STARTUP_S, f"{node.name} to serve:\n{node.tail()}")
        log("every agent serves")
        prometheus_yml = work / "prometheus.yml"
        prometheus_yml.write_text(
            yaml.safe_dump(prometheus_config(nodes, engines, f"{vm.url}/api/v1/write")), encoding="utf-8"
        )
        assert promstore.PROMETHEUS is not None
        web = f"http://127.0.0.1:{free_port()}"
        prometheus = start(
            "prometheus",
            [promstore.PROMETHEUS, agent_mode_flag(), f"--config.file={prometheus_yml}",
             f"--storage.agent.path={work / 'agent-wal'}", f"--web.listen-address={web[7:]}", "--log.level=warn"],
            work / "prometheus.log",
        )  # fmt: skip
        stack.callback(prometheus.stop)
        wait_http(prometheus, f"{web}/-/ready")
        log("Prometheus scraping")
        api = stack.enter_context(PrometheusAPI(vm.url))
        wait(lambda: nodes_scraped(api, vm.url) >= NODES, 60, "every node's scrapes in the store")
        log("every node scraped twice")

        budgets_firing: set[tuple[str, str]] = set()
        missing: list[str] | None = None  # the rules still without data (None: not asked yet)

        # Rules that read other rules' results have them a few evaluations later; the budget
        # alert, two or three 2 s evaluations of its group after the first cost rates (vmalert writes
        # a tile one evaluation and reads it the next).
        def rules_done() -> bool:
            nonlocal missing
            # What vmalert wrote is searchable at once (VictoriaMetrics would take seconds to
            # index each new series), so rules that read other rules' results get them sooner.
            httpx.get(f"{vm.url}/internal/force_flush", timeout=10).raise_for_status()
            # A rule with data has it for the rest of the run: only the others are asked again.
            missing = rules_without_data(api, time.time(), missing)
            budgets_firing.update(firing_budgets(vmalert_url))
            log(f"{len(missing)} rules without data {missing[:3]}, budgets exceeded: {sorted(budgets_firing)}")
            return not missing and EXCEEDED[:2] in budgets_firing

        with contextlib.suppress(AssertionError):
            wait(rules_done, 45, "the recording rules' results and the budget alert")
        log("the recording rules have data")
        time.sleep(RUN_S)
        running_at = time.time() - 1.5  # a scrape ago: the store holds it, from every node
        codes = stop_nodes(nodes, launcher)
        assert codes == [0] * NODES, [(n.name, code, n.tail()) for n, code in zip(nodes, codes, strict=True) if code]
        log("every agent stopped, its ledger written")
        # Stopped, Prometheus sends what it still holds (within --storage.remote.flush-deadline).
        prometheus.popen.send_signal(signal.SIGTERM)
        assert prometheus.popen.wait(timeout=60) == 0, prometheus.tail()
        httpx.get(f"{vm.url}/internal/force_flush", timeout=10).raise_for_status()
        wait_settled(api, since)
        log("every sample in VictoriaMetrics")
        budgets_firing.update(firing_budgets(vmalert_url))
        yield Fleet(api, nodes, engines, since, time.time() + 1, running_at, budgets_firing, notifier.received)


def start_nodes(nodes: Sequence[Node], config: Path, work: Path) -> subprocess.Popen[str]:
    """Every node's `gpuledger run --fake`, forked from one launcher (tests/fleet_launcher.py)."""
    specs = [
        {"argv": ["run", "--config", str(config), "--fake", str(work / f"{n.name}.yaml"), "--fake-speed", str(SPEED),
                  "--listen", "127.0.0.1:0", "--ledger", str(n.ledger)], "log": str(n.log)}
        for n in nodes
    ]  # fmt: skip
    (work / "nodes.json").write_text(json.dumps(specs), encoding="utf-8")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tests.fleet_launcher", str(work / "nodes.json")],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert launcher.stdout is not None
    pids = json.loads(launcher.stdout.readline())["pids"]
    for node, pid in zip(nodes, pids, strict=True):
        node.pid = pid
    return launcher


def stop_nodes(nodes: Sequence[Node], launcher: subprocess.Popen[str]) -> list[int]:
    """SIGTERM to every node, as systemd or the kubelet stops it; their exit codes ([] once told)."""
    if launcher.stdout is None or launcher.stdout.closed:
        return []
    if launcher.poll() is None:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGTERM)
    try:
        out, _ = launcher.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGKILL)
        launcher.kill()
        out, _ = launcher.communicate()
    for line in (out or "").splitlines():
        if line.startswith('{"exit_codes"'):
            codes: list[int] = json.loads(line)["exit_codes"]
            return codes
    return [-1] * len(nodes)


class _Timer:
    def __init__(self, path: Path) -> None:
        self.path, self.start = path, time.monotonic()

    def __call__(self, what: str) -> None:
        with self.path.open("a") as f:
            f.write(f"{time.monotonic() - self.start:7.2f}s {what}\n")
        print(f"{time.monotonic() - self.start:7.2f}s {what}", file=sys.stderr)


@dataclass(frozen=True)
class Tail:
    """What a node's ledger holds beyond the store: the scenario seconds after the last poll the
    store saw, and what they cost (the node's price for all its GPUs)."""

    seconds: float
    dollars: float


@pytest.fixture(scope="module")
def tails(fleet: Fleet) -> dict[str, Tail]:
    window = f"{math.ceil(fleet.until - fleet.since)}s"
    seen = {
        s.label("instance"): s.value
        for s in fleet.api.instant(
            f'last_over_time(gpuledger_stage_last_success_timestamp_seconds{{stage="account"}}[{window}])', fleet.until
        )
    }
    out = {}
    for node in fleet.nodes:
        last = read_info(node.ledger).last_at
        assert last is not None
        seconds = last - seen[node.name]
        out[node.name] = Tail(seconds, node.dollars_per_hour * seconds / 3600)
    return out


def test_every_node_differs_by_exactly_what_it_charged_after_its_last_scrape(
    fleet: Fleet, tails: dict[str, Tail]
) -> None:
    growth = read_counters(fleet.api, Window(fleet.since, fleet.until), "instance")
    stored: dict[str, list[float]] = {}
    for row in usage_rows(growth, "instance", hour=0):
        stored.setdefault(row.node, []).append(row.dollars)
    assert sorted(stored) == sorted(node.name for node in fleet.nodes)
    for node in fleet.nodes:
        ledger = math.fsum(row.dollars for row in read_usage(node.ledger))
        tail = tails[node.name]
        # Stopped a scrape interval or so (2 s) after its last scrape, at 1440x: an hour of
        # scenario time or two, and every second of it at the node's price (8 GPUs: $20.00 an
        # hour). VictoriaMetrics keeps 12 significant digits: a timestamp to 0.1 ms or so.
        assert -1e-3 <= tail.seconds <= 6 * 3600, node.name
        assert ledger - math.fsum(stored[node.name]) == pytest.approx(tail.dollars, abs=1e-6), last_seen(fleet, node)


def last_seen(fleet: Fleet, node: Node) -> str:
    """What the store last saw of a node's polls, and what its ledger and log say: for a failure."""
    window = f"{math.ceil(fleet.until - fleet.since)}s"
    names = (
        "gpuledger_polls_total",
        "gpuledger_poll_failures_total",
        "gpuledger_last_poll_timestamp_seconds",
        "gpuledger_stage_last_success_timestamp_seconds",
        "gpuledger_stage_failures_total",
    )
    seen = [
        f"{name}{{{s.label('stage')}}} = {s.value!r}"
        for name in names
        for s in fleet.api.instant(f'last_over_time({name}{{instance="{node.name}"}}[{window}])', fleet.until)
    ]
    info = read_info(node.ledger)
    return "\n".join([f"{node.name}: ledger {info.first_at!r}..{info.last_at!r}", *seen, node.tail(30)])


@pytest.mark.parametrize("by", GROUPINGS, ids=",".join)
def test_the_fleet_report_is_the_sum_of_the_ledgers(fleet: Fleet, tails: dict[str, Tail], by: Sequence[str]) -> None:
    store = report_from_prometheus(fleet.api, StoreQuery(fleet.since, fleet.until), by=by)
    ledgers = report_from_ledgers([node.ledger for node in fleet.nodes], by=by)
    held = gpus_held(fleet, by)
    tail_per_gpu = {name: tail.seconds / 3600 * PRICE for name, tail in tails.items()}

    def bound(key: tuple[str, ...]) -> float:
        """The most a group's ledger can hold beyond the store: its GPUs' tails."""
        return sum(count * tail_per_gpu[node] for node, count in held.get(key, {}).items())

    ours = {line.key: line.dollars for line in store.lines}
    theirs = {line.key: line.dollars for line in ledgers.lines}
    assert set(ours) <= set(theirs)
    for key, dollars in theirs.items():
        difference = dollars - ours.get(key, 0.0)
        assert -1e-6 <= difference <= bound(key) + 1e-6, (key, dollars, ours.get(key), bound(key))
    everything = sum(tail.dollars for tail in tails.values())
    assert 0 <= ledgers.total.dollars - store.total.dollars == pytest.approx(everything, abs=1e-6)
    # Who left GPUs idle: the same workloads, each no more in the store than in the ledgers and
    # less by no more than every node's tail.
    theirs_left = {line.left_by: line.dollars for line in ledgers.idle_by}
    assert store.idle_by
    for line in store.idle_by:
        assert line.left_by in theirs_left
        assert -1e-6 <= theirs_left[line.left_by] - line.dollars <= everything + 1e-6, line.left_by
    # The store holds the whole fleet: 40 nodes x 2 to 8 GPUs, an hour or more each.
    assert store.total.gpu_hours_charged > NODES * 2


def gpus_held(fleet: Fleet, by: Sequence[str]) -> dict[tuple[str, ...], dict[str, int]]:
    """Group key -> node -> how many GPUs (or MIG instances) the group held there."""
    held: dict[tuple[str, ...], dict[str, set[str]]] = {}
    for node in fleet.nodes:
        for row in read_usage(node.ledger):
            if row.idle or row.unobserved:
                continue
            key = tuple(
                row.node if k == "node" else str(row.gpu) if k == "gpu" else getattr(row.workload, k) for k in by
            )
            held.setdefault(key, {}).setdefault(node.name, set()).add(row.uuid)
    return {key: {n: len(uuids) for n, uuids in nodes.items()} for key, nodes in held.items()}


def test_every_recording_rule_has_data(fleet: Fleet) -> None:
    assert RECORDING_RULE_FILES, "no recording rules in deploy/prometheus"
    missing = rules_without_data(fleet.api, fleet.running_at)
    assert not missing, f"recording rules without data in VictoriaMetrics (vmalert.log beside the store): {missing}"


def test_fleet_queries_return_data(fleet: Fleet) -> None:
    empty = [what for what, expr in FLEET_QUERIES if not fleet.api.instant(expr, fleet.running_at)]
    assert not empty, f"no data from VictoriaMetrics for: {empty}"


def test_each_serving_pod_costs_something_per_unit_of_work(fleet: Fleet) -> None:
    expr = (
        "sum by (pod) (increase(gpuledger_workload_cost_dollars_total[1m])) / on (pod) "
        "sum by (pod) (increase(vllm:generation_tokens_total[1m]) or increase(nv_inference_count[1m]))"
    )
    per_pod = {s.label("pod"): s.value for s in fleet.api.instant(expr, fleet.running_at)}
    assert set(per_pod) == {engine.pod for engine in fleet.engines}
    assert all(value > 0 for value in per_pod.values()), per_pod


def test_the_cli_reads_victoria_metrics(fleet: Fleet) -> None:
    from tests.test_cli import gpuledger

    result = gpuledger(
        "report", "--prometheus", fleet.api.url, "--since", f"{math.ceil(fleet.until - fleet.since)}s",
        "--by", "team", "--format", "csv",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    kinds = [line.split(",")[0] for line in result.stdout.splitlines()[1:]]
    assert kinds.count("group") >= 3
    assert kinds[-3:] == ["idle", "unobserved", "total"]


def test_a_budget_alert_fires_for_the_budget_passed_only(fleet: Fleet) -> None:
    exceeded, other = EXCEEDED[:2], NOT_EXCEEDED[:2]
    assert exceeded in fleet.budgets_firing, (
        f"GPUBudgetExceeded never fired in vmalert (vmalert.log): {fleet.budgets_firing}"
    )
    assert other not in fleet.budgets_firing
    # vmalert sent it on, labelled as the budget is.
    notified = {(a["labels"]["alertname"], a["labels"].get(exceeded[0])) for a in fleet.notified}
    assert ("GPUBudgetExceeded", exceeded[1]) in notified, fleet.notified
    # What vmalert wrote into the store, over the whole run: the alert firing for the one budget,
    # never for the other, whose spend the rules did read (so its silence is not for want of data).
    window = f"{math.ceil(fleet.until - fleet.since)}s"
    fired = fleet.api.instant(
        f'max_over_time(ALERTS{{alertname="GPUBudgetExceeded", alertstate="firing"}}[{window}])', fleet.until
    )
    assert {s.label(exceeded[0]) for s in fired} == {exceeded[1]}, [s.labels for s in fired]
    spent = fleet.api.instant(
        f'max_over_time(budget:gpuledger_cost_dollars:month_to_date{{{other[0]}="{other[1]}"}}[{window}])', fleet.until
    )
    assert spent, "no month-to-date spend recorded for the budget not passed"
    assert 0 < spent[0].value < NOT_EXCEEDED[2], spent
