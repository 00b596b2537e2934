"""`gpuledger report --recommend`: right-sizing advice per workload over the report's window,
as a table, CSV or JSON (agent/accounting/rightsize.py decides; this reads and renders)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.accounting.pricing import _lookup
from agent.accounting.rightsize import (
    ACTION_NONE,
    DEFAULT_HEADROOM,
    DEFAULT_STOP_AFTER_S,
    GIB,
    HOURS_PER_MONTH,
    GpuSpec,
    Recommendation,
    parse_specs,
    recommend,
)
from agent.config import SHIPPED_CATALOGUE, Settings, load_catalogue
from agent.ledger.pending import HOUR_S
from agent.ledger.report import csv_text
from agent.ledger.sizing import ChargedRate, RateKey, SizingRow, read_sizing, workload_sizing
from agent.yamlfile import read_yaml


def load_specs(path: Path = SHIPPED_CATALOGUE) -> Mapping[str, GpuSpec]:
    raw = read_yaml(path, "price catalogue")
    section = raw.get("gpu_specs") if isinstance(raw, dict) else None
    return parse_specs(section or {}, str(path))


def recommendations(
    paths: Sequence[Path],
    settings: Settings,
    *,
    since: float | None,
    until: float | None,
    headroom: float = DEFAULT_HEADROOM,
    stop_after_s: float = DEFAULT_STOP_AFTER_S,
) -> list[Recommendation]:
    """Advice for every workload the ledgers record over [since, until), biggest saving first."""
    rows: list[SizingRow] = []
    rates: dict[RateKey, ChargedRate] = {}
    for path in paths:
        more_rows, more_rates = read_sizing(path, since=since, until=until)
        rows.extend(more_rows)
        for key, rate in more_rates.items():
            old = rates.get(key)
            rates[key] = (
                rate if old is None else ChargedRate(old.dollars + rate.dollars, old.charged_s + rate.charged_s)
            )
    if not rows:
        return []
    end = until if until is not None else float(max(r.hour for r in rows) + HOUR_S)
    catalogue = load_catalogue()
    overrides = settings.pricing.by_model

    def price_of(model: str) -> float | None:
        found = _lookup(overrides, model)
        if found is not None:
            return found[1]
        listed = _lookup(catalogue.gpu_models, model)
        return listed[1].dollars_per_hour if listed is not None else None

    specs = load_specs()
    advice = [
        recommend(usage, specs, price_of, end=end, headroom=headroom, stop_after_s=stop_after_s)
        for usage in workload_sizing(rows, rates, until=until)
    ]
    return sorted(advice, key=lambda r: (-r.saving_per_month, r.workload.describe()))


HEADERS = (
    "WORKLOAD", "HOLDS", "P95 MEM GIB", "PEAK MEM GIB", "P95 BUSY", "MEAN BUSY", "ADVICE", "NOW $/H", "OPTION $/H",
    "SAVES $/MONTH (EST.)",
)  # fmt: skip


def _cells(r: Recommendation) -> list[str]:
    s = r.sizing

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    return [
        r.workload.describe(),
        r.holds,
        num(None if s.p95_memory_bytes is None else s.p95_memory_bytes / GIB, ".1f"),
        num(None if s.peak_memory_bytes is None else s.peak_memory_bytes / GIB, ".1f"),
        num(None if s.p95_busy is None else s.p95_busy * 100, ".0f") + ("%" if s.p95_busy is not None else ""),
        num(None if s.mean_busy is None else s.mean_busy * 100, ".0f") + ("%" if s.mean_busy is not None else ""),
        r.option if r.action != ACTION_NONE else "-",
        num(r.dollars_per_hour, ".4f"),
        num(r.option_dollars_per_hour, ".4f"),
        f"{r.saving_per_month:.2f}",
    ]


def render_recommendations(advice: Sequence[Recommendation], fmt: str) -> str:
    if fmt == "json":
        return (
            json.dumps(
                {
                    "hours_per_month": HOURS_PER_MONTH,
                    "estimate": True,
                    "workloads": [
                        {
                            "workload": r.workload.label_dict(),
                            "holds": r.holds,
                            "gpu_model": r.sizing.gpu_model,
                            "mig_profile": r.sizing.mig_profile,
                            "units": r.sizing.units,
                            "p95_memory_bytes": r.sizing.p95_memory_bytes,
                            "peak_memory_bytes": r.sizing.peak_memory_bytes,
                            "p95_busy": r.sizing.p95_busy,
                            "mean_busy": r.sizing.mean_busy,
                            "busy_source": r.sizing.busy_source,
                            "action": r.action,
                            "option": r.option,
                            "dollars_per_hour": r.dollars_per_hour,
                            "option_dollars_per_hour": r.option_dollars_per_hour,
                            "saving_per_month_estimate": r.saving_per_month,
                            "unused_days": r.unused_days,
                            "basis": r.basis,
                        }
                        for r in advice
                    ],
                },
                indent=2,
            )
            + "\n"
        )
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(
            [h.lower().replace(" ", "_").replace("$", "dollars").replace("(est.)", "estimate") for h in HEADERS]
            + ["basis"]
        )
        for r in advice:
            workload, *figures = _cells(r)
            writer.writerow([csv_text(workload), *figures, r.basis])
        return out.getvalue()
    table = [list(HEADERS)] + [_cells(r) for r in advice]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADERS))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in table]
    lines.append("")
    lines.append(f"Estimates at {HOURS_PER_MONTH:.0f} h/month, from the prices in force; what each rests on:")
    lines.extend(f"  {r.workload.describe()}: {r.basis}" for r in advice)
    return "\n".join(lines) + "\n"
