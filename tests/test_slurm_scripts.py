"""deploy/slurm's prolog and epilog, run with bash as slurmd would run them, read back by the
agent's own map-file reader."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from agent.attribution.resolve import Inputs, attribute
from agent.attribution.sources.slurm import read_slurm_map
from agent.model import Workload
from tests.helpers import Rig

ROOT = Path(__file__).resolve().parent.parent
PROLOG = ROOT / "deploy" / "slurm" / "prolog.sh"
EPILOG = ROOT / "deploy" / "slurm" / "epilog.sh"


def slurmd_runs(script: Path, map_dir: Path, **env: str) -> None:
    """The script with the job's variables, as slurmd passes them; it must exit 0 whatever
    happens, since a failing prolog or epilog drains the node."""
    variables = {"PATH": os.environ["PATH"], "GPULEDGER_ATTRIBUTION__SLURM_MAP_DIR": str(map_dir), **env}
    result = subprocess.run(
        ["bash", str(script)], env=variables, capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def held(map_dir: Path) -> dict[int, tuple[str, str | None, str | None]]:
    return {a.gpu_index: (a.job, a.user, a.account) for a in read_slurm_map(map_dir)}


def test_the_prolog_maps_each_gpu_of_the_job_and_the_epilog_removes_only_its_own(tmp_path: Path) -> None:
    map_dir = tmp_path / "jobs"
    job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_USER": "bob", "SLURM_JOB_ACCOUNT": "physics"}
    slurmd_runs(PROLOG, map_dir, SLURM_JOB_GPUS="0,2", **job)
    assert held(map_dir) == {0: ("4242", "bob", "physics"), 2: ("4242", "bob", "physics")}
    assert sorted(p.name for p in map_dir.iterdir()) == ["nvidia0", "nvidia2"]  # no temporary file left behind
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in map_dir.iterdir())  # what the agent trusts
    # GPU 2 goes to the next job before this one's epilog has run.
    slurmd_runs(PROLOG, map_dir, SLURM_JOB_GPUS="2", SLURM_JOB_ID="4300", SLURM_JOB_USER="carol")
    slurmd_runs(EPILOG, map_dir, **job)
    assert held(map_dir) == {2: ("4300", "carol", None)}
    slurmd_runs(EPILOG, map_dir, SLURM_JOB_ID="4300")
    assert held(map_dir) == {}


def test_an_array_task_is_mapped_by_its_own_job_id_and_named_as_users_know_it(tmp_path: Path) -> None:
    map_dir = tmp_path / "jobs"
    task = {"SLURM_JOB_ID": "1235", "SLURM_ARRAY_JOB_ID": "1234", "SLURM_ARRAY_TASK_ID": "7"}
    slurmd_runs(PROLOG, map_dir, SLURM_JOB_GPUS="1", SLURM_JOB_USER="alice", **task)
    slurmd_runs(PROLOG, map_dir, SLURM_JOB_GPUS="2", SLURM_JOB_ID="1240", SLURM_JOB_USER="bob")
    [mapped, plain] = sorted(read_slurm_map(map_dir), key=lambda a: a.gpu_index)
    # labelled `1234_7`, tied to slurmd's job_1235 cgroup
    assert (mapped.job, mapped.job_id, mapped.user) == ("1234_7", "1235", "alice")
    assert (plain.job, plain.job_id) == ("1240", "1240")
    slurmd_runs(EPILOG, map_dir, **task)
    assert held(map_dir) == {2: ("1240", "bob", None)}


def test_a_job_without_gpus_or_a_directory_that_cannot_be_made_fails_nothing(tmp_path: Path) -> None:
    map_dir = tmp_path / "jobs"
    slurmd_runs(PROLOG, map_dir, SLURM_JOB_ID="4242", SLURM_JOB_USER="bob")  # a CPU-only job
    assert not map_dir.exists()
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory\n")
    slurmd_runs(PROLOG, blocked / "jobs", SLURM_JOB_ID="4242", SLURM_JOB_GPUS="0")  # cannot write: still exit 0
    slurmd_runs(EPILOG, tmp_path / "missing", SLURM_JOB_ID="4242")


def test_the_prolog_names_each_gpu_by_its_device_node_which_the_agent_finds_whatever_its_index(
    tmp_path: Path,
) -> None:
    # SLURM_JOB_GPUS holds the numbers of the job's /dev/nvidia<N> files (gres.conf File=), the
    # driver's minor numbers, not NVML's indexes. On this node /dev/nvidia0 is GPU 1 and
    # /dev/nvidia1 is GPU 0: job 4242 was given /dev/nvidia0, so it holds GPU 1, and GPU 0 is free.
    map_dir = tmp_path / "jobs"
    slurmd_runs(PROLOG, map_dir, SLURM_JOB_GPUS="0", SLURM_JOB_ID="4242", SLURM_JOB_USER="bob")
    rig = Rig({"gpus": [{"minor": 1}, {"minor": 0}]})
    try:
        snapshot = rig.poll().snapshot
    finally:
        rig.close()
    assert snapshot is not None
    held = attribute(Inputs(snapshot, processes={}, slurm_allocations=read_slurm_map(map_dir)))
    by_index = {d.index: [h.workload for h in held.for_device(d.uuid)] for d in snapshot.devices}
    assert by_index == {0: [], 1: [Workload(hpc_job="4242", user="bob")]}
