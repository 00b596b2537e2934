"""`gpuledger simulate`: the whole pipeline over scenario time, as fast as it runs."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from agent.cli.args import EXIT_OK, duration_arg
from agent.cli.wiring import make_attributor, make_backend, make_costing, node_name, rule_specs
from agent.config import load_config
from agent.devices.sampler import Sampler
from agent.errors import BadInputError, GpuledgerError
from agent.model import AgentState
from agent.pipeline import Pipeline
from agent.units import format_duration

log = logging.getLogger("gpuledger")


def cmd_simulate(args: argparse.Namespace) -> int:
    from prometheus_client import generate_latest

    from exporters.prometheus import make_registry

    settings = load_config(args.config)
    duration = duration_arg(args.duration, "--for")
    step = duration_arg(args.step, "--step")
    if step <= 0:
        raise BadInputError("gpuledger: --step: must be above 0")
    for option, target in (("--metrics-out", args.metrics_out), ("--ledger", args.ledger)):
        if target and not Path(target).parent.is_dir():
            raise BadInputError(f"gpuledger: {option}: no such directory {Path(target).parent}")
    backend, node = make_backend(args.scenario, 0.0)
    sampler = Sampler(backend, hostname=node_name(settings, node))
    sampler.start()
    costing = make_costing(settings, node, args.ledger, node.clock.wall_time)
    # Polls --step apart are this run's normal rhythm: never count them as a gap.
    costing = replace(costing, max_interval_s=max(costing.max_interval_s, step))
    pipeline = Pipeline(
        sampler,
        poll_interval_s=step,
        attributor=make_attributor(settings, node),
        costing=costing,
        rules=rule_specs(settings),
    )
    pipeline.refresh_allocations()
    state: AgentState = pipeline.poll_once()
    elapsed = since_flush = since_kubelet = 0.0
    while elapsed + step <= duration + 1e-9:
        node.clock.advance(step)
        elapsed += step
        since_flush += step
        since_kubelet += step
        if since_kubelet >= settings.attribution.kubelet_interval:  # as often as the daemon asks
            pipeline.refresh_allocations()
            since_kubelet = 0.0
        state = pipeline.poll_once()
        if since_flush >= costing.flush_interval_s:
            pipeline.flush_ledger()
            since_flush = 0.0
    if costing.sink is not None:
        costing.sink.close()
        if not costing.sink.health().healthy:
            raise GpuledgerError(f"the ledger {args.ledger} could not be written (see the log)")
    sampler.close()
    import fake_nvml

    fake_nvml.uninstall()
    text = generate_latest(make_registry(lambda: state, settings.attribution.per_pid_series)).decode()
    if args.metrics_out:
        Path(args.metrics_out).write_text(text)
        log.info(
            "simulated %s of %r in %d polls; metrics written to %s",
            format_duration(duration),
            node.scenario.name,
            state.health.polls_total,
            args.metrics_out,
        )
    else:
        sys.stdout.write(text)
    return EXIT_OK
