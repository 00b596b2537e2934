"""The daemon's ledger: a ledger that cannot be opened never stops polling or loses charges."""

from __future__ import annotations

import logging
import sqlite3
from contextlib import closing
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
    with closing(sqlite3.connect(blocker / "ledger.db")) as conn, conn:
        (dollars,) = conn.execute("SELECT sum(dollars) FROM workload_hours").fetchone()
    assert dollars == pytest.approx(600 * 3.6 / 3600)  # ann held the GPU for all ten minutes


def test_only_simulate_leaves_the_fsync_of_each_flush_to_the_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's flushes survive a power cut (synchronous=FULL, 2); `simulate` flushes every
    scenario minute, many times a second, and waits for the disk only at checkpoints
    (synchronous=NORMAL, 1), yet its ledger holds every flush once it has closed."""
    import agent.ledger.store
    from agent.cli.main import main
    from agent.cli.wiring import build_agent
    from agent.config import load_config

    levels: dict[str, int] = {}
    real_open = agent.ledger.store.open_file

    def noting_open(path: Path, *args: object, **kwargs: bool) -> sqlite3.Connection:
        conn = real_open(path, *args, **kwargs)  # type: ignore[arg-type]
        levels[path.name] = conn.execute("PRAGMA synchronous").fetchone()[0]
        return conn

    monkeypatch.setattr(agent.ledger.store, "open_file", noting_open)
    assert main(["simulate", "demo", "--for", "2h", "--ledger", str(tmp_path / "simulated.db")]) == 0
    daemon = build_agent(load_config(None), fake="demo", ledger_path=tmp_path / "daemon.db")
    daemon.close()
    assert levels == {"simulated.db": 1, "daemon.db": 2}
    with closing(sqlite3.connect(tmp_path / "simulated.db")) as conn, conn:
        hours = conn.execute("SELECT count(DISTINCT hour) FROM gpu_hours").fetchone()[0]
    assert hours == 2  # both scenario hours reached the file


def test_a_second_agent_on_a_ledger_being_written_is_refused(tmp_path: Path) -> None:
    """Two agents writing one ledger would each charge every second of the node: the second
    (a `run` by hand beside the service, `simulate --append` into its ledger) is refused with
    one line, exit 1, and the ledger holds each second once."""
    from agent.ledger.files import LedgerInUse
    from agent.ledger.report import report_from_ledger
    from tests.test_cli import gpuledger

    path = tmp_path / "ledger.db"
    ann = {"pid": 1, "gpus": [0], "sm_util": 50, "user": "ann", "uid": 1001}
    scenario = {"gpus": [{"count": 1}], "processes": [ann]}

    def priced(sink: LedgerSink) -> Costing:
        return Costing(prices=lambda s: {g.uuid: Price(3.6, "test") for g in s.gpus}, sink=sink)

    first = LedgerSink(path, retention_s=None)
    rig = Rig(scenario, costing=priced(first))
    try:
        rig.run(600, 60)
        with pytest.raises(LedgerInUse, match=r"another gpuledger is writing it \(pid \d+"):
            LedgerSink(path, retention_s=None)
        # Another process: the simulation's scenario starts after the record ends (2026-11-20),
        # so only the lock stops it.
        later = tmp_path / "later.yaml"
        later.write_text("start: 2027-01-01T00:00:00Z\ngpus: [{count: 1}]\n")
        result = gpuledger("simulate", str(later), "--for", "1h", "--ledger", str(path), "--append")
        assert result.returncode == 1, result.stderr
        assert result.stderr.splitlines()[-1].startswith(f"gpuledger: ledger {path}: another gpuledger is writing it")
        assert "Traceback" not in result.stderr
    finally:
        rig.close()
        assert first.close()
    # ann held the GPU for the ten minutes: 600 s x $3.60/h = $0.60, once; TOTAL = 1 GPU x 600 s.
    report = report_from_ledger(path, by=["user"])
    assert report.total.dollars == pytest.approx(0.60)
    assert report.total.gpu_hours_charged == pytest.approx(600 / 3600)
    # Stopped, it lets go: the next agent writes on.
    second = LedgerSink(path, retention_s=None)
    assert second.recorded_until is not None
    assert second.close()
