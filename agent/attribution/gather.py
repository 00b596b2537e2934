"""Gathers what attribution needs from the host, then hands it to the pure `attribute`.

Process facts are cached per identity (pid, start time): a process is read in full once, and
each later poll costs one small read of its stat file to notice an exit or a reused pid.
Allocations from the kubelet are refreshed on their own schedule, never on a scrape.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from agent.attribution.resolve import Inputs, PodAllocation, Rule, SlurmAllocation, attribute
from agent.attribution.sources.kubelet import KubeletUnavailable, PodResourcesClient
from agent.attribution.sources.podlogs import read_pod_log_dirs
from agent.attribution.sources.procfs import Passwd, ProcFS
from agent.attribution.sources.slurm import read_slurm_map
from agent.errors import GpuledgerError
from agent.model import Attribution, ProcessFacts, ProcessIdentity, Snapshot

log = logging.getLogger(__name__)


class KubeletWatcher:
    """The kubelet's GPU allocations, refreshed by `refresh()` (on a schedule) and cached.

    A node without the socket is a node without Kubernetes: quiet, and no health series.
    Once the socket has been seen, losing it is an outage: logged once per change of state.
    """

    def __init__(self, socket_path: str, timeout_s: float = 2.0) -> None:
        self.socket_path = socket_path
        self._client = PodResourcesClient(socket_path, timeout_s=timeout_s)
        self._lock = threading.Lock()
        self._allocations: tuple[PodAllocation, ...] = ()
        self._up: bool | None = None
        self._seen_socket = False

    @property
    def up(self) -> bool | None:
        return self._up

    def allocations(self) -> tuple[PodAllocation, ...]:
        return self._allocations

    def refresh(self) -> None:
        if not self._seen_socket and not os.path.exists(self.socket_path):
            return
        self._seen_socket = True
        try:
            rows = self._client.list_gpu_allocations()
        except KubeletUnavailable as exc:
            if self._up is not False:
                log.warning("kubelet pod-resources unavailable (%s): attributing pods from cgroups only", exc)
            self._up = False
            # Stale allocations would bill pods that may be gone: cgroups alone until it is back.
            with self._lock:
                self._allocations = ()
            return
        allocations = tuple(PodAllocation(r.namespace, r.pod, r.container, r.device_id) for r in rows)
        with self._lock:
            self._allocations = allocations
        if self._up is not True:
            log.info("kubelet pod-resources answering at %s", self.socket_path)
        self._up = True

    def close(self) -> None:
        self._client.close()


class Attributor:
    def __init__(
        self,
        procfs: ProcFS,
        passwd: Passwd,
        *,
        rules: Sequence[Rule] = (),
        slurm_map_dir: str | Path | None = None,
        pod_logs_dir: str | Path | None = None,
        kubelet: KubeletWatcher | None = None,
        per_pid: bool = False,
    ) -> None:
        self.procfs = procfs
        self.passwd = passwd
        self.rules = tuple(rules)
        self.slurm_map_dir = slurm_map_dir
        self.pod_logs_dir = pod_logs_dir
        self.kubelet = kubelet
        self.per_pid = per_pid
        self._cache: dict[int, ProcessFacts] = {}
        self.full_reads = 0  # how many processes were read in full (for tests and benchmarks)

    def _facts(self, pid: int) -> ProcessFacts | None:
        try:
            identity: ProcessIdentity = self.procfs.identity(pid)
            cached = self._cache.get(pid)
            if cached is not None and cached.identity == identity:
                return cached
            facts = self.procfs.facts(identity)
        except GpuledgerError as exc:
            log.debug("cannot resolve pid %d: %s", pid, exc)
            self._cache.pop(pid, None)
            return None
        self.full_reads += 1
        self._cache[pid] = facts
        return facts

    def attribute(self, snapshot: Snapshot) -> Attribution:
        pids = {p.pid for d in snapshot.devices for p in d.processes}
        processes = {pid: self._facts(pid) for pid in sorted(pids)}
        for gone in set(self._cache) - pids:
            del self._cache[gone]
        uids = {f.uid for f in processes.values() if f is not None and f.uid is not None}
        user_names = {uid: name for uid in uids if (name := self.passwd.name(uid)) is not None}
        slurm = [
            SlurmAllocation(a.gpu_index, a.gpu_instance_id, a.job, a.user)
            for a in (read_slurm_map(self.slurm_map_dir) if self.slurm_map_dir else [])
        ]
        needs_pod_names = any("kubepods" in f.cgroup for f in processes.values() if f is not None)
        pod_names = read_pod_log_dirs(self.pod_logs_dir) if self.pod_logs_dir and needs_pod_names else {}
        return attribute(
            Inputs(
                snapshot=snapshot,
                processes=processes,
                pod_names=pod_names,
                pod_allocations=self.kubelet.allocations() if self.kubelet else (),
                slurm_allocations=slurm,
                user_names=user_names,
                rules=self.rules,
                per_pid=self.per_pid,
                kubelet_up=self.kubelet.up if self.kubelet else None,
            )
        )
