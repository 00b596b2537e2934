"""What `snapshot` prints: a table for people, JSON for programs."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from agent.model import AgentState, Attribution, DeviceReading, Telemetry
from agent.scrub import escape_control
from agent.units import format_duration


def _raised_flags(state: AgentState, with_duration: bool) -> dict[str, list[str]]:
    """GPU uuid -> the rules raised on it, e.g. ["idle 2h"] (or ["idle"])."""
    flags: dict[str, list[str]] = {}
    for flag in state.flags:
        if flag.raised:
            text = f"{flag.rule} {format_duration(flag.held_s)}" if with_duration else flag.rule
            flags.setdefault(flag.uuid, []).append(text)
    return flags


def snapshot_json(state: AgentState) -> dict[str, Any]:
    snapshot, attribution = state.snapshot, state.attribution
    assert snapshot is not None
    prices = dict(state.prices)
    flags = _raised_flags(state, with_duration=False)
    data = asdict(snapshot)
    data["devices"] = [
        dict(
            asdict(d),
            model=d.model,
            gpu=d.label,
            owners=[
                dict(h.workload.label_dict(), pids=list(h.pids), allocated=h.allocated, sm_util=h.sm_util)
                for h in attribution.for_device(d.uuid)
            ],
            price=asdict(price) if (price := prices.get(d.uuid)) is not None else None,
            busy=d.busy,
            flags=flags.get(d.uuid, []),
        )
        for d in snapshot.devices
    ]
    return data


def _fmt(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def render_table(state: AgentState) -> str:
    snapshot, attribution = state.snapshot, state.attribution
    assert snapshot is not None
    prices = dict(state.prices)
    flags = _raised_flags(state, with_duration=True)
    header = (
        "GPU", "MODEL", "UP", "UTIL", "MEM USED/TOTAL GiB", "BUSY", "TEMP", "POWER W", "PROCS", "NVLINK DOWN",
        "SM MHZ", "$/H", "FLAGS", "HEALTH", "OWNERS",
    )  # fmt: skip
    rows: list[tuple[str, ...]] = [header]
    for d in snapshot.devices:
        price = prices.get(d.uuid)
        hourly = f"{price.dollars_per_hour:.2f}" if price is not None else ("-" if d.is_mig else "?")
        sm_mhz = _fmt(d.telemetry.sm_clock_hz if d.telemetry else None, ".0f", 1e-6)
        health = ",".join(health_notes(d.telemetry)) if d.telemetry else ""
        flagged = ", ".join(flags.get(d.uuid, [])) or "-"
        row = (*_row(d), sm_mhz, hourly, flagged, health or "-", _owners(attribution, d))
        # Escaped before the widths are taken: the driver's model name, as the node's name and
        # the price notes below, is printed to a terminal that would act on an escape sequence.
        rows.append(tuple(escape_control(cell) for cell in row))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(snapshot.taken_at))
    title = f"{snapshot.node.hostname}  driver {snapshot.node.driver_version}  at {when}"
    sources: dict[str, list[str]] = {}
    for d in snapshot.gpus:
        price = prices.get(d.uuid)
        source = (
            "no price known" if price is None else price.source + (f" ({price.mismatch})" if price.mismatch else "")
        )
        sources.setdefault(source, []).append(str(d.index))
    notes = [f"$/H for GPU {','.join(gpus)}: {source}" for source, gpus in sources.items()]
    return "\n".join([escape_control(title), *lines, "", *map(escape_control, notes)])


def health_notes(t: Telemetry) -> list[str]:
    """What is wrong with a GPU's hardware, in short words: "throttled:sw_thermal_slowdown",
    "ecc-uncorrected:1", "remap-pending", "pcie:gen3x8<gen4x16", "nvlink-errors:12"."""
    notes = [f"throttled:{reason}" for reason in t.reasons() if reason != "gpu_idle"]
    if t.ecc_uncorrected_volatile:
        notes.append(f"ecc-uncorrected:{t.ecc_uncorrected_volatile}")
    if t.row_remap_failure:
        notes.append("remap-failed")
    if t.row_remap_pending:
        notes.append("remap-pending")
    if t.retired_pages_pending:
        notes.append("page-retirement-pending")
    gen, width = t.pcie_link_generation, t.pcie_link_width
    gen_max, width_max = t.pcie_link_generation_max, t.pcie_link_width_max
    if None not in (gen, width, gen_max, width_max) and (gen, width) != (gen_max, width_max):
        notes.append(f"pcie:gen{gen}x{width}<gen{gen_max}x{width_max}")
    errors = sum((link.crc_errors or 0) + (link.replay_errors or 0) + (link.recovery_errors or 0) for link in t.nvlinks)
    if errors:
        notes.append(f"nvlink-errors:{errors}")
    return notes


def _owners(attribution: Attribution, d: DeviceReading) -> str:
    """Who holds the device, e.g. "job 8812 (alice) llama-3-8b; serving/vllm-llama-0 [alloc]"."""
    parts = []
    for h in attribution.for_device(d.uuid):
        w = h.workload
        text = w.describe()
        if w.user and not text.startswith("user "):
            text += f" ({w.user})"
        if w.model:
            text += f" {w.model}"
        if w.team:
            text += f" team={w.team}"
        if h.allocated and not h.pids:
            text += " [allocated, idle]"
        parts.append(text)
    return "; ".join(parts) or "-"


def _busy(d: DeviceReading) -> str:
    """How busy the device was, by the figure accounting and the rules take ("37% gpm"):
    beside UTIL, where NVML counts any kernel as a full GPU."""
    busy = d.busy
    return "-" if busy is None else f"{busy:.0%} {d.busy_source}"


def _row(d: DeviceReading) -> tuple[str, ...]:
    gib = 1 / 2**30
    memory = (
        "-"
        if d.memory_total_bytes is None
        else f"{_fmt(d.memory_used_bytes, '.1f', gib)}/{_fmt(d.memory_total_bytes, '.0f', gib)}"
    )
    down_links = [str(link.link) for link in d.nvlinks if not link.up]
    model = d.model if not d.is_mig else "  " + d.mig_profile
    return (
        d.label,
        model,
        "yes" if d.up else f"no ({d.down_reason})",
        _fmt(d.utilization, ".0%"),
        memory,
        _busy(d),
        _fmt(d.temperature_c, ".0f"),
        _fmt(d.power_w, ".0f"),
        str(len(d.processes)),
        ",".join(down_links) or "-",
    )
