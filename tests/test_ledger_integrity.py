"""The ledger when things go wrong, on real SQLite files: `report` reads without writing, even
where it may not write; pending charges stay bounded while the file cannot be written, and
none are lost at shutdown without an error line; a corrupt file is moved aside for a fresh one."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from agent.ledger.report import report_from_ledger
from agent.ledger.store import Ledger, LedgerError, fallback_uri, open_read_only, read_usage, reader_uri
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
    assert [line.split(",")[0] for line in result.stdout.splitlines()[1:]] == ["group", "idle", "total"]
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
