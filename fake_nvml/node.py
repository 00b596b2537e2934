"""The fake node's physics: a scenario clock and the readings each GPU shows at a given time."""

from __future__ import annotations

import bisect
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fake_nvml.health import NodeHealth
from fake_nvml.scenario import Fault, Gpu, Process, Scenario
from fake_nvml.scenario.model import ReadingRow

# How often the fake driver records a per-process utilization sample, in scenario seconds,
# and how many it keeps per process (the real driver keeps a short ring buffer too).
PROCESS_SAMPLE_PERIOD_S = 1.0
PROCESS_SAMPLES_KEPT = 32
# The driver stamps a process's sample when it records that process, not at one instant shared by
# every process on the GPU: one GPU's processes show different sub-second stamps (NVIDIA/go-nvml
# issue 51, Syllo/nvtop issue 110). Each process's stamps sit up to this much before the period's
# end, by its pid; under a millisecond, so a sample still falls in the poll it fell in before.
PROCESS_STAMP_SPREAD_US = 1000
# The device's own utilization samples (nvmlDeviceGetSamples, GPU_UTILIZATION_SAMPLES): one per
# period whether or not anything ran (0 then), and a longer ring than the per-process one.
DEVICE_SAMPLE_PERIOD_S = 1.0
DEVICE_SAMPLES_KEPT = 120
_NONE_DOWN: frozenset[int] = frozenset()
_ROUNDING_S = 1e-6  # far above a float's rounding error at scenario times, far below a sample period
_NO_RUN = (0, 0, 0)  # a run of samples holding none


class ScenarioClock:
    """Scenario time in seconds since t=0. Moves only by `advance`, or at `speed` x real time.

    The monotonic source is injectable so that tests of the speed mode need not sleep.
    """

    def __init__(
        self,
        start_epoch: float,
        speed: float = 0.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.start_epoch = start_epoch
        self._monotonic = monotonic
        self._lock = threading.Lock()  # one writer at a time
        # (scenario seconds at the anchor, the anchor on the monotonic clock, speed): replaced
        # whole by a writer, so a reader needs no lock, only one read of it. Every fake driver
        # call reads the clock.
        self._state = (0.0, monotonic(), speed)

    def now(self) -> float:
        """Scenario seconds since t=0."""
        base_s, anchor, speed = self._state
        if speed:
            return base_s + (self._monotonic() - anchor) * speed
        return base_s

    @property
    def speed(self) -> float:
        """Scenario seconds per real second (0: moved only by `advance`)."""
        return self._state[2]

    def wall_time(self) -> float:
        """Unix time the scenario is at now: what a real node's wall clock would show."""
        return self.start_epoch + self.now()

    def advance(self, seconds: float) -> float:
        """Move scenario time forward; returns the scenario time now (speed mode included)."""
        if seconds < 0:
            raise ValueError("the scenario clock does not run backwards")
        with self._lock:
            base_s, anchor, speed = self._state
            base_s += seconds
            self._state = (base_s, anchor, speed)
            return base_s + (self._monotonic() - anchor) * speed

    def set_speed(self, speed: float) -> None:
        with self._lock:
            now = self._monotonic()
            base_s, anchor, old_speed = self._state
            self._state = (base_s + (now - anchor) * old_speed, now, speed)


@dataclass(frozen=True)
class ProcessOnGpu:
    process: Process
    mig: int | None


@dataclass(frozen=True, slots=True, eq=False)
class GpuState:
    """What a whole GPU shows at scenario time t, and the stretch of time around t in which none
    of it can change (`after` < t < `before`): every reading here is a pure function of (GPU, t)
    that changes only at the GPU's edges (a process starting or ending, a load segment, a fault
    starting or ending, a recorded row), so it is worked out once per stretch rather than for
    every call that asks (a poll asks for utilization a dozen times per GPU). The stretch stops
    _ROUNDING_S short of each edge: an edge is found by a float sum (a process's start plus a
    segment's offset), and the reading by a difference that may round the other way, so a time
    that close to an edge is worked out on its own. A state is replaced, never changed, when
    time leaves its stretch: what is worked out from one (NodeHealth's throttling) is kept
    beside it and known to be stale by the state's identity."""

    after: float
    before: float
    row: ReadingRow | None  # the recorded row in force (None: physics decides)
    running: tuple[Process, ...]  # on any part of the GPU
    utilization: float  # percent
    power_w: float
    temperature_c: float
    memory_used_bytes: int
    memory_used_mib: int  # the running processes' own figures, whatever a recorded row says
    nvlinks_down: frozenset[int]


_NO_STATE = GpuState(0.0, 0.0, None, (), 0.0, 0.0, 0.0, 0, 0, _NONE_DOWN)  # holds for no time at all


class FakeNode:
    """A scenario running on a clock: what NVML (and later procfs) would show at any moment."""

    def __init__(self, scenario: Scenario, clock: ScenarioClock) -> None:
        self.scenario = scenario
        self.clock = clock
        self.calls: Counter[str] = Counter()
        self._by_gpu: list[list[ProcessOnGpu]] = [[] for _ in scenario.gpus]
        for process in scenario.processes:
            for ref in process.gpus:
                # Its figures there: `per_gpu`'s where it gives some for this GPU.
                self._by_gpu[ref.gpu].append(ProcessOnGpu(process.on(ref), ref.mig))
        self._faults_by_gpu: dict[int | None, list[Fault]] = {}
        for fault in scenario.faults:
            self._faults_by_gpu.setdefault(fault.gpu, []).append(fault)
        # Times at which a GPU's utilization may change: integrating power between them is exact.
        self._breakpoints: list[list[float]] = []
        for entries in self._by_gpu:
            points: set[float] = {0.0}
            for entry in entries:
                points.add(entry.process.start_s)
                if entry.process.end_s is not None:
                    points.add(entry.process.end_s)
                points.update(entry.process.start_s + s.at_s for s in entry.process.segments)
            self._breakpoints.append(sorted(points))
        # A recorded trace's readings per GPU (row start times, rows): they stand in for physics.
        self._rows = [([row.at_s for row in gpu.readings], gpu.readings) for gpu in scenario.gpus]
        # Which GPUs' device samples a recorded row's interval mean gives (see _recorded_sample).
        self._interval_recorded = [
            any(row.interval_utilization is not None for row in gpu.readings) for gpu in scenario.gpus
        ]
        self._energy_cache: list[tuple[float, float]] = [(0.0, 0.0) for _ in scenario.gpus]
        self._energy_lock = threading.Lock()
        # Every reading is a pure function of (GPU, t) over a frozen scenario: a MIG instance's
        # processes are kept for the last t asked, a whole GPU's readings for a stretch of time
        # (GpuState), between the edges where any of them can change.
        self._running_memo: dict[tuple[int, int | None], tuple[float, tuple[Process, ...]]] = {}
        self._states = [_NO_STATE for _ in scenario.gpus]
        self._context_memo: dict[tuple[int, str], tuple[GpuState, tuple[tuple[Process, int | None], ...]]] = {}
        self._edges: list[list[float]] = []
        for gpu in scenario.gpus:
            edges = set(self._breakpoints[gpu.index]) | {row.at_s for row in gpu.readings}
            for fault in (*self._faults_by_gpu.get(gpu.index, ()), *self._faults_by_gpu.get(None, ())):
                edges.update(edge for edge in (fault.at_s, fault.until_s) if edge is not None)
            self._edges.append(sorted(edges))
        self._segment_times: dict[int, list[float]] = {}  # id(process) -> its segments' start times
        # The last run of samples found to share one reading, (its first k, the k past it, the
        # reading): per GPU for its device samples (`_device_run`), per id(process) for that
        # process's samples. A poll's samples mostly lie in the run the previous poll's ended in.
        self._device_runs = [_NO_RUN for _ in scenario.gpus]
        self._process_runs: dict[int, tuple[int, int, int]] = {}
        # The faults that can touch a call, per (call, family, gpu): the scenario's faults never
        # change, so each call looks through only its own.
        self._nvlink_faults = {
            gpu: tuple(f for f in faults if f.nvlink_down) for gpu, faults in self._faults_by_gpu.items()
        }
        self._call_faults: dict[tuple[str, str, int | None], tuple[tuple[Fault, ...], tuple[Fault, ...]]] = {}
        # Clocks, throttling, memory errors, PCIe and NVLink counters (fake_nvml/health.py).
        self.health = NodeHealth(self, self._breakpoints)

    # -- time ---------------------------------------------------------------------------------

    def now(self) -> float:
        return self.clock.now()

    # -- processes ----------------------------------------------------------------------------

    def processes_on(self, gpu: int, mig: int | None, t: float) -> tuple[Process, ...]:
        """Processes running on a GPU (mig None: on any part of it) or one MIG instance."""
        if mig is None:
            return self.state(gpu, t).running
        return self._running_on(gpu, mig, t)

    def _running_on(self, gpu: int, mig: int | None, t: float) -> tuple[Process, ...]:
        memo = self._running_memo.get((gpu, mig))
        if memo is not None and memo[0] == t:
            return memo[1]
        running = tuple(
            entry.process
            for entry in self._by_gpu[gpu]
            if entry.process.running_at(t) and (mig is None or entry.mig == mig)
        )
        self._running_memo[(gpu, mig)] = (t, running)
        return running

    def context_entries(self, gpu: int, context: str, t: float) -> tuple[tuple[Process, int | None], ...]:
        """(process, MIG instance or None) of the processes running on the GPU at t that hold a
        context of this kind ("compute", "graphics", "mps"): what a process-list call lists.
        Processes start and end only at the GPU's edges, so it is worked out once per state
        (FakeNode.state) and kind, not for each of the poll's list calls."""
        state = self.state(gpu, t)
        memo = self._context_memo.get((gpu, context))
        if memo is not None and memo[0] is state:  # the state is held here: its id is not reused
            return memo[1]
        found = tuple(
            (entry.process, entry.mig)
            for entry in self._by_gpu[gpu]
            if entry.process.running_at(t) and context in entry.process.contexts
        )
        self._context_memo[(gpu, context)] = (state, found)
        return found

    @staticmethod
    def process_util(process: Process, t: float) -> float:
        return process.sm_util_at(t - process.start_s)

    # -- device readings ----------------------------------------------------------------------

    def reading_row(self, gpu: int, t: float) -> ReadingRow | None:
        """The recorded row in force at t (None: the scenario has none then; physics decides)."""
        times, rows = self._rows[gpu]
        if not rows:
            return None
        i = bisect.bisect_right(times, t)
        return rows[i - 1] if i else None

    def state(self, gpu: int, t: float) -> GpuState:
        """The GPU's readings at t: the state of the stretch t lies in, worked out at the first
        time asked in it (alone, for a time within rounding of an edge)."""
        state = self._states[gpu]
        if state.after < t < state.before:
            return state
        edges = self._edges[gpu]
        i = bisect.bisect_right(edges, t)
        after = edges[i - 1] + _ROUNDING_S if i else -math.inf
        before = edges[i] - _ROUNDING_S if i < len(edges) else math.inf
        state = self._state_at(gpu, t, after, before)
        if after < t < before:
            self._states[gpu] = state  # one object replaces another: readers on other threads need no lock
        return state

    def _state_at(self, gpu: int, t: float, after: float, before: float) -> GpuState:
        row = self.reading_row(gpu, t)
        running = self._running_on(gpu, None, t)
        spec = self.scenario.gpus[gpu]
        if row is not None and row.utilization is not None:
            utilization = row.utilization
        else:
            # Percent of the GPU kept busy: the running processes' sm_util summed, capped at 100.
            utilization = min(100.0, sum(self.process_util(p, t) for p in running))
        if row is not None and row.power_w is not None:
            power_w = row.power_w
        else:
            power_w = spec.idle_power_w + (spec.power_limit_w - spec.idle_power_w) * utilization / 100
        if row is not None and row.temperature_c is not None:
            temperature_c = row.temperature_c
        else:
            temperature_c = spec.idle_temp_c + (spec.max_temp_c - spec.idle_temp_c) * utilization / 100
        if row is not None and row.memory_used_bytes is not None:
            memory_used_bytes = row.memory_used_bytes
        else:
            memory_used_bytes = sum(p.memory_bytes_at(t - p.start_s) for p in running)
        if row is not None and row.nvlink_down is not None:
            nvlinks_down = frozenset(row.nvlink_down)
        else:
            faults = self._nvlink_faults.get(gpu)
            nvlinks_down = _NONE_DOWN
            if faults:
                nvlinks_down = frozenset(link for f in faults if f.active(t) for link in f.nvlink_down)
        memory_used_mib = sum(p.memory_mib for p in running)
        return GpuState(
            after, before, row, running, utilization, power_w, temperature_c, memory_used_bytes, memory_used_mib,
            nvlinks_down,
        )  # fmt: skip

    def utilization(self, gpu: int, t: float) -> float:
        """Percent of the GPU kept busy: the running processes' sm_util summed, capped at 100."""
        return self.state(gpu, t).utilization

    def memory_used_mib(self, gpu: int, mig: int | None, t: float) -> int:
        if mig is None:
            return self.state(gpu, t).memory_used_mib
        return sum(p.memory_mib for p in self._running_on(gpu, mig, t))

    def memory_used_bytes(self, gpu: int, mig: int | None, t: float) -> int:
        """Memory in use: a recorded row's figure, else what the running processes hold now."""
        if mig is None:
            return self.state(gpu, t).memory_used_bytes
        return sum(p.memory_bytes_at(t - p.start_s) for p in self._running_on(gpu, mig, t))

    def power_w(self, gpu: int, t: float) -> float:
        return self.state(gpu, t).power_w

    def temperature_c(self, gpu: int, t: float) -> float:
        return self.state(gpu, t).temperature_c

    def energy_j(self, gpu: int, t: float) -> float:
        """Energy since t=0: the exact integral of power, which is constant between breakpoints."""
        with self._energy_lock:
            cached_t, cached_j = self._energy_cache[gpu]
            if t < cached_t:
                cached_t, cached_j = 0.0, 0.0
            points = self._breakpoints[gpu]
            lo = cached_t
            i = bisect.bisect_right(points, lo)
            energy = cached_j
            while lo < t:
                hi = min(points[i], t) if i < len(points) else t
                energy += self.power_w(gpu, lo) * (hi - lo)
                lo = hi
                i += 1
            self._energy_cache[gpu] = (t, energy)
            return energy

    def power_average_w(self, gpu: int, t: float, window_s: float = 1.0) -> float:
        """Mean power over the last `window_s` (or since t=0): what the driver reports as its
        averaged power (NVML_FI_DEV_POWER_AVERAGE: one second)."""
        lo = max(0.0, t - window_s)
        if t <= lo:
            return self.power_w(gpu, t)
        points = self._breakpoints[gpu]
        i = bisect.bisect_right(points, lo)
        energy, a = 0.0, lo
        while a < t:
            b = min(points[i], t) if i < len(points) else t
            energy += self.power_w(gpu, a) * (b - a)
            a = b
            i += 1
        return energy / (t - lo)

    def energy_mj(self, gpu: int, t: float) -> int:
        """The energy counter as the driver reports it, in whole millijoules."""
        row = self.reading_row(gpu, t)
        if row is not None and row.energy_mj is not None:
            return row.energy_mj
        return int(self.energy_j(gpu, t) * 1000)

    def nvlink_up(self, gpu: int, link: int, t: float) -> bool:
        return link not in self.nvlinks_down(gpu, t)

    def nvlinks_down(self, gpu: int, t: float) -> frozenset[int]:
        """The GPU's links that a fault (or a recorded row) holds down at t."""
        return self.state(gpu, t).nvlinks_down

    def device_samples(self, gpu: int, last_seen_us: int, t: float) -> list[tuple[int, int]]:
        """(timestamp_us, percent) GPU utilization samples newer than `last_seen_us`.

        Derived as the per-process samples are: at each DEVICE_SAMPLE_PERIOD_S of scenario time,
        the whole percents of the processes running then, summed and capped at 100. Unlike the
        per-process ones, a period with no work has its sample too (0%), and a process that has
        ended still shows in the samples of the periods it ran. Only the newest
        DEVICE_SAMPLES_KEPT survive. Where a recorded row gives the interval's mean
        (`interval_utilization`), the samples of that interval give it instead (`_recorded_sample`).
        """
        return list(zip(*self.device_sample_columns(gpu, last_seen_us, t), strict=True))

    def device_sample_columns(self, gpu: int, last_seen_us: int, t: float) -> tuple[list[int], list[int]]:
        """`device_samples` as two columns, (time stamps, percents)."""
        start_epoch = self.clock.start_epoch
        newest_k = int(t // DEVICE_SAMPLE_PERIOD_S)
        unseen_k = math.floor((last_seen_us / 1_000_000 - start_epoch) / DEVICE_SAMPLE_PERIOD_S)
        first_k = max(newest_k - DEVICE_SAMPLES_KEPT + 1, unseen_k, 0)
        stamps = self._sample_stamps(first_k, newest_k + 1, DEVICE_SAMPLE_PERIOD_S)
        # Stamps only grow with k: those not newer than last_seen are a prefix.
        skipped = bisect.bisect_right(stamps, last_seen_us)
        unseen = list(stamps[skipped:])
        first_k += skipped
        if self._interval_recorded[gpu]:
            return unseen, self._recorded_percents(gpu, first_k, newest_k + 1)
        percents: list[int] = []
        k, end = first_k, newest_k + 1
        while k < end:
            run_from, run_past, percent = self._device_runs[gpu]
            if not run_from <= k < run_past:
                run_past, percent = self._device_run(gpu, k)
            following = min(end, run_past)
            percents += [percent] * (following - k)
            k = following
        return unseen, percents

    def _device_run(self, gpu: int, k: int) -> tuple[int, int]:
        """(the k past the run of device samples from the k-th that share its percent, the
        percent). Which processes run, and at what, changes only at the GPU's breakpoints: a run
        ends at the first sample at or past the next one, less the rounding margin (a segment's
        start is found by a subtraction, which may round the other way than the breakpoint's
        sum). A run that starts clear of its stretch's first breakpoint is kept: any sample in it
        has the percent it would have had worked out on its own."""
        points = self._breakpoints[gpu]
        at = k * DEVICE_SAMPLE_PERIOD_S
        stretch = bisect.bisect_right(points, at)
        percent = min(self._device_percent(gpu, at), 100)
        following = sys.maxsize  # past every sample: no later breakpoint
        if stretch < len(points):
            following = _first_at_or_past(points[stretch] - _ROUNDING_S, k + 1, DEVICE_SAMPLE_PERIOD_S)
        if not stretch or at >= points[stretch - 1] + _ROUNDING_S:
            self._device_runs[gpu] = (k, following, percent)
        return following, percent

    def _sample_stamps(self, first_k: int, end_k: int, period_s: float, early_us: int = 0) -> Sequence[int]:
        """The time stamps of samples first_k..end_k-1, each `early_us` early:
        round((epoch + k * period) * 1e6) - early_us, which, for a whole-second epoch and period
        (as every scenario has), is exact integer arithmetic, a range (the float sum and product
        are then exact below 2**53)."""
        start_epoch = self.clock.start_epoch
        exact = period_s == 1.0 and start_epoch == int(start_epoch)
        if exact and (abs(start_epoch) + end_k) * 1_000_000 < 2**53:
            base = int(start_epoch)
            return range((base + first_k) * 1_000_000 - early_us, (base + end_k) * 1_000_000 - early_us, 1_000_000)
        return [round((start_epoch + k * period_s) * 1_000_000) - early_us for k in range(first_k, end_k)]

    def _segment_starts(self, process: Process) -> list[float]:
        """The process's segments' start times (seconds after it started), kept per process."""
        times = self._segment_times.get(id(process))
        if times is None:
            times = self._segment_times[id(process)] = [s.at_s for s in process.segments]
        return times

    def _device_percent(self, gpu: int, at: float) -> int:
        """The whole percents of the GPU's processes running at `at`, summed (uncapped)."""
        return sum(round(self._util_at(e.process, at)) for e in self._by_gpu[gpu] if e.process.running_at(at))

    def _recorded_percents(self, gpu: int, first_k: int, end_k: int) -> list[int]:
        """The device samples' percents on a GPU a recorded trace gives interval means for."""
        times, rows = self._rows[gpu]
        points = self._breakpoints[gpu]
        stretch, percent = -1, 0
        percents: list[int] = []
        for k in range(first_k, end_k):
            at = k * DEVICE_SAMPLE_PERIOD_S
            if (value := _recorded_sample(times, rows, k)) is not None:
                percents.append(value)
                continue
            if stretch < 0 or (stretch < len(points) and at >= points[stretch] - _ROUNDING_S):
                stretch = bisect.bisect_right(points, at)
                percent = min(self._device_percent(gpu, at), 100)
            percents.append(percent)
        return percents

    def _util_at(self, process: Process, t: float) -> float:
        """`process.sm_util_at` for scenario time t, by bisection: a bursty process has hundreds
        of segments and every device sample looks one up."""
        times = self._segment_starts(process)
        i = bisect.bisect_right(times, t - process.start_s)
        return process.segments[i - 1].sm_util if i else 0.0

    def process_samples(self, gpu: int, last_seen_us: int, t: float) -> list[tuple[int, int, int]]:
        """(pid, timestamp_us, sm_util) samples newer than `last_seen_us`, as the driver keeps them.

        Samples are taken every PROCESS_SAMPLE_PERIOD_S of scenario time, each process's stamped
        a little apart from the others' (PROCESS_STAMP_SPREAD_US); only the newest
        PROCESS_SAMPLES_KEPT per process survive; a process at 0% leaves no sample (the real
        driver reports only processes with non-zero utilization in the sample period).
        """
        return list(zip(*self.process_sample_columns(gpu, last_seen_us, t), strict=True))

    def process_sample_columns(self, gpu: int, last_seen_us: int, t: float) -> tuple[list[int], list[int], list[int]]:
        """`process_samples` as three columns, (pids, time stamps, SM utilizations)."""
        start_epoch = self.clock.start_epoch
        newest_k = int(t // PROCESS_SAMPLE_PERIOD_S)
        # The first sample newer than last_seen, found by arithmetic rather than by walking
        # the whole buffer (the exact comparison below settles rounding at the edge).
        unseen_k = math.floor((last_seen_us / 1_000_000 - start_epoch) / PROCESS_SAMPLE_PERIOD_S)
        pids: list[int] = []
        stamps: list[int] = []
        utils: list[int] = []
        end = newest_k + 1
        runs = self._process_runs
        for process in self.processes_on(gpu, None, t):
            first_k = max(
                newest_k - PROCESS_SAMPLES_KEPT + 1,
                int(-(-process.start_s // PROCESS_SAMPLE_PERIOD_S)),
                unseen_k,
                0,
            )
            pid = process.pid
            taken = self._sample_stamps(first_k, end, PROCESS_SAMPLE_PERIOD_S, pid % PROCESS_STAMP_SPREAD_US)
            # Stamps only grow with k: those not newer than last_seen are a prefix.
            skipped = bisect.bisect_right(taken, last_seen_us)
            k = first_k + skipped
            while k < end:
                run_from, run_past, util = runs.get(id(process), _NO_RUN)
                if not run_from <= k < run_past:
                    run_past, util = self._process_run(process, k)
                following = min(end, run_past)
                if util > 0:
                    run = following - k
                    pids += [pid] * run
                    stamps += taken[k - first_k : following - first_k]
                    utils += [util] * run
                k = following
        return pids, stamps, utils

    def _process_run(self, process: Process, k: int) -> tuple[int, int]:
        """(the k past the run of the process's samples from the k-th that share its
        utilization, the utilization), kept as the process's run. The segment in force at a
        sample is the last one starting at or before it: the samples before the next segment's
        start share its utilization, and every sample of the run finds it on its own (the same
        subtraction, of a larger k)."""
        offset_s = k * PROCESS_SAMPLE_PERIOD_S - process.start_s
        times = self._segment_starts(process)
        i = bisect.bisect_right(times, offset_s)
        util = round(process.segments[i - 1].sm_util) if i else 0
        following = sys.maxsize  # past every sample: no later segment
        if i < len(times):  # the first later sample that the next segment is in force at
            following = _first_at_or_past(times[i], k + 1, PROCESS_SAMPLE_PERIOD_S, process.start_s)
        self._process_runs[id(process)] = (k, following, util)
        return following, util

    # -- faults -------------------------------------------------------------------------------

    @property
    def calls_can_block(self) -> bool:
        """Whether a call into this node can take real time: only a latency fault makes one (a
        hang, as a GPU falling off the bus makes); every other call returns at once."""
        return any(fault.latency_ms for faults in self._faults_by_gpu.values() for fault in faults)

    def faults_for(self, call: str, family: str, gpu: int | None) -> tuple[tuple[Fault, ...], tuple[Fault, ...]]:
        """(error faults, latency faults) that name this call on this GPU, in scenario order.

        Error faults: node-wide ones, then the GPU's (a GPU-scoped or node-wide fault without a
        call hits every call, like a driver that went away). Latency faults: node-wide ones when
        gpu is None, else that GPU's. Worked out once per (call, gpu): a call with none of
        either, the usual case, then costs two empty loops."""
        key = (call, family, gpu)
        found = self._call_faults.get(key)
        if found is None:
            names = (None, "*", call, family)
            scopes = (None, gpu) if gpu is not None else (None,)
            errors = tuple(
                fault
                for scope in scopes
                for fault in self._faults_by_gpu.get(scope, ())
                if fault.error is not None and fault.call in names
            )
            latencies = tuple(f for f in self._faults_by_gpu.get(gpu, ()) if f.latency_ms and f.call in names)
            found = self._call_faults[key] = (errors, latencies)
        return found

    def fault_error(self, call: str, family: str, gpu: int | None, t: float) -> str | None:
        """The NVML error a call fails with now, if a fault says so.

        A GPU_IS_LOST fault is sticky: once its `at` has passed the GPU stays lost, unless the
        fault gives an `until` (the GPU was reset and came back).
        """
        for fault in self.faults_for(call, family, gpu)[0]:
            if fault.active(t):
                return fault.error
        return None

    def call_latency_s(self, call: str, family: str, gpu: int | None, t: float) -> float:
        """Extra time a call takes: node-wide latency faults when gpu is None, else that GPU's."""
        latency = 0.0
        for fault in self.faults_for(call, family, gpu)[1]:
            if fault.active(t):
                latency = max(latency, fault.latency_ms / 1000)
        return latency

    def xids(self, gpu: int, since_s: float, until_s: float) -> list[tuple[float, int]]:
        return [
            (f.at_s, f.xid)
            for f in self._faults_by_gpu.get(gpu, ())
            if f.xid is not None and since_s < f.at_s <= until_s
        ]

    def sync_host(self, t: float) -> None:
        """Bring host-side files up to scenario time t; a node without a host has none."""

    def gpu(self, index: int) -> Gpu:
        return self.scenario.gpus[index]


def _first_at_or_past(bound: float, first_k: int, period_s: float, less_s: float = 0.0) -> int:
    """The first k from first_k on with k * period_s - less_s >= bound, in the float arithmetic
    a sample's loop would use: where a run of samples sharing one reading ends."""
    k = max(first_k, math.ceil((bound + less_s) / period_s))
    while k > first_k and (k - 1) * period_s - less_s >= bound:
        k -= 1
    while k * period_s - less_s < bound:
        k += 1
    return k


def _recorded_sample(times: list[float], rows: tuple[ReadingRow, ...], k: int) -> int | None:
    """The k-th device sample where a recorded row gives its interval's mean; None elsewhere.

    A sample stands for the period before its stamp, so the one stamped at a row's `at` is of
    the row before. The samples after a row's `at` share its whole-percent mean out in whole
    percents (its floor or its ceiling, the running sum rounded), so that any run of them from
    the row's start sums to the mean times their count, rounded: the agent's time-weighted mean
    over a replayed interval is the recorded one wherever the recording's samples were as many
    (a recording of the fake), and within half a percent over their count elsewhere."""
    at = k * DEVICE_SAMPLE_PERIOD_S
    i = bisect.bisect_left(times, at - _ROUNDING_S) - 1
    if i < 0:
        return None
    mean = rows[i].interval_utilization
    if mean is None:
        return None
    j = k - math.floor((times[i] + _ROUNDING_S) / DEVICE_SAMPLE_PERIOD_S)  # 1 for the row's first
    value = math.floor(mean * j + 0.5) - math.floor(mean * (j - 1) + 0.5)
    return min(max(value, 0), 100)
