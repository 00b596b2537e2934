"""A fake NVML: scenario-driven GPUs served to the real `pynvml` through its library slot.

    import fake_nvml
    node = fake_nvml.install("demo")     # a built-in name, a YAML path, or a dict
    node.clock.advance(3600)
    fake_nvml.uninstall()

`install` puts a `FakeNvmlLibrary` where pynvml keeps the loaded ``libnvidia-ml.so.1``
(``pynvml.nvmlLib``) and clears pynvml's function-pointer cache, so every pynvml wrapper,
in this code or any other tool in the process, calls the fake's C functions.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pynvml

from fake_nvml import events, gpm  # noqa: F401 - register the event-set and GPM C functions
from fake_nvml.host import FakeHost
from fake_nvml.lib import FakeNvmlLibrary, implemented_functions
from fake_nvml.node import FakeNode, ScenarioClock
from fake_nvml.scenario import Scenario, ScenarioError, builtin_names, load_scenario

__all__ = [
    "FakeNode",
    "FakeNvmlLibrary",
    "InstalledNode",
    "Scenario",
    "ScenarioClock",
    "ScenarioError",
    "builtin_names",
    "implemented_functions",
    "install",
    "installed",
    "load_scenario",
    "uninstall",
]

_lock = threading.Lock()
_installed: InstalledNode | None = None


class InstalledNode(FakeNode):
    """The node `install` returns: the scenario, its clock, the call record, the library and,
    unless installed with host=False, the host files and kubelet socket beside it."""

    library: FakeNvmlLibrary
    _host: FakeHost | None = None

    @property
    def host(self) -> FakeHost:
        if self._host is None:
            raise RuntimeError("this fake node was installed with host=False")
        return self._host

    @property
    def proc_root(self) -> Path:
        return self.host.proc_root

    @property
    def passwd_file(self) -> Path:
        return self.host.passwd_file

    def sync_host(self, t: float) -> None:
        if self._host is not None:
            self._host.sync(t)


def install(
    scenario: str | Path | Mapping[str, Any] | Scenario = "demo",
    *,
    speed: float = 0.0,
    clock: ScenarioClock | None = None,
    host: bool = True,
    workdir: str | Path | None = None,
) -> InstalledNode:
    """Load a scenario and make pynvml talk to it. Raises ScenarioError on a bad scenario.

    With `host` (the default), the node also writes its procfs tree, passwd file, Slurm GPU
    map and kubelet pod log directories under `workdir` (a new temporary directory when not
    given) and serves the kubelet pod-resources API on a unix socket there.
    """
    global _installed
    loaded = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    uninstall()
    node = InstalledNode(loaded, clock or ScenarioClock(loaded.start_epoch, speed=speed))
    node.library = FakeNvmlLibrary(node)
    if host:
        if workdir is None:
            workdir = tempfile.mkdtemp(prefix="gpuledger-fake-", dir=scratch_dir())
        root = Path(workdir)
        node._host = FakeHost(node, root)
        node._host.start()
    with _lock, pynvml.libLoadLock:
        pynvml.nvmlLib = node.library
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
        _installed = node
    return node


# Where a fake node writes its host files when not told: a memory filesystem where the machine
# has one with room to spare. The agent reads those files at every poll, and a node rewrites its
# /proc tree as processes come and go: a test's fault matrix creates thousands of directories,
# four times faster in tmpfs than on a disk's ext4.
SHM = Path("/dev/shm")
SHM_FREE_BYTES = 1 << 30


def scratch_dir() -> str | None:
    """/dev/shm where it is a writable directory with 1 GiB free and TMPDIR names no other
    place; None (the temporary directory: TMPDIR, else /tmp) otherwise."""
    if os.environ.get("TMPDIR"):
        return None
    try:
        usage = shutil.disk_usage(SHM)
    except OSError:
        return None
    return str(SHM) if usage.free >= SHM_FREE_BYTES and os.access(SHM, os.W_OK | os.X_OK) else None


def uninstall() -> None:
    """Put pynvml back as it was before `install`: no library loaded, no cached symbols."""
    global _installed
    previous = _installed
    if previous is not None and previous._host is not None:
        previous._host.stop()
    with _lock, pynvml.libLoadLock:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
        _installed = None


def installed() -> InstalledNode | None:
    return _installed
