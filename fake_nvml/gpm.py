"""The fake driver's GPU Performance Monitoring (GPM): DCGM's profiling metrics through NVML.

The C functions pynvml wraps, with its signatures and structs (c_nvmlGpmSupport_t,
c_nvmlGpmMetricsGet_t):

    nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *support)
    nvmlGpmSampleAlloc(nvmlGpmSample_t *sample)      nvmlGpmSampleFree(nvmlGpmSample_t sample)
    nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t sample)
    nvmlGpmMigSampleGet(nvmlDevice_t device, unsigned int gpuInstanceId, nvmlGpmSample_t sample)
    nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *metricsGet)

A sample remembers which device (or MIG GPU instance) it was taken of and when; the metrics
between two samples are the means over that span of what the device's processes did:

    graphics activity   the share of time any kernel ran: the processes' sm_util, summed, capped
                        at 100 (what NVML's utilization reads)
    SM activity         the share of the SMs their kernels kept busy: their sm_active (default:
                        sm_util) summed, capped at 100
    tensor activity     each process's SM activity x its `tensor` share, summed
    SM occupancy        OCCUPANCY_PER_ACTIVE x SM activity (resident warps over the maximum)
    DRAM activity       DRAM_PER_ACTIVE x SM activity (the fake's memory-controller figure)

A MIG instance's figures are over its own SMs; the whole GPU's, over every instance weighted by
its SMs. A recorded trace's `readings:` rows give the figures outright where they have them
(from each row's time to the next; `migs:` per instance). Only Hopper and later GPUs have GPM
(`isSupportedDevice` 0 before), and only drivers from R520 on have the calls at all
(`FUNCTION_SINCE_DRIVER` in lib.py).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from fake_nvml.lib import INVALID_ARGUMENT, NOT_SUPPORTED, SUCCESS, Dev, FakeNvmlLibrary, _c, _int, _obj
from fake_nvml.node import FakeNode
from fake_nvml.scenario import ERROR_CODES
from fake_nvml.scenario.model import ActivityRow

# NVML_GPM_METRIC_* (nvml.h) this fake computes.
GRAPHICS_UTIL = 1
SM_UTIL = 2
SM_OCCUPANCY = 3
ANY_TENSOR_UTIL = 5
DRAM_BW_UTIL = 10
METRICS_GET_VERSION = 1  # NVML_GPM_METRICS_GET_VERSION
SUPPORT_VERSION = 1  # NVML_GPM_SUPPORT_VERSION
ARGUMENT_VERSION_MISMATCH = ERROR_CODES["ARGUMENT_VERSION_MISMATCH"]
# Fixed ratios of the fake's hardware: kernels keep half their SMs' warp slots filled, and move
# data 0.6 of the time they are active (as the fake's NVML memory utilization does).
OCCUPANCY_PER_ACTIVE = 0.5
DRAM_PER_ACTIVE = 0.6
_SAMPLE_TAG = 0x67700000  # "gp" in the high bytes: a sample buffer this library made


_FIELDS = ("graphics", "sm_active", "tensor", "occupancy", "dram")


@dataclass(frozen=True)
class Activity:
    """What a device's processes did, in percent (0-100), at an instant or as a mean."""

    graphics: float = 0.0
    sm_active: float = 0.0
    tensor: float = 0.0
    occupancy: float = 0.0
    dram: float = 0.0

    @classmethod
    def of(cls, graphics: float, sm_active: float, tensor: float) -> Activity:
        """From what the processes do; occupancy and DRAM follow SM activity (the fake's ratios)."""
        return cls(graphics, sm_active, tensor, sm_active * OCCUPANCY_PER_ACTIVE, sm_active * DRAM_PER_ACTIVE)

    @classmethod
    def recorded(cls, row: ActivityRow) -> Activity:
        return cls(
            row.graphics_active or 0.0,
            row.sm_active or 0.0,
            row.tensor_active or 0.0,
            row.sm_occupancy or 0.0,
            row.dram_active or 0.0,
        )

    def metric(self, metric_id: int) -> float | None:
        return {
            GRAPHICS_UTIL: self.graphics,
            SM_UTIL: self.sm_active,
            SM_OCCUPANCY: self.occupancy,
            ANY_TENSOR_UTIL: self.tensor,
            DRAM_BW_UTIL: self.dram,
        }.get(metric_id)


def gpm_supported(model: str) -> bool:
    """Hopper (H100, H200, GH200) and later (Blackwell, B200): the architectures with GPM."""
    return model[:1] in ("H", "B", "G")


def _has_gpm(lib: FakeNvmlLibrary, gpu: int) -> bool:
    """Whether the GPU has GPM: as its scenario entry says (a recorded GPU's answer), else its model."""
    spec = lib._node.gpu(gpu)
    return spec.gpm if spec.gpm is not None else gpm_supported(spec.model)


def activity_at(node: FakeNode, gpu: int, mig: int | None, t: float) -> Activity:
    """A GPU's (mig None) or MIG instance's activity at scenario time t."""
    spec = node.gpu(gpu)
    row = node.reading_row(gpu, t)
    if row is not None:
        recorded = row.activity if mig is None else (row.migs[mig] if mig < len(row.migs) else None)
        if recorded is not None:
            return Activity.recorded(recorded)
    if mig is None and spec.mig:
        # The whole GPU in MIG mode: its instances' activity, weighted by their share of its SMs.
        parts = [(activity_at(node, gpu, j, t), m.sm_count / spec.sm_count) for j, m in enumerate(spec.mig)]
        return Activity(*(sum(getattr(a, f) * w for a, w in parts) for f in _FIELDS))
    graphics = active = tensor = 0.0
    for process in node.processes_on(gpu, mig, t):
        segment = process.segment_at(t - process.start_s)
        if segment is None:
            continue
        graphics += segment.sm_util
        active += segment.active
        tensor += segment.active * segment.tensor / 100
    return Activity.of(min(graphics, 100.0), min(active, 100.0), min(tensor, 100.0))


def mean_activity(node: FakeNode, gpu: int, mig: int | None, t1: float, t2: float) -> Activity:
    """The mean activity over [t1, t2]: exact, as activity only changes at the GPU's breakpoints
    (a process starting, ending or changing segment). A span of no length: the value at t2."""
    if t2 <= t1:
        return activity_at(node, gpu, mig, t2)
    rows = [row.at_s for row in node.gpu(gpu).readings]
    points = sorted({p for p in (*node._breakpoints[gpu], *rows) if t1 < p < t2})
    edges = [t1, *points, t2]
    pieces = [(activity_at(node, gpu, mig, lo), hi - lo) for lo, hi in itertools.pairwise(edges)]
    if all(a == pieces[0][0] for a, _ in pieces):
        return pieces[0][0]  # no arithmetic: a steady figure reads exactly as given
    span = t2 - t1
    return Activity(*(sum(getattr(a, f) * dt for a, dt in pieces) / span for f in _FIELDS))


@dataclass
class _Sample:
    gpu: int | None = None  # None: allocated, not yet filled
    mig: int | None = None
    t: float = 0.0


class _Samples:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.samples: dict[int, _Sample] = {}
        self.ids = itertools.count(1)


_STATE: weakref.WeakKeyDictionary[FakeNvmlLibrary, _Samples] = weakref.WeakKeyDictionary()
_STATE_LOCK = threading.Lock()


def _samples(lib: FakeNvmlLibrary) -> _Samples:
    with _STATE_LOCK:
        state = _STATE.get(lib)
        if state is None:
            state = _STATE[lib] = _Samples()
        return state


def _sample(lib: FakeNvmlLibrary, arg: Any) -> _Sample | None:
    obj = _obj(arg)
    value = ctypes.cast(obj, ctypes.c_void_p).value if obj is not None else None
    if value is None or value & 0xFFF00000 != _SAMPLE_TAG:
        return None
    return _samples(lib).samples.get(value & 0xFFFFF)


@_c("nvmlGpmQueryDeviceSupport")
def _query_support(lib: FakeNvmlLibrary, t: float, dev: Dev, out: Any) -> int:
    support = _obj(out)
    if support.version != SUPPORT_VERSION:
        return ARGUMENT_VERSION_MISMATCH
    support.isSupportedDevice = 1 if _has_gpm(lib, dev.gpu) else 0
    return SUCCESS


@_c("nvmlGpmSampleAlloc", device=False)
def _alloc(lib: FakeNvmlLibrary, t: float, out: Any) -> int:
    state = _samples(lib)
    with state.lock:
        sample_id = next(state.ids)
        state.samples[sample_id] = _Sample()
    ctypes.c_void_p.from_buffer(_obj(out)).value = _SAMPLE_TAG | sample_id
    return SUCCESS


@_c("nvmlGpmSampleFree", device=False)
def _free(lib: FakeNvmlLibrary, t: float, sample: Any) -> int:
    obj = _obj(sample)
    value = ctypes.cast(obj, ctypes.c_void_p).value if obj is not None else None
    state = _samples(lib)
    with state.lock:
        if value is None or state.samples.pop(value & 0xFFFFF, None) is None:
            return INVALID_ARGUMENT
    return SUCCESS


def _fill(lib: FakeNvmlLibrary, t: float, sample: Any, gpu: int, mig: int | None) -> int:
    found = _sample(lib, sample)
    if found is None:
        return INVALID_ARGUMENT
    if not _has_gpm(lib, gpu):
        return NOT_SUPPORTED
    found.gpu, found.mig, found.t = gpu, mig, t
    return SUCCESS


@_c("nvmlGpmSampleGet")
def _sample_get(lib: FakeNvmlLibrary, t: float, dev: Dev, sample: Any) -> int:
    return _fill(lib, t, sample, dev.gpu, dev.mig)


@_c("nvmlGpmMigSampleGet")
def _mig_sample_get(lib: FakeNvmlLibrary, t: float, dev: Dev, gpu_instance_id: Any, sample: Any) -> int:
    if dev.mig is not None:
        return INVALID_ARGUMENT  # asked of the GPU, naming one of its GPU instances
    wanted = _int(gpu_instance_id)
    for j, instance in enumerate(lib._node.gpu(dev.gpu).mig):
        if instance.gpu_instance_id == wanted:
            return _fill(lib, t, sample, dev.gpu, j)
    return ERROR_CODES["NOT_FOUND"]


@_c("nvmlGpmMetricsGet", device=False)
def _metrics_get(lib: FakeNvmlLibrary, t: float, out: Any) -> int:
    request = _obj(out)
    if request.version != METRICS_GET_VERSION:
        return ARGUMENT_VERSION_MISMATCH
    first, second = _sample(lib, request.sample1), _sample(lib, request.sample2)
    if first is None or second is None or first.gpu is None or second.gpu is None:
        return INVALID_ARGUMENT
    if (first.gpu, first.mig) != (second.gpu, second.mig):
        return INVALID_ARGUMENT  # two samples of different devices
    count = _int(request.numMetrics)
    if count > len(request.metrics):
        return INVALID_ARGUMENT
    activity = mean_activity(lib._node, first.gpu, first.mig, first.t, second.t)
    for i in range(count):
        metric = request.metrics[i]
        value = activity.metric(metric.metricId)
        if value is None:
            metric.nvmlReturn = NOT_SUPPORTED
        else:
            metric.value = value
            metric.nvmlReturn = SUCCESS
    return SUCCESS
