"""The engine's counters (/stats, /v1/status, /metrics) count every request's work across actor restarts.

Each actor's own counts start from 0 when it restarts; the engine adds what its earlier incarnations
counted (actors/engine_tree.py), so a total never goes back and a request resumed across a crash is
counted exactly: its decoded tokens are its completion less each attempt's token 0 (prefill's), its
prefill the prompt tokens neither cached nor last, each submission one `submitted_rows`.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.prompts import PROMPTS

MAX_TOKENS = 12


def _counts(engine: Any) -> dict[str, int]:
    status = engine.status()
    counters = status["counters"]
    return {"decoded_tokens": counters["decoded_tokens"], "decode_steps": counters["decode_steps"],
            "submitted_rows": counters["submitted_rows"], "prefill_tokens": status["prompt_cache"]["prefill_tokens"]}


async def _settled(engine: Any) -> None:
    with trio.fail_after(20):
        while not engine.health()[0] or engine.status()["counters"]["kv_bytes"]:
            await trio.sleep(0.01)


@pytest.mark.parametrize("actor", ["decode-step", "prefill", "admission"])
async def test_a_restart_loses_no_count(actor: str) -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=4) as engine:
        first = await engine.complete(PROMPTS[1], max_tokens=MAX_TOKENS)
        before = _counts(engine)
        assert before["decoded_tokens"] == MAX_TOKENS - 1 and before["submitted_rows"] == 1
        assert before["prefill_tokens"] == first.usage.prompt_tokens - 1
        engine.faults.arm(actor, "raise")  # fires as the next request reaches it: before its first decode step
        done = await engine.complete(PROMPTS[2], max_tokens=MAX_TOKENS)
        assert engine.faults.fired and done.token_ids == (await engine.complete(PROMPTS[2], max_tokens=MAX_TOKENS)).token_ids
        await _settled(engine)
        after = _counts(engine)
    # The faulted request, then its undisturbed repeat (a prompt-cache hit: only its last prompt token is fed).
    attempts = 2 if actor == "decode-step" else 1  # a decode-step crash comes after its first token 0
    assert after["decoded_tokens"] == before["decoded_tokens"] + (MAX_TOKENS - attempts) + (MAX_TOKENS - 1)
    assert after["submitted_rows"] == before["submitted_rows"] + 2 + 1
    assert after["decode_steps"] > before["decode_steps"]
    assert after["prefill_tokens"] >= before["prefill_tokens"] + done.usage.prompt_tokens - 1
