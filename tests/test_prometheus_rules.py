"""deploy/prometheus: the rules pass promtool, their unit tests pass, they name only metrics the
agent emits, and the scrape examples are valid configs that label targets the way the rules need.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import zoneinfo
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporters.catalogue import CATALOGUE
from exporters.promrules import BUILTIN_WORK
from tests.promql import metric_names

PROMETHEUS_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RECORDING_RULES = PROMETHEUS_DIR / "gpuledger-recording.rules.yml"
ALERTING_RULES = PROMETHEUS_DIR / "gpuledger-alerts.rules.yml"
FLEET_RULES = PROMETHEUS_DIR / "gpuledger-fleet.rules.yml"
WORK_RULES = PROMETHEUS_DIR / "gpuledger-work.rules.yml"  # rendered by `gpuledger rules`
RULE_FILES = (RECORDING_RULES, ALERTING_RULES, FLEET_RULES, WORK_RULES)
UNIT_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.test.yml"))
SCRAPE_EXAMPLES = sorted((PROMETHEUS_DIR / "scrape").glob("*.yml"))
FILE_SD_TARGETS = PROMETHEUS_DIR / "scrape" / "targets"

# Series the agent's flag rules emit; listed here as well as in the catalogue because they
# were being added to it at the same time as these rules.
FLAG_METRICS = frozenset({"gpuledger_gpu_flag", "gpuledger_gpu_flag_seconds", "gpuledger_workload_flag"})
PROMETHEUS_METRICS = frozenset({"up"})  # synthesised by Prometheus for every target
# The serving engines' and training jobs' counters the work rules join with (their releases
# are cited in exporters/promrules.py).
WORK_METRICS = frozenset(counter.metric for counter in BUILTIN_WORK)
SEVERITIES = frozenset({"info", "warning", "critical"})

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is missing: install the 'prometheus' package (apt-get install prometheus)"
)
# One worker runs the module, from the start of the suite: xdist hands out the largest groups
# first, and a test alone is handed out last, in file order. promtool's unit tests of the
# cluster alerts and the 10 s budgets evaluate days and hours of rules (15-20 s and 6 s alone);
# started last, they ran alone on one worker after the others had finished.
pytestmark = pytest.mark.xdist_group("promtool")


def promtool(*args: str | Path, cwd: Path | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout_s, check=False
    )


def output(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n{result.stdout}{result.stderr}"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def rules(path: Path) -> Iterator[dict[str, Any]]:
    for group in load_yaml(path)["groups"]:
        yield from group["rules"]


def alerts() -> list[dict[str, Any]]:
    return [rule for rule in rules(ALERTING_RULES) if "alert" in rule]


def recorded_names() -> set[str]:
    return {rule["record"] for path in RULE_FILES for rule in rules(path) if "record" in rule}


# The queries alert annotations run: raw (backquoted) Go template strings handed to printf.
_TEMPLATE_QUERIES = re.compile(r"printf\s+`([^`]*)`")


def annotation_queries(alert: dict[str, Any]) -> list[str]:
    return [query for text in alert.get("annotations", {}).values() for query in _TEMPLATE_QUERIES.findall(text)]


def test_metric_names_finds_names_and_only_names() -> None:
    expr = """
      sum by (cluster, instance) (rate(gpuledger_gpu_cost_dollars_total{rule="idle", a=~"x|y"}[5m])) * 3600
      / on (cluster) group_left (team) (cluster:recorded:ratio > bool 0.5)
      and on () (day_of_week(vector(time() - 300)) == 6) or absent(up{job="b"} offset 1h30m)
      unless sum_over_time((foo_bar and on () vector(1))[2d:5m]) > 1e3
      or label_replace(gpuledger_gpu_up, "dst", "$1", "src", "(.*)")
    """
    assert metric_names(expr) == {
        "gpuledger_gpu_cost_dollars_total",
        "cluster:recorded:ratio",
        "up",
        "foo_bar",
        "gpuledger_gpu_up",
    }


def test_metric_names_reports_a_misspelt_metric() -> None:
    known = {spec.name for spec in CATALOGUE}
    assert metric_names("rate(gpuledger_gpu_cost_dolars_total[5m]) * 3600") - known == {
        "gpuledger_gpu_cost_dolars_total"
    }


def test_annotation_queries_are_found() -> None:
    found = {query for alert in alerts() for query in annotation_queries(alert)}
    assert any("gpuledger_gpu_flag_seconds" in query for query in found)
    assert any("cluster:gpuledger_gpu_idle_cost_dollars:sum_weekend_to_date" in query for query in found)


def _every_expression() -> list[tuple[str, str]]:
    cases = []
    for path in RULE_FILES:
        for rule in rules(path):
            name = rule.get("record") or rule["alert"]
            cases.append((f"{path.name}:{name}", rule["expr"]))
            cases.extend((f"{path.name}:{name}:annotation", query) for query in annotation_queries(rule))
    return cases


@pytest.mark.parametrize(("where", "expr"), _every_expression(), ids=[case[0] for case in _every_expression()])
def test_rules_name_only_known_metrics(where: str, expr: str) -> None:
    known = {spec.name for spec in CATALOGUE} | FLAG_METRICS | PROMETHEUS_METRICS | WORK_METRICS | recorded_names()
    unknown = metric_names(expr) - known
    assert not unknown, f"{where} uses metrics neither the agent nor a recording rule defines: {sorted(unknown)}"


# --- the rules' shape and their test coverage -------------------------------------------------


def test_recording_rules_follow_level_metric_operations() -> None:
    for name in recorded_names():
        level, metric, operations = name.split(":")
        assert level, name
        assert metric.startswith("gpuledger_"), name
        assert operations, name


def test_every_alert_has_a_severity_and_a_summary_and_description() -> None:
    for alert in alerts():
        assert alert.get("labels", {}).get("severity") in SEVERITIES, alert["alert"]
        assert {"summary", "description"} <= set(alert.get("annotations", {})), alert["alert"]


def _unit_test_cases() -> Iterator[dict[str, Any]]:
    for path in UNIT_TESTS:
        yield from load_yaml(path)["tests"]


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in _unit_test_cases():
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {alert["alert"] for alert in alerts()}
    assert names - firing == set(), "alerts no unit test sees firing"
    assert names - quiet == set(), "alerts no unit test sees quiet"


def test_every_recording_rule_is_tested_with_a_value() -> None:
    tested = set()
    for case in _unit_test_cases():
        for check in case.get("promql_expr_test", []):
            if check.get("exp_samples"):
                tested |= metric_names(check["expr"])
    assert recorded_names() - tested == set(), "recording rules no unit test evaluates"


# --- promtool ----------------------------------------------------------------------------------


@needs_promtool
@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(path: Path) -> None:
    result = promtool("check", "rules", "--lint=all", "--lint-fatal", path)
    assert result.returncode == 0, output(result)


def test_unit_tests_exist() -> None:
    assert len(UNIT_TESTS) >= 7, UNIT_TESTS


@needs_promtool
@pytest.mark.parametrize("path", UNIT_TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests(path: Path) -> None:
    # Rule files in a unit test are resolved from the test file's own directory.
    result = promtool("test", "rules", path.name, cwd=path.parent)
    if result.returncode != 0:
        pytest.fail(f"promtool test rules {path.name} failed:\n{output(result)}", pytrace=False)


# --- scrape examples ---------------------------------------------------------------------------

# What Kubernetes service discovery would hand each example's relabelling: the agent's pod or
# endpoint on a GPU node, and a target that is not the agent.
SIMULATED_DISCOVERY: dict[str, list[dict[str, Any]]] = {
    "pod": [
        {
            "targets": ["10.1.2.3:9835"],
            "labels": {
                "__meta_kubernetes_namespace": "gpuledger",
                "__meta_kubernetes_pod_name": "gpuledger-x7k2p",
                "__meta_kubernetes_pod_label_app_kubernetes_io_name": "gpuledger",
                "__meta_kubernetes_pod_container_port_number": "9835",
                "__meta_kubernetes_pod_phase": "Running",
                "__meta_kubernetes_pod_node_name": "gpu-node-01",
            },
        },
        {
            "targets": ["10.1.2.4:8080"],
            "labels": {
                "__meta_kubernetes_pod_label_app_kubernetes_io_name": "vllm",
                "__meta_kubernetes_pod_container_port_number": "8080",
                "__meta_kubernetes_pod_phase": "Running",
                "__meta_kubernetes_pod_node_name": "gpu-node-01",
            },
        },
    ],
    "endpoints": [
        {
            "targets": ["10.1.2.3:9835"],
            "labels": {
                "__meta_kubernetes_namespace": "gpuledger",
                "__meta_kubernetes_service_label_app_kubernetes_io_name": "gpuledger",
                "__meta_kubernetes_endpoint_port_name": "metrics",
                "__meta_kubernetes_endpoint_node_name": "gpu-node-01",
            },
        },
        {
            "targets": ["10.1.2.9:443"],
            "labels": {
                "__meta_kubernetes_service_label_app_kubernetes_io_name": "gpuledger",
                "__meta_kubernetes_endpoint_port_name": "webhook",
                "__meta_kubernetes_endpoint_node_name": "gpu-node-02",
            },
        },
    ],
}
EXPECTED_INSTANCES = {
    "static.yml": {"gpu-node-01", "gpu-node-02", "lab-gpu-01"},
    "file-sd.yml": {"gpu-node-01", "gpu-node-02", "gpu-node-03"},
    "kubernetes-pods.yml": {"gpu-node-01"},
    "kubernetes-endpoints.yml": {"gpu-node-01"},
}
KUBERNETES_SD_KEYS = frozenset(
    {"role", "namespaces", "selectors", "api_server", "kubeconfig_file", "attach_metadata", "follow_redirects"}
)


def scrape_jobs(example: Path) -> list[dict[str, Any]]:
    jobs = load_yaml(example)
    assert isinstance(jobs, list), f"{example.name} should be a list of jobs to paste under scrape_configs:"
    return jobs


def prometheus_yml(tmp_path: Path, jobs: list[dict[str, Any]]) -> Path:
    """A whole prometheus.yml around the example's jobs, loading both rule files; file-SD reads
    the example targets shipped next to the examples."""
    for job in jobs:
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [str(FILE_SD_TARGETS / "*.yml")]
    config = {
        "global": {"scrape_interval": "30s", "evaluation_interval": "1m"},
        "rule_files": [str(path) for path in RULE_FILES],
        "scrape_configs": jobs,
    }
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def with_simulated_discovery(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The jobs with Kubernetes discovery replaced by the static targets it would find."""
    for job in jobs:
        for sd in job.pop("kubernetes_sd_configs", []):
            assert set(sd) <= KUBERNETES_SD_KEYS, f"unknown kubernetes_sd_configs keys: {set(sd) - KUBERNETES_SD_KEYS}"
            job.setdefault("static_configs", []).extend(SIMULATED_DISCOVERY[sd["role"]])
    return jobs


def uses_kubernetes(jobs: list[dict[str, Any]]) -> bool:
    return any("kubernetes_sd_configs" in job for job in jobs)


def test_scrape_examples_exist() -> None:
    assert {path.name for path in SCRAPE_EXAMPLES} == set(EXPECTED_INSTANCES)


@needs_promtool
@pytest.mark.parametrize("example", SCRAPE_EXAMPLES, ids=lambda p: p.name)
def test_scrape_example_is_a_valid_config(example: Path, tmp_path: Path) -> None:
    result = promtool("check", "config", prometheus_yml(tmp_path, scrape_jobs(example)))
    if result.returncode != 0 and uses_kubernetes(scrape_jobs(example)) and "kubernetes_sd_configs" in result.stderr:
        # Debian's promtool (and prometheus) are built without Kubernetes discovery, so they
        # cannot parse kubernetes_sd_configs at all: check everything else of the job, with the
        # discovery block's keys checked against the documented ones above.
        result = promtool("check", "config", prometheus_yml(tmp_path, with_simulated_discovery(scrape_jobs(example))))
    assert result.returncode == 0, output(result)


def discovered_targets(config: Path, job: str) -> list[dict[str, str]]:
    """Targets after relabelling, as `promtool check service-discovery` reports them."""
    targets: list[dict[str, Any]] = []
    for timeout in ("1s", "10s"):  # discovery answers at once; the retry is for a loaded machine
        result = promtool("check", "service-discovery", f"--timeout={timeout}", config, job)
        assert result.returncode == 0, output(result)
        targets = json.loads(result.stdout)
        if targets:
            break
    return [target["labels"] for target in targets if target["labels"]]


@needs_promtool
@pytest.mark.parametrize("example", SCRAPE_EXAMPLES, ids=lambda p: p.name)
def test_scrape_example_labels_targets_for_the_rules(example: Path, tmp_path: Path) -> None:
    """Each kept target has a cluster label, instance = the node's name, port 9835, and no
    target label that would push aside the agent's workload labels."""
    jobs = scrape_jobs(example)
    config = prometheus_yml(tmp_path, with_simulated_discovery(jobs))
    targets = [target for job in jobs for target in discovered_targets(config, job["job_name"])]
    assert {target["instance"] for target in targets} == EXPECTED_INSTANCES[example.name]
    for target in targets:
        assert target.get("cluster"), target
        assert target["__address__"].endswith(":9835"), target
        assert not {"namespace", "pod", "container", "user", "model", "team"} & set(target), target


# --- the Alertmanager example ------------------------------------------------------------------

ALERTMANAGER_EXAMPLE = PROMETHEUS_DIR / "alertmanager" / "gpuledger-routes.example.yml"
_ALERTNAME_MATCHER = re.compile(r'alertname\s*(=~|=)\s*"([^"]*)"')


def _routes(route: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield route
    for child in route.get("routes", []):
        yield from _routes(child)


def test_alertmanager_example_names_real_alerts_and_time_intervals() -> None:
    """The example routes and inhibits only alerts these rules define, through intervals it
    defines in real time zones; with amtool (Debian's prometheus-alertmanager) on the machine,
    Alertmanager's own parser agrees and the weekend alert reaches the finops receiver."""
    config = load_yaml(ALERTMANAGER_EXAMPLE)
    names = {alert["alert"] for alert in alerts()}
    matchers = [m for route in _routes(config["route"]) for m in route.get("matchers", [])]
    for rule in config.get("inhibit_rules", []):
        matchers += rule.get("source_matchers", []) + rule.get("target_matchers", [])
    for op, value in (found for m in matchers for found in _ALERTNAME_MATCHER.findall(m)):
        alertnames = value.split("|") if op == "=~" else [value]
        assert set(alertnames) <= names, f"{ALERTMANAGER_EXAMPLE.name} names unknown alerts in {value!r}"

    intervals = {interval["name"]: interval["time_intervals"] for interval in config["time_intervals"]}
    for route in _routes(config["route"]):
        for name in route.get("active_time_intervals", []) + route.get("mute_time_intervals", []):
            assert name in intervals, name
    zones = zoneinfo.available_timezones()
    for spec in (spec for specs in intervals.values() for spec in specs):
        assert not zones or spec["location"] in zones, spec

    amtool = shutil.which("amtool")
    if amtool is not None:
        checked = subprocess.run(
            [amtool, "check-config", str(ALERTMANAGER_EXAMPLE)], capture_output=True, text=True, check=False
        )
        assert checked.returncode == 0, output(checked)
        route = [amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_EXAMPLE}"]
        routed = subprocess.run(
            [*route, "alertname=GPUClusterIdleWeekend", "cluster=prod"], capture_output=True, text=True, check=False
        )
        assert routed.stdout.split() == ["finops"], output(routed)
