"""Fixtures shared by the test suite."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pynvml
import pytest

import fake_nvml

InstallFake = Callable[..., fake_nvml.InstalledNode]


@pytest.fixture
def install_fake() -> Iterator[InstallFake]:
    """Install a fake node (a built-in name, a path, a mapping or a Scenario) and nvmlInit it.

    `init=False` leaves NVML uninitialised; `clock=` hands the node a ScenarioClock. Whatever
    the test does, the fake is uninstalled afterwards, so no other test sees its GPUs.
    """

    def install(
        scenario: str | Path | Mapping[str, Any] | fake_nvml.Scenario = "demo",
        *,
        init: bool = True,
        clock: fake_nvml.ScenarioClock | None = None,
    ) -> fake_nvml.InstalledNode:
        node = fake_nvml.install(scenario, clock=clock)
        if init:
            pynvml.nvmlInit()
        return node

    try:
        yield install
    finally:
        fake_nvml.uninstall()
