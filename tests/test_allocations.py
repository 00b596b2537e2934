"""Allocations (the kubelet's, Slurm's) against the processes actually on each device: which
holdings an allocation marks, and how an allocation that runs nothing holds its device."""

from __future__ import annotations

from dataclasses import replace

from agent.attribution.facts import PodAllocation, SlurmAllocation
from agent.attribution.resolve import Inputs, attribute
from agent.model import (
    DeviceReading,
    Holding,
    NodeInfo,
    ProcessFacts,
    ProcessIdentity,
    ProcessReading,
    Snapshot,
    Workload,
)

POD_A = "11111111-1111-4111-8111-111111111111"
POD_B = "22222222-2222-4222-8222-222222222222"
POD_NAMES = {POD_A: ("ml", "a"), POD_B: ("ml", "b")}
USERS = {1000: "ann", 1001: "bob"}


def pod_cgroup(uid: str) -> str:
    return f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-containerd-{'c' * 64}.scope\n"


def job_cgroup(job: str) -> str:
    return f"0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0\n"


def gpu(index: int, *pids: int, utilization: float | None = 0.5) -> DeviceReading:
    processes = tuple(ProcessReading(pid, 2**30, 0.25 if utilization is not None else None) for pid in pids)
    return DeviceReading(
        index=index, uuid=f"GPU-{index}", name="NVIDIA A100-SXM4-80GB", up=True, utilization=utilization,
        processes=processes,
    )  # fmt: skip


def holdings(
    devices: tuple[DeviceReading, ...],
    cgroups: dict[int, tuple[int, str]],  # pid -> (uid, cgroup)
    pods: tuple[PodAllocation, ...] = (),
    jobs: tuple[SlurmAllocation, ...] = (),
) -> list[tuple[str, Workload, tuple[int, ...], bool]]:
    facts = {pid: ProcessFacts(ProcessIdentity(pid, 1), uid, ("sleep",), cg) for pid, (uid, cg) in cgroups.items()}
    result = attribute(
        Inputs(
            snapshot=Snapshot(0.0, NodeInfo("n"), devices),
            processes=facts,
            pod_names=POD_NAMES,
            pod_allocations=pods,
            slurm_allocations=jobs,
            user_names=USERS,
        )
    )
    return [(h.device_uuid, h.workload, h.pids, h.allocated) for h in result.holdings]


def test_an_allocation_marks_only_its_owners_holdings_on_its_own_device() -> None:
    found = holdings(
        (gpu(0, 10, 11), gpu(1, 12)),
        {10: (1000, pod_cgroup(POD_A)), 11: (1001, pod_cgroup(POD_B)), 12: (1000, pod_cgroup(POD_A))},
        pods=(PodAllocation("ml", "a", "main", "GPU-0"), PodAllocation("ml", "b", "main", "GPU-1")),
    )
    assert found == [
        ("GPU-0", Workload(namespace="ml", pod="a", container="main"), (10,), True),
        # b runs on GPU 0 without an allocation there: a holding, not an allocated one
        ("GPU-0", Workload(namespace="ml", pod="b", container=""), (11,), False),
        # a runs on GPU 1, which is b's: a's holding there is not allocated either
        ("GPU-1", Workload(namespace="ml", pod="a", container=""), (12,), False),
        # and b's allocation of GPU 1, with nothing of b's running there, holds it by itself
        ("GPU-1", Workload(namespace="ml", pod="b", container="main"), (), True),
    ]


def test_a_jobs_allocation_marks_every_holding_of_the_job_on_the_device() -> None:
    found = holdings(
        (gpu(0, 10, 11, 12),),
        {10: (1000, job_cgroup("41")), 11: (1001, job_cgroup("41")), 12: (1001, job_cgroup("42"))},
        jobs=(SlurmAllocation(0, None, "41", None),),  # no user in the map file: each process's uid names it
    )
    assert found == [
        ("GPU-0", Workload(hpc_job="41", user="ann"), (10,), True),
        ("GPU-0", Workload(hpc_job="41", user="bob"), (11,), True),
        ("GPU-0", Workload(hpc_job="42", user="bob"), (12,), False),
    ]


def test_one_pod_allocated_a_device_for_two_containers_holds_it_once() -> None:
    # The first container's allocation makes the holding; the second is the same pod's.
    result = attribute(
        Inputs(
            snapshot=Snapshot(0.0, NodeInfo("n"), (gpu(0),)),
            processes={},
            pod_allocations=(PodAllocation("ml", "a", "main", "GPU-0"), PodAllocation("ml", "a", "side", "GPU-0")),
        )
    )
    workload = Workload(namespace="ml", pod="a", container="main")
    assert result.holdings == (Holding("GPU-0", workload, pids=(), sm_util=0.0, memory_bytes=0, allocated=True),)


def test_an_allocation_that_runs_nothing_uses_none_of_a_device_that_measures_and_unknown_otherwise() -> None:
    result = attribute(
        Inputs(
            snapshot=Snapshot(0.0, NodeInfo("n"), (gpu(0), gpu(1, utilization=None))),
            processes={},
            slurm_allocations=(SlurmAllocation(0, None, "41", None), SlurmAllocation(1, None, "42", None)),
        )
    )
    assert [(h.device_uuid, h.sm_util, h.memory_bytes) for h in result.holdings] == [
        ("GPU-0", 0.0, 0),
        ("GPU-1", None, 0),  # the device cannot measure use: unknown, never 0
    ]


def test_a_pod_allocation_named_by_gpu_index_lands_on_that_gpu() -> None:
    # Device plugins run with deviceIDStrategy=index report "1", not the GPU's UUID.
    found = holdings(
        (gpu(0), gpu(1, 10)), {10: (1000, pod_cgroup(POD_A))}, pods=(PodAllocation("ml", "a", "main", "1"),)
    )
    assert found == [("GPU-1", Workload(namespace="ml", pod="a", container="main"), (10,), True)]


def test_a_time_sliced_replica_of_a_gpu_is_that_gpu() -> None:
    # Time-slicing and MPS advertise each GPU as replicas "<id>::<n>" (k8s-device-plugin's
    # AnnotatedID), by UUID or by index; the kubelet reports each pod's replica.
    found = holdings(
        (gpu(0, 10), gpu(1)),
        {10: (1000, pod_cgroup(POD_A))},
        pods=(PodAllocation("ml", "a", "main", "GPU-0::0"), PodAllocation("ml", "b", "main", "1::3")),
    )
    assert found == [
        ("GPU-0", Workload(namespace="ml", pod="a", container="main"), (10,), True),
        ("GPU-1", Workload(namespace="ml", pod="b", container="main"), (), True),
    ]


def test_gke_time_shared_gpus_and_mig_instances_are_found_by_device_node() -> None:
    # GKE's time-sharing hands each pod a virtual GPU "nvidia<minor>/vgpu<n>", on a MIG instance
    # "nvidia<minor>/gi<id>/vgpu<n>". GPU 0 is /dev/nvidia3 here; GPU 1, MIG-enabled, /dev/nvidia2.
    whole = replace(gpu(0, 10), minor_number=3)
    parent = replace(gpu(1), minor_number=2, mig_enabled=True)
    instance = DeviceReading(
        index=1, uuid="MIG-1-5", name="NVIDIA A100-SXM4-80GB MIG 3g.40gb", up=True, parent_uuid="GPU-1",
        mig_index=0, gpu_instance_id=5, minor_number=2,
    )  # fmt: skip
    found = holdings(
        (whole, parent, instance),
        {10: (1000, pod_cgroup(POD_A))},
        pods=(
            PodAllocation("ml", "a", "main", "nvidia3/vgpu0"),
            PodAllocation("ml", "b", "main", "nvidia3/vgpu1"),
            PodAllocation("ml", "c", "main", "nvidia2/gi5/vgpu0"),
            PodAllocation("ml", "d", "main", "nvidia0"),  # no GPU has minor 0: nobody's
        ),
    )
    assert found == [
        ("GPU-0", Workload(namespace="ml", pod="a", container="main"), (10,), True),
        ("GPU-0", Workload(namespace="ml", pod="b", container="main"), (), True),
        ("MIG-1-5", Workload(namespace="ml", pod="c", container="main"), (), True),
    ]
