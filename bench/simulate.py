"""How fast `simulate` runs, and how big the ledger it writes gets.

    python bench/simulate.py [--scenario demo] [--for 7d] [--step 15s] [--metrics-out]
                             [--against DIR | --against-release] [--rounds N] [--stages]
    python bench/simulate.py --instructions [--scenario demo] [--metrics-out] [--against DIR]

Runs `gpuledger simulate SCENARIO --for D --step S --ledger FILE` as a subprocess (the real
command, start-up included), then prints polls per second of wall time against its target, how
much faster than real time the scenario ran, and the ledger's size on disk (database plus WAL)
with its rows. With --metrics-out the command writes the final metrics text too, and so reads
every readings group (clocks, errors, NVLink, ...), which it skips otherwise.

With --against DIR (another checkout, e.g. `git worktree add /tmp/base <commit>`), the two take
turns, N rounds each, and the ratio of their median rates is printed: on a noisy machine a
ratio measured in one run says more than two figures measured an hour apart. --against-release
compares with the first release (RELEASE, checked out for the run), whose rate the target was
set from, and judges the target as that ratio too (TARGET_RATIO).

With --stages, the same simulation is run again in this process and the time of a poll is
split by pipeline stage (sample, attribute, account, rules, publish, as each poll's state
reports them) and the rest (the ledger's flushes, the schedule): where to look next.

With --instructions, the figure is CPU instructions per poll instead of time, counted by
valgrind's callgrind (apt-get install valgrind): the difference between a 1h and a 2h
simulation, start-up cancelled out, with a fixed hash seed (dict and set layouts otherwise move
the count by about 1%). Slow (minutes) but the same on a busy machine as on an idle one: it tells
changes of a percent apart where wall time on two shared cores cannot.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

from agent.cli.simulate import simulation_settings
from agent.cli.wiring import build_agent
from agent.config import load_config
from agent.pipeline import run_on_scenario_time
from agent.units import parse_duration
from fake_nvml.scenario import load_scenario

REPO = Path(__file__).resolve().parent.parent

# A week of the demo node at 15 s steps in about a minute: fast enough that the test suite and
# every user's what-if simulation stay cheap.
TARGET_POLLS_PER_S = 600
# The first release, where the structure issue measured `simulate demo --for 7d` at 295-306 polls
# a second and set the target above at twice that. Machines differ (this 2-core one runs the
# release at 190-230), so the target is also judged as that ratio, measured side by side in one
# run: the release's lowest figure, 295, is the demanding reading.
RELEASE = "053f41799b70022969bb98125a40f833d05d5a7c"
TARGET_RATIO = TARGET_POLLS_PER_S / 295


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="demo")
    parser.add_argument("--for", dest="duration", default="7d")
    parser.add_argument("--step", default="15s")
    parser.add_argument("--metrics-out", action="store_true", help="write the metrics text too (reads every group)")
    parser.add_argument("--against", type=Path, help="another checkout to run in turn with this one")
    parser.add_argument(
        "--against-release", action="store_true", help="--against the first release (a worktree made for the run)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs of each checkout with --against")
    parser.add_argument("--stages", action="store_true", help="then split a poll's time by pipeline stage")
    parser.add_argument("--instructions", action="store_true", help="count CPU instructions a poll (callgrind)")
    args = parser.parse_args(argv)
    if args.instructions:
        return instructions(args)
    duration_s, step_s = parse_duration(args.duration), parse_duration(args.step)
    polls = math.ceil(duration_s / step_s - 1e-9) + 1  # a last, shorter step ends at --for
    if args.against_release:
        return compare_with_release(args, polls)
    if args.against is not None:
        return compare(args, polls)
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Path(tmp) / "ledger.db"
        elapsed = simulate(args, REPO, Path(tmp))
        if elapsed is None:
            return 1
        size = sum(p.stat().st_size for p in Path(tmp).glob("ledger.db*"))
        with closing(sqlite3.connect(ledger)) as conn, conn:
            workload_rows = conn.execute("SELECT count(*) FROM workload_hours").fetchone()[0]
            gpu_rows = conn.execute("SELECT count(*) FROM gpu_hours").fetchone()[0]
    print(f"gpuledger simulate {args.scenario} --for {args.duration} --step {args.step}{_outputs(args)}")
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
    if args.stages:
        stage_breakdown(args.scenario, duration_s, step_s, args.metrics_out)
    return 0


def _outputs(args: argparse.Namespace) -> str:
    return " --ledger FILE" + (" --metrics-out FILE" if args.metrics_out else "")


def stage_breakdown(scenario: str, duration_s: float, step_s: float, metrics_out: bool) -> None:
    """Microseconds of wall time per poll in each pipeline stage, summed from each poll's own
    stage durations, and in everything else the simulation does (flushes, the schedule). The
    agent is built as `simulate` builds it: its settings (`simulation_settings`: the ledger
    flushed once a scenario hour), and the readings only metrics text shows read only with
    `metrics_out`."""
    logging.disable(logging.CRITICAL)  # the flags it raises are not the point here
    spent: dict[str, float] = {}
    settings = simulation_settings(load_config(None))
    with tempfile.TemporaryDirectory() as tmp:
        agent = build_agent(
            settings, fake=load_scenario(scenario), ledger_path=str(Path(tmp) / "ledger.db"),
            poll_interval_s=step_s, actions="dry_run", ledger_fsync=False, metrics_text=metrics_out,
        )  # fmt: skip
        assert agent.node is not None
        polls = 0

        def poll_then_tally(poll: Callable[[], object]) -> Callable[[], None]:
            def run() -> None:
                nonlocal polls
                poll()
                polls += 1
                for stage in agent.pipeline.state.health.stages:
                    spent[stage.stage] = spent.get(stage.stage, 0.0) + stage.duration_s

            return run

        jobs = [
            replace(job, run=poll_then_tally(job.run)) if job.name == "poll" else job for job in agent.pipeline.jobs()
        ]
        started = time.perf_counter()
        run_on_scenario_time(jobs, agent.node.clock.advance, duration_s, step_s)
        agent.close()
        elapsed = time.perf_counter() - started
    print(f"  a poll, by stage      {elapsed / polls * 1e6:,.0f} us in all ({polls / elapsed:.0f} polls/s in process)")
    for stage, seconds in spent.items():
        print(f"    {stage:19s} {seconds / polls * 1e6:7,.0f} us  {seconds / elapsed:4.0%}")
    rest = elapsed - sum(spent.values())
    print(f"    {'the rest':19s} {rest / polls * 1e6:7,.0f} us  {rest / elapsed:4.0%}  (ledger flushes, schedule)")


def simulate(args: argparse.Namespace, checkout: Path, tmp: Path) -> float | None:
    """Seconds one `simulate` of `checkout` took (run from there, so its own code is imported),
    or None after printing why it failed."""
    command = [
        sys.executable, "-m", "agent", "simulate", args.scenario, "--for", args.duration, "--step", args.step,
        "--ledger", str(tmp / "ledger.db"),
        *(("--metrics-out", str(tmp / "metrics.prom")) if args.metrics_out else ()),
    ]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=checkout)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        print(f"{checkout}: {result.stderr[-2000:]}", file=sys.stderr)
        return None
    return elapsed


def instructions(args: argparse.Namespace) -> int:
    """Instructions a poll of this checkout (and of --against), by callgrind."""
    if shutil.which("valgrind") is None:
        print("bench/simulate.py: --instructions needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    step_s = parse_duration(args.step)
    short_s, long_s = 3600.0, 7200.0
    checkouts = {"this": REPO} | ({"against": args.against.resolve()} if args.against is not None else {})
    per_poll: dict[str, float] = {}
    for name, checkout in checkouts.items():
        counts = []
        for duration_s in (short_s, long_s):
            with tempfile.TemporaryDirectory() as tmp:
                counted = callgrind(args, duration_s, checkout, Path(tmp))
            if counted is None:
                return 1
            counts.append(counted)
        per_poll[name] = (counts[1] - counts[0]) / ((long_s - short_s) / step_s)
        print(f"  {name:8s} {checkout}: {per_poll[name] / 1e6:.3f} M instructions a poll ({args.scenario})")
    if "against" in per_poll:
        print(f"  this / against   {per_poll['this'] / per_poll['against']:.3f}")
    return 0


def callgrind(args: argparse.Namespace, duration_s: float, checkout: Path, tmp: Path) -> int | None:
    """The instructions one `simulate` of `checkout` ran (start-up included), or None after
    printing why it failed."""
    command = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp / 'callgrind.out'}",
        sys.executable, "-m", "agent", "simulate", args.scenario, "--for", f"{duration_s:.0f}s", "--step", args.step,
        "--ledger", str(tmp / "ledger.db"),
        *(("--metrics-out", str(tmp / "metrics.prom")) if args.metrics_out else ()),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=checkout, env=env)
    found = re.search(r"Collected : (\d+)", result.stderr)
    if result.returncode != 0 or found is None:
        print(f"{checkout}: {result.stderr[-2000:]}", file=sys.stderr)
        return None
    return int(found.group(1))


def compare(args: argparse.Namespace, polls: int) -> int:
    """This checkout and --against in turn, --rounds times each; their median rates and ratio."""
    checkouts = {"this": REPO, "against": args.against.resolve()}
    rates: dict[str, list[float]] = {name: [] for name in checkouts}
    for _ in range(args.rounds):
        for name, checkout in checkouts.items():
            with tempfile.TemporaryDirectory() as tmp:
                elapsed = simulate(args, checkout, Path(tmp))
            if elapsed is None:
                return 1
            rates[name].append(polls / elapsed)
    print(
        f"gpuledger simulate {args.scenario} --for {args.duration} --step {args.step}{_outputs(args)},"
        f" {args.rounds} rounds each"
    )
    for name, checkout in checkouts.items():
        print(f"  {name:8s} {checkout}: {', '.join(f'{r:.0f}' for r in rates[name])} polls/s")
    ratio = statistics.median(rates["this"]) / statistics.median(rates["against"])
    print(f"  this / against (medians)   {ratio:.2f}x")
    if args.against_release:
        verdict = "met" if ratio >= TARGET_RATIO else "MISSED"
        target = f"{TARGET_RATIO:.2f}x the release ({TARGET_POLLS_PER_S} against 295)"
        print(f"  target                     {target}: {verdict}")
    return 0


def compare_with_release(args: argparse.Namespace, polls: int) -> int:
    """`compare` against the first release, checked out from this repository's history into a
    worktree for the run (its code runs in this Python, on the packages installed here)."""
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "release"
        added = subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), RELEASE],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if added.returncode != 0:
            print(f"bench/simulate.py: cannot check out the release: {added.stderr.strip()}", file=sys.stderr)
            return 2
        try:
            return compare(argparse.Namespace(**{**vars(args), "against": worktree}), polls)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=False)


if __name__ == "__main__":
    sys.exit(main())
