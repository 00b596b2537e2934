"""The durable ledger, on real SQLite files: sums survive restarts, hours split pro rata, retention,
a flush that cannot write keeps everything, and SIGKILL at any moment never corrupts the file."""

from __future__ import annotations

import logging
import math
import os
import random
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import pytest

from agent.ledger.files import LedgerError
from agent.ledger.pending import hour_shares
from agent.ledger.read import read_usage
from agent.ledger.schema import SCHEMA_VERSION
from agent.ledger.store import Ledger
from agent.model import Charges, GpuCharge, Workload, WorkloadCharge

ROOT = Path(__file__).resolve().parent.parent

H = 3600.0
T0 = 1_795_802_400.0  # 2026-11-27T18:00:00Z, an hour start
VLLM = Workload(namespace="serving", pod="vllm-llama-0", container="vllm", model="llama-3.1-8b")
TRAIN = Workload(hpc_job="8812", user="alice", model="llama-3-8b")


class ManualClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def charges(
    start: float,
    end: float,
    *,
    workloads: tuple[tuple[int, Workload, float], ...] = ((0, VLLM, 1.0),),
    idle: tuple[tuple[int, float], ...] = (),
    node: str = "gpu-node-01",
) -> Charges:
    """One interval: each workload holds its GPU for the whole interval at `dollars`; each idle GPU
    costs `dollars` with nobody on it. Busy is half of held, joules 100 per dollar; each workload
    is its GPU's sole holder, so it is charged all the time it held it."""
    dt = end - start
    wcs = tuple(
        WorkloadCharge(
            gpu=gpu, uuid=f"GPU-{gpu}", workload=w, held_s=dt, busy_s=dt / 2, dollars=d, joules=100 * d, charged_s=dt
        )
        for gpu, w, d in workloads
    )
    gcs = [
        GpuCharge(gpu, f"GPU-{gpu}", "A100-SXM4-80GB", 2.5, dt, d, 0.0, 0.0, 0.0, 100 * d, 0.0)
        for gpu, _, d in workloads
    ]
    gcs += [GpuCharge(gpu, f"GPU-{gpu}", "A100-SXM4-80GB", 2.5, dt, d, dt, d, 0.0, 100 * d, 100 * d) for gpu, d in idle]
    return Charges(start, end, node, wcs, tuple(gcs))


def stored(path: Path, sql: str) -> list[tuple[object, ...]]:
    with closing(sqlite3.connect(path)) as conn, conn:
        return conn.execute(sql).fetchall()


def total_dollars(path: Path) -> float:
    """Workload dollars plus idle dollars, as `report` counts them, summed exactly."""
    with closing(sqlite3.connect(path)) as conn, conn:
        workload = [d for (d,) in conn.execute("SELECT dollars FROM workload_hours")]
        idle = [d for (d,) in conn.execute("SELECT idle_dollars FROM gpu_hours")]
    return math.fsum(workload + idle)


# --- sums, restarts, hours ---


def test_sums_survive_flush_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(path)
    ledger.add(charges(T0, T0 + 15, workloads=((0, VLLM, 0.25), (1, TRAIN, 0.5))))
    ledger.add(charges(T0 + 15, T0 + 30, workloads=((0, VLLM, 0.25), (1, TRAIN, 0.5))))
    assert ledger.pending_rows == 4  # two workload rows and two GPU rows for the one hour
    assert ledger.flush()
    assert ledger.pending_rows == 0
    ledger.close()

    assert stored(
        path, "SELECT hour, pod, hpc_job, held_s, busy_s, dollars, joules, charged_s FROM workload_hours ORDER BY gpu"
    ) == [
        (int(T0), "vllm-llama-0", "", 30.0, 15.0, 0.5, 50.0, 30.0),
        (int(T0), "", "8812", 30.0, 15.0, 1.0, 100.0, 30.0),
    ]
    assert stored(path, "SELECT uuid, model, dollars_per_hour, observed_s, dollars FROM gpu_hours ORDER BY gpu") == [
        ("GPU-0", "A100-SXM4-80GB", 2.5, 30.0, 0.5),
        ("GPU-1", "A100-SXM4-80GB", 2.5, 30.0, 1.0),
    ]
    assert stored(path, "SELECT version FROM schema_version ORDER BY version") == [
        (v,) for v in range(1, SCHEMA_VERSION + 1)
    ]
    assert stored(path, "PRAGMA journal_mode") == [("wal",)]


def test_restarted_agent_keeps_adding_to_the_same_file(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with Ledger(path) as first:
        first.add(charges(T0, T0 + 60, workloads=((0, VLLM, 1.5),), idle=((1, 0.25),)))
    # close() flushed; a new process opens the same file and adds to the same hour's rows
    with Ledger(path) as second:
        second.add(charges(T0 + 60, T0 + 120, workloads=((0, VLLM, 2.0),), idle=((1, 0.5),)))

    assert stored(path, "SELECT held_s, dollars FROM workload_hours") == [(120.0, 3.5)]
    assert stored(path, "SELECT gpu, idle_s, idle_dollars FROM gpu_hours WHERE idle_s > 0") == [(1, 120.0, 0.75)]
    assert total_dollars(path) == 4.25


def test_interval_crossing_hour_boundaries_is_split_pro_rata(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    # 17:30 -> 19:30 is 7200 s: 1800 s (1/4) in the 17:00 hour, 3600 s (1/2) in 18:00, 1800 s (1/4)
    # in 19:00. $8 and 7200 s held therefore land as $2 / $4 / $2 and 1800 / 3600 / 1800 s.
    start = T0 - H / 2
    with Ledger(path) as ledger:
        ledger.add(charges(start, start + 2 * H, workloads=((0, VLLM, 8.0),)))

    assert stored(path, "SELECT hour, held_s, busy_s, dollars, joules FROM workload_hours ORDER BY hour") == [
        (int(T0 - H), 1800.0, 900.0, 2.0, 200.0),
        (int(T0), 3600.0, 1800.0, 4.0, 400.0),
        (int(T0 + H), 1800.0, 900.0, 2.0, 200.0),
    ]
    assert stored(path, "SELECT hour, observed_s, dollars FROM gpu_hours ORDER BY hour") == [
        (int(T0 - H), 1800.0, 2.0),
        (int(T0), 3600.0, 4.0),
        (int(T0 + H), 1800.0, 2.0),
    ]


def test_hour_shares_for_uneven_and_empty_intervals() -> None:
    # 18:40 -> 19:10: 1200 s of 1800 s before 19:00 (2/3), 600 s after (1/3)
    shares = hour_shares(T0 + 2400, T0 + H + 600)
    assert [h for h, _ in shares] == [int(T0), int(T0 + H)]
    assert [s for _, s in shares] == pytest.approx([2 / 3, 1 / 3], rel=1e-15)
    assert hour_shares(T0 + 10, T0 + 10) == [(int(T0), 1.0)]
    assert hour_shares(T0, T0 + H) == [(int(T0), 1.0)]  # ends exactly on the next hour: one hour


def test_retention_deletes_only_hours_older_than_it(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    clock = ManualClock(T0 + 0.5 * H)
    with Ledger(path, retention_s=2 * 86400, clock=clock) as ledger:
        for days_ago in (3, 2, 1):
            hour = T0 - days_ago * 86400
            ledger.add(charges(hour, hour + 60, idle=((1, 1.0),)))
        ledger.add(charges(T0, T0 + 60))
        assert ledger.flush()
    # now - 2 days falls in the hour T0 - 2d, which is kept whole; only the hour a day before it goes
    hours = [h for (h,) in stored(path, "SELECT DISTINCT hour FROM workload_hours ORDER BY hour")]
    assert hours == [int(T0 - 2 * 86400), int(T0 - 86400), int(T0)]
    assert [h for (h,) in stored(path, "SELECT DISTINCT hour FROM gpu_hours ORDER BY hour")] == hours

    clock.t += 86400  # a day later the next flush ages out one more day, with nothing new to write
    with Ledger(path, retention_s=2 * 86400, clock=clock) as ledger:
        assert ledger.flush()
    assert [h for (h,) in stored(path, "SELECT DISTINCT hour FROM workload_hours ORDER BY hour")] == hours[1:]


def test_no_retention_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with Ledger(path, retention_s=None, clock=ManualClock(T0 + 1000 * 86400)) as ledger:
        ledger.add(charges(T0, T0 + 60))
    assert total_dollars(path) == 1.0


def test_read_usage_reads_hours_overlapping_the_range(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with Ledger(path) as ledger:
        for i in range(4):
            ledger.add(charges(T0 + i * H, T0 + i * H + 60, workloads=((0, VLLM, 1.0),), idle=((1, 0.5),)))
    rows = read_usage(path, since=T0 + H + 1800, until=T0 + 3 * H)  # half of hour 1, all of hour 2
    assert sorted({r.hour for r in rows}) == [int(T0 + H), int(T0 + 2 * H)]
    idle = [r for r in rows if r.idle]
    assert [(r.gpu, r.held_s, r.dollars, r.workload) for r in idle] == [(1, 60.0, 0.5, Workload())] * 2
    assert [(r.gpu, r.charged_s) for r in idle] == [(1, 60.0)] * 2  # idle time is charged to the idle row
    assert [(r.gpu, r.held_s, r.charged_s) for r in rows if not r.idle] == [(0, 60.0, 60.0)] * 2
    assert not any(r.unobserved for r in rows)  # every second was observed
    assert len(read_usage(path, since=None, until=None)) == 8


# --- opening ---


def test_missing_directory_is_a_ledger_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    with pytest.raises(LedgerError, match=f"directory {missing} does not exist"):
        Ledger(missing / "ledger.db")


def test_a_file_that_is_not_a_database_is_a_ledger_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    path.write_bytes(b"certainly not SQLite " * 100)
    with pytest.raises(LedgerError, match=f"ledger {path}: cannot open: file is not a database"):
        Ledger(path)
    with pytest.raises(LedgerError, match=f"ledger {path}"):
        read_usage(path, since=None, until=None)


def test_another_programs_database_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("CREATE TABLE invoices (id INTEGER)")
    with pytest.raises(LedgerError, match="not a gpuledger ledger"):
        Ledger(path)
    assert stored(path, "SELECT name FROM sqlite_schema") == [("invoices",)]


def test_a_newer_schema_is_refused_in_one_line_naming_the_file_and_versions(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    Ledger(path).close()
    newer = SCHEMA_VERSION + 1
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("INSERT INTO schema_version VALUES (?, 0)", (newer,))
    for opening in (lambda: Ledger(path), lambda: read_usage(path)):
        with pytest.raises(LedgerError) as caught:
            opening()
        message = str(caught.value)
        assert message == (
            f"ledger {path}: schema version {newer} is newer than this gpuledger reads "
            f"(versions 1 to {SCHEMA_VERSION}): upgrade gpuledger"
        )
        assert "\n" not in message
    assert stored(path, "SELECT MAX(version) FROM schema_version") == [(newer,)]  # left as it was


def test_read_usage_never_creates_a_file(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with pytest.raises(LedgerError, match=f"ledger {path}: no such file"):
        read_usage(path, since=None, until=None)
    assert not path.exists()


def test_closed_ledger_refuses_work(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.db")
    ledger.close()
    ledger.close()  # twice is harmless
    with pytest.raises(LedgerError, match="closed"):
        ledger.add(charges(T0, T0 + 1))
    with pytest.raises(LedgerError, match="closed"):
        ledger.flush()


def test_non_finite_figures_are_refused_not_stored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # One NaN summed into a stored row would make that row NaN for good.
    path = tmp_path / "ledger.db"
    with Ledger(path) as ledger:
        ledger.add(charges(T0, T0 + 60, workloads=((0, VLLM, math.nan),)))
        ledger.add(charges(T0, T0 + 60, workloads=((0, VLLM, math.inf),)))
        ledger.add(charges(0.0, T0))  # an interval back to 1970: a clock error
        ledger.add(charges(T0, T0 + 60, workloads=((0, VLLM, 1.0),)))
        assert ledger.rejected_charges == 5  # NaN and inf: a workload and a GPU charge each; one interval
    assert stored(path, "SELECT dollars FROM workload_hours") == [(1.0,)]
    assert len([r for r in caplog.records if "refusing" in r.getMessage()]) == 1


# --- a flush that cannot write ---


def test_flush_failure_keeps_rows_logs_once_and_recovers_exactly_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another connection holds the write lock (BEGIN EXCLUSIVE), as a `sqlite3` shell or a backup
    would. chmod cannot make the file read-only to root, and a full tmpfs needs a mount; a held
    lock makes SQLite refuse the write (SQLITE_BUSY) on every filesystem, for every user, at once:
    the ledger waits only its busy timeout, 10 ms here. Every sqlite3 error takes the same path."""
    caplog.set_level(logging.INFO, logger="gpuledger.ledger")
    path = tmp_path / "ledger.db"
    clock = ManualClock(T0 + 2 * H)
    ledger = Ledger(path, clock=clock, busy_timeout_s=0.01)
    ledger.add(charges(T0, T0 + 60, workloads=((0, VLLM, 1.0),)))
    assert ledger.flush()
    assert ledger.last_flush_at == T0 + 2 * H

    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    ledger.add(charges(T0 + 60, T0 + 120, workloads=((0, VLLM, 2.0),)))
    for n in range(3):
        clock.t += 60
        assert ledger.flush() is False
        assert not ledger.healthy
        # more usage arrives while the disk is refused, some in an hour not seen before
        ledger.add(charges(T0 + H + n * 60, T0 + H + (n + 1) * 60, workloads=((0, VLLM, 0.5),)))
    assert ledger.pending_rows == 4  # hours T0 and T0+H, a workload row and a GPU row each
    assert ledger.last_flush_at == T0 + 2 * H
    failing = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(failing) == 1
    assert f"ledger {path}: cannot write (database is locked)" in failing[0].getMessage()
    # What the holder can see: only the first flush.
    assert holder.execute("SELECT SUM(dollars) FROM workload_hours").fetchone() == (1.0,)

    holder.execute("COMMIT")
    holder.close()
    clock.t += 60
    assert ledger.flush()
    assert ledger.healthy
    assert ledger.pending_rows == 0
    assert ledger.last_flush_at == clock.t
    recovered = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert recovered == [f"ledger {path}: writing again after 3 failed flushes; 4 hourly rows written"]
    assert ledger.flush()  # nothing pending: nothing written twice
    ledger.close()

    assert stored(path, "SELECT hour, dollars FROM workload_hours ORDER BY hour") == [
        (int(T0), 3.0),
        (int(T0 + H), 1.5),
    ]
    assert stored(path, "SELECT SUM(dollars) FROM gpu_hours") == [(4.5,)]
    assert len(caplog.records) == 2


@contextmanager
def another_writer_holds(path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection holding the ledger's write lock (a `sqlite3` shell, a backup) until
    the block ends; then it lets go of it, having written nothing."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield holder
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_close_logs_what_it_could_not_write(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(path, busy_timeout_s=0.01)
    with another_writer_holds(path):
        ledger.add(charges(T0, T0 + 60, workloads=((0, VLLM, 1.25),), idle=((1, 1.0),)))
        assert ledger.close() is False
    assert ledger.close() is False  # asked again, the answer stands
    assert [r.levelname for r in caplog.records] == ["WARNING", "ERROR"]
    assert "closing with 3 hourly rows ($2.25) that could not be written" in caplog.records[1].getMessage()


def test_close_within_a_bound_waits_on_a_locked_file_no_longer_than_the_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon's shutdown grace (4.5 s) is shorter than the busy timeout (5 s): a close bounded
    by what the grace leaves gives up on the locked file in time to log the lost rows."""
    path = tmp_path / "ledger.db"
    ledger = Ledger(path)  # the default busy timeout, 5 s
    with another_writer_holds(path):
        ledger.add(charges(T0, T0 + 60, workloads=((0, VLLM, 1.25),), idle=((1, 1.0),)))
        started = time.monotonic()
        assert ledger.close(within_s=0.3) is False
        assert time.monotonic() - started < 2.0
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [f"ledger {path}: closing with 3 hourly rows ($2.25) that could not be written"]


def test_close_within_a_bound_does_not_wait_out_a_flush_already_waiting_on_a_locked_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The periodic flush may be waiting its 5 s busy timeout when SIGTERM comes: the close does
    not queue behind it for the flush lock past its bound, and says the rows are lost."""
    path = tmp_path / "ledger.db"
    ledger = Ledger(path)
    flushed: list[bool] = []
    flushing = threading.Thread(target=lambda: flushed.append(ledger.flush()))
    try:
        with another_writer_holds(path):
            ledger.add(charges(T0, T0 + 60, workloads=((0, VLLM, 1.25),), idle=((1, 1.0),)))
            flushing.start()
            until = time.monotonic() + 2.0
            while ledger._flushing_since is None and time.monotonic() < until:  # the flush waits on the lock
                time.sleep(0.01)
            time.sleep(0.05)
            ledger.add(charges(T0 + H, T0 + H + 60, workloads=((0, VLLM, 1.0),)))  # pending beside the flush's
            started = time.monotonic()
            assert ledger.close(within_s=0.3) is False
            assert time.monotonic() - started < 2.0
    finally:
        if flushing.ident is not None:  # started
            flushing.join(10)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert errors[0].startswith(f"ledger {path}: closing while a flush has not returned in 0.3s")
    assert errors[0].endswith("2 more hourly rows ($1.00) could not be written")
    assert flushed == [True]  # the lock went: the flush that waited wrote its rows
    ledger.close()  # the bounded close left the file open to the flush that waited on it


def test_a_flush_stuck_in_the_filesystem_reads_as_failing_and_never_blocks_a_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A flush blocked in the filesystem (a hung NFS mount, a dead disk) never returns and never
    fails: it must still read as failing (gpuledger_ledger_up 0, what the alert watches), and a
    poll that adds past `max_pending_rows` meanwhile must drop the oldest hours, as in any
    outage, not wait behind it for the flush lock. The hang is a write that waits on an event."""
    caplog.set_level(logging.INFO, logger="gpuledger.ledger")
    path = tmp_path / "ledger.db"
    ledger = Ledger(path, max_pending_rows=4, stuck_after_s=0.2)
    release = threading.Event()
    real_write = ledger._write

    def hung_write(*args: Any) -> None:
        release.wait(10)  # bounded, so a failing test cannot hang the suite
        real_write(*args)

    monkeypatch.setattr(ledger, "_write", hung_write)
    ledger.add(charges(T0, T0 + 60))
    flushing = threading.Thread(target=ledger.flush, daemon=True)
    flushing.start()
    time.sleep(0.05)
    assert ledger.healthy  # a flush under way is not yet a stuck one
    time.sleep(0.3)
    assert not ledger.healthy
    stuck = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert stuck == [
        f"ledger {path}: a flush has not returned in 0.2s (the filesystem does not answer); "
        "charges are kept in memory, the oldest hours dropped past ledger.max_pending_rows"
    ]
    assert not ledger.healthy  # said once
    # Six hours of charges while the flush hangs: more rows than may wait, so a poll would call
    # for room (a flush) before each part. It returns at once, the oldest hours dropped.
    adding = threading.Thread(target=ledger.add, args=(charges(T0 + H, T0 + 7 * H),), daemon=True)
    adding.start()
    adding.join(2.0)
    assert not adding.is_alive()
    assert ledger.dropped_rows > 0
    release.set()  # the filesystem answers again
    flushing.join(5.0)
    assert not flushing.is_alive()
    assert ledger.healthy
    assert ledger.flush()
    ledger.close()
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2  # the stall, the drop


def test_report_can_read_while_the_agent_holds_the_write_lock(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with Ledger(path) as ledger:
        ledger.add(charges(T0, T0 + 60))
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN EXCLUSIVE")
    writer.execute("UPDATE workload_hours SET dollars = 99")
    assert [r.dollars for r in read_usage(path, since=None, until=None)] == [1.0]  # WAL: the committed state
    writer.execute("ROLLBACK")
    writer.close()


# --- crash safety ---

# The child: an agent that adds synthetic charges and flushes as often as it can. It prints
# "flushing X" before each flush and "flushed X" after it, X being everything this run has added,
# so a kill between the commit and the second print is still accounted for exactly.
CHILD = r"""
import random, sys
from agent.model import Charges, GpuCharge, Workload, WorkloadCharge
from agent.ledger.store import Ledger

path, seed, t = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rng = random.Random(seed)
ledger = Ledger(path, retention_s=None)
print("ready", flush=True)
workloads = [Workload(namespace="ns", pod=f"pod-{i}", model=f"m{i % 3}") for i in range(6)]
total = 0.0
while True:
    for _ in range(rng.randint(1, 6)):
        dt = rng.uniform(1.0, 2400.0)
        wcs, gcs = [], []
        for gpu in range(4):
            cost = rng.uniform(1.0, 4.0) * dt / 3600
            holders = rng.sample(workloads, rng.randint(0, 3))
            shares = [cost / len(holders) for _ in holders]
            for w, d in zip(holders, shares):
                wcs.append(WorkloadCharge(gpu, f"GPU-{gpu}", w, dt, dt * rng.random(), d, d * 1e5))
            idle = 0.0 if holders else cost
            gcs.append(GpuCharge(gpu, f"GPU-{gpu}", "H100", 3.0, dt, cost, dt if idle else 0.0, idle, 0.0, 1.0, 0.0))
            total += sum(shares) + idle
        ledger.add(Charges(t, t + dt, "node-a", tuple(wcs), tuple(gcs)))
        t += dt
    print(f"flushing {total!r}", flush=True)
    if ledger.flush():
        print(f"flushed {total!r}", flush=True)
"""

CRASH_RUNS = 50


def _last(lines: list[str], word: str) -> tuple[int, float]:
    """(line number, value) of the last "<word> X" line; (-1, 0.0) when there is none."""
    for number in range(len(lines) - 1, -1, -1):
        parts = lines[number].split()
        # the kill may cut the last line short: only a whole line (newline written) counts
        if len(parts) == 2 and parts[0] == word and number < len(lines) - 1:
            return number, float(parts[1])
    return -1, 0.0


def test_sigkill_at_random_moments_never_corrupts_or_loses_a_flush(tmp_path: Path) -> None:
    seed = int(os.environ.get("GPULEDGER_CRASH_SEED", random.randrange(2**32)))
    print(f"crash test seed {seed} (rerun with GPULEDGER_CRASH_SEED={seed})")
    rng = random.Random(seed)
    path = tmp_path / "ledger.db"
    flushed_so_far = 0.0  # everything any run committed, tracked from what the children printed
    kills_in_flush = kills_after_commit = flushes = 0
    began = time.monotonic()
    for run in range(CRASH_RUNS):
        out_path = tmp_path / f"child-{run}.out"
        with out_path.open("w") as out:
            child = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(path), str(rng.randrange(2**32)), str(T0 + run * 5 * H)],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.PIPE,
            )
            # Every fifth run dies while starting up or opening the file; the rest while working.
            if run % 5 != 4:
                deadline = time.monotonic() + 20
                while not out_path.read_text().startswith("ready\n"):
                    assert child.poll() is None, f"seed {seed} run {run}: child died before it was ready"
                    assert time.monotonic() < deadline, f"seed {seed} run {run}: child never got ready"
                    time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.25))
            child.kill()  # SIGKILL
            _, err = child.communicate()
        assert child.returncode == -9, f"seed {seed} run {run}: {err.decode()}"
        lines = out_path.read_text().split("\n")
        flushed_line, flushed = _last(lines, "flushed")
        flushing_line, flushing = _last(lines, "flushing")
        if not path.exists():  # killed before the very first open: nothing to check yet
            assert run % 5 == 4
            assert flushed_line == -1
            continue

        with Ledger(path, retention_s=None):  # the agent can open it again
            pass
        with closing(sqlite3.connect(path)) as conn, conn:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)], f"seed {seed} run {run}"
        on_disk = total_dollars(path)
        assert on_disk >= (flushed_so_far + flushed) * (1 - 1e-9), f"seed {seed} run {run}: a flush was lost"
        # Either the last flush that said "flushed" is the last on disk, or the kill fell between
        # a commit and its "flushed" line and the one announced by "flushing" is on disk too.
        candidates = [flushed_so_far + flushed]
        if flushing_line > flushed_line:
            candidates.append(flushed_so_far + flushing)
        matches = [c for c in candidates if math.isclose(on_disk, c, rel_tol=1e-9, abs_tol=1e-12)]
        assert matches, f"seed {seed} run {run}: on disk {on_disk!r}, expected one of {candidates!r}"
        flushes += sum(line.startswith("flushed ") for line in lines)
        kills_in_flush += flushing_line > flushed_line
        kills_after_commit += matches[0] != candidates[0]
        flushed_so_far = matches[0]
    elapsed = time.monotonic() - began
    print(
        f"{CRASH_RUNS} kills in {elapsed:.1f} s, {flushes} flushes; {kills_in_flush} kills inside a flush, "
        f"{kills_after_commit} of them after its commit; ${flushed_so_far:,.2f} on disk"
    )
    assert flushed_so_far > 0
