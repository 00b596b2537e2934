"""The HTTP endpoint: /metrics renders the collector's registry, /healthz reports poll health.

prometheus_client's WSGI app does the exposition (content negotiation, gzip, OpenMetrics);
this module only routes and serves it on a threading stdlib server.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def make_app(registry: CollectorRegistry, healthy: Callable[[], bool]) -> Callable[..., Iterable[bytes]]:
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/healthz":
            ok = healthy()
            body = b"ok\n" if ok else b"no successful poll within 3 poll intervals\n"
            status = "200 OK" if ok else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
            return [body]
        if path in ("/metrics", "/"):
            result: Iterable[bytes] = metrics_app(environ, start_response)
            return result
        body = b"not found: try /metrics or /healthz\n"
        start_response(
            "404 Not Found", [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
        )
        return [body]

    return app


class MetricsServer:
    """Serves the app on HOST:PORT in a background thread until `stop`."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, healthy: Callable[[], bool]) -> None:
        self._server = make_server(host, port, make_app(registry, healthy), _ThreadingServer, _QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
