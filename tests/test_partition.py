"""Time is a partition: every second of every GPU is charged to workloads, idle (observed,
held by nobody) or unobserved (nobody could see it), with the reason kept. Hand-worked cases
of what used to be booked as idle, or lost; each checks the partition adds up too."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from agent.cli.wiring import build_agent
from agent.config import Settings, load_catalogue
from agent.ledger.sink import LedgerSink
from agent.model import AgentState, Price
from agent.pipeline import Costing, Pipeline
from rules.engine import RuleSpec
from tests.helpers import WAITS_ON_REAL_TIME, Rig
from tests.test_cli import gpuledger

PRICE = 3.6  # $/GPU-hour: $0.001 a second, so seconds read as thousandths of a dollar


@pytest.fixture
def run() -> Iterator[Any]:
    rigs: list[Rig] = []

    def simulate(scenario: dict[str, Any], duration_s: float, step_s: float = 15.0) -> AgentState:
        prices = lambda snapshot: {g.uuid: Price(PRICE, "test") for g in snapshot.gpus}  # noqa: E731
        rig = Rig(scenario, costing=Costing(prices=prices, max_interval_s=300.0))
        rigs.append(rig)
        return rig.run(duration_s, step_s)

    yield simulate
    for rig in rigs:
        rig.close()


def partition(state: AgentState) -> tuple[float, float, dict[str, float]]:
    """(charged to workloads, idle, unobserved by reason) in dollars, over every GPU."""
    charged = sum(w.dollars for w in state.costs.workloads.values())
    idle = sum(g.idle_dollars for g in state.costs.gpus.values())
    unobserved: dict[str, float] = {}
    for g in state.costs.gpus.values():
        for reason, (_seconds, dollars) in g.unobserved_by_reason.items():
            unobserved[reason] = unobserved.get(reason, 0.0) + dollars
    return charged, idle, unobserved


BUSY = {"pid": 1, "gpus": [0], "sm_util": 70, "memory_mib": 1000, "uid": 1000, "user": "ann"}


def test_a_process_list_timeout_is_unobserved_not_idle(run: Any) -> None:
    # 20 minutes at 15 s steps; the process list times out from 10:00 to 12:00. The polls at
    # 10:00, 10:15, ..., 11:45 (8 of them) cannot say who held the GPU: the 8 intervals ending
    # there, 8 x 15 s = 120 s, are unobserved, $0.120. Before, they were idle while the job ran.
    scenario = {
        "gpus": [{"count": 1}],
        "processes": [BUSY],
        "faults": [{"at": "10m", "until": "12m", "call": "nvmlDeviceGetComputeRunningProcesses", "error": "TIMEOUT"}],
    }
    charged, idle, unobserved = partition(run(scenario, 1200))
    assert idle == 0.0
    assert unobserved == {"processes_unreadable": pytest.approx(0.120)}
    assert charged == pytest.approx(1.080)  # the other 1080 s: 1200 - 120
    assert charged + idle + sum(unobserved.values()) == pytest.approx(1200 * PRICE / 3600)  # $1.20


def test_a_transient_not_supported_is_retried_not_learned(run: Any) -> None:
    # NOT_SUPPORTED on the process list from 5:00 to 15:00, after it had worked: read again
    # each poll, so the job is seen again at 15:00 and charged from then to 30:00 as before
    # 5:00. Before, the first NOT_SUPPORTED was learned for good: 0 processes for the rest of
    # the run, and the 90% job's dollars went to idle.
    scenario = {
        "gpus": [{"count": 1}],
        "processes": [BUSY],
        "faults": [
            {"at": "5m", "until": "15m", "call": "nvmlDeviceGetComputeRunningProcesses", "error": "NOT_SUPPORTED"}
        ],
    }
    state = run(scenario, 1800)
    charged, idle, unobserved = partition(state)
    # Unobserved: the 40 intervals ending at 5:00 .. 14:45, 600 s = $0.600; charged: 1200 s.
    assert unobserved == {"processes_unreadable": pytest.approx(0.600)}
    assert charged == pytest.approx(1.200)
    assert idle == 0.0
    assert state.snapshot is not None
    assert [p.pid for p in state.snapshot.devices[0].processes] == [1]  # seen again


def test_a_lost_gpu_is_unobserved_with_its_error_not_idle(run: Any) -> None:
    # Two idle GPUs for 10 minutes; GPU 1 falls off the bus at 4:00 (sticky). GPU 0: 600 s
    # idle, $0.600. GPU 1: idle from 0:00 to 3:45 (225 s, $0.225); from the poll at 4:00 it is
    # down, so the intervals from 3:45 to 10:00 (375 s, $0.375) are unobserved as GPU_IS_LOST.
    # Before, a lost GPU went on accruing idle seconds.
    scenario = {"gpus": [{"count": 2}], "faults": [{"at": "4m", "gpu": 1, "error": "GPU_IS_LOST"}]}
    charged, idle, unobserved = partition(run(scenario, 600))
    assert charged == 0.0
    assert idle == pytest.approx(0.600 + 0.225)
    assert unobserved == {"GPU_IS_LOST": pytest.approx(0.375)}
    assert charged + idle + sum(unobserved.values()) == pytest.approx(2 * 600 * PRICE / 3600)  # $1.20


def test_a_driver_outage_is_unobserved_not_idle(run: Any) -> None:
    # One GPU, nobody on it, 30 minutes; the driver is gone from 10:00 to 20:00. The poll at
    # 10:00 finds it gone; re-initialisation then backs off (5 s, 10 s, ... doubling, polls
    # every 15 s) and first succeeds at the poll at 21:00. Unobserved: 9:45 to 21:00, 675 s,
    # $0.675, all as DRIVER_NOT_LOADED; idle: the other 1125 s, $1.125. Before, the outage
    # was booked as idle.
    scenario = {"gpus": [{"count": 1}], "faults": [{"at": "10m", "until": "20m", "error": "DRIVER_NOT_LOADED"}]}
    charged, idle, unobserved = partition(run(scenario, 1800))
    assert charged == 0.0
    assert unobserved == {"DRIVER_NOT_LOADED": pytest.approx(0.675)}
    assert idle == pytest.approx(1.125)
    assert charged + idle + sum(unobserved.values()) == pytest.approx(1800 * PRICE / 3600)  # $1.80


def simulated_ledger(tmp_path: Path, scenario: str, *simulate_args: str) -> Path:
    """The ledger of the scenario simulated (`simulate_args`: --for, ...) at PRICE a GPU-hour
    and $0.12 a kWh."""
    path = tmp_path / "scenario.yaml"
    path.write_text(scenario)
    config = tmp_path / "config.yaml"
    config.write_text(f"pricing: {{gpu_hourly: {PRICE}, energy_per_kwh: 0.12}}\n")
    ledger = tmp_path / "ledger.db"
    result = gpuledger("simulate", str(path), *simulate_args, "--config", str(config), "--ledger", str(ledger))
    assert result.returncode == 0, result.stderr
    return ledger


def report_by_user(tmp_path: Path, scenario: str, *simulate_args: str) -> dict[str, Any]:
    """`report --by user --format json` of the scenario simulated into a fresh ledger."""
    ledger = simulated_ledger(tmp_path, scenario, *simulate_args)
    report = gpuledger("report", "--ledger", str(ledger), "--by", "user", "--format", "json")
    assert report.returncode == 0, report.stderr
    document: dict[str, Any] = json.loads(report.stdout)
    return document


def test_energy_counted_while_nobody_could_see_the_gpu_is_unobserved_not_the_next_holders(tmp_path: Path) -> None:
    # ann runs at 50% on one GPU for 30 minutes: 50 W idle + 50% of the 350 W up to its 400 W
    # limit = 225 W throughout, 225 W x 1800 s = 405,000 J on its counter. From 10:00 to 20:00
    # every call on the GPU times out: the 40 intervals ending at the polls 10:00 .. 19:45
    # (9:45 to 19:45, 600 s, $0.600) are unobserved, and the counter is not read from 9:45 until
    # 20:00. Its 225 W x 615 s then are the gap's; ann held the GPU for the 15 s of the interval
    # that ended it (225 x 15 = 3,375 J), and nobody saw who used it in the other 600 s
    # (135,000 J). Before, all 138,375 J were charged to ann.
    # ann: 225 W x 1200 s observed = 270,000 J; unobserved: 135,000 J; 270,000 + 135,000 = 405,000.
    # At $0.12/kWh: 270,000 J = 0.075 kWh = $0.009; 135,000 J = 0.0375 kWh = $0.0045.
    document = report_by_user(
        tmp_path,
        "node: {hostname: n1}\n"
        "gpus: [{count: 1, power_limit_w: 400, idle_power_w: 50}]\n"
        "processes: [{pid: 1, gpus: [0], sm_util: 50, memory_mib: 1000, uid: 1000, user: ann}]\n"
        'faults: [{at: 10m, until: 20m, gpu: 0, call: "*", error: TIMEOUT}]\n',
        "--for", "30m",
    )  # fmt: skip
    [ann] = document["rows"]
    assert ann["user"] == "ann"
    assert ann["energy_kwh"] == pytest.approx(0.075)
    assert ann["energy_dollars"] == pytest.approx(0.009)
    assert ann["dollars"] == pytest.approx(1.200)  # 1200 s x $0.001
    unobserved = document["unobserved"]
    assert unobserved["dollars"] == pytest.approx(0.600)
    assert unobserved["energy_kwh"] == pytest.approx(0.0375)
    assert unobserved["energy_dollars"] == pytest.approx(0.0045)
    total = document["total"]
    assert total["energy_kwh"] == pytest.approx(0.1125)  # 405,000 J: all the counter counted
    assert total["dollars"] == pytest.approx(1800 * PRICE / 3600)  # $1.80 = $1.20 + $0.60 + $0 idle


def _stepped_agent(ledger: Path, offset: list[float], processes: tuple[dict[str, Any], ...] = (BUSY,)) -> Any:
    """The agent on one GPU that ann holds throughout (or `processes` run on), at $0.001 a
    second, writing `ledger`, whose clock reads the scenario's plus `offset[0]` (a host clock
    that can be set back), with the default flag rules."""

    def stepped(backend: Any) -> Any:
        clock = backend.clock
        backend.clock = lambda: clock() + offset[0]
        return backend

    sink = LedgerSink(ledger, retention_s=None, node="n1")
    prices = lambda snapshot: {g.uuid: Price(PRICE, "test") for g in snapshot.gpus}  # noqa: E731
    return build_agent(
        Settings(node_name="n1"),
        fake={"node": {"hostname": "n1"}, "gpus": [{"count": 1}], "processes": list(processes)},
        costing=Costing(prices=prices, sink=sink, max_interval_s=300.0),
        wrap_backend=stepped,
    )


def _watch(agent: Any, polls: int) -> None:
    """A poll now, then `polls` more, 15 s of scenario time apart."""
    agent.pipeline.poll_once()
    for _ in range(polls):
        agent.node.clock.advance(15)
        agent.pipeline.poll_once()


def _ledger_time(ledger: Path) -> tuple[float, float, float, float]:
    """(observed seconds, dollars, idle dollars, unobserved dollars) the ledger holds."""
    with closing(sqlite3.connect(ledger)) as db, db:
        found: tuple[float, float, float, float] = db.execute(
            "SELECT sum(observed_s), sum(dollars), sum(idle_dollars), sum(unobserved_dollars) FROM gpu_hours"
        ).fetchone()
    return found


def test_energy_counted_while_a_gpu_was_lost_is_unobserved_not_dropped(tmp_path: Path) -> None:
    # ann keeps one GPU 50% busy for 2h: 50 W idle + 50% of the 400 W up to its 450 W limit =
    # 250 W throughout, 250 W x 7200 s = 1,800,000 J = 0.5 kWh on its counter. The GPU is lost
    # from 30m to 60m (and found again at the sampler's next probe): its time from the poll before
    # the loss to the one after is unobserved, and so is the energy its counter counted then,
    # 250 W x those seconds. Before, the interval that ended the outage was charged no joules: the
    # outage's energy was nobody's and nowhere, and TOTAL fell short of the counter by it.
    # At $0.12/kWh: 0.5 kWh = $0.06 in all.
    document = report_by_user(
        tmp_path,
        "node: {hostname: n1}\n"
        "gpus: [{count: 1, power_limit_w: 450, idle_power_w: 50}]\n"
        "processes: [{pid: 1, gpus: [0], sm_util: 50, memory_mib: 1000, uid: 1000, user: ann}]\n"
        "faults: [{at: 30m, until: 60m, gpu: 0, error: GPU_IS_LOST}]\n",
        "--for", "2h", "--step", "60s",
    )  # fmt: skip
    [ann] = document["rows"]
    unobserved = document["unobserved"]
    unobserved_h = unobserved["gpu_hours_charged"]
    assert unobserved_h >= 0.5  # 30m lost, and the polls around it
    # 0.25 kW x the hours each: ann's observed hours, and the lost ones, nobody's.
    assert ann["energy_kwh"] == pytest.approx(0.25 * (2 - unobserved_h))
    assert unobserved["energy_kwh"] == pytest.approx(0.25 * unobserved_h)
    assert unobserved["energy_dollars"] == pytest.approx(0.25 * unobserved_h * 0.12)
    total = document["total"]
    assert total["energy_kwh"] == pytest.approx(0.5)  # 1,800,000 J: all the counter counted
    assert total["energy_dollars"] == pytest.approx(0.06)


def test_energy_counted_over_an_outage_goes_to_the_hours_of_the_outage_not_the_hour_it_ends(
    tmp_path: Path,
) -> None:
    # As above, 250 W throughout (50 W idle + 50% of the 400 W up to the 450 W limit), but the
    # GPU is lost from 30m to 90m, across the hour at 60m. The counter cannot be read meanwhile;
    # its 250 W x the gap's seconds arrive at the poll that ends the outage. Every hour holds
    # its own 250 W x 3600 s = 900,000 J, split by time like the outage's dollars: ann's
    # 250 W x her observed seconds of the hour, and the rest, 250 W x its unobserved seconds,
    # nobody's. Before, the second hour got all of the gap's energy (1,365,000 J) and the first
    # only ann's (435,000 J), though the GPU drew the same power in both.
    ledger = simulated_ledger(
        tmp_path,
        "start: 2026-11-20T18:00:00Z\n"
        "node: {hostname: n1}\n"
        "gpus: [{count: 1, power_limit_w: 450, idle_power_w: 50}]\n"
        "processes: [{pid: 1, gpus: [0], sm_util: 50, memory_mib: 1000, uid: 1000, user: ann}]\n"
        "faults: [{at: 30m, until: 90m, gpu: 0, error: GPU_IS_LOST}]\n",
        "--for", "2h", "--step", "60s",
    )  # fmt: skip
    with closing(sqlite3.connect(ledger)) as db, db:
        hours = db.execute(
            "SELECT g.hour, g.observed_s, g.unobserved_s, g.joules, w.joules FROM gpu_hours g"
            " JOIN workload_hours w ON w.hour = g.hour AND w.uuid = g.uuid ORDER BY g.hour"
        ).fetchall()
    assert len(hours) == 2
    for _hour, observed_s, unobserved_s, gpu_joules, ann_joules in hours:
        assert unobserved_s >= 1800  # half of each hour lost, and the polls around it
        assert gpu_joules == pytest.approx(250 * 3600)  # 900,000 J
        assert ann_joules == pytest.approx(250 * observed_s)
        assert gpu_joules - ann_joules == pytest.approx(250 * unobserved_s)  # nobody's


def test_a_clock_set_back_never_charges_the_same_time_twice(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Polls every 15 s of scenario time for 20 minutes. At 10:00 the host's clock is set back 5
    # minutes (NTP stepping a clock that ran fast): the polls from then on read 5:15, 5:30, ...
    # The 5:00 to 10:00 the clock shows again were charged already, so nothing is charged until
    # the clock passes 10:00, and then from there: the ledger holds 0:00 to 15:00 on the clock,
    # 900 s, once: ann $0.900 at $0.001 a second, nothing idle or unobserved; 0.900 + 0 + 0 =
    # 900 s x $0.001. Before, the 5 minutes shown twice were charged twice: 1185 s, $1.185.
    caplog.set_level(logging.WARNING, logger="agent.pipeline")
    ledger, offset = tmp_path / "ledger.db", [0.0]
    agent = _stepped_agent(ledger, offset)
    try:
        agent.pipeline.poll_once()
        for step in range(1, 81):
            agent.node.clock.advance(15)
            if step == 41:  # scenario 10:15, the first poll after the step back
                offset[0] = -300.0
            state = agent.pipeline.poll_once()
    finally:
        agent.close()
    charged, idle, unobserved = partition(state)
    assert charged == pytest.approx(0.900)
    assert (idle, unobserved) == (0.0, {})
    observed, dollars, idle_dollars, unobserved_dollars = _ledger_time(ledger)
    assert observed == pytest.approx(900.0)
    assert dollars == pytest.approx(900 * PRICE / 3600)  # $0.900
    assert (idle_dollars, unobserved_dollars) == (0.0, 0.0)
    warnings = [r.getMessage() for r in caplog.records if "set back" in r.getMessage()]
    assert warnings == [  # said once, not at each of the 20 polls behind
        "the clock reads 2026-11-20T18:05:15Z, 4m45s before the time already charged (to 2026-11-20T18:10:00Z): "
        "it was set back; nothing is charged until it passes that time again"
    ]


def test_a_clock_set_back_restarts_a_flags_duration(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # One GPU nobody holds, polled every 15 s; its idle flag (30 min) raises at 30:00. At 40:15
    # the host's clock is set back 45 minutes (it reads -4:45). Before, the flag cleared with
    # "for=-285000ms" (-4:45 less 0:00, when it began) and raised again only once the clock read
    # 30:00 again, 34:45 later. Now it clears having held 40m, as seen to 40:00, and counts
    # again from the step: raised 30 min after it.
    caplog.set_level(logging.WARNING, logger="agent.pipeline")
    offset = [0.0]
    agent = _stepped_agent(tmp_path / "ledger.db", offset, processes=())
    raised_at = []
    try:
        agent.pipeline.poll_once()
        for step in range(1, 161 + 121):
            agent.node.clock.advance(15)
            if step == 161:  # scenario 40:15
                offset[0] = -2700.0
            state = agent.pipeline.poll_once()
            raised_at += [step * 15 for f in state.flags if f.rule == "idle" and f.raised and f.held_s == 1800]
    finally:
        agent.close()
    assert raised_at == [1800, 2415 + 1800]
    lines = [r.getMessage() for r in caplog.records if "rule=idle" in r.getMessage()]
    assert [line.split(" rule=")[0] for line in lines] == ["flag raised:", "flag cleared:", "flag raised:"]
    # Idle cost from 0:00 to 40:00, 2400 s at $0.001: $2.40; from the step on, the clock reads
    # time already charged, so nothing is charged again: $0.00 when it raises again.
    assert "for=40m cost_so_far=$2.40" in lines[1]
    assert "for=30m cost_so_far=$0.00" in lines[2]


def test_a_run_whose_clock_starts_before_the_ledgers_record_ends_charges_only_what_is_new(tmp_path: Path) -> None:
    # Run 1 watches 0:00 to 10:00 into the ledger. Run 2 starts on a host clock set back 5
    # minutes, at 5:00, and watches 10 minutes, to 15:00 on its clock: the 5:00 to 10:00 it
    # sees again are in the ledger already, so it charges 10:00 to 15:00 only. The ledger holds
    # 0:00 to 15:00 once: 900 s, ann $0.900; 0.900 + 0 idle + 0 unobserved = 900 s x $0.001.
    # Before, run 2 charged all its 600 s: 1200 s, $1.200.
    ledger = tmp_path / "ledger.db"
    for start, offset in ((0.0, 0.0), (600.0, -300.0)):
        agent = _stepped_agent(ledger, [offset])
        try:
            agent.node.clock.advance(start)  # run 2: 10:00 into the scenario, its clock at 5:00
            _watch(agent, 40)
        finally:
            agent.close()
    observed, dollars, idle_dollars, unobserved_dollars = _ledger_time(ledger)
    assert observed == pytest.approx(900.0)
    assert dollars == pytest.approx(900 * PRICE / 3600)
    assert (idle_dollars, unobserved_dollars) == (0.0, 0.0)


def test_a_clock_jumping_years_forward_is_charged_nowhere(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The agent starts before NTP has set the host's clock: it reads 1970-01-01T00:16:40Z. Polls
    # every 15 s; at the fifth, NTP sets the clock to the scenario's 2026-11-20T18:01:15Z, a jump
    # of nearly 57 years that no GPU time filled. ann is charged the 4 intervals before it and
    # the 3 after: 7 x 15 s = 105 s, $0.105 at $0.001 a second, in the counters and the ledger
    # alike; the jump is booked nowhere (as downtime over a year between two runs is not).
    # Before, the counters booked it unobserved (no_poll): 57 years x $3.60 an hour, about
    # $1.8 million, while the ledger refused it as too long.
    caplog.set_level(logging.WARNING, logger="agent.pipeline")
    ledger, offset = tmp_path / "ledger.db", [0.0]
    agent = _stepped_agent(ledger, offset)
    try:
        offset[0] = 1000.0 - agent.node.clock.wall_time()
        agent.pipeline.poll_once()
        for step in range(1, 9):
            agent.node.clock.advance(15)
            if step == 5:
                offset[0] = 0.0
            state = agent.pipeline.poll_once()
    finally:
        agent.close()
    [gpu] = state.costs.gpus.values()
    assert gpu.dollars == pytest.approx(0.105)  # 105 s x $0.001
    assert (gpu.idle_dollars, gpu.unobserved_dollars, dict(gpu.unobserved_by_reason)) == (0.0, 0.0, {})
    assert gpu.dollars + gpu.idle_dollars + gpu.unobserved_dollars == pytest.approx(105 * PRICE / 3600)
    observed, dollars, idle_dollars, unobserved_dollars = _ledger_time(ledger)
    assert observed == pytest.approx(105.0)
    assert dollars == pytest.approx(105 * PRICE / 3600)  # $0.105, as the counters
    assert (idle_dollars, unobserved_dollars) == (0.0, 0.0)
    assert [r.getMessage() for r in caplog.records if "jumped" in r.getMessage()] == [
        "the clock jumped forward 20777d17h43m35s, from 1970-01-01T00:17:40Z to 2026-11-20T18:01:15Z: "
        "more than a year, so a clock set late (at boot, before NTP), not time to charge; nothing is charged for it"
    ]


# -- utilization over the interval --------------------------------------------------------------


def bursty(busy_s: int, every_s: int, hours: float, util: int = 90) -> list[dict[str, Any]]:
    """An sm_util schedule: `util`% for busy_s seconds of every every_s seconds, each burst
    starting 2 s into its period (so that no burst straddles a poll at the period's start)."""
    points: list[dict[str, Any]] = [{"at": "0s", "sm_util": 0}]
    for start in range(2, int(hours * 3600), every_s):
        points += [{"at": f"{start}s", "sm_util": util}, {"at": f"{start + busy_s}s", "sm_util": 0}]
    return points


def test_bursty_work_reads_its_time_weighted_utilization(run: Any) -> None:
    # 90% for 5 s of every 15 s: 30% over time. The driver only keeps samples of periods with
    # work, so the mean of the samples present read 90%, and an hour booked 3240 busy seconds
    # (0.9 x 3600); the truth is 0.9 x 5/15 x 3600 = 1080.
    process = {**BUSY, "sm_util": bursty(5, 15, 1.0)}
    state = run({"gpus": [{"count": 1}], "processes": [process]}, 3600)
    [(_key, totals)] = state.costs.workloads.items()
    assert totals.busy_s == pytest.approx(1080, rel=0.01)
    holding = state.attribution.holdings[0]
    assert holding.sm_util == pytest.approx(0.30, abs=0.01)  # the last interval, within 1 point
    # The job held the GPU the whole hour: all of it is charged to it, 3600 s x $0.001 = $3.60.
    assert totals.dollars == pytest.approx(3.60)


def test_steady_work_still_reads_its_utilization_at_long_intervals(run: Any) -> None:
    # A steady 70% polled every minute, longer than the fake driver keeps samples (32 s): the
    # full ring covers only the last 32 s, so that is the span it is averaged over, not 60 s.
    state = run({"gpus": [{"count": 1}], "processes": [BUSY]}, 1800, step_s=60)
    [totals] = state.costs.workloads.values()
    assert state.attribution.holdings[0].sm_util == pytest.approx(0.70)
    assert totals.busy_s == pytest.approx(0.70 * 1800, rel=0.01)  # 1260 s


def test_a_process_that_starts_mid_interval_with_a_full_ring_is_not_credited_more_than_it_ran(run: Any) -> None:
    # Polls at 0 and 60 s. Ann runs at 40% throughout; bob starts at 28 s at 60%, so by 60 s
    # his 32-sample ring is full (29..60 s) though he lost nothing. His figure over the interval
    # is 32 x 60% / 60 periods = 0.32, and 0.60 over the 32 s he held the GPU (60/32 x 0.32).
    # Before, the full ring's mean (0.60) stood for the whole interval and was scaled up again
    # to 1.0 (60/32 x 0.60, capped): bob took 1/1.4 of the shared stretch and used more than he
    # was charged (efficiency 109%).
    bob = {**BUSY, "pid": 2, "uid": 1001, "user": "bob", "start": "28s", "sm_util": 60}
    state = run({"gpus": [{"count": 1}], "processes": [BUSY | {"sm_util": 40}, bob]}, 60, step_s=60)
    assert {h.pids: h.sm_util for h in state.attribution.holdings} == {(1,): 0.40, (2,): pytest.approx(0.32)}
    totals = {w.user: t for (_gpu, _uuid, w), t in state.costs.workloads.items()}
    # Bob: busy 32 s x 0.60 = 19.2 s; charged 0.60 / (0.40 + 0.60) of his 32 s = 19.2 s, $0.0192.
    assert totals["bob"].busy_s == pytest.approx(19.2)
    assert totals["bob"].busy_s <= totals["bob"].charged_s + 1e-9
    assert totals["bob"].dollars == pytest.approx(0.0192)
    # Ann: alone 0-28 s (28 s) plus 0.40 of 28-60 s (12.8 s) = 40.8 s, $0.0408; busy 60 x 0.40.
    assert totals["ann"].dollars == pytest.approx(0.0408)
    assert totals["ann"].busy_s == pytest.approx(24.0)
    charged, idle, unobserved = partition(state)
    assert charged + idle + sum(unobserved.values()) == pytest.approx(60 * PRICE / 3600)  # $0.06


# -- downtime between runs ------------------------------------------------------------------


def test_the_time_between_two_runs_is_unobserved_in_the_ledger(tmp_path: Path) -> None:
    # Run 1 watches an idle GPU from 0:00 to 0:10 into a ledger; run 2, on the same node and
    # ledger, starts at 1:00 (the scenario's clock moved on while nothing ran) and watches to
    # 1:10. The 50 minutes between, 3000 s x $0.001 = $3.000, are unobserved (agent_down), not
    # missing: the ledger then holds every second from 0:00 to 1:10, 4200 s = $4.20.
    ledger = tmp_path / "ledger.db"
    scenario = {"node": {"hostname": "n1"}, "gpus": [{"count": 1}]}
    prices = lambda snapshot: {g.uuid: Price(PRICE, "test") for g in snapshot.gpus}  # noqa: E731

    def watch(from_s: float) -> AgentState:
        sink = LedgerSink(ledger, retention_s=None, clock=lambda: 1_795_300_000.0, node="n1")
        rig = Rig(scenario, costing=Costing(prices=prices, sink=sink, max_interval_s=300.0))
        try:
            rig.node.clock.advance(from_s)
            return rig.run(600, 15)
        finally:
            rig.close()
            assert sink.close()

    watch(0)
    second = watch(3600)
    [gpu] = second.costs.gpus.values()
    assert gpu.unobserved_by_reason == {"agent_down": (pytest.approx(3000.0), pytest.approx(3.000))}
    with closing(sqlite3.connect(ledger)) as db, db:
        idle, unobserved, observed = db.execute(
            "SELECT sum(idle_dollars), sum(unobserved_dollars), sum(observed_s) FROM gpu_hours"
        ).fetchone()
    assert idle == pytest.approx(1.200)  # 2 x 600 s watched, nobody on the GPU
    assert unobserved == pytest.approx(3.000)
    assert idle + unobserved == pytest.approx(4200 * PRICE / 3600)  # $4.20: the whole span
    assert observed == pytest.approx(1200)


# -- who left it idle -------------------------------------------------------------------------


def test_the_idle_flag_and_the_metrics_name_who_left_the_gpu_idle(caplog: pytest.LogCaptureFixture) -> None:
    # Job 100 runs from 0:00 to 10:00, nobody from then until job 200 starts at 50:00. The idle
    # flag (30 min) raises at 40:00 and clears at 50:00; both lines, and the metrics while the
    # GPU sits idle, name job 100, last seen on it at the poll at 9:45. Before, the clearing
    # line named job 200, which ended the idle stretch, and nothing named job 100.
    scenario = {
        "gpus": [{"count": 1}],
        "processes": [
            {"pid": 1, "gpus": [0], "sm_util": 80, "end": "10m", "slurm_job": "100", "uid": 1000, "user": "ann"},
            {"pid": 2, "gpus": [0], "sm_util": 80, "start": "50m", "slurm_job": "200", "uid": 1001, "user": "bob"},
        ],
    }
    rig = Rig(scenario, flag_rules=[RuleSpec("idle", "idle", utilization_below=0.05, for_s=1800)])
    try:
        caplog.set_level("WARNING", logger="agent.pipeline")
        state = rig.run(45 * 60, 15)
        [left] = state.left_by
        assert [w.hpc_job for w in left.workloads] == ["100"]
        assert left.at == rig.node.clock.wall_time() - 45 * 60 + 9 * 60 + 45  # the poll at 9:45
        series = rig.samples(state, {"gpuledger_gpu_idle_left_by_timestamp_seconds"})
        assert [(labels["hpc_job"], value) for _name, labels, value in series] == [("100", left.at)]
        for _ in range(21):  # on to 50:15: job 200 holds it
            state = rig.poll(15)
        assert state.left_by == ()
        assert rig.samples(state, {"gpuledger_gpu_idle_left_by_timestamp_seconds"}) == []
    finally:
        rig.close()
    lines = [r.getMessage() for r in caplog.records if "rule=idle" in r.getMessage()]
    assert len(lines) == 2
    assert lines[0].startswith("flag raised")
    assert "left_by=job 100" in lines[0]
    assert lines[1].startswith("flag cleared")
    assert "left_by=job 100" in lines[1]
    assert "job 200" in lines[1]  # the workload that ended the stretch is still named as such


# -- a sped-up daemon charges what simulate charges ---------------------------------------------


def job_dollars(ledger: Path, job: str) -> float:
    with closing(sqlite3.connect(ledger)) as db, db:
        (dollars,) = db.execute("SELECT sum(dollars) FROM workload_hours WHERE hpc_job = ?", (job,)).fetchone()
    return float(dollars)


SERVING = re.compile(r"serving (http://[0-9.:]+)/metrics")


def last_poll(base: str) -> float | None:
    """The daemon's `gpuledger_last_poll_timestamp_seconds` (its fake clock), None before its first poll."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    found = re.search(r"^gpuledger_last_poll_timestamp_seconds ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else None


@WAITS_ON_REAL_TIME
def test_a_sped_up_clock_starts_with_the_first_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    # The scheduler is made half a real second late, as a loaded machine can make it. Had the clock
    # started with `start`, it would stand at 30 scenario seconds (60x) by the first poll, unwatched
    # time the job below lost from its bill; started by the first poll, it stands at what passes
    # between the hook and the poll's first reading (even 50 real ms of a busy machine: 3 s).
    late_start = Pipeline.start

    def slow_start(self: Pipeline) -> None:
        time.sleep(0.5)
        late_start(self)

    monkeypatch.setattr(Pipeline, "start", slow_start)
    agent = build_agent(Settings(node_name="rig"), fake="weekend-idle", fake_speed=60.0, costing=False, rules=())
    assert agent.node is not None
    clock = agent.node.clock
    first: list[tuple[float, float]] = []
    polled = threading.Event()
    poll = agent.pipeline.poll_once

    def watched_poll() -> Any:
        if not first:
            first.append((clock.now(), clock.speed))
            polled.set()
        return poll()

    monkeypatch.setattr(agent.pipeline, "poll_once", watched_poll)
    try:
        agent.start()
        assert polled.wait(10), "no poll within 10 s"
    finally:
        agent.close()
    at, speed = first[0]
    assert speed == 60.0
    assert 0.0 <= at < 15.0


@WAITS_ON_REAL_TIME
def test_a_sped_up_run_charges_the_job_what_simulate_charges(tmp_path: Path) -> None:
    # weekend-idle's job 9001 holds 8 GPUs for its 4 hours, then dies. `run --fake-speed 3600`
    # polled every 5 real seconds, 5 scenario hours, never saw it and booked it all as idle; a
    # sped-up node is now polled every 20 real ms (FAKE_MIN_POLL_S), and the job is charged what
    # simulate charges (at 1-minute steps: the job starts and ends on one, so simulate charges it
    # exactly, as at 15 s steps, in a quarter of the polls), but for its end. The clock starts
    # with the first poll, which sees the job start; its end falls between two polls (24
    # scenario seconds apart at 1200x: an unloaded run charges about one such interval more,
    # +0.17%), and on a loaded 2-core machine the poll after it can be late: CI saw the job short
    # by 1.4% and 1.9% (a poll 170 and 230 real ms late). So the band is 5%, 12 scenario minutes
    # (a poll 600 real ms late); a daemon that missed the job is 100% off.
    simulated, ran = tmp_path / "simulate.db", tmp_path / "run.db"
    sim = gpuledger("simulate", "weekend-idle", "--for", "5h", "--step", "1m", "--ledger", str(simulated), timeout=300)
    assert sim.returncode == 0, sim.stderr
    daemon = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--fake", "weekend-idle", "--fake-speed", "1200",
         "--listen", "127.0.0.1:0", "--ledger", str(ran)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # At 1200x the default 5 min max_interval is 250 real ms: on a loaded machine a late poll
        # would book scenario minutes unobserved. What this test checks is that the daemon polls
        # often enough to see the job, so gaps are charged here rather than left unobserved.
        env={**os.environ, "GPULEDGER_ACCOUNTING__MAX_INTERVAL": "1h"},
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(daemon.stderr or ()), daemon=True)
    reader.start()
    try:
        # Stop once the daemon's own clock is past 5 scenario hours (the job ends at 4 h), read
        # from its metrics rather than a fixed sleep: a slow start on a loaded machine must not
        # cut the run short.
        first = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            url = next((m.group(1) for line in list(lines) if (m := SERVING.search(line))), None)
            polled = last_poll(url) if url else None
            if polled is not None:
                first = polled if first is None else first
                if polled - first >= 5 * 3600:
                    break
            time.sleep(0.1)
        else:
            pytest.fail(f"the daemon's clock never passed 5 scenario hours: {''.join(lines)}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        reader.join(timeout=5)
        if daemon.stderr is not None:
            daemon.stderr.close()
    stderr = "".join(lines)
    assert daemon.returncode == 0, stderr
    expected = job_dollars(simulated, "9001")
    # 8 GPUs x 4 h at the p4de.24xlarge's price per GPU: the job's whole life, as simulate saw it.
    assert expected == pytest.approx(
        8 * 4 * load_catalogue().instance_types["p4de.24xlarge"].dollars_per_hour / 8, rel=0.01
    )
    assert job_dollars(ran, "9001") == pytest.approx(expected, rel=0.05)


def test_a_holder_gone_between_two_polls_pays_to_the_midpoint_a_new_one_from_its_start(run: Any) -> None:
    # Polls every 60 s for 30 minutes. Job A runs from 0:00 and ends at 10:20; job B starts at
    # 20:40. The interval 10:00-11:00 saw A at its start and nobody at its end, and NVML gives
    # no end time: A pays its first half, so A is charged 0:00-10:30, 630 s = $0.630 (it was
    # 600 s: its last interval went to idle). B's start is known (procfs: 20:40), so B pays from
    # then: 20:40-30:00, 560 s = $0.560 (it was 600 s: it paid for the 40 s before it started;
    # with the midpoint alone, 570 s). Idle: 10:30-20:40, 610 s = $0.610.
    scenario = {
        "gpus": [{"count": 1}],
        "processes": [
            {**BUSY, "pid": 1, "end": "620s", "slurm_job": "1"},
            {**BUSY, "pid": 2, "start": "1240s", "slurm_job": "2"},
        ],
    }
    state = run(scenario, 1800, step_s=60)
    by_job = {w.hpc_job: t.dollars for (_gpu, _uuid, w), t in state.costs.workloads.items()}
    assert by_job == {"1": pytest.approx(0.630), "2": pytest.approx(0.560)}
    charged, idle, unobserved = partition(state)
    assert idle == pytest.approx(0.610)
    assert charged + idle + sum(unobserved.values()) == pytest.approx(1800 * PRICE / 3600)  # $1.80
