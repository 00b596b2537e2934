"""Prometheus rules that `gpuledger rules` renders: cost per unit of work, and budgets.

Both read the fleet recording rules of deploy/prometheus/gpuledger-fleet.rules.yml and
gpuledger-recording.rules.yml (per-owner, per-team, per-namespace, per-model cost rates), so
a 500-node fleet's engine counters are joined with a few hundred pre-aggregated series, never
with every GPU's raw counters.

Cost per unit of work
    A serving engine counts its work (tokens, inferences) per pod; gpuledger counts what each
    pod's GPUs cost. Joined on the pod (`namespace`, `pod`: the target labels Kubernetes
    discovery gives an engine's scrape) or on any other labels a counter shares with the
    workload labels, their ratio is dollars per unit of work. Counters with the same `name`
    (vLLM's, TGI's and SGLang's generated tokens) add up into one unit of work.

Budgets
    PromQL knows no calendar month in a time zone, so the rules compute the local month's
    start and end from `month()`/`day_of_month()`/`days_in_month()` of the clock shifted by
    the zone's UTC offset. The offset in force at each month's start is taken from the tz
    database (a zone's daylight saving time changes mid-month, never at a month's start, so
    twelve offsets describe every month boundary exactly). Spend so far this month sums tiles
    (an hour's, a quarter hour's, or the file's `resolution`) of the recorded 5m cost rates
    over the steps of a [32d:TILE] subquery that lie after the month's start, read at the
    evaluation time with `@ end()`; a tile is its rate samples x the step between them / 3600.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import zoneinfo
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.errors import BadInputError
from agent.model import WORKLOAD_LABELS
from agent.units import parse_duration
from agent.yamlfile import YamlFileError, read_yaml

# The per-owner cost rate of gpuledger-fleet.rules.yml ($/h, every workload label kept, summed
# over GPUs and nodes): the one series every work join reads.
OWNER_COST = "owner:gpuledger_workload_cost_dollars_per_hour:rate5m"
# The per-kind cost rates budgets read ($/h by cluster and the kind's label), from
# gpuledger-recording.rules.yml.
KIND_COST = "{kind}:gpuledger_workload_cost_dollars_per_hour:rate5m"
BUDGET_KINDS = ("team", "namespace", "model")

_SCALE_WORDS = {1: "each", 1_000: "per_thousand", 1_000_000: "per_million", 1_000_000_000: "per_billion"}
_SCALE_TEXT = {1: "", 1_000: "thousand ", 1_000_000: "million ", 1_000_000_000: "billion "}
Scale = Literal[1, 1_000, 1_000_000, 1_000_000_000]

METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
WORK_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


# --- cost per unit of work ---------------------------------------------------------------------


@dataclass(frozen=True)
class WorkCounter:
    """A counter of work a workload does, and how it joins gpuledger's cost series.

    name     the unit of work, plural (`generated_tokens`): recording-rule names carry it
    metric   the counter as Prometheus stores it (`vllm:generation_tokens_total`)
    unit     one unit, in words (`token`), for texts
    scale    dollars per this many units (1_000_000: dollars per million tokens)
    join     (gpuledger workload label, the counter's label) pairs both sides share
    source   where the counter comes from (engine, version, file), for the rules file's header
    """

    name: str
    metric: str
    unit: str
    scale: int = 1
    join: tuple[tuple[str, str], ...] = (("namespace", "namespace"), ("pod", "pod"))
    source: str = ""

    @property
    def level(self) -> str:
        """The aggregation level of its rules: the join labels, `namespace_pod`."""
        return "_".join(label for label, _ in self.join)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(label for label, _ in self.join)


# The engines' own counters, as each release documents them. A `work:` entry of the config with
# one of these names replaces the built-in counters of that name (the training step counter is
# the one most sites rename).
BUILTIN_WORK: tuple[WorkCounter, ...] = (
    WorkCounter(
        "generated_tokens",
        "vllm:generation_tokens_total",
        "token",
        1_000_000,
        source="vLLM 0.5-0.12, counter labelled model_name (+ engine in the V1 engine): "
        "docs/usage/metrics.md, vllm/v1/metrics/loggers.py",
    ),
    WorkCounter(
        "generated_tokens",
        "sglang:generation_tokens_total",
        "token",
        1_000_000,
        source="SGLang 0.4-0.5, counter labelled model_name: docs/references/production_metrics.md, "
        "python/sglang/srt/metrics/collector.py (TokenizerMetricsCollector)",
    ),
    WorkCounter(
        "generated_tokens",
        "tgi_request_generated_tokens_sum",
        "token",
        1_000_000,
        source="TGI 2.x-3.1, histogram tgi_request_generated_tokens (per finished request; _sum is "
        "the tokens), no model label: docs/source/reference/metrics.md",
    ),
    WorkCounter(
        "prompt_tokens",
        "vllm:prompt_tokens_total",
        "token",
        1_000_000,
        source="vLLM 0.5-0.12 (as above)",
    ),
    WorkCounter(
        "prompt_tokens",
        "sglang:prompt_tokens_total",
        "token",
        1_000_000,
        source="SGLang 0.4-0.5 (as above)",
    ),
    WorkCounter(
        "prompt_tokens",
        "tgi_request_input_length_sum",
        "token",
        1_000_000,
        source="TGI 2.x-3.1, histogram tgi_request_input_length (input tokens per request)",
    ),
    WorkCounter(
        "inferences",
        "nv_inference_count",
        "inference",
        1_000,
        source="Triton Inference Server 2.x (NGC 23.xx-25.xx), counter labelled model, version: "
        "inferences performed, a batch of n counting n: docs/user_guide/metrics.md",
    ),
    WorkCounter(
        "training_steps",
        "training_steps_total",
        "step",
        1,
        source="no engine exports one: a training job's own counter (prometheus_client "
        "Counter('training_steps', ...)); rename it under `work:`",
    ),
)


def work_counters(configured: Iterable[WorkCounter]) -> list[WorkCounter]:
    """The built-in counters with the configured ones added; a configured name replaces the
    built-in counters of that name."""
    extra = list(configured)
    replaced = {counter.name for counter in extra}
    return [counter for counter in BUILTIN_WORK if counter.name not in replaced] + extra


def check_work(counters: Sequence[WorkCounter]) -> list[str]:
    """What is wrong with a set of counters, one line each (`work.NAME: ...`)."""
    problems = []
    first: dict[str, WorkCounter] = {}
    for counter in counters:
        where = f"work.{counter.name}"
        if not WORK_NAME.match(counter.name):
            problems.append(f"work: name {counter.name!r}: lower-case letters, digits and _ only")
        if not METRIC_NAME.match(counter.metric):
            problems.append(f"{where}: metric {counter.metric!r} is not a Prometheus metric name")
        if counter.scale not in _SCALE_WORDS:
            problems.append(f"{where}: scale must be one of {', '.join(map(str, _SCALE_WORDS))}")
        if not counter.join:
            problems.append(f"{where}: join needs at least one label")
        for label, theirs in counter.join:
            if label not in WORKLOAD_LABELS:
                problems.append(f"{where}: join: {label!r} is not a workload label ({', '.join(WORKLOAD_LABELS)})")
            if not LABEL_NAME.match(theirs):
                problems.append(f"{where}: join: {theirs!r} is not a label name")
        same = first.setdefault(counter.name, counter)
        if (same.unit, same.scale, same.join) != (counter.unit, counter.scale, counter.join):
            problems.append(f"{where}: {counter.metric} and {same.metric} add up, so unit, scale and join must agree")
    return problems


def work_rate_record(counter: WorkCounter) -> str:
    return f"{counter.level}:gpuledger_work_{counter.name}:rate5m"


def work_cost_record(counter: WorkCounter, level: str | None = None) -> str:
    return f"{level or counter.level}:gpuledger_{counter.name}_cost_dollars_{_SCALE_WORDS[counter.scale]}:ratio_rate5m"


def _selector(metric: str, labels: Iterable[str]) -> str:
    matchers = ", ".join(f'{label}!=""' for label in labels)
    return f"{metric}{{{matchers}}}" if matchers else metric


def _work_rate_expr(counters: Sequence[WorkCounter]) -> str:
    by = ", ".join(("cluster", *counters[0].labels))
    terms = []
    for counter in counters:
        term = f"rate({_selector(counter.metric, (theirs for _, theirs in counter.join))}[5m])"
        for label, theirs in counter.join:
            if label != theirs:
                term = f'label_replace({term}, "{label}", "$1", "{theirs}", "(.*)")'
        terms.append(term)
    # `or`, not `+`: a pod runs one engine, and `+` would drop every pod missing from a side.
    body = "\n  or ".join(terms)
    return f"sum by ({by}) (\n  {body}\n)\n"


def work_groups(counters: Sequence[WorkCounter]) -> list[dict[str, Any]]:
    """One rule group per unit of work: its rate per join level, dollars per unit there, and
    both per model (where the join does not already name the model)."""
    by_name: dict[str, list[WorkCounter]] = {}
    for counter in counters:
        by_name.setdefault(counter.name, []).append(counter)
    groups = []
    for name, same in by_name.items():
        counter = same[0]
        labels = counter.labels
        on = ", ".join(("cluster", *labels))
        kept = ", ".join(("cluster", *labels, *(x for x in ("model", "team") if x not in labels)))
        owners = _selector(OWNER_COST, labels)
        rate = work_rate_record(counter)
        scale = f"{counter.scale:g}" if counter.scale < 1_000_000 else f"{counter.scale:.0e}".replace("+0", "")
        rules: list[dict[str, Any]] = [
            {"record": rate, "expr": _work_rate_expr(same)},
            {
                "record": work_cost_record(counter),
                "expr": (
                    f"sum by ({kept}) ({owners}) / 3600\n  / on ({on}) group_left ()\n  ({rate} > 0)\n* {scale}\n"
                ),
            },
        ]
        if "model" not in labels:
            per_model = f"sum by ({on}, model) ({owners})"
            model_rate = f"model:gpuledger_work_{name}:rate5m"
            rules += [
                {
                    "record": model_rate,
                    "expr": (
                        f"sum by (cluster, model) (\n"
                        f"  ({per_model} * 0 + 1)\n"
                        f"  * on ({on}) group_left ()\n"
                        f"  {rate}\n"
                        f")\n"
                    ),
                },
                {
                    "record": work_cost_record(counter, "model"),
                    "expr": (
                        f"sum by (cluster, model) (\n"
                        f"  {per_model}\n"
                        f"  and on ({on}) {rate}\n"
                        f") / 3600\n"
                        f"  / ({model_rate} > 0)\n"
                        f"* {scale}\n"
                    ),
                },
            ]
        groups.append({"name": f"gpuledger-work-{name.replace('_', '-')}", "rules": rules})
    return groups


def work_header(counters: Sequence[WorkCounter]) -> str:
    lines = [
        "Cost per unit of work: gpuledger's cost joined with the work counters of the serving",
        "engines and training jobs. Rendered by `gpuledger rules`; do not edit, re-render.",
        "",
        f"Reads {OWNER_COST} (gpuledger-fleet.rules.yml):",
        "load that file too. The engines' scrape jobs must carry the labels each counter joins on",
        "(`namespace` and `pod` from Kubernetes discovery) and the same `cluster` label as gpuledger's.",
        "",
        "Per unit of work, at the join level (namespace_pod: per pod) and per model:",
        "  LEVEL:gpuledger_work_NAME:rate5m                      units of work per second",
        "  LEVEL:gpuledger_NAME_cost_dollars_PER:ratio_rate5m     dollars per unit (each), per thousand, per million",
        "Per model, the dollars are those of every pod that exports the counter, busy or not,",
        "over the work they all did. A pod with no work in the window has no per-pod ratio.",
        "",
        "Counters:",
    ]
    for counter in counters:
        join = ", ".join(label if label == theirs else f"{label}={theirs}" for label, theirs in counter.join)
        per = f"{_SCALE_TEXT[counter.scale]}{counter.unit}s" if counter.scale > 1 else counter.unit
        lines.append(f"  {counter.name}: {counter.metric} (dollars per {per},")
        lines.append(f"    joined on {join})")
        if counter.source:
            lines.extend(f"    {line}" for line in _wrap(counter.source, 86))
    return _comment(lines)


# --- budgets -----------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BudgetEntry(_Strict):
    """One monthly budget: of exactly one team, namespace or model."""

    team: str | None = None
    namespace: str | None = None
    model: str | None = None
    monthly_dollars: float = Field(gt=0, allow_inf_nan=False)

    @field_validator("monthly_dollars", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: object) -> object:
        # pydantic reads true as 1.0: `monthly_dollars: yes` (or on) was a budget of $1.
        if isinstance(value, bool):
            raise ValueError(f"a number of dollars, got {str(value).lower()}")
        return value

    @model_validator(mode="after")
    def _one_owner(self) -> BudgetEntry:
        set_ = [kind for kind in BUDGET_KINDS if getattr(self, kind) is not None]
        if len(set_) != 1:
            raise ValueError(f"give exactly one of {', '.join(BUDGET_KINDS)} (got {', '.join(set_) or 'none'})")
        value = getattr(self, set_[0])
        # A lone surrogate (YAML's "\ud800") is no UTF-8: the dumper writes it as an escape that
        # Prometheus's YAML parser refuses, so the whole rule file would fail to load.
        if not value or any(ord(ch) < 32 or 0xD800 <= ord(ch) <= 0xDFFF for ch in value):
            raise ValueError(f"{set_[0]}: not a label value: {value!r}")
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in BUDGET_KINDS if getattr(self, kind) is not None)

    @property
    def value(self) -> str:
        value: str = getattr(self, self.kind)
        return value


class BudgetsFile(_Strict):
    """The budgets file: budgets, the time zone their months follow, how far back the
    month-end forecast looks for the burn rate, and how finely spend is summed (None: by the
    hour, or the quarter hour where months start on one)."""

    timezone: str = "UTC"
    forecast_window: Annotated[str, Field(min_length=1)] = "24h"
    resolution: Annotated[str, Field(min_length=1)] | None = None
    budgets: list[BudgetEntry] = Field(min_length=1)

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        zone_offsets(value, 2026)  # raises ValueError naming what is wrong
        return value

    @field_validator("forecast_window")
    @classmethod
    def _window(cls, value: str) -> str:
        seconds = parse_duration(value)
        if seconds < 3600 or seconds > 31 * 86400 or seconds % 3600:
            raise ValueError(f"whole hours between 1h and 31d, got {value!r}")
        return value

    @field_validator("resolution")
    @classmethod
    def _resolution(cls, value: str | None) -> str | None:
        # Whether it divides the quarter hour, where the zone's months start on one, is the
        # plan's to check: that needs the year's offsets.
        if value is not None and not _divides(parse_duration(value), 3600):
            raise ValueError(f"whole seconds that divide 1h (1h, 15m, 1m, 10s, ...), got {value!r}")
        return value

    @field_validator("budgets")
    @classmethod
    def _unique(cls, value: list[BudgetEntry]) -> list[BudgetEntry]:
        seen: set[tuple[str, str]] = set()
        for entry in value:
            key = (entry.kind, entry.value)
            if key in seen:
                raise ValueError(f"{entry.kind} {entry.value!r} has two budgets")
            seen.add(key)
        return value


def _divides(seconds: float, span: int) -> bool:
    return seconds >= 1 and seconds == int(seconds) and span % int(seconds) == 0


_OFFSET = re.compile(r"^(?:UTC)?([+-])(\d{2}):?(\d{2})$")


def zone_offsets(zone: str, year: int) -> tuple[int, ...]:
    """The UTC offset (seconds) in force at the local start of each month of `year`, 1-12.

    `zone` is an IANA name ("Europe/Berlin"), "UTC", or a fixed offset ("+05:30", "UTC-08:00").
    """
    fixed = _OFFSET.match(zone)
    if fixed:
        sign, hours, minutes = fixed.groups()
        seconds = (int(hours) * 3600 + int(minutes) * 60) * (-1 if sign == "-" else 1)
        if int(minutes) >= 60 or abs(seconds) > 14 * 3600 or seconds % 900:
            raise ValueError(f"{zone!r}: an offset is whole quarter hours within +-14:00")
        return (seconds,) * 12
    if zone in ("UTC", "Z"):
        return (0,) * 12
    try:
        tz = zoneinfo.ZoneInfo(zone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {zone!r} (an IANA name such as Europe/Berlin, or +05:30)") from None
    offsets = []
    for month in range(1, 13):
        offset = dt.datetime(year, month, 1, tzinfo=tz).utcoffset()
        assert offset is not None  # a ZoneInfo always has one
        offsets.append(int(offset.total_seconds()))
    if any(seconds % 900 for seconds in offsets):
        raise ValueError(f"{zone!r}: its offset is not whole quarter hours; give a fixed offset")
    return tuple(offsets)


@dataclass(frozen=True)
class BudgetPlan:
    """A budgets file, resolved: month-start offsets for the rendering year."""

    timezone: str
    offsets: tuple[int, ...]  # seconds, January..December
    forecast_window_s: int
    budgets: tuple[BudgetEntry, ...]
    year: int
    resolution_s: int | None = None  # the tile; None: the month starts' alignment


def load_budgets(path: Path, year: int) -> BudgetPlan:
    """The budgets file at `path`, checked. Raises BadInputError with one line naming the file
    and the key."""
    try:
        raw = read_yaml(path, "budgets")
    except YamlFileError as exc:
        raise BadInputError(str(exc)) from None
    if not isinstance(raw, Mapping):
        raise BadInputError(f"{path}: expected a mapping with budgets:, got {type(raw).__name__}")
    try:
        parsed = BudgetsFile(**raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "budgets"
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise BadInputError(f"{path}: {where}: {message}{more}") from None
    offsets = zone_offsets(parsed.timezone, year)
    resolution_s = None if parsed.resolution is None else int(parse_duration(parsed.resolution))
    alignment = month_alignment(offsets)
    if resolution_s is not None and alignment % resolution_s:
        raise BadInputError(
            f"{path}: resolution: {parsed.timezone}'s months start on a half or quarter hour in {year}, so "
            f"spend is summed by a divisor of 15m (15m, 5m, 1m, 10s, ...), got {parsed.resolution!r}"
        )
    return BudgetPlan(
        timezone=parsed.timezone,
        offsets=offsets,
        forecast_window_s=int(parse_duration(parsed.forecast_window)),
        budgets=tuple(parsed.budgets),
        year=year,
        resolution_s=resolution_s,
    )


MONTH_START = "timezone:gpuledger_month_start_timestamp_seconds:calendar"
MONTH_OFFSET = "timezone:gpuledger_month_utc_offset_seconds:calendar"
MONTH_END = "timezone:gpuledger_month_end_timestamp_seconds:calendar"
LOCAL_MONTH = "timezone:gpuledger_local_month:calendar"
BUDGET = "budget:gpuledger_budget_dollars:monthly"
SPEND = "budget:gpuledger_cost_dollars:month_to_date"
FORECAST = "budget:gpuledger_cost_dollars:month_forecast"
SPENT_RATIO = "budget:gpuledger_budget_spent:ratio"
FORECAST_RATIO = "budget:gpuledger_budget_forecast:ratio"


def burn_record(window_s: int) -> str:
    return f"budget:gpuledger_cost_dollars_per_hour:rate{_duration_text(window_s)}"


def _duration_text(seconds: int) -> str:
    """`7d`, `24h`, `15m`: days only from two on, as people say "the last 24h"."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0 and (unit != "d" or seconds >= 2 * 86400):
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _signed(value: int | float) -> str:
    """`+ 3600` or `- 3600`, to add to an expression."""
    return f"+ {value:g}" if value >= 0 else f"- {-value:g}"


def _just_under(seconds: int) -> str:
    """A range a second short of `seconds`, so that it holds the steps of exactly that span:
    Prometheus 2 counts a step on either end of a range, 3 only the later one, and the step
    exactly `seconds` back ends the tile before."""
    seconds -= 1
    parts = [(seconds // 86400, "d"), (seconds % 86400 // 3600, "h"), (seconds % 3600 // 60, "m"), (seconds % 60, "s")]
    return "".join(f"{n}{unit}" for n, unit in parts if n)


def _lookup(month: str, offsets: Sequence[int], base: str) -> str:
    """The start offset of the month `month` evaluates to (1-12), as PromQL: `base` is a
    vector of the labels wanted, valued 0 (`vector(0)`, or `SERIES * 0`)."""
    common = max(set(offsets), key=offsets.count)
    expr = f"{base} {_signed(common)}"
    for offset in sorted(set(offsets) - {common}):
        months = [m for m, value in enumerate(offsets, start=1) if value == offset]
        hits = " + ".join(f"({month} == bool {m})" for m in months)
        expr += f" {_signed(offset - common)} * ({hits})"
    return f"({expr})"


def _local_month_expr(offsets: Sequence[int]) -> str:
    """The local month (1-12) now, label-less.

    c, the month of now shifted by the zone's largest offset, is the local month or the next.
    It is the local month exactly when now shifted by c's own start offset is still in c (that
    shift is at most the largest, and c starts at local midnight under its own offset). So the
    local month is c, else c - 1 (December before January)."""
    candidate = f"month(vector(time() {_signed(max(offsets))}))"
    if len(set(offsets)) == 1:
        return candidate
    own = _lookup(candidate, offsets, "vector(0)")
    inside = f"(month(vector(time()) + {own}) == bool {candidate})"
    return f"({candidate} + 10 + {inside}) % 12 + 1"


def _zone(plan: BudgetPlan) -> str:
    return f"{{timezone={_quote(plan.timezone)}}}"


def _quote(value: str) -> str:
    """A PromQL string literal (Go's escapes, which JSON's are a subset of)."""
    return json.dumps(value, ensure_ascii=False)


def calendar_rules(plan: BudgetPlan) -> list[dict[str, Any]]:
    """The local month now, its UTC offset at its start, its start and its end (unix seconds),
    labelled with the zone."""
    zone = _zone(plan)
    month, offset, start = f"{LOCAL_MONTH}{zone}", f"{MONTH_OFFSET}{zone}", f"{MONTH_START}{zone}"
    # Now, read as local time under the month's start offset. In the hour(s) before a month
    # that starts on a smaller offset (October to November under summer time) that spills into
    # the next month: those are counted from the last day of this one.
    local = f"({offset} + time())"
    spill = f"(month({local}) != bool {month})"
    # PromQL's % keeps the dividend's sign: before 1970 (tests) the time of day needs + 86400.
    elapsed = f"(day_of_month({local} - 86400 * {spill}) - 1 + {spill}) * 86400 + ({local} % 86400 + 86400) % 86400"
    next_offset = _lookup(f"({month} % 12 + 1)", plan.offsets, f"{month} * 0")
    labels = {"timezone": plan.timezone}
    return [
        {"record": LOCAL_MONTH, "expr": _local_month_expr(plan.offsets) + "\n", "labels": labels},
        {"record": MONTH_OFFSET, "expr": _lookup(month, plan.offsets, f"{month} * 0") + "\n", "labels": labels},
        {"record": MONTH_START, "expr": f"time() - (\n  {elapsed}\n)\n", "labels": labels},
        {
            # The month's length is its days, less the hour summer time takes or plus the one
            # it gives back between its start and the next month's.
            "record": MONTH_END,
            "expr": f"{start}\n+ days_in_month({start} + {offset}) * 86400\n+ {offset}\n- {next_offset}\n",
            "labels": labels,
        },
    ]


def month_alignment(offsets: Sequence[int]) -> int:
    """What every month start is a multiple of (unix seconds): the hour, or the quarter hour in
    a zone whose month starts fall on a half or quarter hour (India, Nepal, parts of Australia).
    Spend is summed in tiles of this length, which never straddle a month start."""
    return 3600 if all(offset % 3600 == 0 for offset in offsets) else 900


def resolution_seconds(plan: BudgetPlan) -> int:
    """How finely spend is summed: the file's resolution, else the whole tile. It divides the
    tile (load_budgets checks), so its tiles never straddle one either."""
    return plan.resolution_s or month_alignment(plan.offsets)


def step_seconds(plan: BudgetPlan) -> int:
    """The step between the 5m rates a tile sums, and the group's evaluation interval: the
    resolution's largest divisor up to 5m, so that the 5m rates read cover every moment (a
    step longer than their window would skip some) and a tile holds whole steps."""
    resolution = resolution_seconds(plan)
    return max(step for step in range(1, min(resolution, 300) + 1) if resolution % step == 0)


def tile_record(seconds: int) -> str:
    return f"budget:gpuledger_cost_dollars:increase{_duration_text(seconds)}"


def _tile_expr(cost: str, tile: int, step: int) -> str:
    """The dollars of the tile ending now: its rates ($/h) x the step (step / 3600 h)."""
    if tile == step:
        # One rate, read as is: a subquery a second short of a step could hold none of its
        # steps when the evaluation is not aligned to them (Prometheus offsets each group).
        return f"sum({cost}) / {3600 // step}\n"
    return f"sum_over_time(sum({cost})[{_just_under(tile)}:{_duration_text(step)}]) / {3600 // step}\n"


def _spend_expr(plan: BudgetPlan, own: str) -> str:
    """Dollars since the month's start: the tiles that end on a step of the subquery after the
    month's start, that start read at the evaluation time (@ end()); at a resolution finer than
    the tile, plus the finer tiles since the last tile's end. Nothing spent yet: 0.

    Finer tiles are summed only back to the last whole tile so that each evaluation reads 768
    tiles (32d of hours) and one tile's worth of finer ones, not a month of finer ones (276480
    at 10s: more than promtool's query limit or VictoriaMetrics's default subquery limit)."""
    tile, resolution = month_alignment(plan.offsets), resolution_seconds(plan)
    whole = (
        f"sum(\n"
        f"  sum_over_time(\n"
        f"    (\n"
        f"      {tile_record(tile)}{own}\n"
        f"      and on () (vector(time()) - {tile} >= on () {MONTH_START}{_zone(plan)} @ end())\n"
        f"    )[32d:{_duration_text(tile)}]\n"
        f"  )\n"
        f")\n"
        f"or vector(0)\n"
    )
    if resolution == tile:
        return whole
    # The last tile's end, the evaluation time rounded down to a tile (month starts are whole
    # tiles in UTC too), read from a one-step subquery: `@` takes no function call.
    last_end = f"max_over_time(vector(time())[{_just_under(tile)}:{_duration_text(tile)}] @ end())"
    finer = (
        f"sum(\n"
        f"  sum_over_time(\n"
        f"    (\n"
        f"      {tile_record(resolution)}{own}\n"
        f"      and on () (vector(time()) - {resolution} >= on () {last_end})\n"
        f"    )[{_just_under(tile)}:{_duration_text(resolution)}]\n"
        f"  )\n"
        f")\n"
        f"or vector(0)\n"
    )
    return f"(\n{_indent(whole)})\n+\n(\n{_indent(finer)})\n"


def _indent(text: str) -> str:
    return "".join(f"  {line}\n" for line in text.splitlines())


def budget_groups(plan: BudgetPlan) -> list[dict[str, Any]]:
    zone = _zone(plan)
    window = plan.forecast_window_s
    tile, resolution, inner = month_alignment(plan.offsets), resolution_seconds(plan), step_seconds(plan)
    tiled, step = tile_record(tile), _duration_text(tile)
    burn = burn_record(window)
    rules = calendar_rules(plan)
    for entry in plan.budgets:
        cost = KIND_COST.format(kind=entry.kind)
        own = f"{{{entry.kind}={_quote(entry.value)}}}"
        labels = {entry.kind: entry.value}
        rules += [
            {"record": BUDGET, "expr": f"vector({entry.monthly_dollars!r})\n", "labels": labels},
            {
                # Dollars of the last tile: its 5m rates ($/h) x 5m (1/12 h) by default. Summing
                # tiles, not steps, keeps a month's subquery at 768 steps (3072 by quarter hours).
                "record": tiled,
                "expr": _tile_expr(f"{cost}{own}", tile, inner),
                "labels": labels,
            },
        ]
        if resolution != tile:
            # The same rates, by the resolution: the tile is the sum of its finer tiles.
            rules.append(
                {
                    "record": tile_record(resolution),
                    "expr": _tile_expr(f"{cost}{own}", resolution, inner),
                    "labels": labels,
                }
            )
        rules += [
            {"record": SPEND, "expr": _spend_expr(plan, own), "labels": labels},
            {
                # Dollars spent over the window, per hour: a tile with no spend counts as 0.
                "record": burn,
                "expr": f"sum_over_time({tiled}{own}[{_just_under(window)}:{step}]) / {window / 3600:g}\n",
                "labels": labels,
            },
            {
                # Spend counts whole tiles of the resolution: the forecast goes on from the last
                # one's end.
                "record": FORECAST,
                "expr": (
                    f"{SPEND}{own}\n"
                    f"+ {burn}{own} * on () group_left () "
                    f"({MONTH_END}{zone} - (time() - time() % {resolution})) / 3600\n"
                    f"or {SPEND}{own}\n"
                ),
                "labels": labels,
            },
        ]
    rules += [
        {"record": SPENT_RATIO, "expr": f"{SPEND} / {BUDGET}\n"},
        {"record": FORECAST_RATIO, "expr": f"{FORECAST} / {BUDGET}\n"},
    ]
    owner = (
        "{{ if $labels.team }}team {{ $labels.team }}{{ end }}"
        "{{ if $labels.namespace }}namespace {{ $labels.namespace }}{{ end }}"
        "{{ if $labels.model }}model {{ $labels.model }}{{ end }}"
    )
    # `index`, not $labels.namespace: a label the alert lacks is then "" in vmalert too, which
    # (unlike Prometheus, missingkey=zero) hands printf a nil and fails the whole alert.
    amount = (
        "{{ with printf `" + BUDGET + "{team=%q, namespace=%q, model=%q}` "
        '(index $labels "team") (index $labels "namespace") (index $labels "model")'
        ' | query }}${{ . | first | value | printf "%.0f" }}{{ end }}'
    )
    month = f"this month ({plan.timezone})"
    alerts = [
        {
            "alert": "GPUBudgetForecastOverrun",
            "expr": f"{FORECAST} > {BUDGET}\nunless {SPEND} >= {BUDGET}\n",
            "for": "30m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": f"GPU spend of {owner} is on course to overrun its budget {month}",
                "description": (
                    f"At the burn rate of the last {_duration_text(window)}, {owner} will have spent "
                    f'${{{{ $value | printf "%.0f" }}}} by the end of the month, over its monthly budget of {amount}.'
                ),
            },
        },
        {
            "alert": "GPUBudgetExceeded",
            "expr": f"{SPEND} >= {BUDGET}\n",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": f"GPU spend of {owner} has passed its budget {month}",
                "description": (
                    f'{owner} has spent ${{{{ $value | printf "%.0f" }}}} {month}, its monthly budget is {amount}.'
                ),
            },
        },
    ]
    # One group, the alerts last: rules of a group run in order, so the alerts compare this
    # evaluation's spend and forecast (groups run concurrently, and one reading another's output
    # sees it an evaluation late). Evaluated every step (5m by default): each tile is recorded
    # at its end, and spend is read as often as the rates a tile sums.
    return [{"name": "gpuledger-budgets", "interval": _duration_text(inner), "rules": rules + alerts}]


def budget_header(plan: BudgetPlan) -> str:
    names = [dt.date(2000, m, 1).strftime("%b") for m in range(1, 13)]
    table = ", ".join(f"{name} {_offset_text(offset)}" for name, offset in zip(names, plan.offsets, strict=True))
    lines = [
        "GPU budgets: spend this month, the month-end forecast and alerts. Rendered by",
        "`gpuledger rules --budgets FILE`; do not edit, re-render.",
        "",
        f"Months follow {plan.timezone}; the UTC offset at each month's start (tz database):",
        *_wrap(table, 88),
        "Daylight saving time changes mid-month and moves no month boundary, so these are exact;",
        "re-render if the zone's rules change (a new law) or for a year whose offsets differ.",
        "",
        "Reads team:, namespace: and model:gpuledger_workload_cost_dollars_per_hour:rate5m",
        "(gpuledger-recording.rules.yml). Spend so far sums those 5m rates over the month's",
        f"{_duration_text(step_seconds(plan))} steps: accurate to about 5 minutes at each end, it counts only what the "
        "rate rules",
        "recorded (Prometheus down: that time is missing). `gpuledger report` has the exact",
        "figures. One budgets file per Prometheus: a second would record the same series.",
        *_resolution_lines(plan),
        "",
        f"{SPEND}              dollars since the local month's start",
        f"{burn_record(plan.forecast_window_s)}  dollars per hour over the forecast window",
        f"{FORECAST}           spend + burn x hours left in the month",
        f"{BUDGET}                 the monthly budget",
        f"{SPENT_RATIO}, {FORECAST_RATIO}",
    ]
    return _comment(lines)


def _resolution_lines(plan: BudgetPlan) -> list[str]:
    """What a resolution finer than the tile gives and costs, for the header."""
    tile, resolution = month_alignment(plan.offsets), resolution_seconds(plan)
    if resolution == tile:
        return []
    fine, whole = _duration_text(resolution), _duration_text(tile)
    text = (
        f"Summed by {fine} (resolution): spend and the forecast lag {fine} rather than {whole}, and"
        f" the group runs every {_duration_text(step_seconds(plan))}, each run reading per budget the month's"
        f" {whole} tiles, the {fine} tiles since the last of them and {tile // step_seconds(plan)} rates"
        f" for the {whole} tile. The burn rate still sums whole {whole} tiles."
    )
    return _wrap(text, 88)


def _offset_text(seconds: int) -> str:
    sign = "-" if seconds < 0 else "+"
    minutes = abs(seconds) // 60
    return f"{sign}{minutes // 60:02d}:{minutes % 60:02d}"


# --- output ------------------------------------------------------------------------------------


# Long annotations stay on one line rather than fold.
_NO_FOLDING = 1_000_000


class _Dumper(yaml.SafeDumper):
    """YAML with multi-line expressions as literal blocks, as people write rule files, and no
    anchors: each rule spells out its labels."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


# What YAML 1.1 also reads as line breaks: PyYAML writes them as they are, each followed by the
# indentation, in a block or a plain or single-quoted scalar, so a name holding one came back
# with spaces after it (a budget matching no series) or, as a newline, broke the expression.
_OTHER_BREAKS = ("\x85", "\u2028", "\u2029")


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Double quotes escape them (\N, \L, \P), which Prometheus's YAML parser reads back.
    style = '"' if any(br in value for br in _OTHER_BREAKS) else "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def rules_yaml(groups: Sequence[Mapping[str, Any]], header: str) -> str:
    """A rule file: the header comment, then `groups:`."""
    body = yaml.dump({"groups": list(groups)}, Dumper=_Dumper, sort_keys=False, width=_NO_FOLDING, allow_unicode=True)
    return header + body


def prometheus_rule_yaml(groups: Sequence[Mapping[str, Any]], header: str, name: str) -> str:
    """The same groups as a prometheus-operator PrometheusRule, to apply beside the chart."""
    manifest = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/name": "gpuledger", "app.kubernetes.io/part-of": "gpuledger"},
        },
        "spec": {"groups": list(groups)},
    }
    return header + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=_NO_FOLDING, allow_unicode=True)


def _comment(lines: Iterable[str]) -> str:
    return "".join(f"# {line}".rstrip() + "\n" for line in lines)


def _wrap(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines
