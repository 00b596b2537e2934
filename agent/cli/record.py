"""`gpuledger record`: poll the driver for a while and write what it saw as a scenario.

    gpuledger record --for 10m [--step 5s] [--out trace.yaml] [--keep-cmdlines] [--fake [SCENARIO]]

The trace is a scenario that `--fake trace.yaml` (run, snapshot, simulate) replays: a user can
send the trace of a node that misbehaves, and the replayed node gives the metrics it gave.
What goes in, and how it comes back:

- each GPU as discovery saw it (model, uuid, PCI bus, memory, power limit, SMs, NVLinks, MIG
  layout) and its readings as a time series (`readings:`, one row per poll: utilization (and the
  mean of the device's own samples over the interval that starts at the row), memory,
  temperature, power, the energy counter, NVLinks down, GPM activity over the span the row lies
  in (the interval that starts at it; on the slow rhythm, the whole slow span's mean on each of
  its rows), and every health reading the poll took, in the driver's units), which the fake
  serves in place of its physics;
- each GPU process with its GPUs, its lifetime, its memory over time and its per-process
  utilization on each of its GPUs (those of a GPU that differ from its first's under `per_gpu`)
  as segments that reproduce the driver's samples (those a full ring lost at the
  mean of those it kept; those the first poll read, from before the trace, at their mean from
  its start), its uid and user name, its
  cgroup, and its pod or Slurm job where the scheduler allocated it the GPU; its command line
  is anonymised (the executable's name, and `--model` with the model the agent recognised)
  unless `--keep-cmdlines` (whole, but scrubbed of credentials); no environment variable is
  ever read into a trace;
- scheduler allocations without a process (`allocations:`), each driver call that failed (as a
  fault over the poll it failed in, so the replayed agent meets the same errors; a reading or
  call the GPU refused as NOT_SUPPORTED and never answered, as one over the whole trace: the
  device lacks it, for every reader of the replay), and every Xid and driver event at the poll
  that received it.

Ctrl-C (or SIGTERM) ends a recording early; the trace holds every poll taken, each whole.
Poll times are written on the --step grid (the k-th poll at k x step), so `simulate trace.yaml
--step STEP` polls when the recording did. Known limits: owners named only by a process's own
environment (self-reported Slurm jobs) replay without that job; a MIG instance's memory is its
processes' sum; a real driver's per-process sample times are replayed at whole seconds.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from agent.attribution.cgroup import parse_cgroup
from agent.attribution.sources.procfs import Passwd, ProcFS
from agent.cli.args import EXIT_OK, duration_arg
from agent.cli.wiring import Agent, build_agent
from agent.config import Settings, load_config
from agent.devices.backend import DeviceBackend
from agent.devices.events import ALL_EVENTS
from agent.devices.instance import detect_instance_type
from agent.devices.sampler import MIN_RING_SAMPLES
from agent.devices.tap import Failure, TappedBackend
from agent.devices.tap import tap as tap_backend
from agent.errors import BadInputError, GpuledgerError
from agent.ledger.export import replacing
from agent.model import (
    Activity,
    AgentState,
    DeviceReading,
    Holding,
    ProcessIdentity,
    Snapshot,
    Telemetry,
    Workload,
)
from agent.scrub import scrub
from agent.units import format_duration

log = logging.getLogger("gpuledger")

MIB = 2**20
# The Xids a driver logs with an uncorrectable ECC error (NVIDIA's Xid catalogue).
UNCORRECTABLE_ECC_XIDS = frozenset({48, 94, 95})
# How often the replayed driver takes a per-process sample (fake_nvml's PROCESS_SAMPLE_PERIOD_S).
REPLAY_SAMPLE_PERIOD_S = 1.0
# The most scenario time `record --fake` covers, and the most real time a recording may last.
MAX_RECORD_S = 7 * 86400.0


@dataclass
class _Process:
    pid: int
    first_s: float
    refs: list[str] = field(default_factory=list)  # "0", or "0:1" for MIG instance 1 of GPU 0
    gpu_uuid: str = ""  # the first GPU it was seen on, whose samples it takes
    uuids: dict[str, str] = field(default_factory=dict)  # each of its refs -> its GPU's uuid
    last_s: float = 0.0  # the last poll that listed it
    started_s: float | None = None  # when it started (procfs), scenario time; None: not known
    gone_s: float | None = None
    # Each of its refs -> the memory it holds there: (t, MiB), at each change.
    memories: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    uid: int | None = None
    user: str | None = None
    argv: tuple[str, ...] = ()
    cgroup: str = ""
    holding: Holding | None = None
    # Samples a full ring lost (GPU uuid -> scenario time -> percent): the mean of those it kept,
    # as the agent took them to be, so that a replay's device samples sum what the recording's did.
    lost: dict[str, dict[float, int]] = field(default_factory=dict)


@dataclass
class _Window:
    """A span of polls at which something held (an allocation) or failed (a fault)."""

    start_s: float
    last_s: float
    end_s: float | None = None


class TraceRecorder:
    """Turns each poll's state (and what the tapped backend kept) into a scenario mapping."""

    def __init__(
        self,
        tap: TappedBackend,
        step_s: float,
        *,
        proc_root: str | Path,
        passwd_file: str | Path,
        keep_cmdlines: bool = False,
        instance_type: str | None = None,
    ) -> None:
        self._tap = tap
        self.step_s = step_s
        self._procfs = ProcFS(proc_root)
        self._passwd = Passwd(passwd_file)
        self._keep_cmdlines = keep_cmdlines
        self._instance_type = instance_type
        self.polls = 0
        self._start: float | None = None
        self._node: dict[str, Any] = {}
        self._gpus: dict[int, dict[str, Any]] = {}  # index -> its scenario entry
        self._rows: dict[int, list[dict[str, Any]]] = {}
        self._taken: dict[int, list[float]] = {}  # index -> when each of its rows' polls was taken
        self._unmeasured: dict[int, int] = {}  # index -> its first row the interval utilization has not covered
        self._index_of: dict[str, int] = {}  # GPU or MIG uuid -> GPU index
        self._refs: dict[str, str] = {}  # GPU or MIG uuid -> "0" or "0:1", as scenarios name them
        # Lost GPUs and a driver gone: the fault key of each outage still open (no poll has seen
        # the GPU, or the driver, answer since its last failure).
        self._open_outages: dict[int | None, tuple[int | None, str | None, str]] = {}
        self._processes: dict[tuple[int, int | None], _Process] = {}
        self._allocations: dict[tuple[Workload, str], list[_Window]] = {}
        self._faults: dict[tuple[int | None, str | None, str], list[_Window]] = {}
        # What each refusal (NOT_SUPPORTED) was asked for: the tap's readings and methods.
        self._refused: dict[tuple[int | None, str | None, str], set[object]] = {}
        self._events: list[dict[str, Any]] = []
        self._failures_seen = 0
        self._events_seen_until = float("-inf")
        self._samples_seen: dict[str, int] = {}  # GPU uuid -> how many of the tap's samples were looked at
        self._first_read: dict[str, int] = {}  # GPU uuid -> how many of the tap's samples the first poll read
        self._ring: dict[str, int] = {}  # GPU uuid -> the most samples one process had in one poll
        self._period_us: dict[str, int] = {}  # GPU uuid -> the smallest gap between two samples of a process
        self._previous_taken: float | None = None

    # -- each poll ----------------------------------------------------------------------------

    def observe(self, state: AgentState, events: Iterable[tuple[float, int, str, int]] = ()) -> None:
        """Take one poll: its snapshot and attribution, the tap's new failures, and the driver
        events received since the last poll ((received at, GPU index, kind, Xid or 0))."""
        snapshot = state.snapshot
        if snapshot is None:
            return
        if self._start is None:
            self._start = snapshot.taken_at
            self._node = {"hostname": snapshot.node.hostname, "driver_version": snapshot.node.driver_version}
            if snapshot.node.cuda_driver_version is not None:
                self._node["cuda_driver_version"] = snapshot.node.cuda_driver_version
            if self._instance_type:
                self._node["instance_type"] = self._instance_type
        k = self.polls
        t = k * self.step_s  # on the --step grid: replayed polls fall where these did
        self.polls += 1
        for device in snapshot.devices:
            self._index_of[device.uuid] = device.index
            self._refs[device.uuid] = device.label
        self._failures(t)
        for gpu in snapshot.gpus:
            self._gpu(snapshot, gpu, t)
        self._down(snapshot, t)
        self._processes_of(snapshot, state, t)
        self._fill_lost_samples()
        if not k:
            self._first_read = dict(self._samples_seen)
        self._previous_taken = snapshot.taken_at
        self._allocations_of(state, t)
        new = [(index, kind, value) for received, index, kind, value in events if received > self._events_seen_until]
        # A double-bit error's own Xid (48; from Ampere on 94 contained, 95 not) is written on its
        # ECC event's fault: the fake sends an uncorrectable error's Xid with it, so written apart
        # it would be sent twice.
        unpaired = [(index, kind) for index, kind, _ in new if kind == "double_bit_ecc"]
        paired: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for index, kind, value in new:
            fault: dict[str, Any] = {"at": t, "gpu": index}
            if kind == "xid" and value in UNCORRECTABLE_ECC_XIDS and (index, "double_bit_ecc") in unpaired:
                unpaired.remove((index, "double_bit_ecc"))
                paired.setdefault((index, "xid"), []).append({"xid": value})
                continue
            fault.update({"xid": value} if kind == "xid" else {"event": kind})
            self._events.append(fault)
            if kind == "double_bit_ecc":
                paired.setdefault((index, kind), []).append(fault)
        for (index, kind), xids in paired.items():
            if kind == "xid":
                for dbe, xid in zip(paired[(index, "double_bit_ecc")], xids, strict=False):
                    dbe.update(xid)
        self._events_seen_until = snapshot.taken_at

    def _gpu(self, snapshot: Snapshot, gpu: DeviceReading, t: float) -> None:
        migs = snapshot.mig_devices(gpu.uuid)
        if gpu.up and gpu.index not in self._gpus:
            entry: dict[str, Any] = {"model": gpu.model, "uuid": gpu.uuid}
            if gpu.pci_bus_id:
                entry["pci_bus_id"] = gpu.pci_bus_id
            if gpu.minor_number is not None:
                entry["minor"] = gpu.minor_number
            if gpu.memory_total_bytes is not None:
                entry["memory_total_mib"] = max(1, round(gpu.memory_total_bytes / MIB))
            if gpu.power_limit_w is not None:
                entry["power_limit_w"] = gpu.power_limit_w
            if gpu.sm_count is not None:
                entry["sm_count"] = gpu.sm_count
            entry["nvlink_links"] = len(gpu.nvlinks)
            if gpu.index in self._tap.gpm:
                entry["gpm"] = self._tap.gpm[gpu.index]
            events = self._tap.events.get(gpu.index)
            if events is not None and events != ALL_EVENTS:  # every kind: the fake's default
                entry["events"] = sorted(kind.value for kind in events)
            if migs:
                entry["mig"] = [m.mig_profile for m in sorted(migs, key=lambda m: m.mig_index or 0)]
            self._gpus[gpu.index] = entry
        if not gpu.up:
            return
        readings = {
            "utilization": None if gpu.utilization is None else round(gpu.utilization * 100, 6),
            # A MIG GPU's memory is its instances' sum, which the replayed processes give.
            "memory_used_mib": None if gpu.memory_used_bytes is None or migs else gpu.memory_used_bytes / MIB,
            "memory_free_mib": _free_mib(gpu) if not migs else None,
            "temperature_c": gpu.temperature_c,
            "power_w": gpu.power_w,
            "energy_j": gpu.energy_j,
        }
        row: dict[str, Any] = {"at": t} | {key: value for key, value in readings.items() if value is not None}
        if gpu.nvlinks:
            row["nvlink_down"] = [link.link for link in gpu.nvlinks if not link.up]
        row.update(_health(gpu.telemetry))
        # Activity read at this poll covers the span since the poll of its earlier sample (the
        # previous poll; on the slow rhythm, the last slow span's first): it belongs to the rows
        # of the polls in that span, which hold over it, so that a replay samples the same means.
        # A poll that carries a figure read earlier adds nothing.
        for earlier in self._span_rows(gpu.index, gpu.activity, snapshot.taken_at):
            earlier.update(_activity(gpu.activity))
        # The interval's utilization (the device's own samples since the last poll that read
        # some) is what NVML-measured busy time and the flags follow: the replay's samples must
        # give it, not the fake's sum of the per-process samples, which a real driver's differ
        # from (or lacks: per-process utilization refused, as under some vGPU drivers). It covers
        # the rows since the last poll it was read at, each holding it over its own interval.
        rows = self._rows.get(gpu.index, [])
        if gpu.interval_utilization is not None:
            for earlier in rows[self._unmeasured.get(gpu.index, 0) :]:
                earlier["interval_utilization"] = round(gpu.interval_utilization * 100, 6)
            self._unmeasured[gpu.index] = len(rows)
        by_slot = sorted(migs, key=lambda m: m.mig_index or 0)
        for slot, mig in enumerate(by_slot):
            for earlier in self._span_rows(gpu.index, mig.activity, snapshot.taken_at):
                earlier.setdefault("migs", [{} for _ in by_slot])[slot] = _activity(mig.activity)
        self._rows.setdefault(gpu.index, []).append(row)
        self._taken.setdefault(gpu.index, []).append(snapshot.taken_at)

    def _span_rows(self, index: int, activity: Activity | None, now: float) -> list[dict[str, Any]]:
        """GPU `index`'s rows of the polls in the span `activity` covers, where it was read at
        this poll (`now`); none where it was carried, or has no span."""
        if activity is None or activity.since is None or activity.until != now:
            return []
        rows, taken = self._rows.get(index, []), self._taken.get(index, [])
        found = []
        i = len(taken) - 1
        while i >= 0 and taken[i] >= activity.since:  # spans are a few polls long: from the end
            found.append(rows[i])
            i -= 1
        return found

    def _processes_of(self, snapshot: Snapshot, state: AgentState, t: float) -> None:
        holding_of: dict[tuple[str, int], Holding] = {}
        for holding in state.attribution.holdings:
            for pid in holding.pids:
                holding_of.setdefault((holding.device_uuid, pid), holding)
        seen: set[tuple[int, int | None]] = set()
        listed: set[str] = set()  # devices whose process list was read: the others say nothing
        for device in snapshot.devices:
            if not device.up or not device.processes_known:
                continue
            listed.add(device.parent_uuid or device.uuid)
            ref = device.label
            for process in device.processes:
                key = self._identity(process.pid)
                seen.add(key)
                track = self._processes.get(key)
                if track is None:
                    track = self._processes[key] = self._new_process(process.pid, key[1], t)
                track.gone_s = None
                track.last_s = t
                if ref not in track.refs:
                    track.refs.append(ref)
                    track.uuids[ref] = device.parent_uuid or device.uuid
                if not track.gpu_uuid:
                    track.gpu_uuid = device.parent_uuid or device.uuid
                if process.used_memory_bytes is not None:
                    # Each GPU's own: a process spread over several holds a different share on each.
                    mib = process.used_memory_bytes / MIB
                    memory = track.memories.setdefault(ref, [])
                    if not memory or memory[-1][1] != mib:
                        memory.append((t, mib))
                held = holding_of.get((device.uuid, process.pid))
                if held is not None and track.holding is None:
                    track.holding = held
        for key, track in self._processes.items():
            if key not in seen and track.gone_s is None and track.gpu_uuid in listed:
                # It ended after the last poll that listed it: when, the polls between (the GPU
                # unreadable) cannot tell, and the replay ends it at the earliest.
                track.gone_s = track.last_s + self.step_s

    def _fill_lost_samples(self) -> None:
        """Where a process's samples read at this poll fill the driver's ring and reach back less
        far than the previous poll (or its start), older ones were lost: the periods between
        are written at the mean of those kept. The agent took them to be that (its figure is the
        kept samples' mean), and left at 0 the replayed GPU's own samples, which sum the
        processes', would read lower than the recorded GPU's did."""
        previous, start = self._previous_taken, self._start or 0.0
        current = {track.pid: track for track in self._processes.values() if track.gone_s is None}
        for uuid, samples in self._tap.samples.items():
            batch = samples[self._samples_seen.get(uuid, 0) :]
            self._samples_seen[uuid] = len(samples)
            by_pid: dict[int, list[tuple[int, int]]] = {}
            for pid, stamp_us, util in batch:
                by_pid.setdefault(pid, []).append((stamp_us, util))
            ring = self._ring[uuid] = max([self._ring.get(uuid, 0), *map(len, by_pid.values())])
            # One process's samples only: the driver stamps each process at its own time (see
            # the sampler), so two processes' stamps are no period apart.
            gaps = [b - a for kept in by_pid.values() for (a, _), (b, _) in itertools.pairwise(sorted(kept)) if b > a]
            if gaps:
                self._period_us[uuid] = min(*gaps, self._period_us.get(uuid, gaps[0]))
            if previous is None or ring < MIN_RING_SAMPLES or not gaps:
                continue
            period_us = min(gaps)
            for pid, kept in by_pid.items():
                track = current.get(pid)
                if track is None or uuid not in track.uuids.values() or len(kept) < ring:
                    continue
                # After the previous poll's samples (read then), from the process's start (a
                # sample may fall on it: within half a period of it counts).
                born_s = start + (track.started_s or 0.0) - period_us / 2_000_000
                mean = round(sum(util for _stamp, util in kept) / len(kept))
                stamp_us = min(stamp for stamp, _util in kept) - period_us
                while stamp_us / 1_000_000 > previous and stamp_us / 1_000_000 >= born_s:
                    track.lost.setdefault(uuid, {})[round(stamp_us / 1_000_000 - start, 6)] = mean
                    stamp_us -= period_us

    def _identity(self, pid: int) -> tuple[int, int | None]:
        try:
            return (pid, self._procfs.identity(pid).start_ticks)
        except GpuledgerError:
            return (pid, None)

    def _new_process(self, pid: int, start_ticks: int | None, t: float) -> _Process:
        track = _Process(pid, t)
        if start_ticks is not None:
            try:
                facts = self._procfs.facts(ProcessIdentity(pid, start_ticks))
            except GpuledgerError:
                return track
            track.uid, track.argv, track.cgroup = facts.uid, facts.cmdline, facts.cgroup
            started = self._procfs.started_at(ProcessIdentity(pid, start_ticks))
            if started is not None and self._start is not None:
                track.started_s = started - self._start
            track.user = self._passwd.name(facts.uid) if facts.uid is not None else None
        return track

    def _allocations_of(self, state: AgentState, t: float) -> None:
        for holding in state.attribution.holdings:
            if holding.allocated and not holding.pids:
                self._extend(self._allocations, (holding.workload, holding.device_uuid), t)

    def _extend(self, windows: dict[Any, list[_Window]], key: Any, t: float) -> None:
        spans = windows.setdefault(key, [])
        if spans and spans[-1].last_s == t - self.step_s and spans[-1].end_s is None:
            spans[-1].last_s = t
        else:
            spans.append(_Window(t, t))

    def _failures(self, t: float) -> None:
        """Calls that failed in this poll: each a fault over this poll alone, but for a GPU lost
        and the driver gone. Those are one fault from the first failure to the last before the
        GPU (or driver) answered again, every call failing: the replayed sampler, retrying with
        backoff, and the event reader, re-registering on its own schedule, must fail whenever
        they asked and fail no longer once the recorded ones succeeded."""
        new: list[Failure] = self._tap.failures[self._failures_seen :]
        self._failures_seen = len(self._tap.failures)
        for failure in new:
            gpu = self._index_of.get(failure.uuid) if failure.uuid else failure.index
            if failure.driver or (failure.lost and gpu is not None):
                scope = None if failure.driver else gpu
                key: tuple[int | None, str | None, str] = (scope, None, failure.error)
                spans = self._faults.get(key)
                if self._open_outages.get(scope) == key and spans:
                    spans[-1].last_s = t
                else:
                    self._faults.setdefault(key, []).append(_Window(t, t))
                    self._open_outages[scope] = key
            elif not failure.lost:
                key = (gpu, failure.call, failure.error)
                if failure.error == "NOT_SUPPORTED":
                    self._refused.setdefault(key, set()).update(failure.asked)
                spans = self._faults.get(key)
                if not spans or spans[-1].last_s != t:
                    self._extend(self._faults, key, t)

    def _down(self, snapshot: Snapshot, t: float) -> None:
        """Close the outages of whatever this poll found answering."""
        if snapshot.driver_up:
            self._open_outages.pop(None, None)
        for gpu in snapshot.gpus:
            if gpu.up:
                self._open_outages.pop(gpu.index, None)

    # -- the trace ----------------------------------------------------------------------------

    def scenario(self) -> dict[str, Any]:
        """The recording as a scenario mapping (YAML-ready)."""
        if self._start is None:
            raise GpuledgerError("nothing was recorded: no poll read the GPUs")
        end_s = (self.polls - 1) * self.step_s  # the last poll
        gpus = []
        # Every GPU a poll listed, those never identified too (down all along: lost, say).
        for index in range(max([*self._gpus, *self._index_of.values()], default=-1) + 1):
            entry = dict(self._gpus.get(index, {"model": "unknown"}))
            if self._rows.get(index):
                entry["readings"] = self._rows[index]
            gpus.append(entry)
        scenario: dict[str, Any] = {
            "start": datetime.fromtimestamp(self._start, UTC).isoformat().replace("+00:00", "Z"),
            "node": self._node,
            "gpus": gpus,
            "processes": [self._process_entry(p, end_s) for p in self._ordered_processes()],
        }
        allocations = [a for a in self._allocation_entries(end_s) if a]
        if allocations:
            scenario["allocations"] = allocations
        faults = self._fault_entries() + self._events
        if faults:
            scenario["faults"] = faults
        return scenario

    def _ordered_processes(self) -> list[_Process]:
        return sorted(self._processes.values(), key=lambda p: (p.first_s, p.pid))

    def _process_entry(self, track: _Process, end_s: float) -> dict[str, Any]:
        stamps = {ref: self._samples(track, track.uuids.get(ref, track.gpu_uuid)) for ref in track.refs}
        # When it started, where procfs said (a process that started between two polls is held
        # from then, not from the poll that first saw it); never after its first sample (on any
        # of its GPUs) or the poll that first listed it, nor before the trace.
        known = () if track.started_s is None else (track.started_s,)
        start_s = max(0.0, min([track.first_s, *(at for found in stamps.values() for at in found), *known]))
        entry: dict[str, Any] = {"pid": track.pid, "gpus": list(track.refs), "start": start_s}
        if track.gone_s is not None and track.gone_s <= end_s:
            entry["end"] = track.gone_s
        # Its figures on each GPU, those of the first as the process's: the memory it holds there
        # (whole MiB in a scenario; its segments carry the exact ones) and segments that give the
        # driver's samples there. A process spread over several GPUs holds and does a different
        # share on each (a model split unevenly): a GPU whose figures differ from the first's has
        # its own under `per_gpu`, or the replay books the first GPU's on every one.
        figures = {}
        for ref in track.refs or [""]:
            memory = track.memories.get(ref, [])
            uuid = track.uuids.get(ref, track.gpu_uuid)
            segments = _segments(
                stamps.get(ref, {}), memory, start_s, track.gone_s or end_s, self._sample_period(track, uuid)
            )
            figures[ref] = {"memory_mib": round(memory[0][1]) if memory else 0, "sm_util": segments}
        first = figures.pop(track.refs[0] if track.refs else "")
        entry.update(first)
        per_gpu = {ref: found for ref, found in figures.items() if found != first}
        if per_gpu:
            entry["per_gpu"] = per_gpu
        if track.uid is not None:
            entry["uid"] = track.uid
        if track.user:
            entry["user"] = track.user
        entry["cmdline"] = self._cmdline(track)
        if track.cgroup.strip():
            entry["cgroup"] = track.cgroup.strip()
        holding = track.holding
        if holding is not None and holding.allocated and not holding.self_reported:
            w = holding.workload
            if w.pod:
                owner = parse_cgroup(track.cgroup) if track.cgroup else None
                pod: dict[str, str] = {"namespace": w.namespace, "name": w.pod, "container": w.container}
                if owner is not None and owner.pod_uid:
                    pod["uid"] = owner.pod_uid
                entry["pod"] = pod
            elif w.hpc_job:
                entry["slurm_job"] = self._map_job(w.hpc_job)
        return entry

    def _map_job(self, job: str) -> str:
        """What a prolog wrote in the map file of the job labelled `job`: an array task's own job
        id (its processes' cgroup's) before its `1234_7`, so that the replay ties the two."""
        for track in self._processes.values():
            held = track.holding
            if held is None or held.workload.hpc_job != job or not track.cgroup:
                continue
            owner = parse_cgroup(track.cgroup)
            if owner is not None and owner.slurm_job and owner.slurm_job != job:
                return f"{owner.slurm_job}={job}"
        return job

    def _samples(self, track: _Process, uuid: str) -> dict[float, int]:
        """The driver's samples of the process on GPU `uuid`: scenario time -> percent. A
        reused pid's samples are its own: none from before it started (procfs's start time)."""
        start = self._start or 0.0
        born_s = max(0.0, track.started_s or 0.0)
        # A process's sample is stamped at its own point of a period, before the period's end: one
        # within half a period before its start (or the trace's) is of the period it started in.
        early_s = born_s - self._period_us.get(uuid, 0) / 2_000_000
        found = dict(track.lost.get(uuid, {}))
        samples = self._tap.samples.get(uuid, [])
        # The first poll read the samples the driver kept from before the trace (a full ring on a
        # busy GPU, all stamped before the poll), and the agent's figure was their mean. The trace
        # cannot go back before its start: that mean holds from it, so the replay's first poll
        # reads it (in one whole-percent sample, as the driver hands out none finer).
        first = self._first_read.get(uuid, 0) if track.first_s == 0 else 0
        before = [util for pid, _stamp_us, util in samples[:first] if pid == track.pid]
        if before:
            found[0.0] = round(sum(before) / len(before))
        for pid, stamp_us, util in samples[first:]:
            if pid == track.pid:
                at = stamp_us / 1_000_000 - start
                if at >= early_s and (track.gone_s is None or at < track.gone_s):
                    found[round(max(at, born_s), 6)] = util
        return found

    def _sample_period(self, track: _Process, uuid: str) -> float | None:
        """How often the driver sampled the process on GPU `uuid` (the smallest gap between two of
        its samples), in seconds; None where it left fewer than two."""
        stamps = sorted({stamp_us for pid, stamp_us, _util in self._tap.samples.get(uuid, ()) if pid == track.pid})
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        return min(gaps) / 1_000_000 if gaps else None

    def _cmdline(self, track: _Process) -> str:
        if self._keep_cmdlines and not track.argv:
            return "python"
        if self._keep_cmdlines:
            # Whole, but scrubbed like every label: a trace is sent on, and a replay's labels are
            # scrubbed anyway. Each argument alone (a URL's query), then the line (`--token abc`).
            kept = scrub(shlex.join(scrub(arg) for arg in track.argv))
            try:
                shlex.split(kept)
                return kept
            except ValueError:  # a quote removed with a secret: the anonymised form below
                pass
        # The executable's name, and the model the agent recognised (already in every series'
        # model label): enough to replay the labels, nothing of the arguments.
        argv = track.argv[0].split() if len(track.argv) == 1 else list(track.argv)
        words = [Path(argv[0]).name if argv else "python"]
        model = track.holding.workload.model if track.holding is not None else ""
        if model:
            words += ["--model", model]
        return shlex.join(words)

    def _allocation_entries(self, end_s: float) -> list[dict[str, Any]]:
        entries = []
        for (workload, uuid), spans in self._allocations.items():
            ref = self._refs.get(uuid)
            if ref is None:
                continue
            for span in spans:
                entry: dict[str, Any] = {"gpus": [ref], "start": span.start_s}
                end = span.last_s + self.step_s
                if end <= end_s:
                    entry["end"] = end
                if workload.pod:
                    pod = {"namespace": workload.namespace, "name": workload.pod, "container": workload.container}
                    entry["pod"] = pod
                elif workload.hpc_job:
                    entry["slurm_job"] = self._map_job(workload.hpc_job)
                    if workload.user:
                        entry["user"] = workload.user
                else:
                    continue  # only the kubelet and the Slurm prolog allocate
                entries.append(entry)
        return entries

    def _lacks(self, key: tuple[int | None, str | None, str]) -> bool:
        """Whether the fault `key` is a reading or call the GPU does not have: refused as
        NOT_SUPPORTED, and never answered on that GPU (or its MIG devices) in the whole
        recording. The agent asks such a thing once and never again, so the recording holds one
        failure of it, at the poll that asked; written over that poll alone, the replayed GPU
        answered it from then on to every reader but that agent (nvitop, a fresh agent's
        snapshot), with readings the recorded GPU never had. One that answered at any time
        failed only for a while (a driver mid-reset): it keeps its spans."""
        gpu, call, _error = key
        asked = self._refused.get(key)
        if gpu is None or call is None or not asked:
            return False
        return not asked & self._tap.answered.get(gpu, set())

    def _fault_entries(self) -> list[dict[str, Any]]:
        entries = []
        still_out = set(self._open_outages.values())
        for key, spans in self._faults.items():
            gpu, call, error = key
            if self._lacks(key):
                # Lacking it is a fact about the device, from the trace's start to its end.
                entries.append({"gpu": gpu, "call": call, "error": error})
                continue
            for span in spans:
                fault: dict[str, Any] = {"at": span.start_s}
                # An outage no poll saw end lasts to the end of the trace: a GPU still lost when
                # the recording ended, retried with backoff, last failed some polls before that.
                if key not in still_out or span is not spans[-1]:
                    fault["until"] = span.last_s + self.step_s
                if gpu is not None:
                    fault["gpu"] = gpu
                if call is not None:
                    fault["call"] = call
                fault["error"] = error
                entries.append(fault)
        return sorted(entries, key=lambda f: f.get("at", 0.0))


class _Flow(dict[str, Any]):
    """A mapping written on one line: a reading row, a segment, a fault."""


class _FlowList(list[Any]):
    """A short list written on one line: a process's GPUs."""


# libyaml's emitter where PyYAML was built with it (its wheels are): the same YAML, written in C,
# some times faster than the pure-Python emitter on a long trace; the representers stay Python.
_BaseDumper: type[yaml.SafeDumper] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _TraceDumper(_BaseDumper):  # type: ignore[valid-type,misc]
    pass


def _number(dumper: yaml.SafeDumper, value: float) -> yaml.Node:
    # Whole numbers as integers (most readings are): a shorter trace, the same value.
    if value.is_integer() and abs(value) < 2**53:
        return dumper.represent_int(int(value))
    return dumper.represent_float(value)


_TraceDumper.add_representer(_Flow, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v, flow_style=True))
_TraceDumper.add_representer(_FlowList, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
_TraceDumper.add_representer(float, _number)


def _styled(scenario: Mapping[str, Any]) -> dict[str, Any]:
    """The trace with its many small entries (rows, segments, faults) each on one line."""
    styled = dict(scenario)
    styled["gpus"] = [
        {**gpu, "readings": [_Flow(row) for row in gpu["readings"]]} if "readings" in gpu else gpu
        for gpu in scenario["gpus"]
    ]
    styled["processes"] = [
        {**p, "gpus": _FlowList(p["gpus"]), "sm_util": [_Flow(s) for s in p["sm_util"]]}
        | (
            {"per_gpu": {ref: {**g, "sm_util": [_Flow(s) for s in g["sm_util"]]} for ref, g in p["per_gpu"].items()}}
            if "per_gpu" in p
            else {}
        )
        for p in scenario["processes"]
    ]
    if "allocations" in scenario:
        styled["allocations"] = [_Flow(a) for a in scenario["allocations"]]
    if "faults" in scenario:
        styled["faults"] = [_Flow(f) for f in scenario["faults"]]
    return styled


def _activity(activity: Activity | None) -> dict[str, float]:
    """GPM figures as a row holds them: percent."""
    if activity is None:
        return {}
    found = {}
    for key in ("graphics_active", "sm_active", "sm_occupancy", "tensor_active", "dram_active"):
        value = getattr(activity, key)
        if value is not None:
            found[key] = value * 100
    return found


def _free_mib(gpu: DeviceReading) -> float | None:
    """What the driver said was free, where that is less than total - used: it reserves memory
    for itself (R510's v2 call keeps that apart from `used`), which dcgm's FB_FREE leaves out.
    Written, the replay's driver reserves the same; unwritten, it reserves none."""
    used, total, free = gpu.memory_used_bytes, gpu.memory_total_bytes, gpu.memory_free_bytes
    if used is None or total is None or free is None or free >= total - used:
        return None
    return free / MIB


def _percent(ratio: float | None) -> int | None:
    # The driver's percent readings are whole numbers: the ratio the agent made of one is
    # turned back into it exactly.
    return None if ratio is None else round(ratio * 100)


def _mhz(hz: float | None) -> int | None:
    return None if hz is None else round(hz / 1e6)


def _health(telemetry: Telemetry | None) -> dict[str, Any]:
    """A poll's health readings as a row holds them (fake_nvml's HealthRow): the driver's own
    units (MHz, percent, ns, KiB), so that the replayed driver answers what this one did.
    What the poll did not have (unsupported, failed, its group switched off) is left out, and
    a replay's physics fills it in; a reading carried between slow polls is written as carried."""
    if telemetry is None:
        return {}
    t = telemetry
    found: dict[str, Any] = {
        "sm_clock_mhz": _mhz(t.sm_clock_hz),
        "memory_clock_mhz": _mhz(t.memory_clock_hz),
        "sm_clock_max_mhz": _mhz(t.sm_clock_max_hz),
        "memory_clock_max_mhz": _mhz(t.memory_clock_max_hz),
        "fan_percent": _percent(t.fan_speed_ratio),
        "performance_state": t.performance_state,
        "clock_event_reasons": t.clock_event_reasons,
        "encoder_utilization": _percent(t.encoder_utilization),
        "decoder_utilization": _percent(t.decoder_utilization),
        "memory_utilization": _percent(t.memory_utilization),
    }
    if t.violation_s:
        found["violation_ns"] = {cause: round(seconds * 1e9) for cause, seconds in t.violation_s}
    ecc = {
        "corrected": t.ecc_corrected_volatile,
        "uncorrected": t.ecc_uncorrected_volatile,
        "corrected_aggregate": t.ecc_corrected_aggregate,
        "uncorrected_aggregate": t.ecc_uncorrected_aggregate,
    }
    found["ecc"] = {k: v for k, v in ecc.items() if v is not None} or None
    retired = (t.retired_pages_single_bit, t.retired_pages_double_bit, t.retired_pages_pending)
    if None not in retired:
        found["retired_pages"] = dict(zip(("single_bit", "double_bit", "pending"), retired, strict=True))
    remapped = (t.remapped_rows_correctable, t.remapped_rows_uncorrectable, t.row_remap_pending, t.row_remap_failure)
    if None not in remapped:
        names = ("correctable", "uncorrectable", "pending", "failure")
        found["remapped_rows"] = dict(zip(names, remapped, strict=True))
    pcie = {
        "generation": t.pcie_link_generation,
        "width": t.pcie_link_width,
        "generation_max": t.pcie_link_generation_max,
        "width_max": t.pcie_link_width_max,
        "replays": t.pcie_replays,
    }
    if t.pcie_tx_bytes_per_s is not None and t.pcie_rx_bytes_per_s is not None:
        # The driver counts KiB/s; the agent's bytes/s are that x 1024, exactly.
        pcie["tx_kib_s"] = round(t.pcie_tx_bytes_per_s / 1024)
        pcie["rx_kib_s"] = round(t.pcie_rx_bytes_per_s / 1024)
    found["pcie"] = {k: v for k, v in pcie.items() if v is not None} or None
    if t.nvlinks:
        links: list[Any] = [None] * (max(link.link for link in t.nvlinks) + 1)
        for link in t.nvlinks:
            counts = {
                "crc": link.crc_errors,
                "replay": link.replay_errors,
                "recovery": link.recovery_errors,
                "tx_kib": None if link.tx_bytes is None else link.tx_bytes // 1024,
                "rx_kib": None if link.rx_bytes is None else link.rx_bytes // 1024,
            }
            links[link.link] = {k: v for k, v in counts.items() if v is not None}
        found["nvlinks"] = links
    return {key: value for key, value in found.items() if value is not None}


def _segments(
    samples: Mapping[float, int],
    memory: list[tuple[float, float]],
    start_s: float,
    end_s: float,
    driver_period_s: float | None = None,
) -> list[dict[str, Any]]:
    """Segments (relative to the process's start) that make the fake hand out these very samples:
    each sample's value from its time on, 0 where the driver left a period without one (it only
    keeps samples of processes that did some work), and the memory the process held from each
    poll that saw it change.

    A sample stands for the driver's sampling period before its stamp. The replayed driver
    samples every REPLAY_SAMPLE_PERIOD_S; a driver that samples less often (a real H200 gave one
    sample per process each 2 s poll, 92 ms before it) has each of its samples stand for the
    replayed ones of its whole period: its value is written from its period less one replayed
    period before its stamp. Written from the stamp, it held over the next period instead, and
    each replayed poll read the mean of the sample it had read and the one before (89.5% where
    the H200's poll read 79%, then 64.5% where it read 50%). A driver that samples more often
    has its samples of each replayed period summed into one (`_per_replayed_period`)."""
    times = sorted(samples)
    gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
    period = driver_period_s or (min(gaps) if gaps else REPLAY_SAMPLE_PERIOD_S)
    if period < REPLAY_SAMPLE_PERIOD_S:
        samples = _per_replayed_period(samples, period)
        times, period = sorted(samples), REPLAY_SAMPLE_PERIOD_S
    lead = max(0.0, period - REPLAY_SAMPLE_PERIOD_S)
    changes: list[tuple[float, str, float]] = []
    for i, at in enumerate(times):
        changes.append((at - lead, "util", samples[at]))
        following = times[i + 1] if i + 1 < len(times) else end_s
        if following - at > period * 1.5:
            changes.append((at + period - lead, "util", 0))
    changes += [(at, "memory", mib) for at, mib in memory]
    util, mib = 0.0, memory[0][1] if memory else 0.0
    segments: list[dict[str, Any]] = [{"at": 0, "sm_util": 0, "memory_mib": mib}]
    for at, kind, value in sorted(changes, key=lambda c: (c[0], c[1] == "memory")):
        if kind == "util":
            util = float(value)
        else:
            mib = value
        rel = round(max(0.0, at - start_s), 6)
        segment = {"at": rel, "sm_util": util, "memory_mib": mib}
        if segments[-1]["at"] == rel:
            segments[-1] = segment
        elif (segments[-1]["sm_util"], segments[-1]["memory_mib"]) != (util, mib):
            segments.append(segment)
    return segments


def _per_replayed_period(samples: Mapping[float, int], period_s: float) -> dict[float, int]:
    """A driver's samples, taken every `period_s` (under REPLAY_SAMPLE_PERIOD_S), as the replayed
    driver's: one per replayed period, the busy time its samples found in it (each stands for
    its own period; a period without one was idle) over the replayed period, in whole percents,
    placed inside that period, so that the replayed poll's mean over its samples is the one the
    recorded poll's samples gave. The last sample of each replayed period alone was what it
    replayed: an A100-like driver sampling a process busy the first half of every second every
    1/6 s gave 40%, and the replay 0% (every second's last samples were idle).
    The first poll's mean (at 0, from before the trace) stays as it is."""
    found: dict[float, int] = {}
    busy: dict[int, float] = {}
    for at, util in samples.items():
        if at <= 0:
            found[at] = util
            continue
        k = math.ceil(at / REPLAY_SAMPLE_PERIOD_S - 1e-9)  # its replayed period: (k - 1, k] periods
        busy[k] = busy.get(k, 0.0) + util * period_s
    for k, util_s in busy.items():
        found[(k - 0.5) * REPLAY_SAMPLE_PERIOD_S] = min(100, round(util_s / REPLAY_SAMPLE_PERIOD_S))
    return found


# -- the command --------------------------------------------------------------------------------


def record(
    agent: Agent,
    tap: TappedBackend,
    duration_s: float,
    step_s: float,
    *,
    keep_cmdlines: bool = False,
    wait: Callable[[float], object] | None = None,
    on_poll: Callable[[AgentState], object] | None = None,
) -> dict[str, Any]:
    """Poll `agent` every `step_s` for `duration_s` (a fake node's clock is moved; a real one is
    waited for with `wait`, by default sleeping) and return the trace as a scenario mapping."""
    node = agent.node
    settings = agent.settings
    recorder = TraceRecorder(
        tap,
        step_s,
        proc_root=node.proc_root if node is not None else settings.proc_root,
        passwd_file=node.passwd_file if node is not None else settings.attribution.passwd_file,
        keep_cmdlines=keep_cmdlines,
        instance_type=node.scenario.node.instance_type if node is not None else detect_instance_type(),
    )
    pipeline = agent.pipeline
    started = time.monotonic()
    polls = int(duration_s // step_s) + 1
    stop = _Stop()
    try:
        with stop:
            for k in range(polls):
                stop.at_once = True
                if stop.asked:
                    break
                if k:
                    if node is not None:
                        node.clock.advance(step_s)
                    else:
                        (wait or time.sleep)(max(0.0, started + k * step_s - time.monotonic()))
                pipeline.refresh_allocations()
                state = pipeline.poll_once()
                stop.at_once = False
                recorder.observe(state, _received(agent))
                if on_poll is not None:
                    on_poll(state)
    except _Stopped:
        pass
    if stop.asked:
        log.warning("recording stopped by a signal after %d poll(s): the trace holds those", recorder.polls)
    return recorder.scenario()


class _Stopped(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during a wait or a poll of `record`."""


class _Stop:
    """Ctrl-C or SIGTERM during `record` ends the recording, not the trace: a wait or a poll is
    cut short at once (`at_once`), while a poll being taken into the trace only asks to stop
    after it, so that each poll is in the trace whole or not at all. Only in the main thread,
    where signals are handled; the handlers before are put back after."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.asked = False
        self.at_once = True
        self._before: dict[int, Any] = {}

    def __enter__(self) -> _Stop:
        if threading.current_thread() is threading.main_thread():
            self._before = {number: signal.signal(number, self._handle) for number in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        self.at_once = False
        for number, handler in self._before.items():
            signal.signal(number, handler)
        self._before = {}

    def _handle(self, _number: int, _frame: object) -> None:
        self.asked = True
        if self.at_once:
            raise _Stopped


def _received(agent: Agent) -> list[tuple[float, int, str, int]]:
    if agent.events is None:
        return []
    return [(at, gpu, event.kind.value, event.data) for at, gpu, event in agent.events.recent]


def build_recording_agent(
    settings: Settings,
    fake: str | Path | Mapping[str, Any] | None,
    step_s: float,
    monotonic: Callable[[], float] = time.monotonic,
) -> tuple[Agent, TappedBackend]:
    """The agent `record` polls: as `run` builds it (so a replay with the same config gives the
    same figures), its backend tapped, and no ledger (a recording charges nobody)."""
    taps: list[TappedBackend] = []

    def tap(backend: DeviceBackend) -> DeviceBackend:
        taps.append(tap_backend(backend))
        return taps[-1]

    agent = build_agent(settings, fake=fake, poll_interval_s=step_s, monotonic=monotonic, wrap_backend=tap)
    return agent, taps[0]


def trace_text(scenario: Mapping[str, Any], header: str) -> str:
    return header + yaml.dump(
        _styled(scenario), Dumper=_TraceDumper, sort_keys=False, default_flow_style=False, width=120
    )


def write_trace(scenario: Mapping[str, Any], out: str, header: str) -> None:
    if out == "-":
        sys.stdout.write(trace_text(scenario, header))
    else:
        with replacing(Path(out)) as handle:
            handle.write(trace_text(scenario, header).encode("utf-8"))


def cmd_record(args: argparse.Namespace) -> int:
    settings = load_config(args.config)
    duration = duration_arg(args.duration, "--for")
    step = duration_arg(args.step, "--step") if args.step else settings.poll_interval
    if duration <= 0 or step <= 0:
        raise BadInputError("gpuledger: --for and --step: must be above 0")
    if step > duration:
        raise BadInputError(f"gpuledger: --step: {format_duration(step)} is longer than --for {args.duration}")
    if duration > MAX_RECORD_S:
        raise BadInputError(f"gpuledger: --for: at most {format_duration(MAX_RECORD_S)}, got {args.duration}")
    if args.out != "-" and not Path(args.out).parent.is_dir():
        raise BadInputError(f"gpuledger: --out: no such directory {Path(args.out).parent}")
    with ExitStack() as stack:
        # The file the trace will replace is opened (its temporary twin) before a poll is taken: an
        # --out that cannot be written (a directory, a device, a read-only place) is refused now,
        # not after a recording of up to a week that it would then lose.
        out = None if args.out == "-" else stack.enter_context(replacing(Path(args.out)))
        agent, tap = build_recording_agent(settings, args.fake, step)
        polls = int(duration // step) + 1
        taken = 0  # fewer than `polls` where a signal stopped the recording

        def on_poll(_state: AgentState) -> None:
            nonlocal taken
            taken += 1
            bar.update()

        try:
            with tqdm(total=polls, unit="poll", desc="recording", disable=None, leave=False, file=sys.stderr) as bar:
                scenario = record(agent, tap, duration, step, keep_cmdlines=args.keep_cmdlines, on_poll=on_poll)
        finally:
            agent.close()
        if taken < polls:
            polls, duration = taken, (taken - 1) * step
        header = _header(args, polls, step, duration)
        if out is None:
            sys.stdout.write(trace_text(scenario, header))
        else:
            out.write(trace_text(scenario, header).encode("utf-8"))
    if args.out != "-":
        print(
            f"recorded {polls} polls of {len(scenario['gpus'])} GPU(s), {len(scenario['processes'])} process(es) "
            f"to {args.out}",
            file=sys.stderr,
        )
    return EXIT_OK


def _header(args: argparse.Namespace, polls: int, step: float, duration: float) -> str:
    where = f"fake node {args.fake!r}" if args.fake else "NVML"
    return (
        f"# Recorded by gpuledger record from {where}: {polls} polls, one every {format_duration(step)}.\n"
        f"# Replay: gpuledger simulate TRACE --for {format_duration(duration)} --step {format_duration(step)}\n"
        f"# (or run / snapshot --fake TRACE). Command lines {'kept' if args.keep_cmdlines else 'anonymised'}; "
        "no environment variables.\n"
    )
