"""The sampler on the real pynvml over the fake: what one poll reads, and how it survives faults."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

import fake_nvml
from agent.devices.backend import DriverLibraryMissing
from agent.devices.nvml import NvmlBackend
from agent.devices.sampler import REINIT_BACKOFF_FIRST_S, Sampler
from agent.devices.telemetry import ReadingOptions
from agent.model import Snapshot

MiB = 2**20


@pytest.fixture
def install() -> Iterator[Any]:
    def _install(spec: Any, readings: ReadingOptions | None = None) -> tuple[fake_nvml.InstalledNode, Sampler]:
        node = fake_nvml.install(spec)
        sampler = Sampler(NvmlBackend(clock=node.clock.wall_time), hostname="test-node", readings=readings)
        sampler.start()
        return node, sampler

    yield _install
    fake_nvml.uninstall()


def by_label(snapshot: Snapshot) -> dict[str, Any]:
    return {d.label: d for d in snapshot.devices}


def test_demo_poll_reads_every_gpu_from_the_scenario(install: Any) -> None:
    node, sampler = install("demo")
    sampler.poll()
    node.clock.advance(5)
    snapshot = sampler.poll()
    gpus = by_label(snapshot)
    assert len(snapshot.gpus) == 8
    assert snapshot.taken_at == pytest.approx(node.clock.wall_time())
    assert snapshot.node.driver_version == "550.54.15"
    busy = gpus["0"]
    assert busy.up
    assert busy.name == "NVIDIA A100-SXM4-80GB"
    assert busy.model == "A100-SXM4-80GB"
    assert busy.utilization == pytest.approx(0.92)
    assert busy.memory_used_bytes == 61000 * MiB
    assert busy.memory_total_bytes == 81920 * MiB
    # power rises from idle 55 W toward the 400 W limit with utilization
    assert busy.power_w == pytest.approx(55 + (400 - 55) * 0.92, abs=0.001)
    assert busy.power_limit_w == 400
    assert busy.temperature_c == round(32 + (83 - 32) * 0.92)
    assert len(busy.nvlinks) == 12
    assert all(link.up for link in busy.nvlinks)
    assert [p.pid for p in busy.processes] == [4101]
    assert busy.processes[0].sm_util == pytest.approx(0.92)
    shared = gpus["4"]
    assert {p.pid: p.sm_util for p in shared.processes} == {5200: pytest.approx(0.55), 6310: pytest.approx(0.20)}
    notebook = gpus["5"]
    assert notebook.utilization == 0
    # the driver reports no sample for a process at 0%: measured, and zero
    assert notebook.processes[0].sm_util == 0.0
    assert notebook.processes[0].used_memory_bytes == 30000 * MiB
    idle = gpus["6"]
    assert idle.processes == ()
    assert idle.power_w == 55


def test_energy_is_the_driver_counter_and_grows_with_scenario_time(install: Any) -> None:
    node, sampler = install("demo")
    first = by_label(sampler.poll())["0"].energy_j
    node.clock.advance(3600)
    second = by_label(sampler.poll())["0"].energy_j
    # GPU 0 runs at 92% all hour: 55 + 345 * 0.92 = 372.4 W for 3600 s
    assert second - first == pytest.approx(372.4 * 3600, rel=1e-6)


def test_process_utilization_is_the_mean_of_samples_since_the_previous_poll(install: Any) -> None:
    node, sampler = install(
        {
            "gpus": [{"count": 1}],
            "processes": [
                {"pid": 10, "gpus": [0], "sm_util": [{"at": "0s", "sm_util": 20}, {"at": "20s", "sm_util": 80}]}
            ],
        }
    )
    node.clock.advance(15)
    sampler.poll()
    node.clock.advance(10)  # samples at t=16..25: 16-19 at 20%, 20-25 at 80%
    reading = by_label(sampler.poll())["0"]
    assert reading.processes[0].sm_util == pytest.approx((4 * 0.20 + 6 * 0.80) / 10)


def test_processes_stamped_apart_each_read_their_own_rate(install: Any) -> None:
    # The driver stamps each process's samples at its own time, so two processes' stamps are
    # apart by any amount (1 us here): that gap is no sampling period. Taken for one, the 10 s
    # between polls held ten million periods, and each process read a millionth of its rate.
    node, sampler = install(
        {"gpus": [{"count": 1}], "processes": [{"pid": p, "gpus": [0], "sm_util": 30 * (p - 9)} for p in (10, 11)]}
    )
    sampler.poll()
    node.clock.advance(10)
    sampler.poll()
    node.clock.advance(10)
    reading = by_label(sampler.poll())["0"]
    stamps = {pid: stamp for pid, stamp, _util in node.process_samples(0, 0, node.clock.now())}
    assert 0 < stamps[10] - stamps[11] < 1000
    assert {p.pid: p.sm_util for p in reading.processes} == {10: pytest.approx(0.30), 11: pytest.approx(0.60)}


def test_field_values_batch_power_energy_and_nvlink_into_one_call(install: Any) -> None:
    node, sampler = install("demo")
    sampler.poll()
    before = node.calls.copy()
    sampler.poll()
    calls = node.calls - before
    assert calls["nvmlDeviceGetFieldValues"] == 8
    assert calls["nvmlDeviceGetPowerUsage"] == 0
    assert calls["nvmlDeviceGetNvLinkState"] == 0
    assert calls["nvmlDeviceGetTotalEnergyConsumption"] == 0
    # no device is read twice for the same thing in one poll
    assert calls["nvmlDeviceGetUtilizationRates"] == 8
    assert calls["nvmlDeviceGetMemoryInfo_v2"] == 8


def test_old_driver_falls_back_to_the_calls_it_has(install: Any) -> None:
    node, sampler = install("old-driver")
    sampler.poll()
    node.clock.advance(5)
    reading = by_label(sampler.poll())["0"]
    assert reading.up
    assert [p.pid for p in reading.processes] == [900]
    assert reading.memory_used_bytes == 12000 * MiB
    assert reading.power_w is not None
    assert reading.power_w > 52
    assert reading.temperature_c is not None
    # v3 and memory-v2 were tried once each, found missing, and never asked for again
    assert node.library.missing_lookups["nvmlDeviceGetComputeRunningProcesses_v3"] == 1
    assert node.library.missing_lookups["nvmlDeviceGetMemoryInfo_v2"] == 1
    assert node.calls["nvmlDeviceGetComputeRunningProcesses_v2"] >= 2
    # the R470 field-values call has no instant-power field: power comes from the single call
    assert node.calls["nvmlDeviceGetPowerUsage"] >= 2


def test_unsupported_temperature_is_absent_and_logged_once(install: Any, caplog: pytest.LogCaptureFixture) -> None:
    node, sampler = install(
        {
            "gpus": [{"count": 2}],
            "faults": [{"gpu": 1, "call": "nvmlDeviceGetTemperature", "error": "NOT_SUPPORTED"}],
        }
    )
    caplog.set_level(logging.INFO, logger="agent.devices.sampler")
    temperature_calls = []
    for _ in range(20):
        before = node.calls.copy()
        snapshot = sampler.poll()
        temperature_calls.append((node.calls - before)["nvmlDeviceGetTemperature"])
        node.clock.advance(5)
    gpus = by_label(snapshot)
    assert gpus["1"].temperature_c is None
    assert gpus["0"].temperature_c == 32
    lines = [r for r in caplog.records if "temperature is not supported" in r.getMessage()]
    assert len(lines) == 1
    assert "GPU 1" in lines[0].getMessage()
    # asked once on GPU 1, then only GPU 0 is asked
    assert temperature_calls[0] == 2
    assert set(temperature_calls[1:]) == {1}
    assert sampler.errors == {}


def test_gpu_lost_mid_run_marks_only_that_gpu_down(install: Any) -> None:
    node, sampler = install("gpu-lost")
    before = by_label(sampler.poll())
    assert before["1"].up
    node.clock.advance(600)
    after = by_label(sampler.poll())
    assert not after["1"].up
    assert after["1"].down_reason == "GPU_IS_LOST"
    assert after["1"].uuid == before["1"].uuid
    assert [after[i].up for i in "023"] == [True, True, True]
    e0 = after["0"].energy_j
    node.clock.advance(60)
    later = by_label(sampler.poll())
    assert later["0"].energy_j > e0
    assert not later["1"].up
    assert any(error == "GPU_IS_LOST" for (_call, error) in sampler.errors)


def test_lost_gpu_is_retried_with_backoff_not_every_poll(install: Any) -> None:
    node, sampler = install(
        {"gpus": [{"count": 2}], "faults": [{"at": "10s", "until": "10m", "gpu": 1, "error": "GPU_IS_LOST"}]}
    )
    node.clock.advance(10)
    sampler.poll()
    attempts = []
    for _ in range(60):  # 60 polls 1 s apart: retries at 5, 10, 20, 40 s after the loss
        node.clock.advance(1)
        before = node.calls.copy()
        sampler.poll()
        attempts.append((node.calls - before)["nvmlDeviceGetMemoryInfo_v2"])
    # GPU 0 is read every poll; GPU 1 only on the backoff schedule
    retries = sum(a - 1 for a in attempts)
    assert 3 <= retries <= 5
    node.clock.advance(600)
    for _ in range(10):
        node.clock.advance(60)
        snapshot = sampler.poll()
    assert by_label(snapshot)["1"].up


def test_driver_gone_then_back_is_reinitialised_with_backoff(install: Any) -> None:
    node, sampler = install(
        {"gpus": [{"count": 2}], "faults": [{"at": "1m", "until": "3m", "call": "*", "error": "DRIVER_NOT_LOADED"}]}
    )
    assert sampler.poll().driver_up
    node.clock.advance(60)
    down = sampler.poll()
    assert not down.driver_up
    assert [d.up for d in down.gpus] == [False, False]
    inits_before = node.calls["nvmlInitWithFlags"]
    for _ in range(int(REINIT_BACKOFF_FIRST_S) - 1):
        node.clock.advance(1)
        sampler.poll()
    assert node.calls["nvmlInitWithFlags"] == inits_before  # still waiting out the first backoff
    while node.clock.now() < 180:
        node.clock.advance(5)
        sampler.poll()
    inits_during = node.calls["nvmlInitWithFlags"] - inits_before
    assert 2 <= inits_during <= 6  # 5, 10, 20, 40, 80 s apart: not one per poll
    node.clock.advance(300)
    back = sampler.poll()
    assert back.driver_up
    assert [d.up for d in back.gpus] == [True, True]


def test_mig_instances_are_devices_joined_to_their_gpu(install: Any) -> None:
    node, sampler = install("mig")
    sampler.poll()
    node.clock.advance(5)
    snapshot = sampler.poll()
    devices = by_label(snapshot)
    parent = devices["0"]
    assert parent.mig_enabled
    assert parent.utilization is None  # MIG-enabled GPUs report no utilization
    assert parent.processes == ()
    instances = snapshot.mig_devices(parent.uuid)
    assert [d.label for d in instances] == ["0:0", "0:1"]
    first, second = instances
    assert first.uuid.startswith("MIG-")
    assert first.parent_uuid == parent.uuid
    assert first.memory_total_bytes == 40 * 1024 * MiB
    assert first.memory_used_bytes == 20000 * MiB
    assert first.sm_count == 42
    assert parent.sm_count == 108
    assert [p.pid for p in first.processes] == [800]
    assert [p.pid for p in second.processes] == [801]
    assert first.processes[0].sm_util is None  # not measurable on MIG: absent, never 0
    assert first.gpu_instance_id == 1
    assert second.gpu_instance_id == 2
    assert devices["1"].utilization == pytest.approx(0.40)


def test_nvlink_down_window_shows_in_the_snapshot(install: Any) -> None:
    node, sampler = install(
        {
            "gpus": [{"count": 2, "nvlink_links": 4}],
            "faults": [{"at": "5m", "until": "6m", "gpu": 1, "nvlink_down": [3]}],
        }
    )
    node.clock.advance(330)
    links = {link.link: link.up for link in by_label(sampler.poll())["1"].nvlinks}
    assert links == {0: True, 1: True, 2: True, 3: False}
    node.clock.advance(60)
    assert all(link.up for link in by_label(sampler.poll())["1"].nvlinks)


def test_transient_errors_are_counted_and_leave_the_reading_absent(install: Any) -> None:
    node, sampler = install(
        {
            "gpus": [{"count": 1}],
            "processes": [{"pid": 5, "gpus": [0], "sm_util": 50, "memory_mib": 100}],
            "faults": [{"at": "1m", "until": "2m", "call": "nvmlDeviceGetComputeRunningProcesses", "error": "TIMEOUT"}],
        }
    )
    node.clock.advance(61)
    during = by_label(sampler.poll())["0"]
    assert during.up
    assert during.processes == ()
    assert during.utilization == pytest.approx(0.5)
    assert sampler.errors[("nvmlDeviceGetComputeRunningProcesses", "TIMEOUT")] == 1
    node.clock.advance(60)
    after = by_label(sampler.poll())["0"]
    assert [p.pid for p in after.processes] == [5]  # TIMEOUT was not learned as unsupported


def test_no_nvml_library_raises_driver_library_missing() -> None:
    fake_nvml.uninstall()
    sampler = Sampler(NvmlBackend(clock=lambda: 0.0))
    with pytest.raises(DriverLibraryMissing):
        sampler.start()


@pytest.mark.parametrize("error", ["GPU_IS_LOST", "RESET_REQUIRED"])
@pytest.mark.parametrize(
    "call",
    [None, "nvmlDeviceGetPowerUsage"],
    ids=["every call", "power, read in the field-values batch"],
)
def test_a_gpu_that_needs_a_reset_is_down_like_a_lost_one(install: Any, error: str, call: str | None) -> None:
    fault: dict[str, Any] = {"at": "1m", "gpu": 1, "error": error}
    if call is not None:
        fault["call"] = call
    node, sampler = install({"gpus": [{"count": 2}], "faults": [fault]})
    assert by_label(sampler.poll())["1"].up
    node.clock.advance(61)
    after = by_label(sampler.poll())
    assert not after["1"].up
    assert after["1"].down_reason == error
    assert after["0"].up
    assert after["0"].power_w is not None


def test_a_fully_split_mig_gpu_costs_at_most_ten_calls_a_poll(install: Any) -> None:
    node, sampler = install(
        {
            "gpus": [{"model": "A100-SXM4-80GB", "mig": ["1g.10gb"] * 7, "nvlink_links": 12}],
            "processes": [
                {"pid": 900 + m, "gpus": [f"0:{m}"], "sm_util": 30, "memory_mib": 1000 + m} for m in range(7)
            ],
        }
    )
    sampler.poll()
    node.clock.advance(5)
    before = node.calls.copy()
    snapshot = sampler.poll()
    calls = node.calls - before
    # temperature, field values (power, energy, 12 NVLinks), the GPU's process list, and
    # one memory reading per MIG device: 3 + 7
    assert sum(calls.values()) <= 10
    assert calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 1
    parent = snapshot.gpus[0]
    instances = snapshot.mig_devices(parent.uuid)
    assert [[p.pid for p in d.processes] for d in instances] == [[900 + m] for m in range(7)]
    assert [d.memory_used_bytes for d in instances] == [(1000 + m) * MiB for m in range(7)]
    assert parent.memory_used_bytes == sum(1000 + m for m in range(7)) * MiB
    assert parent.memory_total_bytes == 81920 * MiB
    assert len(parent.nvlinks) == 12


def test_the_mig_profile_is_carried_on_each_instance(install: Any) -> None:
    _node, sampler = install("mig")
    snapshot = sampler.poll()
    parent = snapshot.gpus[0]
    instances = snapshot.mig_devices(parent.uuid)
    assert [(d.name, d.mig_profile, d.model) for d in instances] == [
        ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "3g.40gb", "A100-SXM4-80GB")
    ] * 2
    assert (parent.mig_profile, parent.model) == ("", "A100-SXM4-80GB")


def test_a_long_process_list_is_read_in_one_call_once_the_buffer_fits(install: Any) -> None:
    node, sampler = install(
        {
            "gpus": [{"count": 1}],
            "processes": [{"pid": 1000 + n, "gpus": [0], "sm_util": 1 + n % 50, "memory_mib": 10} for n in range(100)],
        },
        # The health readings off: the calls counted below are the basic readings' alone.
        ReadingOptions(groups=frozenset()),
    )
    for _ in range(2):  # the first polls grow the buffers: 100 processes, then 5 s of their samples
        sampler.poll()
        node.clock.advance(5)
    before = node.calls.copy()
    reading = by_label(sampler.poll())["0"]
    calls = node.calls - before
    assert [p.pid for p in reading.processes] == list(range(1000, 1100))
    assert [p.sm_util for p in reading.processes] == [pytest.approx((1 + n % 50) / 100) for n in range(100)]
    assert calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 1
    assert calls["nvmlDeviceGetProcessUtilization"] == 1
    assert calls["nvmlDeviceGetSamples"] == 1  # the device's own utilization samples, in one call too
    # memory, utilization, temperature, field values, processes, process samples, device samples
    assert sum(calls.values()) == 7


def test_mps_clients_and_graphics_processes_are_listed_and_a_refused_list_is_asked_once(install: Any) -> None:
    node, sampler = install(
        {
            "gpus": [{"count": 1}],
            "processes": [
                {"pid": 700, "gpus": [0], "memory_mib": 500, "cmdline": "nvidia-cuda-mps-server"},
                {"pid": 701, "gpus": [0], "context": "mps", "sm_util": 60, "memory_mib": 4000},
                {"pid": 702, "gpus": [0], "context": "graphics", "sm_util": 10, "memory_mib": 100},
            ],
            "faults": [{"call": "nvmlDeviceGetGraphicsRunningProcesses", "error": "NOT_SUPPORTED"}],
        }
    )
    sampler.poll()
    before = node.calls.copy()
    for _ in range(3):
        node.clock.advance(5)
        reading = by_label(sampler.poll())["0"]
        # The server and its client; the graphics list is refused, so 702 is not known.
        assert {p.pid: p.sm_util for p in reading.processes} == {700: 0.0, 701: pytest.approx(0.60)}
    calls = node.calls - before
    # The MPS list names a process, so it is read every poll; the refused graphics list never again.
    assert calls["nvmlDeviceGetMPSComputeRunningProcesses_v3"] == 3
    assert calls["nvmlDeviceGetGraphicsRunningProcesses_v3"] == 0


def test_a_graphics_process_that_starts_between_asks_is_listed_once_it_has_a_sample(install: Any) -> None:
    node, sampler = install(
        {
            "gpus": [{"count": 1}],
            "processes": [
                {"pid": 5, "gpus": [0], "sm_util": 50, "memory_mib": 100},
                {"pid": 6, "gpus": [0], "context": "graphics", "start": "7s", "sm_util": 30, "memory_mib": 200},
            ],
        }
    )
    sampler.poll()  # asks the MPS and graphics lists: both empty, next due in a slow interval
    node.clock.advance(5)
    before = node.calls.copy()
    assert [p.pid for p in by_label(sampler.poll())["0"].processes] == [5]
    assert (node.calls - before)["nvmlDeviceGetGraphicsRunningProcesses_v3"] == 0  # not due
    node.clock.advance(5)
    # 6 started at 7 s: its samples name a pid no list read at this poll did, so the lists are
    # asked now, not at the next slow interval.
    reading = by_label(sampler.poll())["0"]
    assert [p.pid for p in reading.processes] == [5, 6]
    assert reading.processes[1].used_memory_bytes == 200 * MiB


def test_a_working_pid_no_list_names_asks_the_lists_once_not_every_poll(install: Any) -> None:
    # The graphics list is refused, so graphics process 6's samples name a pid no list ever
    # does. The lists were asked again on its account at every poll: here one MPS-list call a
    # poll (the refused graphics list is not called), on every GPU with such a process.
    node, sampler = install(
        {
            "gpus": [{"count": 1}],
            "processes": [
                {"pid": 5, "gpus": [0], "sm_util": 50, "memory_mib": 100},
                {"pid": 6, "gpus": [0], "context": "graphics", "sm_util": 30, "memory_mib": 200},
            ],
            "faults": [{"call": "nvmlDeviceGetGraphicsRunningProcesses", "error": "NOT_SUPPORTED"}],
        }
    )
    sampler.poll()  # asks both lists: MPS empty, graphics refused (learned); next due in 30 s
    before = node.calls.copy()
    for _ in range(4):  # 5-20 s: none due
        node.clock.advance(5)
        assert [p.pid for p in by_label(sampler.poll())["0"].processes] == [5]
    # Asked once on 6's account (at 5 s), not again at 10, 15 and 20 s.
    assert (node.calls - before)["nvmlDeviceGetMPSComputeRunningProcesses_v3"] == 1
