"""The ledger when things go wrong, on real SQLite files: `report` reads without writing, even
where it may not write; pending charges stay bounded while the file cannot be written, and
none are lost at shutdown without an error line; a corrupt file is moved aside for a fresh one."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from agent.ledger.files import LedgerError
from agent.ledger.read import fallback_uri, open_read_only, read_usage, reader_uri
from agent.ledger.report import report_from_ledger
from agent.ledger.store import Ledger
from agent.model import Charges, GpuCharge, Workload, WorkloadCharge
from tests.test_cli import gpuledger

ROOT = Path(__file__).resolve().parent.parent
H = 3600.0
T0 = 1_795_802_400.0  # 2026-11-27T18:00:00Z, an hour start
ANN = Workload(user="ann", hpc_job="4101")


def hour_of_work(hour: int, *, node: str = "gpu-node-01") -> Charges:
    """Hour `hour` after T0 on two GPUs at $2.50 an hour: ann holds GPU 0 ($2.50), GPU 1 is idle ($2.50)."""
    start = T0 + hour * H
    work = WorkloadCharge(0, "GPU-0", ANN, H, H / 2, 2.5, 0.0)
    held = GpuCharge(0, "GPU-0", "A100-SXM4-80GB", 2.5, H, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0)
    idle = GpuCharge(1, "GPU-1", "A100-SXM4-80GB", 2.5, H, 2.5, H, 2.5, 0.0, 0.0, 0.0)
    return Charges(start, start + H, node, (work,), (held, idle))


@pytest.fixture
def stopped_agents_ledger(tmp_path: Path) -> Path:
    """Two hours in a ledger as an agent leaves it when it stops: WAL checkpointed and removed."""
    directory = tmp_path / "var-lib-gpuledger"
    directory.mkdir()
    path = directory / "ledger.db"
    with Ledger(path, node="gpu-node-01", retention_s=None) as ledger:
        ledger.add(hour_of_work(0))
        ledger.add(hour_of_work(1))
    assert sorted(p.name for p in directory.iterdir()) == ["ledger.db"]
    return path


# --- report reads read-only ---


def test_the_reader_uri_is_read_only_and_immutable_only_when_asked(tmp_path: Path) -> None:
    odd = tmp_path / "a dir?#%" / "ledger 1.db"
    assert reader_uri(odd) == f"file://{tmp_path.resolve()}/a%20dir%3F%23%25/ledger%201.db?mode=ro"
    assert (
        reader_uri(odd, immutable=True)
        == f"file://{tmp_path.resolve()}/a%20dir%3F%23%25/ledger%201.db?mode=ro&immutable=1"
    )


@pytest.mark.parametrize(
    ("errorcode", "wal_bytes", "immutable"),
    [
        (1544, 0, True),  # SQLITE_READONLY_DIRECTORY: the -shm cannot be created (a user's own view)
        (14, 0, True),  # SQLITE_CANTOPEN: the same, as root meets it in an immutable directory
        (1544, 4152, False),  # the WAL holds commits: immutable would not read them
        (14, 4152, False),
        (11, 0, False),  # SQLITE_CORRUPT: nothing another way of opening mends
        (5, 0, False),  # SQLITE_BUSY
        (8, 0, False),  # SQLITE_READONLY itself: not about the -shm
    ],
)
def test_immutable_is_the_fallback_only_where_it_reads_everything(
    tmp_path: Path, errorcode: int, wal_bytes: int, immutable: bool
) -> None:
    path = tmp_path / "ledger.db"
    expected = reader_uri(path, immutable=True) if immutable else None
    assert fallback_uri(path, errorcode, wal_bytes) == expected


def test_report_connections_refuse_to_write(stopped_agents_ledger: Path) -> None:
    with closing(open_read_only(stopped_agents_ledger)) as conn:
        assert conn.execute("SELECT SUM(dollars) FROM workload_hours").fetchone() == (5.0,)  # 2 h x $2.50
        with pytest.raises(sqlite3.OperationalError, match="attempt to write a readonly database"):
            conn.execute("DELETE FROM workload_hours")
    # The immutable way, exercised for real on a copy: the same rows, no write, nothing created beside it.
    copy_dir = stopped_agents_ledger.parent.parent / "copy"
    copy_dir.mkdir()
    copy = copy_dir / "ledger.db"
    shutil.copyfile(stopped_agents_ledger, copy)
    with closing(sqlite3.connect(reader_uri(copy, immutable=True), uri=True)) as conn:
        assert conn.execute("SELECT SUM(dollars) FROM workload_hours").fetchone() == (5.0,)
        with pytest.raises(sqlite3.OperationalError, match="attempt to write a readonly database"):
            conn.execute("UPDATE ledger_meta SET node = 'x'")
    assert [p.name for p in copy_dir.iterdir()] == ["ledger.db"]  # no -wal, no -shm
    assert copy.read_bytes() == stopped_agents_ledger.read_bytes()


@contextmanager
def unwritable(directory: Path) -> Iterator[None]:
    """`directory` made one this process cannot create files in: mode 0555 for a user; for root,
    whom modes do not stop, the immutable attribute (chattr +i). Skips where neither holds."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        undo = ["chmod", "0755", str(directory)]
    else:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(directory)], check=False).returncode:
            pytest.skip("root, and no chattr +i here: no directory root cannot write")
        undo = ["chattr", "-i", str(directory)]
    try:
        try:
            (directory / "probe").touch()
        except OSError:
            pass
        else:
            (directory / "probe").unlink()
            pytest.skip(f"{directory} stays writable")
        yield
    finally:
        subprocess.run(undo, check=True)


def test_report_reads_a_ledger_in_a_directory_it_may_not_write(stopped_agents_ledger: Path) -> None:
    directory = stopped_agents_ledger.parent
    with unwritable(directory):
        # mode=ro alone needs to create ledger.db-shm beside the file, and cannot:
        with (
            pytest.raises(sqlite3.OperationalError),
            closing(sqlite3.connect(reader_uri(stopped_agents_ledger), uri=True)) as conn,
        ):
            conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()
        result = gpuledger("report", "--ledger", str(stopped_agents_ledger), "--by", "user", "--format", "csv")
        listing = sorted(p.name for p in directory.iterdir())
    assert result.returncode == 0, result.stderr
    rows = {line.split(",")[1]: line.split(",")[2] for line in result.stdout.splitlines()[1:]}
    # ann: 2 h x $2.50 = $5.00; GPU 1 idle 2 h = $5.00; TOTAL $10.00
    assert (float(rows["ann"]), float(rows[""])) == (5.0, 10.0)  # the idle and total rows have no user
    assert [line.split(",")[0] for line in result.stdout.splitlines()[1:]] == ["group", "idle", "unobserved", "total"]
    assert listing == ["ledger.db"]


def test_report_will_not_read_past_commits_it_cannot_see(tmp_path: Path) -> None:
    """An agent killed before its WAL was checkpointed, in a directory the reader cannot write,
    and no -shm: immutable would read the file without the WAL's commits. Refused, in one line."""
    directory = tmp_path / "var-lib-gpuledger"
    directory.mkdir()
    path = directory / "ledger.db"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_FLUSH, str(path)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert killed.returncode == 0, killed.stderr
    wal = Path(f"{path}-wal")
    assert wal.stat().st_size > 0
    Path(f"{path}-shm").unlink()
    with unwritable(directory):
        with pytest.raises(LedgerError) as caught:
            read_usage(path)
        result = gpuledger("report", "--ledger", str(path))
    assert str(caught.value) == (
        f"ledger {path}: cannot open read-only (unable to open database file) and {wal} holds charges not yet in "
        "the file: read it as the user the agent runs as"
    )
    assert (result.returncode, result.stderr) == (1, f"gpuledger: {caught.value}\n")
    # Once it can be read properly, every commit is there: 2 h x $2.50 for ann.
    assert report_from_ledger(path, by=["user"]).lines[0].dollars == 5.0


KILLED_AFTER_FLUSH = r"""
import os, sys
from agent.ledger.store import Ledger
from tests.test_ledger_integrity import hour_of_work
ledger = Ledger(sys.argv[1], retention_s=None)
ledger.add(hour_of_work(0))
ledger.add(hour_of_work(1))
assert ledger.flush()
os._exit(0)  # no close: the WAL keeps the commit, unmerged
"""


# --- pending charges are bounded ---


def held_lock(path: Path) -> sqlite3.Connection:
    """Another connection holding the write lock: SQLite refuses this process's flushes (every user,
    every filesystem, where root ignores modes and a full disk needs a mount)."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    return holder


def test_pending_rows_are_capped_by_dropping_the_oldest_hours_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(path, retention_s=None, busy_timeout_s=0.01, max_pending_rows=7)
    holder = held_lock(path)
    for hour in range(4):  # each hour: ann's row and two GPU rows, $2.50 + $2.50 = $5.00
        ledger.add(hour_of_work(hour))
        assert ledger.flush() is False
        assert ledger.pending_rows <= 7
    # Hour 2 made 9 rows: hour 0 went (3 rows, $5.00); hour 3 made 9 again: hour 1 went.
    assert (ledger.pending_rows, ledger.dropped_rows, ledger.dropped_dollars) == (6, 6, 10.0)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [
        f"ledger {path}: more than ledger.max_pending_rows (7) hourly rows wait to be written; dropping the oldest "
        "hours, starting with 2026-11-27T18:00:00Z ($5.00 in 3 rows); gpuledger_ledger_dropped_rows_total counts "
        "every drop"
    ]  # one line for the outage, not one per drop
    holder.rollback()
    holder.close()
    assert ledger.flush()
    # What reached the file: hours 2 and 3, $5.00 each; the period starts where the kept hours do.
    assert report_from_ledger(path, by=["user"]).total.dollars == 10.0
    with closing(open_read_only(path)) as conn:
        assert conn.execute("SELECT first_at, last_at FROM ledger_meta").fetchone() == (T0 + 2 * H, T0 + 4 * H)

    # A second outage is logged again.
    holder = held_lock(path)
    for hour in range(4, 7):
        ledger.add(hour_of_work(hour))
        assert ledger.flush() is False
    holder.rollback()
    holder.close()
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 2
    assert (ledger.dropped_rows, ledger.dropped_dollars) == (9, 15.0)  # hour 4 too: 3 more rows, $5.00
    assert ledger.close()


def test_dropped_unobserved_hours_count_in_the_dropped_dollars(tmp_path: Path) -> None:
    # The dropped dollars are what report's TOTAL misses, and TOTAL counts unobserved time: they
    # used to count workload and idle dollars only, so dropping hours nobody observed read $0.
    path = tmp_path / "ledger.db"
    ledger = Ledger(path, retention_s=None, busy_timeout_s=0.01, max_pending_rows=2)
    holder = held_lock(path)
    for hour in range(4):  # one GPU at $2/h, unobserved for the whole hour: one row of $2.00
        gpu = GpuCharge(0, "GPU-0", "A100-SXM4-80GB", 2.0, 0.0, 0.0, 0.0, 0.0, H, 0.0, 0.0, unobserved_dollars=2.0)
        ledger.add(Charges(T0 + hour * H, T0 + (hour + 1) * H, "node-a", gpus=(gpu,)))
        assert ledger.flush() is False
    # Hours 2 and 3 each made a third row: hours 0 and 1 went, 2 rows x $2.00 = $4.00.
    assert (ledger.pending_rows, ledger.dropped_rows, ledger.dropped_dollars) == (2, 2, 4.0)
    holder.rollback()
    holder.close()
    assert ledger.close()
    # What the file holds plus what was dropped is the 4 hours x $2/h = $8.00 the GPU cost.
    assert report_from_ledger(path, by=["user"]).total.dollars + ledger.dropped_dollars == 8.0


def test_downtime_longer_than_the_pending_rows_is_written_whole(tmp_path: Path) -> None:
    # Two GPUs at $2/h unobserved for 30 hours, one charge (downtime booked at a start): 60 GPU-hour
    # rows, more than the 7 that may wait; the file takes writes, so none is dropped.
    path = tmp_path / "ledger.db"
    ledger = Ledger(path, retention_s=None, max_pending_rows=7)
    down = 30 * H
    gpus = tuple(
        GpuCharge(g, f"GPU-{g}", "A100-SXM4-80GB", 2.0, 0.0, 0.0, 0.0, 0.0, down, 0.0, 0.0, unobserved_dollars=60.0)
        for g in range(2)
    )
    ledger.add(Charges(T0 + 0.5 * H, T0 + 0.5 * H + down, "node-a", gpus=gpus))
    assert (ledger.dropped_rows, ledger.dropped_dollars) == (0, 0.0)
    assert ledger.close()
    report = report_from_ledger(path, by=["user"])
    # 2 GPUs x 30 h x $2/h = $120, all of it unobserved: 60 GPU-hours (not 3 hours' 6, the rest dropped)
    assert report.unobserved.dollars == pytest.approx(120.0, rel=1e-12)
    assert report.unobserved.gpu_hours_charged == pytest.approx(60.0, rel=1e-12)
    assert report.total.dollars == pytest.approx(120.0, rel=1e-12)
    assert len({row.hour for row in read_usage(path)}) == 31  # 18:30 on the first day to 00:30 on the third
    with closing(open_read_only(path)) as conn:
        assert conn.execute("SELECT first_at, last_at FROM ledger_meta").fetchone() == (T0 + 0.5 * H, T0 + 30.5 * H)


def test_a_month_without_a_ledger_stays_under_four_megabytes(tmp_path: Path) -> None:
    """30 days of an 8-GPU node whose ledger never opens: eight jobs, one per GPU, each hour."""
    import tracemalloc

    from agent.ledger.pending import DEFAULT_MAX_PENDING_ROWS, PendingCharges

    jobs = [Workload(namespace="training", pod=f"llama-pretrain-{gpu}", container="trainer", user="ann",
                     model="llama-3-70b", team="research") for gpu in range(8)]  # fmt: skip
    tracemalloc.start()
    try:
        pending = PendingCharges(tmp_path / "nowhere" / "ledger.db")
        for hour in range(30 * 24):
            start = T0 + hour * H
            work = tuple(WorkloadCharge(g, f"GPU-{g}", jobs[g], H, H * 0.9, 2.5, 1.0e6) for g in range(8))
            gpus = tuple(GpuCharge(g, f"GPU-{g}", "A100-SXM4-80GB", 2.5, H, 2.5, 0, 0, 0, 1.0e6, 0) for g in range(8))
            pending.add(Charges(start, start + H, "gpu-node-01", work, gpus))
        used, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 16 rows an hour (8 workload, 8 GPU): 5000 // 16 = 312 whole hours kept, 4992 rows; the
    # other 720 - 312 = 408 hours dropped: 408 x 16 = 6528 rows, 408 x 8 x $2.50 = $8,160.00.
    assert DEFAULT_MAX_PENDING_ROWS == 5000
    assert (pending.rows, pending.dropped_rows) == (4992, 6528)
    assert pending.dropped_dollars == pytest.approx(8160.0, rel=1e-12)
    assert pending.lost() == (4992, pytest.approx(312 * 8 * 2.5, rel=1e-12))  # $6,240.00 still pending
    print(f"{pending.rows} pending rows use {used / 2**20:.2f} MiB")
    assert used < 4 * 2**20


def test_a_ledger_that_never_opens_loses_its_charges_in_one_error_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from agent.ledger.sink import LedgerSink

    blocker = tmp_path / "state"
    blocker.write_text("a file where the ledger's directory should be")
    sink = LedgerSink(blocker / "ledger.db", retention_s=None, node="gpu-node-01")
    for hour in range(3):
        sink.add(hour_of_work(hour))
    assert sink.health().pending_rows == 9  # coalesced per hour and key: 3 rows an hour
    assert sink.flush() is False
    assert sink.close() is False
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    # 3 hours x ($2.50 for ann + $2.50 idle) = $15.00 in 9 rows
    assert errors[-1] == (
        f"ledger {blocker / 'ledger.db'}: cannot be opened; exiting with 9 hourly rows ($15.00) that could not be "
        "written"
    )
    assert len(errors) == 2  # the outage when it began, the loss at the end


def test_run_exits_1_when_its_charges_cannot_reach_the_ledger(tmp_path: Path) -> None:
    from tests.test_cli import Daemon, polls_at_least, value

    blocker = tmp_path / "state"
    blocker.write_text("a file where the ledger's directory should be")
    config = tmp_path / "gpuledger.yml"
    config.write_text("poll_interval: 1s\n")
    fast = ("--config", str(config), "--fake", "--fake-speed", "3600")
    agent = Daemon(tmp_path, *fast, "--ledger", str(blocker / "ledger.db"))
    try:
        text = agent.wait_for(polls_at_least(3))
        assert value(text, "gpuledger_ledger_up") == 0
        assert value(text, "gpuledger_ledger_pending_rows") > 0
        charged = value(text, "gpuledger_gpu_cost_dollars_total", gpu="0")
    finally:
        code = agent.stop()
    log = (tmp_path / f"daemon-{agent.port}.log").read_text()
    assert code == 1, log
    lost = [line for line in log.splitlines() if "exiting with" in line]
    assert len(lost) == 1, log
    figures = lost[0].split("exiting with ")[1].split(" that could not be written")[0]
    rows, dollars = figures.split(" hourly rows ($")
    assert int(rows) > 0
    assert float(dollars.rstrip(")")) >= charged  # all of GPU 0's cost at least, and the other seven's

    # The same run with a ledger it can write: a clean exit, the charges on disk.
    good = tmp_path / "ledger.db"
    agent = Daemon(tmp_path, *fast, "--ledger", str(good))
    try:
        agent.wait_for(polls_at_least(3))
    finally:
        code = agent.stop()
    assert code == 0
    assert report_from_ledger(good, by=["user"]).total.dollars > 0


# --- a corrupt ledger is moved aside ---


def multi_page_ledger(path: Path, hours: int = 600) -> int:
    """A ledger of `hours` hours of work (three rows an hour: 40 pages of 4 KiB); its page size."""
    with Ledger(path, node="gpu-node-01", retention_s=None) as ledger:
        for hour in range(hours):
            ledger.add(hour_of_work(hour))
    with closing(sqlite3.connect(path)) as conn:
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
    assert pages >= 20
    return int(page_size)


def overwrite(path: Path, offset: int, length: int) -> bytes:
    """Bytes `offset` to `offset + length` of `path` replaced by 0xA5 (a disk that returned garbage);
    the whole file as it is afterwards."""
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(b"\xa5" * length)
    return path.read_bytes()


def test_a_corrupt_ledger_is_moved_aside_at_open_and_a_fresh_one_started(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ledger.db"
    page_size = multi_page_ledger(path)
    pages = path.stat().st_size // page_size
    damaged = overwrite(path, (pages // 2) * page_size + 100, 2000)  # inside a page in the middle
    with pytest.raises(LedgerError, match="malformed"):
        read_usage(path)  # what report met before: an error, after months of writing into it

    ledger = Ledger(path, node="gpu-node-01", retention_s=None)
    [aside] = ledger.moved_aside
    assert aside.parent == path.parent
    assert re.fullmatch(r"ledger\.db\.corrupt-\d{8}T\d{6}Z", aside.name), aside.name  # UTC, to the second
    assert aside.read_bytes() == damaged  # kept as it was, for `sqlite3 .recover`
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line.startswith(f"ledger {path} is corrupt (quick_check: ")
    assert line.endswith(f"); moved it aside to {aside} and started a fresh ledger")
    assert "\n" not in line
    assert not ledger.healthy  # ledger_up 0 until the fresh file has taken a flush
    ledger.add(hour_of_work(700))
    assert ledger.flush()
    assert ledger.healthy
    assert ledger.close()
    # The fresh ledger holds what came after: one hour, $2.50 for ann and $2.50 idle.
    fresh = report_from_ledger(path, by=["user"])
    assert (fresh.total.dollars, fresh.idle.dollars) == (5.0, 2.5)
    # A directory report reads the fresh *.db, never the corrupt file beside it.
    result = gpuledger("report", "--ledger", str(tmp_path), "--format", "json")
    assert result.returncode == 0, result.stderr
    assert '"dollars": 5.0' in result.stdout


def test_ledger_up_is_0_and_the_corrupt_file_counted_until_the_fresh_ledger_is_written(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from agent.ledger.sink import LedgerSink
    from agent.model import AgentState
    from exporters.prometheus import make_registry
    from tests.test_cli import value

    path = tmp_path / "ledger.db"
    page_size = multi_page_ledger(path)
    overwrite(path, 10 * page_size, page_size)  # page 11: a whole page of garbage
    sink = LedgerSink(path, retention_s=None, node="gpu-node-01")

    def scrape() -> str:
        return generate_latest(make_registry(lambda: AgentState(ledger=sink.health()))).decode()

    first = scrape()
    assert (value(first, "gpuledger_ledger_up"), value(first, "gpuledger_ledger_corrupt_files_total")) == (0, 1)
    sink.add(hour_of_work(0))
    assert sink.flush()
    after = scrape()
    assert (value(after, "gpuledger_ledger_up"), value(after, "gpuledger_ledger_corrupt_files_total")) == (1, 1)
    assert sink.close()
    assert len(list(tmp_path.glob("ledger.db.corrupt-*"))) == 1


def test_a_flush_that_meets_a_corrupt_page_moves_the_file_aside_and_keeps_its_rows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(path, node="gpu-node-01", retention_s=None)
    for hour in range(600):
        ledger.add(hour_of_work(hour))
    assert ledger.flush()
    # Damage the file under the running agent: merge the WAL into it, garble the root page of
    # gpu_hours (every flush writes there), and commit from elsewhere so the agent's page cache
    # is not trusted on its next transaction.
    with closing(sqlite3.connect(path, isolation_level=None)) as other:
        other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (page_size,) = other.execute("PRAGMA page_size").fetchone()
        (root,) = other.execute("SELECT rootpage FROM sqlite_schema WHERE name = 'gpu_hours'").fetchone()
        overwrite(path, (root - 1) * page_size, page_size)
        other.execute("UPDATE ledger_meta SET created_by = created_by")
    ledger.add(hour_of_work(700))
    assert ledger.flush() is False
    assert not ledger.healthy
    [aside] = ledger.moved_aside
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"ledger {path} is corrupt (database disk image is malformed); moved it aside to {aside} and started a "
        "fresh ledger"
    ]
    assert ledger.flush()  # the fresh file takes the hour that was pending
    assert ledger.healthy
    assert ledger.close()
    assert report_from_ledger(path, by=["user"]).total.dollars == 5.0  # hour 700: $2.50 + $2.50


def test_a_file_that_is_not_sqlite_is_never_moved(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    path.write_bytes(b"SQLite format 2\x00" + b"\xa5" * 8192)  # not SQLite's header: someone else's file
    with pytest.raises(LedgerError, match="file is not a database"):
        Ledger(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.db"]


def test_moving_aside_takes_the_wal_along_and_never_overwrites(tmp_path: Path) -> None:
    from agent.ledger.files import move_aside

    path = tmp_path / "ledger.db"
    for content in (b"first", b"second"):
        path.write_bytes(content)
        Path(f"{path}-wal").write_bytes(content + b" wal")
        move_aside(path, T0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ledger.db.corrupt-20261127T180000Z",
        "ledger.db.corrupt-20261127T180000Z-1",
        "ledger.db.corrupt-20261127T180000Z-1-wal",
        "ledger.db.corrupt-20261127T180000Z-wal",
    ]
    assert (tmp_path / "ledger.db.corrupt-20261127T180000Z-1-wal").read_bytes() == b"second wal"
