"""GPU activity between two polls (SM activity, occupancy, tensor and DRAM activity), read the
way NVIDIA's GPU Performance Monitoring (GPM, Hopper and later) reads it: a sample of the
device's counters at each poll (or each slow interval), and the metrics between the previous
sample and this one.

`ActivityBackend` is the seam (implemented for NVIDIA in agent/devices/nvml.py); `ActivityMeter`
is what the sampler keeps per device: two sample buffers, the previous sample, and what the
device has shown it cannot do. Nothing here names a vendor library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
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

    With `every_s` (the slow rhythm), a sample is taken only once that long has passed since the
    last one, and the polls between carry its figures: GPM's are means over the span between two
    samples, so a 30 s span's mean is exact for those 30 s, and costs two calls instead of twelve
    at 5 s polls. What is carried is dropped with the interval it came from: a failed read (the
    next poll reads again, whatever the rhythm), a lost device (`restart`), and a new meter for
    a device discovered anew. The first span is one poll long (its second sample is taken at the
    next poll), and has no figure until then, as a first poll has none.
    """

    def __init__(
        self,
        backend: ActivityBackend,
        handle: Handle,
        gpu_instance_id: int | None = None,
        every_s: float | None = None,
    ) -> None:
        self._backend = backend
        self.handle = handle
        self.gpu_instance_id = gpu_instance_id
        self.every_s = every_s
        self._spare: list[Any] = []
        self._previous: Any = None
        self._previous_at: float | None = None  # when `_previous` was taken (the caller's clock)
        self._due_at: float | None = None  # the next sample, on the slow rhythm; None: at the next read
        self._carried: Activity | None = None  # the last span's figures, on the slow rhythm

    def read(self, on_error: Callable[[DeviceError], None], now: float | None = None) -> Activity | None:
        """The activity since the previous sample, `now` on the caller's clock (stamped on it as
        `since` and `until`). On the slow rhythm, before the next sample is due: the figures
        the last sample gave. ReadingNotSupported, DeviceLost and DriverUnavailable are raised;
        any other failure goes to `on_error`, and returns None."""
        if self.every_s is None or now is None:
            return self._measure(on_error, now)
        if self._due_at is not None and now < self._due_at:
            return self._carried
        self._carried, self._due_at = None, None
        failures: list[DeviceError] = []

        def failed(exc: DeviceError) -> None:
            failures.append(exc)
            on_error(exc)

        activity = self._measure(failed, now)
        if not failures and activity is not None:
            self._carried, self._due_at = activity, now + self.every_s
        # A first sample (at discovery, after a loss or a failed read) is followed by another at
        # the next poll, not a slow interval later: two calls once, so an agent that restarts or
        # a GPU that recovers has a figure from its second poll on instead of a slow interval of
        # None (busy seconds 0) each time.
        return activity

    def _measure(self, on_error: Callable[[DeviceError], None], now: float | None) -> Activity | None:
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
        since, self._previous_at = self._previous_at, now
        if previous is None:
            return None
        try:
            activity = b.activity_between(previous, sample)
        except (ReadingNotSupported, DeviceLost, DriverUnavailable):
            raise
        except DeviceError as exc:
            on_error(exc)
            return None
        finally:
            self._spare.append(previous)
        return activity if now is None else replace(activity, since=since, until=now)

    def restart(self) -> None:
        """Forget the previous sample (the device was lost): the next read starts a new interval."""
        self._forget(None)

    def _forget(self, sample: Any) -> None:
        if sample is not None:
            self._spare.append(sample)
        if self._previous is not None:
            self._spare.append(self._previous)
            self._previous = None
        self._previous_at = None
        self._carried, self._due_at = None, None

    def close(self) -> None:
        """Free both buffers (while the driver that gave them still answers)."""
        self._forget(None)
        for sample in self._spare:
            self._backend.free_activity_sample(sample)
        self._spare.clear()
