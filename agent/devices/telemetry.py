"""Which health readings a poll asks for, and how they become a `Telemetry`.

The readings come in groups, each switched on or off in the config (`readings:`). A group's
readings are read on one of three rhythms:

- every poll: what rides on calls the poll makes anyway (NVLink traffic and the memory
  controller's utilization);
- every `slow_interval` (30 s by default, dcgm-exporter's collection interval): the rest
  (SM and memory clocks, performance state, fan, clock-event reasons, violation time, memory
  errors, PCIe link and replays, NVLink errors, encoder and decoder, PCIe throughput). In
  between, a poll carries the last value read. The SM clock is among them although it changes
  from second to second: power capping moves it every few milliseconds, so one instant each
  poll shows it no better than one each slow interval, and read beside the clock-event reasons
  it shows how far they held it down at that same instant. NVML has a field only for the
  counters; the others are a call each, and a poll has about ten calls per GPU to spend (read
  every poll, the SM clock took a whole H100 with GPM from 9.5 calls a poll to 10.33). Counters are cheap where the
  driver batches them as fields, but a driver without those fields answers each with a call
  of its own (36 for the NVLink errors of a 12-link GPU), and this keeps such a driver's polls
  short too;
- once: what is fixed (the clocks' and the PCIe link's maxima), at the GPU's first good poll.
  The memory clock joins them on a GPU that says it supports a single memory clock (HBM boards:
  A100, H100), which cannot change it; elsewhere, or where the GPU cannot say, it stays slow.

A reading that failed is asked again at the next poll, whatever its rhythm, and is absent
until it answers; one the GPU does not have is learned by the sampler and never asked again.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from agent.devices.backend import VIOLATION_QUANTITIES, Quantity, ReadingKey
from agent.model import VIOLATION_CAUSES, NvLinkCounters, Telemetry, nvlink_counters

Q = Quantity


@dataclass(frozen=True)
class Group:
    """A group of readings the config switches as one."""

    every_poll: tuple[Quantity, ...] = ()
    slow: tuple[Quantity, ...] = ()
    once: tuple[Quantity, ...] = ()
    per_link_every_poll: tuple[Quantity, ...] = ()  # one reading per NVLink link
    per_link_slow: tuple[Quantity, ...] = ()


_VIOLATIONS = VIOLATION_QUANTITIES
assert len(_VIOLATIONS) == len(VIOLATION_CAUSES)

GROUPS: dict[str, Group] = {
    # The memory clock changes only with the performance state, and HBM boards never change it:
    # how many memory clocks the GPU supports (read once) says which (`TelemetryReader`).
    "clocks": Group(
        slow=(Q.SM_CLOCK, Q.MEMORY_CLOCK, Q.PERFORMANCE_STATE),  # the SM clock: see the module's docstring
        once=(Q.SM_CLOCK_MAX, Q.MEMORY_CLOCK_MAX, Q.MEMORY_CLOCKS_SUPPORTED),
    ),
    "fan": Group(slow=(Q.FAN_SPEED,)),
    # The reasons as dcgm-exporter reads them, every 30 s by default; the violation time, also
    # read then, says how long each cause held the clocks down in between.
    "throttle": Group(slow=(Q.CLOCK_EVENT_REASONS, *_VIOLATIONS)),
    "memory_errors": Group(
        slow=(
            Q.ECC_CORRECTED_VOLATILE,
            Q.ECC_UNCORRECTED_VOLATILE,
            Q.ECC_CORRECTED_AGGREGATE,
            Q.ECC_UNCORRECTED_AGGREGATE,
            Q.RETIRED_PAGES_SINGLE_BIT,
            Q.RETIRED_PAGES_DOUBLE_BIT,
            Q.RETIRED_PAGES_PENDING,
            Q.REMAPPED_ROWS_CORRECTABLE,
            Q.REMAPPED_ROWS_UNCORRECTABLE,
            Q.ROW_REMAP_PENDING,
            Q.ROW_REMAP_FAILURE,
        )
    ),
    "pcie": Group(
        slow=(Q.PCIE_LINK_GENERATION, Q.PCIE_LINK_WIDTH, Q.PCIE_REPLAYS),
        once=(Q.PCIE_LINK_GENERATION_MAX, Q.PCIE_LINK_WIDTH_MAX),
    ),
    # Opt-in: NVML samples PCIe traffic for 20 ms inside each of these calls.
    "pcie_throughput": Group(slow=(Q.PCIE_TX_RATE, Q.PCIE_RX_RATE)),
    "nvlink_errors": Group(per_link_slow=(Q.NVLINK_CRC_ERRORS, Q.NVLINK_REPLAY_ERRORS, Q.NVLINK_RECOVERY_ERRORS)),
    "nvlink_throughput": Group(per_link_every_poll=(Q.NVLINK_TX_BYTES, Q.NVLINK_RX_BYTES)),
    "codecs": Group(slow=(Q.ENCODER_UTILIZATION, Q.DECODER_UTILIZATION)),
    "memory_utilization": Group(every_poll=(Q.MEMORY_UTILIZATION,)),
}
OPT_IN = frozenset({"pcie_throughput"})
DEFAULT_GROUPS = frozenset(GROUPS) - OPT_IN
DEFAULT_SLOW_INTERVAL_S = 30.0

# How the sampler reads the GPM activity of a MIG-enabled GPU's instances (two NVML calls per
# instance each time, as NVML samples one GPU instance per call): on the slow rhythm, each figure
# the mean over the last slow span, carried into the polls between (with the GPU's own
# activity, which on such a GPU only feeds its exported series); every poll (exact per poll,
# 14 calls a poll for a fully split H100); or not at all (the instances have no busy measure).
MIG_ACTIVITY_SLOW = "slow"
MIG_ACTIVITY_EVERY_POLL = "every_poll"
MIG_ACTIVITY_OFF = "off"
MIG_ACTIVITY_MODES = (MIG_ACTIVITY_SLOW, MIG_ACTIVITY_EVERY_POLL, MIG_ACTIVITY_OFF)


@dataclass(frozen=True)
class ReadingOptions:
    """Which groups of `GROUPS` a poll reads, how often the slow ones, how MIG instances'
    activity is read (one of `MIG_ACTIVITY_MODES`), and whether it reads the other readings that
    only the metrics text shows."""

    groups: frozenset[str] = DEFAULT_GROUPS
    slow_interval_s: float = DEFAULT_SLOW_INTERVAL_S
    mig_activity: str = MIG_ACTIVITY_SLOW
    # The readings outside the groups that only the metrics text (and `snapshot`'s table, and
    # `record`) shows: the GPU's temperature and each NVLink's state, up or down.
    exposition: bool = True

    def __post_init__(self) -> None:
        unknown = self.groups - set(GROUPS)
        if unknown:
            raise ValueError(f"unknown reading groups: {', '.join(sorted(unknown))}")
        if self.mig_activity not in MIG_ACTIVITY_MODES:
            raise ValueError(f"mig_activity must be one of {', '.join(MIG_ACTIVITY_MODES)}, got {self.mig_activity!r}")


@dataclass
class TelemetryReader:
    """One GPU's health readings across polls: what to ask this poll, and what was read last
    of the readings not asked every poll. The sampler keeps one per GPU."""

    options: ReadingOptions
    links: int
    all_slow: bool = False  # every reading on the slow rhythm (a MIG-enabled GPU's)
    _every_poll: tuple[ReadingKey, ...] = ()
    _slow: tuple[ReadingKey, ...] = ()
    _once: tuple[ReadingKey, ...] = ()
    _every_poll_set: frozenset[ReadingKey] = frozenset()
    _link_keys: tuple[tuple[ReadingKey, ...], ...] = ()  # per link, a key per _LINK_QUANTITIES
    _per_link: bool = False  # some per-link reading is on
    # The memory clock is on the slow rhythm (as `_fix_memory_clock` may move it): a flag, as
    # asking `_slow` at every poll compares the tuples of its dozens of keys.
    _memory_clock_slow: bool = False
    _slow_due_at: float | None = None  # backend clock; None: at the first poll
    _retry: set[ReadingKey] = field(default_factory=set)  # slow or once readings that failed
    _kept: dict[ReadingKey, float] = field(default_factory=dict)  # the last slow and once values
    _nvlink_total: tuple[float, float] | None = None  # (time, bytes) of the previous poll
    _all_link_keys: tuple[ReadingKey, ...] = ()  # every link's _LINK_QUANTITIES keys, link by link
    # The every-poll readings among _SCALAR_KEYS and _all_link_keys, each with its position there.
    _every_scalars: tuple[tuple[int, ReadingKey], ...] = ()
    _every_counts: tuple[tuple[int, ReadingKey], ...] = ()
    # What the last poll showed, and the readings it was made from: a poll whose readings are
    # the same hands it on, and one whose readings differ in part rebuilds only that part (see
    # `_made`). Between slow polls most readings are carried, so most polls change little.
    _last: Telemetry | None = None
    _last_scalars: tuple[float | None, ...] = ()
    _last_counts: tuple[float | None, ...] = ()
    _scalar_fields: dict[str, Any] = field(default_factory=dict)  # Telemetry's fields of _last_scalars
    _link_counters: tuple[NvLinkCounters, ...] = ()  # made from _last_counts
    # The readings of a slow poll as `keys` last gave them (the extra once readings retried,
    # what it returned, and the part after the every-poll readings), made again only when they
    # change: `telemetry` knows the list by identity and keeps its values in bulk.
    _slow_asked: tuple[tuple[ReadingKey, ...], tuple[ReadingKey, ...], tuple[ReadingKey, ...]] | None = None
    # `_kept`'s values for _SCALAR_KEYS and for _all_link_keys (None: not worked out since it
    # last changed): a poll's readings are looked up in what it read, these the defaults, rather
    # than in a merged copy of both dicts made every poll.
    _kept_scalars: tuple[float | None, ...] | None = None
    _kept_counts: tuple[float | None, ...] = ()
    # Where NVLink traffic is read: each link's transmit and receive counts out of all counts.
    _traffic_of: Callable[[tuple[float | None, ...]], tuple[float | None, ...]] | None = None

    def __post_init__(self) -> None:
        groups = [GROUPS[name] for name in sorted(self.options.groups)]
        links = range(self.links)
        self._every_poll = tuple(
            [_key(q) for g in groups for q in g.every_poll]
            + [_key(q, link) for g in groups for link in links for q in g.per_link_every_poll]
        )
        self._slow = tuple(
            [_key(q) for g in groups for q in g.slow]
            + [_key(q, link) for g in groups for link in links for q in g.per_link_slow]
        )
        self._once = tuple(_key(q) for g in groups for q in g.once)
        if self.all_slow:
            self._every_poll, self._slow = (), self._every_poll + self._slow
        self._every_poll_set = frozenset(self._every_poll)
        self._link_keys = tuple(tuple(_key(q, link) for q in _LINK_QUANTITIES) for link in links)
        self._all_link_keys = tuple(key for keys in self._link_keys for key in keys)
        self._every_scalars = tuple((i, key) for i, key in enumerate(_SCALAR_KEYS) if key in self._every_poll_set)
        self._every_counts = tuple((i, key) for i, key in enumerate(self._all_link_keys) if key in self._every_poll_set)
        self._per_link = self.links > 0 and any(g.per_link_every_poll or g.per_link_slow for g in groups)
        if self.links > 0 and any(Q.NVLINK_TX_BYTES in g.per_link_every_poll for g in groups):
            # Each link's transmit and receive bytes, link by link (the last two of its counts).
            self._traffic_of = operator.itemgetter(
                *[link * _LINK_WIDTH + offset for link in links for offset in (3, 4)]
            )
        self._retry.update(self._once)
        self._memory_clock_slow = _MEMORY_CLOCK in self._slow

    @property
    def enabled(self) -> bool:
        return bool(self._every_poll or self._slow or self._once)

    def keys(self, now: float) -> tuple[ReadingKey, ...]:
        """The readings to ask for at a poll at `now` (backend clock)."""
        if self._slow_due_at is None or now >= self._slow_due_at:
            extra = tuple(k for k in self._once if k in self._retry)
            cached = self._slow_asked
            if cached is None or cached[0] != extra:
                rest = self._slow + extra
                every_set = self._every_poll_set
                kept = tuple(k for k in rest if k not in every_set)
                cached = self._slow_asked = (extra, self._every_poll + rest, kept)
            return cached[1]
        if self._retry:
            return self._every_poll + tuple(k for k in self._slow + self._once if k in self._retry)
        return self._every_poll

    def telemetry(
        self,
        now: float,
        asked: tuple[ReadingKey, ...],
        values: Mapping[ReadingKey, float],
        unsupported: Container[object] = (),
    ) -> Telemetry:
        """What this poll shows, from the values read for `asked` (those `keys(now)` named);
        `unsupported` holds the readings the GPU has shown it does not have."""
        if self._slow_due_at is None or now >= self._slow_due_at:
            self._slow_due_at = now + self.options.slow_interval_s
        every = self._every_poll
        slow_asked = self._slow_asked
        if asked is every:
            pass  # the every-poll readings alone: nothing to keep or retry
        elif slow_asked is not None and asked is slow_asked[1]:
            self._keep(slow_asked[2], values, unsupported)
        else:
            # `keys` puts the every-poll readings first: only those after them are kept or retried.
            rest = asked[len(every) :] if asked[: len(every)] == every else asked
            every_set = self._every_poll_set
            self._keep_each(tuple(key for key in rest if key not in every_set), values, unsupported)
        self._fix_memory_clock()
        kept_scalars = self._kept_scalars
        if kept_scalars is None:
            kept = self._kept.get
            kept_scalars = self._kept_scalars = tuple(map(kept, _SCALAR_KEYS))
            self._kept_counts = tuple(map(kept, self._all_link_keys)) if self._per_link else ()
        # Each reading as read this poll, else as kept (`values.get` with `_kept`'s value as the
        # default: what a merged {**_kept, **values} would give).
        get = values.get
        if asked is every:
            # Read in place: a poll that reads only the few every-poll readings (every other
            # poll at the default rhythms) does not look up the dozens of kept ones.
            scalars = _read_into(kept_scalars, self._every_scalars, get)
            counts = _read_into(self._kept_counts, self._every_counts, get)
        else:
            scalars = tuple(map(get, _SCALAR_KEYS, kept_scalars))
            counts = tuple(map(get, self._all_link_keys, self._kept_counts)) if self._per_link else ()
        rate = None
        if self._traffic_of is not None:
            rate = self._nvlink_rate(now, self._traffic_of(counts))
        return self._made(scalars, counts, rate)

    def _keep(
        self, rest: tuple[ReadingKey, ...], values: Mapping[ReadingKey, float], unsupported: Container[object]
    ) -> None:
        """Keeps the values of `rest` (readings not asked every poll, each once) for the polls
        that do not read them: `_keep_each`, with the readings that answered kept in bulk (a
        slow poll has dozens) and only those that did not (the GPU does not have them, or they
        failed) one at a time."""
        got = tuple(map(values.get, rest, itertools.repeat(_ABSENT)))
        answered = list(map(operator.is_not, got, itertools.repeat(_ABSENT)))
        kept = cast("Iterable[float]", itertools.compress(got, answered))
        self._kept.update(zip(itertools.compress(rest, answered), kept, strict=True))
        if self._retry:
            self._retry.difference_update(itertools.compress(rest, answered))
        self._keep_each(tuple(itertools.compress(rest, map(operator.not_, answered))), values, unsupported)
        self._kept_scalars = None

    def _keep_each(
        self, rest: tuple[ReadingKey, ...], values: Mapping[ReadingKey, float], unsupported: Container[object]
    ) -> None:
        """`_keep`, a reading at a time: one that failed is dropped, and retried unless the GPU
        does not have it."""
        for key in rest:
            if key in values:
                self._kept[key] = values[key]
                self._retry.discard(key)
                continue
            self._kept.pop(key, None)  # absent until it answers again
            if key in unsupported:
                self._retry.discard(key)
            else:
                self._retry.add(key)  # failed this poll: asked again at the next
        if rest:
            self._kept_scalars = None

    def _made(
        self, scalars: tuple[float | None, ...], counts: tuple[float | None, ...], nvlink_rate: float | None
    ) -> Telemetry:
        """The Telemetry of the readings of _SCALAR_KEYS (in order) and of every link's
        _LINK_QUANTITIES (link by link). Equal readings make an equal Telemetry, so the last one
        is handed on where they are all as they were (an idle GPU between slow polls), and only
        the part whose readings changed is built again: a busy GPU's link traffic moves every
        poll, its clocks and error counts seldom. Built whole every poll, the Telemetry of a
        12-link GPU was a sixth of the CPU time of the GPU's poll."""
        last = self._last
        same_scalars = last is not None and scalars == self._last_scalars
        same_counts = last is not None and counts == self._last_counts
        if last is not None and same_scalars and same_counts and nvlink_rate == last.nvlink_bytes_per_s:
            return last
        if not same_scalars:
            self._scalar_fields = _scalar_fields(scalars)
            self._last_scalars = scalars
        if not same_counts:
            self._link_counters = _link_counters(counts)
            self._last_counts = counts
        self._last = Telemetry(**self._scalar_fields, nvlinks=self._link_counters, nvlink_bytes_per_s=nvlink_rate)
        return self._last

    def _fix_memory_clock(self) -> None:
        """Moves the memory clock from the slow rhythm to the once rhythm when the GPU has said it
        supports a single memory clock. Saves a call every slow interval (issue 11's budget: a
        whole H100 at 10 calls a poll). Its last value carries into every poll as before, and a
        memory clock that has not answered yet stays in `_retry`, which the once rhythm asks
        again at the next poll; a count that failed or is unsupported leaves it slow."""
        if not self._memory_clock_slow or self._kept.get(_MEMORY_CLOCKS_SUPPORTED) != 1.0:
            return
        self._memory_clock_slow = False
        self._slow = tuple(k for k in self._slow if k != _MEMORY_CLOCK)
        self._once += (_MEMORY_CLOCK,)
        self._slow_asked = None

    def _nvlink_rate(self, now: float, counts: tuple[float | None, ...]) -> float | None:
        """Bytes per second over every link, both ways, since the previous poll, from each link's
        transmit and receive bytes (in link order)."""
        if not counts or None in counts:
            self._nvlink_total = None
            return None
        total = sum(cast("tuple[float, ...]", counts))  # none is None (above)
        previous, self._nvlink_total = self._nvlink_total, (now, total)
        if previous is None or now <= previous[0] or total < previous[1]:
            return None  # the first poll, or the driver reloaded and its counters restarted
        return (total - previous[1]) / (now - previous[0])


@functools.cache
def _key(quantity: Quantity, link: int | None = None) -> ReadingKey:
    """The one key object of a reading, shared by every reader and _SCALAR_KEYS. A poll's values
    are keyed by the very keys `keys` handed out, and a dict that finds the object it holds
    skips comparing the tuples: a poll looks up about a hundred per GPU."""
    return ReadingKey(quantity, link)


_KEYS: dict[Quantity, ReadingKey] = {q: _key(q) for q in Quantity}
_MEMORY_CLOCK = _KEYS[Q.MEMORY_CLOCK]
_MEMORY_CLOCKS_SUPPORTED = _KEYS[Q.MEMORY_CLOCKS_SUPPORTED]
_LINK_QUANTITIES = (
    Q.NVLINK_CRC_ERRORS,
    Q.NVLINK_REPLAY_ERRORS,
    Q.NVLINK_RECOVERY_ERRORS,
    Q.NVLINK_TX_BYTES,
    Q.NVLINK_RX_BYTES,
)


# The Telemetry fields _scalar_fields fills from one reading each, in order, with the quantity
# read and how its value is carried: as read (a float), as a count, or as a flag.
_SCALARS: tuple[tuple[str, Quantity, type], ...] = (
    ("sm_clock_hz", Q.SM_CLOCK, float),
    ("memory_clock_hz", Q.MEMORY_CLOCK, float),
    ("sm_clock_max_hz", Q.SM_CLOCK_MAX, float),
    ("memory_clock_max_hz", Q.MEMORY_CLOCK_MAX, float),
    ("fan_speed_ratio", Q.FAN_SPEED, float),
    ("performance_state", Q.PERFORMANCE_STATE, int),
    ("clock_event_reasons", Q.CLOCK_EVENT_REASONS, int),
    ("ecc_corrected_volatile", Q.ECC_CORRECTED_VOLATILE, int),
    ("ecc_uncorrected_volatile", Q.ECC_UNCORRECTED_VOLATILE, int),
    ("ecc_corrected_aggregate", Q.ECC_CORRECTED_AGGREGATE, int),
    ("ecc_uncorrected_aggregate", Q.ECC_UNCORRECTED_AGGREGATE, int),
    ("retired_pages_single_bit", Q.RETIRED_PAGES_SINGLE_BIT, int),
    ("retired_pages_double_bit", Q.RETIRED_PAGES_DOUBLE_BIT, int),
    ("retired_pages_pending", Q.RETIRED_PAGES_PENDING, bool),
    ("remapped_rows_correctable", Q.REMAPPED_ROWS_CORRECTABLE, int),
    ("remapped_rows_uncorrectable", Q.REMAPPED_ROWS_UNCORRECTABLE, int),
    ("row_remap_pending", Q.ROW_REMAP_PENDING, bool),
    ("row_remap_failure", Q.ROW_REMAP_FAILURE, bool),
    ("pcie_link_generation", Q.PCIE_LINK_GENERATION, int),
    ("pcie_link_generation_max", Q.PCIE_LINK_GENERATION_MAX, int),
    ("pcie_link_width", Q.PCIE_LINK_WIDTH, int),
    ("pcie_link_width_max", Q.PCIE_LINK_WIDTH_MAX, int),
    ("pcie_replays", Q.PCIE_REPLAYS, int),
    ("pcie_tx_bytes_per_s", Q.PCIE_TX_RATE, float),
    ("pcie_rx_bytes_per_s", Q.PCIE_RX_RATE, float),
    ("encoder_utilization", Q.ENCODER_UTILIZATION, float),
    ("decoder_utilization", Q.DECODER_UTILIZATION, float),
    ("memory_utilization", Q.MEMORY_UTILIZATION, float),
)
_SCALAR_KEYS = tuple(_KEYS[quantity] for _name, quantity, _kind in _SCALARS) + tuple(_KEYS[q] for q in _VIOLATIONS)
_SCALAR_KINDS = tuple(kind for _name, _quantity, kind in _SCALARS)
_SCALAR_NAMES = tuple(name for name, _quantity, _kind in _SCALARS)
_LINK_WIDTH = len(_LINK_QUANTITIES)


def _scalar_fields(scalars: tuple[float | None, ...]) -> dict[str, Any]:
    """Telemetry's fields (but the links') from the readings of _SCALAR_KEYS, in order."""
    # Each value carried as _SCALARS says (a float, int or bool), which mypy cannot follow.
    fields: dict[str, Any] = {
        name: value if value is None or kind is float else kind(value)
        for name, kind, value in zip(_SCALAR_NAMES, _SCALAR_KINDS, scalars, strict=False)
    }
    fields["violation_s"] = tuple(
        (cause, seconds)
        for cause, seconds in zip(VIOLATION_CAUSES, scalars[len(_SCALARS) :], strict=True)
        if seconds is not None
    )
    return fields


def _link_counters(counts: tuple[float | None, ...]) -> tuple[NvLinkCounters, ...]:
    """Each link's counters from every link's _LINK_QUANTITIES readings (link by link); a link is
    left out only when none of its counters was read."""
    width = _LINK_WIDTH
    if None not in counts:  # every link read in full, the usual case
        return nvlink_counters(list(map(int, cast("tuple[float, ...]", counts))))
    return tuple(
        [
            NvLinkCounters(link, *[None if c is None else int(c) for c in counts[link * width : (link + 1) * width]])
            for link in range(len(counts) // width)
            if counts[link * width : (link + 1) * width] != _NO_COUNTS
        ]
    )


def _read_into(
    kept: tuple[float | None, ...],
    read_at: tuple[tuple[int, ReadingKey], ...],
    get: Callable[[ReadingKey], float | None],
) -> tuple[float | None, ...]:
    """`kept`, with the reading at each position of `read_at` as `get` gives it."""
    merged = list(kept)
    for position, key in read_at:
        merged[position] = get(key)
    return tuple(merged)


_NO_COUNTS: tuple[None, ...] = (None,) * _LINK_WIDTH
_ABSENT = object()  # a reading the poll's values lack (`TelemetryReader._keep`)
