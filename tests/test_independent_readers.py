"""Independent readers agree: nvitop and gpustat, run on the same fake node through the same
pynvml, read what gpuledger's snapshot reads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import fake_nvml
from agent.devices.nvml import NvmlBackend
from agent.devices.sampler import Sampler
from agent.model import Snapshot


@pytest.fixture
def demo_snapshot() -> Iterator[Snapshot]:
    node = fake_nvml.install("demo")
    node.clock.advance(3 * 3600)  # into the second util segment of the inference server
    sampler = Sampler(NvmlBackend(clock=node.clock.wall_time))
    sampler.start()
    yield sampler.poll()
    fake_nvml.uninstall()


def test_nvitop_device_api_reads_the_same_values(demo_snapshot: Snapshot) -> None:
    from nvitop import Device

    devices = Device.all()
    assert len(devices) == len(demo_snapshot.gpus)
    for device, reading in zip(devices, demo_snapshot.gpus, strict=True):
        assert device.uuid() == reading.uuid
        assert device.gpu_utilization() == round((reading.utilization or 0) * 100)
        assert device.memory_used() == reading.memory_used_bytes
        assert device.memory_total() == reading.memory_total_bytes
        assert device.temperature() == reading.temperature_c
        assert device.power_usage() == round((reading.power_w or 0) * 1000)  # nvitop reports mW
        assert sorted(device.processes()) == sorted(p.pid for p in reading.processes)


def test_gpustat_reads_the_same_values(demo_snapshot: Snapshot) -> None:
    import gpustat

    stats = gpustat.new_query()
    assert len(stats) == len(demo_snapshot.gpus)
    for gpu, reading in zip(stats, demo_snapshot.gpus, strict=True):
        assert gpu.uuid == reading.uuid
        assert gpu.utilization == round((reading.utilization or 0) * 100)
        assert gpu.memory_used == (reading.memory_used_bytes or 0) // 2**20  # gpustat reports MiB
        assert gpu.temperature == reading.temperature_c
        assert gpu.power_draw == int(reading.power_w or 0)  # gpustat truncates mW to W
        # gpustat drops processes psutil cannot find on this host, and scenario pids are not
        # real host processes, so its process list is not compared here.


def test_nvitop_reads_the_same_clocks_utilizations_and_links(demo_snapshot: Snapshot) -> None:
    from nvitop import NA, Device

    for device, reading in zip(Device.all(), demo_snapshot.gpus, strict=True):
        t = reading.telemetry
        assert t is not None
        assert device.sm_clock() * 1e6 == t.sm_clock_hz  # nvitop reports MHz
        assert device.memory_clock() * 1e6 == t.memory_clock_hz
        assert device.max_sm_clock() * 1e6 == t.sm_clock_max_hz
        assert device.performance_state() == f"P{t.performance_state}"
        assert device.fan_speed() is NA  # passively cooled A100s
        assert t.fan_speed_ratio is None
        assert device.memory_utilization() == round((t.memory_utilization or 0) * 100)
        assert device.encoder_utilization() == round((t.encoder_utilization or 0) * 100)
        assert device.decoder_utilization() == round((t.decoder_utilization or 0) * 100)
        # nvitop has no PCIe link methods: Device.__getattr__ passes these through to pynvml
        assert device.curr_pcie_link_generation() == t.pcie_link_generation
        assert device.max_pcie_link_width() == t.pcie_link_width_max
