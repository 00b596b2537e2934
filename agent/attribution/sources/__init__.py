"""The workload sources, one module each, and the one place they are registered.

A source implements `agent.attribution.sources.base.AttributionSource`: each poll it adds what
it reads to the poll's `HostFacts`. Sources gather in the order registered below, so the
process facts come first and later sources may use them. A new source is one new module here
plus one `register(...)` line below.
"""

from __future__ import annotations

from agent.attribution.sources.base import AttributionSource, SourceFactory, SourceOptions
from agent.attribution.sources.kubelet import KubeletSource
from agent.attribution.sources.podlogs import PodLogSource
from agent.attribution.sources.procfs import ProcessSource
from agent.attribution.sources.slurm import SlurmMapSource

_SOURCES: dict[str, SourceFactory] = {}


def register(name: str, factory: SourceFactory) -> None:
    """Add a source; it gathers after those registered before it."""
    if name in _SOURCES:
        raise ValueError(f"attribution source {name!r} is already registered")
    _SOURCES[name] = factory


def source_names() -> tuple[str, ...]:
    """The registered sources, in the order they gather."""
    return tuple(_SOURCES)


def open_sources(options: SourceOptions) -> tuple[AttributionSource, ...]:
    """One of each registered source, opened with `options`, in the order they gather."""
    return tuple(factory(options) for factory in _SOURCES.values())


register("procfs", ProcessSource.from_options)
register("kubelet", KubeletSource.from_options)
register("slurm", SlurmMapSource.from_options)
register("podlogs", PodLogSource.from_options)
