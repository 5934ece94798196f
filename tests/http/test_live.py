"""Raw HTTP against a tiny real model: SSE framing, disconnects freeing KV, status and stats."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread, sse_events

from tests.goldens import golden
from mlx_trio.actors.row_cap import AUTO_CEILING

CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 6}


@pytest.fixture(scope="module")
def http(live_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def _wait_for(http: httpx.Client, condition: Callable[[dict[str, Any]], bool],
              timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = http.get("/stats").json()["batch"]
        if condition(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def _cancelled(http: httpx.Client) -> int:
    """Requests the engine's actors dropped because their caller left (summed over the status tree)."""
    def count(node: dict[str, Any]) -> int:
        stats = node.get("stats") or {}
        own = sum(v for k, v in stats.items() if k in ("cancelled", "requests_cancelled") and isinstance(v, int))
        return own + sum(count(child) for child in node.get("children", []))

    return count(http.get("/v1/status").json()["tree"])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions"])
def test_chat_sse_framing_on_a_real_model(http: httpx.Client, path: str) -> None:
    """Keepalive comments for the prompt, role only first, one finish_reason, usage chunk, [DONE] last."""
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    response = http.post(path, json=body)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "data: [DONE]"
    assert events.count("data: [DONE]") == 1
    comments = [e for e in events if e.startswith(": keepalive ")]
    # The first progress comment counts the prompt tokens already cached (0 on a cold prompt).
    assert comments and comments[0].startswith(": keepalive ")
    done, total = map(int, comments[0].removeprefix(": keepalive ").split("/"))
    assert 0 <= done < total
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1] if e.startswith("data: ")]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


def test_disconnect_mid_stream_frees_the_row_and_its_kv(http: httpx.Client) -> None:
    """Closing a long stream early: /stats shows the row leave and kv_bytes return to 0."""
    cancelled = _cancelled(http)
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        # One iterator kept open: leaving an httpx line iterator closes the connection, which is
        # the disconnect under test and must not happen before the busy check.
        lines = response.iter_lines()
        data = [line for line in itertools.islice(lines, 12) if line.startswith("data: {")]
        assert data, "no token arrived"
        busy = http.get("/stats").json()["batch"]
        assert busy["active_rows"] == 1 and busy["kv_bytes"] > 0, busy
    stats = _wait_for(http, lambda s: s["active_rows"] == 0 and s["kv_bytes"] == 0)
    assert stats["active_rows"] == 0 and stats["pending_rows"] == 0 and stats["kv_bytes"] == 0
    counters = http.get("/v1/status").json()["counters"]
    assert counters["kv_bytes"] == 0 and counters["active_rows"] == 0
    assert _cancelled(http) == cancelled + 1
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_disconnect_of_a_non_streamed_request_cancels_it(live_server: ServerThread, http: httpx.Client) -> None:
    """A client timing out on a non-streamed request cancels it in the engine (not run to max_tokens)."""
    cancelled = _cancelled(http)
    with httpx.Client(base_url=live_server.url, timeout=0.3) as impatient, pytest.raises(httpx.TimeoutException):
        impatient.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 3000})
    stats = _wait_for(http, lambda s: s["active_rows"] == 0 and s["kv_bytes"] == 0)
    assert stats["active_rows"] == 0 and stats["kv_bytes"] == 0
    assert _cancelled(http) == cancelled + 1


def test_stats_and_status_shapes(http: httpx.Client) -> None:
    """/stats has the batch fields; /v1/status has the supervision tree with the http child in it."""
    stats = http.get("/stats").json()["batch"]
    assert set(stats) == {"configured", "mode", "active_rows", "pending_rows", "submitted_rows", "kv_bytes",
                          "kv_budget_bytes", "decode_steps", "decoded_tokens", "kv_blocks"}
    # --batch auto (the default): a tiny model's rows of 8k tokens fit the CPU's budget many times over.
    assert stats["configured"] == AUTO_CEILING and stats["mode"] == "batch" and stats["kv_budget_bytes"] > 0
    assert stats["kv_blocks"] is None  # the padded layout (auto on the CPU)
    status = http.get("/v1/status").json()
    assert status["counters"]["kv_layout"] == "padded"  # --kv-layout auto on the CPU, and why
    assert status["counters"]["kv_layout_reason"].startswith("auto: no paged decode kernel on this backend (cpu)")
    children = {c["id"]: c for c in status["tree"]["children"]}
    assert children["http"]["state"] == "running" and children["http"]["kind"] == "http"
    assert {"engine", "sessions"} <= set(children)
    assert status["counters"]["lease_queue_depth"] >= 0


def test_health_is_ok_when_loaded(http: httpx.Client) -> None:
    """With the model loaded and every actor up, /health is exactly 200 {"status": "ok"}."""
    response = http.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def _decode_counts(http: httpx.Client) -> tuple[int, int]:
    """(steps, tokens_decoded) of the batch decode actor, from the status tree."""
    def find(node: dict[str, Any]) -> dict[str, Any] | None:
        stats = node.get("stats") or {}
        if "tokens_decoded" in stats and "steps" in stats:
            return stats
        return next((found for child in node.get("children", []) if (found := find(child))), None)

    stats = find(http.get("/v1/status").json()["tree"])
    assert stats is not None
    return stats["steps"], stats["tokens_decoded"]


# Eight golden cases (mlx-lm's own outputs, goldens/tiny.json): greedy and seeded sampling, penalties and
# logit bias, raw and chat; two repeat with another case between them.
CONCURRENT_CASES = ("greedy_raw", "greedy_chat", "seeded_top_p", "seeded_top_k_min_p", "seeded_penalties",
                    "greedy_logit_bias", "greedy_raw", "seeded_top_p")


def test_eight_concurrent_sse_clients_each_stream_their_own_golden(live_server: ServerThread,
                                                                   http: httpx.Client) -> None:
    """Under the default --batch auto: 8 SSE clients at once share decode steps and each streams exactly its golden."""
    cases = [golden("llama", name) for name in CONCURRENT_CASES]
    start = threading.Barrier(len(cases))

    def stream(case: dict[str, Any]) -> tuple[str, str | None]:
        chat = isinstance(case["prompt"], list)
        body = {**case["params"], "stream": True, "temperature": case["params"].get("temperature", 0.0),
                **({"messages": case["prompt"]} if chat else {"prompt": case["prompt_ids"]})}
        text, finish = "", None
        with httpx.Client(base_url=live_server.url, timeout=CLIENT_TIMEOUT_S) as client:
            start.wait()
            with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    for choice in json.loads(line.removeprefix("data: "))["choices"]:
                        text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                        finish = choice.get("finish_reason") or finish
        return text, finish

    steps, tokens = _decode_counts(http)
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(stream, cases))
    assert results == [(case["text"], case["finish_reason"]) for case in cases]
    steps_after, tokens_after = _decode_counts(http)
    # Rows shared steps: a serial run would take one step per decoded token.
    assert tokens_after - tokens > 2 * (steps_after - steps)
