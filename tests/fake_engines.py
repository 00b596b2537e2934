"""Serving engines' own /metrics, as a scrape sees them, for the serving pods of the fake fleet:
each pod's endpoint on its own port, its work counters growing while it runs.

The names and labels are the engines' own, so rules written against them join gpuledger's cost
counters here as they would in a cluster (by pod: the scrape's Kubernetes target labels; by
model: the engine's label):

    vLLM (0.6 and later, /metrics of the OpenAI server; counters via prometheus_client)
        vllm:prompt_tokens_total{model_name}, vllm:generation_tokens_total{model_name},
        vllm:request_success_total{model_name, finished_reason}, vllm:num_requests_running{model_name}
    Triton Inference Server (2.x, port 8002; counters typed counter, without a _total suffix)
        nv_inference_request_success{model, version}, nv_inference_count{model, version},
        nv_inference_exec_count{model, version}
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from socketserver import BaseServer, ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

TICK_S = 0.2  # how often the engines' work counters move


@dataclass
class Engine:
    """One serving pod's engine: kind ("vllm" or "triton"), the pod, the model it serves."""

    kind: str
    namespace: str
    pod: str
    model: str
    port: int = 0
    requests_per_tick: int = 3
    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=False))
    requests: int = 0  # served so far

    def __post_init__(self) -> None:
        if self.kind == "vllm":
            labels = ["model_name"]
            self._prompt = Counter(
                "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=self.registry
            )
            self._generated = Counter(
                "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=self.registry
            )
            self._success = Counter(
                "vllm:request_success", "Count of successfully processed requests.", [*labels, "finished_reason"],
                registry=self.registry,
            )  # fmt: skip
            self._running = Gauge(
                "vllm:num_requests_running", "Number of requests currently running on GPU.", labels,
                registry=self.registry,
            )  # fmt: skip
        elif self.kind == "triton":
            self.registry.register(_Triton(self))
        else:
            raise ValueError(f"unknown engine {self.kind!r}")

    def tick(self) -> None:
        """One tick of work: a few requests, each some prompt and generated tokens."""
        self.requests += self.requests_per_tick
        if self.kind == "vllm":
            model = self.model
            self._prompt.labels(model).inc(512 * self.requests_per_tick)
            self._generated.labels(model).inc(128 * self.requests_per_tick)
            self._success.labels(model, "stop").inc(self.requests_per_tick)
            self._running.labels(model).set(self.requests_per_tick)


class _Triton(Collector):
    """Triton's per-model counters: typed counter, named without _total (prometheus-cpp's way)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        labels = {"model": self._engine.model, "version": "1"}
        count = float(self._engine.requests)
        for name, help_text, value in (
            ("nv_inference_request_success", "Number of successful inference requests, all batch sizes", count),
            ("nv_inference_count", "Number of inferences performed (does not include cached requests)", count * 4),
            ("nv_inference_exec_count", "Number of model executions performed", count),
        ):
            metric = Metric(name, help_text, "counter")
            metric.samples.append(Sample(name, labels, value))
            yield metric


def _text_app(registry: CollectorRegistry) -> Callable[..., list[bytes]]:
    """The Prometheus text format, whatever the scraper asks for: the engines' metric names keep
    their colons there (prometheus_client's OpenMetrics output would escape them to `_`, which
    the engines' own servers, on older clients, do not)."""

    def app(_environ: dict[str, object], start_response: Callable[..., object]) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4; charset=utf-8")])
        return [generate_latest(registry)]

    return app


class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *_args: Any) -> None:
        pass


@dataclass
class Engines:
    """Every engine, each served on its own port, ticking on one thread until closed."""

    engines: list[Engine]
    _servers: list[WSGIServer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        for engine in self.engines:
            server = make_server("127.0.0.1", 0, _text_app(engine.registry), ThreadingWSGIServer, _QuietHandler)
            engine.port = server.server_port
            threading.Thread(target=server.serve_forever, name=f"engine-{engine.pod}", daemon=True).start()
            self._servers.append(server)
        threading.Thread(target=self._run, name="fake-engines", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            for engine in self.engines:
                engine.tick()

    def close(self) -> None:
        self._stop.set()
        shut_down(self._servers)


def shut_down(servers: Sequence[BaseServer]) -> None:
    """Stop and close `servers`, asked together. Each one's loop looks for a shutdown every
    half second and `shutdown` waits for it: one at a time, a fleet's engines took 8 s to stop."""
    stopping = [threading.Thread(target=server.shutdown) for server in servers]
    for thread in stopping:
        thread.start()
    for thread in stopping:
        thread.join()
    for server in servers:
        server.server_close()
