"""Line up what gpuledger read on a real GPU with what nvidia-smi and nvitop read beside it
(the files scripts/realgpu/run.sh leaves in its OUT folder) and print Markdown tables:

  python scripts/realgpu/compare.py OUT

1. Each `snapshot --json` against the watcher's reading nearest in time, field by field.
2. Each /metrics scrape of `run` against the nearest reading, over time, with the workload phase.
3. The recorded trace's readings against the nearest readings, as the largest and median gaps.
"""

from __future__ import annotations

import datetime
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

Row = dict[str, Any]
MIB = 2**20


def _num(value: object) -> float | None:
    """nvidia-smi's text as a number: None for [N/A] and the like, hex masks as integers."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    if text.startswith("0x"):
        return float(int(text, 16))
    if text.startswith("P") and text[1:].isdigit():
        return float(text[1:])
    try:
        return float(text)
    except ValueError:
        return None


def _load_watch(out: Path) -> list[Row]:
    rows = []
    for line in (out / "watch.jsonl").read_text().splitlines():
        row = json.loads(line)
        row["mid"] = (row["t"] + row["smi_t"]) / 2
        rows.append(row)
    return rows


def _nearest(watch: list[Row], t: float) -> Row:
    return min(watch, key=lambda r: abs(r["mid"] - t))


def _by_uuid(rows: object) -> dict[str, Row]:
    return {r["uuid"]: r for r in rows} if isinstance(rows, list) else {}


def _phases(out: Path) -> list[tuple[float, float, str]]:
    """(start, end, name) of each workload phase, from the workloads' marks in log.txt."""
    starts: dict[str, float] = {}
    spans = []
    for m in re.finditer(r"^\[(\w+)\] (\d+\.\d+) (start|end) (\w+)$", (out / "log.txt").read_text(), re.M):
        key = f"{m[1]}.{m[4]}"
        if m[3] == "start":
            starts[key] = float(m[2])
        elif key in starts:
            spans.append((starts.pop(key), float(m[2]), m[4]))
    spans.extend((s, float("inf"), k.split(".")[1]) for k, s in starts.items())
    return sorted(spans)


def _phase_at(phases: list[tuple[float, float, str]], t: float) -> str:
    return "+".join(name for start, end, name in phases if start <= t < end) or "-"


# (field, ours from a snapshot device, nvidia-smi column and scale, nvitop key and scale)
Field = tuple[str, Callable[[Row], float | None], str | None, float, str | None, float]


def _t(key: str, scale: float = 1.0) -> Callable[[Row], float | None]:
    def get(d: Row) -> float | None:
        v = (d.get("telemetry") or {}).get(key)
        return None if v is None else float(v) * scale

    return get


def _d(key: str, scale: float = 1.0) -> Callable[[Row], float | None]:
    def get(d: Row) -> float | None:
        v = d.get(key)
        return None if v is None else float(v) * scale

    return get


FIELDS: list[Field] = [
    ("utilization %", _d("utilization", 100), "utilization.gpu", 1, "gpu_utilization", 1),
    ("memory used MiB", _d("memory_used_bytes", 1 / MIB), "memory.used", 1, "memory_used", 1 / MIB),
    ("memory total MiB", _d("memory_total_bytes", 1 / MIB), "memory.total", 1, "memory_total", 1 / MIB),
    ("temperature C", _d("temperature_c"), "temperature.gpu", 1, "temperature", 1),
    ("power W", _d("power_w"), "power.draw", 1, "power_usage_mw", 1e-3),
    ("power limit W", _d("power_limit_w"), "power.limit", 1, "power_limit_mw", 1e-3),
    ("energy kJ (counter)", _d("energy_j", 1e-3), None, 1, "energy_mj", 1e-6),
    ("SM clock MHz", _t("sm_clock_hz", 1e-6), "clocks.sm", 1, "sm_clock", 1),
    ("memory clock MHz", _t("memory_clock_hz", 1e-6), "clocks.mem", 1, "memory_clock", 1),
    ("SM clock max MHz", _t("sm_clock_max_hz", 1e-6), "clocks.max.sm", 1, "max_sm_clock", 1),
    ("memory clock max MHz", _t("memory_clock_max_hz", 1e-6), "clocks.max.mem", 1, "max_memory_clock", 1),
    ("performance state P", _t("performance_state"), "pstate", 1, "performance_state", 1),
    ("fan %", _t("fan_speed_ratio", 100), "fan.speed", 1, "fan_speed", 1),
    ("clock event reasons", _t("clock_event_reasons"), "clocks_event_reasons.active", 1, "clocks_event_reasons", 1),
    ("PCIe generation", _t("pcie_link_generation"), "pcie.link.gen.current", 1, "pcie_gen", 1),
    ("PCIe generation max", _t("pcie_link_generation_max"), "pcie.link.gen.max", 1, "pcie_gen_max", 1),
    ("PCIe width", _t("pcie_link_width"), "pcie.link.width.current", 1, "pcie_width", 1),
    ("PCIe width max", _t("pcie_link_width_max"), "pcie.link.width.max", 1, "pcie_width_max", 1),
    ("memory controller %", _t("memory_utilization", 100), "utilization.memory", 1, "memory_utilization", 1),
    ("encoder %", _t("encoder_utilization", 100), "utilization.encoder", 1, "encoder", 1),
    ("decoder %", _t("decoder_utilization", 100), "utilization.decoder", 1, "decoder", 1),
    ("ECC corrected (volatile)", _t("ecc_corrected_volatile"), "ecc.errors.corrected.volatile.total", 1, None, 1),
    ("ECC uncorrected (volatile)", _t("ecc_uncorrected_volatile"), "ecc.errors.uncorrected.volatile.total", 1, None, 1),
]


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.0f}" if abs(v - round(v)) < 1e-9 or abs(v) >= 100 else f"{v:.2f}"


def _snapshot_tables(out: Path, watch: list[Row], phases: list[tuple[float, float, str]]) -> Iterable[str]:
    for name in ("snap_busy.json", "snap_idle.json"):
        path = out / name
        if not path.is_file() or not path.read_text().strip():
            yield f"\n`{name}`: missing or empty\n"
            continue
        snap = json.loads(path.read_text())
        near = _nearest(watch, snap["taken_at"])
        smi, top = _by_uuid(near["smi_gpu"]), _by_uuid(near["nvitop"])
        yield (
            f"\n### {name}: taken at +{snap['taken_at'] - watch[0]['t']:.1f} s, "
            f"phase {_phase_at(phases, snap['taken_at'])}; "
            f"nvidia-smi/nvitop reading {near['mid'] - snap['taken_at']:+.1f} s from it; poll took "
            f"{snap.get('poll_duration_s', 0) * 1000:.0f} ms\n"
        )
        for d in snap["devices"]:
            s, n = smi.get(d["uuid"], {}), top.get(d["uuid"], {})
            yield f"\n{d['name']} {d['uuid']} busy source {d.get('busy_source')}, activity {d.get('activity')}\n"
            yield "| reading | gpuledger | nvidia-smi | nvitop |\n| --- | ---: | ---: | ---: |"
            for label, ours, smi_key, smi_scale, top_key, top_scale in FIELDS:
                sv = _num(s.get(smi_key)) if smi_key else None
                tv = _num(n.get(top_key)) if top_key else None
                yield (
                    f"| {label} | {_fmt(ours(d))} | {_fmt(None if sv is None else sv * smi_scale)} "
                    f"| {_fmt(None if tv is None else tv * top_scale)} |"
                )
            apps = {int(a["pid"]): _num(a.get("used_gpu_memory")) for a in near["smi_apps"] or [] if a.get("pid")}
            top_procs = {int(p): v for p, v in (n.get("processes") or {}).items()}
            yield "\n| pid | gpuledger MiB | gpuledger SM % | nvidia-smi MiB | nvitop MiB | nvitop SM % | owners |"
            yield "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"
            owners = {pid: o for o in d.get("owners", []) for pid in o.get("pids", [])}
            for pid in sorted({p["pid"] for p in d["processes"]} | set(apps) | set(top_procs)):
                ours_p = next((p for p in d["processes"] if p["pid"] == pid), {})
                o = owners.get(pid, {})
                who = ", ".join(f"{k}={v}" for k, v in o.items() if v and k not in ("pids", "sm_util", "allocated"))
                mem = ours_p.get("used_memory_bytes")
                sm = ours_p.get("sm_util")
                tp = top_procs.get(pid, {})
                yield (
                    f"| {pid} | {_fmt(None if mem is None else mem / MIB)} | {_fmt(None if sm is None else sm * 100)} "
                    f"| {_fmt(apps.get(pid))} | {_fmt(None if tp.get('memory') is None else tp['memory'] / MIB)} "
                    f"| {_fmt(tp.get('sm'))} | {who} |"
                )


def _scrapes(out: Path) -> list[tuple[float, dict[tuple[str, tuple[tuple[str, str], ...]], float]]]:
    text = (out / "scrapes.txt").read_text() if (out / "scrapes.txt").is_file() else ""
    result = []
    for chunk in re.split(r"^# SCRAPE ", text, flags=re.M)[1:]:
        head, _, body = chunk.partition("\n")
        values = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        result.append((float(head), values))
    return result


def _gpu_value(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, uuid: str) -> float | None:
    found = [v for (n, labels), v in values.items() if n == name and ("uuid", uuid) in labels]
    return found[0] if found else None


def _sum(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, uuid: str) -> float:
    return sum(v for (n, labels), v in values.items() if n == name and ("uuid", uuid) in labels)


def _scrape_table(out: Path, watch: list[Row], phases: list[tuple[float, float, str]]) -> Iterable[str]:
    scrapes = [(t, v) for t, v in _scrapes(out) if v]
    if not scrapes:
        yield "\n`scrapes.txt`: no scrape answered\n"
        return
    uuids = sorted({dict(labels)["uuid"] for (n, labels) in scrapes[-1][1] if n == "gpuledger_gpu_up"})
    t0 = watch[0]["t"]
    for uuid in uuids:
        yield f"\n### run: /metrics every 2 s, {uuid}\n"
        yield (
            "| t s | phase | util (gl) | util (smi) | util (nvitop) | SM active | tensor active | DRAM active "
            "| workload busy/s | power W (gl) | power W (smi) | memory MiB (gl) | memory MiB (smi) | temp (gl/smi) |"
        )
        yield "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
        previous: tuple[float, float] | None = None
        for t, values in scrapes:
            near = _nearest(watch, t)
            s = _by_uuid(near["smi_gpu"]).get(uuid, {})
            n = _by_uuid(near["nvitop"]).get(uuid, {})
            busy = _sum(values, "gpuledger_workload_gpu_busy_seconds_total", uuid)
            charged = _sum(values, "gpuledger_workload_gpu_charged_seconds_total", uuid)
            rate = None
            if previous is not None and charged > previous[1]:
                rate = (busy - previous[0]) / (charged - previous[1])
            previous = (busy, charged)

            def g(name: str, scale: float = 1.0, values: Any = values, uuid: str = uuid) -> str:
                v = _gpu_value(values, name, uuid)
                return _fmt(None if v is None else v * scale)

            yield (
                f"| {t - t0:.0f} | {_phase_at(phases, t)} | {g('gpuledger_gpu_utilization_ratio', 100)} "
                f"| {_fmt(_num(s.get('utilization.gpu')))} | {_fmt(_num(n.get('gpu_utilization')))} "
                f"| {g('gpuledger_gpu_sm_active_ratio', 100)} | {g('gpuledger_gpu_tensor_active_ratio', 100)} "
                f"| {g('gpuledger_gpu_dram_active_ratio', 100)} | {_fmt(None if rate is None else rate * 100)} "
                f"| {g('gpuledger_gpu_power_watts')} | {_fmt(_num(s.get('power.draw')))} "
                f"| {g('gpuledger_gpu_memory_used_bytes', 1 / MIB)} | {_fmt(_num(s.get('memory.used')))} "
                f"| {g('gpuledger_gpu_temperature_celsius')}/{_fmt(_num(s.get('temperature.gpu')))} |"
            )


TRACE_FIELDS = [
    ("utilization %", "utilization", "utilization.gpu"),
    ("memory used MiB", "memory_used_mib", "memory.used"),
    ("temperature C", "temperature_c", "temperature.gpu"),
    ("power W", "power_w", "power.draw"),
    ("SM clock MHz", "sm_clock_mhz", "clocks.sm"),
    ("memory clock MHz", "memory_clock_mhz", "clocks.mem"),
]


def _trace_table(out: Path, watch: list[Row]) -> Iterable[str]:
    path = out / "trace.yaml"
    if not path.is_file():
        yield "\n`trace.yaml`: missing\n"
        return
    trace = yaml.safe_load(path.read_text())
    start = datetime.datetime.fromisoformat(str(trace["start"]).replace("Z", "+00:00")).timestamp()
    yield f"\n### trace.yaml: {len(trace['gpus'])} GPU(s), start {trace['start']}\n"
    yield "| reading | points | median gap to nvidia-smi | largest gap | trace range | nvidia-smi range |"
    yield "| --- | ---: | ---: | ---: | --- | --- |"
    for gpu in trace["gpus"]:
        for label, key, smi_key in TRACE_FIELDS:
            gaps, ours, theirs = [], [], []
            for r in gpu.get("readings", []):
                if r.get(key) is None:
                    continue
                near = _nearest(watch, start + r["at"])
                sv = _num(_by_uuid(near["smi_gpu"]).get(gpu["uuid"], {}).get(smi_key))
                if sv is None:
                    continue
                gaps.append(abs(float(r[key]) - sv))
                ours.append(float(r[key]))
                theirs.append(sv)
            if gaps:
                yield (
                    f"| {label} | {len(gaps)} | {_fmt(statistics.median(gaps))} | {_fmt(max(gaps))} "
                    f"| {_fmt(min(ours))}..{_fmt(max(ours))} | {_fmt(min(theirs))}..{_fmt(max(theirs))} |"
                )
    procs = trace.get("processes", [])
    yield f"\nprocesses in the trace: {len(procs)}"
    for p in procs:
        yield f"- {json.dumps(p, default=str)[:300]}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: compare.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    watch = _load_watch(out)
    phases = _phases(out)
    print(f"# gpuledger against nvidia-smi and nvitop ({len(watch)} watcher readings)")
    print("\nworkload phases (s from the watcher's first reading):")
    for start, end, name in phases:
        print(f"- {name}: +{start - watch[0]['t']:.1f} .. +{end - watch[0]['t']:.1f}")
    for block in (_snapshot_tables(out, watch, phases), _scrape_table(out, watch, phases), _trace_table(out, watch)):
        for line in block:
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
