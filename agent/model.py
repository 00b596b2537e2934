"""Plain frozen data passed between the stages: sampler -> attribution -> accounting -> rules
-> exporters. Nothing here does I/O; every stage may import this module and nothing else of
another stage."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ProcessReading:
    pid: int
    used_memory_bytes: int | None
    # Mean SM utilization (0-1) over the driver's samples since the previous poll; None when the
    # device cannot measure it (MIG, old GPUs). A process with no sample on a device that
    # measures is 0: the driver only reports processes that did some work.
    sm_util: float | None
    gpu_instance_id: int | None = None


@dataclass(frozen=True, slots=True)
class NvLinkReading:
    link: int
    up: bool


@dataclass(frozen=True, slots=True)
class DeviceReading:
    """One GPU, or one MIG instance of a GPU (then `parent_uuid` is set), as read in one poll.

    Readings the device does not have, or that failed this poll, are None, never 0.
    """

    index: int
    uuid: str
    name: str
    up: bool
    parent_uuid: str | None = None
    mig_index: int | None = None
    gpu_instance_id: int | None = None
    pci_bus_id: str = ""
    down_reason: str | None = None
    mig_enabled: bool = False
    sm_count: int | None = None
    utilization: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    energy_j: float | None = None
    nvlinks: tuple[NvLinkReading, ...] = ()
    processes: tuple[ProcessReading, ...] = ()

    @property
    def model(self) -> str:
        """The GPU model as scenarios and pricing name it: the NVML name minus "NVIDIA "."""
        return self.name.removeprefix("NVIDIA ").split(" MIG ")[0]

    @property
    def is_mig(self) -> bool:
        return self.parent_uuid is not None

    @property
    def label(self) -> str:
        """The `gpu` label: the index, or "index:mig" for a MIG instance."""
        return str(self.index) if self.mig_index is None else f"{self.index}:{self.mig_index}"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    hostname: str
    driver_version: str = ""
    cuda_driver_version: int | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one poll read, stamped with the backend's clock (unix seconds)."""

    taken_at: float
    node: NodeInfo
    devices: tuple[DeviceReading, ...]
    poll_duration_s: float = 0.0
    driver_up: bool = True

    @property
    def gpus(self) -> tuple[DeviceReading, ...]:
        return tuple(d for d in self.devices if d.parent_uuid is None)

    def mig_devices(self, parent_uuid: str) -> tuple[DeviceReading, ...]:
        return tuple(d for d in self.devices if d.parent_uuid == parent_uuid)


@dataclass(frozen=True, slots=True)
class AgentHealth:
    """The agent's own counters as of the latest poll, swapped in with the snapshot."""

    polls_total: int = 0
    polls_failed: int = 0
    polls_overran: int = 0
    last_success_at: float | None = None  # backend clock
    nvml_errors: tuple[tuple[str, str, int], ...] = ()  # (call, error, count)


@dataclass(frozen=True, slots=True)
class AgentState:
    snapshot: Snapshot | None = None
    health: AgentHealth = field(default_factory=AgentHealth)
