"""Time that cannot be booked yet: unobserved time with no unit to book it to, or no price.

Two kinds of time wait here, both unobserved, both booked once what they lack is known:

- Time when no GPU was known at all: the driver could not list them and nothing else named
  them (no PCI view, no ledger), from the agent's first poll on, and the time since the
  ledger's record ended. Once GPUs become known, it is booked to each of them as unobserved,
  for the reason it was unobserved (`Unplaced`).
- Time of a GPU that discovery could not identify and that has no price: without its name its
  model is unknown, so only a node-wide price (pricing.gpu_hourly, the instance's price split
  over its GPUs) can price it, and where none is set it is priced at the price it gets once
  identified (`Unpriced`). Once it is, its held time is booked under its uuid at that price.

Either way the time is kept as stretches (start, end, reason) merged where they touch, so
memory stays bounded however long the wait; and it is booked into the hours it belongs to
(the ledger splits a charge over the hours it spans). Time still waiting when the agent stops
is booked as well as it can be (`drain`): a GPU never identified at $0 under its provisional
uuid (its seconds are known, its price is not); time with no unit at all nowhere, said in one
line. Pure: no I/O, `now` comes with the snapshots.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

from agent.accounting.cost import downtime
from agent.model import Charges, DeviceReading, Price, Snapshot


@dataclass
class Stretch:
    start: float
    end: float
    reason: str


def _extend(stretches: list[Stretch], start: float, end: float, reason: str) -> None:
    """Add (start, end] to `stretches`, merged into the last one where it continues it."""
    if end <= start:
        return
    last = stretches[-1] if stretches else None
    if last is not None and last.reason == reason and last.end == start:
        last.end = end
    else:
        stretches.append(Stretch(start, end, reason))


@dataclass
class Unplaced:
    """Unobserved time before any GPU was known, booked to every GPU once some are."""

    stretches: list[Stretch] = field(default_factory=list)

    def add(self, start: float, end: float, reason: str) -> None:
        _extend(self.stretches, start, end, reason)

    @property
    def seconds(self) -> float:
        return sum(s.end - s.start for s in self.stretches)

    def place(
        self, snapshot: Snapshot, prices: Mapping[str, Price | None], energy_per_kwh: float | None
    ) -> list[Charges]:
        """The waiting time as charges to the GPUs of `snapshot` (none when it has none)."""
        if not snapshot.gpus or not self.stretches:
            return []
        placed = [
            downtime(s.start, s.end, snapshot, prices, reason=s.reason, energy_per_kwh=energy_per_kwh)
            for s in self.stretches
        ]
        self.stretches = []
        return placed


@dataclass
class _Held:
    reading: DeviceReading  # the GPU as it was when its time was held (provisional uuid)
    stretches: list[Stretch] = field(default_factory=list)


@dataclass
class Unpriced:
    """Unobserved time of undiscovered GPUs that have no price, held by GPU index."""

    held: dict[int, _Held] = field(default_factory=dict)

    def hold(self, charges: Charges, snapshot: Snapshot, prices: Mapping[str, Price | None]) -> Charges:
        """`charges` less the GPU charges of undiscovered GPUs without a price, kept here."""
        waiting = {g.uuid: g for g in snapshot.gpus if not g.discovered and prices.get(g.uuid) is None and g.uuid}
        if not waiting or not any(c.uuid in waiting for c in charges.gpus):
            return charges
        kept = []
        for charge in charges.gpus:
            gpu = waiting.get(charge.uuid)
            if gpu is None:
                kept.append(charge)
                continue
            held = self.held.setdefault(gpu.index, _Held(gpu))
            held.reading = gpu
            # An undiscovered GPU is down, so all of its interval is unobserved.
            _extend(held.stretches, charges.start, charges.end, charge.unobserved_reason)
        return replace(charges, gpus=tuple(kept))

    @property
    def seconds(self) -> float:
        return sum(s.end - s.start for held in self.held.values() for s in held.stretches)

    def release(
        self, snapshot: Snapshot, prices: Mapping[str, Price | None], energy_per_kwh: float | None
    ) -> list[Charges]:
        """The held time of GPUs `snapshot` shows discovered, as charges under their uuid at
        their price (at $0 where even the identified GPU has none, as for any unpriced GPU)."""
        if not self.held:
            return []
        found = []
        for gpu in snapshot.gpus:
            held = self.held.get(gpu.index)
            if held is None or not gpu.discovered:
                continue
            del self.held[gpu.index]
            found += _book(held.stretches, replace(snapshot, devices=(gpu,)), prices, energy_per_kwh)
        return found

    def drain(
        self, last: Snapshot, energy_per_kwh: float | None
    ) -> Iterator[tuple[DeviceReading, float, list[Charges]]]:
        """Everything still held: per GPU, its reading, its seconds and its charges at $0."""
        for index in sorted(self.held):
            held = self.held.pop(index)
            alone = replace(last, devices=(held.reading,))
            seconds = sum(s.end - s.start for s in held.stretches)
            yield held.reading, seconds, _book(held.stretches, alone, {}, energy_per_kwh)


def _book(
    stretches: list[Stretch], snapshot: Snapshot, prices: Mapping[str, Price | None], energy_per_kwh: float | None
) -> list[Charges]:
    return [
        downtime(s.start, s.end, snapshot, prices, reason=s.reason, energy_per_kwh=energy_per_kwh) for s in stretches
    ]
