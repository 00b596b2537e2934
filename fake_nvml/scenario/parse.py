"""The scenario reader: YAML as loaded, checked key by key into the frozen model.

Every problem is reported as one `ScenarioError` line naming the file, the key path and the
entry, e.g. ``demo.yaml: processes[2].gpus: GPU 9 does not exist (the node has 8)``, so that
a bad scenario fails at load and never as a puzzling reading halfway through a run.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from agent.units import parse_duration
from agent.yamlfile import undecodable_locs
from fake_nvml.scenario.facts import (
    BOARD_FACTS,
    DEFAULT_BOARD,
    DEFAULT_FACTS,
    DEVICE_EVENT_KINDS,
    DRIVER_EVENTS,
    ECC_EVENTS,
    ERROR_CODES,
    MIG_PROFILE,
    MODEL_FACTS,
    POLICY_NAMES,
    THROTTLE_KINDS,
    GpuModelFacts,
)
from fake_nvml.scenario.model import (
    ActivityRow,
    Allocation,
    EccErrors,
    Fault,
    Gpu,
    GpuRef,
    HealthRow,
    MigInstance,
    NodeFacts,
    NvLinkErrors,
    PcieDowngrade,
    PodRef,
    Process,
    ReadingRow,
    RowRemap,
    Scenario,
    ScenarioError,
    UtilSegment,
)

# Bounds that keep every number a scenario gives inside what the fake driver can report: NVML's
# unsigned counters, a node's GPUs (its handles number up to 255) and links, a process id. Beyond
# them a run hung, ran out of memory or wrapped values silently.
MAX_COUNT = 2**64 - 1  # NVML's widest counters are unsigned long long
MAX_NUMBER = 1e15  # a number with no narrower bound (watts, joules): finite, and far from overflow
MAX_GPUS = 64
MAX_NVLINKS = 18  # NVML_NVLINK_MAX_LINKS
MAX_MIB = 2**24  # 16 TiB of GPU memory
MAX_PID = 4_194_304  # Linux's PID_MAX_LIMIT
MAX_EVENTS = 1_000_000  # errors one fault adds to a counter
MAX_LATENCY_MS = 86_400_000.0  # a call that hangs for a day
MAX_CMDLINE = 131_072  # Linux's MAX_ARG_STRLEN
MAX_WATTS = 10_000.0  # a board's power in milliwatts stays within NVML's unsigned int
DEVICE_PLUGINS = ("nvidia", "gke")  # NodeFacts.device_plugin


class _Reader:
    """Typed access to one mapping of the YAML, with the path used in error messages."""

    def __init__(self, source: str, path: str, data: object) -> None:
        if not isinstance(data, Mapping):
            raise ScenarioError(f"{source}: {path or 'scenario'}: expected a mapping, got {_kind(data)}")
        self.source = source
        self.path = path
        self.data: Mapping[str, Any] = data

    def where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str) -> ScenarioError:
        return ScenarioError(f"{self.source}: {self.where(key)}: {message}")

    def check_keys(self, allowed: Sequence[str]) -> None:
        for key in self.data:
            if key not in allowed:
                raise self.fail(str(key), f"unknown key (expected one of: {', '.join(allowed)})")

    def str_(self, key: str, default: str | None = None) -> str | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise self.fail(key, f"expected text, got {_kind(value)}")
        return str(value)

    def int_(self, key: str, default: int | None = None, *, minimum: int = 0, maximum: int = MAX_COUNT) -> int | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected a whole number, got {_short(value)}")
        if value < minimum:
            raise self.fail(key, f"must be at least {minimum}, got {_short(value)}")
        if value > maximum:
            raise self.fail(key, f"must be at most {maximum}, got {_short(value)}")
        return value

    def num(self, key: str, default: float | None = None, *, maximum: float = MAX_NUMBER) -> float | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"expected a number, got {_short(value)}")
        if not math.isfinite(value):
            raise self.fail(key, f"must be a finite number, got {value}")
        if value < 0 or value > maximum:
            raise self.fail(key, f"must be 0..{maximum:g}, got {_short(value)}")
        return float(value)

    def duration(self, key: str, default: float | None = None) -> float | None:
        value = self.data.get(key)
        if value is None:
            return default
        try:
            return parse_duration(value)
        except ValueError as exc:
            raise self.fail(key, str(exc)) from None

    def list_(self, key: str) -> list[Any]:
        value = self.data.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list, got {_kind(value)}")
        return value

    def child(self, key: str, data: object) -> _Reader:
        return _Reader(self.source, self.where(key), data)


def _kind(value: object) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def _uuid(hostname: str, *parts: object) -> str:
    digest = hashlib.sha256("/".join([hostname, *map(str, parts)]).encode()).hexdigest()
    return f"{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def _cmdline(r: _Reader) -> str:
    """A process's command line: at most MAX_ARG_STRLEN characters, the kernel's limit on one
    argument (splitting one of megabytes into /proc's arguments took minutes)."""
    cmdline = r.str_("cmdline", "python") or "python"
    if len(cmdline) > MAX_CMDLINE:
        raise r.fail("cmdline", f"at most {MAX_CMDLINE} characters, got {len(cmdline)}")
    return cmdline


def _short(value: object) -> str:
    """A value for an error line: its repr, cut to 40 characters (a line, not a 5 MB string)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _parse_gpus(top: _Reader, hostname: str) -> tuple[Gpu, ...]:
    entries = top.list_("gpus")
    if not entries:
        raise top.fail("gpus", "required: at least one GPU")
    gpus: list[Gpu] = []
    for i, entry in enumerate(entries):
        r = top.child(f"gpus[{i}]", entry)
        r.check_keys(
            [
                "model", "count", "memory_total_mib", "power_limit_w", "idle_power_w",
                "idle_temp_c", "max_temp_c", "nvlink_links", "mig", "sm_count",
                "uuid", "pci_bus_id", "readings", "minor", "gpm", "events",
            ]
        )  # fmt: skip
        model = r.str_("model", "A100-SXM4-80GB") or "A100-SXM4-80GB"
        facts = MODEL_FACTS.get(model, DEFAULT_FACTS)
        count = r.int_("count", 1, minimum=1, maximum=MAX_GPUS) or 1
        if len(gpus) + count > MAX_GPUS:
            raise r.fail("count", f"a node has at most {MAX_GPUS} GPUs; these would make {len(gpus) + count}")
        memory_total_mib = r.int_("memory_total_mib", minimum=1, maximum=MAX_MIB) or facts.memory_total_mib
        power_limit_w = r.num("power_limit_w", facts.power_limit_w, maximum=MAX_WATTS) or float(facts.power_limit_w)
        idle_power_w = r.num("idle_power_w", facts.idle_power_w, maximum=MAX_WATTS) or 0.0
        if idle_power_w > power_limit_w:
            raise r.fail("idle_power_w", f"{idle_power_w:g} is above power_limit_w {power_limit_w:g}")
        idle_temp_c = r.num("idle_temp_c", 32.0, maximum=120) or 0.0
        max_temp_c = r.num("max_temp_c", 83.0, maximum=120) or 0.0
        nvlink_links = r.int_("nvlink_links", 0, maximum=MAX_NVLINKS) or 0
        sm_count = r.int_("sm_count", facts.sm_count, minimum=1, maximum=1024) or facts.sm_count
        profiles = r.list_("mig")
        gpm = r.data.get("gpm")
        if gpm is not None and not isinstance(gpm, bool):
            raise r.fail("gpm", f"expected true or false, got {gpm!r}")
        events = None
        if "events" in r.data:
            events = tuple(r.list_("events"))
            for kind in events:
                if kind not in DEVICE_EVENT_KINDS:
                    raise r.fail("events", f"unknown driver event {kind!r} (use: {', '.join(DEVICE_EVENT_KINDS)})")
        if count > 1 and {"uuid", "pci_bus_id", "readings", "minor"} & set(r.data):
            raise r.fail(
                "count", "uuid, pci_bus_id and readings belong to one GPU (a minor too): give each its own entry"
            )
        readings = _parse_readings(r, nvlink_links, len(profiles))
        for _ in range(count):
            index = len(gpus)
            minor = r.int_("minor", index, maximum=255)
            if minor is None:
                minor = index
            taken = next((g.index for g in gpus if g.minor == minor), None)
            if taken is not None:
                raise r.fail(
                    "minor", f"/dev/nvidia{minor} is already GPU {taken}'s (a GPU's minor is its index unless given)"
                )
            uuid = r.str_("uuid") or "GPU-" + _uuid(hostname, "gpu", index)
            mig = _parse_mig(r, profiles, facts, memory_total_mib, hostname, index)
            gpus.append(
                Gpu(
                    index=index,
                    model=model,
                    uuid=uuid,
                    pci_bus_id=r.str_("pci_bus_id") or f"00000000:{0x10 + index * 0x10:02X}:00.0",
                    pci_device_id=facts.pci_device_id,
                    memory_total_mib=memory_total_mib,
                    power_limit_w=power_limit_w,
                    idle_power_w=idle_power_w,
                    idle_temp_c=idle_temp_c,
                    max_temp_c=max(max_temp_c, idle_temp_c),
                    nvlink_links=nvlink_links,
                    sm_count=sm_count,
                    mig=mig,
                    readings=readings,
                    minor=minor,
                    gpm=gpm,
                    events=events,
                )
            )
    return tuple(gpus)


_ACTIVITY_KEYS = ("graphics_active", "sm_active", "sm_occupancy", "tensor_active", "dram_active")


def _activity_row(r: _Reader) -> ActivityRow | None:
    values = {key: r.num(key, None, maximum=100) for key in _ACTIVITY_KEYS}
    return ActivityRow(**values) if any(v is not None for v in values.values()) else None


def _parse_readings(gpu: _Reader, links: int, migs: int) -> tuple[ReadingRow, ...]:
    """A GPU's `readings:` time series (what `gpuledger record` writes): rows in time order, each
    holding from its `at` until the next; percent for utilization and activity."""
    rows: list[ReadingRow] = []
    for k, item in enumerate(gpu.list_("readings")):
        r = gpu.child(f"readings[{k}]", item)
        r.check_keys(
            [
                "at", "utilization", "interval_utilization", "memory_used_mib", "memory_free_mib",
                "temperature_c", "power_w", "energy_j", "nvlink_down", *_ACTIVITY_KEYS, "migs", *_HEALTH_KEYS,
            ]
        )  # fmt: skip
        at = r.duration("at")
        if at is None:
            raise r.fail("at", "required: when the row starts to hold")
        if rows and at <= rows[-1].at_s:
            raise r.fail("at", "rows must be in time order")
        down = None
        if "nvlink_down" in r.data:
            down = []
            for link in r.list_("nvlink_down"):
                if isinstance(link, bool) or not isinstance(link, int) or not 0 <= link < links:
                    raise r.fail("nvlink_down", f"expected links of this GPU (0..{links - 1}), got {link!r}")
                down.append(link)
        mig_rows: list[ActivityRow | None] = []
        for j, entry in enumerate(r.list_("migs")):
            if j >= migs:
                raise r.fail("migs", f"the GPU has {migs} MIG instance(s)")
            m = r.child(f"migs[{j}]", entry)
            m.check_keys(list(_ACTIVITY_KEYS))
            mig_rows.append(_activity_row(m))
        memory = r.num("memory_used_mib", maximum=MAX_MIB)
        free = r.num("memory_free_mib", maximum=MAX_MIB)
        energy = r.num("energy_j")
        rows.append(
            ReadingRow(
                at_s=at,
                utilization=r.num("utilization", None, maximum=100),
                interval_utilization=r.num("interval_utilization", None, maximum=100),
                memory_used_bytes=None if memory is None else round(memory * 2**20),
                memory_free_bytes=None if free is None else round(free * 2**20),
                temperature_c=r.num("temperature_c", None, maximum=200),
                power_w=r.num("power_w", maximum=MAX_WATTS),
                energy_mj=None if energy is None else round(energy * 1000),
                nvlink_down=None if down is None else tuple(down),
                activity=_activity_row(r),
                migs=tuple(mig_rows),
                health=_health_row(r, links),
            )
        )
    return tuple(rows)


# A row's hardware health readings (HealthRow): whole numbers in the driver's units.
_HEALTH_NUMBERS = (
    "sm_clock_mhz", "memory_clock_mhz", "sm_clock_max_mhz", "memory_clock_max_mhz", "fan_percent",
    "performance_state", "clock_event_reasons", "encoder_utilization", "decoder_utilization",
    "memory_utilization",
)  # fmt: skip
_HEALTH_KEYS = (*_HEALTH_NUMBERS, "violation_ns", "ecc", "retired_pages", "remapped_rows", "pcie", "nvlinks")
_ECC_KEYS = ("corrected", "uncorrected", "corrected_aggregate", "uncorrected_aggregate")
_PCIE_KEYS = ("generation", "width", "generation_max", "width_max", "replays", "tx_kib_s", "rx_kib_s")
_NVLINK_KEYS = ("crc", "replay", "recovery", "tx_kib", "rx_kib")


def _whole(r: _Reader, key: str, names: Sequence[str]) -> dict[str, int]:
    """The whole numbers a mapping under `key` gives, by name (absent names left out)."""
    m = r.child(key, r.data[key])
    m.check_keys(list(names))
    return {name: value for name in names if (value := m.int_(name)) is not None}


def _flags(r: _Reader, key: str, counts: Sequence[str], flags: Sequence[str]) -> tuple[Any, ...]:
    """A mapping of counts and true/false flags, all required, as a tuple in that order."""
    m = r.child(key, r.data[key])
    m.check_keys([*counts, *flags])
    found: list[Any] = []
    for name in counts:
        value = m.int_(name)
        if value is None:
            raise m.fail(name, "required")
        found.append(value)
    for name in flags:
        flag = m.data.get(name)
        if not isinstance(flag, bool):
            raise m.fail(name, f"expected true or false, got {flag!r}")
        found.append(flag)
    return tuple(found)


def _health_row(r: _Reader, links: int) -> HealthRow | None:
    """A row's health readings, None where it gives none."""
    if not any(key in r.data for key in _HEALTH_KEYS):
        return None
    numbers = {key: r.int_(key) for key in _HEALTH_NUMBERS}
    for key in ("fan_percent", "encoder_utilization", "decoder_utilization", "memory_utilization"):
        value = numbers[key]
        if value is not None and value > 100:
            raise r.fail(key, f"must be 0..100, got {value}")
    violations: dict[int, int] = {}
    if r.data.get("violation_ns") is not None:
        violations = {POLICY_NAMES[n]: v for n, v in _whole(r, "violation_ns", list(POLICY_NAMES)).items()}
    ecc = _whole(r, "ecc", _ECC_KEYS) if r.data.get("ecc") is not None else {}
    retired = remapped = None
    if r.data.get("retired_pages") is not None:
        retired = _flags(r, "retired_pages", ("single_bit", "double_bit"), ("pending",))
    if r.data.get("remapped_rows") is not None:
        remapped = _flags(r, "remapped_rows", ("correctable", "uncorrectable"), ("pending", "failure"))
    pcie = _whole(r, "pcie", _PCIE_KEYS) if r.data.get("pcie") is not None else {}
    if ("tx_kib_s" in pcie) != ("rx_kib_s" in pcie):
        raise r.fail("pcie", "tx_kib_s and rx_kib_s go together")
    nvlinks: list[dict[str, int]] = []
    for link, entry in enumerate(r.list_("nvlinks")):
        if link >= links:
            raise r.fail("nvlinks", f"the GPU has {links} NVLink link(s)")
        nvlinks.append(_link_row(r, link, entry))
    return HealthRow(
        **numbers,
        violation_ns=violations,
        ecc=ecc,
        retired_pages=retired,
        remapped_rows=remapped,
        pcie_generation=pcie.get("generation"),
        pcie_width=pcie.get("width"),
        pcie_generation_max=pcie.get("generation_max"),
        pcie_width_max=pcie.get("width_max"),
        pcie_replays=pcie.get("replays"),
        pcie_kib_s=(pcie["tx_kib_s"], pcie["rx_kib_s"]) if "tx_kib_s" in pcie else None,
        nvlinks=tuple(nvlinks),
    )


def _link_row(r: _Reader, link: int, entry: object) -> dict[str, int]:
    """One link's counters in a row's `nvlinks:` list (null: none recorded for that link)."""
    if entry is None:
        return {}
    m = r.child(f"nvlinks[{link}]", entry)
    m.check_keys(list(_NVLINK_KEYS))
    return {name: value for name in _NVLINK_KEYS if (value := m.int_(name)) is not None}


def _parse_mig(
    r: _Reader,
    profiles: list[Any],
    facts: GpuModelFacts,
    memory_total_mib: int,
    hostname: str,
    gpu_index: int,
) -> tuple[MigInstance, ...]:
    if profiles and facts.mig_slices == 0:
        raise r.fail("mig", "this GPU model does not support MIG")
    instances: list[MigInstance] = []
    used_slices = 0
    for j, profile in enumerate(profiles):
        match = MIG_PROFILE.match(str(profile))
        if not match:
            raise r.fail(f"mig[{j}]", f"expected a profile like 3g.40gb, got {profile!r}")
        slices, memory_gb = int(match.group(1)), int(match.group(2))
        used_slices += slices
        if used_slices > facts.mig_slices:
            raise r.fail(f"mig[{j}]", f"profiles use {used_slices} slices, the GPU has {facts.mig_slices}")
        if memory_gb * 1024 > memory_total_mib:
            raise r.fail(f"mig[{j}]", f"{profile} needs more memory than the GPU has")
        instances.append(
            MigInstance(
                profile=str(profile),
                slices=slices,
                memory_total_mib=memory_gb * 1024,
                sm_count=slices * facts.sms_per_slice,
                # GPU instance ids as the driver numbers them: small integers from 1
                gpu_instance_id=j + 1,
                uuid="MIG-" + _uuid(hostname, "mig", gpu_index, j),
            )
        )
    return tuple(instances)


def _parse_gpu_refs(r: _Reader, key: str, gpus: tuple[Gpu, ...], empty_ok: bool = False) -> tuple[GpuRef, ...]:
    items = r.data.get(key)
    if items is None:
        raise r.fail(key, "required: the GPUs it uses, e.g. [0, 1] or ['0:1']")
    if not isinstance(items, list) or not (items or empty_ok):
        raise r.fail(key, f"expected a non-empty list of GPU indexes, got {_kind(items)}")
    refs: list[GpuRef] = []
    for item in items:
        text = str(item)
        match = re.fullmatch(r"(\d+)(?::(\d+))?", text)
        if isinstance(item, bool) or not match:
            raise r.fail(key, f"expected a GPU index or 'gpu:mig', got {item!r}")
        gpu, mig = int(match.group(1)), match.group(2)
        if GpuRef(gpu, None if mig is None else int(mig)) in refs:
            raise r.fail(key, f"GPU {text} is listed twice")
        if gpu >= len(gpus):
            raise r.fail(key, f"GPU {gpu} does not exist (the node has {len(gpus)})")
        if mig is None:
            if gpus[gpu].mig:
                raise r.fail(key, f"GPU {gpu} is MIG-partitioned: name an instance, e.g. '{gpu}:0'")
            refs.append(GpuRef(gpu))
        else:
            if int(mig) >= len(gpus[gpu].mig):
                raise r.fail(key, f"GPU {gpu} has no MIG instance {mig}")
            refs.append(GpuRef(gpu, int(mig)))
    return tuple(refs)


def _parse_pod(r: _Reader, key: str) -> PodRef | None:
    value = r.data.get(key)
    if value is None:
        return None
    p = r.child(key, value)
    p.check_keys(["namespace", "name", "container", "uid"])
    name = p.str_("name")
    namespace = p.str_("namespace", "default") or "default"
    if not name:
        raise p.fail("name", "required: the pod's name")
    uid = p.str_("uid") or _uuid("pod", namespace, name)
    return PodRef(namespace=namespace, name=name, container=p.str_("container", "") or "", uid=uid)


def _activity(r: _Reader, util: float, tensor_default: float) -> tuple[float | None, float]:
    """A segment's (or a process's) `sm_active` and `tensor`, checked against its sm_util."""
    active = r.num("sm_active", None, maximum=100)
    if active is not None and active > util:
        raise r.fail("sm_active", f"{active:g} is above sm_util {util:g}: SMs cannot be busy longer than kernels run")
    tensor = r.num("tensor", tensor_default, maximum=100)
    return active, tensor or 0.0


def _parse_segments(r: _Reader) -> tuple[UtilSegment, ...]:
    value = r.data.get("sm_util", 0)
    tensor_default = r.num("tensor", 0.0, maximum=100) or 0.0
    if isinstance(value, list):
        if "sm_active" in r.data:
            raise r.fail("sm_active", "with sm_util segments, give sm_active in each segment")
        segments: list[UtilSegment] = []
        for k, item in enumerate(value):
            s = r.child(f"sm_util[{k}]", item)
            s.check_keys(["at", "sm_util", "sm_active", "tensor", "memory_mib"])
            at = s.duration("at", 0.0) or 0.0
            util = s.num("sm_util", 0.0, maximum=100) or 0.0
            if segments and at < segments[-1].at_s:
                raise s.fail("at", "segments must be in time order")
            memory_mib = s.num("memory_mib", maximum=MAX_MIB)
            segments.append(UtilSegment(at, util, *_activity(s, util, tensor_default), memory_mib))
        return tuple(segments)
    util = r.num("sm_util", 0.0, maximum=100) or 0.0
    return (UtilSegment(0.0, util, *_activity(r, util, tensor_default)),)


def _parse_per_gpu(
    r: _Reader, process: Process, gpus: tuple[Gpu, ...]
) -> dict[GpuRef, tuple[tuple[UtilSegment, ...], int]]:
    """`per_gpu:`: GPU ("1", "0:1") -> its own `sm_util` (a number or segments), `sm_active`,
    `tensor` and `memory_mib` there; what an entry leaves out is the process's."""
    value = r.data.get("per_gpu")
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise r.fail("per_gpu", f"expected a mapping of its GPUs to their figures, got {_kind(value)}")
    found: dict[GpuRef, tuple[tuple[UtilSegment, ...], int]] = {}
    for key, item in value.items():
        (ref,) = _parse_gpu_refs(_Reader(r.source, r.path, {"per_gpu": [key]}), "per_gpu", gpus)
        if ref not in process.gpus:
            raise r.fail("per_gpu", f"GPU {ref} is not one of its gpus")
        g = r.child(f"per_gpu[{key}]", item)
        g.check_keys(["sm_util", "sm_active", "tensor", "memory_mib"])
        segments = _parse_segments(g) if "sm_util" in g.data else process.segments
        found[ref] = (segments, g.int_("memory_mib", process.memory_mib, maximum=MAX_MIB) or 0)
    return found


CONTEXTS = {
    "compute": frozenset({"compute"}),
    "graphics": frozenset({"graphics"}),
    "compute+graphics": frozenset({"compute", "graphics"}),
    "mps": frozenset({"mps"}),
}


def _parse_contexts(r: _Reader) -> frozenset[str]:
    """`context:` compute (the default), graphics, compute+graphics, or mps (an MPS client)."""
    raw = r.str_("context", "compute") or "compute"
    found = CONTEXTS.get(raw)
    if found is None:
        raise r.fail("context", f"expected one of {', '.join(CONTEXTS)}, got {raw!r}")
    return found


def _parse_processes(top: _Reader, gpus: tuple[Gpu, ...]) -> tuple[Process, ...]:
    processes: list[Process] = []
    seen: dict[int, Process] = {}
    for i, entry in enumerate(top.list_("processes")):
        r = top.child(f"processes[{i}]", entry)
        r.check_keys(
            [
                "pid", "gpus", "start", "end", "sm_util", "sm_active", "tensor", "memory_mib", "uid", "user",
                "cmdline", "environ", "cgroup", "pod", "slurm_job", "container_id", "encoder_util",
                "decoder_util", "parent", "per_gpu", "context",
            ]
        )  # fmt: skip
        pid = r.int_("pid", minimum=1, maximum=MAX_PID)
        if pid is None:
            raise r.fail("pid", "required: the process id")
        start = r.duration("start", 0.0) or 0.0
        end = r.duration("end")
        if end is not None and end <= start:
            raise r.fail("end", "must be after start")
        previous = seen.get(pid)
        if previous is not None and (previous.end_s is None or previous.end_s > start):
            raise r.fail(
                "pid",
                f"pid {pid} is already running then (a reused pid must start after the old one ends)",
            )
        parent = r.int_("parent", minimum=1, maximum=MAX_PID)
        if parent == pid:
            raise r.fail("parent", "a process cannot be its own parent")
        environ_raw = r.data.get("environ") or {}
        if not isinstance(environ_raw, Mapping):
            raise r.fail("environ", f"expected a mapping of names to values, got {_kind(environ_raw)}")
        process = Process(
            pid=pid,
            # `gpus: []`: a process on no GPU, e.g. the API server whose workers hold them.
            gpus=_parse_gpu_refs(r, "gpus", gpus, empty_ok=True),
            start_s=start,
            end_s=end,
            segments=_parse_segments(r),
            memory_mib=r.int_("memory_mib", 0, maximum=MAX_MIB) or 0,
            uid=r.int_("uid", 0) or 0,
            user=r.str_("user"),
            cmdline=_cmdline(r),
            environ={str(k): str(v) for k, v in environ_raw.items()},
            cgroup=r.str_("cgroup"),
            pod=_parse_pod(r, "pod"),
            slurm_job=r.str_("slurm_job"),
            container_id=r.str_("container_id"),
            encoder_util=r.num("encoder_util", 0.0, maximum=100) or 0.0,
            decoder_util=r.num("decoder_util", 0.0, maximum=100) or 0.0,
            parent=parent,
            contexts=_parse_contexts(r),
        )
        process = replace(process, per_gpu=_parse_per_gpu(r, process, gpus))
        seen[pid] = process
        processes.append(process)
    return tuple(processes)


def _parse_allocations(top: _Reader, gpus: tuple[Gpu, ...]) -> tuple[Allocation, ...]:
    allocations: list[Allocation] = []
    for i, entry in enumerate(top.list_("allocations")):
        r = top.child(f"allocations[{i}]", entry)
        r.check_keys(["gpus", "pod", "slurm_job", "user", "account", "start", "end"])
        start = r.duration("start", 0.0) or 0.0
        end = r.duration("end")
        if end is not None and end <= start:
            raise r.fail("end", "must be after start")
        pod = _parse_pod(r, "pod")
        slurm_job = r.str_("slurm_job")
        if pod is None and slurm_job is None:
            raise r.fail("pod", "an allocation needs a pod: or a slurm_job:")
        account = r.str_("account")
        if account is not None and (slurm_job is None or r.str_("user") is None):
            raise r.fail("account", "a Slurm job's account: needs slurm_job: and user:")
        allocations.append(
            Allocation(
                gpus=_parse_gpu_refs(r, "gpus", gpus),
                start_s=start,
                end_s=end,
                pod=pod,
                slurm_job=slurm_job,
                user=r.str_("user"),
                account=account,
            )
        )
    return tuple(allocations)


def _parse_faults(top: _Reader, gpus: tuple[Gpu, ...]) -> tuple[Fault, ...]:
    faults: list[Fault] = []
    for i, entry in enumerate(top.list_("faults")):
        r = top.child(f"faults[{i}]", entry)
        r.check_keys(
            [
                "at", "until", "gpu", "call", "error", "nvlink_down", "xid", "event", "latency_ms", "ecc", "remap",
                "throttle", "pcie_downgrade", "nvlink_errors",
            ]
        )  # fmt: skip
        at = r.duration("at", 0.0) or 0.0
        until = r.duration("until")
        if until is not None and until <= at:
            raise r.fail("until", "must be after at")
        gpu = r.int_("gpu")
        if gpu is not None and gpu >= len(gpus):
            raise r.fail("gpu", f"GPU {gpu} does not exist (the node has {len(gpus)})")
        error = r.str_("error")
        if error is not None and error not in ERROR_CODES:
            raise r.fail("error", f"unknown NVML error {error!r} (use names like GPU_IS_LOST, NOT_SUPPORTED)")
        call = r.str_("call")
        if call is not None and call != "*" and not call.startswith("nvml"):
            raise r.fail(
                "call",
                f"expected an NVML function name like nvmlDeviceGetTemperature or '*', got {call!r}",
            )
        links_raw = r.list_("nvlink_down")
        links: list[int] = []
        for link in links_raw:
            if isinstance(link, bool) or not isinstance(link, int) or link < 0:
                raise r.fail("nvlink_down", f"expected link numbers, got {link!r}")
            if gpu is None:
                raise r.fail("gpu", "nvlink_down needs the GPU it happens on")
            if link >= gpus[gpu].nvlink_links:
                raise r.fail("nvlink_down", f"GPU {gpu} has no NVLink link {link}")
            links.append(link)
        xid = r.int_("xid")
        if xid is not None and gpu is None:
            raise r.fail("gpu", "xid needs the GPU it happens on")
        event = r.str_("event")
        if event is not None and event not in DRIVER_EVENTS:
            raise r.fail("event", f"unknown driver event {event!r} (use one of: {', '.join(DRIVER_EVENTS)})")
        if event is not None and gpu is None:
            raise r.fail("gpu", "event needs the GPU it happens on")
        latency_ms = r.num("latency_ms", 0.0, maximum=MAX_LATENCY_MS) or 0.0
        health = _parse_health_fault(r, gpus, gpu)
        if event in ECC_EVENTS:
            # One model of a memory error (fake_nvml/health.py): an ECC event is an `ecc:` fault
            # of one error, which both moves the counters and sends the event.
            if health.get("ecc") is not None:
                raise r.fail("event", f"{event} is an ecc fault of one error: give ecc or event, not both")
            health["ecc"] = EccErrors(**{ECC_EVENTS[event]: 1})
            event = None
        if (
            error is None
            and not links
            and xid is None
            and event is None
            and latency_ms == 0
            and not any(health.values())
        ):
            raise r.fail(
                "error",
                "a fault needs one of error, nvlink_down, xid, event, latency_ms, ecc, remap, throttle, "
                "pcie_downgrade or nvlink_errors",
            )
        faults.append(Fault(at, until, gpu, call, error, tuple(links), xid, latency_ms, event, **health))
    return tuple(faults)


def _counts(r: _Reader, key: str, names: Sequence[str]) -> dict[str, int]:
    """A mapping of event counts under `key`, e.g. ecc: {corrected: 120, uncorrected: 1}."""
    c = r.child(key, r.data[key])
    c.check_keys(list(names))
    return {name: c.int_(name, 0, maximum=MAX_EVENTS) or 0 for name in names}


def _parse_health_fault(r: _Reader, gpus: tuple[Gpu, ...], gpu: int | None) -> dict[str, Any]:
    """The hardware-health kinds of one fault (ecc, remap, throttle, pcie_downgrade,
    nvlink_errors), as Fault's keyword arguments; each needs the GPU it happens on."""
    found: dict[str, Any] = {}
    kinds = ("ecc", "remap", "throttle", "pcie_downgrade", "nvlink_errors")
    named = [kind for kind in kinds if r.data.get(kind) is not None]
    if named and gpu is None:
        raise r.fail("gpu", f"{named[0]} needs the GPU it happens on")
    if gpu is None:
        return found
    board = BOARD_FACTS.get(gpus[gpu].model, DEFAULT_BOARD)
    if r.data.get("ecc") is not None:
        found["ecc"] = EccErrors(**_counts(r, "ecc", ("corrected", "uncorrected")))
    if r.data.get("remap") is not None:
        if not board.remaps_rows:
            raise r.fail("remap", f"a {gpus[gpu].model} retires pages instead (row remapping came with Ampere)")
        m = r.child("remap", r.data["remap"])
        m.check_keys(["correctable", "uncorrectable", "pending", "failure"])
        uncorrectable = m.int_("uncorrectable", 0, maximum=MAX_EVENTS) or 0
        flags = {}
        for flag, default in (("pending", uncorrectable > 0), ("failure", False)):
            value = m.data.get(flag, default)
            if not isinstance(value, bool):
                raise m.fail(flag, f"expected true or false, got {value!r}")
            flags[flag] = value
        found["remap"] = RowRemap(m.int_("correctable", 0, maximum=MAX_EVENTS) or 0, uncorrectable, **flags)
    throttle = r.str_("throttle")
    if throttle is not None:
        if throttle not in THROTTLE_KINDS:
            raise r.fail("throttle", f"unknown cause {throttle!r} (use one of: {', '.join(THROTTLE_KINDS)})")
        found["throttle"] = throttle
    if r.data.get("pcie_downgrade") is not None:
        p = r.child("pcie_downgrade", r.data["pcie_downgrade"])
        p.check_keys(["generation", "width", "replays"])
        generation = p.int_("generation", minimum=1)
        width = p.int_("width", minimum=1)
        if generation is not None and generation > board.pcie_generation:
            raise p.fail("generation", f"the {gpus[gpu].model}'s link is Gen{board.pcie_generation} at most")
        if width is not None and width > board.pcie_width:
            raise p.fail("width", f"the {gpus[gpu].model}'s link is x{board.pcie_width} at most")
        found["pcie_downgrade"] = PcieDowngrade(generation, width, p.int_("replays", 0) or 0)
    if r.data.get("nvlink_errors") is not None:
        n = r.child("nvlink_errors", r.data["nvlink_errors"])
        n.check_keys(["links", "crc", "replay", "recovery"])
        if gpus[gpu].nvlink_links == 0:
            raise r.fail("nvlink_errors", f"GPU {gpu} has no NVLink links")
        links: tuple[int, ...] | None = None
        if n.data.get("links") is not None:
            links = tuple(n.list_("links"))
            for link in links:
                if isinstance(link, bool) or not isinstance(link, int) or not 0 <= link < gpus[gpu].nvlink_links:
                    raise n.fail("links", f"GPU {gpu} has no NVLink link {link!r}")
        counts = {name: n.int_(name, 0, maximum=MAX_EVENTS) or 0 for name in ("crc", "replay", "recovery")}
        found["nvlink_errors"] = NvLinkErrors(links, **counts)
    return found


def _parse_start(top: _Reader) -> datetime:
    value = top.data.get("start")
    if value is None:
        return datetime(2026, 11, 20, 18, 0, tzinfo=UTC)
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    try:
        parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        raise top.fail("start", f"expected an ISO time like 2026-11-20T18:00:00Z, got {value!r}") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def parse_scenario(data: object, source: str = "scenario") -> Scenario:
    """Validate a scenario mapping (as loaded from YAML) into a `Scenario`."""
    top = _Reader(source, "", data)
    undecodable = undecodable_locs(data, [])
    if undecodable:
        # A lone surrogate ("\\ud800") went on to the fake's files and the GPUs' UUIDs: a traceback.
        where = "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in undecodable[0]).lstrip(".")
        raise ScenarioError(f"{source}: {where}: not UTF-8 text")
    top.check_keys(["name", "start", "node", "gpus", "processes", "allocations", "faults"])
    node_r = top.child("node", top.data.get("node") or {})
    node_r.check_keys(
        ["hostname", "driver_version", "cuda_driver_version", "instance_type", "missing_functions", "device_plugin"]
    )
    hostname = node_r.str_("hostname", "gpu-node-01") or "gpu-node-01"
    driver_version = node_r.str_("driver_version", "550.54.15") or "550.54.15"
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", driver_version):
        raise node_r.fail("driver_version", f"expected a version like 550.54.15, got {driver_version!r}")
    missing = node_r.list_("missing_functions")
    device_plugin = node_r.str_("device_plugin", "nvidia") or "nvidia"
    if device_plugin not in DEVICE_PLUGINS:
        raise node_r.fail("device_plugin", f"expected one of {', '.join(DEVICE_PLUGINS)}, got {device_plugin!r}")
    node = NodeFacts(
        hostname=hostname,
        driver_version=driver_version,
        cuda_driver_version=node_r.int_("cuda_driver_version", 12040) or 12040,
        instance_type=node_r.str_("instance_type"),
        missing_functions=frozenset(str(m) for m in missing),
        device_plugin=device_plugin,
    )
    gpus = _parse_gpus(top, hostname)
    return Scenario(
        name=top.str_("name", source) or source,
        start=_parse_start(top),
        node=node,
        gpus=gpus,
        processes=_parse_processes(top, gpus),
        allocations=_parse_allocations(top, gpus),
        faults=_parse_faults(top, gpus),
        raw=top.data,
    )
