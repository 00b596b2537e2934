"""GPU activity between two polls (SM activity, occupancy, tensor and DRAM activity), read the
way NVIDIA's GPU Performance Monitoring (GPM, Hopper and later) reads it: a sample of the
device's counters at each poll, and the metrics between the previous poll's sample and this one.

`ActivityBackend` is the seam (implemented for NVIDIA in agent/devices/nvml.py); `ActivityMeter`
is what the sampler keeps per device: two sample buffers, the previous sample, and what the
device has shown it cannot do. Nothing here names a vendor library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from agent.devices.backend import DeviceError, DeviceLost, DriverUnavailable, Handle, ReadingNotSupported
from agent.model import Activity


@runtime_checkable
class ActivityBackend(Protocol):
    """A device library that can sample activity. Raises only `DeviceError`s."""

    def activity_supported(self, handle: Handle) -> bool:
        """Whether the device has activity counters (False, or ReadingNotSupported: it has not)."""
        ...

    def new_activity_sample(self) -> Any:
        """A buffer for one sample (freed with `free_activity_sample`)."""
        ...

    def take_activity_sample(self, handle: Handle, sample: Any, gpu_instance_id: int | None) -> None:
        """Fill `sample` with the device's counters now; of one MIG GPU instance of it when
        `gpu_instance_id` is given (`handle` is then the whole GPU's)."""
        ...

    def activity_between(self, earlier: Any, later: Any) -> Activity:
        """The activity over the span between two samples of one device."""
        ...

    def free_activity_sample(self, sample: Any) -> None: ...


class ActivityMeter:
    """Activity of one device (a GPU, or one MIG GPU instance of it), one reading per poll.

    Each `read` takes a sample and returns the activity since the previous `read`'s sample (None
    at the first, or after a sample that failed: an interval is only ever measured end to end).
    Two buffers are enough, used in turn. Errors other than a lost device or driver propagate to
    the caller's policy through `on_error`.
    """

    def __init__(self, backend: ActivityBackend, handle: Handle, gpu_instance_id: int | None = None) -> None:
        self._backend = backend
        self.handle = handle
        self.gpu_instance_id = gpu_instance_id
        self._spare: list[Any] = []
        self._previous: Any = None

    def read(self, on_error: Callable[[DeviceError], None]) -> Activity | None:
        """The activity since the previous read. ReadingNotSupported, DeviceLost and
        DriverUnavailable are raised; any other failure goes to `on_error`, and returns None."""
        b = self._backend
        sample = self._spare.pop() if self._spare else None
        try:
            if sample is None:
                sample = b.new_activity_sample()
            b.take_activity_sample(self.handle, sample, self.gpu_instance_id)
        except (ReadingNotSupported, DeviceLost, DriverUnavailable):
            self._forget(sample)
            raise
        except DeviceError as exc:
            self._forget(sample)
            on_error(exc)
            return None
        previous, self._previous = self._previous, sample
        if previous is None:
            return None
        try:
            return b.activity_between(previous, sample)
        except (ReadingNotSupported, DeviceLost, DriverUnavailable):
            raise
        except DeviceError as exc:
            on_error(exc)
            return None
        finally:
            self._spare.append(previous)

    def restart(self) -> None:
        """Forget the previous sample (the device was lost): the next read starts a new interval."""
        self._forget(None)

    def _forget(self, sample: Any) -> None:
        if sample is not None:
            self._spare.append(sample)
        if self._previous is not None:
            self._spare.append(self._previous)
            self._previous = None

    def close(self) -> None:
        """Free both buffers (while the driver that gave them still answers)."""
        self._forget(None)
        for sample in self._spare:
            self._backend.free_activity_sample(sample)
        self._spare.clear()
