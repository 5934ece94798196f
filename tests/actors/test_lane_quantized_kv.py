"""Quantized KV (`--kv-bits`) through the whole lane: tokens, the prompt cache and its SSD tier, a decoder restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_trio import open_engine
from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.testing.tiny_models import TinyModelSpec, tiny_model
from tests.actors.test_lane_batching import _fail_on_call, _two_requests_through_a_fault, _wait_drained
from tests.prompts import PROMPTS

# Heads of 64 dims, so groups of 32 and 64 both divide them (see tests/engine/batch/test_batch_quantized.py).
LLAMA_Q = TinyModelSpec("llama", hidden_size=128, heads=2, kv_heads=1)
Q4 = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}
SYSTEM = "You are a careful agent. Read the sea story and answer in plain words. " * 20
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about the ship."}]


def _serial(path: Path, prompt: list[int], max_tokens: int, **quant: Any) -> tuple[int, ...]:
    """mlx-lm's generate_step alone, greedy, with the same KV scheme, up to EOS (which completions leave out)."""
    model, tokenizer = load(str(path))
    tokens: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, kv_bits=quant["kv_bits"],
                                  kv_group_size=quant["kv_group_size"],
                                  quantized_kv_start=quant["quantized_kv_start"]):
        if int(token) in tokenizer.eos_token_ids:
            break
        tokens.append(int(token))
    return tuple(tokens)


def _ids(path: Path, prompts: list[str]) -> list[list[int]]:
    _, tokenizer = load(str(path))
    return [list(tokenizer.encode(p)) for p in prompts]


@pytest.mark.parametrize("batch", [1, 4])
async def test_concurrent_requests_each_get_mlx_lm_serial_quantized_tokens(batch: int) -> None:
    """Rows quantized from their first chunk (start 0), staggered joins: each == generate_step(kv_bits=4, ...)."""
    path = tiny_model(LLAMA_Q)
    prompts = _ids(path, PROMPTS[:6])
    expected = [_serial(path, p, 20, **Q4) for p in prompts]
    got: dict[int, tuple[int, ...]] = {}
    async with open_engine(str(path), batch=batch, **Q4) as engine:
        async def one(i: int) -> None:
            await trio.sleep(0.003 * i)
            got[i] = (await engine.complete(prompts[i], max_tokens=20)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        await _wait_drained(engine)
    assert [got[i] for i in range(len(prompts))] == expected


async def test_a_prompt_cache_hit_on_a_quantized_entry_equals_the_uncached_run() -> None:
    async with open_engine(str(tiny_model(LLAMA_Q)), batch=4, **Q4) as engine:
        cold = await engine.complete(CHAT, max_tokens=12)
        warm = await engine.complete(CHAT, max_tokens=12)
    assert cold.usage.cached_tokens == 0 and warm.usage.cached_tokens > 200
    assert warm.token_ids == cold.token_ids


async def _ssd_run(directory: Path, **quant: Any) -> tuple[tuple[int, ...], int, dict[str, Any]]:
    async with open_engine(str(tiny_model(LLAMA_Q)), batch=4, prompt_cache_dir=directory, **quant) as engine:
        done = await engine.complete(CHAT, max_tokens=8)
        await engine.drain_persistence()
        return done.token_ids, done.usage.cached_tokens, engine.status()["prompt_cache"]["ssd"]


async def test_ssd_entries_are_keyed_by_the_kv_format(tmp_path: Path) -> None:
    """A restart with other --kv-bits (or bf16) misses the stored entry (no error; the scan drops it as another
    format's); a restart with the same format restores what it stored, equal to the uncached run."""
    cold, cached, ssd = await _ssd_run(tmp_path, **Q4)
    assert cached == 0 and ssd["writes"] >= 1
    q8 = {**Q4, "kv_bits": 8}
    cold8, cached, ssd = await _ssd_run(tmp_path, **q8)
    assert cached == 0 and ssd["reads"] == 0 and not ssd["degraded"]
    warm8, cached, ssd = await _ssd_run(tmp_path, **q8)
    assert warm8 == cold8 and cached > 200 and ssd["reads"] == 1
    _, cached, ssd = await _ssd_run(tmp_path)
    assert cached == 0 and ssd["reads"] == 0
    again, cached, ssd = await _ssd_run(tmp_path, **Q4)
    assert again == cold and cached == 0


async def test_a_decoder_restart_resumes_quantized_rows(monkeypatch) -> None:
    """A failing step restarts decode-step; each row re-prefills its prompt and the tokens it had, quantized again.

    The resumed row is mlx-lm's serial quantized run of that longer prompt (its re-prefill attends the
    tokens it had in the format a fresh prefill gives them, docs/design.md "Quantized KV"), so the stream
    is: the first k tokens, then that run's.
    """
    path = tiny_model(LLAMA_Q)
    prompts = _ids(path, PROMPTS[:2])
    uninterrupted = [_serial(path, p, 30, **Q4) for p in prompts]
    _fail_on_call(monkeypatch, DecodeBatch, "step_decoded", 6, "injected step failure")
    results, decode, reserved = await _two_requests_through_a_fault(path, **Q4)
    assert decode["restarts"] == 1 and reserved == 0
    for prompt, first, got in zip(prompts, uninterrupted, results, strict=True):
        # Which step fails depends on when the second request joins (later on a loaded box): any k from
        # token 0 to the whole answer, but the rest is always the serial run of the longer prompt.
        resumed = [first[:k] + _serial(path, prompt + list(first[:k]), 30 - k, **Q4) for k in range(1, 31)]
        assert got in resumed


@pytest.mark.slow
async def test_the_default_model_with_8_bit_kv_matches_generate_step(tmp_path: Path) -> None:
    """SmolLM2 (64-dim heads) at --kv-bits 8 from the first chunk, two rows together: each == generate_step's."""
    quant = {"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 0}
    async with open_engine(cache_dir=tmp_path, batch=4, **quant) as engine:
        chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name three colours.")]
        ids = [engine.model.encode(chat) for chat in chats]
        got = {}

        async def one(i: int) -> None:
            got[i] = (await engine.complete(ids[i], max_tokens=24)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(one, i)
        path = Path(engine.model.path)
    assert [got[0], got[1]] == [_serial(path, p, 24, **quant) for p in ids]
