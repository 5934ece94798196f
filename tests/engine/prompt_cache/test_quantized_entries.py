"""Quantized prompt-cache entries: stored and restored as they are (no dequantize), and keyed by the KV format."""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.engine.prompt_cache.host_cache import from_host, model_cache_layout, to_host
from mlx_trio.engine.prompt_cache.identity import CacheIdentity
from mlx_trio.testing.tiny_models import TinyModelSpec, tiny_model

LLAMA_Q = TinyModelSpec("llama", hidden_size=128, heads=2, kv_heads=1)
SCHEME = KvScheme(bits=4, group_size=32, start=0)
PROMPT = [(13 * i + 5) % 500 + 3 for i in range(40)]


@cache
def _model() -> Any:
    return load(str(tiny_model(LLAMA_Q)))[0]


def _quantized(tokens: list[int]) -> list[Any]:
    caches = make_prompt_cache(_model())
    _model()(mx.array([tokens]), cache=caches)
    SCHEME.convert_due(caches)
    mx.eval([c.state for c in caches])
    return caches


def _continue(caches: list[Any], steps: int = 6) -> list[mx.array]:
    logits = [_model()(mx.array([[PROMPT[-1]]]), cache=caches)[0, -1]]
    for _ in range(steps):
        logits.append(_model()(mx.array([[int(mx.argmax(logits[-1]).item())]]), cache=caches)[0, -1])
    mx.eval(logits)
    return logits


def test_a_quantized_entry_round_trips_bit_exact_without_its_tail_and_continues_identically() -> None:
    head = PROMPT[:-1]
    entry = to_host(_quantized(head), head)
    assert entry.nbytes < sum(c.nbytes for c in _quantized(head))  # the 256-position buffer is cut to the tokens
    restored = from_host(entry)
    assert all(type(c) is QuantizedKVCache and (c.bits, c.group_size) == (4, 32) for c in restored)
    assert np.dtype(np.uint32) in {a.dtype for a in entry.arrays.values()}  # packed values, not dequantized floats
    got, want = _continue(restored), _continue(_quantized(head))
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True))


def test_the_identity_names_the_kv_format_and_bf16_keys_are_unchanged() -> None:
    model = _model()
    bf16 = model_cache_layout(model)
    assert bf16 == "KVCache*2"  # what every bf16 SSD file was keyed by before quantized KV existed
    layouts = {model_cache_layout(model, s.key()) for s in
               (SCHEME, KvScheme(bits=8, group_size=32, start=0), KvScheme(bits=4, group_size=64, start=0),
                KvScheme(bits=4, group_size=32, start=100))}
    assert len(layouts) == 4 and bf16 not in layouts
    keys = {CacheIdentity("m", "t", layout).key(PROMPT) for layout in layouts | {bf16}}
    assert len(keys) == 5


def test_a_quantized_stored_format_names_the_step_size_and_the_entry_cut() -> None:
    """A quantized entry is cut where its row converted, which moves with --prefill-step-size: a restart with
    another step size (or files stored before the cut, keyed by `key()` alone) must miss."""
    formats = {SCHEME.stored_key(2048), SCHEME.stored_key(512), SCHEME.key()}
    assert len(formats) == 3 and "" not in formats
    assert KvScheme().stored_key(2048) == ""  # bf16 keys stay what they were
