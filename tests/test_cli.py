"""The `gpuledger` command end to end: real subprocesses, real HTTP, real exit codes."""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.model import WORKLOAD_LABELS, AgentState, DeviceReading
from fake_nvml.scenario import load_scenario
from tests.cli_server import CliServer

REPO = Path(__file__).resolve().parent.parent


_CLI = CliServer(REPO)


def gpuledger(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m agent ARGS` in a process of its own, as subprocess.run gives it back; forked
    from a server that has imported the agent already (tests/cli_server.py)."""
    return _CLI.run(args, {**os.environ, **(env or {})}, REPO, timeout)


def free_port() -> int:
    """A port nothing listens on, for a daemon that must be told its port before it binds it.

    Taken from below the kernel's ephemeral range, where bind(("", 0)) never lands: a port that
    bind(0) handed out and this closed could be handed out again, to a server binding port 0
    meanwhile (the tests' fake engines and agents do), before the daemon binds it (a store's URL
    then answered with a fake vLLM's metrics). Random, so that parallel workers seldom pick the
    same one, and checked free."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _PORTS.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


_PORTS = random.Random()  # seeded from the OS: each xdist worker its own sequence


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default 32768)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > 11_000 else 32768


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    for (sample_name, sample_labels), v in samples(text).items():
        if sample_name == name and all((k, val) in sample_labels for k, val in labels.items()):
            return v
    raise KeyError((name, labels))


class Daemon:
    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log = (tmp_path / f"daemon-{self.port}.log").open("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--listen", f"127.0.0.1:{self.port}", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **(env or {})},
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_for(self, predicate: object, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}: {self.output()}")
            try:
                _status, last = fetch(self.url + "/metrics")
                if callable(predicate) and predicate(last):
                    return last
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"timed out; last scrape:\n{last[:2000]}\nlog:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[type[Daemon]]:
    started: list[Daemon] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Daemon:
        d = Daemon(tmp_path, *args, env=env)
        started.append(d)
        return d

    yield start  # type: ignore[misc]
    for d in started:
        d.stop()


def polls_at_least(n: int) -> object:
    def check(text: str) -> bool:
        try:
            return value(text, "gpuledger_polls_total") >= n
        except KeyError:
            return False

    return check


# -- the helper: commands forked from the CLI server give what a fresh interpreter gives -------


def test_a_forked_command_gives_what_a_fresh_interpreter_gives(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("pricing: {gpu_hourly: 2.5}\n")
    commands: list[tuple[tuple[str, ...], dict[str, str]]] = [
        (("--version",), {}),
        (("report", "--ledger", str(tmp_path / "none.db")), {}),  # exit 2, one line on stderr
        (("check-config", str(config)), {"GPULEDGER_PRICING__GPU_HOURLY": "lots"}),  # the environment counts
        (("simulate", "demo", "--for", "1h", "--step", "5m"), {}),  # stdout, and log lines on stderr
    ]
    for args, env in commands:
        forked = gpuledger(*args, env=env)
        fresh = subprocess.run(
            [sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=60, cwd=REPO,
            env={**os.environ, **env}, check=False,
        )  # fmt: skip
        assert forked.returncode == fresh.returncode, args
        assert forked.stdout == fresh.stdout, args
        # Log lines carry the time and the fake node's temporary directory: compare what they say.
        assert _messages(forked.stderr) == _messages(fresh.stderr), args
    assert gpuledger("check-config", str(config)).returncode == 0  # nothing of the last command's environment stays


def _messages(stderr: str) -> list[str]:
    return [re.sub(r"^\S+ \S+ |/(tmp|dev/shm)/\S+", "", line) for line in stderr.splitlines()]


def test_a_forked_command_past_its_timeout_is_killed_and_the_next_one_runs() -> None:
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        gpuledger("run", "--fake", "--listen", "127.0.0.1:0", timeout=2)
    assert time.monotonic() - started < 10
    assert gpuledger("--version").returncode == 0


def test_run_fake_serves_demo_metrics_and_health_over_http(daemon: type[Daemon]) -> None:
    d = daemon("--fake", env={"GPULEDGER_POLL_INTERVAL": "0.2s"})  # type: ignore[call-arg]
    text = d.wait_for(polls_at_least(2))
    assert value(text, "gpuledger_gpu_utilization_ratio", gpu="0") == pytest.approx(0.92)
    assert value(text, "gpuledger_gpu_memory_used_bytes", gpu="5") == 30000 * 2**20
    assert value(text, "gpuledger_gpu_up", gpu="7") == 1
    assert value(text, "gpuledger_nvml_up") == 1
    gpus = {labels for (name, labels) in samples(text) if name == "gpuledger_gpu_info"}
    assert len(gpus) == 8
    assert all("pid" not in dict(labels) for (_name, labels) in samples(text))
    status, body = fetch(d.url + "/healthz")
    assert (status, body) == (200, "ok\n")
    assert fetch(d.url + "/nope")[0] == 404
    assert d.stop() == 0


def test_run_fake_names_every_demo_workload_over_http(daemon: type[Daemon], tmp_path: Path) -> None:
    config = tmp_path / "teams.yaml"
    config.write_text(
        "attribution:\n  rules:\n"
        "    - {match: {namespace: '^research-'}, set: {team: research}}\n"
        "    - {match: {account: '^nlp$'}, set: {team: nlp}}\n"
    )
    d = daemon("--fake", "--config", str(config), env={"GPULEDGER_POLL_INTERVAL": "0.2s"})  # type: ignore[call-arg]
    text = d.wait_for(polls_at_least(3))
    keys = ("gpu", *WORKLOAD_LABELS)
    held = {
        tuple(dict(labels)[k] for k in keys)
        for (name, labels) in samples(text)
        if name == "gpuledger_workload_gpu_processes"
    }
    job = ("", "", "", "8812", "", "alice", "llama-3-8b", "nlp")
    assert held == {
        *((str(gpu), *job) for gpu in range(4)),
        ("4", "serving", "vllm-llama-0", "vllm", "", "", "", "meta-llama/Llama-3.1-8B-Instruct", ""),
        ("4", "", "", "9f2b7c1d4e5a", "", "", "carol", "BAAI/bge-large-en-v1.5", ""),
        ("5", "research-nlp", "notebook-7", "jupyter", "", "", "", "", "research"),
        ("7", "research-cv", "notebook-3", "jupyter", "", "", "", "", "research"),
    }
    assert all("pid" not in dict(labels) for (_name, labels) in samples(text))


def test_fake_speed_makes_energy_grow_at_the_simulated_rate(daemon: type[Daemon]) -> None:
    # max_interval 1h: at 3600x the default 5 min is 83 real ms, and a poll that late on a loaded
    # machine would leave scenario minutes unobserved; this test is about the simulated rate.
    env = {"GPULEDGER_POLL_INTERVAL": "0.2s", "GPULEDGER_ACCOUNTING__MAX_INTERVAL": "1h"}
    d = daemon("--fake", "--fake-speed", "3600", env=env)  # type: ignore[call-arg]
    first = d.wait_for(polls_at_least(2))  # cost counters start with the second poll's interval
    t0 = time.monotonic()
    start_polls = value(first, "gpuledger_polls_total")
    # Twenty polls, not five: each poll reads the energy counter a few real milliseconds after
    # its timestamp, seconds of scenario time at 3600x, and over five polls (an hour) that jitter
    # alone once put the rate 1.4% off on a loaded CI machine.
    second = d.wait_for(polls_at_least(start_polls + 20))
    real_elapsed = time.monotonic() - t0
    scenario_elapsed = value(second, "gpuledger_last_poll_timestamp_seconds") - value(
        first, "gpuledger_last_poll_timestamp_seconds"
    )
    energy = value(second, "gpuledger_gpu_energy_joules_total", gpu="0") - value(
        first, "gpuledger_gpu_energy_joules_total", gpu="0"
    )
    # scenario time runs an hour per second, so it outpaces real time by far
    assert scenario_elapsed > 100 * real_elapsed * 0.5
    # GPU 0 draws 55 + 345 * 0.92 = 372.4 W in the first three hours of the demo
    assert energy / scenario_elapsed == pytest.approx(372.4, rel=0.01)
    # and costs its price for every scenario hour: fast polls are the run's rhythm, not gaps
    price = value(second, "gpuledger_gpu_price_dollars_per_hour", gpu="0")
    cost = value(second, "gpuledger_gpu_cost_dollars_total", gpu="0") - value(
        first, "gpuledger_gpu_cost_dollars_total", gpu="0"
    )
    assert cost == pytest.approx(price * scenario_elapsed / 3600, rel=0.01)


def test_healthz_is_503_while_no_poll_succeeds(daemon: type[Daemon], tmp_path: Path) -> None:
    scenario = tmp_path / "no-driver.yaml"
    scenario.write_text("gpus: [{count: 1}]\nfaults: [{call: '*', error: DRIVER_NOT_LOADED}]\n")
    d = daemon("--fake", str(scenario), env={"GPULEDGER_POLL_INTERVAL": "0.2s"})  # type: ignore[call-arg]
    text = d.wait_for(polls_at_least(3))
    assert value(text, "gpuledger_nvml_up") == 0
    assert value(text, "gpuledger_poll_failures_total") >= 3
    assert value(text, "gpuledger_nvml_errors_total", error="DRIVER_NOT_LOADED") >= 1
    assert fetch(d.url + "/healthz")[0] == 503


def test_run_without_a_driver_exits_1_with_one_line() -> None:
    result = gpuledger("run", "--listen", f"127.0.0.1:{free_port()}")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "libnvidia-ml.so.1" in lines[0]
    assert "--fake" in lines[0]
    assert "Traceback" not in result.stderr


def test_snapshot_prints_a_table_of_the_demo_node() -> None:
    result = gpuledger("snapshot", "--fake")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("gpu-node-01")
    table = lines[2 : lines.index("")]
    rows = {line.split()[0]: line.split() for line in table}
    assert set(rows) == {str(i) for i in range(8)}
    assert rows["0"][3] == "92%"
    assert rows["5"][3] == "0%"
    assert rows["5"][4] == "29.3/80"


def test_snapshot_escapes_the_node_and_model_names_it_prints(tmp_path: Path) -> None:
    # Workload labels were escaped already; the node's name, the driver's model name and the
    # price notes reached the terminal raw (\x1b[2J clears the screen, \x1b]0;..\x07 sets its title).
    scenario = tmp_path / "escapes.yaml"
    scenario.write_text('{node: {hostname: "node\\e[2J"}, gpus: [{model: "A100\\e]0;x\\a"}]}\n')
    result = gpuledger("snapshot", "--fake", str(scenario))
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout
    assert "\x07" not in result.stdout
    title, header, row = result.stdout.splitlines()[:3]
    assert title.startswith("node\\x1b[2J  driver ")
    assert row.split()[:3] == ["0", "A100\\x1b]0;x\\x07", "yes"]
    # The widths are those of the escaped text: the columns stay aligned.
    assert row.index("yes") == header.index("UP")


def test_snapshot_json_carries_every_device() -> None:
    import json

    result = gpuledger("snapshot", "--fake", "mig", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [d["gpu"] for d in data["devices"]] == ["0", "0:0", "0:1", "1"]
    assert data["devices"][1]["parent_uuid"] == data["devices"][0]["uuid"]
    assert data["devices"][0]["utilization"] is None


def test_simulate_runs_scenario_time_without_sleeping(tmp_path: Path) -> None:
    out = tmp_path / "metrics.prom"
    started = time.monotonic()
    result = gpuledger("simulate", "weekend-idle", "--for", "6h", "--step", "60s", "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 30
    text = out.read_text()
    assert value(text, "gpuledger_polls_total") == 6 * 60 + 1
    # the job died at 4h: every GPU is idle at 6h
    assert value(text, "gpuledger_gpu_utilization_ratio", gpu="3") == 0
    # 4 h at 55 + 345 * 0.95 = 382.75 W, then 2 h at 55 W idle
    assert value(text, "gpuledger_gpu_energy_joules_total", gpu="3") == pytest.approx(
        4 * 3600 * 382.75 + 2 * 3600 * 55, rel=1e-6
    )
    ts = value(text, "gpuledger_last_poll_timestamp_seconds")
    assert ts == pytest.approx(1795197600 + 6 * 3600)  # 2026-11-20T18:00Z + 6 h


def test_simulate_honours_every_output_option_run_honours(tmp_path: Path) -> None:
    config = tmp_path / "gpuledger.yml"
    textfile = tmp_path / "textfile" / "gpuledger.prom"
    textfile.parent.mkdir()
    config.write_text(
        "exporters: {dcgm_compat: true, textfile_path: " + str(textfile) + "}\nattribution: {per_pid_series: true}\n"
    )
    out = tmp_path / "metrics.prom"
    result = gpuledger("simulate", "demo", "--for", "2m", "--config", str(config), "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert value(text, "gpuledger_polls_total") == 2 * 4 + 1  # every 15 s from t=0 to 2 min
    # dcgm-exporter's names beside gpuledger's, from the same state: the demo's GPU 0 runs at 92%.
    assert value(text, "DCGM_FI_DEV_GPU_UTIL", gpu="0") == value(text, "gpuledger_gpu_utilization_ratio", gpu="0") * 100
    # per-pid series: a pid label on every workload series, naming each process the demo runs
    # (and empty on allocations that run none)
    pids = {dict(labels).get("pid") for name, labels in samples(text) if name == "gpuledger_workload_gpu_processes"}
    running = {str(p.pid) for p in load_scenario("demo").processes if p.running_at(120)}
    assert pids - {""} == running
    # and the node_exporter textfile holds the same final state
    assert textfile.read_text() == text


def test_simulate_checks_the_textfile_directory_as_run_does(tmp_path: Path) -> None:
    config = tmp_path / "gpuledger.yml"
    missing = tmp_path / "nowhere" / "gpuledger.prom"
    config.write_text(f"exporters: {{textfile_path: {missing}}}\n")
    result = gpuledger("simulate", "demo", "--for", "1m", "--config", str(config))
    assert result.returncode == 2
    assert result.stderr.strip() == f"gpuledger: exporters.textfile_path: no such directory {missing.parent}"


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (("snapshot", "--fake", "no-such-scenario"), "no-such-scenario"),
        (("simulate", "demo", "--for", "soon"), "--for"),
        (("simulate", "demo", "--for", "1h", "--step", "0s"), "--step"),
        (("run", "--fake", "--listen", "nonsense"), "--listen"),
        (("frobnicate",), "frobnicate"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_naming_them(args: tuple[str, ...], expect: str) -> None:
    result = gpuledger(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expect in lines[0]
    assert "Traceback" not in result.stderr


def test_bad_scenario_exits_2_naming_the_key(tmp_path: Path) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text("gpus: [{count: 2}]\nprocesses:\n  - {pid: 1, gpus: [0]}\n  - {pid: 2, gpus: [5]}\n")
    result = gpuledger("snapshot", "--fake", str(scenario))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "processes[1].gpus" in result.stderr
    assert "GPU 5" in result.stderr


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("poll_interval: often\n")
    result = gpuledger("run", "--fake", "--config", str(config), "--listen", f"127.0.0.1:{free_port()}")
    assert result.returncode == 2
    assert "poll_interval" in result.stderr
    assert str(config) in result.stderr
    assert "Traceback" not in result.stderr


def test_run_refuses_a_poll_interval_that_no_interval_is_charged_for() -> None:
    # Polling every 10m on a real node with the default max_interval (5m) booked every interval,
    # all the GPUs' time and dollars, unobserved.
    env = {"GPULEDGER_POLL_INTERVAL": "10m"}
    result = gpuledger("run", "--listen", f"127.0.0.1:{free_port()}", env=env, timeout=20)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "gpuledger: poll_interval (10m) must be shorter than accounting.max_interval (5m), "
        "or every interval is booked unobserved"
    ]


def test_check_config_reports_every_problem_with_its_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        "poll_interval: often\npricing: {gpu_hourly: -2, by_modle: {}}\nrules:\n  idle: {utilization_below: 5}\n"
    )
    result = gpuledger("check-config", str(config))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    keys = [line.split(": ")[1] for line in lines]
    assert keys == ["poll_interval", "pricing.gpu_hourly", "pricing.by_modle", "rules.idle.utilization_below"]
    good = tmp_path / "good.yaml"
    good.write_text("poll_interval: 10s\npricing: {gpu_hourly: 2.5}\n")
    ok = gpuledger("check-config", str(good))
    assert ok.returncode == 0
    assert ok.stdout.strip().endswith("ok")


def test_a_mapping_given_whole_and_key_by_key_is_refused() -> None:
    # Whichever of the two variables came last won: the L4's price could be dropped unsaid.
    env = {"GPULEDGER_PRICING__BY_MODEL__L4": "0.8", "GPULEDGER_PRICING__BY_MODEL": '{"H100-SXM5-80GB": 4.0}'}
    result = gpuledger("check-config", os.devnull, env=env)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "environment: GPULEDGER_PRICING__BY_MODEL and GPULEDGER_PRICING__BY_MODEL__L4 both set "
        "pricing.by_model: give it whole (JSON) or key by key, not both"
    ]
    # A whole section does merge with its keys' variables.
    env = {"GPULEDGER_PRICING__BY_MODEL__L4": "0.8", "GPULEDGER_PRICING": '{"energy_per_kwh": 0.1}'}
    assert gpuledger("check-config", os.devnull, env=env).returncode == 0


def test_an_action_variable_set_key_by_key_is_refused(tmp_path: Path) -> None:
    # The command was handed slurm_conf=/etc/slurm.conf, not the SLURM_CONF it was configured with.
    config = tmp_path / "actions.yaml"
    config.write_text("actions:\n  triggers:\n    drain: {flag: idle, scope: gpu, command: [/bin/true]}\n")
    result = gpuledger("check-config", str(config), env={"GPULEDGER_ACTIONS__TRIGGERS__DRAIN__ENV__SLURM_CONF": "/x"})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "environment: GPULEDGER_ACTIONS__TRIGGERS__DRAIN__ENV__SLURM_CONF: the command's variable would be named "
        "slurm_conf (names are read lowercased); give actions.triggers.drain.env whole as JSON in "
        "GPULEDGER_ACTIONS__TRIGGERS__DRAIN__ENV"
    ]


def test_a_misspelt_top_level_variable_is_named_with_the_nearest_setting() -> None:
    # GPULEDGER_POLL_INTERVALL was ignored without a word (the agent polled every 5s, not 30s),
    # while a misspelt nested key is an error. Kubernetes' service links for a Service named
    # gpuledger set nothing and are no typo: they pass unremarked.
    env = {
        "GPULEDGER_POLL_INTERVALL": "30s",
        "GPULEDGER_SERVICE_HOST": "10.0.0.7",
        "GPULEDGER_SERVICE_PORT_METRICS": "9835",
        "GPULEDGER_PORT": "tcp://10.0.0.7:9835",
        "GPULEDGER_PORT_9835_TCP_ADDR": "10.0.0.7",
    }
    result = gpuledger("check-config", os.devnull, env=env)
    assert result.returncode == 0
    assert result.stderr.splitlines() == [
        "warning: environment: GPULEDGER_POLL_INTERVALL: no such setting, ignored "
        "(did you mean GPULEDGER_POLL_INTERVAL?)"
    ]
    assert "30s" not in result.stderr  # names only: a value may be a secret


def test_environment_overrides_the_file_and_bad_values_name_the_variable(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("pricing: {gpu_hourly: 2.5}\n")
    result = gpuledger("check-config", str(config), env={"GPULEDGER_PRICING__GPU_HOURLY": "lots"})
    assert result.returncode == 2
    assert "GPULEDGER_PRICING__GPU_HOURLY" in result.stderr
    assert "pricing.gpu_hourly" in result.stderr


# -- simulate's output: a summary by default, the exposition where asked, progress on a TTY --


def test_simulate_prints_a_summary_whose_dollars_add_up(tmp_path: Path) -> None:
    from agent.config import load_catalogue

    result = gpuledger("simulate", "demo", "--for", "2h")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "simulated 2h of 'demo' in 481 polls"  # one at t=0, then 2h / 15 s = 480 steps
    assert "# TYPE" not in result.stdout  # not the exposition
    gpu_time = next(line for line in lines if line.strip().startswith("GPU time"))
    assert "16.00 GPU-hours observed, 0.00 unobserved" in gpu_time  # 8 GPUs x 2 h, watched throughout
    cost = next(line for line in lines if line.strip().startswith("cost"))
    charged, idle, unobserved = (float(part.split("$")[1].split()[0].replace(",", "")) for part in cost.split(","))
    # The demo node is a p4de.24xlarge: its hourly price over its 8 GPUs, for 8 GPUs x 2 h.
    p4de = load_catalogue().instance_types["p4de.24xlarge"]
    whole = p4de.dollars_per_hour / 8 * 8 * 2
    assert unobserved == 0.0
    assert charged > 0
    assert idle > 0
    assert charged + idle + unobserved == pytest.approx(whole, abs=0.011)  # each figure rounded to the cent
    assert "flags now    " in result.stdout
    assert "idle (GPU 6)" in result.stdout


def test_simulate_writes_the_exposition_to_stdout_when_asked() -> None:
    result = gpuledger("simulate", "demo", "--for", "1m", "--metrics-out", "-")
    assert result.returncode == 0, result.stderr
    families = {f.name for f in text_string_to_metric_families(result.stdout)}
    assert {"gpuledger_gpu_cost_dollars", "gpuledger_polls"} <= families
    assert "simulated" not in result.stdout


# NVML calls that only the readings shown in metrics text alone make: the readings groups'
# (agent/devices/telemetry.py) and the temperature's. The groups' field ids, and the NVLinks'
# states, ride in the field-values call that every poll makes anyway.
TEXT_ONLY_CALLS = frozenset(
    {
        "nvmlDeviceGetTemperature",  # the temperature
        "nvmlDeviceGetClockInfo",  # clocks
        "nvmlDeviceGetPerformanceState",  # clocks
        "nvmlDeviceGetCurrentClocksEventReasons",  # throttle
        "nvmlDeviceGetCurrPcieLinkGeneration",  # pcie
        "nvmlDeviceGetCurrPcieLinkWidth",  # pcie
        "nvmlDeviceGetEncoderUtilization",  # codecs
        "nvmlDeviceGetDecoderUtilization",  # codecs
    }
)


def simulated_in_process(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[str, Counter[str], AgentState]:
    """`gpuledger simulate ARGS` in this process: its stdout, each NVML call its fake node
    answered, and the agent's last state."""
    import agent.cli.simulate
    from agent.cli.main import main
    from agent.cli.wiring import Agent, build_agent

    built: list[Agent] = []

    def keep(*positional: Any, **named: Any) -> Agent:
        built.append(build_agent(*positional, **named))
        return built[-1]

    with monkeypatch.context() as patch:
        patch.setattr(agent.cli.simulate, "build_agent", keep)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["simulate", *args]) == 0
    node = built[0].node
    assert node is not None
    return out.getvalue(), node.calls, built[0].pipeline.state


def ledger_rows(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of a ledger but those that say which file it is and when it was
    made (its id, its creation and its migrations' wall-clock times), in order."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        assert {"ledger_meta", "schema_version", "gpu_hours"} <= set(tables)
        return {
            table: sorted(db.execute(f"SELECT * FROM {table}"), key=repr)
            for table in tables
            if table not in ("ledger_meta", "schema_version")
        }


def test_simulate_reads_what_only_metrics_text_shows_only_for_metrics_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The readings groups, the temperature and the NVLinks' states reach only the metrics
    text: a simulation that writes none does not read them, and its ledger and summary are the
    same as where they are read. The health scenario has hardware trouble of every kind, so every
    group has something to read."""
    plain, shown, textfile = tmp_path / "plain.db", tmp_path / "shown.db", tmp_path / "node.prom"
    summary, calls, state = simulated_in_process(monkeypatch, "health", "--for", "2h", "--ledger", str(plain))
    assert not TEXT_ONLY_CALLS & calls.keys()
    assert calls["nvmlDeviceGetFieldValues"] > 0  # the readings that are not text-only are read
    assert all(d.temperature_c is None and d.nvlinks == () for d in devices(state))
    assert all(d.energy_j is not None for d in devices(state))

    metrics = tmp_path / "metrics.prom"
    args = ("health", "--for", "2h", "--ledger", str(shown), "--metrics-out", str(metrics))
    summary_shown, calls_shown, state_shown = simulated_in_process(monkeypatch, *args)
    assert all(calls_shown[call] > 0 for call in TEXT_ONLY_CALLS), calls_shown
    assert all(d.temperature_c is not None for d in devices(state_shown))
    assert any(d.nvlinks for d in devices(state_shown))
    text = metrics.read_text()
    assert "gpuledger_gpu_sm_clock_hertz" in text
    assert "gpuledger_gpu_temperature_celsius" in text
    assert "gpuledger_gpu_nvlink_up" in text
    assert ledger_rows(plain) == ledger_rows(shown)
    assert (
        summary.replace(str(plain), "LEDGER")
        == "\n".join(
            line for line in summary_shown.replace(str(shown), "LEDGER").splitlines() if "metrics.prom" not in line
        )
        + "\n"
    )

    # A textfile in the settings is metrics text too.
    config = tmp_path / "gpuledger.yaml"
    config.write_text(f"exporters:\n  textfile_path: {textfile}\n", encoding="utf-8")
    _, calls_textfile, _ = simulated_in_process(monkeypatch, "health", "--for", "10m", "--config", str(config))
    assert all(calls_textfile[call] > 0 for call in TEXT_ONLY_CALLS), calls_textfile
    assert "gpuledger_gpu_temperature_celsius" in textfile.read_text()


def devices(state: AgentState) -> tuple[DeviceReading, ...]:
    assert state.snapshot is not None
    return state.snapshot.devices


def test_simulate_writes_its_ledger_once_a_scenario_hour(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulation flushes its ledger once a scenario hour, not at the daemon's every minute
    (which is many times a real second here), unless ledger.flush_interval is longer; its rows
    are those the daemon's rhythm writes, but for the last bits of sums added up in fewer parts."""
    import agent.ledger.store
    from agent.cli.wiring import build_agent
    from agent.config import load_config
    from agent.pipeline import run_on_scenario_time

    flushes: list[str] = []
    real_flush = agent.ledger.store.Ledger.flush

    def counted(self: agent.ledger.store.Ledger) -> bool:
        flushes.append(self._path.name)
        return real_flush(self)

    monkeypatch.setattr(agent.ledger.store.Ledger, "flush", counted)
    hourly, daily, minutely = tmp_path / "hourly.db", tmp_path / "daily.db", tmp_path / "minutely.db"
    # Two GPUs, one held by a process that ends part-way through an hour, one idle: every table
    # gets rows, in a fraction of the demo node's polls.
    node = tmp_path / "node.yaml"
    node.write_text(
        "start: 2026-11-20T00:00:00Z\ngpus: [{count: 2}]\n"
        "processes: [{pid: 4242, gpus: [0], sm_util: 40, user: ann, uid: 1001, end: 100m}]\n",
        encoding="utf-8",
    )
    simulated_in_process(monkeypatch, str(node), "--for", "3h", "--ledger", str(hourly))
    assert flushes == ["hourly.db"] * 3  # at 1h, 2h and 3h (and the close's own write)

    config = tmp_path / "gpuledger.yaml"
    config.write_text("ledger:\n  flush_interval: 2h\n", encoding="utf-8")
    flushes.clear()
    simulated_in_process(monkeypatch, str(node), "--for", "3h", "--ledger", str(daily), "--config", str(config))
    assert flushes == ["daily.db"]  # a longer interval is kept: at 2h

    # The daemon's rhythm on the same clock: a flush each scenario minute.
    flushes.clear()
    daemon = build_agent(
        load_config(None), fake=node, ledger_path=minutely, poll_interval_s=15, actions="dry_run", ledger_fsync=False
    )
    assert daemon.node is not None
    run_on_scenario_time(daemon.pipeline.jobs(), daemon.node.clock.advance, 3 * 3600, 15)
    assert daemon.close()
    assert len(flushes) == 180
    written, expected = ledger_rows(hourly), ledger_rows(minutely)
    assert written.keys() == expected.keys()
    assert all(expected[table] for table in ("workload_hours", "gpu_hours", "idle_hours", "sizing_hours"))
    for table, rows in expected.items():
        assert len(written[table]) == len(rows), table
        for got, want in zip(sorted(written[table], key=_keys), sorted(rows, key=_keys), strict=True):
            assert _keys(got) == _keys(want), table
            assert got == pytest.approx(want, rel=1e-12), table
    assert ledger_rows(daily) == ledger_rows(hourly)


def _keys(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """A ledger row's cells but its sums (floats), which the flushes' rhythm can change in the
    last bits."""
    return tuple(cell for cell in row if not isinstance(cell, float))


def test_simulate_shows_progress_on_a_terminal_only() -> None:
    import fcntl
    import pty
    import struct
    import termios

    controller, terminal = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, in which tqdm draws an empty bar: give it 80.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    with os.fdopen(controller, "rb", buffering=0) as tty:
        process = subprocess.Popen(
            [sys.executable, "-m", "agent", "simulate", "demo", "--for", "1h"],
            stdout=subprocess.PIPE,
            stderr=terminal,
            cwd=REPO,
        )
        os.close(terminal)
        seen = b""
        while True:
            try:
                chunk = tty.read(4096)
            except OSError:  # the terminal closed: the process is done with it
                break
            if not chunk:
                break
            seen += chunk
        out, _ = process.communicate(timeout=120)
    assert process.returncode == 0
    assert b"simulate demo" in seen
    assert b"poll" in seen
    # ...and never in the output a script reads.
    assert b"poll/s" not in out
    assert out.startswith(b"simulated 1h of 'demo'")
    piped = gpuledger("simulate", "demo", "--for", "15m")
    assert "simulate demo" not in piped.stderr  # stderr not a terminal: no bar


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (("snapshot", "--at", "1h"), "gpuledger: --at: only meaningful with --fake"),
        (("snapshot", "--fake", "--at", "400d"), "gpuledger: --at: at most 366d, got 400d"),
    ],
)
def test_snapshot_at_is_bounded_and_needs_a_fake_node(args: tuple[str, ...], expect: str) -> None:
    result = gpuledger(*args, timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip() == expect


def test_sigterm_while_another_process_holds_the_ledger_lost_rows_are_logged_within_the_grace(
    daemon: type[Daemon], tmp_path: Path
) -> None:
    """The ledger's busy timeout (5 s) is longer than the shutdown grace (4.5 s): a closing flush
    that waited it out was cut off by the deadline, exit 1 with a line blaming the GPU driver and
    no word of the charges lost. The flush now waits only what the grace leaves, and the README's
    promise holds: the lost rows are logged with their dollars, and `run` exits 1."""
    ledger = tmp_path / "ledger.db"
    d = daemon("--fake", "--ledger", str(ledger), env={"GPULEDGER_POLL_INTERVAL": "0.2s"})  # type: ignore[call-arg]
    d.wait_for(polls_at_least(3))
    holder = sqlite3.connect(ledger, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        started = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(timeout=15)
        took_s = time.monotonic() - started
    finally:
        holder.close()
    log = d.output()
    assert code == 1, log
    assert took_s < 5.0, log  # the README's bound: the grace, from when the main loop sees the signal
    assert "that could not be written" in log
    assert "driver" not in log.split("shutting down", 1)[1], log


def test_snapshot_of_a_real_driver_polls_twice_so_gpm_has_an_interval(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --fake the driver is the one pynvml loads: here the fake installed in its place,
    its clock running with the wall clock, as a real H200's would. A single poll had no GPM
    figure at all (the first GPM sample has nothing to compare with): `snapshot` on a real H200
    showed no busy figure where `snapshot --fake` did."""
    import json

    import fake_nvml
    from agent.cli.main import main

    node = {
        "gpus": [{"model": "H200"}],
        "processes": [{"pid": 7000, "gpus": [0], "sm_util": 100, "sm_active": 25, "memory_mib": 3000}],
    }
    fake_nvml.install(node, host=False, speed=1.0)
    try:
        assert main(["snapshot", "--json"]) == 0
    finally:
        fake_nvml.uninstall()
    device = json.loads(capsys.readouterr().out)["devices"][0]
    assert device["busy_source"] == "gpm"
    activity = device["activity"]
    assert activity["sm_active"] == pytest.approx(0.25)
    # Its span: the second of wall time between the two polls (give or take the polls' own time).
    assert activity["until"] - activity["since"] == pytest.approx(1.0, abs=0.5)
