"""The HTTP endpoint under hostile and heavy clients: real connections to the real server on
loopback, each test bounded in time and connections."""

from __future__ import annotations

import base64
import gzip
import http.client
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

import exporters.webconfig
from agent.model import AgentState
from exporters.http import Limits, MetricsServer
from exporters.prometheus import make_registry
from exporters.webconfig import BasicAuth, FailureThrottle, Login, load_web_config
from tests.helpers import WAITS_ON_REAL_TIME, Rig

pytestmark = WAITS_ON_REAL_TIME

PASSWORD = "correct horse battery staple"
# Cost 4 keeps the suite fast; the throttle counts checks, not their cost.
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
OTHER_PASSWORD = "tr0ub4dor&3"
OTHER_HASH = bcrypt.hashpw(OTHER_PASSWORD.encode(), bcrypt.gensalt(4)).decode()


@pytest.fixture(scope="module")
def demo_states() -> list[AgentState]:
    """Two successive polls of the demo node (384 series each), a minute apart."""
    rig = Rig("demo")
    try:
        return [rig.poll(), rig.poll(60)]
    finally:
        rig.close()


class Source:
    """A pipeline stand-in: `state` is swapped for a new object at each "poll"; `renders`
    counts the collector's reads of it, one per rendering of the exposition."""

    def __init__(self, state: AgentState) -> None:
        self.state = state
        self.renders = 0

    def for_registry(self) -> AgentState:
        self.renders += 1
        return self.state

    def __call__(self) -> AgentState:
        return self.state


Serve = Callable[..., tuple[MetricsServer, Source]]


@pytest.fixture
def serve(demo_states: list[AgentState], tmp_path: Path) -> Iterator[Serve]:
    servers: list[MetricsServer] = []

    def start(
        limits: Limits | None = None, web_config: str | None = None, healthy: Callable[[], bool] = lambda: True
    ) -> tuple[MetricsServer, Source]:
        source = Source(demo_states[0])
        web = None
        if web_config is not None:
            path = tmp_path / "web.yml"
            path.write_text(web_config)
            web = load_web_config(path)
        registry = make_registry(source.for_registry)
        server = MetricsServer("127.0.0.1", 0, registry, healthy, web=web, state=source, limits=limits or Limits())
        server.start()
        servers.append(server)
        return server, source

    yield start
    for server in servers:
        server.stop()


def get(
    port: int, path: str = "/metrics", headers: dict[str, str] | None = None, timeout_s: float = 10
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def closed_after(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closes `sock` (EOF or reset); fails past `limit_s`."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for more than {limit_s} s")
    return time.monotonic() - started


def open_idle(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""  # data would be a surprise too; EOF means closed
    except BlockingIOError:
        return True  # nothing to read: the server has not closed it
    except OSError:
        return False
    finally:
        sock.setblocking(True)


# --- idle and slow clients ----------------------------------------------------------------


def test_hundreds_of_idle_connections_then_50_concurrent_scrapers_get_no_errors(serve: Serve) -> None:
    # Idle connections may wait 60 s, far longer than the test: they are all open while it scrapes.
    server, source = serve(Limits(request_timeout_s=60))
    expected = generate_latest(make_registry(source))
    idle = open_idle(server.port, 300)
    try:
        deadline = time.monotonic() + 10
        while server.open_connections < 300:
            assert time.monotonic() < deadline, f"only {server.open_connections} of 300 accepted"
            time.sleep(0.01)

        def scrape(_: int) -> tuple[int, bytes] | str:
            try:
                status, _headers, body = get(server.port, timeout_s=10)
            except OSError as exc:
                return f"{type(exc).__name__}: {exc}"
            return status, body

        with ThreadPoolExecutor(max_workers=50) as pool:
            results = list(pool.map(scrape, range(200)))
        errors = [r for r in results if not (isinstance(r, tuple) and r[0] == 200)]
        assert errors == []
        assert all(r == (200, expected) for r in results)
        assert all(still_open(sock) for sock in idle)  # held, not dropped to make the scrapes work
    finally:
        for sock in idle:
            sock.close()


def test_past_the_connection_cap_the_longest_idle_connection_makes_room(serve: Serve) -> None:
    server, _source = serve(Limits(request_timeout_s=60, max_connections=20))
    idle = open_idle(server.port, 20)
    try:
        deadline = time.monotonic() + 10
        while server.open_connections < 20:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(5):
            assert get(server.port)[0] == 200
        assert server.open_connections <= 20
        closed = [sock for sock in idle if not still_open(sock)]
        assert 1 <= len(closed) <= 5
        assert closed == idle[: len(closed)]  # the oldest went first
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.parametrize(
    "sends",
    [
        [],
        [b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"],  # the head never ends
        [b"G", b"E", b"T", b" ", b"/", b"m", b"e", b"t", b"r", b"i", b"c", b"s"],  # a byte at a time
    ],
    ids=["nothing", "half-a-request", "a-byte-at-a-time"],
)
def test_a_client_without_a_complete_request_is_closed_within_the_request_timeout(
    serve: Serve, sends: list[bytes]
) -> None:
    server, _source = serve(Limits(request_timeout_s=1.0))
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        started = time.monotonic()
        for chunk in sends:
            try:
                sock.sendall(chunk)
            except OSError:
                break  # closed on us mid-drip
            time.sleep(0.1)  # a byte every 0.1 s: each read alone is prompt, the whole is not
        waited = time.monotonic() - started + closed_after(sock, limit_s=5)
    # 1 s allowed, swept every 0.25 s (and slack for a busy machine); not cut before the 1 s.
    assert 0.9 <= waited <= 2.5
    assert get(server.port)[0] == 200


def test_a_request_that_arrives_in_pieces_within_the_timeout_is_answered(serve: Serve) -> None:
    server, source = serve(Limits(request_timeout_s=5.0))
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        for chunk in (b"GET /metr", b"ics HTTP/1.1\r\nHost: 127.0.0.1\r", b"\n\r\n"):
            sock.sendall(chunk)
            time.sleep(0.2)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.0 200 OK\r\n")
    assert answer.endswith(generate_latest(make_registry(source)))


# --- resets and logging -------------------------------------------------------------------


def reset(sock: socket.socket) -> None:
    """Close with an RST instead of a FIN, as a crashed or impatient client does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_a_reset_mid_request_or_mid_answer_logs_no_traceback(
    serve: Serve, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    server, _source = serve()
    with caplog.at_level(logging.DEBUG):
        # Mid-request: half a head, then a reset.
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/pl")
        time.sleep(0.2)
        reset(sock)
        # Mid-answer: a whole request, then a reset before reading the answer.
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            reset(sock)
        time.sleep(0.5)
        assert get(server.port)[0] == 200  # and the server still serves
    records = [r for r in caplog.records if r.name.startswith("exporters")]
    assert [r for r in records if r.exc_info or r.levelno > logging.DEBUG] == []
    assert all("\n" not in r.getMessage() for r in records)
    # At most one line per reset connection, plus the request lines of the answered scrapes.
    assert len([r for r in records if "reset" in r.getMessage().lower()]) <= 21
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err == ""


def test_a_request_line_cannot_forge_a_log_line(serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    server, _source = serve()
    with caplog.at_level(logging.DEBUG), socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /metrics\rFORGED 200 HTTP/1.1\r\n\r\n")
        while sock.recv(65536):
            pass
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("exporters")]
    assert messages
    assert all("\r" not in m and "\n" not in m for m in messages)


def test_no_answer_names_the_python_build_it_runs_on(serve: Serve) -> None:
    # wsgiref's default Server header is "WSGIServer/0.2 CPython/3.11.7": a free fingerprint.
    # Every kind of answer: the app's (200, 404, 405), and http.server's own errors (431).
    server, _source = serve()
    requests = (
        b"GET /metrics HTTP/1.1\r\n\r\n",
        b"GET /nowhere HTTP/1.1\r\n\r\n",
        b"DELETE /metrics HTTP/1.1\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n",
    )
    statuses = []
    for request in requests:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(request)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1")
        statuses.append(int(head.split()[1]))
        assert "Python" not in head, head
        assert "WSGIServer" not in head, head
        assert "\r\nServer: gpuledger\r\n" in head + "\r\n", head
    assert statuses == [200, 404, 405, 431]


# --- rendering once per poll --------------------------------------------------------------


def test_two_scrapes_within_a_poll_get_the_same_bytes_rendered_once_and_a_new_poll_new_bytes(
    serve: Serve, demo_states: list[AgentState]
) -> None:
    server, source = serve()
    first = get(server.port)[2]
    second = get(server.port)[2]
    assert first == second == generate_latest(make_registry(lambda: demo_states[0]))
    assert source.renders == 1
    with ThreadPoolExecutor(max_workers=16) as pool:
        bodies = set(pool.map(lambda _: get(server.port)[2], range(64)))
    assert bodies == {first}
    assert source.renders == 1  # 66 scrapes, one render

    source.state = demo_states[1]  # the next poll
    after = get(server.port)[2]
    assert after != first
    assert after == generate_latest(make_registry(lambda: demo_states[1]))
    assert get(server.port)[2] == after
    assert source.renders == 2


def test_gzip_when_asked_is_the_same_exposition_once_decompressed(serve: Serve) -> None:
    server, source = serve()
    status, headers, plain = get(server.port)
    assert status == 200
    assert "content-encoding" not in headers
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    status, headers, zipped = get(server.port, headers={"Accept-Encoding": "gzip"})
    assert status == 200
    assert headers["content-encoding"] == "gzip"
    assert int(headers["content-length"]) == len(zipped) < len(plain) / 4
    assert gzip.decompress(zipped) == plain
    assert get(server.port, headers={"Accept-Encoding": "gzip"})[2] == zipped
    assert source.renders == 1  # both encodings from one rendering


def test_openmetrics_when_the_accept_header_asks_for_it(serve: Serve, demo_states: list[AgentState]) -> None:
    server, source = serve()
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    status, headers, body = get(server.port, headers={"Accept": accept, "Accept-Encoding": "gzip"})
    assert status == 200
    assert headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert gzip.decompress(body) == generate_openmetrics(make_registry(lambda: demo_states[0]))
    assert gzip.decompress(body).endswith(b"# EOF\n")
    assert get(server.port)[2].startswith(b"# HELP")  # plain text still plain text
    assert source.renders == 2  # one per format


def test_options_names_the_methods_and_others_are_refused(serve: Serve) -> None:
    server, _source = serve()
    for path, method, status, allow in (
        ("/metrics", "OPTIONS", 200, "GET, HEAD, OPTIONS"),
        ("/metrics", "POST", 405, "GET, HEAD, OPTIONS"),
        ("/", "PUT", 405, "GET, HEAD, OPTIONS"),
        ("/healthz", "POST", 405, "GET, HEAD"),  # it once answered 200 to anything
    ):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            conn.request(method, path, body=b"x" if method in ("POST", "PUT") else None)
            response = conn.getresponse()
            assert response.status == status, (path, method)
            assert response.getheader("Allow") == allow
            assert b"gpuledger_" not in response.read()
        finally:
            conn.close()


def raw_answer(port: int, request: bytes) -> tuple[str, bytes]:
    """The response head and every byte after it, read off the socket (http.client drops what
    follows a HEAD response's head, which is what this looks for)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    return head.decode("latin-1"), rest


def test_head_answers_what_get_would_without_the_body(serve: Serve) -> None:
    # It was a 405 on /metrics (prometheus_client's app allows GET and OPTIONS only) and a 200
    # with the body on /healthz; Go's servers, node_exporter's among them, answer HEAD as GET.
    healthy = [True]
    server, source = serve(healthy=lambda: healthy[0])
    for path, accept_encoding in (("/metrics", "identity"), ("/metrics", "gzip"), ("/healthz", "identity")):
        status, _headers, body = get(server.port, path, headers={"Accept-Encoding": accept_encoding})
        request = f"HEAD {path} HTTP/1.1\r\nHost: x\r\nAccept-Encoding: {accept_encoding}\r\n\r\n"
        head, rest = raw_answer(server.port, request.encode())
        assert head.split()[1] == str(status) == "200"
        assert f"\r\nContent-Length: {len(body)}" in head
        assert ("Content-Encoding: gzip" in head) == (accept_encoding == "gzip")
        assert rest == b""
    assert source.renders == 1  # HEAD and GET share the poll's rendering
    healthy[0] = False
    head, rest = raw_answer(server.port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.split()[1] == "503"
    assert rest == b""


def test_name_filters_keep_the_samples_named_and_nothing_else(serve: Serve) -> None:
    # `?name[]=` used to answer an empty page: prometheus_client's restricted registry finds
    # collectors by describe(), which gpuledger's collector does not have.
    server, _source = serve()
    full = get(server.port)[2].decode().splitlines()
    wanted = ("gpuledger_polls_total", "gpuledger_gpu_temperature_celsius")
    status, headers, body = get(
        server.port, "/metrics?name[]=gpuledger_polls_total&name[]=gpuledger_gpu_temperature_celsius"
    )
    assert status == 200
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples = [line for line in body.decode().splitlines() if not line.startswith("#")]
    expected = [line for line in full if line.split("{")[0].split(" ")[0] in wanted]
    assert len(expected) == 1 + 8  # one poll counter, one temperature per demo GPU
    assert sorted(samples) == sorted(expected)
    assert "# TYPE gpuledger_polls_total counter" in body.decode()
    status, headers, zipped = get(
        server.port,
        "/metrics?name[]=gpuledger_polls_total",
        headers={"Accept": "application/openmetrics-text;version=1.0.0", "Accept-Encoding": "gzip"},
    )
    assert headers["content-encoding"] == "gzip"
    text = gzip.decompress(zipped).decode()
    assert text.endswith("# EOF\n")
    assert [line for line in text.splitlines() if not line.startswith("#")] == [
        line for line in full if line.startswith("gpuledger_polls_total ")
    ]
    assert get(server.port, "/metrics?name[]=no_such_metric")[::2] == (200, b"")


def test_healthz_is_200_while_healthy_and_503_when_not(serve: Serve) -> None:
    healthy = [True]
    server, _source = serve(healthy=lambda: healthy[0])
    assert get(server.port, "/healthz")[::2] == (200, b"ok\n")
    healthy[0] = False
    assert get(server.port, "/healthz")[::2] == (503, b"no successful poll within 3 poll intervals\n")
    assert get(server.port, "/nowhere")[0] == 404


# --- failed logins ------------------------------------------------------------------------


class CountingCheckpw:
    def __init__(self) -> None:
        self.calls = 0
        self.busy = 0
        self.most_at_once = 0
        self.lock = threading.Lock()
        self.real = bcrypt.checkpw

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        with self.lock:
            self.calls += 1
            self.busy += 1
            self.most_at_once = max(self.most_at_once, self.busy)
        try:
            time.sleep(0.01)  # as long as a cost-10 hash, near enough to overlap if allowed
            return bool(self.real(password, hashed))
        finally:
            with self.lock:
                self.busy -= 1


@pytest.fixture
def checkpw(monkeypatch: pytest.MonkeyPatch) -> CountingCheckpw:
    counting = CountingCheckpw()
    monkeypatch.setattr(exporters.webconfig.bcrypt, "checkpw", counting)
    return counting


def test_a_burst_of_wrong_passwords_is_throttled_and_a_good_login_still_works(
    serve: Serve, checkpw: CountingCheckpw
) -> None:
    server, _source = serve(web_config=f"basic_auth_users: {{prometheus: '{HASH}', grafana: '{OTHER_HASH}'}}\n")
    assert get(server.port, headers=basic("prometheus", PASSWORD))[0] == 200  # checked once, then cached
    assert checkpw.calls == 1
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(lambda i: get(server.port, headers=basic("prometheus", f"guess{i}")), range(64)))
    elapsed_s = time.monotonic() - started
    statuses = [status for status, _headers, _body in answers]
    assert set(statuses) <= {401, 429}
    # From one address: a burst of 5 checks, then one a second (elapsed rounded up).
    allowed_checks = 5 + int(elapsed_s) + 1
    assert checkpw.calls - 1 <= allowed_checks
    assert statuses.count(401) <= allowed_checks
    assert statuses.count(429) >= 64 - allowed_checks
    assert all(headers["retry-after"] == "1" for status, headers, _body in answers if status == 429)
    assert checkpw.most_at_once == 1  # never two bcrypt checks at once

    # The cached scraper is not locked out by the guessing from its address...
    assert get(server.port, headers=basic("prometheus", PASSWORD))[0] == 200
    # ...a login not seen before waits its turn, then gets in. (A few more guesses first, so
    # that the bucket is empty now, however long the burst above took.)
    for i in range(8):
        assert get(server.port, headers=basic("prometheus", f"again{i}"))[0] in (401, 429)
    calls = checkpw.calls
    assert get(server.port, headers=basic("grafana", OTHER_PASSWORD))[0] == 429
    assert checkpw.calls == calls  # refused before bcrypt
    time.sleep(1.1)
    assert get(server.port, headers=basic("grafana", OTHER_PASSWORD))[0] == 200


def test_the_failure_throttle_refills_forgives_and_stays_small() -> None:
    now = [0.0]
    throttle = FailureThrottle(burst=3, interval_s=2.0, max_clients=4, clock=lambda: now[0])
    assert [throttle.take("10.0.0.1") for _ in range(4)] == [True, True, True, False]
    assert throttle.take("10.0.0.2")  # another address has its own bucket
    now[0] += 1.9
    assert not throttle.take("10.0.0.1")  # 0.95 of a check regained: not yet
    now[0] += 0.2
    assert throttle.take("10.0.0.1")  # one check per 2 s
    assert not throttle.take("10.0.0.1")
    throttle.forgive("10.0.0.1")
    assert throttle.take("10.0.0.1")  # a good login wiped the slate
    for i in range(100):
        throttle.take(f"192.0.2.{i}")
    assert len(vars(throttle)["_buckets"]) == 4  # bounded: the least recent forgotten


def test_only_one_bcrypt_check_runs_at_a_time_whatever_the_addresses(checkpw: CountingCheckpw) -> None:
    auth = BasicAuth({"prometheus": HASH.encode()}, bcrypt_wait_s=5.0)
    wrong = "Basic " + base64.b64encode(b"prometheus:wrong").decode()
    with ThreadPoolExecutor(max_workers=8) as pool:
        verdicts = list(pool.map(lambda i: auth.verdict(wrong, f"198.51.100.{i}"), range(32)))
    assert verdicts == [Login.REFUSED] * 32  # each address within its burst: all checked...
    assert checkpw.calls == 32
    assert checkpw.most_at_once == 1  # ...one at a time


def test_waiting_too_long_for_bcrypt_is_throttled_not_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def slow_checkpw(password: bytes, hashed: bytes) -> bool:
        release.wait(5)
        return False

    monkeypatch.setattr(exporters.webconfig.bcrypt, "checkpw", slow_checkpw)
    auth = BasicAuth({"prometheus": HASH.encode()}, bcrypt_wait_s=0.2)
    wrong = "Basic " + base64.b64encode(b"prometheus:wrong").decode()
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(auth.verdict, wrong, "203.0.113.1")
        time.sleep(0.1)
        started = time.monotonic()
        assert auth.verdict(wrong, "203.0.113.2") is Login.THROTTLED
        assert time.monotonic() - started < 1.0
        release.set()
        assert first.result() is Login.REFUSED


# --- TLS clients that stall ---------------------------------------------------------------


def test_clients_stalled_before_or_in_the_tls_handshake_do_not_hold_up_others(serve: Serve, tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    from tests.test_webconfig import _cryptography_pki

    pki = _cryptography_pki(tmp_path)
    server, _source = serve(
        Limits(request_timeout_s=60),
        web_config=f"tls_server_config: {{cert_file: {pki.server_cert}, key_file: {pki.server_key}}}\n",
    )
    stalled = open_idle(server.port, 100)  # connected, no ClientHello
    half_hello: list[Any] = []
    for _ in range(20):  # a ClientHello record header promising bytes that never come
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"\x16\x03\x01\x02\x00\x01")
        half_hello.append(sock)
    try:
        context = ssl.create_default_context(cafile=str(pki.server_cert))
        for _ in range(5):
            started = time.monotonic()
            conn = http.client.HTTPSConnection("localhost", server.port, timeout=10, context=context)
            try:
                conn.request("GET", "/healthz")
                response = conn.getresponse()
                assert (response.status, response.read()) == (200, b"ok\n")
            finally:
                conn.close()
            assert time.monotonic() - started < 2.0
        assert all(still_open(sock) for sock in stalled + half_hello)
    finally:
        for sock in stalled + half_hello:
            sock.close()
