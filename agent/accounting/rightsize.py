"""Right-sizing: for each workload, the cheapest unit in the price catalogue that fits what it
used, and what the change would save a month. Pure: usage, GPU specs and prices in, advice out.

What a workload needs, from the ledger's sizing sketches over the window (agent/accounting/
sketch.py): its p95 memory per unit (never above its peak) and its p95 busy per unit, each
with `headroom` (20% by default) on top. Compute is scaled by the catalogue's dense BF16 (FP16
where the part has no BF16) tensor throughput: a workload 15% busy on a 312-TFLOPS A100 needs
0.15 x 312 = 46.8 TFLOPS, x 1.2 headroom = 56.2. An option fits when it has that memory per unit
and that throughput, on as many units as the workload holds now or fewer (a one-GPU workload is
offered one unit; a workload on n units may be offered n' <= n, assuming its work and memory
spread evenly). Options: every catalogued GPU model with a price, the held model in fewer units,
and the held GPU's MIG profiles (priced at the held GPU's price x slices / 7).

A workload that did no measurable work (busy over 1% of its held time) for `stop_after_s` or
longer, and still held its units at the end of the window, is told to stop: unused for N days.

Every figure is an estimate (a month is 730 hours: 8760 / 12), and says what it rests on. Busy
from NVML utilization overstates use (any kernel running counts as busy), so advice from it is
conservative; GPM SM activity is used where the ledger recorded it.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from agent.accounting import sketch
from agent.accounting.pricing import _lookup
from agent.model import Workload

HOURS_PER_MONTH = 730.0  # 8760 h / 12
DEFAULT_HEADROOM = 0.2
DEFAULT_STOP_AFTER_S = 86400.0
USED_BUSY_FRACTION = 0.01  # busier than this over an hour's held time: it did some work
GIB = 2**30
MIG_SLICES = 7

ACTION_NONE = "none"
ACTION_STOP = "stop"
ACTION_SMALLER = "smaller_gpu"
ACTION_MIG = "mig"
ACTION_FEWER = "fewer_gpus"


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """A GPU model's memory (GiB, as the datasheet's GB figure), dense BF16/FP16 tensor TFLOPS,
    the MIG profiles it can be split into, and where the figures came from."""

    memory_gib: float
    dense_tflops: float
    mig_profiles: tuple[str, ...]
    source: str
    read: dt.date


_PROFILE = re.compile(r"(\d+)g\.(\d+)gb")


def mig_shape(profile: str) -> tuple[int, float] | None:
    """(compute slices of 7, memory GiB) of a MIG profile name such as "3g.40gb"."""
    match = _PROFILE.fullmatch(profile.strip().casefold())
    if match is None:
        return None
    return int(match.group(1)), float(match.group(2))


@dataclass(frozen=True, slots=True)
class WorkloadSizing:
    """What one workload held and used of one kind of unit over a window (ledger/sizing.py sums it)."""

    workload: Workload
    nodes: tuple[str, ...]
    gpu_model: str
    mig_profile: str
    units: int  # held at once, at most
    held_s: float  # unit-seconds
    busy_s: float
    measured_s: float
    memory_s: float
    peak_memory_bytes: float | None
    memory_total_bytes: float | None
    busy_sketch: Mapping[int, float]
    memory_sketch: Mapping[int, float]
    first_hour: int
    last_hour: int
    last_used_hour: int | None
    busy_source: str = ""
    charged_dollars: float | None = None  # what it paid for these units over the window
    charged_s: float | None = None
    units_at_end: int | None = None  # held at once in the last hour it held any (None: `units`)

    @property
    def mean_busy(self) -> float | None:
        return self.busy_s / self.measured_s if self.measured_s > 0 else None

    @property
    def p95_busy(self) -> float | None:
        bucket = sketch.quantile_bucket(self.busy_sketch, 0.95)
        return None if bucket is None else sketch.busy_edge(bucket)

    @property
    def p95_memory_bytes(self) -> float | None:
        bucket = sketch.quantile_bucket(self.memory_sketch, 0.95)
        if bucket is None:
            return None
        edge = sketch.memory_edge(bucket)
        return min(edge, self.peak_memory_bytes) if self.peak_memory_bytes is not None else edge


@dataclass(frozen=True, slots=True)
class Recommendation:
    """The advice for one workload: the cheapest option that fits, or none, or stop."""

    workload: Workload
    holds: str  # "1 x A100-SXM4-80GB", "1 x A100-SXM4-80GB MIG 3g.40gb"
    sizing: WorkloadSizing
    action: str  # ACTION_*
    option: str  # what to move to ("" for none)
    dollars_per_hour: float | None  # what it pays now for all its units
    option_dollars_per_hour: float | None
    saving_per_month: float  # estimate, at HOURS_PER_MONTH
    basis: str  # the figures the estimate rests on
    unused_days: float | None = None


def parse_specs(raw: object, where: str) -> Mapping[str, GpuSpec]:
    """The catalogue's gpu_specs section (prices.yaml). ValueError, one line, for a bad entry."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: gpu_specs: expected a mapping of GPU models")
    specs: dict[str, GpuSpec] = {}
    expected = {"memory_gb", "dense_tflops", "mig_profiles", "source", "read"}
    for name, fields in raw.items():
        entry = f"{where}: gpu_specs.{name}"
        if not isinstance(name, str) or not isinstance(fields, Mapping):
            raise ValueError(f"{entry}: expected a mapping of fields")
        missing = sorted(expected - {"mig_profiles"} - set(fields))
        unknown = sorted(str(k) for k in fields if k not in expected)
        if missing or unknown:
            raise ValueError(f"{entry}: missing {missing} / unknown {unknown}")
        numbers = [fields["memory_gb"], fields["dense_tflops"]]
        if any(isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 for v in numbers):
            raise ValueError(f"{entry}: memory_gb and dense_tflops must be positive numbers")
        profiles = fields.get("mig_profiles", [])
        if not isinstance(profiles, list) or any(not isinstance(p, str) or mig_shape(p) is None for p in profiles):
            raise ValueError(f"{entry}: mig_profiles must be a list of names like 3g.40gb")
        read = fields["read"]
        if isinstance(read, str):
            read = dt.date.fromisoformat(read)
        if not isinstance(read, dt.date) or not isinstance(fields["source"], str):
            raise ValueError(f"{entry}: source must be text and read a date")
        specs[name] = GpuSpec(
            float(fields["memory_gb"]), float(fields["dense_tflops"]), tuple(profiles), fields["source"], read
        )
    return MappingProxyType(specs)


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _pct(value: float) -> str:
    return f"{value * 100:.0f}%"


def _money(value: float) -> str:
    return f"${value:.4f}".rstrip("0").rstrip(".") + "/h"


@dataclass(frozen=True, slots=True)
class _Option:
    action: str
    label: str
    units: int
    dollars_per_hour: float  # for all its units
    basis: str


def recommend(
    usage: WorkloadSizing,
    specs: Mapping[str, GpuSpec],
    price_of: Callable[[str], float | None],
    *,
    end: float,
    headroom: float = DEFAULT_HEADROOM,
    stop_after_s: float = DEFAULT_STOP_AFTER_S,
) -> Recommendation:
    """The advice for one workload over a window that ends at `end` (unix seconds).

    `price_of(model)` is a GPU model's $/GPU-hour at the prices in force (config, else the
    catalogue); the held units' own price is what the ledger charged for them, else that."""
    held = _lookup(specs, usage.gpu_model)
    shape = mig_shape(usage.mig_profile) if usage.mig_profile else None
    holds = f"{usage.units} x {usage.gpu_model}" + (f" MIG {usage.mig_profile}" if usage.mig_profile else "")
    unit_price = _unit_price(usage, price_of, shape)
    now_per_hour = unit_price * usage.units if unit_price is not None else None

    def verdict(action: str, option: str, option_per_hour: float | None, basis: str, **kw: float) -> Recommendation:
        saving = (
            (now_per_hour - option_per_hour) * HOURS_PER_MONTH
            if now_per_hour is not None and option_per_hour is not None
            else 0.0
        )
        return Recommendation(
            usage.workload, holds, usage, action, option, now_per_hour, option_per_hour, saving, basis,
            unused_days=kw.get("unused_days"),
        )  # fmt: skip

    still_held = usage.last_hour + 2 * 3600 >= end
    unused_since = usage.last_used_hour + 3600 if usage.last_used_hour is not None else usage.first_hour
    unused_s = end - unused_since
    if still_held and unused_s >= stop_after_s:
        # Stopping saves what it holds now, not the most it held at once in the window (a job
        # that ran on 4 GPUs for an hour and has sat on 1 since saves 1 GPU's price).
        days = unused_s / 86400
        held_now = usage.units_at_end if usage.units_at_end is not None else usage.units
        now_per_hour = unit_price * held_now if unit_price is not None else None
        holds = f"{held_now} x {usage.gpu_model}" + (f" MIG {usage.mig_profile}" if usage.mig_profile else "")
        basis = f"estimate: no measurable work (busy over {_pct(USED_BUSY_FRACTION)} of held time) for {days:.1f} days"
        if now_per_hour is not None:
            basis += f"; {holds} at {_money(now_per_hour)} x {HOURS_PER_MONTH:.0f} h/month"
        return verdict(ACTION_STOP, f"stop it: unused for {days:.1f} days", 0.0, basis, unused_days=days)

    p95_busy = usage.p95_busy
    p95_memory = usage.p95_memory_bytes
    if held is None or unit_price is None or now_per_hour is None or p95_busy is None or p95_memory is None:
        missing = [
            what
            for what, gone in (
                (f"specs of {usage.gpu_model}", held is None),
                ("a price", unit_price is None),
                ("busy readings", p95_busy is None),
                ("memory readings", p95_memory is None),
            )
            if gone
        ]
        return verdict(ACTION_NONE, "", None, f"cannot size: no {', no '.join(missing)}")
    held_name, held_spec = held
    slices = shape[0] if shape is not None else MIG_SLICES
    held_tflops = held_spec.dense_tflops * slices / MIG_SLICES
    need_tflops = usage.units * p95_busy * held_tflops * (1 + headroom)
    need_memory_gib = usage.units * p95_memory / GIB * (1 + headroom)
    uses = (
        f"uses p95 {_gib(p95_memory)} (peak {_gib(usage.peak_memory_bytes or 0.0)}) and p95 {_pct(p95_busy)} busy"
        f" ({usage.busy_source or 'busy'}) of {held_tflops:.0f} TFLOPS per unit; needs {need_memory_gib:.1f} GiB and"
        f" {need_tflops:.1f} TFLOPS with {_pct(headroom)} headroom"
    )
    gpu_price = unit_price * MIG_SLICES / slices  # the whole held GPU's price
    options: list[_Option] = []
    for name, spec in specs.items():
        same = name == held_name
        price = gpu_price if same else price_of(name)
        if price is None:
            continue
        # As many units as its compute or its memory needs, whichever needs more.
        count = max(
            1,
            math.ceil(round(need_tflops / spec.dense_tflops, 9)),
            math.ceil(round(need_memory_gib / spec.memory_gib, 9)),
        )
        if count > usage.units:
            continue
        if same and count == usage.units and shape is None:
            continue  # what it holds now
        action = ACTION_FEWER if same else ACTION_SMALLER
        options.append(
            _Option(
                action, f"{count} x {name}", count, price * count,
                f"{count} x {spec.memory_gib:g} GiB, {count} x {spec.dense_tflops:g} TFLOPS at {_money(price)}"
                f" ({spec.source})",
            )
        )  # fmt: skip
    for profile in held_spec.mig_profiles:
        mig = mig_shape(profile)
        if mig is None or profile == usage.mig_profile or usage.units != 1:
            continue
        mig_slices, mig_gib = mig
        mig_tflops = held_spec.dense_tflops * mig_slices / MIG_SLICES
        if mig_tflops < need_tflops or mig_gib < need_memory_gib or mig_slices >= MIG_SLICES:
            continue
        price = gpu_price * mig_slices / MIG_SLICES
        options.append(
            _Option(
                ACTION_MIG, f"{held_name} MIG {profile}", 1, price,
                f"{mig_gib:g} GiB, {held_spec.dense_tflops:g} x {mig_slices}/7 = {mig_tflops:.1f} TFLOPS at"
                f" {_money(gpu_price)} x {mig_slices}/7 = {_money(price)}",
            )
        )  # fmt: skip
    cheaper = [o for o in options if o.dollars_per_hour < now_per_hour - 1e-9]
    if not cheaper:
        return verdict(ACTION_NONE, "", None, f"estimate: {uses}; nothing cheaper fits")
    best = min(cheaper, key=lambda o: (o.dollars_per_hour, o.label))
    basis = (
        f"estimate: {uses}; {best.label}: {best.basis}; saving ({_money(now_per_hour)} - "
        f"{_money(best.dollars_per_hour)}) x {HOURS_PER_MONTH:.0f} h/month"
    )
    return verdict(best.action, best.label, best.dollars_per_hour, basis)


def _unit_price(
    usage: WorkloadSizing, price_of: Callable[[str], float | None], shape: tuple[int, float] | None
) -> float | None:
    """What one held unit costs an hour: its GPU's price as the ledger charged it, else at the
    prices in force; a MIG instance that x slices / 7, as its options are priced."""
    if usage.charged_dollars is not None and usage.charged_s and usage.charged_s > 0:
        price: float | None = usage.charged_dollars / (usage.charged_s / 3600)
    else:
        price = price_of(usage.gpu_model)
    if price is None:
        return None
    return price * (shape[0] / MIG_SLICES if shape is not None else 1.0)
