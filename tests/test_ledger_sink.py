"""The daemon's ledger: a ledger that cannot be opened never stops polling or loses charges."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

import pytest

from agent.ledger.sink import LedgerSink
from agent.ledger.store import Ledger
from agent.model import LedgerHealth, Price
from agent.pipeline import Costing
from tests.helpers import Rig
from tests.test_ledger import T0, TRAIN, VLLM, ManualClock, charges, stored


def test_a_ledger_that_cannot_open_keeps_charges_until_it_can(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="agent.ledger.sink")
    blocker = tmp_path / "state"
    blocker.write_text("a file where the ledger's directory should be")
    sink = LedgerSink(blocker / "ledger.db", retention_s=None)
    rig = Rig(
        {"gpus": [{"count": 1}], "processes": [{"pid": 1, "gpus": [0], "sm_util": 50, "user": "ann", "uid": 1001}]},
        costing=Costing(prices=lambda s: {g.uuid: Price(3.6, "test") for g in s.gpus}, sink=sink),
    )
    try:
        state = rig.run(600, 60)  # ten minutes of polls while the ledger cannot open
        assert state.snapshot is not None
        assert len(state.snapshot.gpus) == 1  # polling and exporting go on
        assert state.ledger is not None
        assert not state.ledger.healthy
        # Every interval's charges are kept, summed per hour and key (bounded memory): the ten
        # minutes fall in one hour, so one row for ann's workload and one for the GPU.
        assert state.ledger.pending_rows == 2
        for _ in range(3):
            assert sink.flush() is False
        opened = [r for r in caplog.records if "cannot be opened" in r.getMessage()]
        assert len(opened) == 1  # one line for the outage, not one per retry
        blocker.unlink()  # the operator fixes the disk
        assert sink.flush() is True
        assert sink.health().healthy
    finally:
        rig.close()
        sink.close()
    with sqlite3.connect(blocker / "ledger.db") as conn:
        (dollars,) = conn.execute("SELECT sum(dollars) FROM workload_hours").fetchone()
    assert dollars == pytest.approx(600 * 3.6 / 3600)  # ann held the GPU for all ten minutes


def test_write_behind_leaves_the_same_ledger_and_healths_as_flushing_in_place(tmp_path: Path) -> None:
    """`simulate` flushes behind: the flush's fsync overlaps the next poll. Everything the ledger
    is told, and everything it reports, must be what flushing in place gives, in simulate's
    rhythm: a charge per 15 s step, a flush every fourth, the clock moving on right after it."""
    runs: dict[bool, tuple[list[LedgerHealth], list[tuple[object, ...]]]] = {}
    for write_behind in (False, True):
        clock = ManualClock(T0)
        path = tmp_path / f"behind-{write_behind}.db"
        sink = LedgerSink(path, retention_s=None, clock=clock, write_behind=write_behind)
        healths = []
        for step in range(1, 13):
            sink.add(charges(clock.t, clock.t + 15, workloads=((0, VLLM, 0.25 * step), (1, TRAIN, 0.5))))
            healths.append(sink.health())
            if step % 4 == 0:
                assert sink.flush() is True
            clock.t += 15  # the next step begins while a flush behind may still be writing
            healths.append(sink.health())
        sink.close()
        runs[write_behind] = (healths, stored(path, "SELECT * FROM workload_hours ORDER BY gpu"))
    assert runs[True] == runs[False]
    healths = runs[True][0]
    # A flush is stamped with the clock at the moment it was asked for, not when it committed.
    assert healths[7].last_flush_at == T0 + 3 * 15  # step 4 began at T0 + 45 and flushed then
    assert healths[7].pending_rows == 0
    # 0.25 + 0.5 + ... + 3.0 dollars on GPU 0 (0.25 x (1 + ... + 12) = 0.25 x 78 = 19.5), 12 x 0.5 on GPU 1
    dollars = stored(tmp_path / "behind-True.db", "SELECT dollars FROM workload_hours ORDER BY gpu")
    assert [d for (d,) in dollars] == [pytest.approx(19.5), pytest.approx(6.0)]


def test_charges_added_while_a_flush_behind_writes_reach_the_ledger_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next poll's charges arrive while the flush behind is still writing (simulate's
    rhythm on a busy disk): the poll does not wait for it, and the ledger gets them after the
    flush, so it ends as flushing in place leaves it: the first charge written, the later two
    pending, then all three in the file."""
    release, finished = threading.Event(), []
    flush_in_place = Ledger.flush

    def slow_flush(ledger: Ledger) -> bool:
        assert release.wait(10)  # the disk is slow until the test lets it finish
        written = flush_in_place(ledger)
        finished.append(written)
        return written

    monkeypatch.setattr(Ledger, "flush", slow_flush)
    runs: dict[bool, tuple[LedgerHealth, list[tuple[object, ...]]]] = {}
    for write_behind in (False, True):
        release.clear()
        finished.clear()
        if not write_behind:
            release.set()
        clock = ManualClock(T0)
        path = tmp_path / f"behind-{write_behind}.db"
        sink = LedgerSink(path, retention_s=None, clock=clock, write_behind=write_behind)
        sink.add(charges(T0, T0 + 15, workloads=((0, VLLM, 1.0),)))
        assert sink.flush() is True
        clock.t += 15
        sink.add(charges(T0 + 15, T0 + 30, workloads=((0, VLLM, 2.0),)))
        sink.add(charges(T0 + 30, T0 + 45, workloads=((1, TRAIN, 4.0),)))
        assert finished == ([] if write_behind else [True])  # behind: the adds did not wait for it
        release.set()
        health = sink.health()
        sink.close()
        runs[write_behind] = (health, stored(path, "SELECT gpu, dollars FROM workload_hours ORDER BY gpu"))
    assert runs[True] == runs[False]
    health, rows = runs[True]
    assert health.last_flush_at == T0  # the flush asked for at T0, before the clock moved on
    # After that flush: VLLM's row on GPU 0 (its second charge) and TRAIN's on GPU 1, each with
    # its GPU's row, all in the one hour: 4 rows pending.
    assert health.pending_rows == 4
    # 1.0 + 2.0 on GPU 0 (the first written by the flush, the second by close), 4.0 on GPU 1
    assert rows == [(0, pytest.approx(3.0)), (1, pytest.approx(4.0))]
