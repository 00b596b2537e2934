"""Discovery under faults, end to end: a GPU that cannot be identified, a driver that cannot list
the GPUs, what names them meanwhile (NVML's count, the PCI bus, the ledger), what prices them,
and the retries with backoff until every GPU is discovered.

Every case keeps time a partition: per GPU, charged + idle + unobserved dollars = price x the
run's wall time, in the metrics and in the ledger.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sqlite3
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.accounting.cost import downtime
from agent.accounting.unpriced import Unpriced
from agent.config import PricingConfig, Settings
from agent.devices.pci import nvidia_gpus, nvml_bus_id
from agent.ledger.known import recorded_gpus
from agent.model import AgentState, DeviceReading, NodeInfo, Price, Snapshot
from tests.helpers import WAITS_ON_REAL_TIME, Rig
from tests.test_cli import Daemon, daemon, fetch, polls_at_least, samples, value
from tests.test_fault_matrix import ANN, BOB, NODE, ledger_by_gpu
from tests.test_ledger_migrations import write_v1_ledger

pytestmark = WAITS_ON_REAL_TIME

__all__ = ["daemon"]  # the fixture, used by name

PRICE = 3.6  # $/GPU-hour: $0.001 a GPU-second
BY_MODEL = PricingConfig(by_model={"A100-SXM4-80GB": PRICE})  # a price only a GPU's model gives
STEP_S = 15.0
START_EPOCH = datetime.fromisoformat(NODE["start"].replace("Z", "+00:00")).timestamp()


def poll_every(rig: Rig, step_s: float, until_s: float) -> dict[float, AgentState]:
    """Poll at 0 and every `step_s` to `until_s`; the state each poll published, by time."""
    states = {0.0: rig.poll()}
    while rig.node.clock.now() + step_s <= until_s + 1e-9:
        state = rig.poll(step_s)
        states[rig.node.clock.now()] = state
    return states


def by_gpu(state: AgentState) -> dict[int, tuple[float, float, dict[str, tuple[float, float]]]]:
    """Per GPU index, summed over the uuids it went by: (charged $, idle $, {reason: (s, $)})."""
    found: dict[int, tuple[float, float, dict[str, tuple[float, float]]]] = {}
    for (gpu, _uuid, _workload), w in state.costs.workloads.items():
        charged, idle, reasons = found.get(gpu, (0.0, 0.0, {}))
        found[gpu] = (charged + w.dollars, idle, reasons)
    for (gpu, _uuid), g in state.costs.gpus.items():
        charged, idle, reasons = found.get(gpu, (0.0, 0.0, {}))
        for reason, (seconds, dollars) in g.unobserved_by_reason.items():
            before = reasons.get(reason, (0.0, 0.0))
            reasons[reason] = (before[0] + seconds, before[1] + dollars)
        found[gpu] = (charged, idle + g.idle_dollars, reasons)
    return found


def unobserved_dollars(reasons: Mapping[str, tuple[float, float]]) -> float:
    return sum(dollars for _seconds, dollars in reasons.values())


def assert_partition(state: AgentState, seconds: float) -> None:
    """Time is a partition: per GPU, charged + idle + unobserved dollars = $3.6/h x `seconds`."""
    found = by_gpu(state)
    assert set(found) == {0, 1, 2}
    for gpu, (charged, idle, reasons) in found.items():
        assert charged + idle + unobserved_dollars(reasons) == pytest.approx(PRICE * seconds / 3600), f"GPU {gpu}"


def ledger_uuids(path: Path, gpu: int) -> set[str]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return {uuid for (uuid,) in conn.execute("SELECT DISTINCT uuid FROM gpu_hours WHERE gpu = ?", (gpu,))}


# --- a GPU that cannot be identified, and no price for the whole node --------------------------


def test_an_unidentified_gpu_waits_for_its_price_then_books_it_under_its_own_uuid(tmp_path: Path) -> None:
    """GPU 1's handle call fails until 1:15, so its model, and with only pricing.by_model set its
    price, are unknown until it is discovered at 1:45 (retried at 0:15, 0:30, 1:00: backoff 5 s
    doubling). Its unobserved time waits meanwhile, then is booked at its price under its uuid."""
    scenario = {
        **NODE,
        "faults": [{"at": "0s", "until": "75s", "gpu": 1, "call": "nvmlDeviceGetHandleByIndex", "error": "NOT_READY"}],
    }
    ledger = tmp_path / "ledger.db"
    rig = Rig(scenario, settings=Settings(poll_interval=STEP_S, pricing=BY_MODEL), ledger_path=ledger)
    try:
        states = poll_every(rig, STEP_S, 120.0)
    finally:
        assert rig.agent.close()
    # At 1:30 GPU 1 is still unidentified: nothing booked for it yet, its 90 s waiting.
    assert 1 not in by_gpu(states[90.0])
    assert states[90.0].snapshot is not None
    assert [g.uuid for g in states[90.0].snapshot.gpus][1] == "unidentified-1"
    # At 1:45 it is discovered: the 90 s that waited (0:00-1:30) are booked at $3.6/h, $0.090,
    # and the interval 1:30-1:45, which starts at its undiscovered reading, $0.015: 105 s of
    # NOT_READY, $0.105. Bob's job pays for the 15 s from 1:45 to 2:00: $0.015.
    charged, idle, reasons = by_gpu(states[120.0])[1]
    assert reasons == {"NOT_READY": (pytest.approx(105.0), pytest.approx(0.105))}
    assert (charged, idle) == (pytest.approx(0.015), 0.0)
    # The partition: 0.015 + 0 + 0.105 = 0.12 = 120 s x $0.001, as for GPUs 0 and 2.
    assert charged + idle + unobserved_dollars(reasons) == pytest.approx(PRICE * 120 / 3600)
    assert_partition(states[120.0], 120.0)
    # In the ledger too, all of it under GPU 1's own uuid.
    uuid = next(g.uuid for g in states[120.0].snapshot.gpus if g.index == 1)  # type: ignore[union-attr]
    assert ledger_uuids(ledger, 1) == {uuid}
    assert ledger_by_gpu(ledger)[1] == (pytest.approx(0.015), 0.0, pytest.approx(0.105))


def test_a_gpu_never_identified_is_booked_at_0_dollars_when_the_agent_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """GPU 1 never answers and nothing prices the node: at the stop its 120 s of NOT_READY are
    booked under its provisional uuid at $0 (its price is unknown without its model), with a
    line that says so: the seconds are in the ledger, never dropped."""
    scenario = {**NODE, "faults": [{"at": "0s", "gpu": 1, "call": "nvmlDeviceGetHandleByIndex", "error": "NOT_READY"}]}
    ledger = tmp_path / "ledger.db"
    rig = Rig(scenario, settings=Settings(poll_interval=STEP_S, pricing=BY_MODEL), ledger_path=ledger)
    try:
        poll_every(rig, STEP_S, 120.0)
    finally:
        with caplog.at_level(logging.WARNING):
            assert rig.agent.close()
    assert any("GPU 1 was never identified" in r.getMessage() and "2m" in r.getMessage() for r in caplog.records)
    assert ledger_uuids(ledger, 1) == {"unidentified-1"}
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as conn:
        row = conn.execute(
            "SELECT sum(unobserved_s), sum(unobserved_dollars), sum(idle_s) FROM gpu_hours WHERE gpu = 1"
        )
        assert row.fetchone() == (pytest.approx(120.0), 0.0, 0.0)
    # The other GPUs as usual: ann's job pays $0.12 for GPU 0, GPU 2 idles for $0.12.
    assert ledger_by_gpu(ledger)[0] == (pytest.approx(0.12), 0.0, 0.0)
    assert ledger_by_gpu(ledger)[2] == (0.0, pytest.approx(0.12), 0.0)


def test_a_node_wide_price_prices_an_unidentified_gpu_at_once() -> None:
    """With pricing.gpu_hourly every GPU costs the same, so GPU 1's unobserved time is booked as
    it passes, under its provisional uuid, then under its own once discovered at 1:45."""
    scenario = {
        **NODE,
        "faults": [{"at": "0s", "until": "75s", "gpu": 1, "call": "nvmlDeviceGetUUID", "error": "CORRUPTED_INFOROM"}],
    }
    rig = Rig(scenario, settings=Settings(poll_interval=STEP_S, pricing=PricingConfig(gpu_hourly=PRICE)))
    try:
        states = poll_every(rig, STEP_S, 120.0)
    finally:
        rig.close()
    # By 1:30: 90 s x $0.001 = $0.090, under unidentified-1.
    assert states[90.0].costs.gpus[(1, "unidentified-1")].unobserved_by_reason == {
        "CORRUPTED_INFOROM": (pytest.approx(90.0), pytest.approx(0.090))
    }
    charged, idle, reasons = by_gpu(states[120.0])[1]
    # 0:00-1:45 unobserved, $0.105; bob pays for 1:45-2:00, $0.015: $0.12 in all.
    assert reasons == {"CORRUPTED_INFOROM": (pytest.approx(105.0), pytest.approx(0.105))}
    assert charged + idle + unobserved_dollars(reasons) == pytest.approx(0.12)
    assert (charged, idle) == (pytest.approx(0.015), 0.0)
    assert_partition(states[120.0], 120.0)


def test_an_instance_types_price_prices_an_unidentified_gpu_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a p4de.24xlarge (the catalogue's $27.44705/h for 8 x A100-SXM4-80GB) every GPU costs
    $27.44705 / 8 = $3.43088125/h, its model unknown or not: GPU 1, never identified, has its
    unobserved time booked at that price as it passes, not at $0 when the agent stops."""
    scenario = {
        **NODE,
        "node": {**NODE["node"], "instance_type": "p4de.24xlarge"},
        "faults": [{"at": "0s", "gpu": 1, "call": "nvmlDeviceGetHandleByIndex", "error": "NOT_READY"}],
    }
    ledger = tmp_path / "ledger.db"
    rig = Rig(scenario, settings=Settings(poll_interval=STEP_S), ledger_path=ledger)
    try:
        states = poll_every(rig, STEP_S, 120.0)
    finally:
        with caplog.at_level(logging.WARNING):
            assert rig.agent.close()
    each = 27.44705 / 8
    # By 1:30: 90 s x $3.43088125/h = $0.0857720..., under unidentified-1.
    assert states[90.0].costs.gpus[(1, "unidentified-1")].unobserved_by_reason == {
        "NOT_READY": (pytest.approx(90.0), pytest.approx(each * 90 / 3600))
    }
    assert not any("never identified" in r.getMessage() for r in caplog.records)
    # At the stop: 120 s x $3.43088125/h = $0.1143627..., the same as GPU 2 idled for.
    assert ledger_uuids(ledger, 1) == {"unidentified-1"}
    assert ledger_by_gpu(ledger)[1] == (0.0, 0.0, pytest.approx(each * 120 / 3600))
    assert ledger_by_gpu(ledger)[2] == (0.0, pytest.approx(each * 120 / 3600), 0.0)


def test_discovery_is_retried_with_backoff_until_the_gpu_answers() -> None:
    """GPU 2's uuid call fails with a corrupted inforom for good, polled every second: it is
    asked again at 0:05, 0:15 and 0:35 (5 s, doubling), not at every poll; the other GPUs are
    read throughout, the driver up, and the agent degraded (one GPU undiscovered)."""
    scenario = {**NODE, "faults": [{"at": "0s", "gpu": 2, "call": "nvmlDeviceGetUUID", "error": "CORRUPTED_INFOROM"}]}
    rig = Rig(scenario, settings=Settings(poll_interval=1.0, pricing=PricingConfig(gpu_hourly=PRICE)))
    asked: dict[float, int] = {}
    try:
        states = {0.0: rig.poll()}
        asked[0.0] = rig.sampler.errors[("nvmlDeviceGetUUID", "CORRUPTED_INFOROM")]
        for _ in range(40):
            state = rig.poll(1.0)
            states[rig.node.clock.now()] = state
            asked[rig.node.clock.now()] = rig.sampler.errors[("nvmlDeviceGetUUID", "CORRUPTED_INFOROM")]
    finally:
        rig.close()
    tries = sorted({n: t for t, n in sorted(asked.items(), reverse=True)}.items())
    assert tries == [(1, 0.0), (2, 5.0), (3, 15.0), (4, 35.0)]  # (attempts so far, first time seen)
    last = states[40.0]
    assert last.snapshot is not None
    assert [(g.index, g.up, g.down_reason) for g in last.snapshot.gpus] == [
        (0, True, None), (1, True, None), (2, False, "CORRUPTED_INFOROM"),
    ]  # fmt: skip
    assert last.snapshot.driver_up
    metrics = rig.samples(last, {"gpuledger_undiscovered_gpus", "gpuledger_nvml_up"})
    assert {name: v for name, _labels, v in metrics} == {"gpuledger_undiscovered_gpus": 1.0, "gpuledger_nvml_up": 1.0}
    # GPU 2 went unobserved for all 40 s: $0.040 at $0.001 a second, the partition whole.
    charged, idle, reasons = by_gpu(last)[2]
    assert (charged, idle, reasons) == (0.0, 0.0, {"CORRUPTED_INFOROM": (pytest.approx(40.0), pytest.approx(0.040))})
    assert_partition(last, 40.0)


# --- item 9 of issue 10, through the daemon -----------------------------------------------------


def test_a_non_fatal_discovery_error_leaves_the_others_polled_and_the_agent_visibly_degraded(
    daemon: type[Daemon], tmp_path: Path
) -> None:
    """`gpuledger run` on a node where, at boot, GPU 1's handle call answers NOT_READY (for the
    first 3 s), GPU 2's inforom is corrupted (its uuid never reads) and GPU 0's field values
    answer UNKNOWN (its NVLink count cannot be read for 3 s). GPUs 0 and 1 come up, GPU 2 shows
    down with its error, the driver up, /healthz 200 and saying degraded; discovery is retried
    with backoff, never at every poll."""
    scenario = tmp_path / "boot.yaml"
    faults = [
        {"at": "0s", "until": "3s", "gpu": 1, "call": "nvmlDeviceGetHandleByIndex", "error": "NOT_READY"},
        {"at": "0s", "gpu": 2, "call": "nvmlDeviceGetUUID", "error": "CORRUPTED_INFOROM"},
        {"at": "0s", "until": "3s", "gpu": 0, "call": "nvmlDeviceGetNvLinkState", "error": "UNKNOWN"},
    ]
    scenario.write_text(yaml.safe_dump({**NODE, "faults": faults}))
    env = {"GPULEDGER_POLL_INTERVAL": "0.5s", "GPULEDGER_PRICING__GPU_HOURLY": str(PRICE)}
    d = daemon("--fake", str(scenario), env=env)  # type: ignore[call-arg]
    first = d.wait_for(polls_at_least(2))
    assert value(first, "gpuledger_nvml_up") == 1
    assert value(first, "gpuledger_gpu_up", gpu="0") == 1
    assert value(first, "gpuledger_gpu_down_reason", gpu="1", reason="NOT_READY") == 1
    assert value(first, "gpuledger_gpu_down_reason", gpu="2", reason="CORRUPTED_INFOROM") == 1
    assert value(first, "gpuledger_undiscovered_gpus") == 2
    # GPU 0's NVLink count is unknown, not 0: no link series until it is read.
    assert not [labels for (name, labels) in samples(first) if name == "gpuledger_gpu_nvlink_up"]
    status, body = fetch(d.url + "/healthz")
    assert status == 200
    assert body.startswith("degraded: ")
    assert "GPU 1 (NOT_READY)" in body
    assert "GPU 2 (CORRUPTED_INFOROM)" in body

    def gpu_1_up(text: str) -> bool:
        with contextlib.suppress(KeyError):
            return value(text, "gpuledger_gpu_up", gpu="1") == 1 and value(text, "gpuledger_gpu_nvlink_up", gpu="0")
        return False

    # The retries at 5 s find GPU 1 and GPU 0's links (the faults ended at 3 s).
    later = d.wait_for(gpu_1_up, timeout=30)
    assert value(later, "gpuledger_undiscovered_gpus") == 1
    links = {
        (dict(labels)["gpu"], dict(labels)["link"]) for (name, labels) in samples(later) if name.endswith("link_up")
    }
    assert links == {("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")}  # GPU 2, down, has none
    # GPU 2 is asked at the start and again 5, 15, 35, ... s in (5 s, doubling), not at each poll.
    elapsed = value(later, "gpuledger_last_poll_timestamp_seconds") - START_EPOCH
    tries = value(later, "gpuledger_nvml_errors_total", call="nvmlDeviceGetUUID", error="CORRUPTED_INFOROM")
    assert tries == 1 + sum(1 for retry in (5, 15, 35, 75) if retry <= elapsed)
    assert value(later, "gpuledger_polls_total") > 2 * tries
    # Its time is unobserved, at the node's price: never $0, never under an empty uuid.
    unobserved = value(later, "gpuledger_gpu_unobserved_cost_dollars_total", gpu="2", reason="CORRUPTED_INFOROM")
    seconds = value(later, "gpuledger_gpu_unobserved_seconds_total", gpu="2", reason="CORRUPTED_INFOROM")
    assert seconds > 0
    assert unobserved == pytest.approx(seconds * PRICE / 3600)
    assert ("gpuledger_gpu_up", (("gpu", "2"), ("uuid", "unidentified-2"))) in samples(later)
    # The partition, per GPU over the uuids it went by: charged + idle + unobserved dollars is
    # $3.6/h x its observed and unobserved seconds, and those are the same wall time for all.
    walls = []
    for gpu in ("0", "1", "2"):
        dollars = sum(
            v
            for (name, labels), v in samples(later).items()
            if ("gpu", gpu) in labels
            and name
            in (
                "gpuledger_workload_cost_dollars_total",
                "gpuledger_gpu_idle_cost_dollars_total",
                "gpuledger_gpu_unobserved_cost_dollars_total",
            )
        )
        wall = sum(
            v
            for (name, labels), v in samples(later).items()
            if ("gpu", gpu) in labels
            and name in ("gpuledger_gpu_observed_seconds_total", "gpuledger_gpu_unobserved_seconds_total")
        )
        assert dollars == pytest.approx(PRICE * wall / 3600), gpu
        walls.append(wall)
    assert walls == [pytest.approx(walls[0])] * 3
    assert "GPU 2 (CORRUPTED_INFOROM)" in fetch(d.url + "/healthz")[1]
    assert d.stop() == 0


# --- the driver cannot list the GPUs: the PCI bus and the ledger name them ----------------------


def test_the_ledger_names_the_gpus_while_the_driver_is_absent_after_a_restart(tmp_path: Path) -> None:
    """Run 1 (18:00-18:01) records the node; the agent stops; run 2 starts at 18:02 with the
    driver not loaded for good and no PCI view: its GPUs go by the uuids and models the ledger
    recorded, so the minute it was stopped (agent_down) and the minute of run 2 (DRIVER_NOT_LOADED)
    are booked to each GPU, priced by its model."""
    ledger = tmp_path / "ledger.db"
    settings = Settings(poll_interval=STEP_S, pricing=BY_MODEL)
    first = Rig(NODE, settings=settings, ledger_path=ledger)
    try:
        uuids = [g.uuid for g in poll_every(first, STEP_S, 60.0)[60.0].snapshot.gpus]  # type: ignore[union-attr]
    finally:
        assert first.agent.close()
    second_node = {**NODE, "start": "2026-11-20T18:02:00Z", "faults": [{"at": "0s", "error": "DRIVER_NOT_LOADED"}]}
    second = Rig(second_node, settings=settings, ledger_path=ledger)
    try:
        sys_root = second.node.host.sys_root
        sys_root.rename(sys_root.with_name("no-sys"))  # no PCI view: only the ledger can say
        states = poll_every(second, STEP_S, 60.0)
    finally:
        assert second.agent.close()
    last = states[60.0]
    assert last.snapshot is not None
    assert [(g.uuid, g.model, g.up, g.down_reason, g.discovered) for g in last.snapshot.gpus] == [
        (uuid, "A100-SXM4-80GB", False, "DRIVER_NOT_LOADED", False) for uuid in uuids
    ]
    for gpu in (0, 1, 2):
        # 60 s stopped + 60 s without a driver, at $0.001 a second: $0.060 each.
        assert by_gpu(last)[gpu] == (0.0, 0.0, {
            "agent_down": (pytest.approx(60.0), pytest.approx(0.060)),
            "DRIVER_NOT_LOADED": (pytest.approx(60.0), pytest.approx(0.060)),
        })  # fmt: skip
    # The ledger, 18:00 to 18:03: run 1's minute (ann pays for GPU 0, bob for GPU 1, GPU 2 idle:
    # $0.060 each), then 2 minutes unobserved ($0.120): $0.18 = 180 s x $0.001 per GPU.
    assert ledger_by_gpu(ledger) == {
        0: (pytest.approx(0.060), 0.0, pytest.approx(0.120)),
        1: (pytest.approx(0.060), 0.0, pytest.approx(0.120)),
        2: (0.0, pytest.approx(0.060), pytest.approx(0.120)),
    }
    assert {gpu: ledger_uuids(ledger, gpu) for gpu in (0, 1, 2)} == {i: {uuid} for i, uuid in enumerate(uuids)}


def test_a_gpu_unidentified_at_a_restart_goes_by_the_ledgers_uuid_from_the_first_poll(tmp_path: Path) -> None:
    """Run 1 (18:00-18:01) records the node; run 2 starts at 18:02 with GPU 1's handle call
    failing for good, and only pricing.by_model set. The devices are opened before the ledger,
    but from the first poll GPU 1 goes by the uuid and model the ledger recorded: the minute
    the agent was stopped is booked under that uuid at its model's price, not at $0 under
    unidentified-1 as a GPU whose model is unknown."""
    ledger = tmp_path / "ledger.db"
    settings = Settings(poll_interval=STEP_S, pricing=BY_MODEL)
    first = Rig(NODE, settings=settings, ledger_path=ledger)
    try:
        uuid = [g.uuid for g in poll_every(first, STEP_S, 60.0)[60.0].snapshot.gpus][1]  # type: ignore[union-attr]
    finally:
        assert first.agent.close()
    lost = {
        **NODE,
        "start": "2026-11-20T18:02:00Z",
        "faults": [{"at": "0s", "gpu": 1, "call": "nvmlDeviceGetHandleByIndex", "error": "GPU_IS_LOST"}],
    }
    second = Rig(lost, settings=settings, ledger_path=ledger)
    try:
        states = poll_every(second, STEP_S, 60.0)
    finally:
        assert second.agent.close()
    assert [(g.uuid, g.model) for g in states[0.0].snapshot.gpus][1] == (uuid, "A100-SXM4-80GB")  # type: ignore[union-attr]
    # GPU 1 in run 2, $0.001 a second: the minute stopped, $0.060, and the minute lost, $0.060.
    assert by_gpu(states[60.0])[1] == (0.0, 0.0, {
        "agent_down": (pytest.approx(60.0), pytest.approx(0.060)),
        "GPU_IS_LOST": (pytest.approx(60.0), pytest.approx(0.060)),
    })  # fmt: skip
    # The ledger, 18:00-18:03: bob's minute $0.060, then 2 minutes unobserved $0.120, all of
    # it under GPU 1's own uuid: $0.18 = 180 s x $0.001.
    assert ledger_by_gpu(ledger)[1] == (pytest.approx(0.060), 0.0, pytest.approx(0.120))
    assert ledger_uuids(ledger, 1) == {uuid}


def test_gpus_that_swapped_indexes_across_a_restart_never_share_a_uuid(tmp_path: Path) -> None:
    """Run 1 (18:00-18:01) records GPUs A, B, C at indexes 0, 1, 2; run 2 starts at 18:02 with A
    and B swapped (B at 0 with ann's job, A at 1 with bob's) and GPU 1's uuid unreadable until
    1:15, discovered at 1:45 (retried at 0:15, 0:30, 1:00, 1:45). Until then GPU 1 goes by its
    provisional uuid, not by B, the uuid the ledger recorded at index 1: B is GPU 0's now, and
    sharing it GPU 0 would start each interval at GPU 1's down reading, its readable time
    unobserved and ann's job charged nothing, and the two GPUs' hours would be one ledger row."""
    ledger = tmp_path / "ledger.db"
    settings = Settings(poll_interval=STEP_S, pricing=PricingConfig(gpu_hourly=PRICE))
    first = Rig(NODE, settings=settings, ledger_path=ledger)
    try:
        a, b, c = [g.uuid for g in poll_every(first, STEP_S, 60.0)[60.0].snapshot.gpus]  # type: ignore[union-attr]
    finally:
        assert first.agent.close()
    swapped = {
        **NODE,
        "start": "2026-11-20T18:02:00Z",
        "gpus": [{"model": "A100-SXM4-80GB", "nvlink_links": 2, "uuid": uuid} for uuid in (b, a, c)],
        "faults": [{"at": "0s", "until": "75s", "gpu": 1, "call": "nvmlDeviceGetUUID", "error": "CORRUPTED_INFOROM"}],
    }
    second = Rig(swapped, settings=settings, ledger_path=ledger)
    try:
        states = poll_every(second, STEP_S, 120.0)
    finally:
        assert second.agent.close()
    assert [g.uuid for g in states[90.0].snapshot.gpus] == [b, "unidentified-1", c]  # type: ignore[union-attr]
    # Run 2, $0.001 a GPU-second: ann pays for GPU 0 all 120 s, $0.120; GPU 1 is unobserved to
    # 1:45, $0.105, and bob pays for 1:45-2:00, $0.015; GPU 2 idles, $0.120.
    assert by_gpu(states[120.0]) == {
        0: (pytest.approx(0.120), 0.0, {"agent_down": (pytest.approx(60.0), pytest.approx(0.060))}),
        1: (pytest.approx(0.015), 0.0, {
            "agent_down": (pytest.approx(60.0), pytest.approx(0.060)),
            "CORRUPTED_INFOROM": (pytest.approx(105.0), pytest.approx(0.105)),
        }),
        2: (0.0, pytest.approx(0.120), {"agent_down": (pytest.approx(60.0), pytest.approx(0.060))}),
    }  # fmt: skip
    # The ledger, 18:00-18:04, 240 s a GPU, $0.240: GPU 0, ann $0.060 + $0.120 and the minute
    # stopped $0.060; GPU 1, bob $0.060 + $0.015, unobserved $0.060 + $0.105; GPU 2 idle
    # $0.060 + $0.120, unobserved $0.060.
    assert ledger_by_gpu(ledger) == {
        0: (pytest.approx(0.180), 0.0, pytest.approx(0.060)),
        1: (pytest.approx(0.075), 0.0, pytest.approx(0.165)),
        2: (0.0, pytest.approx(0.180), pytest.approx(0.060)),
    }
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as conn:
        # No hour of one uuid holds more than the hour's 3600 s.
        [(most,)] = conn.execute("SELECT max(observed_s + unobserved_s) FROM gpu_hours").fetchall()
    assert most == pytest.approx(240.0)


def test_recorded_gpus_reads_the_latest_hour_of_a_first_release_ledger(tmp_path: Path) -> None:
    """The ledger's GPUs as the sampler is told them: (index, uuid, NVML name), from its latest
    hour, in a file of the first schema as much as the latest (the columns are there since)."""
    path = tmp_path / "v1.db"
    write_v1_ledger(path)
    name = "NVIDIA A100-SXM4-80GB"
    assert recorded_gpus(path, "node-a") == [(0, "GPU-0", name), (1, "GPU-1", name), (2, "GPU-2", name)]
    assert recorded_gpus(path, "another-node") == []
    assert recorded_gpus(tmp_path / "missing.db", "node-a") == []


# SQLite's numbered (?1) and named (:name, @name, $name) placeholders.
_NAMED_PLACEHOLDER = re.compile(r"\?\d+|[:@$][A-Za-z_]\w*")


class _BindsAsPython312:
    """A ledger connection that binds as Python 3.12.0 to 3.12.3 do: a sequence of parameters for
    a numbered or named placeholder is refused (they warn, and the suite's warnings are errors)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, parameters: Any = ()) -> sqlite3.Cursor:
        if parameters and not isinstance(parameters, Mapping) and _NAMED_PLACEHOLDER.search(sql):
            raise AssertionError(f"a sequence bound to a named placeholder: {sql}")
        return self._conn.execute(sql, parameters)

    def close(self) -> None:
        self._conn.close()


def test_recorded_gpus_binds_the_node_as_python_3_12_takes_placeholders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On Python 3.12.1 the restarted agent's read of its ledger warned that `?1` bound from a
    # sequence will be an error (with -W error, as this suite runs, the agent did not start).
    import agent.ledger.known

    opened = agent.ledger.known.open_read_only
    monkeypatch.setattr(agent.ledger.known, "open_read_only", lambda path: _BindsAsPython312(opened(path)))
    path = tmp_path / "v1.db"
    write_v1_ledger(path)
    assert [uuid for _, uuid, _ in recorded_gpus(path, "node-a")] == ["GPU-0", "GPU-1", "GPU-2"]
    assert recorded_gpus(path, "another-node") == []


def write_device(root: Path, name: str, vendor: int, pci_class: int, driver: str | None = None) -> None:
    device = root / "bus" / "pci" / "devices" / name
    device.mkdir(parents=True)
    (device / "vendor").write_text(f"0x{vendor:04x}\n")
    (device / "class").write_text(f"0x{pci_class:06x}\n")
    if driver is not None:
        target = root / "bus" / "pci" / "drivers" / driver
        target.mkdir(parents=True, exist_ok=True)
        (device / "driver").symlink_to(target)


def test_the_pci_bus_lists_nvidia_gpus_in_bus_order_as_nvml_spells_their_ids(tmp_path: Path) -> None:
    write_device(tmp_path, "0000:b1:00.0", 0x10DE, 0x030200, driver="nvidia")  # a 3D controller
    write_device(tmp_path, "0000:17:00.0", 0x10DE, 0x030000)  # a VGA controller, no driver bound
    write_device(tmp_path, "0000:17:00.1", 0x10DE, 0x040300)  # its HDMI audio: not a GPU
    write_device(tmp_path, "0000:c3:00.0", 0x10DE, 0x068000)  # an NVSwitch: not a GPU
    write_device(tmp_path, "0000:ca:00.0", 0x10DE, 0x030200, driver="vfio-pci")  # a VM's, not NVML's
    write_device(tmp_path, "0000:00:02.0", 0x8086, 0x030000, driver="i915")  # another vendor's
    assert nvidia_gpus(tmp_path) == ["00000000:17:00.0", "00000000:B1:00.0"]
    assert nvidia_gpus(tmp_path / "nowhere") == []
    assert nvml_bus_id("10000:3a:00.0") == "00010000:3A:00.0"


def test_the_fake_node_shows_its_gpus_on_the_pci_bus_with_the_bus_ids_nvml_gives() -> None:
    rig = Rig(NODE, settings=Settings(pricing=PricingConfig(gpu_hourly=PRICE)))
    try:
        state = rig.poll()
        assert state.snapshot is not None
        assert nvidia_gpus(rig.node.host.sys_root) == [g.pci_bus_id for g in state.snapshot.gpus]
    finally:
        rig.close()


# --- NVLink ---------------------------------------------------------------------------------------


def test_an_nvlink_count_that_cannot_be_read_is_unknown_until_it_can_never_zero() -> None:
    """GPU 1's NVLink calls fail (UNKNOWN) until 0:20: at discovery its link count cannot be read,
    so it has no link series (unknown, not "no NVLink"), while it is polled as usual; the count
    is read again with backoff (0:15 fails, 0:30 succeeds) and its two links appear."""
    scenario = {
        **NODE,
        "faults": [{"at": "0s", "until": "20s", "gpu": 1, "call": "nvmlDeviceGetNvLinkState", "error": "UNKNOWN"}],
    }
    rig = Rig(scenario, settings=Settings(poll_interval=STEP_S, pricing=PricingConfig(gpu_hourly=PRICE)))
    try:
        states = poll_every(rig, STEP_S, 45.0)
    finally:
        rig.close()
    links: dict[float, dict[int, tuple[bool, ...]]] = {}
    for t, state in states.items():
        assert state.snapshot is not None
        links[t] = {g.index: tuple(link.up for link in g.nvlinks) for g in state.snapshot.gpus if g.up}
    assert links == {
        0.0: {0: (True, True), 1: (), 2: (True, True)},
        15.0: {0: (True, True), 1: (), 2: (True, True)},
        30.0: {0: (True, True), 1: (True, True), 2: (True, True)},
        45.0: {0: (True, True), 1: (True, True), 2: (True, True)},
    }
    # Bob's job paid for GPU 1 all along: 45 s x $0.001 = $0.045, nothing idle or unobserved.
    charged, idle, reasons = by_gpu(states[45.0])[1]
    assert (charged, idle, unobserved_dollars(reasons)) == (pytest.approx(0.045), 0.0, 0.0)
    assert_partition(states[45.0], 45.0)


# --- the kubelet away ---------------------------------------------------------------------------

NOTEBOOK = {"namespace": "research", "name": "notebook-2", "container": "jupyter",
            "uid": "1e2d3c4b-5a69-4788-9a0b-c1d2e3f4a5b6"}  # fmt: skip
BOB_POD = {"namespace": "serving", "name": "bob-0", "container": "main", "uid": "7d1c5e2a-0b4f-4c8e-9a6d-3f2e1b0c9d8a"}


def test_a_kubelet_away_past_the_staleness_limit_makes_unheld_gpus_unobserved_not_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """GPU 2 is allocated to a notebook that runs nothing on it; the kubelet stops at 0:30 and is
    back at 1:30, with attribution.kubelet_stale_after 30s. Its last answer was seen at 0:15, so
    its allocations stand at 0:30 and 0:45 and are unknown from 1:00 to 1:15: GPU 2 is then
    unobserved (attribution_unavailable), never idle; GPUs 0 and 1 are named by their
    processes' cgroups throughout."""
    scenario: dict[str, Any] = {
        **NODE,
        "processes": [ANN, {**BOB, "pod": BOB_POD}],
        "allocations": [{"gpus": [2], "pod": NOTEBOOK}],
    }
    settings = Settings.model_validate(
        {"poll_interval": STEP_S, "pricing": {"gpu_hourly": PRICE}, "attribution": {"kubelet_stale_after": "30s"}}
    )
    rig = Rig(scenario, settings=settings)
    server = rig.node.host.server
    states: dict[float, AgentState] = {}
    try:
        with caplog.at_level(logging.WARNING):
            states[0.0] = rig.poll()
            for t in range(15, 121, 15):
                rig.node.clock.advance(STEP_S)
                if t == 30:
                    server.stop()
                if t == 90:
                    server.start()
                states[float(t)] = rig.poll()
    finally:
        rig.close()
    assert [states[t].attribution.allocations_known for t in sorted(states)] == [
        True, True, True, True, False, False, True, True, True,
    ]  # fmt: skip
    assert [states[t].attribution.kubelet_up for t in (15.0, 30.0, 90.0)] == [True, False, True]
    charged, idle, reasons = by_gpu(states[120.0])[2]
    # 0:45-1:00 is half the notebook's (its allocation stood at 0:45), half unknown (1:00): 7.5 s
    # each; 1:00-1:15 unknown, 15 s; 1:15-1:30 half unknown, half the notebook's again: 7.5 s.
    # Unobserved 7.5 + 15 + 7.5 = 30 s, $0.030; the notebook pays for the other 90 s, $0.090.
    assert reasons == {"attribution_unavailable": (pytest.approx(30.0), pytest.approx(0.030))}
    assert (charged, idle) == (pytest.approx(0.090), 0.0)
    assert charged + idle + unobserved_dollars(reasons) == pytest.approx(0.12)
    notebook = sum(w.dollars for (gpu, _u, wl), w in states[120.0].costs.workloads.items() if wl.pod == "notebook-2")
    assert notebook == pytest.approx(0.090)
    for gpu in (0, 1):  # ann's job and bob's pod, by their cgroups: $0.12 each, nothing else
        assert by_gpu(states[120.0])[gpu] == (pytest.approx(0.12), 0.0, {})
    assert_partition(states[120.0], 120.0)
    assert sum("booked as unobserved, not idle" in r.getMessage() for r in caplog.records) == 1


def test_a_gpu_no_process_holds_is_not_flagged_idle_while_its_allocations_are_unknown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """GPU 2 is allocated to a notebook that runs nothing on it; the kubelet answers last at 0:30
    and then stays away, with attribution.kubelet_stale_after 30s and an `idle` rule of 5 min.
    From 1:15 nobody can say whether the notebook still holds GPU 2: accounting books it
    unobserved, and the idle flag, which before raised at 6:15 on a GPU the notebook may still
    hold, stays down."""
    scenario: dict[str, Any] = {**NODE, "allocations": [{"gpus": [2], "pod": NOTEBOOK}]}
    settings = Settings.model_validate(
        {
            "poll_interval": STEP_S,
            "pricing": {"gpu_hourly": PRICE},
            "attribution": {"kubelet_stale_after": "30s"},
            "rules": {"idle": {"for": "5m"}},
        }
    )
    rig = Rig(scenario, settings=settings)
    try:
        with caplog.at_level(logging.WARNING):
            rig.poll()
            rig.poll(STEP_S)
            rig.poll(STEP_S)
            rig.node.host.server.stop()
            states = poll_every(rig, STEP_S, 900.0)
    finally:
        rig.close()
    last = states[max(states)]
    assert last.attribution.allocations_known is False
    assert not [f for state in states.values() for f in state.flags if f.raised]
    assert not [r for r in caplog.records if r.getMessage().startswith("flag raised")]
    charged, idle, reasons = by_gpu(last)[2]
    # 0:00-1:00 the notebook's, 1:00-1:15 half its own, half unknown: 67.5 s at $0.001 a second,
    # $0.0675; the other 832.5 s of the 15 min unknown, $0.8325. Nothing idle, as no flag is.
    assert (charged, idle) == (pytest.approx(0.0675), 0.0)
    assert reasons == {"attribution_unavailable": (pytest.approx(832.5), pytest.approx(0.8325))}
    assert charged + idle + unobserved_dollars(reasons) == pytest.approx(900 * PRICE / 3600)  # $0.90


def test_waiting_time_stays_a_few_stretches_however_long_it_waits() -> None:
    """A day of 15 s polls of an unidentified, unpriced GPU, with its down reason changing once:
    two stretches held, not 5760 intervals; released at $3.6/h once it is discovered, every
    second of the day at $0.001: $86.40."""
    node = NodeInfo("n")
    waiting = DeviceReading(
        index=1, uuid="unidentified-1", name="", up=False, down_reason="NOT_READY", discovered=False
    )
    unpriced = Unpriced()
    day = 86400.0
    for start in range(0, int(day), int(STEP_S)):
        reason = "NOT_READY" if start < day / 2 else "UNKNOWN"
        gpu = replace(waiting, down_reason=reason)
        snapshot = Snapshot(start + STEP_S, node, (gpu,), driver_up=True)
        charges = downtime(start, start + STEP_S, snapshot, {}, reason=reason)
        assert unpriced.hold(charges, snapshot, {}).gpus == ()
    assert [len(h.stretches) for h in unpriced.held.values()] == [2]
    assert unpriced.seconds == day
    found = replace(waiting, uuid="GPU-1", name="NVIDIA A100-SXM4-80GB", up=True, down_reason=None, discovered=True)
    released = unpriced.release(Snapshot(day, node, (found,)), {"GPU-1": Price(PRICE, "config")}, None)
    assert unpriced.held == {}
    booked = [g for charges in released for g in charges.gpus]
    assert {g.uuid for g in booked} == {"GPU-1"}
    # Half the day each reason: 43200 s x $0.001 = $43.20 each, $86.40 in all, all unobserved.
    assert {g.unobserved_reason: (g.unobserved_s, g.unobserved_dollars) for g in booked} == {
        "NOT_READY": (43200.0, pytest.approx(43.2)),
        "UNKNOWN": (43200.0, pytest.approx(43.2)),
    }
    assert sum(g.unobserved_dollars + g.dollars for g in booked) == pytest.approx(PRICE * day / 3600)
