"""What a node keeps after days of short-lived GPU work: /metrics series and memory.

    python bench/churn.py [--tasks 2000] [--every 5m] [--lasts 2m] [--step 15s] [--cmdline-chars 0]

A scenario of `--tasks` processes, one starting every `--every` on alternate GPUs and each
running `--lasts`, each a new pid and a new workload (a CI pod, a Slurm array task or a bare
container, in turn) with a model of its own, per-pid series switched on and a rule setting the
model from the cmdline; `--cmdline-chars` pads each cmdline (a config passed in the arguments).
The agent is built by `build_agent`, as `simulate` builds it, and polled every `--step`. Four
times along the run it prints the series in /metrics and the memory the run holds (tracemalloc,
from after the first poll on). Series of finished workloads go after `accounting.forget_after`
(1h), so both should level off once the run is past the first hour, whatever `--tasks` is.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

from agent.cli.wiring import build_agent
from agent.config import AttributionConfig, AttributionRule, Settings
from agent.pipeline import run_on_scenario_time
from agent.units import parse_duration

MODEL_RULE = AttributionRule(match={"cmdline": "--model[= ]([^ ]+)"}, set={"model": "$1"})


def scenario(tasks: int, every_s: float, lasts_s: float, cmdline_chars: int) -> dict[str, Any]:
    processes: list[dict[str, Any]] = []
    for i in range(tasks):
        task: dict[str, Any] = {
            "pid": 10_000 + i,
            "gpus": [i % 2],
            "start": f"{i * every_s:.0f}s",
            "end": f"{i * every_s + lasts_s:.0f}s",
            "sm_util": 60,
            "memory_mib": 4000,
            "uid": 2000 + i % 40,
            "user": f"user{i % 40}",
            "cmdline": f"python train.py --model model-{i} --cfg=" + "x" * cmdline_chars,
        }
        kind = i % 3
        if kind == 0:
            task["pod"] = {
                "namespace": "ci",
                "name": f"ci-job-{i}",
                "container": "main",
                "uid": f"{i:08x}-0000-4000-8000-000000000000",
            }
        elif kind == 1:
            task["slurm_job"] = f"{70_000 + i // 100}_{i % 100}"
        else:
            task["container_id"] = f"{i:064x}"
        processes.append(task)
    return {"gpus": [{"model": "A100-SXM4-80GB", "count": 2}], "processes": processes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--every", default="5m")
    parser.add_argument("--lasts", default="2m")
    parser.add_argument("--step", default="15s")
    parser.add_argument("--cmdline-chars", type=int, default=0)
    args = parser.parse_args(argv)
    every_s, lasts_s, step_s = (parse_duration(v) for v in (args.every, args.lasts, args.step))
    duration_s = args.tasks * every_s + 2 * 3600  # past the last task's forget_after
    settings = Settings(node_name="churn", attribution=AttributionConfig(per_pid_series=True, rules=[MODEL_RULE]))
    agent = build_agent(
        settings, fake=scenario(args.tasks, every_s, lasts_s, args.cmdline_chars), poll_interval_s=step_s
    )
    node = agent.node
    assert node is not None
    print(f"{args.tasks} tasks, one every {args.every} for {args.lasts}, polled every {args.step}")
    print(f"{'scenario time':>14} {'series':>8} {'memory KiB':>11} {'wall s':>7}")
    started = time.perf_counter()
    tracemalloc.start()
    done = 0.0
    try:
        for quarter in range(1, 5):
            span = duration_s * quarter / 4 - done
            run_on_scenario_time(agent.pipeline.jobs(), node.clock.advance, span, step_s)
            done += span
            gc.collect()
            held = tracemalloc.get_traced_memory()[0]
            series = series_by_family(agent.exposition(agent.pipeline.state).decode())
            wall = time.perf_counter() - started
            print(f"{done / 3600:>12.1f} h {sum(series.values()):>8} {held / 1024:>11,.0f} {wall:>7.1f}")
    finally:
        tracemalloc.stop()
        agent.close()
    print("largest families at the end:")
    for name, count in series.most_common(8):
        print(f"  {count:6d} {name}")
    return 0


def series_by_family(text: str) -> Counter[str]:
    """Samples per metric name in exposition `text`."""
    return Counter(line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line[:1] not in ("", "#"))


if __name__ == "__main__":
    sys.exit(main())
