"""The HTTP endpoint: /metrics serves the registry's exposition, rendered once per poll;
/healthz reports poll health.

How a connection is served, and why:

- One thread (`metrics-http`) owns the listening socket and every connection that has not yet
  sent a complete request head. It accepts, completes TLS handshakes and reads request heads
  without blocking, so an idle or slow client costs a socket, never a thread. A connection
  whose head is not complete `request_timeout_s` after it was accepted is closed: one that
  sends nothing, half a request, or a byte a second.
- A complete head goes to a fixed pool of `workers` threads, which parse it with the standard
  library (http.server, wsgiref), run the WSGI app and write the response, each socket call
  bounded by `write_timeout_s`. One request per connection, as prometheus_client's own server.
- At most `max_connections` are open. A new one beyond that closes the connection that has
  waited longest without a complete request, so a client hoarding connections cannot lock out
  a scraper. The listen backlog is `backlog` (the kernel caps it at net.core.somaxconn).
- A client that resets, disconnects or times out costs at most one debug line.

The exposition changes once per poll, so it is rendered once per poll and format (plain text,
OpenMetrics when the Accept header asks for it), gzipped once, and those bytes are served to
every scraper (`Exposition`); HEAD gets GET's headers and no body, OPTIONS the methods
allowed, any other method a 405. `?name[]=NAME` (repeatable) keeps the samples so named, as
prometheus_client's own server does, rendered per request.

TLS (exporters/webconfig.py): a plain-HTTP request on the TLS port gets a 400 saying so, as Go's
servers answer, and no handshake; a client certificate must name one of `client_allowed_sans`
when the web config lists them. /healthz is open without credentials; every other path needs
them, and failed logins are throttled (webconfig.BasicAuth): a throttled client gets 429.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any, cast
from urllib.parse import parse_qs
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler

from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from agent.model import AgentState
from exporters.webconfig import REALM, BasicAuth, Login, WebConfig, peer_san_allowed

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
App = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

# The first byte of every TLS connection: a handshake record.
_TLS_HANDSHAKE = 0x16
_PLAIN_HTTP_ANSWER = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
# A request head ends with an empty line; http.server accepts bare LF line ends too.
_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")
# Clients choose the content type's version and escaping, so the set is open-ended: cache this
# many and render any others per request.
_MAX_CACHED_FORMATS = 8
_RESPONSE_BUFFER_BYTES = 256 * 1024  # headers and body leave in one write


@dataclass(frozen=True)
class Limits:
    """What one client may cost the server."""

    request_timeout_s: float = 5.0  # from accept to a complete request head, TLS handshake included
    write_timeout_s: float = 10.0  # each socket call while answering
    max_connections: int = 1024  # open at once, answering or waiting for a request
    workers: int = 8  # threads answering complete requests
    backlog: int = 1024  # listen queue of connections the kernel completed but we have not accepted
    max_head_bytes: int = 64 * 1024  # request line and headers; a longer head is dropped


@dataclass(frozen=True)
class Rendered:
    """One format of one state's exposition, plain and gzipped."""

    content_type: str
    body: bytes
    gzipped: bytes


class Exposition:
    """The registry's exposition, rendered at most once per state object and format.

    `state` returns the object the registry renders from; the pipeline swaps in a new frozen one
    after each poll, so its identity says whether the exposition can have changed. A scrape of an
    unchanged state costs a dict lookup. The first scrape after a poll renders; scrapes arriving
    meanwhile are served the previous poll's bytes rather than waiting on the render (only the
    very first scrape of a format waits, there being nothing older to serve).
    """

    def __init__(self, registry: CollectorRegistry, state: Callable[[], object]) -> None:
        self._registry = registry
        self._state = state
        self._rendering = threading.Lock()  # one render at a time; never held by a cache hit
        # content type -> (the state it was rendered from, its bytes). Replaced whole per format:
        # a reader sees the old pair or the new one.
        self._cache: dict[str, tuple[object, Rendered]] = {}

    def get(self, accept: str | None) -> Rendered:
        encoder, content_type = choose_encoder(accept or "")
        state = self._state()
        cached = self._cache.get(content_type)
        if cached is not None:
            if cached[0] is state:
                return cached[1]
            if not self._rendering.acquire(blocking=False):
                return cached[1]  # another scrape is rendering this poll
        else:
            self._rendering.acquire()
        try:
            cached = self._cache.get(content_type)
            if cached is not None and cached[0] is state:
                return cached[1]  # rendered while this one waited
            body = encoder(self._registry)
            rendered = Rendered(content_type, body, gzip.compress(body, mtime=0))
            if cached is not None or len(self._cache) < _MAX_CACHED_FORMATS:
                self._cache[content_type] = (state, rendered)
            return rendered
        finally:
            self._rendering.release()


class _Only(Collector):
    """The registry's families cut down to the samples named (`?name[]=`): matched by sample
    name, as prometheus_client's restricted registry matches them. The collector has no
    describe(), so that registry would find nothing to restrict; this asks it for everything."""

    def __init__(self, registry: CollectorRegistry, names: frozenset[str]) -> None:
        self._registry = registry
        self._names = names

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            samples = [s for s in family.samples if s.name in self._names]
            if samples:
                kept = Metric(family.name, family.documentation, family.type, family.unit)
                kept.samples = samples
                yield kept


_ALLOW_HEALTHZ = [("Allow", "GET, HEAD")]
_ALLOW_METRICS = [("Allow", "GET, HEAD, OPTIONS")]


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
    state: Callable[[], object],
    auth: BasicAuth | None = None,
    headers: Iterable[tuple[str, str]] = (),
) -> App:
    """The WSGI app: /healthz, then credentials, then /metrics (or /) from `Exposition`."""
    exposition = Exposition(registry, state)
    extra_headers = list(headers)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        if method == "HEAD":
            # What GET would answer, headers only (Content-Length included): as Go's servers do,
            # so a probe that asks with HEAD (curl -I, some load balancers) sees the status.
            for _chunk in app({**environ, "REQUEST_METHOD": "GET"}, start_response):
                pass
            return []
        if extra_headers:
            start_response = _with_headers(start_response, extra_headers)
        path = environ.get("PATH_INFO", "/")
        if path == "/healthz":
            if method != "GET":
                return _text(start_response, "405 Method Not Allowed", b"use GET or HEAD\n", _ALLOW_HEALTHZ)
            if not healthy():
                body = b"no successful poll within 3 poll intervals\n"
                return _text(start_response, "503 Service Unavailable", body, [])
            return _text(start_response, "200 OK", (degraded(state()) or "ok").encode() + b"\n", [])
        if auth is not None:
            login = auth.verdict(environ.get("HTTP_AUTHORIZATION"), environ.get("REMOTE_ADDR", ""))
            if login is Login.THROTTLED:
                retry = [("Retry-After", str(auth.retry_after_s))]
                return _text(start_response, "429 Too Many Requests", b"too many failed logins\n", retry)
            if login is not Login.ALLOWED:
                challenge = [("WWW-Authenticate", f'Basic realm="{REALM}"')]
                return _text(start_response, "401 Unauthorized", b"Unauthorized\n", challenge)
        if path not in ("/metrics", "/"):
            return _text(start_response, "404 Not Found", b"not found: try /metrics or /healthz\n", [])
        if method == "OPTIONS":
            return _text(start_response, "200 OK", b"", _ALLOW_METRICS)
        if method != "GET":
            return _text(start_response, "405 Method Not Allowed", b"use GET, HEAD or OPTIONS\n", _ALLOW_METRICS)
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        if names:
            encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT") or "")
            only = CollectorRegistry(auto_describe=False)
            only.register(_Only(registry, frozenset(names)))
            body = encoder(only)
            rendered = Rendered(content_type, body, gzip.compress(body, mtime=0))
        else:
            rendered = exposition.get(environ.get("HTTP_ACCEPT"))
        response_headers = [("Content-Type", rendered.content_type)]
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
            body = rendered.gzipped
            response_headers.append(("Content-Encoding", "gzip"))
        else:
            body = rendered.body
        response_headers.append(("Content-Length", str(len(body))))
        start_response("200 OK", response_headers)
        return [body]

    return app


def degraded(state: object) -> str:
    """Why a healthy agent is degraded ("" when it is not): GPUs discovery has not identified
    yet. /healthz still answers 200 then: it is what liveness probes and systemd's watchdog ask,
    and restarting the agent cannot mend a GPU's inforom; gpuledger_undiscovered_gpus and
    gpuledger_gpu_down_reason are what to alert on."""
    snapshot = state.snapshot if isinstance(state, AgentState) else None
    if snapshot is None:
        return ""
    undiscovered = [g for g in snapshot.gpus if not g.discovered]
    if not undiscovered:
        return ""
    gpus = ", ".join(f"GPU {g.index} ({g.down_reason or 'unknown'})" for g in undiscovered)
    return f"degraded: not yet discovered, retried with backoff: {gpus}"


# --- serving ------------------------------------------------------------------------------


class _Connection:
    """A client connection while the serving thread owns it, before its request is complete."""

    __slots__ = ("address", "deadline", "head", "sock", "stage")

    def __init__(self, sock: socket.socket, address: Any, deadline: float, stage: str) -> None:
        self.sock = sock  # an ssl.SSLSocket once the handshake has begun
        self.address = address
        self.deadline = deadline
        # "sniff": a TLS port's first byte is awaited; "handshake"; "head": reading the request;
        # "plain-on-tls": a plain-HTTP request on the TLS port, to be answered with a 400.
        self.stage = stage
        self.head = bytearray()

    @property
    def client(self) -> str:
        return str(self.address[0]) if isinstance(self.address, tuple) else str(self.address)


class _HeadThenSocket(io.RawIOBase):
    """Reads the request head already received, then the socket (a body, if a client sends one)."""

    def __init__(self, head: bytes, sock: socket.socket) -> None:
        self._head = memoryview(head)
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._sock.recv_into(buffer)


# What the Server header says: the product, not the Python build it runs on (wsgiref would send
# "WSGIServer/0.2 CPython/3.11.7", telling anyone who connects which interpreter's bugs to try).
SERVER_HEADER = "gpuledger"


class _ResponseHandler(ServerHandler):
    server_software = SERVER_HEADER

    def log_exception(self, exc_info: Any) -> None:
        # wsgiref prints the traceback to stderr; the daemon's log is the place for it.
        if isinstance(exc_info[1], OSError):
            log.debug("answering a request: %s", exc_info[1])
        else:
            log.error("the HTTP app failed", exc_info=exc_info)


class _RequestHandler(WSGIRequestHandler):
    """wsgiref's request handler, fed the head the serving thread already read."""

    def version_string(self) -> str:  # the Server header of the errors http.server answers itself
        return SERVER_HEADER

    def setup(self) -> None:
        conn: _Connection = self.request
        self.connection = conn.sock
        self.rfile = io.BufferedReader(_HeadThenSocket(bytes(conn.head), conn.sock))
        self.wfile = cast(io.BufferedWriter, conn.sock.makefile("wb", _RESPONSE_BUFFER_BYTES))

    def address_string(self) -> str:
        return str(self.client_address[0])

    def handle(self) -> None:
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline = self.request_version = self.command = ""
            self.send_error(414)
            return
        if not self.parse_request():
            return  # parse_request answered already
        rfile, wfile = cast(IO[bytes], self.rfile), cast(IO[bytes], self.wfile)
        handler = _ResponseHandler(rfile, wfile, self.get_stderr(), self.get_environ(), multithread=True)
        handler.request_handler = self  # type: ignore[attr-defined]  # wsgiref logs the request through it
        handler.run(self.server.get_app())  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        message = (format % args).encode("unicode_escape").decode("ascii")  # a request line may hold anything
        log.debug("%s %s", self.address_string(), message)


class _Site:
    """What wsgiref's request handler reads from its `server`: the app and the base environ."""

    def __init__(self, app: App, host: str, port: int, https: bool) -> None:
        self._app = app
        self.base_environ = {
            "SERVER_NAME": host,
            "SERVER_PORT": str(port),
            "GATEWAY_INTERFACE": "CGI/1.1",
            "SCRIPT_NAME": "",
            "CONTENT_LENGTH": "",
            "REMOTE_HOST": "",
            **({"HTTPS": "on"} if https else {}),  # wsgi.url_scheme becomes https
        }

    def get_app(self) -> App:
        return self._app


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    # IPv4 first where a name has both, so `localhost` binds 127.0.0.1 as it always has.
    family, _type, _proto, _name, address = min(infos, key=lambda info: info[0] != socket.AF_INET)
    listener = socket.create_server(address[:2], family=family, backlog=backlog)
    listener.setblocking(False)
    return listener


def _answer_plain_http(sock: socket.socket) -> None:
    sock.sendall(_PLAIN_HTTP_ANSWER)
    sock.shutdown(socket.SHUT_WR)
    # Read what the client sent before closing: closing with unread data resets the
    # connection, and the client might never see the answer. At most 1 MiB, for at most 1 s.
    deadline = time.monotonic() + 1.0
    for _ in range(16):
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            break
        sock.settimeout(left_s)
        if not sock.recv(65536):
            break


class MetricsServer:
    """Serves /metrics and /healthz on HOST:PORT in background threads until `stop`; over TLS
    and with basic auth when `web` (a loaded web-config file) asks for them. `state` returns the
    object the registry renders from (the pipeline's `state`): the exposition is rendered again
    only when it returns a different object. Binds in the constructor (OSError if it cannot)."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        healthy: Callable[[], bool],
        web: WebConfig | None = None,
        *,
        state: Callable[[], object],
        limits: Limits = Limits(),
    ) -> None:
        self.limits = limits
        self._tls = web.tls if web is not None else None
        self._allowed_sans = web.client_allowed_sans if web is not None else ()
        app = make_app(
            registry,
            healthy,
            state,
            auth=web.auth if web is not None else None,
            headers=web.headers if web is not None else (),
        )
        self._listener = _listen(host, port, limits.backlog)
        self._site = _Site(app, host, self.port, https=self._tls is not None)
        self._selector = selectors.DefaultSelector()
        self._waiting: dict[int, _Connection] = {}  # by file descriptor, oldest first
        self._answering = 0
        self._answering_lock = threading.Lock()
        self._requests: queue.SimpleQueue[_Connection | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._listener_paused_until = 0.0
        self._next_sweep = 0.0  # when waiting connections are next checked against their deadline
        self._thread = threading.Thread(target=self._serve, name="metrics-http", daemon=True)
        self._workers = [
            threading.Thread(target=self._work, name=f"metrics-http-worker-{i}", daemon=True)
            for i in range(limits.workers)
        ]

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    @property
    def open_connections(self) -> int:
        with self._answering_lock:
            return len(self._waiting) + self._answering

    def start(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        for worker in self._workers:
            worker.start()
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, close waiting connections, and let workers finish what they answer."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for _ in self._workers:
            self._requests.put(None)
        for conn in list(self._waiting.values()):
            self._close(conn)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # The serving thread: everything below until _work runs on it alone.

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                self._serve_once()
            except Exception:
                # A bug here must not leave the port open and unanswered for the rest of the run.
                log.exception("the HTTP serving loop failed; carrying on")
                time.sleep(0.1)

    def _serve_once(self) -> None:
        for key, _events in self._selector.select(timeout=0.25):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(64)
            else:
                self._advance(key.data)
        now = time.monotonic()
        if self._listener_paused_until and now >= self._listener_paused_until:
            self._listener_paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ)
        if now >= self._next_sweep:
            self._next_sweep = now + 0.25
            for conn in [c for c in self._waiting.values() if c.deadline <= now]:
                log.debug("closing the connection from %s: no complete request in time", conn.client)
                self._close(conn)

    def _accept(self) -> None:
        for _ in range(64):  # a batch, then back to serving the connections already open
            try:
                sock, address = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                # Out of file descriptors (EMFILE, ENFILE) or a transient accept error: make
                # room if anyone is waiting, else stop accepting briefly rather than spin.
                log.debug("accept failed: %s", exc)
                if self._waiting:
                    self._close(next(iter(self._waiting.values())))
                else:
                    self._selector.unregister(self._listener)
                    self._listener_paused_until = time.monotonic() + 0.1
                return
            if self.open_connections >= self.limits.max_connections:
                if not self._waiting:
                    sock.close()  # every slot is answering a complete request
                    continue
                oldest = next(iter(self._waiting.values()))
                log.debug("connection limit reached: closing the oldest idle one, from %s", oldest.client)
                self._close(oldest)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + self.limits.request_timeout_s
            conn = _Connection(sock, address, deadline, "sniff" if self._tls is not None else "head")
            with self._answering_lock:
                self._waiting[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _advance(self, conn: _Connection) -> None:
        """Moves a waiting connection on as far as the bytes it has sent allow."""
        try:
            if conn.stage == "sniff":
                self._sniff(conn)
            if conn.stage == "handshake":
                self._handshake(conn)
            if conn.stage == "head":
                self._read_head(conn)
        except BlockingIOError:
            pass  # woken with nothing to read after all
        except (OSError, ValueError) as exc:  # ValueError: a socket closed under us
            log.debug("connection from %s ended: %s", conn.client, exc)
            self._close(conn)

    def _sniff(self, conn: _Connection) -> None:
        assert self._tls is not None
        first = conn.sock.recv(1, socket.MSG_PEEK)
        if not first:
            self._close(conn)
        elif first[0] != _TLS_HANDSHAKE:
            conn.stage = "plain-on-tls"
            self._hand_over(conn)
        else:
            # The SSLSocket takes over the file descriptor: register it in the socket's place.
            self._selector.unregister(conn.sock)
            conn.sock = self._tls.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
            conn.stage = "handshake"

    def _handshake(self, conn: _Connection) -> None:
        sock = cast(ssl.SSLSocket, conn.sock)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._selector.modify(sock, selectors.EVENT_READ, conn)
            return
        except ssl.SSLWantWriteError:
            self._selector.modify(sock, selectors.EVENT_WRITE, conn)
            return
        if not peer_san_allowed(sock.getpeercert(), self._allowed_sans):
            log.debug("client certificate of %s names none of client_allowed_sans", conn.client)
            self._close(conn)
            return
        conn.stage = "head"

    def _read_head(self, conn: _Connection) -> None:
        while True:
            try:
                chunk = conn.sock.recv(65536)
            except (BlockingIOError, ssl.SSLWantReadError):
                break
            except ssl.SSLWantWriteError:
                self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
                return
            if not chunk:
                self._close(conn)  # the client went away before finishing its request
                return
            conn.head += chunk
            if any(end in conn.head for end in _HEAD_ENDS):
                self._hand_over(conn)
                return
            if len(conn.head) > self.limits.max_head_bytes:
                log.debug("closing the connection from %s: request head over %d bytes", conn.client, len(conn.head))
                self._close(conn)
                return
        self._selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _hand_over(self, conn: _Connection) -> None:
        self._selector.unregister(conn.sock)
        with self._answering_lock:
            del self._waiting[conn.sock.fileno()]
            self._answering += 1
        self._requests.put(conn)

    def _close(self, conn: _Connection) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        with self._answering_lock:
            self._waiting.pop(conn.sock.fileno(), None)
        conn.sock.close()

    # The workers.

    def _work(self) -> None:
        while (conn := self._requests.get()) is not None:
            try:
                conn.sock.settimeout(self.limits.write_timeout_s)
                if conn.stage == "plain-on-tls":
                    _answer_plain_http(conn.sock)
                else:
                    # wsgiref reads only base_environ and get_app() from its `server`.
                    _RequestHandler(cast(Any, conn), conn.address, cast(Any, self._site))
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_WR)
            except OSError as exc:
                log.debug("answering %s: %s", conn.client, exc)
            except Exception:
                log.exception("answering %s failed", conn.client)
            finally:
                conn.sock.close()
                with self._answering_lock:
                    self._answering -= 1
