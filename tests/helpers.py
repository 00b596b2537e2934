"""A fake node with the agent wired to it, as the CLI wires them, for tests that need both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import generate_latest

import fake_nvml
from agent.attribution.gather import Attributor, KubeletWatcher
from agent.attribution.resolve import compile_rules, rule_env_keys
from agent.attribution.sources.procfs import Passwd, ProcFS
from agent.devices.nvml import NvmlBackend
from agent.devices.sampler import Sampler
from agent.model import AgentState
from agent.pipeline import Costing, Pipeline
from exporters.prometheus import make_registry
from rules.engine import RuleSpec


class Rig:
    """A fake node with its host files, and the agent's pipeline wired to them."""

    def __init__(
        self,
        scenario: Any,
        rules: Any = (),
        per_pid: bool = False,
        kubelet_timeout_s: float = 1.0,
        costing: Costing | None = None,
        flag_rules: Sequence[RuleSpec] = (),
    ) -> None:
        self.node = fake_nvml.install(scenario)
        host = self.node.host
        compiled = compile_rules(list(rules))
        allow = {"SLURM_JOB_ID", "SLURM_JOB_USER", "SLURM_JOB_ACCOUNT"} | rule_env_keys(compiled)
        self.kubelet = KubeletWatcher(str(host.podresources_socket), timeout_s=kubelet_timeout_s)
        self.attributor = Attributor(
            ProcFS(host.proc_root, env_allowlist=allow),
            Passwd(host.passwd_file),
            rules=compiled,
            slurm_map_dir=host.slurm_map_dir,
            pod_logs_dir=host.pod_logs_dir,
            kubelet=self.kubelet,
            per_pid=per_pid,
        )
        self.sampler = Sampler(NvmlBackend(clock=self.node.clock.wall_time), hostname="rig")
        self.sampler.start()
        # Poll durations pinned to 0: stable output for golden files.
        self.pipeline = Pipeline(
            self.sampler, 5.0, monotonic=lambda: 0.0, attributor=self.attributor, costing=costing, rules=flag_rules
        )
        self.per_pid = per_pid

    def poll(self, advance_s: float = 0.0) -> AgentState:
        if advance_s:
            self.node.clock.advance(advance_s)
        self.pipeline.refresh_allocations()
        return self.pipeline.poll_once()

    def metrics(self, state: AgentState) -> str:
        return generate_latest(make_registry(lambda: state, self.per_pid)).decode()

    def close(self) -> None:
        self.kubelet.close()
        fake_nvml.uninstall()

    def run(self, duration_s: float, step_s: float) -> AgentState:
        """Polls every step_s over duration_s of scenario time (one poll at the start too)."""
        state = self.poll()
        elapsed = 0.0
        while elapsed + step_s <= duration_s + 1e-9:
            elapsed += step_s
            state = self.poll(step_s)
        return state
