"""`gpuledger report --format html`: the page of agent/ledger/page.py, from ledgers with the
right-sizing advice of `report --recommend`, or from a store without it; and `report --out`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from agent import __version__
from agent.cli.recommend import recommendations
from agent.cli.rules import _write
from agent.config import Settings
from agent.ledger.page import render_html
from agent.ledger.report import Report, report_and_rows

GENERATOR = f"gpuledger {__version__}"


def html_from_ledgers(
    paths: Sequence[Path],
    settings: Settings,
    *,
    by: Sequence[str],
    since: float | None,
    until: float | None,
    runs: bool,
    headroom: float,
) -> str:
    """The page of the ledgers' report over [since, until), with its right-sizing advice."""
    report, rows = report_and_rows(paths, by=by, since=since, until=until, runs=runs)
    advice = recommendations(paths, settings, since=since, until=until, headroom=headroom)
    return render_html(report, rows, advice, generator=GENERATOR)


def html_from_store(report: Report) -> str:
    """The page of a store's report: no hours to chart, no sizing histograms to advise from."""
    return render_html(report, None, None, generator=GENERATOR)


def write_output(text: str, out: str) -> None:
    """`text` to standard output ("-") or, whole or not at all, to the file `out`."""
    if out == "-":
        sys.stdout.write(text)
        return
    _write(Path(out), text)
