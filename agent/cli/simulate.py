"""`gpuledger simulate`: the whole pipeline over scenario time, as fast as it runs.

The agent is built as `run` builds it, so every output option `run` honours (per-pid series,
dcgm-exporter compatibility, the textfile, the ledger) applies here too; its periodic jobs run
on the scenario clock at the daemon's rhythm, one poll per --step.
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
from agent.pipeline import run_on_scenario_time
from agent.units import format_duration

log = logging.getLogger("gpuledger")


def cmd_simulate(args: argparse.Namespace) -> int:
    settings = load_config(args.config)
    duration = duration_arg(args.duration, "--for")
    step = duration_arg(args.step, "--step")
    if step <= 0:
        raise BadInputError("gpuledger: --step: must be above 0")
    for option, target in (("--metrics-out", args.metrics_out), ("--ledger", args.ledger)):
        if target and not Path(target).parent.is_dir():
            raise BadInputError(f"gpuledger: {option}: no such directory {Path(target).parent}")
    # Polls --step apart are this run's normal rhythm (build_agent never counts them as a gap).
    agent = build_agent(
        settings, fake=args.scenario, ledger_path=args.ledger, poll_interval_s=step, ledger_write_behind=True
    )
    node = agent.node
    assert node is not None
    try:
        run_on_scenario_time(agent.pipeline.jobs(), node.clock.advance, duration, step)
    finally:
        agent.close()  # flushes the ledger and writes the textfile, if configured
    sink = agent.costing.sink if agent.costing is not None else None
    if sink is not None and not sink.health().healthy:
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
