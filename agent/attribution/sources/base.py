"""What a workload source is: the seam between attribution and the places it reads.

A source reads one place on the host (procfs, the kubelet, Slurm's map files, the pod log
directories) and adds what it finds to the poll's `HostFacts`. `agent.attribution.gather`
knows sources only through `AttributionSource`; which sources exist is decided in one place,
the registry in `agent.attribution.sources`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from agent.attribution.facts import HostFacts
from agent.model import Snapshot


@dataclass(frozen=True)
class Refresher:
    """Work a source repeats on a schedule of its own rather than on every poll (a slow remote
    call, say): the pipeline runs `refresh` every `interval_s` seconds, as a job named `name`,
    before the poll that falls due at the same moment."""

    name: str
    interval_s: float
    refresh: Callable[[], object]


@dataclass(frozen=True)
class SourceOptions:
    """Where the sources read, and how: what the wiring takes from the settings (or from the
    fake node's host), so that no source reads configuration itself."""

    proc_root: str = "/proc"
    passwd_file: str = "/etc/passwd"
    env_allowlist: frozenset[str] = frozenset()  # environment keys procfs may keep
    slurm_map_dir: str | None = None  # None or "": no Slurm map files to read
    pod_logs_dir: str | None = None
    podresources_socket: str | None = None  # None or "": no kubelet to ask
    kubelet_timeout_s: float = 2.0
    kubelet_interval_s: float = 10.0
    # How long the kubelet's last allocations stand in for it while it does not answer.
    kubelet_stale_after_s: float = 300.0
    # Only for a kubelet that runs in this process (the fake node's): a token equal between two
    # moments only when its answer to List is the same at both. While it stays equal to the one
    # taken with the last answer, the refresher keeps that answer instead of asking again. A
    # real kubelet has none, and is asked every `kubelet_interval_s`.
    kubelet_answer_token: Callable[[], object] | None = None


class AttributionSource(Protocol):
    """One place attribution learns who holds the GPUs from.

    A source may subclass this protocol to inherit the defaults: no refreshers, nothing to close.
    """

    def gather(self, snapshot: Snapshot, found: HostFacts) -> HostFacts:
        """`found` with what this source knows about `snapshot` added. Sources gather in the order
        they are registered, so each may use what those before it found (process facts come
        first). Called on every poll: anything slow belongs in a refresher."""
        ...

    def refreshers(self) -> Iterable[Refresher]:
        """Work to run on a schedule of its own; none by default."""
        return ()

    def timeouts(self) -> int:
        """Reads given up on at their deadline so far (the pipeline counts them as failures of
        the attribute stage); none by default."""
        return 0

    def close(self) -> None:
        """Let go of connections; nothing by default."""
        return None


# Opens a source from the options; a registry entry.
SourceFactory = Callable[[SourceOptions], AttributionSource]
