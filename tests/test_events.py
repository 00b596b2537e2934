"""Driver events: the fake's event-set API through the real pynvml, and the agent's reader of it.

The reader is specified by what an operator relies on: every Xid the driver reports is counted
once, in order, on the GPU it happened on; a GPU falling off the bus or the driver going away
does not end event reading for the GPUs that remain; and the poll never waits for the reader.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

import fake_nvml
from agent.config import EventsConfig, Settings, WatchdogConfig
from agent.devices.events import EventKind, EventReader
from agent.model import AgentState
from agent.pipeline import DriverHung
from exporters.prometheus import make_registry
from fake_nvml import events as fake_events
from fake_nvml.scenario import ScenarioError
from tests.helpers import WAITS_ON_REAL_TIME, Rig
from tests.test_cli import Daemon, polls_at_least

pytestmark = WAITS_ON_REAL_TIME

HOUR = 3600.0


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    fake_nvml.uninstall()


XID = pynvml.nvmlEventTypeXidCriticalError


def node(faults: list[dict[str, Any]], gpus: int = 3) -> dict[str, Any]:
    return {"node": {"hostname": "events"}, "gpus": [{"model": "H100-SXM5-80GB", "count": gpus}], "faults": faults}


def sample(state: AgentState, name: str, **labels: str) -> float | None:
    registry = make_registry(lambda: state, dcgm_compat=True)
    return registry.get_sample_value(name, labels)


def reader_of(rig: Rig) -> EventReader:
    assert rig.agent.events is not None
    return rig.agent.events


# -- the fake's C functions, through pynvml ------------------------------------------------------


def test_a_set_delivers_each_registered_gpus_events_in_scenario_time_order() -> None:
    fake = fake_nvml.install(
        node(
            [
                {"at": "3h", "gpu": 0, "xid": 94},
                {"at": "1h", "gpu": 1, "xid": 48},
                {"at": "2h", "gpu": 0, "event": "double_bit_ecc"},
                {"at": "2h30m", "gpu": 2, "xid": 79},  # GPU 2 is not registered: never delivered
            ]
        ),
        host=False,
    )
    pynvml.nvmlInit()
    event_set = pynvml.nvmlEventSetCreate()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
    wanted = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
    for handle in handles[:2]:
        pynvml.nvmlDeviceRegisterEvents(handle, wanted, event_set)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 0)  # nothing has happened yet
    fake.clock.advance(4 * HOUR)
    got = []
    for _ in range(4):
        data = pynvml.nvmlEventSetWait_v2(event_set, 0)
        got.append((pynvml.nvmlDeviceGetIndex(data.device), data.eventType, data.eventData))
    assert got == [
        (1, pynvml.nvmlEventTypeXidCriticalError, 48),
        (0, pynvml.nvmlEventTypeDoubleBitEccError, 0),
        (0, pynvml.nvmlEventTypeXidCriticalError, 94),  # the double-bit error's own Xid (Hopper remaps rows)
        (0, pynvml.nvmlEventTypeXidCriticalError, 94),
    ]
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 0)
    pynvml.nvmlEventSetFree(event_set)


def test_a_wait_blocks_for_its_timeout_and_wakes_when_scenario_time_reaches_an_event() -> None:
    fake = fake_nvml.install(node([{"at": "10s", "gpu": 0, "xid": 31}], gpus=1), host=False)
    pynvml.nvmlInit()
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(0), XID, event_set)
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 200)
    assert time.monotonic() - started >= 0.2
    fake.clock.set_speed(1000.0)  # 10 scenario seconds pass in 10 ms of real time
    assert pynvml.nvmlEventSetWait_v2(event_set, 5000).eventData == 31


def test_a_wait_on_a_running_clock_sleeps_until_the_next_event_is_due(monkeypatch: pytest.MonkeyPatch) -> None:
    # At 100x an Xid 60 scenario seconds in is due 0.6 real seconds after the clock starts: the
    # wait naps at most WAIT_NAP_MAX_S (0.5 s) at a time, then up to the event, and answers it
    # then, not a hundred times a second looking in between. With nothing due it naps 0.5 s.
    fake = fake_nvml.install(node([{"at": "60s", "gpu": 0, "xid": 31}], gpus=1), host=False)
    pynvml.nvmlInit()
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(0), XID, event_set)
    naps: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(fake_events.time, "sleep", sleep)
    fake.clock.set_speed(100.0)
    started = time.monotonic()
    assert pynvml.nvmlEventSetWait_v2(event_set, 5000).eventData == 31
    # Not before it is due (0.6 s less the moment the first look took), and the naps planned to
    # end there: a nap that ran late on a loaded machine shortens the next.
    assert time.monotonic() - started >= 0.55
    assert len(naps) <= 3, naps
    assert naps[0] == fake_events.WAIT_NAP_MAX_S
    assert sum(naps) <= 0.6 + fake_events.WAIT_TICK_S, naps
    naps.clear()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 700)  # nothing more is due
    assert naps[0] == fake_events.WAIT_NAP_MAX_S, naps
    assert len(naps) <= 2, naps


def test_what_happened_before_registration_is_not_delivered() -> None:
    fake = fake_nvml.install(node([{"at": "1h", "gpu": 0, "xid": 13}, {"at": "3h", "gpu": 0, "xid": 43}], gpus=1))
    pynvml.nvmlInit()
    fake.clock.advance(2 * HOUR)
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(0), XID, event_set)
    fake.clock.advance(2 * HOUR)
    assert pynvml.nvmlEventSetWait_v2(event_set, 0).eventData == 43
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 0)


def test_supported_types_and_a_mig_device_offering_xids_only() -> None:
    fake_nvml.install("mig", host=False)
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    whole = pynvml.nvmlDeviceGetSupportedEventTypes(gpu)
    assert whole & pynvml.nvmlEventTypeXidCriticalError
    assert whole & pynvml.nvmlEventTypeSingleBitEccError
    assert pynvml.nvmlDeviceGetSupportedEventTypes(mig) == pynvml.nvmlEventTypeXidCriticalError
    event_set = pynvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceRegisterEvents(mig, pynvml.nvmlEventTypeClock, event_set)


def test_a_lost_gpu_fails_the_wait_after_its_last_events() -> None:
    fake = fake_nvml.install("gpu-lost", host=False)  # GPU 1: Xid 79 and lost at 10m
    pynvml.nvmlInit()
    event_set = pynvml.nvmlEventSetCreate()
    for i in range(4):
        pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(i), XID, event_set)
    fake.clock.advance(600)
    assert pynvml.nvmlEventSetWait_v2(event_set, 0).eventData == 79
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlEventSetWait_v2(event_set, 0)


def test_a_set_from_before_a_driver_restart_is_stale_after_it() -> None:
    restart = {"at": "1h", "until": "1h5m", "call": "*", "error": "DRIVER_NOT_LOADED"}
    fake = fake_nvml.install(node([restart, {"at": "2h", "gpu": 0, "xid": 94}], gpus=1), host=False)
    pynvml.nvmlInit()
    old = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(0), XID, old)
    fake.clock.advance(HOUR + 60)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlEventSetWait_v2(old, 0)
    fake.clock.advance(HOUR)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlEventSetWait_v2(old, 0)


def test_a_scenario_event_must_be_known_and_name_its_gpu() -> None:
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.event: unknown driver event 'ecc'"):
        fake_nvml.load_scenario(node([{"at": "1h", "gpu": 0, "event": "ecc"}]))
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.gpu: event needs the GPU"):
        fake_nvml.load_scenario(node([{"at": "1h", "event": "clock_change"}]))


# -- the agent's reader ---------------------------------------------------------------------------


def test_the_reader_counts_every_event_in_order_and_exports_them() -> None:
    rig = Rig(
        node(
            [
                {"at": "30m", "gpu": 1, "xid": 48},
                {"at": "45m", "gpu": 0, "event": "single_bit_ecc"},
                {"at": "1h", "gpu": 1, "xid": 94},
                {"at": "1h", "gpu": 2, "event": "clock_change"},
                {"at": "90m", "gpu": 1, "xid": 48},
            ]
        )
    )
    try:
        rig.poll()
        state = rig.poll(2 * HOUR)  # every event lands between these two polls
        reader = reader_of(rig)
        assert [(gpu, event.kind, event.data) for _, gpu, event in reader.recent] == [
            (1, EventKind.XID, 48),
            (0, EventKind.SINGLE_BIT_ECC, 0),
            (1, EventKind.XID, 94),
            (1, EventKind.XID, 48),
        ]  # not GPU 2's clock change: the agent does not listen for those
        uuid = [d.uuid for d in state.snapshot.gpus] if state.snapshot else []
        assert sample(state, "gpuledger_gpu_xid_errors_total", gpu="1", uuid=uuid[1], xid="48") == 2
        assert sample(state, "gpuledger_gpu_xid_errors_total", gpu="1", uuid=uuid[1], xid="94") == 1
        assert sample(state, "gpuledger_gpu_events_total", gpu="1", uuid=uuid[1], event="xid") == 3
        assert sample(state, "gpuledger_gpu_events_total", gpu="0", uuid=uuid[0], event="single_bit_ecc") == 1
        # Clock changes are not listened for (a real H200 sends ~40 a second under load).
        assert sample(state, "gpuledger_gpu_events_total", gpu="2", uuid=uuid[2], event="clock_change") is None
        assert sample(state, "gpuledger_gpu_xid_errors_total", gpu="0", uuid=uuid[0], xid="48") is None
        # Received at the poll that caught up with them: the clock then, 2 h after the start.
        start = rig.node.clock.start_epoch
        assert sample(state, "gpuledger_gpu_last_xid_timestamp_seconds", gpu="1", uuid=uuid[1]) == start + 2 * HOUR
        # dcgm-exporter's gauge: the last Xid's code, 0 where none came.
        labels = {"gpu": "1", "UUID": uuid[1]}
        assert _dcgm(state, "DCGM_FI_DEV_XID_ERRORS", labels) == 48
        assert _dcgm(state, "DCGM_FI_DEV_XID_ERRORS", {"gpu": "0", "UUID": uuid[0]}) == 0
        assert all(sample(state, "gpuledger_gpu_events_up", gpu=str(i), uuid=uuid[i]) == 1 for i in range(3))
    finally:
        rig.close()


def _dcgm(state: AgentState, name: str, labels: dict[str, str]) -> float | None:
    registry = make_registry(lambda: state, dcgm_compat=True)
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_the_reader_survives_a_lost_gpu_and_registers_it_again_when_it_returns() -> None:
    rig = Rig(
        node(
            [
                {"at": "10m", "gpu": 1, "xid": 79},
                {"at": "10m", "until": "40m", "gpu": 1, "error": "GPU_IS_LOST"},
                {"at": "20m", "gpu": 0, "xid": 94},  # after the loss, on a GPU that remains
                {"at": "25m", "gpu": 1, "xid": 48},  # while GPU 1 is lost: nobody hears it
                {"at": "50m", "gpu": 1, "xid": 63},  # after it came back
            ]
        )
    )
    try:
        reader = reader_of(rig)
        state = rig.poll()
        seen = []
        for _ in range(12):  # every 5 minutes for an hour
            state = rig.poll(300)
            seen = [(gpu, event.data) for _, gpu, event in reader.recent]
            if rig.node.clock.now() == 900:
                uuid1 = state.snapshot.gpus[1].uuid if state.snapshot else ""
                assert sample(state, "gpuledger_gpu_events_up", gpu="1", uuid=uuid1) == 0
        assert seen == [(1, 79), (0, 94), (1, 63)]
        assert state.events is not None
        assert all(g.watched for g in state.events.gpus)
    finally:
        rig.close()


def test_the_reader_survives_a_driver_restart() -> None:
    restart = {"at": "10m", "until": "12m", "call": "*", "error": "DRIVER_NOT_LOADED"}
    rig = Rig(node([{"at": "5m", "gpu": 0, "xid": 13}, restart, {"at": "30m", "gpu": 2, "xid": 79}]))
    try:
        reader = reader_of(rig)
        rig.poll()
        for _ in range(8):  # to 40 min
            state = rig.poll(300)
            if rig.node.clock.now() == 600:
                assert state.events is not None
                assert not state.events.reading
        assert [(gpu, event.data) for _, gpu, event in reader.recent] == [(0, 13), (2, 79)]
        assert state.events is not None
        assert state.events.reading
        assert rig.node.calls["nvmlEventSetCreate"] >= 2  # made again after the driver came back
    finally:
        rig.close()


def test_a_poll_never_waits_for_the_readers_wait() -> None:
    settings = Settings(node_name="rig", events=EventsConfig(wait=5.0))
    rig = Rig(node([{"at": "1h", "gpu": 0, "xid": 79}]), settings=settings)
    try:
        reader = reader_of(rig)
        reader.start()
        deadline = time.monotonic() + 5
        while fake_events.waiting(rig.node.library) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake_events.waiting(rig.node.library) == 1  # blocked in a 5 s wait
        durations = []
        for _ in range(5):
            started = time.monotonic()
            rig.poll(60)
            durations.append(time.monotonic() - started)
            assert fake_events.waiting(rig.node.library) == 1  # still waiting throughout
        # Each poll took a fraction of the wait it ran beside: it never waited for it.
        assert max(durations) < 1.0, durations
        rig.node.clock.advance(HOUR)  # the Xid's time comes while the reader waits: it wakes
        deadline = time.monotonic() + 5
        while not reader.recent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(gpu, event.data) for _, gpu, event in reader.recent] == [(0, 79)]
        started = time.monotonic()
        assert reader.stop()
        assert time.monotonic() - started < 5.5
    finally:
        rig.close()


def test_a_reader_stuck_in_a_driver_call_fails_healthz_and_reads_as_not_watched() -> None:
    """The reader's thread stuck in nvmlEventSetWait (from 1 minute in, the wait takes an hour)
    went unnoticed: /healthz stayed 200 and gpuledger_gpu_events_up 1 while no event could come
    through. It is a stuck driver call like a poll's: unhealthy, and past exit_after the end."""
    settings = Settings(
        node_name="rig",
        events=EventsConfig(wait=0.1),
        watchdog=WatchdogConfig(call_timeout=0.2, exit_after=600),
    )
    rig = Rig(node([{"at": "1m", "call": "nvmlEventSetWait", "latency_ms": 3_600_000}], gpus=2), settings=settings)
    try:
        reader = reader_of(rig)
        reader.start()
        state = rig.poll()
        assert state.snapshot is not None
        uuids = [d.uuid for d in state.snapshot.gpus]
        assert [sample(state, "gpuledger_gpu_events_up", gpu=str(i), uuid=u) for i, u in enumerate(uuids)] == [1, 1]
        assert rig.pipeline.healthy()
        rig.node.clock.advance(120)  # the reader's next wait does not return
        deadline = time.monotonic() + 5
        while rig.pipeline.healthy() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not rig.pipeline.healthy()  # within the wait (0.1 s) and the call budget (0.2 s)
        state = rig.poll(15)
        assert [sample(state, "gpuledger_gpu_events_up", gpu=str(i), uuid=u) for i, u in enumerate(uuids)] == [0, 0]
        assert [sample(state, "gpuledger_gpu_up", gpu=str(i), uuid=u) for i, u in enumerate(uuids)] == [1, 1]
        rig.pipeline.exit_after_s = 0.1  # the hard deadline passed
        with pytest.raises(DriverHung, match=r"has not returned for \ds \(the driver-event reader\)"):
            rig.poll(15)
    finally:
        rig.close()


def test_sigterm_during_a_long_wait_ends_the_daemon_cleanly_within_the_grace(tmp_path: Path) -> None:
    """events.wait may be up to 10 s. SIGTERM while the reader was in such a wait waited it
    out, past the 4.5 s shutdown grace: the daemon was cut off with exit 1, saying a GPU driver
    call was stuck, on a healthy node."""
    daemon = Daemon(tmp_path, "--fake", env={"GPULEDGER_EVENTS__WAIT": "10s"})
    daemon.wait_for(polls_at_least(1))
    started = time.monotonic()
    code = daemon.stop()
    took_s = time.monotonic() - started
    output = Path(daemon.log.name).read_text()
    assert code == 0, output
    assert took_s < 5.0
    assert "shutdown did not finish" not in output


def test_events_can_be_switched_off() -> None:
    rig = Rig(node([]), settings=Settings(node_name="rig", events=EventsConfig(enabled=False)))
    try:
        state = rig.poll()
        assert rig.agent.events is None
        assert state.events is None
        assert "gpuledger_gpu_events_up" not in rig.metrics(state)
        assert rig.node.calls["nvmlEventSetCreate"] == 0
    finally:
        rig.close()
