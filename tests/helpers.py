"""A fake node with the agent built on it by `build_agent`, as every command builds it."""

from __future__ import annotations

import functools
import importlib
import os
import stat
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from agent.attribution.sources.kubelet import KubeletSource
from agent.attribution.sources.procfs import ProcessSource
from agent.cli.wiring import Agent, build_agent
from agent.config import AttributionConfig, AttributionRule, Settings
from agent.model import AgentState
from agent.pipeline import Costing
from rules.engine import RuleSpec

Sample = tuple[str, dict[str, str], float]  # name, labels, value

# For a module whose tests spend their time waiting on real time (deadlines, sleeps, daemons
# on a sped-up fake clock) more than computing. Such modules share one xdist worker (pyproject's
# --dist loadgroup hands a group to one worker, and groups before lone tests), which waits
# beside workers that keep the two CPUs busy; in file order they came up together, and all
# three workers waited at once.
WAITS_ON_REAL_TIME = pytest.mark.xdist_group("waits")


class Rig:
    """A fake node with its host files, and the agent built on it.

    With `settings`, the agent is exactly what the CLI builds from them: prices, the flag rules
    they enable, a ledger at `ledger_path`. Without, the settings are the defaults plus
    `rules` (attribution rules), `per_pid` and `kubelet_timeout_s`, and the agent prices with
    `costing` (no accounting when None) and flags with `flag_rules` (none by default).
    Stage durations are pinned to 0: stable output for golden files. With `metrics_text` False
    the agent skips the readings only metrics text shows, as `simulate` does without it.
    """

    def __init__(
        self,
        scenario: Any,
        rules: Any = (),
        per_pid: bool = False,
        kubelet_timeout_s: float = 1.0,
        costing: Costing | None = None,
        flag_rules: Sequence[RuleSpec] = (),
        *,
        settings: Settings | None = None,
        ledger_path: str | Path | None = None,
        metrics_text: bool = True,
    ) -> None:
        if settings is None:
            attribution = AttributionConfig(
                rules=[AttributionRule(match=match, set=values) for match, values in rules],
                per_pid_series=per_pid,
                kubelet_timeout=kubelet_timeout_s,
            )
            self.agent: Agent = build_agent(
                Settings(node_name="rig", attribution=attribution),
                fake=scenario,
                monotonic=lambda: 0.0,
                costing=costing if costing is not None else False,
                rules=flag_rules,
                ledger_path=ledger_path,
                metrics_text=metrics_text,
            )
        else:
            self.agent = build_agent(
                settings, fake=scenario, monotonic=lambda: 0.0, ledger_path=ledger_path, metrics_text=metrics_text
            )
        assert self.agent.node is not None
        self.node = self.agent.node
        self.pipeline = self.agent.pipeline
        self.attributor = self.agent.attributor
        self.sampler = self.agent.sampler
        self.kubelet = self.attributor.source(KubeletSource)
        self.processes = self.attributor.source(ProcessSource)

    def poll(self, advance_s: float = 0.0) -> AgentState:
        if advance_s:
            self.node.clock.advance(advance_s)
        self.pipeline.refresh_allocations()
        return self.pipeline.poll_once()

    def metrics(self, state: AgentState) -> str:
        return self.agent.exposition(state).decode()

    def samples(self, state: AgentState, names: Collection[str]) -> list[Sample]:
        """The samples named `names` that a scrape of `state` would show, read from the
        registry (no exposition text written and parsed)."""
        registry = self.agent.registry(lambda: state, only=names)
        return [(s.name, s.labels, s.value) for m in registry.collect() for s in m.samples if s.name in names]

    def close(self) -> None:
        """Flush the ledger, if any, and uninstall the fake node."""
        self.agent.close()

    def run(self, duration_s: float, step_s: float) -> AgentState:
        """Polls every step_s over duration_s of scenario time (one poll at the start too)."""
        state = self.poll()
        elapsed = 0.0
        while elapsed + step_s <= duration_s + 1e-9:
            elapsed += step_s
            state = self.poll(step_s)
        return state


# What the weekend alert test feeds promtool: the series the shipped rules read, once a minute.
WEEKEND_ALERT_SERIES = (
    "gpuledger_gpu_flag",
    "gpuledger_gpu_up",
    "gpuledger_gpu_idle_cost_dollars_total",
    "gpuledger_gpu_idle_left_by_timestamp_seconds",
    "gpuledger_gpu_idle_left_by_cost_dollars_total",
)


@dataclass
class WeekendIdleRun:
    """Four days of the `weekend-idle` node (Friday 18:00 to Tuesday 18:00), polled every minute
    of the first day and every 5 minutes after by the agent as the default settings build it,
    with a ledger, as `simulate` runs it: without the readings only metrics text shows, which no
    flag, cost or ledger row reads (test_cli's
    `test_simulate_reads_what_only_metrics_text_shows_only_for_metrics_text`), at half the cost."""

    step_s: float
    ledger_path: Path
    # (scenario time, GPU index, raised) each time an `idle` flag changed
    idle_transitions: list[tuple[float, int, bool]]
    # per poll of the first day (t = 0, 60, ... 86400): the samples of `first_day_series`
    first_day: list[list[Sample]]
    last: AgentState


def run_weekend_idle(ledger_path: Path, first_day_series: Sequence[str]) -> WeekendIdleRun:
    """The run the weekend tests share; samples are read from the registry, not from text."""
    step_s = 60.0
    rig = Rig("weekend-idle", settings=Settings(), ledger_path=ledger_path, metrics_text=False)
    wanted = set(first_day_series)
    transitions: list[tuple[float, int, bool]] = []
    first_day: list[list[Sample]] = []
    raised: dict[int, bool] = {}
    try:
        state = rig.poll()
        while True:
            now = rig.node.clock.now()
            for flag in state.flags:
                if flag.rule == "idle":
                    if raised.get(flag.gpu, False) != flag.raised:
                        transitions.append((now, flag.gpu, flag.raised))
                    raised[flag.gpu] = flag.raised
            if now <= 86400:
                first_day.append(rig.samples(state, wanted))
            if now >= 4 * 86400:
                break
            # Every minute on the first day (the alert test's series), then every 5 minutes:
            # each transition the weekend test checks (Friday 22:00, Monday 09:00) is on a poll.
            state = rig.poll(step_s if now < 86400 else 300.0)
    finally:
        rig.close()  # flushes the ledger
    return WeekendIdleRun(step_s, ledger_path, transitions, first_day, state)


@functools.cache
def operator_models() -> ModuleType:
    """prometheus-operator's v1 CRD models (cloudcoil), imported on first use: building their
    four thousand pydantic models takes seconds, which every xdist worker would otherwise pay
    at collection whether or not it runs a test that validates a manifest."""
    return importlib.import_module("cloudcoil.models.prometheus_operator.v1")


def hang_file_syncs(monkeypatch: pytest.MonkeyPatch, module: Any = os) -> threading.Event:
    """A filesystem that stops answering (a hung NFS mount): `module.fsync` of a regular file waits
    until the returned gate is set (10 s at most), then syncs. A directory's fsync is not held."""
    gate = threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            gate.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(module, "fsync", fsync)
    return gate
