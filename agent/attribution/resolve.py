"""Who holds each GPU: processes and scheduler allocations turned into workloads. Pure.

Inputs are plain data gathered by `agent.attribution.gather` from the sources (procfs facts, pod
names, kubelet and Slurm allocations, user names: `agent.attribution.facts`); the output is an
`Attribution` with one `Holding` per (device, workload), labelled by `agent.attribution.labels`.
Label cardinality is bounded by workloads, not processes: pids appear only when per-pid series
are switched on.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from agent.attribution.cgroup import CgroupOwner, parse_cgroup
from agent.attribution.facts import PodAllocation, SlurmAllocation
from agent.attribution.labels import LabelRule, apply_rules
from agent.model import Attribution, DeviceReading, Holding, ProcessFacts, ProcessReading, Snapshot, Workload

# Pure, and sees the same few texts every poll: remember its answers.
_owner_of = lru_cache(maxsize=8192)(parse_cgroup)


@dataclass(frozen=True)
class Inputs:
    snapshot: Snapshot
    processes: Mapping[int, ProcessFacts | None]  # None: procfs could not resolve the pid
    pod_names: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # pod uid -> (namespace, name)
    pod_allocations: Sequence[PodAllocation] = ()
    slurm_allocations: Sequence[SlurmAllocation] = ()
    user_names: Mapping[int, str] = field(default_factory=dict)
    rules: Sequence[LabelRule] = ()  # the labelling rules (`attribution.rules`)
    per_pid: bool = False
    kubelet_up: bool | None = None
    team_from_account: bool = False  # a Slurm job's account is its team where no rule names one


@dataclass
class _Acc:
    pids: list[int] = field(default_factory=list)
    sm_util: float | None = None
    memory_bytes: int | None = None
    allocated: bool = False
    self_reported: bool = False
    started_at: float | None = None

    def began(self, at: float | None) -> None:
        """It held the device from `at` (a process's or allocation's start), if that is earlier."""
        if at is not None and (self.started_at is None or at < self.started_at):
            self.started_at = at

    account: str = ""


_HoldingKey = tuple[str, Workload, int | None]  # (device uuid, workload, pid when per-pid)
# Who an allocation belongs to: ("pod", namespace, pod) or ("job", hpc_job).
_Owner = tuple[str, ...]


def attributed_readings(snapshot: Snapshot) -> tuple[tuple[object, ...], ...]:
    """Everything of `snapshot` that `attribute` reads, device by device: two snapshots with
    equal readings here attribute alike (given equal other inputs). Kept beside `attribute`, so
    that a reading it starts to use is added here too."""
    return tuple(
        (
            d.uuid,
            d.index,
            d.minor_number,
            d.parent_uuid is None,
            d.gpu_instance_id,
            d.mig_index,
            d.up,
            d.utilization is None,
            d.processes,
        )
        for d in snapshot.devices
    )


def _device_index(snapshot: Snapshot) -> tuple[dict[str, DeviceReading], dict[tuple[int, int | None], str]]:
    by_uuid = {d.uuid: d for d in snapshot.devices}
    by_slot: dict[tuple[int, int | None], str] = {}
    for d in snapshot.devices:
        by_slot[(d.index, d.gpu_instance_id if d.is_mig else None)] = d.uuid
    return by_uuid, by_slot


# GKE's device plugin (GoogleCloudPlatform/container-engine-accelerators) names a GPU by its
# device node, "nvidia<minor>", and a MIG instance by its GPU's node and GPU instance id,
# "nvidia<minor>/gi<id>" (the driver's capabilities/gpu<minor>/mig/gi<id>); a time-shared one
# carries a replica, "/vgpu<n>", after either.
_GKE_DEVICE = re.compile(r"nvidia([0-9]+)(?:/gi([0-9]+))?(?:/vgpu[0-9]+)?")

# The resources the NVIDIA and GKE device plugins hand GPUs out as: whole or shared GPUs, and MIG
# instances (shared or not). Other nvidia.com resources (the network operator's RDMA devices, a
# renamed GPU resource) are matched too, but an id of theirs that is no GPU's is no anomaly.
_GPU_RESOURCE = re.compile(r"nvidia\.com/(gpu|mig-[^/]+)(\.[^/]*)?")


def _pod_device_uuid(
    device_id: str,
    by_uuid: Mapping[str, DeviceReading],
    by_slot: Mapping[tuple[int, int | None], str],
    by_mig_label: Mapping[str, str],
    by_minor: Mapping[int, int],
) -> str | None:
    # A GPU shared by time-slicing or MPS is advertised as replicas "<id>::<n>", one per pod
    # sharing it (k8s-device-plugin's AnnotatedID); each replica is that device.
    device, sep, replica = device_id.rpartition("::")
    if sep and replica.isdigit():
        device_id = device
    if device_id in by_uuid:
        return device_id
    if device_id.isdigit():  # device plugins run with deviceIDStrategy=index report indexes
        return by_slot.get((int(device_id), None))  # a whole GPU (or a MIG-enabled GPU itself)
    gke = _GKE_DEVICE.fullmatch(device_id)
    if gke is not None:
        index = by_minor.get(int(gke[1]))
        gpu_instance = None if gke[2] is None else int(gke[2])
        return None if index is None else by_slot.get((index, gpu_instance))
    # A MIG device by index is "<gpu>:<n>", n the index nvmlDeviceGetMigDeviceHandleByIndex takes
    # (go-nvlib's VisitMigDevices): the reading's `label`, not its GPU instance id.
    return by_mig_label.get(device_id)


def attribute(inputs: Inputs) -> Attribution:
    snapshot = inputs.snapshot
    by_uuid, by_slot = _device_index(snapshot)
    by_mig_label = {d.label: d.uuid for d in snapshot.devices if d.is_mig}
    by_minor = {d.minor_number: d.index for d in snapshot.devices if not d.is_mig and d.minor_number is not None}

    pods_on_device: dict[str, list[PodAllocation]] = {}
    # device uuid -> (namespace, pod) -> its containers: what a process in a pod looks up.
    pod_containers: dict[str, dict[tuple[str, str], set[str]]] = {}
    unmatched: set[str] = set()
    for alloc in inputs.pod_allocations:
        uuid = _pod_device_uuid(alloc.device_id, by_uuid, by_slot, by_mig_label, by_minor)
        if uuid is None:
            if _GPU_RESOURCE.fullmatch(alloc.resource_name):
                unmatched.add(alloc.device_id)
        else:
            pods_on_device.setdefault(uuid, []).append(alloc)
            pod_containers.setdefault(uuid, {}).setdefault((alloc.namespace, alloc.pod), set()).add(alloc.container)
    slurm_on_device: dict[str, SlurmAllocation] = {}
    for s in inputs.slurm_allocations:
        index = by_minor.get(s.gpu_index) if s.by_minor else s.gpu_index
        uuid = None if index is None else by_slot.get((index, s.gpu_instance_id))
        if uuid is not None:
            slurm_on_device[uuid] = s
    # slurmd's cgroup names a job by its numeric id; the map files say the name users know it
    # by (an array task's `1234_7`), which labels it on every device.
    slurm_names = {s.job_id: s.job for s in inputs.slurm_allocations if s.job_id is not None}
    named_pods = frozenset(inputs.pod_names.values())  # the pods whose uid the log directories name

    unresolved: dict[str, int] = {}
    placed: list[tuple[str, ProcessReading, ProcessFacts | None, Workload, bool, str]] = []
    for device in snapshot.devices:
        if not device.up:
            continue
        for proc in device.processes:
            facts = inputs.processes.get(proc.pid)
            if facts is None:
                unresolved[device.uuid] = unresolved.get(device.uuid, 0) + 1
                placed.append((device.uuid, proc, None, Workload(), False, ""))
            else:
                workload, claimed, account = _process_workload(
                    facts, device.uuid, inputs, pod_containers, named_pods, slurm_on_device, slurm_names
                )
                placed.append((device.uuid, proc, facts, workload, claimed, account))
    owner_models = _owner_models(workload for *_, workload, _claimed, _account in placed)

    holdings: dict[_HoldingKey, _Acc] = {}
    for uuid, proc, facts, workload, claimed, account in placed:
        key = (uuid, _with_owner_model(workload, owner_models), proc.pid if inputs.per_pid else None)
        acc = holdings.setdefault(key, _Acc())
        if facts is not None and account and not acc.account:
            acc.account = account
        acc.self_reported = acc.self_reported or (facts is not None and claimed)
        acc.pids.append(proc.pid)
        if facts is not None:
            acc.began(facts.started_at)
        if proc.sm_util is not None:
            acc.sm_util = (acc.sm_util or 0.0) + proc.sm_util
        if proc.used_memory_bytes is not None:
            acc.memory_bytes = (acc.memory_bytes or 0) + proc.used_memory_bytes

    # Each allocation marks only its owner's holdings on its device, found through this index:
    # attribution costs processes + allocations, not their product.
    by_owner: dict[tuple[str, _Owner], list[_Acc]] = {}
    for (uuid, workload, _pid), acc in holdings.items():
        _index_holding(by_owner, uuid, workload, acc)
    measures: dict[str, bool] = {}
    for uuid, allocs in pods_on_device.items():
        for alloc in allocs:
            base = Workload(namespace=alloc.namespace, pod=alloc.pod, container=alloc.container)
            _mark_allocated(holdings, by_owner, measures, by_uuid[uuid], base, inputs, owner_models, None)
    for uuid, s in slurm_on_device.items():
        job = Workload(hpc_job=s.job, user=s.user or "")
        _mark_allocated(
            holdings, by_owner, measures, by_uuid[uuid], job, inputs, owner_models, s.started_at, s.account or ""
        )

    order = {d.uuid: i for i, d in enumerate(snapshot.devices)}
    return Attribution(
        holdings=tuple(
            Holding(
                device_uuid=uuid,
                workload=workload,
                pids=tuple(sorted(acc.pids)),
                sm_util=None if acc.sm_util is None else min(acc.sm_util, 1.0),
                memory_bytes=acc.memory_bytes,
                allocated=acc.allocated,
                pid=pid,
                self_reported=acc.self_reported and not acc.allocated,
                started_at=acc.started_at,
                account=acc.account,
            )
            for (uuid, workload, pid), acc in sorted(
                holdings.items(), key=lambda kv: (order[kv[0][0]], kv[0][1], kv[0][2] or 0)
            )
        ),
        unresolved=tuple(sorted(unresolved.items())),
        kubelet_up=inputs.kubelet_up,
        unmatched_devices=tuple(sorted(unmatched)),
    )


def _owner_models(workloads: Iterable[Workload]) -> dict[Workload, str]:
    """The one model each pod, job, container or unit names, keyed by its workload without it.

    One job's processes do not all say what they run: the ranks a server spawns (vLLM's
    tensor-parallel workers, `multiprocessing` children, Ray actors) carry none of its flags. Left
    alone, one job's dollars would split between its model and ''. A process of such an owner that
    names no model takes the model its other processes name, where they name exactly one; a user's
    unscheduled processes are separate work and take nothing from each other."""
    named: dict[Workload, set[str]] = {}
    for w in workloads:
        if w.model and (w.pod or w.hpc_job or w.container or w.unit):
            named.setdefault(replace(w, model=""), set()).add(w.model)
    return {owner: next(iter(models)) for owner, models in named.items() if len(models) == 1}


def _with_owner_model(w: Workload, owner_models: Mapping[Workload, str]) -> Workload:
    """`w`, with its owner's model (`_owner_models`) where it names none itself."""
    model = "" if w.model else owner_models.get(w, "")
    return replace(w, model=model) if model else w


def _owner_of_allocation(allocated: Workload) -> _Owner:
    """A pod's allocation belongs to the pod (any of its containers), a job's to the job."""
    return ("pod", allocated.namespace, allocated.pod) if allocated.pod else ("job", allocated.hpc_job)


def _index_holding(by_owner: dict[tuple[str, _Owner], list[_Acc]], uuid: str, held: Workload, acc: _Acc) -> None:
    """File a holding under every owner whose allocation would claim it: its pod, if any, and
    its job (the empty job too, as an allocation naming no job claims the holdings with none)."""
    by_owner.setdefault((uuid, ("job", held.hpc_job)), []).append(acc)
    if held.pod:
        by_owner.setdefault((uuid, ("pod", held.namespace, held.pod)), []).append(acc)


def _mark_allocated(
    holdings: dict[_HoldingKey, _Acc],
    by_owner: dict[tuple[str, _Owner], list[_Acc]],
    measures: dict[str, bool],
    device: DeviceReading,
    base: Workload,
    inputs: Inputs,
    owner_models: Mapping[Workload, str],
    started_at: float | None,
    account: str = "",
) -> None:
    """An allocation is held by the process holdings of the same owner on that device; with
    none, the allocation holds the device by itself (a notebook that runs nothing), using
    none of it: 0 where the device measures use, unknown where it cannot. `measures` remembers
    per device whether it does. The holding began no later than the allocation (`started_at`,
    where the scheduler's record tells it)."""
    held = by_owner.get((device.uuid, _owner_of_allocation(base)))
    if held:
        for acc in held:
            acc.allocated = True
            acc.began(started_at)
            acc.account = account or acc.account  # the prolog's account wins over the environment's
        return
    # A job's GPUs that run nothing are still its model's.
    labelled = apply_rules(base, (), None, inputs.rules, account or None, inputs.team_from_account)
    workload = _with_owner_model(labelled, owner_models)
    acc = holdings.setdefault((device.uuid, workload, None), _Acc())
    acc.account = account
    _index_holding(by_owner, device.uuid, workload, acc)  # a later allocation of the same owner shares it
    acc.allocated = True
    acc.began(started_at)
    if device.uuid not in measures:
        # Whether utilization was read, not its value: `attributed_readings` keys on no more.
        measures[device.uuid] = device.utilization is not None or any(p.sm_util is not None for p in device.processes)
    acc.sm_util = 0.0 if measures[device.uuid] else acc.sm_util
    acc.memory_bytes = acc.memory_bytes or 0


def _process_workload(
    facts: ProcessFacts,
    device_uuid: str,
    inputs: Inputs,
    pod_containers: Mapping[str, Mapping[tuple[str, str], set[str]]],
    named_pods: Collection[tuple[str, str]],
    slurm_on_device: Mapping[str, SlurmAllocation],
    slurm_names: Mapping[str, str],
) -> tuple[Workload, bool, str]:
    """The process's workload, whether only its own environment says so, and its Slurm account.

    Trusted sources decide: the cgroup (set by the kubelet, slurmd, systemd or the container
    runtime, not by the process), the kubelet's pod names and the prolog's map file (root's).
    A process's environment is its own to write, so SLURM_JOB_ID and SLURM_JOB_USER there are a
    claim: used only where nothing trusted names a job, never for the user (that is the uid's),
    and marked as self-reported. Otherwise any local user could bill their GPU time to someone
    else's job. The account is the map file's for the job on this device, else the process's
    SLURM_JOB_ACCOUNT; only a job has one.
    """
    owner: CgroupOwner | None = _owner_of(facts.cgroup)
    claimed = False
    uid = facts.uid
    user = inputs.user_names.get(uid, str(uid)) if uid is not None else ""
    account: str | None = facts.env_value("SLURM_JOB_ACCOUNT")
    mapped = slurm_on_device.get(device_uuid)
    # slurmd in a pod (Slinky) or a container builds its jobs' cgroups inside the pod's or the
    # container's, where any process there could make a job_<id> directory too: such a job is the
    # owner only where the prolog's map file (root's) gives this device to that same job;
    # otherwise the pod or container is.
    job_owns = (
        owner is not None
        and owner.slurm_job is not None
        and (
            (owner.kind == "slurm" and not owner.job_nested)
            or (mapped is not None and mapped.job_id == owner.slurm_job)
        )
    )
    if owner is not None and owner.kind == "pod" and owner.pod_uid and not job_owns:
        namespace, pod = inputs.pod_names.get(owner.pod_uid, ("", ""))
        pods = pod_containers.get(device_uuid, {})
        only = next(iter(pods)) if len(pods) == 1 else None
        if not pod and only is not None and only not in named_pods:
            # The kubelet names the pods holding this device; with exactly one, it is ours, unless
            # the log directories name that pod under its own uid: then ours is another pod (one
            # the kubelet no longer lists, whose process outlived it), not to be billed to it.
            namespace, pod = only
        containers = pods.get((namespace, pod), set())
        container = next(iter(containers)) if len(containers) == 1 else ""
        w = Workload(namespace=namespace, pod=pod or f"uid-{owner.pod_uid}", container=container)
    elif owner is not None and owner.slurm_job and job_owns:
        # slurmd's cgroup names the job (by its numeric id: the map files name an array task's
        # `1234_7`); its user is the map file's for that job, else the uid's.
        job_user = mapped.user if mapped is not None and mapped.job_id == owner.slurm_job and mapped.user else user
        w = Workload(hpc_job=slurm_names.get(owner.slurm_job, owner.slurm_job), user=job_user)
    else:
        env_job = facts.env_value("SLURM_JOB_ID")
        if owner is not None and owner.kind in ("container", "slurm") and owner.container_id:
            w = Workload(container=owner.container_id[:12], user=user)
        elif owner is not None and owner.kind == "service" and owner.unit:
            w = Workload(unit=owner.unit, user=user)
        elif mapped is not None and (not mapped.user or mapped.user == user):
            # The map file's job holds this GPU; a process no cgroup places is that job's only
            # when it runs as the job's user: another user's stays their own, and may not claim
            # the job (or another) through its environment either.
            w = Workload(hpc_job=mapped.job, user=mapped.user or user)
        elif env_job and mapped is None:
            w = Workload(hpc_job=env_job, user=user)
            claimed = True
        else:
            owner_uid = owner.uid if owner is not None and owner.uid is not None else uid
            w = Workload(user=inputs.user_names.get(owner_uid, str(owner_uid)) if owner_uid is not None else "")
    if w.hpc_job and mapped is not None and mapped.job == w.hpc_job and mapped.account:
        account = mapped.account
    # Rules may match any process's account; only a job is billed to one (and teamed by it).
    labelled = apply_rules(w, facts.cmdline, facts, inputs.rules, account, inputs.team_from_account and bool(w.hpc_job))
    return labelled, claimed, (account or "") if w.hpc_job else ""
