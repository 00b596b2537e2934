"""Fake serving-engine and training-job metrics endpoints, for end-to-end tests of the work rules.

Each endpoint is a prometheus_client HTTP server exporting, under the engines' real names
(exporters/promrules.py cites the releases), counters that grow at fixed rates with real time,
as a busy vLLM, Triton or training job would. Prometheus scrapes them with the target labels
Kubernetes discovery gives a pod (`namespace`, `pod`), which is what the work rules join on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from tests.fake_engines import shut_down


@dataclass(frozen=True)
class Counter:
    """A counter of work: its family name as the engine's client library declares it, its
    labels, and how many units a second it grows by."""

    name: str
    labels: Mapping[str, str]
    per_second: float
    # Triton (C++ prometheus-cpp) exports counters without the _total suffix prometheus_client
    # adds; such a one is served as an untyped sample of exactly this name.
    bare: bool = False


@dataclass(frozen=True)
class Engine:
    """One fake pod's metrics endpoint."""

    namespace: str
    pod: str
    counters: tuple[Counter, ...]


def vllm(namespace: str, pod: str, model: str, tokens_per_s: float) -> Engine:
    """vLLM (V1 engine): generated and prompt tokens, labelled model_name and engine."""
    labels = {"model_name": model, "engine": "0"}
    return Engine(
        namespace,
        pod,
        (
            Counter("vllm:generation_tokens", labels, tokens_per_s),
            Counter("vllm:prompt_tokens", labels, 4 * tokens_per_s),
        ),
    )


def triton(namespace: str, pod: str, model: str, inferences_per_s: float) -> Engine:
    return Engine(
        namespace, pod, (Counter("nv_inference_count", {"model": model, "version": "1"}, inferences_per_s, bare=True),)
    )


def trainer(namespace: str, pod: str, steps_per_s: float) -> Engine:
    """A training job's own step counter (prometheus_client Counter('training_steps'))."""
    return Engine(namespace, pod, (Counter("training_steps", {}, steps_per_s),))


@dataclass(eq=False)  # the registry keys collectors by identity
class _Growing(Collector):
    counters: tuple[Counter, ...]
    started: float = field(default_factory=time.monotonic)

    def collect(self) -> Iterator[Metric]:
        elapsed = time.monotonic() - self.started
        for counter in self.counters:
            value = counter.per_second * elapsed
            if counter.bare:
                family = Metric(counter.name, f"fake {counter.name}", "unknown")
                family.add_sample(counter.name, dict(counter.labels), value)
            else:
                family = CounterMetricFamily(counter.name, f"fake {counter.name}", labels=list(counter.labels))
                family.add_metric(list(counter.labels.values()), value)
            yield family


@dataclass
class Serving:
    """The running endpoints: (engine, "127.0.0.1:PORT") each."""

    targets: list[tuple[Engine, str]]
    _servers: list[tuple[WSGIServer, threading.Thread]]

    def stop(self) -> None:
        shut_down([server for server, _thread in self._servers])
        for _server, thread in self._servers:
            thread.join(timeout=5)


# The text format version the engines' servers announce (and Prometheus 2 knows).
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _text_app(registry: CollectorRegistry) -> object:
    """Always the classic text format, as vLLM's and Triton's servers answer Prometheus:
    prometheus_client's own server would negotiate OpenMetrics, which it writes with the
    colons of vLLM's names escaped."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        start_response("200 OK", [("Content-Type", TEXT_FORMAT)])
        return [generate_latest(registry)]

    return app


def serve(engines: list[Engine]) -> Serving:
    """Start one endpoint per engine on a free loopback port."""
    targets: list[tuple[Engine, str]] = []
    servers: list[tuple[WSGIServer, threading.Thread]] = []
    for engine in engines:
        registry = CollectorRegistry()
        registry.register(_Growing(engine.counters))
        server = make_server("127.0.0.1", 0, _text_app(registry), handler_class=_Quiet)  # type: ignore[arg-type]
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append((server, thread))
        targets.append((engine, f"127.0.0.1:{server.server_port}"))
    return Serving(targets, servers)
