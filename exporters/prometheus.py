"""The Prometheus collector: every scrape renders the latest `AgentState`, nothing else.

No NVML call, /proc read or disk write happens here; a GPU or process that is gone from the
snapshot is gone from the next scrape, with no series to clean up.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from agent import __version__
from agent.model import UNOBSERVED_NO_POLL, Activity, AgentState, DeviceReading
from exporters.catalogue import BY_NAME, Kind
from exporters.dcgm import DcgmCollector
from exporters.health import health_series

StateSource = Callable[[], AgentState]


class _Families:
    """Families keyed by catalogue name, created on first use so absent readings emit nothing;
    with `only`, just the families of those catalogue names."""

    def __init__(self, per_pid: bool = False, only: Collection[str] | None = None) -> None:
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        self._per_pid = per_pid
        self._only = None if only is None else frozenset(only)

    def add(self, name: str, labels: Sequence[str], value: float) -> None:
        family = self._families.get(name)
        if family is None:
            if self._only is not None and name not in self._only:
                return
            spec = BY_NAME[name]
            cls = CounterMetricFamily if spec.kind is Kind.COUNTER else GaugeMetricFamily
            names = [*spec.labels, *(spec.optional_labels if self._per_pid else ())]
            family = cls(spec.family_name, spec.help, labels=names, unit="")
            self._families[name] = family
        family.add_metric(list(labels), value)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


class GpuledgerCollector(Collector):
    def __init__(self, state: StateSource, per_pid: bool = False, only: Collection[str] | None = None) -> None:
        self._state = state
        self._per_pid = per_pid
        self._only = only

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        out = _Families(self._per_pid, self._only)
        snapshot = state.snapshot
        driver = ""
        cuda = ""
        if snapshot is not None:
            driver = snapshot.node.driver_version
            cuda = "" if snapshot.node.cuda_driver_version is None else str(snapshot.node.cuda_driver_version)
            process_counts: dict[str, int | None] = {}
            for device in snapshot.devices:
                owner = device.parent_uuid or device.uuid
                known = process_counts.get(owner, 0)
                # A list that could not be read is unknown, not empty: no count at all then.
                process_counts[owner] = (
                    None if known is None or not device.processes_known else known + len(device.processes)
                )
            for device in snapshot.devices:
                if device.parent_uuid is None:
                    _gpu_series(out, device, driver, process_counts.get(device.uuid, 0))
                else:
                    _mig_series(out, device)
            _workload_series(out, state, self._per_pid)
            out.add("gpuledger_poll_duration_seconds", (), snapshot.poll_duration_s)
            out.add("gpuledger_nvml_up", (), 1.0 if snapshot.driver_up else 0.0)
            out.add("gpuledger_undiscovered_gpus", (), float(sum(not d.discovered for d in snapshot.gpus)))
        _cost_series(out, state)
        _flag_series(out, state)
        _event_series(out, state)
        if state.attribution.kubelet_up is not None:
            out.add("gpuledger_kubelet_up", (), 1.0 if state.attribution.kubelet_up else 0.0)
            out.add("gpuledger_kubelet_unmatched_devices", (), float(len(state.attribution.unmatched_devices)))
        health = state.health
        if health.last_success_at is not None:
            out.add("gpuledger_last_poll_timestamp_seconds", (), health.last_success_at)
        out.add("gpuledger_polls_total", (), health.polls_total)
        out.add("gpuledger_poll_failures_total", (), health.polls_failed)
        out.add("gpuledger_poll_overruns_total", (), health.polls_overran)
        for stage in health.stages:
            out.add("gpuledger_stage_duration_seconds", (stage.stage,), stage.duration_s)
            out.add("gpuledger_stage_failures_total", (stage.stage,), stage.failures)
            if stage.last_success_at is not None:
                out.add("gpuledger_stage_last_success_timestamp_seconds", (stage.stage,), stage.last_success_at)
        for call, error, count in health.nvml_errors:
            out.add("gpuledger_nvml_errors_total", (call, error), count)
        for action, result, count in state.actions:
            out.add("gpuledger_actions_total", (action, result), count)
        out.add("gpuledger_build_info", (__version__, driver, cuda), 1.0)
        yield from out


def _gpu_series(out: _Families, d: DeviceReading, driver_version: str, processes: int | None) -> None:
    ids = (str(d.index), d.uuid)
    out.add("gpuledger_gpu_info", (*ids, d.name, d.pci_bus_id, driver_version), 1.0)
    out.add("gpuledger_gpu_up", ids, 1.0 if d.up else 0.0)
    if not d.up:
        out.add("gpuledger_gpu_down_reason", (*ids, d.down_reason or "unknown"), 1.0)
        return
    optional = (
        ("gpuledger_gpu_utilization_ratio", d.utilization),
        ("gpuledger_gpu_memory_used_bytes", d.memory_used_bytes),
        ("gpuledger_gpu_memory_total_bytes", d.memory_total_bytes),
        ("gpuledger_gpu_temperature_celsius", d.temperature_c),
        ("gpuledger_gpu_power_watts", d.power_w),
        ("gpuledger_gpu_power_limit_watts", d.power_limit_w),
        ("gpuledger_gpu_energy_joules_total", d.energy_j),
    )
    for name, value in optional:
        if value is not None:
            out.add(name, ids, float(value))
    for link in d.nvlinks:
        out.add("gpuledger_gpu_nvlink_up", (*ids, str(link.link)), 1.0 if link.up else 0.0)
    _activity_series(out, "gpuledger_gpu", ids, d.activity)
    if d.busy_source:
        out.add("gpuledger_gpu_busy_source_info", (*ids, d.busy_source), 1.0)
    if processes is not None:
        out.add("gpuledger_gpu_processes", ids, float(processes))
    if d.telemetry is not None:
        health_series(out, ids, d.telemetry)


def _mig_series(out: _Families, d: DeviceReading) -> None:
    parent_uuid = d.parent_uuid or ""
    ids = (str(d.index), parent_uuid, str(d.mig_index))
    gi = "" if d.gpu_instance_id is None else str(d.gpu_instance_id)
    out.add("gpuledger_mig_info", (*ids, d.uuid, gi, d.mig_profile), 1.0)
    if d.memory_used_bytes is not None:
        out.add("gpuledger_mig_memory_used_bytes", ids, float(d.memory_used_bytes))
    if d.memory_total_bytes is not None:
        out.add("gpuledger_mig_memory_total_bytes", ids, float(d.memory_total_bytes))
    _activity_series(out, "gpuledger_mig", ids, d.activity)
    if d.busy_source:
        # A MIG instance is a cost unit of its own: named by its uuid, as its flags and holders are.
        out.add("gpuledger_gpu_busy_source_info", (str(d.index), d.uuid, d.busy_source), 1.0)


def _activity_series(out: _Families, prefix: str, ids: tuple[str, ...], activity: Activity | None) -> None:
    if activity is None:
        return
    for suffix, value in (
        ("sm_active_ratio", activity.sm_active),
        ("sm_occupancy_ratio", activity.sm_occupancy),
        ("tensor_active_ratio", activity.tensor_active),
        ("dram_active_ratio", activity.dram_active),
    ):
        if value is not None:
            out.add(f"{prefix}_{suffix}", ids, value)


def _workload_series(out: _Families, state: AgentState, per_pid: bool) -> None:
    snapshot = state.snapshot
    assert snapshot is not None
    devices = {d.uuid: d for d in snapshot.devices}
    for holding in state.attribution.holdings:
        device = devices.get(holding.device_uuid)
        if device is None:
            continue
        labels: tuple[str, ...] = (str(device.index), device.uuid, *holding.workload.labels())
        if per_pid:
            labels = (*labels, "" if holding.pid is None else str(holding.pid))
        if holding.sm_util is not None:
            out.add("gpuledger_workload_gpu_utilization_ratio", labels, holding.sm_util)
        if holding.memory_bytes is not None:
            out.add("gpuledger_workload_gpu_memory_used_bytes", labels, float(holding.memory_bytes))
        out.add("gpuledger_workload_gpu_processes", labels, float(len(holding.pids)))
        out.add("gpuledger_workload_gpu_allocated", labels, 1.0 if holding.allocated else 0.0)
        if holding.self_reported:
            out.add("gpuledger_workload_gpu_self_reported", labels, 1.0)
    unresolved = dict(state.attribution.unresolved)
    for device in snapshot.gpus:
        if device.up:
            count = unresolved.get(device.uuid, 0) + sum(
                unresolved.get(m.uuid, 0) for m in snapshot.mig_devices(device.uuid)
            )
            out.add("gpuledger_gpu_unresolved_processes", (str(device.index), device.uuid), float(count))


def _event_series(out: _Families, state: AgentState) -> None:
    if state.events is None:
        return
    for gpu in state.events.gpus:
        ids = (str(gpu.gpu), gpu.uuid)
        out.add("gpuledger_gpu_events_up", ids, 1.0 if gpu.watched else 0.0)
        by_kind: dict[str, int] = {}
        for kind, value, count in gpu.counts:
            by_kind[kind] = by_kind.get(kind, 0) + count
            if kind == "xid":
                out.add("gpuledger_gpu_xid_errors_total", (*ids, str(value)), float(count))
        for kind, count in sorted(by_kind.items()):
            out.add("gpuledger_gpu_events_total", (*ids, kind), float(count))
        if gpu.last_xid_at is not None:
            out.add("gpuledger_gpu_last_xid_timestamp_seconds", ids, gpu.last_xid_at)


def _flag_series(out: _Families, state: AgentState) -> None:
    for flag in state.flags:
        ids = (str(flag.gpu), flag.uuid, flag.rule)
        out.add("gpuledger_gpu_flag", ids, 1.0 if flag.raised else 0.0)
        out.add("gpuledger_gpu_flag_seconds", ids, flag.held_s)
        if flag.raised:
            for workload in flag.holders:
                out.add("gpuledger_workload_flag", (str(flag.gpu), flag.uuid, *workload.labels(), flag.rule), 1.0)
    for left in state.left_by:
        for workload in left.workloads:
            labels = (str(left.gpu), left.uuid, *workload.labels())
            out.add("gpuledger_gpu_idle_left_by_timestamp_seconds", labels, left.at)


def _cost_series(out: _Families, state: AgentState) -> None:
    # Energy dollars come priced from accounting (None where no price per kWh is set), so
    # /metrics shows the very figures the ledger and `report` sum.
    for (gpu, uuid, workload), w in state.costs.workloads.items():
        labels = (str(gpu), uuid, *workload.labels())
        out.add("gpuledger_workload_gpu_seconds_total", labels, w.held_s)
        out.add("gpuledger_workload_gpu_busy_seconds_total", labels, w.busy_s)
        out.add("gpuledger_workload_gpu_charged_seconds_total", labels, w.charged_s)
        out.add("gpuledger_workload_gpu_unmeasured_seconds_total", labels, w.unmeasured_s)
        out.add("gpuledger_workload_cost_dollars_total", labels, w.dollars)
        # No series where no energy counter measured any of it: unknown, not 0 J.
        if w.joules is not None:
            out.add("gpuledger_workload_energy_joules_total", labels, w.joules)
        if w.energy_dollars is not None:
            out.add("gpuledger_workload_energy_cost_dollars_total", labels, w.energy_dollars)
    for (gpu, uuid), g in state.costs.gpus.items():
        ids = (str(gpu), uuid)
        out.add("gpuledger_gpu_cost_dollars_total", ids, g.dollars)
        out.add("gpuledger_gpu_idle_cost_dollars_total", ids, g.idle_dollars)
        out.add("gpuledger_gpu_idle_seconds_total", ids, g.idle_s)
        out.add("gpuledger_gpu_observed_seconds_total", ids, g.observed_s)
        # Idle energy too, so that a report read from Prometheus has the ledger's idle row whole.
        if g.idle_joules is not None:
            out.add("gpuledger_gpu_idle_energy_joules_total", ids, g.idle_joules)
        if g.idle_energy_dollars is not None:
            out.add("gpuledger_gpu_idle_energy_cost_dollars_total", ids, g.idle_energy_dollars)
        if g.busy_s is not None:
            out.add("gpuledger_gpu_busy_seconds_total", ids, g.busy_s)
        for left_by, idle in sorted(g.idle_by_left.items()):
            labels = (*ids, *left_by.labels())
            out.add("gpuledger_gpu_idle_left_by_seconds_total", labels, idle.idle_s)
            out.add("gpuledger_gpu_idle_left_by_cost_dollars_total", labels, idle.idle_dollars)
        # no_poll is there from the start at 0, so that cost + idle + unobserved sums in PromQL
        # have a series to add; the other reasons appear with their first second.
        reasons = {UNOBSERVED_NO_POLL: (0.0, 0.0), **g.unobserved_by_reason}
        for reason, (seconds, dollars) in sorted(reasons.items()):
            out.add("gpuledger_gpu_unobserved_seconds_total", (*ids, reason), seconds)
            out.add("gpuledger_gpu_unobserved_cost_dollars_total", (*ids, reason), dollars)
        if g.energy_dollars is not None:
            out.add("gpuledger_gpu_energy_cost_dollars_total", ids, g.energy_dollars)
    if state.snapshot is not None:
        index = {d.uuid: d.index for d in state.snapshot.gpus}
        for uuid, price in state.prices:
            if price is not None and uuid in index:
                out.add("gpuledger_gpu_price_dollars_per_hour", (str(index[uuid]), uuid), price.dollars_per_hour)
                out.add("gpuledger_gpu_price_info", (str(index[uuid]), uuid, price.origin, price.purchase), 1.0)
                out.add("gpuledger_gpu_price_mismatch", (str(index[uuid]), uuid), 1.0 if price.mismatch else 0.0)
    if state.ledger is not None:
        out.add("gpuledger_ledger_up", (), 1.0 if state.ledger.healthy else 0.0)
        out.add("gpuledger_ledger_pending_rows", (), float(state.ledger.pending_rows))
        out.add("gpuledger_ledger_dropped_rows_total", (), float(state.ledger.dropped_rows))
        out.add("gpuledger_ledger_dropped_dollars_total", (), state.ledger.dropped_dollars)
        out.add("gpuledger_ledger_corrupt_files_total", (), float(state.ledger.corrupt_files))
        if state.ledger.last_flush_at is not None:
            out.add("gpuledger_ledger_last_flush_timestamp_seconds", (), state.ledger.last_flush_at)


def make_registry(
    state: StateSource, per_pid: bool = False, dcgm_compat: bool = False, only: Collection[str] | None = None
) -> CollectorRegistry:
    """A registry holding only gpuledger's collector (no process/platform defaults), and with
    `dcgm_compat` also dcgm-exporter's series rendered from the same state (exporters/dcgm.py).
    `only` (catalogue names) keeps just those of gpuledger's families (dcgm-exporter's are not
    filtered): a reader that wants a few series every simulated minute skips building the
    thousand others."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuledgerCollector(state, per_pid, only))
    if dcgm_compat:
        registry.register(DcgmCollector(state))
    return registry
