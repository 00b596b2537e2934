"""Idle and underused GPUs, flagged against thresholds. Pure: state in, state out, `now` given.

Each rule has a condition on one GPU's poll (utilization below a threshold, with or without a
holder, memory above a size, or a mean over a window) and a duration. A flag raises once its
condition has held for the duration, measured on the backend clock between polls, and clears
at the first poll where it no longer holds. A GPU that is down, or that cannot measure
utilization (MIG), holds no condition; one that nobody is known to hold, but that someone may
(its processes unreadable, the scheduler's allocations unknown), is not idle. An interval
longer than the longest the agent charges (`max_interval_s`: the agent stopped, the node slept)
was not seen, and a clock set back makes no duration across it: a condition that holds after
either holds from then, not from before it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import NamedTuple

from agent.model import Flag, Workload

CONDITIONS = ("idle", "allocated_idle", "underused", "stranded_memory")
# Conditions that are their holders' doing: a workload that arrives while one holds (a GPU
# handed to the next job between two polls) starts an episode of its own, so a flag never
# says that a job which has just started left its GPU idle for hours.
HELD_CONDITIONS = frozenset({"allocated_idle", "underused", "stranded_memory"})


@dataclass(frozen=True, slots=True)
class RuleSpec:
    name: str
    condition: str  # one of CONDITIONS
    utilization_below: float
    for_s: float
    window_s: float = 0.0  # underused: the mean is taken over this much of the past
    memory_above_bytes: int = 0  # stranded_memory
    models: tuple[str, ...] = ()  # only GPUs whose model matches one of these globs
    nodes: tuple[str, ...] = ()  # only nodes whose hostname matches one of these globs

    def applies_to(self, model: str, node: str) -> bool:
        return (not self.models or any(fnmatchcase(model, m) for m in self.models)) and (
            not self.nodes or any(fnmatchcase(node, n) for n in self.nodes)
        )


# GpuObservation and RuleState are NamedTuples, not frozen dataclasses: the pipeline builds an
# observation per GPU and the rules a state per GPU and rule at every poll, and a NamedTuple is
# built in a third of the time (a frozen dataclass sets each field through object.__setattr__).
# Both are as immutable; `_replace` stands for dataclasses.replace.
class GpuObservation(NamedTuple):
    """One GPU at one poll, as the rules see it."""

    gpu: int
    uuid: str
    model: str
    node: str
    up: bool
    utilization: float | None
    memory_used_bytes: int | None
    holders: tuple[Workload, ...]
    interval_s: float  # time since the previous poll (0 at the first)
    # False where nobody is known to hold it but someone may (its process list unreadable, or
    # the scheduler's allocations unknown): accounting books that time unobserved, not idle.
    holders_known: bool = True
    dollars: float = 0.0  # what the GPU cost over that interval
    idle_dollars: float = 0.0  # of which nobody held it


class Window(NamedTuple):
    """An underused rule's samples, (end, seconds, utilization) oldest first: `samples[start:end]`.

    The list is shared by the states that follow one another and only ever grows at its end, so
    that sliding the window by a poll is a new view and one append, not a copy of the hundreds of
    samples a window holds. No view ever changes: the list is appended to in place only by the
    view that ends where the list does (the latest); any other (an earlier state judged again)
    copies its own samples first. Samples that left every window are dropped from the list once
    they outnumber those in it."""

    samples: list[tuple[float, float, float]]
    start: int
    end: int


_NO_SAMPLES = Window([], 0, 0)  # an empty window: never appended to (a sample starts a list of its own)


class RuleState(NamedTuple):
    since: float | None = None  # when the condition started holding, without a break
    raised: bool = False
    dollars: float = 0.0  # cost while the condition has held (idle cost for `idle`)
    window: Window = _NO_SAMPLES  # underused: the samples the mean is taken over
    window_seconds: float = 0.0  # sums over `window`, kept so the mean costs O(1) per poll
    window_weighted: float = 0.0
    holders: tuple[Workload, ...] = ()  # HELD_CONDITIONS: who held the GPU at the last poll
    gpu: int = 0  # the GPU's index, for the line that clears the flag of a unit no longer seen


_CLEAR = RuleState()  # a condition that does not hold, with nothing in its window


@dataclass(frozen=True, slots=True)
class Transition:
    """A flag raising or clearing: what the log line says."""

    gpu: int
    uuid: str
    rule: str
    raised: bool
    at: float
    held_s: float
    holders: tuple[Workload, ...]
    dollars: float


@dataclass(frozen=True)
class Evaluation:
    states: Mapping[tuple[str, str], RuleState]
    flags: tuple[Flag, ...] = ()
    transitions: tuple[Transition, ...] = field(default=())


# A rule that applies to a GPU, with what `evaluate` reads of it at each of its GPUs: its name,
# condition and whether its flags name the GPU's holders (`_FLAG_NAMES_HOLDERS`). A plain tuple,
# not a NamedTuple: unpacking a tuple's subclass takes the interpreter's slow path.
_Applied = tuple[RuleSpec, str, str, bool]


def _slide(
    state: RuleState, sample: tuple[float, float, float] | None, now: float, window_s: float
) -> tuple[Window, float, float, float | None]:
    """The window after adding `sample` and dropping what ended before now - window_s, its
    running sums, and the time-weighted mean over exactly the last window_s seconds."""
    samples, first, end = state.window
    seconds, weighted = state.window_seconds, state.window_weighted
    if sample is not None:
        seconds += sample[1]
        weighted += sample[1] * sample[2]
    start = now - window_s
    while first < end:
        sample_end, dt, util = samples[first]
        if sample_end > start:
            break
        first += 1
        seconds -= dt
        weighted -= dt * util
    if sample is not None:
        if first < end:
            if end != len(samples):  # a later state's samples follow: copy this one's
                samples, first, end = samples[first:end], 0, end - first
            samples.append(sample)
            end += 1
        elif sample[0] > start:
            samples, first, end = [sample], 0, 1
        else:  # the window is shorter than the interval: the sample ended before it began
            seconds -= sample[1]
            weighted -= sample[1] * sample[2]
    if first == end:
        return _NO_SAMPLES, 0.0, 0.0, None
    if first > end - first:  # mostly samples no window holds any more
        samples, first, end = samples[first:end], 0, end - first
    first_end, first_dt, first_util = samples[first]
    excess = max(0.0, first_dt - (first_end - start))  # the part of the oldest sample before the window
    covered = seconds - excess
    mean = (weighted - excess * first_util) / covered if covered > 0 else None
    return Window(samples, first, end), seconds, weighted, mean


def _condition(spec: RuleSpec, obs: GpuObservation, window_mean: float | None) -> bool:
    if not obs.up or obs.utilization is None:
        return False
    if spec.condition == "idle":
        return not obs.holders and obs.holders_known and obs.utilization < spec.utilization_below
    if spec.condition == "allocated_idle":
        return bool(obs.holders) and obs.utilization < spec.utilization_below
    if spec.condition == "underused":
        # Underuse is a holder's: a GPU nobody holds is `idle`, and flagging it twice is noise.
        return bool(obs.holders) and window_mean is not None and window_mean < spec.utilization_below
    if spec.condition == "stranded_memory":
        memory = obs.memory_used_bytes or 0
        return memory > spec.memory_above_bytes and obs.utilization < spec.utilization_below
    raise ValueError(f"unknown condition {spec.condition!r}")


def _arrived(holders: Sequence[Workload], old: RuleState) -> bool:
    """Whether a workload holds the GPU now that did not at the last poll. Workloads are told
    apart by what they are (the pod, the job), not by every label: a job's labels grow a
    `model` once its process starts, and it is the same job."""
    if tuple(holders) == old.holders:
        return False
    before = {w.describe() for w in old.holders}
    return any(w.describe() not in before for w in holders)


def evaluate(
    states: Mapping[tuple[str, str], RuleState],
    observations: Sequence[GpuObservation],
    specs: Sequence[RuleSpec],
    now: float,
    max_interval_s: float = math.inf,
    flags_before: Sequence[Flag] = (),
) -> Evaluation:
    """One poll's worth of rule evaluation. `states` is keyed by (GPU uuid, rule name); an
    observation whose interval is longer than `max_interval_s` follows time nobody saw.
    `flags_before`: the last poll's flags, if any. A lowered flag that is the same as the one in
    its place there is handed on rather than built again: on most GPUs most rules hold at no poll,
    and their flags stay as they were, poll after poll."""
    new_states: dict[tuple[str, str], RuleState] = {}
    flags: list[Flag] = []
    transitions: list[Transition] = []
    # A node's GPUs are mostly of one model: decide which rules apply once per (model, node),
    # each with what its loop reads of it (`_Applied`).
    applicable: dict[tuple[str, str], tuple[_Applied, ...]] = {}
    for obs in observations:
        where = (obs.model, obs.node)
        applied_here = applicable.get(where)
        if applied_here is None:
            applied_here = applicable[where] = tuple(
                (spec, spec.name, spec.condition, spec.condition in _FLAG_NAMES_HOLDERS)
                for spec in specs
                if spec.applies_to(obs.model, obs.node)
            )
        gpu, uuid, holders = obs.gpu, obs.uuid, obs.holders
        # Time nobody saw, or a clock set back (NTP): no duration runs on across either.
        unseen = obs.interval_s > max_interval_s or obs.interval_s < 0
        for spec, name, condition, names_holders in applied_here:
            key = (uuid, name)
            old = states.get(key, _CLEAR)
            flag_holders = holders if names_holders else ()
            if old is _CLEAR and (condition != "underused" or not holders) and not _condition(spec, obs, None):
                # The common case, a condition that did not hold and does not: nothing to keep,
                # no line, a lowered flag (see below for what each part would have been).
                new_states[key] = _CLEAR
                flags.append(_lowered(flags_before, len(flags), gpu, uuid, name, flag_holders))
                continue
            window, w_seconds, w_weighted, mean = old.window, 0.0, 0.0, None
            if condition == "underused":
                if not holders:
                    # Nobody holds it: underuse holds for nobody, and the window is emptied when a
                    # holder comes (below), so samples of no holder's time are not kept at all.
                    window, mean = _NO_SAMPLES, None
                else:
                    sample = None
                    if obs.up and obs.utilization is not None and obs.interval_s > 0 and not unseen:
                        sample = (now, obs.interval_s, obs.utilization)
                    if obs.interval_s < 0 or _arrived(holders, old):
                        # Underuse is a holder's: a workload that has just come is judged on its
                        # own time on the GPU, not on the hours it sat idle (or busy) before.
                        # Samples stamped later than the clock now reads would never leave the window.
                        old = old._replace(window=_NO_SAMPLES, window_seconds=0.0, window_weighted=0.0)
                    window, w_seconds, w_weighted, mean = _slide(old, sample, now, spec.window_s)
            holds = _condition(spec, obs, mean)
            if old.since is not None and (
                unseen or (holds and condition in HELD_CONDITIONS and _arrived(holders, old))
            ):
                if old.raised:  # the flag of those who held it clears, naming them
                    # After a gap, it held for as long as it was seen to: until the poll before.
                    seen_until = now - obs.interval_s if unseen else now
                    held_s = seen_until - old.since
                    transitions.append(Transition(gpu, uuid, name, False, now, held_s, old.holders, old.dollars))
                old = old._replace(since=None, raised=False, dollars=0.0)
            if holds:
                # The condition counts from the first poll that saw it: a flag never raises early.
                since = old.since if old.since is not None else now
                cost = obs.idle_dollars if condition == "idle" else obs.dollars
                dollars = old.dollars + cost if old.since is not None else 0.0
                held_s = now - since
                raised = held_s >= spec.for_s
                state = RuleState(since, raised, dollars, window, w_seconds, w_weighted, holders, gpu)
            else:
                held_s = now - old.since if old.since is not None else 0.0
                # Most rules hold on most GPUs at no poll: one shared cleared state for them all.
                if window is not _NO_SAMPLES or w_seconds or w_weighted:
                    state = RuleState(
                        window=window, window_seconds=w_seconds, window_weighted=w_weighted, holders=holders
                    )
                else:
                    state = _CLEAR
                raised = False
            if raised != old.raised:
                dollars_so_far = state.dollars if raised else old.dollars
                # A holder's flag clears naming that holder, though it may have just left the GPU.
                who = old.holders if not raised and condition in HELD_CONDITIONS else holders
                transitions.append(Transition(gpu, uuid, name, raised, now, held_s, who, dollars_so_far))
            new_states[key] = state
            if raised:
                flags.append(Flag(gpu, uuid, name, True, held_s, flag_holders, state.dollars))
            else:
                flags.append(_lowered(flags_before, len(flags), gpu, uuid, name, flag_holders))
    # A unit this poll did not observe at all (the MIG instances of a GPU lost, or destroyed) holds
    # no condition either: its raised flags clear, naming their holders, as a GPU's do when it is down.
    for (uuid, rule), old in states.items():
        if old.raised and old.since is not None and (uuid, rule) not in new_states:
            transitions.append(Transition(old.gpu, uuid, rule, False, now, now - old.since, old.holders, old.dollars))
    return Evaluation(new_states, tuple(flags), tuple(transitions))


# The conditions whose flags name the GPU's holders, lowered or raised: the others' name nobody
# (an idle GPU has none; an underused one is its holders' flag only in the transitions' lines).
_FLAG_NAMES_HOLDERS = frozenset({"allocated_idle", "stranded_memory"})


def _lowered(before: Sequence[Flag], i: int, gpu: int, uuid: str, rule: str, holders: tuple[Workload, ...]) -> Flag:
    """A lowered flag: `before[i]` where that is the same flag (the last poll's, in the same
    place when the GPUs and rules are the same), else a new one."""
    if i < len(before):
        flag = before[i]
        if (
            not flag.raised
            and flag.uuid == uuid
            and flag.rule == rule
            and flag.gpu == gpu
            and flag.holders == holders
            and flag.held_s == 0.0
            and flag.dollars == 0.0
        ):
            return flag
    return Flag(gpu, uuid, rule, False, 0.0, holders, 0.0)
