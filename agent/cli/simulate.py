"""`gpuledger simulate`: the whole pipeline over scenario time, as fast as it runs.

The agent is built as `run` builds it, so every output option `run` honours (per-pid series,
dcgm-exporter compatibility, the textfile, the ledger) applies here too; its periodic jobs run
on the scenario clock at the daemon's rhythm, one poll per --step.

Everything that can be refused is refused before the first poll: a --for or --step that would
charge nothing, and a --ledger that already holds charges (simulating the same scenario into it
twice would count every hour twice; --append says that is meant) or cannot be written.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from agent.cli.args import EXIT_OK, duration_arg
from agent.cli.wiring import build_agent
from agent.config import load_config
from agent.errors import BadInputError, GpuledgerError
from agent.ledger.store import Ledger, LedgerError, iso_time, recorded_period
from agent.pipeline import run_on_scenario_time
from agent.units import format_duration

log = logging.getLogger("gpuledger")


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
    if args.append and not args.ledger:
        raise BadInputError("gpuledger: --append: only meaningful with --ledger")
    for option, target in (("--metrics-out", args.metrics_out), ("--ledger", args.ledger)):
        if target and not Path(target).parent.is_dir():
            raise BadInputError(f"gpuledger: {option}: no such directory {Path(target).parent}")
    if args.ledger:
        check_ledger(Path(args.ledger), append=args.append)
    # Polls --step apart are this run's normal rhythm (build_agent never counts them as a gap).
    agent = build_agent(settings, fake=args.scenario, ledger_path=args.ledger, poll_interval_s=step)
    node = agent.node
    assert node is not None
    try:
        run_on_scenario_time(agent.pipeline.jobs(), node.clock.advance, duration, step)
    finally:
        written = agent.close()  # flushes the ledger and writes the textfile, if configured
    if not written:
        raise GpuledgerError(f"the ledger {args.ledger} could not be written (see the log)")
    state = agent.pipeline.state
    text = agent.exposition(state)
    if args.metrics_out:
        Path(args.metrics_out).write_bytes(text)
        log.info(
            "simulated %s of %r in %d polls; metrics written to %s",
            format_duration(duration),
            node.scenario.name,
            state.health.polls_total,
            args.metrics_out,
        )
    else:
        sys.stdout.write(text.decode())
    return EXIT_OK


def check_ledger(path: Path, *, append: bool) -> None:
    """Refuse (BadInputError, one line) a ledger that holds charges unless `append`, and one that
    cannot be opened for writing: opened and closed here, before anything is simulated."""
    try:
        if path.is_dir():
            raise LedgerError(f"ledger {path}: is a directory")
        period = recorded_period(path)
        if period is not None and not append:
            raise BadInputError(
                f"gpuledger: --ledger: {path} already holds charges ({iso_time(period[0])} to "
                f"{iso_time(period[1])}); pass --append to add to them, or choose a new file"
            )
        Ledger(path, retention_s=None).close()
    except LedgerError as exc:
        raise BadInputError(f"gpuledger: --ledger: {exc}") from None
    except OSError as exc:
        raise BadInputError(f"gpuledger: --ledger: {path}: {exc.strerror or exc}") from None
