"""A driver call that never returns cannot freeze the agent: the stuck GPU reads as down
(TIMEOUT), the other GPUs keep being polled, /healthz fails, and past the hard deadline the
agent flushes the ledger and exits non-zero; SIGTERM during the hang ends it within 5 s.

The hang is the fake library's latency fault: the call sleeps (in real time) far longer than
any test, on one GPU, from one scenario moment on."""

from __future__ import annotations

import linecache
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import pytest

from agent import deadline
from agent.attribution.sources.procfs import Passwd, ProcessSource
from agent.cli.wiring import build_agent
from agent.config import Settings, WatchdogConfig
from agent.deadline import CallTimeout, Worker
from agent.model import AgentState
from agent.pipeline import DriverHung
from tests.helpers import WAITS_ON_REAL_TIME
from tests.test_cli import Daemon, free_port

pytestmark = WAITS_ON_REAL_TIME

REPO = Path(__file__).resolve().parent.parent

# Two GPUs; from 1 minute in, every call on GPU 1 takes an hour.
HUNG_SCENARIO = """
start: 2026-11-20T18:00:00Z
node: {hostname: hung-node, instance_type: p4d.24xlarge}
gpus: [{model: A100-SXM4-80GB, count: 2}]
processes:
  - {pid: 100, gpus: [0], sm_util: 90, memory_mib: 1000, uid: 1000, user: alice, cmdline: "python a.py"}
  - {pid: 101, gpus: [1], sm_util: 90, memory_mib: 1000, uid: 1001, user: bob, cmdline: "python b.py"}
faults:
  - {at: 1m, gpu: 1, latency_ms: 3600000}
"""


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "hung.yaml"
    path.write_text(HUNG_SCENARIO)
    return path


def test_a_stuck_gpu_reads_as_down_while_the_other_keeps_being_polled(scenario: Path) -> None:
    settings = Settings(node_name="rig", watchdog=WatchdogConfig(call_timeout=0.3, exit_after=600))
    agent = build_agent(settings, fake=scenario, costing=False, rules=())
    assert agent.node is not None
    pipeline, clock = agent.pipeline, agent.node.clock
    try:
        first = pipeline.poll_once()
        assert first.snapshot is not None
        assert [d.up for d in first.snapshot.devices] == [True, True]
        assert pipeline.healthy()

        clock.advance(120)  # GPU 1's calls now hang
        started = time.monotonic()
        timed_out = pipeline.poll_once()
        assert time.monotonic() - started < 2.0  # the poll gave up at its budget (0.3 s)
        sample = next(s for s in timed_out.health.stages if s.stage == "sample")
        assert sample.failures == 1
        assert not pipeline.healthy()  # a stuck call fails /healthz at once
        assert set(pipeline.stuck) == {first.snapshot.devices[1].uuid}

        for _ in range(3):  # the next polls skip GPU 1 and read GPU 0, without waiting
            clock.advance(15)
            started = time.monotonic()
            state = pipeline.poll_once()
            assert time.monotonic() - started < 0.3
            assert state.snapshot is not None
            gpu0, gpu1 = state.snapshot.devices
            assert gpu0.up
            assert (gpu1.up, gpu1.down_reason) == (False, "TIMEOUT")
            assert state.snapshot.taken_at == first.snapshot.taken_at + 120 + 15 * (_ + 1)
        assert not pipeline.healthy()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value for m in agent.registry().collect() for s in m.samples
        }
        gpu1_ids = (("gpu", "1"), ("uuid", gpu1.uuid))
        assert samples[("gpuledger_gpu_up", gpu1_ids)] == 0.0
        assert samples[("gpuledger_gpu_down_reason", tuple(sorted((*gpu1_ids, ("reason", "TIMEOUT")))))] == 1.0
    finally:
        agent.close()


def test_a_gpu_whose_call_returns_does_not_restart_another_stuck_gpus_clock(tmp_path: Path) -> None:
    """GPU 0 hangs for good, GPU 1 for a moment. When GPU 1's call returns, GPU 1 is read again,
    and only it: asking GPU 0 again would make another call into a hung GPU, read as healthy for
    the budget that call waits, and restart GPU 0's clock towards exit_after (once per GPU that
    recovers), putting off the exit."""
    path = tmp_path / "two.yaml"
    faults = "faults:\n  - {at: 1m, gpu: 0, latency_ms: 3600000}\n  - {at: 1m, until: 3m, gpu: 1, latency_ms: 800}\n"
    path.write_text(HUNG_SCENARIO.split("faults:", maxsplit=1)[0] + faults)
    settings = Settings(node_name="rig", watchdog=WatchdogConfig(call_timeout=0.3, exit_after=600))
    agent = build_agent(settings, fake=path, costing=False, rules=())
    assert agent.node is not None
    pipeline, clock = agent.pipeline, agent.node.clock
    try:
        pipeline.poll_once()
        clock.advance(90)
        pipeline.poll_once()  # GPU 0 gets stuck
        (gpu0, since), *_ = pipeline.stuck.items()
        pipeline.poll_once()  # then GPU 1
        assert len(pipeline.stuck) == 2
        threads = len(_poll_threads())
        clock.advance(120)  # GPU 1's fault is over: its call returns within 0.8 s, and its thread ends
        assert wait_until(lambda: len(_poll_threads()) == threads - 1, 5)
        started = time.monotonic()
        state = pipeline.poll_once()
        assert time.monotonic() - started < 0.3  # GPU 0 was not asked again
        assert pipeline.stuck == {gpu0: since}  # still stuck since it first got stuck
        assert not pipeline.healthy()
        assert state.snapshot is not None
        assert [(d.up, d.down_reason) for d in state.snapshot.devices] == [(False, "TIMEOUT"), (True, None)]
    finally:
        agent.close()


def _poll_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("gpuledger-poll")}


@pytest.mark.parametrize(
    ("faults", "wrapped", "blocking"),
    [
        pytest.param("", False, False, id="no latency fault: read in-line"),
        pytest.param("faults:\n  - {at: 1m, gpu: 1, latency_ms: 3600000}\n", False, True, id="a latency fault"),
        pytest.param("faults:\n  - {at: 1m, call: '*', latency_ms: 5}\n", False, True, id="node-wide latency"),
        pytest.param("", True, True, id="a wrapped backend"),
    ],
)
def test_only_calls_that_can_block_go_through_the_watchdog_thread(
    tmp_path: Path, faults: str, wrapped: bool, blocking: bool
) -> None:
    """The watchdog's thread guards calls that can hang. A fake node whose scenario has no
    latency fault cannot block (its calls are Python that returns), so its polls read the
    devices on their own thread: the hand-off cost simulate a tenth of its time. A latency
    fault anywhere, or a backend someone wrapped (which may do anything), keeps the guard."""
    path = tmp_path / "node.yaml"
    path.write_text(HUNG_SCENARIO.split("faults:", maxsplit=1)[0] + faults)
    before = _poll_threads()
    agent = build_agent(
        Settings(node_name="rig"), fake=path, costing=False, rules=(), wrap_backend=(lambda b: b) if wrapped else None
    )
    assert agent.node is not None
    try:
        assert agent.node.calls_can_block is (bool(faults))
        assert agent.pipeline.calls_block is blocking
        state = agent.pipeline.poll_once()
        assert state.snapshot is not None
        assert [d.up for d in state.snapshot.devices] == [True, True]
        assert (_poll_threads() - before != set()) is blocking  # a worker started only to guard calls
    finally:
        agent.close()


# -- the worker that runs the calls: a call past its budget parks its thread until it returns ------


def test_a_call_within_its_budget_returns_its_result_or_raises_its_error_on_the_same_thread() -> None:
    worker = Worker("test-worker")
    threads = [worker.call(threading.current_thread, 1.0) for _ in range(2)]
    assert threads[0] is threads[1]
    assert threads[0] is not threading.current_thread()
    with pytest.raises(ZeroDivisionError):
        worker.call(lambda: 1 / 0, 1.0)
    assert worker.call(lambda: 42, 1.0) == 42
    worker.close()


def test_a_call_past_its_budget_parks_its_thread_until_it_returns() -> None:
    gate = threading.Event()
    worker = Worker("test-worker")
    with pytest.raises(CallTimeout) as timeout:
        worker.call(lambda: gate.wait(10), 0.05)
    thread = timeout.value.thread
    assert thread is not None
    assert thread.is_alive()
    assert worker.parked == 1
    assert worker.call(lambda: 7, 1.0) == 7  # a fresh thread takes the next call
    gate.set()
    thread.join(2.0)
    assert not thread.is_alive()  # its call returned: the thread ends, the GPU is read again
    assert worker.parked == 0
    worker.close()


def test_a_call_that_returns_between_the_timeout_and_its_abandonment_ends_its_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The window: the caller's wait runs out, then the call returns and its thread goes back to
    waiting for a job before the caller marks it abandoned. That thread waited for good, read as
    a call that never returned (its GPU stuck until watchdog.exit_after). The caller's wait is
    made to run out first, then the call let go, and only once its thread is back in
    `jobs.get()` does the caller go on to abandon it."""
    gate = threading.Event()

    class LateLock:
        """The worker's `done` lock; a wait that runs out lets the call finish before it says so."""

        def __init__(self, lock: threading.Lock, thread: Callable[[], threading.Thread]) -> None:
            self._lock = lock
            self._thread = thread

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            if self._lock.acquire(blocking, timeout):
                return True
            gate.set()
            assert _waits_for_a_job(self._thread(), 5.0)
            return False

        def release(self) -> None:
            self._lock.release()

    class Late(deadline._Thread):
        def __init__(self, name: str) -> None:
            super().__init__(name)
            self.done = LateLock(self.done, lambda: self.thread)  # type: ignore[assignment]

    monkeypatch.setattr(deadline, "_Thread", Late)
    worker = Worker("test-worker")
    with pytest.raises(CallTimeout) as timeout:
        worker.call(lambda: gate.wait(10), 0.05)
    thread = timeout.value.thread
    assert thread is not None
    thread.join(2.0)
    assert not thread.is_alive()
    assert worker.parked == 0


def _waits_for_a_job(thread: threading.Thread, within_s: float) -> bool:
    """Whether `thread` is back at the top of its loop, waiting for the next job."""
    until = time.monotonic() + within_s
    while time.monotonic() < until:
        frame = sys._current_frames().get(thread.ident or 0)
        if frame is not None and "self.jobs.get()" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
            return True
        time.sleep(0.001)
    return False


def test_past_the_hard_deadline_the_poll_gives_up_for_good(scenario: Path) -> None:
    # A call budget well above what a loaded CI machine makes a healthy call take: at 0.2 s a slow
    # but healthy driver-level call was once the one caught, and the message named the driver.
    settings = Settings(node_name="rig", watchdog=WatchdogConfig(call_timeout=0.6, exit_after=1.2))
    agent = build_agent(settings, fake=scenario, costing=False, rules=())
    assert agent.node is not None
    try:
        agent.pipeline.poll_once()
        agent.node.clock.advance(120)
        agent.pipeline.poll_once()  # GPU 1 gets stuck
        time.sleep(1.3)
        with pytest.raises(DriverHung, match=r"has not returned for \ds \(GPU GPU-"):
            agent.pipeline.poll_once()
    finally:
        agent.close()


# -- the daemon -------------------------------------------------------------------------------


def healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def wait_until(condition: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def daemon(scenario: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    """`run` on the hung node at 60x (the hang starts a second in), polling every 0.5 s, a
    call budget of 1 s and a hard deadline of 6 s; with a ledger flushed only at exit."""
    port, ledger = free_port(), tmp_path / "ledger.db"
    env = {
        **os.environ,
        "GPULEDGER_POLL_INTERVAL": "0.5s",
        "GPULEDGER_WATCHDOG__CALL_TIMEOUT": "1s",
        "GPULEDGER_WATCHDOG__EXIT_AFTER": "6s",
        "GPULEDGER_LEDGER__FLUSH_INTERVAL": "1h",
        "NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
        "WATCHDOG_USEC": "400000",
    }
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(10)
    process = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--fake", str(scenario), "--fake-speed", "60",
         "--listen", f"127.0.0.1:{port}", "--ledger", str(ledger)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert notify.recv(100) == b"READY=1"  # serving
        assert notify.recv(100) == b"WATCHDOG=1"  # healthy, before the hang
        notify.close()
        yield process, port, ledger
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()  # reaps it and closes its pipes


def ledger_rows(ledger: Path) -> int:
    with closing(sqlite3.connect(ledger)) as db, db:
        return int(db.execute("SELECT count(*) FROM gpu_hours").fetchone()[0])


def test_the_daemon_exits_at_the_hard_deadline_with_the_ledger_flushed(
    daemon: tuple[subprocess.Popen[str], int, Path],
) -> None:
    process, port, ledger = daemon
    assert wait_until(lambda: healthz(port) == 503, 10)  # the stuck call fails /healthz
    _, stderr = process.communicate(timeout=20)
    code = process.returncode
    assert code == 1, stderr
    assert "flushing the ledger and exiting" in stderr
    assert "Traceback" not in stderr
    assert ledger_rows(ledger) == 2  # both GPUs' hour, written at exit (flushes were hourly)


def test_sigterm_during_a_hang_ends_the_daemon_within_5s(daemon: tuple[subprocess.Popen[str], int, Path]) -> None:
    process, port, ledger = daemon
    assert wait_until(lambda: healthz(port) == 503, 10)
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=10)
    code = process.returncode
    assert time.monotonic() - started < 5.0
    assert code == 0, stderr
    assert ledger_rows(ledger) == 2


# -- /proc: a read stuck on one process (its memory locked, an NFS or FUSE mount) ---------------


def _unblock(fifo: Path, then: bytes | None = None) -> None:
    """Let a read blocked in opening `fifo` go (a writer appears, writes nothing and leaves),
    with a regular file holding `then` in its place from now on, unless None. Nothing to let go
    where nobody is reading."""
    try:
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader
        return
    if then is not None:
        fifo.unlink()
        fifo.write_bytes(then)
    os.close(writer)


def test_a_proc_read_that_never_returns_delays_only_that_process(scenario: Path) -> None:
    """A process's environ that blocks (here a FIFO, whose open waits for a writer) stood for
    the whole poll: nothing was polled or published again, and /healthz went 503 for good. The
    read is given up on at its budget; the other process is attributed, the stuck one is left
    unresolved (and not read again while its read is stuck), and the failure is counted once."""
    agent = build_agent(Settings(node_name="rig"), fake=scenario, costing=False, rules=())
    assert agent.node is not None
    processes = agent.attributor.source(ProcessSource)
    processes.read_budget_s = 0.3
    environ = agent.node.host.proc_root / "101" / "environ"
    environ.unlink()
    os.mkfifo(environ)
    before = threading.active_count()
    polled: list[AgentState] = []
    try:
        poller = threading.Thread(target=lambda: polled.append(agent.pipeline.poll_once()), daemon=True)
        poller.start()
        poller.join(timeout=5)
        assert not poller.is_alive(), "the poll is stuck in a read of /proc/101/environ"
        for _ in range(3):  # the stuck pid is not asked again: no wait, no second thread
            started = time.monotonic()
            polled.append(agent.pipeline.poll_once())
            assert time.monotonic() - started < 0.3
        assert agent.pipeline.healthy()
        assert threading.active_count() == before + 1  # the one thread parked in the stuck read
        for state in polled:
            users = {(h.workload.user, h.pids) for h in state.attribution.holdings}
            assert users == {("alice", (100,)), ("", (101,))}
            attribute = next(s for s in state.health.stages if s.stage == "attribute")
            assert attribute.failures == 1
        _unblock(environ, then=b"")  # the read returns; the next poll reads pid 101 again
        assert wait_until(lambda: threading.active_count() == before, 5)
        state = agent.pipeline.poll_once()
        assert {(h.workload.user, h.pids) for h in state.attribution.holdings} == {
            ("alice", (100,)),
            ("bob", (101,)),
        }
    finally:
        _unblock(environ)
        agent.close()


def test_a_passwd_file_that_is_no_regular_file_neither_blocks_the_poll_nor_names_anyone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """attribution.passwd_file naming a FIFO (or /dev/stdin) blocked the poll for good in its
    read, every poll after it waiting behind it. It is read only as a regular file: until it is
    one, nobody is named, said once."""
    passwd = tmp_path / "passwd"
    os.mkfifo(passwd)
    names = Passwd(passwd)
    found: list[dict[int, str]] = []
    reader = threading.Thread(target=lambda: found.extend(names.names({1000}) for _ in range(2)), daemon=True)
    try:
        reader.start()
        reader.join(timeout=5)
        assert not reader.is_alive(), "the poll is stuck reading the passwd file"
    finally:
        _unblock(passwd)
    assert found == [{}, {}]
    assert len([r for r in caplog.records if "not a regular file" in r.getMessage()]) == 1
    passwd.unlink()
    passwd.write_text("alice:x:1000:1000::/home/alice:/bin/bash\n")
    assert names.names({1000}) == {1000: "alice"}


def test_sigterm_ends_the_daemon_when_systemds_notify_queue_is_full(tmp_path: Path) -> None:
    """A service manager that stops reading its notify socket (hung, or a wrapper that never
    reads) fills its queue; STOPPING=1, sent before the shutdown's deadline is set, then waited
    in sendto for good, and SIGTERM never ended the agent. A notification that cannot be
    delivered now is dropped (and said)."""
    path = tmp_path / "notify.sock"
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(str(path))
    manager.settimeout(30)
    daemon = Daemon(tmp_path, "--fake", env={"NOTIFY_SOCKET": str(path)})
    try:
        assert manager.recv(100) == b"READY=1"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as flood:
            flood.setblocking(False)
            assert not _fill(flood, str(path))  # the queue's length is bounded: it fills
        started = time.monotonic()
        code = daemon.stop()
        took_s = time.monotonic() - started
    finally:
        manager.close()
    output = Path(daemon.log.name).read_text()
    assert code == 0, output
    assert took_s < 5.0
    assert "cannot notify systemd" in output


def _fill(sock: socket.socket, address: str, most: int = 100_000) -> bool:
    """Send datagrams to `address` until its queue is full; True if it never filled."""
    try:
        for _ in range(most):
            sock.sendto(b"x", address)
    except BlockingIOError:
        return False
    return True
