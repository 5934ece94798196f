"""--kv-layout paged end to end: the same completions as today's layout, a shared system prompt reused from blocks
(`cached_tokens`), `/stats` `batch.kv_blocks` back to idle after the requests, and a request the pool can never
hold refused with a 400 naming the budget."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import attrs
import httpx
import pytest

from mlx_trio.http.server.config import ServerConfig
from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread, tiny_engine_config

SYSTEM = "You are a careful agent. Read the sea story and answer in plain words. " * 12
TASKS = ["Tell me about the ship.", "Tell me about the shore.", "Count the waves.", "Name the robot.",
         "Why is the sky blue?", "Write a poem.", "What is 2024?", "Say hello."]
BUDGET = 16 << 20  # 2,048 blocks of 16 tokens of the tiny llama (512 bytes a token); admission also counts a prefill transient


@pytest.fixture(scope="module")
def paged_server() -> Iterator[ServerThread]:
    config = attrs.evolve(tiny_engine_config(), kv_layout="paged", kv_budget_bytes=BUDGET)
    with ServerThread(config, ServerConfig(port=0)) as server:
        yield server


def _chat(url: str, task: str, max_tokens: int = 6) -> dict:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}],
            "max_tokens": max_tokens, "temperature": 0}
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_paged_completions_equal_todays_layout_and_reuse_the_shared_prefix(paged_server: ServerThread,
                                                                           live_server: ServerThread) -> None:
    first = _chat(paged_server.url, TASKS[0])
    with ThreadPoolExecutor(8) as pool:  # siblings at once, joining and leaving the batch
        paged = list(pool.map(lambda t: _chat(paged_server.url, t), TASKS))
        plain = list(pool.map(lambda t: _chat(live_server.url, t), TASKS))
    assert [r["choices"][0]["message"]["content"] for r in paged] == \
        [r["choices"][0]["message"]["content"] for r in plain]
    assert first["choices"][0]["message"]["content"] == paged[0]["choices"][0]["message"]["content"]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in paged]
    assert min(cached) >= 300  # the system prompt's blocks, kept cached after the first request
    with httpx.Client(base_url=paged_server.url, timeout=CLIENT_TIMEOUT_S) as http:
        stats = http.get("/stats").json()["batch"]
        status = http.get("/v1/status").json()
    blocks = stats["kv_blocks"]
    assert blocks["total"] == BUDGET // blocks["block_bytes"] and blocks["block_size"] == 16
    assert blocks["used"] == 0 and stats["kv_bytes"] == 0  # every row gone: no block referenced
    assert blocks["cached"] > 0 and blocks["prefix_tokens_reused"] >= sum(cached)
    assert stats["kv_budget_bytes"] == blocks["total"] * blocks["block_bytes"]
    assert status["counters"]["kv_blocks"]["total"] == blocks["total"]


def test_a_request_the_pool_can_never_hold_is_a_400_naming_the_budget(paged_server: ServerThread) -> None:
    body = {"messages": [{"role": "user", "content": "the sea " * 1500}], "max_tokens": 8}  # ~3k tokens
    with httpx.Client(base_url=paged_server.url, timeout=CLIENT_TIMEOUT_S) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert "budget" in response.text.lower()


def test_siblings_arriving_together_prefill_their_shared_prefix_about_once() -> None:
    """8 requests with one long system prompt sent at once to a fresh server: the prefix's blocks are computed
    about once (each later chunk takes what a sibling cached), and `cached_tokens` says so per response."""
    config = attrs.evolve(tiny_engine_config(), kv_layout="paged", kv_budget_bytes=BUDGET)
    with ServerThread(config, ServerConfig(port=0)) as server, ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda t: _chat(server.url, t, max_tokens=2), TASKS))
        with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as http:
            reused = http.get("/stats").json()["batch"]["kv_blocks"]["prefix_tokens_reused"]
    prompt = [r["usage"]["prompt_tokens"] for r in responses]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses]
    computed = sum(prompt) - sum(cached)
    assert computed <= 1.3 * (max(prompt) + 7 * (max(prompt) - 400)), (prompt, cached)
    assert sorted(cached)[1] >= 400 and reused >= sum(cached)
