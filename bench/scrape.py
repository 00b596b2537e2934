"""What a scrape costs under load: gpuledger's HTTP endpoint against prometheus_client's own.

(Named scrape.py, not http.py: run as a script, bench/ comes first on sys.path, and a
bench/http.py would stand in for the standard library's http module in every benchmark.)

    python bench/scrape.py [--requests 2000] [--idle 500] [--compare-tree DIR]

Each server runs in its own process on loopback, one at a time, serving the same fake node:

  gpuledger           `gpuledger run --fake` from this checkout: the real daemon, the built-in
                      `demo` node (384 series), polling every 5 s, its own HTTP server.
  gpuledger@DIR       the same daemon from another checkout (`--compare-tree`), e.g. the code
                      before a change: `git worktree add /tmp/before HEAD~1`.
  prometheus_client   the floor: prometheus_client's `start_http_server`, serving the daemon's
                      exposition (captured once, replayed by a collector), rendered per scrape.

Against each, two phases of `--requests` scrapes (a new connection each, with the Accept and
Accept-Encoding headers Prometheus sends, so OpenMetrics, gzipped):

  16 scrapers         16 threads scraping as fast as they can: latency p50 / p99 / max.
  50 scrapers + idle  first `--idle` connections are opened and held (any the server closes
                      is opened again, as a client hogging connections would), then 50
                      threads scrape: errors (timeouts, resets, refusals, non-200) and latency.

Every request has a 10 s timeout and every phase a 60 s deadline, so the run stops by itself
however badly a server does. Latency is wall time from connect to the last byte of the body;
server CPU per scrape is the server process's user+system time over the phase divided by the
scrapes it answered. Listen overflows are the kernel's counter for the whole machine (other
work on the machine adds to it). Only loopback is used.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, and this file's name would hide
# the standard library's `http` package from every import below (prometheus_client's too).
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

import argparse
import http.client
import os
import selectors
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled

# What Prometheus 2.x sends when it scrapes.
SCRAPE_HEADERS = {
    "Accept": (
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
        "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    ),
    "Accept-Encoding": "gzip",
    "User-Agent": "Prometheus/2.53.0",
}
REQUEST_TIMEOUT_S = 10.0
PHASE_DEADLINE_S = 60.0
MIN_SERIES = 384

TARGET_P99_MS_AT_16 = 20.0
TARGET_ERRORS_AT_50_WITH_IDLE = 0


@dataclass
class Phase:
    name: str
    latencies_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    not_run: int = 0
    wall_s: float = 0.0
    server_cpu_s: float = 0.0
    listen_overflows: int = 0
    idle_reopened: int = 0
    idle_failed: int = 0

    def percentile_ms(self, p: int) -> float:
        if len(self.latencies_s) < 2:
            return float("nan")
        return statistics.quantiles(self.latencies_s, n=100, method="inclusive")[p - 1] * 1000


# --- the servers --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape_once(port: int, timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", "/metrics", headers=SCRAPE_HEADERS)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def plain_exposition(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def series_count(exposition: str) -> int:
    return sum(1 for line in exposition.splitlines() if line and not line.startswith("#"))


def wait_until_serving(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench/scrape.py: the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if series_count(plain_exposition(port)) >= MIN_SERIES:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"bench/scrape.py: no exposition of {MIN_SERIES}+ series within 60 s:\n{log.read_text()}")


def start_daemon(tree: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--fake", "--listen", f"127.0.0.1:{port}"],
            cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree), "GPULEDGER_POLL_INTERVAL": "5s"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    wait_until_serving(proc, port, log)
    return proc


def start_floor(exposition: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve-floor", str(port), str(exposition)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    wait_until_serving(proc, port, log)
    return proc


def serve_floor(port: int, exposition: Path) -> int:
    """The floor's process: prometheus_client's own server and a registry of the same series."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(exposition.read_text()))

    class Replay:
        def collect(self) -> Iterable[Metric]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Replay())
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    stop.wait()
    server.shutdown()
    return 0


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def listen_overflows() -> int:
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split()[1:], values.split()[1:], strict=True)).get("ListenOverflows", 0))
    return 0


# --- the clients --------------------------------------------------------------------------


class IdleConnections:
    """Holds `count` connections open without sending a byte, opening again any the server closes."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.count = count
        self.reopened = 0
        self.failed = 0
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, name="idle-holder", daemon=True)

    def _open(self) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=REQUEST_TIMEOUT_S)
        except OSError:
            self.failed += 1
            return
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)

    def __enter__(self) -> IdleConnections:
        for _ in range(self.count):
            self._open()
        self._thread.start()
        return self

    def _hold(self) -> None:
        while not self._stop.is_set():
            for key, _events in self._selector.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                self._selector.unregister(sock)
                sock.close()  # readable means closed by the server: we sent nothing to answer
                if not self._stop.is_set():
                    self.reopened += 1
                    self._open()

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()


def hammer(port: int, scrapers: int, requests: int, phase: Phase) -> None:
    """`scrapers` threads share `requests` scrapes; each records its latency or its error."""
    remaining = iter(range(requests))
    lock = threading.Lock()
    deadline = time.monotonic() + PHASE_DEADLINE_S

    def take() -> bool:
        with lock:
            return next(remaining, None) is not None

    def scraper() -> None:
        while take():
            if time.monotonic() > deadline:
                with lock:
                    phase.not_run += 1
                continue
            started = time.perf_counter()
            try:
                status, body = scrape_once(port)
            except TimeoutError:
                error = "timeout"
            except OSError as exc:
                error = type(exc).__name__
            except http.client.HTTPException as exc:
                error = type(exc).__name__
            else:
                elapsed = time.perf_counter() - started
                error = "" if status == 200 and body else f"status {status}"
            with lock:
                if error:
                    phase.errors[error] += 1
                else:
                    phase.latencies_s.append(elapsed)

    threads = [threading.Thread(target=scraper, name=f"scraper-{i}") for i in range(scrapers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def measure(name: str, proc: subprocess.Popen[bytes], port: int, args: argparse.Namespace) -> list[Phase]:
    for _ in range(20):  # warm-up: imports, first renders, caches
        scrape_once(port)
    phases = []
    for scrapers, idle in ((16, 0), (50, args.idle)):
        phase = Phase(f"{name}: {scrapers} scrapers" + (f" + {idle} idle connections" if idle else ""))
        with IdleConnections(port, idle) as holder:
            cpu_before, overflows_before = cpu_seconds(proc.pid), listen_overflows()
            started = time.perf_counter()
            hammer(port, scrapers, args.requests, phase)
            phase.wall_s = time.perf_counter() - started
            phase.server_cpu_s = cpu_seconds(proc.pid) - cpu_before
            phase.listen_overflows = listen_overflows() - overflows_before
            phase.idle_reopened, phase.idle_failed = holder.reopened, holder.failed
        phases.append(phase)
        time.sleep(1)  # let the server close what is left before the next phase
    return phases


# --- the report ---------------------------------------------------------------------------


def report(phases: list[Phase]) -> Iterator[str]:
    width = max(len(phase.name) for phase in phases)
    yield (
        f"{'':{width}} {'ok':>5} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'req/s':>7} {'cpu ms/req':>10} {'overflows':>9}"
    )
    for phase in phases:
        answered = len(phase.latencies_s)
        errors = sum(phase.errors.values())
        per_request_ms = phase.server_cpu_s * 1000 / answered if answered else float("nan")
        yield (
            f"{phase.name:{width}} {answered:5d} {errors:6d} {phase.percentile_ms(50):8.1f} "
            f"{phase.percentile_ms(99):8.1f} {max(phase.latencies_s, default=0) * 1000:8.1f} "
            f"{answered / phase.wall_s if phase.wall_s else 0:7.0f} {per_request_ms:10.2f} {phase.listen_overflows:9d}"
        )
        details = [f"{kind}: {n}" for kind, n in sorted(phase.errors.items())]
        if phase.not_run:
            details.append(f"not run before the {PHASE_DEADLINE_S:.0f} s deadline: {phase.not_run}")
        if phase.idle_reopened or phase.idle_failed:
            details.append(f"idle connections closed by the server and reopened: {phase.idle_reopened}")
            details.append(f"idle connections that could not be opened: {phase.idle_failed}")
        if details:
            yield f"{'':4}{'; '.join(details)}"


def verdicts(phases: list[Phase]) -> Iterator[str]:
    ours = [p for p in phases if p.name.startswith("gpuledger:")]
    if len(ours) != 2:
        return
    at_16, at_50 = ours
    p99 = at_16.percentile_ms(99)
    errors = sum(at_50.errors.values()) + at_50.not_run
    met = "met" if p99 <= TARGET_P99_MS_AT_16 else "MISSED"
    yield f"target: p99 <= {TARGET_P99_MS_AT_16:.0f} ms at 16 scrapers: {p99:.1f} ms ({met})"
    yield (
        f"target: {TARGET_ERRORS_AT_50_WITH_IDLE} errors at 50 scrapers with idle connections: {errors} "
        f"({'met' if errors <= TARGET_ERRORS_AT_50_WITH_IDLE else 'MISSED'})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="scrapes per phase (default 2000)")
    parser.add_argument("--idle", type=int, default=500, help="idle connections held open (default 500)")
    parser.add_argument("--compare-tree", type=Path, help="also measure the daemon of this checkout")
    parser.add_argument("--serve-floor", nargs=2, metavar=("PORT", "EXPOSITION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_floor:
        return serve_floor(int(args.serve_floor[0]), Path(args.serve_floor[1]))

    trees = [("gpuledger", REPO)]
    if args.compare_tree is not None:
        trees.append((f"gpuledger@{args.compare_tree}", args.compare_tree.resolve()))
    phases: list[Phase] = []
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        exposition = Path(tmp) / "exposition.prom"
        for name, tree in trees:
            port = free_port()
            proc = start_daemon(tree, port, Path(tmp) / f"{name.replace('/', '_')}.log")
            try:
                if not exposition.exists():
                    text = plain_exposition(port)
                    exposition.write_text(text)
                    print(f"exposition: {series_count(text)} series, {len(text.encode())} bytes as plain text")
                phases += measure(name, proc, port, args)
            finally:
                stop_server(proc)
        port = free_port()
        proc = start_floor(exposition, port, Path(tmp) / "floor.log")
        try:
            phases += measure("prometheus_client", proc, port, args)
        finally:
            stop_server(proc)
    print(f"{args.requests} scrapes per phase, each a new connection with Prometheus's Accept headers")
    for line in report(phases):
        print(line)
    for line in verdicts(phases):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
