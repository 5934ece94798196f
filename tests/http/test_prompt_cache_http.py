"""The prompt cache over HTTP: real cached-token counts in usage, counters in /stats and /v1/status."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread

from mlx_trio.http.server.metrics import log as request_log

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


def test_a_changed_word_names_where_the_prompt_left_the_cache(live_server: ServerThread,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """One word changed mid-system-prompt: the log line and /stats name that token and the text around it."""
    from mlx_lm.tokenizer_utils import load  # noqa: PLC0415  (tests may import mlx-lm; the http package may not)

    from mlx_trio.testing.tiny_models import LLAMA, tiny_model  # noqa: PLC0415

    tokenizer = load(tiny_model(LLAMA))
    words = ["The lighthouse keeper counts the waves at night."] * 20
    first = [{"role": "system", "content": " ".join(words)}, {"role": "user", "content": "How many?"}]
    words[12] = "The lighthouse keeper counts the gulls at night."
    second = [{**first[0], "content": " ".join(words)}, first[1]]
    ids = [tokenizer.apply_chat_template(chat, add_generation_prompt=True) for chat in (first, second)]
    at = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    with httpx.Client(base_url=live_server.url, timeout=CLIENT_TIMEOUT_S) as http, \
            caplog.at_level(logging.INFO, logger=request_log.name):
        for chat in (first, second, first):
            assert http.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 2}).status_code == 200
        last = http.get("/stats").json()["prompt_cache"]["last_divergence"]
    before, cached, prompt = (tokenizer.decode(part) for part in (ids[0][at - 8:at], ids[0][at:at + 8],
                                                                  ids[1][at:at + 8]))
    assert "gulls" in prompt and "waves" in cached
    assert last == {"position": at, "entry_tokens": last["entry_tokens"], "before": before, "cached": cached,
                    "prompt": prompt}
    # The first request left a boundary snapshot and its finished row: either runs past the changed word.
    assert last["entry_tokens"] > at
    lines = [r.getMessage() for r in caplog.records if r.name == request_log.name]
    assert len(lines) == 3 and "diverged_at" not in lines[0]
    assert f"diverged_at={at}/{last['entry_tokens']} before={before!r} cached={cached!r} prompt={prompt!r}" in lines[1]
    # The first prompt again: its own row holds all of it (the cached answer is past the prompt): nothing lost.
    assert "diverged_at" not in lines[2]


def test_every_wire_reports_cached_tokens_streamed_and_whole(live_server: ServerThread) -> None:
    """The same chat on chat completions, Responses and Messages: each reports the cached prompt tokens."""
    system, user = "Count the sea birds, one by one, and say the total. " * 12, "Go."
    chat = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    wires = [
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 2},
         lambda usage: usage["prompt_tokens_details"]["cached_tokens"]),
        ("/v1/responses", {"instructions": system, "input": user, "max_output_tokens": 2},
         lambda usage: usage["input_tokens_details"]["cached_tokens"]),
        ("/v1/messages", {"model": "m", "system": system, "messages": chat[1:], "max_tokens": 2},
         lambda usage: usage["cache_read_input_tokens"]),
    ]
    with httpx.Client(base_url=live_server.url, timeout=CLIENT_TIMEOUT_S) as http:
        assert http.post("/v1/chat/completions", json=wires[0][1]).status_code == 200  # fills the cache
        for path, body, cached in wires:
            whole = http.post(path, json=body).json()
            stream_body = {**body, "stream": True, **({"stream_options": {"include_usage": True}}
                                                       if path == "/v1/chat/completions" else {})}
            events = [json.loads(line[len("data: "):]) for line in http.post(path, json=stream_body).text.splitlines()
                      if line.startswith("data: {")]
            last_usage = [e.get("usage") or e.get("response", {}).get("usage") for e in events]
            streamed = [u for u in last_usage if u and u.get("output_tokens", u.get("completion_tokens"))][-1]
            # At least the system prompt's snapshot; a repeat of a prompt whose finished row is still being
            # stored does not wait for it (a concurrent twin would wait a whole decode), so the two may differ.
            assert cached(whole["usage"]) >= 300 and cached(streamed) >= 300, (path, whole, streamed)
