"""Who owns a process, read from the text of its `/proc/<pid>/cgroup`.

Pure: the caller reads the file (through its procfs root) and hands the text in; nothing here
touches the filesystem. The text is one `hierarchy-ID:controllers:path` line per hierarchy:
many lines on cgroup v1, the single `0::/path` on v2, both on a hybrid host.

The path names the workload because every manager that places processes writes its own
marker into it:

    kubelet, systemd driver   /kubepods.slice/kubepods-burstable.slice/
                                  kubepods-burstable-pod<uid, '-' written as '_'>.slice/
                                  cri-containerd-<id>.scope | crio-<id>.scope | docker-<id>.scope
    kubelet, cgroupfs driver  /kubepods/burstable/pod<uid>/<id>   (or crio-<id>)
    Slurm, cgroup/v1          /slurm[_<node>]/uid_<uid>/job_<id>/step_<step>/task_<n>
    Slurm, cgroup/v2          /system.slice/[<node>_]slurmstepd.scope/job_<id>/step_<step>/user/task_<n>
    Docker                    /docker/<id>  or  /system.slice/docker-<id>.scope
    Podman                    /machine.slice/libpod-<id>.scope, /libpod_parent/libpod-<id>
    systemd (systemd.slice(5)) /system.slice/<name>.service, /user.slice/user-<uid>.slice/...

Several of these nest (a kind node is a Docker container holding pods; Slinky runs slurmd in a
pod; rootless Podman lives under a user's systemd manager), so every marker on a line is
read, and the owner is the most specific one: pod > slurm > container > service > user. A pod
beats the container because the container belongs to the pod. Between lines of a v1 file the
same order decides, then the deeper path. Below a user's own manager (user@<uid>.service, a tree
systemd delegates to the user, who can make any directory there) only containers and services
count: a pod, Slurm job or other user named there is the user's claim, not the owner. A Slurm job
inside a pod (Slinky) or a container (Slurm in Docker) is marked `job_nested`: the pod or container
could have made that directory itself, so `agent.attribution.resolve` decides whether the job is
the owner.

Nothing is guessed: every id returned is taken from the text (a pod uid has systemd's '_'
turned back into '-' and is lower-cased). Text that names no workload gives None, and no text
makes this raise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CgroupOwner", "parse_cgroup"]


@dataclass(frozen=True, slots=True)
class CgroupOwner:
    """The workload a process belongs to, as its cgroup path names it.

    `kind` is the owner. The other fields are what the same line says about it: a pod's own
    container; the Slurm job inside a pod (Slinky) or the container around a job; the uid whose
    slice or Slurm tree holds it. `unit` is set only for kind "service".
    """

    kind: str  # "pod" | "slurm" | "container" | "service" | "user"
    pod_uid: str | None = None
    container_id: str | None = None
    runtime: str | None = None  # "containerd" | "crio" | "docker" | "podman"
    slurm_job: str | None = None
    slurm_step: str | None = None
    unit: str | None = None
    uid: int | None = None
    # The job's directories lie inside a pod's or container's cgroup (slurmd run there: Slinky,
    # Slurm in Docker), which that pod or container could have made itself.
    job_nested: bool = False


# re.ASCII throughout: `\d` would otherwise accept other scripts' digits, which int() turns
# into numbers that do not appear in the text.
_LINE = re.compile(r"[0-9]+:[^:]*:(/.*)", re.ASCII)
# A v2 cgroup that was removed while the process still sits in it (a zombie) is shown with this
# suffix by proc_cgroup_show() in kernel/cgroup/cgroup.c.
_DELETED = " (deleted)"

# A pod UID as the API server issues it (a UUID), or the 32-hex md5 the kubelet gives a static
# pod. Under the systemd driver the kubelet escapes '-' as '_' (cgroup_manager_linux.go).
_POD_UID = r"[0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12}|[0-9a-fA-F]{32}"
# The systemd driver spells the whole ancestry into the slice name, so the segment alone is
# enough: kubepods-pod<uid>.slice (guaranteed), kubepods-burstable-pod<uid>.slice, and with a
# --cgroup-root such as kind's /kubelet, kubelet-kubepods-besteffort-pod<uid>.slice.
_POD_SLICE = re.compile(rf"(?:[^/]*-)?kubepods(?:-burstable|-besteffort)?-pod({_POD_UID})\.slice", re.ASCII)
# The cgroupfs driver: pod<uid> below a `kubepods` directory (/kubepods/[qos/]pod<uid>).
_POD_DIR = re.compile(rf"pod({_POD_UID})", re.ASCII)
_KUBEPODS_DIR = "kubepods"

# Runtimes name a container's scope <prefix>-<id>.scope (systemd driver: runc turns the
# "slice:prefix:id" cgroupsPath into that) or <prefix>-<id> / the bare id (cgroupfs driver).
# crio-conmon-<id> and libpod-conmon-<id> hold the monitor, not the container: they do not match.
_CONTAINER_SCOPE = re.compile(r"(cri-containerd|crio|docker|libpod|nerdctl)-([0-9a-f]{64})(?:\.scope)?", re.ASCII)
_CONTAINER_BARE = re.compile(r"[0-9a-f]{64}", re.ASCII)
_RUNTIME_OF_PREFIX = {
    "cri-containerd": "containerd",
    "nerdctl": "containerd",
    "crio": "crio",
    "docker": "docker",
    "libpod": "podman",
}
_DOCKER_CGROUPFS_PARENT = "docker"

_SLURM_V1_ROOT = re.compile(r"slurm(?:_[^/]+)?", re.ASCII)
_SLURM_V2_ROOT = re.compile(r"(?:[^/]+_)?slurmstepd\.scope", re.ASCII)
_SLURM_UID = re.compile(r"uid_([0-9]+)", re.ASCII)
_SLURM_JOB = re.compile(r"job_([0-9]+)", re.ASCII)
_SLURM_STEP = re.compile(r"step_([A-Za-z0-9]+)", re.ASCII)

# systemd unit names: ASCII letters, digits, ":-_.\" and '@' for template instances.
_SERVICE = re.compile(r"[A-Za-z0-9:_.\\@-]+\.service", re.ASCII)
# user@<uid>.service is the user's own systemd manager: it says whose tree this is, it is not a
# workload of its own.
_USER_MANAGER = re.compile(r"user@([0-9]+)\.service", re.ASCII)
_USER_SLICE = re.compile(r"user-([0-9]+)\.slice", re.ASCII)
# A uid is 32 bits: at most 10 digits. Longer digit runs are not uids, and would take int() past
# its default 4300-digit limit, where it raises.
_UID_DIGITS_MAX = 10

_PRIORITY = {"pod": 5, "slurm": 4, "container": 3, "service": 2, "user": 1}


def parse_cgroup(text: str) -> CgroupOwner | None:
    """The most specific workload named on any line of a `/proc/<pid>/cgroup` text, or None.

    None for the root cgroup, init.scope, slices without a user, conmon outside a pod, and
    anything that is not cgroup text.
    """
    best: CgroupOwner | None = None
    best_rank = (0, 0)
    seen: set[str] = set()
    for line in text.split("\n"):
        match = _LINE.fullmatch(line.strip())
        if match is None:
            continue
        path = match.group(1).removesuffix(_DELETED)
        if path in seen:  # v1 repeats one path for most controllers
            continue
        seen.add(path)
        segments = _segments(path)
        owner = _owner_of(segments)
        if owner is None:
            continue
        rank = (_PRIORITY[owner.kind], len(segments))
        if rank > best_rank:
            best, best_rank = owner, rank
    return best


def _segments(path: str) -> list[str]:
    parts = [part for part in path.split("/") if part and part != "."]
    # Read from inside another cgroup namespace, the kernel writes the path relative to the
    # reader's root, climbing out with leading '..' (a DaemonSet agent sees host pods that way).
    start = 0
    while start < len(parts) and parts[start] == "..":
        start += 1
    return parts[start:]


def _owner_of(segments: list[str]) -> CgroupOwner | None:
    pod_uid: str | None = None
    pod_container: tuple[str, str | None] | None = None
    container: tuple[str, str | None] | None = None
    slurm_job: str | None = None
    slurm_step: str | None = None
    job_nested = False
    unit: str | None = None
    uid: int | None = None
    under_kubepods = False
    # Below user@<uid>.service the tree is the user's own: systemd delegates it (Delegate=yes),
    # so the user can mkdir any name there and move processes in. Only what a user may run as
    # themselves counts below it: their containers (rootless Podman) and their services. A
    # kubepods-pod<uid>.slice, slurmstepd.scope/job_<id> or user-<uid>.slice written there is
    # a claim on someone else's pod, job or name, and is not read.
    delegated = False

    for i, segment in enumerate(segments):
        parent = segments[i - 1] if i else ""
        found = _container_of(segment, parent)
        if found is not None:
            container = found  # the deepest one: Docker-in-Docker's inner container
            continue
        if delegated:
            if _SERVICE.fullmatch(segment) and not _USER_MANAGER.fullmatch(segment):
                unit = segment
            continue

        pod = _pod_uid_of(segment, under_kubepods)
        if pod is not None:
            # The innermost pod owns the process; its own container is the next segment.
            pod_uid = pod
            child = segments[i + 1] if i + 1 < len(segments) else ""
            pod_container = _container_of(child, segment)
            continue
        if segment == _KUBEPODS_DIR:
            under_kubepods = True
            continue

        job = _slurm_job_of(segments, i)
        if job is not None:
            slurm_job, slurm_step, slurm_uid = job
            job_nested = pod_uid is not None or container is not None
            if slurm_uid is not None:
                uid = slurm_uid
            continue

        manager = _USER_MANAGER.fullmatch(segment)
        user_tree = manager or _USER_SLICE.fullmatch(segment)
        if user_tree is not None:
            tree_uid = _uid(user_tree.group(1))
            if tree_uid is not None:
                uid = tree_uid
            delegated = manager is not None
            continue
        if _SERVICE.fullmatch(segment):
            unit = segment

    # A pod owns what runs in it, a Slurm job inside it included; else the job owns its tree,
    # the container around it included.
    container_id, runtime = (pod_container if pod_uid is not None else container) or (None, None)
    if pod_uid is not None or slurm_job is not None:
        return CgroupOwner(
            "pod" if pod_uid is not None else "slurm",
            pod_uid=pod_uid,
            container_id=container_id,
            runtime=runtime,
            slurm_job=slurm_job,
            slurm_step=slurm_step,
            uid=uid,
            job_nested=job_nested,
        )
    if container_id is not None:
        return CgroupOwner("container", container_id=container_id, runtime=runtime, uid=uid)
    if unit is not None:
        return CgroupOwner("service", unit=unit, uid=uid)
    if uid is not None:
        return CgroupOwner("user", uid=uid)
    return None


def _container_of(segment: str, parent: str) -> tuple[str, str | None] | None:
    """(container id, runtime) when the segment is a container's own cgroup."""
    scope = _CONTAINER_SCOPE.fullmatch(segment)
    if scope is not None:
        return scope.group(2), _RUNTIME_OF_PREFIX[scope.group(1)]
    if _CONTAINER_BARE.fullmatch(segment):
        # The cgroupfs drivers name the directory by the bare id; only Docker's own parent says
        # which runtime made it (under a pod it is containerd or dockershim, we cannot tell).
        return segment, "docker" if parent == _DOCKER_CGROUPFS_PARENT else None
    return None


def _pod_uid_of(segment: str, under_kubepods: bool) -> str | None:
    if not segment.startswith("pod") and "kubepods" not in segment:
        return None
    match = _POD_SLICE.fullmatch(segment)
    if match is None and under_kubepods:
        match = _POD_DIR.fullmatch(segment)
    if match is None:
        return None
    return match.group(1).replace("_", "-").lower()


def _slurm_job_of(segments: list[str], i: int) -> tuple[str, str | None, int | None] | None:
    """(job, step, uid) when segments[i] is a Slurm root followed by its job directories.

    A `job_N` directory means a Slurm job only right below Slurm's own root: v1
    slurm[_<node>]/uid_<uid>/job_<id>, v2 [<node>_]slurmstepd.scope/job_<id>.
    """
    segment = segments[i]
    if "slurm" not in segment:
        return None
    uid: int | None = None
    if _SLURM_V2_ROOT.fullmatch(segment):
        job_at = i + 1
    elif _SLURM_V1_ROOT.fullmatch(segment):
        owner = _SLURM_UID.fullmatch(segments[i + 1]) if i + 1 < len(segments) else None
        if owner is None:
            return None
        uid = _uid(owner.group(1))
        job_at = i + 2
    else:
        return None
    job = _SLURM_JOB.fullmatch(segments[job_at]) if job_at < len(segments) else None
    if job is None:
        return None
    step = _SLURM_STEP.fullmatch(segments[job_at + 1]) if job_at + 1 < len(segments) else None
    return job.group(1), step.group(1) if step else None, uid


def _uid(digits: str) -> int | None:
    return int(digits) if len(digits) <= _UID_DIGITS_MAX else None
