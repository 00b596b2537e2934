"""The shipped example actions (deploy/actions/): the example config is one the agent accepts,
and each script, run the way the agent runs it (`run_command`: argv, the context on stdin and in
GPULEDGER_* variables, nothing else of the environment), calls its tool with the right
arguments. The tools (curl, aws, gcloud, scancel, kubectl) are stand-ins on PATH that record
their arguments and answer like the real ones."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from agent.actions.policy import Decision, Target, Trigger
from agent.actions.runner import EXECUTED, FAILED, Outcome, run_command
from agent.model import Workload
from tests.test_cli import gpuledger

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "deploy" / "actions"
NOW = 1_795_000_000.0


def stub(bin_dir: Path, name: str, body: str) -> None:
    """A stand-in for `name` that appends its arguments to <bin_dir>/<name>.calls, then runs `body`."""
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\necho "$*" >> "{bin_dir}/{name}.calls"\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def calls(bin_dir: Path, name: str) -> list[str]:
    path = bin_dir / f"{name}.calls"
    return path.read_text().splitlines() if path.exists() else []


NOBODY = Workload()


def act(script: str, bin_dir: Path, scope: str, workload: Workload = NOBODY, **env: str) -> Outcome:
    trigger = Trigger(
        name="example",
        flag="idle" if scope == "node" else "allocated_idle",
        scope=scope,
        dry_run=False,
        command=(str(EXAMPLES / script),),
        timeout_s=20.0,
        env=tuple(env.items()),
    )
    target = Target(
        key=f"{scope}:x",
        scope=scope,
        node="gpu-node-01",
        rule=trigger.flag,
        gpus=((0, "GPU-0"), (1, "GPU-1")),
        workloads=(workload,) if scope == "workload" else (),
        held_s=7200.0,
        dollars=13.72,
    )
    # The agent's PATH, with the stand-ins first: what the command inherits.
    return run_command(Decision(trigger, "run", target, NOW - 7200), NOW, {"PATH": f"{bin_dir}:/usr/bin:/bin"})


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    path = tmp_path / "bin"
    path.mkdir()
    return path


def test_the_example_config_is_one_the_agent_accepts(tmp_path: Path) -> None:
    document = yaml.safe_load((EXAMPLES / "config.example.yaml").read_text())
    triggers = document["actions"]["triggers"]
    assert set(triggers) == {"stop-idle-node", "scancel-idle-job", "scale-idle-deployment", "notify-owner"}
    # Installed, the scripts live in /etc/gpuledger/actions/; here, in the checkout.
    for trigger in triggers.values():
        if "command" in trigger:
            name = Path(trigger["command"][0]).name
            assert (EXAMPLES / name).is_file(), name
            trigger["command"][0] = str(EXAMPLES / name)
    document["actions"]["state_file"] = str(tmp_path / "actions.json")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(document))
    result = gpuledger("check-config", str(config))
    assert result.returncode == 0, result.stderr
    assert document["actions"]["dry_run"] is True  # shipped as a dry run


def test_stop_instance_aws_stops_this_instance(bin_dir: Path) -> None:
    stub(
        bin_dir,
        "curl",
        'case "$*" in *api/token*) echo TOKEN ;; *instance-id*) echo i-0abc123 ;; *region*) echo eu-west-1 ;; esac',
    )
    stub(bin_dir, "aws", "echo STOPPING")
    outcome = act("stop-instance-aws.sh", bin_dir, "node")
    assert outcome.result == EXECUTED, outcome.detail
    assert calls(bin_dir, "aws") == ["ec2 stop-instances --region eu-west-1 --instance-ids i-0abc123 --output text"]
    token_call, *meta_calls = calls(bin_dir, "curl")
    assert "-X PUT http://169.254.169.254/latest/api/token" in token_call
    assert all("X-aws-ec2-metadata-token: TOKEN" in c for c in meta_calls)  # IMDSv2: every read with the token


def test_stop_instance_refuses_anything_but_a_node(bin_dir: Path) -> None:
    stub(bin_dir, "curl", "echo x")
    stub(bin_dir, "aws", "")
    outcome = act("stop-instance-aws.sh", bin_dir, "gpu")
    assert outcome.result == FAILED
    assert "exited 2" in outcome.detail
    assert calls(bin_dir, "aws") == []


def test_stop_instance_aws_without_an_instance_id_stops_nothing(bin_dir: Path) -> None:
    stub(bin_dir, "curl", 'case "$*" in *api/token*) echo TOKEN ;; *) echo "<html>captive portal</html>" ;; esac')
    stub(bin_dir, "aws", "")
    outcome = act("stop-instance-aws.sh", bin_dir, "node")
    assert outcome.result == FAILED
    assert "no instance id" in outcome.detail
    assert calls(bin_dir, "aws") == []


def test_stop_instance_gcp_stops_this_instance(bin_dir: Path) -> None:
    stub(
        bin_dir,
        "curl",
        'case "$*" in *instance/name) echo gpu-node-01 ;; '
        "*instance/zone) echo projects/123/zones/us-central1-a ;; esac",
    )
    stub(bin_dir, "gcloud", "")
    outcome = act("stop-instance-gcp.sh", bin_dir, "node")
    assert outcome.result == EXECUTED, outcome.detail
    assert calls(bin_dir, "gcloud") == ["compute instances stop gpu-node-01 --zone us-central1-a --quiet"]
    assert all("Metadata-Flavor: Google" in c for c in calls(bin_dir, "curl"))


@pytest.mark.parametrize("job", ["8812", "9911_3"])
def test_scancel_idle_job_cancels_the_job(bin_dir: Path, job: str) -> None:
    stub(bin_dir, "scancel", "")
    outcome = act("scancel-idle-job.sh", bin_dir, "workload", Workload(hpc_job=job, user="bob"))
    assert outcome.result == EXECUTED, outcome.detail
    assert calls(bin_dir, "scancel") == [job]


@pytest.mark.parametrize("job", ["", "--signal=KILL", "12 34", "8812_", "_3", "1_2_3"])
def test_scancel_idle_job_hands_scancel_nothing_but_a_job_id(bin_dir: Path, job: str) -> None:
    stub(bin_dir, "scancel", "")
    outcome = act("scancel-idle-job.sh", bin_dir, "workload", Workload(hpc_job=job, namespace="ns", pod="p"))
    assert outcome.result == FAILED
    assert calls(bin_dir, "scancel") == []


def test_scale_deployment_to_zero_finds_the_deployment_of_the_pod(bin_dir: Path) -> None:
    stub(
        bin_dir,
        "kubectl",
        'case "$*" in "get pod "*) printf vllm-7d9f ;; "get replicaset "*) printf vllm ;; esac',
    )
    pod = Workload(namespace="dev-nlp", pod="vllm-7d9f-x2x4q", container="vllm", user="u")
    outcome = act("scale-deployment-to-zero.sh", bin_dir, "workload", pod)
    assert outcome.result == EXECUTED, outcome.detail
    get_pod, get_rs, annotate, scale = calls(bin_dir, "kubectl")
    assert get_pod.startswith("get pod --namespace dev-nlp vllm-7d9f-x2x4q -o jsonpath=")
    assert get_rs.startswith("get replicaset --namespace dev-nlp vllm-7d9f -o jsonpath=")
    assert annotate.startswith("annotate deployment --namespace dev-nlp vllm --overwrite gpuledger.io/scaled-to-zero=")
    assert scale == "scale deployment --namespace dev-nlp vllm --replicas=0"


def test_scale_deployment_to_zero_leaves_a_bare_pod_alone(bin_dir: Path) -> None:
    stub(bin_dir, "kubectl", "")  # no owner
    outcome = act("scale-deployment-to-zero.sh", bin_dir, "workload", Workload(namespace="dev", pod="solo"))
    assert outcome.result == FAILED
    assert "no ReplicaSet owner" in outcome.detail
    assert [c.split()[0] for c in calls(bin_dir, "kubectl")] == ["get"]


def test_scale_deployment_to_zero_refuses_a_slurm_job(bin_dir: Path) -> None:
    stub(bin_dir, "kubectl", "")
    outcome = act("scale-deployment-to-zero.sh", bin_dir, "workload", Workload(hpc_job="8812"))
    assert outcome.result == FAILED
    assert calls(bin_dir, "kubectl") == []
