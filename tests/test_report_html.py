"""`gpuledger report --format html`: the page's figures are `--format json`'s, they add up to the
price of the window's GPU time, every label is text (never markup), an empty window is a page
that says so, and the page renders in a real headless browser (Debian's chromium) with no console
error and no request, charts drawn.

One simulated ledger and one browser for the module (xdist_group keeps them on one worker)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.cli.reportpage import GENERATOR, html_from_ledgers
from agent.config import load_config
from agent.ledger import charts, page
from agent.ledger.page import MAX_BARS, bucket_size, bucket_start, cents_adding_up, render_html, spend_over_time
from agent.ledger.read import UsageRow
from agent.ledger.report import build_report, parse_by, parse_time, render
from agent.ledger.store import Ledger
from agent.model import Workload
from tests.test_cli import gpuledger

pytestmark = pytest.mark.xdist_group("report_html")

PRICE = 2.5  # $/GPU-hour, pricing.gpu_hourly
HOURS = 12
BY = "namespace,pod,hpc_job"
# A pod name that is markup: the page must show it as text. Its `$...$` would be mathtext to
# matplotlib, which must draw it literally too.
EVIL_POD = "<script>alert('$x$')</script>"

# Four A100s for 12 hours, polled every minute:
#   GPU 0  Slurm job 8812, 90% busy, ends at 6h; then idle, left by the job
#   GPU 1  the pod named like a script tag, 40% busy throughout
#   GPU 2  allocated to notebook-7, which runs nothing on it (all waste)
#   GPU 3  idle throughout, left by nobody known
SCENARIO = f"""
start: 2026-11-20T18:00:00Z
node: {{hostname: gpu-node-html}}
gpus:
  - {{model: A100-SXM4-80GB, count: 4}}
processes:
  - {{pid: 4101, gpus: [0], end: 6h, sm_util: 90, memory_mib: 60000, uid: 1001, user: alice, slurm_job: "8812",
     cmdline: "torchrun train.py --model llama-3-8b"}}
  - pid: 5200
    gpus: [1]
    sm_util: 40
    memory_mib: 20000
    uid: 1002
    user: bob
    pod: {{namespace: serving, name: "{EVIL_POD}", container: vllm, uid: 0b6c2f4e-0000-4000-8000-000000000001}}
    cmdline: "vllm serve meta-llama/Llama-3.1-8B-Instruct"
allocations:
  - gpus: [2]
    pod: {{namespace: research, name: notebook-7, container: jupyter, uid: 5f2c0000-0000-4000-8000-000000000002}}
"""

# By hand, at $2.5 a GPU-hour:
TOTAL_DOLLARS = 4 * HOURS * PRICE  # 4 GPUs x 12 h x $2.5 = $120
NOTEBOOK_DOLLARS = HOURS * PRICE  # allocated from the first poll to the last: 12 h x $2.5 = $30
POD_DOLLARS = HOURS * PRICE  # 12 h x $2.5 = $30
POD_WASTE = POD_DOLLARS * (1 - 0.40)  # 40% busy: $30 x 0.6 = $18
# The job is last seen at the 5h59m poll and gone at 6h: charged to the midpoint, 6 h - 30 s.
JOB_DOLLARS = (6 * 3600 - 30) / 3600 * PRICE  # 5.991667 h x $2.5 = $14.979167
JOB_WASTE = JOB_DOLLARS * (1 - 0.90)  # 90% busy: $14.979167 x 0.1 = $1.497917
IDLE_NOBODY = HOURS * PRICE  # GPU 3: 12 h x $2.5 = $30
IDLE_LEFT_BY_JOB = (6 * 3600 + 30) / 3600 * PRICE  # GPU 0 after the job: 6.008333 h x $2.5 = $15.020833


@dataclass
class Page:
    """What the page shows, read from its HTML: the tiles, the rows of each table by its id (each
    row its attributes and its number cells' (data-field or column, data-value, text))."""

    tiles: dict[str, float | None] = field(default_factory=dict)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    svgs: int = 0
    scripts: int = 0


class _Reader(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.page = Page()
        self.table: str | None = None
        self.row: dict[str, Any] | None = None
        self.cell: dict[str, str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "div" and "data-figure" in a:
            self.page.tiles[a["data-figure"]] = float(a["data-value"]) if a["data-value"] else None
        elif tag == "table":
            self.table = a.get("id", "")
            self.page.tables[self.table] = []
        elif tag == "tr" and self.table is not None:
            self.row = {"attrs": a, "cells": []}
        elif tag == "td" and self.row is not None:
            self.cell = {"field": a.get("data-field", ""), "value": a.get("data-value", ""), "text": ""}
        elif tag == "svg":
            self.page.svgs += 1
        elif tag == "script":
            self.page.scripts += 1

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cell["text"] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self.row is not None and self.cell is not None:
            self.row["cells"].append(self.cell)
            self.cell = None
        elif tag == "tr" and self.row is not None and self.table is not None:
            if self.row["cells"]:
                self.page.tables[self.table].append(self.row)
            self.row = None
        elif tag == "table":
            self.table = None


def read_page(text: str) -> Page:
    reader = _Reader()
    reader.feed(text)
    reader.close()
    return reader.page


def figures(row: dict[str, Any]) -> dict[str, float | None]:
    return {c["field"]: (float(c["value"]) if c["value"] else None) for c in row["cells"] if c["field"]}


def shown(row: dict[str, Any]) -> dict[str, str]:
    return {c["field"]: c["text"] for c in row["cells"] if c["field"]}


@dataclass(frozen=True)
class Ledgers:
    dir: Path
    ledger: Path
    config: Path
    html: str
    html_file: Path
    json: dict[str, Any]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Ledgers:
    """The scenario simulated once into a ledger, and its report as JSON and as a page."""
    where = tmp_path_factory.mktemp("report_html")
    scenario, config, ledger = where / "four-gpus.yaml", where / "config.yaml", where / "ledger.db"
    scenario.write_text(SCENARIO)
    config.write_text(f"pricing: {{gpu_hourly: {PRICE}}}\n")
    done = gpuledger(
        "simulate", str(scenario), "--for", f"{HOURS}h", "--step", "60s", "--config", str(config),
        "--ledger", str(ledger), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    as_json = gpuledger("report", "--ledger", str(ledger), "--by", BY, "--format", "json")
    assert as_json.returncode == 0, as_json.stderr
    page = where / "report.html"
    as_html = gpuledger("report", "--ledger", str(ledger), "--by", BY, "--format", "html", "--out", str(page))
    assert as_html.returncode == 0, as_html.stderr
    assert as_html.stdout == ""  # --out: the page went to the file
    return Ledgers(where, ledger, config, page.read_text(), page, json.loads(as_json.stdout))


def _row_key(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(json.loads(row["attrs"]["data-key"])[k] for k in parse_by(BY))


def test_hand_arithmetic_holds_in_the_json_the_page_is_checked_against(made: Ledgers) -> None:
    rows = {(r["namespace"], r["pod"], r["hpc_job"]): r for r in made.json["rows"]}
    assert rows.keys() == {("research", "notebook-7", ""), ("serving", EVIL_POD, ""), ("", "", "8812")}
    assert rows["research", "notebook-7", ""]["dollars"] == pytest.approx(NOTEBOOK_DOLLARS)
    assert rows["serving", EVIL_POD, ""]["dollars"] == pytest.approx(POD_DOLLARS)
    assert rows["serving", EVIL_POD, ""]["waste_dollars"] == pytest.approx(POD_WASTE)
    assert rows["", "", "8812"]["dollars"] == pytest.approx(JOB_DOLLARS)
    assert rows["", "", "8812"]["waste_dollars"] == pytest.approx(JOB_WASTE)
    left = {x["workload"]["hpc_job"]: x["dollars"] for x in made.json["idle"]["left_by"]}
    assert left == {"": pytest.approx(IDLE_NOBODY), "8812": pytest.approx(IDLE_LEFT_BY_JOB)}
    assert made.json["total"]["dollars"] == pytest.approx(TOTAL_DOLLARS)


def test_every_row_of_the_page_is_the_json_report(made: Ledgers) -> None:
    page = read_page(made.html)
    table = page.tables["rows"]
    groups = [r for r in table if r["attrs"]["data-kind"] == "group"]
    # Same rows, same order (dollars, largest first), every figure equal to the last bit.
    assert [_row_key(r) for r in groups] == [tuple(r[k] for k in parse_by(BY)) for r in made.json["rows"]]
    for row, expected in zip(groups, made.json["rows"], strict=True):
        assert figures(row) == {k: v for k, v in expected.items() if k in figures(row)}
        assert set(figures(row)) == {"dollars", "gpu_hours_charged", "gpu_hours_used", "efficiency_ratio",
                                     "waste_dollars", "energy_kwh"}  # fmt: skip
    job = next(r for r in groups if _row_key(r) == ("", "", "8812"))
    assert figures(job)["dollars"] == pytest.approx(JOB_DOLLARS)
    # What people read: the figure rounded to cents, the efficiency in percent.
    assert shown(job)["dollars"] == f"{JOB_DOLLARS:,.2f}" == "14.98"
    assert shown(job)["efficiency_ratio"] == "90.0%"
    assert job["cells"][0]["text"] == "(none)"  # no namespace: as the table says it

    idle = [r for r in table if r["attrs"]["data-kind"] == "idle"]
    json_idle = made.json["idle"]["left_by"]
    assert [json.loads(r["attrs"]["data-left-by"]) for r in idle] == [x["workload"] for x in json_idle]
    for row, expected in zip(idle, json_idle, strict=True):
        assert figures(row)["dollars"] == expected["dollars"]
        assert figures(row)["gpu_hours_charged"] == expected["gpu_hours_charged"]
        assert figures(row)["efficiency_ratio"] is None
    by_who = {json.loads(r["attrs"]["data-left-by"])["hpc_job"]: figures(r)["dollars"] for r in idle}
    assert by_who == {"": pytest.approx(IDLE_NOBODY), "8812": pytest.approx(IDLE_LEFT_BY_JOB)}
    # The idle section's own table says the same.
    section = {r["attrs"]["data-left-by"]: figures(r)["dollars"] for r in page.tables["idle-by"]}
    assert section == {r["attrs"]["data-left-by"]: figures(r)["dollars"] for r in idle}

    (unobserved,) = (r for r in table if r["attrs"]["data-kind"] == "unobserved")
    assert figures(unobserved)["dollars"] == made.json["unobserved"]["dollars"] == 0.0
    (total,) = (r for r in table if r["attrs"]["data-kind"] == "total")
    assert figures(total) == {k: v for k, v in made.json["total"].items() if k in figures(total)}


def test_the_tiles_add_up_to_the_price_of_the_windows_gpu_time(made: Ledgers) -> None:
    tiles = read_page(made.html).tiles
    assert tiles["total_dollars"] == made.json["total"]["dollars"]
    assert tiles["total_dollars"] == pytest.approx(TOTAL_DOLLARS)  # 4 GPUs x 12 h x $2.5
    # Charged + idle + unobserved = price x time.
    workloads = NOTEBOOK_DOLLARS + POD_DOLLARS + JOB_DOLLARS  # $30 + $30 + $14.979167 = $74.979167
    assert tiles["workload_dollars"] == pytest.approx(workloads)
    assert tiles["idle_dollars"] == pytest.approx(IDLE_NOBODY + IDLE_LEFT_BY_JOB)  # $30 + $15.020833
    assert tiles["unobserved_dollars"] == 0.0
    parts = (tiles["workload_dollars"], tiles["idle_dollars"], tiles["unobserved_dollars"])
    assert math.fsum(p or 0.0 for p in parts) == pytest.approx(4 * HOURS * PRICE, rel=1e-12)
    assert tiles["idle_dollars"] == made.json["idle"]["dollars"]
    assert tiles["waste_dollars"] == made.json["total"]["waste_dollars"]
    assert tiles["efficiency_ratio"] == made.json["total"]["efficiency_ratio"]
    assert "= $120.00, the price of 48.00 GPU-hours" in made.html


def test_the_summary_sum_adds_up_to_the_cent() -> None:
    # A lost GPU's ledger read "Charged to workloads $17.65 + idle $0.00 + unobserved $2.93 =
    # $20.59": each part rounded alone. $17.654 + $0 + $2.934 = $20.588 -> $20.59; the parts'
    # cents 1765.4, 0, 293.4 floor to 2058, one short: the largest remainder (a tie, the first)
    # takes it: $17.66 + $0.00 + $2.93 = $20.59.
    assert cents_adding_up([17.654, 0.0, 2.934], 20.588) == [17.66, 0.0, 2.93]
    assert cents_adding_up([30.0, 45.020833, 0.0], 75.020833) == [30.0, 45.02, 0.0]  # already adds up


@given(st.lists(st.floats(min_value=0, max_value=1e7, allow_nan=False), min_size=3, max_size=3))
def test_shown_parts_always_add_up_and_stay_within_a_cent(parts: list[float]) -> None:
    total = math.fsum(parts)
    shown = cents_adding_up(parts, total)
    assert round(sum(round(p * 100) for p in shown)) == round(total * 100)
    assert all(abs(s - p) < 0.01 + 1e-9 for s, p in zip(shown, parts, strict=True))


def test_spend_over_time_adds_up_hour_by_hour(made: Ledgers) -> None:
    hours = read_page(made.html).tables["over-time-table"]
    assert len(hours) == HOURS  # 12 hourly bars
    assert hours[0]["attrs"]["data-start"] == "2026-11-20T18:00:00Z"
    for hour in hours:
        # Every hour: 4 GPUs x $2.5 = $10, whoever it went to.
        assert math.fsum(float(c["value"]) for c in hour["cells"] if c["value"]) == pytest.approx(10.0)


@pytest.mark.parametrize(("since", "until"), [("1970-01-01", None), ("1970-01-01", "8999-12-31")])
def test_a_window_of_centuries_charts_the_hours_the_ledger_holds(made: Ledgers, since: str, until: str | None) -> None:
    # The bars followed the window asked for: 1970 to now was 2,900 empty weekly bars (4.6 MB,
    # 15 s), to 8999 millions (never done). They span the ledger's 12 hours, hour by hour, as the
    # page of the ledger's own window does.
    settings = load_config(str(made.config))
    bounds = {name: parse_time(value, 0.0) for name, value in (("since", since), ("until", until)) if value}
    text = html_from_ledgers(
        [made.ledger], settings, by=parse_by(BY), since=bounds["since"], until=bounds.get("until"), runs=False,
        headroom=0.2,
    )  # fmt: skip
    page = read_page(text)
    bars = page.tables["over-time-table"]
    assert len(bars) == HOURS  # 12 hourly bars
    assert (bars[0]["attrs"]["data-start"], bars[-1]["attrs"]["data-start"]) == (
        "2026-11-20T18:00:00Z",
        "2026-11-21T05:00:00Z",
    )
    assert len(text) < 2 * len(made.html)
    assert page.tiles["total_dollars"] == pytest.approx(TOTAL_DOLLARS)  # 4 GPUs x 12 h x $2.5 = $120


def test_the_report_says_which_hours_of_the_window_the_ledger_holds(made: Ledgers) -> None:
    # The window starts at midnight, the ledger at 18:00: its figures are 12 hours', not 30.
    window = ("--ledger", str(made.ledger), "--by", BY, "--since", "2026-11-20")
    as_json = json.loads(gpuledger("report", *window, "--format", "json").stdout)
    assert (as_json["since"], as_json["until"]) == ("2026-11-20T00:00:00Z", "2026-11-21T06:00:00Z")
    assert (as_json["recorded_since"], as_json["recorded_until"]) == ("2026-11-20T18:00:00Z", "2026-11-21T06:00:00Z")
    held = "The ledger holds only 2026-11-20T18:00:00Z to 2026-11-21T06:00:00Z of these hours: the figures cover those."
    assert gpuledger("report", *window).stdout.splitlines()[-1] == held
    page = gpuledger("report", *window, "--format", "html").stdout
    assert held in page
    # 4 GPUs x 12 h = 48 GPU-hours x $2.5 = $120, every hour the ledger holds, not the window's 30.
    assert (
        "= $120.00, the price of 48.00 GPU-hours: every hour of every GPU the ledgers hold from "
        "2026-11-20T18:00:00Z to 2026-11-21T06:00:00Z, once." in page
    )
    # Where the ledger holds the whole window, nothing more is said.
    assert made.json["recorded_since"] == made.json["since"] == "2026-11-20T18:00:00Z"
    assert "The ledger holds" not in gpuledger("report", "--ledger", str(made.ledger)).stdout
    # Bounds inside an hour read it whole, idle time as charged time: 18:30 to 19:30 is the
    # hours of 18:00 and 19:00, 4 GPUs x 2 h = 8 GPU-hours x $2.5 = $20, GPU 3 idle in both
    # (2 GPU-hours x $2.5 = $5), GPU 0 held by the job (still running at 6h) = $5.
    inside = gpuledger(
        "report", "--ledger", str(made.ledger), "--by", BY, "--since", "2026-11-20T18:30", "--until",
        "2026-11-20T19:30", "--format", "json",
    )  # fmt: skip
    hours = json.loads(inside.stdout)
    assert (hours["since"], hours["recorded_until"]) == ("2026-11-20T18:00:00Z", "2026-11-20T20:00:00Z")
    assert hours["total"]["gpu_hours_charged"] == pytest.approx(8.0)
    assert hours["total"]["dollars"] == pytest.approx(20.0)
    assert hours["idle"]["dollars"] == pytest.approx(5.0)
    assert {r["hpc_job"]: r["dollars"] for r in hours["rows"]}["8812"] == pytest.approx(5.0)


def test_labels_are_text_never_markup(made: Ledgers) -> None:
    page = read_page(made.html)
    assert page.scripts == 0
    assert "<script" not in made.html.lower()
    assert "&lt;script&gt;alert(&#x27;$x$&#x27;)&lt;/script&gt;" in made.html
    # Nothing but what the page carries, said to the browser too.
    assert "default-src 'none'" in made.html
    assert page.svgs == 5  # spend over time, idle, waste, efficiency, savings


def test_the_page_is_the_same_page_each_time(made: Ledgers) -> None:
    settings = load_config(str(made.config))
    again = html_from_ledgers(
        [made.ledger], settings, by=parse_by(BY), since=None, until=None, runs=False, headroom=0.2
    )
    assert again == made.html


def test_savings_are_report_recommends(made: Ledgers) -> None:
    advice = gpuledger("report", "--ledger", str(made.ledger), "--recommend", "--format", "json")
    assert advice.returncode == 0, advice.stderr
    expected = {
        json.dumps(w["workload"], sort_keys=True): w["saving_per_month_estimate"]
        for w in json.loads(advice.stdout)["workloads"]
        if w["saving_per_month_estimate"] > 0
    }
    rows = read_page(made.html).tables["savings"]
    assert len(rows) == len(expected) == 2  # the idle notebook and the 40%-busy pod fit a MIG slice
    assert sorted(figures(r)["saving_per_month"] for r in rows) == sorted(expected.values())


def test_an_empty_window_is_a_page_that_says_so(made: Ledgers) -> None:
    out = made.dir / "empty.html"
    done = gpuledger(
        "report", "--ledger", str(made.ledger), "--since", "2027-01-01", "--until", "2027-02-01",
        "--format", "html", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert 'id="empty"' in text
    assert "No GPU time recorded in this window" in text
    assert "ledger hours 2027-01-01T00:00:00Z to 2027-02-01T00:00:00Z" in text
    assert read_page(text).svgs == 0


def test_a_ledger_with_no_charges_is_a_page_that_says_so(made: Ledgers) -> None:
    empty = made.dir / "new.db"
    with Ledger(empty, retention_s=None):
        pass
    done = gpuledger("report", "--ledger", str(empty), "--format", "html")
    assert done.returncode == 0, done.stderr
    assert 'id="empty"' in done.stdout
    assert "no ledger hours recorded" in done.stdout


def test_without_matplotlib_one_line_names_the_extra(made: Ledgers, tmp_path: Path) -> None:
    # A matplotlib that cannot be imported, first on the path.
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('not installed')\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", ""), str(Path(__file__).parent.parent)])
    done = gpuledger("report", "--ledger", str(made.ledger), "--format", "html", env={"PYTHONPATH": path})
    assert done.returncode == 2
    assert done.stderr == (
        "gpuledger: report --format html needs matplotlib: pip install 'gpuledger[html]'\n"
    )  # fmt: skip
    assert done.stdout == ""


def test_out_writes_any_format_to_the_file(made: Ledgers) -> None:
    out = made.dir / "report.csv"
    to_file = gpuledger("report", "--ledger", str(made.ledger), "--format", "csv", "--out", str(out))
    to_stdout = gpuledger("report", "--ledger", str(made.ledger), "--format", "csv")
    assert to_file.returncode == to_stdout.returncode == 0
    assert to_file.stdout == ""
    assert out.read_text() == to_stdout.stdout
    assert to_stdout.stdout.startswith("kind,namespace,hpc_job,dollars")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--recommend",), "--format html holds the right-sizing advice already"),
        (("--out", "/nonexistent-dir/r.html"), "--out"),
    ],
)
def test_bad_html_arguments_are_one_line_exit_2(made: Ledgers, args: tuple[str, ...], message: str) -> None:
    done = gpuledger("report", "--ledger", str(made.ledger), "--format", "html", *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.splitlines()) == 1


# --- in a real browser ------------------------------------------------------------------------------


def chromium() -> str:
    """Debian's chromium (scripts/check installs it). Missing is a failure, not a skip: a skipped
    browser test would let a broken page through unnoticed."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: apt-get install chromium (scripts/check does)")
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium())
        yield launched
        launched.close()


@dataclass
class Visit:
    console: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def test_the_page_renders_in_chromium_without_errors_or_requests(made: Ledgers, browser: Any, tmp_path: Path) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    seen = Visit()
    page.on("console", lambda m: seen.console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: seen.errors.append(str(e)))
    page.on("request", lambda r: seen.requests.append(r.url))
    page.on("requestfailed", lambda r: seen.failed.append(r.url))
    url = made.html_file.resolve().as_uri()
    response = page.goto(url, wait_until="load")
    assert response is not None
    assert response.ok
    assert seen.console == []
    assert seen.errors == []
    assert seen.failed == []
    assert seen.requests == [url]  # the page itself and nothing else: no network at view time

    charts = page.locator("svg.chart")
    assert charts.count() == 5
    for i in range(charts.count()):
        chart = charts.nth(i)
        assert chart.is_visible()
        box = chart.bounding_box()
        assert box is not None
        assert box["width"] > 400
        assert box["height"] > 100
        assert chart.get_attribute("aria-label")
    # The script-named pod is text in the table, and no script ran.
    cell = page.locator("#rows td", has_text="alert(").first
    assert cell.inner_text().replace("\n", "") == EVIL_POD
    assert page.title().startswith("GPU cost by namespace, pod, hpc_job")
    shot = tmp_path / "report.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page.close()


def test_the_empty_page_renders_too(made: Ledgers, browser: Any) -> None:
    empty = made.dir / "empty-browser.html"
    done = gpuledger(
        "report", "--ledger", str(made.ledger), "--since", "2027-01-01", "--until", "2027-01-02",
        "--format", "html", "--out", str(empty),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(empty.resolve().as_uri())
    assert page.locator("#empty").is_visible()
    assert problems == []
    page.close()


# --- spend over time, pure --------------------------------------------------------------------------

FRIDAY = datetime(2026, 11, 20, 18, tzinfo=UTC).timestamp()


def hourly_rows(workload: Workload, dollars_per_hour: float, hours: int) -> list[UsageRow]:
    return [
        UsageRow(int(FRIDAY + h * 3600), "gpu-node-01", 0, "GPU-0", workload, 3600.0, 1800.0, dollars_per_hour, 0.0,
                 charged_s=3600.0)
        for h in range(hours)
    ]  # fmt: skip


def test_bucket_sizes_and_weeks_from_monday() -> None:
    assert bucket_size(FRIDAY, FRIDAY + 4 * 86400) == 3600  # up to 4 days: hours
    assert bucket_size(FRIDAY, FRIDAY + 31 * 86400) == 86400  # a month: days
    assert bucket_size(FRIDAY, FRIDAY + 365 * 86400) == 7 * 86400  # a year: weeks
    week = datetime.fromtimestamp(bucket_start(FRIDAY, 7 * 86400), UTC)
    assert (week.isoformat(), week.strftime("%A")) == ("2026-11-16T00:00:00+00:00", "Monday")
    day = bucket_start(FRIDAY, 86400)
    assert datetime.fromtimestamp(day, UTC).isoformat() == "2026-11-20T00:00:00+00:00"


def test_hours_decades_apart_are_a_bounded_number_of_bars() -> None:
    # A node that wrote an hour with its clock still at 1970 before it synced: two hours 57 years
    # apart were 2,969 weekly bars (a 1 MB page, 5 s). At most MAX_BARS bars, of whole weeks from Monday.
    job = Workload(hpc_job="1", user="alice")
    rows = [hourly_rows(job, 2.5, 1)[0], replace(hourly_rows(job, 2.5, 1)[0], hour=3600)]
    report = build_report(rows, ("hpc_job",))
    timeline = spend_over_time(report, rows)
    assert len(timeline.starts) <= MAX_BARS
    assert timeline.bucket_s % (7 * 86400) == 0
    assert datetime.fromtimestamp(timeline.starts[-1], UTC).strftime("%A") == "Monday"
    assert timeline.starts[0] <= 3600  # the first bar holds 1970's hour, the last 2026's
    assert timeline.starts[-1] + timeline.bucket_s > FRIDAY
    # The bars add up to the report: 2 hours x $2.5 = $5.
    assert math.fsum(dict(timeline.series)["1"]) == pytest.approx(5.0) == report.total.dollars
    bars = read_page(render_html(report, rows, None, generator=GENERATOR)).tables["over-time-table"]
    assert len(bars) == len(timeline.starts)


def test_ten_days_are_daily_bars_that_add_up_to_the_report() -> None:
    a = Workload(hpc_job="1", user="alice")
    b = Workload(hpc_job="2", user="bob")
    rows = hourly_rows(a, 2.5, 240) + hourly_rows(b, 0.5, 24)
    report = build_report(rows, ("hpc_job",))
    timeline = spend_over_time(report, rows, top=1)
    assert timeline.bucket_s == 86400
    # Friday 18:00 for 240 hours: Nov 20 (6 hours) to Nov 30 (18 hours), 11 days.
    assert len(timeline.starts) == 11
    series = dict(timeline.series)
    assert list(series) == ["1", "other (1)", "(idle)", "(unobserved)"]
    # Job 1 at $2.5 an hour: 6 h on the first day ($15), 24 h on each of the 9 between ($60), 18 h on the last ($45).
    assert series["1"] == pytest.approx((15.0, *([60.0] * 9), 45.0))
    assert math.fsum(series["1"]) == pytest.approx(240 * 2.5)  # = the report's line: $600
    # Job 2, drawn as "other": $0.5 an hour for its first 24 hours: $3 on Nov 20, $9 on Nov 21.
    assert series["other (1)"] == pytest.approx((3.0, 9.0, *([0.0] * 9)))
    assert series["(idle)"] == (0.0,) * 11


def dollar_ticks(svg: str) -> list[str]:
    """The dollar tick labels of a chart: matplotlib draws each text as outlines and writes the
    text itself in a comment beside them."""
    return [text for text in re.findall(r"<!-- (.*?) -->", svg) if text.startswith("$")]


def test_dollar_ticks_show_the_cents_of_steps_under_a_dollar() -> None:
    idle = [charts.Series("idle dollars", (2.5, 1.2), charts.IDLE_COLOUR)]
    small = charts.horizontal_bars(["job 1", "job 2"], idle, xlabel="idle dollars", title="idle")
    # Ticks every $0.50 up to $2.50: each shown as it is, not rounded to "$0, $0, $1, $2, $2, $2".
    assert dollar_ticks(small) == ["$0.00", "$0.50", "$1.00", "$1.50", "$2.00", "$2.50"]
    spend = [charts.Series("job 1", (3000.0, 2000.0), charts.PALETTE[0])]
    large = charts.time_bars([FRIDAY, FRIDAY + 3600], 3600, spend, ylabel="dollars per hour", title="spend")
    assert dollar_ticks(large) == ["$0", "$500", "$1,000", "$1,500", "$2,000", "$2,500", "$3,000"]


def test_each_column_of_the_table_and_the_page_adds_up_to_total_to_the_cent() -> None:
    # Three jobs, one GPU-hour each, half of it used. Each rounded alone, the dollars read $1.01 +
    # $2.01 + $3.01 = $6.03 under a TOTAL of $1.007 + $2.006 + $3.009 = $6.022, $6.02; the waste
    # (half of each) $0.50 + $1.00 + $1.50 = $3.00 under $0.5035 + $1.003 + $1.5045 = $3.011, $3.01.
    jobs = [(Workload(hpc_job="1"), 1.007), (Workload(hpc_job="2"), 2.006), (Workload(hpc_job="3"), 3.009)]
    rows = [row for workload, dollars in jobs for row in hourly_rows(workload, dollars, 1)]
    report = build_report(rows, ("hpc_job",))
    # Largest remainder: the dollars' cents 100.7, 200.6, 300.9 floor to 600, two short of 602:
    # the two largest remainders (.9, .7) take one each. The waste's 50.35, 100.3, 150.45 floor to
    # 300, one short of 301: the largest (.45) takes it.
    dollars = {"3": "3.01", "2": "2.00", "1": "1.01", "(idle)": "0.00", "(unobserved)": "0.00", "TOTAL": "6.02"}
    waste = {"3": "1.51", "2": "1.00", "1": "0.50", "(idle)": "0.00", "(unobserved)": "-", "TOTAL": "3.01"}
    table = [line.split() for line in render(report, "table").splitlines()[4:] if line and line[0] != "-"]
    assert {cells[0]: cells[1] for cells in table} == dollars
    assert {cells[0]: cells[5] for cells in table} == waste
    # The page's table shows the same text; its data-value keeps each figure whole.
    page = read_page(render_html(report, rows, None, generator=GENERATOR)).tables["rows"]
    names = [*(json.loads(r["attrs"]["data-key"])["hpc_job"] for r in page[:3]), "(idle)", "(unobserved)", "TOTAL"]
    assert dict(zip(names, (shown(r)["dollars"] for r in page), strict=True)) == dollars
    assert dict(zip(names, (shown(r)["waste_dollars"] for r in page), strict=True)) == waste
    assert figures(page[0])["dollars"] == 3.009


def test_the_tiles_gpu_hours_add_up_to_the_windows_like_their_dollars() -> None:
    # A job charged 0.3355 GPU-hours, the idle GPU 0.3365, 0.328 unobserved: 1.0000 GPU-hours.
    # Each rounded alone they read 0.34 + 0.34 + 0.33 = 1.01 under a total of 1.00. Largest
    # remainder: 33.55, 33.65, 32.8 hundredths floor to 98, two short of 100: the two largest
    # remainders (.8, .65) take them, 0.33 + 0.34 + 0.33 = 1.00.
    where = {"hour": int(FRIDAY), "node": "gpu-node-01", "gpu": 0, "uuid": "GPU-0", "busy_s": 0.0, "joules": 0.0}
    parts = [(Workload(hpc_job="1"), 1207.8, {}), (Workload(), 1211.4, {"idle": True}),
             (Workload(), 1180.8, {"unobserved": True})]  # fmt: skip
    # Each at $2.50/h: seconds / 3600 x $2.50.
    rows = [UsageRow(workload=w, held_s=s, dollars=s / 3600 * 2.5, charged_s=s, **where, **k) for w, s, k in parts]
    page = render_html(build_report(rows, ("hpc_job",)), rows, None, generator=GENERATOR)
    subs = dict(re.findall(r'data-figure="(\w+)"[^>]*>.*?<div class="sub">([\d.]+) GPU-hours</div>', page))
    assert subs == {"total_dollars": "1.00", "workload_dollars": "0.33", "idle_dollars": "0.34",
                    "unobserved_dollars": "0.33"}  # fmt: skip


def test_dollars_whose_use_nothing_measured_are_not_drawn_as_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # An hour at $3.60 per GPU-hour: job 1 on a MIG instance without GPM (weight 42/108: $1.40,
    # its use unknown), job 2 on a whole GPU 40% busy ($3.60: $1.44 used, $2.16 wasted). The
    # waste chart drew job 1's $1.40 as used, as if its waste (unknown) were 0.
    mig_s = 3600 * 42 / 108
    rows = [
        UsageRow(int(FRIDAY), "n", 0, "MIG-1", Workload(hpc_job="1"), mig_s, 0.0, 3.6 * 42 / 108, 0.0,
                 charged_s=mig_s, unmeasured_s=mig_s),
        UsageRow(int(FRIDAY), "n", 1, "GPU-1", Workload(hpc_job="2"), 3600.0, 1440.0, 3.6, 0.0, charged_s=3600.0),
    ]  # fmt: skip
    drawn: dict[str, dict[str, float]] = {}

    def bars(labels: Any, series: Any, **_: Any) -> str:
        for part in series:
            drawn[part.name] = dict(zip(labels, part.values, strict=True))
        return "<svg/>"

    monkeypatch.setattr(charts, "horizontal_bars", bars)
    page._waste_section(build_report(rows, parse_by("hpc_job")))
    assert drawn["used"] == pytest.approx({"2": 1.44, "1": 0.0})  # $3.60 x 0.4
    assert drawn["wasted"] == pytest.approx({"2": 2.16, "1": 0.0})  # $3.60 x 0.6
    assert drawn["use not measured"] == pytest.approx({"2": 0.0, "1": 1.40})  # $3.60 x 42/108
