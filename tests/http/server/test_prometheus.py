"""GET /metrics: Prometheus text format that parses, per-server registries, counters that move."""

from __future__ import annotations

from typing import Any

import httpx
from tests.http.fakes import FakeEngine
from tests.http.http_helpers import serve_fake
from prometheus_client.parser import text_string_to_metric_families

from mlx_trio.events import Finished, TextDelta, Usage
from mlx_trio.http.server.app import server_metrics
from mlx_trio.http.server.drain import Drain
from mlx_trio.http.server.metrics import RequestLog

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def _scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


class RestartedEngine(FakeEngine):
    """A fake whose tree shows a restarted decoder and a session (sessions get no series)."""

    def status(self) -> dict[str, Any]:
        status = super().status()
        status["tree"]["children"] = [
            {"id": "engine", "kind": "supervisor", "restart": "permanent", "state": "running", "restarts": 0,
             "children": [{"id": "decode-step", "kind": "decode-step", "restart": "permanent", "state": "running",
                           "restarts": 2}]},
            {"id": "sessions", "kind": "supervisor", "restart": "permanent", "state": "running", "restarts": 0,
             "children": [{"id": "session-req-1", "kind": "session", "restart": "temporary", "state": "running",
                           "restarts": 0}]},
        ]
        status["counters"].update(kv_bytes=4096, pending_rows=3, lease_busy_fraction=0.25, lease_queue_depth=1)
        return status


async def test_metrics_parse_and_counters_move_after_a_request() -> None:
    """After one streamed completion: requests, tokens, TTFT and inter-token samples moved; engine gauges are read."""
    async with serve_fake(RestartedEngine()) as (_, client):
        before = await _scrape(client)
        assert before[("mlx_trio_prompt_cache_hits_total", ())] == 0
        assert before[("mlx_trio_generation_tokens_total", ())] == 0
        body = {"prompt": "one two three", "max_tokens": 5, "stream": True}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        after = await _scrape(client)
    request = ("mlx_trio_http_requests_total",
               (("endpoint", "/v1/completions"), ("method", "POST"), ("status", "200")))
    assert after[request] == 1
    assert after[("mlx_trio_prompt_tokens_total", ())] == 3
    assert after[("mlx_trio_generation_tokens_total", ())] == 5
    assert after[("mlx_trio_generations_total", (("outcome", "length"),))] == 1
    assert after[("mlx_trio_time_to_first_token_seconds_count", ())] == 1
    assert after[("mlx_trio_inter_token_latency_seconds_count", ())] == 4
    assert after[("mlx_trio_prompt_cache_hits_total", ())] == 0
    assert after[("mlx_trio_kv_bytes", ())] == 4096 and after[("mlx_trio_waiting_rows", ())] == 3
    assert after[("mlx_trio_running_rows", ())] == 0
    assert after[("mlx_trio_lease_busy_fraction", ())] == 0.25 and after[("mlx_trio_lease_queue_depth", ())] == 1
    assert after[("mlx_trio_actor_restarts_total", (("actor", "decode-step"), ("kind", "decode-step")))] == 2
    assert not any(labels and dict(labels).get("actor", "").startswith("session-") for _, labels in after)
    # The scrape before was counted too: the first request to /metrics.
    assert after[("mlx_trio_http_requests_total", (("endpoint", "/metrics"), ("method", "GET"), ("status", "200")))] == 1


async def test_unknown_paths_share_one_series_and_errors_keep_their_status() -> None:
    """A 404 on any path counts under endpoint "other" (no series per path); a 400 keeps its status."""
    async with serve_fake() as (_, client):
        await client.get("/nope/1")
        await client.get("/nope/2")
        await client.post("/v1/completions", json={"prompt": ""})
        samples = await _scrape(client)
    assert samples[("mlx_trio_http_requests_total", (("endpoint", "other"), ("method", "GET"), ("status", "404")))] == 2
    bad = ("mlx_trio_http_requests_total", (("endpoint", "/v1/completions"), ("method", "POST"), ("status", "400")))
    assert samples[bad] == 1


async def test_two_servers_in_one_process_count_separately() -> None:
    """Each server has its own registry: no duplicate-name error, no shared counts."""
    async with serve_fake() as (_, first), serve_fake() as (_, second):
        await first.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
        assert (await _scrape(first))[("mlx_trio_generation_tokens_total", ())] == 2
        assert (await _scrape(second))[("mlx_trio_generation_tokens_total", ())] == 0


def test_a_cached_prompt_counts_as_a_prompt_cache_hit() -> None:
    """A finished generation whose usage reports cached tokens is a hit; its cached tokens are counted."""
    metrics = server_metrics(FakeEngine(), Drain())
    log = RequestLog("r", kind="text", stream=False, metrics=metrics)
    log.saw(TextDelta("a", (1, 2)))
    log.saw(TextDelta("b", (3, 4)))  # two tokens in one delta: two inter-token samples
    log.saw(Finished("stop", Usage(10, 4, cached_tokens=6)))
    log.done("stop")
    log.done("stop")  # counted once, like the log line
    value = metrics.registry.get_sample_value
    assert value("mlx_trio_prompt_cache_hits_total") == 1
    assert value("mlx_trio_prompt_cached_tokens_total") == 6
    assert value("mlx_trio_generations_total", {"outcome": "stop"}) == 1
    assert value("mlx_trio_inter_token_latency_seconds_count") == 2
