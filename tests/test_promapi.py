"""The query API client's answers to what stores send back: each failure is one of its own
errors with one line saying what to do, never an httpx exception (httpx's MockTransport stands
in for the store)."""

from __future__ import annotations

import http.server
import ipaddress
import json
import re
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.errors import BadInputError
from agent.fleet.promapi import (
    NotPrometheusAPI,
    PrometheusAPI,
    QueryTimeout,
    StoreError,
    StoreOptions,
    StoreUnauthorized,
    StoreUnreachable,
    parse_header,
)


def api(handler: Callable[[httpx.Request], httpx.Response], url: str = "http://store:9090") -> PrometheusAPI:
    return PrometheusAPI(url, transport=httpx.MockTransport(handler))


def answer(status: int, body: object, content_type: str = "application/json") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.Response(status, content=content, headers={"Content-Type": content_type})


def vector(*values: tuple[dict[str, str], float]) -> dict[str, object]:
    result = [{"metric": metric, "value": [1700000000.0, repr(value)]} for metric, value in values]
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


def test_a_vector_comes_back_as_series_without_their_name() -> None:
    seen: list[httpx.Request] = []

    def store(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer(200, vector(({"__name__": "m_total", "gpu": "0"}, 2.5)))

    [series] = api(store).instant("last_over_time(m_total[1h])", 1700000000.0)
    assert (series.labels, series.value) == ((("gpu", "0"),), 2.5)
    form = dict(httpx.QueryParams(seen[0].content.decode()))
    assert (seen[0].method, seen[0].url.path) == ("POST", "/api/v1/query")
    # The server ends a slow query at the client's own limit.
    assert (form["query"], form["time"], form["timeout"]) == ("last_over_time(m_total[1h])", "1700000000.000", "120s")


@pytest.mark.parametrize("url", ["http://store:9090/", "http://store:9090/api/v1", "http://store:9090/api/v1/"])
def test_a_datasource_url_is_taken_as_the_base(url: str) -> None:
    assert api(lambda _: answer(200, vector()), url).url == "http://store:9090"


@pytest.mark.parametrize(
    ("response", "error", "words"),
    [
        (answer(200, b"<html>Grafana</html>", "text/html"), NotPrometheusAPI, "text/html"),
        (answer(404, b"404 page not found", "text/plain"), NotPrometheusAPI, "HTTP 404"),
        (answer(200, {"status": "success", "data": "?"}), NotPrometheusAPI, "without a query result"),
        (answer(401, b"Unauthorized", "text/plain"), StoreUnauthorized, "--bearer-token-file"),
        (answer(503, b"Service Unavailable", "text/plain"), StoreError, "HTTP 503"),
        (
            answer(422, {"status": "error", "errorType": "bad_data", "error": "parse error at char 4\nmore"}),
            StoreError,
            "bad_data): parse error at char 4",
        ),
        (
            answer(
                503, {"status": "error", "errorType": "timeout", "error": "query timed out in expression evaluation"}
            ),
            QueryTimeout,
            "longer than 120s",
        ),
    ],
)
def test_what_a_store_sends_back_becomes_one_error(
    response: httpx.Response, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=re.escape(words)) as caught:
        api(lambda _: response).instant("up", 0.0)
    assert "\n" not in str(caught.value)


def test_a_refused_connection_is_unreachable_with_its_reason() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    with pytest.raises(StoreUnreachable, match=r"cannot connect: \[Errno 111\] Connection refused"):
        api(refuse).instant("up", 0.0)


def test_a_read_that_never_ends_is_a_query_timeout() -> None:
    def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(QueryTimeout, match="no answer within 120s"):
        api(hang).instant("up", 0.0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("X-Scope-OrgID: team-a", ("X-Scope-OrgID", "team-a")), ("A:b:c", ("A", "b:c")), ("  N :  v ", ("N", "v"))],
)
def test_headers_are_name_colon_value(text: str, expected: tuple[str, str]) -> None:
    assert parse_header(text) == expected


@pytest.mark.parametrize(
    "text", ["no colon", ": value", "two words: value", "Authorization Bearer s3cret", "Bearer s3cret: x"]
)
def test_a_header_without_a_name_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="Name: value") as raised:
        parse_header(text)
    # The message quoted the text, the token with it when the colon was missed.
    assert "s3cret" not in str(raised.value)


@pytest.mark.parametrize(
    ("text", "problem"),
    [("Authorization: Bearer s3cret\nsecond-line", "a line break"), ("X-Token: s3cret\x1b", "other than printable")],
)
def test_a_header_value_that_cannot_be_sent_is_refused_without_quoting_it(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as raised:
        parse_header(text)
    assert "s3cret" not in str(raised.value)


def test_a_token_file_of_more_than_the_token_is_refused_without_quoting_it(tmp_path: Path) -> None:
    # Its second line went out with the token: httpx refused the header at the first query, with
    # "cannot connect: Illegal header value b'Bearer s3cret\\nline2'" on the terminal.
    token = tmp_path / "token"
    token.write_text("s3cret\nline2\n", encoding="utf-8")
    with pytest.raises(BadInputError, match="the token holds a line break") as raised:
        PrometheusAPI("http://store:9090", StoreOptions(bearer_token_file=str(token)))
    assert "s3cret" not in str(raised.value)


# httpx's own InvalidURL escaped, a traceback, for an unclosed IPv6 bracket or a port no number.
@pytest.mark.parametrize("url", ["prometheus:9090", "ftp://store", "http://", "", "http://[::1", "http://store:90x0"])
def test_only_http_urls_are_stores(url: str) -> None:
    with pytest.raises(BadInputError, match="http:// or https://"):
        PrometheusAPI(url)


def _private_ca_chain(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate for 127.0.0.1 issued by it, as a minimal private CA makes them: the
    X.509 extensions that verification needs (basic constraints, the name), none of the
    identifier extensions (Subject and Authority Key Identifier) RFC 5280 asks CAs to add.
    Returns the CA certificate, the server's certificate and its key."""
    from cryptography import x509

    from tests.certs import issue, write_pem

    ca = issue("internal CA", [], None, ca=True)
    store = issue("store", [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))], ca)
    ca_cert, _ = write_pem(directory, "ca", ca)
    store_cert, store_key = write_pem(directory, "store", store)
    return ca_cert, store_cert, store_key


def test_a_store_certified_by_a_private_ca_is_trusted_through_the_ca_file_as_python_3_13_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Python 3.13's default context sets VERIFY_X509_STRICT (and VERIFY_X509_PARTIAL_CHAIN); on 3.13
    # the same --ca-file that Prometheus and Grafana trust was refused ("Missing Authority Key
    # Identifier"). Made here as 3.13 makes it, so that 3.11 checks what 3.13 does.
    default_context = ssl.create_default_context

    def as_python_3_13(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        context = default_context(*args, **kwargs)
        context.verify_flags |= ssl.VERIFY_X509_STRICT | ssl.VERIFY_X509_PARTIAL_CHAIN
        return context

    monkeypatch.setattr(ssl, "create_default_context", as_python_3_13)
    ca_file, cert, key = _private_ca_chain(tmp_path)
    body = json.dumps(vector(({"gpu": "0"}, 1.0))).encode()

    class Store(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Store)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{server.server_address[1]}"
    try:
        store = PrometheusAPI(url, StoreOptions(ca_file=str(ca_file), timeout_s=10.0))
        try:
            [series] = store.instant("up", 0.0)
        finally:
            store.close()
        assert series.value == 1.0
        # Still verified: against another CA the certificate is refused.
        (tmp_path / "other").mkdir()
        other_ca, _, _ = _private_ca_chain(tmp_path / "other")
        stranger = PrometheusAPI(url, StoreOptions(ca_file=str(other_ca), timeout_s=10.0))
        try:
            with pytest.raises(StoreUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
                stranger.instant("up", 0.0)
        finally:
            stranger.close()
    finally:
        server.shutdown()
        server.server_close()
