"""`gpuledger rules`: the Prometheus rules for cost per unit of work, or for budgets.

    gpuledger rules [--config FILE]                 the work rules: built-in engine counters plus
                                                    the config's `work:` ones
    gpuledger rules --budgets FILE                  the budget rules (spend, forecast, alerts)
    ... [--format rules|prometheusrule] [--out FILE]

The rendering is exporters/promrules.py; this module reads the inputs and writes the file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import TypeVar

from agent.cli.args import EXIT_OK
from agent.config import load_config
from agent.errors import ConfigError
from agent.ledger.export import replacing
from exporters.promrules import (
    WorkCounter,
    budget_groups,
    budget_header,
    check_work,
    load_budgets,
    prometheus_rule_yaml,
    rules_yaml,
    work_counters,
    work_groups,
    work_header,
)

_Parser = TypeVar("_Parser", bound=argparse.ArgumentParser)


def add_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    rules = sub.add_parser("rules", help="render Prometheus rules: cost per unit of work, or budgets")
    rules.add_argument("--config", help="YAML config file (its work: counters join the built-in ones)")
    rules.add_argument("--budgets", metavar="FILE", help="render the budget rules of this budgets file instead")
    rules.add_argument(
        "--format",
        choices=("rules", "prometheusrule"),
        default="rules",
        help="a Prometheus rule file, or a prometheus-operator PrometheusRule manifest (default: rules)",
    )
    rules.add_argument("--out", metavar="FILE", help="write to FILE (default: stdout)")


def cmd_rules(args: argparse.Namespace) -> int:
    if args.budgets:
        plan = load_budgets(Path(args.budgets), dt.datetime.now(dt.UTC).year)
        groups, header, name = budget_groups(plan), budget_header(plan), "gpuledger-budgets"
    else:
        counters = work_counters(_configured_work(args.config))
        problems = check_work(counters)
        if problems:
            raise ConfigError(f"{args.config or 'config'}: {problems[0]}")
        groups, header, name = work_groups(counters), work_header(counters), "gpuledger-work"
    text = rules_yaml(groups, header) if args.format == "rules" else prometheus_rule_yaml(groups, header, name)
    if args.out and args.out != "-":
        _write(Path(args.out), text)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _configured_work(config: str | None) -> list[WorkCounter]:
    settings = load_config(config)
    return [
        WorkCounter(name=entry.name, metric=entry.metric, unit=entry.unit, scale=entry.scale, join=entry.join_pairs())
        for entry in settings.work
    ]


def _write(path: Path, text: str) -> None:
    """Write atomically: Prometheus may reload the file at any moment."""
    with replacing(path) as out:
        out.write(text.encode())
