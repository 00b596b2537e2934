"""The kubelet's per-pod log directories (`/var/log/pods/<namespace>_<pod>_<uid>`): how a pod UID
found in a cgroup gets its namespace and name without asking the API server. A missing directory
is a node without Kubernetes."""

from __future__ import annotations

import os
import re
from pathlib import Path

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
