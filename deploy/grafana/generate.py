#!/usr/bin/env python3
"""Generates gpuledger's Grafana dashboards as code with grafana-foundation-sdk.

    python deploy/grafana/generate.py              # rewrite deploy/grafana/dashboards/*.json
    python deploy/grafana/generate.py --out DIR    # write them into DIR instead
    python deploy/grafana/generate.py --check      # exit 1 when the committed JSON is stale

The JSON is committed; tests/test_grafana.py regenerates it and fails on any difference, so
edit this file, never the JSON. Output is deterministic: sorted keys, two-space indent,
panel ids and query refIds assigned in order.

Labels the queries rely on (deploy/prometheus/README.md): `cluster` and `instance` target
labels, and the agent's workload labels (a Slurm job is `hpc_job`, shown as "job", a systemd
service `unit`; neither clashes with the scrape's `job`). Dollar rates are
$/hour; the cost view's totals are `increase(...[$__range])` over the dashboard's time range.
Where a recording rule from deploy/prometheus fits (same labels, 5m rate) the panels read it;
panels that must follow a variable the rule aggregates away (gpu, namespace on a node) read
the agent's counters.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import bargauge, common, dashboard, prometheus, stat, statetimeline, table
from grafana_foundation_sdk.builders import timeseries as ts
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as models
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

DASHBOARDS_DIR = Path(__file__).resolve().parent / "dashboards"
TAG = "gpuledger"
DATASOURCE = models.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Selectors the panels share. Every variable below has `.*` as its "All" value, which also
# matches a series without the label (no cluster target label) or with it empty (namespace,
# team and model of a Slurm job).
NODE = 'cluster=~"$cluster", instance=~"$instance"'
GPU = f'{NODE}, gpu=~"$gpu"'
WORKLOAD = f'{NODE}, namespace=~"$namespace", team=~"$team", model=~"$model"'
# The workload labels, as the agent exports them (agent/model.py, WORKLOAD_LABELS).
OWNER = "namespace, pod, container, hpc_job, unit, user, model, team"
# Most workloads set only some of these (a pod: namespace/pod/container; a Slurm job:
# hpc_job/user; a systemd service: unit/user).
WORKLOAD_LEGEND = "{{namespace}} {{pod}} {{container}} {{hpc_job}} {{unit}} {{user}}"
# How tables title the Slurm job's label.
SHOWN = {"hpc_job": "job"}

USD = "currencyUSD"
RATIO = "percentunit"
# What a bar or legend shows for a workload label the agent left empty.
UNNAMED = {"namespace": "(no namespace)", "team": "(no team)", "model": "(unknown)", "hpc_job": "(no job)"}


def named(expr: str, label: str) -> str:
    """`expr` with an empty `label` shown as UNNAMED[label] rather than as a blank."""
    return f'label_replace({expr}, "{label}", "{UNNAMED[label]}", "{label}", "")'


# --- queries and panels ----------------------------------------------------------------------


def query(expr: str, legend: str = "", *, instant: bool = False, as_table: bool = False) -> prometheus.Dataquery:
    target = prometheus.Dataquery().expr(expr).datasource(DATASOURCE)
    if legend:
        target = target.legend_format(legend)
    target = target.instant() if instant else target.range()
    if as_table:
        target = target.format(PromQueryFormat.TABLE)
    return target


def _with_targets(panel: Any, targets: Sequence[prometheus.Dataquery]) -> Any:
    for ref, target in zip("ABCDEFGHIJ", targets, strict=False):
        panel = panel.with_target(target.ref_id(ref))
    return panel


def _common(panel: Any, title: str, description: str, w: int, h: int, unit: str) -> Any:
    panel = panel.title(title).description(description).datasource(DATASOURCE).span(w).height(h)
    return panel.unit(unit) if unit else panel


def _thresholds(*steps: tuple[float | None, str]) -> dashboard.ThresholdsConfig:
    return (
        dashboard.ThresholdsConfig()
        .mode(models.ThresholdsMode.ABSOLUTE)
        .steps([models.Threshold(value=value, color=color) for value, color in steps])
    )


GREEN_ONLY = _thresholds((None, "green"))


def _mapping(values: dict[str, tuple[str, str]]) -> list[models.ValueMapping]:
    options = {
        key: models.ValueMappingResult(text=text, color=color, index=i)
        for i, (key, (text, color)) in enumerate(values.items())
    }
    return [models.ValueMap(options=options)]


UP_DOWN = _mapping({"0": ("down", "red"), "1": ("up", "green")})
RAISED = _mapping({"0": ("clear", "transparent"), "1": ("raised", "orange")})


def stat_panel(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    unit: str = "",
    w: int = 3,
    h: int = 4,
    thresholds: dashboard.ThresholdsConfig = GREEN_ONLY,
    decimals: float | None = None,
) -> stat.Panel:
    panel = (
        _common(stat.Panel(), title, description, w, h, unit)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .graph_mode(common_models.BigValueGraphMode.AREA)
        .color_mode(common_models.BigValueColorMode.VALUE)
        .thresholds(thresholds)
    )
    if decimals is not None:
        panel = panel.decimals(decimals)
    return _with_targets(panel, targets)  # type: ignore[no-any-return]


def graph_panel(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    unit: str = "",
    w: int = 12,
    h: int = 8,
    min_val: float | None = None,
    max_val: float | None = None,
    legend_right: bool = False,
    stacked: bool = False,
) -> ts.Panel:
    legend = common.VizLegendOptions().show_legend(True).calcs(["mean", "lastNotNull", "max"])
    if legend_right:
        legend = legend.display_mode(common_models.LegendDisplayMode.TABLE).placement(
            common_models.LegendPlacement.RIGHT
        )
    else:
        legend = legend.display_mode(common_models.LegendDisplayMode.LIST).placement(
            common_models.LegendPlacement.BOTTOM
        )
    panel = (
        _common(ts.Panel(), title, description, w, h, unit)
        .line_width(1)
        .fill_opacity(10)
        .show_points(common_models.VisibilityMode.NEVER)
        .legend(legend)
        .tooltip(
            common.VizTooltipOptions()
            .mode(common_models.TooltipDisplayMode.MULTI)
            .sort(common_models.SortOrder.DESCENDING)
        )
    )
    if stacked:
        panel = panel.stacking(common.StackingConfig().mode(common_models.StackingMode.NORMAL))
    if min_val is not None:
        panel = panel.min(min_val)
    if max_val is not None:
        panel = panel.max(max_val)
    return _with_targets(panel, targets)  # type: ignore[no-any-return]


def bar_panel(
    title: str,
    description: str,
    target: prometheus.Dataquery,
    *,
    unit: str = USD,
    w: int = 8,
    h: int = 8,
) -> bargauge.Panel:
    panel = (
        _common(bargauge.Panel(), title, description, w, h, unit)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .display_mode(common_models.BarGaugeDisplayMode.BASIC)
        .orientation(common_models.VizOrientation.HORIZONTAL)
        .min(0)
        .color_scheme(dashboard.FieldColor().mode(models.FieldColorModeId.CONTINUOUS_GR_YL_RD))
        .thresholds(GREEN_ONLY)
    )
    return _with_targets(panel, [target])  # type: ignore[no-any-return]


def table_panel(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    rename: dict[str, str],
    hide: Sequence[str] = (),
    units: dict[str, str] | None = None,
    mappings: dict[str, list[models.ValueMapping]] | None = None,
    sort_by: str = "",
    w: int = 24,
    h: int = 8,
) -> table.Panel:
    """An instant table: the targets' rows merged on their labels, columns renamed and hidden."""
    panel = _common(table.Panel(), title, description, w, h, "")
    if len(targets) > 1:
        panel = panel.with_transformation(models.DataTransformerConfig(id_val="merge", options={}))
    organize = {
        "excludeByName": dict.fromkeys(("Time", "__name__", "job", *hide), True),
        "renameByName": rename,
    }
    panel = panel.with_transformation(models.DataTransformerConfig(id_val="organize", options=organize))
    for column, unit in (units or {}).items():
        panel = panel.override_by_name(column, [models.DynamicConfigValue(id_val="unit", value=unit)])
    # Per column: label columns hold values ("0", "1") a panel-wide mapping would rewrite too.
    for column, mapping in (mappings or {}).items():
        panel = panel.override_by_name(column, [models.DynamicConfigValue(id_val="mappings", value=mapping)])
    if sort_by:
        panel = panel.sort_by([common.TableSortByFieldState().display_name(sort_by).desc(True)])
    return _with_targets(panel, targets)  # type: ignore[no-any-return]


def timeline_panel(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    mappings: list[models.ValueMapping],
    w: int = 12,
    h: int = 8,
) -> statetimeline.Panel:
    panel = (
        _common(statetimeline.Panel(), title, description, w, h, "")
        .mappings(mappings)
        .show_value(common_models.VisibilityMode.NEVER)
        .merge_values(True)
        .fill_opacity(70)
        .thresholds(GREEN_ONLY)
        .color_scheme(dashboard.FieldColor().mode(models.FieldColorModeId.THRESHOLDS))
    )
    return _with_targets(panel, targets)  # type: ignore[no-any-return]


# --- variables ---------------------------------------------------------------------------------


def datasource_variable() -> dashboard.DatasourceVariable:
    return dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")


def label_variable(
    name: str, label: str, metric: str, selector: str = "", *, multi: bool = True
) -> dashboard.QueryVariable:
    """A variable listing a label's values; "All" is `.*` so it also matches an empty label."""
    series = f"{metric}{{{selector}}}" if selector else metric
    variable = (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query({"query": f"label_values({series}, {name})", "refId": "PrometheusVariableQueryEditor-VariableQuery"})
        .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(models.VariableSort.ALPHABETICAL_CASE_INSENSITIVE_ASC)
        .multi(multi)
    )
    if multi:
        variable = variable.include_all(True).all_value(".*")
    return variable


# The fleet view lists clusters and nodes from a per-node recording rule (one series a node),
# the others from the agents' own inventory series (one a GPU).
INVENTORY = "gpuledger_gpu_info"
FLEET_INVENTORY = "instance:gpuledger_gpus_up:sum"


def cluster_variable(inventory: str = INVENTORY) -> dashboard.QueryVariable:
    return label_variable("cluster", "Cluster", inventory)


def instance_variable(*, multi: bool = True, inventory: str = INVENTORY) -> dashboard.QueryVariable:
    return label_variable("instance", "Node", inventory, 'cluster=~"$cluster"', multi=multi)


def base_dashboard(
    uid: str, title: str, description: str, time_from: str, inventory: str = INVENTORY
) -> dashboard.Dashboard:
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags([TAG])
        .timezone("browser")
        .time(time_from, "now")
        .refresh("1m")
        .tooltip(models.DashboardCursorSync.CROSSHAIR)
        .link(
            dashboard.DashboardLink("gpuledger dashboards")
            .type(models.DashboardLinkType.DASHBOARDS)
            .tags([TAG])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
        .with_variable(datasource_variable())
        .with_variable(cluster_variable(inventory))
    )


# --- fleet overview ----------------------------------------------------------------------------


def fleet() -> dashboard.Dashboard:
    """The whole fleet, from recording rules only (deploy/prometheus/gpuledger-fleet.rules.yml and
    its siblings): a query here reads a few series per node or per workload, never the agents'
    per-GPU series, so it costs the same on 500 nodes as on 5."""
    cost_rules = (
        ("instance:gpuledger_gpu_cost_dollars_per_hour:rate5m", "all GPUs"),
        ("instance:gpuledger_gpu_idle_cost_dollars_per_hour:rate5m", "idle (no workload)"),
        ("instance:gpuledger_workload_waste_cost_dollars_per_hour:rate5m", "waste (charged, unused)"),
    )
    up, lost, idle = (f"instance:gpuledger_gpus_{what}:sum{{{NODE}}}" for what in ("up", "lost", "idle"))
    flagged = f"instance_rule:gpuledger_gpus_flagged:sum{{{NODE}}}"
    whole = 'cluster=~"$cluster"'  # per-workload levels have no node: the node filter does not apply

    def owners(label: str, rule: str, title: str, description: str, unit: str = USD, w: int = 8) -> ts.Panel:
        return graph_panel(
            title,
            description + " Whole clusters: the node filter does not apply (recording rule).",
            [query(named(f"{label}:{rule}{{{whole}}}", label), f"{{{{cluster}}}} {{{{{label}}}}}")],
            unit=unit,
            min_val=0,
            stacked=True,
            w=w,
        )

    def per_unit(name: str, title: str, description: str, level: str = "model") -> ts.Panel:
        rule = f"{level}:gpuledger_{name}:ratio_rate5m"
        if level == "model":
            legend = "{{cluster}} {{model}}"
            description += " Per model: the dollars of every pod exporting the counter over all their work."
        else:
            legend = "{{cluster}} {{namespace}}/{{pod}} {{model}}"
        return graph_panel(
            title,
            description + " Recording rules of gpuledger-work.rules.yml, 5m rates.",
            [query(f"{rule}{{{whole}}}", legend)],
            unit=USD,
            min_val=0,
            w=12,
        )

    # Over the dashboard's range: a sum of the recorded 5m rates at Grafana's step, x the step
    # in hours. Sampled, so approximate for workloads shorter than the step; `gpuledger report`
    # has exact figures.
    def over_range(rule: str) -> str:
        return f"sum_over_time({rule}{{{whole}}}[$__range:$__interval]) * $__interval_ms / 3600000"

    top = f"topk(10, {over_range('owner:gpuledger_workload_cost_dollars_per_hour:rate5m')})"

    return (
        base_dashboard(
            "gpuledger-fleet",
            "gpuledger / Fleet overview",
            "Every GPU node gpuledger watches: how busy the GPUs are, how many sit idle, what they "
            "cost per hour, who spends it and what a unit of work costs. Recording rules only.",
            "now-6h",
            inventory=FLEET_INVENTORY,
        )
        .with_variable(instance_variable(inventory=FLEET_INVENTORY))
        .with_row(dashboard.Row("Fleet now"))
        .with_panel(stat_panel("GPUs up", "GPUs the agents can read now.", [query(f"sum({up})")], decimals=0))
        .with_panel(
            stat_panel(
                "GPUs lost",
                "GPUs an agent knows but cannot read (lost, fallen off the bus, failing). Zero is good.",
                [query(f"sum({lost})")],
                thresholds=_thresholds((None, "green"), (1, "red")),
                decimals=0,
            )
        )
        .with_panel(
            stat_panel(
                "Mean utilization",
                "Mean GPU utilization over the GPUs that report one (each GPU weighs the same).",
                [
                    query(
                        f"sum(instance:gpuledger_gpu_utilization:sum{{{NODE}}})"
                        f" / sum(instance:gpuledger_gpu_utilization:count{{{NODE}}})"
                    )
                ],
                unit=RATIO,
                thresholds=_thresholds((None, "red"), (0.4, "orange"), (0.7, "green")),
            )
        )
        .with_panel(
            stat_panel(
                "GPUs idle",
                "Fraction of the readable GPUs the agents flag idle: no workload holds them and they "
                "have done no work for rules.idle.for (30m by default).",
                [query(f"sum({idle}) / (sum({up}) > 0)")],
                unit=RATIO,
                thresholds=_thresholds((None, "green"), (0.1, "orange"), (0.3, "red")),
            )
        )
        .with_panel(
            stat_panel(
                "Cost ($/h)",
                "What the GPUs cost per hour, held or not (recording rule, 5m rate).",
                [query(f"sum(instance:gpuledger_gpu_cost_dollars_per_hour:rate5m{{{NODE}}})")],
                unit=USD,
            )
        )
        .with_panel(
            stat_panel(
                "Idle cost ($/h)",
                "Cost per hour of GPUs no workload holds (recording rule, 5m rate).",
                [query(f"sum(instance:gpuledger_gpu_idle_cost_dollars_per_hour:rate5m{{{NODE}}})")],
                unit=USD,
                thresholds=_thresholds((None, "green"), (1, "orange")),
            )
        )
        .with_panel(
            stat_panel(
                "Waste ($/h)",
                "What workloads pay per hour for GPU time they are charged and do not use: cost x "
                "(1 - busy/charged) (recording rule, 5m rate).",
                [query(f"sum(instance:gpuledger_workload_waste_cost_dollars_per_hour:rate5m{{{NODE}}})")],
                unit=USD,
                thresholds=_thresholds((None, "green"), (1, "orange")),
            )
        )
        .with_panel(
            stat_panel(
                "Flags raised",
                "GPUs each rule flags now (idle, allocated_idle, underused, stranded_memory).",
                [query(f"sum by (rule) ({flagged})", "{{rule}}")],
                thresholds=_thresholds((None, "green"), (1, "orange")),
                decimals=0,
            )
        )
        .with_panel(
            stat_panel(
                "GPUs unhealthy",
                "GPUs with a hardware problem now: lost, uncorrectable memory errors, a row remap pending or "
                "failed, held down by heat, NVLink errors, a narrow PCIe link (the Unhealthy GPUs table says which).",
                [query(f"sum(instance:gpuledger_gpus_unhealthy:count{{{NODE}}}) or vector(0)")],
                thresholds=_thresholds((None, "green"), (1, "red")),
                decimals=0,
            )
        )
        .with_row(dashboard.Row("Over time"))
        .with_panel(
            graph_panel(
                "Utilization by node",
                "Mean GPU utilization of each node (recording rule).",
                [query(f"instance:gpuledger_gpu_utilization:avg{{{NODE}}}", "{{cluster}} {{instance}}")],
                unit=RATIO,
                min_val=0,
                max_val=1,
            )
        )
        .with_panel(
            graph_panel(
                "Idle GPUs by cluster",
                "Fraction of each cluster's readable GPUs flagged idle.",
                [query(f"sum by (cluster) ({idle}) / (sum by (cluster) ({up}) > 0)", "{{cluster}}")],
                unit=RATIO,
                min_val=0,
                max_val=1,
            )
        )
        .with_panel(
            graph_panel(
                "Cost, idle cost and waste ($/h)",
                "Per cluster: all GPU cost, the part no workload held, and the part workloads were "
                "charged without using (recording rules, 5m rates).",
                [query(f"sum by (cluster) ({rule}{{{NODE}}})", f"{{{{cluster}}}} {what}") for rule, what in cost_rules],
                unit=USD,
                min_val=0,
            )
        )
        .with_panel(
            graph_panel(
                "GPUs up and lost",
                "Readable GPUs, and GPUs an agent knows but cannot read.",
                [
                    query(f"sum by (cluster) ({up})", "{{cluster}} up"),
                    query(f"sum by (cluster) ({lost})", "{{cluster}} lost"),
                ],
                min_val=0,
            )
        )
        .with_panel(
            graph_panel(
                "Flags raised by rule",
                "GPUs each rule flags.",
                [query(f"sum by (rule) ({flagged})", "{{rule}}")],
                min_val=0,
                stacked=True,
                w=24,
            )
        )
        .with_row(dashboard.Row("Hardware health"))
        .with_panel(
            table_panel(
                "Unhealthy GPUs",
                "Every GPU with a hardware problem now, one row per problem: lost; uncorrectable ECC errors "
                "since its driver loaded (value: how many); a row remap failed (replace it) or pending (reset "
                "it); a page retirement pending (reload the driver); clocks held down by heat or the power "
                "brake over a quarter of the last 10m (value: the fraction); over 1 NVLink CRC or replay "
                "error a second; a PCIe link narrower than it can be. The alerts of deploy/prometheus fire on "
                "the same conditions (recording rule gpu:gpuledger_gpu_problem:max).",
                [query(f"gpu:gpuledger_gpu_problem:max{{{NODE}}}", instant=True, as_table=True)],
                rename={"problem": "problem", "Value": "value"},
                sort_by="instance",
                w=24,
                h=8,
            )
        )
        .with_row(dashboard.Row("Who spends ($/h)"))
        .with_panel(
            owners(
                "team",
                "gpuledger_workload_cost_dollars_per_hour:rate5m",
                "Cost by team ($/h)",
                "What each team's workloads pay per hour.",
            )
        )
        .with_panel(
            owners(
                "team",
                "gpuledger_workload_waste_cost_dollars_per_hour:rate5m",
                "Waste by team ($/h)",
                "What each team pays per hour for GPU time it is charged and does not use.",
            )
        )
        .with_panel(
            owners(
                "team",
                "gpuledger_gpu_idle_cost_left_by_dollars_per_hour:rate5m",
                "Idle left behind, by team ($/h)",
                "Cost per hour of idle GPUs, by the team whose workload held them last.",
            )
        )
        .with_panel(
            graph_panel(
                "GPUs charged and used, by team",
                "GPU-hours per hour: what each team is charged (its share of the GPUs it holds) and "
                "what it keeps busy. Whole clusters: the node filter does not apply (recording rules).",
                [
                    query(
                        named(f"team:gpuledger_workload_gpu_charged_seconds:rate5m{{{whole}}}", "team"),
                        "{{cluster}} {{team}} charged",
                    ),
                    query(
                        named(f"team:gpuledger_workload_gpu_busy_seconds:rate5m{{{whole}}}", "team"),
                        "{{cluster}} {{team}} used",
                    ),
                ],
                min_val=0,
                w=8,
            )
        )
        .with_panel(
            owners(
                "model",
                "gpuledger_workload_cost_dollars_per_hour:rate5m",
                "Cost by model ($/h)",
                "What workloads pay per hour, by the model they serve or train.",
            )
        )
        .with_panel(
            graph_panel(
                "Top jobs by cost ($/h)",
                "The 10 Slurm jobs that cost most per hour now, with their cluster (Slurm numbers jobs per cluster). "
                "Whole clusters (recording rule).",
                [
                    query(
                        f"topk(10, hpc_job:gpuledger_workload_cost_dollars_per_hour:rate5m{{{whole}}})",
                        "{{cluster}} job {{hpc_job}}",
                    )
                ],
                unit=USD,
                min_val=0,
                w=8,
            )
        )
        .with_row(dashboard.Row("Over the time range"))
        .with_panel(
            table_panel(
                "Top workloads by dollars",
                "The 10 workloads that cost most over the dashboard's time range, with the GPU-hours "
                "they were charged and used and the dollars they wasted: the recorded rates summed at "
                "Grafana's step (approximate for workloads shorter than a step; `gpuledger report` "
                "has exact figures). A Slurm job is `hpc_job` (shown as job), a systemd service `unit`.",
                [
                    query(top, instant=True, as_table=True),
                    *(
                        query(
                            f"{over_range(f'owner:{rule}')} and on (cluster, {OWNER}) {top}",
                            instant=True,
                            as_table=True,
                        )
                        for rule in (
                            "gpuledger_workload_gpu_charged_seconds:rate5m",
                            "gpuledger_workload_gpu_busy_seconds:rate5m",
                            "gpuledger_workload_waste_cost_dollars_per_hour:rate5m",
                        )
                    ),
                ],
                rename={
                    **SHOWN,
                    "Value #A": "dollars",
                    "Value #B": "GPU-hours charged",
                    "Value #C": "GPU-hours used",
                    "Value #D": "waste dollars",
                },
                units={"dollars": USD, "waste dollars": USD, "GPU-hours charged": "h", "GPU-hours used": "h"},
                sort_by="dollars",
                w=16,
                h=9,
            )
        )
        .with_panel(
            bar_panel(
                "Top models by dollars",
                "The 10 models that cost most over the dashboard's time range (recorded rates summed at "
                "Grafana's step); (unknown) is GPU time the agent could tie to no model.",
                query(
                    "topk(10, "
                    + named(
                        f"sum by (model) ({over_range('model:gpuledger_workload_cost_dollars_per_hour:rate5m')})",
                        "model",
                    )
                    + ")",
                    "{{model}}",
                    instant=True,
                ),
                h=9,
            )
        )
        .with_row(dashboard.Row("Cost per unit of work"))
        .with_panel(
            per_unit(
                "generated_tokens_cost_dollars_per_million",
                "Dollars per million generated tokens, by model",
                "GPU dollars over the tokens vLLM, TGI and SGLang generated.",
            )
        )
        .with_panel(
            per_unit(
                "prompt_tokens_cost_dollars_per_million",
                "Dollars per million prompt tokens, by model",
                "GPU dollars over the prompt tokens the engines processed (the same dollars as the "
                "generated tokens': each figure carries all of the cost).",
            )
        )
        .with_panel(
            per_unit(
                "inferences_cost_dollars_per_thousand",
                "Dollars per thousand inferences, by model",
                "GPU dollars over Triton's inferences (a batch of n counts n).",
            )
        )
        .with_panel(
            per_unit(
                "training_steps_cost_dollars_each",
                "Dollars per training step, by pod",
                "GPU dollars of each training pod over the steps its step counter counts.",
                level="namespace_pod",
            )
        )
    )


# --- node view ---------------------------------------------------------------------------------


def node() -> dashboard.Dashboard:
    per_gpu = "GPU {{gpu}}"
    owner_sum = f"sum by (gpu, {OWNER})"
    return (
        base_dashboard(
            "gpuledger-node",
            "gpuledger / Node",
            "One GPU node: every GPU's readings, NVLink, flags, who holds each GPU, and the agent's health.",
            "now-3h",
        )
        .with_variable(instance_variable(multi=False))
        .with_variable(label_variable("gpu", "GPU", "gpuledger_gpu_info", NODE))
        .with_row(dashboard.Row("Node now"))
        .with_panel(
            stat_panel(
                "GPUs up", "GPUs the agent can read now.", [query(f"sum(gpuledger_gpu_up{{{GPU}}})")], decimals=0
            )
        )
        .with_panel(
            stat_panel(
                "Utilization",
                "Mean utilization of the selected GPUs.",
                [query(f"avg(gpuledger_gpu_utilization_ratio{{{GPU}}})")],
                unit=RATIO,
            )
        )
        .with_panel(
            stat_panel(
                "Power",
                "Power draw of the selected GPUs.",
                [query(f"sum(gpuledger_gpu_power_watts{{{GPU}}})")],
                unit="watt",
            )
        )
        .with_panel(
            stat_panel(
                "Processes",
                "Compute processes on the selected GPUs.",
                [query(f"sum(gpuledger_gpu_processes{{{GPU}}})")],
                decimals=0,
            )
        )
        .with_panel(
            stat_panel(
                "Node cost ($/h)",
                "What all GPUs of the node cost per hour (recording rule, 5m rate).",
                [query(f"sum(instance:gpuledger_gpu_cost_dollars_per_hour:rate5m{{{NODE}}})")],
                unit=USD,
            )
        )
        .with_panel(
            stat_panel(
                "Node idle cost ($/h)",
                "Cost per hour of the node's GPUs that no workload holds (recording rule, 5m rate).",
                [query(f"sum(instance:gpuledger_gpu_idle_cost_dollars_per_hour:rate5m{{{NODE}}})")],
                unit=USD,
                thresholds=_thresholds((None, "green"), (0.01, "orange")),
            )
        )
        .with_panel(
            stat_panel(
                "Flags raised",
                "Flags raised on the selected GPUs, all rules together.",
                [query(f"sum(gpuledger_gpu_flag{{{GPU}}})")],
                thresholds=_thresholds((None, "green"), (1, "orange")),
                decimals=0,
            )
        )
        .with_panel(
            stat_panel(
                "NVLink links down",
                "Inactive NVLink links on the selected GPUs.",
                [query(f"sum(gpuledger_gpu_nvlink_up{{{GPU}}} == bool 0)")],
                thresholds=_thresholds((None, "green"), (1, "red")),
                decimals=0,
            )
        )
        .with_row(dashboard.Row("GPU readings"))
        .with_panel(
            graph_panel(
                "Utilization",
                "NVML GPU utilization: the fraction of time a kernel ran.",
                [query(f"gpuledger_gpu_utilization_ratio{{{GPU}}}", per_gpu)],
                unit=RATIO,
                min_val=0,
                max_val=1,
                legend_right=True,
            )
        )
        .with_panel(
            graph_panel(
                "Memory used and total",
                "Device memory in use, and each GPU's total.",
                [
                    query(f"gpuledger_gpu_memory_used_bytes{{{GPU}}}", "GPU {{gpu}} used"),
                    query(f"gpuledger_gpu_memory_total_bytes{{{GPU}}}", "GPU {{gpu}} total"),
                ],
                unit="bytes",
                min_val=0,
                legend_right=True,
            ).override_by_regexp(
                "/total$/",
                [
                    models.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
                    models.DynamicConfigValue(id_val="custom.fillOpacity", value=0),
                ],
            )
        )
        .with_panel(
            graph_panel(
                "Temperature",
                "GPU core temperature.",
                [query(f"gpuledger_gpu_temperature_celsius{{{GPU}}}", per_gpu)],
                unit="celsius",
                legend_right=True,
            )
        )
        .with_panel(
            graph_panel(
                "Power and limit",
                "Board power draw, and the enforced power limit.",
                [
                    query(f"gpuledger_gpu_power_watts{{{GPU}}}", per_gpu),
                    query(f"max(gpuledger_gpu_power_limit_watts{{{GPU}}})", "limit"),
                ],
                unit="watt",
                min_val=0,
                legend_right=True,
            )
        )
        .with_panel(
            graph_panel(
                "Energy rate",
                "Slope of the NVML energy counter (J/s = W); on a real node it follows the power draw.",
                [query(f"rate(gpuledger_gpu_energy_joules_total{{{GPU}}}[$__rate_interval])", per_gpu)],
                unit="watt",
                min_val=0,
                legend_right=True,
            )
        )
        .with_panel(
            graph_panel(
                "Cost and idle cost per GPU ($/h)",
                "Each GPU's cost per hour while observed, and the part no workload held.",
                [
                    query(f"rate(gpuledger_gpu_cost_dollars_total{{{GPU}}}[$__rate_interval]) * 3600", "GPU {{gpu}}"),
                    query(
                        f"rate(gpuledger_gpu_idle_cost_dollars_total{{{GPU}}}[$__rate_interval]) * 3600",
                        "GPU {{gpu}} idle",
                    ),
                ],
                unit=USD,
                min_val=0,
                legend_right=True,
            )
        )
        .with_panel(
            table_panel(
                "GPUs and prices",
                "Each GPU, its model and PCI bus id, its price per hour and where that price comes from.",
                [
                    query(
                        f"gpuledger_gpu_price_dollars_per_hour{{{GPU}}}"
                        " * on (cluster, instance, gpu, uuid) group_left (model_name, pci_bus_id, driver_version)"
                        f" gpuledger_gpu_info{{{GPU}}}"
                        " * on (cluster, instance, gpu, uuid) group_left (source)"
                        f" gpuledger_gpu_price_info{{{GPU}}}",
                        instant=True,
                        as_table=True,
                    )
                ],
                rename={"Value": "$/h", "model_name": "model", "source": "price source"},
                units={"$/h": USD},
                w=24,
                h=8,
            )
        )
        .with_row(dashboard.Row("NVLink"))
        .with_panel(
            timeline_panel(
                "NVLink: all links up",
                "Per GPU: up while every NVLink link is active, down while any is not "
                "(the NVLink links down stat above counts them).",
                [query(f"min by (gpu) (gpuledger_gpu_nvlink_up{{{GPU}}})", per_gpu)],
                mappings=UP_DOWN,
            )
        )
        .with_panel(
            table_panel(
                "NVLink links, down first",
                "Every NVLink link of the selected GPUs and its state now; inactive links sort first.",
                [query(f"sort(gpuledger_gpu_nvlink_up{{{GPU}}})", instant=True, as_table=True)],
                rename={"Value": "state"},
                hide=("cluster", "instance"),
                mappings={"state": UP_DOWN},
                w=12,
            )
        )
        .with_row(dashboard.Row("Clocks and throttling"))
        .with_panel(
            graph_panel(
                "SM clock",
                "SM clock of each GPU, and the highest it can run at (dashed).",
                [
                    query(f"gpuledger_gpu_sm_clock_hertz{{{GPU}}}", per_gpu),
                    query(f"max(gpuledger_gpu_sm_clock_max_hertz{{{GPU}}})", "max"),
                ],
                unit="hertz",
                min_val=0,
                legend_right=True,
            ).override_by_name(
                "max", [models.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})]
            )
        )
        .with_panel(
            graph_panel(
                "Memory clock",
                "Memory clock of each GPU (HBM boards keep theirs; GDDR boards lower it when idle).",
                [query(f"gpuledger_gpu_memory_clock_hertz{{{GPU}}}", per_gpu)],
                unit="hertz",
                min_val=0,
                legend_right=True,
            )
        )
        .with_panel(
            graph_panel(
                "Clocks held down, by cause",
                "Fraction of the time the driver held each GPU's clocks below what was asked, by cause "
                "(power cap, thermal, sync boost, board limit or power brake, reliability); idle time is left out.",
                [
                    query(
                        "sum by (gpu, cause) (rate(gpuledger_gpu_clock_violation_seconds_total"
                        f'{{{GPU}, cause=~"power|thermal|sync_boost|board_limit|reliability"}}[$__rate_interval]))',
                        "GPU {{gpu}} {{cause}}",
                    )
                ],
                unit=RATIO,
                min_val=0,
                legend_right=True,
            )
        )
        .with_panel(
            graph_panel(
                "Throttle reasons active",
                "How many clock-event reasons hold each GPU's clocks down now (power cap, thermal or hardware "
                "slowdown, sync boost, power brake; idle is not counted).",
                [
                    query(
                        f"sum by (gpu) (gpuledger_gpu_clock_event_reason{{{GPU},"
                        ' reason!~"gpu_idle|applications_clocks_setting|display_clock_setting"})',
                        per_gpu,
                    )
                ],
                min_val=0,
                legend_right=True,
            )
        )
        .with_panel(
            graph_panel(
                "Performance state",
                "Each GPU's performance state: 0 (P0) is full performance, higher is lower power.",
                [query(f"gpuledger_gpu_performance_state{{{GPU}}}", per_gpu)],
                min_val=0,
                legend_right=True,
            )
        )
        .with_panel(
            graph_panel(
                "Engines: memory controller, encoder, decoder",
                "Fraction of time each GPU's memory controller, video encoder and video decoder were busy.",
                [
                    query(f"gpuledger_gpu_memory_controller_utilization_ratio{{{GPU}}}", "GPU {{gpu}} memory"),
                    query(f"gpuledger_gpu_encoder_utilization_ratio{{{GPU}}}", "GPU {{gpu}} encoder"),
                    query(f"gpuledger_gpu_decoder_utilization_ratio{{{GPU}}}", "GPU {{gpu}} decoder"),
                ],
                unit=RATIO,
                min_val=0,
                max_val=1,
                legend_right=True,
            )
        )
        .with_row(dashboard.Row("Hardware health"))
        .with_panel(
            table_panel(
                "Memory errors per GPU",
                "ECC errors since the driver loaded (corrected, uncorrected) and over the board's life, rows "
                "remapped to spares, and whether a remap waits for a reset or has failed (the GPU needs service).",
                [
                    query(
                        f'max by (gpu, uuid) (gpuledger_gpu_ecc_errors_total{{{GPU}, type="corrected"}})',
                        instant=True,
                        as_table=True,
                    ),
                    query(
                        f'max by (gpu, uuid) (gpuledger_gpu_ecc_errors_total{{{GPU}, type="uncorrected"}})',
                        instant=True,
                        as_table=True,
                    ),
                    query(
                        f'max by (gpu, uuid) (gpuledger_gpu_ecc_aggregate_errors_total{{{GPU}, type="uncorrected"}})',
                        instant=True,
                        as_table=True,
                    ),
                    query(
                        f"sum by (gpu, uuid) (gpuledger_gpu_remapped_rows_total{{{GPU}}})", instant=True, as_table=True
                    ),
                    query(
                        f"max by (gpu, uuid) (gpuledger_gpu_row_remap_pending{{{GPU}}})", instant=True, as_table=True
                    ),
                    query(
                        f"max by (gpu, uuid) (gpuledger_gpu_row_remap_failure{{{GPU}}})", instant=True, as_table=True
                    ),
                ],
                rename={
                    "Value #A": "ECC corrected",
                    "Value #B": "ECC uncorrected",
                    "Value #C": "uncorrected, board's life",
                    "Value #D": "rows remapped",
                    "Value #E": "remap pending",
                    "Value #F": "remap failed",
                },
                mappings={
                    "remap pending": _mapping({"0": ("no", "green"), "1": ("reset needed", "orange")}),
                    "remap failed": _mapping({"0": ("no", "green"), "1": ("replace", "red")}),
                },
                sort_by="ECC uncorrected",
                w=12,
            )
        )
        .with_panel(
            table_panel(
                "PCIe links",
                "Each GPU's PCIe link now against the most it can run at, and the replays it has needed.",
                [
                    query(
                        f"max by (gpu, uuid) (gpuledger_gpu_pcie_link_generation{{{GPU}}})", instant=True, as_table=True
                    ),
                    query(
                        f"max by (gpu, uuid) (gpuledger_gpu_pcie_link_generation_max{{{GPU}}})",
                        instant=True,
                        as_table=True,
                    ),
                    query(f"max by (gpu, uuid) (gpuledger_gpu_pcie_link_width{{{GPU}}})", instant=True, as_table=True),
                    query(
                        f"max by (gpu, uuid) (gpuledger_gpu_pcie_link_width_max{{{GPU}}})", instant=True, as_table=True
                    ),
                    query(
                        f"max by (gpu, uuid) (gpuledger_gpu_pcie_replays_total{{{GPU}}})", instant=True, as_table=True
                    ),
                ],
                rename={
                    "Value #A": "generation",
                    "Value #B": "max generation",
                    "Value #C": "lanes",
                    "Value #D": "max lanes",
                    "Value #E": "replays",
                },
                w=12,
            )
        )
        .with_panel(
            graph_panel(
                "ECC errors",
                "Memory errors counted per GPU over time, by type (corrected, uncorrected).",
                [
                    query(
                        f"sum by (gpu, type) (increase(gpuledger_gpu_ecc_errors_total{{{GPU}}}[$__rate_interval]))",
                        "GPU {{gpu}} {{type}}",
                    )
                ],
                min_val=0,
                legend_right=True,
            )
        )
        .with_panel(
            graph_panel(
                "NVLink errors per second",
                "NVLink CRC, replay and recovery errors per second, summed over each GPU's links.",
                [
                    query(
                        f"sum by (gpu, type) (rate(gpuledger_gpu_nvlink_errors_total{{{GPU}}}[$__rate_interval]))",
                        "GPU {{gpu}} {{type}}",
                    )
                ],
                min_val=0,
                legend_right=True,
            )
        )
        .with_panel(
            graph_panel(
                "NVLink traffic",
                "Bytes per second each GPU sends and receives over all its NVLink links.",
                [
                    query(
                        f"sum by (gpu) (rate(gpuledger_gpu_nvlink_transmit_bytes_total{{{GPU}}}[$__rate_interval]))",
                        "GPU {{gpu}} sent",
                    ),
                    query(
                        f"sum by (gpu) (rate(gpuledger_gpu_nvlink_receive_bytes_total{{{GPU}}}[$__rate_interval]))",
                        "GPU {{gpu}} received",
                    ),
                ],
                unit="Bps",
                min_val=0,
                legend_right=True,
                w=24,
            )
        )
        .with_row(dashboard.Row("Flags"))
        .with_panel(
            timeline_panel(
                "Flags",
                "When each rule flagged each GPU.",
                [query(f"max by (gpu, rule) (gpuledger_gpu_flag{{{GPU}}})", "GPU {{gpu}} {{rule}}")],
                mappings=RAISED,
            )
        )
        .with_panel(
            table_panel(
                "Flags raised now",
                "Each raised flag and how long its condition has held.",
                [query(f"gpuledger_gpu_flag_seconds{{{GPU}}} > 0", instant=True, as_table=True)],
                rename={"Value": "held for"},
                hide=("cluster", "instance"),
                units={"held for": "s"},
                sort_by="held for",
                w=12,
            )
        )
        .with_panel(
            table_panel(
                "Who holds flagged GPUs",
                "The workloads holding a GPU flagged allocated_idle or stranded_memory: who to ask.",
                [query(f"gpuledger_workload_flag{{{GPU}}} == 1", instant=True, as_table=True)],
                rename=SHOWN,
                hide=("cluster", "instance", "Value"),
                w=24,
            )
        )
        .with_row(dashboard.Row("Owners"))
        .with_panel(
            table_panel(
                "Owners now",
                "Every workload on every GPU: its share of the utilization, the memory it holds, whether "
                "the scheduler allocated the GPU to it, and what it pays per hour.",
                [
                    query(
                        f"{owner_sum} (gpuledger_workload_gpu_utilization_ratio{{{GPU}}})", instant=True, as_table=True
                    ),
                    query(
                        f"{owner_sum} (gpuledger_workload_gpu_memory_used_bytes{{{GPU}}})", instant=True, as_table=True
                    ),
                    query(f"{owner_sum} (gpuledger_workload_gpu_allocated{{{GPU}}})", instant=True, as_table=True),
                    query(
                        f"{owner_sum} (rate(gpuledger_workload_cost_dollars_total{{{GPU}}}[$__rate_interval])) * 3600",
                        instant=True,
                        as_table=True,
                    ),
                ],
                rename={
                    **SHOWN,
                    "Value #A": "utilization",
                    "Value #B": "memory",
                    "Value #C": "allocated",
                    "Value #D": "$/h",
                },
                units={"utilization": RATIO, "memory": "bytes", "$/h": USD},
                sort_by="$/h",
                h=9,
            )
        )
        .with_panel(
            graph_panel(
                "Utilization by workload",
                "Each workload's share of the GPUs' utilization.",
                [
                    query(
                        f"sum by ({OWNER}) (gpuledger_workload_gpu_utilization_ratio{{{GPU}}})",
                        WORKLOAD_LEGEND,
                    )
                ],
                unit=RATIO,
                min_val=0,
            )
        )
        .with_panel(
            graph_panel(
                "Memory by workload",
                "GPU memory each workload holds.",
                [
                    query(
                        f"sum by ({OWNER}) (gpuledger_workload_gpu_memory_used_bytes{{{GPU}}})",
                        WORKLOAD_LEGEND,
                    )
                ],
                unit="bytes",
                min_val=0,
                stacked=True,
            )
        )
        .with_row(dashboard.Row("Agent health"))
        .with_panel(
            timeline_panel(
                "Agent, NVML, ledger, kubelet",
                "Scrape target up; NVML answering; the ledger's last flush succeeded (absent when the "
                "agent runs without a ledger); the kubelet pod-resources API answering (absent off Kubernetes).",
                [
                    query(f'up{{job=~".*gpuledger.*", {NODE}}}', "scrape"),
                    query(f"gpuledger_nvml_up{{{NODE}}}", "NVML"),
                    query(f"gpuledger_ledger_up{{{NODE}}}", "ledger"),
                    query(f"gpuledger_kubelet_up{{{NODE}}}", "kubelet"),
                ],
                mappings=UP_DOWN,
            )
        )
        .with_panel(
            graph_panel(
                "Poll duration and last poll age",
                "How long the latest NVML poll took, and how old the latest poll was when Prometheus "
                "scraped it (the alert fires past 3 poll intervals).",
                [
                    query(f"gpuledger_poll_duration_seconds{{{NODE}}}", "poll duration"),
                    query(
                        f"timestamp(gpuledger_last_poll_timestamp_seconds{{{NODE}}})"
                        f" - gpuledger_last_poll_timestamp_seconds{{{NODE}}}",
                        "last poll age",
                    ),
                ],
                unit="s",
            )
        )
        .with_panel(
            graph_panel(
                "Polls per second",
                "Polls run, polls that read nothing, and polls that overran the interval.",
                [
                    query(f"rate(gpuledger_polls_total{{{NODE}}}[$__rate_interval])", "polls"),
                    query(f"rate(gpuledger_poll_failures_total{{{NODE}}}[$__rate_interval])", "failures"),
                    query(f"rate(gpuledger_poll_overruns_total{{{NODE}}}[$__rate_interval])", "overruns"),
                ],
                unit="ops",
                min_val=0,
            )
        )
        .with_panel(
            graph_panel(
                "NVML errors per second",
                "Failed NVML calls by call and error; a flat 'none' line while there are none.",
                [
                    query(
                        f"sum by (call, error) (rate(gpuledger_nvml_errors_total{{{NODE}}}[$__rate_interval]))"
                        ' or on () label_replace(vector(0), "error", "none", "", "")',
                        "{{call}} {{error}}",
                    )
                ],
                unit="ops",
                min_val=0,
            )
        )
        .with_panel(
            table_panel(
                "Agent build",
                "Agent version and the driver it talks to.",
                [query(f"gpuledger_build_info{{{NODE}}}", instant=True, as_table=True)],
                rename={},
                hide=("Value",),
                h=4,
            )
        )
    )


# --- cost view ---------------------------------------------------------------------------------


def _increase(metric: str, selector: str) -> str:
    return f"increase({metric}{{{selector}}}[$__range])"


def cost() -> dashboard.Dashboard:
    cost_w = _increase("gpuledger_workload_cost_dollars_total", WORKLOAD)
    # Charged GPU-seconds (held x the workload's share), not held ones: two workloads sharing a
    # GPU each hold all of it, so held time counts a shared GPU once per holder.
    charged_w = _increase("gpuledger_workload_gpu_charged_seconds_total", WORKLOAD)
    busy_w = _increase("gpuledger_workload_gpu_busy_seconds_total", WORKLOAD)
    # Charged time whose use nothing measured (a MIG instance without GPM) is neither used nor
    # wasted; an agent from before that counter has none.
    unmeasured_w = f"({_increase('gpuledger_workload_gpu_unmeasured_seconds_total', WORKLOAD)} or {charged_w} * 0)"
    # A workload's unused charged time: clamped per workload, as a workload busier than its
    # share wastes nothing rather than making up for another's waste.
    wasted_w = f"clamp_min({charged_w} - {unmeasured_w} - {busy_w}, 0)"
    waste_cost_w = f"{cost_w} * clamp_min(({charged_w} - {unmeasured_w} - {busy_w}) / ({charged_w} > 0), 0)"
    rule_sel = 'cluster=~"$cluster", {label}=~"${label}"'

    def by(label: str, title: str, *, per_cluster: bool = False) -> bargauge.Panel:
        keys, legend, where = label, f"{{{{{label}}}}}", ""
        if per_cluster:  # an id each cluster numbers on its own: the same one in two clusters is two
            keys, legend, where = f"cluster, {label}", f"{{{{{label}}}}} ({{{{cluster}}}})", ", per cluster"
        return bar_panel(
            f"Dollars by {title}",
            f"What workloads paid over the dashboard's time range, by {title}{where}; {UNNAMED[label]} is GPU "
            f"time with no {title}.",
            query(f"sort_desc({named(f'sum by ({keys}) ({cost_w})', label)})", legend, instant=True),
            w=6,
        )

    def per_hour(label: str, title: str) -> ts.Panel:
        rule = f"{label}:gpuledger_workload_cost_dollars_per_hour:rate5m"
        return graph_panel(
            f"Cost by {title} ($/h)",
            f"What workloads pay per hour, by {title}, for the whole cluster (recording rule, 5m rate).",
            [query(named(f"{rule}{{{rule_sel.format(label=label)}}}", label), f"{{{{cluster}}}} {{{{{label}}}}}")],
            unit=USD,
            min_val=0,
            stacked=True,
            w=8,
        )

    return (
        base_dashboard(
            "gpuledger-cost",
            "gpuledger / Cost",
            "Where the GPU dollars went over the chosen time range: by namespace, team, model and job, "
            "what was wasted (charged but not used), what sat idle, and what each GPU costs.",
            "now-24h",
        )
        .with_variable(instance_variable())
        .with_variable(label_variable("namespace", "Namespace", "gpuledger_workload_cost_dollars_total", NODE))
        .with_variable(label_variable("team", "Team", "gpuledger_workload_cost_dollars_total", NODE))
        .with_variable(label_variable("model", "Model", "gpuledger_workload_cost_dollars_total", NODE))
        .with_row(dashboard.Row("Over the time range"))
        .with_panel(
            stat_panel(
                "GPU cost",
                "All cost of the selected nodes' GPUs over the time range (namespace, team and model do not apply).",
                [query(f"sum({_increase('gpuledger_gpu_cost_dollars_total', NODE)})")],
                unit=USD,
                w=4,
            )
        )
        .with_panel(
            stat_panel(
                "Workload cost",
                "What the selected workloads paid.",
                [query(f"sum({cost_w})")],
                unit=USD,
                w=4,
            )
        )
        .with_panel(
            stat_panel(
                "Idle cost",
                "Cost of GPUs no workload held (belongs to nobody, so namespace, team and model do not apply).",
                [query(f"sum({_increase('gpuledger_gpu_idle_cost_dollars_total', NODE)})")],
                unit=USD,
                thresholds=_thresholds((None, "green"), (1, "orange")),
                w=4,
            )
        )
        .with_panel(
            stat_panel(
                "Waste cost",
                "What the selected workloads paid for GPU time they were charged for but did not use: "
                "cost x (1 - busy/charged), per workload and GPU.",
                [query(f"sum({waste_cost_w})")],
                unit=USD,
                thresholds=_thresholds((None, "green"), (1, "orange")),
                w=4,
            )
        )
        .with_panel(
            stat_panel(
                "GPU-hours charged / wasted",
                "GPU-hours charged to the selected workloads (each its share of a GPU it held: a shared "
                "GPU counts once), and the part they did not use (charged - busy).",
                [
                    query(f"sum({charged_w}) / 3600", "charged"),
                    query(f"sum({wasted_w}) / 3600", "wasted"),
                ],
                unit="h",
                w=4,
            )
        )
        .with_panel(
            stat_panel(
                "Efficiency",
                "Busy GPU-hours over the charged GPU-hours whose use was measured, of the selected workloads.",
                [query(f"sum({busy_w}) / (sum({charged_w} - {unmeasured_w}) > 0)")],
                unit=RATIO,
                thresholds=_thresholds((None, "red"), (0.4, "orange"), (0.7, "green")),
                w=4,
            )
        )
        .with_row(dashboard.Row("Dollars by owner (over the time range)"))
        .with_panel(by("namespace", "namespace"))
        .with_panel(by("team", "team"))
        .with_panel(by("model", "model"))
        .with_panel(by("hpc_job", "job", per_cluster=True))  # Slurm numbers jobs per cluster
        .with_panel(
            table_panel(
                "Workloads: dollars, GPU-hours charged, busy and wasted",
                "Each workload of each cluster over the time range. Charged = its share of the GPU time it "
                "held; wasted = charged - busy; its dollars are the waste cost.",
                [
                    query(f"sum by (cluster, {OWNER}) ({cost_w})", instant=True, as_table=True),
                    query(f"sum by (cluster, {OWNER}) ({charged_w}) / 3600", instant=True, as_table=True),
                    query(f"sum by (cluster, {OWNER}) ({busy_w}) / 3600", instant=True, as_table=True),
                    query(f"sum by (cluster, {OWNER}) ({wasted_w}) / 3600", instant=True, as_table=True),
                    query(f"sum by (cluster, {OWNER}) ({waste_cost_w})", instant=True, as_table=True),
                ],
                rename={
                    **SHOWN,
                    "Value #A": "dollars",
                    "Value #B": "GPU-hours charged",
                    "Value #C": "GPU-hours busy",
                    "Value #D": "GPU-hours wasted",
                    "Value #E": "waste dollars",
                },
                units={
                    "dollars": USD,
                    "waste dollars": USD,
                    "GPU-hours charged": "h",
                    "GPU-hours busy": "h",
                    "GPU-hours wasted": "h",
                },
                sort_by="dollars",
                h=10,
            )
        )
        .with_row(dashboard.Row("Over time ($/h, whole cluster)"))
        .with_panel(per_hour("namespace", "namespace"))
        .with_panel(per_hour("team", "team"))
        .with_panel(per_hour("model", "model"))
        .with_panel(
            graph_panel(
                "Waste by namespace ($/h)",
                "What each namespace pays per hour for GPU time it is charged for without using (recording rule).",
                [
                    query(
                        named(
                            "namespace:gpuledger_workload_waste_cost_dollars_per_hour:rate5m"
                            f"{{{rule_sel.format(label='namespace')}}}",
                            "namespace",
                        ),
                        "{{cluster}} {{namespace}}",
                    )
                ],
                unit=USD,
                min_val=0,
                stacked=True,
                w=8,
            )
        )
        .with_panel(
            graph_panel(
                "GPUs paid for and idle, by team",
                "Charged minus busy GPU-seconds per second: how many GPUs' worth each team pays for "
                "without using (recording rule; a shared GPU counts once).",
                [
                    query(
                        named(
                            f"team:gpuledger_workload_gpu_waste_seconds:rate5m{{{rule_sel.format(label='team')}}}",
                            "team",
                        ),
                        "{{cluster}} {{team}}",
                    )
                ],
                min_val=0,
                stacked=True,
                w=8,
            )
        )
        .with_panel(
            graph_panel(
                "Idle cost by node ($/h)",
                "Cost per hour of each node's GPUs that no workload holds (recording rule).",
                [query(f"instance:gpuledger_gpu_idle_cost_dollars_per_hour:rate5m{{{NODE}}}", "{{instance}}")],
                unit=USD,
                min_val=0,
                stacked=True,
                w=8,
            )
        )
        .with_row(dashboard.Row("Idle dollars and prices"))
        .with_panel(
            bar_panel(
                "Idle dollars by node",
                "Cost over the time range of each node's GPUs while no workload held them.",
                query(
                    f"sort_desc(sum by (instance) ({_increase('gpuledger_gpu_idle_cost_dollars_total', NODE)}))",
                    "{{instance}}",
                    instant=True,
                ),
            )
        )
        .with_panel(
            bar_panel(
                "Dollars per busy GPU-hour, by model",
                "What each model paid over the time range divided by the GPU-hours it kept busy: the "
                "price of useful GPU time, list price where nothing was wasted.",
                query(
                    f"sort_desc(sum by (model) ({cost_w}) / (sum by (model) ({busy_w}) / 3600 > 0))",
                    "{{model}}",
                    instant=True,
                ),
            )
        )
        .with_panel(
            table_panel(
                "Price per GPU",
                "Each GPU's price per hour and its source (config override, instance type, catalogue).",
                [
                    query(
                        f"gpuledger_gpu_price_dollars_per_hour{{{NODE}}}"
                        " * on (cluster, instance, gpu, uuid) group_left (model_name)"
                        f" gpuledger_gpu_info{{{NODE}}}"
                        " * on (cluster, instance, gpu, uuid) group_left (source)"
                        f" gpuledger_gpu_price_info{{{NODE}}}",
                        instant=True,
                        as_table=True,
                    )
                ],
                rename={"Value": "$/h", "model_name": "model", "source": "price source"},
                units={"$/h": USD},
                sort_by="$/h",
                w=8,
            )
        )
    )


# --- output ------------------------------------------------------------------------------------

DASHBOARDS = {"fleet-overview": fleet, "node": node, "cost": cost}


def render(builder: dashboard.Dashboard) -> str:
    model = builder.build()
    for number, panel in enumerate(model.panels or [], start=1):
        panel.id_val = number
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def rendered() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"gpuledger-{name}.json": render(make()) for name, make in DASHBOARDS.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DASHBOARDS_DIR, help="directory to write (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when --out differs")
    args = parser.parse_args(argv)
    files = rendered()
    if args.check:
        stale = []
        for name, text in files.items():
            path = args.out / name
            current = path.read_text(encoding="utf-8") if path.exists() else ""
            if current != text:
                stale.append(name)
                sys.stdout.writelines(
                    difflib.unified_diff(current.splitlines(True), text.splitlines(True), str(path), name)
                )
        extra = sorted(p.name for p in args.out.glob("*.json") if p.name not in files)
        for name in extra:
            print(f"{args.out / name}: not generated by this script")
        if stale or extra:
            print(f"stale: run python {Path(__file__).as_posix()}", file=sys.stderr)
            return 1
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
