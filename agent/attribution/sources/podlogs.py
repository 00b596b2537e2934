"""The kubelet's per-pod log directories (`/var/log/pods/<namespace>_<pod>_<uid>`): how a pod UID
found in a cgroup gets its namespace and name without asking the API server. A missing directory
is a node without Kubernetes."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from agent.attribution.facts import HostFacts
from agent.attribution.sources.base import AttributionSource, SourceOptions
from agent.attribution.sources.settled import Listing
from agent.model import Snapshot

# The uid is the API server's UUID, or for a static pod the kubelet's 32-hex hash of its manifest
# (pkg/kubelet/config/common.go), which its cgroup carries too.
_POD_DIR = re.compile(r"^([a-z0-9][a-z0-9-]*)_([a-z0-9][a-z0-9.-]*)_([0-9a-f-]{36}|[0-9a-f]{32})$")


def read_pod_log_dirs(directory: str | Path) -> dict[str, tuple[str, str]]:
    """pod UID -> (namespace, pod name), from the kubelet's `<namespace>_<pod>_<uid>` directories."""
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    return _pods_named(names)


def _pods_named(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    pods: dict[str, tuple[str, str]] = {}
    for name in names:
        match = _POD_DIR.match(name)
        if match:
            pods[match.group(3)] = (match.group(1), match.group(2))
    return pods


class PodLogSource(AttributionSource):
    """Pod names for the pod UIDs in process cgroups, from the kubelet's log directories; read
    only on a poll that has a process in a pod (after the process facts are gathered), and
    listed again only when the directory changed (a pod's directory made or removed)."""

    def __init__(self, directory: str | Path | None, now_ns: Callable[[], int] = time.time_ns) -> None:
        self.directory = directory
        self._listing = Listing(directory, now_ns) if directory else None
        self._pods: tuple[list[str], dict[str, tuple[str, str]]] = ([], {})  # the listing, its pods

    @classmethod
    def from_options(cls, options: SourceOptions) -> PodLogSource:
        return cls(options.pod_logs_dir)

    def gather(self, snapshot: Snapshot, found: HostFacts) -> HostFacts:
        if self._listing is None or not any("kubepods" in f.cgroup for f in found.processes.values() if f is not None):
            return found
        names = self._listing.names()
        listed, pods = self._pods
        if names is not listed:
            pods = _pods_named(names)
            self._pods = (names, pods)
        return replace(found, pod_names={**found.pod_names, **pods})
