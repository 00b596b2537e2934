"""The fault matrix: each fault the fake node can produce, run through the real agent (built by
`build_agent` from settings, driven by its own jobs as `simulate` drives them, with a ledger
where the fault can touch it), and each held to the same three promises:

  no crash        the agent keeps polling (`gpuledger_polls_total` grows by one every step) and no
                  stage fails (`gpuledger_stage_failures_total` stays 0, save the one poll that
                  gave up on a hung call: that is how a hang is reported)
  health visible  the fault shows in the metrics, read from the registry: the GPU down with its
                  reason, the driver down, the NVML error counted, the reading absent (never a
                  stale value or 0), the kubelet or the ledger down; and all of it gone again
                  once a transient fault is over
  nothing lost    time is a partition: per GPU, charged + idle + unobserved dollars = price x the
                  run's wall time, in the metrics and in the ledger; a GPU a job holds is never
                  booked idle, a free one never charged; unobserved time carries the fault's
                  reason, for as long as the case works out by hand

Every case runs the same node for two minutes of scenario time, polled every 15 s: three A100s,
GPU 0 running ann's Slurm job at 60%, GPU 1 bob's service at 80% (the GPU the faults hit), GPU 2
free. A transient fault lasts from 0:30 to 1:15 (the polls at 0:30, 0:45 and 1:00 meet it); a
sticky one starts at 0:30 and never ends; a discovery fault starts at 0:00. Every NVML error the
fake knows meets every call the agent makes each poll, and every discovery call, once each:
transient or sticky in turn, so that each error and each call is met both ways.

A case marked xfail(strict) is a bug today; its reason says what is wrong. Strict, so that the
fix shows up as a failure until the mark goes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sqlite3
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.attribution.sources.procfs import ProcessUnreadable, ProcFS
from agent.config import AttributionConfig, LedgerConfig, PricingConfig, Settings, WatchdogConfig
from agent.ledger import store
from agent.model import AgentState
from agent.pipeline import run_on_scenario_time
from fake_nvml.scenario import ERROR_CODES
from tests.helpers import Rig, Sample

PRICE = 3.6  # $/GPU-hour: $0.001 a GPU-second, so seconds read as thousandths of a dollar
STEP_S = 15.0
RUN_S = 120.0
AT_S = 30.0  # a mid-run fault starts here
UNTIL_S = 75.0  # and a transient one ends here
BEFORE_S = 15.0  # a poll before any mid-run fault
DURING_S = 60.0  # a poll inside every fault's window
POLLS = int(RUN_S / STEP_S) + 1  # one at the start, one after each step: 9
WALL = PRICE * RUN_S / 3600  # what each GPU costs over the run: 120 s x $0.001 = $0.12
GPUS = (0, 1, 2)
BUSY = (0, 1)  # the GPUs a job holds the whole run
FAULTED = 1  # the GPU that GPU-scoped faults hit
# The watchdog's budget for a driver call, and the kubelet's: generous, so that a loaded machine
# never makes a slow poll look like a hang, except in the cases about hangs.
CALL_TIMEOUT_S = 5.0
KUBELET_TIMEOUT_S = 2.0
HANG_TIMEOUT_S = 0.5  # the hang cases' call budget
HANG_MS = 1500  # a transient hang: past that budget, short enough for the test to wait out
KUBELET_HANG_TIMEOUT_S = 0.3  # the hanging kubelet's cases wait this long for each answer
LEDGER_FLUSH_S = 15.0  # ledger cases flush after every poll; the others every minute

# NVML's return codes by what they say (nvml.h): the GPU itself is gone (off the bus, or it
# needs a reset), or the library has lost its driver; every other code concerns the one call.
GPU_GONE = frozenset({"GPU_IS_LOST", "GPU_NOT_FOUND", "RESET_REQUIRED"})
DRIVER_GONE = frozenset({"UNINITIALIZED", "DRIVER_NOT_LOADED", "LIB_RM_VERSION_MISMATCH"})
KINDS = tuple(ERROR_CODES)  # every error the fake can return

# What the agent reads every poll: the NVML functions behind each reading (a fault on any of
# them takes it away), and GPU 1's series it feeds.
READINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "utilization": (("nvmlDeviceGetUtilizationRates",), ("gpuledger_gpu_utilization_ratio",)),
    "memory": (
        ("nvmlDeviceGetMemoryInfo",),
        ("gpuledger_gpu_memory_used_bytes", "gpuledger_gpu_memory_total_bytes"),
    ),
    # The agent reads the versioned call where the driver has it, the old one where not.
    "temperature": (
        ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
        ("gpuledger_gpu_temperature_celsius",),
    ),
    # Power is the mean since the previous poll from the energy counter, which a fault on the
    # driver's own power reading leaves alone: the series stays (sampler._mean_power).
    "power": (("nvmlDeviceGetPowerUsage",), ()),
    "energy": (("nvmlDeviceGetTotalEnergyConsumption",), ("gpuledger_gpu_energy_joules_total",)),
    "field values": (
        ("nvmlDeviceGetFieldValues",),
        ("gpuledger_gpu_power_watts", "gpuledger_gpu_energy_joules_total", "gpuledger_gpu_nvlink_up"),
    ),
    "processes": (("nvmlDeviceGetComputeRunningProcesses",), ()),
    "process utilization": (("nvmlDeviceGetProcessUtilization",), ()),
    "nvlink": (("nvmlDeviceGetNvLinkState",), ("gpuledger_gpu_nvlink_up",)),
}
# What discovery asks of each GPU before anything else.
DISCOVERY = {
    "handle": "nvmlDeviceGetHandleByIndex",
    "uuid": "nvmlDeviceGetUUID",
    "name": "nvmlDeviceGetName",
}

# The GPU series a healthy poll shows: after a transient fault every one of them is back.
DEVICE_SERIES = frozenset(
    {
        "gpuledger_gpu_up",
        "gpuledger_gpu_utilization_ratio",
        "gpuledger_gpu_memory_used_bytes",
        "gpuledger_gpu_memory_total_bytes",
        "gpuledger_gpu_temperature_celsius",
        "gpuledger_gpu_power_watts",
        "gpuledger_gpu_energy_joules_total",
        "gpuledger_gpu_nvlink_up",
        "gpuledger_gpu_processes",
    }
)
SERIES = DEVICE_SERIES | {
    "gpuledger_gpu_down_reason",
    "gpuledger_nvml_up",
    "gpuledger_nvml_errors_total",
    "gpuledger_polls_total",
    "gpuledger_stage_failures_total",
    "gpuledger_workload_cost_dollars_total",
    "gpuledger_workload_energy_joules_total",
    "gpuledger_gpu_idle_cost_dollars_total",
    "gpuledger_gpu_unobserved_cost_dollars_total",
    "gpuledger_gpu_unobserved_seconds_total",
    "gpuledger_gpu_unresolved_processes",
    "gpuledger_kubelet_up",
    "gpuledger_ledger_up",
    "gpuledger_ledger_pending_rows",
    "gpuledger_ledger_corrupt_files_total",
    "gpuledger_undiscovered_gpus",
}

ANN = {"pid": 100, "gpus": [0], "sm_util": 60, "memory_mib": 4000, "uid": 1000, "user": "ann",
       "cmdline": "python train.py", "slurm_job": "500"}  # fmt: skip
BOB = {"pid": 101, "gpus": [1], "sm_util": 80, "memory_mib": 4000, "uid": 1001, "user": "bob",
       "cmdline": "python serve.py"}  # fmt: skip
NODE: dict[str, Any] = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "fault-node"},
    "gpus": [{"model": "A100-SXM4-80GB", "count": 3, "nvlink_links": 2}],
    "processes": [ANN, BOB],
}
# Bob's process as a Kubernetes pod's: the kubelet then reports GPU 1 allocated to the pod, so
# its holder is known even while the process list is not.
BOB_POD = {"namespace": "serving", "name": "bob-0", "container": "main", "uid": "7d1c5e2a-0b4f-4c8e-9a6d-3f2e1b0c9d8a"}
AS_POD: dict[str, Any] = {"processes": [ANN, {**BOB, "pod": BOB_POD}]}


# --- a case -------------------------------------------------------------------------------------


@dataclass
class Context:
    """What a case's setup and host-side faults work on."""

    tmp: Path
    monkeypatch: pytest.MonkeyPatch
    threads_before: set[threading.Thread]
    undo: list[Callable[[], object]] = field(default_factory=list)
    rig: Rig | None = None
    # What a case's setup and host functions keep between calls in one run.
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def agent_rig(self) -> Rig:
        assert self.rig is not None, "the agent is not built yet"
        return self.rig


@dataclass(frozen=True)
class Case:
    """One fault, and what the agent must show for it.

    down          GPU -> its down reason at `during`
    driver_down   gpuledger_nvml_up is 0 at `during`
    error         the NVML error gpuledger_nvml_errors_total must count (None: it counts nothing)
    absent        GPU 1's series the fault takes away at `during`
    unobserved    GPU -> {reason: seconds} unobserved by the end (seconds None: some)
    held          GPUs a job holds: charged whenever observed, never idle; the others idle
    known         GPUs the agent can know of (the partition is checked for each)
    ledger        the agent writes a ledger (at `prepare`'s path, else in the case's directory)
    ledger_holds  the ledger has every charge at the end, as the counters do
    prepare       makes the ledger's path (and any fault on it) before the agent is built
    setup         runs once the agent is built, before its first poll
    host          runs after each step's clock advance, before that step's jobs (scenario time)
    check         further assertions of the case's own
    bug           what is wrong today: the case is xfail(strict)
    """

    id: str
    faults: Sequence[Mapping[str, object]] = ()
    transient: bool = True
    down: Mapping[int, str] = field(default_factory=dict)
    driver_down: bool = False
    error: str | None = None
    absent: Sequence[str] = ()
    unobserved: Mapping[int, Mapping[str, float | None]] = field(default_factory=dict)
    held: Sequence[int] = BUSY
    known: Sequence[int] = GPUS
    during: float = DURING_S
    sample_failures: int = 0
    call_timeout_s: float = CALL_TIMEOUT_S
    kubelet_timeout_s: float = KUBELET_TIMEOUT_S
    scenario: Mapping[str, object] = field(default_factory=dict)
    flush_s: float = 60.0
    ledger: bool = False
    ledger_holds: bool = True
    written: bool | None = True  # Agent.close says every charge reached the ledger (None: `check` says)
    prepare: Callable[[Context], Path] | None = None
    setup: Callable[[Context], None] | None = None
    host: Callable[[Context, float], None] | None = None
    check: Callable[[Run], None] | None = None
    bug: str | None = None
    runs: bool = True  # False: the bug makes running it harmful to the machine (xfail, not run)

    def param(self) -> Any:
        marks = [pytest.mark.xfail(strict=True, reason=self.bug, run=self.runs)] if self.bug else []
        return pytest.param(self, id=self.id, marks=marks)


# --- one run ------------------------------------------------------------------------------------


class _Lines(logging.Handler):
    """The run's log lines at WARNING and above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@dataclass
class Run:
    """A case's run: the state each poll published, and what the ledger and the log hold after."""

    rig: Rig
    states: dict[float, AgentState]  # scenario time -> the state its poll published
    healthy: dict[float, bool]  # scenario time -> Pipeline.healthy() right after that poll
    ledger: Path | None
    written: bool  # what Agent.close said: every charge reached the ledger
    in_ledger: dict[int, tuple[float, float, float]] | None  # ledger_by_gpu after the run; None: unreadable
    log: list[str]
    _samples: dict[float, list[Sample]] = field(default_factory=dict)

    def samples(self, t: float) -> list[Sample]:
        if t not in self._samples:
            self._samples[t] = self.rig.samples(self.states[t], SERIES)
        return self._samples[t]

    def find(self, t: float, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [
            (s_labels, value)
            for s_name, s_labels, value in self.samples(t)
            if s_name == name and all(s_labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, t: float, name: str, **labels: str) -> float | None:
        """The one sample `name{labels}` at time t; None when there is none."""
        found = self.find(t, name, **labels)
        assert len(found) <= 1, f"{name}{labels}: {found}"
        return found[0][1] if found else None

    def total(self, t: float, name: str, **labels: str) -> float:
        return sum(value for _labels, value in self.find(t, name, **labels))

    def series(self, t: float) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
        """The GPU series at time t, by name and labels."""
        return {(n, tuple(sorted(labels.items()))) for n, labels, _v in self.samples(t) if n in DEVICE_SERIES}


def run_case(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Run:
    context = Context(tmp_path, monkeypatch, set(threading.enumerate()))
    lines = _Lines()
    logging.getLogger().addHandler(lines)
    try:
        ledger = case.prepare(context) if case.prepare is not None else tmp_path / "ledger.db" if case.ledger else None
        settings = Settings(
            poll_interval=STEP_S,
            pricing=PricingConfig(gpu_hourly=PRICE),
            watchdog=WatchdogConfig(call_timeout=case.call_timeout_s),
            attribution=AttributionConfig(kubelet_timeout=case.kubelet_timeout_s),
            ledger=LedgerConfig(flush_interval=case.flush_s),
        )
        scenario = {**NODE, **case.scenario, "faults": [dict(f) for f in case.faults]}
        rig = context.rig = Rig(scenario, settings=settings, ledger_path=ledger)
        states: dict[float, AgentState] = {}
        healthy: dict[float, bool] = {}

        def advance(seconds: float) -> None:
            rig.node.clock.advance(seconds)
            if case.host is not None:
                case.host(context, rig.node.clock.now())

        def record() -> None:
            now = rig.node.clock.now()
            states[now] = rig.pipeline.state
            healthy[now] = rig.pipeline.healthy()

        try:
            if case.setup is not None:
                case.setup(context)
            steps = run_on_scenario_time(rig.pipeline.jobs(), advance, RUN_S, STEP_S, on_step=record)
        finally:
            written = rig.agent.close()
        in_ledger = None
        if ledger is not None:
            with contextlib.suppress(sqlite3.Error):
                in_ledger = ledger_by_gpu(ledger)
    finally:
        for undo in reversed(context.undo):
            undo()
        logging.getLogger().removeHandler(lines)
    assert steps == POLLS - 1
    return Run(rig, states, healthy, ledger, written, in_ledger, lines.lines)


Series = frozenset[tuple[str, tuple[tuple[str, str], ...]]]


@pytest.fixture(scope="module")
def fault_free_series(tmp_path_factory: pytest.TempPathFactory) -> Series:
    """The GPU series a run without faults shows at its end (name and labels)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        run = run_case(Case("no fault"), tmp_path_factory.mktemp("no-fault"), monkeypatch)
    return frozenset(run.series(RUN_S))


# --- the promises -------------------------------------------------------------------------------


def assert_no_crash(run: Run, case: Case) -> None:
    # One poll at the start and one a step, and each published its state.
    assert [run.states[t].health.polls_total for t in sorted(run.states)] == list(range(2, POLLS + 1))
    assert run.value(RUN_S, "gpuledger_polls_total") == POLLS
    failures = {labels["stage"]: v for labels, v in run.find(RUN_S, "gpuledger_stage_failures_total")}
    assert failures == {"sample": case.sample_failures, "attribute": 0, "account": 0, "rules": 0, "publish": 0}
    if case.written is not None:
        assert run.written is case.written


def assert_health(run: Run, case: Case, fault_free: Series) -> None:
    at = case.during
    down: dict[int, list[str]] = {}
    for labels, up in run.find(at, "gpuledger_gpu_up"):
        if not up:
            reasons = run.find(at, "gpuledger_gpu_down_reason", gpu=labels["gpu"])
            down[int(labels["gpu"])] = [r["reason"] for r, _v in reasons]
    assert down == {gpu: [reason] for gpu, reason in case.down.items()}
    assert run.value(at, "gpuledger_nvml_up") == (0.0 if case.driver_down else 1.0)
    if case.error is not None:
        assert run.total(RUN_S, "gpuledger_nvml_errors_total", error=case.error) > 0
    else:
        assert run.find(RUN_S, "gpuledger_nvml_errors_total") == []
    for name in case.absent:
        # Absent while the fault lasts, never a stale value or 0; there before it.
        assert run.find(at, name, gpu=str(FAULTED)) == [], name
        assert run.find(BEFORE_S, name, gpu=str(FAULTED)) != [], name
    if case.transient:
        # Over by the end: every GPU up, and every series a run without faults shows is back.
        assert run.value(RUN_S, "gpuledger_nvml_up") == 1.0
        assert [v for _l, v in run.find(RUN_S, "gpuledger_gpu_up")] == [1.0] * len(case.known)
        assert fault_free - run.series(RUN_S) == set()
    if case.check is not None:
        case.check(run)


def assert_nothing_lost(run: Run, case: Case) -> None:
    """Per GPU: charged + idle + unobserved = $0.12, in the metrics and in the ledger, and the
    unobserved seconds by reason as the case works them out."""
    holds = run.ledger is not None and case.ledger_holds
    in_ledger = run.in_ledger or {}
    if holds:
        assert run.in_ledger is not None, "the ledger cannot be read"
    assert {int(labels["gpu"]) for labels, _v in run.find(RUN_S, "gpuledger_gpu_up")} == set(case.known)
    for gpu in case.known:
        label = str(gpu)
        charged = run.total(RUN_S, "gpuledger_workload_cost_dollars_total", gpu=label)
        idle = run.total(RUN_S, "gpuledger_gpu_idle_cost_dollars_total", gpu=label)
        unobserved = run.total(RUN_S, "gpuledger_gpu_unobserved_cost_dollars_total", gpu=label)
        assert charged + idle + unobserved == pytest.approx(WALL), f"GPU {gpu}: {charged}, {idle}, {unobserved}"
        # Summed over the GPU's uuids: one it could not be identified by, then its own.
        seen: dict[str, float] = {}
        for labels, seconds in run.find(RUN_S, "gpuledger_gpu_unobserved_seconds_total", gpu=label):
            if seconds:
                seen[labels["reason"]] = seen.get(labels["reason"], 0.0) + seconds
        expected = case.unobserved.get(gpu, {})
        assert set(seen) == set(expected), f"GPU {gpu}: unobserved {seen}"
        for reason, seconds in expected.items():
            if seconds is not None:
                assert seen[reason] == pytest.approx(seconds), f"GPU {gpu}: {reason}"
        # What was observed went to the job holding the GPU, or to idle where none did.
        observed = WALL - unobserved
        if gpu in case.held:
            assert (charged, idle) == pytest.approx((observed, 0.0)), f"GPU {gpu}"
        else:
            assert (charged, idle) == pytest.approx((0.0, observed)), f"GPU {gpu}"
        if holds:
            assert in_ledger.get(gpu) == pytest.approx((charged, idle, unobserved)), f"GPU {gpu} in the ledger"


def ledger_by_gpu(path: Path) -> dict[int, tuple[float, float, float]]:
    """(charged, idle, unobserved) dollars per GPU index in the ledger: its hourly rows summed."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        charged = dict(conn.execute("SELECT gpu, sum(dollars) FROM workload_hours GROUP BY gpu").fetchall())
        rows = conn.execute("SELECT gpu, sum(idle_dollars), sum(unobserved_dollars) FROM gpu_hours GROUP BY gpu")
        return {gpu: (charged.get(gpu, 0.0), idle, unobserved) for gpu, idle, unobserved in rows.fetchall()}


# --- NVML errors --------------------------------------------------------------------------------


def every_gpu(unobserved: Mapping[str, float | None]) -> dict[int, Mapping[str, float | None]]:
    """The same unobserved time on every GPU (one mapping shared: it is never changed)."""
    return dict.fromkeys(GPUS, unobserved)


def _window(transient: bool, at: str = "30s") -> dict[str, object]:
    return {"at": at, "until": "75s"} if transient else {"at": at}


def _how(transient: bool) -> str:
    return "transient" if transient else "sticky"


def transient_for(kind: str, call_index: int) -> bool:
    """Whether `kind` on the call-th call of its table is transient or sticky: alternating, so
    that every kind is met both ways and every call both ways, each (kind, call) pair once."""
    return (KINDS.index(kind) + call_index) % 2 == 0


def call_case(reading: str, kind: str) -> Case:
    """`kind` from every call behind `reading`, on GPU 1, from 0:30 (to 1:15 when transient)."""
    transient = transient_for(kind, list(READINGS).index(reading))
    calls, series = READINGS[reading]
    faults = [{**_window(transient), "gpu": FAULTED, "call": call, "error": kind} for call in calls]
    name = f"{reading}/{kind}/{_how(transient)}"
    if kind in GPU_GONE:
        # GPU 1 is down from the poll at 0:30 and retried with backoff (5 s, doubling). Transient:
        # it fails again at 0:45 and 1:00, waits at 1:15 (next try 1:20) and reads at 1:30; the
        # intervals ending 0:30 to 1:30 are unobserved, 5 x 15 s = 75 s. Sticky: 0:15 to 2:00, 105 s.
        return Case(
            name, faults, transient, down={FAULTED: kind}, error=kind,
            unobserved={FAULTED: {kind: 75.0 if transient else 105.0}},
        )  # fmt: skip
    if kind in DRIVER_GONE:
        # The driver reads as gone: every GPU is down from the poll at 0:30, and the library is
        # re-initialised with backoff (5 s, doubling, back to 5 s once an init succeeds).
        # Transient: at 0:45 and 1:00 the init succeeds and the poll fails again, at 1:15 the fault
        # is over; unobserved 0:15 to 1:15, 4 x 15 s = 60 s a GPU. Field values are read at
        # discovery too (the NVLink count), so there the init itself fails at 0:45 (next 0:55) and
        # 1:00 (next 1:20), waits at 1:15 and succeeds at 1:30: 75 s. Sticky: 0:15 to 2:00, 105 s.
        # NVLink: the re-discovery at 0:45 and 1:00 cannot read GPU 1's link count (the field
        # answers with the error) and keeps the count it read before; the poll then fails.
        seconds = (75.0 if reading == "field values" else 60.0) if transient else 105.0
        return Case(
            name, faults, transient, down=dict.fromkeys(GPUS, kind), driver_down=True, error=kind,
            unobserved=every_gpu({kind: seconds}),
        )  # fmt: skip
    if reading == "processes":
        # Who holds GPU 1 is unknown at the polls that meet the fault: transient 0:30, 0:45, 1:00,
        # 3 x 15 s = 45 s; sticky 0:30 to 2:00, 7 x 15 s = 105 s. Unobserved, never idle.
        seconds = 45.0 if transient else 105.0
        return Case(
            name, faults, transient, error=kind, unobserved={FAULTED: {"processes_unreadable": seconds}},
            **growing_buffer(kind, transient),
        )  # fmt: skip
    if reading == "process utilization" and kind == "NOT_FOUND":
        # NVML's answer when no process has run since the last sample: no error, nothing to show.
        return Case(name, faults, transient)
    if reading == "field values" and kind in ("NOT_SUPPORTED", "FUNCTION_NOT_FOUND"):
        # A driver without batched reads: every value is read by its own call instead.
        return Case(name, faults, transient)
    if reading == "process utilization":
        return Case(name, faults, transient, error=kind, **growing_buffer(kind, transient))
    return Case(name, faults, transient, error=kind, absent=series)


def growing_buffer(kind: str, transient: bool) -> dict[str, Any]:
    """The process calls answer into a buffer the agent keeps, and grows when the driver says
    INSUFFICIENT_SIZE, up to a bound (see
    test_a_driver_that_keeps_saying_too_small_cannot_grow_the_agent_without_bound)."""
    # Fixed: the buffers stop growing at agent/devices/nvml.py's MAX_PROCESSES / MAX_SAMPLES.
    return {}


def discovery_case(what: str, kind: str) -> Case:
    """`kind` from GPU 1's `what` call from the start (to 1:15 when transient). GPUs 0 and 2
    are polled throughout; GPU 1 is down with the error until it is discovered, its time
    unobserved with that reason, under its provisional uuid at the node's price
    ($3.6/h from pricing.gpu_hourly: its model is unknown until then)."""
    transient = transient_for(kind, list(DISCOVERY).index(what))
    faults = [{**_window(transient, at="0s"), "gpu": FAULTED, "call": DISCOVERY[what], "error": kind}]
    name = f"discovery {what}/{kind}/{_how(transient)}"
    # Retried with backoff from the failure at start (5 s, doubling): at 0:15 (next 0:25), 0:30
    # (next 0:50) and 1:00 (next 1:40); transient, the fault is over at 1:15 and the try at 1:45
    # succeeds: unobserved 0:00 to 1:45, 105 s; sticky, the whole run, 120 s.
    seconds = 105.0 if transient else RUN_S
    if kind in DRIVER_GONE:
        # Discovery as a whole fails (the library is re-initialised on that schedule); NVML's
        # device count names the three GPUs meanwhile, down for the error, so each one's time
        # is booked from the start.
        return Case(
            name, faults, transient, down=dict.fromkeys(GPUS, kind), driver_down=True, error=kind,
            unobserved=every_gpu({kind: seconds}),
        )  # fmt: skip
    return Case(name, faults, transient, down={FAULTED: kind}, error=kind, unobserved={FAULTED: {kind: seconds}})


# --- hangs ----------------------------------------------------------------------------------------


def wait_for_stuck_calls(context: Context, now: float) -> None:
    """At 1:15, when the transient hang is over, let the call stuck since 0:30 return (it sleeps
    HANG_MS of real time), so the poll at 1:15 finds it gone. The poll threads started by this
    case, bar the one now taking calls, are the stuck ones."""
    if now != UNTIL_S:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        new = [
            t for t in threading.enumerate() if t.name.startswith("gpuledger-poll") and t not in context.threads_before
        ]
        if len(new) <= 1:
            return
        time.sleep(0.05)
    raise AssertionError("the stuck driver call never returned")


def hang_check(transient: bool) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        # /healthz fails while the call is stuck (at once, not after some polls).
        assert (run.healthy[45.0], run.healthy[60.0], run.healthy[RUN_S]) == (False, False, transient)

    return check


def hang_cases() -> list[Case]:
    # Every call on GPU 1 takes HANG_MS from 0:30 (an hour when sticky). The poll at 0:30 gives up
    # after the call budget and publishes nothing (the sample stage's one failure); later polls skip
    # GPU 1 while its call is stuck. Unobserved: 0:15 to 0:45 (30 s, one interval since no poll
    # finished at 0:30), 0:45 to 1:00 and, transient, 1:00 to 1:15 (GPU 1 reads again at 1:15):
    # 60 s; sticky, to 2:00: 30 s + 5 x 15 s = 105 s. GPUs 0 and 2 are read on time throughout.
    return [
        Case(
            f"hang/GPU 1/{_how(transient)}",
            [{**_window(transient), "gpu": FAULTED, "latency_ms": HANG_MS if transient else 3_600_000}],
            transient,
            down={FAULTED: "TIMEOUT"},
            unobserved={FAULTED: {"TIMEOUT": 60.0 if transient else 105.0}},
            sample_failures=1,
            call_timeout_s=HANG_TIMEOUT_S,
            host=wait_for_stuck_calls if transient else None,
            check=hang_check(transient),
        )
        for transient in (True, False)
    ]


# --- the driver and the GPU as a whole ------------------------------------------------------------


def node_cases() -> list[Case]:
    cases = [Case("no fault")]
    for transient in (True, False):
        how = _how(transient)
        # The driver goes away at 0:30 for every call. Re-initialisation is tried with backoff
        # (5 s, doubling, reset by a success): transient, it fails at 0:45 and 1:00 (next 1:20),
        # waits at 1:15 and succeeds at 1:30; unobserved 0:15 to 1:30, 5 x 15 s = 75 s per GPU.
        # Sticky: 0:15 to 2:00, 105 s.
        cases.append(
            Case(
                f"driver lost mid-run/{how}",
                [{**_window(transient), "error": "DRIVER_NOT_LOADED"}],
                transient,
                down=dict.fromkeys(GPUS, "DRIVER_NOT_LOADED"),
                driver_down=True,
                error="DRIVER_NOT_LOADED",
                unobserved=every_gpu({"DRIVER_NOT_LOADED": 75.0 if transient else 105.0}),
            )
        )
        # GPU 1 falls off the bus (every call on it fails): as a lost GPU above, 75 s or 105 s.
        cases.append(
            Case(
                f"GPU 1 lost/{how}",
                [{**_window(transient), "gpu": FAULTED, "error": "GPU_IS_LOST"}],
                transient,
                down={FAULTED: "GPU_IS_LOST"},
                error="GPU_IS_LOST",
                unobserved={FAULTED: {"GPU_IS_LOST": 75.0 if transient else 105.0}},
            )
        )
        cases.append(
            Case(
                f"NVLink 1 of GPU 1 down/{how}",
                [{**_window(transient), "gpu": FAULTED, "nvlink_down": [1]}],
                transient,
                check=nvlink_down_check(transient),
            )
        )
    # Xid 79 (fallen off the bus) and every call lost from then on, as in the gpu-lost scenario.
    cases.append(
        Case(
            "GPU 1 Xid 79 and lost/sticky",
            [{"at": "30s", "gpu": FAULTED, "xid": 79}, {"at": "30s", "gpu": FAULTED, "error": "GPU_IS_LOST"}],
            transient=False,
            down={FAULTED: "GPU_IS_LOST"},
            error="GPU_IS_LOST",
            unobserved={FAULTED: {"GPU_IS_LOST": 105.0}},
        )
    )
    # The driver is not loaded when the agent starts, and loads at 1:15. The GPUs are on the PCI
    # bus all along: sysfs names them, so they show down for the missing driver from the start.
    # nvmlInit is retried with backoff (5 s, doubling): it fails at 0:00 (next 0:05), 0:15 (next
    # 0:25), 0:30 (next 0:50) and 1:00 (next 1:40), and succeeds at 1:45: 0:00 to 1:45 is
    # unobserved, 105 s a GPU; the jobs pay for the last 15 s.
    driver_absent = {"at": "0s", "until": "75s", "error": "DRIVER_NOT_LOADED"}
    cases.append(
        Case(
            "driver absent then present",
            [driver_absent],
            down=dict.fromkeys(GPUS, "DRIVER_NOT_LOADED"),
            driver_down=True,
            error="DRIVER_NOT_LOADED",
            unobserved=every_gpu({"DRIVER_NOT_LOADED": 105.0}),
            check=undiscovered_check({BEFORE_S: 3, DURING_S: 3, RUN_S: 0}),
        )
    )
    # The same on a host whose PCI bus cannot be read either (no sysfs): nothing names a GPU
    # until the driver does at 1:45, and then the 105 s before are booked to each GPU it names.
    cases.append(
        Case(
            "driver absent then present, no PCI view",
            [driver_absent],
            driver_down=True,
            error="DRIVER_NOT_LOADED",
            unobserved=every_gpu({"DRIVER_NOT_LOADED": 105.0}),
            setup=hide_pci_bus,
            check=undiscovered_check({BEFORE_S: 0, DURING_S: 0, RUN_S: 0}),
        )
    )
    # Never loaded: the agent runs and says so, and the GPUs the PCI bus shows are down for it,
    # their whole run unobserved (120 s each).
    cases.append(
        Case(
            "driver never present",
            [{"at": "0s", "error": "DRIVER_NOT_LOADED"}],
            transient=False,
            down=dict.fromkeys(GPUS, "DRIVER_NOT_LOADED"),
            driver_down=True,
            error="DRIVER_NOT_LOADED",
            unobserved=every_gpu({"DRIVER_NOT_LOADED": RUN_S}),
            check=never_up_check,
        )
    )
    # Never loaded, and no PCI view: nothing can be known of the GPUs.
    cases.append(
        Case(
            "driver never present, no PCI view",
            [{"at": "0s", "error": "DRIVER_NOT_LOADED"}],
            transient=False,
            driver_down=True,
            error="DRIVER_NOT_LOADED",
            known=(),
            setup=hide_pci_bus,
            check=never_up_check,
        )
    )
    processes_fault = {
        **_window(True),
        "gpu": FAULTED,
        "call": "nvmlDeviceGetComputeRunningProcesses",
        "error": "UNKNOWN",
    }
    # Bob's pod holds GPU 1 by the kubelet's allocation: while the process list cannot be read
    # the allocation still names the holder, so nothing is unobserved and the pod pays throughout.
    cases.append(
        Case(
            "processes of an allocated GPU/UNKNOWN/transient",
            [processes_fault],
            scenario=AS_POD,
            error="UNKNOWN",
            check=lambda run: pod_paid_check(run, "bob-0", WALL),
        )
    )
    # How many processes run on GPU 1 is unknown while its list cannot be read.
    cases.append(
        Case(
            "processes unreadable: the count is absent/UNKNOWN/transient",
            [processes_fault],
            error="UNKNOWN",
            absent=("gpuledger_gpu_processes",),
            unobserved={FAULTED: {"processes_unreadable": 45.0}},  # as processes/*/transient
        )
    )
    # GPU 1's energy counter cannot be read at 0:30, 0:45 and 1:00, and reads again at 1:15: the
    # counter went on counting meanwhile, so the run's energy is all there, bob's: 331 W (55 W idle
    # + 80% of the 345 W up to the 400 W limit) x 120 s = 39,720 J.
    cases.append(
        Case(
            "energy unreadable: its joules still counted/UNKNOWN/transient",
            [{**_window(True), "gpu": FAULTED, "call": "nvmlDeviceGetTotalEnergyConsumption", "error": "UNKNOWN"}],
            error="UNKNOWN",
            absent=("gpuledger_gpu_energy_joules_total",),
            check=energy_check,
        )
    )
    return [replace(case, ledger=True) for case in cases]


def energy_check(run: Run) -> None:
    assert run.total(RUN_S, "gpuledger_workload_energy_joules_total", gpu="1", user="bob") == pytest.approx(39_720)


def pod_paid_check(run: Run, pod: str, dollars: float) -> None:
    assert run.total(RUN_S, "gpuledger_workload_cost_dollars_total", pod=pod) == pytest.approx(dollars)


def nvlink_down_check(transient: bool) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        links = {labels["link"]: v for labels, v in run.find(DURING_S, "gpuledger_gpu_nvlink_up", gpu=str(FAULTED))}
        assert links == {"0": 1.0, "1": 0.0}
        end = {labels["link"]: v for labels, v in run.find(RUN_S, "gpuledger_gpu_nvlink_up", gpu=str(FAULTED))}
        assert end == {"0": 1.0, "1": 1.0 if transient else 0.0}

    return check


def never_up_check(run: Run) -> None:
    assert {t: run.value(t, "gpuledger_nvml_up") for t in run.states} == dict.fromkeys(run.states, 0.0)
    assert not any(run.healthy.values())


def hide_pci_bus(context: Context) -> None:
    """A host whose sysfs cannot be read: the GPUs on its PCI bus are not to be seen."""
    shutil.rmtree(context.agent_rig.node.host.sys_root)


def undiscovered_check(expected: Mapping[float, int]) -> Callable[[Run], None]:
    """gpuledger_undiscovered_gpus at the given times: the GPUs the node has that discovery
    has not identified (the agent is degraded while there are any)."""

    def check(run: Run) -> None:
        assert {t: run.value(t, "gpuledger_undiscovered_gpus") for t in expected} == expected

    return check


# --- the host: procfs and the kubelet ---------------------------------------------------------------


class DeniedProcFS(ProcFS):
    """procfs where some processes' files may not be read, as the kernel answers an agent that
    lacks the privilege (hidepid=2 for every file, or no CAP_SYS_PTRACE for `environ`)."""

    def __init__(self, procfs: ProcFS, files: frozenset[str] | None) -> None:
        super().__init__(procfs.root, env_allowlist=procfs.env_allowlist)
        self.files = files  # None: every file
        self.denied: set[int] = set()

    def _read(self, pid: int, name: str) -> bytes:
        if pid in self.denied and (self.files is None or name in self.files):
            raise ProcessUnreadable(f"pid {pid}: permission denied")
        return super()._read(pid, name)


def deny(pids: Sequence[int], files: frozenset[str] | None, transient: bool, at: float = AT_S) -> Case:
    """From `at` (to 1:15 when transient) the agent may not read `files` (None: any file) of the
    processes `pids`."""

    def setup(context: Context) -> None:
        processes = context.agent_rig.processes
        processes.procfs = context.scratch["procfs"] = DeniedProcFS(processes.procfs, files)
        if at == 0:
            processes.procfs.denied.update(pids)

    def host(context: Context, now: float) -> None:
        procfs: DeniedProcFS = context.scratch["procfs"]
        if now == at:
            procfs.denied.update(pids)
        if transient and now == UNTIL_S:
            procfs.denied.difference_update(pids)

    if files is None:
        return Case(
            f"procfs denied for bob's process/{_how(transient)}",
            transient=transient,
            setup=setup,
            host=host,
            check=unresolved_check(transient),
        )
    return Case(
        f"procfs {', '.join(sorted(files))} denied for every process/{_how(transient)}",
        transient=transient,
        setup=setup,
        host=host,
        check=still_named_check,
    )


def unresolved_check(transient: bool) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        # GPU 1's process is counted as unresolved while it cannot be read, and still charged
        # (to a workload without labels): the GPU is held, whoever holds it.
        unresolved = [run.value(t, "gpuledger_gpu_unresolved_processes", gpu="1") for t in (BEFORE_S, DURING_S, RUN_S)]
        assert unresolved == [0.0, 1.0, 0.0 if transient else 1.0]
        assert run.total(DURING_S, "gpuledger_workload_cost_dollars_total", gpu="1", user="", pod="") > 0

    return check


def still_named_check(run: Run) -> None:
    # The environment is what a process says of itself; the trusted sources (the Slurm cgroup,
    # the uid) name every owner without it: ann's job all along, bob all along.
    assert run.total(RUN_S, "gpuledger_workload_cost_dollars_total", gpu="0", hpc_job="500") == pytest.approx(WALL)
    assert run.total(RUN_S, "gpuledger_workload_cost_dollars_total", gpu="1", user="bob") == pytest.approx(WALL)


def kubelet_gone(transient: bool) -> Callable[[Context, float], None]:
    """The kubelet stops at 0:30, its socket removed (and starts again at 1:15 when transient)."""

    def host(context: Context, now: float) -> None:
        server = context.agent_rig.node.host.server
        if now == AT_S:
            server.stop()
            assert not os.path.exists(server.socket_path)
        if transient and now == UNTIL_S:
            server.start()

    return host


def kubelet_hanging(transient: bool) -> Callable[[Context, float], None]:
    """The kubelet takes calls from 0:30 and never answers them (until 1:15 when transient)."""

    def host(context: Context, now: float) -> None:
        server = context.agent_rig.node.host.server
        if now == AT_S:
            server.hang(True)
        if transient and now == UNTIL_S:
            server.hang(False)

    return host


def kubelet_cases() -> list[Case]:
    cases = [
        Case(f"kubelet gone/{_how(t)}", transient=t, scenario=AS_POD, host=kubelet_gone(t), check=kubelet_check(t))
        for t in (True, False)
    ]
    cases += [
        Case(
            f"kubelet hanging/{_how(t)}",
            transient=t,
            scenario=AS_POD,
            host=kubelet_hanging(t),
            check=kubelet_check(t),
            kubelet_timeout_s=KUBELET_HANG_TIMEOUT_S,
        )
        for t in (True, False)
    ]
    # GPU 2 allocated to a notebook pod that runs nothing on it: only the kubelet knows it is held.
    # Away for 45 s (0:30 to 1:15), within attribution.kubelet_stale_after (5 min), the kubelet's
    # last allocations stand for it: the notebook pays for GPU 2 throughout, never idle.
    notebook = {"namespace": "research", "name": "notebook-2", "container": "jupyter",
                "uid": "1e2d3c4b-5a69-4788-9a0b-c1d2e3f4a5b6"}  # fmt: skip
    cases.append(
        Case(
            "kubelet gone, GPU 2 allocated without a process/transient",
            scenario={**AS_POD, "allocations": [{"gpus": [2], "pod": notebook}]},
            held=GPUS,
            host=kubelet_gone(True),
            check=kubelet_check(True),
        )
    )
    return cases


def kubelet_check(transient: bool) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        ups = [run.value(t, "gpuledger_kubelet_up") for t in (BEFORE_S, DURING_S, RUN_S)]
        assert ups == [1.0, 0.0, 1.0 if transient else 0.0]
        # Bob's pod is still named while the kubelet is away, from its process's cgroup.
        pod_paid_check(run, "bob-0", WALL)

    return check


# --- the ledger ---------------------------------------------------------------------------------


def immutable(path: Path, *, opened: bool = False) -> Callable[[], object]:
    """Make `path` one this process cannot write or create files in (chattr +i: root ignores
    modes; mode 0555 for anyone else); the undo. Skips where neither works, and for anyone but
    root when the file is `opened` already (a mode does not stop writes through an open file)."""
    if os.geteuid() != 0:
        if opened:
            pytest.skip("a mode does not stop writes to a file already open; chattr +i needs root")
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        return lambda: path.chmod(mode)
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], check=False).returncode:
        pytest.skip("root, and no chattr +i here: nothing root cannot write")
    return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)


CENT = 0.01  # the lost-charges line rounds its dollars to cents


def lost_line(run: Run) -> tuple[int, float]:
    """(rows, dollars) of the one error line saying what never reached the ledger."""
    [line] = [line for line in run.log if "that could not be written" in line]
    found = re.search(r"with (\d+) hourly rows \(\$([0-9.]+)\) that could not be written", line)
    assert found is not None, line
    return int(found.group(1)), float(found.group(2))


def ledger_up_check(down_at: Sequence[float], up_at: Sequence[float]) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        assert [run.value(t, "gpuledger_ledger_up") for t in down_at] == [0.0] * len(down_at)
        assert [run.value(t, "gpuledger_ledger_up") for t in up_at] == [1.0] * len(up_at)

    return check


def blocked_directory(transient: bool) -> Case:
    """A regular file where the ledger's directory should be (it cannot be created); removed
    at 1:15 when transient."""

    def prepare(context: Context) -> Path:
        (context.tmp / "state").write_text("not a directory")
        return context.tmp / "state" / "ledger.db"

    def host(context: Context, now: float) -> None:
        if transient and now == UNTIL_S:
            (context.tmp / "state").unlink()

    def never_opened(run: Run) -> None:
        ledger_up_check((BEFORE_S, DURING_S, RUN_S), ())(run)
        # One line at the end says what never reached the ledger: the whole run, 3 GPUs x $0.12
        # = $0.36, in one hour's rows: a row per GPU and one per job (ann, bob), 5.
        assert lost_line(run) == pytest.approx((5, 0.36))

    if transient:
        # The flush at 1:15 opens it: ledger_up 0 until the poll at 1:15 publishes, 1 from 1:30.
        return Case(
            "ledger directory blocked/transient", prepare=prepare, host=host, flush_s=LEDGER_FLUSH_S,
            check=ledger_up_check((BEFORE_S, DURING_S, UNTIL_S), (90.0, RUN_S)),
        )  # fmt: skip
    return Case(
        "ledger directory blocked/sticky", transient=False, prepare=prepare, flush_s=LEDGER_FLUSH_S,
        ledger_holds=False, written=False, check=never_opened,
    )  # fmt: skip


def read_only_at_start() -> Case:
    """The ledger's directory may not be written when the agent starts; it may from 1:15."""

    def prepare(context: Context) -> Path:
        directory = context.tmp / "ro"
        directory.mkdir()
        context.undo.append(immutable(directory))
        return directory / "ledger.db"

    def host(context: Context, now: float) -> None:
        if now == UNTIL_S:
            context.undo.pop()()

    return Case(
        "ledger read-only at start/transient", prepare=prepare, host=host, flush_s=LEDGER_FLUSH_S,
        check=ledger_up_check((BEFORE_S, DURING_S, UNTIL_S), (90.0, RUN_S)),
    )  # fmt: skip


def read_only_mid_run(transient: bool) -> Case:
    """From 0:30 the ledger file, its WAL and its directory may not be written (to 1:15)."""

    def host(context: Context, now: float) -> None:
        ledger = context.tmp / "ledger.db"
        if now == AT_S:
            context.undo += [immutable(path, opened=True) for path in (ledger, Path(f"{ledger}-wal"), context.tmp)]
        if transient and now == UNTIL_S:
            while context.undo:
                context.undo.pop()()

    if transient:
        # The flushes at 0:30, 0:45 and 1:00 fail; the one at 1:15 writes what they kept.
        return Case(
            "ledger read-only mid-run/transient", host=host, flush_s=LEDGER_FLUSH_S,
            check=ledger_up_check((45.0, DURING_S, UNTIL_S), (BEFORE_S, 90.0, RUN_S)),
        )  # fmt: skip

    def check(run: Run) -> None:
        ledger_up_check((45.0, DURING_S, RUN_S), (BEFORE_S,))(run)
        # The flush at 0:15 was the last to work: 0:15 to 2:00 never reached the file, 105 s x
        # 3 GPUs x $0.001 = $0.315, in 5 rows (one hour: 3 GPUs, 2 jobs); the file has 0:00-0:15.
        assert lost_line(run) == pytest.approx((5, 0.315), abs=CENT)
        assert run.in_ledger is not None
        assert {gpu: sum(v) for gpu, v in run.in_ledger.items()} == dict.fromkeys(GPUS, pytest.approx(0.015))

    return Case(
        "ledger read-only mid-run/sticky", transient=False, host=host, flush_s=LEDGER_FLUSH_S,
        ledger_holds=False, written=False, check=check,
    )  # fmt: skip


class _FullConnection:
    """A ledger connection on a disk that fills up: while `disk_full` is set, every write fails
    with SQLITE_FULL, as SQLite reports ENOSPC; everything else is the real connection's."""

    def __init__(self, conn: sqlite3.Connection, disk_full: threading.Event) -> None:
        self._conn = conn
        self._disk_full = disk_full

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        if self._disk_full.is_set():
            error = sqlite3.OperationalError("database or disk is full")
            error.sqlite_errorcode = 13  # SQLITE_FULL, as sqlite3 sets it on the errors it raises
            error.sqlite_errorname = "SQLITE_FULL"
            raise error
        return self._conn.executemany(sql, rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def disk_full_connection(transient: bool) -> Case:
    """The ledger's connection answers SQLITE_FULL to every write from 0:30 (to 1:15)."""

    def prepare(context: Context) -> Path:
        real = store.open_file
        disk_full = context.scratch["disk full"] = threading.Event()

        def open_file(*args: Any, **kwargs: Any) -> Any:
            return _FullConnection(real(*args, **kwargs), disk_full)

        context.monkeypatch.setattr(store, "open_file", open_file)
        return context.tmp / "ledger.db"

    def host(context: Context, now: float) -> None:
        disk_full: threading.Event = context.scratch["disk full"]
        if now == AT_S:
            disk_full.set()
        if transient and now == UNTIL_S:
            disk_full.clear()

    return full_case("ledger full (SQLITE_FULL)", transient, prepare, host)


def full_case(
    name: str, transient: bool, prepare: Callable[[Context], Path], host: Callable[[Context, float], None]
) -> Case:
    if transient:
        return Case(
            f"{name}/transient", prepare=prepare, host=host, flush_s=LEDGER_FLUSH_S,
            check=ledger_up_check((45.0, DURING_S, UNTIL_S), (BEFORE_S, 90.0, RUN_S)),
        )  # fmt: skip

    def check(run: Run) -> None:
        ledger_up_check((45.0, DURING_S, RUN_S), (BEFORE_S,))(run)
        # As read-only: 0:15 to 2:00 is kept in memory and lost at exit, in one line.
        assert lost_line(run) == pytest.approx((5, 0.315), abs=CENT)
        assert run.value(RUN_S, "gpuledger_ledger_pending_rows") == 5

    return Case(
        f"{name}/sticky", transient=False, prepare=prepare, host=host, flush_s=LEDGER_FLUSH_S,
        ledger_holds=False, written=False, check=check,
    )  # fmt: skip


def tiny_filesystem(transient: bool) -> Case:
    """The ledger on a 1 MiB tmpfs that a filler file fills from 0:30 (and frees at 1:15)."""

    def prepare(context: Context) -> Path:
        mount = context.tmp / "tiny"
        mount.mkdir()
        if (
            os.geteuid() != 0
            or subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, check=False
            ).returncode
        ):
            pytest.skip("cannot mount a tmpfs here (needs root): the SQLITE_FULL cases stand in")
        context.undo.append(lambda: subprocess.run(["umount", "-l", str(mount)], check=False))
        return mount / "ledger.db"

    def host(context: Context, now: float) -> None:
        filler = context.tmp / "tiny" / "filler"
        if now == AT_S:
            with filler.open("wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
                    os.fsync(f.fileno())
        if transient and now == UNTIL_S:
            filler.unlink()

    return full_case("ledger full (a full filesystem)", transient, prepare, host)


def corrupt_mid_run() -> Case:
    """At 0:30 (the file holds 0:00-0:15) a page every flush writes is garbled under the agent."""

    def host(context: Context, now: float) -> None:
        if now != AT_S:
            return
        path = context.tmp / "ledger.db"
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            (page_size,) = other.execute("PRAGMA page_size").fetchone()
            (root,) = other.execute("SELECT rootpage FROM sqlite_schema WHERE name = 'gpu_hours'").fetchone()
            with path.open("r+b") as f:
                f.seek((root - 1) * page_size)
                f.write(b"\xa5" * page_size)
            # A commit from elsewhere, so that the agent does not trust its page cache.
            other.execute("UPDATE ledger_meta SET created_by = created_by")

    def check(run: Run) -> None:
        # The flush at 0:30 meets the corruption: the file is moved aside and ledger_up is 0
        # until the fresh one takes the flush at 0:45, with what the failed flush kept.
        ledger_up_check((45.0,), (BEFORE_S, DURING_S, RUN_S))(run)
        assert run.value(RUN_S, "gpuledger_ledger_corrupt_files_total") == 1
        assert run.ledger is not None
        assert len(list(run.ledger.parent.glob("ledger.db.corrupt-*"))) == 1
        # The fresh ledger holds everything after the last good flush (0:15): 105 s = $0.105 a
        # GPU; the first 15 s are in the file moved aside.
        assert run.in_ledger is not None
        assert {gpu: sum(v) for gpu, v in run.in_ledger.items()} == dict.fromkeys(GPUS, pytest.approx(0.105))

    return Case(
        "ledger corrupted mid-run/transient", host=host, flush_s=LEDGER_FLUSH_S, ledger_holds=False, check=check
    )


def corrupt_at_start() -> Case:
    """A ledger whose pages were garbled while the agent was down."""

    def prepare(context: Context) -> Path:
        path = context.tmp / "ledger.db"
        with store.Ledger(path, node="fault-node", retention_s=None):
            pass
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute("CREATE TABLE ballast (x BLOB)")
            conn.executemany("INSERT INTO ballast VALUES (?)", [(os.urandom(3000),) for _ in range(40)])
            conn.commit()
            (page_size,) = conn.execute("PRAGMA page_size").fetchone()
            (pages,) = conn.execute("PRAGMA page_count").fetchone()
        with path.open("r+b") as f:
            f.seek(pages // 2 * page_size + 100)
            f.write(b"\xa5" * 2000)
        return path

    def check(run: Run) -> None:
        # Moved aside at open: ledger_up 0 until the fresh file takes its first flush (0:15).
        ledger_up_check((BEFORE_S,), (AT_S, RUN_S))(run)
        assert run.value(RUN_S, "gpuledger_ledger_corrupt_files_total") == 1

    return Case("ledger corrupt at start/transient", prepare=prepare, flush_s=LEDGER_FLUSH_S, check=check)


def removed_while_open(what: str) -> Case:
    """At 0:30 the ledger's directory (or the file and its WAL) is deleted under the agent."""

    def host(context: Context, now: float) -> None:
        if now != AT_S:
            return
        if what == "directory":
            shutil.rmtree(context.tmp / "var")
        else:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{context.tmp / 'var' / 'ledger.db'}{suffix}").unlink(missing_ok=True)

    def prepare(context: Context) -> Path:
        return context.tmp / "var" / "ledger.db"

    def check(run: Run) -> None:
        # What came after the deletion is somewhere: in a ledger at the path (0:15-2:00, $0.105
        # a GPU), or said lost at exit, with ledger_up 0.
        if run.in_ledger is not None:
            assert {gpu: sum(v) for gpu, v in run.in_ledger.items()} == dict.fromkeys(GPUS, pytest.approx(0.105))
            assert run.written
        else:
            assert run.value(RUN_S, "gpuledger_ledger_up") == 0.0
            assert lost_line(run)[1] == pytest.approx(0.315, abs=CENT)
            assert not run.written

    return Case(
        f"ledger {what} deleted while open/sticky", transient=False, prepare=prepare, host=host,
        flush_s=LEDGER_FLUSH_S, ledger_holds=False, written=None, check=check,
    )  # fmt: skip


def missing_directory() -> Case:
    """The ledger's directory does not exist yet: the agent creates it, as a daemon whose
    state directory was never made (a fresh node) needs."""

    def check(run: Run) -> None:
        ledger_up_check((), (BEFORE_S, DURING_S, RUN_S))(run)

    return Case(
        "ledger directory missing at start",
        prepare=lambda context: context.tmp / "var" / "lib" / "gpuledger" / "ledger.db",
        flush_s=LEDGER_FLUSH_S,
        check=check,
    )


def ledger_cases() -> list[Case]:
    cases = [
        missing_directory(),
        blocked_directory(True),
        blocked_directory(False),
        read_only_at_start(),
        read_only_mid_run(True),
        read_only_mid_run(False),
        disk_full_connection(True),
        disk_full_connection(False),
        tiny_filesystem(True),
        tiny_filesystem(False),
        corrupt_mid_run(),
        corrupt_at_start(),
        removed_while_open("directory"),
        removed_while_open("file"),
    ]
    return [replace(case, ledger=True) for case in cases]


# --- the matrix ---------------------------------------------------------------------------------


def all_cases() -> list[Case]:
    cases = [
        *node_cases(),
        *[call_case(reading, kind) for reading in READINGS for kind in KINDS],
        *[discovery_case(what, kind) for what in DISCOVERY for kind in KINDS],
        *hang_cases(),
        deny([101], None, transient=True),
        deny([101], None, transient=False),
        deny([100, 101], frozenset({"environ"}), transient=False, at=0),
        *kubelet_cases(),
        *ledger_cases(),
    ]
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return cases


@pytest.mark.parametrize("case", [case.param() for case in all_cases()])
def test_fault(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault_free_series: Series) -> None:
    run = run_case(case, tmp_path, monkeypatch)
    assert_no_crash(run, case)
    assert_health(run, case, fault_free_series)
    assert_nothing_lost(run, case)


def test_the_matrix_covers_what_it_must() -> None:
    cases = all_cases()
    assert len(cases) >= 40
    # (error, call, transient) of every NVML error fault in the matrix
    met = {(f.get("error"), f.get("call"), "until" in f) for case in cases for f in case.faults if f.get("error")}
    for group in ([calls[0] for calls, _series in READINGS.values()], list(DISCOVERY.values())):
        # Every error the fake knows on every call of the group...
        for kind in KINDS:
            for call in group:
                assert {t for k, c, t in met if (k, c) == (kind, call)}, (kind, call)
        # ...each error both transient and sticky, and each call both ways too.
        for kind in KINDS:
            assert {t for k, c, t in met if k == kind and c in group} == {True, False}, kind
        for call in group:
            assert {t for k, c, t in met if c == call} == {True, False}, call


@pytest.mark.parametrize("reading", ["processes", "process utilization"])
def test_a_driver_that_keeps_saying_too_small_cannot_grow_the_agent_without_bound(reading: str) -> None:
    """The sticky INSUFFICIENT_SIZE of the matrix, bounded: four polls of GPU 1's process call
    answering INSUFFICIENT_SIZE without the size it needs. Whatever the agent retries, what it
    holds for one GPU's answer must stay small. Each poll grew the buffer eightfold (x2 + 5, three
    tries): from 64 entries to 64 x 8^4 = 262,144 of 24 or 32 bytes, MiBs, by the fourth; it now
    stops at a bound."""
    call = READINGS[reading][0][0]
    scenario = {**NODE, "faults": [{"at": "0s", "gpu": FAULTED, "call": call, "error": "INSUFFICIENT_SIZE"}]}
    rig = Rig(scenario, settings=Settings(pricing=PricingConfig(gpu_hourly=PRICE)))
    try:
        # A first poll, untraced: what the process allocates once (modules a poll imports the
        # first time, the fake's field plans) is not the agent's answer, and run alone this test
        # counted it (1.06 MB). The buffer is allocated anew at every call, so the four traced
        # polls see it whole.
        rig.poll(STEP_S)
        tracemalloc.start()
        try:
            for _ in range(4):
                rig.poll(STEP_S)
            _now, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        rig.close()
    # A few hundred processes or samples at most: well under 1 MiB.
    assert peak < 2**20


def test_simulate_rides_out_faults_on_every_gpu(tmp_path: Path) -> None:
    """The same node through the `simulate` command, as a process: GPU 0's temperature fails
    from 0:30 on, GPU 1's process list times out from 0:30 to 1:15, GPU 2 falls off the bus at
    1:00. One clean exit, and the dollars add up in the metrics and in the ledger."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.test_cli import gpuledger

    scenario = tmp_path / "faults.yaml"
    faults = [
        {"at": "30s", "gpu": 0, "call": "nvmlDeviceGetTemperatureV", "error": "UNKNOWN"},
        {"at": "30s", "until": "75s", "gpu": 1, "call": "nvmlDeviceGetComputeRunningProcesses", "error": "TIMEOUT"},
        {"at": "60s", "gpu": 2, "error": "GPU_IS_LOST"},
    ]
    scenario.write_text(yaml.safe_dump({**NODE, "faults": faults}))
    metrics, ledger = tmp_path / "metrics.prom", tmp_path / "ledger.db"
    result = gpuledger(
        "simulate", str(scenario), "--for", "2m", "--step", "15s", "--metrics-out", str(metrics),
        "--ledger", str(ledger), env={"GPULEDGER_PRICING__GPU_HOURLY": str(PRICE)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr

    by_gpu: dict[str, dict[str, float]] = {gpu: {} for gpu in "012"}
    for family in text_string_to_metric_families(metrics.read_text()):
        for s in family.samples:
            gpu = s.labels.get("gpu")
            if s.name == "gpuledger_workload_cost_dollars_total" and gpu is not None:
                by_gpu[gpu]["charged"] = by_gpu[gpu].get("charged", 0.0) + s.value
            elif s.name == "gpuledger_gpu_idle_cost_dollars_total" and gpu is not None:
                by_gpu[gpu]["idle"] = s.value
            elif s.name == "gpuledger_gpu_unobserved_cost_dollars_total" and gpu is not None and s.value:
                by_gpu[gpu][s.labels["reason"]] = s.value
            elif s.name == "gpuledger_polls_total":
                assert s.value == POLLS
    assert by_gpu == {
        # GPU 0: charged throughout, $0.12; a temperature it cannot read costs nothing.
        "0": {"charged": pytest.approx(0.12), "idle": 0.0},
        # GPU 1: the polls at 0:30, 0:45 and 1:00 cannot say who holds it: 45 s unobserved,
        # $0.045; the job pays for the other 75 s, $0.075.
        "1": {"charged": pytest.approx(0.075), "idle": 0.0, "processes_unreadable": pytest.approx(0.045)},
        # GPU 2: free to 0:45 ($0.045 idle), lost from the poll at 1:00: 0:45 to 2:00 unobserved,
        # 75 s, $0.075.
        "2": {"idle": pytest.approx(0.045), "GPU_IS_LOST": pytest.approx(0.075)},
    }
    assert ledger_by_gpu(ledger) == {
        0: (pytest.approx(0.12), 0.0, 0.0),
        1: (pytest.approx(0.075), 0.0, pytest.approx(0.045)),
        2: (0.0, pytest.approx(0.045), pytest.approx(0.075)),
    }
