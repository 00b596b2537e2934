"""The one place the agent is assembled from settings: backend, sampler, attribution, costing,
rules. Every command, test and benchmark builds the agent through here."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from agent.accounting.instance import detect_instance_type
from agent.accounting.pricing import load_catalogue, resolve_price
from agent.attribution.gather import Attributor, KubeletWatcher
from agent.attribution.resolve import compile_rules, rule_env_keys
from agent.attribution.sources.procfs import Passwd, ProcFS
from agent.config import Settings
from agent.devices import create_backend
from agent.devices.backend import DeviceBackend
from agent.model import Price, Snapshot
from agent.pipeline import Costing
from rules.engine import RuleSpec

log = logging.getLogger("gpuledger")


def rule_specs(settings: Settings) -> list[RuleSpec]:
    """The rule engine's specs from the config: the four defaults (unless disabled) and custom ones."""
    r = settings.rules
    configured: list[tuple[str, str, Any]] = [
        ("idle", "idle", r.idle),
        ("allocated_idle", "allocated_idle", r.allocated_idle),
        ("underused", "underused", r.underused),
        ("stranded_memory", "stranded_memory", r.stranded_memory),
    ]
    configured += [(c.name, c.condition, c) for c in r.custom]
    return [
        RuleSpec(
            name,
            condition,
            c.utilization_below,
            c.for_,
            window_s=getattr(c, "window", 0.0),
            memory_above_bytes=getattr(c, "memory_above", 0),
            models=tuple(c.models),
            nodes=tuple(c.nodes),
        )
        for name, condition, c in configured
        if c.enabled
    ]


def make_attributor(settings: Settings, node: Any) -> Attributor:
    """Attribution reading the host's files, or the fake node's when running on one."""
    a = settings.attribution
    rules = compile_rules([(rule.match, rule.set) for rule in a.rules])
    allowlist = set(a.env_allowlist) | rule_env_keys(rules)
    if node is not None:
        host = node.host
        proc_root, passwd, slurm_dir, pod_logs, socket_path = (
            host.proc_root, host.passwd_file, host.slurm_map_dir, host.pod_logs_dir, str(host.podresources_socket)
        )  # fmt: skip
    else:
        proc_root, passwd, slurm_dir, pod_logs, socket_path = (
            settings.proc_root, a.passwd_file, a.slurm_map_dir, a.pod_logs_dir, a.podresources_socket
        )  # fmt: skip
    return Attributor(
        ProcFS(proc_root, env_allowlist=allowlist),
        Passwd(passwd),
        rules=rules,
        slurm_map_dir=slurm_dir,
        pod_logs_dir=pod_logs,
        kubelet=KubeletWatcher(socket_path, timeout_s=a.kubelet_timeout),
        per_pid=a.per_pid_series,
    )


def make_costing(settings: Settings, node: Any, ledger_path: str | None, clock: Callable[[], float]) -> Costing:
    """Prices per GPU (config, instance type, catalogue), the charge limits, and the ledger."""
    from agent.ledger.sink import LedgerSink

    catalogue = load_catalogue()
    pricing = settings.pricing
    instance_type = node.scenario.node.instance_type if node is not None else detect_instance_type()

    def prices(snapshot: Snapshot) -> dict[str, Price | None]:
        gpus = snapshot.gpus
        found = {
            g.uuid: resolve_price(
                model=g.model,
                uuid=g.uuid,
                gpu_count=len(gpus),
                instance_type=instance_type,
                pricing=pricing,
                catalogue=catalogue,
            )
            for g in gpus
            if g.name
        }
        for g in gpus:
            if g.name and found.get(g.uuid) is None:
                log.warning("no price for GPU %d (%s): set pricing.by_model or pricing.gpu_hourly", g.index, g.model)
        return found

    sink = LedgerSink(ledger_path, retention_s=settings.ledger.retention, clock=clock) if ledger_path else None
    return Costing(
        prices=prices,
        max_interval_s=settings.accounting.max_interval,
        forget_after_s=settings.accounting.forget_after,
        energy_per_kwh=pricing.energy_per_kwh,
        sink=sink,
        flush_interval_s=settings.ledger.flush_interval,
    )


def node_name(settings: Settings, node: Any) -> str | None:
    """node_name from the config, else the fake node's hostname, else (None) the host's."""
    if settings.node_name:
        return settings.node_name
    return str(node.scenario.node.hostname) if node is not None else None


def make_backend(fake: str | None, speed: float, backend: str = "nvml") -> tuple[DeviceBackend, Any]:
    """The device backend named `backend`, and the fake node when running on one (a fake node
    stands in for NVML's library, so it is always read through the nvml backend)."""
    if fake is None:
        return create_backend(backend, time.time), None
    import fake_nvml

    node = fake_nvml.install(fake, speed=speed)
    return create_backend("nvml", node.clock.wall_time), node
