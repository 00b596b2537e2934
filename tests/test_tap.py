"""The backend `record` taps keeps the capabilities of the backend it wraps, as every Python the
project supports sees them."""

from __future__ import annotations

import inspect

import pytest

import fake_nvml
from agent.devices.activity import ActivityBackend
from agent.devices.backend import DeviceBackend
from agent.devices.events import EventBackend
from agent.devices.nvml import NvmlBackend
from agent.devices.tap import TappedBackend, tap

CAPABILITIES = (ActivityBackend, EventBackend)


def _members(protocol: type) -> set[str]:
    return {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}


def _statically_has(obj: object, protocol: type) -> bool:
    """isinstance(obj, protocol) as Python 3.12 and later decide it: each member looked up with
    inspect.getattr_static, so a method that only __getattr__ forwards does not count (3.11, which
    CI runs, used hasattr, and was fooled by the tap's forwarding)."""
    sentinel = object()
    return all(inspect.getattr_static(obj, name, sentinel) is not sentinel for name in _members(protocol))


def test_a_tap_of_the_nvml_backend_has_gpm_and_driver_events_on_every_python() -> None:
    # Before the tap forwarded these by methods of its own, `record` on Python 3.12 found no
    # GPM (the trace of a real H200 had no activity rows, its busy source nvml) and no events.
    node = fake_nvml.install({"gpus": [{"model": "H200"}]}, host=False)
    try:
        backend = NvmlBackend(clock=node.clock.wall_time)
        tapped = tap(backend)
        for protocol in CAPABILITIES:
            assert _statically_has(backend, protocol), protocol.__name__
            assert _statically_has(tapped, protocol), protocol.__name__
            assert isinstance(tapped, protocol)
    finally:
        fake_nvml.uninstall()


class _Bare:
    """A backend without activity or events (nor, here, anything else the tap does not need)."""

    @staticmethod
    def clock() -> float:
        return 0.0


@pytest.mark.parametrize("protocol", CAPABILITIES, ids=lambda p: p.__name__)
def test_a_tap_claims_no_capability_the_wrapped_backend_lacks(protocol: type) -> None:
    tapped = tap(_Bare())  # type: ignore[arg-type]
    assert type(tapped) is TappedBackend
    assert not isinstance(tapped, protocol)
    assert not _statically_has(tapped, protocol)


def test_the_tap_has_every_device_backend_method_of_its_own() -> None:
    # A method only `__getattr__` forwards goes unseen: its failures never reached the trace
    # (nvmlDeviceGetSamples' did not, so a replay read the samples a recorded poll could not).
    assert _members(DeviceBackend) - set(vars(TappedBackend)) == set()
