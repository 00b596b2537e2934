"""`gpuledger export`: the ledger's rows as CSV and Parquet in the documented schema, whose exports
of several nodes concatenate into one table that adds up to the report of all of them."""

from __future__ import annotations

import csv
import io
import math
import os
import stat
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli.reportpage import write_output
from agent.cli.wiring import build_agent
from agent.config import Settings
from agent.ledger.export import COLUMNS, read_records, records, write, write_csv
from agent.ledger.read import UsageRow
from agent.ledger.report import report_from_ledgers
from agent.ledger.store import Ledger
from agent.model import Charges, GpuCharge, Workload, WorkloadCharge
from agent.pipeline import run_on_scenario_time
from tests.test_cli import gpuledger

# One worker runs this module, so the two nodes' ledgers, a module fixture, are built once rather than once
# per xdist worker (pyproject: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("export")

pa = pytest.importorskip("pyarrow", reason="pyarrow (gpuledger[parquet]) is not installed")
pq = pytest.importorskip("pyarrow.parquet")

SCENARIOS = Path(__file__).resolve().parent.parent / "fake_nvml" / "scenarios"
PRICE = 2.5  # $/GPU-hour (pricing.gpu_hourly)
HOURS = 3
T0 = 1_795_802_400.0  # 2026-11-27T18:00:00Z

# The schema README documents, column for column: a change here is a change for every warehouse.
SCHEMA = [
    ("hour", "timestamp[ms, tz=UTC]"), ("node", "string"), ("gpu", "int32"), ("uuid", "string"),
    ("kind", "string"), ("namespace", "string"), ("pod", "string"), ("container", "string"),
    ("hpc_job", "string"), ("unit", "string"), ("user", "string"), ("model", "string"), ("team", "string"),
    ("left_by_namespace", "string"), ("left_by_pod", "string"), ("left_by_container", "string"),
    ("left_by_hpc_job", "string"), ("left_by_unit", "string"), ("left_by_user", "string"),
    ("left_by_model", "string"), ("left_by_team", "string"), ("dollars", "double"),
    ("gpu_hours_charged", "double"), ("gpu_hours_held", "double"), ("gpu_hours_used", "double"),
    ("energy_kwh", "double"), ("energy_dollars", "double"), ("gpu_hours_unmeasured", "double"),
    ("account", "string"),
]  # fmt: skip
KEY = ("hour", "node", "uuid", "kind", *(name for name, _ in SCHEMA[5:21]), "account")


@pytest.fixture(scope="module")
def ledgers(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three hours of two nodes, each in its own ledger, as each node's agent writes it."""
    work = tmp_path_factory.mktemp("export")
    settings = Settings.model_validate({"pricing": {"gpu_hourly": PRICE, "energy_per_kwh": 0.12}})
    paths = []
    for name in ("demo", "weekend-idle"):
        scenario = yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text(encoding="utf-8"))
        path = work / f"{name}.db"
        agent = build_agent(settings, fake=scenario, ledger_path=path, poll_interval_s=60.0)
        assert agent.node is not None
        try:
            run_on_scenario_time(agent.pipeline.jobs(), agent.node.clock.advance, HOURS * 3600.0, 60.0)
        finally:
            agent.close()
        paths.append(path)
    return paths


def export(tmp_path: Path, ledger: Path, fmt: str) -> Path:
    """What `gpuledger export --ledger LEDGER --format FMT --out FILE` does, in this process
    (the command's two calls, without a Python start; the command line itself is run below)."""
    out = tmp_path / f"{ledger.stem}.{fmt}"
    write(read_records([ledger]), fmt, str(out))
    return out


def test_the_csv_header_is_the_documented_schema(ledgers: list[Path]) -> None:
    result = gpuledger("export", "--ledger", str(ledgers[0]))
    assert result.returncode == 0, result.stderr
    assert next(csv.reader(io.StringIO(result.stdout))) == [name for name, _ in SCHEMA] == list(COLUMNS)
    assert len(result.stdout.splitlines()) == 1 + len(pq.read_table(export(ledgers[0].parent, ledgers[0], "parquet")))


def test_the_parquet_schema_is_the_documented_schema(ledgers: list[Path], tmp_path: Path) -> None:
    table = pq.read_table(export(tmp_path, ledgers[0], "parquet"))
    assert [(field.name, str(field.type)) for field in table.schema] == SCHEMA


def test_two_nodes_exports_concatenate_into_one_table_that_adds_up(ledgers: list[Path], tmp_path: Path) -> None:
    table = pa.concat_tables([pq.read_table(export(tmp_path, path, "parquet")) for path in ledgers])
    rows = table.to_pylist()
    # No row of one node can be taken for one of the other: the key is unique across both.
    keys = Counter(tuple(row[c] for c in KEY) for row in rows)
    assert max(keys.values()) == 1
    assert {row["node"] for row in rows} == {"gpu-node-01", "gpu-node-07"}
    # Every GPU-hour is in it once: 2 nodes x 8 GPUs x 3 h = 48 GPU-hours, $120.00 at $2.50.
    assert math.fsum(row["gpu_hours_charged"] for row in rows) == pytest.approx(2 * 8 * HOURS, rel=1e-9)
    assert math.fsum(row["dollars"] for row in rows) == pytest.approx(2 * 8 * HOURS * PRICE, rel=1e-9)
    # And it is the report's: the same dollars by job, idle and unobserved.
    report = report_from_ledgers(ledgers, by=["hpc_job"])
    by_job: dict[str, list[float]] = {}
    for row in rows:
        if row["kind"] == "workload":
            by_job.setdefault(row["hpc_job"], []).append(row["dollars"])
    assert {job: math.fsum(d) for job, d in by_job.items()} == {
        line.key[0]: pytest.approx(line.dollars, rel=1e-12) for line in report.lines
    }
    idle = math.fsum(row["dollars"] for row in rows if row["kind"] == "idle")
    assert idle == pytest.approx(report.idle.dollars, rel=1e-12)
    used = math.fsum(row["gpu_hours_used"] or 0.0 for row in rows)
    assert used == pytest.approx(report.total.gpu_hours_used, rel=1e-12)


def test_a_job_billed_to_two_accounts_in_an_hour_is_two_rows_told_apart(tmp_path: Path) -> None:
    # Job 8812's first half hour was its allocation alone (the prolog's map file named no account),
    # the second its process, whose SLURM_JOB_ACCOUNT says nlp: the ledger keeps a row of each.
    # The export had two rows of one key, and a warehouse loading by that key kept one: $1.25 lost.
    path = tmp_path / "ledger.db"
    job = Workload(hpc_job="8812", user="alice")
    with Ledger(path, retention_s=None) as ledger:
        for start, account in ((T0, ""), (T0 + 1800, "nlp")):
            # Half an hour at $2.50/h: $1.25.
            held = WorkloadCharge(0, "GPU-0", job, 1800.0, 900.0, 1.25, 0.0, charged_s=1800.0, account=account)
            gpu = GpuCharge(0, "GPU-0", "A100-SXM4-80GB", PRICE, 1800.0, 1.25, 0.0, 0.0, 0.0, 0.0, 0.0)
            ledger.add(Charges(start, start + 1800, "gpu-node-01", (held,), (gpu,)))
    rows = read_records([path])
    assert max(Counter(tuple(row[c] for c in KEY) for row in rows).values()) == 1
    assert {row["account"]: row["dollars"] for row in rows} == {"": 1.25, "nlp": 1.25}
    report = report_from_ledgers([path], by=["account"])
    assert {line.key[0]: line.dollars for line in report.lines} == {"": 1.25, "nlp": 1.25}


def test_csv_and_parquet_hold_the_same_rows(ledgers: list[Path], tmp_path: Path) -> None:
    parquet = pq.read_table(export(tmp_path, ledgers[1], "parquet")).to_pylist()
    with export(tmp_path, ledgers[1], "csv").open(encoding="utf-8", newline="") as handle:
        text = list(csv.DictReader(handle))
    assert len(text) == len(parquet)
    for from_csv, from_parquet in zip(text, parquet, strict=True):
        assert from_csv["hour"] == from_parquet["hour"].isoformat().replace("+00:00", "Z")
        assert float(from_csv["dollars"]) == from_parquet["dollars"]  # repr: the same float
        assert from_csv["energy_dollars"] == (
            "" if from_parquet["energy_dollars"] is None else repr(from_parquet["energy_dollars"])
        )


def test_csv_labels_never_become_spreadsheet_formulas() -> None:
    # A model and a self-reported Slurm job are whatever a user wrote: = + - @ would start a formula.
    job = Workload(hpc_job='=HYPERLINK("http://evil.example/","x")', user="ann", model="-2+3")
    rows = [
        UsageRow(0, "gpu-node-01", 0, "GPU-0", job, 3600.0, 1800.0, 2.5, 0.0, charged_s=3600.0),
        UsageRow(0, "gpu-node-01", 1, "GPU-1", Workload(), 3600.0, 0.0, 2.5, 0.0, idle=True, charged_s=3600.0,
                 left_by=Workload(model="@SUM(1)")),
    ]  # fmt: skip
    out = io.StringIO()
    write_csv(records(rows), out)
    written = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert (written[0]["hpc_job"], written[0]["model"], written[1]["left_by_model"]) == (
        '\'=HYPERLINK("http://evil.example/","x")',
        "'-2+3",
        "'@SUM(1)",
    )
    assert (written[0]["user"], written[0]["dollars"], written[0]["gpu_hours_used"]) == ("ann", "2.5", "0.5")
    # Parquet holds the labels as they are (its records are the CSV's before the cells are written).
    assert records(rows)[0]["hpc_job"] == '=HYPERLINK("http://evil.example/","x")'


def test_each_hour_of_a_node_costs_its_gpus_price(ledgers: list[Path], tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = pq.read_table(export(tmp_path, ledgers[0], "parquet")).to_pylist()
    per_hour: dict[Any, list[float]] = {}
    for row in rows:
        per_hour.setdefault(row["hour"], []).append(row["dollars"])
    # 8 GPUs x $2.50 = $20.00 an hour, split among workloads and idle.
    assert {hour: math.fsum(d) for hour, d in per_hour.items()} == dict.fromkeys(per_hour, pytest.approx(20.0))
    assert len(per_hour) == HOURS
    kinds = Counter(row["kind"] for row in rows)
    assert kinds["idle"] == HOURS  # GPU 6 is nobody's, each hour
    # Nobody ever held GPU 6: its idle rows are left by nobody known (empty labels); no other
    # kind of row was left by anyone (null).
    assert {row["left_by_hpc_job"] for row in rows if row["kind"] == "idle"} == {""}
    assert {row["left_by_hpc_job"] for row in rows if row["kind"] != "idle"} == {None}


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--format", "parquet"), "Parquet is binary: give --out FILE"),
        (("--out", "/nonexistent/dir/x.csv"), "--out: no such directory"),
        (("--ledger", "/nonexistent.db"), "no such ledger file"),
        (("--since", "tomorrow"), "expected a time"),
    ],
)
def test_bad_export_arguments_are_one_line(ledgers: list[Path], args: tuple[str, ...], words: str) -> None:
    result = gpuledger("export", "--ledger", str(ledgers[0]), *args)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert words in result.stderr


def test_an_out_that_is_not_a_file_is_refused_and_left_alone(ledgers: list[Path], tmp_path: Path) -> None:
    # Renaming the export over a directory fails; over a FIFO or a device it would succeed and
    # destroy it (`--out /dev/null` once left a regular file where the device was).
    directory = tmp_path / "out.csv"
    directory.mkdir()
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    for target, kind in ((directory, "a directory"), (fifo, "not a regular file")):
        result = gpuledger("export", "--ledger", str(ledgers[0]), "--out", str(target))
        assert (result.returncode, result.stderr.strip()) == (
            2,
            f"gpuledger: --out: {target} is {kind}: name a file to write",
        )
    assert sorted(tmp_path.iterdir()) == sorted([directory, fifo])  # no temporary file left behind
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_an_out_that_is_a_ledger_is_refused_and_left_alone(ledgers: list[Path], tmp_path: Path) -> None:
    # `--out demo.db` for `--out demo.csv` replaced the ledger with its own export: every charge
    # it recorded was lost (and a running agent, finding its file replaced, started a new one).
    ledger = tmp_path / "demo.db"
    ledger.write_bytes(ledgers[0].read_bytes())
    before = ledger.read_bytes()
    for args in (("export", "--ledger", str(ledger)), ("report", "--ledger", str(ledgers[1]), "--format", "csv")):
        result = gpuledger(*args, "--out", str(ledger))
        assert (result.returncode, result.stderr.strip()) == (
            2,
            f"gpuledger: --out: {ledger} is an SQLite database (a ledger?): name another file",
        )
    assert ledger.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_an_out_that_is_a_symlink_is_written_through(ledgers: list[Path], tmp_path: Path) -> None:
    real = tmp_path / "real.csv"
    real.write_text("old\n")
    link = tmp_path / "link.csv"
    link.symlink_to(real)
    result = gpuledger("export", "--ledger", str(ledgers[0]), "--out", str(link))
    assert result.returncode == 0, result.stderr
    assert link.is_symlink()  # still the link, now to the new export
    assert real.read_text().startswith("hour,node,gpu,uuid,kind,")


def test_every_out_is_on_disk_before_it_replaces_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # report --out and rules --out write through the same replacing() as export: each must sync the
    # new file before renaming it over the old, else a power cut can leave an empty file in its place.
    events: list[str] = []
    fsync, rename = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), rename(a, b))[1])
    out = tmp_path / "report.csv"
    out.write_text("old\n")
    write_output("kind,dollars\ntotal,1.0\n", str(out))
    assert events == ["fsync", "replace"]
    assert out.read_text() == "kind,dollars\ntotal,1.0\n"


def test_an_out_keeps_the_mode_of_the_file_it_replaces_and_a_new_one_follows_the_umask(tmp_path: Path) -> None:
    # Every --out was made rw-r--r--: a report kept private (0600) became readable by everyone
    # on the host when it was written again, and a user's umask 077 was ignored.
    kept = tmp_path / "private.csv"
    kept.write_text("old\n")
    kept.chmod(0o600)
    write_output("kind,dollars\ntotal,1.0\n", str(kept))
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert kept.read_text() == "kind,dollars\ntotal,1.0\n"
    before = os.umask(0o077)
    try:
        write_output("kind,dollars\n", str(tmp_path / "new.csv"))
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "new.csv").stat().st_mode) == 0o600  # 0666 less 077


def test_mig_instances_use_nothing_measured_is_exported_as_unknown(tmp_path: Path) -> None:
    """The `mig` scenario for an hour: GPU 0's two 3g.40gb instances (42 of an A100's 108 SMs
    each, no GPM) have no busy figure; GPU 1, whole, is 40% busy by NVML."""
    path = tmp_path / "mig.db"
    assert gpuledger("simulate", "mig", "--for", "1h", "--ledger", str(path)).returncode == 0
    workloads = [r for r in read_records([path]) if r["kind"] == "workload"]
    migs = [r for r in workloads if r["gpu"] == 0]
    (whole,) = (r for r in workloads if r["gpu"] == 1)
    assert len(migs) == 2
    for row in migs:
        # 1 h x 42/108 of the GPU each, none of it measured: used unknown, not 0.
        assert row["gpu_hours_charged"] == pytest.approx(42 / 108, rel=1e-9)
        assert row["gpu_hours_unmeasured"] == row["gpu_hours_charged"]
        assert row["gpu_hours_used"] is None
    # GPU 1: 1 GPU-hour at 40% = 0.4 used, all measured.
    assert (whole["gpu_hours_used"], whole["gpu_hours_unmeasured"]) == (pytest.approx(0.4, rel=1e-9), 0.0)
