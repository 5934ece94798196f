"""`GET /metrics`: Prometheus text format, from a registry of the server's own.

Each `Metrics` has its own `CollectorRegistry` (never prometheus-client's
global one), so several servers in one process do not collide, and one
`HttpServer` keeps its `Metrics` across restarts of the HTTP child, so its
counters do not reset. Two kinds of series:

* counted by the HTTP layer as requests pass: requests by method,
  endpoint and status, generations by outcome, prompt / generation / cached tokens,
  prompt-cache hits, time-to-first-token and inter-token latency;
* read from `Engine.status()` at each scrape (`EngineCollector`): running and
  waiting rows, KV bytes, lease busy fraction and queue depth, and restarts
  and liveness of every supervised actor (sessions excepted: they are
  temporary, never restarted, and would be one series per request).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from quart import Quart, Response, request

from mlx_trio.events import Usage
from mlx_trio.http.server.fresh_status import fresh_status

if TYPE_CHECKING:
    from mlx_trio.http.server.state import AppState

PREFIX = "mlx_trio"
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# engine.status()["counters"] key → (metric name, help).
_ENGINE_GAUGES = {
    "active_rows": ("running_rows", "Requests being prefilled or decoded"),
    "pending_rows": ("waiting_rows", "Requests queued for admission"),
    "kv_bytes": ("kv_bytes", "Bytes of KV cache held by running requests"),
    "kv_budget_bytes": ("kv_budget_bytes", "Bytes of KV cache admission may reserve"),
    "lease_busy_fraction": ("lease_busy_fraction", "Fraction of recent time the GPU lease thread was busy"),
    "lease_queue_depth": ("lease_queue_depth", "Jobs waiting for the GPU lease thread"),
}

# engine.status()["counters"] key → (counter name, help): totals since the engine started
# (across actor restarts: actors/engine_tree.py `RetiredCounts`).
_ENGINE_COUNTERS = {
    "decode_steps": ("decode_steps", "Model forwards of decode steps (a speculative step is one)"),
    "decoded_tokens": ("decoded_tokens", "Tokens the decode steps emitted"),
    "speculative_proposed": ("speculative_proposed_tokens", "Speculative proposals verified"),
    "speculative_accepted": ("speculative_accepted_tokens", "Speculative proposals the target model accepted"),
}


class Metrics:
    """The instruments of one server. `status` is `Engine.status`; `gauges` adds HTTP-side gauges."""

    def __init__(self, status: Callable[[], dict[str, Any]],
                 gauges: Callable[[], dict[str, tuple[str, float]]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests answered, by method, endpoint and status",
                                ["method", "endpoint", "status"], registry=self.registry)
        self.generations = Counter(f"{PREFIX}_generations", "Generations ended, by finish reason or error code",
                                   ["outcome"], registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished generations",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens",
                                         "Completion tokens of finished generations (EOS included)",
                                         registry=self.registry)
        self.cached_prompt_tokens = Counter(f"{PREFIX}_prompt_cached_tokens",
                                            "Prompt tokens served from the prompt cache", registry=self.registry)
        self.prompt_cache_hits = Counter(f"{PREFIX}_prompt_cache_hits",
                                         "Finished generations whose prompt was partly in the prompt cache",
                                         registry=self.registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "From the request reaching the engine to its first token", buckets=TTFT_BUCKETS_S,
                              registry=self.registry)
        self.inter_token = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                                     "Time between consecutive streamed tokens", buckets=INTER_TOKEN_BUCKETS_S,
                                     registry=self.registry)
        self.registry.register(EngineCollector(status, gauges))

    def finished(self, usage: Usage) -> None:
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.cached_prompt_tokens.inc(usage.cached_tokens)
        if usage.cached_tokens > 0:
            self.prompt_cache_hits.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """Reads the engine's counters and supervision tree at scrape time."""

    def __init__(self, status: Callable[[], dict[str, Any]],
                 gauges: Callable[[], dict[str, tuple[str, float]]] | None) -> None:
        self._status = status
        self._gauges = gauges

    def describe(self) -> list[Metric]:
        return []  # names are fixed and unique; no need to collect at registration

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        counters = status.get("counters", {})
        for key, (name, help_text) in _ENGINE_GAUGES.items():
            value = counters.get(key)
            if isinstance(value, (int, float)):
                yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
        for key, (name, help_text) in _ENGINE_COUNTERS.items():
            value = counters.get(key)
            if isinstance(value, int):
                yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
        restarts = CounterMetricFamily(f"{PREFIX}_actor_restarts", "Restarts of each supervised actor",
                                       labels=["actor", "kind"])
        up = GaugeMetricFamily(f"{PREFIX}_actor_up", "1 while the actor runs", labels=["actor", "kind"])
        for node in _supervised(status.get("tree", {})):
            labels = [str(node.get("id")), str(node.get("kind", ""))]
            restarts.add_metric(labels, node.get("restarts", 0))
            up.add_metric(labels, 1 if node.get("state") == "running" else 0)
        yield restarts
        yield up
        for name, (help_text, value) in (self._gauges() if self._gauges else {}).items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)


def _supervised(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every child under `node`, depth first; temporary children (sessions) are left out."""
    for child in node.get("children", ()):
        if child.get("restart") != "temporary":
            yield child
            yield from _supervised(child)


def register_metrics(app: Quart, state: AppState) -> None:
    metrics = state.metrics

    @app.after_request
    async def count_request(response: Response) -> Response:
        # The route's pattern, not the path: unknown paths must not add series.
        endpoint = request.url_rule.rule if request.url_rule is not None else "other"
        metrics.requests.labels(method=request.method, endpoint=endpoint, status=str(response.status_code)).inc()
        return response

    @app.get("/metrics")
    async def scrape() -> Response:
        await fresh_status(state.engine)  # the collector reads `status()`: a front's copy is made current first
        return Response(metrics.exposition(), status=200, content_type=CONTENT_TYPE_LATEST)
