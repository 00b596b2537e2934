"""`gpuledger report`: cost and usage from one or more ledgers, grouped, as a table, CSV or JSON.

Layering: this module only reads ledgers, through `agent.ledger.read.read_ledger` (the ledger package is
the only one that talks to sqlite3); it never writes. Everything else here is pure: rows in, text out.

Choices a reader of the output should know:
- Several ledgers (files, or every *.db file of a directory) are merged into one report: the
  ledgers of many nodes, or one node's successive files. Two files that record the same node
  over overlapping periods are refused (`check_overlaps`): they are one ledger copied twice,
  or one simulation written twice, and summing them would count that time twice.
- A pod is named within its namespace and a GPU's index within its node: grouping by `pod` groups
  by `namespace` too, and by `gpu` by `node` too (`SCOPED_BY`), each shown as a column of its own.
- Rows are sorted by dollars, largest first (ties by the group's names). The `(idle)` row, the
  cost of GPUs nobody held, and the `(unobserved)` row, the cost of GPU time nobody could see
  (the agent stopped, the driver or GPU unreadable, polls too far apart), are not workloads:
  they come after them, just above TOTAL, always in the same place (shown at 0.00 when empty),
  so neither people nor scripts have to look for them.
- Idle time is broken down by who left the GPUs idle (`left_by`: the workload that held a GPU
  last before each idle stretch). Where some is known, the table shows one `(idle) left by ...`
  row per such workload instead of the one `(idle)` row (`(idle) left by nobody known` for the
  rest: GPUs nobody held since the agent started, hours recorded before the ledger kept it), so
  the column still adds up to TOTAL; CSV has one `idle` row per left_by with the workload's
  labels as a JSON object in its `left_by` column; JSON lists them under `idle.left_by`.
- GPU-hours charged are each workload's share of its GPUs' time (the share that splits the
  dollars), not the time it held them: two workloads sharing a GPU for an hour held it an hour
  each, and are charged, say, 0.75 and 0.25 of it. So the rows add up: workloads + idle +
  unobserved is every GPU-hour of the window, and TOTAL can never exceed GPUs x hours.
- TOTAL is the sum of every workload row, the idle row and the unobserved row: all the GPU time
  paid for. Its figures are summed (math.fsum, exactly rounded) from the ledger's own, never
  from the rounded ones shown; its efficiency is GPU-hours used over all GPU-hours paid for
  (time nobody observed counts as unused: as far as anyone saw). The table shows each column's
  rows in whole cents that add up to TOTAL's (`shown_figures`), so a row may read a cent off
  what it rounds to alone; CSV and JSON carry every figure unrounded.
- The ledger keeps hours, so a range is read as whole hours: every hour that overlaps
  [since, until) counts, for charged, idle and unobserved time alike, and the output states the
  hours it covers; where the ledgers hold only part of them (the window reaches before the first
  ledger began or past the last flush), it says which (`recorded_note`, JSON `recorded_since` /
  `recorded_until`).
- Efficiency is used/charged: a percent in the table; in CSV and JSON `efficiency_ratio`, 0-1
  like every ratio gpuledger exports, empty / null where nothing was charged, for the idle row
  (nobody held it) and for the unobserved row (what it was used for is unknown; its GPU-hours
  used and waste are unknown too: "-", empty, null).
- Use nothing measured is unknown, not idle: GPU time whose unit had no busy figure (a MIG
  instance without GPM, `busy_source: gpm` on a GPU without it, a shared GPU whose holders'
  shares of use cannot be told) is charged as usual but counts neither as used nor as wasted.
  Efficiency is used over the measured part of the charged time; a line none of whose time was
  measured has its GPU-hours used, efficiency and waste unknown ("-", empty, null), and a partly
  measured line's waste is what its measured part wasted.
- Waste dollars are what was paid for and not used: dollars x (1 - used/charged), summed stored
  hour by stored hour, so that a workload on GPUs of different prices wastes what each idle
  GPU-hour cost (with one price it is the row's dollars x (1 - efficiency)). All the idle row's
  dollars are waste; TOTAL's waste is the workloads' plus the idle row's.
- Energy is the GPUs' own energy counters split like cost, in kWh, so TOTAL's is what the
  counters counted; the unobserved row's is the part no holder could be charged (the GPU was
  read, its holders were not; or the counter's gap after an outage beyond the interval that
  ended it), "-" where there is none (the counter was not read either). Its dollars are the ledger's
  (priced once, by accounting, at `pricing.energy_per_kwh`), summed over the hours that had a
  price. Energy no counter measured (a GPU without one) is unknown, not 0: a line none of whose
  energy was measured shows "-" (empty, null) for both, a line partly measured the measured part.
  CSV and JSON always carry `energy_kwh` and `energy_dollars` (empty / null where
  nothing was priced); the table shows ENERGY KWH where energy was recorded and ENERGY $ where
  it was priced.
- Labels are whatever users named their pods, jobs and models: a CSV cell of one that starts with
  `=`, `+`, `-`, `@`, a tab or a carriage return starts with a `'` (`csv_text`), so that a
  spreadsheet shows `=HYPERLINK(...)` as text instead of running it; JSON holds labels as they are.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agent.ledger.pending import HOUR_S, hour_start
from agent.ledger.read import LedgerInfo, UsageRow, read_ledger
from agent.model import WORKLOAD_LABELS, Workload
from agent.scrub import escape_control
from agent.units import iso_time, joules_to_kwh, parse_duration

# `account`: the Slurm account a job is billed to, kept in the ledger (it is no metric label).
GROUP_KEYS = ("node", "gpu", *WORKLOAD_LABELS, "account")
# Older names `--by` still accepts: `job` was the Slurm job's label before it became `hpc_job`.
GROUP_ALIASES = {"job": "hpc_job"}
DEFAULT_BY = ("namespace", "hpc_job")
FORMATS = ("table", "csv", "json")

IDLE_LABEL = "(idle)"
UNOBSERVED_LABEL = "(unobserved)"
TOTAL_LABEL = "TOTAL"
NONE_LABEL = "(none)"  # a workload with no value for a grouping key (a Slurm job has no namespace)


@dataclass(frozen=True, slots=True)
class ReportLine:
    key: tuple[str, ...]  # the values of the report's `by` keys; () for the idle, unobserved and total lines
    dollars: float
    charged_s: float  # its share of the GPUs' time: the lines' charged seconds add up to the window's
    busy_s: float
    joules: float | None = 0.0  # None where no energy counter measured any of it
    energy_dollars: float | None = None  # None where no hour of the line had an energy price
    waste_dollars: float | None = None  # paid for and not used; None where use is unknown
    observed: bool = True  # False for unobserved time: its use and waste are unknown
    left_by: Workload | None = None  # an idle line's: who left the GPUs idle (Workload(): nobody known)
    # When and on what it ran (report --runs): the first and the last hour it was charged in (the
    # ledger keeps hours), and the cost units (GPUs, MIG instances) it was charged for.
    first_hour: float | None = None
    last_hour: float | None = None
    gpus: int = 0
    unmeasured_s: float = 0.0  # the part of charged_s whose use nothing measured (UsageRow.unmeasured_s)

    @property
    def measured_s(self) -> float:
        """Charged seconds whose use was measured: what busy_s is a part of."""
        return measured_seconds(self.charged_s, self.unmeasured_s)

    @property
    def use_known(self) -> bool:
        """Whether any of its use was measured (or nothing was charged): else used is unknown."""
        return self.observed and (self.measured_s > 0 or self.charged_s <= 0)

    @property
    def energy_kwh(self) -> float | None:
        return None if self.joules is None else joules_to_kwh(self.joules)

    @property
    def gpu_hours_charged(self) -> float:
        return self.charged_s / HOUR_S

    @property
    def gpu_hours_used(self) -> float:
        return self.busy_s / HOUR_S

    @property
    def efficiency(self) -> float | None:
        """Used over the charged time whose use was measured (0-1; all of it, unless some unit had
        no busy figure); None where nothing was charged, nobody observed it or nothing measured it."""
        measured = self.measured_s
        return self.busy_s / measured if measured > 0 and self.observed else None


def measured_seconds(charged_s: float, unmeasured_s: float) -> float:
    """The charged seconds whose use was measured; 0 where what is left is rounding (a part in a
    billion: both are sums of the same shares where nothing was measured)."""
    measured = charged_s - unmeasured_s
    return measured if measured > charged_s * 1e-9 else 0.0


def _unobserved_line() -> ReportLine:
    return ReportLine((), 0.0, 0.0, 0.0, observed=False)


@dataclass(frozen=True, slots=True)
class Report:
    by: tuple[str, ...]
    lines: tuple[ReportLine, ...]  # dollars descending
    idle: ReportLine
    total: ReportLine  # lines + idle + unobserved
    since: float | None = None  # start of the first hour covered; None: nothing recorded
    until: float | None = None  # end of the last hour covered
    ledgers: int = 1  # how many ledger files were merged
    unobserved: ReportLine = field(default_factory=_unobserved_line)
    # The idle line by who left the GPUs idle, dollars descending: they add up to `idle`.
    idle_by: tuple[ReportLine, ...] = ()
    store: str | None = None  # where the figures come from when not ledgers ("Prometheus API at URL")
    runs: bool = False  # show each line's start, end and GPUs (report --runs)
    # The hours the ledgers hold within [since, until): the start of the first, the end of the
    # last (None: none, and for a store's report). A window reaching before a ledger began or
    # past its last flush spans more hours than there are figures for (`recorded_note`).
    recorded_since: float | None = None
    recorded_until: float | None = None


# A run is a Slurm job or a pod: `--runs` shows when each ran and on how many GPUs.
RUN_KEYS = ("hpc_job", "pod")


def parse_by(text: str) -> tuple[str, ...]:
    """The grouping keys from a comma-separated list such as "namespace,pod"."""
    return check_by([part.strip() for part in text.split(",") if part.strip()])


# Keys that name a thing only within another: a pod's name is unique only in its namespace, a
# GPU's index only on its node. Grouping by one groups by both (the scope is added just before
# it, unless asked for already), so that train-0 of two namespaces, or GPU 0 of every node, are
# never summed into one row.
SCOPED_BY = {"pod": "namespace", "gpu": "node"}


def check_by(by: Sequence[str]) -> tuple[str, ...]:
    """The grouping keys, aliases replaced by their names and each key's scope (`SCOPED_BY`) added
    where missing; ValueError for an unknown or repeated key."""
    keys = tuple(GROUP_ALIASES.get(key, key) for key in by)
    if not keys:
        raise ValueError(f"group by at least one of {', '.join(GROUP_KEYS)}")
    for key in keys:
        if key not in GROUP_KEYS:
            raise ValueError(f"cannot group by {key!r}: use any of {', '.join(GROUP_KEYS)}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"each grouping key once, got {','.join(keys)}")
    scoped: list[str] = []
    for key in keys:
        scope = SCOPED_BY.get(key)
        if scope is not None and scope not in keys:
            scoped.append(scope)
        scoped.append(key)
    return tuple(scoped)


def _key_value(row: UsageRow, key: str) -> str:
    if key == "node":
        return row.node
    if key == "gpu":
        return str(row.gpu)
    if key == "account":
        return row.account
    value: str = getattr(row.workload, key)
    return value


def build_report(
    rows: Iterable[UsageRow], by: Sequence[str], *, since: float | None = None, until: float | None = None
) -> Report:
    """Group workload rows by `by`; idle rows make the idle line, unobserved rows the unobserved
    line; every row counts in the total.

    `since` / `until` say what the report covers; where None, the first / last hour in `rows`.
    """
    keys = check_by(by)
    groups: dict[tuple[str, ...], _Sums] = {}
    idle = _Sums()
    idle_by: dict[Workload, _Sums] = {}
    unobserved = _Sums(observed=False)
    everything = _Sums()
    hours: set[int] = set()
    for row in rows:
        hours.add(row.hour)
        if row.unobserved:
            sums = unobserved
        elif row.idle:
            sums = idle
            idle_by.setdefault(row.left_by, _Sums()).add(row)
        else:
            sums = groups.setdefault(tuple(_key_value(row, key) for key in keys), _Sums())
        sums.add(row)
        everything.add(row)

    lines = sorted((sums.line(key) for key, sums in groups.items()), key=lambda ln: (-ln.dollars, ln.key))
    recorded_since = float(min(hours)) if hours else None
    recorded_until = float(max(hours) + HOUR_S) if hours else None
    since = recorded_since if since is None else since
    until = recorded_until if until is None else until
    left = sorted(
        (replace(sums.line(()), left_by=w) for w, sums in idle_by.items()),
        key=lambda ln: (-ln.dollars, ln.left_by == Workload(), ln.left_by),
    )
    return Report(
        keys,
        tuple(lines),
        idle.line(()),
        everything.line(()),
        since,
        until,
        unobserved=unobserved.line(()),
        idle_by=tuple(left),
        recorded_since=recorded_since,
        recorded_until=recorded_until,
    )


def row_waste(row: UsageRow) -> float | None:
    """What the row's dollars paid for and nobody used: dollars x (1 - used/charged); all of an
    idle row's dollars; None for unobserved time (what it was used for is unknown).

    Where part of the row's time had no busy figure (`unmeasured_s`), only the measured part's
    dollars count: dollars x measured/charged x (1 - used/measured); where none of it had one,
    its waste is unknown (None), never all of its dollars.

    Busy seconds above the charged ones (per-process readings that add up to more than the GPU
    can do) count as fully used, never as negative waste."""
    if row.unobserved:
        return None
    if not row.charged_s > 0:
        return row.dollars
    measured = measured_seconds(row.charged_s, row.unmeasured_s)
    if measured <= 0:
        return None
    used = min(row.busy_s / measured, 1.0)
    return row.dollars * (measured / row.charged_s) * (1.0 - used)


@dataclass(slots=True)
class _Sums:
    """The figures of one report line, kept whole so that each is summed once, exactly (fsum)."""

    dollars: list[float] = field(default_factory=list)
    charged_s: list[float] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    joules: list[float] = field(default_factory=list)
    energy_dollars: list[float] = field(default_factory=list)
    waste_dollars: list[float] = field(default_factory=list)
    unmeasured_s: list[float] = field(default_factory=list)
    unknown_waste: bool = False  # some row's waste is unknown (nothing measured its use)
    unmetered: bool = False  # some row's energy is unknown (no energy counter measured it)
    priced: bool = False
    observed: bool = True  # False: the unobserved line, whose use and waste are unknown
    hours: set[int] = field(default_factory=set)
    units: set[tuple[str, str]] = field(default_factory=set)  # (node, uuid) of each GPU or MIG instance

    def add(self, row: UsageRow) -> None:
        self.hours.add(row.hour)
        self.units.add((row.node, row.uuid))
        self.dollars.append(row.dollars)
        self.charged_s.append(row.charged_s)
        self.busy_s.append(row.busy_s)
        if row.joules is not None:
            self.joules.append(row.joules)
        else:
            self.unmetered = True
        self.unmeasured_s.append(row.unmeasured_s)
        waste = row_waste(row)
        if waste is not None:
            self.waste_dollars.append(waste)
        elif not row.unobserved:
            self.unknown_waste = True
        if row.energy_dollars is not None:
            self.energy_dollars.append(row.energy_dollars)
            self.priced = True

    def line(self, key: tuple[str, ...]) -> ReportLine:
        return ReportLine(
            key=key,
            dollars=math.fsum(self.dollars),
            charged_s=math.fsum(self.charged_s),
            busy_s=math.fsum(self.busy_s),
            joules=math.fsum(self.joules) if self.joules or not self.unmetered else None,
            energy_dollars=math.fsum(self.energy_dollars) if self.priced else None,
            # Unknown where nothing of the line measured its use; else what the measured part wasted.
            waste_dollars=math.fsum(self.waste_dollars)
            if self.observed and (self.waste_dollars or not self.unknown_waste)
            else None,
            observed=self.observed,
            unmeasured_s=math.fsum(self.unmeasured_s),
            first_hour=float(min(self.hours)) if self.hours else None,
            last_hour=float(max(self.hours)) if self.hours else None,
            gpus=len(self.units),
        )


def report_from_ledger(
    path: str | Path, *, by: Sequence[str], since: float | None = None, until: float | None = None
) -> Report:
    """`report_from_ledgers` of one file."""
    return report_from_ledgers([path], by=by, since=since, until=until)


def report_from_ledgers(
    paths: Sequence[str | Path],
    *,
    by: Sequence[str],
    since: float | None = None,
    until: float | None = None,
    runs: bool = False,
) -> Report:
    """Read the hours overlapping [since, until) from every ledger and build one report; with
    `runs`, each line says in which hours it ran and on how many GPUs (grouped by hpc_job or pod).

    LedgerError if a file is unreadable; ValueError for bad arguments and for two files that
    record the same node over overlapping periods (`check_overlaps`).
    """
    return report_and_rows(paths, by=by, since=since, until=until, runs=runs)[0]


def report_and_rows(
    paths: Sequence[str | Path],
    *,
    by: Sequence[str],
    since: float | None = None,
    until: float | None = None,
    runs: bool = False,
) -> tuple[Report, list[UsageRow]]:
    """`report_from_ledgers`, and the rows it was built from (the HTML page charts them hour by hour)."""
    keys = check_by(by)
    if runs and not set(RUN_KEYS) & set(keys):
        raise ValueError("--runs: a run is a Slurm job or a pod: group --by hpc_job or --by pod")
    if since is not None and until is not None and since >= until:
        raise ValueError(f"--since ({iso_time(since)}) must be before --until ({iso_time(until)})")
    if not paths:
        raise ValueError("no ledger to read")
    contents = [read_ledger(path, since=since, until=until) for path in paths]
    check_overlaps([c.info for c in contents])
    covered_since = None if since is None else float(hour_start(since))
    covered_until = None if until is None else float(-hour_start(-until))  # rounded up to the hour
    rows = [row for c in contents for row in c.rows]
    report = build_report(rows, keys, since=covered_since, until=covered_until)
    return replace(report, ledgers=len(contents), runs=runs), rows


def check_overlaps(infos: Sequence[LedgerInfo]) -> None:
    """ValueError (one line, naming both files) where two ledgers record one node over
    overlapping periods. Periods that only touch (one file ends when the next begins, as after a
    corrupt file was moved aside) are fine; so are ledgers that record nothing."""
    for i, a in enumerate(infos):
        for b in infos[i + 1 :]:
            if a.first_at is None or a.last_at is None or b.first_at is None or b.last_at is None:
                continue
            start, end = max(a.first_at, b.first_at), min(a.last_at, b.last_at)
            common = sorted(((a.nodes | {a.node}) & (b.nodes | {b.node})) - {""})
            if common and start < end:
                copies = " (copies of one ledger)" if a.ledger_id == b.ledger_id else ""
                raise ValueError(
                    f"{a.path} and {b.path} both record node {common[0]} from {iso_time(start)} to "
                    f"{iso_time(end)}{copies}: reading both would count that time twice"
                )


def ledger_files(targets: Sequence[str | Path]) -> list[Path]:
    """The files `targets` name: a file as given, a directory's *.db files (sorted by name). A
    file named twice (itself and through its directory) is read once. ValueError naming a target
    that does not exist or a directory with no ledger in it, or for an empty target."""
    files: list[Path] = []
    seen: set[Path] = set()
    for target in targets:
        if not str(target):
            # Path("") is ".": `--ledger "$LEDGER"` with LEDGER unset read the working directory's ledgers.
            raise ValueError("an empty path names no ledger file")
        path = Path(target)
        if path.is_dir():
            found = sorted(p for p in path.glob("*.db") if p.is_file())
            if not found:
                raise ValueError(f"no *.db ledger files in directory {path}")
        elif path.exists():
            found = [path]
        else:
            raise ValueError(f"no such ledger file {path}")
        for file in found:
            identity = file.resolve()
            if identity not in seen:
                seen.add(identity)
                files.append(file)
    return files


_RELATIVE = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d|w))+")


def parse_time(text: str, now: float) -> float:
    """Unix seconds from an ISO date or date-time (UTC unless it has an offset), "now", or a
    duration such as 7d, 36h, 90m meaning that long before `now`."""
    value = text.strip()
    if value == "now":
        return now
    if _RELATIVE.fullmatch(value):
        return _in_range(now - parse_duration(value), text)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"expected a time such as 2026-11-20, 2026-11-20T18:00 (UTC unless an offset is given), "
            f"or 7d / 36h / 90m for that long ago, got {text!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return _in_range(moment.timestamp(), text)


# Times a ledger can hold: from the epoch to well before datetime's year-9999 edge, where adding
# the hour a report rounds up to would overflow.
_LATEST_S = datetime(9000, 1, 1, tzinfo=UTC).timestamp()


def _in_range(t: float, text: str) -> float:
    if not 0 <= t < _LATEST_S:
        raise ValueError(f"time out of range (1970 to 8999), got {text!r}")
    return t


def render(report: Report, fmt: str = "table") -> str:
    if fmt == "table":
        return _render_table(report)
    if fmt == "csv":
        return _render_csv(report)
    if fmt == "json":
        return _render_json(report)
    raise ValueError(f"unknown report format {fmt!r}: use one of {', '.join(FORMATS)}")


# --- table: for people, finance among them ---

_NUMBER_HEADERS = ("DOLLARS", "GPU-HOURS CHARGED", "GPU-HOURS USED", "EFFICIENCY", "WASTE $")
_RUN_HEADERS = ("FIRST HOUR", "LAST HOUR", "GPUS")


def _run(line: ReportLine) -> list[str]:
    return [str(value) for value in _run_figures(line).values()]


_ENERGY_HEADERS = ("ENERGY KWH", "ENERGY $")


def _amount(value: float) -> str:
    # Half a cent either way of zero is zero, not "-0.00".
    return f"{0.0 if abs(value) < 0.005 else value:,.2f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _maybe(value: float | None) -> str:
    return "-" if value is None else _amount(value)


def _numbers(figures: dict[str, float | None], energy: tuple[bool, bool]) -> list[str]:
    """A line's figures (`shown_figures`), "-" where unknown; `energy` says whether the table shows
    (kWh, energy dollars)."""
    with_kwh, with_energy_dollars = energy
    return [
        _maybe(figures["dollars"]),
        _maybe(figures["gpu_hours_charged"]),
        _maybe(figures["gpu_hours_used"]),
        _percent(figures["efficiency_ratio"]),
        _maybe(figures["waste_dollars"]),
        *([_maybe(figures["energy_kwh"])] if with_kwh else []),
        *([_maybe(figures["energy_dollars"])] if with_energy_dollars else []),
    ]


def _span(report: Report) -> str:
    start = "..." if report.since is None else iso_time(report.since)
    end = "..." if report.until is None else iso_time(report.until)
    if report.store is not None:
        return f"{report.store}, {start} to {end}"
    merged = f" from {report.ledgers} ledgers" if report.ledgers > 1 else ""
    if report.since is None and report.until is None:
        return f"no ledger hours recorded{merged}"
    return f"ledger hours {start} to {end}{merged}"


def recorded_note(report: Report) -> str | None:
    """What part of the window the ledgers hold, where not all of it (None where they hold it all,
    and for a store's report): the figures are those hours', not the window's."""
    if report.store is not None or (report.recorded_since, report.recorded_until) == (report.since, report.until):
        return None
    held = "The ledgers hold" if report.ledgers > 1 else "The ledger holds"
    if report.recorded_since is None or report.recorded_until is None:
        return f"{held} none of these hours."
    since, until = iso_time(report.recorded_since), iso_time(report.recorded_until)
    return f"{held} only {since} to {until} of these hours: the figures cover those."


NOBODY_KNOWN = "nobody known"


def left_by_name(workload: Workload) -> str:
    """Who left GPUs idle, for people: "job 9001 (dave)", "serving/vllm-llama-0", "nobody known"."""
    if workload == Workload():
        return NOBODY_KNOWN
    name = workload.describe()
    return f"{name} ({workload.user})" if workload.hpc_job and workload.user else name


def _idle_lines(report: Report) -> list[tuple[str, ReportLine]]:
    """The table's idle rows: one `(idle)` row, or one per workload that left GPUs idle where
    any is known (they add up to the one row they replace)."""
    if not report.idle_by or [line.left_by for line in report.idle_by] == [Workload()]:
        return [(IDLE_LABEL, report.idle)]
    return [(f"{IDLE_LABEL} left by {left_by_name(line.left_by or Workload())}", line) for line in report.idle_by]


def _render_table(report: Report) -> str:
    key_count = len(report.by)
    # Energy columns only where there is something to show: GPUs without an energy counter record
    # none, and a node without pricing.energy_per_kwh prices none.
    energy = ((report.total.joules or 0.0) > 0, report.total.energy_dollars is not None)
    shown_energy = [name for name, shown in zip(_ENERGY_HEADERS, energy, strict=True) if shown]
    run_headers = list(_RUN_HEADERS) if report.runs else []
    header = [key.upper() for key in report.by] + run_headers + list(_NUMBER_HEADERS) + shown_energy
    idle_lines = _idle_lines(report)
    shown = shown_figures(report, [line for _, line in idle_lines])
    # Keys come from ledgers and stores, which may have been written anywhere: a node's name is
    # not escaped when recorded, as workload labels are. Escaped before the widths are taken.
    body = [
        [escape_control(value) or NONE_LABEL for value in line.key]
        + (_run(line) if report.runs else [])
        + _numbers(figures, energy)
        for line, figures in zip(report.lines, shown, strict=False)
    ]
    key_count += len(run_headers)  # the run's columns align left, like the keys
    idle = [
        [escape_control(label)] + [""] * (key_count - 1) + _numbers(figures, energy)
        for (label, _), figures in zip(idle_lines, shown[len(report.lines) :], strict=False)
    ]
    unobserved = [UNOBSERVED_LABEL] + [""] * (key_count - 1) + _numbers(shown[-1], energy)
    total = [TOTAL_LABEL] + [""] * (key_count - 1) + _numbers(_figures(report.total), energy)
    widths = [max(len(row[i]) for row in [header, *body, *idle, unobserved, total]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        cells = [
            cell.ljust(width) if i < key_count else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * width for width in widths)
    out = [
        escape_control(f"GPU cost by {', '.join(report.by)}; {_span(report)}"),
        "",
        fmt(header),
        rule,
        *(fmt(row) for row in body),
        *(fmt(row) for row in idle),
        fmt(unobserved),
        rule,
        fmt(total),
    ]
    note = recorded_note(report)
    if note is not None:
        out += ["", note]
    return "\n".join(out) + "\n"


# --- CSV and JSON: for programs; plain numbers at full precision ---

_NUMBER_FIELDS = (
    "dollars", "gpu_hours_charged", "gpu_hours_used", "efficiency_ratio", "waste_dollars", "energy_kwh",
    "energy_dollars",
)  # fmt: skip
_RUN_FIELDS = ("first_hour", "last_hour", "gpus")


def _run_figures(line: ReportLine) -> dict[str, str | int | None]:
    """A run's first and last hour (their starts, UTC) and its GPUs."""
    return {
        "first_hour": None if line.first_hour is None else iso_time(line.first_hour),
        "last_hour": None if line.last_hour is None else iso_time(line.last_hour),
        "gpus": line.gpus,
    }


def _figures(line: ReportLine, *, efficiency: bool = True) -> dict[str, float | None]:
    """The line's figures by field name, None where unknown (the table, CSV and JSON all show these)."""
    return {
        "dollars": line.dollars,
        "gpu_hours_charged": line.gpu_hours_charged,
        "gpu_hours_used": line.gpu_hours_used if line.use_known else None,
        "efficiency_ratio": line.efficiency if efficiency else None,
        "waste_dollars": line.waste_dollars,
        # Unobserved time's energy is known where the counter was read (its holders were not).
        "energy_kwh": line.energy_kwh if line.observed or (line.joules or 0.0) > 0 else None,
        "energy_dollars": line.energy_dollars,
    }


# The figures TOTAL sums: shown to the cent, the rows' add up to TOTAL's.
_SUMMED_FIELDS = ("dollars", "gpu_hours_charged", "gpu_hours_used", "waste_dollars", "energy_kwh", "energy_dollars")


def shown_figures(report: Report, idle: Sequence[ReportLine]) -> list[dict[str, float | None]]:
    """The figures of the lines a table shows above TOTAL (the report's lines, `idle`: its idle line
    or the lines by left_by, then the unobserved line), each summed figure in whole cents so that
    the column adds up to TOTAL's to the cent (`cents_adding_up`): each rounded alone, five rows
    can miss TOTAL by two cents. TOTAL stays the exact sum, rounded; CSV and JSON carry every
    figure unrounded."""
    shown = [
        *(_figures(line) for line in report.lines),
        # Nobody held the idle GPUs, so there is no used/charged to speak of.
        *(_figures(line, efficiency=False) for line in idle),
        _figures(report.unobserved),
    ]
    whole = _figures(report.total)
    for name in _SUMMED_FIELDS:
        wanted = whole[name]
        known = [figures for figures in shown if figures[name] is not None]
        if wanted is None or not known:
            continue
        for figures, cents in zip(known, cents_adding_up([f[name] or 0.0 for f in known], wanted), strict=True):
            figures[name] = cents
    return shown


def cents_adding_up(parts: Sequence[float], total: float) -> list[float]:
    """`parts` in whole cents that add up to `total` in whole cents (largest remainder): shown
    side by side as a sum, each rounded alone can miss the total by a cent ($17.654 + $2.934 =
    $20.588 reads $17.65 + $2.93 = $20.59)."""
    cents = [p * 100 for p in parts]
    kept = [math.floor(c) for c in cents]
    short = round(total * 100) - sum(kept)
    by_remainder = sorted(range(len(parts)), key=lambda i: cents[i] - kept[i], reverse=True)
    for i in by_remainder[: max(0, min(short, len(parts)))]:
        kept[i] += 1
    return [k / 100 for k in kept]


# A spreadsheet (Excel, LibreOffice, Google Sheets) runs a cell that starts with one of these as a
# formula, quoted or not: a `--model =HYPERLINK(...)` or a self-reported SLURM_JOB_ID, which any
# user on a node writes, would be a live formula in the copy of a report finance opens.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_text(value: str) -> str:
    """A text cell for CSV: `value`, with a `'` before it where a spreadsheet would take it for a
    formula (OWASP's advice for CSV injection). Numbers are not text cells: never prefixed."""
    return f"'{value}" if value.startswith(_FORMULA_STARTS) else value


def _render_csv(report: Report) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    run_fields = list(_RUN_FIELDS) if report.runs else []
    writer.writerow(["kind", *report.by, *run_fields, *_NUMBER_FIELDS, "left_by"])

    def numbers(line: ReportLine, *, efficiency: bool = True) -> list[str]:
        # repr: the shortest text that reads back as the same float; no thousands separators.
        return ["" if v is None else repr(v) for v in _figures(line, efficiency=efficiency).values()]

    blank = [""] * (len(report.by) + len(run_fields))
    for line in report.lines:
        run = [str(v) if v is not None else "" for v in _run_figures(line).values()] if report.runs else []
        writer.writerow(["group", *map(csv_text, line.key), *run, *numbers(line), ""])
    # One idle row per workload that left GPUs idle ({} where nobody is known), adding up to the
    # idle total; a report with no breakdown has its one idle row.
    for idle in report.idle_by or (report.idle,):
        left_by = "" if idle.left_by is None else json.dumps(_set_labels(idle.left_by), sort_keys=True)
        writer.writerow(["idle", *blank, *numbers(idle, efficiency=False), left_by])
    writer.writerow(["unobserved", *blank, *numbers(report.unobserved), ""])
    writer.writerow(["total", *blank, *numbers(report.total), ""])
    return out.getvalue()


def _set_labels(workload: Workload) -> dict[str, str]:
    """The workload's labels that have a value."""
    return {name: value for name, value in workload.label_dict().items() if value}


def _render_json(report: Report) -> str:
    document: dict[str, Any] = {
        "since": None if report.since is None else iso_time(report.since),
        "until": None if report.until is None else iso_time(report.until),
        # The hours of the window the ledgers hold (null: none; and from a store)
        "recorded_since": None if report.recorded_since is None else iso_time(report.recorded_since),
        "recorded_until": None if report.recorded_until is None else iso_time(report.recorded_until),
        "by": list(report.by),
        "rows": [
            dict(zip(report.by, line.key, strict=True)) | (_run_figures(line) if report.runs else {}) | _figures(line)
            for line in report.lines
        ],
        "idle": _figures(report.idle, efficiency=False)
        | {
            "left_by": [
                {"workload": (line.left_by or Workload()).label_dict()} | _figures(line, efficiency=False)
                for line in report.idle_by
            ]
        },
        "unobserved": _figures(report.unobserved),
        "total": _figures(report.total),
    }
    return json.dumps(document, indent=2) + "\n"
