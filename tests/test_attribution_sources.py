"""The attribution source seam: a new workload source is one module plus one registration, and
the agent gathers from it, schedules its refreshers and closes it without knowing what it is."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agent.attribution import gather, sources
from agent.attribution.facts import HostFacts, SlurmAllocation
from agent.attribution.resolve import Inputs, attribute, attributed_readings
from agent.attribution.sources.base import AttributionSource, Refresher, SourceOptions
from agent.model import Attribution, NodeInfo, Snapshot, Workload
from tests.helpers import Rig

# One whole GPU busy with an unlabelled process of ann's, one idle GPU.
NODE = {
    "gpus": [{"count": 2}],
    "processes": [{"pid": 700, "gpus": [0], "sm_util": 50, "uid": 2001, "user": "ann", "cmdline": "python job.py"}],
}


class JobMapSource(AttributionSource):
    """A site's own map of batch jobs, `{"<gpu index>": "<job id>"}` in a JSON file: the whole
    of a new source (the module a site would add under agent/attribution/sources/)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.refreshes = 0
        self.closed = False

    def gather(self, snapshot: Snapshot, found: HostFacts) -> HostFacts:
        mapped = json.loads(self.path.read_text())
        jobs = tuple(SlurmAllocation(int(gpu), None, job, None) for gpu, job in mapped.items())
        return replace(found, slurm_allocations=(*found.slurm_allocations, *jobs))

    def refreshers(self) -> Iterable[Refresher]:
        return (Refresher("job-map", 30.0, self.refresh),)

    def refresh(self) -> None:
        self.refreshes += 1

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def job_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The JSON map file, with `JobMapSource` registered for this test only (monkeypatch puts
    the registry back afterwards)."""
    monkeypatch.setattr(sources, "_SOURCES", dict(sources._SOURCES))
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps({"0": "5150", "1": "5151"}))
    sources.register("job-map", lambda options: JobMapSource(path))  # the one registration line
    return path


def test_the_built_in_sources_gather_processes_first() -> None:
    # Later sources read what earlier ones found: pod log dirs are read only for pods' processes.
    assert sources.source_names() == ("procfs", "kubelet", "slurm", "podlogs")


def test_a_registered_source_attributes_its_workloads(job_map: Path) -> None:
    rig = Rig(NODE)
    try:
        rig.poll()
        state = rig.poll(5)
        extra = rig.attributor.source(JobMapSource)
    finally:
        rig.close()
    assert state.snapshot is not None
    gpu0, gpu1 = (state.attribution.for_device(g.uuid) for g in state.snapshot.gpus)
    # ann's process runs in no job's cgroup and with no job in its environment: the map names its job.
    assert [(h.workload, h.pids, h.allocated) for h in gpu0] == [(Workload(hpc_job="5150", user="ann"), (700,), True)]
    # The idle GPU is held by its allocation alone, using none of it.
    assert [(h.workload, h.pids, h.allocated, h.sm_util) for h in gpu1] == [(Workload(hpc_job="5151"), (), True, 0.0)]
    assert extra.closed  # closed with the agent, as every source is


def test_a_sources_refreshers_become_periodic_jobs(job_map: Path) -> None:
    rig = Rig(NODE)
    try:
        jobs = {job.name: job for job in rig.pipeline.jobs()}
        extra = rig.attributor.source(JobMapSource)
        jobs["job-map"].run()
        rig.poll()  # a one-off poll runs every refresher first, as `snapshot` does
    finally:
        rig.close()
    assert list(jobs) == ["kubelet", "job-map", "poll"]  # refreshers in registration order, then the poll
    assert (jobs["job-map"].interval_s, jobs["job-map"].at_start) == (30.0, True)
    assert extra.refreshes == 2


def test_a_source_registered_twice_is_refused(job_map: Path) -> None:
    with pytest.raises(ValueError, match="already registered"):
        sources.register("job-map", lambda options: JobMapSource(job_map))


def test_sources_are_opened_from_the_options_alone(tmp_path: Path) -> None:
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "3").write_text("4242 bob\n")
    (tmp_path / "slurm" / "0.2").write_text("4243\n")  # MIG GPU instance 2 of GPU 0, no user
    # The prolog wrote them when each job started there: that time is the allocation's start.
    os.utime(tmp_path / "slurm" / "3", (1_795_000_000.0, 1_795_000_000.0))
    os.utime(tmp_path / "slurm" / "0.2", (1_795_000_060.0, 1_795_000_060.0))
    options = SourceOptions(proc_root=str(tmp_path / "proc"), slurm_map_dir=str(tmp_path / "slurm"))
    opened = sources.open_sources(options)
    try:
        found = HostFacts()
        for source in opened:
            found = source.gather(Snapshot(0.0, NodeInfo("n"), ()), found)
    finally:
        for source in opened:
            source.close()
    # The map files' own type is the one attribution reads: no conversion between them.
    assert found.slurm_allocations == (
        SlurmAllocation(0, 2, "4243", None, started_at=1_795_000_060.0),
        SlurmAllocation(3, None, "4242", "bob", started_at=1_795_000_000.0),
    )
    assert found.kubelet_up is None  # no socket configured: no kubelet, and no health series


def test_a_steady_state_hands_on_the_last_attribution_and_a_change_is_followed(job_map: Path) -> None:
    rig = Rig({**NODE, "processes": [{**NODE["processes"][0], "end": "1m"}]})  # type: ignore[dict-item]
    try:
        first = rig.poll().attribution
        second = rig.poll(5).attribution
        # Nothing the attribution reads changed: the same result, not one worked out again.
        assert second is first
        job_map.write_text(json.dumps({"0": "5150", "1": "6000"}))  # a source's facts change
        moved = rig.poll(5).attribution
        gone = rig.poll(60).attribution  # the snapshot changes: ann's process has ended
    finally:
        rig.close()
    assert [h.workload for h in first.holdings] == [Workload(hpc_job="5150", user="ann"), Workload(hpc_job="5151")]
    assert [h.workload for h in moved.holdings] == [Workload(hpc_job="5150", user="ann"), Workload(hpc_job="6000")]
    assert [(h.workload, h.pids, h.sm_util) for h in gone.holdings] == [
        (Workload(hpc_job="5150"), (), 0.0),
        (Workload(hpc_job="6000"), (), 0.0),
    ]


class _Reads:
    """Stands in for a snapshot or a device reading and writes down each attribute read of it
    ("snapshot.devices", "device.processes"). A property is worked out on the stand-in, so what
    it reads is written down instead (`is_mig` as "device.parent_uuid"), and so is a method."""

    __slots__ = ("_kind", "_of", "_seen")

    def __init__(self, of: object, kind: str, seen: set[str]) -> None:
        self._of, self._kind, self._seen = of, kind, seen

    def __getattr__(self, name: str) -> Any:
        on_class = getattr(type(self._of), name, None)
        if isinstance(on_class, property):
            assert on_class.fget is not None
            return on_class.fget(self)
        if callable(on_class):
            return on_class.__get__(self)
        self._seen.add(f"{self._kind}.{name}")
        value = getattr(self._of, name)
        if name == "devices":
            return tuple(_Reads(device, "device", self._seen) for device in value)
        return value


@pytest.mark.parametrize("scenario", ["demo", "mig", "gpu-lost", "weekend-idle"])
def test_the_steady_state_key_covers_every_reading_attribution_reads(
    scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reuse above is only right while `attributed_readings` names every reading of the
    snapshot that `attribute` reads: one it missed could change while the key stays equal, and a
    steady poll would hand on a stale owner. Every attribution worked out over a few hours of
    each scenario is done again on a stand-in snapshot that notes what is read of it. It sees
    which readings are read, not what of them: the key holds whether `utilization` is None, which
    is all `attribute` asks of it (a comment at its one use says so)."""
    captured: list[Inputs] = []

    def capturing(inputs: Inputs) -> Attribution:
        captured.append(inputs)
        return attribute(inputs)

    monkeypatch.setattr(gather, "attribute", capturing)
    rig = Rig(scenario)
    try:
        rig.run(6 * 3600, 600)
    finally:
        rig.close()
    assert captured
    keyed: set[str] = set()
    read: set[str] = set()
    for inputs in captured:
        attributed_readings(_Reads(inputs.snapshot, "snapshot", keyed))  # type: ignore[arg-type]
        again = attribute(replace(inputs, snapshot=_Reads(inputs.snapshot, "snapshot", read)))  # type: ignore[arg-type]
        assert again == attribute(inputs)  # the stand-in changes nothing
    assert read, "attribute read nothing of the snapshot"
    assert read <= keyed, f"attribute reads {sorted(read - keyed)}, which attributed_readings leaves out"
