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

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pynvml

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
    """The node `install` returns: the scenario, its clock, the call record and the library."""

    library: FakeNvmlLibrary


def install(
    scenario: str | Path | Mapping[str, Any] | Scenario = "demo",
    *,
    speed: float = 0.0,
    clock: ScenarioClock | None = None,
) -> InstalledNode:
    """Load a scenario and make pynvml talk to it. Raises ScenarioError on a bad scenario."""
    global _installed
    loaded = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    node = InstalledNode(loaded, clock or ScenarioClock(loaded.start_epoch, speed=speed))
    node.library = FakeNvmlLibrary(node)
    with _lock, pynvml.libLoadLock:
        pynvml.nvmlLib = node.library
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
        _installed = node
    return node


def uninstall() -> None:
    """Put pynvml back as it was before `install`: no library loaded, no cached symbols."""
    global _installed
    with _lock, pynvml.libLoadLock:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
        _installed = None


def installed() -> InstalledNode | None:
    return _installed
