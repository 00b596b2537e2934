"""Gathers what attribution needs from the host, then hands it to the pure `attribute`.

Each poll starts from empty `HostFacts` and passes them through every source, in the order the
registry (`agent.attribution.sources`) gives, then resolves the facts into workloads. Sources
that refresh on a schedule of their own (the kubelet's allocation list) say so through
`refreshers()`, which the pipeline turns into periodic jobs: never work done on a scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

from agent.attribution.facts import HostFacts
from agent.attribution.labels import LabelRule
from agent.attribution.resolve import Inputs, attribute, attributed_readings
from agent.attribution.sources.base import AttributionSource, Refresher
from agent.model import Attribution, Snapshot

S = TypeVar("S")

log = logging.getLogger(__name__)


class Attributor:
    """Attribution as the agent runs it: `sources` read the host, `rules` label the workloads,
    `per_pid` keeps one holding per process."""

    def __init__(
        self,
        sources: Sequence[AttributionSource],
        *,
        rules: Sequence[LabelRule] = (),
        per_pid: bool = False,
        team_from_account: bool = False,
    ) -> None:
        self.sources = tuple(sources)
        self.rules = tuple(rules)
        self.per_pid = per_pid
        self.team_from_account = team_from_account
        # The last poll's inputs to `attribute` and its result (see `attribute`).
        self._last: tuple[tuple[object, ...], HostFacts, Attribution] | None = None
        self._told_unmatched: set[str] = set()  # device ids already logged as matching no device

    def attribute(self, snapshot: Snapshot) -> Attribution:
        """The holdings of `snapshot`'s devices, from what the sources find. In a steady state
        (the same processes with the same readings, facts and allocations as at the last poll)
        that is the last poll's attribution, handed on rather than worked out again: `attribute`
        is pure, so equal inputs give an equal result."""
        found = HostFacts()
        for source in self.sources:
            found = source.gather(snapshot, found)
        key = (attributed_readings(snapshot), self.rules, self.per_pid, self.team_from_account)
        last = self._last
        if last is not None and last[0] == key and last[1] == found:
            return last[2]
        attribution = attribute(
            Inputs(
                snapshot=snapshot,
                processes=found.processes,
                pod_names=found.pod_names,
                pod_allocations=found.pod_allocations,
                slurm_allocations=found.slurm_allocations,
                user_names=found.user_names,
                rules=self.rules,
                per_pid=self.per_pid,
                kubelet_up=found.kubelet_up,
                team_from_account=self.team_from_account,
            )
        )
        if not found.allocations_known:
            attribution = replace(attribution, allocations_known=False)
        self._tell_unmatched(attribution.unmatched_devices, found)
        self._last = (key, found, attribution)
        return attribution

    def _tell_unmatched(self, device_ids: Sequence[str], found: HostFacts) -> None:
        """Once per device id: which pod the kubelet gave it to, and that no device here has it."""
        for device_id in device_ids:
            if device_id in self._told_unmatched:
                continue
            self._told_unmatched.add(device_id)
            pods = sorted({f"{a.namespace}/{a.pod}" for a in found.pod_allocations if a.device_id == device_id})
            log.warning(
                "kubelet allocated device %r (to %s), which no GPU or MIG instance on this node goes by: "
                "that pod is not billed for it (gpuledger_kubelet_unmatched_devices counts such ids)",
                device_id,
                ", ".join(pods),
            )

    def refreshers(self) -> tuple[Refresher, ...]:
        """Every source's scheduled work, in the order the sources gather."""
        return tuple(refresher for source in self.sources for refresher in source.refreshers())

    def refresh(self) -> None:
        """Run every refresher now (at start-up, or before a one-off snapshot)."""
        for refresher in self.refreshers():
            refresher.refresh()

    def timeouts(self) -> int:
        """Every source's reads given up on at their deadline so far."""
        return sum(source.timeouts() for source in self.sources)

    def source(self, kind: type[S]) -> S:
        """The source of type `kind` (tests and benchmarks look inside one). Raises LookupError."""
        for source in self.sources:
            if isinstance(source, kind):
                return source
        raise LookupError(f"no {kind.__name__} among the attribution sources")

    def close(self) -> None:
        """Close every source, in the order they gather."""
        for source in self.sources:
            source.close()
