"""The `gpuledger` command: the composition root, and the only code that reads configuration.

Exit codes: 0 ok, 2 bad input (config, scenario, arguments), 1 any other failure. Errors are
one line on stderr naming what was wrong and where; --debug adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NoReturn

from agent import __version__
from agent.attribution import compile_rules, rule_env_keys
from agent.attributor import Attributor, KubeletWatcher
from agent.config import Settings, check_config, load_config
from agent.errors import BadInputError, GpuledgerError, NvmlLibraryMissing
from agent.hostfiles import detect_instance_type
from agent.model import AgentState, Attribution, DeviceReading, Price, Snapshot
from agent.nvml import NvmlBackend
from agent.pipeline import Costing, Pipeline
from agent.pricing import load_catalogue, resolve_price
from agent.procfs import Passwd, ProcFS
from agent.report import GROUP_KEYS, parse_by, parse_time, render, report_from_ledger
from agent.sampler import Sampler
from agent.units import format_duration, parse_duration
from rules.engine import RuleSpec

log = logging.getLogger("gpuledger")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so errors stay one line."""

    def error(self, message: str) -> NoReturn:
        raise BadInputError(f"{self.prog}: {message}")


def _build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="gpuledger", description="GPU monitoring agent: usage, owners and cost per GPU.")
    parser.add_argument("--version", action="version", version=f"gpuledger {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)

    run = sub.add_parser("run", help="run the daemon: poll NVML and serve /metrics")
    run.add_argument("--config", help="YAML config file")
    run.add_argument(
        "--fake", nargs="?", const="demo", metavar="SCENARIO", help="run on a fake node (default scenario: demo)"
    )
    run.add_argument(
        "--fake-speed", type=float, default=1.0, metavar="N", help="scenario seconds per real second (with --fake)"
    )
    run.add_argument("--listen", metavar="HOST:PORT", help="address to serve on (default 0.0.0.0:9835)")
    run.add_argument(
        "--ledger", metavar="FILE", help="ledger file (default: ledger.path; with --fake, no ledger unless given)"
    )
    run.add_argument(
        "--web-config",
        metavar="FILE",
        help="TLS and basic auth for /metrics, exporter-toolkit web-config format (default: web_config_file)",
    )

    snap = sub.add_parser("snapshot", help="poll once and print each GPU")
    snap.add_argument("--config", help="YAML config file")
    snap.add_argument(
        "--fake", nargs="?", const="demo", metavar="SCENARIO", help="read a fake node (default scenario: demo)"
    )
    snap.add_argument(
        "--at", default="0s", metavar="DURATION", help="with --fake: scenario time to read at (default 0s)"
    )
    snap.add_argument("--json", action="store_true", help="print JSON instead of a table")

    sim = sub.add_parser("simulate", help="run the pipeline over scenario time without sleeping")
    sim.add_argument("scenario", help="built-in scenario name or YAML file")
    sim.add_argument(
        "--for", dest="duration", required=True, metavar="DURATION", help="scenario time to cover, e.g. 3d"
    )
    sim.add_argument(
        "--step", default="15s", metavar="DURATION", help="poll every this much scenario time (default 15s)"
    )
    sim.add_argument("--config", help="YAML config file")
    sim.add_argument("--metrics-out", metavar="FILE", help="write the final /metrics text here (default: stdout)")
    sim.add_argument("--ledger", metavar="FILE", help="write the charges to this ledger file")

    rep = sub.add_parser("report", help="cost and usage from the ledger")
    rep.add_argument("--ledger", metavar="FILE", help="ledger file (default: ledger.path)")
    rep.add_argument("--config", help="YAML config file")
    rep.add_argument("--since", metavar="T", help="ISO date/time (UTC) or e.g. 7d for seven days ago")
    rep.add_argument("--until", metavar="T", help="ISO date/time (UTC) or e.g. 1d")
    rep.add_argument("--by", default="namespace,job", metavar="KEYS", help=f"group by any of: {', '.join(GROUP_KEYS)}")
    rep.add_argument("--format", choices=("table", "csv", "json"), default="table")

    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("file", help="YAML config file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    _setup_logging(debug)
    try:
        args = _build_parser().parse_args(args_list)
        handler: Callable[[argparse.Namespace], int] = _COMMANDS[args.command]
        return handler(args)
    except BadInputError as exc:
        return _fail(str(exc), EXIT_BAD_INPUT, debug)
    except NvmlLibraryMissing:
        return _fail(
            "gpuledger: cannot load the NVML library (libnvidia-ml.so.1): is the NVIDIA driver installed? "
            "(use --fake to run on a simulated node)",
            EXIT_FAILURE,
            debug,
        )
    except GpuledgerError as exc:
        return _fail(f"gpuledger: {exc}", EXIT_FAILURE, debug)
    except _scenario_error() as exc:
        return _fail(f"gpuledger: scenario {exc}", EXIT_BAD_INPUT, debug)
    except KeyboardInterrupt:
        return EXIT_FAILURE
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        return _fail(f"gpuledger:{where}: {exc.strerror or exc}", EXIT_FAILURE, debug)


def _scenario_error() -> type[Exception]:
    # Imported lazily: the fake is only loaded when a command asks for it.
    from fake_nvml.scenario import ScenarioError

    return ScenarioError


def _fail(message: str, code: int, debug: bool) -> int:
    if debug:
        logging.getLogger("gpuledger").exception(message)
    print(message.splitlines()[0] if message else "gpuledger: failed", file=sys.stderr)
    return code


def _setup_logging(debug: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # APScheduler logs every job run at INFO; that is noise at a 5 s interval.
    logging.getLogger("apscheduler").setLevel(logging.DEBUG if debug else logging.WARNING)


def _settings(path: str | None) -> Settings:
    return load_config(path)


def _duration_arg(value: str, option: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise BadInputError(f"gpuledger: {option}: {exc}") from None


def _parse_listen(value: str, option: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise BadInputError(f"gpuledger: {option}: expected HOST:PORT such as 0.0.0.0:9835, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def rule_specs(settings: Settings) -> list[RuleSpec]:
    """The rule engine's specs from the config: the four defaults (unless disabled) and custom ones."""
    r = settings.rules
    configured: list[tuple[str, str, Any]] = [
        ("idle", "idle", r.idle),
        ("allocated_idle", "allocated_idle", r.allocated_idle),
        ("underused", "underused", r.underused),
        ("stranded_memory", "stranded_memory", r.stranded_memory),
    ]
    configured += [(c.name, c.condition, c) for c in r.custom]
    return [
        RuleSpec(
            name,
            condition,
            c.utilization_below,
            c.for_,
            window_s=getattr(c, "window", 0.0),
            memory_above_bytes=getattr(c, "memory_above", 0),
            models=tuple(c.models),
            nodes=tuple(c.nodes),
        )
        for name, condition, c in configured
        if c.enabled
    ]


def _make_attributor(settings: Settings, node: Any) -> Attributor:
    """Attribution reading the host's files, or the fake node's when running on one."""
    a = settings.attribution
    rules = compile_rules([(rule.match, rule.set) for rule in a.rules])
    allowlist = set(a.env_allowlist) | rule_env_keys(rules)
    if node is not None:
        host = node.host
        proc_root, passwd, slurm_dir, pod_logs, socket_path = (
            host.proc_root, host.passwd_file, host.slurm_map_dir, host.pod_logs_dir, str(host.podresources_socket)
        )  # fmt: skip
    else:
        proc_root, passwd, slurm_dir, pod_logs, socket_path = (
            settings.proc_root, a.passwd_file, a.slurm_map_dir, a.pod_logs_dir, a.podresources_socket
        )  # fmt: skip
    return Attributor(
        ProcFS(proc_root, env_allowlist=allowlist),
        Passwd(passwd),
        rules=rules,
        slurm_map_dir=slurm_dir,
        pod_logs_dir=pod_logs,
        kubelet=KubeletWatcher(socket_path, timeout_s=a.kubelet_timeout),
        per_pid=a.per_pid_series,
    )


def _make_costing(settings: Settings, node: Any, ledger_path: str | None, clock: Callable[[], float]) -> Costing:
    """Prices per GPU (config, instance type, catalogue), the charge limits, and the ledger."""
    from exporters.ledger_sink import LedgerSink

    catalogue = load_catalogue()
    pricing = settings.pricing
    instance_type = node.scenario.node.instance_type if node is not None else detect_instance_type()

    def prices(snapshot: Snapshot) -> dict[str, Price | None]:
        gpus = snapshot.gpus
        found = {
            g.uuid: resolve_price(
                model=g.model,
                uuid=g.uuid,
                gpu_count=len(gpus),
                instance_type=instance_type,
                pricing=pricing,
                catalogue=catalogue,
            )
            for g in gpus
            if g.name
        }
        for g in gpus:
            if g.name and found.get(g.uuid) is None:
                log.warning("no price for GPU %d (%s): set pricing.by_model or pricing.gpu_hourly", g.index, g.model)
        return found

    sink = LedgerSink(ledger_path, retention_s=settings.ledger.retention, clock=clock) if ledger_path else None
    return Costing(
        prices=prices,
        max_interval_s=settings.accounting.max_interval,
        forget_after_s=settings.accounting.forget_after,
        energy_per_kwh=pricing.energy_per_kwh,
        sink=sink,
        flush_interval_s=settings.ledger.flush_interval,
    )


def _node_name(settings: Settings, node: Any) -> str | None:
    """node_name from the config, else the fake node's hostname, else (None) the host's."""
    if settings.node_name:
        return settings.node_name
    return str(node.scenario.node.hostname) if node is not None else None


def _make_backend(fake: str | None, speed: float) -> tuple[NvmlBackend, Any]:
    """The NVML backend, and the fake node when running on one."""
    if fake is None:
        return NvmlBackend(clock=time.time), None
    import fake_nvml

    node = fake_nvml.install(fake, speed=speed)
    return NvmlBackend(clock=node.clock.wall_time), node


def _cmd_run(args: argparse.Namespace) -> int:
    from prometheus_client import generate_latest

    from exporters.http import MetricsServer
    from exporters.prometheus import make_registry
    from exporters.textfile import TextfileWriter
    from exporters.webconfig import load_web_config

    settings = _settings(args.config)
    if args.fake is None and args.fake_speed != 1.0:
        raise BadInputError("gpuledger: --fake-speed: only meaningful with --fake")
    if args.fake_speed <= 0:
        raise BadInputError(f"gpuledger: --fake-speed: must be above 0, got {args.fake_speed:g}")
    host, port = _parse_listen(args.listen or settings.listen, "--listen" if args.listen else "listen")
    web_config_file = args.web_config or settings.web_config_file
    web = load_web_config(web_config_file) if web_config_file else None  # ConfigError: exit 2
    textfile_path = settings.exporters.textfile_path
    if textfile_path and not Path(textfile_path).parent.is_dir():
        raise BadInputError(f"gpuledger: exporters.textfile_path: no such directory {Path(textfile_path).parent}")
    backend, node = _make_backend(args.fake, args.fake_speed)
    sampler = Sampler(backend, hostname=_node_name(settings, node))
    sampler.start()
    attributor = _make_attributor(settings, node)
    ledger_path = args.ledger or (None if node is not None else settings.ledger.path)
    costing = _make_costing(settings, node, ledger_path, time.time)
    if node is not None:
        # At --fake-speed N one poll interval spans N times as much scenario time: that is the
        # run's normal rhythm, not a gap to leave uncharged.
        rhythm = settings.poll_interval * args.fake_speed
        costing = replace(costing, max_interval_s=max(costing.max_interval_s, 3 * rhythm))
    pipeline = Pipeline(
        sampler,
        settings.poll_interval,
        attributor=attributor,
        kubelet_interval_s=settings.attribution.kubelet_interval,
        costing=costing,
        rules=rule_specs(settings),
    )
    per_pid = settings.attribution.per_pid_series
    dcgm_compat = settings.exporters.dcgm_compat
    registry = make_registry(lambda: pipeline.state, per_pid, dcgm_compat=dcgm_compat)
    try:
        server = MetricsServer(host, port, registry, pipeline.healthy, web=web)
    except OSError as exc:
        raise BadInputError(f"gpuledger: listen {host}:{port}: {exc.strerror or exc}") from None
    textfile = (
        TextfileWriter(
            textfile_path,
            lambda: pipeline.state,
            lambda state: generate_latest(make_registry(lambda: state, per_pid, dcgm_compat=dcgm_compat)),
        )
        if textfile_path
        else None
    )
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("received signal %d, shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.start()
    pipeline.start()
    if textfile is not None:
        textfile.start(settings.poll_interval)
    where = f"fake node {node.scenario.name!r} at {args.fake_speed:g}x" if node is not None else "NVML"
    log.info(
        "gpuledger %s serving %s://%s:%d/metrics, polling %s every %s",
        __version__,
        server.scheme,
        host,
        server.port,
        where,
        format_duration(settings.poll_interval),
    )
    stop.wait()
    pipeline.stop()
    if textfile is not None:
        textfile.stop()  # the last poll reaches the file too
    if costing.sink is not None:
        costing.sink.close()  # the last charges reach the ledger before we exit
    server.stop()
    sampler.close()
    if node is not None:
        import fake_nvml

        fake_nvml.uninstall()
    return EXIT_OK


def _cmd_snapshot(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    at = _duration_arg(args.at, "--at")
    backend, node = _make_backend(args.fake, 0.0)
    sampler = Sampler(backend, hostname=_node_name(settings, node))
    sampler.start()
    clock = node.clock.wall_time if node is not None else time.time
    pipeline = Pipeline(
        sampler,
        poll_interval_s=5.0,
        attributor=_make_attributor(settings, node),
        costing=_make_costing(settings, node, None, clock),
        rules=rule_specs(settings),
    )
    pipeline.refresh_allocations()
    if node is not None:
        # A fake node can show what a daemon running since t=0 would show at --at: flags need
        # their durations, costs their history. Poll each minute up to 5 s before --at, then at
        # --at (per-process utilization is the mean over the samples between two polls).
        while node.clock.now() + 60 <= at - 5:
            pipeline.poll_once()
            node.clock.advance(60)
        pipeline.poll_once()
        node.clock.advance(max(0.0, at - node.clock.now()) if at >= 5 else 5.0)
    state = pipeline.poll_once()
    sampler.close()
    if node is not None:
        import fake_nvml

        fake_nvml.uninstall()
    if state.snapshot is None:
        raise GpuledgerError("the poll read nothing")
    if args.json:
        print(json.dumps(_snapshot_json(state), indent=2))
    else:
        print(render_table(state))
    return EXIT_OK


def _raised_flags(state: AgentState, with_duration: bool) -> dict[str, list[str]]:
    """GPU uuid -> the rules raised on it, e.g. ["idle 2h"] (or ["idle"])."""
    flags: dict[str, list[str]] = {}
    for flag in state.flags:
        if flag.raised:
            text = f"{flag.rule} {format_duration(flag.held_s)}" if with_duration else flag.rule
            flags.setdefault(flag.uuid, []).append(text)
    return flags


def _snapshot_json(state: AgentState) -> dict[str, Any]:
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
                dict(asdict(h.workload), pids=list(h.pids), allocated=h.allocated, sm_util=h.sm_util)
                for h in attribution.for_device(d.uuid)
            ],
            price=asdict(price) if (price := prices.get(d.uuid)) is not None else None,
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
        "GPU", "MODEL", "UP", "UTIL", "MEM USED/TOTAL GiB", "TEMP", "POWER W", "PROCS", "NVLINK DOWN",
        "$/H", "FLAGS", "OWNERS",
    )  # fmt: skip
    rows: list[tuple[str, ...]] = [header]
    for d in snapshot.devices:
        price = prices.get(d.uuid)
        hourly = f"{price.dollars_per_hour:.2f}" if price is not None else ("-" if d.is_mig else "?")
        rows.append((*_row(d), hourly, ", ".join(flags.get(d.uuid, [])) or "-", _owners(attribution, d)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(snapshot.taken_at))
    title = f"{snapshot.node.hostname}  driver {snapshot.node.driver_version}  at {when}"
    sources: dict[str, list[str]] = {}
    for d in snapshot.gpus:
        price = prices.get(d.uuid)
        sources.setdefault(price.source if price is not None else "no price known", []).append(str(d.index))
    notes = [f"$/H for GPU {','.join(gpus)}: {source}" for source, gpus in sources.items()]
    return "\n".join([title, *lines, "", *notes])


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


def _row(d: DeviceReading) -> tuple[str, ...]:
    gib = 1 / 2**30
    memory = (
        "-"
        if d.memory_total_bytes is None
        else f"{_fmt(d.memory_used_bytes, '.1f', gib)}/{_fmt(d.memory_total_bytes, '.0f', gib)}"
    )
    down_links = [str(link.link) for link in d.nvlinks if not link.up]
    model = d.model if not d.is_mig else "  " + d.name.split(" MIG ")[-1]
    return (
        d.label,
        model,
        "yes" if d.up else f"no ({d.down_reason})",
        _fmt(d.utilization, ".0%"),
        memory,
        _fmt(d.temperature_c, ".0f"),
        _fmt(d.power_w, ".0f"),
        str(len(d.processes)),
        ",".join(down_links) or "-",
    )


def _cmd_simulate(args: argparse.Namespace) -> int:
    from prometheus_client import generate_latest

    from exporters.prometheus import make_registry

    settings = _settings(args.config)
    duration = _duration_arg(args.duration, "--for")
    step = _duration_arg(args.step, "--step")
    if step <= 0:
        raise BadInputError("gpuledger: --step: must be above 0")
    for option, target in (("--metrics-out", args.metrics_out), ("--ledger", args.ledger)):
        if target and not Path(target).parent.is_dir():
            raise BadInputError(f"gpuledger: {option}: no such directory {Path(target).parent}")
    backend, node = _make_backend(args.scenario, 0.0)
    sampler = Sampler(backend, hostname=_node_name(settings, node))
    sampler.start()
    costing = _make_costing(settings, node, args.ledger, node.clock.wall_time)
    # Polls --step apart are this run's normal rhythm: never count them as a gap.
    costing = replace(costing, max_interval_s=max(costing.max_interval_s, step))
    pipeline = Pipeline(
        sampler,
        poll_interval_s=step,
        attributor=_make_attributor(settings, node),
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


def _cmd_report(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    path = args.ledger or settings.ledger.path
    if not Path(path).exists():
        raise BadInputError(f"gpuledger: --ledger: no such ledger file {path}")
    now = time.time()
    try:
        by = parse_by(args.by)
        since = parse_time(args.since, now) if args.since else None
        until = parse_time(args.until, now) if args.until else None
        report = report_from_ledger(path, by=by, since=since, until=until)
    except ValueError as exc:
        raise BadInputError(f"gpuledger: report: {exc}") from None
    sys.stdout.write(render(report, args.format))
    return EXIT_OK


def _cmd_check_config(args: argparse.Namespace) -> int:
    _settings_obj, problems = check_config(args.file)
    if problems:
        for line in problems:
            print(line, file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{args.file}: ok")
    return EXIT_OK


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _cmd_run,
    "snapshot": _cmd_snapshot,
    "simulate": _cmd_simulate,
    "check-config": _cmd_check_config,
    "report": _cmd_report,
}
