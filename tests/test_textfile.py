"""node_exporter textfile-collector output: one atomic rewrite per poll, off the scrape path."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import exporters.textfile
import fake_nvml
from agent.config import check_config
from agent.model import AgentHealth, AgentState
from exporters.http import MetricsServer
from exporters.prometheus import make_registry
from exporters.textfile import TextfileWriter, write_atomic
from tests.helpers import Rig, hang_file_syncs
from tests.test_cli import Daemon, gpuledger, value


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    fake_nvml.uninstall()


@pytest.fixture(scope="module")
def demo_states() -> list[AgentState]:
    """Three successive polls of the demo node, a minute apart."""
    rig = Rig("demo")
    try:
        return [rig.poll(), rig.poll(60), rig.poll(60)]
    finally:
        rig.close()


def render(state: AgentState) -> bytes:
    return generate_latest(make_registry(lambda: state))


class Source:
    """A pipeline stand-in: `state` is swapped for a new object at each "poll"."""

    def __init__(self, state: AgentState) -> None:
        self.state = state

    def __call__(self) -> AgentState:
        return self.state


def test_the_file_is_the_whole_exposition_and_promtool_accepts_it(
    tmp_path: Path, demo_states: list[AgentState]
) -> None:
    path = tmp_path / "gpuledger.prom"
    writer = TextfileWriter(path, Source(demo_states[0]), render)
    assert writer.write_if_new()
    assert path.read_bytes() == render(demo_states[0])
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # node_exporter runs as another user
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpuledger.prom"]  # no temp file left behind
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (scripts/check installs it)")
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=path.read_text(), capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (result.stdout + result.stderr).strip() == ""


def test_each_poll_is_written_once_and_nothing_before_the_first(tmp_path: Path, demo_states: list[AgentState]) -> None:
    path = tmp_path / "gpuledger.prom"
    source = Source(AgentState())  # the pipeline's state before its first poll
    writer = TextfileWriter(path, source, render)
    assert not writer.write_if_new()
    assert not path.exists()
    for state in demo_states:
        source.state = state
        assert writer.write_if_new()
        assert not writer.write_if_new()  # the same poll again: no rewrite
        assert path.read_bytes() == render(state)
    assert writer.writes == len(demo_states)


def test_a_reader_never_sees_a_partial_file(tmp_path: Path, demo_states: list[AgentState]) -> None:
    path = tmp_path / "gpuledger.prom"
    versions = [render(state) for state in demo_states]
    assert len(set(versions)) == len(versions)
    for version in versions:  # each complete version parses: a read equal to one does too
        assert list(text_string_to_metric_families(version.decode()))
    write_atomic(path, versions[0])
    done = threading.Event()
    bad: list[str] = []
    reads = 0

    def reader() -> None:
        nonlocal reads
        while not done.is_set():
            data = path.read_bytes()
            reads += 1
            if data not in versions:
                bad.append(f"read {len(data)} bytes matching no complete version")
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(300):
            write_atomic(path, versions[i % len(versions)])
    finally:
        done.set()
        thread.join()
    assert bad == []
    assert reads > 50  # the reader really ran alongside the writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpuledger.prom"]


def scrape(server: MetricsServer) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def test_scrapes_never_write_the_file(
    tmp_path: Path, demo_states: list[AgentState], monkeypatch: pytest.MonkeyPatch
) -> None:
    writing_threads: list[str] = []
    real_write = exporters.textfile.write_atomic

    def recording_write(path: Path, data: bytes, mode: int = 0o644) -> None:
        writing_threads.append(threading.current_thread().name)
        real_write(path, data, mode)

    monkeypatch.setattr(exporters.textfile, "write_atomic", recording_write)
    path = tmp_path / "gpuledger.prom"
    source = Source(demo_states[0])
    server = MetricsServer("127.0.0.1", 0, make_registry(source), healthy=lambda: True, state=source)
    writer = TextfileWriter(path, source, render)
    server.start()
    try:
        # A scrape renders the state; with the writer not running, nothing is written at all.
        for _ in range(10):
            assert "gpuledger_gpu_info" in scrape(server)
        assert not path.exists()
        assert writing_threads == []

        writer.start(poll_interval_s=0.2)  # checks every 50 ms
        for state in demo_states:
            source.state = state
            deadline = time.monotonic() + 10
            while not path.exists() or path.read_bytes() != render(state):
                assert time.monotonic() < deadline, "the writer never wrote the new poll"
                scrape(server)
                time.sleep(0.01)
        # The file is renamed into place a moment before the writer counts the write.
        deadline = time.monotonic() + 10
        while writer.writes < len(demo_states) and time.monotonic() < deadline:
            time.sleep(0.01)
        written = writer.writes
        inode = path.stat().st_ino
        for _ in range(20):  # scrapes of an unchanged state: no rewrite
            scrape(server)
        time.sleep(0.2)
        assert writer.writes == written == len(demo_states)
        assert path.stat().st_ino == inode
    finally:
        writer.stop()
        server.stop()
    # Every write ran on the writer's schedule thread, none in an HTTP request thread.
    assert len(writing_threads) == written
    assert not any(name.startswith("metrics-http") for name in writing_threads)  # the server's threads


def test_a_failed_write_is_logged_once_and_retried(
    tmp_path: Path, demo_states: list[AgentState], caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "collector"
    path = directory / "gpuledger.prom"
    source = Source(demo_states[0])
    writer = TextfileWriter(path, source, render)
    with caplog.at_level(logging.WARNING, logger="exporters.textfile"):
        assert not writer.write_if_new()  # the directory does not exist (yet)
        source.state = demo_states[1]
        assert not writer.write_if_new()
    assert writer.failures == 2
    assert len([r for r in caplog.records if "textfile not written" in r.getMessage()]) == 1
    directory.mkdir()
    assert writer.write_if_new()
    assert path.read_bytes() == render(demo_states[1])


def test_the_daemon_rewrites_the_file_after_polls(tmp_path: Path) -> None:
    path = tmp_path / "node-exporter" / "gpuledger.prom"
    path.parent.mkdir()
    env = {"GPULEDGER_POLL_INTERVAL": "0.2s", "GPULEDGER_EXPORTERS__TEXTFILE_PATH": str(path)}
    daemon = Daemon(tmp_path, "--fake", env=env)
    try:
        deadline = time.monotonic() + 30
        polls: list[float] = []
        while len(set(polls)) < 3:
            assert time.monotonic() < deadline, daemon.output()
            if path.exists():
                polls.append(value(path.read_text(), "gpuledger_polls_total"))
            time.sleep(0.1)
        assert polls == sorted(polls)  # each version is a later poll
        assert value(path.read_text(), "gpuledger_gpu_utilization_ratio", gpu="0") == pytest.approx(0.92)
    finally:
        assert daemon.stop() == 0
    assert [p.name for p in path.parent.iterdir()] == ["gpuledger.prom"]


def test_textfile_path_must_be_a_prom_file_in_an_existing_directory(tmp_path: Path) -> None:
    config = tmp_path / "gpuledger.yaml"
    config.write_text("exporters: {textfile_path: /var/lib/node_exporter/gpuledger.txt}\n")
    _settings, problems = check_config(config)
    assert len(problems) == 1
    assert "exporters.textfile_path" in problems[0]
    assert "*.prom" in problems[0]
    missing = tmp_path / "no-such-dir" / "gpuledger.prom"
    result = gpuledger(
        "run", "--fake", "--listen", "127.0.0.1:0", env={"GPULEDGER_EXPORTERS__TEXTFILE_PATH": str(missing)}
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"gpuledger: exporters.textfile_path: no such directory {missing.parent}"
    ]


def test_health_counters_alone_make_a_new_version(tmp_path: Path, demo_states: list[AgentState]) -> None:
    # A failed poll keeps the last snapshot but swaps in new counters: that is a new version too.
    path = tmp_path / "gpuledger.prom"
    source = Source(demo_states[0])
    writer = TextfileWriter(path, source, render)
    assert writer.write_if_new()
    failed = replace(demo_states[0], health=replace(demo_states[0].health, polls_failed=1))
    assert isinstance(failed.health, AgentHealth)
    source.state = failed
    assert writer.write_if_new()
    assert value(path.read_text(), "gpuledger_poll_failures_total") == 1
    assert os.path.getsize(path) == len(render(failed))


def test_a_directory_that_cannot_be_synced_is_no_failed_write(
    tmp_path: Path, demo_states: list[AgentState], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Some filesystems refuse fsync on a directory (EINVAL): the file is renamed into place all
    # the same, so the writer must neither log it as not written nor rewrite it at every check.
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        real_fsync(fd)

    monkeypatch.setattr(exporters.textfile.os, "fsync", fsync)
    path = tmp_path / "gpuledger.prom"
    writer = TextfileWriter(path, Source(demo_states[0]), render)
    with caplog.at_level(logging.WARNING, logger="exporters.textfile"):
        assert writer.write_if_new()
        assert not writer.write_if_new()  # the same poll: written once, not again at each check
    assert path.read_bytes() == render(demo_states[0])
    assert (writer.writes, writer.failures) == (1, 0)
    assert [r.getMessage() for r in caplog.records] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpuledger.prom"]


def test_a_write_that_never_returns_is_said_once_and_holds_up_nothing(
    tmp_path: Path, demo_states: list[AgentState], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A filesystem that stops answering (a hung NFS mount): syncing the new version does not
    # return. The check waited on it for as long as it took, nothing said so, and `stop` (the
    # daemon's shutdown) waited too, until its grace ran out and it exited 1.
    gate = hang_file_syncs(monkeypatch, exporters.textfile.os)
    monkeypatch.setattr(exporters.textfile, "WRITE_STUCK_AFTER_S", 0.2, raising=False)
    path = tmp_path / "gpuledger.prom"
    source = Source(demo_states[0])
    writer = TextfileWriter(path, source, render)
    writers = {t for t in threading.enumerate() if t.name.startswith("gpuledger-textfile")}
    try:
        with caplog.at_level(logging.INFO, logger="exporters.textfile"):
            started = time.monotonic()
            assert not writer.write_if_new()
            assert time.monotonic() - started < 1.0  # it waited for the write 0.2 s, and said so
            source.state = demo_states[1]
            for _ in range(3):  # no second write into the hung filesystem, and the stuck one said once
                assert not writer.write_if_new()
            assert (writer.writes, writer.failures) == (0, 1)
            started = time.monotonic()
            writer.stop()
            assert time.monotonic() - started < 1.0  # nothing to wait for while a write is stuck
            writing = {t for t in threading.enumerate() if t.name.startswith("gpuledger-textfile")} - writers
            assert len(writing) == 1  # the one thread in the stuck write
            gate.set()
            for thread in writing:
                thread.join(5.0)
            assert writer.write_if_new()  # it returned: the latest state is written
        assert path.read_bytes() == render(demo_states[1])
        assert (writer.writes, writer.failures) == (2, 1)  # the stuck write did write, at last
        messages = [r.getMessage() for r in caplog.records]
        assert len([m for m in messages if "a write has not returned" in m]) == 1
        assert len([m for m in messages if "the stuck write returned" in m]) == 1
    finally:
        gate.set()


def test_a_write_left_under_way_counts_once_it_is_done(
    tmp_path: Path, demo_states: list[AgentState], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A check waits on a write one check interval at most: a slower write is written all the
    # same, and must count as written, not be written a second time.
    gate = hang_file_syncs(monkeypatch, exporters.textfile.os)
    path = tmp_path / "gpuledger.prom"
    writer = TextfileWriter(path, Source(demo_states[0]), render)
    before = set(threading.enumerate())
    assert not writer.write_if_new(0.01)
    gate.set()
    for thread in set(threading.enumerate()) - before:
        thread.join(5.0)
    assert not writer.write_if_new()  # that state is in the file already
    assert (writer.writes, writer.failures) == (1, 0)
    assert path.read_bytes() == render(demo_states[0])
