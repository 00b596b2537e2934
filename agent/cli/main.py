"""The `gpuledger` command: the composition root, and the only code that reads configuration.

Exit codes: 0 ok, 2 bad input (config, scenario, arguments), 1 any other failure. Errors are
one line on stderr naming what was wrong and where; --debug adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from agent import __version__
from agent.cli.args import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_OK,
    duration_arg,
    parse_listen,
    positive_finite,
    time_arg,
)
from agent.cli.export import add_export_command, cmd_export
from agent.cli.fleet import add_store_options, cmd_report_prometheus
from agent.cli.logs import setup_logging
from agent.cli.reportpage import write_output
from agent.cli.rules import add_parser as add_rules_parser
from agent.cli.rules import cmd_rules
from agent.cli.systemd import notify, watchdog_interval_s
from agent.config import Settings, check_config, host_problems, load_config, unknown_variables
from agent.devices.backend import DriverLibraryMissing
from agent.errors import BadInputError, ConfigError, GpuledgerError
from agent.ledger.files import NotALedger
from agent.ledger.report import (
    DEFAULT_BY,
    GROUP_KEYS,
    ledger_files,
    parse_by,
    render,
    report_from_ledgers,
)
from agent.scrub import escape_control
from agent.units import format_duration

log = logging.getLogger("gpuledger")

MAX_FAKE_SPEED = 525_600.0  # scenario seconds per real second: a year of the fake node a minute

# snapshot --at polls each scenario minute up to that moment: a year is half a million polls
# (minutes of work); beyond that the question is not one a snapshot answers.
MAX_SNAPSHOT_AT_S = 366 * 86400.0
# On a real node, snapshot's two polls are this far apart: what is measured over an interval (GPM
# activity, per-process utilization, the mean power) needs one. A single poll on a real H200 had
# no busy figure at all (GPM's first sample has nothing to compare with), where `snapshot --fake`,
# polling twice, showed one.
SNAPSHOT_SPAN_S = 1.0


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
    sim.add_argument(
        "--metrics-out",
        metavar="FILE",
        help="write the final /metrics text to FILE (- for stdout; default: a summary only)",
    )
    sim.add_argument(
        "--ledger", metavar="FILE", help="write the charges to this ledger file (new, or empty unless --append)"
    )
    sim.add_argument(
        "--append", action="store_true", help="add to a --ledger that already holds charges (else refused)"
    )

    rep = sub.add_parser("report", help="cost and usage from the ledger")
    rep.add_argument(
        "--ledger",
        action="append",
        metavar="FILE|DIR",
        help="ledger file, or a directory of *.db ledgers; repeat to merge several (default: ledger.path)",
    )
    rep.add_argument("--config", help="YAML config file")
    rep.add_argument("--since", metavar="T", help="ISO date/time (UTC) or e.g. 7d for seven days ago")
    rep.add_argument("--until", metavar="T", help="ISO date/time (UTC) or e.g. 1d")
    rep.add_argument(
        "--by",
        default=",".join(DEFAULT_BY),
        metavar="KEYS",
        help=f"group by any of: {', '.join(GROUP_KEYS)} (job: hpc_job)",
    )
    rep.add_argument(
        "--format",
        choices=("table", "csv", "json", "html"),
        default="table",
        help="html: one self-contained page with charts (the gpuledger[html] extra)",
    )
    rep.add_argument("--out", default="-", metavar="FILE", help="write the report here (default -: standard output)")
    rep.add_argument(
        "--recommend",
        action="store_true",
        help="right-sizing advice per workload instead: the cheapest fitting GPU, MIG profile or count, or stop",
    )
    rep.add_argument(
        "--headroom", type=float, default=0.2, metavar="F", help="memory and compute headroom for --recommend (0.2)"
    )
    rep.add_argument(
        "--runs", action="store_true", help="with --by hpc_job or pod: each run's first and last hour and its GPUs too"
    )

    add_store_options(rep)

    add_rules_parser(sub)

    rec = sub.add_parser("record", help="poll the driver for a while and write what it saw as a scenario")
    rec.add_argument("--for", dest="duration", required=True, metavar="DURATION", help="how long to record, e.g. 10m")
    rec.add_argument("--step", metavar="DURATION", help="poll every this long (default: poll_interval)")
    rec.add_argument("--out", default="-", metavar="FILE", help="write the trace here (default: stdout)")
    rec.add_argument(
        "--keep-cmdlines",
        action="store_true",
        help="keep command lines whole, credentials scrubbed (default: the executable and model)",
    )
    rec.add_argument("--config", help="YAML config file")
    rec.add_argument(
        "--fake", nargs="?", const="demo", metavar="SCENARIO", help="record a fake node (default scenario: demo)"
    )

    add_export_command(sub)

    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("file", help="YAML config file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    setup_logging(debug)
    try:
        args = _build_parser().parse_args(args_list)
        handler: Callable[[argparse.Namespace], int] = _COMMANDS[args.command]
        return handler(args)
    except BadInputError as exc:
        return _fail(str(exc), EXIT_BAD_INPUT, debug)
    except DriverLibraryMissing as exc:
        return _fail(
            f"gpuledger: cannot load {exc.detail} (use --fake to run on a simulated node)", EXIT_FAILURE, debug
        )
    except NotALedger as exc:
        # A file given as a ledger (report, export) that is not one is bad input; a ledger that
        # is damaged, unreadable to this user or newer than this gpuledger is a failure.
        return _fail(f"gpuledger: {exc}", EXIT_BAD_INPUT, debug)
    except GpuledgerError as exc:
        return _fail(f"gpuledger: {exc}", EXIT_FAILURE, debug)
    except _scenario_error() as exc:
        return _fail(f"gpuledger: scenario {exc}", EXIT_BAD_INPUT, debug)
    except KeyboardInterrupt:
        return EXIT_FAILURE
    except BrokenPipeError:
        # The reader went away (`gpuledger export | head`): stop quietly, as cat does, and keep
        # Python from complaining when it flushes stdout on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except OSError as exc:
        where = f"gpuledger: {exc.filename}" if exc.filename else "gpuledger"
        return _fail(f"{where}: {exc.strerror or exc}", EXIT_FAILURE, debug)


def _scenario_error() -> type[Exception]:
    """The fake's ScenarioError, once a command has loaded the fake (only then can one be
    raised); before that a class nothing raises, so that an exception passing through main()
    (argparse's SystemExit for --help, say) does not import the fake to be compared with it."""
    model = sys.modules.get("fake_nvml.scenario.model")
    error: type[Exception] = getattr(model, "ScenarioError", _NoScenarioError)
    return error


class _NoScenarioError(Exception):
    """Raised by nothing: what _scenario_error() gives while the fake is not loaded."""


def _fail(message: str, code: int, debug: bool) -> int:
    if debug:
        logging.getLogger("gpuledger").exception(message)
    # One line, whatever the message quotes (a path given with a NUL or an escape sequence in it).
    print(escape_control(message.splitlines()[0]) if message else "gpuledger: failed", file=sys.stderr)
    return code


def _cmd_run(args: argparse.Namespace) -> int:
    from agent.cli.wiring import build_agent
    from exporters.http import MetricsServer
    from exporters.webconfig import load_web_config

    settings = load_config(args.config)
    if args.fake is None and args.fake_speed != 1.0:
        raise BadInputError("gpuledger: --fake-speed: only meaningful with --fake")
    positive_finite(args.fake_speed, "--fake-speed")
    if args.fake_speed > MAX_FAKE_SPEED:
        # Beyond it a poll interval of real time spans more scenario time than a clock can count.
        raise BadInputError(
            f"gpuledger: --fake-speed: at most {MAX_FAKE_SPEED:,.0f} (a year a minute), got {args.fake_speed:g}"
        )
    if args.fake is None and settings.poll_interval >= settings.accounting.max_interval:
        # Every interval would be longer than the longest charged: all GPU time booked unobserved.
        # (A fake node's intervals follow --fake-speed, and wiring widens the limit for them.)
        raise BadInputError(
            f"gpuledger: poll_interval ({format_duration(settings.poll_interval)}) must be shorter than "
            f"accounting.max_interval ({format_duration(settings.accounting.max_interval)}), "
            "or every interval is booked unobserved"
        )
    host, port = parse_listen(args.listen or settings.listen, "--listen" if args.listen else "listen")
    web_config_file = args.web_config or settings.web_config_file
    web = load_web_config(web_config_file) if web_config_file else None  # ConfigError: exit 2
    agent = build_agent(
        settings,
        fake=args.fake,
        fake_speed=args.fake_speed if args.fake is not None else 0.0,
        # The ledger keeps the backend's clock (its retention included): on a fake node the
        # scenario's, which stamps every charge, however far it is from the host's.
        ledger_path=args.ledger or (None if args.fake is not None else settings.ledger.path),
    )
    node = agent.node
    try:
        server = MetricsServer(
            host, port, agent.registry(), agent.pipeline.healthy, web=web, state=lambda: agent.pipeline.state
        )
    except OSError as exc:
        agent.close()
        raise BadInputError(f"gpuledger: listen {host}:{port}: {exc.strerror or exc}") from None
    stop = threading.Event()
    exit_code = EXIT_OK

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("received signal %d, shutting down", signum)
        stop.set()

    def _on_hung(exc: GpuledgerError) -> None:
        nonlocal exit_code
        log.error(
            "%s, past watchdog.exit_after (%s): flushing the ledger and exiting so that the service manager "
            "(systemd Restart=on-failure, or the kubelet) starts a fresh agent",
            exc,
            format_duration(settings.watchdog.exit_after),
        )
        exit_code = EXIT_FAILURE
        stop.set()

    agent.pipeline.on_hung = _on_hung

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.start()
    agent.start()
    where = f"fake node {node.scenario.name!r} at {args.fake_speed:g}x" if node is not None else "NVML"
    log.info(
        "gpuledger %s serving %s://%s:%d/metrics, polling %s every %s",
        __version__,
        server.scheme,
        host,
        server.port,
        where,
        format_duration(agent.pipeline.poll_interval_s),
    )
    notify("READY=1")
    beat = watchdog_interval_s()
    if beat is not None:
        threading.Thread(target=_watchdog, args=(stop, beat, agent.pipeline.healthy), daemon=True).start()
    # Wake each second: a signal the kernel hands to another thread reaches the Python handler
    # only when the main thread runs bytecode, and a wait with no timeout might never return.
    while not stop.wait(1.0):
        pass
    notify("STOPPING=1")
    # Whatever the driver is doing, the process ends within SHUTDOWN_GRACE_S: a thread stuck in
    # a driver call cannot be joined, and systemd's stop timeout would end in SIGKILL anyway.
    deadline = threading.Timer(SHUTDOWN_GRACE_S, _exit_now, args=(EXIT_FAILURE, lambda: agent.closing))
    deadline.daemon = True
    deadline.start()
    # The ledger first: the last charges reach it (or are logged as lost), then the textfile.
    written = agent.close(SHUTDOWN_GRACE_S - SHUTDOWN_AFTER_LEDGER_S)
    server.stop()
    deadline.cancel()
    # Charges the ledger could not take are lost (logged with their dollars): not a clean exit.
    return exit_code if written else EXIT_FAILURE


# SIGTERM to exit: at most this long, ledger flushed (it goes first).
SHUTDOWN_GRACE_S = 4.5
# Of the grace, what is kept for the rest of the shutdown: the ledger's close waits on its file
# (the busy timeout, 5 s, is longer than the grace) only for what is left before this.
SHUTDOWN_AFTER_LEDGER_S = 0.5


def _watchdog(stop: threading.Event, every_s: float, healthy: Callable[[], bool]) -> None:
    """Tell systemd we are alive while /healthz would say so; silence gets us restarted."""
    while not stop.wait(every_s):
        if healthy():
            notify("WATCHDOG=1")


def _exit_now(code: int, waiting_on: Callable[[], str]) -> None:
    log.error(
        "shutdown did not finish within %.1fs (%s); exiting now", SHUTDOWN_GRACE_S, waiting_on() or "still closing"
    )
    logging.shutdown()
    os._exit(code)


def _cmd_snapshot(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from agent.cli.render import render_table, snapshot_json
    from agent.cli.wiring import build_agent

    settings = load_config(args.config)
    if settings.readings.mig_activity == "slow":
        # One look, not a daemon's steady polls: its last two polls are 5 s apart, and with
        # --at the slow rhythm would carry the span of the minute polls before them; read MIG
        # activity over those 5 s like the rest of the snapshot (a few calls more, once).
        readings = settings.readings.model_copy(update={"mig_activity": "every_poll"})
        settings = settings.model_copy(update={"readings": readings})
    at = duration_arg(args.at, "--at")
    if args.fake is None and args.at != "0s":
        raise BadInputError("gpuledger: --at: only meaningful with --fake")
    if at > MAX_SNAPSHOT_AT_S:
        raise BadInputError(f"gpuledger: --at: at most {format_duration(MAX_SNAPSHOT_AT_S)}, got {args.at}")
    agent = build_agent(settings, fake=args.fake, poll_interval_s=5.0, actions="off")
    node, pipeline = agent.node, agent.pipeline
    try:
        pipeline.refresh_allocations()
        if node is not None:
            # A fake node can show what a daemon running since t=0 would show at --at: flags need
            # their durations, costs their history. Poll each minute up to 5 s before --at, then at
            # --at (per-process utilization is the mean over the samples between two polls).
            minutes = max(0, int((at - 5) // 60))
            with tqdm(total=minutes, unit="poll", desc="catching up to --at", disable=None, leave=False) as bar:
                while node.clock.now() + 60 <= at - 5:
                    pipeline.poll_once()
                    node.clock.advance(60)
                    bar.update()
            pipeline.poll_once()
            node.clock.advance(max(0.0, at - node.clock.now()) if at >= 5 else 5.0)
        else:
            pipeline.poll_once()
            time.sleep(SNAPSHOT_SPAN_S)
        state = pipeline.poll_once()
    finally:
        agent.close()
    if state.snapshot is None:
        raise GpuledgerError("the poll read nothing")
    if args.json:
        print(json.dumps(snapshot_json(state), indent=2))
    else:
        print(render_table(state))
    return EXIT_OK


def _cmd_report(args: argparse.Namespace) -> int:
    if args.prometheus is not None:
        return cmd_report_prometheus(args)
    settings = load_config(args.config)
    try:
        paths = ledger_files(args.ledger or [settings.ledger.path])
    except ValueError as exc:
        raise BadInputError(f"gpuledger: --ledger: {exc}") from None
    now = time.time()
    try:
        by = parse_by(args.by)
        since = time_arg(args.since, "--since", now)
        until = time_arg(args.until, "--until", now)
        if args.format == "html":
            return _report_html(args, paths, settings, by=by, since=since, until=until)
        if args.recommend:
            from agent.cli.recommend import recommendations, render_recommendations

            if not 0 <= args.headroom < 10:
                raise ValueError(f"--headroom must be from 0 to 10, got {args.headroom}")
            advice = recommendations(paths, settings, since=since, until=until, headroom=args.headroom)
            write_output(render_recommendations(advice, args.format), args.out)
            return EXIT_OK
        report = report_from_ledgers(paths, by=by, since=since, until=until, runs=args.runs)
    except ValueError as exc:
        raise BadInputError(f"gpuledger: report: {exc}") from None
    write_output(render(report, args.format), args.out)
    return EXIT_OK


def _report_html(
    args: argparse.Namespace,
    paths: Sequence[Path],
    settings: Settings,
    *,
    by: tuple[str, ...],
    since: float | None,
    until: float | None,
) -> int:
    from agent.cli.reportpage import html_from_ledgers
    from agent.ledger.charts import require_matplotlib

    if args.recommend:
        raise BadInputError("gpuledger: report: --format html holds the right-sizing advice already: drop --recommend")
    require_matplotlib()  # before reading anything: one line naming the extra
    if not 0 <= args.headroom < 10:
        raise ValueError(f"--headroom must be from 0 to 10, got {args.headroom}")
    page = html_from_ledgers(paths, settings, by=by, since=since, until=until, runs=args.runs, headroom=args.headroom)
    write_output(page, args.out)
    return EXIT_OK


def _cmd_check_config(args: argparse.Namespace) -> int:
    settings, problems = check_config(args.file)
    if settings is not None:
        # The checks run makes on this host too: a config check-config passes, run starts with.
        problems = host_problems(settings, args.file)
        if not problems and settings.web_config_file:
            from exporters.webconfig import load_web_config

            try:
                load_web_config(settings.web_config_file)
            except ConfigError as exc:
                problems = [str(exc)]
    if problems:
        # Not every check escapes the values it quotes (an action's program, from the file), and
        # `run` prints the same line escaped.
        for line in problems:
            print(escape_control(line), file=sys.stderr)
        return EXIT_BAD_INPUT
    for line in unknown_variables():
        print(escape_control(f"warning: {line}"), file=sys.stderr)
    print(f"{args.file}: ok")
    return EXIT_OK


def _cmd_simulate(args: argparse.Namespace) -> int:
    from agent.cli.simulate import cmd_simulate

    return cmd_simulate(args)


def _cmd_record(args: argparse.Namespace) -> int:
    from agent.cli.record import cmd_record

    return cmd_record(args)


# The commands that poll (run, snapshot, simulate, record) import the device, attribution and
# fake-node stack when they run; report, export, rules and check-config start without it.
_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _cmd_run,
    "snapshot": _cmd_snapshot,
    "simulate": _cmd_simulate,
    "check-config": _cmd_check_config,
    "report": _cmd_report,
    "export": cmd_export,
    "record": _cmd_record,
    "rules": cmd_rules,
}
