"""`gpuledger report --format html`: the report as one self-contained page for people.

What the page holds, for the report's window and grouping (`--by`, `--since`/`--until`):
spend over time by the report's groups, idle dollars by who left the GPUs idle (`left_by`),
waste by workload, efficiency, the largest right-sizing savings (`report --recommend`'s advice),
and the report's full table. Every figure on it is the report's own (`agent.ledger.report`'s
`_figures`, the function the table, CSV and JSON print from), and each number cell carries the
full-precision value in `data-value`, so what the page says can be checked against `--format
json`. The spend over time is the same report built again for each hour, day or week
(`spend_over_time`): its bars add up to the report's TOTAL.

Self-contained: styles inline, charts inline SVG (agent/ledger/charts.py), no script, no font,
no image fetched; a Content-Security-Policy that allows nothing else says so to the browser.
Every text that comes from the ledger (workload labels are whatever users named their pods,
jobs and models) is HTML-escaped here, and drawn literally in the charts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from agent.accounting.rightsize import ACTION_NONE, HOURS_PER_MONTH, Recommendation
from agent.ledger import charts
from agent.ledger.charts import Series
from agent.ledger.pending import HOUR_S, hour_start
from agent.ledger.read import UsageRow
from agent.ledger.report import (
    IDLE_LABEL,
    NONE_LABEL,
    TOTAL_LABEL,
    UNOBSERVED_LABEL,
    Report,
    ReportLine,
    _amount,
    _figures,
    _percent,
    _run_figures,
    _span,
    build_report,
    cents_adding_up,
    left_by_name,
    recorded_note,
    shown_figures,
)
from agent.model import Workload
from agent.units import iso_time

DAY_S = 86400.0
WEEK_S = 7 * DAY_S
# Bars on the spend-over-time chart: hourly up to four days, daily up to three months, weekly beyond,
# and beyond MAX_BARS weeks (five years) as many weeks a bar as keep them at most MAX_BARS: hours
# decades apart (a node that wrote some with its clock still at 1970) are a chart, not 3,000 bars.
HOURLY_UP_TO_S = 4 * DAY_S
DAILY_UP_TO_S = 92 * DAY_S
MAX_BARS = 260
# Groups drawn on their own in the spend chart (the rest are one "other" part); workloads on the
# waste and efficiency charts; savings on the right-sizing chart.
TOP_SERIES = 8
TOP_WORKLOADS = 15
TOP_SAVINGS = 10
OTHER = "other"


@dataclass(frozen=True, slots=True)
class Timeline:
    """Dollars per bucket of time: `starts` (Unix seconds) of buckets `bucket_s` long, and per
    series (the largest groups, `other`, idle, unobserved) its dollars in each bucket."""

    bucket_s: float
    starts: tuple[float, ...]
    series: tuple[tuple[str, tuple[float, ...]], ...]


def bucket_size(since: float, until: float) -> float:
    span = until - since
    if span <= HOURLY_UP_TO_S:
        return HOUR_S
    if span <= DAILY_UP_TO_S:
        return DAY_S
    # One more bar than the span's weeks: the first week may start before `since`.
    return WEEK_S * max(1, math.ceil((span / WEEK_S + 1) / MAX_BARS))


def bucket_start(t: float, size: float) -> float:
    """The UTC hour, day or week (or run of weeks, counted from the epoch's first Monday) that `t`
    falls in; weeks start on Monday 00:00."""
    if size >= WEEK_S:
        monday = 4 * DAY_S  # the epoch was a Thursday
        return t - (t - monday) % size
    return t - t % size


def bucket_name(size: float) -> str:
    """What a bar of `size` seconds is, for the chart's axis and table."""
    if size == HOUR_S:
        return "hour"
    if size == DAY_S:
        return "day (UTC)"
    weeks = round(size / WEEK_S)
    return "week (UTC, from Monday)" if weeks == 1 else f"{weeks} weeks (UTC, from Monday)"


def line_name(line: ReportLine) -> str:
    """A group's name for people: its key values, "(none)" for a value it lacks."""
    return " / ".join(value or NONE_LABEL for value in line.key)


def spend_over_time(report: Report, rows: Sequence[UsageRow], *, top: int = TOP_SERIES) -> Timeline:
    """The report's dollars by bucket of time, each bucket's report built from its rows by
    `build_report`, as the report itself is: the buckets of a series add up to its line.

    The buckets span the hours the ledgers hold within the window (`Report.recorded_since`,
    `recorded_until`), not the window asked for: `--since 1970-01-01` would otherwise draw 2,900
    empty weekly bars (and `--until 8999-12-31` millions) around a week of figures."""
    if report.recorded_since is None or report.recorded_until is None:
        return Timeline(HOUR_S, (), ())
    size = bucket_size(report.recorded_since, report.recorded_until)
    first = bucket_start(report.recorded_since, size)
    starts: list[float] = []
    t = first
    while t < report.recorded_until:
        starts.append(t)
        t += size
    by_bucket: dict[float, list[UsageRow]] = {start: [] for start in starts}
    for row in rows:
        by_bucket.setdefault(bucket_start(float(hour_start(row.hour)), size), []).append(row)
    shown = report.lines[:top]
    keys = {line.key for line in shown}
    rest = len(report.lines) - len(shown)
    groups: dict[tuple[str, ...], list[float]] = {line.key: [] for line in shown}
    other: list[float] = []
    idle: list[float] = []
    unobserved: list[float] = []
    for start in starts:
        part = build_report(by_bucket[start], report.by)
        dollars = {line.key: line.dollars for line in part.lines}
        for key, values in groups.items():
            values.append(dollars.get(key, 0.0))
        other.append(math.fsum(d for key, d in dollars.items() if key not in keys))
        idle.append(part.idle.dollars)
        unobserved.append(part.unobserved.dollars)
    series = [(line_name(line), tuple(groups[line.key])) for line in shown]
    if rest:
        series.append((f"{OTHER} ({rest})", tuple(other)))
    series += [(IDLE_LABEL, tuple(idle)), (UNOBSERVED_LABEL, tuple(unobserved))]
    return Timeline(size, tuple(starts), tuple(series))


# --- the page --------------------------------------------------------------------------------------

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; color: #1d1d1f; margin: 2rem auto; max-width: 72rem; padding: 0 1rem; }
h1 { font-size: 1.5rem; margin-bottom: .2rem; }
h2 { font-size: 1.15rem; margin-top: 2.2rem; border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
.span, .note { color: #555; }
.tiles { display: grid; grid-template-columns: repeat(auto-fit, minmax(10rem, 1fr)); gap: .8rem; margin: 1.2rem 0; }
.tile { border: 1px solid #ddd; border-radius: 6px; padding: .6rem .8rem; }
.tile .label { color: #555; font-size: .85rem; }
.tile .value { font-size: 1.35rem; font-weight: 600; font-variant-numeric: tabular-nums; }
.tile .sub { color: #555; font-size: .8rem; }
svg.chart { display: block; width: 100%; height: auto; }
table { border-collapse: collapse; margin: .6rem 0; font-variant-numeric: tabular-nums; }
th, td { padding: .25rem .6rem; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
th { background: #f6f6f6; }
td.num, th.num { text-align: right; white-space: nowrap; }
tr.total td { font-weight: 600; border-top: 2px solid #999; }
tr.idle td, tr.unobserved td { color: #555; }
.empty { font-size: 1.1rem; padding: 1rem; border: 1px dashed #bbb; border-radius: 6px; }
"""

# No script, no font, no image, no request of any kind: the page shows only what it carries.
_CSP = "default-src 'none'; style-src 'unsafe-inline'"

_COLUMNS = (
    ("dollars", "Dollars"),
    ("gpu_hours_charged", "GPU-hours charged"),
    ("gpu_hours_used", "GPU-hours used"),
    ("efficiency_ratio", "Efficiency"),
    ("waste_dollars", "Waste $"),
    ("energy_kwh", "Energy kWh"),
    ("energy_dollars", "Energy $"),
)


def render_html(
    report: Report,
    rows: Sequence[UsageRow] | None,
    advice: Sequence[Recommendation] | None,
    *,
    generator: str,
) -> str:
    """The page. `rows` are the rows the report was built from (None: a store's report, which
    has no hours to chart); `advice` is `report --recommend`'s (None: not available here).
    BadInputError where matplotlib (the `html` extra) is missing."""
    charts.require_matplotlib()
    by = ", ".join(report.by)
    title = f"GPU cost by {by}"
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="span">{escape(_span(report))}</p>',
    ]
    note = recorded_note(report)
    if note is not None:
        body.append(f'<p class="note" id="recorded">{escape(note)}</p>')
    if report.total.charged_s == 0 and report.total.dollars == 0:
        body.append(
            '<p class="empty" id="empty">No GPU time recorded in this window: nothing to show. '
            "Is the window right (<code>--since</code>, <code>--until</code>), "
            "and is the agent writing this ledger?</p>"
        )
    else:
        body += _summary(report)
        body += _over_time(report, rows)
        body += _idle_section(report)
        body += _waste_section(report)
        body += _efficiency_section(report)
        body += _savings_section(advice)
        body += _table_section(report)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<meta name="generator" content="{escape(generator)}">\n'
        f"<title>{escape(title)}: {escape(_span(report))}</title>\n"
        f"<style>{_CSS}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )


def _value(value: float | None) -> str:
    """A figure at full precision for `data-value` (repr reads back as the same float); empty
    where unknown."""
    return "" if value is None else repr(value)


def _shown(field: str, value: float | None) -> str:
    if field == "efficiency_ratio":
        return _percent(value)
    return "-" if value is None else _amount(value)


def _tile(figure: str, label: str, value: float | None, shown: str, sub: str) -> str:
    return (
        f'<div class="tile" data-figure="{figure}" data-value="{_value(value)}">'
        f'<div class="label">{escape(label)}</div><div class="value">{escape(shown)}</div>'
        f'<div class="sub">{escape(sub)}</div></div>'
    )


def _summary(report: Report) -> list[str]:
    workloads = math.fsum(line.dollars for line in report.lines)
    workload_hours = math.fsum(line.charged_s for line in report.lines) / HOUR_S
    total = report.total
    # The three parts of the time paid for, shown so that they add up to it to the cent, its
    # dollars and its GPU-hours alike.
    shown = cents_adding_up([workloads, report.idle.dollars, report.unobserved.dollars], total.dollars)
    hours = cents_adding_up(
        [workload_hours, report.idle.gpu_hours_charged, report.unobserved.gpu_hours_charged], total.gpu_hours_charged
    )
    tiles = [
        _tile("total_dollars", "GPU time paid for", total.dollars, f"${_amount(total.dollars)}",
              f"{_amount(total.gpu_hours_charged)} GPU-hours"),
        _tile("workload_dollars", "Charged to workloads", workloads, f"${_amount(shown[0])}",
              f"{_amount(hours[0])} GPU-hours"),
        _tile("idle_dollars", "Idle (held by nobody)", report.idle.dollars, f"${_amount(shown[1])}",
              f"{_amount(hours[1])} GPU-hours"),
        _tile("unobserved_dollars", "Unobserved (seen by nobody)", report.unobserved.dollars,
              f"${_amount(shown[2])}", f"{_amount(hours[2])} GPU-hours"),
        _tile("waste_dollars", "Waste (paid for, unused)", total.waste_dollars,
              f"${_shown('waste_dollars', total.waste_dollars)}", "workloads' unused share + idle"),
        _tile("efficiency_ratio", "Efficiency", total.efficiency, _percent(total.efficiency),
              "GPU-hours used / paid for"),
    ]  # fmt: skip
    return [
        '<div class="tiles">',
        *tiles,
        "</div>",
        f'<p class="note">Charged to workloads ${_amount(shown[0])} + idle ${_amount(shown[1])} + '
        f"unobserved ${_amount(shown[2])} = ${_amount(total.dollars)}, the price of "
        f"{_amount(total.gpu_hours_charged)} GPU-hours: {escape(_hours_paid_for(report))}, once.</p>",
    ]


def _hours_paid_for(report: Report) -> str:
    """Which GPU-hours TOTAL is the price of: those the ledgers hold, which may start after the
    window does or end before it; a store's report, the window's."""
    if report.recorded_since is None or report.recorded_until is None:
        return "every hour of every GPU in the window"
    since, until = iso_time(report.recorded_since), iso_time(report.recorded_until)
    return f"every hour of every GPU the ledgers hold from {since} to {until}"


def _section(anchor: str, heading: str) -> str:
    return f'<h2 id="{anchor}">{escape(heading)}</h2>'


def _series_colours(names: Sequence[str]) -> list[str]:
    colours = []
    workload = 0
    for name in names:
        if name == IDLE_LABEL:
            colours.append(charts.IDLE_COLOUR)
        elif name == UNOBSERVED_LABEL:
            colours.append(charts.UNOBSERVED_COLOUR)
        elif name.startswith(f"{OTHER} ("):
            colours.append(charts.OTHER_COLOUR)
        else:
            colours.append(charts.PALETTE[workload % len(charts.PALETTE)])
            workload += 1
    return colours


def _over_time(report: Report, rows: Sequence[UsageRow] | None) -> list[str]:
    by = ", ".join(report.by)
    out = [_section("over-time", f"Spend over time by {by}")]
    if rows is None:
        out.append(
            "<p class=\"note\">Spend over time comes from ledgers: a store's report reads each counter's "
            "growth over the whole window, not hour by hour.</p>"
        )
        return out
    timeline = spend_over_time(report, rows)
    if not timeline.starts:
        return [*out, '<p class="note">No hours recorded.</p>']
    names = [name for name, _ in timeline.series]
    series = [
        Series(name, values, colour)
        for (name, values), colour in zip(timeline.series, _series_colours(names), strict=True)
        if any(values)
    ]
    unit = bucket_name(timeline.bucket_s)
    out.append(charts.time_bars(timeline.starts, timeline.bucket_s, series, ylabel=f"dollars per {unit}",
                                title=f"Dollars per {unit} by {by}"))  # fmt: skip
    head = "".join(f'<th class="num">{escape(s.name)}</th>' for s in series)
    body = []
    for i, start in enumerate(timeline.starts):
        cells = "".join(
            f'<td class="num" data-value="{_value(s.values[i])}">{_amount(s.values[i])}</td>' for s in series
        )
        body.append(f'<tr data-start="{iso_time(start)}"><td>{iso_time(start)}</td>{cells}</tr>')
    out.append(
        f"<details><summary>Dollars per {escape(unit)}, as a table</summary>"
        f'<table id="over-time-table"><thead><tr><th>{escape(unit)} from</th>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></details>"
    )
    return out


def _idle_rows(report: Report) -> list[tuple[str, ReportLine]]:
    return [(left_by_name(line.left_by or Workload()), line) for line in report.idle_by] or [
        ("nobody known", report.idle)
    ]


def _idle_section(report: Report) -> list[str]:
    out = [_section("idle", "Idle dollars by who left the GPUs idle")]
    if report.idle.dollars == 0 and report.idle.charged_s == 0:
        return [*out, '<p class="note">No GPU sat idle in this window.</p>']
    idle = _idle_rows(report)
    out.append(
        '<p class="note">Each idle stretch is booked to the workload that held the GPU last before it '
        "(<code>left_by</code>); &ldquo;nobody known&rdquo;: nobody held it since the agent started.</p>"
    )
    out.append(
        charts.horizontal_bars(
            [name for name, _ in idle],
            [Series("idle dollars", tuple(line.dollars for _, line in idle), charts.IDLE_COLOUR)],
            xlabel="idle dollars",
            title="Idle dollars by who left the GPUs idle",
        )
    )
    body = "".join(
        f'<tr data-left-by="{escape(json.dumps((line.left_by or Workload()).label_dict(), sort_keys=True))}">'
        f"<td>{escape(name)}</td>{_num_cell('gpu_hours_charged', line.gpu_hours_charged)}"
        f"{_num_cell('dollars', line.dollars)}</tr>"
        for name, line in idle
    )
    out.append(
        '<table id="idle-by"><thead><tr><th>left by</th><th class="num">GPU-hours idle</th>'
        f'<th class="num">Dollars</th></tr></thead><tbody>{body}</tbody></table>'
    )
    return out


def _top_workloads(report: Report) -> list[ReportLine]:
    return [line for line in report.lines[:TOP_WORKLOADS] if line.charged_s > 0]


def _more(report: Report, shown: int) -> str:
    hidden = len(report.lines) - shown
    return f'<p class="note">{hidden} smaller groups are in the table below.</p>' if hidden > 0 else ""


def _waste_section(report: Report) -> list[str]:
    out = [_section("waste", "Waste by workload")]
    lines = _top_workloads(report)
    if not lines:
        return [*out, '<p class="note">No workload held a GPU in this window.</p>']
    waste = tuple(line.waste_dollars or 0.0 for line in lines)
    # Dollars of time whose use nothing measured (a MIG instance without GPM): neither used nor
    # wasted, drawn as such, not as used (waste unknown is not waste 0).
    unknown = tuple(
        line.dollars * min(line.unmeasured_s / line.charged_s, 1.0) if line.charged_s > 0 else 0.0 for line in lines
    )
    used = tuple(max(line.dollars - w - u, 0.0) for line, w, u in zip(lines, waste, unknown, strict=True))
    out.append(
        '<p class="note">What each workload paid for and did not use: its dollars x (1 - used/charged), '
        "hour by hour. Idle GPUs are all waste too (above).</p>"
    )
    parts = [Series("used", used, charts.USED_COLOUR), Series("wasted", waste, charts.WASTE_COLOUR)]
    if any(unknown):
        parts.append(Series("use not measured", unknown, charts.OTHER_COLOUR))
    out.append(
        charts.horizontal_bars(
            [line_name(line) for line in lines], parts, xlabel="dollars", title="Dollars used and wasted by workload"
        )
    )
    out.append(_more(report, len(lines)))
    return out


def _efficiency_section(report: Report) -> list[str]:
    out = [_section("efficiency", "Efficiency")]
    lines = [line for line in _top_workloads(report) if line.efficiency is not None]
    if not lines:
        return [*out, '<p class="note">No workload held a GPU in this window.</p>']
    out.append(
        f'<p class="note">GPU-hours used / GPU-hours charged, per workload; over all GPU time paid for: '
        f"{escape(_percent(report.total.efficiency))}.</p>"
    )
    out.append(
        charts.horizontal_bars(
            [line_name(line) for line in lines],
            [Series("efficiency", tuple(min(line.efficiency or 0.0, 1.0) for line in lines), charts.PALETTE[0])],
            xlabel="GPU-hours used / charged",
            title="Efficiency by workload",
            percent=True,
        )
    )
    out.append(_more(report, len(lines)))
    return out


def _savings_section(advice: Sequence[Recommendation] | None) -> list[str]:
    out = [_section("right-sizing", "Top right-sizing savings")]
    if advice is None:
        return [
            *out,
            '<p class="note">Right-sizing advice comes from ledgers (each hour\'s memory and busy '
            "histograms): <code>report --ledger ... --format html</code>.</p>",
        ]
    saving = [r for r in advice if r.action != ACTION_NONE and r.saving_per_month > 0][:TOP_SAVINGS]
    if not saving:
        return [*out, '<p class="note">No cheaper option fits any workload of this window.</p>']
    out.append(
        f'<p class="note">Estimates, at {HOURS_PER_MONTH:.0f} hours a month, from the prices in force '
        "(<code>report --recommend</code>; each row says what it rests on).</p>"
    )
    out.append(
        charts.horizontal_bars(
            [r.workload.describe() for r in saving],
            [Series("saves $/month", tuple(r.saving_per_month for r in saving), charts.PALETTE[2])],
            xlabel="estimated dollars saved a month",
            title="Estimated monthly savings by workload",
        )
    )
    body = "".join(
        f"<tr><td>{escape(r.workload.describe())}</td><td>{escape(r.holds)}</td><td>{escape(r.option)}</td>"
        f'{_num_cell("saving_per_month", r.saving_per_month)}<td class="note">{escape(r.basis)}</td></tr>'
        for r in saving
    )
    out.append(
        '<table id="savings"><thead><tr><th>workload</th><th>holds</th><th>advice</th>'
        f'<th class="num">saves $/month (est.)</th><th>basis</th></tr></thead><tbody>{body}</tbody></table>'
    )
    return out


def _num_cell(field: str, value: float | None, shown: float | None = None) -> str:
    """A number cell: `value` at full precision in data-value; the text `shown` (the value
    where not given), as `_shown` writes it."""
    text = _shown(field, value if shown is None else shown)
    return f'<td class="num" data-field="{field}" data-value="{_value(value)}">{escape(text)}</td>'


def _table_section(report: Report) -> list[str]:
    energy = {"energy_kwh": (report.total.joules or 0.0) > 0, "energy_dollars": report.total.energy_dollars is not None}
    columns = [(field, name) for field, name in _COLUMNS if energy.get(field, True)]
    runs = ("first hour", "last hour", "GPUs") if report.runs else ()
    head = (
        "".join(f"<th>{escape(key)}</th>" for key in report.by)
        + "".join(f"<th>{name}</th>" for name in runs)
        + "".join(f'<th class="num">{escape(name)}</th>' for _, name in columns)
    )
    blank = "<td></td>" * (len(report.by) + len(runs) - 1)

    idle_rows = _idle_rows(report)
    # The cells' text adds up to TOTAL's column by column, as `gpuledger report`'s table does.
    shown = iter(shown_figures(report, [line for _, line in idle_rows]))

    def numbers(line: ReportLine, *, efficiency: bool = True, total: bool = False) -> str:
        figures = _figures(line, efficiency=efficiency)
        text = figures if total else next(shown)
        return "".join(_num_cell(field, figures[field], text[field]) for field, _ in columns)

    body = []
    for line in report.lines:
        key = json.dumps(dict(zip(report.by, line.key, strict=True)), sort_keys=True)
        cells = "".join(f"<td>{escape(value or NONE_LABEL)}</td>" for value in line.key)
        if report.runs:
            cells += "".join(f"<td>{escape(str(v or '-'))}</td>" for v in _run_figures(line).values())
        body.append(f'<tr class="group" data-kind="group" data-key="{escape(key)}">{cells}{numbers(line)}</tr>')
    for name, line in idle_rows:
        labels = json.dumps((line.left_by or Workload()).label_dict(), sort_keys=True)
        body.append(
            f'<tr class="idle" data-kind="idle" data-left-by="{escape(labels)}"><td>{escape(IDLE_LABEL)} left by '
            f"{escape(name)}</td>{blank}{numbers(line, efficiency=False)}</tr>"
        )
    body.append(
        f'<tr class="unobserved" data-kind="unobserved"><td>{escape(UNOBSERVED_LABEL)}</td>{blank}'
        f"{numbers(report.unobserved)}</tr>"
    )
    total = numbers(report.total, total=True)
    body.append(f'<tr class="total" data-kind="total"><td>{TOTAL_LABEL}</td>{blank}{total}</tr>')
    return [
        _section("table", "Every row"),
        '<p class="note">The same rows as <code>gpuledger report</code> prints, largest first.</p>',
        f'<table id="rows"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>',
    ]
