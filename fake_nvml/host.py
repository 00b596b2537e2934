"""The host side of a fake node: the files and sockets a real GPU node shows its agent.

For the scenario time the node is at, it keeps up to date
  - a procfs-shaped tree (`proc/<pid>/{stat,status,cmdline,environ,cgroup}`) of the running
    scenario processes (those on no GPU too), with the cgroup paths their pod / Slurm job /
    container implies and the parent pid their `parent:` names,
  - a passwd-format file naming the scenario's users,
  - Slurm's GPU mapping directory (one file per GPU index or MIG `gpu.gi`: job id, user, account),
  - the kubelet's `/var/log/pods/<namespace>_<pod>_<uid>` directories,
  - sysfs's PCI devices (`sys/bus/pci/devices/<bus id>/{vendor,device,class}`) of its GPUs,
  - and serves the kubelet pod-resources v1 API on a unix socket (a real gRPC server),
so the agent reads them with its production code, exactly as on a real node.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
import shlex
import shutil
import threading
from pathlib import Path

from fake_nvml.node import FakeNode
from fake_nvml.podresources import FakePodResourcesServer
from fake_nvml.scenario import GpuRef, PodRef, Process

CLOCK_TICKS_PER_S = 100  # USER_HZ on Linux
# The fake host booted a day before scenario t=0: process start times are boot-relative.
BOOT_BEFORE_START_S = 86400


def _hex_id(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


def pod_container_id(pod: PodRef) -> str:
    return _hex_id("container", pod.namespace, pod.name, pod.container)


_PLAIN_WORDS = re.compile(r"[^ \t\r\n]+")


def split_cmdline(cmdline: str) -> list[str]:
    """A scenario's command line as its argv, split as a POSIX shell would (shlex). A line with
    no quote or backslash, the usual one, is split at its spaces directly: shlex reads one
    character at a time in Python, a tenth of a second for a 32 KiB line."""
    if "'" in cmdline or '"' in cmdline or "\\" in cmdline:
        return shlex.split(cmdline)
    return _PLAIN_WORDS.findall(cmdline)


def default_cgroup(process: Process) -> str:
    """The cgroup v2 path a real node would give the process, from what the scenario says it is.

    Shapes: kubelet's systemd cgroup driver with containerd (pods), Slurm's cgroup/v2 plugin
    (jobs), Docker's systemd driver (plain containers), logind (everything else)."""
    if process.cgroup:
        return process.cgroup if ":" in process.cgroup else f"0::{process.cgroup}\n"
    if process.pod is not None:
        uid = process.pod.uid.replace("-", "_")
        qos = "burstable"
        return (
            f"0::/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid}.slice/"
            f"cri-containerd-{pod_container_id(process.pod)}.scope\n"
        )
    if process.slurm_job is not None:
        return f"0::/system.slice/slurmstepd.scope/job_{process.slurm_job}/step_0/user/task_0\n"
    if process.container_id is not None:
        return f"0::/system.slice/docker-{process.container_id}.scope\n"
    return f"0::/user.slice/user-{process.uid}.slice/session-{process.uid % 97 + 1}.scope\n"


class FakeHost:
    def __init__(self, node: FakeNode, root: Path) -> None:
        self.node = node
        self.root = root
        self.proc_root = root / "proc"
        self.passwd_file = root / "passwd"
        self.slurm_map_dir = root / "slurm-gpus"
        self.pod_logs_dir = root / "pods"
        self.podresources_socket = root / "kubelet.sock"
        self.sys_root = root / "sys"
        self._lock = threading.Lock()
        scenario = node.scenario
        points: set[float] = set()
        for p in scenario.processes:
            points.add(p.start_s)
            if p.end_s is not None:
                points.add(p.end_s)
        for a in scenario.allocations:
            points.add(a.start_s)
            if a.end_s is not None:
                points.add(a.end_s)
        self._points = sorted(points)
        self._window: tuple[float, float] | None = None
        self._written_pids: set[int] = set()
        self._rows: tuple[float, float, list[tuple[str, str, str, str, list[str]]]] | None = None
        for d in (self.proc_root, self.slurm_map_dir, self.pod_logs_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._write_static()
        self.server = FakePodResourcesServer(self._pod_rows, str(self.podresources_socket))

    def start(self) -> None:
        self.sync(self.node.now())
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- time ---------------------------------------------------------------------------------

    def sync(self, t: float) -> None:
        """Bring the files up to scenario time t; cheap when nothing changed since last time."""
        window = self._window
        if window is not None and window[0] <= t < window[1]:
            return
        with self._lock:
            i = bisect.bisect_right(self._points, t)
            lo = self._points[i - 1] if i > 0 else float("-inf")
            hi = self._points[i] if i < len(self._points) else float("inf")
            self._write_processes(t)
            self._write_slurm_map(t)
            self._window = (lo, hi)

    # -- files --------------------------------------------------------------------------------

    def _write_static(self) -> None:
        users: dict[int, str] = {0: "root"}
        for p in self.node.scenario.processes:
            if p.user:
                users.setdefault(p.uid, p.user)
        lines = [f"{name}:x:{uid}:{uid}::/home/{name}:/bin/bash" for uid, name in sorted(users.items())]
        self.passwd_file.write_text("\n".join(lines) + "\n")
        pods: set[PodRef] = {p.pod for p in self.node.scenario.processes if p.pod is not None}
        pods.update(a.pod for a in self.node.scenario.allocations if a.pod is not None)
        for pod in pods:
            (self.pod_logs_dir / f"{pod.namespace}_{pod.name}_{pod.uid}" / (pod.container or "main")).mkdir(
                parents=True, exist_ok=True
            )
        (self.proc_root / "stat").write_text(f"btime {int(self.node.clock.start_epoch) - BOOT_BEFORE_START_S}\n")
        # The GPUs on the PCI bus, as sysfs shows them whether or not the driver is loaded.
        for gpu in self.node.scenario.gpus:
            device = self.sys_root / "bus" / "pci" / "devices" / gpu.pci_bus_id.removeprefix("0000").lower()
            device.mkdir(parents=True, exist_ok=True)
            (device / "vendor").write_text("0x10de\n")
            (device / "device").write_text(f"0x{gpu.pci_device_id:04x}\n")
            (device / "class").write_text("0x030200\n")  # a 3D controller

    def _write_processes(self, t: float) -> None:
        running = {p.pid: p for p in self.node.scenario.processes if p.running_at(t)}
        for pid in self._written_pids - set(running):
            shutil.rmtree(self.proc_root / str(pid), ignore_errors=True)
        for pid, process in running.items():
            directory = self.proc_root / str(pid)
            start_ticks = int((BOOT_BEFORE_START_S + process.start_s) * CLOCK_TICKS_PER_S)
            stat_file = directory / "stat"
            if stat_file.exists() and f" {start_ticks} " in stat_file.read_text():
                continue  # already written for this very process
            directory.mkdir(parents=True, exist_ok=True)
            argv = split_cmdline(process.cmdline)
            comm = Path(argv[0]).name[:15] if argv else "python"
            # Fields 3..52 of proc(5); field 22 is the start time in clock ticks after boot.
            # Field 4 is the parent's pid.
            ppid = str(process.parent or 1)
            fields = ["S", ppid, str(pid), str(pid), "0", "-1", "4194304"] + ["0"] * 12 + [str(start_ticks)]
            fields += ["0"] * 30
            (directory / "status").write_text(
                f"Name:\t{comm}\nState:\tS (sleeping)\nPid:\t{pid}\n"
                f"Uid:\t{process.uid}\t{process.uid}\t{process.uid}\t{process.uid}\n"
                f"Gid:\t{process.uid}\t{process.uid}\t{process.uid}\t{process.uid}\n"
            )
            (directory / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
            (directory / "environ").write_bytes(
                b"".join(f"{k}={v}".encode() + b"\0" for k, v in process.environ.items())
            )
            (directory / "cgroup").write_text(default_cgroup(process))
            # stat last: a reader that sees the new start time sees the new process's files.
            stat_file.write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
        self._written_pids = set(running)

    def _write_slurm_map(self, t: float) -> None:
        """The prolog's files for the jobs running at t, each dated (its modification time) when
        its job started, in scenario wall-clock time, as a prolog writing it then would leave it."""
        wanted: dict[str, tuple[str, float]] = {}
        scenario = self.node.scenario
        epoch = self.node.clock.start_epoch
        for a in scenario.allocations:
            if a.slurm_job is not None and a.start_s <= t and (a.end_s is None or t < a.end_s):
                for ref in a.gpus:
                    content = " ".join(f for f in (a.slurm_job, a.user, a.account) if f)
                    wanted[self._map_name(ref)] = (content, epoch + a.start_s)
        for p in scenario.processes:
            if p.slurm_job is not None and p.running_at(t):
                for ref in p.gpus:
                    content = f"{p.slurm_job} {p.user}" if p.user else p.slurm_job
                    wanted.setdefault(self._map_name(ref), (content, epoch + p.start_s))
        for existing in self.slurm_map_dir.iterdir():
            if existing.name not in wanted:
                existing.unlink(missing_ok=True)
        for name, (content, written_at) in wanted.items():
            target = self.slurm_map_dir / name
            if not target.exists() or target.read_text().strip() != content or target.stat().st_mtime != written_at:
                target.write_text(content + "\n")
                os.utime(target, (written_at, written_at))

    def _map_name(self, ref: GpuRef) -> str:
        if ref.mig is None:
            return str(ref.gpu)
        return f"{ref.gpu}.{self.node.scenario.gpus[ref.gpu].mig[ref.mig].gpu_instance_id}"

    # -- kubelet ------------------------------------------------------------------------------

    def _pod_rows(self) -> list[tuple[str, str, str, str, list[str]]]:
        """(namespace, pod, container, resource, device ids) the kubelet reports now: the same
        rows from one start or end of a process or allocation to the next."""
        t = self.node.now()
        cached = self._rows
        if cached is not None and cached[0] <= t < cached[1]:
            return cached[2]
        rows = self._pod_rows_at(t)
        i = bisect.bisect_right(self._points, t)
        lo = self._points[i - 1] if i > 0 else float("-inf")
        hi = self._points[i] if i < len(self._points) else float("inf")
        self._rows = (lo, hi, rows)
        return rows

    def _pod_rows_at(self, t: float) -> list[tuple[str, str, str, str, list[str]]]:
        held: dict[tuple[str, str, str, str], list[str]] = {}
        scenario = self.node.scenario
        entries: list[tuple[PodRef, tuple[GpuRef, ...]]] = [
            (a.pod, a.gpus)
            for a in scenario.allocations
            if a.pod is not None and a.start_s <= t and (a.end_s is None or t < a.end_s)
        ]
        entries += [(p.pod, p.gpus) for p in scenario.processes if p.pod is not None and p.running_at(t)]
        gke = scenario.node.device_plugin == "gke"
        for pod, refs in entries:
            for ref in refs:
                gpu = scenario.gpus[ref.gpu]
                if gke:  # GKE's plugin: the device node, and a MIG instance's GPU instance id
                    gi = "" if ref.mig is None else f"/gi{gpu.mig[ref.mig].gpu_instance_id}"
                    resource, device = "nvidia.com/gpu", f"nvidia{gpu.minor}{gi}"
                elif ref.mig is None:
                    resource, device = "nvidia.com/gpu", gpu.uuid
                else:
                    resource, device = f"nvidia.com/mig-{gpu.mig[ref.mig].profile}", gpu.mig[ref.mig].uuid
                devices = held.setdefault((pod.namespace, pod.name, pod.container or "main", resource), [])
                if device not in devices:
                    devices.append(device)
        return [(ns, name, container, resource, devices) for (ns, name, container, resource), devices in held.items()]
