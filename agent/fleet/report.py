"""`gpuledger report --prometheus URL`: the ledger's report, for every node a Prometheus-compatible
store holds, from the counters the agents export.

Each counter the ledger has a column for is read as its exact growth over the window
(agent/fleet/source.py), and each series becomes the row the ledger would have held for it
(`UsageRow`), so the grouping, the idle and unobserved rows, the totals and the rendering are
the ledger report's own (agent/ledger/report.py): one row model, one renderer.

    ledger column                      counter
    workload dollars, charged, busy,   gpuledger_workload_cost_dollars_total, _gpu_charged_seconds_total,
      held, joules, energy dollars,      _gpu_busy_seconds_total, _gpu_seconds_total,
      unmeasured                         _energy_joules_total, _energy_cost_dollars_total,
                                         _gpu_unmeasured_seconds_total (0 where an agent from before
                                         it does not export it: its time counted as measured)
    idle seconds, dollars, joules,     gpuledger_gpu_idle_seconds_total, _idle_cost_dollars_total,
      energy dollars                     _idle_energy_joules_total, _idle_energy_cost_dollars_total
    unobserved seconds, dollars        gpuledger_gpu_unobserved_seconds_total, _unobserved_cost_dollars_total
    idle by last holder (left_by)      gpuledger_gpu_idle_left_by_seconds_total, _idle_left_by_cost_dollars_total
                                         (agents that export them; the idle row is whole without)

The node of a row is the value of `node_label` (`instance` by default: the shipped scrape
configurations set it to the node's name). Workload labels a target label pushed aside are read
from their `exported_` names. Every series counts once: a store holding each sample twice (two
Prometheus replicas without deduplication) doubles the figures, as it would any sum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from agent.fleet import DEFAULT_NODE_LABEL
from agent.fleet.promapi import EmptyStore, LabelSet, PrometheusAPI
from agent.fleet.source import (
    DEFAULT_LOOKBACK_S,
    Window,
    agent_restarts,
    counter_growth,
    has_series,
    unscraped_nodes,
)
from agent.ledger.pending import hour_start
from agent.ledger.read import UsageRow
from agent.ledger.report import Report, build_report, check_by
from agent.model import WORKLOAD_LABELS, Workload
from agent.units import iso_time, scaled

QUERY_WORKERS = 4  # counters asked for at once: enough to overlap round trips, few for the store

WORKLOAD_COUNTERS = {
    "dollars": "gpuledger_workload_cost_dollars_total",
    "charged_s": "gpuledger_workload_gpu_charged_seconds_total",
    "busy_s": "gpuledger_workload_gpu_busy_seconds_total",
    "held_s": "gpuledger_workload_gpu_seconds_total",
    "joules": "gpuledger_workload_energy_joules_total",
    "energy_dollars": "gpuledger_workload_energy_cost_dollars_total",
    "unmeasured_s": "gpuledger_workload_gpu_unmeasured_seconds_total",
}
IDLE_COUNTERS = {
    "seconds": "gpuledger_gpu_idle_seconds_total",
    "dollars": "gpuledger_gpu_idle_cost_dollars_total",
    "joules": "gpuledger_gpu_idle_energy_joules_total",
    "energy_dollars": "gpuledger_gpu_idle_energy_cost_dollars_total",
}
UNOBSERVED_COUNTERS = {
    "seconds": "gpuledger_gpu_unobserved_seconds_total",
    "dollars": "gpuledger_gpu_unobserved_cost_dollars_total",
}
LEFT_BY_COUNTERS = {
    "seconds": "gpuledger_gpu_idle_left_by_seconds_total",
    "dollars": "gpuledger_gpu_idle_left_by_cost_dollars_total",
}
# Every GPU an agent prices has this series: the store holds gpuledger's data where it has one.
PROBE_COUNTER = "gpuledger_gpu_cost_dollars_total"
ALL_COUNTERS = (
    *WORKLOAD_COUNTERS.values(),
    *IDLE_COUNTERS.values(),
    *UNOBSERVED_COUNTERS.values(),
    *LEFT_BY_COUNTERS.values(),
)

_WORKLOAD_NAMES = frozenset(WORKLOAD_LABELS) | {f"exported_{name}" for name in WORKLOAD_LABELS}
# Ties tiny differences of float sums to zero: an idle row's left_by lines add up to its seconds
# and dollars (both counters are read from the same scrapes), to rounding.
_RESIDUE = 1e-9


@dataclass(frozen=True, slots=True)
class StoreQuery:
    """What to read: the window and the label that names a series' node."""

    since: float
    until: float
    node_label: str = DEFAULT_NODE_LABEL
    lookback_s: float = DEFAULT_LOOKBACK_S


Growth = dict[LabelSet, float]


def report_from_prometheus(api: PrometheusAPI, query: StoreQuery, *, by: Sequence[str]) -> Report:
    """The report of every node `api` holds over [since, until]. EmptyStore where the store has no
    gpuledger series in the window; the store's own errors as agent.fleet.promapi raises them."""
    keys = check_by(by)
    if not query.until > query.since:
        raise ValueError(f"--since ({iso_time(query.since)}) must be before --until ({iso_time(query.until)})")
    window = Window(query.since, query.until, query.lookback_s)
    # One small question first: a store that cannot answer, or holds nothing, says so once.
    if not has_series(api, PROBE_COUNTER, window):
        raise EmptyStore(
            f"{api.shown_url}: no gpuledger series from {iso_time(window.since)} to {iso_time(window.until)} "
            "(is it scraping the agents, or remote-writing their samples? is the window right?)"
        )
    growth = read_counters(api, window, query.node_label)
    rows = usage_rows(growth, query.node_label, hour=hour_start(window.since))
    report = build_report(rows, keys, since=window.since, until=window.until)
    # A store's figures are each counter's growth over the whole window: no hours of their own.
    return replace(report, store=f"Prometheus API at {api.shown_url}", recorded_since=None, recorded_until=None)


def read_counters(api: PrometheusAPI, window: Window, node_label: str) -> dict[str, Growth]:
    """Counter name -> series -> growth over the window, every counter asked for at once."""
    gaps = unscraped_nodes(api, window, node_label=node_label)
    restarts = agent_restarts(api, window, node_label=node_label, gaps=gaps)

    def one(metric: str) -> Growth:
        return counter_growth(api, metric, window, node_label=node_label, restarts=restarts, gaps=gaps)

    pool = ThreadPoolExecutor(max_workers=QUERY_WORKERS, thread_name_prefix="gpuledger-query")
    try:
        answers = list(pool.map(one, ALL_COUNTERS))
    finally:
        pool.shutdown(cancel_futures=True)  # after an error, ask nothing more
    return dict(zip(ALL_COUNTERS, answers, strict=True))


def usage_rows(growth: Mapping[str, Growth], node_label: str, *, hour: int) -> list[UsageRow]:
    """The rows the ledger would hold for the window (`hour`: where it starts), one per series
    that grew in it: a workload whose series is still exported after it ended (for
    accounting.forget_after) was charged nothing, and the ledger has no row for it."""
    return [row for row in _rows(growth, node_label, hour) if _grew(row)]


def _grew(row: UsageRow) -> bool:
    return any((row.held_s, row.charged_s, row.busy_s, row.dollars, row.joules, row.energy_dollars))


def _rows(growth: Mapping[str, Growth], node_label: str, hour: int) -> list[UsageRow]:
    owners = _Owners(node_label, _target_labels(growth, node_label))
    rows = _workload_rows(growth, owners, hour)
    rows += _idle_rows(growth, owners, hour)
    unobserved_s, unobserved_dollars = (growth[UNOBSERVED_COUNTERS[k]] for k in ("seconds", "dollars"))
    for labels in sorted(unobserved_s.keys() | unobserved_dollars.keys()):
        seconds = unobserved_s.get(labels, 0.0)
        rows.append(
            _row(
                labels,
                node_label,
                hour,
                held_s=seconds,
                charged_s=seconds,
                dollars=unobserved_dollars.get(labels, 0.0),
                unobserved=True,
            )
        )
    return rows


def _workload_rows(growth: Mapping[str, Growth], owners: _Owners, hour: int) -> list[UsageRow]:
    figures = {field: growth[metric] for field, metric in WORKLOAD_COUNTERS.items()}
    every = set().union(*(series.keys() for series in figures.values()))
    return [
        _row(
            labels,
            owners.node_label,
            hour,
            workload=owners.workload(labels),
            dollars=figures["dollars"].get(labels, 0.0),
            charged_s=figures["charged_s"].get(labels, 0.0),
            busy_s=figures["busy_s"].get(labels, 0.0),
            held_s=figures["held_s"].get(labels, 0.0),
            joules=figures["joules"].get(labels),  # no series: no counter measured it
            energy_dollars=figures["energy_dollars"].get(labels),
            unmeasured_s=figures["unmeasured_s"].get(labels, 0.0),
        )
        for labels in sorted(every)
    ]


def _idle_rows(growth: Mapping[str, Growth], owners: _Owners, hour: int) -> list[UsageRow]:
    """The idle rows of each GPU series: one per last holder where the agent exports who left the
    GPU idle, else one (left by nobody known). The counters by last holder have no energy: the
    GPU's idle energy is split among them by idle seconds (an idle GPU draws its idle power,
    whoever left it so); what they leave of the idle seconds and dollars (rounding; time an
    older agent did not attribute) is the nobody-known row's."""
    idle = {field: growth[metric] for field, metric in IDLE_COUNTERS.items()}
    left_s, left_dollars = (growth[LEFT_BY_COUNTERS[k]] for k in ("seconds", "dollars"))
    left_by: dict[LabelSet, list[LabelSet]] = {}
    for labels in left_s.keys() | left_dollars.keys():
        left_by.setdefault(owners.gpu(labels), []).append(labels)
    rows = []
    for labels in sorted(set().union(*(series.keys() for series in idle.values())) | left_by.keys()):
        seconds, dollars = idle["seconds"].get(labels, 0.0), idle["dollars"].get(labels, 0.0)
        joules, energy_dollars = idle["joules"].get(labels), idle["energy_dollars"].get(labels)
        holders = [
            (holder, left_s.get(holder, 0.0), left_dollars.get(holder, 0.0))
            for holder in sorted(left_by.get(labels, ()))
        ]
        if not holders:
            rows.append(
                _row(labels, owners.node_label, hour, held_s=seconds, charged_s=seconds, dollars=dollars, idle=True,
                     joules=joules, energy_dollars=energy_dollars)
            )  # fmt: skip
            continue
        rest_s, rest_dollars = seconds, dollars
        for holder, held, paid in holders:
            held_j, held_energy = _energy_share(held, seconds, joules, energy_dollars)
            rows.append(
                _row(holder, owners.node_label, hour, held_s=held, charged_s=held, dollars=paid, idle=True,
                     joules=held_j, energy_dollars=held_energy, left_by=owners.workload(holder))
            )  # fmt: skip
            rest_s, rest_dollars = rest_s - held, rest_dollars - paid
        rest_s, rest_dollars = _tidy(rest_s, seconds), _tidy(rest_dollars, dollars)
        if rest_s or rest_dollars:
            rest_j, rest_energy = _energy_share(rest_s, seconds, joules, energy_dollars)
            rows.append(
                _row(labels, owners.node_label, hour, held_s=rest_s, charged_s=rest_s, dollars=rest_dollars, idle=True,
                     joules=rest_j, energy_dollars=rest_energy)
            )  # fmt: skip
    return rows


def _energy_share(
    part_s: float, whole_s: float, joules: float | None, dollars: float | None
) -> tuple[float | None, float | None]:
    """The idle energy (joules, dollars) of `part_s` of a GPU's `whole_s` idle seconds (None where
    no counter measured it)."""
    share = part_s / whole_s if whole_s > 0 else 0.0
    return scaled(joules, share), scaled(dollars, share)


def _row(
    labels: LabelSet,
    node_label: str,
    hour: int,
    *,
    workload: Workload | None = None,
    held_s: float = 0.0,
    busy_s: float = 0.0,
    charged_s: float = 0.0,
    dollars: float = 0.0,
    joules: float | None = 0.0,
    energy_dollars: float | None = None,
    idle: bool = False,
    unobserved: bool = False,
    left_by: Workload | None = None,  # an idle row's last holder; None: nobody known
    unmeasured_s: float = 0.0,
) -> UsageRow:
    values = dict(labels)
    return UsageRow(
        hour=hour,
        node=values.get(node_label, ""),
        gpu=_index(values.get("gpu", "")),
        uuid=values.get("uuid", ""),
        workload=workload or Workload(),
        held_s=held_s,
        busy_s=busy_s,
        dollars=dollars,
        joules=joules,
        energy_dollars=energy_dollars,
        idle=idle,
        charged_s=charged_s,
        unobserved=unobserved,
        left_by=left_by or Workload(),
        unmeasured_s=unmeasured_s,
    )


def _target_labels(growth: Mapping[str, Growth], node_label: str) -> dict[str, frozenset[str]]:
    """Node -> the workload label names its GPUs' own series (idle, unobserved) carry. The agent
    puts no workload label on those, so these are target labels the scrape added (a pod's
    `namespace`, `pod`, ...): on the node's workload series they pushed the workload's own
    aside to exported_<name>, or stand where the workload had none (an empty label is none)."""
    found: dict[str, set[str]] = {}
    for metric in (*IDLE_COUNTERS.values(), *UNOBSERVED_COUNTERS.values()):
        for labels in growth[metric]:
            values = dict(labels)
            found.setdefault(values.get(node_label, ""), set()).update(set(values) & set(WORKLOAD_LABELS))
    return {node: frozenset(names) for node, names in found.items()}


@dataclass(frozen=True, slots=True)
class _Owners:
    """Reads a series' workload, and its GPU's own labels, past the target labels of its node."""

    node_label: str
    targets: Mapping[str, frozenset[str]]  # _target_labels

    def _shadowed(self, labels: LabelSet) -> frozenset[str]:
        return self.targets.get(dict(labels).get(self.node_label, ""), frozenset())

    def workload(self, labels: LabelSet) -> Workload:
        """The workload a series names; a label Prometheus renamed exported_<name> (a target label
        of the same name won) is read under that name, and a target label is never the workload's."""
        values, shadowed = dict(labels), self._shadowed(labels)
        return Workload(
            **{
                name: values.get(f"exported_{name}", "" if name in shadowed else values.get(name, ""))
                for name in WORKLOAD_LABELS
            }
        )

    def gpu(self, labels: LabelSet) -> LabelSet:
        """A workload series' labels without the workload's: its GPU's own series' labels."""
        shadowed = self._shadowed(labels)
        return tuple((name, value) for name, value in labels if name in shadowed or name not in _WORKLOAD_NAMES)


def _index(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return -1


def _tidy(rest: float, whole: float) -> float:
    """What the last holders leave of an idle figure: 0 where that is rounding of `whole`."""
    return 0.0 if abs(rest) <= _RESIDUE * max(1.0, abs(whole)) else rest
