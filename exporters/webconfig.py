"""TLS and basic auth for the HTTP endpoint, from a web-config file in the format exporters
built on prometheus/exporter-toolkit share (node_exporter's --web.config.file):

    tls_server_config:
      cert_file: server.crt            # relative paths are relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional: mutual TLS
      client_ca_file: clients-ca.crt
      min_version: TLS12               # default TLS12; max_version default TLS13
    http_server_config:
      headers: {Strict-Transport-Security: max-age=31536000}
    basic_auth_users:
      prometheus: $2y$10$...           # bcrypt hashes (htpasswd -nBC 10 "" | tr -d ':\\n')

Differences from exporter-toolkit, each an explicit error rather than a silent no-op:
inline `cert`/`key` (use the files), `cipher_suites` and `curve_preferences` (Go's names have
no exact OpenSSL equivalent), `rate_limit`, and the client auth types that accept a client
certificate without verifying it (`RequestClientCert`, `RequireAnyClientCert`: Python's ssl
module verifies every certificate it asks for). `http2` is accepted; the endpoint serves
HTTP/1.1. The file is read once when the daemon starts, not on every request.

/healthz needs no credentials: it says only whether polls succeed, and liveness probes
(kubelet, systemd, load balancers) should not need the scrape password. Everything else,
/metrics and unknown paths alike, answers 401 without them.

This module is the only one that imports `bcrypt`.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import logging
import math
import re
import secrets
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import bcrypt
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, field_validator

from agent.errors import ConfigError
from agent.scrub import escape_control
from agent.yamlfile import YamlFileError, read_yaml

log = logging.getLogger(__name__)

REALM = "gpuledger"

TLS_VERSIONS: dict[str, ssl.TLSVersion] = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
ClientAuthType = Literal[
    "NoClientCert", "RequestClientCert", "RequireAnyClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert"
]
TlsVersionName = Literal["TLS10", "TLS11", "TLS12", "TLS13"]
HeaderName = Literal[
    "Content-Security-Policy",
    "X-Frame-Options",
    "X-Content-Type-Options",
    "X-XSS-Protection",
    "Strict-Transport-Security",
]

# $2a$ / $2b$ / $2y$ (htpasswd writes 2y), a two-digit cost, 22 characters of salt and 31 of hash.
_BCRYPT_HASH = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TlsServerConfig(_Strict):
    cert_file: str | None = None
    key_file: str | None = None
    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None
    client_ca_file: str | None = None
    client_auth_type: ClientAuthType = "NoClientCert"
    client_allowed_sans: list[str] = []
    min_version: TlsVersionName = "TLS12"
    max_version: TlsVersionName = "TLS13"
    cipher_suites: list[str] = []
    prefer_server_cipher_suites: bool = True
    curve_preferences: list[str] = []

    @field_validator("cert", "key")
    @classmethod
    def _no_inline_pair(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("inline certificates and keys are not supported by gpuledger: use cert_file and key_file")
        return value

    @field_validator("cipher_suites", "curve_preferences")
    @classmethod
    def _no_go_names(cls, value: list[str]) -> list[str]:
        if value:
            raise ValueError("not supported by gpuledger (OpenSSL's defaults for the TLS version apply)")
        return value

    @field_validator("client_auth_type")
    @classmethod
    def _verifiable(cls, value: str) -> str:
        if value in ("RequestClientCert", "RequireAnyClientCert"):
            raise ValueError(
                f"{value} (a client certificate without verification) is not supported by gpuledger: "
                "use RequireAndVerifyClientCert or VerifyClientCertIfGiven with client_ca_file"
            )
        return value


class HttpServerConfig(_Strict):
    http2: bool = True  # accepted for compatibility; the endpoint serves HTTP/1.1
    headers: dict[HeaderName, str] = {}


class RateLimitConfig(_Strict):
    interval: Any = None
    burst: Any = None


def _bcrypt_hash(value: str) -> str:
    match = _BCRYPT_HASH.match(value)
    if match is None:
        raise ValueError("not a bcrypt hash (expected $2y$10$ and 53 more characters, as htpasswd -nB writes)")
    if not 4 <= int(match.group(1)) <= 31:
        raise ValueError(f"bcrypt cost {match.group(1)} is outside 04-31")
    return value


def _user_name(value: str) -> str:
    if ":" in value:
        raise ValueError("a user name cannot contain ':' (basic auth splits on it)")
    return value


BcryptHash = Annotated[str, AfterValidator(_bcrypt_hash)]
UserName = Annotated[str, AfterValidator(_user_name)]


class WebConfigFile(_Strict):
    tls_server_config: TlsServerConfig | None = None
    http_server_config: HttpServerConfig = HttpServerConfig()
    basic_auth_users: dict[UserName, BcryptHash] | None = None
    rate_limit: RateLimitConfig | None = None

    @field_validator("rate_limit")
    @classmethod
    def _no_rate_limit(cls, value: RateLimitConfig | None) -> RateLimitConfig | None:
        if value is not None:
            raise ValueError("not supported by gpuledger")
        return value


@dataclass(frozen=True)
class WebConfig:
    """What the HTTP server needs: a server TLS context (None: plain HTTP), the SANs a client
    certificate must carry (empty: any verified certificate), the basic-auth check (None: no
    auth), and headers to add to every response."""

    source: str
    tls: ssl.SSLContext | None = None
    client_allowed_sans: tuple[str, ...] = ()
    auth: BasicAuth | None = None
    headers: tuple[tuple[str, str], ...] = ()


def load_web_config(path: str | Path) -> WebConfig:
    """Parse and check the web-config file; load its certificates. Raises ConfigError (exit 2)
    with one line per problem, each naming the file and the key."""
    path = Path(path)
    try:
        raw = read_yaml(path, "web config")
    except YamlFileError as exc:
        raise ConfigError(str(exc)) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping of settings at the top, got {type(raw).__name__}")
    try:
        parsed = WebConfigFile(**raw)
    except ValidationError as exc:
        raise ConfigError("; ".join(_problems(exc, str(path)))) from None
    tls = parsed.tls_server_config
    context = _tls_context(tls, path) if tls is not None else None
    users = parsed.basic_auth_users or {}
    if users and context is None:
        log.warning("%s: basic_auth_users without tls_server_config: passwords cross the network in clear text", path)
    return WebConfig(
        source=str(path),
        tls=context,
        client_allowed_sans=tuple(tls.client_allowed_sans) if tls is not None else (),
        auth=BasicAuth({user: hashed.encode() for user, hashed in users.items()}) if users else None,
        headers=tuple(parsed.http_server_config.headers.items()),
    )


def _problems(exc: ValidationError, source: str) -> list[str]:
    lines = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"] if part != "[key]")
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        # A key may be any text, newlines included: the line stays one line.
        lines.append(escape_control(f"{source}: {key}: {message}"))
    return lines


def _tls_context(tls: TlsServerConfig, config_path: Path) -> ssl.SSLContext:
    where = f"{config_path}: tls_server_config"
    if not tls.cert_file or not tls.key_file:
        missing = "cert_file" if not tls.cert_file else "key_file"
        raise ConfigError(f"{where}.{missing}: required when tls_server_config is set")
    base = config_path.parent
    cert_file = _existing(base, tls.cert_file, f"{where}.cert_file")
    key_file = _existing(base, tls.key_file, f"{where}.key_file")
    if TLS_VERSIONS[tls.min_version] > TLS_VERSIONS[tls.max_version]:
        raise ConfigError(f"{where}.min_version: {tls.min_version} is above max_version {tls.max_version}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_VERSIONS[tls.min_version]
    context.maximum_version = TLS_VERSIONS[tls.max_version]
    if tls.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        problem = f"cannot load the certificate {cert_file} with the key {key_file} ({exc.reason or exc})"
        raise ConfigError(f"{where}.cert_file/key_file: {problem}") from None
    has_ca = tls.client_ca_file is not None or tls.client_ca is not None
    if tls.client_auth_type == "NoClientCert":
        if has_ca:
            raise ConfigError(f"{where}.client_ca_file: set without a client_auth_type that verifies clients")
        if tls.client_allowed_sans:
            raise ConfigError(f"{where}.client_allowed_sans: needs client_auth_type RequireAndVerifyClientCert")
        return context
    if not has_ca:
        raise ConfigError(f"{where}.client_ca_file: required by client_auth_type {tls.client_auth_type}")
    if tls.client_allowed_sans and tls.client_auth_type != "RequireAndVerifyClientCert":
        raise ConfigError(f"{where}.client_allowed_sans: needs client_auth_type RequireAndVerifyClientCert")
    try:
        if tls.client_ca_file is not None:
            context.load_verify_locations(cafile=_existing(base, tls.client_ca_file, f"{where}.client_ca_file"))
        if tls.client_ca is not None:
            context.load_verify_locations(cadata=tls.client_ca)
    except ssl.SSLError as exc:
        raise ConfigError(f"{where}.client_ca_file: cannot load the client CA: {exc.reason}") from None
    required = tls.client_auth_type == "RequireAndVerifyClientCert"
    context.verify_mode = ssl.CERT_REQUIRED if required else ssl.CERT_OPTIONAL
    return context


def _existing(base: Path, name: str, key: str) -> str:
    path = base / name  # an absolute `name` wins over `base`
    if not path.is_file():
        raise ConfigError(f"{key}: no such file {path}")
    return str(path)


def peer_san_allowed(peer_cert: Mapping[str, Any] | None, allowed: tuple[str, ...]) -> bool:
    """True when the verified client certificate names one of `allowed` (DNS, IP, email or
    URI subject alternative name), as exporter-toolkit's client_allowed_sans checks."""
    if not allowed:
        return True
    if not peer_cert:
        return False
    names = {str(value) for _kind, value in peer_cert.get("subjectAltName", ())}
    return any(name in names for name in allowed)


class Login(enum.Enum):
    ALLOWED = "allowed"
    REFUSED = "refused"  # no, wrong or malformed credentials: 401
    THROTTLED = "throttled"  # too many failures from this client, or bcrypt busy: 429


class FailureThrottle:
    """Failed logins per client address, as token buckets: `burst` failures at once, then one
    more every `interval_s`. At most `max_clients` addresses are remembered, the least recently
    seen forgotten first: a forgotten address starts again with a full bucket, so the bound
    costs precision under a flood of addresses, never memory."""

    def __init__(
        self,
        burst: int = 5,
        interval_s: float = 1.0,
        max_clients: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst = burst
        self.interval_s = interval_s
        self._max_clients = max_clients
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, client: str) -> bool:
        """Spend one attempt for `client`; False when it has none left."""
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.pop(client, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) / self.interval_s)
            allowed = tokens >= 1.0
            self._buckets[client] = (tokens - 1.0 if allowed else tokens, now)
            while len(self._buckets) > self._max_clients:
                self._buckets.popitem(last=False)
        return allowed

    def forgive(self, client: str) -> None:
        """A good login: the client's earlier failures no longer count."""
        with self._lock:
            self._buckets.pop(client, None)


class BasicAuth:
    """Checks `Authorization: Basic` against bcrypt hashes.

    bcrypt is slow on purpose (tens of milliseconds at cost 10), and Prometheus sends the same
    credentials every scrape, so a successful check is remembered for `cache_ttl_s`. The cache
    is keyed by an HMAC of user and password under a key made at start and kept only in memory:
    it holds neither the password nor a digest that could be attacked offline without that key.
    Failures are never cached. An unknown user costs a bcrypt check all the same, so timing does
    not tell which user names exist.

    Guessing is throttled before it reaches bcrypt: each client address may spend `burst`
    checks at once, then one a second (`FailureThrottle`; a good login refunds its check), and
    only one bcrypt check runs at a time, so wrong passwords from any number of clients keep at
    most one core busy. A throttled client, or one that waited `bcrypt_wait_s` for its turn, is
    told to retry later. Credentials already in the cache skip both, so a scraper whose
    password was checked keeps scraping from an address someone else is guessing from.
    """

    def __init__(
        self,
        users: Mapping[str, bytes],
        cache_ttl_s: float = 60.0,
        max_cached: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        failures: FailureThrottle | None = None,
        bcrypt_wait_s: float = 1.0,
    ) -> None:
        if not users:
            raise ValueError("no users")
        self._users = dict(users)
        self._decoy = self._users[min(self._users)]
        self._ttl_s = cache_ttl_s
        self._max_cached = max_cached
        self._clock = clock
        self._key = secrets.token_bytes(32)
        self._cache: dict[bytes, float] = {}  # HMAC(user, password) -> expiry
        self._lock = threading.Lock()
        self._failures = failures if failures is not None else FailureThrottle(clock=clock)
        self._bcrypt_turn = threading.Lock()
        self._bcrypt_wait_s = bcrypt_wait_s

    @property
    def retry_after_s(self) -> int:
        """Seconds a throttled client should wait (a Retry-After header's value)."""
        return max(1, math.ceil(self._failures.interval_s))

    def check(self, authorization: str | None, client: str = "") -> bool:
        return self.verdict(authorization, client) is Login.ALLOWED

    def verdict(self, authorization: str | None, client: str = "") -> Login:
        """Whether the `Authorization` header's credentials let `client` (an address) in."""
        credentials = _parse_basic(authorization)
        if credentials is None:
            return Login.REFUSED  # costs no bcrypt check, so nothing to throttle
        user, password = credentials
        hashed = self._users.get(user)
        token = hmac.new(self._key, user.encode() + b"\0" + password, hashlib.sha256).digest()
        now = self._clock()
        with self._lock:
            expiry = self._cache.get(token)
            if expiry is not None and expiry > now and hashed is not None:
                return Login.ALLOWED
        if not self._failures.take(client):
            return Login.THROTTLED
        if not self._bcrypt_turn.acquire(timeout=self._bcrypt_wait_s):
            return Login.THROTTLED
        try:
            matched = bcrypt.checkpw(password, hashed if hashed is not None else self._decoy)
        except ValueError:  # e.g. a password over bcrypt's 72 bytes
            matched = False
        finally:
            self._bcrypt_turn.release()
        if not matched or hashed is None:
            return Login.REFUSED
        self._failures.forgive(client)
        with self._lock:
            if len(self._cache) >= self._max_cached:
                self._cache = {k: t for k, t in self._cache.items() if t > now}
                if len(self._cache) >= self._max_cached:
                    self._cache.clear()
            self._cache[token] = now + self._ttl_s
        return Login.ALLOWED


def _parse_basic(authorization: str | None) -> tuple[str, bytes] | None:
    if not authorization:
        return None
    scheme, _, encoded = authorization.strip().partition(" ")
    if scheme.lower() != "basic" or not encoded:
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = decoded.partition(b":")
    if not sep:
        return None
    try:
        return user.decode(), password
    except UnicodeDecodeError:
        return None
