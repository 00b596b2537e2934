"""The poll: named stages in a fixed order, each timed and counted, the result swapped in
atomically for the HTTP side to render.

    sample -> attribute -> account -> rules -> publish

  sample     the sampler reads every GPU into a `Snapshot`; it is handed on as `Sampled`, the
             snapshot with the one before it, so the interval both accounting and the rules
             measure is fixed here, once
  attribute  processes and allocations -> the workloads holding each device (`Attribution`)
  account    the interval priced and split between the holders (`Charges`), added to the
             running totals and handed to the ledger
  rules      the flag rules judge each GPU (`Flag`s, and a log line per flag that changes)
  publish    everything above as one frozen `AgentState`, swapped in by a single assignment

A stage that raises is logged and counted (`gpuledger_stage_failures_total{stage}`), and the
poll goes on with that stage's last good result: a failed attribution keeps the previous
attribution, a failed accounting charges nothing for its interval, failed rules keep the
previous flags, a failed publish leaves the previous state in place. Each stage's latest
duration and last success are exported too (`StageHealth`).

The agent's periodic work (polls, the attribution sources' refreshers such as the kubelet's,
ledger flushes) is described once, by `Pipeline.jobs()`: the daemon hands the jobs to
APScheduler (`start`), `simulate` runs the same jobs on scenario time (`run_on_scenario_time`).
Either way a scrape only reads `state`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol, TypeVar

from agent.accounting.cost import (
    LastEnergy,
    account,
    accumulate,
    cost_units,
    downtime,
    split_at_price_changes,
    spread_gap_energy,
)
from agent.accounting.unpriced import Unplaced, Unpriced
from agent.accounting.usage import unit_usage
from agent.attribution.gather import Attributor
from agent.deadline import CallTimeout, Worker
from agent.devices.backend import DriverLibraryMissing
from agent.devices.events import EventReader
from agent.devices.sampler import Sampler
from agent.errors import GpuledgerError
from agent.model import (
    UNOBSERVED_AGENT_DOWN,
    UNOBSERVED_UNREADABLE,
    AgentHealth,
    AgentState,
    Attribution,
    Charges,
    CostTotals,
    DeviceReading,
    Flag,
    LedgerHealth,
    LeftBy,
    Price,
    Snapshot,
    StageHealth,
    Workload,
)
from agent.scrub import CACHED_TEXT_MAX_CHARS, bound_label
from agent.units import format_duration, iso_time
from rules.engine import GpuObservation, RuleSpec, RuleState, Transition, evaluate

if TYPE_CHECKING:  # imported where `run` starts the scheduler: simulate, snapshot and report never do
    from apscheduler.events import JobExecutionEvent

    from agent.schedule import Schedule

log = logging.getLogger(__name__)
T = TypeVar("T")

HEALTHY_WITHIN_POLLS = 3
HEALTHY_WITHIN_MIN_S = 1.0  # a sped-up fake node polls every few ms: one slow poll is not sickness
# Distinct workloads whose scrubbed labels are remembered (a few hundred on a busy node).
CLEAN_WORKLOADS_KEPT = 4096
# A poll waits on the driver for this many intervals at most; a stuck call past EXIT_AFTER
# (at least a minute, or 12 intervals) makes the daemon exit so systemd or the kubelet restarts it.
CALL_TIMEOUT_POLLS = 3
EXIT_AFTER_MIN_S = 60.0
# Downtime between runs, or an interval between two polls, longer than this is not booked: a
# ledger copied from another machine or a clock that jumped (an agent started before NTP set
# the clock, in 1970 or 2000), more likely than an agent stopped or a node asleep over a year.
MAX_DOWNTIME_S = 366 * 86400.0
STOP_WAIT_S = 2.0  # how long stop() waits for a poll in progress
IDLE_RULES = frozenset({"idle"})  # flags whose log lines name who left the GPU idle (and any rule of that condition)
TIMEOUT = "TIMEOUT"  # the down reason of a GPU whose call is stuck (NVML's own name for it)
EVENTS_KEY = "events"  # DriverHung's key for the driver-event reader's thread
STAGES = ("sample", "attribute", "account", "rules", "publish")


class DriverHung(GpuledgerError):
    """A driver call has been stuck past the hard deadline: the agent cannot recover in-process."""

    def __init__(self, keys: Sequence[str], stuck_s: float) -> None:
        where = ", ".join(f"GPU {k}" if k else "the driver" for k in keys if k != EVENTS_KEY)
        if EVENTS_KEY in keys:
            where = ", ".join(filter(None, (where, "the driver-event reader")))
        super().__init__(f"a GPU driver call has not returned for {stuck_s:.0f}s ({where})")
        self.keys = tuple(keys)
        self.stuck_s = stuck_s


class ChargeSink(Protocol):
    """Where each interval's charges go besides the counters: the ledger."""

    def add(self, charges: Charges) -> None: ...

    def flush(self) -> bool: ...

    def health(self) -> LedgerHealth: ...

    def close(self, within_s: float | None = None) -> bool:
        """Flush and close, waiting at most `within_s` on the file; False when some charges could
        not be written (the sink logs them)."""
        ...

    @property
    def recorded_until(self) -> float | None:
        """Where the sink's record ended before this run (None: it records nothing yet)."""
        ...


class ActionHook(Protocol):
    """What acts on each poll's published state (agent.actions.Actions): it decides on the poll
    thread, runs elsewhere, and reports its counts for the next state published."""

    def observe(self, state: AgentState) -> None: ...

    def counts(self) -> tuple[tuple[str, str, int], ...]: ...


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


@dataclass(frozen=True, slots=True)
class Sampled:
    """The sample stage's output: this poll's snapshot, and the snapshot before it that the
    interval runs from (None at the first poll)."""

    snapshot: Snapshot
    previous: Snapshot | None

    @property
    def interval_s(self) -> float:
        return self.snapshot.taken_at - self.previous.taken_at if self.previous is not None else 0.0


@dataclass(frozen=True)
class PeriodicJob:
    """Work the agent repeats on its own schedule, every `interval_s` seconds (of the backend's
    clock in `simulate`, of real time in the daemon). `at_start`: also run once at the start.
    Runs that fall due while one is still going, or between two steps of a simulation, are
    coalesced into one."""

    name: str
    interval_s: float
    run: Callable[[], object]
    at_start: bool = True
    # How late a run may start and still count (the daemon only): a poll due so long ago that
    # the next one is nearly due is skipped, and counted as an overrun.
    misfire_grace_s: int | None = None
    # `simulate` only: where --for is not a whole number of steps, its last, shorter step ends
    # with a run of this job whether due or not (the poll), so the run covers all of --for.
    at_end: bool = False


class _Stage:
    """One stage's running record (mutated by the poll thread only)."""

    __slots__ = ("duration_s", "failures", "last_success_at", "name", "started", "succeeded")

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = 0.0  # monotonic
        self.duration_s = 0.0
        self.failures = 0
        self.last_success_at: float | None = None
        self.succeeded = False  # in the poll now running

    def health(self) -> StageHealth:
        return StageHealth(self.name, self.duration_s, self.failures, self.last_success_at)


class Pipeline:
    def __init__(
        self,
        sampler: Sampler,
        poll_interval_s: float,
        monotonic: Callable[[], float] = time.monotonic,
        attributor: Attributor | None = None,
        costing: Costing | None = None,
        rules: Sequence[RuleSpec] = (),
        call_timeout_s: float | None = None,
        exit_after_s: float | None = None,
        calls_block: bool = True,
    ) -> None:
        self.sampler = sampler
        # How long a poll may wait on the driver (default CALL_TIMEOUT_POLLS intervals), and how
        # long a call may stay stuck before the agent gives up and exits to be restarted.
        self.call_timeout_s = call_timeout_s if call_timeout_s is not None else CALL_TIMEOUT_POLLS * poll_interval_s
        self.exit_after_s = exit_after_s if exit_after_s is not None else max(EXIT_AFTER_MIN_S, 12 * poll_interval_s)
        # Called (from the poll thread) when a call has been stuck past exit_after_s; the daemon
        # flushes the ledger and exits. Without it, the poll raises DriverHung.
        self.on_hung: Callable[[DriverHung], None] | None = None
        # Called once, on the poll thread, just before the first scheduled poll reads anything
        # (a sped-up fake node starts its clock there).
        self.before_first_poll: Callable[[], None] | None = None
        self._worker = Worker("gpuledger-poll")
        # False where no driver call can block (a fake node without latency faults): the devices
        # are then read on the poll's own thread. The hand-off to the worker and back, two
        # cross-core wake-ups a poll, cost `simulate` a tenth of its time and buy nothing there.
        self.calls_block = calls_block
        # GPU key ("" for the driver) -> when its call got stuck, and the thread still in that
        # call: each key is read again once its own call returns.
        self._stuck: dict[str, tuple[float, threading.Thread | None]] = {}
        self.attributor = attributor
        self._attribute_timeouts = 0  # the attributor's timeouts() already counted as failures
        # The driver-event reader: on its own thread in the daemon, caught up at each poll
        # otherwise (`simulate`, `snapshot`), so its events land in the state either way.
        self.events: EventReader | None = None
        self._events_stuck = False  # its thread's driver call has been said to be stuck
        self.costing = costing
        self.rules = tuple(rules)
        self.poll_interval_s = poll_interval_s
        self._monotonic = monotonic
        # Each stage's last good result, which a failing stage leaves in place.
        self._previous: Snapshot | None = None
        self._attribution = Attribution()
        self._clean_workloads: dict[Workload, Workload | None] = {}
        # The last attribution scrubbed and its scrubbed form: a steady state hands on the same
        # attribution poll after poll (Attributor.attribute).
        self._scrubbed_last: tuple[Attribution, Attribution] | None = None
        # The last attribution the rules stage saw, its devices' parents, and who holds what (`_holders`).
        self._holders_last: (
            tuple[Attribution, dict[str, str], dict[str, set[Workload]], dict[str, tuple[Workload, ...]]] | None
        ) = None
        self._last_energy: dict[str, LastEnergy] = {}  # GPU uuid -> its last energy counter reading
        # Where the time booked so far ends (the ledger's record, then each interval booked): a
        # clock stepped back (NTP) must not book the same wall-clock time twice.
        self._booked_until: float | None = None
        self._behind_since: float | None = None  # the clock of the last poll found behind it
        # GPU uuid -> (its index, its holders, the time) when last seen held.
        self._last_held: dict[str, tuple[int, tuple[Workload, ...], float]] = {}
        self._left_by: dict[str, LeftBy] = {}  # GPU uuid -> who left it idle (while nobody holds it)
        # MIG instance uuid -> its holders when last seen held: whom its idle flag's lines name.
        self._mig_last_held: dict[str, LeftBy] = {}
        # Cost unit uuid -> the workloads that held it at the last poll that saw it held: whom
        # accounting books its idle time to (`IdleCharge.left_by`).
        self._unit_left_by: dict[str, tuple[Workload, ...]] = {}
        self._holders_remembered: Attribution | None = None  # the attribution `_unit_left_by` last took in
        self._totals = CostTotals()
        self._prices: dict[str, Price | None] = {}
        # What the last state published of each of these, while it still stands (None: built
        # again at the next publish). Most polls change none of them: each is rebuilt only when
        # it changed, not sorted and copied at every poll.
        self._published_prices: tuple[tuple[str, Price | None], ...] | None = None
        self._published_left_by: tuple[LeftBy, ...] | None = None
        self._published_errors: tuple[tuple[tuple[str, str], int], ...] = ()  # the sampler's errors, unsorted
        self._published_nvml_errors: tuple[tuple[str, str, int], ...] = ()
        # Unobserved time waiting for a GPU to book it to, or for a GPU's price (accounting/unpriced.py).
        self._unplaced = Unplaced()
        self._unpriced = Unpriced()
        self._rule_states: Mapping[tuple[str, str], RuleState] = {}
        self._flags: tuple[Flag, ...] = ()
        self._stages = {name: _Stage(name) for name in STAGES}
        self._state = AgentState()
        self._last_success_monotonic: float | None = None
        self._overran = 0
        self._failed = 0
        self._polls = 0
        self._scheduler: Schedule | None = None
        self._overrun_lock = threading.Lock()
        self._polling = threading.Lock()  # held by a scheduled poll while it runs
        self.actions: ActionHook | None = None  # set by the wiring when actions are configured

    @property
    def state(self) -> AgentState:
        return self._state

    def healthy(self) -> bool:
        """True while a poll has succeeded within the last HEALTHY_WITHIN_POLLS intervals and no
        driver call is stuck (the driver-event reader's included)."""
        last = self._last_success_monotonic
        window = max(HEALTHY_WITHIN_POLLS * self.poll_interval_s, HEALTHY_WITHIN_MIN_S)
        recent = last is not None and self._monotonic() - last <= window
        return recent and not self._stuck and (self.events is None or self.events.stuck_since is None)

    def open_devices(self) -> None:
        """Start the sampler (load the library, discover the GPUs) within the call budget. A
        driver that hangs at start-up is then a stuck call like any other: the agent serves
        /metrics (unhealthy), logs it, and polls again once the call returns. Raises
        DriverLibraryMissing when there is no library at all."""
        if not self.calls_block:
            self.sampler.start()
            return
        try:
            self._worker.call(self.sampler.start, self.call_timeout_s)
        except CallTimeout as exc:
            self.sampler.abandon()
            self._stick("", exc)
            log.error(
                "the GPU driver did not answer within %.1fs at start-up; serving /metrics as unhealthy until it does",
                self.call_timeout_s,
            )

    @property
    def stuck(self) -> Mapping[str, float]:
        """GPUs (uuid; "" for the driver itself) whose call has not returned, and since when
        (monotonic seconds)."""
        return {key: since for key, (since, _call) in self._stuck.items()}

    # -- the poll -----------------------------------------------------------------------------

    def poll_once(self) -> AgentState:
        """Run the stages in order and swap the result in. Raises only DriverLibraryMissing."""
        started = self._monotonic()
        for stage in self._stages.values():
            stage.succeeded = False
        sampled = self._run("sample", self._sample, None)
        if sampled is not None:
            snapshot = sampled.snapshot
            earlier = self._attribution
            attribution = self._run("attribute", lambda: self._attribute(snapshot), self._attribution)
            self._attribution = attribution
            # The poll's duration, as exported and checked against the interval: reading the
            # GPUs and their owners. Accounting and the rules are the agent's own bookkeeping.
            poll_duration_s = self._monotonic() - started
            charges = self._run("account", lambda: self._account(sampled, attribution, earlier), None)
            self._run("rules", lambda: self._judge(sampled, attribution, charges), None)
        else:
            poll_duration_s = self._monotonic() - started
        self._polls += 1
        up = sampled is not None and sampled.snapshot.driver_up
        if not up:
            self._failed += 1
        if poll_duration_s > self.poll_interval_s:
            with self._overrun_lock:
                self._overran += 1
            log.warning(
                "poll took %.3fs, longer than the %.3fs interval", poll_duration_s, self.poll_interval_s,
                extra={"duration_s": poll_duration_s},
            )  # fmt: skip
        if up:
            self._last_success_monotonic = self._monotonic()
        state = self._run("publish", lambda: self._publish(sampled, poll_duration_s), None)
        if state is not None:
            state = self._act(state)
            self._state = state  # one reference assignment: scrapes see old or new, never half
        return self._state

    def _act(self, state: AgentState) -> AgentState:
        """The actions' decisions on the state about to be published, and their counts in it."""
        actions = self.actions
        if actions is None:
            return state
        try:
            actions.observe(state)
            return replace(state, actions=actions.counts())
        except Exception:
            # Like a failing stage: logged, and the poll's state is published all the same.
            log.exception("the actions failed")
            return state

    def _run(self, name: str, work: Callable[[], T], fallback: T) -> T:
        """Run one stage: time it, count its failure and hand back `fallback` if it raises."""
        stage = self._stages[name]
        stage.started = started = self._monotonic()
        try:
            result = work()
        except (DriverLibraryMissing, DriverHung):
            raise  # no NVML at all, or stuck for good: the daemon cannot go on (the CLI says so)
        except CallTimeout:
            stage.failures += 1  # logged where it was caught, once
            result = fallback
        except Exception:
            # A bug in one stage must not stop the daemon: count it, keep the last good result.
            log.exception("the %s stage failed", name)
            stage.failures += 1
            result = fallback
        else:
            stage.succeeded = True
        stage.duration_s = self._monotonic() - started
        return result

    def _sample(self) -> Sampled:
        stuck = self._stuck
        for key, (_since, call) in list(stuck.items()):
            if call is not None and not call.is_alive():
                # That stuck call returned at last (its thread ended): read its GPU again. Only
                # its own: another GPU's call may still be stuck, and asking it again would
                # restart its clock towards exit_after.
                log.warning(
                    "%s: the stuck driver call returned; polling %s again",
                    f"GPU {key}" if key else "the GPU driver", "it" if key else "every GPU",
                    extra={"uuid": key},
                )  # fmt: skip
                del stuck[key]
        if stuck:
            worst = self._monotonic() - min(since for since, _call in stuck.values())
            if worst > self.exit_after_s:
                raise DriverHung(sorted(stuck), worst)
        if self.events is not None:
            self._check_events(self.events)
        if not self.calls_block:
            snapshot = self._read_devices({})
        elif "" in stuck:
            snapshot = self.sampler.down_snapshot(TIMEOUT)
        else:
            skip = dict.fromkeys(stuck, TIMEOUT)
            try:
                snapshot = self._worker.call(lambda: self._read_devices(skip), self.call_timeout_s)
            except CallTimeout as exc:
                key = self.sampler.reading or ""
                self.sampler.abandon()
                self._stick(key, exc)
                log.error(
                    "%s: a driver call has not returned in %.1fs; reading it as down (%s) and polling %s",
                    f"GPU {key}" if key else "the GPU driver", self.call_timeout_s, TIMEOUT,
                    "the other GPUs without it" if key else "nothing until it returns",
                    extra={"uuid": key},
                )  # fmt: skip
                raise
        # The interval is fixed here, before anything else sees this snapshot.
        sampled = Sampled(snapshot, self._previous)
        self._previous = snapshot
        return sampled

    def _check_events(self, events: EventReader) -> None:
        """The driver-event reader's thread stuck in a driver call: said once (and once when it
        returns), and past exit_after the end, as for a poll's call. Its clock is real time, as
        the reader's is, whatever the pipeline's `monotonic`."""
        since = events.stuck_since
        if since is None:
            if self._events_stuck:
                self._events_stuck = False
                log.warning("driver events: the stuck driver call returned; reading events again")
            return
        stuck_s = time.monotonic() - since
        if not self._events_stuck:
            self._events_stuck = True
            log.error(
                "driver events: a driver call has not returned in %.1fs; no events are read until it does",
                stuck_s,
            )
        if stuck_s > self.exit_after_s:
            raise DriverHung([EVENTS_KEY], stuck_s)

    def _stick(self, key: str, timeout: CallTimeout) -> None:
        """`key`'s call did not return in time: it reads as stuck until that call's thread ends."""
        since = self._stuck[key][0] if key in self._stuck else self._monotonic()
        self._stuck[key] = (since, timeout.thread)

    def _read_devices(self, skip: Mapping[str, str]) -> Snapshot:
        """The sampler's poll, then (when no thread reads them) the driver events up to now."""
        snapshot = self.sampler.poll(skip)
        if self.events is not None:
            self.events.catch_up()
        return snapshot

    def _attribute(self, snapshot: Snapshot) -> Attribution:
        attributor = self.attributor
        if attributor is None:
            return Attribution()
        attribution = attributor.attribute(snapshot)
        # A read given up on (a process's /proc stuck) leaves that process unresolved, not the
        # stage failed: the rest of the attribution stands, and the read is counted here.
        timeouts = attributor.timeouts()
        self._stages["attribute"].failures += timeouts - self._attribute_timeouts
        self._attribute_timeouts = timeouts
        return self._scrubbed(attribution)

    def _scrubbed(self, attribution: Attribution) -> Attribution:
        """`attribution` with every workload label and Slurm account scrubbed of credentials and
        control characters, and cut to `agent.scrub.LABEL_MAX_CHARS` (a process's own cmdline or
        environment can make one 128 KiB long). Here, once, because every output (metrics,
        textfile, ledger, flags and their log lines, snapshot) is built from this stage's result:
        a model given as https://user:pass@host/m?token=... leaves the agent as https://host/m."""
        last = self._scrubbed_last
        if last is not None and last[0] is attribution:
            return last[1]
        clean = self._clean_workloads
        if len(clean) > CLEAN_WORKLOADS_KEPT:
            clean.clear()  # workloads come and go; the ones still running are redone next poll
        holdings = []
        changed = False
        for holding in attribution.holdings:
            workload = holding.workload
            scrubbed = clean.get(workload, workload)
            if scrubbed is workload:  # not seen yet
                raw = workload.label_dict()
                values = {name: bound_label(value) for name, value in raw.items()}
                # None: nothing to scrub. Each poll's attribution may build its workloads anew,
                # so "the same" means equal, not the object first remembered.
                scrubbed = None if values == raw else Workload.from_labels(values)
                # Not one with a long label (a model a rule took from a long argument): kept,
                # thousands of them would hold a long text each (CACHED_TEXT_MAX_CHARS says more).
                if sum(map(len, raw.values())) <= CACHED_TEXT_MAX_CHARS:
                    clean[workload] = scrubbed
            # The Slurm account is no label but reaches the ledger and `report --by account`; the
            # process's own SLURM_JOB_ACCOUNT can hold anything.
            account = bound_label(holding.account) if holding.account else ""
            if scrubbed is not None or account != holding.account:
                changed = True
                clean_workload = scrubbed if scrubbed is not None else workload
                holdings.append(replace(holding, workload=clean_workload, account=account))
            else:
                holdings.append(holding)
        result = replace(attribution, holdings=tuple(holdings)) if changed else attribution
        self._scrubbed_last = (attribution, result)
        return result

    def _account(self, sampled: Sampled, attribution: Attribution, earlier: Attribution) -> Charges | None:
        costing = self.costing
        if costing is None:
            return None
        snapshot = sampled.snapshot
        if any(g.uuid not in self._prices for g in snapshot.gpus):
            self._prices.update(costing.prices(snapshot))
            self._published_prices = None
        previous = sampled.previous
        if previous is None:
            self._book_downtime(snapshot, costing)
            self._remember_holders(attribution)
            return None
        polled_at = previous.taken_at
        booked = self._booked_until
        if booked is not None and snapshot.taken_at <= booked:
            self._clock_behind(snapshot.taken_at, booked)
            self._remember_holders(attribution)
            self._remember_energy(snapshot, None)
            return None
        if booked is not None and previous.taken_at < booked:
            # The clock caught up with the time already booked within this interval: its rest.
            log.info("the clock is past %s again: charging from there", iso_time(booked))
            previous = replace(previous, taken_at=booked)
        self._booked_until, self._behind_since = snapshot.taken_at, None
        if snapshot.taken_at - previous.taken_at > MAX_DOWNTIME_S:
            self._clock_jumped(previous.taken_at, snapshot.taken_at)
            self._remember_holders(attribution)
            self._remember_energy(snapshot, None)
            return None
        if not previous.gpus or not snapshot.gpus:
            # No GPU known at one end (the driver could not list them and nothing else named
            # them): the interval waits, unobserved, until GPUs are known to book it to.
            down = snapshot if not snapshot.gpus else previous
            if not down.driver_up:
                self._unplaced.add(previous.taken_at, snapshot.taken_at, down.down_reason or UNOBSERVED_UNREADABLE)
            for placed in self._unplaced.place(snapshot, self._prices, costing.energy_per_kwh):
                self._book(placed, snapshot, costing)
            return None
        # Counters last read before the interval (an outage): their joules count from then.
        counted_from = {u: e.at for u, e in self._last_energy.items() if e.at < polled_at}
        charges = account(
            previous,
            snapshot,
            attribution,
            self._prices,
            max_interval_s=costing.max_interval_s,
            energy_per_kwh=costing.energy_per_kwh,
            earlier=earlier,
            energy_before=self._last_energy,
            left_by=self._unit_left_by,
        )
        if sampled.interval_s <= costing.max_interval_s:  # what longer intervals used is not known
            charges = replace(charges, usage=unit_usage(snapshot, attribution))
        self._remember_holders(attribution)
        self._remember_energy(snapshot, charges)
        self._book(charges, snapshot, costing, counted_from)
        return charges

    def _remember_energy(self, snapshot: Snapshot, charges: Charges | None) -> None:
        """Each GPU's last energy counter reading, for the polls that cannot read it, with the
        unobserved seconds since (`charges` says which): that share of the gap's energy is nobody's."""
        unobserved_s = {g.uuid: g.unobserved_s for g in charges.gpus} if charges is not None else {}
        for gpu in snapshot.gpus:
            if gpu.energy_j is not None:
                self._last_energy[gpu.uuid] = LastEnergy(gpu.energy_j, snapshot.taken_at)
            elif (last := self._last_energy.get(gpu.uuid)) is not None and unobserved_s.get(gpu.uuid):
                self._last_energy[gpu.uuid] = replace(last, unobserved_s=last.unobserved_s + unobserved_s[gpu.uuid])

    def _clock_behind(self, now: float, booked: float) -> None:
        """A poll whose clock is at or before the time already booked: nothing to charge (that
        time is in the counters and the ledger once already), said once per step back."""
        if now < booked and (self._behind_since is None or now < self._behind_since):
            log.warning(
                "the clock reads %s, %s before the time already charged (to %s): it was set back; "
                "nothing is charged until it passes that time again",
                iso_time(now), format_duration(booked - now), iso_time(booked),
            )  # fmt: skip
        self._behind_since = now

    @staticmethod
    def _clock_jumped(before: float, now: float) -> None:
        """Two polls over a year apart: the clock was set late, and the years between are no
        GPU time. Booked (unobserved) they would put decades of dollars in the counters, which
        the ledger refuses (`agent.ledger.pending.MAX_INTERVAL_S`)."""
        log.warning(
            "the clock jumped forward %s, from %s to %s: more than a year, so a clock set late "
            "(at boot, before NTP), not time to charge; nothing is charged for it",
            format_duration(now - before), iso_time(before), iso_time(now),
        )  # fmt: skip

    def _book(
        self, charges: Charges, snapshot: Snapshot, costing: Costing, counted_from: Mapping[str, float] | None = None
    ) -> None:
        """The one way charges reach the counters and the ledger: less the time of GPUs that
        wait for a price, plus the waiting time of GPUs that have one now. `counted_from`: when
        each GPU's energy counter was last read, where that is before `charges` start."""
        kept = self._unpriced.hold(charges, snapshot, self._prices)
        for booked in (kept, *self._unpriced.release(snapshot, self._prices, costing.energy_per_kwh)):
            totals = accumulate(self._totals, booked, forget_after_s=costing.forget_after_s)
            if costing.sink is not None:
                # The ledger splits a charge over its hours by time: an outage's energy over the
                # outage, and each part cut where the price changes.
                gaps = spread_gap_energy(booked, counted_from) if booked is kept and counted_from else (booked,)
                for part in gaps:
                    for piece in split_at_price_changes(part, self._prices):
                        costing.sink.add(piece)
            self._totals = totals  # only once the ledger has them too: counters and ledger agree

    def _remember_holders(self, attribution: Attribution) -> None:
        # A steady state hands on the same attribution poll after poll (`_scrubbed`): its holders
        # are remembered already.
        if attribution is self._holders_remembered:
            return
        self._holders_remembered = attribution
        held: dict[str, set[Workload]] = {}
        for h in attribution.holdings:
            held.setdefault(h.device_uuid, set()).add(h.workload)
        for uuid, workloads in held.items():
            self._unit_left_by[uuid] = tuple(sorted(workloads))

    def _book_downtime(self, snapshot: Snapshot, costing: Costing) -> None:
        """At the first poll: the time since the ledger's record ended, when nobody watched,
        charged to nobody as unobserved (agent_down), so downtime between runs is in the
        ledger and in report, not missing from both. With no GPU known yet (the driver cannot
        list them) it waits for them, like the time after it."""
        since = costing.sink.recorded_until if costing.sink is not None else None
        self._booked_until = snapshot.taken_at if since is None else max(since, snapshot.taken_at)
        if since is not None and snapshot.taken_at < since:
            self._clock_behind(snapshot.taken_at, since)
        if since is None or not 0 < snapshot.taken_at - since <= MAX_DOWNTIME_S:
            return
        log.info(
            "the agent was not running for %s before this start (the ledger's record ended then): booked as unobserved",
            format_duration(snapshot.taken_at - since),
        )
        if not snapshot.gpus:
            self._unplaced.add(since, snapshot.taken_at, UNOBSERVED_AGENT_DOWN)
            return
        charges = downtime(
            since,
            snapshot.taken_at,
            snapshot,
            self._prices,
            reason=UNOBSERVED_AGENT_DOWN,
            energy_per_kwh=costing.energy_per_kwh,
        )
        self._book(charges, snapshot, costing)

    def settle(self) -> None:
        """Book what still waits, once, as the agent stops (before the ledger closes): a GPU
        never identified, at $0 under its provisional uuid (its price is unknown without its
        model); time before any GPU was known cannot be booked to one, and is said in a line."""
        costing = self.costing
        last = self._previous
        if costing is None or last is None or not self._polling.acquire(blocking=False):
            return  # nothing to book, or a poll is still running (stuck): it owns the totals
        try:
            for gpu, seconds, charges in self._unpriced.drain(last, costing.energy_per_kwh):
                log.warning(
                    "GPU %d was never identified: its %s unobserved before this stop are booked at $0 under %s, "
                    "its price being unknown without its model",
                    gpu.index, format_duration(seconds), gpu.uuid, extra={"gpu": gpu.index, "uuid": gpu.uuid},
                )  # fmt: skip
                for booked in charges:
                    self._totals = accumulate(self._totals, booked, forget_after_s=costing.forget_after_s)
                    if costing.sink is not None:
                        costing.sink.add(booked)
            if self._unplaced.seconds:
                log.warning(
                    "%s went unobserved with no GPU known to book it to: the driver never listed one",
                    format_duration(self._unplaced.seconds),
                )
            self._state = replace(self._state, costs=self._totals)
        finally:
            self._polling.release()

    def _judge(self, sampled: Sampled, attribution: Attribution, charges: Charges | None) -> None:
        snapshot = sampled.snapshot
        unit_held_by, holders = self._holders(snapshot, attribution)
        # Who left each GPU idle, as of before this poll: a clearing idle flag names them, not
        # the workload whose arrival cleared it.
        left_before = dict(self._left_by)
        gpus = snapshot.gpus
        # The devices that are no GPU are MIG instances: most nodes have none, and skip their work.
        has_migs = len(gpus) != len(snapshot.devices)
        self._track_left_by(snapshot.taken_at, gpus, holders)
        if not self.rules:
            return
        cost = {g.uuid: g for g in charges.gpus} if charges is not None else {}
        migs_of = snapshot.migs_by_parent() if has_migs else {}
        observations = []
        node, interval_s = snapshot.node.hostname, sampled.interval_s
        for gpu in gpus:
            charge = cost.get(gpu.uuid)
            migs = migs_of.get(gpu.uuid, ())
            observations.append(
                GpuObservation(
                    gpu=gpu.index,
                    uuid=gpu.uuid,
                    model=gpu.model,
                    node=node,
                    up=gpu.up,
                    # How busy, by the GPU's busy source. A MIG-enabled GPU is judged per instance.
                    utilization=None if migs else gpu.busy,
                    memory_used_bytes=gpu.memory_used_bytes,
                    holders=holders.get(gpu.uuid, ()),
                    interval_s=interval_s,
                    holders_known=attribution.allocations_known and gpu.processes_known,
                    dollars=charge.dollars if charge is not None else 0.0,
                    idle_dollars=charge.idle_dollars if charge is not None else 0.0,
                )
            )
            if migs:
                dollars = charge.dollars if charge else 0.0
                observations += self._mig_observations(
                    sampled, gpu, migs, unit_held_by, dollars, allocations_known=attribution.allocations_known
                )
        # Without accounting there is no longest interval: no time is unobserved.
        max_interval_s = self.costing.max_interval_s if self.costing is not None else math.inf
        result = evaluate(self._rule_states, observations, self.rules, snapshot.taken_at, max_interval_s, self._flags)
        self._rule_states = result.states
        self._flags = result.flags
        if result.transitions:
            idle_rules = IDLE_RULES | {r.name for r in self.rules if r.condition == "idle"}
        for t in result.transitions:
            left = self._left_by.get(t.uuid) or left_before.get(t.uuid) or self._mig_last_held.get(t.uuid)
            _log_transition(t, left, idle=t.rule in idle_rules)
        # After the lines: one that clears an instance's idle flag names who left it, not who came.
        for device in snapshot.devices if has_migs else ():
            held = unit_held_by.get(device.uuid)
            if device.parent_uuid is not None and device.up and held:
                self._mig_last_held[device.uuid] = LeftBy(
                    device.index, device.uuid, tuple(sorted(held)), snapshot.taken_at
                )

    def _holders(
        self, snapshot: Snapshot, attribution: Attribution
    ) -> tuple[Mapping[str, set[Workload]], Mapping[str, tuple[Workload, ...]]]:
        """Who holds each unit (a GPU or a MIG instance), and so each GPU (sorted). The same
        attribution on the same devices holds them as at the last poll: a steady state hands on
        one attribution poll after poll (`_scrubbed`), and these are the last poll's then, the
        very same tuples, which `_track_left_by` and the rules compare by identity first."""
        parent = {d.uuid: d.parent_uuid or d.uuid for d in snapshot.devices}
        last = self._holders_last
        if last is not None and last[0] is attribution and last[1] == parent:
            return last[2], last[3]
        unit_held_by: dict[str, set[Workload]] = {}
        held_by: dict[str, set[Workload]] = {}
        for h in attribution.holdings:
            gpu_uuid = parent.get(h.device_uuid)
            if gpu_uuid is not None:
                unit_held_by.setdefault(h.device_uuid, set()).add(h.workload)
                held_by.setdefault(gpu_uuid, set()).add(h.workload)
        holders = {uuid: tuple(sorted(workloads)) for uuid, workloads in held_by.items()}
        self._holders_last = (attribution, parent, unit_held_by, holders)
        return unit_held_by, holders

    def _mig_observations(
        self,
        sampled: Sampled,
        gpu: DeviceReading,
        migs: tuple[DeviceReading, ...],
        held_by: Mapping[str, set[Workload]],
        gpu_dollars: float,
        *,
        allocations_known: bool,
    ) -> list[GpuObservation]:
        """Each MIG instance of `gpu` (`migs`) as the rules see it: a unit of its own (its uuid,
        its holders in `held_by`, its share of the GPU's cost), busy by its GPM SM activity
        where it has that."""
        snapshot = sampled.snapshot
        found = []
        for unit in cost_units(snapshot, gpu, migs):
            device = unit.device
            if device is None:
                continue  # SMs no instance holds: nobody to flag
            held = tuple(sorted(held_by.get(unit.uuid, ())))
            dollars = gpu_dollars * unit.weight
            found.append(
                GpuObservation(
                    gpu=gpu.index,
                    uuid=device.uuid,
                    model=gpu.model,
                    node=snapshot.node.hostname,
                    up=gpu.up and device.up,
                    utilization=device.busy,
                    memory_used_bytes=device.memory_used_bytes,
                    holders=held,
                    interval_s=sampled.interval_s,
                    holders_known=allocations_known and device.processes_known,
                    dollars=dollars,
                    idle_dollars=0.0 if held else dollars,
                )
            )
        return found

    def _track_left_by(
        self, taken_at: float, gpus: Sequence[DeviceReading], holders: Mapping[str, tuple[Workload, ...]]
    ) -> None:
        """Remember who held each GPU at the last poll that saw it held; once nobody holds it,
        they are who left it idle (`left_by`), until someone holds it again."""
        # `_last_held` keeps the parts of a LeftBy, built only once nobody holds the GPU (and then
        # once for the whole idle stretch): a GPU held poll after poll would build one every poll.
        last_held, left_by = self._last_held, self._left_by
        for gpu in gpus:
            if not gpu.up:
                continue
            uuid = gpu.uuid
            held = holders.get(uuid)
            if held:
                last_held[uuid] = (gpu.index, held, taken_at)
                if left_by.pop(uuid, None) is not None:
                    self._published_left_by = None
            elif uuid not in left_by and (last := last_held.get(uuid)) is not None:
                index, workloads, at = last
                left_by[uuid] = LeftBy(index, uuid, workloads, at)
                self._published_left_by = None

    def _publish(self, sampled: Sampled | None, poll_duration_s: float) -> AgentState:
        previous = self._state
        snapshot = previous.snapshot
        last_success_at = previous.health.last_success_at
        if sampled is not None:
            taken = sampled.snapshot
            snapshot = Snapshot(taken.taken_at, taken.node, taken.devices, poll_duration_s, taken.driver_up)
            if taken.driver_up:
                last_success_at = taken.taken_at
        costing = self.costing
        health = AgentHealth(
            polls_total=self._polls,
            polls_failed=self._failed,
            polls_overran=self._overran,
            last_success_at=last_success_at,
            nvml_errors=self._nvml_errors(),
            stages=self._stage_health(snapshot.taken_at if sampled is not None and snapshot is not None else None),
        )
        return AgentState(
            snapshot=snapshot,
            attribution=self._attribution if sampled is not None else previous.attribution,
            costs=self._totals if costing is not None else CostTotals(),
            prices=self._prices_at(snapshot.taken_at if snapshot is not None else None) if costing is not None else (),
            ledger=costing.sink.health() if costing is not None and costing.sink is not None else None,
            flags=self._flags,
            left_by=self._left_by_published(),
            health=health,
            events=self.events.events if self.events is not None else None,
        )

    def _prices_at(self, t: float | None) -> tuple[tuple[str, Price | None], ...]:
        """Each GPU's price in force at `t` (a price history changes it over time)."""
        published = self._published_prices
        if published is not None:
            return published
        found = tuple(
            (uuid, price.at(t) if price is not None and t is not None else price)
            for uuid, price in sorted(self._prices.items())
        )
        # Prices without a history are in force at any time: the same until the prices change.
        if all(price is None or not price.changes for price in self._prices.values()):
            self._published_prices = found
        return found

    def _nvml_errors(self) -> tuple[tuple[str, str, int], ...]:
        """The sampler's error counts by (call, error), sorted."""
        errors = tuple(self.sampler.errors.items())
        if errors != self._published_errors:
            self._published_errors = errors
            self._published_nvml_errors = tuple((call, error, n) for (call, error), n in sorted(errors))
        return self._published_nvml_errors

    def _left_by_published(self) -> tuple[LeftBy, ...]:
        """Who left each GPU nobody holds, by GPU uuid."""
        published = self._published_left_by
        if published is None:
            published = self._published_left_by = tuple(self._left_by[uuid] for uuid in sorted(self._left_by))
        return published

    def _stage_health(self, taken_at: float | None) -> tuple[StageHealth, ...]:
        """Every stage's record as this poll leaves it. The publish stage, still running, counts
        as succeeding (if it does not, this state is never seen) and its time so far as its
        duration: what remains is building one object."""
        publish = self._stages["publish"]
        publish.succeeded = True
        publish.duration_s = self._monotonic() - publish.started
        for stage in self._stages.values():
            if stage.succeeded and taken_at is not None:
                stage.last_success_at = taken_at
        return tuple([stage.health() for stage in self._stages.values()])

    # -- periodic work ------------------------------------------------------------------------

    def flush_ledger(self) -> None:
        if self.costing is not None and self.costing.sink is not None:
            self.costing.sink.flush()

    def refresh_allocations(self) -> None:
        """Run every attribution source's refresher now, e.g. ask the kubelet for its GPU
        allocations (the daemon does this on each refresher's own schedule)."""
        if self.attributor is not None:
            self.attributor.refresh()

    def jobs(self) -> tuple[PeriodicJob, ...]:
        """The agent's periodic work, in the order jobs due at the same moment run: the sources'
        refreshers (allocations) before the poll that uses them, the ledger flushed after the
        poll that fed it."""
        jobs: list[PeriodicJob] = []
        if self.attributor is not None:
            jobs += [PeriodicJob(r.name, r.interval_s, r.refresh) for r in self.attributor.refreshers()]
        jobs.append(
            PeriodicJob(
                "poll",
                self.poll_interval_s,
                self._scheduled_poll,
                misfire_grace_s=max(1, int(self.poll_interval_s)),
                at_end=True,
            )
        )
        if self.costing is not None and self.costing.sink is not None:
            jobs.append(PeriodicJob("ledger", self.costing.flush_interval_s, self.flush_ledger, at_start=False))
        return tuple(jobs)

    def start(self) -> None:
        """Run `jobs()` on real time, in background threads, until `stop`."""
        from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED  # noqa: PLC0415 - run only

        from agent.schedule import Schedule  # noqa: PLC0415 - run only

        schedule = Schedule("poll")
        schedule.add_listener(self._on_missed, EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES)
        for job in self.jobs():
            schedule.add(job.name, job.run, job.interval_s, at_start=job.at_start, misfire_grace_s=job.misfire_grace_s)
        schedule.start()
        self._scheduler = schedule

    def _scheduled_poll(self) -> None:
        try:
            with self._polling:
                if self.before_first_poll is not None:
                    first, self.before_first_poll = self.before_first_poll, None
                    first()
                self.poll_once()
        except DriverLibraryMissing as exc:
            log.error("%s", exc)
        except DriverHung as exc:
            if self.on_hung is None:
                raise
            self.on_hung(exc)

    def _on_missed(self, event: JobExecutionEvent) -> None:
        if event.job_id != "poll":
            return
        # A poll skipped because the previous one was still going: that poll overran.
        with self._overrun_lock:
            self._overran += 1
        log.warning("a poll was skipped: the previous one is still running")

    def stop(self, wait_s: float = STOP_WAIT_S) -> bool:
        """Stop the schedule and wait up to `wait_s` for a poll still running. False when it is
        still running (stuck in the driver): the caller must not shut the driver down under it."""
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None
        finished = self._polling.acquire(timeout=wait_s)
        if finished:
            self._polling.release()
            self._worker.close()
        return finished and not self._stuck


def run_on_scenario_time(
    jobs: Iterable[PeriodicJob],
    advance: Callable[[float], object],
    duration_s: float,
    step_s: float,
    on_step: Callable[[], object] | None = None,
) -> int:
    """Run `jobs` as the daemon's scheduler would over `duration_s` of a clock that `advance`
    moves, stepping it `step_s` at a time and never sleeping. Returns the steps taken.

    Jobs due at the start run first; then after each step every job whose time has come runs
    once, in the order given, however many of its runs fell within the step (APScheduler's
    coalescing). Each job keeps the daemon's rhythm: due every `interval_s` from the start.
    Where `duration_s` is not a whole number of steps, a last, shorter step ends the run at
    `duration_s`, and the `at_end` jobs (the poll) run then too, due or not: otherwise the
    seconds after the last whole step would be in no interval. `on_step` is called after each
    step's jobs (progress).
    """
    schedule = [(job, 0.0 if job.at_start else job.interval_s) for job in jobs]
    elapsed = 0.0
    steps = 0

    def run_due(last: bool = False) -> None:
        for i, (job, due) in enumerate(schedule):
            if due <= elapsed + 1e-9 or (last and job.at_end):
                job.run()
                # The next run is the first of the job's beats after now, as with coalesce=True.
                beats = math.floor((elapsed - due) / job.interval_s + 1e-9) + 1
                schedule[i] = (job, due + beats * job.interval_s)

    run_due()
    while elapsed + step_s <= duration_s + 1e-9:
        advance(step_s)
        elapsed += step_s
        steps += 1
        run_due()
        if on_step is not None:
            on_step()
    rest = duration_s - elapsed
    if rest > 1e-9:
        advance(rest)
        elapsed = duration_s
        steps += 1
        run_due(last=True)
        if on_step is not None:
            on_step()
    return steps


NOBODY_SINCE_START = "(nobody since the agent started)"


def _log_transition(t: Transition, left_by: LeftBy | None = None, *, idle: bool = True) -> None:
    """One structured line per flag change: GPU, rule, workload, how long, what it cost so far;
    for the idle rules (`idle`), who left the GPU idle and when they were last seen on it (not
    whoever ends the idle stretch), or that nobody has held it since the agent started."""
    workloads = ", ".join(w.describe() for w in t.holders) or "(nobody)"
    left = ""
    if not idle:
        left_by = None
    elif left_by is not None:
        left = f" left_by={left_by.describe()} left_at={datetime.fromtimestamp(left_by.at, UTC).isoformat()}"
    else:
        left = f" left_by={NOBODY_SINCE_START}"
    log.warning(
        "flag %s: rule=%s gpu=%d uuid=%s workload=%s for=%s cost_so_far=$%.2f%s",
        "raised" if t.raised else "cleared",
        t.rule,
        t.gpu,
        t.uuid,
        workloads,
        format_duration(t.held_s),
        t.dollars,
        left,
        extra={
            "event": "flag_raised" if t.raised else "flag_cleared",
            "rule": t.rule,
            "gpu": t.gpu,
            "uuid": t.uuid,
            "workload": workloads,
            "held_s": t.held_s,
            "cost_dollars": t.dollars,
            "left_by": left_by.describe() if left_by is not None else (NOBODY_SINCE_START if idle else None),
        },
    )
