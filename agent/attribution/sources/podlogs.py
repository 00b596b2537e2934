"""The kubelet's per-pod log directories (`/var/log/pods/<namespace>_<pod>_<uid>`): how a pod UID
found in a cgroup gets its namespace and name without asking the API server. A missing directory
is a node without Kubernetes."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from agent.attribution.facts import HostFacts
from agent.attribution.sources.base import AttributionSource, SourceOptions
from agent.model import Snapshot

_POD_DIR = re.compile(r"^([a-z0-9][a-z0-9-]*)_([a-z0-9][a-z0-9.-]*)_([0-9a-f-]{36})$")


def read_pod_log_dirs(directory: str | Path) -> dict[str, tuple[str, str]]:
    """pod UID -> (namespace, pod name), from the kubelet's `<namespace>_<pod>_<uid>` directories."""
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    pods: dict[str, tuple[str, str]] = {}
    for name in names:
        match = _POD_DIR.match(name)
        if match:
            pods[match.group(3)] = (match.group(1), match.group(2))
    return pods


class PodLogSource(AttributionSource):
    """Pod names for the pod UIDs in process cgroups, from the kubelet's log directories; read
    only on a poll that has a process in a pod (after the process facts are gathered)."""

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = directory

    @classmethod
    def from_options(cls, options: SourceOptions) -> PodLogSource:
        return cls(options.pod_logs_dir)

    def gather(self, snapshot: Snapshot, found: HostFacts) -> HostFacts:
        if not self.directory or not any("kubepods" in f.cgroup for f in found.processes.values() if f is not None):
            return found
        return replace(found, pod_names={**found.pod_names, **read_pod_log_dirs(self.directory)})
