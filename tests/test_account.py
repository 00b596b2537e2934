"""A Slurm job's account: where attribution finds it (the prolog's map file, else the job's
SLURM_JOB_ACCOUNT), the team it gives a job no rule names, and `report --by account` (and
`--by container`) on a ledger the agent wrote."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agent.attribution.sources.slurm import read_slurm_map
from agent.config import Settings, load_catalogue
from agent.model import AgentState, Workload
from tests.helpers import Rig
from tests.test_cli import gpuledger as cli

# One worker runs this module, so its ledger, a module fixture, is built once rather than once per
# xdist worker (pyproject: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("account")

REPO = Path(__file__).resolve().parent.parent


def job(account_in_map: str | None = None, account_in_env: str | None = None, gpus: int = 1) -> dict[str, Any]:
    """Slurm job 4242 (bob) running on GPU 0, allocated GPUs 0..gpus-1 by its prolog's map files."""
    allocation: dict[str, Any] = {"gpus": list(range(gpus)), "slurm_job": "4242", "user": "bob"}
    if account_in_map:
        allocation["account"] = account_in_map
    environ = {"SLURM_JOB_ID": "4242"} | ({"SLURM_JOB_ACCOUNT": account_in_env} if account_in_env else {})
    return {
        "gpus": [{"count": gpus}],
        "processes": [
            {
                "pid": 800,
                "gpus": [0],
                "sm_util": 50,
                "user": "bob",
                "uid": 1030,
                "slurm_job": "4242",
                "environ": environ,
            }
        ],
        "allocations": [allocation],
    }


def holdings(scenario: dict[str, Any], **attribution: Any) -> AgentState:
    rig = Rig(scenario, settings=Settings(attribution=attribution))
    try:
        return rig.poll()
    finally:
        rig.close()


def accounts(state: AgentState) -> set[tuple[str, str, str]]:
    return {(h.workload.hpc_job, h.account, h.workload.team) for h in state.attribution.holdings}


def test_the_map_file_carries_the_account_after_the_user(tmp_path: Path) -> None:
    (tmp_path / "0").write_text("4242 bob nlp-research\n")
    (tmp_path / "1").write_text("4243 carol\n")
    (tmp_path / "2").write_text("4244 dan bad;account\n")
    found = {a.job: a.account for a in read_slurm_map(tmp_path)}
    assert found == {"4242": "nlp-research", "4243": None, "4244": None}  # an odd account is not taken


def test_a_jobs_account_is_its_team_where_no_rule_names_one() -> None:
    assert accounts(holdings(job(account_in_map="nlp"))) == {("4242", "nlp", "nlp")}
    # The process's own SLURM_JOB_ACCOUNT where the map file names none.
    assert accounts(holdings(job(account_in_env="vision"))) == {("4242", "vision", "vision")}


def test_the_prologs_account_wins_over_the_environments() -> None:
    assert accounts(holdings(job(account_in_map="nlp", account_in_env="someone-else"))) == {("4242", "nlp", "nlp")}


def test_a_rule_naming_the_team_wins_and_the_default_can_be_turned_off() -> None:
    rule = {"match": {"account": "^nlp$"}, "set": {"team": "language"}}
    assert accounts(holdings(job(account_in_map="nlp"), rules=[rule])) == {("4242", "nlp", "language")}
    assert accounts(holdings(job(account_in_map="nlp"), team_from_account=False)) == {("4242", "nlp", "")}


def test_an_allocation_without_a_process_has_the_map_files_account() -> None:
    state = holdings(job(account_in_map="nlp", gpus=2))
    by_gpu = {h.device_uuid: (h.account, h.workload.team, h.pids) for h in state.attribution.holdings}
    assert sorted(by_gpu.values()) == [("nlp", "nlp", ()), ("nlp", "nlp", (800,))]


def test_a_process_outside_any_job_has_no_account() -> None:
    scenario = {
        "gpus": [{"count": 1}],
        "processes": [{"pid": 810, "gpus": [0], "user": "eve", "uid": 1031, "environ": {"SLURM_JOB_ACCOUNT": "nlp"}}],
    }
    (holding,) = holdings(scenario).attribution.holdings
    assert (holding.workload, holding.account) == (Workload(user="eve"), "")


def test_the_account_is_no_metric_label() -> None:
    rig = Rig(job(account_in_map="nlp"), settings=Settings())
    try:
        text = rig.metrics(rig.poll())
    finally:
        rig.close()
    assert "account=" not in text
    assert 'hpc_job="4242"' in text
    assert 'team="nlp"' in text


# -- report --by account and --by container ---------------------------------------------------


def gpuledger(*args: str) -> subprocess.CompletedProcess[str]:
    return cli(*args, timeout=300)


@pytest.fixture(scope="module")
def demo_ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "demo.db"
    result = gpuledger("simulate", "demo", "--for", "2h", "--step", "1m", "--ledger", str(path))
    assert result.returncode == 0, result.stderr
    return path


# The demo node is a p4de.24xlarge: $27.44705/h over its 8 GPUs, $3.43088125 per GPU-hour.
GPU_HOUR = load_catalogue().instance_types["p4de.24xlarge"].dollars_per_hour / 8


def test_report_by_account(demo_ledger: Path) -> None:
    result = gpuledger("report", "--ledger", str(demo_ledger), "--by", "account", "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_account = {row["account"]: row["dollars"] for row in report["rows"]}
    # Job 8812 (account nlp, from its SLURM_JOB_ACCOUNT) is the sole holder of GPUs 0-3 for the
    # two hours: 4 x 2 x $3.43088125 = $27.44705. Everything else held has no account.
    assert by_account["nlp"] == pytest.approx(4 * 2 * GPU_HOUR, rel=1e-9)
    assert set(by_account) == {"nlp", ""}
    # 8 GPUs x 2 h, all of it in TOTAL.
    assert report["total"]["dollars"] == pytest.approx(8 * 2 * GPU_HOUR, rel=1e-9)
    table = gpuledger("report", "--ledger", str(demo_ledger), "--by", "account,team")
    assert table.stdout.splitlines()[4].split()[:2] == ["nlp", "nlp"]  # the dearest row: nlp, teamed by its account


def test_report_by_container(demo_ledger: Path) -> None:
    result = gpuledger("report", "--ledger", str(demo_ledger), "--by", "container", "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = {row["container"]: row["dollars"] for row in report["rows"]}
    # The plain Docker container, the vLLM pod's container, the notebooks' jupyter containers,
    # and the Slurm job (no container).
    assert set(rows) == {"9f2b7c1d4e5a", "vllm", "jupyter", ""}
    # GPU 4 is shared by vllm and the container: together they pay its 2 hours, $6.8617625.
    assert rows["vllm"] + rows["9f2b7c1d4e5a"] == pytest.approx(2 * GPU_HOUR, rel=1e-9)
    # The notebooks hold GPUs 5 and 7: 2 x 2 x $3.43088125.
    assert rows["jupyter"] == pytest.approx(2 * 2 * GPU_HOUR, rel=1e-9)
    parts = sum(rows.values()) + report["idle"]["dollars"] + report["unobserved"]["dollars"]
    assert parts == pytest.approx(8 * 2 * GPU_HOUR, rel=1e-9)
