"""What the workload sources find, as plain data: the vocabulary between the sources (which
read the host) and `agent.attribution.resolve` (which turns it into workloads, purely).

Each poll starts from an empty `HostFacts`; every registered source adds what it knows and
hands it on, and the result goes to `attribute`. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.model import ProcessFacts


@dataclass(frozen=True, slots=True)
class PodAllocation:
    """One device the kubelet has allocated to one container."""

    namespace: str
    pod: str
    container: str
    # As the device plugin says: a GPU or MIG UUID, a GPU index, or GKE's "nvidia<minor>[/gi<id>]";
    # a time-shared replica has "::<n>" (NVIDIA's) or "/vgpu<n>" (GKE's) after it.
    device_id: str
    resource_name: str = "nvidia.com/gpu"  # e.g. nvidia.com/gpu.shared, nvidia.com/mig-1g.10gb


@dataclass(frozen=True, slots=True)
class SlurmAllocation:
    """One GPU, or MIG instance, allocated to a Slurm job (as its prolog's map file says)."""

    gpu_index: int  # the GPU's NVML index; its /dev/nvidia<minor> number where `by_minor`
    gpu_instance_id: int | None  # a MIG GPU instance (a `<gpu>.<gi>` map file); None for a whole GPU
    job: str
    user: str | None
    # When the prolog wrote the map file (its modification time, unix seconds): the
    # allocation's start. None where the file's time could not be read.
    started_at: float | None = None
    account: str | None = None  # the job's Slurm account, where the map file names it
    # An array task's own job id, where `job` is its `<array job>_<task>` (the map file's
    # `1235=1234_7`); None for any other job.
    task_job_id: str | None = None
    # An `nvidia<minor>` map file: `gpu_index` is the GPU's device node number (the prolog's
    # SLURM_JOB_GPUS), which need not be its NVML index.
    by_minor: bool = False

    @property
    def job_id(self) -> str | None:
        """The numeric id slurmd names the job's cgroup by (`job_<id>`): `job` itself for a plain
        job, the task's own for an array task; None where the map file gives only `1234_7`."""
        if self.task_job_id is not None:
            return self.task_job_id
        return self.job if self.job.isascii() and self.job.isdigit() else None


# Not frozen, though no source sets a field: each source hands on a copy (`replace`) every poll,
# and a frozen dataclass's __init__ sets each field through object.__setattr__, which made each
# copy cost 1.6 times as much (4.6 against 2.8 us).
@dataclass(slots=True)
class HostFacts:
    """Everything the sources found in one poll, each field added by the source that knows it."""

    processes: Mapping[int, ProcessFacts | None] = field(default_factory=dict)  # None: pid unresolvable
    user_names: Mapping[int, str] = field(default_factory=dict)  # uid -> user name
    pod_names: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # pod uid -> (namespace, name)
    pod_allocations: tuple[PodAllocation, ...] = ()
    slurm_allocations: tuple[SlurmAllocation, ...] = ()
    kubelet_up: bool | None = None  # None: no kubelet on this node
    # False while the scheduler's allocations cannot be known (see Attribution.allocations_known)
    allocations_known: bool = True
