"""The one place the agent is assembled from settings: the device backend and sampler,
attribution, prices and the ledger, the flag rules, the pipeline, and the outputs that render
its state (the Prometheus registry, the textfile). `run`, `snapshot`, `simulate`, the tests'
rig and the benchmarks all build it with `build_agent`, so every one of them honours the same
options the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from agent.accounting.pricing import NO_SPOT_PRICE, price_schedule
from agent.actions import Actions, Selector, Trigger
from agent.actions.config import TargetList
from agent.attribution.gather import Attributor
from agent.attribution.labels import compile_rules, rule_env_keys
from agent.attribution.sources import open_sources
from agent.attribution.sources.base import SourceOptions
from agent.config import Settings, host_problems, load_catalogue
from agent.devices import create_backend
from agent.devices.backend import DeviceBackend
from agent.devices.events import EventBackend, EventReader
from agent.devices.instance import detect_instance_type
from agent.devices.pci import nvidia_gpus
from agent.devices.sampler import Sampler
from agent.errors import BadInputError
from agent.model import AgentState, Price, Snapshot
from agent.pipeline import Costing, Pipeline
from exporters.prometheus import make_registry
from exporters.textfile import TextfileWriter
from rules.engine import RuleSpec

if TYPE_CHECKING:
    import fake_nvml

log = logging.getLogger("gpuledger")

FAKE_MIN_POLL_S = 0.02
# Closing within a deadline, the textfile's last write waits at least this long.
LAST_TEXTFILE_WAIT_S = 0.25


@dataclass(eq=False)
class Agent:
    """The assembled agent. `start` runs it on real time (the daemon); `simulate` and the tests
    drive `pipeline` themselves. `close` shuts everything down, in order, and may be called
    more than once."""

    settings: Settings
    node: fake_nvml.InstalledNode | None  # the fake node it reads, when it reads one
    backend: DeviceBackend
    sampler: Sampler
    attributor: Attributor
    costing: Costing | None
    pipeline: Pipeline
    textfile: TextfileWriter | None
    fake_speed: float = 0.0  # scenario seconds per real second once started (0: moved by hand)
    actions: Actions | None = None  # the configured actions (config `actions:`), if any
    events: EventReader | None = None  # the driver-event reader (None: events off, or no event API)
    _closed: bool = False
    _ledger_written: bool = True
    # What `close` waits on now, for the daemon's shutdown deadline to name ("" before close).
    closing: str = ""

    def registry(
        self, state: Callable[[], AgentState] | None = None, only: Collection[str] | None = None
    ) -> CollectorRegistry:
        """A registry rendering `state` (by default the pipeline's latest), with the per-pid
        series and dcgm-exporter compatibility the settings ask for; `only`: make_registry's."""
        pipeline = self.pipeline
        return make_registry(
            state if state is not None else lambda: pipeline.state,
            self.settings.attribution.per_pid_series,
            dcgm_compat=self.settings.exporters.dcgm_compat,
            only=only,
        )

    def exposition(self, state: AgentState | None = None) -> bytes:
        """The /metrics text of `state` (by default the pipeline's latest)."""
        return generate_latest(self.registry((lambda: state) if state is not None else None))

    def start(self) -> None:
        """Poll, refresh allocations, flush the ledger and write the textfile in the background.
        A sped-up fake node's clock starts with the first poll, not before: scenario time spent
        while the agent was still being built, or while the scheduler's thread was starting on
        a loaded machine (at 1200x, 50 real ms is a scenario minute), would be time nobody
        watched."""
        if self.node is not None and self.fake_speed:
            clock, speed = self.node.clock, self.fake_speed
            self.pipeline.before_first_poll = lambda: clock.set_speed(speed)
        self.pipeline.start()
        if self.events is not None:
            self.events.start()
        if self.textfile is not None:
            self.textfile.start(self.pipeline.poll_interval_s)

    def close(self, within_s: float | None = None) -> bool:
        """Stop the schedules, flush and close the ledger, write the last state to the textfile,
        then let go of the attribution sources (the kubelet), NVML and the fake node. A driver
        call still stuck is left alone (shutting the library down under it could hang too).
        False when charges could not be written to the ledger (logged, with their rows and
        dollars): `run` then exits 1. With `within_s`, the ledger waits on its file only for
        what is left of it once the poll has stopped, so that a locked file is reported as lost
        rows before the daemon's shutdown deadline; `closing` says what is being waited on."""
        if self._closed:
            return self._ledger_written
        self._closed = True
        deadline = None if within_s is None else time.monotonic() + within_s
        if self.events is not None:
            self.events.stop_soon()  # its last wait runs out while the ledger flushes
        self.closing = "a GPU driver call is stuck"
        idle = self.pipeline.stop()
        self.pipeline.settle()  # time still waiting for a price is booked before the ledger closes
        if self.actions is not None:
            self.closing = "an action is still running"
            self.actions.close()
        if self.costing is not None and self.costing.sink is not None:
            # The last charges reach the ledger before anything slower.
            self.closing = "the ledger's file is locked by another process or its filesystem does not answer"
            left_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._ledger_written = self.costing.sink.close(left_s)
        if self.textfile is not None:
            self.closing = "the textfile's filesystem does not answer"
            # The last poll reaches the file too, within what the deadline leaves (and a moment
            # besides); not at all while a write is stuck.
            wait_s = None if deadline is None else max(LAST_TEXTFILE_WAIT_S, deadline - time.monotonic())
            self.textfile.stop(wait_s)
        self.closing = "an attribution source (the kubelet) does not answer"
        self.attributor.close()
        self.closing = "a GPU driver call is stuck"
        # The reader's wait in progress (events.wait, up to 10 s) is waited for only as long as
        # the deadline leaves: past it the reader is left to end with the process, NVML open.
        left_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        events_stopped = self.events.stop(left_s) if self.events is not None else True
        if idle and events_stopped:
            self.sampler.close()
        if self.node is not None:
            import fake_nvml

            fake_nvml.uninstall()
        self.closing = ""
        return self._ledger_written


def build_agent(
    settings: Settings,
    *,
    fake: str | Path | Mapping[str, Any] | fake_nvml.Scenario | None = None,
    fake_speed: float = 0.0,
    ledger_path: str | Path | None = None,
    clock: Callable[[], float] | None = None,
    poll_interval_s: float | None = None,
    monotonic: Callable[[], float] = time.monotonic,
    costing: Costing | bool = True,
    rules: Sequence[RuleSpec] | None = None,
    actions: Literal["on", "dry_run", "off"] = "on",
    wrap_backend: Callable[[DeviceBackend], DeviceBackend] | None = None,
    ledger_fsync: bool = True,
    metrics_text: bool = True,
) -> Agent:
    """Assemble the agent, with NVML initialised (raises DriverLibraryMissing without a driver).

    fake           read a fake node instead of NVML: a built-in scenario name, a YAML path, a
                   mapping or a Scenario; it is installed here and uninstalled by `close`
    fake_speed     scenario seconds per real second (0: the clock moves only when advanced)
    ledger_path    write charges to this ledger (none when None)
    clock          the ledger's wall clock; by default the backend's (the fake node's, on one)
    poll_interval_s  default `settings.poll_interval`
    monotonic      times the stages (tests pin it, so durations are stable)
    costing        True: prices from the settings; False: no accounting; a `Costing`: that one
                   (tests and benchmarks with prices of their own)
    rules          the flag rules; by default those the settings enable
    actions        "on": the configured actions, as configured; "dry_run": every one a dry run,
                   with no state file (`simulate`); "off": none. On a fake node the state file
                   is never used (a demo must not mark the host's real episodes as acted on).
    wrap_backend   wraps the device backend before anything uses it (`record` keeps what it says)
    ledger_fsync   sync the ledger to disk at every flush (False for `simulate`, whose flushes
                   come often: still atomic, synced at checkpoints and at close)
    metrics_text   False where nothing this agent makes is shown as metrics text (`simulate`
                   without --metrics-out): the readings only that text shows (the readings.*
                   groups, the temperature, the NVLinks' states) are then not read, unless the
                   settings write a textfile. The ledger, the flags and the costs never see them.
    """
    problems = host_problems(settings, "gpuledger")
    if problems:
        raise BadInputError(problems[0])
    textfile_path = settings.exporters.textfile_path
    interval_s = settings.poll_interval if poll_interval_s is None else poll_interval_s
    if fake is not None and fake_speed > 1 and poll_interval_s is None:
        # A sped-up fake node is polled as often in scenario time as the daemon polls in real
        # time, as far as one real poll every FAKE_MIN_POLL_S allows (every 72 scenario seconds
        # at 3600x): polling every 5 real seconds would see the node every 5 scenario hours,
        # miss a 4-hour job and book it as idle.
        interval_s = max(interval_s / fake_speed, FAKE_MIN_POLL_S)
    backend, node = _backend(fake, 0.0, settings.backend)  # the clock starts with the first poll
    if wrap_backend is not None:
        backend = wrap_backend(backend)
    try:
        sys_root = str(node.host.sys_root) if node is not None else settings.sys_root
        sampler = Sampler(
            backend,
            hostname=node_name(settings, node),
            pci_gpus=partial(nvidia_gpus, sys_root),
            busy_source=settings.accounting.busy_source,
            readings=settings.readings.options(metrics_text=metrics_text or bool(textfile_path)),
        )
        # The devices first (within the call budget): without a driver nothing else is built,
        # so `run` says that, and only that, in its one line.
        specs = rule_specs(settings) if rules is None else rules
        pipeline = Pipeline(
            sampler,
            interval_s,
            monotonic=monotonic,
            rules=specs,
            call_timeout_s=settings.watchdog.call_timeout,
            exit_after_s=settings.watchdog.exit_after,
            # The watchdog's thread is for a driver that can hang. A fake node's calls return at
            # once unless its scenario makes them slow, or something wraps the backend.
            calls_block=node is None or wrap_backend is not None or node.calls_can_block,
        )
        pipeline.open_devices()
        if settings.events.enabled and isinstance(backend, EventBackend):
            pipeline.events = EventReader(
                backend,
                wait_s=settings.events.wait,
                retry_s=settings.events.retry,
                call_timeout_s=settings.watchdog.call_timeout,
            )
        attributor = pipeline.attributor = _attributor(settings, node)
        priced: Costing | None = None
        if isinstance(costing, Costing):
            priced = costing
        elif costing:
            priced = _costing(
                settings, node, ledger_path, clock or backend.clock, sampler.hostname, fsync_each_flush=ledger_fsync
            )
            if node is not None:
                # On a fake node one poll interval spans `fake_speed` times as much scenario time
                # (or, in `simulate`, one step): that is the run's normal rhythm, not a gap to
                # leave uncharged.
                rhythm_s = interval_s * fake_speed if fake_speed else interval_s
                priced = replace(priced, max_interval_s=max(priced.max_interval_s, 3 * rhythm_s))
        pipeline.costing = priced
        if priced is not None and priced.sink is not None:
            from agent.ledger.sink import LedgerSink

            if isinstance(priced.sink, LedgerSink):
                sampler.remember(priced.sink.known_gpus)  # what the GPUs go by while the driver cannot say
        acting = _actions(settings, specs, actions, fake=node is not None, interval_s=interval_s)
        pipeline.actions = acting
    except BaseException:
        if node is not None:
            import fake_nvml

            fake_nvml.uninstall()
        raise
    agent = Agent(
        settings, node, backend, sampler, attributor, priced, pipeline, None, fake_speed=fake_speed, actions=acting,
        events=pipeline.events,
    )  # fmt: skip
    if textfile_path:
        agent.textfile = TextfileWriter(textfile_path, lambda: pipeline.state, agent.exposition)
    return agent


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


# An episode decided before a restart waits this long, past its rule's `for`, for its flag to
# raise again (at least this many polls).
RESUME_GRACE_S = 300.0
RESUME_GRACE_POLLS = 3


def _actions(
    settings: Settings, specs: Sequence[RuleSpec], mode: str, *, fake: bool, interval_s: float
) -> Actions | None:
    """The configured actions as the pipeline runs them; None when there are none (or "off")."""
    config = settings.actions
    if mode == "off" or not config.triggers:
        return None
    for_s = {spec.name: spec.for_s for spec in specs}
    grace_s = max(RESUME_GRACE_S, RESUME_GRACE_POLLS * interval_s)
    triggers = [
        Trigger(
            name=name,
            flag=t.flag,
            scope=t.scope,
            after_s=t.after,
            cooldown_s=t.cooldown,
            dry_run=mode == "dry_run" or (config.dry_run if t.dry_run is None else t.dry_run),
            allow=(_selector(config.allow), _selector(t.allow)),
            deny=(_selector(config.deny), _selector(t.deny)),
            resume_s=for_s.get(t.flag, 0.0) + grace_s,
            command=tuple(t.command or ()),
            timeout_s=t.webhook.timeout if t.webhook is not None else t.timeout,
            env=tuple(sorted(t.env.items())),
            pass_env=tuple(t.pass_env),
            webhook_url=t.webhook.url if t.webhook is not None else "",
            webhook_format=t.webhook.format if t.webhook is not None else "alertmanager",
            webhook_headers=tuple(sorted(t.webhook.headers.items())) if t.webhook is not None else (),
        )
        for name, t in config.triggers.items()
    ]
    state_file = None if fake or mode == "dry_run" else config.state_file
    return Actions(triggers, workers=config.workers, queue_size=config.queue_size, state_file=state_file)


def _selector(names: TargetList) -> Selector:
    return Selector(tuple(names.namespaces), tuple(names.hpc_jobs), tuple(names.users), tuple(names.nodes))


def node_name(settings: Settings, node: fake_nvml.InstalledNode | None) -> str | None:
    """node_name from the config, else the fake node's hostname, else (None) the host's."""
    if settings.node_name:
        return settings.node_name
    return str(node.scenario.node.hostname) if node is not None else None


def _backend(
    fake: str | Path | Mapping[str, Any] | fake_nvml.Scenario | None, speed: float, name: str
) -> tuple[DeviceBackend, fake_nvml.InstalledNode | None]:
    """The device backend `name`, and the fake node when running on one (a fake node stands
    in for NVML's library, so it is always read through the nvml backend)."""
    if fake is None:
        return create_backend(name, time.time), None
    import fake_nvml

    node = fake_nvml.install(fake, speed=speed)
    return create_backend("nvml", node.clock.wall_time), node


def _attributor(settings: Settings, node: fake_nvml.InstalledNode | None) -> Attributor:
    """Attribution reading the host's files, or the fake node's when running on one."""
    a = settings.attribution
    rules = compile_rules([(rule.match, rule.set) for rule in a.rules])
    allowlist = set(a.env_allowlist) | rule_env_keys(rules)
    answer_token: Callable[[], object] | None = None
    if node is not None:
        host = node.host
        proc_root, passwd, slurm_dir, pod_logs, socket_path = (
            str(host.proc_root), str(host.passwd_file), str(host.slurm_map_dir), str(host.pod_logs_dir),
            str(host.podresources_socket),
        )  # fmt: skip
        # The fake kubelet runs in this process and can say when its answer changes.
        answer_token = host.server.answer_token
    else:
        proc_root, passwd, slurm_dir, pod_logs, socket_path = (
            settings.proc_root, a.passwd_file, a.slurm_map_dir, a.pod_logs_dir, a.podresources_socket
        )  # fmt: skip
    options = SourceOptions(
        proc_root=proc_root,
        passwd_file=passwd,
        env_allowlist=frozenset(allowlist),
        slurm_map_dir=slurm_dir,
        pod_logs_dir=pod_logs,
        podresources_socket=socket_path,
        kubelet_timeout_s=a.kubelet_timeout,
        kubelet_interval_s=a.kubelet_interval,
        kubelet_stale_after_s=a.kubelet_stale_after,
        kubelet_answer_token=answer_token,
    )
    return Attributor(
        open_sources(options), rules=rules, per_pid=a.per_pid_series, team_from_account=a.team_from_account
    )


def _costing(
    settings: Settings,
    node: fake_nvml.InstalledNode | None,
    ledger_path: str | Path | None,
    clock: Callable[[], float],
    hostname: str,
    *,
    fsync_each_flush: bool = True,
) -> Costing:
    """Prices per GPU (config, instance type, catalogue), the charge limits, and the ledger
    (which records `hostname`, the node name the charges carry)."""
    from agent.ledger.files import unusable
    from agent.ledger.sink import LedgerSink

    catalogue = load_catalogue()
    pricing = settings.pricing
    instance_type = node.scenario.node.instance_type if node is not None else detect_instance_type()

    epochs = pricing.epochs()
    warned: set[str] = set()  # each warning once per run, however often GPUs are priced
    # What to do about an instance type listed with other GPUs: the config's, or the detected one.
    mismatch_hint = (
        "pricing.instance_type names it: correct it, or price these GPUs with pricing.by_model"
        if pricing.instance_type
        else "set pricing.instance_type if the detected one is wrong"
    )

    def prices(snapshot: Snapshot) -> dict[str, Price | None]:
        # A GPU not identified yet (no name, so no model) is priced by what prices the whole
        # node, where that is set (gpu_hourly, the instance type); else it waits for its own.
        gpus = snapshot.gpus
        found = {
            g.uuid: price_schedule(
                epochs,
                model=g.model,
                uuid=g.uuid,
                gpu_count=len(gpus),
                instance_type=instance_type,
                catalogue=catalogue,
            )
            for g in gpus
        }
        for g in gpus:
            if g.discovered and found.get(g.uuid) is None:
                log.warning("no price for GPU %d (%s): set pricing.by_model or pricing.gpu_hourly", g.index, g.model)
        periods = [p for price in found.values() if price is not None for p in (price, *(c for _, c in price.changes))]
        for message in sorted({p.mismatch for p in periods if p.mismatch} - warned):
            warned.add(message)
            log.warning("pricing: %s (%s)", message, mismatch_hint)
        for p in periods:
            if p.source.startswith(NO_SPOT_PRICE) and "spot" not in warned:
                warned.add("spot")
                log.warning("pricing: %s; add the instance type to pricing.spot_hourly", p.source.split(":")[0])
        return found

    # A path that can never hold a ledger is refused now: the daemon would keep every charge in
    # memory, retrying, and lose them all when it stops. (One that cannot be opened yet, its
    # directory missing or its disk read-only, is retried: that can mend.)
    why = unusable(Path(ledger_path)) if ledger_path else None
    if why is not None:
        raise BadInputError(f"gpuledger: ledger {ledger_path}: {why}")
    sink = (
        LedgerSink(
            ledger_path,
            retention_s=settings.ledger.retention,
            clock=clock,
            node=hostname,
            max_pending_rows=settings.ledger.max_pending_rows,
            fsync_each_flush=fsync_each_flush,
        )
        if ledger_path
        else None
    )
    return Costing(
        prices=prices,
        max_interval_s=settings.accounting.max_interval,
        forget_after_s=settings.accounting.forget_after,
        energy_per_kwh=pricing.energy_per_kwh,
        sink=sink,
        flush_interval_s=settings.ledger.flush_interval,
    )
