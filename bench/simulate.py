"""How fast `simulate` runs, and how big the ledger it writes gets.

    python bench/simulate.py [--scenario demo] [--for 7d] [--step 15s]

Runs `gpuledger simulate SCENARIO --for D --step S --ledger FILE` as a subprocess (the real
command, start-up included), then prints polls per second of wall time against its target, how
much faster than real time the scenario ran, and the ledger's size on disk (database plus WAL)
with its rows.
"""

from __future__ import annotations

import argparse
import math
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

from agent.units import parse_duration
from fake_nvml.scenario import load_scenario

# A week of the demo node at 15 s steps in about a minute: fast enough that the test suite and
# every user's what-if simulation stay cheap.
TARGET_POLLS_PER_S = 600


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="demo")
    parser.add_argument("--for", dest="duration", default="7d")
    parser.add_argument("--step", default="15s")
    args = parser.parse_args(argv)
    duration_s, step_s = parse_duration(args.duration), parse_duration(args.step)
    polls = math.ceil(duration_s / step_s - 1e-9) + 1  # a last, shorter step ends at --for
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Path(tmp) / "ledger.db"
        command = [
            sys.executable, "-m", "agent", "simulate", args.scenario, "--for", args.duration, "--step", args.step,
            "--ledger", str(ledger), "--metrics-out", str(Path(tmp) / "metrics.prom"),
        ]  # fmt: skip
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        elapsed = time.perf_counter() - started
        if result.returncode != 0:
            print(result.stderr[-2000:], file=sys.stderr)
            return 1
        size = sum(p.stat().st_size for p in Path(tmp).glob("ledger.db*"))
        with sqlite3.connect(ledger) as conn:
            workload_rows = conn.execute("SELECT count(*) FROM workload_hours").fetchone()[0]
            gpu_rows = conn.execute("SELECT count(*) FROM gpu_hours").fetchone()[0]
    print(f"gpuledger simulate {args.scenario} --for {args.duration} --step {args.step}")
    print(f"  polls                 {polls}")
    print(f"  wall time             {elapsed:.1f} s (process start-up included)")
    rate = polls / elapsed
    verdict = "met" if rate >= TARGET_POLLS_PER_S else "MISSED"
    print(f"  polls per second      {rate:.0f} (target {TARGET_POLLS_PER_S} or more: {verdict})")
    print(f"  scenario speed        {duration_s / elapsed:,.0f}x real time")
    gpus = len(load_scenario(args.scenario).gpus)
    print(f"  ledger on disk        {size / 1024:.0f} KiB")
    print(f"  ledger rows           {workload_rows} workload-hours, {gpu_rows} GPU-hours")
    print(f"  ledger per GPU-day    {size / 1024 / (gpus * duration_s / 86400):.1f} KiB ({gpus} GPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
