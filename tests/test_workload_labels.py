"""The workload labels: one list, taken from the Workload fields; a Slurm job is `hpc_job`, a
systemd service is `unit`; and `job`, the old name, still works where people typed it (labelling
rules in config files)."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import fake_nvml
from agent.attribution.facts import SlurmAllocation
from agent.attribution.labels import compile_rules
from agent.attribution.resolve import Inputs, attribute
from agent.config import ConfigError, load_config
from agent.model import (
    WORKLOAD_LABELS,
    DeviceReading,
    Holding,
    NodeInfo,
    ProcessFacts,
    ProcessIdentity,
    ProcessReading,
    Snapshot,
    Workload,
)
from exporters.catalogue import CATALOGUE
from tests.helpers import Rig


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    fake_nvml.uninstall()


def test_the_label_list_is_the_workload_fields_in_order() -> None:
    assert WORKLOAD_LABELS == ("namespace", "pod", "container", "hpc_job", "unit", "user", "model", "team")
    w = Workload(namespace="ns", pod="p", container="c", hpc_job="8812", unit="u.service", user="ann", model="m")
    assert w.labels() == ("ns", "p", "c", "8812", "u.service", "ann", "m", "")
    assert w.label_dict() == dict(zip(WORKLOAD_LABELS, w.labels(), strict=True))
    assert Workload.from_labels(w.label_dict() | {"gpu": "0"}) == w  # other keys are not labels
    # Every workload series of the catalogue carries exactly that list, after the device's.
    workload_specs = [spec for spec in CATALOGUE if "namespace" in spec.labels]
    # 6 gauges (one: who left a GPU idle), 9 counters (two: the idle time and cost by who left
    # the GPU idle), the workload flag
    assert len(workload_specs) == 16
    for spec in workload_specs:
        assert spec.labels[:2] == ("gpu", "uuid")
        assert spec.labels[2 : 2 + len(WORKLOAD_LABELS)] == WORKLOAD_LABELS, spec.name
    assert all("job" not in spec.labels for spec in CATALOGUE)


def test_a_workloads_remembered_hash_stays_in_its_process() -> None:
    # The hash is remembered at the first lookup; pickled, a workload carries its labels only,
    # so a process with other string hashes (another PYTHONHASHSEED) finds it as its own.
    w = Workload(namespace="serving", pod="vllm-llama-0", container="vllm", model="meta-llama/Llama-3.1-8B")
    assert hash(w) == hash(replace(w, team="")) == hash(Workload.from_labels(w.label_dict()))
    assert hash(w) != hash(replace(w, team="inference"))
    script = (
        "import pickle, sys\n"
        "from agent.model import Workload\n"
        "w = pickle.loads(sys.stdin.buffer.read())\n"
        "fresh = Workload.from_labels(w.label_dict())\n"
        "print(hash(w) == hash(fresh), {fresh: 1}.get(w), w in {fresh}, w == fresh)\n"
    )
    for seed in ("1", "2"):
        found = subprocess.run(
            [sys.executable, "-c", script],
            input=pickle.dumps(w),
            capture_output=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert found.stdout.decode().split() == ["True", "1", "True", "True"]
    assert copy.copy(w) == w
    assert hash(copy.deepcopy(w)) == hash(w)


@pytest.mark.parametrize(
    ("workload", "described"),
    [
        (Workload(namespace="serving", pod="vllm-llama-0", container="vllm"), "serving/vllm-llama-0"),
        (Workload(hpc_job="8812", user="alice"), "job 8812"),
        (Workload(hpc_job="9911_3"), "job 9911_3"),  # an array task
        (Workload(unit="triton.service", user="svc"), "triton.service"),
        (Workload(container="9f2b7c1d4e5a", user="carol"), "container 9f2b7c1d4e5a"),
        (Workload(user="ann"), "user ann"),
        (Workload(), "(unknown)"),
    ],
)
def test_describe_names_each_kind_of_owner(workload: Workload, described: str) -> None:
    assert workload.describe() == described


# --- attribution: which label each owner sets ----------------------------------------------------

GPU = DeviceReading(index=0, uuid="GPU-0", name="NVIDIA A100-SXM4-80GB", up=True, utilization=0.5)


RuleText = Sequence[tuple[Mapping[str, str], Mapping[str, str]]]


def holder(
    cgroup: str, env: Mapping[str, str] | None = None, slurm: tuple[SlurmAllocation, ...] = (), rules: RuleText = ()
) -> Workload:
    """The one workload holding GPU 0, where pid 100 (uid 1000, ann) runs in `cgroup`."""
    device = replace(GPU, processes=(ProcessReading(100, 2**30, 0.5),))
    facts = ProcessFacts(
        identity=ProcessIdentity(100, 1), uid=1000, cmdline=("python", "serve.py"), cgroup=cgroup,
        env=tuple((env or {}).items()),
    )  # fmt: skip
    inputs = Inputs(
        snapshot=Snapshot(0.0, NodeInfo("n"), (device,)),
        processes={100: facts},
        slurm_allocations=slurm,
        user_names={1000: "ann"},
        rules=compile_rules(rules),
    )
    holdings = attribute(inputs).holdings
    assert len(holdings) == 1, holdings
    return holdings[0].workload


SERVICE = "0::/system.slice/triton.service\n"
SLURM_CGROUP = "0::/system.slice/slurmstepd.scope/job_8812/step_0/user/task_0\n"
LOGIN = "0::/user.slice/user-1000.slice/session-3.scope\n"


def test_a_systemd_service_sets_unit_not_hpc_job() -> None:
    assert holder(SERVICE) == Workload(unit="triton.service", user="ann")


def test_a_slurm_job_sets_hpc_job_from_each_source() -> None:
    # Its cgroup (the slurmstepd tree), the prolog's map file for the GPU, or, with neither,
    # the SLURM_JOB_ID the process's environment claims (its user stays the uid's: the claim
    # names a job, never who ran it; test_attribution.py has the spoofing cases, and another
    # user's process on a GPU the map file gives a job).
    assert holder(SLURM_CGROUP) == Workload(hpc_job="8812", user="ann")
    mapped = (SlurmAllocation(gpu_index=0, gpu_instance_id=None, job="9911", user="ann"),)
    assert holder(LOGIN, slurm=mapped) == Workload(hpc_job="9911", user="ann")
    assert holder(LOGIN, env={"SLURM_JOB_ID": "4242", "SLURM_JOB_USER": "cat"}) == Workload(hpc_job="4242", user="ann")
    assert holder(LOGIN) == Workload(user="ann")  # none of them: a user's process


def test_labelling_rules_match_hpc_job_and_unit_and_still_accept_job() -> None:
    by_job = [({"job": "^88"}, {"team": "hpc"})]
    by_hpc_job = [({"hpc_job": "^88"}, {"team": "hpc"})]
    by_unit = [({"unit": r"^triton\."}, {"model": "triton"})]
    assert holder(SLURM_CGROUP, rules=by_job).team == "hpc"  # the old name, as config files have it
    assert holder(SLURM_CGROUP, rules=by_hpc_job).team == "hpc"
    assert holder(SERVICE, rules=by_job).team == ""  # a service is no Slurm job, whatever its name
    assert holder(SERVICE, rules=by_unit).model == "triton"


def test_config_accepts_job_hpc_job_and_unit_as_rule_fields(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "attribution:\n  rules:\n"
        "    - {match: {job: '^1'}, set: {team: a}}\n"
        "    - {match: {hpc_job: '^2'}, set: {team: b}}\n"
        "    - {match: {unit: 'nginx'}, set: {team: c}}\n"
    )
    rules = load_config(str(path)).attribution.rules
    assert [list(rule.match) for rule in rules] == [["job"], ["hpc_job"], ["unit"]]
    path.write_text("attribution:\n  rules:\n    - {match: {jobid: '^1'}, set: {team: a}}\n")
    with pytest.raises(ConfigError, match="jobid: unknown field"):
        load_config(str(path))


# --- end to end: what the exporter shows --------------------------------------------------------


def test_exported_series_name_the_service_by_unit_and_the_job_by_hpc_job() -> None:
    scenario = {
        "gpus": [{"count": 2}],
        "processes": [
            {"pid": 10, "gpus": [0], "sm_util": 30, "memory_mib": 1000, "uid": 1001, "user": "svc",
             "cmdline": "tritonserver --http-port 8000", "cgroup": SERVICE.strip()},
            {"pid": 20, "gpus": [1], "sm_util": 60, "memory_mib": 2000, "uid": 1002, "user": "alice",
             "cmdline": "python train.py", "slurm_job": "8812"},
        ],
    }  # fmt: skip
    rig = Rig(scenario)
    try:
        text = rig.metrics(rig.poll())
    finally:
        rig.close()
    held = {
        s.labels["gpu"]: {name: s.labels[name] for name in WORKLOAD_LABELS}
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpuledger_workload_gpu_processes"
    }
    assert held["0"] == Workload(unit="triton.service", user="svc").label_dict()
    assert held["1"] == Workload(hpc_job="8812", user="alice").label_dict()
    assert "exported_job" not in text
    assert 'job="' not in text.replace('hpc_job="', "")  # no label called job at all


# --- spoofing: what a process says of itself never beats what root set up -----------------------


def holding(cgroup: str, env: Mapping[str, str], slurm: tuple[SlurmAllocation, ...] = ()) -> Holding:
    device = replace(GPU, processes=(ProcessReading(100, 2**30, 0.5),))
    facts = ProcessFacts(ProcessIdentity(100, 1), 1000, ("python", "x.py"), cgroup, tuple(env.items()))
    inputs = Inputs(
        snapshot=Snapshot(0.0, NodeInfo("n"), (device,)),
        processes={100: facts},
        slurm_allocations=slurm,
        user_names={1000: "ann", 1001: "bob"},
    )
    [held] = [h for h in attribute(inputs).holdings if 100 in h.pids]
    return held


def test_an_environment_claim_cannot_take_a_job_the_map_file_names() -> None:
    # ann's process, outside any Slurm cgroup, claims job 9911 on GPU 0; the prolog's map file
    # (root's) says GPU 0 belongs to bob's job 5000.
    theirs = (SlurmAllocation(gpu_index=0, gpu_instance_id=None, job="5000", user="bob"),)
    claim = {"SLURM_JOB_ID": "9911", "SLURM_JOB_USER": "bob"}
    held = holding(LOGIN, claim, theirs)
    # Neither the claim nor the map file's job: bob's job holds the GPU, not ann's process.
    assert held.workload == Workload(user="ann")
    assert not held.self_reported
    mine = (SlurmAllocation(gpu_index=0, gpu_instance_id=None, job="5000", user="ann"),)
    assert holding(LOGIN, claim, mine).workload == Workload(hpc_job="5000", user="ann")  # her own job's


def test_an_environment_claim_cannot_change_the_job_or_user_a_cgroup_names() -> None:
    held = holding(SLURM_CGROUP, {"SLURM_JOB_ID": "9911", "SLURM_JOB_USER": "bob"})
    assert held.workload == Workload(hpc_job="8812", user="ann")  # slurmd's cgroup, and the uid's user
    assert not held.self_reported
    in_a_pod = "0::/kubepods.slice/kubepods-pod0b6c2f4e_3c1d_4e8a_9f11_2a7d5c9e0b01.slice/cri-containerd-ab.scope\n"
    assert holding(in_a_pod, {"SLURM_JOB_ID": "9911"}).workload.hpc_job == ""


def test_an_unconfirmed_claim_keeps_the_uid_as_user_and_is_marked_self_reported() -> None:
    held = holding(LOGIN, {"SLURM_JOB_ID": "9911", "SLURM_JOB_USER": "bob"})
    assert held.workload == Workload(hpc_job="9911", user="ann")  # never bob: the uid is ann's
    assert held.self_reported
    assert not holding(LOGIN, {}).self_reported
