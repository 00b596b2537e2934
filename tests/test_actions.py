"""Opt-in actions on flags (config `actions:`), end to end on a fake node: a real HTTP receiver
on loopback takes the webhooks, real scripts the commands.

Scenario time moves by hand (a poll a minute); actions run on the runner's threads in real
time, so each test waits for the runner to go idle before it looks at what ran.
"""

from __future__ import annotations

import json
import logging
import stat
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent.actions import Actions, Trigger
from agent.actions.policy import Selector
from agent.config import Settings, unknown_variables
from agent.model import AgentState
from tests.helpers import Rig, hang_file_syncs
from tests.test_cli import gpuledger

START = datetime(2026, 11, 20, 18, 0, tzinfo=UTC).timestamp()
STEP_S = 60.0
HOUR = 3600.0


# -- the receiving end -----------------------------------------------------------------------


class Receiver:
    """An HTTP server on loopback that keeps every JSON body POSTed to it."""

    def __init__(self) -> None:
        received: list[dict[str, Any]] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def settle(actions: Actions, timeout_s: float = 15.0) -> None:
    """Wait until no action is running or waiting (each outcome then counted)."""
    deadline = time.monotonic() + timeout_s
    while not actions.idle():
        assert time.monotonic() < deadline, "actions still running"
        time.sleep(0.02)


def counts(state: AgentState, action: str) -> dict[str, int]:
    return {result: n for name, result, n in state.actions if name == action and n}


def run(rig: Rig, until_s: float) -> AgentState:
    """Poll every minute of scenario time from where the node is up to `until_s`."""
    state = rig.pipeline.state
    while rig.node.clock.now() + STEP_S <= until_s + 1e-9:
        state = rig.poll(STEP_S)
    return state


def settings(**actions: Any) -> Settings:
    return Settings(node_name="act-node", pricing={"gpu_hourly": 2.0}, actions=actions)


# Two idle GPUs; a job runs on GPU 0 from 3h to 4h, which ends the node's first idle stretch.
IDLE_NODE = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "act-node"},
    "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
    "processes": [{"pid": 900, "gpus": [0], "start": "3h", "end": "4h", "sm_util": 90, "user": "ann", "uid": 1010}],
}

# Slurm job 4242 holds GPUs 0 and 1 and runs nothing on them; GPU 2 is busy with another job.
ALLOCATED_IDLE = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "act-node"},
    "gpus": [{"model": "A100-SXM4-80GB", "count": 3}],
    "processes": [{"pid": 910, "gpus": [2], "sm_util": 80, "user": "cat", "uid": 1011, "slurm_job": "5151"}],
    "allocations": [
        {"gpus": [0, 1], "slurm_job": "4242", "user": "bob"},
        {"gpus": [2], "slurm_job": "5151", "user": "cat"},
    ],
}

# A pod in a protected namespace holding a GPU it does not use.
PROD_POD = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "act-node"},
    "gpus": [{"model": "A100-SXM4-80GB", "count": 1}],
    "allocations": [{"gpus": [0], "pod": {"namespace": "prod-serving", "name": "api-0", "container": "api"}}],
}


# -- webhooks --------------------------------------------------------------------------------


def test_the_webhook_arrives_once_per_episode(receiver: Receiver) -> None:
    rig = Rig(
        IDLE_NODE,
        settings=settings(
            dry_run=False,
            triggers={
                "page-idle-node": {
                    "flag": "idle",
                    "scope": "node",
                    "after": "1h",
                    "cooldown": "30m",
                    "webhook": {"url": receiver.url},
                }
            },
        ),
    )
    actions = rig.agent.actions
    assert actions is not None
    try:
        rig.poll()
        # Idle from t=0: the flag raises at 30m and has held 1h at t=1h: one webhook, then
        # nothing more however long the episode lasts.
        run(rig, 3 * HOUR - STEP_S)
        settle(actions)
        assert len(receiver.received) == 1
        # 3h: the job takes GPU 0, the episode ends; 4h: it leaves, the node is idle again (a
        # new episode from the first poll that measures it idle, 4h1m), the flag raises at 4h31
        # and has held 1h at 5h1m.
        state = run(rig, 7 * HOUR)
        settle(actions)
        state = rig.poll(STEP_S)
    finally:
        rig.close()
    assert len(receiver.received) == 2
    first, second = receiver.received
    assert first["version"] == "4"
    assert first["status"] == "firing"
    assert first["receiver"] == "gpuledger-actions"
    (alert,) = first["alerts"]
    assert alert["status"] == "firing"
    assert alert["labels"] == {
        "alertname": "GPULedgerAction",
        "action": "page-idle-node",
        "rule": "idle",
        "node": "act-node",
        "scope": "node",
    }
    assert alert["startsAt"] == "2026-11-20T18:00:00Z"  # the episode's start: t=0
    assert alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert alert["annotations"]["held_seconds"] == "3600"
    # What the two GPUs cost while idle up to t=1h: $2/GPU-hour x 2 GPUs x 1h = $4.00.
    assert alert["annotations"]["dollars"] == "4.00"
    # t=4h1m: the poll at 4h measures the minute before it, when the job still kept GPU 0 busy;
    # the first interval measured idle ends at the next poll.
    assert second["alerts"][0]["startsAt"] == "2026-11-20T22:01:00Z"
    assert counts(state, "page-idle-node") == {"executed": 2}
    assert 'gpuledger_actions_total{action="page-idle-node",result="executed"} 2.0' in rig.metrics(state)


def test_a_restarted_agent_does_not_act_twice_on_one_episode(receiver: Receiver, tmp_path: Path) -> None:
    trigger = Trigger(
        "page-idle-node", "idle", "node", after_s=HOUR, dry_run=False, resume_s=35 * 60, webhook_url=receiver.url
    )
    state_file = tmp_path / "actions.json"
    idle_forever = {**IDLE_NODE, "processes": []}
    first = Rig(idle_forever, settings=settings())
    first.pipeline.actions = before = Actions([trigger], state_file=state_file)
    try:
        first.poll()
        run(first, 80 * 60)  # the webhook went at 1h
        settle(before)
        assert before.flush()
    finally:
        before.close()
        first.close()
    assert len(receiver.received) == 1
    assert json.loads(state_file.read_text())["episodes"][0]["target"] == "node:act-node"

    # The agent comes back at 2h: its idle flags raise again at 2h30 and hold 1h at 3h30, on
    # the same node, in what is, for all anyone knows, the same episode.
    second = Rig(idle_forever, settings=settings())
    second.node.clock.advance(2 * HOUR)
    second.pipeline.actions = after = Actions([trigger], state_file=state_file)
    try:
        second.poll()
        state = run(second, 5 * HOUR)
        settle(after)
    finally:
        after.close()
        second.close()
    assert len(receiver.received) == 1
    assert counts(state, "page-idle-node") == {}


def test_a_state_file_not_written_by_the_stop_is_said(
    receiver: Receiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The state file's filesystem stops answering: the decision to page went out, but its record
    # never reaches the file, so a restarted agent pages again. The stop waited its second for
    # the file and went on without a word.
    gate = hang_file_syncs(monkeypatch)
    trigger = Trigger("page-idle-node", "idle", "node", after_s=HOUR, dry_run=False, webhook_url=receiver.url)
    rig = Rig({**IDLE_NODE, "processes": []}, settings=settings())
    rig.pipeline.actions = actions = Actions([trigger], state_file=tmp_path / "actions.json")
    try:
        rig.poll()
        run(rig, 80 * 60)  # the webhook went at 1h; its record waits on the file
        settle(actions)
        with caplog.at_level(logging.ERROR, logger="gpuledger.actions"):
            actions.close(0.2)
    finally:
        gate.set()
        rig.close()
    assert len(receiver.received) == 1
    [line] = [r.getMessage() for r in caplog.records if r.name == "gpuledger.actions"]
    assert "not written within 0.2s" in line
    assert "may act on them again" in line


# -- commands --------------------------------------------------------------------------------


def test_a_command_runs_once_with_the_flags_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the agent has in its environment that no command should see.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never-to-a-child")
    monkeypatch.setenv("GPULEDGER_PRICING__GPU_HOURLY", "2.0")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    record = script(tmp_path / "record.sh", 'cat > "$OUT/stdin-$$.json"\nenv > "$OUT/env-$$.txt"\n')
    rig = Rig(
        ALLOCATED_IDLE,
        settings=settings(
            dry_run=False,
            triggers={
                "scancel-idle": {
                    "flag": "allocated_idle",
                    "scope": "workload",
                    "after": "1h",
                    "command": [str(record), "--reason", "idle"],
                    "env": {"OUT": str(tmp_path)},
                    "pass_env": ["AWS_REGION"],
                }
            },
        ),
    )
    actions = rig.agent.actions
    assert actions is not None
    try:
        rig.poll()
        state = run(rig, 3 * HOUR)
        settle(actions)
        state = rig.poll(STEP_S)
    finally:
        rig.close()
    (stdin,) = tmp_path.glob("stdin-*.json")
    (env_file,) = tmp_path.glob("env-*.txt")
    context = json.loads(stdin.read_text())
    assert context["action"] == "scancel-idle"
    assert context["rule"] == "allocated_idle"
    assert context["scope"] == "workload"
    assert context["node"] == "act-node"
    assert context["workload"]["hpc_job"] == "4242"
    assert context["workload"]["user"] == "bob"
    assert context["gpus"] == [
        {"gpu": 0, "uuid": context["gpus"][0]["uuid"]},
        {"gpu": 1, "uuid": context["gpus"][1]["uuid"]},
    ]
    assert context["held_seconds"] == 3600.0
    assert context["episode_start"] == "2026-11-20T18:00:00Z"
    assert context["at"] == "2026-11-20T19:00:00Z"
    # The job's two GPUs while the flag held, t=0 to 1h: $2/GPU-hour x 2 GPUs x 1h = $4.
    assert context["dollars"] == pytest.approx(4.0)
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    assert env["GPULEDGER_HPC_JOB"] == "4242"
    assert env["GPULEDGER_USER"] == "bob"
    assert env["GPULEDGER_GPUS"] == "0,1"
    assert env["GPULEDGER_RULE"] == "allocated_idle"
    assert env["GPULEDGER_DOLLARS"] == "4.00"
    assert env["AWS_REGION"] == "us-east-1"  # passed through by name
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert "GPULEDGER_PRICING__GPU_HOURLY" not in env
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "TZ", "PWD", "OUT", "AWS_REGION"} | {
        k for k in env if k.startswith("GPULEDGER_")
    }
    # A gpuledger the command runs takes none of the context for a misspelt setting.
    assert unknown_variables(env) == []
    assert counts(state, "scancel-idle") == {"executed": 1}


def test_dry_run_logs_and_does_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpuledger.actions")
    record = script(tmp_path / "record.sh", 'touch "$OUT/ran"\n')
    rig = Rig(
        ALLOCATED_IDLE,
        settings=settings(
            triggers={
                "scancel-idle": {
                    "flag": "allocated_idle",
                    "scope": "workload",
                    "after": "1h",
                    "command": [str(record)],
                    "env": {"OUT": str(tmp_path)},
                }
            }
        ),
    )
    actions = rig.agent.actions
    assert actions is not None
    try:
        rig.poll()
        state = run(rig, 3 * HOUR)
        settle(actions)
    finally:
        rig.close()
    assert not (tmp_path / "ran").exists()
    lines = [r.getMessage() for r in caplog.records if r.name == "gpuledger.actions"]
    assert lines == [
        f"action scancel-idle dry_run: job 4242 on act-node: allocated_idle on every GPU (2) for 1h, $4.00 so far; "
        f"{record}: dry run, nothing done"
    ]
    assert counts(state, "scancel-idle") == {"dry_run": 1}


@pytest.mark.parametrize(
    "lists",
    [
        {"deny": {"namespaces": ["prod-*"]}},  # on the denylist
        {"allow": {"namespaces": ["research-*"], "hpc_jobs": ["*"]}},  # on no allowlist entry
    ],
    ids=["denied", "not-allowed"],
)
def test_a_protected_namespace_is_never_acted_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, lists: dict[str, Any]
) -> None:
    caplog.set_level(logging.INFO, logger="gpuledger.actions")
    record = script(tmp_path / "record.sh", 'touch "$OUT/ran"\n')
    rig = Rig(
        PROD_POD,
        settings=settings(
            dry_run=False,
            triggers={
                "scale-to-zero": {
                    "flag": "allocated_idle",
                    "scope": "workload",
                    "after": "30m",
                    "cooldown": "0s",
                    "command": [str(record)],
                    "env": {"OUT": str(tmp_path)},
                    **lists,
                }
            },
        ),
    )
    actions = rig.agent.actions
    assert actions is not None
    try:
        rig.poll()
        state = run(rig, 6 * HOUR)
        settle(actions)
    finally:
        rig.close()
    assert not (tmp_path / "ran").exists()
    # Decided once for the episode, and logged once, not at every poll.
    assert counts(state, "scale-to-zero") == {"denied": 1}
    (line,) = [r.getMessage() for r in caplog.records if r.name == "gpuledger.actions"]
    assert line.startswith("action scale-to-zero denied: prod-serving/api-0 on act-node")


# Mallory (uid 1012) runs an idle process outside any Slurm job and claims Bob's job 4242 in
# her own environment: nothing trusted (cgroup, map file) names a job on GPU 0.
CLAIMED_JOB = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "act-node"},
    "gpus": [{"model": "A100-SXM4-80GB", "count": 1}],
    "processes": [
        {
            "pid": 920,
            "gpus": [0],
            "sm_util": 0,
            "memory_mib": 2048,
            "uid": 1012,
            "user": "mallory",
            "environ": {"SLURM_JOB_ID": "4242"},
        }
    ],
}


def test_a_job_only_a_processs_environment_names_is_never_acted_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # scancel-idle-job.sh as the examples wire it (workload scope, allowed for every job): the
    # job id it would cancel must come from a trusted source, not from what Mallory's process
    # says, or any local user could have another user's job cancelled.
    caplog.set_level(logging.INFO, logger="gpuledger.actions")
    record = script(tmp_path / "record.sh", 'echo "$GPULEDGER_HPC_JOB" > "$OUT/ran"\n')
    rig = Rig(
        CLAIMED_JOB,
        settings=settings(
            dry_run=False,
            triggers={
                "scancel-idle": {
                    "flag": "allocated_idle",
                    "scope": "workload",
                    "after": "1h",
                    "command": [str(record)],
                    "env": {"OUT": str(tmp_path)},
                    "allow": {"hpc_jobs": ["*"]},
                }
            },
        ),
    )
    actions = rig.agent.actions
    assert actions is not None
    try:
        rig.poll()
        state = run(rig, 3 * HOUR)
        settle(actions)
    finally:
        rig.close()
    (holding,) = state.attribution.holdings
    assert holding.workload.hpc_job == "4242"
    assert holding.workload.user == "mallory"
    assert holding.self_reported
    assert not (tmp_path / "ran").exists()
    assert counts(state, "scancel-idle") == {"denied": 1}
    (line,) = [r.getMessage() for r in caplog.records if r.name == "gpuledger.actions"]
    assert line.startswith("action scancel-idle denied: job 4242 on act-node")
    assert line.endswith("its job is named only by its own processes' environment (self-reported)")
    # Her process held the GPU the whole 3h, so all of it is charged to her claim, none idle or
    # unobserved: $2/GPU-hour x 1 GPU x 3h = $6.00.
    charged = sum(w.dollars for w in state.costs.workloads.values())
    idle = sum(g.idle_dollars for g in state.costs.gpus.values())
    unobserved = sum(g.unobserved_dollars for g in state.costs.gpus.values())
    assert charged == pytest.approx(6.0)
    assert charged + idle + unobserved == pytest.approx(2.0 * 1 * 3)


def test_a_hanging_command_is_killed_at_its_timeout_and_polls_go_on(tmp_path: Path) -> None:
    hang = script(tmp_path / "hang.sh", 'echo $$ > "$OUT/pid"\nsleep 60 &\necho $! > "$OUT/child"\nwait\n')
    rig = Rig(
        ALLOCATED_IDLE,
        settings=settings(
            dry_run=False,
            triggers={
                "hang": {
                    "flag": "allocated_idle",
                    "scope": "workload",
                    "after": "30m",
                    "timeout": "1s",
                    "command": [str(hang)],
                    "env": {"OUT": str(tmp_path)},
                }
            },
        ),
    )
    actions = rig.agent.actions
    assert actions is not None
    try:
        rig.poll()
        run(rig, 30 * 60 - STEP_S)
        stamps = []
        slowest = 0.0
        started = time.monotonic()
        # The command starts at the 30m poll and hangs; polls go on meanwhile, each quick.
        while not actions.idle() or time.monotonic() - started < 0.5:
            before = time.monotonic()
            state = rig.poll(STEP_S)
            slowest = max(slowest, time.monotonic() - before)
            stamps.append(state.health.last_success_at)
            assert time.monotonic() - started < 15, "the command was not killed"
            time.sleep(0.05)
        state = rig.poll(STEP_S)
    finally:
        rig.close()
    assert slowest < 0.5
    assert len(stamps) > 3
    assert stamps == sorted(set(stamps))  # every poll read the GPUs anew, a minute on
    assert counts(state, "hang") == {"timeout": 1}
    for name in ("pid", "child"):
        pid = int((tmp_path / name).read_text())
        assert not _alive(pid), f"{name} {pid} still running"


def test_a_run_whose_node_got_busy_while_it_waited_is_cancelled(tmp_path: Path) -> None:
    # One worker. Two node actions fire on the idle node at 1h: the first takes the worker and
    # holds it until the test lets go; the stop waits in the queue. A job starts on GPU 0 at 3h
    # and the idle flags clear: by the time the worker is free the node is no longer idle, and
    # stopping it would kill the job.
    hold = script(tmp_path / "hold.sh", 'while [ ! -e "$OUT/release" ]; do sleep 0.05; done\n')
    stop = script(tmp_path / "stop.sh", 'touch "$OUT/stopped"\n')
    node_idle = {"flag": "idle", "scope": "node", "after": "1h", "env": {"OUT": str(tmp_path)}}
    rig = Rig(
        IDLE_NODE,
        settings=settings(
            dry_run=False,
            workers=1,
            triggers={
                "hold": {**node_idle, "command": [str(hold)]},
                "stop-node": {**node_idle, "command": [str(stop)]},
            },
        ),
    )
    actions = rig.agent.actions
    assert actions is not None
    try:
        rig.poll()
        run(rig, HOUR)
        state = run(rig, 3 * HOUR + STEP_S)
        assert state.snapshot is not None
        assert not [f for f in state.flags if f.rule == "idle" and f.uuid == state.snapshot.gpus[0].uuid and f.raised]
        (tmp_path / "release").touch()
        settle(actions)
        state = rig.poll(STEP_S)
    finally:
        rig.close()
    assert not (tmp_path / "stopped").exists()
    assert counts(state, "hold") == {"executed": 1}
    assert counts(state, "stop-node") == {"cancelled": 1}
    # Up to 3h02m: the job has held GPU 0 for its last 2 minutes ($2/GPU-hour x 2/60 h), every
    # other GPU-second was idle; 2 GPUs x (3h + 2/60 h) x $2 in all.
    charged = sum(t.dollars for t in state.costs.workloads.values())
    idle = sum(g.idle_dollars for g in state.costs.gpus.values())
    unobserved = sum(g.unobserved_dollars for g in state.costs.gpus.values())
    assert charged == pytest.approx(2.0 * 2 / 60)
    assert charged + idle + unobserved == pytest.approx(2 * (3 + 2 / 60) * 2.0)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for a reaper does not)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return status.rpartition(")")[2].split()[0] != "Z"


# -- the wiring ------------------------------------------------------------------------------


def test_the_config_builds_the_triggers_it_names() -> None:
    rig = Rig(
        ALLOCATED_IDLE,
        settings=settings(
            deny={"namespaces": ["kube-system"]},
            triggers={
                "notify": {
                    "flag": "allocated_idle",
                    "scope": "workload",
                    "after": "2h",
                    "webhook": {"url": "https://hooks.example.com/services/T0/B0/secret", "format": "slack"},
                    "deny": {"users": ["root"]},
                    "dry_run": False,
                },
            },
        ),
    )
    try:
        actions = rig.agent.actions
        assert actions is not None
        (trigger,) = actions.triggers
    finally:
        rig.close()
    assert trigger.name == "notify"
    assert trigger.after_s == 2 * HOUR
    assert trigger.dry_run is False  # the trigger's own setting wins over the section's
    assert trigger.webhook_format == "slack"
    assert trigger.deny == (Selector(namespaces=("kube-system",)), Selector(users=("root",)))
    # A restarted agent's allocated_idle flags raise after their 30m; an episode from before
    # waits that and five minutes of grace.
    assert trigger.resume_s == 30 * 60 + 300


def test_without_triggers_the_agent_has_no_actions() -> None:
    rig = Rig(ALLOCATED_IDLE, settings=settings())
    try:
        assert rig.agent.actions is None
        assert rig.pipeline.actions is None
    finally:
        rig.close()


def test_simulate_only_logs_what_would_run(tmp_path: Path) -> None:
    record = script(tmp_path / "record.sh", 'touch "$OUT/ran"\n')
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "actions": {
                    "dry_run": False,
                    "state_file": str(tmp_path / "state.json"),
                    "triggers": {
                        "stop-node": {"flag": "idle", "scope": "gpu", "after": "1h", "command": [str(record)]}
                    },
                }
            }
        )
    )
    result = gpuledger(
        "simulate",
        "demo",
        "--for",
        "3h",
        "--step",
        "1m",
        "--config",
        str(config),
        env={"OUT": str(tmp_path)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "ran").exists()
    assert not (tmp_path / "state.json").exists()
    # The demo's GPU 6 is idle from t=0: one dry run for it.
    assert "action stop-node dry_run: GPU 6 on gpu-node-01" in result.stderr


# -- configuration ---------------------------------------------------------------------------


def _cli(*args: str) -> Any:
    return gpuledger(*args)


@pytest.mark.parametrize(
    ("trigger", "key"),
    [
        ({"flag": "idel", "scope": "node", "command": ["/bin/true"]}, "actions.triggers.t.flag"),
        ({"flag": "idle", "scope": "cluster", "command": ["/bin/true"]}, "actions.triggers.t.scope"),
        ({"flag": "idle", "scope": "workload", "command": ["/bin/true"]}, "actions.triggers.t.scope"),
        ({"flag": "idle", "scope": "node"}, "actions.triggers.t"),  # neither command nor webhook
        ({"flag": "idle", "scope": "node", "command": []}, "actions.triggers.t.command"),
        ({"flag": "idle", "scope": "node", "webhook": {"url": "file:///etc/passwd"}}, "actions.triggers.t.webhook.url"),
        ({"flag": "idle", "scope": "node", "after": "soon", "command": ["/bin/true"]}, "actions.triggers.t.after"),
        ({"flag": "idle", "scope": "node", "command": ["/no/such/program"]}, "actions.triggers.t.command"),
        (
            {"flag": "idle", "scope": "node", "env": {"GPULEDGER_NODE": "x"}, "command": ["/bin/true"]},
            "actions.triggers.t.env",
        ),
    ],
    ids=[
        "unknown-flag",
        "unknown-scope",
        "no-workload",
        "no-way",
        "empty-argv",
        "bad-url",
        "bad-after",
        "no-program",
        "reserved-env",
    ],
)
def test_a_bad_trigger_is_one_line_naming_its_key_and_exit_2(tmp_path: Path, trigger: dict[str, Any], key: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"actions": {"state_file": None, "triggers": {"t": trigger}}}))
    for command in (["check-config", str(config)], ["run", "--fake", "--config", str(config)]):
        result = _cli(*command)
        assert result.returncode == 2, (command, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert f": {key}: " in lines[0]
        assert "Traceback" not in result.stderr
        if command[0] == "check-config":
            assert lines[0].startswith(f"{config}: {key}: ")
