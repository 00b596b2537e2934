"""`gpuledger report --prometheus URL` (the fleet's report from a Prometheus-compatible store) and
the options that reach a store behind authentication or TLS."""

from __future__ import annotations

import argparse
import logging
import time

from agent.cli.args import EXIT_OK, duration_arg, time_arg
from agent.cli.reportpage import write_output
from agent.errors import BadInputError
from agent.fleet import DEFAULT_NODE_LABEL, DEFAULT_TIMEOUT_S
from agent.ledger.report import parse_by, render
from agent.scrub import escape_control
from agent.units import format_duration
from exporters.promrules import LABEL_NAME

# A store has no beginning the query API tells: without --since, the last 30 days (a month's
# showback; Prometheus keeps 15 days by default, long-term stores a year or more).
DEFAULT_SPAN_S = 30 * 86400.0


def add_store_options(parser: argparse.ArgumentParser) -> None:
    """The `report` options that read a Prometheus-compatible store instead of ledgers."""
    store = parser.add_argument_group("reading a Prometheus-compatible store (the whole fleet)")
    store.add_argument(
        "--prometheus",
        metavar="URL",
        help="the query API's base URL (Prometheus, VictoriaMetrics, Thanos, Mimir), instead of --ledger",
    )
    store.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="an HTTP header for every query (repeat for more), e.g. 'X-Scope-OrgID: team-a'",
    )
    store.add_argument("--bearer-token-file", metavar="FILE", help="send the token in FILE as a bearer token")
    store.add_argument("--ca-file", metavar="FILE", help="verify the store's TLS certificate against these CAs")
    store.add_argument("--insecure-skip-verify", action="store_true", help="do not verify the store's TLS certificate")
    store.add_argument(
        "--query-timeout",
        default=format_duration(DEFAULT_TIMEOUT_S),
        metavar="DURATION",
        help=f"give up on a query after this long (default {format_duration(DEFAULT_TIMEOUT_S)})",
    )
    store.add_argument(
        "--node-label",
        default=DEFAULT_NODE_LABEL,
        metavar="LABEL",
        help=f"the label naming each series' node (default {DEFAULT_NODE_LABEL}, as the shipped scrape configs set it)",
    )


def cmd_report_prometheus(args: argparse.Namespace) -> int:
    # Imported here: httpx is needed by this command only, not by the daemon's start.
    from agent.fleet.promapi import PrometheusAPI, StoreOptions, parse_header
    from agent.fleet.report import StoreQuery, report_from_prometheus

    # httpx logs every request at INFO: a report asks dozens of questions, and its output is the answer.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.ledger:
        raise BadInputError("gpuledger: report: --ledger and --prometheus read different sources: give one")
    for flag, given in (("--recommend", args.recommend), ("--runs", args.runs)):
        if given:
            # Both read what only a ledger keeps (each hour's sizing sketches; each run's hours).
            raise BadInputError(f"gpuledger: report: {flag} reads ledgers, not a --prometheus store")
    if args.format == "html":
        from agent.ledger.charts import require_matplotlib

        require_matplotlib()  # before the first query: one line naming the extra
    timeout_s = duration_arg(args.query_timeout, "--query-timeout")
    if timeout_s <= 0:
        raise BadInputError("gpuledger: --query-timeout: must be above 0")
    if not LABEL_NAME.fullmatch(args.node_label):
        # It goes into the queries' label matchers as is: anything else broke them only when a
        # counter fell (the store's parse error, mid-report) or added a matcher of its own.
        raise BadInputError(
            f"gpuledger: --node-label: {escape_control(repr(args.node_label))} is not a label name "
            "(letters, digits and _, not starting with a digit)"
        )
    try:
        headers = dict(parse_header(text) for text in args.header)
    except ValueError as exc:
        raise BadInputError(f"gpuledger: --header: {exc}") from None
    now = time.time()
    try:
        by = parse_by(args.by)
        until_at, since_at = time_arg(args.until, "--until", now), time_arg(args.since, "--since", now)
        until = until_at if until_at is not None else now
        since = since_at if since_at is not None else until - DEFAULT_SPAN_S
    except ValueError as exc:
        raise BadInputError(f"gpuledger: report: {exc}") from None
    if "account" in by:
        # The Slurm account is no metric label (only the ledger keeps it): every row would be
        # grouped under an empty account.
        raise BadInputError("gpuledger: report: --by account reads ledgers, not a --prometheus store")
    options = StoreOptions(
        headers=headers,
        bearer_token_file=args.bearer_token_file,
        ca_file=args.ca_file,
        insecure_skip_verify=args.insecure_skip_verify,
        timeout_s=timeout_s,
    )
    try:
        with PrometheusAPI(args.prometheus, options) as api:
            report = report_from_prometheus(api, StoreQuery(since, until, node_label=args.node_label), by=by)
    except BadInputError as exc:
        raise BadInputError(f"gpuledger: report: {exc}") from None
    except ValueError as exc:
        raise BadInputError(f"gpuledger: report: {exc}") from None
    if args.format == "html":
        from agent.cli.reportpage import html_from_store

        write_output(html_from_store(report), args.out)
    else:
        write_output(render(report, args.format), args.out)
    return EXIT_OK
