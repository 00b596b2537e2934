"""The device stage: backends that read GPUs, and the sampler that turns readings into snapshots.

A backend is chosen by name (the `backend` setting). Each module registers a factory here;
the factory imports its module only when chosen, so a node never needs another vendor's
library installed. A second vendor is one new module implementing
`agent.devices.backend.DeviceBackend` plus one `register(...)` line below.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.devices.backend import DeviceBackend
from agent.errors import ConfigError

# Builds a backend from the clock it stamps snapshots with (unix seconds).
BackendFactory = Callable[[Callable[[], float]], DeviceBackend]

_BACKENDS: dict[str, BackendFactory] = {}


def register(name: str, factory: BackendFactory) -> None:
    if name in _BACKENDS:
        raise ValueError(f"device backend {name!r} is already registered")
    _BACKENDS[name] = factory


def backend_names() -> tuple[str, ...]:
    return tuple(sorted(_BACKENDS))


def create_backend(name: str, clock: Callable[[], float]) -> DeviceBackend:
    """The backend registered as `name`. Raises ConfigError naming the known ones."""
    factory = _BACKENDS.get(name)
    if factory is None:
        raise ConfigError(f"backend: unknown device backend {name!r} (known: {', '.join(backend_names())})")
    return factory(clock)


def _nvml(clock: Callable[[], float]) -> DeviceBackend:
    from agent.devices.nvml import NvmlBackend  # noqa: PLC0415 - imported only when chosen

    return NvmlBackend(clock=clock)


register("nvml", _nvml)
