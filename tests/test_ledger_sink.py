"""The daemon's ledger: a ledger that cannot be opened never stops polling or loses charges."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from agent.ledger.sink import LedgerSink
from agent.model import Price
from agent.pipeline import Costing
from tests.helpers import Rig


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
