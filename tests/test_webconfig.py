"""TLS and basic auth on /metrics from an exporter-toolkit web-config file, tested with real
HTTPS requests against the real server (in-process and as `gpuledger run`)."""

from __future__ import annotations

import base64
import ipaddress
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest

import exporters.webconfig
from agent.errors import ConfigError
from agent.model import AgentState
from exporters.http import MetricsServer
from exporters.prometheus import make_registry
from exporters.webconfig import BasicAuth, load_web_config
from tests.helpers import Rig
from tests.test_cli import REPO, free_port, gpuledger, value

PASSWORD = "correct horse battery staple"
# Cost 4 keeps the suite fast; the server handles any cost the same way.
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


# --- certificates -------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    server_cert: Path
    server_key: Path
    ca_cert: Path | None = None  # signs the client certificates (mutual TLS tests only)
    client_cert: Path | None = None
    client_key: Path | None = None
    stranger_cert: Path | None = None  # signed by the CA, but with a SAN nobody allowed
    stranger_key: Path | None = None


def _openssl_self_signed(directory: Path) -> Pki:
    cert, key = directory / "server.crt", directory / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return Pki(cert, key)


def _cryptography_pki(directory: Path) -> Pki:
    from cryptography import x509

    from tests.certs import issue, write_pem

    server = issue("localhost", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))], None)
    ca = issue("gpuledger test CA", [], None, ca=True)
    client = issue("prometheus", [x509.DNSName("prometheus.monitoring.svc")], ca)
    stranger = issue("someone", [x509.DNSName("someone.example")], ca)
    server_cert, server_key = write_pem(directory, "server", server)
    ca_cert, _ = write_pem(directory, "ca", ca)
    client_cert, client_key = write_pem(directory, "client", client)
    stranger_cert, stranger_key = write_pem(directory, "stranger", stranger)
    return Pki(server_cert, server_key, ca_cert, client_cert, client_key, stranger_cert, stranger_key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    try:
        return _cryptography_pki(directory)
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor openssl is installed to make test certificates")
        return _openssl_self_signed(directory)


def needs_client_pki(pki: Pki) -> None:
    if pki.ca_cert is None:
        pytest.skip("mutual TLS tests make their CA with the cryptography package")


# --- a server and a client ----------------------------------------------------------------


@pytest.fixture(scope="module")
def state() -> AgentState:
    rig = Rig("demo")
    try:
        return rig.run(30, 15)
    finally:
        rig.close()


def web_config(directory: Path, text: str) -> Path:
    path = directory / "web.yml"
    path.write_text(text)
    return path


def tls_and_auth(pki: Pki, extra_tls: str = "", extra: str = "") -> str:
    return (
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n{extra_tls}"
        f"basic_auth_users:\n  prometheus: '{HASH}'\n{extra}"
    )


@pytest.fixture
def serve(tmp_path: Path, state: AgentState) -> Iterator[Any]:
    servers: list[MetricsServer] = []

    def start(config_text: str) -> MetricsServer:
        server = MetricsServer(
            "127.0.0.1",
            0,
            make_registry(lambda: state),
            lambda: True,
            web=load_web_config(web_config(tmp_path, config_text)),
            state=lambda: state,
        )
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def client_context(pki: Pki, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.server_cert))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def get(
    url: str, context: ssl.SSLContext | None = None, authorization: str | None = None
) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, headers={"Authorization": authorization} if authorization else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def raw_plain_http(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


# --- HTTPS and basic auth against the in-process server -----------------------------------


def test_https_with_the_right_password_serves_metrics(serve: Any, pki: Pki) -> None:
    server = serve(tls_and_auth(pki))
    assert server.scheme == "https"
    status, _headers, body = get(
        f"https://localhost:{server.port}/metrics", client_context(pki), basic("prometheus", PASSWORD)
    )
    assert status == 200
    assert value(body, "gpuledger_gpu_utilization_ratio", gpu="0") == pytest.approx(0.92)


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        basic("prometheus", "wrong"),
        basic("prometheus", ""),
        basic("nobody", PASSWORD),
        basic("prometheus", PASSWORD + "x"),
        "Bearer " + PASSWORD,
        "Basic not-base64!",
        "Basic " + base64.b64encode(PASSWORD.encode()).decode(),  # no user:password separator
    ],
    ids=["none", "wrong", "empty", "unknown-user", "longer", "bearer", "garbage", "no-colon"],
)
def test_missing_or_wrong_credentials_get_401_with_a_basic_challenge(
    serve: Any, pki: Pki, authorization: str | None
) -> None:
    server = serve(tls_and_auth(pki))
    status, headers, body = get(f"https://localhost:{server.port}/metrics", client_context(pki), authorization)
    assert status == 401
    assert headers["WWW-Authenticate"] == 'Basic realm="gpuledger"'
    assert "gpuledger_" not in body


def test_unknown_paths_need_credentials_too_but_healthz_does_not(serve: Any, pki: Pki) -> None:
    server = serve(tls_and_auth(pki))
    context = client_context(pki)
    assert get(f"https://localhost:{server.port}/secret", context)[0] == 401
    assert get(f"https://localhost:{server.port}/secret", context, basic("prometheus", PASSWORD))[0] == 404
    status, _headers, body = get(f"https://localhost:{server.port}/healthz", context)
    assert (status, body) == (200, "ok\n")


def test_plain_http_to_the_tls_port_is_refused(serve: Any, pki: Pki) -> None:
    server = serve(tls_and_auth(pki))
    answer = raw_plain_http(server.port)
    assert answer.startswith(b"HTTP/1.0 400 Bad Request")
    assert b"HTTP request to an HTTPS server" in answer
    assert b"gpuledger_" not in answer
    status, _headers, _body = get(
        f"http://127.0.0.1:{server.port}/metrics", authorization=basic("prometheus", PASSWORD)
    )
    assert status == 400
    # The server is still serving TLS afterwards.
    assert get(f"https://localhost:{server.port}/healthz", client_context(pki))[0] == 200


def test_a_client_that_does_not_trust_the_certificate_cannot_connect(serve: Any, pki: Pki) -> None:
    server = serve(tls_and_auth(pki))
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        get(f"https://localhost:{server.port}/metrics", ssl.create_default_context(), basic("prometheus", PASSWORD))


def test_min_version_refuses_older_clients(serve: Any, pki: Pki) -> None:
    server = serve(tls_and_auth(pki, extra_tls="  min_version: TLS13\n"))
    old_client = client_context(pki)
    old_client.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises(urllib.error.URLError):
        get(f"https://localhost:{server.port}/healthz", old_client)
    assert get(f"https://localhost:{server.port}/healthz", client_context(pki))[0] == 200


def test_an_htpasswd_2y_hash_works(serve: Any, pki: Pki) -> None:
    htpasswd_style = "$2y$" + HASH.removeprefix("$2b$")
    server = serve(
        f"tls_server_config: {{cert_file: {pki.server_cert}, key_file: {pki.server_key}}}\n"
        f"basic_auth_users: {{prometheus: '{htpasswd_style}'}}\n"
    )
    url = f"https://localhost:{server.port}/metrics"
    assert get(url, client_context(pki), basic("prometheus", PASSWORD))[0] == 200
    assert get(url, client_context(pki), basic("prometheus", "nope"))[0] == 401


def test_basic_auth_without_tls_and_response_headers(serve: Any) -> None:
    server = serve(
        f"basic_auth_users: {{prometheus: '{HASH}'}}\n"
        "http_server_config: {headers: {X-Content-Type-Options: nosniff, X-Frame-Options: deny}}\n"
    )
    assert server.scheme == "http"
    status, headers, _body = get(f"http://127.0.0.1:{server.port}/metrics", authorization=basic("prometheus", PASSWORD))
    assert status == 200
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Frame-Options"] == "deny"
    status, headers, _body = get(f"http://127.0.0.1:{server.port}/metrics")
    assert status == 401
    assert headers["X-Frame-Options"] == "deny"  # on every response


def test_mutual_tls_requires_a_certificate_from_the_client_ca(serve: Any, pki: Pki) -> None:
    needs_client_pki(pki)
    server = serve(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca_cert}\n"
        "  client_allowed_sans: [prometheus.monitoring.svc]\n"
    )
    url = f"https://localhost:{server.port}/metrics"
    status, _headers, body = get(url, client_context(pki, pki.client_cert, pki.client_key))
    assert status == 200
    assert "gpuledger_gpu_info" in body
    for context in (client_context(pki), client_context(pki, pki.stranger_cert, pki.stranger_key)):
        # No certificate: the handshake fails. A verified certificate naming none of the allowed
        # SANs: the server hangs up before reading the request.
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            get(url, context)
    # The stranger's certificate itself is good: only client_allowed_sans turned it away.
    open_to_the_ca = serve(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca_cert}\n"
    )
    stranger = client_context(pki, pki.stranger_cert, pki.stranger_key)
    assert get(f"https://localhost:{open_to_the_ca.port}/healthz", stranger)[0] == 200


# --- the credential cache -----------------------------------------------------------------


class CountingCheckpw:
    def __init__(self) -> None:
        self.calls = 0
        self.real = bcrypt.checkpw

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        self.calls += 1
        return bool(self.real(password, hashed))


@pytest.fixture
def checkpw(monkeypatch: pytest.MonkeyPatch) -> CountingCheckpw:
    counting = CountingCheckpw()
    monkeypatch.setattr(exporters.webconfig.bcrypt, "checkpw", counting)
    return counting


def test_a_successful_check_is_cached_briefly_and_failures_never(checkpw: CountingCheckpw) -> None:
    now = [1000.0]
    auth = BasicAuth({"prometheus": HASH.encode()}, cache_ttl_s=60, clock=lambda: now[0])
    right = basic("prometheus", PASSWORD)
    assert auth.check(right)
    assert auth.check(right)
    assert checkpw.calls == 1  # the second scrape skipped bcrypt
    now[0] += 61
    assert auth.check(right)
    assert checkpw.calls == 2  # expired: checked again
    for _ in range(3):
        assert not auth.check(basic("prometheus", "wrong"))
    assert checkpw.calls == 5  # every wrong password pays for bcrypt
    assert not auth.check(basic("nobody", PASSWORD))
    assert checkpw.calls == 6  # an unknown user costs a check too: timing does not reveal users


def test_the_cache_holds_neither_password_nor_a_plain_digest_of_it() -> None:
    import hashlib

    auth = BasicAuth({"prometheus": HASH.encode()})
    assert auth.check(basic("prometheus", PASSWORD))
    keys = list(vars(auth)["_cache"])
    assert len(keys) == 1
    secret = f"prometheus:{PASSWORD}".encode()
    for plain in (
        secret,
        PASSWORD.encode(),
        hashlib.sha256(secret).digest(),
        hashlib.sha256(PASSWORD.encode()).digest(),
    ):
        assert keys[0] != plain
        assert PASSWORD.encode() not in keys[0]


def test_an_overlong_password_is_a_failure_not_a_crash() -> None:
    auth = BasicAuth({"prometheus": HASH.encode()})
    assert not auth.check(basic("prometheus", "x" * 200))


# --- bad web-config files: one line, exit 2 -----------------------------------------------


BAD_CONFIGS = [
    ("tls_server_config: {cert_file: CERT, key_file: KEY, cert_fle: x}", "tls_server_config.cert_fle: unknown key"),
    ("basic_auth_users: {prometheus: hunter2}", "basic_auth_users.prometheus: not a bcrypt hash"),
    ("basic_auth_users: {prometheus: '$2b$99$" + "a" * 53 + "'}", "basic_auth_users.prometheus: bcrypt cost 99"),
    ("tls_server_config: {cert_file: /no/such/server.crt, key_file: KEY}", "tls_server_config.cert_file: no such file"),
    ("tls_server_config: {cert_file: CERT}", "tls_server_config.key_file: required"),
    ("tls_server_config: {cert_file: KEY, key_file: CERT}", "tls_server_config.cert_file/key_file: cannot load"),
    (
        "tls_server_config: {cert_file: CERT, key_file: KEY, client_auth_type: RequireAndVerifyClientCert}",
        "tls_server_config.client_ca_file: required by client_auth_type RequireAndVerifyClientCert",
    ),
    (
        "tls_server_config: {cert_file: CERT, key_file: KEY, client_auth_type: RequireAnyClientCert}",
        "tls_server_config.client_auth_type: RequireAnyClientCert",
    ),
    ("tls_server_config: {cert_file: CERT, key_file: KEY, min_version: TLS9}", "tls_server_config.min_version"),
    (
        "tls_server_config: {cert_file: CERT, key_file: KEY, min_version: TLS13, max_version: TLS12}",
        "tls_server_config.min_version: TLS13 is above max_version TLS12",
    ),
    ("tls_server_config: {cert: '-----BEGIN', key_file: KEY}", "tls_server_config.cert: inline"),
    ("rate_limit: {interval: 1s, burst: 10}", "rate_limit: not supported"),
    ("http_server_config: {headers: {X-Powered-By: me}}", "http_server_config.headers.X-Powered-By"),
    ("basic_auth_users: [prometheus]", "basic_auth_users: Input should be a valid dictionary"),
    ("tls_server_config: {cert_file: CERT", "web.yml: line 1: expected"),
    ("- just a list", "expected a mapping of settings at the top"),
]


@pytest.mark.parametrize(("text", "expected"), BAD_CONFIGS, ids=[e for _t, e in BAD_CONFIGS])
def test_a_bad_web_config_is_one_line_naming_the_key_and_exit_2(
    tmp_path: Path, pki: Pki, text: str, expected: str
) -> None:
    path = web_config(tmp_path, text.replace("CERT", str(pki.server_cert)).replace("KEY", str(pki.server_key)))
    with pytest.raises(ConfigError) as raised:
        load_web_config(path)
    assert expected in str(raised.value)
    result = gpuledger("run", "--fake", "--listen", f"127.0.0.1:{free_port()}", "--web-config", str(path), timeout=30)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{path}: ")
    assert expected in lines[0]


def test_a_missing_web_config_file_from_the_config_or_environment_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yml"
    config = tmp_path / "gpuledger.yaml"
    config.write_text(f"web_config_file: {missing}\n")
    for args, env in (
        (("--config", str(config)), {}),
        ((), {"GPULEDGER_WEB_CONFIG_FILE": str(missing)}),
    ):
        result = gpuledger("run", "--fake", "--listen", f"127.0.0.1:{free_port()}", *args, env=env, timeout=30)
        assert result.returncode == 2
        assert result.stderr.strip() == f"{missing}: no such web config file"


def test_relative_paths_are_relative_to_the_web_config_file(tmp_path: Path, pki: Pki, state: AgentState) -> None:
    directory = tmp_path / "etc"
    directory.mkdir()
    shutil.copy(pki.server_cert, directory / "tls.crt")
    shutil.copy(pki.server_key, directory / "tls.key")
    path = directory / "web.yml"
    path.write_text("tls_server_config: {cert_file: tls.crt, key_file: tls.key}\n")
    web = load_web_config(path)
    assert web.tls is not None
    assert web.auth is None


# --- the daemon end to end ----------------------------------------------------------------


def test_gpuledger_run_serves_https_with_basic_auth(tmp_path: Path, pki: Pki) -> None:
    path = web_config(tmp_path, tls_and_auth(pki))
    port = free_port()
    log = (tmp_path / "daemon.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--fake", "--listen", f"127.0.0.1:{port}", "--web-config", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "GPULEDGER_POLL_INTERVAL": "0.2s"},
    )
    url = f"https://localhost:{port}"
    context = client_context(pki)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
            try:
                status, _headers, body = get(url + "/metrics", context, basic("prometheus", PASSWORD))
                if status == 200 and "gpuledger_gpu_utilization_ratio" in body:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            time.sleep(0.1)
        assert value(body, "gpuledger_gpu_utilization_ratio", gpu="0") == pytest.approx(0.92)
        assert get(url + "/metrics", context, basic("prometheus", "wrong"))[0] == 401
        assert get(url + "/metrics", context)[0] == 401
        assert get(url + "/healthz", context)[0] == 200
        assert raw_plain_http(port).startswith(b"HTTP/1.0 400 Bad Request")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        log.close()
    assert f"serving https://127.0.0.1:{port}/metrics" in (tmp_path / "daemon.log").read_text()
