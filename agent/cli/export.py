"""`gpuledger export`: the ledger's rows, as CSV or Parquet, for a warehouse."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from agent.cli.args import EXIT_OK, time_arg
from agent.config import load_config
from agent.errors import BadInputError
from agent.ledger.export import FORMATS, read_records, write
from agent.ledger.report import ledger_files


def add_export_command(sub: argparse._SubParsersAction[Any]) -> None:
    export = sub.add_parser("export", help="the ledger's hourly rows as CSV or Parquet, for a warehouse")
    export.add_argument(
        "--ledger",
        action="append",
        metavar="FILE|DIR",
        help="ledger file, or a directory of *.db ledgers; repeat for several (default: ledger.path)",
    )
    export.add_argument("--config", help="YAML config file")
    export.add_argument("--since", metavar="T", help="ISO date/time (UTC) or e.g. 7d for seven days ago")
    export.add_argument("--until", metavar="T", help="ISO date/time (UTC) or e.g. 1d")
    export.add_argument("--format", choices=FORMATS, default="csv")
    export.add_argument("--out", default="-", metavar="FILE", help="write here (default -: standard output, CSV only)")


def cmd_export(args: argparse.Namespace) -> int:
    settings = load_config(args.config)
    try:
        paths = ledger_files(args.ledger or [settings.ledger.path])
    except ValueError as exc:
        raise BadInputError(f"gpuledger: --ledger: {exc}") from None
    if args.out != "-" and not Path(args.out).parent.is_dir():
        raise BadInputError(f"gpuledger: --out: no such directory {Path(args.out).parent}")
    if args.out == "-" and args.format == "parquet":
        raise BadInputError("gpuledger: export: Parquet is binary: give --out FILE")
    now = time.time()
    try:
        since = time_arg(args.since, "--since", now)
        until = time_arg(args.until, "--until", now)
        rows = read_records(paths, since=since, until=until)
    except ValueError as exc:
        raise BadInputError(f"gpuledger: export: {exc}") from None
    write(rows, args.format, args.out)
    return EXIT_OK
