"""The prompt cache over HTTP: real cached-token counts in usage, counters in /stats and /v1/status."""

from __future__ import annotations

import httpx
from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread

SYSTEM = "You are a careful agent. Read the sea story and answer in plain words. " * 12


def test_a_repeated_system_prompt_reports_cached_tokens(live_server: ServerThread) -> None:
    with httpx.Client(base_url=live_server.url, timeout=CLIENT_TIMEOUT_S) as http:
        before = http.get("/stats").json()["prompt_cache"]
        usages = []
        for task in ("Tell me about the ship.", "Tell me about the shore."):
            body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}],
                    "max_tokens": 3}
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            usages.append(response.json()["usage"])
        after = http.get("/stats").json()["prompt_cache"]
        status = http.get("/v1/status").json()["prompt_cache"]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 300
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] < usages[1]["prompt_tokens"]
    assert after["enabled"] and after["hits"] >= before["hits"] + 1
    assert after["hit_tokens"] - before["hit_tokens"] >= usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert status["entries"] >= 1 and status["bytes"] > 0
