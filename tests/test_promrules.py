"""`gpuledger rules`: the work and budget rules it renders are what deploy/prometheus ships,
pass promtool, join the counters a config names on the labels it names, follow a time zone's
month boundaries (daylight saving time included), and bad input is one line, exit 2.

The shipped files' own promtool unit tests (deploy/prometheus/tests/work.test.yml and
budgets.test.yml) run in tests/test_prometheus_rules.py.
"""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli.main import main
from exporters.promrules import (
    LOCAL_MONTH,
    MONTH_END,
    MONTH_OFFSET,
    MONTH_START,
    BudgetPlan,
    calendar_rules,
    zone_offsets,
)
from tests.helpers import operator_models
from tests.test_cli import gpuledger as cli

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
WORK_RULES = PROMETHEUS_DIR / "gpuledger-work.rules.yml"
FLEET_RULES = PROMETHEUS_DIR / "gpuledger-fleet.rules.yml"
BUDGETS_EXAMPLE = PROMETHEUS_DIR / "budgets" / "budgets.example.yaml"
BUDGET_RULES_EXAMPLE = PROMETHEUS_DIR / "budgets" / "gpuledger-budgets.example.rules.yml"
# The budgets file of deploy/prometheus/tests/budgets-10s.test.yml, and its rules.
BUDGETS_10S = PROMETHEUS_DIR / "tests" / "budgets-10s.yaml"
BUDGET_RULES_10S = PROMETHEUS_DIR / "tests" / "budgets-10s.rules.yml"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is missing: apt-get install prometheus")

# One price unit a minute: $1/1024 a second (exact in binary, as promtool compares exactly).
UNIT_PER_MINUTE = 0.05859375


def gpuledger(*args: str) -> subprocess.CompletedProcess[str]:
    return cli(*args, timeout=60)


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300, check=False
    )


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def write(path: Path, data: Any) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    text = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def sample(expr: str, at: str, labels: str, value: float) -> dict[str, Any]:
    return {"expr": expr, "eval_time": at, "exp_samples": [{"labels": labels, "value": value}]}


def promtool_test(tmp_path: Path, rule_files: list[Path], tests: list[dict[str, Any]], interval: str = "1m") -> None:
    unit = write(
        tmp_path / "unit.test.yml",
        {"rule_files": [str(p) for p in rule_files], "evaluation_interval": interval, "tests": tests},
    )
    result = promtool("test", "rules", unit, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# --- work rules ----------------------------------------------------------------------------------


def test_the_shipped_work_rules_are_what_gpuledger_rules_renders() -> None:
    result = gpuledger("rules")
    assert result.returncode == 0, result.stderr
    assert result.stdout == WORK_RULES.read_text(encoding="utf-8"), (
        "deploy/prometheus/gpuledger-work.rules.yml is stale: run "
        "`gpuledger rules --out deploy/prometheus/gpuledger-work.rules.yml` (and deploy/helm/sync-rules.sh)"
    )
    # Every engine, with the release its names come from.
    for cited in ("vLLM 0.", "SGLang 0.", "TGI 2.", "Triton Inference Server 2."):
        assert cited in result.stdout


WORK_CONFIG = {
    "work": [
        # A site's own step counter, from a Slurm job's exporter: replaces the built-in one.
        {"name": "training_steps", "metric": "trainer_steps_total", "unit": "step", "join": ["hpc_job"]},
        # An embedding service scraped with its pod under other label names.
        {
            "name": "embedded_texts",
            "metric": "embedder_texts_total",
            "unit": "text",
            "scale": 1000,
            "join": {"namespace": "kubernetes_namespace", "pod": "kubernetes_pod_name"},
        },
        # Joined on the model alone: no per-model level of its own.
        {"name": "images", "metric": "sd_images_total", "unit": "image", "join": {"model": "model_id"}},
    ]
}


@needs_promtool
def test_configured_counters_join_on_the_labels_they_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path / "config.yaml", WORK_CONFIG)
    out = tmp_path / "gpuledger-work.rules.yml"
    code, stdout, err = run(capsys, "rules", "--config", str(config), "--out", str(out))
    assert (code, stdout, err) == (0, "", "")
    text = out.read_text(encoding="utf-8")
    checked = promtool("check", "rules", "--lint=all", "--lint-fatal", out)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "training_steps_total" not in text  # the configured name replaces the built-in one
    assert 'rate(trainer_steps_total{hpc_job!=""}[5m])' in text
    assert "vllm:generation_tokens_total" in text  # the other built-ins stay
    groups = {group["name"]: group["rules"] for group in yaml.safe_load(text)["groups"]}
    assert [rule["record"] for rule in groups["gpuledger-work-images"]] == [
        "model:gpuledger_work_images:rate5m",
        "model:gpuledger_images_cost_dollars_each:ratio_rate5m",
    ]

    # The numbers, through the fleet rules' per-owner cost:
    #   Slurm job 8812 (llama-ft, research) on 2 GPUs of 1 unit: $2/1024 a second, over half a
    #   step a second = $1/256 = $0.00390625 a step.
    #   Pod search/embedder-0 (bge, search) on 1 unit: $1/1024 a second over 512 texts a second,
    #   x 1000 = 1000/2^19 = $0.0019073486328125 a thousand texts.
    gpu = {"cluster": "prod", "job": "gpuledger", "instance": "node-01"}
    job = {"hpc_job": "8812", "user": "alice", "model": "llama-ft", "team": "research"}
    pod = {"namespace": "search", "pod": "embedder-0", "container": "embed", "model": "bge", "team": "search"}
    inputs = [
        series("gpuledger_workload_cost_dollars_total", {**gpu, "gpu": "0", **job}, f"0+{UNIT_PER_MINUTE}x20"),
        series("gpuledger_workload_cost_dollars_total", {**gpu, "gpu": "1", **job}, f"0+{UNIT_PER_MINUTE}x20"),
        series("gpuledger_workload_cost_dollars_total", {**gpu, "gpu": "2", **pod}, f"0+{UNIT_PER_MINUTE}x20"),
        series("trainer_steps_total", {"cluster": "prod", "job": "slurm-jobs", "hpc_job": "8812"}, "0+30x20"),
        series(
            "embedder_texts_total",
            {
                "cluster": "prod",
                "job": "embedders",
                "kubernetes_namespace": "search",
                "kubernetes_pod_name": "embedder-0",
            },
            f"0+{512 * 60}x20",
        ),
    ]
    steps = "hpc_job:gpuledger_training_steps_cost_dollars_each:ratio_rate5m"
    texts = "namespace_pod:gpuledger_embedded_texts_cost_dollars_per_thousand:ratio_rate5m"
    checks = [
        sample(steps, "10m", f'{steps}{{cluster="prod",hpc_job="8812",model="llama-ft",team="research"}}', 0.00390625),
        sample(
            "model:gpuledger_training_steps_cost_dollars_each:ratio_rate5m",
            "10m",
            'model:gpuledger_training_steps_cost_dollars_each:ratio_rate5m{cluster="prod",model="llama-ft"}',
            0.00390625,
        ),
        sample(
            "namespace_pod:gpuledger_work_embedded_texts:rate5m",
            "10m",
            'namespace_pod:gpuledger_work_embedded_texts:rate5m{cluster="prod",namespace="search",pod="embedder-0"}',
            512,
        ),
        sample(
            texts,
            "10m",
            f'{texts}{{cluster="prod",namespace="search",pod="embedder-0",model="bge",team="search"}}',
            0.0019073486328125,
        ),
    ]
    promtool_test(
        tmp_path, [FLEET_RULES, out], [{"interval": "1m", "input_series": inputs, "promql_expr_test": checks}]
    )


@pytest.mark.parametrize(
    ("work", "expected"),
    [
        ([{"name": "steps", "metric": "bad name"}], "work.0.metric"),
        ([{"name": "Steps", "metric": "steps_total"}], "work.0.name"),
        ([{"name": "steps", "metric": "steps_total", "join": ["jobid"]}], "'jobid' is not a workload label"),
        ([{"name": "steps", "metric": "steps_total", "join": {"pod": "kubernetes pod"}}], "is not a label name"),
        ([{"name": "steps", "metric": "steps_total", "scale": 100}], "work.0.scale"),
        (
            [
                {"name": "tokens", "metric": "a_total", "scale": 1000},
                {"name": "tokens", "metric": "b_total", "scale": 1000000},
            ],
            "tokens: a_total and b_total add up",
        ),
    ],
)
def test_a_bad_work_counter_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], work: list[dict[str, Any]], expected: str
) -> None:
    config = write(tmp_path / "config.yaml", {"work": work})
    for args in (("rules", "--config", str(config)), ("check-config", str(config))):
        code, out, err = run(capsys, *args)
        assert code == 2, args
        assert out == ""
        assert expected in err, err
        assert str(config) in err
        assert "Traceback" not in err
    code, _, err = run(capsys, "rules", "--config", str(config))
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("budgets", [False, True], ids=["work", "budgets"])
def test_prometheusrule_format_is_a_valid_manifest_of_the_same_groups(
    capsys: pytest.CaptureFixture[str], budgets: bool
) -> None:
    extra = ("--budgets", str(BUDGETS_EXAMPLE)) if budgets else ()
    code, rules_text, _ = run(capsys, "rules", *extra)
    assert code == 0
    code, manifest_text, _ = run(capsys, "rules", *extra, "--format", "prometheusrule")
    assert code == 0
    manifest = yaml.safe_load(manifest_text)
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"]["name"] == ("gpuledger-budgets" if budgets else "gpuledger-work")
    # The operator's CRD model drops what its schema does not know: a round trip loses nothing.
    parsed = operator_models().PrometheusRule.model_validate(manifest)
    assert parsed.model_dump(mode="json", by_alias=True, exclude_unset=True) == manifest
    assert manifest["spec"]["groups"] == yaml.safe_load(rules_text)["groups"]


def test_out_writes_the_file_and_refuses_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "work.rules.yml"
    assert run(capsys, "rules", "--out", str(out))[0] == 0
    assert out.read_text(encoding="utf-8") == WORK_RULES.read_text(encoding="utf-8")
    assert out.stat().st_mode & 0o777 == 0o644
    code, _, err = run(capsys, "rules", "--out", str(tmp_path))
    assert code == 2
    assert "is a directory" in err


# --- budgets -------------------------------------------------------------------------------------


def test_the_example_budget_rules_are_what_gpuledger_rules_renders() -> None:
    result = gpuledger("rules", "--budgets", str(BUDGETS_EXAMPLE))
    assert result.returncode == 0, result.stderr
    assert result.stdout == BUDGET_RULES_EXAMPLE.read_text(encoding="utf-8"), (
        "deploy/prometheus/budgets/gpuledger-budgets.example.rules.yml is stale: re-render it with "
        "gpuledger rules --budgets deploy/prometheus/budgets/budgets.example.yaml --out ..."
    )


def test_the_10s_budget_rules_promtool_tests_are_what_gpuledger_rules_renders() -> None:
    result = gpuledger("rules", "--budgets", str(BUDGETS_10S))
    assert result.returncode == 0, result.stderr
    assert result.stdout == BUDGET_RULES_10S.read_text(encoding="utf-8"), (
        "deploy/prometheus/tests/budgets-10s.rules.yml is stale: re-render it with "
        "gpuledger rules --budgets deploy/prometheus/tests/budgets-10s.yaml --out ..."
    )


# resolution -> (the group's interval, the finer tile's record or None, the hour tile's step),
# New York (months start on the hour).
RESOLUTIONS = {
    None: ("5m", None, "5m"),
    "1h": ("5m", None, "5m"),
    "30m": ("5m", "increase30m", "5m"),
    "450s": ("225s", "increase450s", "225s"),  # 7.5m: its largest divisor up to 5m
    "5m": ("5m", "increase5m", "5m"),
    "10s": ("10s", "increase10s", "10s"),
    "1s": ("1s", "increase1s", "1s"),
}


@pytest.mark.parametrize("resolution", RESOLUTIONS, ids=str)
def test_resolution_sets_the_tile_the_step_and_the_interval(tmp_path: Path, resolution: str | None) -> None:
    """Finer tiles and the step their rates are read at, and the group runs every step; the
    default (and the hour itself) renders the example's rules exactly."""
    interval, finer, step = RESOLUTIONS[resolution]
    text = BUDGETS_EXAMPLE.read_text(encoding="utf-8")
    if resolution is not None:
        text += f"resolution: {resolution}\n"
    out = tmp_path / "budgets.rules.yml"
    result = gpuledger("rules", "--budgets", str(write(tmp_path / "budgets.yaml", text)), "--out", str(out))
    assert result.returncode == 0, result.stderr
    group = yaml.safe_load(out.read_text(encoding="utf-8"))["groups"][0]
    assert group["interval"] == interval
    records = {rule.get("record"): rule["expr"] for rule in group["rules"]}
    hour_tile = records["budget:gpuledger_cost_dollars:increase1h"]
    assert f":{step}]) / {3600 // parse_seconds(step)}" in hour_tile
    if finer is None:
        assert out.read_text(encoding="utf-8") == BUDGET_RULES_EXAMPLE.read_text(encoding="utf-8")
        assert not [
            name
            for name in records
            if name
            and name.startswith("budget:gpuledger_cost_dollars:increase")
            and name != "budget:gpuledger_cost_dollars:increase1h"
        ]
    else:
        assert f"budget:gpuledger_cost_dollars:{finer}" in records
        assert f"budget:gpuledger_cost_dollars:{finer}" in records["budget:gpuledger_cost_dollars:month_to_date"]


def parse_seconds(text: str) -> int:
    return int(text[:-1]) * {"s": 1, "m": 60, "h": 3600}[text[-1]]


def test_zone_offsets_are_each_months_start_offset() -> None:
    # Berlin: CET (+1) at the start of November to March, CEST (+2) April to October.
    assert zone_offsets("Europe/Berlin", 2026) == (3600,) * 3 + (7200,) * 7 + (3600,) * 2
    # Sydney, the other way round: AEDT (+11) at the start of November to April (it ends on the
    # first Sunday of April and begins on the first Sunday of October, both after the 1st).
    assert zone_offsets("Australia/Sydney", 2026) == (39600,) * 4 + (36000,) * 6 + (39600,) * 2
    assert zone_offsets("+05:30", 2026) == (19800,) * 12
    assert zone_offsets("UTC-03:30", 2026) == (-12600,) * 12
    assert zone_offsets("UTC", 2026) == (0,) * 12
    with pytest.raises(ValueError, match="unknown time zone 'Mars/Olympus'"):
        zone_offsets("Mars/Olympus", 2026)
    with pytest.raises(ValueError, match="quarter hours"):
        zone_offsets("+05:20", 2026)


# Zones whose month starts test every path: summer time at some month starts (Berlin, New York,
# St John's at a half hour), the southern hemisphere (Sydney), and fixed offsets on a half or
# quarter hour (Kolkata, Kathmandu), on either side of UTC.
CALENDAR_ZONES = ("Europe/Berlin", "America/New_York", "Australia/Sydney", "America/St_Johns", "Asia/Kolkata", "+05:45")


@needs_promtool
def test_month_boundaries_follow_the_zone_summer_time_included(tmp_path: Path) -> None:
    """The calendar rules at a quarter hour before and at each month start of a year, in each
    zone: the local month, its start offset, start and end. A promtool test clock starts at
    1970-01-01 and steps through every rule at every interval, so each boundary gets a rule
    group of its own whose clock is shifted to an hour before it (time() + shift)."""
    year = 2026
    groups, checks = [], []
    for zone in CALENDAR_ZONES:
        offsets = zone_offsets(zone, year)

        def start(month: int, y: int = year, offsets: tuple[int, ...] = offsets) -> int:
            # The UTC instant of local midnight on the 1st, under that month's start offset.
            y, month = (y + 1, 1) if month == 13 else (y - 1, 12) if month == 0 else (y, month)
            return int(dt.datetime(y, month, 1, tzinfo=dt.UTC).timestamp()) - offsets[month - 1]

        for month in range(1, 13):
            shift = start(month) - 3600
            label = f"{zone}@{month}"
            rules = calendar_rules(BudgetPlan(label, offsets, 86400, (), year))
            for rule in rules:
                rule["expr"] = rule["expr"].replace("time()", f"(time() + {shift})")
            groups.append({"name": label, "interval": "15m", "rules": rules})
            for at, local in (("45m", month - 1), ("1h", month)):
                number = (local - 1) % 12 + 1
                expected = {
                    LOCAL_MONTH: number,
                    MONTH_OFFSET: offsets[number - 1],
                    MONTH_START: start(local),
                    MONTH_END: start(local + 1),
                }
                for record, value in expected.items():
                    selector = f'{record}{{timezone="{label}"}}'
                    checks.append(sample(selector, at, selector, value))
    rules_file = write(tmp_path / "calendar.rules.yml", {"groups": groups})
    promtool_test(tmp_path, [rules_file], [{"interval": "15m", "input_series": [], "promql_expr_test": checks}], "15m")


@needs_promtool
def test_a_half_hour_zone_sums_quarter_hours_and_resets_at_its_midnight(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """St John's (UTC-03:30 in winter): January starts at 03:30 UTC on the test clock's first
    day. Spend is summed by quarter hours there, so the month boundary falls between two."""
    budgets = write(
        tmp_path / "budgets.yaml",
        {"timezone": "America/St_Johns", "budgets": [{"team": "research", "monthly_dollars": 100}]},
    )
    out = tmp_path / "budgets.rules.yml"
    assert run(capsys, "rules", "--budgets", str(budgets), "--out", str(out))[0] == 0
    assert "budget:gpuledger_cost_dollars:increase15m" in out.read_text(encoding="utf-8")
    spend = "budget:gpuledger_cost_dollars:month_to_date"
    # $12/h from 00:05: a quarter hour holds 3 of its 5m steps, $3.
    checks = [
        # 03:15: December's 13 quarter hours 00:15..03:15: $39.
        sample(spend, "3h15m", f'{spend}{{team="research"}}', 39),
        # 03:30: January, nothing yet; 04:30: its quarter hours to 03:45 .. 04:30, $12.
        sample(spend, "3h30m", f'{spend}{{team="research"}}', 0),
        sample(spend, "4h30m", f'{spend}{{team="research"}}', 12),
    ]
    inputs = [series("team:gpuledger_workload_cost_dollars_per_hour:rate5m", {"team": "research"}, "_ 12x100")]
    promtool_test(tmp_path, [out], [{"interval": "5m", "input_series": inputs, "promql_expr_test": checks}], "5m")


# Teams whose names hold what a PromQL string, a regex, a selector and a Go template treat
# specially, and what YAML 1.1 reads as line breaks (NEL, the line and paragraph separators: the
# rule file held "\u2028" followed by spaces, or NEL as a newline), each beside a team named like a
# regex that matches every team.
ODD_TEAMS = ['a"b\\c}d|x ü', "line\u2028para\u2029next\x85line"]


@needs_promtool
@pytest.mark.parametrize("odd_team", ODD_TEAMS, ids=ascii)
def test_a_budget_alerts_for_the_team_it_names_and_only_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], odd_team: str
) -> None:
    budgets = write(
        tmp_path / "budgets.yaml",
        {"budgets": [{"team": odd_team, "monthly_dollars": 30}, {"team": ".*", "monthly_dollars": 30}]},
    )
    out = tmp_path / "budgets.rules.yml"
    assert run(capsys, "rules", "--budgets", str(budgets), "--out", str(out))[0] == 0
    result = promtool("check", "rules", out)
    assert result.returncode == 0, result.stdout + result.stderr
    # The odd team spends $12/h from 00:05: an hour tile holds 12 5m rates of $12/h, $12; its three
    # tiles to 03:00 are $36 (3 x 12), over its $30; at 02:55 two, $24. Team ".*" spends nothing.
    quoted = odd_team.replace("\\", "\\\\").replace('"', '\\"')
    inputs = [
        {"series": f'team:gpuledger_workload_cost_dollars_per_hour:rate5m{{team="{quoted}"}}', "values": "_ 12x100"}
    ]
    fired = {
        "exp_labels": {"severity": "critical", "team": odd_team},
        "exp_annotations": {
            "summary": f"GPU spend of team {odd_team} has passed its budget this month (UTC)",
            "description": f"team {odd_team} has spent $36 this month (UTC), its monthly budget is $30.",
        },
    }
    alerts = [
        {"eval_time": "2h55m", "alertname": "GPUBudgetExceeded"},
        {"eval_time": "3h", "alertname": "GPUBudgetExceeded", "exp_alerts": [fired]},
    ]
    spend = "budget:gpuledger_cost_dollars:month_to_date"
    checks = [sample(f'{spend}{{team=".*"}}', "3h", f'{spend}{{team=".*"}}', 0)]
    tests = [{"interval": "5m", "input_series": inputs, "alert_rule_test": alerts, "promql_expr_test": checks}]
    promtool_test(tmp_path, [out], tests, "5m")


BAD_BUDGETS = [
    ("budgets: []\n", "budgets: List should have at least 1 item"),
    ("timezone: UTC\n", "budgets: Field required"),
    ("budgets: [{team: a, monthly_dollars: 10}]\nmonth_starts: 1\n", "month_starts: unknown key"),
    ("budgets: [{team: a, namespace: b, monthly_dollars: 10}]\n", "budgets.0: give exactly one of"),
    ("budgets: [{monthly_dollars: 10}]\n", "budgets.0: give exactly one of"),
    ("budgets: [{team: a, monthly_dollars: -5}]\n", "budgets.0.monthly_dollars"),
    ("budgets: [{team: a, monthly_dollars: .nan}]\n", "budgets.0.monthly_dollars"),
    # YAML's yes/on/true was read as a budget of $1.
    ("budgets: [{team: a, monthly_dollars: yes}]\n", "budgets.0.monthly_dollars: a number of dollars, got true"),
    ("budgets: [{team: a, monthly_dollars: 10, teams: b}]\n", "budgets.0.teams: unknown key"),
    ("timezone: Mars/Olympus\nbudgets: [{team: a, monthly_dollars: 10}]\n", "timezone: unknown time zone"),
    ("forecast_window: 90m\nbudgets: [{team: a, monthly_dollars: 10}]\n", "forecast_window: whole hours"),
    ("forecast_window: soon\nbudgets: [{team: a, monthly_dollars: 10}]\n", "forecast_window: expected a duration"),
    ("budgets: [{team: a, monthly_dollars: 10}, {team: a, monthly_dollars: 20}]\n", "team 'a' has two budgets"),
    # A lone surrogate rendered a rule file (exit 0) that promtool and Prometheus refuse to load.
    ('budgets: [{team: "a\\ud800", monthly_dollars: 10}]\n', "budgets.0: team: not a label value: 'a\\ud800'"),
    ("budgets: [{team: a, monthly_dollars: 10}\n", "budgets.yaml: line"),
    ("- team: a\n", "expected a mapping with budgets:"),
    ("resolution: 7s\nbudgets: [{team: a, monthly_dollars: 10}]\n", "resolution: whole seconds that divide 1h"),
    ("resolution: 2h\nbudgets: [{team: a, monthly_dollars: 10}]\n", "resolution: whole seconds that divide 1h"),
    ("resolution: 1.5s\nbudgets: [{team: a, monthly_dollars: 10}]\n", "resolution: whole seconds that divide 1h"),
    ("resolution: 0s\nbudgets: [{team: a, monthly_dollars: 10}]\n", "resolution: whole seconds that divide 1h"),
    ("resolution: soon\nbudgets: [{team: a, monthly_dollars: 10}]\n", "resolution: expected a duration"),
    # St John's months start on the half hour: 30m divides the hour, not the quarter hour.
    (
        "timezone: America/St_Johns\nresolution: 30m\nbudgets: [{team: a, monthly_dollars: 10}]\n",
        "resolution: America/St_Johns's months start on a half or quarter hour",
    ),
]


@pytest.mark.parametrize(("text", "expected"), BAD_BUDGETS, ids=[case[1] for case in BAD_BUDGETS])
def test_a_bad_budgets_file_is_one_line_naming_the_key_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    path = write(tmp_path / "budgets.yaml", text)
    code, out, err = run(capsys, "rules", "--budgets", str(path))
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{path}:"), err
    assert expected in err, err


def test_a_missing_budgets_file_is_exit_2_through_the_real_command(tmp_path: Path) -> None:
    result = gpuledger("rules", "--budgets", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"{tmp_path / 'nope.yaml'}: no such budgets file"
