"""Decode's KV buffers kept off a multiple of 256 under prefill-only cuDNN (engine/kv/decode_layout.py).

MLX's CUDA backend runs a length-1 query on cuDNN only over a buffer of a
multiple of 256 slots; the layout pads such buffers before each decode step.
On the CPU the attention kernel is the same either way, so the padded steps
must give exactly the logits and tokens of the unpadded ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from mlx_trio import open_engine
from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.kv import decode_layout
from mlx_trio.engine.kv.batch_kv import HostPaddedBatchKVCache
from mlx_trio.engine.kv.decode_layout import CUDNN_DECODE_STEP, PAD, keep_vector_decode
from mlx_trio.testing import batch_reference as ref
from mlx_trio.testing.tiny_models import LLAMA, TinyModelSpec, tiny_model

from tests.goldens import GOLDENS, replay


@pytest.fixture
def layout_on() -> Iterator[None]:
    was = decode_layout.is_active()
    decode_layout.set_active(True)
    yield
    decode_layout.set_active(was)


def _filled(cache: Any, tokens: int, batch: int = 1) -> Any:
    keys = mx.random.normal((batch, 2, tokens, 8))
    cache.update_and_fetch(keys, keys + 1)
    return cache


def test_off_it_changes_nothing() -> None:
    assert not decode_layout.is_active()  # the default, and what the CPU's lease thread leaves
    cache = _filled(KVCache(), 5)
    keys = cache.keys
    keep_vector_decode([cache])
    assert cache.keys is keys


def test_a_buffer_on_the_multiple_is_padded_and_stays_off_it(layout_on: None) -> None:
    cache = _filled(KVCache(), 300)  # a 512-slot buffer
    before_k, before_v = cache.keys_and_values()
    mx.eval(before_k, before_v)
    keep_vector_decode([cache])
    assert cache.keys.shape[2] == 2 * CUDNN_DECODE_STEP + PAD and cache.offset == 300
    k, v = cache.keys_and_values()
    assert mx.array_equal(k, before_k).item() and mx.array_equal(v, before_v).item()
    # Decode to the end of the buffer and past it: mlx-lm's own growth keeps it off the multiple.
    for _ in range(2 * CUDNN_DECODE_STEP + PAD - 300 + 3):
        keep_vector_decode([cache])
        _filled(cache, 1)
        assert cache.keys.shape[2] % CUDNN_DECODE_STEP == PAD
    assert cache.keys.shape[2] == 3 * CUDNN_DECODE_STEP + PAD


def test_batch_caches_are_padded_rotating_and_unaligned_ones_left(layout_on: None) -> None:
    plain = _filled(BatchKVCache([0, 3]), 256, batch=2)
    host = _filled(HostPaddedBatchKVCache([0, 0]), 10, batch=2)
    ring = _filled(RotatingKVCache(max_size=256), 300)
    odd = _filled(KVCache(), 5)
    odd.keys = odd.keys[..., :100, :]  # as after an extraction: any length
    odd.values = odd.values[..., :100, :]
    shapes = {id(c): c.keys.shape for c in (ring, odd)}
    keep_vector_decode([plain, host, ring, odd])
    assert plain.keys.shape[2] == plain.values.shape[2] == 256 + PAD
    assert host.keys.shape[2] == 256 + PAD and host.is_unpadded
    assert ring.keys.shape == shapes[id(ring)] and odd.keys.shape == shapes[id(odd)]


@cache
def _llama() -> tuple[Any, tuple[int, ...]]:
    model, tokenizer = load(str(tiny_model(LLAMA)))
    return model, tuple(tokenizer.eos_token_ids)


CHURN = [(0, 12, 16), (3, 40, 9), (1, 1, 6), (2, 27, 14), (3, 8, 1), (4, 33, 10), (7, 38, 11), (10, 24, 7)]


def test_padded_decode_is_bit_identical_to_mlx_lm_batching(layout_on: None) -> None:
    """Joins, leaves and a lone row again, every step padded where due: every logit equals mlx-lm's."""
    from mlx_trio.params import SamplingParams

    model, eos = _llama()
    arrivals = [ref.Arrival(f"r{i}", at, tuple((11 * i + 5 * j + j * j) % 509 + 3 for j in range(n)),
                            SamplingParams(max_tokens=m)) for i, (at, n, m) in enumerate(CHURN)]
    padded: list[int] = []

    def watch(_: int, batch: DecodeBatch) -> None:
        padded.append(batch._caches[0].keys.shape[2] % CUDNN_DECODE_STEP)

    got = ref.run_schedule(ref.ours(model, prefill_step_size=8), arrivals, eos=eos, max_batch=8, on_step=watch)
    decode_layout.set_active(False)
    want = ref.run_schedule(ref.reference(model, prefill_step_size=8), arrivals, eos=eos, max_batch=8)
    assert 0 not in padded and PAD in padded and any(p != PAD for p in padded), padded  # where due, only there
    assert got.tokens == want.tokens
    for key, diff in ref.logit_diffs(got, want).items():
        assert diff == 0.0, (key, diff)


@pytest.mark.parametrize("batch", [1, 8], ids=["batch-1", "batch-8"])
@pytest.mark.parametrize("case", [c for c in GOLDENS["cases"] if c["model"] == "llama"][:3], ids=lambda c: c["name"])
async def test_engine_with_the_layout_still_matches_mlx_lm(layout_on: None, case: dict[str, Any], batch: int) -> None:
    """The goldens through the whole engine with every decode step padded where due."""
    path = tiny_model(TinyModelSpec(**GOLDENS["models"][case["model"]]))
    async with open_engine(str(path), batch=batch, prefill_step_size=case.get("prefill_step_size", 2048)) as engine:
        await replay(engine, case)
