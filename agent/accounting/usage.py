"""What each workload used of each device at a poll, for right-sizing (`UnitUsage`). Pure.

Busy is, in order of trust: the device's SM activity where GPU Performance Monitoring measures it
(`DeviceReading.activity.sm_active`, Hopper and later, read where the sampler provides it) and the
workload holds the device alone; else the workload's own processes' SM share
(`Holding.sm_util`); else, for a sole holder, the device's utilization over the interval. NVML
utilization counts any time a kernel ran, so it overstates how busy a GPU is: right-sizing from
it is conservative (it recommends less than SM activity would).
"""

from __future__ import annotations

from agent.accounting.cost import Recent, device_busy_ratio, held_by_device
from agent.model import Attribution, DeviceReading, Snapshot, UnitUsage

BUSY_GPM = "gpm"
BUSY_NVML = "nvml"
BUSY_PROCESS = "process"


def sm_active(device: DeviceReading) -> float | None:
    """The device's GPM SM activity (0-1) over the interval, where the snapshot carries it.

    Read by name: the GPM reading (`DeviceReading.activity`) comes from the sampler's GPM support
    and is absent where that is not built or the GPU has no GPM."""
    activity = getattr(device, "activity", None)
    value = getattr(activity, "sm_active", None)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _clamp(value: float | None) -> float | None:
    return None if value is None else min(max(value, 0.0), 1.0)


def unit_usage(snapshot: Snapshot, attribution: Attribution) -> tuple[UnitUsage, ...]:
    """One `UnitUsage` per workload and unit it holds at this snapshot."""
    by_uuid = {d.uuid: d for d in snapshot.devices}
    held = held_by_device(attribution)
    usage: list[UnitUsage] = []
    for device_uuid in sorted(held):
        device = by_uuid.get(device_uuid)
        if device is None or not device.up:
            continue
        parent = by_uuid.get(device.parent_uuid) if device.parent_uuid is not None else device
        if parent is None:
            continue
        holdings = held[device_uuid]
        alone = len(holdings) == 1 or len({h.workload for h in holdings}) == 1
        # The device's own figures, the same for each of its holdings.
        gpm = sm_active(device) if alone else None
        gpu_model, mig_profile = parent.model, device.mig_profile if device.is_mig else ""
        for i, holding in enumerate(holdings):
            busy: float | None = None
            source = ""
            if gpm is not None:
                busy, source = gpm, BUSY_GPM
            elif holding.sm_util is not None:
                busy, source = holding.sm_util, BUSY_PROCESS
            elif alone:
                busy = device_busy_ratio(device)
                source = BUSY_NVML if busy is not None else ""
            memory = holding.memory_bytes
            if memory is None and alone:
                memory = device.memory_used_bytes
            usage.append(
                _USAGE.get_or_make(
                    (device_uuid, i),
                    (
                        holding.workload,
                        device_uuid,
                        gpu_model,
                        mig_profile,
                        memory,
                        device.memory_total_bytes,
                        _clamp(busy),
                        source,
                    ),
                )
            )
    return tuple(usage)


# Each unit's usage at the last poll, by holding (its place in the unit's holdings), handed out
# again where it is the same (`agent.accounting.cost.Recent`): a steady workload's is, poll after poll. Positional, in
# UnitUsage's field order (checked).
_USAGE: Recent[tuple[str, int], UnitUsage] = Recent(
    UnitUsage,
    "workload",
    "uuid",
    "gpu_model",
    "mig_profile",
    "memory_bytes",
    "memory_total_bytes",
    "busy",
    "busy_source",
)
