"""The fake node's hardware health: clocks, throttling, memory errors, PCIe and NVLink links.

Every reading is a function of (GPU, scenario time), like the node's power and temperature:

- Clocks follow load and temperature. An idle GPU sits at its idle clocks with the GPU-idle
  reason; a busy one runs at its maximum unless something holds it down: power within 3% of
  the limit (software power cap), temperature at the GPU's maximum operating temperature
  (software thermal slowdown) or at its slowdown threshold (hardware slowdown), or a
  `throttle:` fault. The violation counters integrate how long each cause held the clocks.
- ECC errors, remapped rows, PCIe replays and NVLink errors move only with `ecc:`, `remap:`,
  `pcie_downgrade:` and `nvlink_errors:` faults (see Fault.accrued for how counts accrue).
- NVLink and PCIe traffic follow utilization; a link that is down carries none.
- A recorded trace's rows (`readings:`, with `HealthRow`s) stand in for all of this: where the
  row in force holds a reading, that is the answer, exactly as the recorded driver gave it.

Counters that integrate over time (violation time, NVLink bytes) are exact: everything they
depend on is constant between the GPU's breakpoints (process starts, ends and load segments,
and the faults' edges), so each is a sum of rectangles, kept incrementally as time moves on.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from fake_nvml.scenario.facts import (
    BOARD_FACTS,
    DEFAULT_BOARD,
    POLICY_BOARD_LIMIT,
    POLICY_LOW_UTILIZATION,
    POLICY_POWER,
    POLICY_RELIABILITY,
    POLICY_SYNC_BOOST,
    POLICY_THERMAL,
    POLICY_TOTAL_APP_CLOCKS,
    POLICY_TOTAL_BASE_CLOCKS,
    REASON_GPU_IDLE,
    REASON_HW_SLOWDOWN,
    REASON_HW_THERMAL_SLOWDOWN,
    REASON_SW_POWER_CAP,
    REASON_SW_THERMAL_SLOWDOWN,
    THROTTLE_KINDS,
    BoardFacts,
)
from fake_nvml.scenario.model import Fault, HealthRow

if TYPE_CHECKING:
    from fake_nvml.node import FakeNode, GpuState

T = TypeVar("T")

# The temperature thresholds the fake driver reports (nvmlDeviceGetTemperatureThreshold): the
# GPU's maximum operating temperature, and the hardware slowdown threshold above it.
GPU_MAX_OPERATING_C = 87
SLOWDOWN_C = 89
POWER_CAP_FRACTION = 0.97  # power within 3% of the limit: the driver caps the clocks
POWER_CAP_CLOCK_FACTOR = 0.9
SW_THERMAL_CLOCK_FACTOR = 0.75
HW_SLOWDOWN_CLOCK_FACTOR = 0.5
# Traffic at 100% utilization. NVLink: per link and direction (an A100's 12 links carry 300 GB/s
# each way at most, 25 GB/s a link); PCIe: per direction.
NVLINK_BYTES_PER_S = 20e9
PCIE_BYTES_PER_S = 2e9
# The policies the violation counters are kept for, in nvmlPerfPolicyType_t order of the fields.
POLICIES = (
    POLICY_POWER,
    POLICY_THERMAL,
    POLICY_SYNC_BOOST,
    POLICY_BOARD_LIMIT,
    POLICY_LOW_UTILIZATION,
    POLICY_RELIABILITY,
    POLICY_TOTAL_APP_CLOCKS,
    POLICY_TOTAL_BASE_CLOCKS,
)
_POLICY_INDEX = {policy: i for i, policy in enumerate(POLICIES)}
_NS_PER_S = 1e9


class _Integral:
    """The integral from 0 to t of a vector rate that is constant between `points`, kept for
    the last t asked (polls move forward; an earlier t starts again from 0)."""

    def __init__(self, points: list[float], rate: Callable[[float], tuple[float, ...]]) -> None:
        self._points = points
        self._rate = rate
        self._lock = threading.Lock()
        self._t = 0.0
        self._total: tuple[float, ...] = tuple(0.0 for _ in rate(0.0))

    def at(self, t: float) -> tuple[float, ...]:
        if t == self._t:  # a poll asks for every link at one instant
            return self._total
        with self._lock:
            lo, total = self._t, list(self._total)
            if t < lo:
                lo, total = 0.0, [0.0] * len(total)
            points = self._points
            i = bisect.bisect_right(points, lo)
            while lo < t:
                hi = min(points[i], t) if i < len(points) else t
                span = hi - lo
                total = [so_far + r * span for so_far, r in zip(total, self._rate(lo), strict=True)]
                lo = hi
                i += 1
            # The total first: a reader that sees the new time must see the new total.
            result = self._total = tuple(total)
            self._t = t
            return result


class NodeHealth:
    """Clocks, throttling and error counters of every GPU of a fake node."""

    def __init__(self, node: FakeNode, breakpoints: list[list[float]]) -> None:
        self._node = node
        scenario = node.scenario
        self._boards = [BOARD_FACTS.get(gpu.model, DEFAULT_BOARD) for gpu in scenario.gpus]
        # The GPUs with no recorded rows (a scenario's rows are fixed), for which `_recorded`
        # answers None without the node's row lookup.
        self._unrecorded = [not gpu.readings for gpu in scenario.gpus]
        self._faults: list[tuple[Fault, ...]] = [
            tuple(f for f in scenario.faults if f.gpu == gpu.index) for gpu in scenario.gpus
        ]
        self._violations: list[_Integral] = []
        self._nvlink: list[_Integral] = []
        self._nvlink_error_faults = [tuple(f for f in faults if f.nvlink_errors is not None) for faults in self._faults]
        self._kib_memo: dict[int, tuple[float, tuple[int, ...]]] = {}
        # The GPUs whose links no fault and no recorded row takes down: every link of such a GPU
        # carries the same at all times, so its traffic is kept as one link's (`_nvlink_rates`).
        self._links_alike = [
            not gpu.readings and not any(f.nvlink_down for f in self._faults[gpu.index]) for gpu in scenario.gpus
        ]
        # Throttling (reason bits, clock factor, policies holding the clocks down) of each GPU, a
        # function of its state: what it depends on changes only at the GPU's edges (the
        # throttle faults' edges among them).
        self._throttles_of = [self._per_state(gpu.index, self._throttles_at) for gpu in scenario.gpus]
        for gpu in scenario.gpus:
            # A fault's edges change throttling, link state and link width too.
            edges = {e for f in self._faults[gpu.index] for e in (f.at_s, f.until_s) if e is not None}
            points = sorted(set(breakpoints[gpu.index]) | edges)
            self._violations.append(_Integral(points, self._violation_rates(gpu.index)))
            self._nvlink.append(_Integral(points, self._nvlink_rates(gpu.index)))

    def board(self, gpu: int) -> BoardFacts:
        return self._boards[gpu]

    def _recorded(self, gpu: int, t: float) -> HealthRow | None:
        """The health readings of the recorded row in force at t (None: physics answers)."""
        if self._unrecorded[gpu]:  # asked ~84 times a poll, on most scenarios of a GPU without rows
            return None
        row = self._node.reading_row(gpu, t)
        return None if row is None else row.health

    def clock_max_mhz(self, gpu: int, t: float) -> tuple[int, int]:
        """(SM, memory) clock maxima: the recording's, else the board's data sheet."""
        board, row = self._boards[gpu], self._recorded(gpu, t)
        sm = row.sm_clock_max_mhz if row is not None and row.sm_clock_max_mhz is not None else board.sm_clock_max_mhz
        memory = board.memory_clock_max_mhz
        if row is not None and row.memory_clock_max_mhz is not None:
            memory = row.memory_clock_max_mhz
        return sm, memory

    def memory_clocks_mhz(self, gpu: int, t: float) -> tuple[int, ...]:
        """The memory clocks the GPU supports, highest first: the board's, with a recording's
        maximum in place of the data sheet's, and every memory clock a recording shows (a
        trace whose memory clock moves came from a board that can move it)."""
        board = self._boards[gpu]
        clocks = set(board.memory_clocks_mhz) - {board.memory_clock_max_mhz}
        clocks.add(self.clock_max_mhz(gpu, t)[1])
        for row in self._node.scenario.gpus[gpu].readings:
            if row.health is not None and row.health.memory_clock_mhz is not None:
                clocks.add(row.health.memory_clock_mhz)
        return tuple(sorted(clocks, reverse=True))

    def performance_state(self, gpu: int, t: float) -> int:
        """P0 while busy, P8 idle."""
        row = self._recorded(gpu, t)
        if row is not None and row.performance_state is not None:
            return row.performance_state
        return 0 if self._node.utilization(gpu, t) > 0 else 8

    def memory_utilization_percent(self, gpu: int, t: float) -> int:
        """The memory controller's busy percent: 60% of the SMs' while anything holds memory."""
        row = self._recorded(gpu, t)
        if row is not None and row.memory_utilization is not None:
            return row.memory_utilization
        state = self._node.state(gpu, t)
        return round(state.utilization * 0.6) if state.memory_used_mib else 0

    # -- clocks and throttling ----------------------------------------------------------------

    def _per_state(self, gpu: int, of_state: Callable[[int, float, GpuState], T]) -> Callable[[float], T]:
        """`of_state` of the GPU at t, a function of its state (FakeNode.state), worked out once per
        state: a state is replaced, never changed, when time leaves its stretch."""
        state_at = self._node.state
        memo: tuple[GpuState, T] | None = None

        def at(t: float) -> T:
            nonlocal memo
            state = state_at(gpu, t)
            if memo is None or memo[0] is not state:
                memo = (state, of_state(gpu, t, state))  # one assignment: no lock for other threads
            return memo[1]

        return at

    def _throttles(self, gpu: int, t: float) -> tuple[int, float, frozenset[int]]:
        """(reason bits, clock factor, policies holding the clocks down) at t."""
        return self._throttles_of[gpu](t)

    def _throttles_at(self, gpu: int, t: float, state: GpuState) -> tuple[int, float, frozenset[int]]:
        spec = self._node.scenario.gpus[gpu]
        util = state.utilization
        reasons, factor, policies = 0, 1.0, set()
        if util <= 0:
            reasons |= REASON_GPU_IDLE
            policies.add(POLICY_LOW_UTILIZATION)
        elif state.power_w >= POWER_CAP_FRACTION * spec.power_limit_w:
            reasons |= REASON_SW_POWER_CAP
            factor = POWER_CAP_CLOCK_FACTOR
            policies.add(POLICY_POWER)
        temperature = state.temperature_c
        if temperature >= SLOWDOWN_C:
            reasons |= REASON_HW_THERMAL_SLOWDOWN | REASON_HW_SLOWDOWN
            factor = min(factor, HW_SLOWDOWN_CLOCK_FACTOR)
            policies.add(POLICY_THERMAL)
        elif temperature >= GPU_MAX_OPERATING_C:
            reasons |= REASON_SW_THERMAL_SLOWDOWN
            factor = min(factor, SW_THERMAL_CLOCK_FACTOR)
            policies.add(POLICY_THERMAL)
        for fault in self._faults[gpu]:
            if fault.throttle is not None and fault.active(t):
                kind = THROTTLE_KINDS[fault.throttle]
                reasons |= kind.reasons
                factor = min(factor, kind.clock_factor)
                policies.add(kind.policy)
        if factor < 1.0:
            policies.add(POLICY_TOTAL_APP_CLOCKS)
        if factor <= HW_SLOWDOWN_CLOCK_FACTOR:
            policies.add(POLICY_TOTAL_BASE_CLOCKS)
        return reasons, factor, frozenset(policies)

    def clock_event_reasons(self, gpu: int, t: float) -> int:
        row = self._recorded(gpu, t)
        if row is not None and row.clock_event_reasons is not None:
            return row.clock_event_reasons
        return self._throttles(gpu, t)[0]

    def sm_clock_mhz(self, gpu: int, t: float) -> int:
        row = self._recorded(gpu, t)
        if row is not None and row.sm_clock_mhz is not None:
            return row.sm_clock_mhz
        board = self._boards[gpu]
        if self._node.utilization(gpu, t) <= 0:
            return board.sm_clock_idle_mhz
        return round(board.sm_clock_max_mhz * self._throttles(gpu, t)[1])

    def memory_clock_mhz(self, gpu: int, t: float) -> int:
        row = self._recorded(gpu, t)
        if row is not None and row.memory_clock_mhz is not None:
            return row.memory_clock_mhz
        board = self._boards[gpu]
        busy = self._node.utilization(gpu, t) > 0
        return board.memory_clock_max_mhz if busy else board.memory_clock_idle_mhz

    def _violation_rates(self, gpu: int) -> Callable[[float], tuple[float, ...]]:
        def rates(gpu: int, t: float, state: GpuState) -> tuple[float, ...]:
            policies = self._throttles(gpu, t)[2]
            return tuple(1.0 if policy in policies else 0.0 for policy in POLICIES)

        return self._per_state(gpu, rates)

    def violation_ns(self, gpu: int, policy: int, t: float) -> int | None:
        """Nanoseconds the policy has held the clocks down since t=0; None for a policy the
        fake does not keep."""
        index = _POLICY_INDEX.get(policy)
        if index is None:
            return None
        row = self._recorded(gpu, t)
        if row is not None and policy in row.violation_ns:
            return row.violation_ns[policy]
        return round(self._violations[gpu].at(t)[index] * 1e9)

    def violation_ns_all(self, gpu: int, t: float) -> tuple[int, ...]:
        """`violation_ns` of every policy in POLICIES, in that order: a batch asks for them all."""
        row = self._recorded(gpu, t)
        held = self._violations[gpu].at(t)
        if row is None or not row.violation_ns:
            return tuple(map(round, map(_NS_PER_S.__mul__, held)))  # round(seconds * 1e9), each
        recorded = row.violation_ns
        return tuple([recorded.get(p, round(seconds * 1e9)) for p, seconds in zip(POLICIES, held, strict=True)])

    def fan_percent(self, gpu: int, t: float) -> int | None:
        """The fan's speed, rising with temperature; None for a passively cooled board."""
        row = self._recorded(gpu, t)
        if row is not None and row.fan_percent is not None:
            return row.fan_percent
        if not self._boards[gpu].fans:
            return None
        spec = self._node.scenario.gpus[gpu]
        span = max(spec.max_temp_c - spec.idle_temp_c, 1.0)
        heat = (self._node.temperature_c(gpu, t) - spec.idle_temp_c) / span
        return round(30 + 60 * min(max(heat, 0.0), 1.0))

    # -- memory errors ------------------------------------------------------------------------

    def ecc_errors(self, gpu: int, uncorrected: bool, t: float, aggregate: bool = False) -> int:
        """ECC errors since t=0. Volatile and aggregate counts are the same: the scenario's
        board has seen no errors before it, and its driver is never reloaded (a recording
        keeps both as the driver gave them)."""
        row = self._recorded(gpu, t)
        if row is not None:
            name = ("uncorrected" if uncorrected else "corrected") + ("_aggregate" if aggregate else "")
            if name in row.ecc:
                return row.ecc[name]
        total = 0.0
        for fault in self._faults[gpu]:
            if fault.ecc is not None:
                total += fault.accrued(fault.ecc.uncorrected if uncorrected else fault.ecc.corrected, t)
        return int(total)

    def ecc_errors_all(self, gpu: int, t: float) -> tuple[int, int, int, int]:
        """`ecc_errors` as (corrected, uncorrected, corrected aggregate, uncorrected aggregate),
        the faults gone through once: a batch asks for all four."""
        corrected = uncorrected = 0.0
        for fault in self._faults[gpu]:
            if fault.ecc is not None:
                corrected += fault.accrued(fault.ecc.corrected, t)
                uncorrected += fault.accrued(fault.ecc.uncorrected, t)
        counts = (int(corrected), int(uncorrected), int(corrected), int(uncorrected))
        row = self._recorded(gpu, t)
        if row is None or not row.ecc:
            return counts
        recorded = row.ecc
        names = ("corrected", "uncorrected", "corrected_aggregate", "uncorrected_aggregate")
        found = [recorded.get(name, count) for name, count in zip(names, counts, strict=True)]
        return found[0], found[1], found[2], found[3]

    @staticmethod
    def ecc_error_times(fault: Fault) -> list[tuple[float, bool]]:
        """When each memory error of an `ecc:` fault happens, and whether it is uncorrected:
        the moments its counter (`ecc_errors`, through Fault.accrued) steps up by one. The
        driver sends one ECC event for each (nvmlEventTypeSingleBitEccError for a corrected
        error, ..DoubleBitEccError for an uncorrected one), so a scenario's errors and the events
        an event set delivers are the same errors."""
        ecc = fault.ecc
        if ecc is None:
            return []
        times: list[tuple[float, bool]] = []
        for count, uncorrected in ((ecc.corrected, False), (ecc.uncorrected, True)):
            if fault.until_s is None:
                times += [(fault.at_s, uncorrected)] * count
            else:
                span = fault.until_s - fault.at_s
                times += [(fault.at_s + span * k / count, uncorrected) for k in range(1, count + 1)]
        return sorted(times)

    def retired_pages(self, gpu: int, t: float) -> tuple[int, int, bool] | None:
        """(pages retired for single-bit errors, for double-bit errors, retirement pending);
        None on a board that remaps rows instead. Each double-bit error retires its page, which
        stays pending until the driver reloads."""
        row = self._recorded(gpu, t)
        if row is not None and row.retired_pages is not None:
            return row.retired_pages
        if self._boards[gpu].remaps_rows:
            return None
        double = self.ecc_errors(gpu, True, t)
        return 0, double, double > 0

    def remapped_rows(self, gpu: int, t: float) -> tuple[int, int, bool, bool] | None:
        """(correctable, uncorrectable, pending, failure); None on a board before Ampere."""
        row = self._recorded(gpu, t)
        if row is not None and row.remapped_rows is not None:
            return row.remapped_rows
        if not self._boards[gpu].remaps_rows:
            return None
        correctable = uncorrectable = 0
        pending = failure = False
        for fault in self._faults[gpu]:
            remap = fault.remap
            if remap is None or t < fault.at_s:
                continue
            correctable += remap.correctable
            uncorrectable += remap.uncorrectable
            # `until` is the reset that applies a pending remap; a failure stays.
            pending = pending or (remap.pending and fault.active(t))
            failure = failure or remap.failure
        return correctable, uncorrectable, pending, failure

    # -- PCIe ---------------------------------------------------------------------------------

    def pcie_link(self, gpu: int, t: float) -> tuple[int, int]:
        """(generation, width) the link runs at now."""
        board, row = self._boards[gpu], self._recorded(gpu, t)
        generation, width = board.pcie_generation, board.pcie_width
        if row is not None and row.pcie_generation is not None and row.pcie_width is not None:
            return row.pcie_generation, row.pcie_width
        for fault in self._faults[gpu]:
            downgrade = fault.pcie_downgrade
            if downgrade is not None and fault.active(t):
                generation = min(generation, downgrade.generation or generation)
                width = min(width, downgrade.width or width)
        return generation, width

    def pcie_link_max(self, gpu: int, t: float) -> tuple[int, int]:
        """(generation, width) the link can run at: the recording's, else the data sheet's."""
        board, row = self._boards[gpu], self._recorded(gpu, t)
        generation, width = board.pcie_generation, board.pcie_width
        if row is not None and row.pcie_generation_max is not None:
            generation = row.pcie_generation_max
        if row is not None and row.pcie_width_max is not None:
            width = row.pcie_width_max
        return generation, width

    def pcie_replays(self, gpu: int, t: float) -> int:
        row = self._recorded(gpu, t)
        if row is not None and row.pcie_replays is not None:
            return row.pcie_replays
        return int(
            sum(f.accrued(f.pcie_downgrade.replays, t) for f in self._faults[gpu] if f.pcie_downgrade is not None)
        )

    def pcie_throughput_kib_s(self, gpu: int, t: float) -> tuple[int, int]:
        """(transmit, receive) KiB/s now: the host feeds the GPU more than it reads back."""
        row = self._recorded(gpu, t)
        if row is not None and row.pcie_kib_s is not None:
            return row.pcie_kib_s
        busy = self._node.utilization(gpu, t) / 100
        return round(busy * PCIE_BYTES_PER_S / 2 / 1024), round(busy * PCIE_BYTES_PER_S / 1024)

    # -- NVLink -------------------------------------------------------------------------------

    def nvlink_errors(self, gpu: int, link: int, kind: str, t: float) -> int:
        """Errors of `kind` ("crc", "replay", "recovery") counted on one link since t=0."""
        row = self._recorded(gpu, t)
        if row is not None and link < len(row.nvlinks) and kind in row.nvlinks[link]:
            return row.nvlinks[link][kind]
        total = 0.0
        for fault in self._faults[gpu]:
            errors = fault.nvlink_errors
            if errors is not None and (errors.links is None or link in errors.links):
                total += fault.accrued(getattr(errors, kind), t)
        return int(total)

    def _nvlink_rates(self, gpu: int) -> Callable[[float], tuple[float, ...]]:
        links = self._node.scenario.gpus[gpu].nvlink_links
        if self._links_alike[gpu]:
            links = min(links, 1)

        def rates(gpu: int, t: float, state: GpuState) -> tuple[float, ...]:
            busy = state.utilization / 100
            down = state.nvlinks_down
            return tuple(0.0 if link in down else busy * NVLINK_BYTES_PER_S for link in range(links))

        return self._per_state(gpu, rates)

    def nvlink_kib(self, gpu: int, link: int, t: float, receive: bool = False) -> int:
        """KiB carried by one link in one direction since t=0 (traffic is symmetric here, not
        always in a recording)."""
        row = self._recorded(gpu, t)
        if row is not None and link < len(row.nvlinks):
            recorded = row.nvlinks[link].get("rx_kib" if receive else "tx_kib")
            if recorded is not None:
                return recorded
        return int(self._nvlink[gpu].at(t)[0 if self._links_alike[gpu] else link] / 1024)

    def nvlink_kib_all(self, gpu: int, t: float, receive: bool = False) -> tuple[int, ...]:
        """`nvlink_kib` of every link of the GPU, worked out once per instant: a poll asks for
        each link's traffic both ways (the same both ways, unless a recorded row says not)."""
        if self._recorded(gpu, t) is not None:
            links = self._node.scenario.gpus[gpu].nvlink_links
            return tuple(self.nvlink_kib(gpu, link, t, receive) for link in range(links))
        memo = self._kib_memo.get(gpu)
        if memo is not None and memo[0] == t:
            return memo[1]
        totals = self._nvlink[gpu].at(t)
        if self._links_alike[gpu] and totals:
            kib = (int(totals[0] / 1024),) * self._node.scenario.gpus[gpu].nvlink_links
        else:
            kib = tuple([int(carried / 1024) for carried in totals])
        self._kib_memo[gpu] = (t, kib)
        return kib

    def nvlink_errors_all(self, gpu: int, kind: str, t: float) -> tuple[int, ...]:
        """`nvlink_errors` of every link of the GPU; zeros, at once, for a GPU no fault gives
        NVLink errors (most of them)."""
        links = self._node.scenario.gpus[gpu].nvlink_links
        if not self._nvlink_error_faults[gpu] and self._recorded(gpu, t) is None:
            return (0,) * links
        return tuple(self.nvlink_errors(gpu, link, kind, t) for link in range(links))

    # -- video --------------------------------------------------------------------------------

    def codec_percent(self, gpu: int, t: float, encoder: bool) -> int:
        """The video encoder's (or decoder's) load: its processes' summed, capped at 100."""
        row = self._recorded(gpu, t)
        recorded = None if row is None else row.encoder_utilization if encoder else row.decoder_utilization
        if recorded is not None:
            return recorded
        processes = self._node.processes_on(gpu, None, t)
        load = sum(p.encoder_util if encoder else p.decoder_util for p in processes)
        return round(min(load, 100.0))
