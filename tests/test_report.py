"""`gpuledger report`: grouping, the (idle) and TOTAL rows, exact totals, the three formats, and
the times people type, over a real ledger file."""

from __future__ import annotations

import csv
import io
import json
import math
import sqlite3
from pathlib import Path

import pytest

from agent.ledger.report import (
    GROUP_KEYS,
    Report,
    ReportLine,
    build_report,
    check_overlaps,
    parse_by,
    parse_time,
    render,
    report_from_ledger,
    report_from_ledgers,
)
from agent.ledger.store import Ledger, LedgerError, LedgerInfo, read_usage
from agent.model import Charges, GpuCharge, Workload, WorkloadCharge
from tests.test_cli import gpuledger

H = 3600.0
T0 = 1_795_802_400.0  # 2026-11-27T18:00:00Z, a Friday evening

VLLM = Workload(namespace="serving", pod="vllm-llama-0", container="vllm", model="llama-3.1-8b", team="inference")
NOTEBOOK = Workload(namespace="research", pod="notebook-7", container="jupyter", user="carol", team="research")
TRAIN = Workload(hpc_job="8812", user="alice", model="llama-3-8b", team="research")

# The weekend: (node, gpu, workload or None for idle, dollars, held hours, busy hours) per hour, for
# hours 0..5 after T0. Dollars with a tenth of a cent in them, so that how they are summed matters.
WEEKEND = [
    ("gpu-node-01", 0, VLLM, 4.101, 1.0, 0.9),
    ("gpu-node-01", 1, TRAIN, 3.333, 1.0, 0.75),
    ("gpu-node-01", 2, NOTEBOOK, 2.5, 1.0, 0.01),
    ("gpu-node-01", 3, None, 2.5, 1.0, 0.0),
    ("gpu-node-02", 0, TRAIN, 3.333, 1.0, 0.5),
    ("gpu-node-02", 1, None, 3.1, 1.0, 0.0),
]
HOURS = 6


@pytest.fixture
def weekend_ledger(tmp_path: Path) -> Path:
    """Six hours of the weekend, written through the ledger the agent uses."""
    path = tmp_path / "ledger.db"
    with Ledger(path, retention_s=None) as ledger:
        for hour in range(HOURS):
            start = T0 + hour * H
            for node in ("gpu-node-01", "gpu-node-02"):
                wcs, gcs = [], []
                for n, gpu, workload, dollars, held_h, busy_h in WEEKEND:
                    if n != node:
                        continue
                    uuid = f"GPU-{node[-2:]}-{gpu}"
                    if workload is None:
                        gcs.append(GpuCharge(gpu, uuid, "A100", dollars, H, dollars, held_h * H, dollars, 0, 0, 0))
                    else:
                        wcs.append(WorkloadCharge(gpu, uuid, workload, held_h * H, busy_h * H, dollars, 0.0))
                        gcs.append(GpuCharge(gpu, uuid, "A100", dollars, H, dollars, 0, 0, 0, 0, 0))
                ledger.add(Charges(start, start + H, node, tuple(wcs), tuple(gcs)))
    return path


def raw(path: Path, sql: str) -> list[float]:
    with sqlite3.connect(path) as conn:
        return [v for (v,) in conn.execute(sql)]


def expected(by: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """Dollars per group, straight from WEEKEND: the specification the report must meet."""
    sums: dict[tuple[str, ...], list[float]] = {}
    for node, gpu, workload, dollars, _, _ in WEEKEND:
        if workload is None:
            continue
        facts = {"node": node, "gpu": str(gpu)} | {k: getattr(workload, k) for k in GROUP_KEYS[2:]}
        sums.setdefault(tuple(facts[k] for k in by), []).extend([dollars] * HOURS)
    return {key: math.fsum(values) for key, values in sums.items()}


@pytest.mark.parametrize("key", GROUP_KEYS)
def test_grouping_by_each_key(weekend_ledger: Path, key: str) -> None:
    report = report_from_ledger(weekend_ledger, by=[key])
    got = {line.key: line.dollars for line in report.lines}
    assert got == pytest.approx(expected((key,)), rel=1e-12)
    assert [line.dollars for line in report.lines] == sorted(got.values(), reverse=True)


def test_grouping_by_two_keys(weekend_ledger: Path) -> None:
    report = report_from_ledger(weekend_ledger, by=["team", "user"])
    assert [line.key for line in report.lines] == [("research", "alice"), ("inference", ""), ("research", "carol")]
    assert {line.key: line.dollars for line in report.lines} == pytest.approx(expected(("team", "user")), rel=1e-12)
    alice = report.lines[0]
    # job 8812 on two GPUs, six hours each: 12 GPU-hours held, 6 x (0.75 + 0.5) used
    assert alice.gpu_hours_held == 12.0
    assert alice.gpu_hours_used == pytest.approx(7.5)
    assert alice.efficiency == pytest.approx(7.5 / 12)


def test_idle_row_carries_unheld_gpus(weekend_ledger: Path) -> None:
    report = report_from_ledger(weekend_ledger, by=["namespace"])
    assert report.idle.dollars == pytest.approx(HOURS * (2.5 + 3.1), rel=1e-12)
    assert report.idle.gpu_hours_held == 2 * HOURS  # two idle GPUs, six hours each
    assert report.idle.gpu_hours_used == 0.0
    assert all(line.key != ("(idle)",) for line in report.lines)


def test_total_is_the_exact_sum_of_workload_and_idle_dollars_in_the_ledger(weekend_ledger: Path) -> None:
    report = report_from_ledger(weekend_ledger, by=["pod"])
    stored = raw(weekend_ledger, "SELECT dollars FROM workload_hours") + raw(
        weekend_ledger, "SELECT idle_dollars FROM gpu_hours"
    )
    assert report.total.dollars == math.fsum(stored)  # exactly: summed once, from the stored figures
    assert report.total.dollars == pytest.approx(sum(line.dollars for line in report.lines) + report.idle.dollars)
    assert report.total.gpu_hours_held == len(WEEKEND) * HOURS  # every GPU-hour paid for
    # and it is the GPUs' whole cost, to rounding
    assert report.total.dollars == pytest.approx(math.fsum(raw(weekend_ledger, "SELECT dollars FROM gpu_hours")))


def test_range_reads_whole_hours_and_says_which(weekend_ledger: Path) -> None:
    # 19:30 to 21:00 touches the 19:00 and 20:00 hours
    report = report_from_ledger(weekend_ledger, by=["node"], since=T0 + 1.5 * H, until=T0 + 3 * H)
    assert (report.since, report.until) == (T0 + H, T0 + 3 * H)
    assert report.total.gpu_hours_held == len(WEEKEND) * 2
    everything = report_from_ledger(weekend_ledger, by=["node"])
    assert (everything.since, everything.until) == (T0, T0 + HOURS * H)  # from the data itself
    with pytest.raises(ValueError, match="must be before"):
        report_from_ledger(weekend_ledger, by=["node"], since=T0 + H, until=T0)


def test_empty_range_is_an_empty_report(weekend_ledger: Path) -> None:
    report = report_from_ledger(weekend_ledger, by=["pod"], since=T0 + 100 * H)
    assert report.lines == ()
    assert report.total == ReportLine((), 0.0, 0.0, 0.0)
    assert "TOTAL" in render(report, "table")


def test_bad_grouping_keys_are_named() -> None:
    with pytest.raises(ValueError, match=r"cannot group by 'pid': use any of node, gpu, namespace"):
        build_report([], ["pid"])
    with pytest.raises(ValueError, match="each grouping key once"):
        parse_by("pod,pod")
    with pytest.raises(ValueError, match="at least one"):
        parse_by(" , ")
    assert parse_by("namespace, pod") == ("namespace", "pod")


def test_by_job_is_by_hpc_job_and_the_default_is_namespace_and_hpc_job(weekend_ledger: Path) -> None:
    def report(*by: str) -> str:
        result = gpuledger("report", "--ledger", str(weekend_ledger), *by, "--format", "json")
        assert result.returncode == 0, result.stderr
        return result.stdout

    by_alias, by_name, by_default = report("--by", "job"), report("--by", "hpc_job"), report()
    assert by_alias == by_name
    assert json.loads(by_alias)["by"] == ["hpc_job"]
    # job 8812 on two GPUs for six hours at $3.333: 12 x 3.333 = $39.996
    assert {r["hpc_job"]: r["dollars"] for r in json.loads(by_name)["rows"]}["8812"] == pytest.approx(39.996)
    assert json.loads(by_default)["by"] == ["namespace", "hpc_job"]
    assert parse_by("namespace,job") == ("namespace", "hpc_job")
    with pytest.raises(ValueError, match="each grouping key once"):
        parse_by("job,hpc_job")  # the alias and its name are one key


def test_missing_ledger_is_a_ledger_error(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="no such file"):
        report_from_ledger(tmp_path / "nope.db", by=["pod"])


# --- rendering ---


def finance_report() -> Report:
    return Report(
        by=("namespace", "pod"),
        lines=(
            ReportLine(("serving", "vllm-llama-0"), 12345.678, 4938.2 * H, 4100.0 * H),
            ReportLine(("", "notebook-7"), 80.5, 32.0 * H, 0.0),
        ),
        idle=ReportLine((), 1500.0, 600.0 * H, 0.0),
        total=ReportLine((), 13926.178, 5570.2 * H, 4100.0 * H),
        since=T0,
        until=T0 + 48 * H,
    )


def test_table_for_a_finance_reader() -> None:
    assert render(finance_report(), "table") == (
        "GPU cost by namespace, pod; ledger hours 2026-11-27T18:00:00Z to 2026-11-29T18:00:00Z\n"
        "\n"
        "NAMESPACE  POD             DOLLARS  GPU-HOURS HELD  GPU-HOURS USED  EFFICIENCY\n"
        "---------  ------------  ---------  --------------  --------------  ----------\n"
        "serving    vllm-llama-0  12,345.68        4,938.20        4,100.00       83.0%\n"
        "(none)     notebook-7        80.50           32.00            0.00        0.0%\n"
        "(idle)                    1,500.00          600.00            0.00           -\n"
        "---------  ------------  ---------  --------------  --------------  ----------\n"
        "TOTAL                    13,926.18        5,570.20        4,100.00       73.6%\n"
    )


def test_efficiency_is_a_dash_when_nothing_was_held() -> None:
    report = Report(("pod",), (ReportLine(("p",), 0.0, 0.0, 0.0),), ReportLine((), 0, 0, 0), ReportLine((), 0, 0, 0))
    line = render(report, "table").splitlines()[4]
    assert line.split() == ["p", "0.00", "0.00", "0.00", "-"]
    assert json.loads(render(report, "json"))["rows"][0]["efficiency_ratio"] is None


def test_csv_reads_back_to_the_same_numbers(weekend_ledger: Path) -> None:
    report = report_from_ledger(weekend_ledger, by=["node", "pod"])
    rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert list(rows[0]) == [
        "kind", "node", "pod", "dollars", "gpu_hours_held", "gpu_hours_used", "efficiency_ratio", "energy_kwh",
        "energy_dollars",
    ]  # fmt: skip
    assert [r["kind"] for r in rows] == ["group"] * len(report.lines) + ["idle", "total"]
    for r, line in zip(rows, [*report.lines, report.idle, report.total], strict=True):
        assert (r["node"], r["pod"]) == (line.key or ("", ""))
        assert float(r["dollars"]) == line.dollars
        assert float(r["gpu_hours_held"]) == line.gpu_hours_held
        assert float(r["gpu_hours_used"]) == line.gpu_hours_used
    assert rows[-2]["efficiency_ratio"] == ""  # nobody held the idle GPUs
    assert float(rows[-1]["efficiency_ratio"]) == report.total.efficiency
    assert "," not in rows[-1]["dollars"]


def test_json_reads_back_to_the_same_numbers(weekend_ledger: Path) -> None:
    report = report_from_ledger(weekend_ledger, by=["team"], since=T0, until=T0 + 2 * H)
    document = json.loads(render(report, "json"))
    assert list(document) == ["since", "until", "by", "rows", "idle", "total"]
    assert (document["since"], document["until"], document["by"]) == (
        "2026-11-27T18:00:00Z",
        "2026-11-27T20:00:00Z",
        ["team"],
    )
    assert [(r["team"], r["dollars"], r["gpu_hours_held"], r["gpu_hours_used"]) for r in document["rows"]] == [
        (line.key[0], line.dollars, line.gpu_hours_held, line.gpu_hours_used) for line in report.lines
    ]
    assert document["idle"]["dollars"] == report.idle.dollars
    assert document["idle"]["efficiency_ratio"] is None
    assert document["total"]["dollars"] == report.total.dollars
    stored = [r.dollars for r in read_usage(weekend_ledger, since=T0, until=T0 + 2 * H)]
    assert document["total"]["dollars"] == math.fsum(stored)


def test_unknown_format_is_named() -> None:
    with pytest.raises(ValueError, match="unknown report format 'xml'"):
        render(finance_report(), "xml")


# --- times ---

NOW = T0 + 30 * 60  # 2026-11-27T18:30:00Z


@pytest.mark.parametrize(
    ("text", "expected_t"),
    [
        ("2026-11-27", T0 - 18 * H),
        ("2026-11-27T18:00", T0),
        ("2026-11-27 18:00:00", T0),
        ("2026-11-27T18:00:00Z", T0),
        ("2026-11-27T20:00:00+02:00", T0),
        ("7d", NOW - 7 * 86400),
        ("36h", NOW - 36 * H),
        ("90m", NOW - 90 * 60),
        ("1d12h", NOW - 36 * H),
        (" now ", NOW),
    ],
)
def test_parse_time(text: str, expected_t: float) -> None:
    assert parse_time(text, NOW) == expected_t


@pytest.mark.parametrize("text", ["yesterday", "", "7x", "-3d", "7", "2026-13-01", "36 h"])
def test_parse_time_rejects_with_one_line_naming_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="expected a time such as") as caught:
        parse_time(text, NOW)
    message = str(caught.value)
    assert repr(text) in message
    assert "\n" not in message


# --- several ledgers ---


def info(
    path: str, node: str, first: float | None, last: float | None, *, rows: tuple[str, ...] = (), ident: str = ""
) -> LedgerInfo:
    """A ledger's record: `rows` the nodes its rows name (default its own), `ident` its id (default its path)."""
    return LedgerInfo(Path(path), ident or path, node, T0, "gpuledger test", first, last, frozenset(rows or (node,)))


def test_check_overlaps_refuses_one_node_twice_and_nothing_else() -> None:
    a = info("a.db", "n1", T0, T0 + 2 * H)
    check_overlaps([a, info("b.db", "n2", T0, T0 + 2 * H)])  # other node
    check_overlaps([a, info("b.db", "n1", T0 + 2 * H, T0 + 3 * H)])  # touching, not overlapping
    check_overlaps([a, info("b.db", "n1", None, None)])  # records nothing
    check_overlaps([a, info("b.db", "", T0, T0 + H, rows=("",))])  # a node nobody named
    with pytest.raises(ValueError, match="both record node n1") as caught:
        check_overlaps([a, info("b.db", "n2", T0 + H, T0 + 5 * H, rows=("n2", "n1"))])  # n1 under an old name
    assert str(caught.value) == (
        "a.db and b.db both record node n1 from 2026-11-27T19:00:00Z to 2026-11-27T20:00:00Z: "
        "reading both would count that time twice"
    )
    with pytest.raises(ValueError, match=r"\(copies of one ledger\)"):
        check_overlaps([a, info("c.db", "n2", T0 - H, T0 + 1, rows=("n1",), ident="a.db")])


def test_two_ledgers_add_up_to_their_sum(weekend_ledger: Path, tmp_path: Path) -> None:
    # The weekend's node-01 hours in one file, node-02's in another: the merge is the whole weekend.
    split = {node: tmp_path / f"{node}.db" for node in ("gpu-node-01", "gpu-node-02")}
    for node, path in split.items():
        with Ledger(path, retention_s=None) as ledger:
            for row in read_usage(weekend_ledger):
                if row.node != node or row.idle:
                    continue
                charge = WorkloadCharge(row.gpu, row.uuid, row.workload, row.held_s, row.busy_s, row.dollars, 0.0)
                gpu = GpuCharge(row.gpu, row.uuid, "A100", 1.0, H, row.dollars, 0, 0, 0, 0, 0)
                ledger.add(Charges(row.hour, row.hour + H, node, (charge,), (gpu,)))
    merged = report_from_ledgers(list(split.values()), by=["node"])
    whole = report_from_ledger(weekend_ledger, by=["node"])
    assert {line.key: line.dollars for line in merged.lines} == {line.key: line.dollars for line in whole.lines}
    assert merged.ledgers == 2
    assert render(merged, "table").splitlines()[0].endswith("from 2 ledgers")
