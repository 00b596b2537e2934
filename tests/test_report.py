"""`gpuledger report`: grouping, the (idle), (unobserved) and TOTAL rows, charged hours that add
up to the window's GPU-hours, exact totals, the three formats, and the times people type, over a
real ledger file."""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import sqlite3
import tempfile
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings

from agent.accounting.cost import account
from agent.ledger.files import LedgerError
from agent.ledger.read import LedgerInfo, UsageRow, read_usage
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
from agent.ledger.store import Ledger
from agent.model import (
    Attribution,
    Charges,
    DeviceReading,
    GpuCharge,
    Holding,
    NodeInfo,
    Price,
    Snapshot,
    Workload,
    WorkloadCharge,
)
from tests.test_accounting import MAX_INTERVAL_S, node_interval
from tests.test_cli import gpuledger

H = 3600.0
T0 = 1_795_802_400.0  # 2026-11-27T18:00:00Z, a Friday evening

VLLM = Workload(namespace="serving", pod="vllm-llama-0", container="vllm", model="llama-3.1-8b", team="inference")
NOTEBOOK = Workload(namespace="research", pod="notebook-7", container="jupyter", user="carol", team="research")
TRAIN = Workload(hpc_job="8812", user="alice", model="llama-3-8b", team="research")

# The weekend: (node, gpu, workload or None for idle, dollars, held hours, busy hours) per hour, for
# hours 0..5 after T0. Dollars with a tenth of a cent in them, so that how they are summed matters.
# Every workload is its GPU's sole holder, so it is charged all the time it held it.
WEEKEND = [
    ("gpu-node-01", 0, VLLM, 4.101, 1.0, 0.9),
    ("gpu-node-01", 1, TRAIN, 3.333, 1.0, 0.75),
    ("gpu-node-01", 2, NOTEBOOK, 2.5, 1.0, 0.01),
    ("gpu-node-01", 3, None, 2.5, 1.0, 0.0),
    ("gpu-node-02", 0, TRAIN, 3.333, 1.0, 0.5),
    ("gpu-node-02", 1, None, 3.1, 1.0, 0.0),
]
HOURS = 6
# The Slurm accounts jobs are billed to (`report --by account`); pods have none.
ACCOUNTS = {TRAIN: "nlp"}


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
                        wcs.append(
                            WorkloadCharge(
                                gpu, uuid, workload, held_h * H, busy_h * H, dollars, 0.0, charged_s=held_h * H,
                                account=ACCOUNTS.get(workload, ""),
                            )
                        )  # fmt: skip
                        gcs.append(GpuCharge(gpu, uuid, "A100", dollars, H, dollars, 0, 0, 0, 0, 0))
                ledger.add(Charges(start, start + H, node, tuple(wcs), tuple(gcs)))
    return path


def raw(path: Path, sql: str) -> list[float]:
    with closing(sqlite3.connect(path)) as conn, conn:
        return [v for (v,) in conn.execute(sql)]


def expected(by: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """Dollars per group, straight from WEEKEND: the specification the report must meet."""
    sums: dict[tuple[str, ...], list[float]] = {}
    for node, gpu, workload, dollars, _, _ in WEEKEND:
        if workload is None:
            continue
        facts = {"node": node, "gpu": str(gpu)} | workload.label_dict() | {"account": ACCOUNTS.get(workload, "")}
        sums.setdefault(tuple(facts[k] for k in by), []).extend([dollars] * HOURS)
    return {key: math.fsum(values) for key, values in sums.items()}


@pytest.mark.parametrize("key", GROUP_KEYS)
def test_grouping_by_each_key(weekend_ledger: Path, key: str) -> None:
    report = report_from_ledger(weekend_ledger, by=[key])
    got = {line.key: line.dollars for line in report.lines}
    # A pod is named within its namespace, a GPU's index within its node: those group by both.
    assert report.by == {"pod": ("namespace", "pod"), "gpu": ("node", "gpu")}.get(key, (key,))
    assert got == pytest.approx(expected(report.by), rel=1e-12)
    assert [line.dollars for line in report.lines] == sorted(got.values(), reverse=True)


def test_a_pod_is_named_within_its_namespace_and_a_gpu_within_its_node(weekend_ledger: Path, tmp_path: Path) -> None:
    # GPU 0 of gpu-node-01 (vllm, $4.101/h) and of gpu-node-02 (job 8812, $3.333/h) were one row "0".
    by_gpu = report_from_ledger(weekend_ledger, by=["gpu"])
    assert by_gpu.by == ("node", "gpu")
    got = {line.key: line.dollars for line in by_gpu.lines if line.key[1] == "0"}
    assert got == {
        ("gpu-node-01", "0"): pytest.approx(6 * 4.101),  # 6 h x $4.101 = $24.606
        ("gpu-node-02", "0"): pytest.approx(6 * 3.333),  # 6 h x $3.333 = $19.998, not $44.604 in one
    }
    assert render(by_gpu, "csv").startswith("kind,node,gpu,dollars,")

    # Two teams each run a pod named train-0, on GPUs 0 and 1 at $2.50/h: team-a's for 2 h, team-b's
    # for 1 h, then GPU 1 sits idle.
    team_a, team_b = Workload(namespace="team-a", pod="train-0"), Workload(namespace="team-b", pod="train-0")
    path = tmp_path / "pods.db"
    with Ledger(path, node="gpu-node-01", retention_s=None) as ledger:
        for hour, holder in ((0, team_b), (1, None)):
            start = T0 + hour * H
            wcs = [WorkloadCharge(0, "GPU-0", team_a, H, H / 2, 2.5, 0.0, charged_s=H)]
            gcs = [GpuCharge(0, "GPU-0", "A100", 2.5, H, 2.5, 0, 0, 0, 0, 0)]
            if holder is None:
                gcs.append(GpuCharge(1, "GPU-1", "A100", 2.5, H, 2.5, H, 2.5, 0, 0, 0))
            else:
                wcs.append(WorkloadCharge(1, "GPU-1", holder, H, H / 4, 2.5, 0.0, charged_s=H))
                gcs.append(GpuCharge(1, "GPU-1", "A100", 2.5, H, 2.5, 0, 0, 0, 0, 0))
            ledger.add(Charges(start, start + H, "gpu-node-01", tuple(wcs), tuple(gcs)))
    pods = report_from_ledgers([path], by=["pod"], runs=True)
    assert pods.by == ("namespace", "pod")
    lines = {line.key: line for line in pods.lines}
    assert list(lines) == [("team-a", "train-0"), ("team-b", "train-0")]  # two pods, two runs, not one
    assert lines["team-a", "train-0"].dollars == pytest.approx(5.0)  # 2 h x $2.50
    assert lines["team-b", "train-0"].dollars == pytest.approx(2.5)  # 1 h x $2.50
    assert (lines["team-b", "train-0"].first_hour, lines["team-b", "train-0"].last_hour) == (T0, T0)
    # Conservation: $5.00 + $2.50 + idle $2.50 = 2 GPUs x 2 h x $2.50 = $10.00.
    assert pods.idle.dollars == pytest.approx(2.5)
    assert pods.total.dollars == pytest.approx(10.0)
    assert render(pods, "csv").startswith("kind,namespace,pod,first_hour,last_hour,gpus,dollars,")


def test_grouping_by_two_keys(weekend_ledger: Path) -> None:
    report = report_from_ledger(weekend_ledger, by=["team", "user"])
    assert [line.key for line in report.lines] == [("research", "alice"), ("inference", ""), ("research", "carol")]
    assert {line.key: line.dollars for line in report.lines} == pytest.approx(expected(("team", "user")), rel=1e-12)
    alice = report.lines[0]
    # job 8812 on two GPUs, six hours each, the sole holder of both: 2 x 6 x 1.0 = 12 GPU-hours
    # charged, 6 x (0.75 + 0.5) used
    assert alice.gpu_hours_charged == 12.0
    assert alice.gpu_hours_used == pytest.approx(7.5)
    assert alice.efficiency == pytest.approx(7.5 / 12)
    # Waste, hour by hour: $3.333 x (1 - 0.75) on node-01 and $3.333 x (1 - 0.5) on node-02, six
    # hours each: 6 x (0.83325 + 1.6665) = $14.9985
    assert alice.waste_dollars == pytest.approx(14.9985, rel=1e-12)


def test_idle_row_carries_unheld_gpus(weekend_ledger: Path) -> None:
    report = report_from_ledger(weekend_ledger, by=["namespace"])
    assert report.idle.dollars == pytest.approx(HOURS * (2.5 + 3.1), rel=1e-12)
    assert report.idle.gpu_hours_charged == 2 * HOURS  # two idle GPUs, six hours each: 12 idle GPU-hours
    assert report.idle.gpu_hours_used == 0.0
    assert report.idle.waste_dollars == report.idle.dollars  # paid for, used by nobody
    assert all(line.key != ("(idle)",) for line in report.lines)


def test_total_is_the_exact_sum_of_workload_and_idle_dollars_in_the_ledger(weekend_ledger: Path) -> None:
    report = report_from_ledger(weekend_ledger, by=["pod"])
    stored = raw(weekend_ledger, "SELECT dollars FROM workload_hours") + raw(
        weekend_ledger, "SELECT idle_dollars FROM gpu_hours"
    )
    assert report.total.dollars == math.fsum(stored)  # exactly: summed once, from the stored figures
    assert report.total.dollars == pytest.approx(sum(line.dollars for line in report.lines) + report.idle.dollars)
    # Every GPU-hour paid for, once: 6 GPUs x 6 hours = 36, each workload sole holder of its GPU.
    assert report.total.gpu_hours_charged == len(WEEKEND) * HOURS
    assert report.unobserved == ReportLine((), 0.0, 0.0, 0.0, observed=False)  # every second was observed
    # and it is the GPUs' whole cost, to rounding
    assert report.total.dollars == pytest.approx(math.fsum(raw(weekend_ledger, "SELECT dollars FROM gpu_hours")))


def test_range_reads_whole_hours_and_says_which(weekend_ledger: Path) -> None:
    # 19:30 to 21:00 touches the 19:00 and 20:00 hours
    report = report_from_ledger(weekend_ledger, by=["node"], since=T0 + 1.5 * H, until=T0 + 3 * H)
    assert (report.since, report.until) == (T0 + H, T0 + 3 * H)
    assert report.total.gpu_hours_charged == len(WEEKEND) * 2  # 6 GPUs x the 2 hours read
    everything = report_from_ledger(weekend_ledger, by=["node"])
    assert (everything.since, everything.until) == (T0, T0 + HOURS * H)  # from the data itself
    with pytest.raises(ValueError, match="must be before"):
        report_from_ledger(weekend_ledger, by=["node"], since=T0 + H, until=T0)


def test_empty_range_is_an_empty_report(weekend_ledger: Path) -> None:
    report = report_from_ledger(weekend_ledger, by=["pod"], since=T0 + 100 * H)
    assert report.lines == ()
    assert report.total == ReportLine((), 0.0, 0.0, 0.0, waste_dollars=0.0)
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


# vllm-llama-0 wasted $12,345.678 x (1 - 4,100 / 4,938.2) = $12,345.678 x 838.2 / 4,938.2 = $2,095.53
VLLM_WASTE = 12345.678 * 838.2 / 4938.2


def finance_report() -> Report:
    return Report(
        by=("namespace", "pod"),
        lines=(
            ReportLine(("serving", "vllm-llama-0"), 12345.678, 4938.2 * H, 4100.0 * H, waste_dollars=VLLM_WASTE),
            ReportLine(("", "notebook-7"), 80.5, 32.0 * H, 0.0, waste_dollars=80.5),  # used nothing: all waste
        ),
        idle=ReportLine((), 1500.0, 600.0 * H, 0.0, waste_dollars=1500.0),
        # 24 GPU-hours nobody saw, at $2.50: $60
        unobserved=ReportLine((), 60.0, 24.0 * H, 0.0, observed=False),
        # $12,345.678 + $80.50 + $1,500 + $60 = $13,986.178; 4,938.2 + 32 + 600 + 24 = 5,594.2 GPU-hours;
        # waste $2,095.53 + $80.50 + $1,500 = $3,676.03; efficiency 4,100 / 5,594.2 = 73.3%
        total=ReportLine((), 13986.178, 5594.2 * H, 4100.0 * H, waste_dollars=VLLM_WASTE + 80.5 + 1500.0),
        since=T0,
        until=T0 + 48 * H,
        recorded_since=T0,  # the ledgers hold the whole window
        recorded_until=T0 + 48 * H,
    )


def test_table_for_a_finance_reader() -> None:
    assert render(finance_report(), "table") == (
        "GPU cost by namespace, pod; ledger hours 2026-11-27T18:00:00Z to 2026-11-29T18:00:00Z\n"
        "\n"
        "NAMESPACE     POD             DOLLARS  GPU-HOURS CHARGED  GPU-HOURS USED  EFFICIENCY   WASTE $\n"
        "------------  ------------  ---------  -----------------  --------------  ----------  --------\n"
        "serving       vllm-llama-0  12,345.68           4,938.20        4,100.00       83.0%  2,095.53\n"
        "(none)        notebook-7        80.50              32.00            0.00        0.0%     80.50\n"
        "(idle)                       1,500.00             600.00            0.00           -  1,500.00\n"
        "(unobserved)                    60.00              24.00               -           -         -\n"
        "------------  ------------  ---------  -----------------  --------------  ----------  --------\n"
        "TOTAL                       13,986.18           5,594.20        4,100.00       73.3%  3,676.03\n"
    )


def test_the_table_escapes_the_names_ledgers_and_stores_hold() -> None:
    # A node's name is recorded as given (workload labels are escaped when attributed), and a
    # ledger or a store may have been written anywhere: "\x1b[2J" in one cleared the terminal.
    lines = (
        ReportLine(("gpu\x1b[2J01",), 2.5, H, H, waste_dollars=0.0),
        ReportLine(("gpu-02",), 2.5, H, 0.0, waste_dollars=2.5),  # used nothing: all waste
    )
    left = Workload(namespace="ns", pod="p\x1b]0;x\x07")
    idle = ReportLine((), 5.0, 2 * H, 0.0, waste_dollars=5.0, left_by=left)
    # $2.50 + $2.50 + $5.00 idle = $10.00 over 1 + 1 + 2 = 4 GPU-hours; waste $2.50 + $5.00 = $7.50
    total = ReportLine((), 10.0, 4 * H, H, waste_dollars=7.5)
    table = render(Report(("node",), lines, idle, total, idle_by=(idle,)), "table")
    assert "\x1b" not in table
    assert "\x07" not in table
    rows = table.splitlines()
    assert rows[4].split() == ["gpu\\x1b[2J01", "2.50", "1.00", "1.00", "100.0%", "0.00"]
    assert rows[6].startswith("(idle) left by ns/p\\x1b]0;x\\x07  ")
    assert rows[9].split() == ["TOTAL", "10.00", "4.00", "1.00", "25.0%", "7.50"]
    # The widths are the escaped text's: every row ends in the same column.
    assert len({len(row) for row in rows[2:]}) == 1


def test_efficiency_is_a_dash_when_nothing_was_charged() -> None:
    report = Report(("pod",), (ReportLine(("p",), 0.0, 0.0, 0.0),), ReportLine((), 0, 0, 0), ReportLine((), 0, 0, 0))
    line = render(report, "table").splitlines()[4]
    assert line.split() == ["p", "0.00", "0.00", "0.00", "-", "-"]  # and no waste given
    assert json.loads(render(report, "json"))["rows"][0]["efficiency_ratio"] is None


def test_csv_labels_never_become_spreadsheet_formulas() -> None:
    # Any user on a node names a model (--model) or a self-reported Slurm job (SLURM_JOB_ID): a cell
    # starting with = + - @ is a live formula in Excel, quoted or not, so it starts with a '.
    names = ['=HYPERLINK("http://evil.example/","x")', "+cmd|calc", "-2+3", "@SUM(1)", "llama-3-8b"]
    lines = tuple(ReportLine((name,), 1.0, H, H) for name in names)
    report = Report(("model",), lines, ReportLine((), 0, 0, 0), ReportLine((), 5.0, 5 * H, 5 * H))
    rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert [r["model"] for r in rows[:5]] == [
        '\'=HYPERLINK("http://evil.example/","x")',
        "'+cmd|calc",
        "'-2+3",
        "'@SUM(1)",
        "llama-3-8b",
    ]
    assert rows[0]["dollars"] == "1.0"  # figures are numbers, never prefixed
    assert [r["model"] for r in json.loads(render(report, "json"))["rows"]] == names  # JSON: as they are


def test_csv_reads_back_to_the_same_numbers(weekend_ledger: Path) -> None:
    report = report_from_ledger(weekend_ledger, by=["node", "pod"])
    rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert list(rows[0]) == [
        "kind", "node", "namespace", "pod", "dollars", "gpu_hours_charged", "gpu_hours_used", "efficiency_ratio",
        "waste_dollars", "energy_kwh", "energy_dollars", "left_by",
    ]  # fmt: skip
    assert [r["kind"] for r in rows] == ["group"] * len(report.lines) + ["idle", "unobserved", "total"]
    for r, line in zip(rows, [*report.lines, report.idle, report.unobserved, report.total], strict=True):
        assert (r["node"], r["namespace"], r["pod"]) == (line.key or ("", "", ""))
        assert float(r["dollars"]) == line.dollars
        assert float(r["gpu_hours_charged"]) == line.gpu_hours_charged
        if line.observed:
            assert float(r["gpu_hours_used"]) == line.gpu_hours_used
            assert float(r["waste_dollars"]) == line.waste_dollars
    assert rows[-3]["efficiency_ratio"] == ""  # nobody held the idle GPUs
    assert rows[-3]["left_by"] == "{}"  # hours written without saying who left the GPUs idle: nobody known
    # nobody saw the unobserved time: how much of it was used is unknown, not 0
    assert (rows[-2]["gpu_hours_used"], rows[-2]["efficiency_ratio"], rows[-2]["waste_dollars"]) == ("", "", "")
    assert float(rows[-1]["efficiency_ratio"]) == report.total.efficiency
    assert "," not in rows[-1]["dollars"]


def test_json_reads_back_to_the_same_numbers(weekend_ledger: Path) -> None:
    report = report_from_ledger(weekend_ledger, by=["team"], since=T0, until=T0 + 2 * H)
    document = json.loads(render(report, "json"))
    assert list(document) == [
        "since", "until", "recorded_since", "recorded_until", "by", "rows", "idle", "unobserved", "total",
    ]  # fmt: skip
    assert (document["since"], document["until"], document["by"]) == (
        "2026-11-27T18:00:00Z",
        "2026-11-27T20:00:00Z",
        ["team"],
    )
    assert [
        (r["team"], r["dollars"], r["gpu_hours_charged"], r["gpu_hours_used"], r["waste_dollars"])
        for r in document["rows"]
    ] == [
        (line.key[0], line.dollars, line.gpu_hours_charged, line.gpu_hours_used, line.waste_dollars)
        for line in report.lines
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
                charge = WorkloadCharge(
                    row.gpu, row.uuid, row.workload, row.held_s, row.busy_s, row.dollars, 0.0, charged_s=row.charged_s
                )
                gpu = GpuCharge(row.gpu, row.uuid, "A100", 1.0, H, row.dollars, 0, 0, 0, 0, 0)
                ledger.add(Charges(row.hour, row.hour + H, node, (charge,), (gpu,)))
    merged = report_from_ledgers(list(split.values()), by=["node"])
    whole = report_from_ledger(weekend_ledger, by=["node"])
    assert {line.key: line.dollars for line in merged.lines} == {line.key: line.dollars for line in whole.lines}
    assert merged.ledgers == 2
    assert render(merged, "table").splitlines()[0].endswith("from 2 ledgers")


# --- a shared GPU, charged once: hours that add up ------------------------------------------------

ANN = Workload(hpc_job="101", user="ann")
BOB = Workload(hpc_job="102", user="bob")
CAROL = Workload(hpc_job="103", user="carol")


@pytest.fixture
def shared_gpu_ledger(tmp_path: Path) -> Path:
    """One hour, T0 to T0 + 1 h, of three GPUs at $3.60/h ($0.001 a second), accounted by the
    agent's own `account()` over two half-hour intervals and written to a ledger:

      GPU 0  shared all hour by ann at 60% SM and bob at 20%; its counter reads 1.8 MJ (0.5 kWh)
      GPU 1  held by nobody; 720 kJ (0.2 kWh)
      GPU 2  carol at 50% for the first half hour (540 kJ, 0.15 kWh), then lost (GPU_IS_LOST):
             the second half hour nobody could see
    Energy at $0.20/kWh.
    """
    node = NodeInfo("gpu-node-01")

    def gpu(index: int, energy_j: float | None, *, up: bool = True) -> DeviceReading:
        return DeviceReading(
            index=index,
            uuid=f"GPU-{index}",
            name="NVIDIA A100-SXM4-80GB",
            up=up,
            down_reason=None if up else "GPU_IS_LOST",
            energy_j=energy_j,
        )

    polls = [
        Snapshot(T0, node, (gpu(0, 0.0), gpu(1, 0.0), gpu(2, 0.0))),
        Snapshot(T0 + H / 2, node, (gpu(0, 900_000.0), gpu(1, 360_000.0), gpu(2, 540_000.0))),
        Snapshot(T0 + H, node, (gpu(0, 1_800_000.0), gpu(1, 720_000.0), gpu(2, None, up=False))),
    ]
    holders = Attribution(
        holdings=(
            Holding("GPU-0", ANN, sm_util=0.6),
            Holding("GPU-0", BOB, sm_util=0.2),
            Holding("GPU-2", CAROL, sm_util=0.5),
        )
    )
    prices = {f"GPU-{i}": Price(3.6, "test") for i in range(3)}
    path = tmp_path / "shared.db"
    with Ledger(path, node=node.hostname, retention_s=None) as ledger:
        for prev, curr in itertools.pairwise(polls):
            ledger.add(account(prev, curr, holders, prices, max_interval_s=H, energy_per_kwh=0.20))
    return path


def test_a_shared_gpu_is_one_gpu_hour_by_gpu(shared_gpu_ledger: Path) -> None:
    report = report_from_ledger(shared_gpu_ledger, by=["gpu"])
    lines = {line.key: line for line in report.lines}
    assert list(lines) == [("gpu-node-01", "0"), ("gpu-node-01", "2")]  # dollars descending; GPU 1 is the idle row
    shared = lines[("gpu-node-01", "0")]
    # Two workloads held GPU 0 for the hour; it is one GPU-hour, not two.
    assert shared.gpu_hours_charged == pytest.approx(1.0, rel=1e-12)
    assert shared.dollars == pytest.approx(3.60, rel=1e-12)  # an hour at $3.60
    assert shared.gpu_hours_used == pytest.approx(0.8, rel=1e-12)  # 60% + 20% of the hour
    assert shared.efficiency == pytest.approx(0.8, rel=1e-12)
    # Waste: $3.60 x (1 - 0.8 / 1.0) = $0.72 (ann's $0.54 and bob's $0.18 below)
    assert shared.waste_dollars == pytest.approx(0.72, rel=1e-12)
    carol = lines[("gpu-node-01", "2")]
    # Carol's half hour: $1.80, 0.5 GPU-hours charged, 0.25 used (50%), waste $1.80 x 0.5 = $0.90
    assert (carol.dollars, carol.gpu_hours_charged) == (pytest.approx(1.80), pytest.approx(0.5))
    assert (carol.gpu_hours_used, carol.efficiency) == (pytest.approx(0.25), pytest.approx(0.5))
    assert carol.waste_dollars == pytest.approx(0.90, rel=1e-12)


def test_shared_gpu_workloads_are_charged_their_shares(shared_gpu_ledger: Path) -> None:
    report = report_from_ledger(shared_gpu_ledger, by=["user"])
    lines = {line.key[0]: line for line in report.lines}
    ann, bob = lines["ann"], lines["bob"]
    # Split 60:20 by SM use: ann 60/80 = 0.75 of the hour, bob 20/80 = 0.25; dollars likewise,
    # $3.60 x 0.75 = $2.70 and $3.60 x 0.25 = $0.90.
    assert (ann.gpu_hours_charged, bob.gpu_hours_charged) == (pytest.approx(0.75), pytest.approx(0.25))
    assert (ann.dollars, bob.dollars) == (pytest.approx(2.70), pytest.approx(0.90))
    assert (ann.gpu_hours_used, bob.gpu_hours_used) == (pytest.approx(0.6), pytest.approx(0.2))
    # Efficiency used / charged: ann 0.6 / 0.75 = 80%, bob 0.2 / 0.25 = 80% (used / held would say
    # 60% and 20%: each held the whole GPU, but neither could have used more than its share).
    assert (ann.efficiency, bob.efficiency) == (pytest.approx(0.8, rel=1e-12), pytest.approx(0.8, rel=1e-12))
    # Waste: ann $2.70 x (1 - 0.8) = $0.54, bob $0.90 x (1 - 0.8) = $0.18.
    assert (ann.waste_dollars, bob.waste_dollars) == (pytest.approx(0.54, rel=1e-12), pytest.approx(0.18, rel=1e-12))
    # Energy is split like cost: 0.5 kWh x 0.75 = 0.375 kWh ($0.075), x 0.25 = 0.125 kWh ($0.025).
    assert (ann.energy_kwh, bob.energy_kwh) == (pytest.approx(0.375), pytest.approx(0.125))
    assert (ann.energy_dollars, bob.energy_dollars) == (pytest.approx(0.075), pytest.approx(0.025))


@pytest.mark.parametrize("by", [["gpu"], ["user"], ["node", "hpc_job"]])
def test_total_is_gpus_times_hours_whatever_the_grouping(shared_gpu_ledger: Path, by: list[str]) -> None:
    report = report_from_ledger(shared_gpu_ledger, by=by)
    total = report.total
    # 3 GPUs x 1 hour = 3 GPU-hours; at $3.60 each, $10.80: charged 1.00 (GPU 0) + 0.50 (carol)
    # + 1.00 idle (GPU 1) + 0.50 unobserved (GPU 2 lost).
    assert (report.since, report.until) == (T0, T0 + H)
    assert total.gpu_hours_charged == pytest.approx(3 * 1.0, rel=1e-12)
    assert total.dollars == pytest.approx(3 * 3.60, rel=1e-12)
    parts = [*report.lines, report.idle, report.unobserved]
    assert total.charged_s == pytest.approx(math.fsum(line.charged_s for line in parts), rel=1e-12)
    assert total.dollars == pytest.approx(math.fsum(line.dollars for line in parts), rel=1e-12)
    # Used 0.8 + 0.25 = 1.05 of 3 GPU-hours: 35%. Waste $0.72 + $0.90 + the idle $3.60 = $5.22.
    assert total.gpu_hours_used == pytest.approx(1.05, rel=1e-12)
    assert total.efficiency == pytest.approx(0.35, rel=1e-12)
    assert total.waste_dollars == pytest.approx(5.22, rel=1e-12)
    # Energy: 0.5 + 0.2 + 0.15 = 0.85 kWh x $0.20 = $0.17 (nothing read while GPU 2 was lost).
    assert (total.energy_kwh, total.energy_dollars) == (pytest.approx(0.85), pytest.approx(0.17))


def test_the_unobserved_row_carries_time_nobody_saw(shared_gpu_ledger: Path) -> None:
    report = report_from_ledger(shared_gpu_ledger, by=["gpu"])
    # GPU 2's second half hour: 0.5 GPU-hours at $3.60/h = $1.80, charged to no workload and not idle.
    assert report.unobserved.gpu_hours_charged == pytest.approx(0.5, rel=1e-12)
    assert report.unobserved.dollars == pytest.approx(1.80, rel=1e-12)
    assert (report.unobserved.efficiency, report.unobserved.waste_dollars) == (None, None)
    assert report.idle.gpu_hours_charged == pytest.approx(1.0, rel=1e-12)  # GPU 1 only
    document = json.loads(render(report, "json"))
    assert document["unobserved"] == {
        "dollars": report.unobserved.dollars,
        "gpu_hours_charged": report.unobserved.gpu_hours_charged,
        "gpu_hours_used": None,  # unknown, not 0
        "efficiency_ratio": None,
        "waste_dollars": None,
        "energy_kwh": None,
        "energy_dollars": None,
    }


def test_report_by_gpu_table_for_a_shared_gpu(shared_gpu_ledger: Path) -> None:
    result = gpuledger("report", "--ledger", str(shared_gpu_ledger), "--by", "gpu")
    assert result.returncode == 0, result.stderr
    # The figures of the tests above, to the cent; TOTAL's 3.00 GPU-hours are 3 GPUs x 1 hour.
    assert result.stdout == (
        "GPU cost by node, gpu; ledger hours 2026-11-27T18:00:00Z to 2026-11-27T19:00:00Z\n"
        "\n"
        "NODE          GPU  DOLLARS  GPU-HOURS CHARGED  GPU-HOURS USED  EFFICIENCY  WASTE $  ENERGY KWH  ENERGY $\n"
        "------------  ---  -------  -----------------  --------------  ----------  -------  ----------  --------\n"
        "gpu-node-01   0       3.60               1.00            0.80       80.0%     0.72        0.50      0.10\n"
        "gpu-node-01   2       1.80               0.50            0.25       50.0%     0.90        0.15      0.03\n"
        "(idle)                3.60               1.00            0.00           -     3.60        0.20      0.04\n"
        "(unobserved)          1.80               0.50               -           -        -           -         -\n"
        "------------  ---  -------  -----------------  --------------  ----------  -------  ----------  --------\n"
        "TOTAL                10.80               3.00            1.05       35.0%     5.22        0.85      0.17\n"
    )


def test_a_gpu_swapped_within_an_hour_keeps_the_energy_nobody_carried(tmp_path: Path) -> None:
    # GPU 0 was GPU-a for the first half hour, ann's: its counter read 900 kJ, all hers. A reboot
    # put GPU-b at index 0, whose first half hour nobody could see the holders of: its 360 kJ are
    # nobody's. Set against both GPUs' rows by index, GPU-b's 360 kJ less ann's 900 kJ was below
    # 0, and TOTAL missed them.
    path = tmp_path / "swap.db"
    with Ledger(path, node="gpu-node-01", retention_s=None) as ledger:
        half = H / 2
        # Half an hour at $3.60/h: $1.80.
        ann = WorkloadCharge(0, "GPU-a", ANN, half, half, 1.80, 900_000.0, charged_s=half)
        held = GpuCharge(0, "GPU-a", "A100", 3.6, half, 1.80, 0.0, 0.0, 0.0, 900_000.0, 0.0)
        ledger.add(Charges(T0, T0 + half, "gpu-node-01", (ann,), (held,)))
        unseen = GpuCharge(0, "GPU-b", "A100", 3.6, 0.0, 0.0, 0.0, 0.0, half, 360_000.0, 0.0, unobserved_dollars=1.80)
        ledger.add(Charges(T0 + half, T0 + H, "gpu-node-01", (), (unseen,)))
    report = report_from_ledger(path, by=["user"])
    # 900 kJ = 0.25 kWh ann's; 360 kJ = 0.1 kWh nobody's; 1.26 MJ = 0.35 kWh, what the counters counted.
    assert [(line.key, line.energy_kwh) for line in report.lines] == [(("ann",), pytest.approx(0.25))]
    assert report.unobserved.energy_kwh == pytest.approx(0.1)
    assert report.total.energy_kwh == pytest.approx(0.35)
    # $1.80 + $1.80 = $3.60: the hour of index 0 at $3.60/h.
    assert report.total.dollars == pytest.approx(3.60)


@settings(max_examples=40, deadline=None)
@given(node_interval())
def test_charged_gpu_hours_add_up_to_gpus_times_the_interval(case: Any) -> None:
    """On random nodes (whole and MIG GPUs, shared units, GPUs down, intervals too long to
    charge), through accounting, the ledger and the report: the rows' charged seconds add up to
    every GPU's wall time, never more, whatever the grouping."""
    prev, curr, attribution, prices = case
    charges = account(prev, curr, attribution, prices, max_interval_s=MAX_INTERVAL_S)
    dt = curr.taken_at - prev.taken_at
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.db"
        with Ledger(path, retention_s=None) as ledger:
            ledger.add(charges)
        for by in (["gpu"], ["user", "hpc_job"]):
            report = report_from_ledger(path, by=by)
            total = report.total
            gpus = len(curr.gpus)
            assert total.charged_s == pytest.approx(gpus * dt, rel=1e-9, abs=1e-9)
            assert report.since is not None
            assert report.until is not None
            assert total.charged_s <= gpus * (report.until - report.since) * (1 + 1e-12)
            parts = [*report.lines, report.idle, report.unobserved]
            assert math.fsum(line.charged_s for line in parts) == pytest.approx(total.charged_s, rel=1e-12, abs=1e-9)
            for line in report.lines:
                # Efficiency can pass 1 here: the strategy's per-process readings may add up to
                # more than the GPU (two at 100%), which accounting does not yet cap; waste never
                # goes below 0 for it.
                assert line.efficiency is None or line.efficiency >= 0.0
                assert line.unmeasured_s <= line.charged_s * (1 + 1e-12)
                if line.waste_dollars is None:
                    # Unknown only where nothing measured its use (a unit without a busy figure).
                    assert line.efficiency is None
                    assert line.unmeasured_s > 0
                else:
                    assert line.waste_dollars >= 0.0


# --- use nothing measured is unknown, not idle --------------------------------------------------


def test_mig_instances_without_a_busy_figure_have_unknown_efficiency_and_waste(tmp_path: Path) -> None:
    """The `mig` scenario for 2 h at $3.60 per GPU-hour: GPU 0, an A100 (108 SMs, no GPM) cut into
    two 3g.40gb instances (42 SMs each) whose use nothing measures, one busy at 70%; GPU 1 whole,
    40% busy by NVML."""
    path = tmp_path / "mig.db"
    env = {"GPULEDGER_PRICING__GPU_HOURLY": "3.6"}
    simulated = gpuledger("simulate", "mig", "--for", "2h", "--ledger", str(path), env=env)
    assert simulated.returncode == 0, simulated.stderr
    result = gpuledger("report", "--ledger", str(path), "--by", "gpu", "--format", "json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    rows = {row["gpu"]: row for row in document["rows"]}
    # GPU 0's instances: 2 h x 84/108 of the GPU = 1.5556 GPU-hours, x $3.60 = $5.60. Their use is
    # unknown, not 0: no used GPU-hours, efficiency or waste.
    assert rows["0"]["dollars"] == pytest.approx(2 * 3.6 * 84 / 108, rel=1e-9)
    assert rows["0"]["gpu_hours_charged"] == pytest.approx(2 * 84 / 108, rel=1e-9)
    assert (rows["0"]["gpu_hours_used"], rows["0"]["efficiency_ratio"], rows["0"]["waste_dollars"]) == (None,) * 3
    # GPU 1: 2 h x $3.60 = $7.20, 40% busy: 0.8 GPU-hours used, waste $7.20 x 0.6 = $4.32.
    assert rows["1"]["dollars"] == pytest.approx(7.2, rel=1e-9)
    assert rows["1"]["efficiency_ratio"] == pytest.approx(0.4, rel=1e-9)
    assert rows["1"]["waste_dollars"] == pytest.approx(4.32, rel=1e-9)
    # The 24 SMs no instance has are idle: 2 h x 24/108 x $3.60 = $1.60, all waste.
    assert document["idle"]["dollars"] == pytest.approx(1.6, rel=1e-9)
    total = document["total"]
    # Conservation: $5.60 + $7.20 + $1.60 = 2 GPUs x 2 h x $3.60 = $14.40.
    assert total["dollars"] == pytest.approx(14.4, rel=1e-9)
    assert total["gpu_hours_charged"] == pytest.approx(4.0, rel=1e-9)
    # Efficiency over the measured 4 - 1.5556 GPU-hours: 0.8 / 2.4444; waste $4.32 + $1.60.
    assert total["efficiency_ratio"] == pytest.approx(0.8 / (4 - 2 * 84 / 108), rel=1e-9)
    assert total["waste_dollars"] == pytest.approx(4.32 + 1.6, rel=1e-9)
    table = gpuledger("report", "--ledger", str(path), "--by", "gpu").stdout
    gpu0 = next(line.split() for line in table.splitlines() if line.split()[1:2] == ["0"])
    assert gpu0[2:7] == ["5.60", "1.56", "-", "-", "-"]


def test_a_partly_measured_row_is_efficient_over_its_measured_part() -> None:
    # An hour at $3.60, 1800 s of it without a busy figure, 900 s busy in the other 1800 s.
    row = UsageRow(int(T0), "n", 0, "GPU-0", TRAIN, 3600.0, 900.0, 3.6, 0.0, charged_s=3600.0, unmeasured_s=1800.0)
    line = build_report([row], ["hpc_job"]).lines[0]
    assert line.efficiency == 0.5  # 900 / 1800 measured, not 900 / 3600
    assert line.gpu_hours_used == 0.25
    assert line.waste_dollars == pytest.approx(0.9, rel=1e-12)  # the measured half's $1.80 x (1 - 0.5)
