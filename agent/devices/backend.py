"""The seam between the sampler and a vendor's GPU management library.

`Sampler` (agent/devices/sampler.py) talks to a `DeviceBackend` and nothing else: it decides
what to read and what to do when a read fails; the backend decides how to read it. A backend
module (agent/devices/nvml.py for NVIDIA) is the only place that imports its vendor library,
and it maps that library's errors to the ones below with ``raise ... from``:

    GpuledgerError                      (agent.errors)
    └── DeviceError                     a call into the driver failed; .call and .error name it
        ├── DriverLibraryMissing        the vendor library cannot be loaded (no driver on this host)
        ├── DriverUnavailable           the driver is not loaded / went away: re-initialise later
        ├── ReadingNotSupported         this device has no such reading: learned once, then skipped
        │   └── ReadingNoLongerSupported    it had, and the backend has no way left to read it
        ├── PermissionDenied            the agent may not read this (e.g. MIG aggregates, unprivileged)
        └── DeviceLost                  the device fell off the bus or needs a reset

Readings cross the seam in SI units (watts, joules, bytes, degrees Celsius, fractions 0-1):
a backend converts its library's units once, where it reads them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from agent.errors import GpuledgerError

# A device as the backend knows it: opaque to everything above the backend, which only hands
# it back. The backend may keep its per-device memos on it.
Handle = Any


class DeviceError(GpuledgerError):
    """A call into the device library failed. `call` names the library call, `error` the
    library's error name (e.g. "TIMEOUT"): both are exported as labels, so keep them stable.
    `detail` is for a person (for DriverLibraryMissing: which library, and what to check)."""

    def __init__(self, call: str, error: str, detail: str = "") -> None:
        self.call = call
        self.error = error
        self.detail = detail
        super().__init__(f"{call}: {error}" + (f" ({detail})" if detail else ""))


class DriverLibraryMissing(DeviceError):
    pass


class DriverUnavailable(DeviceError):
    pass


class ReadingNotSupported(DeviceError):
    pass


class ReadingNoLongerSupported(ReadingNotSupported):
    """A reading the device gave before and the backend now has no way left to read (the only
    call that served it stopped answering for good): learned like ReadingNotSupported, although
    it answered before, rather than counted as a failure every poll."""


class PermissionDenied(DeviceError):
    pass


class DeviceLost(DeviceError):
    pass


class Quantity(enum.StrEnum):
    """What `DeviceBackend.read` can be asked for, each in the unit its name says. A StrEnum:
    its members hash as strings, in C, and a poll looks them up thousands of times."""

    UTILIZATION = "utilization"  # fraction of time the device was busy, 0-1
    MEMORY_USED = "memory used"  # bytes
    MEMORY_TOTAL = "memory total"  # bytes
    # bytes the driver reports free: the total less what is used and (since R510's v2 call) its
    # own reservation, which counts as neither
    MEMORY_FREE = "memory free"
    TEMPERATURE = "temperature"  # degrees Celsius
    POWER = "power"  # watts, instantaneous
    ENERGY = "energy"  # joules since the driver loaded
    NVLINK_UP = "nvlink"  # 1.0 when the link (ReadingKey.link) is up, 0.0 when down
    # Clocks, cooling, performance state (agent/devices/telemetry.py groups what follows).
    SM_CLOCK = "sm clock"  # hertz
    MEMORY_CLOCK = "memory clock"  # hertz
    SM_CLOCK_MAX = "sm clock max"  # hertz
    MEMORY_CLOCK_MAX = "memory clock max"  # hertz
    # How many memory clocks the device can run at (a count, from the supported-clocks list): 1
    # on HBM boards, whose memory clock therefore never changes and is read once.
    MEMORY_CLOCKS_SUPPORTED = "memory clocks supported"
    FAN_SPEED = "fan speed"  # fraction of the fan's maximum speed (a driver may report above 1)
    PERFORMANCE_STATE = "performance state"  # 0 (P0, the most performance) to 15
    # Throttling: the reasons the clocks are held down now (NVML's clocks-event reason bits), and
    # for how long each cause has held them down since the driver loaded (seconds).
    CLOCK_EVENT_REASONS = "clock event reasons"
    VIOLATION_POWER = "violation power"
    VIOLATION_THERMAL = "violation thermal"
    VIOLATION_SYNC_BOOST = "violation sync boost"
    VIOLATION_BOARD_LIMIT = "violation board limit"
    VIOLATION_LOW_UTILIZATION = "violation low utilization"
    VIOLATION_RELIABILITY = "violation reliability"
    VIOLATION_APP_CLOCKS = "violation application clocks"
    VIOLATION_BASE_CLOCKS = "violation base clocks"
    # Memory errors: counts (volatile: since the driver loaded; aggregate: the board's lifetime),
    # and 0/1 flags.
    ECC_CORRECTED_VOLATILE = "ecc corrected volatile"
    ECC_UNCORRECTED_VOLATILE = "ecc uncorrected volatile"
    ECC_CORRECTED_AGGREGATE = "ecc corrected aggregate"
    ECC_UNCORRECTED_AGGREGATE = "ecc uncorrected aggregate"
    RETIRED_PAGES_SINGLE_BIT = "retired pages single bit"
    RETIRED_PAGES_DOUBLE_BIT = "retired pages double bit"
    RETIRED_PAGES_PENDING = "retired pages pending"
    REMAPPED_ROWS_CORRECTABLE = "remapped rows correctable"
    REMAPPED_ROWS_UNCORRECTABLE = "remapped rows uncorrectable"
    ROW_REMAP_PENDING = "row remap pending"
    ROW_REMAP_FAILURE = "row remap failure"
    # PCIe: link generation and lanes, replays (a count), throughput (bytes per second).
    PCIE_LINK_GENERATION = "pcie link generation"
    PCIE_LINK_WIDTH = "pcie link width"
    PCIE_LINK_GENERATION_MAX = "pcie link generation max"
    PCIE_LINK_WIDTH_MAX = "pcie link width max"
    PCIE_REPLAYS = "pcie replays"
    PCIE_TX_RATE = "pcie tx rate"
    PCIE_RX_RATE = "pcie rx rate"
    # NVLink, per link (ReadingKey.link): error counts, and data bytes carried since the driver loaded.
    NVLINK_CRC_ERRORS = "nvlink crc errors"
    NVLINK_REPLAY_ERRORS = "nvlink replay errors"
    NVLINK_RECOVERY_ERRORS = "nvlink recovery errors"
    NVLINK_TX_BYTES = "nvlink tx bytes"
    NVLINK_RX_BYTES = "nvlink rx bytes"
    # Engines, fractions of time busy (0-1): video encoder, decoder, the memory controller.
    ENCODER_UTILIZATION = "encoder utilization"
    DECODER_UTILIZATION = "decoder utilization"
    MEMORY_UTILIZATION = "memory utilization"


# The driver's violation time, one quantity per cause, in agent.model.VIOLATION_CAUSES's order.
VIOLATION_QUANTITIES: tuple[Quantity, ...] = (
    Quantity.VIOLATION_POWER,
    Quantity.VIOLATION_THERMAL,
    Quantity.VIOLATION_SYNC_BOOST,
    Quantity.VIOLATION_BOARD_LIMIT,
    Quantity.VIOLATION_LOW_UTILIZATION,
    Quantity.VIOLATION_RELIABILITY,
    Quantity.VIOLATION_APP_CLOCKS,
    Quantity.VIOLATION_BASE_CLOCKS,
)


class ReadingKey(NamedTuple):
    """One reading of one device: a quantity, and the link for per-link quantities. A named
    tuple, not a dataclass: it keys the dicts of every read, and tuples hash and compare in C."""

    quantity: Quantity
    link: int | None = None

    def __str__(self) -> str:
        return self.quantity.value if self.link is None else f"{self.quantity.value} {self.link}"


@dataclass(frozen=True, slots=True)
class ReadResult:
    """The answer to one `DeviceBackend.read`: each key asked for is in exactly one mapping.

    An error is per key: `ReadingNotSupported` means the device has no such reading (the
    sampler stops asking), anything else failed this once (the sampler counts it). The same
    exception object under several keys is one failed call."""

    values: Mapping[ReadingKey, float]
    errors: Mapping[ReadingKey, DeviceError]


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A compute process on a device. On a MIG-enabled GPU the instance ids say which MIG
    device it runs on; None where the library does not say."""

    pid: int
    used_memory_bytes: int | None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


# (pid, timestamp in microseconds, SM utilization in whole percent): a tuple, not a class,
# because a busy node yields tens of thousands of samples a poll.
ProcessSample = tuple[int, int, int]
# (timestamp in microseconds, the device's utilization over its sampling period in whole
# percent): the device's own samples, one per sampling period, 0% included.
UtilizationSample = tuple[int, float]


class DeviceBackend(Protocol):
    """A GPU management library as the sampler uses it.

    Every method raises only `DeviceError`s. `DeviceLost` and `DriverUnavailable` are always
    raised (they end the device's poll, or the whole poll); `read` returns other per-key
    failures in its result. Discovery methods (`name` .. `compute_instance_id`) are called
    once per device when the sampler (re)discovers devices; `read`, the process lists,
    `process_utilization` and `utilization_samples` every poll, so those are the ones to make cheap: batch, pre-size
    buffers, remember which call variant the driver has.
    """

    clock: Callable[[], float]  # the backend's clock, unix seconds: snapshots are stamped with it

    # -- library ------------------------------------------------------------------------------
    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def cuda_driver_version(self) -> int: ...
    def device_count(self) -> int: ...
    def handle_by_index(self, index: int) -> Handle: ...

    # -- identity, read at discovery ----------------------------------------------------------
    def name(self, handle: Handle) -> str: ...
    def uuid(self, handle: Handle) -> str: ...
    def pci_bus_id(self, handle: Handle) -> str: ...
    def minor_number(self, handle: Handle) -> int:
        """The GPU's device-node number (/dev/nvidia<minor>), which is not its index: the name
        GKE's device plugin gives the GPU to the kubelet ("nvidia<minor>")."""
        ...

    def power_limit_w(self, handle: Handle) -> float: ...
    def sm_count(self, handle: Handle) -> int: ...
    def nvlink_count(self, handle: Handle) -> int: ...
    def mig_enabled(self, handle: Handle) -> bool: ...
    def mig_handles(self, handle: Handle) -> list[tuple[int, Handle]]:
        """(slot, handle) of each MIG device the GPU has now; slots need not be contiguous."""
        ...

    def mig_profile(self, handle: Handle) -> str:
        """A MIG device's profile as the MIG user guide names it, e.g. "3g.40gb"."""
        ...

    def gpu_instance_id(self, handle: Handle) -> int: ...
    def compute_instance_id(self, handle: Handle) -> int: ...

    # -- readings, every poll -----------------------------------------------------------------
    def read(self, handle: Handle, keys: Sequence[ReadingKey]) -> ReadResult:
        """The readings `keys` name, in as few library calls as the backend can manage."""
        ...

    def running_processes(self, handle: Handle) -> list[ProcessInfo]:
        """Compute processes on the device. On a MIG-enabled GPU: every process on any of its
        MIG devices, with instance ids (PermissionDenied where that needs privileges)."""
        ...

    def mps_processes(self, handle: Handle) -> list[ProcessInfo]:
        """CUDA MPS clients on the device: under MPS the compute list shows only the MPS server."""
        ...

    def graphics_processes(self, handle: Handle) -> list[ProcessInfo]:
        """Processes with a graphics context on the device; one with a compute context too is
        in both lists."""
        ...

    def process_utilization(self, handle: Handle, since_us: int) -> list[ProcessSample]:
        """Per-process SM utilization samples stamped after `since_us`; [] when there are none."""
        ...

    def utilization_samples(self, handle: Handle, since_us: int) -> list[UtilizationSample]:
        """The device's own utilization samples stamped after `since_us`, oldest first; [] when
        there are none."""
        ...
