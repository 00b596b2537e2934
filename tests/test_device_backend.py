"""The device-backend seam: the sampler runs on any `DeviceBackend`, not only NVML's.

`TinyBackend` is a made-up vendor written against the protocol alone (no pynvml, no fake
NVML): if the sampler leaned on anything NVML-specific, these snapshots would be wrong.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import pytest

import agent.devices
from agent.config import Settings
from agent.devices import create_backend, register
from agent.devices.backend import (
    DeviceBackend,
    DeviceError,
    DeviceLost,
    Handle,
    PermissionDenied,
    ProcessInfo,
    ProcessSample,
    Quantity,
    ReadingKey,
    ReadingNotSupported,
    ReadResult,
    UtilizationSample,
)
from agent.devices.nvml import mig_profile_from_name
from agent.devices.sampler import Sampler
from agent.errors import ConfigError
from agent.model import AgentState, DeviceReading, NodeInfo, Snapshot
from exporters.prometheus import make_registry

GiB = 2**30
T0 = 1_800_000_000.0


class TinyBackend:
    """Two GPUs: "g0" whole, "g1" split into two halves "g1/0" and "g1/1" (GPU instances 1
    and 2). g0 has no temperature sensor. Every call is counted in `asked`."""

    VALUES: dict[tuple[str, ReadingKey], float] = {
        ("g0", ReadingKey(Quantity.MEMORY_USED)): 2 * GiB,
        ("g0", ReadingKey(Quantity.MEMORY_TOTAL)): 16 * GiB,
        ("g0", ReadingKey(Quantity.UTILIZATION)): 0.5,
        ("g0", ReadingKey(Quantity.POWER)): 150.0,
        ("g0", ReadingKey(Quantity.ENERGY)): 9000.0,
        ("g0", ReadingKey(Quantity.NVLINK_UP, 0)): 1.0,
        ("g0", ReadingKey(Quantity.NVLINK_UP, 1)): 0.0,
        ("g1", ReadingKey(Quantity.MEMORY_TOTAL)): 32 * GiB,
        ("g1", ReadingKey(Quantity.TEMPERATURE)): 41.0,
        ("g1", ReadingKey(Quantity.POWER)): 90.0,
        ("g1/0", ReadingKey(Quantity.MEMORY_USED)): 3 * GiB,
        ("g1/0", ReadingKey(Quantity.MEMORY_TOTAL)): 16 * GiB,
        ("g1/1", ReadingKey(Quantity.MEMORY_USED)): 1 * GiB,
        ("g1/1", ReadingKey(Quantity.MEMORY_TOTAL)): 16 * GiB,
    }

    def __init__(self, clock: Callable[[], float] = lambda: T0, *, aggregate_processes: bool = True) -> None:
        self.clock = clock
        self.aggregate_processes = aggregate_processes
        self.lost: set[str] = set()
        self.asked: Counter[str] = Counter()

    def _ask(self, call: str, handle: Handle = None) -> None:
        self.asked[call] += 1
        if handle in self.lost:
            raise DeviceLost(call, "FELL_OFF_THE_BUS")

    def init(self) -> None:
        self._ask("init")

    def shutdown(self) -> None:
        self._ask("shutdown")

    def driver_version(self) -> str:
        return "7.1"

    def cuda_driver_version(self) -> int:
        raise ReadingNotSupported("tinyCudaVersion", "NO_CUDA")

    def device_count(self) -> int:
        return 2

    def handle_by_index(self, index: int) -> Handle:
        return f"g{index}"

    def name(self, handle: Handle) -> str:
        return "Tiny T1" if "/" not in handle else "Tiny T1 half"

    def uuid(self, handle: Handle) -> str:
        return f"TINY-{handle}"

    def pci_bus_id(self, handle: Handle) -> str:
        return f"0000:0{handle[1]}:00.0"

    def minor_number(self, handle: Handle) -> int:
        return 7 - int(handle[1])

    def power_limit_w(self, handle: Handle) -> float:
        return 300.0

    def sm_count(self, handle: Handle) -> int:
        return 40 if "/" in handle else 80

    def nvlink_count(self, handle: Handle) -> int:
        return 2 if handle == "g0" else 0

    def mig_enabled(self, handle: Handle) -> bool:
        return bool(handle == "g1")

    def mig_handles(self, handle: Handle) -> list[tuple[int, Handle]]:
        return [(0, "g1/0"), (1, "g1/1")] if handle == "g1" else []

    def mig_profile(self, handle: Handle) -> str:
        return "half"

    def gpu_instance_id(self, handle: Handle) -> int:
        return 1 + int(handle[-1])

    def compute_instance_id(self, handle: Handle) -> int:
        return 0

    def read(self, handle: Handle, keys: Sequence[ReadingKey]) -> ReadResult:
        values: dict[ReadingKey, float] = {}
        errors: dict[ReadingKey, DeviceError] = {}
        for key in keys:  # one call per reading: batching is a backend's own business
            self._ask(f"read {key}", handle)
            value = self.VALUES.get((handle, key))
            if value is None:
                errors[key] = ReadingNotSupported(f"read {key}", "NO_SENSOR")
            else:
                values[key] = value
        return ReadResult(values, errors)

    def running_processes(self, handle: Handle) -> list[ProcessInfo]:
        self._ask(f"processes {handle}", handle)
        if handle == "g0":
            return [ProcessInfo(10, 1 * GiB), ProcessInfo(11, 1 * GiB)]
        on_halves = {"g1/0": [ProcessInfo(20, 3 * GiB, 1, 0)], "g1/1": [ProcessInfo(21, 1 * GiB, 2, 0)]}
        if handle == "g1":
            if not self.aggregate_processes:
                raise PermissionDenied("processes g1", "NOT_ROOT")
            return [*on_halves["g1/0"], *on_halves["g1/1"]]
        return on_halves[handle]

    def mps_processes(self, handle: Handle) -> list[ProcessInfo]:
        raise ReadingNotSupported(f"mps processes {handle}", "NOT_SUPPORTED")

    def graphics_processes(self, handle: Handle) -> list[ProcessInfo]:
        raise ReadingNotSupported(f"graphics processes {handle}", "NOT_SUPPORTED")

    def process_utilization(self, handle: Handle, since_us: int) -> list[ProcessSample]:
        self._ask(f"samples {handle}", handle)
        samples = [(10, 1_000_000, 40), (10, 2_000_000, 60), (11, 1_500_000, 10)]
        return [s for s in samples if s[1] > since_us]

    def utilization_samples(self, handle: Handle, since_us: int) -> list[UtilizationSample]:
        self._ask(f"utilization samples {handle}", handle)
        samples: list[UtilizationSample] = [(1_000_000, 30.0), (2_000_000, 70.0)]
        return [s for s in samples if s[0] > since_us]


def tiny_sampler(backend: TinyBackend) -> Sampler:
    typed: DeviceBackend = backend  # mypy checks TinyBackend against the protocol here
    sampler = Sampler(typed, hostname="tiny-node")
    sampler.start()
    return sampler


def by_label(snapshot: Snapshot) -> dict[str, DeviceReading]:
    return {d.label: d for d in snapshot.devices}


@pytest.mark.parametrize("aggregate_processes", [True, False], ids=["gpu-wide process list", "per-instance lists"])
def test_a_backend_without_nvml_drives_the_sampler_to_a_full_snapshot(aggregate_processes: bool) -> None:
    backend = TinyBackend(aggregate_processes=aggregate_processes)
    snapshot = tiny_sampler(backend).poll()
    assert snapshot.taken_at == T0
    assert snapshot.node == NodeInfo("tiny-node", "7.1", None)  # no CUDA: absent, not 0
    devices = by_label(snapshot)
    assert list(devices) == ["0", "1", "1:0", "1:1"]
    whole = devices["0"]
    assert (whole.uuid, whole.name, whole.pci_bus_id, whole.sm_count) == ("TINY-g0", "Tiny T1", "0000:00:00.0", 80)
    assert (whole.utilization, whole.power_w, whole.energy_j, whole.power_limit_w) == (0.5, 150.0, 9000.0, 300.0)
    assert whole.interval_utilization == 0.5  # its own samples since the last poll, 30% and 70%
    assert (whole.memory_used_bytes, whole.memory_total_bytes) == (2 * GiB, 16 * GiB)
    assert whole.temperature_c is None  # the tiny GPU has no sensor
    assert [(link.link, link.up) for link in whole.nvlinks] == [(0, True), (1, False)]
    # pid 10: samples of 40% and 60% -> 0.5; pid 11: one of 10% -> 0.1
    assert [(p.pid, p.used_memory_bytes, p.sm_util) for p in whole.processes] == [(10, GiB, 0.5), (11, GiB, 0.1)]
    split = devices["1"]
    assert split.mig_enabled
    assert (split.temperature_c, split.power_w, split.utilization) == (41.0, 90.0, None)
    # The GPU's memory in use is its instances' (3 GiB + 1 GiB); its total is read once.
    assert (split.memory_used_bytes, split.memory_total_bytes) == (4 * GiB, 32 * GiB)
    assert split.processes == ()
    halves = snapshot.mig_devices("TINY-g1")
    assert [(d.uuid, d.mig_profile, d.gpu_instance_id, d.sm_count) for d in halves] == [
        ("TINY-g1/0", "half", 1, 40),
        ("TINY-g1/1", "half", 2, 40),
    ]
    assert [(d.memory_used_bytes, d.memory_total_bytes) for d in halves] == [(3 * GiB, 16 * GiB), (GiB, 16 * GiB)]
    # Per-process utilization cannot be sampled on MIG: absent, never 0.
    assert [[(p.pid, p.sm_util, p.gpu_instance_id) for p in d.processes] for d in halves] == [
        [(20, None, 1)],
        [(21, None, 2)],
    ]


def test_a_reading_the_backend_lacks_is_asked_for_once() -> None:
    backend = TinyBackend()
    sampler = tiny_sampler(backend)
    for _ in range(3):
        sampler.poll()
    assert backend.asked["read temperature"] == 1 + 3  # g0 once (then learned), g1 every poll
    assert backend.asked["read utilization"] == 3 + 1  # g0 every poll, the split g1 once
    assert backend.asked["read power"] == 3 + 3
    assert sampler.errors == {}


def test_a_lost_device_from_any_backend_is_down_and_the_others_read() -> None:
    backend = TinyBackend()
    sampler = tiny_sampler(backend)
    backend.lost.add("g0")
    devices = by_label(sampler.poll())
    assert (devices["0"].up, devices["0"].down_reason) == (False, "FELL_OFF_THE_BUS")
    assert devices["1"].up
    assert devices["1:0"].memory_used_bytes == 3 * GiB
    assert sampler.errors[("read memory used", "FELL_OFF_THE_BUS")] == 1


def test_a_second_backend_is_one_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent.devices, "_BACKENDS", dict(agent.devices._BACKENDS))  # leave the real registry be
    register("tiny", TinyBackend)
    assert Settings(backend="tiny").backend == "tiny"
    backend = create_backend("tiny", lambda: T0 + 5)
    assert isinstance(backend, TinyBackend)
    assert Sampler(backend, hostname="n").poll().taken_at == T0 + 5
    with pytest.raises(ValueError, match="already registered"):
        register("tiny", TinyBackend)


def test_an_unknown_backend_is_a_config_error_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="known: nvml"):
        create_backend("rocm", lambda: T0)
    with pytest.raises(ValueError, match=r"unknown device backend 'rocm' \(known: nvml\)"):
        Settings(backend="rocm")


@pytest.mark.parametrize(
    ("name", "profile"),
    [
        ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "3g.40gb"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", "1g.10gb+me"),
        ("NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb", "1c.3g.20gb"),  # a compute instance of a GPU instance
        ("A100-SXM4-40GB MIG 2g.10gb", "2g.10gb"),  # older drivers leave "NVIDIA " off
        ("NVIDIA A100-SXM4-80GB", ""),
    ],
)
def test_the_mig_profile_is_read_from_the_nvml_name(name: str, profile: str) -> None:
    assert mig_profile_from_name(name) == profile


def test_exporters_show_the_profile_the_reading_carries_not_one_parsed_from_the_name() -> None:
    gpu = DeviceReading(0, "GPU-a", "NVIDIA A100-SXM4-80GB", True, mig_enabled=True)
    # A backend whose MIG names do not follow NVML's "<model> MIG <profile>" shape.
    instance = DeviceReading(
        0, "MIG-a", "slice zero", True, parent_uuid="GPU-a", mig_index=0, mig_profile="2g.20gb", gpu_instance_id=3,
        memory_used_bytes=GiB, memory_total_bytes=20 * GiB,
    )  # fmt: skip
    state = AgentState(snapshot=Snapshot(T0, NodeInfo("n"), (gpu, instance)))
    registry = make_registry(lambda: state, dcgm_compat=True)
    labels = {"gpu": "0", "uuid": "GPU-a", "mig": "0", "mig_uuid": "MIG-a", "gpu_instance_id": "3"}
    assert registry.get_sample_value("gpuledger_mig_info", {**labels, "profile": "2g.20gb"}) == 1
    used = [
        s.labels["GPU_I_PROFILE"]
        for family in registry.collect()
        if family.name == "DCGM_FI_DEV_FB_USED"
        for s in family.samples
    ]
    assert used == ["2g.20gb"]
    assert instance.model == "slice zero"
    named = DeviceReading(
        0, "MIG-b", "NVIDIA A100-SXM4-80GB MIG 3g.40gb", True, parent_uuid="GPU-a", mig_profile="3g.40gb"
    )
    assert named.model == "A100-SXM4-80GB"
