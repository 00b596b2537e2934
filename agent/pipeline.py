"""The poll loop: sampler -> snapshot, swapped in atomically for the HTTP side to render.

The daemon runs `poll_once` on an APScheduler interval job (one instance at a time, missed runs
coalesced); `simulate` calls it in a loop while it moves the fake clock. Either way a scrape
only reads `state`, a single reference to frozen data.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Protocol

from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED, JobExecutionEvent
from apscheduler.schedulers.background import BackgroundScheduler

from agent.accounting.cost import account, accumulate
from agent.attribution.gather import Attributor
from agent.devices.backend import DriverLibraryMissing
from agent.devices.sampler import Sampler
from agent.model import AgentHealth, AgentState, Attribution, Charges, CostTotals, LedgerHealth, Price, Snapshot
from agent.units import format_duration
from rules.engine import Flag, GpuObservation, RuleSpec, RuleState, Transition, evaluate

log = logging.getLogger(__name__)

HEALTHY_WITHIN_POLLS = 3


class ChargeSink(Protocol):
    """Where each interval's charges go besides the counters: the ledger."""

    def add(self, charges: Charges) -> None: ...

    def flush(self) -> bool: ...

    def health(self) -> LedgerHealth: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Costing:
    """How the pipeline prices GPU time: a price per GPU, the longest interval it will charge
    (longer ones are unobserved time), how long finished workloads keep their series, an
    optional energy price, and where charges are written."""

    prices: Callable[[Snapshot], Mapping[str, Price | None]]
    max_interval_s: float = 300.0
    forget_after_s: float = 3600.0
    energy_per_kwh: float | None = None
    sink: ChargeSink | None = None
    flush_interval_s: float = 60.0


class Pipeline:
    def __init__(
        self,
        sampler: Sampler,
        poll_interval_s: float,
        monotonic: Callable[[], float] = time.monotonic,
        attributor: Attributor | None = None,
        kubelet_interval_s: float = 10.0,
        costing: Costing | None = None,
        rules: Sequence[RuleSpec] = (),
    ) -> None:
        self.sampler = sampler
        self.attributor = attributor
        self.costing = costing
        self._previous: Snapshot | None = None
        self._totals = CostTotals()
        self._prices: dict[str, Price | None] = {}
        self.rules = tuple(rules)
        self._rule_states: Mapping[tuple[str, str], RuleState] = {}
        self._flags: tuple[Flag, ...] = ()
        self.kubelet_interval_s = kubelet_interval_s
        self.poll_interval_s = poll_interval_s
        self._monotonic = monotonic
        self._state = AgentState()
        self._last_success_monotonic: float | None = None
        self._overran = 0
        self._failed = 0
        self._polls = 0
        self._scheduler: BackgroundScheduler | None = None
        self._overrun_lock = threading.Lock()

    @property
    def state(self) -> AgentState:
        return self._state

    def healthy(self) -> bool:
        """True while a poll has succeeded within the last HEALTHY_WITHIN_POLLS intervals."""
        last = self._last_success_monotonic
        return last is not None and self._monotonic() - last <= HEALTHY_WITHIN_POLLS * self.poll_interval_s

    def poll_once(self) -> AgentState:
        """Poll, attribute, and swap the result in. The poll's duration covers both."""
        started = self._monotonic()
        snapshot: Snapshot | None = None
        try:
            snapshot = self.sampler.poll()
        except DriverLibraryMissing:
            raise
        except Exception:
            # A bug in one poll must not stop the daemon: count it, keep the last good snapshot.
            log.exception("poll failed")
        attribution = self._attribute(snapshot) if snapshot is not None else None
        duration = self._monotonic() - started
        self._polls += 1
        previous = self._state
        if snapshot is None or not snapshot.driver_up:
            self._failed += 1
        if duration > self.poll_interval_s:
            with self._overrun_lock:
                self._overran += 1
            log.warning(
                "poll took %.3fs, longer than the %.3fs interval", duration, self.poll_interval_s,
                extra={"duration_s": duration},
            )  # fmt: skip
        last_success_at = previous.health.last_success_at
        if snapshot is not None and snapshot.driver_up:
            last_success_at = snapshot.taken_at
            self._last_success_monotonic = self._monotonic()
        health = AgentHealth(
            polls_total=self._polls,
            polls_failed=self._failed,
            polls_overran=self._overran,
            last_success_at=last_success_at,
            nvml_errors=tuple((call, error, n) for (call, error), n in sorted(self.sampler.errors.items())),
        )
        if snapshot is not None and attribution is not None:
            interval_s = snapshot.taken_at - self._previous.taken_at if self._previous is not None else 0.0
            charges = self._charge(snapshot, attribution)
            self._judge(snapshot, attribution, charges, interval_s)
            snapshot = Snapshot(snapshot.taken_at, snapshot.node, snapshot.devices, duration, snapshot.driver_up)
            new_state = self._with_costs(AgentState(snapshot=snapshot, attribution=attribution, health=health))
        else:
            new_state = self._with_costs(
                AgentState(snapshot=previous.snapshot, attribution=previous.attribution, health=health)
            )
        self._state = new_state  # one reference assignment: scrapes see old or new, never half
        return new_state

    def _charge(self, snapshot: Snapshot, attribution: Attribution) -> Charges | None:
        previous, self._previous = self._previous, snapshot
        costing = self.costing
        if costing is None:
            return None
        if any(g.uuid not in self._prices for g in snapshot.gpus):
            self._prices.update(costing.prices(snapshot))
        if previous is None:
            return None
        try:
            charges = account(
                previous,
                snapshot,
                attribution,
                self._prices,
                max_interval_s=costing.max_interval_s,
                energy_per_kwh=costing.energy_per_kwh,
            )
        except Exception:
            log.exception("accounting failed for the interval ending %.0f", snapshot.taken_at)
            return None
        self._totals = accumulate(self._totals, charges, forget_after_s=costing.forget_after_s)
        if costing.sink is not None:
            costing.sink.add(charges)
        return charges

    def _judge(self, snapshot: Snapshot, attribution: Attribution, charges: Charges | None, interval_s: float) -> None:
        if not self.rules:
            return
        cost = {g.uuid: g for g in charges.gpus} if charges is not None else {}
        observations = []
        for gpu in snapshot.gpus:
            units = {gpu.uuid} | {m.uuid for m in snapshot.mig_devices(gpu.uuid)}
            holders = tuple(sorted({h.workload for h in attribution.holdings if h.device_uuid in units}))
            charge = cost.get(gpu.uuid)
            observations.append(
                GpuObservation(
                    gpu=gpu.index,
                    uuid=gpu.uuid,
                    model=gpu.model,
                    node=snapshot.node.hostname,
                    up=gpu.up,
                    utilization=gpu.utilization,
                    memory_used_bytes=gpu.memory_used_bytes,
                    holders=holders,
                    interval_s=interval_s,
                    dollars=charge.dollars if charge is not None else 0.0,
                    idle_dollars=charge.idle_dollars if charge is not None else 0.0,
                )
            )
        result = evaluate(self._rule_states, observations, self.rules, snapshot.taken_at)
        self._rule_states = result.states
        self._flags = result.flags
        for t in result.transitions:
            _log_transition(t)

    def _with_costs(self, state: AgentState) -> AgentState:
        costing = self.costing
        if costing is None:
            return replace(state, flags=self._flags)
        return replace(
            state,
            flags=self._flags,
            costs=self._totals,
            prices=tuple(sorted(self._prices.items())),
            ledger=costing.sink.health() if costing.sink is not None else None,
        )

    def flush_ledger(self) -> None:
        if self.costing is not None and self.costing.sink is not None:
            self.costing.sink.flush()

    def _attribute(self, snapshot: Snapshot) -> Attribution:
        if self.attributor is None:
            return Attribution()
        try:
            return self.attributor.attribute(snapshot)
        except Exception:
            # Readings without owners beat no readings: keep the poll, lose its attribution.
            log.exception("attribution failed")
            return Attribution()

    def refresh_allocations(self) -> None:
        """Ask the kubelet for its GPU allocations (the daemon does this on its own schedule)."""
        if self.attributor is not None and self.attributor.kubelet is not None:
            self.attributor.kubelet.refresh()

    def start(self) -> None:
        scheduler = BackgroundScheduler(daemon=True)
        scheduler.add_listener(self._on_missed, EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES)
        scheduler.add_job(
            self._scheduled_poll,
            "interval",
            seconds=self.poll_interval_s,
            max_instances=1,
            coalesce=True,
            misfire_grace_time=max(1, int(self.poll_interval_s)),
            id="poll",
            next_run_time=datetime.now(UTC),
        )
        if self.attributor is not None and self.attributor.kubelet is not None:
            scheduler.add_job(
                self.refresh_allocations,
                "interval",
                seconds=self.kubelet_interval_s,
                max_instances=1,
                coalesce=True,
                id="kubelet",
                next_run_time=datetime.now(UTC),
            )
        if self.costing is not None and self.costing.sink is not None:
            scheduler.add_job(
                self.flush_ledger,
                "interval",
                seconds=self.costing.flush_interval_s,
                max_instances=1,
                coalesce=True,
                id="ledger",
            )
        scheduler.start()
        self._scheduler = scheduler

    def _scheduled_poll(self) -> None:
        try:
            self.poll_once()
        except DriverLibraryMissing as exc:
            log.error("%s", exc)

    def _on_missed(self, event: JobExecutionEvent) -> None:
        # A run skipped because the previous poll was still going: that poll overran.
        with self._overrun_lock:
            self._overran += 1
        log.warning("a poll was skipped: the previous one is still running")

    def stop(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
            self._scheduler = None


def _log_transition(t: Transition) -> None:
    """One structured line per flag change: GPU, rule, workload, how long, what it cost so far."""
    workloads = ", ".join(w.describe() for w in t.holders) or "(nobody)"
    log.warning(
        "flag %s: rule=%s gpu=%d uuid=%s workload=%s for=%s cost_so_far=$%.2f",
        "raised" if t.raised else "cleared",
        t.rule,
        t.gpu,
        t.uuid,
        workloads,
        format_duration(t.held_s),
        t.dollars,
        extra={
            "event": "flag_raised" if t.raised else "flag_cleared",
            "rule": t.rule,
            "gpu": t.gpu,
            "uuid": t.uuid,
            "workload": workloads,
            "held_s": t.held_s,
            "cost_dollars": t.dollars,
        },
    )
