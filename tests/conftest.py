"""Fixtures shared by the test suite."""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hypothesis import settings

import fake_nvml
from tests.helpers import WEEKEND_ALERT_SERIES, WeekendIdleRun, run_weekend_idle

InstallFake = Callable[..., fake_nvml.InstalledNode]

# The fuzz suites draw the same examples on every run (HYPOTHESIS_PROFILE=explore draws new
# ones): a red build then means the code changed, not that the dice did. Explore locally and
# add what it finds as an explicit @example.
settings.register_profile("ci", derandomize=True, deadline=None)  # no timing verdicts on a busy machine
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Python 3.13 warns (ResourceWarning, an error in this suite) when a sqlite3 connection is
# collected without close(); 3.11 and 3.12 close it silently. `with sqlite3.connect(...) as c`
# commits but does not close. So that a connection left open fails on 3.11 as it does on 3.13,
# connections made in the test process (the agent's own included) warn here as 3.13's do.
if sys.version_info < (3, 13):

    class _WarnsUnclosed(sqlite3.Connection):
        _open = False  # as 3.13: a connect() that raised left nothing open

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._open = True

        def close(self) -> None:
            super().close()
            self._open = False

        def __del__(self) -> None:
            if self._open:
                warnings.warn(f"unclosed database in {self!r}", ResourceWarning, stacklevel=1, source=self)

    sqlite3.connect = functools.partial(sqlite3.connect, factory=_WarnsUnclosed)  # type: ignore[assignment]


@pytest.fixture(autouse=True)
def _no_log_handler_left_behind() -> Iterator[None]:
    """Take away the log handler a test's in-process `main()` left on the root logger.

    `main()` sets logging up (agent/cli/logs.py: a StreamHandler on the sys.stderr of that
    moment), which inside a test is pytest's capture of it, closed when the test ends. Left in
    place, every later test in the worker that logs gets "--- Logging error ---" and a traceback
    on stderr, and a test that checks stderr for tracebacks fails (tests/test_http.py did, once a
    snapshot test ran main() in-process before it on the same worker).
    """
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if type(handler) is logging.StreamHandler and handler not in before:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _pynvml_as_shipped() -> Iterator[None]:
    """Put back any pynvml function a test's imports replaced.

    gpustat, on import, swaps pynvml's `_nvmlGetFunctionPointer` (a missing `_v3` process call
    silently becomes `_v2`) and `nvmlDeviceGetMemoryInfo` (no `version=`) for its own; left in
    place, that would hide the fake's driver profiles from every test that runs afterwards.
    """
    before = {name: value for name, value in vars(pynvml).items() if callable(value)}
    yield
    for name, value in before.items():
        if getattr(pynvml, name, None) is not value:
            setattr(pynvml, name, value)


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


@pytest.fixture(scope="session")
def weekend_idle(tmp_path_factory: pytest.TempPathFactory) -> WeekendIdleRun:
    """Four days of the weekend-idle node, simulated once for every test that reads them."""
    return run_weekend_idle(tmp_path_factory.mktemp("weekend") / "weekend.db", WEEKEND_ALERT_SERIES)
