"""Independent readings for the real-hardware check: every --every seconds, one JSON line with
the wall time, what nvitop's Device API reads, and what `nvidia-smi --query-gpu` and
`--query-compute-apps` print, for comparison with gpuledger's snapshot, trace and /metrics
(scripts/realgpu/compare.py). Runs until killed or --for has passed."""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
import time
from typing import Any

SMI_GPU = (
    "uuid,name,utilization.gpu,utilization.memory,memory.used,memory.total,temperature.gpu,"
    "power.draw,power.draw.instant,power.limit,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,"
    "pstate,fan.speed,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
    "pcie.link.width.max,utilization.encoder,utilization.decoder,ecc.errors.corrected.volatile.total,"
    "ecc.errors.uncorrected.volatile.total,clocks_event_reasons.active,mig.mode.current"
)
SMI_APPS = "gpu_uuid,pid,process_name,used_gpu_memory"


def _smi(query: str, fields: str) -> list[dict[str, str]] | str:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-{query}={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi: {exc}"
    if out.returncode != 0:
        return f"nvidia-smi rc {out.returncode}: {out.stdout.strip()} {out.stderr.strip()}"
    names = fields.split(",")
    return [
        dict(zip(names, (v.strip() for v in row), strict=False)) for row in csv.reader(io.StringIO(out.stdout)) if row
    ]


def _valid_fields(query: str, fields: str) -> str:
    """The fields this nvidia-smi knows: one unknown field fails the whole query, so on a failure
    each is tried alone once and the unknown ones are left out (and named on stderr)."""
    if isinstance(_smi(query, fields), list):
        return fields
    kept = [f for f in fields.split(",") if isinstance(_smi(query, f), list)]
    print(f"watch: nvidia-smi --query-{query} leaves out {sorted(set(fields.split(',')) - set(kept))}", file=sys.stderr)
    return ",".join(kept)


def _nvitop(devices: list[Any]) -> list[dict[str, Any]]:
    from nvitop import NA  # noqa: PLC0415 - the watcher runs on without nvitop

    def v(x: object) -> object:
        return None if x is NA else x

    rows = []
    for d in devices:
        with d.oneshot():
            rows.append(
                {
                    "uuid": d.uuid(),
                    "gpu_utilization": v(d.gpu_utilization()),
                    "memory_utilization": v(d.memory_utilization()),
                    "memory_used": v(d.memory_used()),
                    "memory_total": v(d.memory_total()),
                    "temperature": v(d.temperature()),
                    "power_usage_mw": v(d.power_usage()),
                    "power_limit_mw": v(d.power_limit()),
                    "energy_mj": v(d.total_energy_consumption()),
                    "sm_clock": v(d.sm_clock()),
                    "memory_clock": v(d.memory_clock()),
                    "max_sm_clock": v(d.max_sm_clock()),
                    "max_memory_clock": v(d.max_memory_clock()),
                    "fan_speed": v(d.fan_speed()),
                    "performance_state": str(d.performance_state()),
                    "clocks_event_reasons": v(d.current_clocks_event_reasons()),
                    "pcie_gen": v(d.curr_pcie_link_generation()),
                    "pcie_width": v(d.curr_pcie_link_width()),
                    "pcie_gen_max": v(d.max_pcie_link_generation()),
                    "pcie_width_max": v(d.max_pcie_link_width()),
                    "encoder": v(d.encoder_utilization()),
                    "decoder": v(d.decoder_utilization()),
                    "processes": {
                        str(pid): {"memory": v(p.gpu_memory()), "sm": v(p.gpu_sm_utilization())}
                        for pid, p in d.processes().items()
                    },
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("--for", dest="duration", type=float, default=3600.0)
    args = parser.parse_args()
    try:
        from nvitop import Device  # noqa: PLC0415 - the watcher runs on without nvitop

        devices: list[Any] = Device.all()
    except Exception as exc:  # the watcher still records nvidia-smi without nvitop
        print(f"watch: nvitop unavailable: {exc!r}", file=sys.stderr)
        devices = []
    gpu_fields = _valid_fields("gpu", SMI_GPU)
    end = time.time() + args.duration
    while time.time() < end:
        t = time.time()
        line: dict[str, Any] = {"t": round(t, 3)}
        try:
            line["nvitop"] = _nvitop(devices) if devices else None
        except Exception as exc:  # one bad read must not end the watch
            line["nvitop"] = f"error: {exc!r}"
        line["nvitop_t"] = round(time.time(), 3)
        line["smi_gpu"] = _smi("gpu", gpu_fields)
        line["smi_apps"] = _smi("compute-apps", SMI_APPS)
        line["smi_t"] = round(time.time(), 3)
        print(json.dumps(line), flush=True)
        time.sleep(max(0.0, t + args.every - time.time()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
