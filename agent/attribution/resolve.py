"""Who holds each GPU: processes and scheduler allocations turned into workloads. Pure.

Inputs are plain data gathered by `agent.attribution.gather` (procfs facts, pod names, kubelet and
Slurm allocations, user names); the output is an `Attribution` with one `Holding` per
(device, workload). Label cardinality is bounded by workloads, not processes: pids appear
only when per-pid series are switched on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from agent.attribution.cgroup import CgroupOwner, parse_cgroup
from agent.attribution.recognise import recognise_model
from agent.model import Attribution, DeviceReading, Holding, ProcessFacts, Snapshot, Workload

# Both are pure and see the same few texts every poll: remember their answers.
_owner_of = lru_cache(maxsize=8192)(parse_cgroup)
_model_of = lru_cache(maxsize=8192)(recognise_model)

# Fields a rule may match on, beyond `env.<KEY>` for allowlisted environment variables.
MATCH_FIELDS = ("cmdline", "namespace", "pod", "container", "hpc_job", "unit", "user", "account")
# Older names a rule may still use: `job` was the Slurm job's label before it became `hpc_job`.
MATCH_ALIASES = {"job": "hpc_job"}
SET_FIELDS = ("model", "team")


@dataclass(frozen=True, slots=True)
class Rule:
    match: tuple[tuple[str, re.Pattern[str]], ...]
    set: tuple[tuple[str, str], ...]


def compile_rules(rules: Sequence[tuple[Mapping[str, str], Mapping[str, str]]]) -> tuple[Rule, ...]:
    """(match, set) pairs, as the config validated them, into rules."""
    return tuple(
        Rule(
            match=tuple((MATCH_ALIASES.get(key, key), re.compile(pattern)) for key, pattern in match.items()),
            set=tuple(sets.items()),
        )
        for match, sets in rules
    )


def rule_env_keys(rules: Sequence[Rule]) -> set[str]:
    """Environment keys the rules read: they join the allowlist, and nothing else does."""
    return {key.removeprefix("env.") for rule in rules for key, _ in rule.match if key.startswith("env.")}


@dataclass(frozen=True, slots=True)
class PodAllocation:
    namespace: str
    pod: str
    container: str
    device_id: str  # a GPU or MIG UUID, or a GPU index, as the device plugin reports it


@dataclass(frozen=True, slots=True)
class SlurmAllocation:
    gpu_index: int
    gpu_instance_id: int | None
    job: str
    user: str | None


@dataclass(frozen=True)
class Inputs:
    snapshot: Snapshot
    processes: Mapping[int, ProcessFacts | None]  # None: procfs could not resolve the pid
    pod_names: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # pod uid -> (namespace, name)
    pod_allocations: Sequence[PodAllocation] = ()
    slurm_allocations: Sequence[SlurmAllocation] = ()
    user_names: Mapping[int, str] = field(default_factory=dict)
    rules: Sequence[Rule] = ()
    per_pid: bool = False
    kubelet_up: bool | None = None


@dataclass
class _Acc:
    pids: list[int] = field(default_factory=list)
    sm_util: float | None = None
    memory_bytes: int | None = None
    allocated: bool = False


def _device_index(snapshot: Snapshot) -> tuple[dict[str, DeviceReading], dict[tuple[int, int | None], str]]:
    by_uuid = {d.uuid: d for d in snapshot.devices}
    by_slot: dict[tuple[int, int | None], str] = {}
    for d in snapshot.devices:
        by_slot[(d.index, d.gpu_instance_id if d.is_mig else None)] = d.uuid
    return by_uuid, by_slot


def _pod_device_uuid(device_id: str, by_uuid: Mapping[str, DeviceReading], snapshot: Snapshot) -> str | None:
    if device_id in by_uuid:
        return device_id
    if device_id.isdigit():  # device plugins run with deviceIDStrategy=index report indexes
        for d in snapshot.gpus:
            if d.index == int(device_id):
                return d.uuid
    return None


def attribute(inputs: Inputs) -> Attribution:
    snapshot = inputs.snapshot
    by_uuid, by_slot = _device_index(snapshot)

    pods_on_device: dict[str, list[PodAllocation]] = {}
    for alloc in inputs.pod_allocations:
        uuid = _pod_device_uuid(alloc.device_id, by_uuid, snapshot)
        if uuid is not None:
            pods_on_device.setdefault(uuid, []).append(alloc)
    slurm_on_device: dict[str, SlurmAllocation] = {}
    for s in inputs.slurm_allocations:
        uuid = by_slot.get((s.gpu_index, s.gpu_instance_id))
        if uuid is not None:
            slurm_on_device[uuid] = s

    holdings: dict[tuple[str, Workload, int | None], _Acc] = {}
    unresolved: dict[str, int] = {}
    for device in snapshot.devices:
        if not device.up:
            continue
        for proc in device.processes:
            facts = inputs.processes.get(proc.pid)
            if facts is None:
                unresolved[device.uuid] = unresolved.get(device.uuid, 0) + 1
                workload = Workload()
            else:
                workload = _process_workload(facts, device.uuid, inputs, pods_on_device, slurm_on_device)
            key = (device.uuid, workload, proc.pid if inputs.per_pid else None)
            acc = holdings.setdefault(key, _Acc())
            acc.pids.append(proc.pid)
            if proc.sm_util is not None:
                acc.sm_util = (acc.sm_util or 0.0) + proc.sm_util
            if proc.used_memory_bytes is not None:
                acc.memory_bytes = (acc.memory_bytes or 0) + proc.used_memory_bytes

    for uuid, allocs in pods_on_device.items():
        for alloc in allocs:
            base = Workload(namespace=alloc.namespace, pod=alloc.pod, container=alloc.container)
            _mark_allocated(holdings, by_uuid[uuid], base, inputs)
    for uuid, s in slurm_on_device.items():
        _mark_allocated(holdings, by_uuid[uuid], Workload(hpc_job=s.job, user=s.user or ""), inputs)

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
            )
            for (uuid, workload, pid), acc in sorted(
                holdings.items(), key=lambda kv: (order[kv[0][0]], kv[0][1], kv[0][2] or 0)
            )
        ),
        unresolved=tuple(sorted(unresolved.items())),
        kubelet_up=inputs.kubelet_up,
    )


def _same_owner(held: Workload, allocated: Workload) -> bool:
    if allocated.pod:
        return (held.namespace, held.pod) == (allocated.namespace, allocated.pod)
    return held.hpc_job == allocated.hpc_job


def _mark_allocated(
    holdings: dict[tuple[str, Workload, int | None], _Acc],
    device: DeviceReading,
    base: Workload,
    inputs: Inputs,
) -> None:
    """An allocation is held by the process holdings of the same owner on that device; with
    none, the allocation holds the device by itself (a notebook that runs nothing), using
    none of it: 0 where the device measures use, unknown where it cannot."""
    matched = False
    for (device_uuid, workload, _pid), acc in holdings.items():
        if device_uuid == device.uuid and _same_owner(workload, base):
            acc.allocated = True
            matched = True
    if not matched:
        workload = _apply_rules(base, (), None, inputs.rules)
        acc = holdings.setdefault((device.uuid, workload, None), _Acc())
        acc.allocated = True
        measures = device.utilization is not None or any(p.sm_util is not None for p in device.processes)
        acc.sm_util = 0.0 if measures else acc.sm_util
        acc.memory_bytes = acc.memory_bytes or 0


def _process_workload(
    facts: ProcessFacts,
    device_uuid: str,
    inputs: Inputs,
    pods_on_device: Mapping[str, list[PodAllocation]],
    slurm_on_device: Mapping[str, SlurmAllocation],
) -> Workload:
    owner: CgroupOwner | None = _owner_of(facts.cgroup)
    uid = facts.uid
    user = inputs.user_names.get(uid, str(uid)) if uid is not None else ""
    account: str | None = facts.env_value("SLURM_JOB_ACCOUNT")
    if owner is not None and owner.kind == "pod" and owner.pod_uid:
        namespace, pod = inputs.pod_names.get(owner.pod_uid, ("", ""))
        allocs = pods_on_device.get(device_uuid, [])
        if not pod:
            # The kubelet names the pods holding this device; with exactly one, it is ours.
            pods = {(a.namespace, a.pod) for a in allocs}
            if len(pods) == 1:
                namespace, pod = next(iter(pods))
        containers = {a.container for a in allocs if (a.namespace, a.pod) == (namespace, pod)}
        container = next(iter(containers)) if len(containers) == 1 else ""
        w = Workload(namespace=namespace, pod=pod or f"uid-{owner.pod_uid}", container=container)
    elif owner is not None and owner.kind == "slurm" and owner.slurm_job:
        w = Workload(hpc_job=owner.slurm_job, user=facts.env_value("SLURM_JOB_USER") or user)
    else:
        env_job = facts.env_value("SLURM_JOB_ID")
        mapped = slurm_on_device.get(device_uuid)
        if owner is not None and owner.kind == "container" and owner.container_id:
            w = Workload(container=owner.container_id[:12], user=user)
        elif owner is not None and owner.kind == "service" and owner.unit:
            w = Workload(unit=owner.unit, user=user)
        elif env_job:
            w = Workload(hpc_job=env_job, user=facts.env_value("SLURM_JOB_USER") or user)
        elif mapped is not None:
            w = Workload(hpc_job=mapped.job, user=mapped.user or user)
        else:
            owner_uid = owner.uid if owner is not None and owner.uid is not None else uid
            w = Workload(user=inputs.user_names.get(owner_uid, str(owner_uid)) if owner_uid is not None else "")
    return _apply_rules(w, facts.cmdline, facts, inputs.rules, account)


def _field_value(
    key: str, w: Workload, cmdline: Sequence[str], facts: ProcessFacts | None, account: str | None
) -> str | None:
    if key == "cmdline":
        return " ".join(cmdline) if cmdline else None
    if key == "account":
        return account
    if key.startswith("env."):
        return facts.env_value(key[4:]) if facts is not None else None
    value = str(getattr(w, key))
    return value or None


def _apply_rules(
    w: Workload,
    cmdline: Sequence[str],
    facts: ProcessFacts | None,
    rules: Sequence[Rule],
    account: str | None = None,
) -> Workload:
    """Config rules first (the first rule that sets a field wins it), then the built-in
    recognisers for a model no rule named."""
    chosen: dict[str, str] = {}
    for rule in rules:
        if all(name in chosen for name, _ in rule.set):
            continue
        groups: list[str] = []
        for key, pattern in rule.match:
            value = _field_value(key, w, cmdline, facts, account)
            found = pattern.search(value) if value is not None else None
            if found is None:
                break
            groups.extend(g or "" for g in found.groups())
        else:
            for name, template in rule.set:
                if name not in chosen:
                    chosen[name] = _expand(template, groups)
    if "model" not in chosen and cmdline:
        recognised = _model_of(tuple(cmdline))
        if recognised:
            chosen["model"] = recognised
    return _with_fields(w, tuple(chosen.items())) if chosen else w


@lru_cache(maxsize=8192)
def _with_fields(w: Workload, fields: tuple[tuple[str, str], ...]) -> Workload:
    # The same few workloads get the same labels every poll, and `replace` inspects the
    # dataclass each time it is called: remember its answers.
    return replace(w, **dict(fields))


def _expand(template: str, groups: Sequence[str]) -> str:
    return re.sub(
        r"\$(\d)", lambda m: groups[int(m.group(1)) - 1] if 0 < int(m.group(1)) <= len(groups) else "", template
    )
