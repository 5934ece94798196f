"""`/stats` and `/v1/status` read after a response already count it, whichever process answers.

Read-your-writes: served the default way (one front process over the engine link) and in one
process (`--api-server-count 0`), with a draft model and with prompt lookup, the counters read
right after each response include that response's work, exactly where it is knowable: the decoded
tokens are its completion tokens less token 0 (prefill's), a draft identical to the model has every
proposal accepted, and `prefill_tokens` grows by the prompt tokens neither cached nor last (token 0's
step feeds the last), on every prefill path: chunked, a cohort, a prompt-cache hit.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread, tiny_engine_config

from mlx_trio.http import ServerConfig

# A prompt longer than this prefills in several chunks (solo path); shorter ones that arrive together, as a cohort.
STEP = 64
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=[(1, "draft"), (1, "lookup"), (0, "draft"), (0, "lookup")],
                ids=["front-draft", "front-lookup", "in-process-draft", "in-process-lookup"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[ServerThread, str]]:
    fronts, speculation = request.param
    engine = tiny_engine_config()
    speculative: dict[str, Any] = ({"draft_model": engine.model} if speculation == "draft" else {"prompt_lookup": True})
    config = attrs.evolve(engine, prefill_step_size=STEP, num_draft_tokens=3, **speculative)
    with ServerThread(config, ServerConfig(port=0, api_server_count=fronts)) as served:
        yield served, speculation


def _complete(url: str, prompt: list[int]) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                        "temperature": 0.0})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def _stats(url: str) -> dict[str, Any]:
    """/stats once the engine is quiet: the two views of one engine agree when nothing runs between the reads.

    A response can end a step before the batch does (the pipelined step after a row's last token, the leave one
    step behind), so the pair is read again until it agrees; a view that never catches up fails."""
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        for _ in range(100):
            stats, status = client.get("/stats").json(), client.get("/v1/status").json()
            if (stats["batch"]["decode_steps"] == status["counters"]["decode_steps"]
                    and stats["prompt_cache"]["prefill_tokens"] == status["prompt_cache"]["prefill_tokens"]):
                return stats
            time.sleep(0.02)
    raise AssertionError(f"/stats and /v1/status never agreed: {stats['batch']} vs {status['counters']}")


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, int]:
    return {"decode_steps": after["batch"]["decode_steps"] - before["batch"]["decode_steps"],
            "decoded_tokens": after["batch"]["decoded_tokens"] - before["batch"]["decoded_tokens"],
            "proposed": after["speculative"]["proposed"] - before["speculative"]["proposed"],
            "accepted": after["speculative"]["accepted"] - before["speculative"]["accepted"],
            "prefill_tokens": after["prompt_cache"]["prefill_tokens"] - before["prompt_cache"]["prefill_tokens"]}


def _uncached(usage: dict[str, Any]) -> int:
    """The prompt tokens a request's prefill ran: neither cached nor the last (token 0's step feeds that one)."""
    return usage["prompt_tokens"] - 1 - usage["prompt_tokens_details"]["cached_tokens"]


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 480 + 10 for i in range(length)]


def test_each_response_is_counted_before_the_next_read(server: tuple[ServerThread, str]) -> None:
    served, speculation = server
    for seed, length in [(1, 20), (2, 3 * STEP + 5), (1, 20)]:  # short, chunked, then a prompt-cache hit
        before = _stats(served.url)
        usage = _complete(served.url, _prompt(seed, length))
        delta = _delta(_stats(served.url), before)
        assert delta["decoded_tokens"] == usage["completion_tokens"] - 1 == MAX_TOKENS - 1, (delta, usage)
        assert delta["prefill_tokens"] == _uncached(usage), (delta, usage)
        assert 0 < delta["decode_steps"] <= delta["decoded_tokens"] + 2, delta  # (+ steps run past the end)
        if speculation == "draft":  # the model as its own draft: every proposal is the model's own token
            assert delta["accepted"] == delta["proposed"] > 0, delta
            assert delta["decode_steps"] < delta["decoded_tokens"], delta
        else:
            assert delta["proposed"] >= delta["accepted"] >= 0, delta
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the repeat hit the prompt cache


@pytest.mark.parametrize("length", [30, 3 * STEP + 8], ids=["cohort", "interleaved-chunks"])
def test_eight_concurrent_prompts_are_counted_whole(server: tuple[ServerThread, str], length: int) -> None:
    """Short prompts arriving together prefill as a cohort; long ones chunk by chunk, interleaved."""
    served, speculation = server
    prompts = [_prompt(100 + length + i, length + i) for i in range(8)]
    before = _stats(served.url)
    start = threading.Barrier(len(prompts))

    def one(prompt: list[int]) -> dict[str, Any]:
        start.wait()
        return _complete(served.url, prompt)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        usages = list(pool.map(one, prompts))
    delta = _delta(_stats(served.url), before)
    assert delta["prefill_tokens"] == sum(_uncached(usage) for usage in usages), (delta, usages)
    assert delta["decoded_tokens"] == sum(usage["completion_tokens"] - 1 for usage in usages), delta
    assert delta["decode_steps"] > 0 and delta["proposed"] >= delta["accepted"], delta
    # A draft model proposes at every speculative step; prompt lookup only where an n-gram recurs, and after a
    # step with none it waits up to MAX_QUIET_STEPS plain steps, which joins under load may shift past the end.
    assert delta["proposed"] > 0 or speculation == "lookup", delta
