"""A client for the Prometheus HTTP query API (`/api/v1/query`, `/api/v1/query_range`), as
Prometheus, VictoriaMetrics, Thanos Query and Mimir serve it. The only module of the fleet
report that talks HTTP (through httpx); nothing above it sees an httpx exception:

    GpuledgerError
    ├── StoreError               the store answered, but failed the query (HTTP 5xx, a limit):
    │                            exit 1
    └── BadInputError
        └── StoreUnusable        what the person running `report` must fix: exit 2
            ├── StoreUnreachable     no connection (refused, DNS, TLS)
            ├── NotPrometheusAPI     something answered that is not the query API
            ├── StoreUnauthorized    HTTP 401/403: credentials (--header, --bearer-token-file)
            ├── QueryTimeout         no answer within the query timeout
            └── EmptyStore           the store holds no gpuledger series for the window

Queries are POSTed as forms (selectors naming many nodes outgrow a URL) with the server-side
`timeout` set to the client's, so a slow query ends on both sides at once.
"""

from __future__ import annotations

import math
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agent.errors import BadInputError, GpuledgerError
from agent.fleet import DEFAULT_TIMEOUT_S
from agent.scrub import scrub


class StoreError(GpuledgerError):
    """The store answered but could not run a query (an HTTP 5xx, a limit it enforces)."""


class StoreUnusable(BadInputError):
    """The store cannot be used as given: the message says what to fix."""


class StoreUnreachable(StoreUnusable):
    pass


class NotPrometheusAPI(StoreUnusable):
    pass


class StoreUnauthorized(StoreUnusable):
    pass


class QueryTimeout(StoreUnusable):
    pass


class EmptyStore(StoreUnusable):
    pass


LabelSet = tuple[tuple[str, str], ...]  # a series' labels, sorted by name: hashable and stable


@dataclass(frozen=True, slots=True)
class Series:
    """One series of a query's answer: its labels (without `__name__`) and its samples, (unix
    seconds, value) in time order; an instant vector's series has one sample."""

    labels: LabelSet
    samples: tuple[tuple[float, float], ...]

    @property
    def value(self) -> float:
        """The (last) sample's value."""
        return self.samples[-1][1]

    def label(self, name: str) -> str:
        for key, value in self.labels:
            if key == name:
                return value
        return ""


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """How to reach the store: extra headers, a bearer token file, TLS verification."""

    headers: Mapping[str, str] = field(default_factory=dict)
    bearer_token_file: str | None = None
    ca_file: str | None = None
    insecure_skip_verify: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S


def parse_header(text: str) -> tuple[str, str]:
    """'Name: value' -> (name, value); ValueError saying what is wrong otherwise, never quoting
    the text: a header is where a credential goes (`Authorization Bearer TOKEN`, its colon missed)."""
    name, sep, value = text.partition(":")
    if not sep:
        raise ValueError("expected 'Name: value', got no ':'")
    if not name.strip():
        raise ValueError("expected 'Name: value', got no name before the ':'")
    if any(c.isspace() for c in name.strip()):
        raise ValueError("expected 'Name: value', got spaces in the name before the ':'")
    problem = _unsendable(value.strip())
    if problem:
        raise ValueError(f"the value of {name.strip()} holds {problem}")
    return name.strip(), value.strip()


def _unsendable(value: str) -> str | None:
    """What keeps `value` from going out as a header value, in words that do not quote it: httpx
    refuses it only at the first request, with a message that does (`Illegal header value
    b'Bearer TOKEN\\n...'`, a token file's second line with it)."""
    if any(c in "\r\n" for c in value):
        return "a line break"
    if any(not (" " <= c <= "~" or c == "\t") for c in value):
        return "a character other than printable ASCII"
    return None


class PrometheusAPI:
    """Queries one store. `transport` replaces the network (httpx.MockTransport in tests)."""

    def __init__(
        self, url: str, options: StoreOptions | None = None, *, transport: httpx.BaseTransport | None = None
    ) -> None:
        options = options or StoreOptions()
        self.url = _base_url(url)
        # The URL as messages and reports name it: a store's URL may carry its credentials
        # (http://reader:PASSWORD@store), which the requests need and no output may show.
        self.shown_url = scrub(self.url)
        headers = dict(options.headers)
        if options.bearer_token_file:
            headers["Authorization"] = f"Bearer {_read_token(options.bearer_token_file)}"
        verify: ssl.SSLContext | bool = True
        if options.insecure_skip_verify:
            verify = False
        elif options.ca_file:
            try:
                verify = ssl.create_default_context(cafile=options.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise BadInputError(f"--ca-file {options.ca_file}: cannot load: {exc}") from None
            # Python 3.13's default context adds OpenSSL's X509_STRICT checks (RFC 5280 profile
            # rules, not signatures: e.g. an issued certificate must carry an Authority Key
            # Identifier). Prometheus, Grafana and promtool (Go) accept certificates of private CAs
            # that lack those extensions, so the same --ca-file trusted the same store on 3.11 and
            # 3.12 and was refused on 3.13. The chain, names, dates and signatures are still checked.
            verify.verify_flags &= ~ssl.VERIFY_X509_STRICT
        self.timeout_s = options.timeout_s
        # A little longer on the client: the server's own timeout should be the one that speaks.
        slack = min(5.0, options.timeout_s)
        timeout = httpx.Timeout(options.timeout_s + slack, connect=min(10.0, options.timeout_s + slack))
        try:
            self._client = httpx.Client(
                headers=headers, verify=verify, timeout=timeout, transport=transport, trust_env=True
            )
        except ValueError as exc:  # an invalid header value
            raise BadInputError(f"--header: {exc}") from None

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> PrometheusAPI:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def instant(self, expr: str, at: float) -> list[Series]:
        """An instant query at `at`: a vector's series (one sample each) or, for a range
        selector such as `m[1h]`, a matrix's (its raw samples)."""
        return self._series(self._post("query", {"query": expr, "time": _time(at)}), expr)

    def range(self, expr: str, start: float, end: float, step_s: float) -> list[Series]:
        """A range query: each series' values at start, start + step, ... up to end."""
        form = {"query": expr, "start": _time(start), "end": _time(end), "step": f"{step_s:.3f}"}
        return self._series(self._post("query_range", form), expr)

    def _post(self, endpoint: str, form: dict[str, str]) -> Any:
        url = f"{self.url}/api/v1/{endpoint}"
        form = {**form, "timeout": f"{self.timeout_s:g}s"}
        try:
            response = self._client.post(url, data=form)
        except httpx.TimeoutException:
            raise QueryTimeout(
                f"{self.shown_url}: no answer within {self.timeout_s:g}s "
                "(raise --query-timeout, or report a shorter window)"
            ) from None
        except httpx.TransportError as exc:
            raise StoreUnreachable(f"{self.shown_url}: cannot connect: {_reason(exc)}") from None
        except httpx.InvalidURL as exc:
            raise StoreUnusable(f"{self.shown_url}: not a usable URL: {exc}") from None
        return self._payload(response, expr=form["query"])

    def _payload(self, response: httpx.Response, expr: str) -> Any:
        status = response.status_code
        if status in (401, 403):
            raise StoreUnauthorized(
                f"{self.shown_url}: HTTP {status} {response.reason_phrase}: the store wants credentials "
                "(--bearer-token-file, --header 'Authorization: ...')"
            )
        try:
            payload = response.json()
        except ValueError:
            payload = None
        if not isinstance(payload, dict) or payload.get("status") not in ("success", "error"):
            if status >= 500:  # a store that is there but failing (restarting, overloaded)
                raise StoreError(f"{self.shown_url}: HTTP {status} {response.reason_phrase} for {_short(expr)}")
            kind = response.headers.get("content-type", "no content type").split(";")[0]
            raise NotPrometheusAPI(
                f"{self.shown_url}: not a Prometheus query API (HTTP {status}, {kind} from /api/v1/query): give the "
                "server's base URL, e.g. http://prometheus:9090 or http://victoriametrics:8428"
            )
        if payload["status"] == "error":
            kind, error = payload.get("errorType", ""), str(payload.get("error", "")).splitlines()[0:1]
            message = error[0] if error else "no message"
            if kind == "timeout" or ("timeout" in message.lower() and "exceed" in message.lower()):
                raise QueryTimeout(f"{self.shown_url}: the query took longer than {self.timeout_s:g}s: {message}")
            raise StoreError(f"{self.shown_url}: query failed ({kind or f'HTTP {status}'}): {message}: {_short(expr)}")
        if status >= 300:
            raise StoreError(f"{self.shown_url}: HTTP {status} {response.reason_phrase} for {_short(expr)}")
        return payload.get("data")

    def _series(self, data: Any, expr: str) -> list[Series]:
        if not isinstance(data, dict) or "resultType" not in data:
            raise NotPrometheusAPI(f"{self.shown_url}: answered without a query result: not a Prometheus query API")
        kind, result = data["resultType"], data.get("result") or []
        if kind == "vector":
            return [
                Series(_labels(item["metric"]), ((float(item["value"][0]), _float(item["value"][1])),))
                for item in result
            ]
        if kind == "matrix":
            return [
                Series(_labels(item["metric"]), tuple((float(t), _float(v)) for t, v in item.get("values") or ()))
                for item in result
            ]
        raise StoreError(f"{self.shown_url}: expected a vector or matrix for {_short(expr)}, got a {kind}")


def _base_url(url: str) -> str:
    """The server's base URL: a trailing slash or /api/v1 (as copied from a datasource) dropped."""
    base = url.strip().rstrip("/")
    base = base.removesuffix("/api/v1")
    try:
        parsed = httpx.URL(base) if base else None
    except httpx.InvalidURL:  # "http://[::1", a port that is no number
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise BadInputError(f"--prometheus: expected an http:// or https:// URL, got {scrub(url)!r}")
    return base


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise BadInputError(f"--bearer-token-file {path}: {exc.strerror or exc}") from None
    if not token:
        raise BadInputError(f"--bearer-token-file {path}: empty")
    problem = _unsendable(token)
    if problem:
        raise BadInputError(f"--bearer-token-file {path}: the token holds {problem} (one line, the token alone)")
    return token


def _labels(metric: Mapping[str, str]) -> LabelSet:
    return tuple(sorted((k, v) for k, v in metric.items() if k != "__name__"))


def _float(text: str) -> float:
    # Prometheus writes values as strings; NaN (a staleness marker in raw samples) stays NaN.
    return float(text)


def _time(t: float) -> str:
    if not math.isfinite(t):
        raise ValueError(f"not a time: {t}")
    return f"{t:.3f}"


def _short(expr: str, limit: int = 160) -> str:
    return expr if len(expr) <= limit else expr[: limit - 3] + "..."


def _reason(exc: httpx.TransportError) -> str:
    """The innermost cause's words: "[Errno 111] Connection refused", not httpx's wrapper."""
    cause: BaseException = exc
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    text = str(cause) or str(exc) or type(exc).__name__
    return text.splitlines()[0]


def selector(metric: str, matchers: Sequence[tuple[str, str, str]] = ()) -> str:
    """`metric{name op "value", ...}` with the values quoted for PromQL."""
    if not matchers:
        return metric
    inner = ",".join(f"{name}{op}{_quote(value)}" for name, op, value in matchers)
    return f"{metric}{{{inner}}}"


def _quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'
