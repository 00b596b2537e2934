"""Reading what right-sizing needs from ledgers (`sizing_hours`, schema version 6), and the
price each workload was charged at (`workload_hours`). Read-only, like read.py."""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.accounting import sketch
from agent.accounting.rightsize import WorkloadSizing
from agent.ledger.read import _bounds, current_schema
from agent.model import Workload


@dataclass(frozen=True, slots=True)
class SizingRow:
    """One stored hour of one workload on one kind of unit (schema.py, version 6)."""

    hour: int
    node: str
    workload: Workload
    gpu_model: str
    mig_profile: str
    memory_total_bytes: float | None
    busy_source: str
    held_s: float
    busy_s: float
    measured_s: float
    memory_s: float
    peak_memory_bytes: float | None
    max_units: int
    busy_sketch: sketch.Sketch
    memory_sketch: sketch.Sketch


@dataclass(frozen=True, slots=True)
class ChargedRate:
    """What a workload paid for one kind of unit over the window: dollars and charged seconds.
    Their ratio is the GPU's $/hour, for a MIG instance too (its charged seconds are weighted by
    its share of the GPU, as its dollars are)."""

    dollars: float
    charged_s: float


# A workload, the GPU model it held and whether it held MIG instances of it (True) or whole GPUs.
RateKey = tuple[Workload, str, bool]


def read_sizing(
    path: str | Path, *, since: float | None = None, until: float | None = None
) -> tuple[list[SizingRow], dict[RateKey, ChargedRate]]:
    """The sizing rows of the hours overlapping [since, until), and per (workload, GPU model,
    MIG or not) what it was charged (dollars, charged seconds), for the price it pays."""
    where, params = _bounds(since, until)
    with current_schema(Path(path)) as conn:
        return _read(conn, where, params)


def _read(
    conn: sqlite3.Connection, where: str, params: Sequence[int | float]
) -> tuple[list[SizingRow], dict[RateKey, ChargedRate]]:
    conn.row_factory = sqlite3.Row
    conn.execute("BEGIN")
    rows = conn.execute(f"SELECT * FROM sizing_hours{where} ORDER BY hour", params).fetchall()
    # What a workload paid, by its rows' GPU: found by the row's uuid (a whole GPU's), else by
    # its GPU index (a MIG instance's row names the instance; the first uuid where a GPU was
    # swapped within the hour), as schema.py's version 4 finds it.
    qualified = where.replace("hour", "w.hour")
    charged = conn.execute(
        "SELECT w.*, g.model AS gpu_model, g.uuid != w.uuid AS mig FROM workload_hours AS w JOIN gpu_hours AS g"
        " ON g.hour = w.hour AND g.node = w.node AND g.uuid = coalesce("
        "(SELECT uuid FROM gpu_hours WHERE hour = w.hour AND node = w.node AND uuid = w.uuid),"
        " (SELECT uuid FROM gpu_hours WHERE hour = w.hour AND node = w.node AND gpu = w.gpu ORDER BY uuid LIMIT 1))"
        f"{qualified}",
        params,
    ).fetchall()
    conn.execute("COMMIT")
    sizing = [
        SizingRow(
            hour=r["hour"],
            node=r["node"],
            workload=Workload.from_labels(r),
            gpu_model=r["gpu_model"],
            mig_profile=r["mig_profile"],
            memory_total_bytes=r["memory_total_bytes"],
            busy_source=r["busy_source"],
            held_s=r["held_s"],
            busy_s=r["busy_s"],
            measured_s=r["measured_s"],
            memory_s=r["memory_s"],
            peak_memory_bytes=r["peak_memory_bytes"],
            max_units=r["max_units"],
            busy_sketch=sketch.decode(r["busy_sketch"]),
            memory_sketch=sketch.decode(r["memory_sketch"]),
        )
        for r in rows
    ]
    dollars: dict[RateKey, list[float]] = {}
    seconds: dict[RateKey, list[float]] = {}
    for r in charged:
        key = (Workload.from_labels(r), r["gpu_model"], bool(r["mig"]))
        dollars.setdefault(key, []).append(r["dollars"])
        seconds.setdefault(key, []).append(r["charged_s"])
    rates = {key: ChargedRate(math.fsum(dollars[key]), math.fsum(seconds[key])) for key in dollars}
    return sizing, rates


def workload_sizing(
    rows: Sequence[SizingRow], rates: dict[RateKey, ChargedRate], *, until: float | None = None
) -> list[WorkloadSizing]:
    """The rows summed per workload and kind of unit over the window (every node alike: a job on
    two nodes holds the sum of its units there; its peaks are the larger)."""
    groups: dict[tuple[Workload, str, str], list[SizingRow]] = {}
    for row in rows:
        groups.setdefault((row.workload, row.gpu_model, row.mig_profile), []).append(row)
    out = []
    for (workload, gpu_model, mig_profile), group in groups.items():
        busy_sketch: sketch.Sketch = {}
        memory_sketch: sketch.Sketch = {}
        for row in group:
            sketch.merge(busy_sketch, row.busy_sketch)
            sketch.merge(memory_sketch, row.memory_sketch)
        # Units held at once: the most in one hour on one node, summed over nodes in that hour.
        per_hour: dict[int, int] = {}
        for row in group:
            per_hour[row.hour] = per_hour.get(row.hour, 0) + row.max_units
        # Hours in which it did measurable work (busy over 1% of what it held), or may have: an hour
        # with no busy reading at all (a MIG instance without GPM) does not show it idle.
        used_hours = [row.hour for row in group if not row.measured_s > 0 or row.busy_s > 0.01 * row.measured_s]
        peaks = [row.peak_memory_bytes for row in group if row.peak_memory_bytes is not None]
        totals = [row.memory_total_bytes for row in group if row.memory_total_bytes is not None]
        rate = rates.get((workload, gpu_model, bool(mig_profile)))
        out.append(
            WorkloadSizing(
                workload=workload,
                nodes=tuple(sorted({row.node for row in group})),
                gpu_model=gpu_model,
                mig_profile=mig_profile,
                units=max(per_hour.values()),
                held_s=math.fsum(row.held_s for row in group),
                busy_s=math.fsum(row.busy_s for row in group),
                measured_s=math.fsum(row.measured_s for row in group),
                memory_s=math.fsum(row.memory_s for row in group),
                peak_memory_bytes=max(peaks) if peaks else None,
                memory_total_bytes=max(totals) if totals else None,
                busy_sketch=busy_sketch,
                memory_sketch=memory_sketch,
                first_hour=min(per_hour),
                last_hour=max(per_hour),
                last_used_hour=max(used_hours) if used_hours else None,
                busy_source=next((row.busy_source for row in reversed(group) if row.busy_source), ""),
                charged_dollars=rate.dollars if rate is not None else None,
                charged_s=rate.charged_s if rate is not None else None,
                units_at_end=per_hour[max(per_hour)],
            )
        )
    return out
