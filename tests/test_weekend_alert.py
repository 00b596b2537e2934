"""The idle weekend reaches a human: the agent's own metrics from a simulation of the
`weekend-idle` node, fed to `promtool test rules` with the shipped rules, fire
`GPUClusterIdleWeekend` on Saturday with the dollars wasted in its annotation."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.config import load_catalogue
from tests.helpers import WEEKEND_ALERT_SERIES, WeekendIdleRun

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
STEP_S = 60
# promtool's clock starts at 1970-01-01T00:00Z, a Thursday; the scenario starts on a Friday at
# 18:00, so its t=0 is promtool's 1d18h and its weekend falls on promtool's Saturday and Sunday.
OFFSET_MIN = (24 + 18) * 60
KEEP = WEEKEND_ALERT_SERIES
TARGET = {"cluster": "sim", "instance": "gpu-node-07:9835", "job": "gpuledger"}
P4DE = load_catalogue().instance_types["p4de.24xlarge"]
BURN = P4DE.dollars_per_hour  # all eight GPUs idle: the whole instance's price per hour
ALERT = "GPUClusterIdleWeekend"
RULE_FILES = ("gpuledger-recording.rules.yml", "gpuledger-alerts.rules.yml")
# Recording groups before the alert groups that read them: promtool's order is otherwise not
# fixed, and the alert's annotation could read a result one evaluation old.
GROUP_ORDER = (
    "gpuledger-fleet",
    "gpuledger-cost",
    "gpuledger-waste",
    "gpuledger-gpu-alerts",
    "gpuledger-cluster-alerts",
    "gpuledger-health-alerts",
)


def series_of(run: WeekendIdleRun, hours: float) -> dict[str, list[float]]:
    """Each kept series of the agent's /metrics, once per simulated minute from t=0."""
    assert run.step_s == STEP_S
    series: dict[str, list[float]] = {}
    for i, samples in enumerate(run.first_day[: int(hours * 3600 / STEP_S) + 1]):
        for name, labels, value in samples:
            if name in KEEP:
                with_target = {**labels, **TARGET}
                key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(with_target.items())) + "}"
                series.setdefault(key, [float("nan")] * i).append(value)
    return series


def rules_the_alert_reads(alert: str, out: Path) -> list[str]:
    """The shipped rules as promtool must evaluate them for `alert`: the alert and every
    recording rule its expression or annotations read, transitively, verbatim and in their own
    groups, written to `out`; the names of those groups. The other rules are evaluated by their
    own promtool tests; left in, they would triple this test's evaluation time for nothing."""
    rules = [
        (group, rule)
        for name in RULE_FILES
        for group in yaml.safe_load((RULES / name).read_text(encoding="utf-8"))["groups"]
        for rule in group["rules"]
    ]
    recorded = {rule["record"]: rule for _, rule in rules if "record" in rule}
    wanted = [rule for _, rule in rules if rule.get("alert") == alert]
    assert len(wanted) == 1, f"{alert} is not one alerting rule of {RULE_FILES}"
    kept = {id(wanted[0])}
    for rule in wanted:  # grows as the rules read are found
        read = rule["expr"] + " " + " ".join(str(v) for v in rule.get("annotations", {}).values())
        for name in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", read):
            if name in recorded and id(recorded[name]) not in kept:
                kept.add(id(recorded[name]))
                wanted.append(recorded[name])
    groups: dict[str, dict[str, Any]] = {}
    for group, rule in rules:
        if id(rule) in kept:
            groups.setdefault(group["name"], {**{k: v for k, v in group.items() if k != "rules"}, "rules": []})
            groups[group["name"]]["rules"].append(rule)
    out.write_text(yaml.safe_dump({"groups": list(groups.values())}, sort_keys=False), encoding="utf-8")
    return list(groups)


def promtool_values(values: list[float]) -> str:
    """promtool's expanding notation, one `a+bxn` run per stretch of constant increment."""
    missing = next((i for i, v in enumerate(values) if not math.isnan(v)), len(values))  # NaN: not yet exported
    parts = [f"_x{OFFSET_MIN + missing}"]
    values = values[missing:]
    i = 0
    while i < len(values):
        j = i + 1
        step = values[j] - values[i] if j < len(values) else 0.0
        while j + 1 < len(values) and abs((values[j + 1] - values[j]) - step) <= 1e-9 * max(1.0, abs(values[j])):
            j += 1
        runs = j - i if j < len(values) else 0
        parts.append(f"{values[i]!r}+{step!r}x{runs}" if runs else repr(values[i]))
        i = j + 1 if runs else j
    return " ".join(parts)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (scripts/check installs it)")
@pytest.mark.xdist_group("weekend-idle")  # with test_weekend.py: the simulation runs once
def test_the_weekend_idle_simulation_fires_the_weekend_alert_with_its_dollars(
    tmp_path: Path, weekend_idle: WeekendIdleRun
) -> None:
    series = series_of(weekend_idle, hours=24)  # Friday 18:00 to Saturday 18:00
    idle_flags = [k for k in series if k.startswith("gpuledger_gpu_flag") and 'rule="idle"' in k]
    assert len(idle_flags) == 8
    saturday_18 = f"{2 * 24 + 18}h"  # promtool time of the scenario's Saturday 18:00
    weekend_dollars = BURN * 18  # Saturday 00:00 to 18:00, all eight GPUs idle
    last_4h = BURN * 4
    description = (
        "8 of 8 GPUs in cluster sim are idle with no workload, and most have been for 4h or more this weekend. "
        f"Idle cost this weekend so far (since Saturday 00:00 UTC): ${weekend_dollars:.2f}; over the last 4h: "
        f"${last_4h:.2f}; burning ${BURN:.2f}/h now. "
        # Who left them idle: job 9001 ends at 22:00 Friday; the last minute's poll that saw it
        # on its GPUs was 21:59. All the idle cost of the last 4h is booked to it: it left all
        # eight GPUs idle (gpuledger_gpu_idle_left_by_cost_dollars_total).
        "Left idle by job 9001 (user dave), last seen on them at 2026-11-20 21:59:00 +0000 UTC: "
        f"${last_4h:.2f} of idle cost over the last 4h. "
        "Scale the node pool down or give the GPUs to a batch queue."
    )
    rule_file = tmp_path / "weekend.rules.yml"
    groups = rules_the_alert_reads(ALERT, rule_file)
    assert {"gpuledger-fleet", "gpuledger-cost", "gpuledger-cluster-alerts"} <= set(groups), groups
    test = {
        "rule_files": [str(rule_file)],
        # Every 5m, the weekend subquery's step (as deploy/prometheus/tests/cluster-alerts.test.yml):
        # the figures are the same as at 1m, at a fifth of the evaluations.
        "evaluation_interval": "5m",
        "group_eval_order": [name for name in GROUP_ORDER if name in groups],
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": k, "values": promtool_values(v)} for k, v in sorted(series.items())],
                "alert_rule_test": [
                    # Friday 23:30: every GPU has been idle 1 h, but it is a weekday.
                    {"eval_time": f"{24 + 23}h30m", "alertname": ALERT, "exp_alerts": []},
                    # Saturday 03:00: weekend, all idle, but not yet for the alert's 4 h of weekend.
                    {"eval_time": f"{2 * 24 + 3}h", "alertname": ALERT, "exp_alerts": []},
                    {
                        "eval_time": saturday_18,
                        "alertname": ALERT,
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "cluster": "sim"},
                                "exp_annotations": {
                                    "summary": (
                                        "100% of the GPUs in cluster sim have sat idle for 4h or more this weekend"
                                    ),
                                    "description": description,
                                },
                            }
                        ],
                    },
                ],
                "promql_expr_test": [
                    {
                        "expr": "cluster:gpuledger_gpus_idle:ratio",
                        "eval_time": saturday_18,
                        "exp_samples": [{"labels": 'cluster:gpuledger_gpus_idle:ratio{cluster="sim"}', "value": 1}],
                    }
                ],
            }
        ],
    }
    test_file = tmp_path / "weekend.test.yml"
    test_file.write_text(yaml.safe_dump(test, width=1 << 20))
    result = subprocess.run(["promtool", "test", "rules", str(test_file)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
