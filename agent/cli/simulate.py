"""`gpuledger simulate`: the whole pipeline over scenario time, as fast as it runs.

The agent is built as `run` builds it, so every output option `run` honours (per-pid series,
dcgm-exporter compatibility, the textfile, the ledger) applies here too; its periodic jobs run
on the scenario clock at the daemon's rhythm, one poll per --step, but for the ledger's
flushes (once a scenario hour). The readings only metrics text shows (the readings.* groups,
temperatures, NVLink states) are read only where it is written (--metrics-out, the textfile).

Everything that can be refused is refused before the first poll: a --for or --step that would
charge nothing, a --ledger that cannot be written or already holds charges (unless --append), and
an --append whose scenario starts before the ledger's record ends: time is a partition, and
simulating time the ledger already holds (the same scenario twice, or an earlier one after a
later) would count it twice, or leave a hole in it that nothing books.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from tqdm import tqdm

from agent.cli.args import EXIT_OK, duration_arg
from agent.cli.wiring import build_agent
from agent.config import Settings, load_config
from agent.errors import BadInputError, GpuledgerError
from agent.ledger.files import LedgerError
from agent.ledger.read import recorded_period
from agent.ledger.store import Ledger
from agent.model import AgentState
from agent.pipeline import run_on_scenario_time
from agent.scrub import escape_control
from agent.units import format_duration, iso_time

log = logging.getLogger("gpuledger")

MAX_POLLS = 6_307_200  # a year of polls 5 s apart: hours at the speed simulate runs


# How often a simulation writes its ledger, in scenario time, where ledger.flush_interval is
# shorter: the interval bounds what a crash of the daemon loses in real time, and 60 scenario
# seconds go by in about a hundredth of a real second here.
SIMULATED_FLUSH_S = 3600.0


def simulation_settings(settings: Settings) -> Settings:
    """`settings` as a simulation applies them: the ledger is written once a scenario hour
    (SIMULATED_FLUSH_S) and at the end. At the daemon's every minute, its flushes were 7% of the
    run and bought nothing, as the rows are hours. The rows hold the same charges; only their
    sums' last bits can differ, as a row is added up in fewer parts."""
    if settings.ledger.flush_interval >= SIMULATED_FLUSH_S:
        return settings
    return settings.model_copy(
        update={"ledger": settings.ledger.model_copy(update={"flush_interval": SIMULATED_FLUSH_S})}
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    settings = load_config(args.config)
    duration = duration_arg(args.duration, "--for")
    step = duration_arg(args.step, "--step")
    if duration <= 0:
        raise BadInputError(f"gpuledger: --for: must be above 0, got {args.duration}")
    if step <= 0:
        raise BadInputError("gpuledger: --step: must be above 0")
    if step > duration:
        raise BadInputError(
            f"gpuledger: --step: {format_duration(step)} is longer than --for {format_duration(duration)}: "
            "no interval would be simulated"
        )
    if duration / step > MAX_POLLS:
        raise BadInputError(
            f"gpuledger: --step: {format_duration(step)} over --for {format_duration(duration)} is "
            f"{duration / step:,.0f} polls; at most {MAX_POLLS:,} (a year at 5 s steps): take a longer --step"
        )
    if args.append and not args.ledger:
        raise BadInputError("gpuledger: --append: only meaningful with --ledger")
    for option, target in (("--metrics-out", args.metrics_out), ("--ledger", args.ledger)):
        if target and target != "-" and not Path(target).parent.is_dir():
            raise BadInputError(f"gpuledger: {option}: no such directory {Path(target).parent}")
    if args.metrics_out and Path(args.metrics_out).is_dir():
        raise BadInputError(f"gpuledger: --metrics-out: {args.metrics_out} is a directory: name a file to write")
    from fake_nvml import load_scenario  # here: `run` on a real driver never loads the fake

    scenario = load_scenario(args.scenario)
    settings = simulation_settings(settings)
    if args.ledger:
        check_ledger(Path(args.ledger), append=args.append, start=scenario.start_epoch)
    # Polls --step apart are this run's normal rhythm (build_agent never counts them as a gap).
    # Scenario time is not the host's: actions are only logged as dry runs.
    # Even hourly, flushes come a few times a real second here: each commits atomically, and
    # the file is synced as it closes rather than waited on at each.
    # The readings only metrics text shows (the readings.* groups, temperatures, NVLink states)
    # are read only where there is some to write, --metrics-out or the textfile: a run without
    # would spend more than a third of each poll reading them for nothing.
    agent = build_agent(
        settings, fake=scenario, ledger_path=args.ledger, poll_interval_s=step, actions="dry_run", ledger_fsync=False,
        metrics_text=bool(args.metrics_out),
    )  # fmt: skip
    node = agent.node
    assert node is not None
    # Progress on a terminal only (tqdm turns itself off when stderr is not a TTY): a week at
    # 15 s steps is 40,000 polls, a minute or more of waiting.
    with tqdm(
        total=math.ceil(duration / step - 1e-9),
        unit="poll",
        desc=f"simulate {node.scenario.name}",
        disable=None,
        leave=False,
    ) as bar:
        try:
            run_on_scenario_time(agent.pipeline.jobs(), node.clock.advance, duration, step, on_step=bar.update)
        finally:
            written = agent.close()  # flushes the ledger and writes the textfile, if configured
    if not written:
        raise GpuledgerError(f"the ledger {args.ledger} could not be written (see the log)")
    state = agent.pipeline.state
    if args.metrics_out == "-":
        sys.stdout.write(agent.exposition(state).decode())
        return EXIT_OK
    if args.metrics_out:
        try:
            Path(args.metrics_out).write_bytes(agent.exposition(state))
        except OSError as exc:  # the ledger is written: only the metrics are missing
            raise GpuledgerError(f"--metrics-out: {args.metrics_out}: {exc.strerror or exc}") from None
    print(summary(state, node.scenario.name, duration, args.ledger, args.metrics_out))
    return EXIT_OK


def summary(state: AgentState, scenario: str, duration_s: float, ledger: str | None, metrics_out: str | None) -> str:
    """What a run of `simulate` did, in a few lines: the final exposition is hundreds of series,
    so it is written only where asked (--metrics-out FILE, or - for stdout)."""
    gpus = state.costs.gpus.values()
    charged = sum(g.dollars for g in gpus) - sum(g.idle_dollars for g in gpus)
    idle = sum(g.idle_dollars for g in gpus)
    observed_h = sum(g.observed_s for g in gpus) / 3600
    unobserved_h = sum(g.unobserved_s for g in gpus) / 3600
    unobserved = sum(g.unobserved_dollars for g in gpus)
    lines = [
        f"simulated {format_duration(duration_s)} of {scenario!r} in {state.health.polls_total} polls",
        f"  GPU time     {observed_h:,.2f} GPU-hours observed, {unobserved_h:,.2f} unobserved",
        f"  cost         ${charged:,.2f} charged to workloads, ${idle:,.2f} idle, ${unobserved:,.2f} unobserved",
        f"  flags now    {_flags(state)}",
    ]
    if ledger:
        lines.append(f"  ledger       {ledger}")
    if metrics_out:
        lines.append(f"  metrics      {metrics_out}")
    return "\n".join(escape_control(line) for line in lines)


def _flags(state: AgentState) -> str:
    """The raised flags, one entry per rule with its GPUs: "idle (GPU 6), allocated_idle (GPUs 5, 7)"."""
    by_rule: dict[str, list[int]] = {}
    for flag in state.flags:
        if flag.raised:
            by_rule.setdefault(flag.rule, []).append(flag.gpu)
    return (
        ", ".join(
            f"{rule} (GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, sorted(gpus)))})"
            for rule, gpus in sorted(by_rule.items())
        )
        or "none"
    )


def check_ledger(path: Path, *, append: bool, start: float) -> None:
    """Refuse (BadInputError, one line) a ledger that holds charges unless `append`, one whose
    record ends after `start` (the simulation's first instant, epoch seconds), and one that
    cannot be opened for writing: opened and closed here, before anything is simulated."""
    try:
        period = recorded_period(path)
        if period is not None and not append:
            raise BadInputError(
                f"gpuledger: --ledger: {path} already holds charges ({iso_time(period[0])} to "
                f"{iso_time(period[1])}); pass --append to add to them, or choose a new file"
            )
        if period is not None and start < period[1]:
            raise BadInputError(
                f"gpuledger: --append: {path} records charges until {iso_time(period[1])}, after the scenario's "
                f"start {iso_time(start)}: that time would be counted twice; start the scenario at or after "
                f"{iso_time(period[1])}, or choose a new file"
            )
        Ledger(path, retention_s=None).close()
    except LedgerError as exc:
        raise BadInputError(f"gpuledger: --ledger: {exc}") from None
    except OSError as exc:
        raise BadInputError(f"gpuledger: --ledger: {path}: {exc.strerror or exc}") from None
