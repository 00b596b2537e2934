"""deploy/grafana: the committed dashboards are what the generator writes, every panel queries
Prometheus, every query names only metrics the agent emits or the rules record, and every
template variable a query uses is defined. tests/test_prometheus_e2e.py runs the queries.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporters.catalogue import CATALOGUE
from tests.promql import metric_names

ROOT = Path(__file__).resolve().parent.parent
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARDS_DIR = GRAFANA_DIR / "dashboards"
GENERATOR = GRAFANA_DIR / "generate.py"
RULE_FILES = sorted((ROOT / "deploy" / "prometheus").glob("*.rules.yml"))
EXPECTED_DASHBOARDS = ("gpuledger-cost.json", "gpuledger-fleet-overview.json", "gpuledger-node.json")

PROMETHEUS_METRICS = frozenset({"up"})  # synthesised by Prometheus for every target
# Grafana's own variables (https://grafana.com/docs/grafana/latest/dashboards/variables/add-template-variables/#global-variables).
GRAFANA_VARIABLES = frozenset(
    {
        "__interval",
        "__interval_ms",
        "__rate_interval",
        "__rate_interval_ms",
        "__range",
        "__range_s",
        "__range_ms",
        "__from",
        "__to",
        "__dashboard",
        "__org",
        "__user",
        "__name",
        "timeFilter",
    }
)


# --- reading dashboards (tests/test_prometheus_e2e.py uses these too) ----------------------------


def load_dashboards() -> dict[str, dict[str, Any]]:
    """File name -> dashboard, for every committed dashboard."""
    return {path.name: json.loads(path.read_text(encoding="utf-8")) for path in sorted(DASHBOARDS_DIR.glob("*.json"))}


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that shows data: rows are skipped, a collapsed row's panels are not."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def panel_queries(dashboard: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) for every PromQL target of every panel; where is "title/refId"."""
    return [
        (f"{panel['title']}/{target.get('refId', '?')}", target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def variables(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(dashboard.get("templating", {}).get("list", []))


def variable_query(variable: Mapping[str, Any]) -> str:
    query = variable.get("query", "")
    return str(query.get("query", "")) if isinstance(query, Mapping) else str(query)


_VARIABLE_REFS = re.compile(r"\$\{(\w+)(?:[:.][^}]*)?\}|\$(\w+)|\[\[(\w+)(?::\w+)?\]\]")


def variable_refs(text: str) -> set[str]:
    return {next(group for group in match.groups() if group) for match in _VARIABLE_REFS.finditer(text)}


def substitute(text: str, values: Mapping[str, str]) -> str:
    """Replace $name, ${name} and [[name]] with values[name]; an unknown name is a KeyError."""
    return _VARIABLE_REFS.sub(lambda match: values[next(group for group in match.groups() if group)], text)


_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.*),)?\s*(\w+)\s*\)\s*$", re.DOTALL)


def label_values_query(query: str) -> tuple[str, str]:
    """(series selector, label) of a `label_values(series, label)` variable query."""
    match = _LABEL_VALUES.match(query)
    if not match:
        raise ValueError(f"not a label_values() query: {query!r}")
    return (match.group(1) or "").strip(), match.group(2)


def recorded_names() -> set[str]:
    return {
        rule["record"]
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]
        for rule in group["rules"]
        if "record" in rule
    }


def known_metrics() -> set[str]:
    return {spec.name for spec in CATALOGUE} | recorded_names() | PROMETHEUS_METRICS


# --- the generator ------------------------------------------------------------------------------


def test_committed_dashboards_are_what_the_generator_writes(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(GENERATOR), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, (
        f"{GENERATOR.relative_to(ROOT)} failed (is grafana-foundation-sdk installed? pip install -e '.[test]'):\n"
        f"{result.stdout}{result.stderr}"
    )
    generated = {path.name: path.read_text(encoding="utf-8") for path in sorted(tmp_path.glob("*.json"))}
    committed = {path.name: path.read_text(encoding="utf-8") for path in sorted(DASHBOARDS_DIR.glob("*.json"))}
    hint = f"the committed dashboards are stale: run `python {GENERATOR.relative_to(ROOT)}` and commit the JSON"
    assert sorted(generated) == sorted(committed), hint
    stale = [name for name in generated if generated[name] != committed[name]]
    assert not stale, f"{hint} ({', '.join(stale)} differ)"


def test_generator_output_is_deterministic(tmp_path: Path) -> None:
    outputs = []
    for run in ("a", "b"):
        out = tmp_path / run
        subprocess.run(
            [sys.executable, str(GENERATOR), "--out", str(out)], check=True, timeout=120, capture_output=True
        )
        outputs.append({path.name: path.read_bytes() for path in sorted(out.glob("*.json"))})
    assert outputs[0] == outputs[1]


def test_the_three_dashboards_are_shipped() -> None:
    assert tuple(sorted(load_dashboards())) == EXPECTED_DASHBOARDS


# --- every dashboard --------------------------------------------------------------------------

DASHBOARDS = load_dashboards()
EVERY_PANEL = [
    pytest.param(dashboard, panel, id=f"{name}:{panel.get('title')}")
    for name, dashboard in DASHBOARDS.items()
    for panel in panels(dashboard)
]
EVERY_DASHBOARD = [pytest.param(dashboard, id=name) for name, dashboard in DASHBOARDS.items()]


@pytest.mark.parametrize(("dashboard", "panel"), EVERY_PANEL)
def test_every_panel_has_a_promql_target(dashboard: dict[str, Any], panel: dict[str, Any]) -> None:
    targets = panel.get("targets", [])
    assert any(target.get("expr", "").strip() for target in targets), f"{panel.get('title')!r}: no PromQL target"
    assert panel.get("datasource") == {"type": "prometheus", "uid": "${datasource}"}
    ref_ids = [target.get("refId") for target in targets]
    assert all(ref_ids), f"{panel.get('title')!r}: a target without refId"
    assert len(set(ref_ids)) == len(ref_ids), f"{panel.get('title')!r}: duplicate refIds {ref_ids}"
    assert panel.get("title"), "every panel has a title"
    assert panel.get("description"), f"{panel.get('title')!r}: every panel says what it shows"


@pytest.mark.parametrize("dashboard", EVERY_DASHBOARD)
def test_every_metric_is_catalogued_or_recorded(dashboard: dict[str, Any]) -> None:
    known = known_metrics()
    queries = panel_queries(dashboard) + [
        (f"${v['name']}", label_values_query(variable_query(v))[0])
        for v in variables(dashboard)
        if v["type"] == "query"
    ]
    unknown = {where: sorted(metric_names(expr) - known) for where, expr in queries if metric_names(expr) - known}
    assert not unknown, f"metrics neither in exporters/catalogue.py nor recorded in deploy/prometheus: {unknown}"


@pytest.mark.parametrize("dashboard", EVERY_DASHBOARD)
def test_every_template_variable_used_is_defined(dashboard: dict[str, Any]) -> None:
    defined: set[str] = set()
    for variable in variables(dashboard):
        # A variable's query may use only variables defined before it (Grafana resolves in order).
        early = variable_refs(variable_query(variable)) - defined - GRAFANA_VARIABLES
        assert not early, f"${variable['name']} uses {sorted(early)} before they are defined"
        defined.add(variable["name"])
    text = json.dumps(list(panels(dashboard)))
    undefined = variable_refs(text) - defined - GRAFANA_VARIABLES
    assert not undefined, f"undefined template variables: {sorted(undefined)}"


@pytest.mark.parametrize("dashboard", EVERY_DASHBOARD)
def test_dashboard_identity_and_variables(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"].startswith("gpuledger-")
    assert "gpuledger" in dashboard["tags"]
    names = [variable["name"] for variable in variables(dashboard)]
    assert names[:3] == ["datasource", "cluster", "instance"]
    assert variables(dashboard)[0]["type"] == "datasource"
    for variable in variables(dashboard)[1:]:
        label_values_query(variable_query(variable))  # a label_values() query, so the e2e test can run it
        if variable.get("includeAll"):
            # "All" must also match series without the label or with it empty (Slurm jobs have no namespace).
            assert variable.get("allValue") == ".*", variable["name"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"


FLEET_DASHBOARD = "gpuledger-fleet-overview.json"


def test_the_fleet_dashboard_reads_recording_rules_only() -> None:
    """On 500 nodes a query over the agents' per-GPU series reads thousands of them; every
    fleet panel and variable reads recording-rule series instead (a few per node or workload)."""
    dashboard = DASHBOARDS[FLEET_DASHBOARD]
    recorded = recorded_names()
    queries = panel_queries(dashboard) + [
        (f"${v['name']}", label_values_query(variable_query(v))[0])
        for v in variables(dashboard)
        if v["type"] == "query"
    ]
    assert len(queries) > 30
    raw = {where: sorted(metric_names(expr) - recorded) for where, expr in queries if metric_names(expr) - recorded}
    assert not raw, f"fleet queries that read series no recording rule records: {raw}"
    assert all(metric_names(expr) for _, expr in queries), "every query names a series"
    # The per-owner, per-job and per-unit-of-work levels are there, not only per node.
    used = set().union(*(metric_names(expr) for _, expr in queries))
    for level in ("owner:", "team:", "model:", "hpc_job:", "instance:", "namespace_pod:"):
        assert any(name.startswith(level) for name in used), level


def test_metric_names_finds_names_and_only_names() -> None:
    expr = (
        'sum by (namespace) (increase(gpuledger_workload_cost_dollars_total{cluster=~"$cluster"}[$__range]))'
        " / on (cluster) group_left (source) cluster:gpuledger_gpus_up:sum or on () vector(0)"
        ' * label_replace(up{job="x"}, "a", "b", "c", "") > bool 1e3'
        " + sum_over_time(owner:x:rate5m[$__range:$__interval]) * $__interval_ms / 3600000"
    )
    assert metric_names(expr) == {
        "gpuledger_workload_cost_dollars_total",
        "cluster:gpuledger_gpus_up:sum",
        "up",
        "owner:x:rate5m",
    }


def test_variable_refs_and_substitution() -> None:
    text = 'x{a=~"$cluster", b="${instance}", c="[[gpu]]"}[$__range] $/h'
    assert variable_refs(text) == {"cluster", "instance", "gpu", "__range"}
    values = {"cluster": "e2e", "instance": "n1", "gpu": ".*", "__range": "1m"}
    assert substitute(text, values) == 'x{a=~"e2e", b="n1", c=".*"}[1m] $/h'


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is missing: apt-get install prometheus")
def test_every_query_parses(tmp_path: Path) -> None:
    """promtool parses every panel and variable query, as recording rules in a scratch file."""
    values = dict.fromkeys(("cluster", "instance", "gpu", "namespace", "team", "model"), ".*")
    values |= {"__range": "1h", "__rate_interval": "1m", "__interval": "15s", "__interval_ms": "15000"}
    rules = []
    for name, dashboard in DASHBOARDS.items():
        series = [label_values_query(variable_query(v))[0] for v in variables(dashboard)[1:]]
        for n, expr in enumerate([expr for _, expr in panel_queries(dashboard)] + [s for s in series if s]):
            rules.append(
                {
                    "record": f"dashboard:{name.removesuffix('.json').replace('-', '_')}:q{n}",
                    "expr": substitute(expr, values),
                }
            )
    path = tmp_path / "dashboards.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}), encoding="utf-8")
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, f"{result.stdout}{result.stderr}"
