"""Charges waiting for the ledger file: summed in memory into one row per hour and key between
flushes, and bounded while the file cannot be written (`PendingCharges`: past `max_rows` the
oldest hours are dropped whole, counted and logged).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import NamedTuple

from agent.accounting import sketch
from agent.ledger.schema import GPU_MEASURES, IDLE_MEASURES, PRICED_MEASURES, WORKLOAD_MEASURES
from agent.model import Charges, GpuCharge, IdleCharge, UnitUsage, Workload, WorkloadCharge
from agent.units import iso_time

log = logging.getLogger("gpuledger.ledger")


HOUR_S = 3600
# An interval longer than this is a clock error upstream, not usage: splitting it into hours
# would make one pending row per hour back to 1970.
MAX_INTERVAL_S = 366 * 86400
# Pending rows kept in memory while the file cannot be written. A row takes about 750 bytes
# (measured with tracemalloc on eight GPUs' rows), so the default stays under 4 MB: about ten
# days of an 8-GPU node's hours (16 to 32 rows an hour).
DEFAULT_MAX_PENDING_ROWS = 5000


class _WorkloadHour(NamedTuple):
    """The key of a pending workload row."""

    hour: int
    node: str
    gpu: int
    uuid: str
    workload: Workload
    account: str = ""


class _GpuHour(NamedTuple):
    """The key of a pending GPU row."""

    hour: int
    node: str
    uuid: str

    def columns(self) -> dict[str, object]:
        return {"hour": self.hour, "node": self.node, "uuid": self.uuid}


class _SizingHour(NamedTuple):
    """The key of a pending sizing row: a workload and the kind of unit it holds, in one hour."""

    hour: int
    node: str
    workload: Workload
    gpu_model: str
    mig_profile: str

    def columns(self) -> dict[str, object]:
        return {
            "hour": self.hour,
            "node": self.node,
            **self.workload.label_dict(),
            "gpu_model": self.gpu_model,
            "mig_profile": self.mig_profile,
        }


@dataclass(slots=True)
class _PendingSizing:
    """A pending sizing_hours row (see schema.py, version 6)."""

    memory_total_bytes: float | None = None
    busy_source: str = ""
    held_s: float = 0.0
    busy_s: float = 0.0
    measured_s: float = 0.0
    memory_s: float = 0.0
    peak_memory_bytes: float | None = None
    max_units: int = 0
    busy_sketch: sketch.Sketch = field(default_factory=dict)
    memory_sketch: sketch.Sketch = field(default_factory=dict)

    def add(self, usage: UnitUsage, unit_s: float) -> None:
        if usage.memory_total_bytes is not None:
            self.memory_total_bytes = float(usage.memory_total_bytes)
        self.held_s += unit_s
        busy = usage.busy
        if busy is not None:
            self.busy_source = usage.busy_source or self.busy_source
            self.busy_s += busy * unit_s
            self.measured_s += unit_s
            bucket = sketch.busy_bucket(busy)
            self.busy_sketch[bucket] = self.busy_sketch.get(bucket, 0.0) + unit_s  # sketch.add, inline
        memory = usage.memory_bytes
        if memory is not None:
            self.memory_s += unit_s
            self.peak_memory_bytes = max(self.peak_memory_bytes or 0.0, float(memory))
            bucket = sketch.memory_bucket(memory)
            self.memory_sketch[bucket] = self.memory_sketch.get(bucket, 0.0) + unit_s  # sketch.add, inline

    def absorb(self, later: _PendingSizing) -> None:
        self.memory_total_bytes = later.memory_total_bytes or self.memory_total_bytes
        self.busy_source = later.busy_source or self.busy_source
        self.held_s += later.held_s
        self.busy_s += later.busy_s
        self.measured_s += later.measured_s
        self.memory_s += later.memory_s
        if later.peak_memory_bytes is not None:
            self.peak_memory_bytes = max(self.peak_memory_bytes or 0.0, later.peak_memory_bytes)
        self.max_units = max(self.max_units, later.max_units)
        sketch.merge(self.busy_sketch, later.busy_sketch)
        sketch.merge(self.memory_sketch, later.memory_sketch)

    def columns(self) -> dict[str, object]:
        return {
            "memory_total_bytes": self.memory_total_bytes,
            "busy_source": self.busy_source,
            "held_s": self.held_s,
            "busy_s": self.busy_s,
            "measured_s": self.measured_s,
            "memory_s": self.memory_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "max_units": self.max_units,
            "busy_sketch": sketch.encode(self.busy_sketch),
            "memory_sketch": sketch.encode(self.memory_sketch),
        }


# Measure name -> the pending sum (None: a priced measure nothing priced has reached yet).
Sums = dict[str, float | None]


def _add_sums(sums: Sums, names: Iterable[str], values: Iterable[float | None], share: float = 1.0) -> None:
    for name, value in zip(names, values, strict=True):
        if value is None:
            continue
        old = sums.get(name)
        sums[name] = value * share if old is None else old + value * share


# The measures of a charge, in the order of the names above (attrgetter: this runs every poll).
_workload_measures = attrgetter(*WORKLOAD_MEASURES)
_gpu_measures = attrgetter(*GPU_MEASURES)
_idle_measures = attrgetter(*IDLE_MEASURES)


def idle_parts(gc: GpuCharge) -> tuple[IdleCharge, ...]:
    """A GPU charge's idle time by who left it idle; a charge that does not break its idle time
    down (made by hand, or by downtime booking) is all left by nobody known."""
    if gc.idle_by or not (gc.idle_s or gc.idle_dollars or gc.idle_joules):
        return gc.idle_by
    return (IdleCharge(Workload(), gc.idle_s, gc.idle_dollars, gc.idle_joules, gc.idle_energy_dollars),)


@dataclass(slots=True)
class _PendingGpu:
    """A pending GPU-hour row, and its idle time by who left the GPU idle (the idle_hours rows
    of the same hour and GPU: they go wherever the GPU-hour goes, so they count as part of it)."""

    gpu: int
    model: str
    dollars_per_hour: float
    sums: Sums = field(default_factory=dict)
    idle_by: dict[Workload, Sums] = field(default_factory=dict)
    purchase: str = ""
    price_source: str = ""

    def price_values(self) -> tuple[float, str | None, str | None]:
        """The price columns' values, in PRICE_ATTRIBUTES order."""
        return (self.dollars_per_hour, self.purchase or None, self.price_source or None)

    def update(self, gpu: int, model: str, dollars_per_hour: float, purchase: str, price_source: str) -> None:
        """The GPU's attributes as a later charge gives them (the latest in the hour wins)."""
        self.gpu, self.model, self.dollars_per_hour = gpu, model, dollars_per_hour
        self.purchase, self.price_source = purchase, price_source

    def add_idle(self, idle_by: dict[Workload, Sums]) -> None:
        for left_by, sums in idle_by.items():
            _add_sums(self.idle_by.setdefault(left_by, {}), sums.keys(), sums.values())


def hour_start(t: float) -> int:
    """The unix time of the start of the UTC hour holding `t`."""
    return int(t // HOUR_S) * HOUR_S


def hour_shares(start: float, end: float) -> list[tuple[int, float]]:
    """(hour, fraction of [start, end) that falls in it) for every hour the interval touches.

    A zero-length interval (a reading with nothing to integrate) belongs wholly to its hour.
    """
    if not end > start:
        return [(hour_start(start), 1.0)]
    span = end - start
    shares = []
    hour = hour_start(start)
    while hour < end:
        overlap = min(end, hour + HOUR_S) - max(start, hour)
        if overlap > 0:
            shares.append((hour, overlap / span))
        hour += HOUR_S
    return shares


def _finite(values: Sequence[float | None]) -> bool:
    # None and 0 are dropped by filter (both fine); NaN and infinities are truthy and stay. In
    # C, without a generator frame per value: every charge's figures pass through here.
    return all(map(math.isfinite, filter(None, values)))


@dataclass(slots=True)
class Batch:
    """Hourly rows not yet written, and the period of the charges summed into them."""

    workload_rows: dict[_WorkloadHour, Sums] = field(default_factory=dict)
    gpu_rows: dict[_GpuHour, _PendingGpu] = field(default_factory=dict)
    first_at: float | None = None
    last_at: float | None = None
    sizing_rows: dict[_SizingHour, _PendingSizing] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        # Sizing rows are not counted: a workload has one per kind of unit it holds, never more
        # than its workload rows of the hour, and they are dropped with their hour.
        return len(self.workload_rows) + len(self.gpu_rows)

    def sizing_columns(self) -> list[dict[str, object]]:
        """The sizing_hours rows, as UPSERT_SIZING takes them."""
        return [key.columns() | p.columns() for key, p in self.sizing_rows.items()]

    def dollars(self) -> float:
        """What these rows would add to `report`'s TOTAL: workload, idle and unobserved dollars."""
        return math.fsum(
            [s.get("dollars") or 0.0 for s in self.workload_rows.values()]
            + [
                (p.sums.get("idle_dollars") or 0.0) + (p.sums.get("unobserved_dollars") or 0.0)
                for p in self.gpu_rows.values()
            ]
        )

    def holds_before(self, hour: int) -> bool:
        """Whether a row here, or the period these rows cover, starts before `hour`."""
        if self.first_at is not None and self.first_at < hour:
            return True
        return any(key.hour < hour for rows in (self.workload_rows, self.gpu_rows, self.sizing_rows) for key in rows)

    def nodes(self) -> set[str]:
        return {key.node for key in self.gpu_rows} | {key.node for key in self.workload_rows}

    def idle_columns(self) -> list[dict[str, object]]:
        """The idle_hours rows (a GPU-hour's idle time by who left it idle), as UPSERT_IDLE takes them."""
        return [
            key.columns()
            | left_by.label_dict()
            | {"gpu": p.gpu}
            | {name: sums.get(name, None if name in PRICED_MEASURES else 0.0) for name in IDLE_MEASURES}
            for key, p in self.gpu_rows.items()
            for left_by, sums in p.idle_by.items()
        ]

    def cover(self, start: float, end: float) -> None:
        self.first_at = start if self.first_at is None else min(self.first_at, start)
        self.last_at = end if self.last_at is None else max(self.last_at, end)

    def absorb(self, newer: Batch) -> None:
        """Add `newer`'s rows to these (these being the older: a newer GPU row's attributes win)."""
        for key, sums in newer.workload_rows.items():
            old = self.workload_rows.get(key)
            if old is None:
                self.workload_rows[key] = sums
            else:
                _add_sums(old, sums.keys(), sums.values())
        for gpu_key, later in newer.gpu_rows.items():
            earlier = self.gpu_rows.get(gpu_key)
            if earlier is None:
                self.gpu_rows[gpu_key] = later
            else:
                earlier.update(later.gpu, later.model, later.dollars_per_hour, later.purchase, later.price_source)
                _add_sums(earlier.sums, later.sums.keys(), later.sums.values())
                earlier.add_idle(later.idle_by)
        for sizing_key, newer_sizing in newer.sizing_rows.items():
            older_sizing = self.sizing_rows.get(sizing_key)
            if older_sizing is None:
                self.sizing_rows[sizing_key] = newer_sizing
            else:
                older_sizing.absorb(newer_sizing)
        if newer.first_at is not None and newer.last_at is not None:
            self.cover(newer.first_at, newer.last_at)

    def take_hour(self, hour: int) -> Batch:
        """Remove every row of `hour` and return them; the period then starts after that hour."""
        taken = Batch(
            {k: v for k, v in self.workload_rows.items() if k.hour == hour},
            {k: v for k, v in self.gpu_rows.items() if k.hour == hour},
            sizing_rows={k: v for k, v in self.sizing_rows.items() if k.hour == hour},
        )
        for key in taken.workload_rows:
            del self.workload_rows[key]
        for gpu_key in taken.gpu_rows:
            del self.gpu_rows[gpu_key]
        for sizing_key in taken.sizing_rows:
            del self.sizing_rows[sizing_key]
        if not self.rows:
            self.first_at = self.last_at = None
        elif self.first_at is not None and self.last_at is not None:
            self.first_at = min(max(self.first_at, hour + HOUR_S), self.last_at)
        return taken


class PendingCharges:
    """Charges added and not yet written, summed into one row per hour and key: at most
    `max_rows` rows, so a ledger that cannot be written for days never exhausts memory.

    Past `max_rows` the oldest hours are dropped whole (never part of an hour, so a dropped
    hour's GPU rows and workload rows go together); the rows and dollars dropped are counted
    and the first drop of each outage is logged as an error. Safe to call from several threads.
    `LedgerSink` keeps one while the file cannot even be opened and hands it to the `Ledger`
    that opens it.
    """

    def __init__(self, path: str | Path, max_rows: int = DEFAULT_MAX_PENDING_ROWS) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be 1 or more, got {max_rows}")
        self._path = Path(path)
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._batch = Batch()
        self._dropped_rows = 0
        self._dropped_dollars = 0.0
        self._dropping = False  # a drop has been logged since the last successful flush
        self._rejected = 0

    @property
    def rows(self) -> int:
        with self._lock:
            return self._batch.rows

    @property
    def dropped_rows(self) -> int:
        """Hourly rows dropped, since this started, because more than `max_rows` were pending."""
        return self._dropped_rows

    @property
    def dropped_dollars(self) -> float:
        """What the dropped rows held: workload dollars plus idle dollars."""
        return self._dropped_dollars

    @property
    def rejected(self) -> int:
        """Charges (or parts of them) refused for non-finite figures or an impossible interval."""
        return self._rejected

    def lost(self) -> tuple[int, float]:
        """(rows, dollars) pending now: what would be lost if nothing more could be written."""
        with self._lock:
            return self._batch.rows, self._batch.dollars()

    def lost_text(self) -> str:
        """What `lost()` and the rows dropped before it come to, as the closing error line says it."""
        rows, dollars = self.lost()
        dropped = self.dropped_rows
        earlier = f", besides {dropped} rows (${self.dropped_dollars:.2f}) dropped earlier" if dropped else ""
        return f"{rows} hourly rows (${dollars:.2f}) that could not be written{earlier}"

    def add(self, charges: Charges, make_room: Callable[[], object] | None = None) -> None:
        """Sum one interval's charges into the pending rows of the hours it covers, pro rata.

        With `make_room` (the ledger's flush), a charge over more hours than `max_rows` leaves
        room for (weeks of downtime, booked at the agent's first poll) is summed a part at a
        time, `make_room` called before each part that would not fit: its oldest hours are
        written, not dropped as an outage's are."""
        if not (_finite((charges.start, charges.end)) and charges.end - charges.start <= MAX_INTERVAL_S):
            self._reject(f"interval {charges.start!r} to {charges.end!r}")
            return
        workloads: list[tuple[WorkloadCharge, tuple[float | None, ...]]] = []
        for wc in charges.workloads:
            measures: tuple[float | None, ...] = _workload_measures(wc)
            if _finite(measures):
                workloads.append((wc, measures))
            else:
                self._reject(f"workload charge {wc.workload.describe()} on {wc.uuid}: {measures}")
        gpus: list[tuple[GpuCharge, tuple[float | None, ...]]] = []
        for gc in charges.gpus:
            gpu_measures: tuple[float | None, ...] = _gpu_measures(gc)
            if _finite((*gpu_measures, gc.dollars_per_hour)):
                gpus.append((gc, gpu_measures))
            else:
                self._reject(f"GPU charge on {gc.uuid}: {gpu_measures}")
        shares = hour_shares(charges.start, charges.end)
        rows_per_hour = max(1, len(workloads) + len(gpus))
        step = len(shares) if make_room is None else max(1, self.max_rows // (2 * rows_per_hour))
        for i in range(0, len(shares), step):
            part = shares[i : i + step]
            if make_room is not None and self.rows + len(part) * rows_per_hour > self.max_rows:
                make_room()
            self._add_hours(charges, workloads, gpus, part)

    def _add_hours(
        self,
        charges: Charges,
        workloads: Sequence[tuple[WorkloadCharge, tuple[float | None, ...]]],
        gpus: Sequence[tuple[GpuCharge, tuple[float | None, ...]]],
        shares: Sequence[tuple[int, float]],
    ) -> None:
        """`add`'s work for the hours of `shares`, a run of the interval's hours."""
        node = charges.node
        with self._lock:
            batch = self._batch
            # Rows are found by plain tuples: a NamedTuple key hashes and compares as the tuple it
            # is, and making one is a Python call, so it is made only for a new row.
            workload_rows, gpu_rows = batch.workload_rows, batch.gpu_rows
            for wc, measures in workloads:
                for hour, share in shares:
                    key = (hour, node, wc.gpu, wc.uuid, wc.workload, wc.account)
                    sums = workload_rows.get(key)  # type: ignore[call-overload]
                    if sums is None:
                        sums = workload_rows[_WorkloadHour(*key)] = {}
                    _add_sums(sums, WORKLOAD_MEASURES, measures, share)
            for gc, gpu_measures in gpus:
                for hour, share in shares:
                    gpu_key = (hour, node, gc.uuid)
                    pending = gpu_rows.get(gpu_key)  # type: ignore[call-overload]
                    if pending is None:
                        pending = gpu_rows[_GpuHour(*gpu_key)] = _PendingGpu(
                            gc.gpu, gc.model, gc.dollars_per_hour, purchase=gc.purchase, price_source=gc.price_source
                        )
                    else:
                        pending.update(gc.gpu, gc.model, gc.dollars_per_hour, gc.purchase, gc.price_source)
                    _add_sums(pending.sums, GPU_MEASURES, gpu_measures, share)
                    for idle in idle_parts(gc):
                        sums = pending.idle_by.setdefault(idle.left_by, {})
                        _add_sums(sums, IDLE_MEASURES, _idle_measures(idle), share)
            _add_usage(batch, charges, shares)
            if charges.workloads or charges.gpus:
                first, last = shares[0][0], shares[-1][0]
                batch.cover(max(charges.start, first), min(charges.end, last + HOUR_S))
            self._cap()

    def take(self) -> Batch:
        """Everything pending, for a flush to write; `restore` it if the flush fails."""
        with self._lock:
            batch, self._batch = self._batch, Batch()
        return batch

    def restore(self, batch: Batch) -> None:
        """Put rows a failed flush took back in front of whatever was added meanwhile."""
        with self._lock:
            batch.absorb(self._batch)
            self._batch = batch
            self._cap()

    def written(self) -> None:
        """A flush worked: the next drop starts a new outage, logged again."""
        self._dropping = False

    def _cap(self) -> None:
        # Called with the lock held. Drops whole hours, oldest first, until the rows fit.
        batch = self._batch
        while batch.rows > self.max_rows:
            oldest = min(
                [key.hour for key in batch.gpu_rows]
                + [key.hour for key in batch.workload_rows]
                + [key.hour for key in batch.sizing_rows]
            )
            dropped = batch.take_hour(oldest)
            dollars = dropped.dollars()
            self._dropped_rows += dropped.rows
            self._dropped_dollars += dollars
            if not self._dropping:
                self._dropping = True
                log.error(
                    "ledger %s: more than ledger.max_pending_rows (%d) hourly rows wait to be written; dropping "
                    "the oldest hours, starting with %s ($%.2f in %d rows); gpuledger_ledger_dropped_rows_total "
                    "counts every drop",
                    self._path,
                    self.max_rows,
                    iso_time(oldest),
                    dollars,
                    dropped.rows,
                )

    def _reject(self, what: str) -> None:
        self._rejected += 1
        if self._rejected == 1:
            log.warning(
                "ledger %s: refusing %s (not finite or too long); further refusals are only counted", self._path, what
            )


def _add_usage(batch: Batch, charges: Charges, shares: Sequence[tuple[int, float]]) -> None:
    """Each workload's use of each unit, weighted by the interval's seconds in each hour."""
    interval_s = charges.end - charges.start
    if not charges.usage or not interval_s > 0:
        return
    node = charges.node
    rows = batch.sizing_rows
    # Per kind of unit a workload holds: how many it holds, and its pending row in each hour.
    units: dict[tuple[Workload, str, str], tuple[list[int], list[_PendingSizing]]] = {}
    for usage in charges.usage:
        if not _finite((usage.busy, usage.memory_bytes, usage.memory_total_bytes)):
            continue
        kind = (usage.workload, usage.gpu_model, usage.mig_profile)
        found = units.get(kind)
        if found is None:
            pendings = []
            for hour, _share in shares:
                key = (hour, node, *kind)
                # A plain tuple finds the _SizingHour key (a NamedTuple hashes and compares as
                # the tuple it is): the key is made only for a new row.
                pending = rows.get(key)  # type: ignore[call-overload]
                if pending is None:
                    pending = rows[_SizingHour(*key)] = _PendingSizing()
                pendings.append(pending)
            found = units[kind] = ([0], pendings)
        found[0][0] += 1
        for pending, (_hour, share) in zip(found[1], shares, strict=True):
            pending.add(usage, interval_s * share)
    for (count,), pendings in units.values():
        for pending in pendings:
            pending.max_units = max(pending.max_units, count)
