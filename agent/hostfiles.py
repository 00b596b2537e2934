"""Files the schedulers leave on the host: Slurm's GPU mapping directory and the kubelet's
per-pod log directories. Missing directories are normal (not every node runs both)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_MAP_NAME = re.compile(r"^(\d+)(?:\.(\d+))?$")
_POD_DIR = re.compile(r"^([a-z0-9][a-z0-9-]*)_([a-z0-9][a-z0-9.-]*)_([0-9a-f-]{36})$")


@dataclass(frozen=True, slots=True)
class SlurmGpuAllocation:
    gpu_index: int
    gpu_instance_id: int | None  # a MIG GPU instance, from a `<gpu>.<gi>` file name
    job: str
    user: str | None


def read_slurm_map(directory: str | Path) -> list[SlurmGpuAllocation]:
    """One file per GPU index (`3`) or MIG instance (`0.2`), as a prolog writes them and an
    epilog removes them; the first line holds the job id and, optionally, the user."""
    root = Path(directory)
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    found: list[SlurmGpuAllocation] = []
    for entry in entries:
        match = _MAP_NAME.match(entry.name)
        if not match:
            continue
        try:
            first = entry.read_text(errors="replace").strip().splitlines()
        except OSError:
            continue  # removed by the epilog while we listed: the job is gone
        fields = first[0].split() if first else []
        if not fields or not re.fullmatch(r"[0-9]+(?:_[0-9]+)?", fields[0]):
            log.debug("ignoring %s: no job id on its first line", entry)
            continue
        found.append(
            SlurmGpuAllocation(
                gpu_index=int(match.group(1)),
                gpu_instance_id=int(match.group(2)) if match.group(2) else None,
                job=fields[0],
                user=fields[1] if len(fields) > 1 else None,
            )
        )
    return found


def read_pod_log_dirs(directory: str | Path) -> dict[str, tuple[str, str]]:
    """pod UID -> (namespace, pod name), from the kubelet's `<namespace>_<pod>_<uid>` directories."""
    try:
        names = [entry.name for entry in Path(directory).iterdir()]
    except OSError:
        return {}
    pods: dict[str, tuple[str, str]] = {}
    for name in names:
        match = _POD_DIR.match(name)
        if match:
            pods[match.group(3)] = (match.group(1), match.group(2))
    return pods


_AWS_INSTANCE = re.compile(r"^[a-z][a-z0-9-]*\.[0-9]*[a-z0-9]+$")


def detect_instance_type(dmi_dir: str | Path = "/sys/devices/virtual/dmi/id") -> str | None:
    """The cloud instance type, where the firmware says it without asking the network: EC2
    writes it as the DMI product name (e.g. "p4d.24xlarge"). Elsewhere: None (set
    pricing.instance_type)."""
    try:
        product = (Path(dmi_dir) / "product_name").read_text().strip()
    except OSError:
        return None
    return product if _AWS_INSTANCE.match(product) else None
