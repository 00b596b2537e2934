"""Reads every device once per poll into an immutable `Snapshot`.

Policy lives here, calls live in `agent.devices.nvml`: a reading a device does not have is learned once
per (device, field), logged once and skipped from then on; one GPU failing never fails the
others; a driver that goes away is re-initialised with exponential backoff on the backend clock.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from agent.devices.nvml import (
    FI_NVLINK_GET_STATE,
    FI_NVLINK_LINK_COUNT,
    FI_POWER_INSTANT,
    FI_TOTAL_ENERGY_CONSUMPTION,
    MAX_NVLINKS,
    FieldResult,
    Handle,
    NvmlBackend,
)
from agent.errors import (
    NvmlDriverUnavailable,
    NvmlError,
    NvmlFunctionMissing,
    NvmlGpuLost,
    NvmlLibraryMissing,
    NvmlNotSupported,
)
from agent.model import DeviceReading, NodeInfo, NvLinkReading, ProcessReading, Snapshot

log = logging.getLogger(__name__)
T = TypeVar("T")

REINIT_BACKOFF_FIRST_S = 5.0
REINIT_BACKOFF_MAX_S = 300.0


@dataclass
class _Mig:
    slot: int
    handle: Handle
    uuid: str
    name: str
    gpu_instance_id: int | None
    sm_count: int | None


@dataclass
class _Gpu:
    index: int
    handle: Handle
    uuid: str
    name: str
    pci_bus_id: str
    power_limit_w: float | None
    sm_count: int | None
    mig_enabled: bool
    nvlinks: int
    migs: list[_Mig] = field(default_factory=list)
    last_seen_us: int = 0
    # Readings this GPU has shown it does not have.
    unsupported: set[str] = field(default_factory=set)
    # Readings the batched field-values call cannot give but a single call can.
    unbatched: set[str] = field(default_factory=set)
    lost_reason: str | None = None
    retry_at: float = 0.0
    retry_backoff_s: float = REINIT_BACKOFF_FIRST_S


class Sampler:
    """Polls NVML through `backend`. Not thread-safe: the scheduler runs one poll at a time."""

    def __init__(self, backend: NvmlBackend, hostname: str | None = None) -> None:
        self.backend = backend
        self.hostname = hostname or socket.gethostname()
        self.errors: Counter[tuple[str, str]] = Counter()
        self._gpus: list[_Gpu] = []
        self._known_uuids: dict[int, str] = {}
        self._known_names: dict[int, str] = {}
        self._initialised = False
        self._next_init_at = 0.0
        self._init_backoff_s = REINIT_BACKOFF_FIRST_S
        self._driver_version = ""
        self._cuda_version: int | None = None
        self._use_field_values = True

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Initialise NVML and discover devices. Raises NvmlLibraryMissing when there is no NVML.

        A driver that is installed but not answering yet (still loading, mid-upgrade) is not
        fatal: polls report it down and initialisation is retried with backoff.
        """
        now = self.backend.clock()
        try:
            self._init(now)
        except NvmlLibraryMissing:
            raise
        except NvmlError as exc:
            self._count(exc)
            log.error("nvml is not answering (%s); retrying with backoff", exc.error)
            self._schedule_reinit(now)

    def close(self) -> None:
        if self._initialised:
            self.backend.shutdown()
            self._initialised = False

    def _init(self, now: float) -> None:
        self.backend.init()
        self._initialised = True
        try:
            self._driver_version = self.backend.driver_version()
            self._cuda_version = self._optional("", "cuda_version", self.backend.cuda_driver_version)
            self._gpus = [self._discover(i) for i in range(self.backend.device_count())]
        except NvmlDriverUnavailable:
            self._initialised = False
            raise
        self._init_backoff_s = REINIT_BACKOFF_FIRST_S
        log.info(
            "nvml initialised: driver %s, %d GPU(s)",
            self._driver_version,
            len(self._gpus),
            extra={"driver_version": self._driver_version, "gpus": len(self._gpus)},
        )

    def _discover(self, index: int) -> _Gpu:
        try:
            handle = self.backend.handle_by_index(index)
            uuid = self.backend.uuid(handle)
            name = self.backend.name(handle)
        except NvmlGpuLost as exc:
            self._count(exc)
            gpu = _Gpu(
                index,
                None,
                self._known_uuids.get(index, ""),
                self._known_names.get(index, ""),
                "",
                None,
                None,
                False,
                0,
            )
            gpu.lost_reason = exc.error
            return gpu
        self._known_uuids[index], self._known_names[index] = uuid, name
        key = uuid
        pci = self._optional(key, "pci", lambda: self.backend.pci_bus_id(handle)) or ""
        gpu = _Gpu(
            index=index,
            handle=handle,
            uuid=uuid,
            name=name,
            pci_bus_id=pci,
            power_limit_w=self._optional(key, "power_limit", lambda: self.backend.power_limit_w(handle)),
            sm_count=self._optional(key, "sm_count", lambda: self.backend.sm_count(handle)),
            mig_enabled=bool(self._optional(key, "mig_mode", lambda: self.backend.mig_enabled(handle))),
            nvlinks=self._count_nvlinks(key, handle),
        )
        if gpu.mig_enabled:
            for slot, mig_handle in self.backend.mig_handles(handle):
                mig_uuid = self.backend.uuid(mig_handle)
                gpu.migs.append(
                    _Mig(
                        slot=slot,
                        handle=mig_handle,
                        uuid=mig_uuid,
                        name=self._optional(mig_uuid, "name", partial(self.backend.name, mig_handle)) or name,
                        gpu_instance_id=self._optional(
                            mig_uuid, "gi", partial(self.backend.gpu_instance_id, mig_handle)
                        ),
                        sm_count=self._optional(mig_uuid, "sm_count", partial(self.backend.sm_count, mig_handle)),
                    )
                )
        return gpu

    def _count_nvlinks(self, key: str, handle: Handle) -> int:
        try:
            result = self.backend.field_values(handle, [FI_NVLINK_LINK_COUNT])[0]
            if result.value is not None:
                return int(result.value)
        except (NvmlNotSupported, NvmlFunctionMissing):
            pass
        links = 0
        for link in range(MAX_NVLINKS):
            try:
                self.backend.nvlink_up(handle, link)
            except NvmlError:
                break
            links += 1
        return links

    def _optional(self, key: str, what: str, read: Callable[[], T]) -> T | None:
        """A discovery-time reading the device may not have: None, logged once, when it doesn't."""
        try:
            return read()
        except (NvmlNotSupported, NvmlFunctionMissing):
            log.info("%s: %s not supported", key or "node", what)
            return None

    # -- polling ------------------------------------------------------------------------------

    def poll(self) -> Snapshot:
        now = self.backend.clock()
        if not self._initialised:
            if now < self._next_init_at:
                return self._down_snapshot(now, "driver unavailable")
            try:
                self._init(now)
                log.warning("nvml is back after re-initialisation")
            except NvmlLibraryMissing:
                raise
            except NvmlError as exc:
                self._count(exc)
                self._schedule_reinit(now)
                return self._down_snapshot(now, exc.error)
        devices: list[DeviceReading] = []
        for gpu in self._gpus:
            try:
                devices.extend(self._read_gpu(gpu, now))
            except NvmlDriverUnavailable as exc:
                self._count(exc)
                log.error("nvml went away (%s); re-initialising with backoff", exc.error)
                self.backend.shutdown()
                self._initialised = False
                self._schedule_reinit(now)
                return self._down_snapshot(now, exc.error)
        taken = Snapshot(
            taken_at=now,
            node=NodeInfo(self.hostname, self._driver_version, self._cuda_version),
            devices=tuple(devices),
            poll_duration_s=0.0,
        )
        return taken

    def _schedule_reinit(self, now: float) -> None:
        self._next_init_at = now + self._init_backoff_s
        self._init_backoff_s = min(self._init_backoff_s * 2, REINIT_BACKOFF_MAX_S)

    def _down_snapshot(self, now: float, reason: str) -> Snapshot:
        devices = tuple(_down(g, reason) for g in self._gpus)
        node = NodeInfo(self.hostname, self._driver_version, self._cuda_version)
        return Snapshot(now, node, devices, driver_up=False)

    def _count(self, exc: NvmlError) -> None:
        self.errors[(exc.call, exc.error)] += 1

    @staticmethod
    def _back_off(gpu: _Gpu, now: float) -> None:
        gpu.retry_at = now + gpu.retry_backoff_s
        gpu.retry_backoff_s = min(gpu.retry_backoff_s * 2, REINIT_BACKOFF_MAX_S)

    def _lost(self, gpu: _Gpu, now: float, exc: NvmlError) -> DeviceReading:
        if gpu.lost_reason is None:
            log.error(
                "GPU %d (%s) is lost: %s", gpu.index, gpu.uuid, exc.error, extra={"gpu": gpu.index, "uuid": gpu.uuid}
            )
        self._count(exc)
        gpu.lost_reason = exc.error
        self._back_off(gpu, now)
        return _down(gpu, exc.error)

    def _read_gpu(self, gpu: _Gpu, now: float) -> list[DeviceReading]:
        if gpu.lost_reason is not None:
            if now < gpu.retry_at:
                return [_down(gpu, gpu.lost_reason)]
            if gpu.handle is None:
                # Lost before we ever had a handle: look it up again.
                rediscovered = self._discover(gpu.index)
                if rediscovered.lost_reason is not None:
                    rediscovered.retry_backoff_s = gpu.retry_backoff_s
                    self._back_off(rediscovered, now)
                    self._gpus[gpu.index] = rediscovered
                    return [_down(rediscovered, rediscovered.lost_reason)]
                self._gpus[gpu.index] = gpu = rediscovered
        try:
            readings = self._read_healthy(gpu)
        except NvmlGpuLost as exc:
            return [self._lost(gpu, now, exc)]
        if gpu.lost_reason is not None:
            log.warning("GPU %d (%s) is readable again", gpu.index, gpu.uuid)
            gpu.lost_reason = None
            gpu.retry_backoff_s = REINIT_BACKOFF_FIRST_S
        return readings

    def _reading(self, gpu_key: str, unsupported: set[str], what: str, read: Callable[[], T]) -> T | None:
        """One reading, or None. NotSupported is learned (never asked again); a GPU that is lost
        or a driver that went away propagates; any other error counts and leaves this poll's
        reading absent."""
        if what in unsupported:
            return None
        try:
            return read()
        except (NvmlNotSupported, NvmlFunctionMissing) as exc:
            unsupported.add(what)
            log.info("%s: %s is not supported (%s); not asking again", gpu_key, what, exc.error)
            return None
        except (NvmlGpuLost, NvmlDriverUnavailable):
            raise
        except NvmlError as exc:
            self._count(exc)
            log.debug("%s: reading %s failed: %s", gpu_key, what, exc)
            return None

    def _read_healthy(self, gpu: _Gpu) -> list[DeviceReading]:
        b = self.backend
        h = gpu.handle
        u = gpu.unsupported
        key = f"GPU {gpu.index} ({gpu.uuid})"
        memory = self._reading(key, u, "memory", lambda: b.memory(h))
        utilization = self._reading(key, u, "utilization", lambda: b.utilization(h))
        temperature = self._reading(key, u, "temperature", lambda: b.temperature_c(h))
        power, energy, links = self._read_power_energy_links(gpu, key)
        processes = self._read_processes(gpu, key, h, u, per_process_util=True) or ()
        readings = [
            DeviceReading(
                index=gpu.index,
                uuid=gpu.uuid,
                name=gpu.name,
                up=True,
                pci_bus_id=gpu.pci_bus_id,
                mig_enabled=gpu.mig_enabled,
                sm_count=gpu.sm_count,
                utilization=utilization,
                memory_used_bytes=memory[0] if memory else None,
                memory_total_bytes=memory[1] if memory else None,
                temperature_c=temperature,
                power_w=power,
                power_limit_w=gpu.power_limit_w,
                energy_j=energy,
                nvlinks=links,
                processes=processes if not gpu.migs else (),
            )
        ]
        for mig in gpu.migs:
            mig_u = gpu.unsupported
            mig_key = f"{key} MIG {mig.slot}"
            mig_memory = self._reading(mig_key, mig_u, f"mig{mig.slot}.memory", partial(b.memory, mig.handle))
            mig_processes = self._read_processes(gpu, mig_key, mig.handle, mig_u, per_process_util=False, slot=mig.slot)
            readings.append(
                DeviceReading(
                    index=gpu.index,
                    uuid=mig.uuid,
                    name=mig.name,
                    up=True,
                    parent_uuid=gpu.uuid,
                    mig_index=mig.slot,
                    gpu_instance_id=mig.gpu_instance_id,
                    pci_bus_id=gpu.pci_bus_id,
                    sm_count=mig.sm_count,
                    memory_used_bytes=mig_memory[0] if mig_memory else None,
                    memory_total_bytes=mig_memory[1] if mig_memory else None,
                    processes=mig_processes or (),
                )
            )
        return readings

    def _read_power_energy_links(
        self, gpu: _Gpu, key: str
    ) -> tuple[float | None, float | None, tuple[NvLinkReading, ...]]:
        """Power, energy and NVLink states, batched into one field-values call where it can be."""
        b = self.backend
        h = gpu.handle
        u = gpu.unsupported
        power: float | None = None
        energy: float | None = None
        link_states: dict[int, bool] = {}
        wanted: list[int | tuple[int, int]] = []
        if self._use_field_values:
            if "power" not in u and "power" not in gpu.unbatched:
                wanted.append(FI_POWER_INSTANT)
            if "energy" not in u and "energy" not in gpu.unbatched:
                wanted.append(FI_TOTAL_ENERGY_CONSUMPTION)
            if "nvlink" not in u and "nvlink" not in gpu.unbatched:
                wanted.extend((FI_NVLINK_GET_STATE, link) for link in range(gpu.nvlinks))
        results: list[FieldResult] = []
        if wanted:
            try:
                results = b.field_values(h, wanted)
            except (NvmlNotSupported, NvmlFunctionMissing) as exc:
                log.info("field values are not available (%s): reading one call per value", exc.error)
                self._use_field_values = False
            except (NvmlGpuLost, NvmlDriverUnavailable):
                raise
            except NvmlError as exc:
                self._count(exc)
            for result in results:
                what = {FI_POWER_INSTANT: "power", FI_TOTAL_ENERGY_CONSUMPTION: "energy"}.get(result.field_id, "nvlink")
                if result.error is not None:
                    # The batch lacks it; the single call may still have it (older drivers).
                    if result.error in ("NOT_SUPPORTED", "INVALID_ARGUMENT"):
                        gpu.unbatched.add(what)
                    elif result.error in ("GPU_IS_LOST", "GPU_NOT_FOUND"):
                        raise NvmlGpuLost("nvmlDeviceGetFieldValues", result.error)
                    else:
                        self.errors[("nvmlDeviceGetFieldValues", result.error)] += 1
                    continue
                if what == "power":
                    power = result.value / 1000 if result.value is not None else None
                elif what == "energy":
                    energy = result.value / 1000 if result.value is not None else None
                else:
                    link_states[result.scope_id] = bool(result.value)
        if power is None and (not self._use_field_values or "power" in gpu.unbatched):
            power = self._reading(key, u, "power", lambda: b.power_w(h))
        if energy is None and (not self._use_field_values or "energy" in gpu.unbatched):
            energy = self._reading(key, u, "energy", lambda: b.energy_j(h))
        if gpu.nvlinks and (not self._use_field_values or "nvlink" in gpu.unbatched) and "nvlink" not in u:
            for link in range(gpu.nvlinks):
                state = self._reading(key, u, "nvlink", partial(b.nvlink_up, h, link))
                if state is not None:
                    link_states[link] = state
        return (
            power,
            energy,
            tuple(NvLinkReading(link, up) for link, up in sorted(link_states.items())),
        )

    def _read_processes(
        self,
        gpu: _Gpu,
        key: str,
        handle: Handle,
        unsupported: set[str],
        *,
        per_process_util: bool,
        slot: int | None = None,
    ) -> tuple[ProcessReading, ...] | None:
        tag = "processes" if slot is None else f"mig{slot}.processes"
        infos = self._reading(key, unsupported, tag, lambda: self.backend.running_processes(handle))
        if infos is None:
            return None
        utils: dict[int, float] | None = None
        if per_process_util and infos:
            utils = self._process_utils(gpu, key)
        return tuple(
            ProcessReading(
                pid=info.pid,
                used_memory_bytes=info.used_memory_bytes,
                sm_util=None if utils is None else utils.get(info.pid, 0.0),
                gpu_instance_id=info.gpu_instance_id,
            )
            for info in infos
        )

    def _process_utils(self, gpu: _Gpu, key: str) -> dict[int, float] | None:
        """Mean SM utilization per pid over the samples since the previous poll."""
        samples = self._reading(
            key,
            gpu.unsupported,
            "process utilization",
            lambda: self.backend.process_utilization(gpu.handle, gpu.last_seen_us),
        )
        if samples is None:
            return None
        sums: dict[int, int] = {}
        counts: dict[int, int] = {}
        newest = gpu.last_seen_us
        for pid, stamp_us, util in samples:
            if stamp_us <= gpu.last_seen_us:
                continue
            sums[pid] = sums.get(pid, 0) + util
            counts[pid] = counts.get(pid, 0) + 1
            newest = max(newest, stamp_us)
        gpu.last_seen_us = newest
        # Sum whole percents and divide once, so a steady 92% reads 0.92, not 0.9200000000000002.
        return {pid: sums[pid] / counts[pid] / 100 for pid in sums}


def _down(gpu: _Gpu, reason: str) -> DeviceReading:
    """A GPU that could not be read: its identity, up=0, and why; no readings."""
    return DeviceReading(
        index=gpu.index, uuid=gpu.uuid, name=gpu.name, up=False, pci_bus_id=gpu.pci_bus_id, down_reason=reason
    )
