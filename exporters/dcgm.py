"""dcgm-exporter compatibility: the DCGM_FI_DEV_* series dashboards and alerts written for
NVIDIA's dcgm-exporter query, rendered from the same `AgentState` as gpuledger's own series.

Switched on by `exporters.dcgm_compat`. Only the fields gpuledger reads are emitted; a reading
the GPU does not have (None) emits nothing, as dcgm-exporter skips blank DCGM values. Where the
names, help texts, units and labels come from (NVIDIA/dcgm-exporter):

- names, units and HELP: `etc/default-counters.csv` (also `etc/dcp-metrics-included.csv`,
  which adds `DCGM_FI_DRIVER_VERSION` as a label on every series);
- label set and order: `internal/pkg/rendermetrics/render_metrics.go` (gpuMetricsFormat):
  `gpu`, `UUID`, `pci_bus_id`, `device` ("nvidia<index>"), `modelName` (the NVML name),
  `GPU_I_PROFILE` and `GPU_I_ID` on MIG instances, `Hostname`, then the label fields;
- `namespace`, `pod`, `container`: `internal/pkg/transformation/kubernetes.go` (set only
  when a pod holds the device; absent otherwise);
- `hpc_job`: `internal/pkg/transformation/hpc.go` (the HPC job mapping files; set only when a
  batch job holds the device). gpuledger's own series use the same name, so dashboards written
  for either carry over;
- these attributes come after the identity labels in name order, as the Go template's `range`
  over a map renders them.

Decisions where gpuledger and dcgm-exporter differ:

- One series per device, always. When several pods hold one GPU (time-slicing, or a pod
  beside its sidecar), the pod the kubelet allocated the GPU to wins over one that only runs
  a process there, then the first by namespace/pod/container. dcgm-exporter without
  virtual-GPU mode keeps whichever pod the kubelet listed last; its virtual-GPU mode
  duplicates the series per pod, which makes `sum()` over GPUs count a GPU twice. The same
  for `hpc_job`: the allocated job, then the first by id, where dcgm-exporter repeats the series
  for each job its mapping file lists.
- `DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION` is typed `gauge`, not `counter`. dcgm-exporter
  declares it a counter without the `_total` suffix; OpenMetrics forbids that and
  prometheus_client renders such a family with a TYPE line naming `..._total`, so the sample
  would lose its metadata. The type is metadata only: `rate()` and `increase()` over it give
  the same numbers either way.
- MIG: a partitioned GPU's framebuffer series are per MIG instance (with `GPU_I_PROFILE`,
  `GPU_I_ID`; `gpu` and `UUID` are the parent's, as dcgm-exporter prints them), and its
  temperature, power and energy are one series for the whole GPU, so sums over a node never
  count a board twice.
- `DCGM_FI_DEV_XID_ERRORS` is the last Xid's code, as dcgm-exporter's gauge ("Value of the last
  XID error encountered."), 0 for a GPU the agent watches that has had none since it started;
  absent for a GPU whose events the agent cannot read. Like dcgm-exporter's, it carries the
  code as `err_code` (`internal/pkg/collector/gpu_collector.go`, toMetric); dcgm-exporter's
  `err_msg`, its own text for each code, is left out.
- The DCP profiling fields (`DCGM_FI_PROF_GR_ENGINE_ACTIVE`, `_SM_ACTIVE`, `_SM_OCCUPANCY`,
  `_PIPE_TENSOR_ACTIVE`, `_DRAM_ACTIVE`; names and HELP from `etc/dcp-metrics-included.csv`, the
  two it leaves commented out in its words) come from NVML's GPM where the GPU has it (Hopper and
  later): ratios 0-1 over the last poll interval, as DCGM gives them over its own sampling
  period. Per GPU, and per MIG instance with its `GPU_I_PROFILE` and `GPU_I_ID`.
- Clocks, throttling, memory errors and links (exporters/dcgm_health.py): the GPU's own fields,
  one series per GPU, in DCGM's units.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from agent.model import AgentState, DeviceReading, Holding
from exporters.catalogue import Kind, MetricSpec
from exporters.dcgm_health import DCGM_HEALTH_CATALOGUE, health_samples

StateSource = Callable[[], AgentState]

MIB = 2**20

# The labels on every series, in dcgm-exporter's order; MIG and pod labels only where they apply.
IDENTITY = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION")
MIG_LABELS = ("GPU_I_PROFILE", "GPU_I_ID")
# What dcgm-exporter calls the attributes of the workload holding a device, in its render order.
WORKLOAD_ATTRIBUTES = ("container", "hpc_job", "namespace", "pod")

DCGM_CATALOGUE: tuple[MetricSpec, ...] = (
    MetricSpec("DCGM_FI_DEV_GPU_UTIL", Kind.GAUGE, "GPU utilization (in %).", IDENTITY, "percent", WORKLOAD_ATTRIBUTES),
    MetricSpec(
        "DCGM_FI_DEV_FB_FREE",
        Kind.GAUGE,
        "Framebuffer memory free (in MiB).",
        IDENTITY,
        "mebibytes",
        (*MIG_LABELS, *WORKLOAD_ATTRIBUTES),
    ),
    MetricSpec(
        "DCGM_FI_DEV_FB_USED",
        Kind.GAUGE,
        "Framebuffer memory used (in MiB).",
        IDENTITY,
        "mebibytes",
        (*MIG_LABELS, *WORKLOAD_ATTRIBUTES),
    ),
    MetricSpec("DCGM_FI_DEV_GPU_TEMP", Kind.GAUGE, "GPU temperature (in C).", IDENTITY, "celsius", WORKLOAD_ATTRIBUTES),
    MetricSpec("DCGM_FI_DEV_POWER_USAGE", Kind.GAUGE, "Power draw (in W).", IDENTITY, "watts", WORKLOAD_ATTRIBUTES),
    MetricSpec(
        "DCGM_FI_DEV_XID_ERRORS",
        Kind.GAUGE,
        "Value of the last XID error encountered.",
        (*IDENTITY, "err_code"),
        "",
        WORKLOAD_ATTRIBUTES,
    ),
    MetricSpec(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        Kind.GAUGE,  # a counter in dcgm-exporter: see the module docstring
        "Total energy consumption since boot (in mJ).",
        IDENTITY,
        "millijoules",
        WORKLOAD_ATTRIBUTES,
    ),
    # Clocks, throttling, memory errors, links: one series per GPU (a MIG-partitioned one's too).
    *(MetricSpec(s.name, s.kind, s.help, IDENTITY, s.unit, WORKLOAD_ATTRIBUTES) for s in DCGM_HEALTH_CATALOGUE),
)

# The profiling fields, with the Activity attribute each renders.
DCGM_PROFILING: tuple[tuple[MetricSpec, str], ...] = tuple(
    (MetricSpec(name, Kind.GAUGE, help_text, IDENTITY, "ratio", (*MIG_LABELS, *WORKLOAD_ATTRIBUTES)), field)
    for name, help_text, field in (
        ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "Ratio of time the graphics engine is active.", "graphics_active"),
        ("DCGM_FI_PROF_SM_ACTIVE", "The ratio of cycles an SM has at least 1 warp assigned.", "sm_active"),
        ("DCGM_FI_PROF_SM_OCCUPANCY", "The ratio of number of warps resident on an SM.", "sm_occupancy"),
        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles the tensor (HMMA) pipe is active.", "tensor_active"),
        (
            "DCGM_FI_PROF_DRAM_ACTIVE",
            "Ratio of cycles the device memory interface is active sending or receiving data.",
            "dram_active",
        ),
    )
)
DCGM_CATALOGUE = (*DCGM_CATALOGUE, *(spec for spec, _ in DCGM_PROFILING))

DCGM_BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in DCGM_CATALOGUE}


class DcgmCollector(Collector):
    """dcgm-exporter's series for every GPU (and MIG instance) of the latest snapshot."""

    def __init__(self, state: StateSource) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        families = {spec.name: Metric(spec.name, spec.help, spec.kind.value) for spec in DCGM_CATALOGUE}
        state = self._state()
        snapshot = state.snapshot
        if snapshot is not None:
            node = snapshot.node
            events = {g.uuid: g for g in state.events.gpus} if state.events is not None else {}
            for gpu in snapshot.gpus:
                if not gpu.up:
                    continue  # dcgm-exporter skips blank values; a lost GPU has none
                labels = _identity(gpu, node.hostname, node.driver_version)
                board = {**labels, **_workload_attributes(state, gpu.uuid)}
                if gpu.utilization is not None:
                    _add(families, "DCGM_FI_DEV_GPU_UTIL", board, round(gpu.utilization * 100))
                if gpu.temperature_c is not None:
                    _add(families, "DCGM_FI_DEV_GPU_TEMP", board, gpu.temperature_c)
                if gpu.power_w is not None:
                    _add(families, "DCGM_FI_DEV_POWER_USAGE", board, gpu.power_w)
                if gpu.energy_j is not None:
                    _add(families, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", board, round(gpu.energy_j * 1000))
                seen = events.get(gpu.uuid)
                if seen is not None and (seen.watched or seen.last_xid is not None):
                    xid = seen.last_xid or 0
                    _add(families, "DCGM_FI_DEV_XID_ERRORS", {**board, "err_code": str(xid)}, xid)
                if gpu.telemetry is not None:
                    for name, value in health_samples(gpu.telemetry):
                        _add(families, name, board, value)
                instances = snapshot.mig_devices(gpu.uuid)
                if not instances:
                    _framebuffer(families, board, gpu)
                    _profiling(families, board, gpu)
                for mig in instances:
                    mig_labels = {
                        **labels,
                        "GPU_I_PROFILE": mig.mig_profile,
                        "GPU_I_ID": "" if mig.gpu_instance_id is None else str(mig.gpu_instance_id),
                        **_workload_attributes(state, mig.uuid),
                    }
                    _framebuffer(families, mig_labels, mig)
                    _profiling(families, mig_labels, mig)
        yield from (family for family in families.values() if family.samples)


def _identity(gpu: DeviceReading, hostname: str, driver_version: str) -> dict[str, str]:
    labels = {
        "gpu": str(gpu.index),
        "UUID": gpu.uuid,
        "pci_bus_id": gpu.pci_bus_id,
        "device": f"nvidia{gpu.index}",
        "modelName": gpu.name,
    }
    if hostname:  # dcgm-exporter leaves Hostname out when it has none
        labels["Hostname"] = hostname
    if driver_version:
        labels["DCGM_FI_DRIVER_VERSION"] = driver_version
    return labels


def _workload_attributes(state: AgentState, device_uuid: str) -> dict[str, str]:
    """namespace/pod/container of the pod holding the device and `hpc_job` of the batch job
    holding it, each only where there is one (one series per device), in render order."""
    holders = state.attribution.for_device(device_uuid)
    attributes: dict[str, str] = {}
    pods = [h for h in holders if h.workload.pod]
    if pods:
        w = min(pods, key=_pod_rank).workload
        attributes.update(container=w.container, namespace=w.namespace, pod=w.pod)
    jobs = [h for h in holders if h.workload.hpc_job]
    if jobs:
        attributes["hpc_job"] = min(jobs, key=_job_rank).workload.hpc_job
    return {name: attributes[name] for name in WORKLOAD_ATTRIBUTES if name in attributes}


# The scheduler's allocation first (it is what dcgm-exporter's pod and HPC mappers read), then by
# name, so the labels do not flip between scrapes as load moves.
def _pod_rank(holding: Holding) -> tuple[bool, str, str, str]:
    w = holding.workload
    return (not holding.allocated, w.namespace, w.pod, w.container)


def _job_rank(holding: Holding) -> tuple[bool, str]:
    return (not holding.allocated, holding.workload.hpc_job)


def _framebuffer(families: dict[str, Metric], labels: dict[str, str], device: DeviceReading) -> None:
    # DCGM reports whole MiB (the driver's bytes divided down), so these are integers too. Free
    # is NVML's `free`, not total - used: the driver's reservation is in neither
    # (DcgmCacheManager::ReadAndCacheFBMemoryInfo, nvmlDeviceGetMemoryInfo_v2).
    used, free = device.memory_used_bytes, device.memory_free_bytes
    if used is not None:
        _add(families, "DCGM_FI_DEV_FB_USED", labels, used // MIB)
    if free is not None:
        _add(families, "DCGM_FI_DEV_FB_FREE", labels, free // MIB)


def _profiling(families: dict[str, Metric], labels: dict[str, str], device: DeviceReading) -> None:
    activity = device.activity
    if activity is None:
        return
    for spec, field in DCGM_PROFILING:
        value = getattr(activity, field)
        if value is not None:
            _add(families, spec.name, labels, value)


def _add(families: dict[str, Metric], name: str, labels: dict[str, str], value: float) -> None:
    families[name].add_sample(name, labels, float(value))
