"""The HTTP endpoint: /metrics renders the collector's registry, /healthz reports poll health.

prometheus_client's WSGI app does the exposition (content negotiation, gzip, OpenMetrics);
this module only routes and serves it on a threading stdlib server, with TLS and basic auth
when a web-config file asks for them (exporters/webconfig.py).

TLS: the listening socket stays plain and each accepted connection is wrapped in its own
request thread, so a client that stalls its handshake holds up only itself, never the accept
loop. A plain-HTTP request on the TLS port gets a 400 saying so, as Go's servers answer, and
no handshake. /healthz is open without credentials (see exporters/webconfig.py); every other
path needs them.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from exporters.webconfig import REALM, BasicAuth, WebConfig, peer_san_allowed

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]

# A TLS handshake or request that has not arrived in this long is dropped.
CONNECTION_TIMEOUT_S = 10.0
# The first byte of every TLS connection: a handshake record.
_TLS_HANDSHAKE = 0x16
_PLAIN_HTTP_ANSWER = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    tls: ssl.SSLContext | None = None
    client_allowed_sans: tuple[str, ...] = ()

    def setup_environ(self) -> None:
        super().setup_environ()
        if self.tls is not None:
            self.base_environ["HTTPS"] = "on"  # wsgi.url_scheme becomes https

    def finish_request(self, request: Any, client_address: Any) -> None:
        # Runs in the request's own thread (ThreadingMixIn), so the handshake does too.
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        tls_socket = self._handshake(request, client_address)
        if tls_socket is None:
            return
        try:
            super().finish_request(tls_socket, client_address)
        finally:
            self.shutdown_request(tls_socket)

    def _handshake(self, request: socket.socket, client_address: Any) -> ssl.SSLSocket | None:
        assert self.tls is not None
        request.settimeout(CONNECTION_TIMEOUT_S)
        try:
            first = request.recv(1, socket.MSG_PEEK)
            if first and first[0] != _TLS_HANDSHAKE:
                _answer_plain_http(request)
                return None
            tls_socket = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            log.debug("TLS handshake with %s failed: %s", client_address, exc)
            return None
        if not peer_san_allowed(tls_socket.getpeercert(), self.client_allowed_sans):
            log.debug("client certificate of %s names none of client_allowed_sans", client_address)
            self.shutdown_request(tls_socket)
            return None
        return tls_socket


def _answer_plain_http(request: socket.socket) -> None:
    request.sendall(_PLAIN_HTTP_ANSWER)
    request.shutdown(socket.SHUT_WR)
    # Read what the client sent before closing: closing with unread data resets the
    # connection, and the client might never see the answer.
    request.settimeout(1.0)
    for _ in range(16):  # at most 1 MiB, at most a few seconds
        if not request.recv(65536):
            break


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def _text(start_response: StartResponse, status: str, body: bytes, extra: list[tuple[str, str]]) -> list[bytes]:
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))), *extra]
    start_response(status, headers)
    return [body]


def _with_headers(start_response: StartResponse, extra: list[tuple[str, str]]) -> StartResponse:
    def respond(status: str, headers: list[tuple[str, str]], *args: Any) -> Any:
        return start_response(status, [*headers, *extra], *args)

    return respond


def make_app(
    registry: CollectorRegistry,
    healthy: Callable[[], bool],
    auth: BasicAuth | None = None,
    headers: Iterable[tuple[str, str]] = (),
) -> Callable[..., Iterable[bytes]]:
    metrics_app = make_wsgi_app(registry)
    extra_headers = list(headers)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if extra_headers:
            start_response = _with_headers(start_response, extra_headers)
        path = environ.get("PATH_INFO", "/")
        if path == "/healthz":
            ok = healthy()
            body = b"ok\n" if ok else b"no successful poll within 3 poll intervals\n"
            return _text(start_response, "200 OK" if ok else "503 Service Unavailable", body, [])
        if auth is not None and not auth.check(environ.get("HTTP_AUTHORIZATION")):
            challenge = [("WWW-Authenticate", f'Basic realm="{REALM}"')]
            return _text(start_response, "401 Unauthorized", b"Unauthorized\n", challenge)
        if path in ("/metrics", "/"):
            result: Iterable[bytes] = metrics_app(environ, start_response)
            return result
        return _text(start_response, "404 Not Found", b"not found: try /metrics or /healthz\n", [])

    return app


class MetricsServer:
    """Serves the app on HOST:PORT in a background thread until `stop`; over TLS and with
    basic auth when `web` (a loaded web-config file) asks for them."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        healthy: Callable[[], bool],
        web: WebConfig | None = None,
    ) -> None:
        app = make_app(
            registry,
            healthy,
            auth=web.auth if web is not None else None,
            headers=web.headers if web is not None else (),
        )
        self._server = make_server(host, port, app, _ThreadingServer, _QuietHandler)
        if web is not None and web.tls is not None:
            self._server.tls = web.tls
            self._server.client_allowed_sans = web.client_allowed_sans
            self._server.setup_environ()
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def scheme(self) -> str:
        return "https" if self._server.tls is not None else "http"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
