"""Tests for `mlx_trio.engine.prompt_cache.host_cache`: mlx-lm caches → host → caches, bit-exact and still generating."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from mlx_trio.engine.prompt_cache.identity import cache_layout
from mlx_trio.engine.prompt_cache.host_cache import from_host, model_cache_layout, to_host
from mlx_trio.engine.prompt_cache.host_entry import CLASSES, HostEntry, same_entry
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, tiny_model

from mlx_trio.testing import batch_reference

# Past llama_swa's window (16) before the split, and past it again while continuing.
PROMPT = [(13 * i + 5) % 250 + 3 for i in range(40)]
SPLIT = 25
DECODE_STEPS = 20


@cache
def _llama() -> nn.Module:
    return load(str(tiny_model(LLAMA)))[0]


@cache
def _llama_swa() -> nn.Module:
    return load(str(tiny_model(LLAMA_SWA)))[0]


@cache
def _llama_bf16() -> nn.Module:
    model = load(str(tiny_model(LLAMA)))[0]
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": _llama, "llama_swa": _llama_swa, "llama_bf16": _llama_bf16,
    "qwen3_next": cache(batch_reference.tiny_qwen3_next),
}
LAYOUTS = {"llama": "KVCache*2", "llama_swa": "RotatingKVCache,KVCache", "llama_bf16": "KVCache*2",
           "qwen3_next": "ArraysCache,KVCache,ArraysCache,KVCache"}


def _continue(model: nn.Module, caches: list[Any], rest: list[int], steps: int) -> list[mx.array]:
    """Feed `rest`, then `steps` greedy L=1 steps; every step's last-position logits."""
    logits = [model(mx.array([rest]), cache=caches)[0, -1]]
    for _ in range(steps):
        token = int(mx.argmax(logits[-1]).item())
        logits.append(model(mx.array([[token]]), cache=caches)[0, -1])
    mx.eval(logits)
    return logits


def _prefilled(model: nn.Module, tokens: list[int], decode_steps: int = 0) -> list[Any]:
    caches = make_prompt_cache(model)
    model(mx.array([tokens]), cache=caches)
    for token in range(decode_steps):  # L=1 steps: the rotating cache's in-place, wrapped-around path
        model(mx.array([[token + 7]]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("decode_steps", [0, 9], ids=["after_prefill", "after_decode"])
def test_restored_caches_continue_exactly_like_the_originals(name: str, decode_steps: int) -> None:
    """Split a run at SPLIT tokens, round-trip the caches through the host, continue: identical logits."""
    model = MODELS[name]()
    head, rest = PROMPT[:SPLIT], PROMPT[SPLIT:]
    held = head + [t + 7 for t in range(decode_steps)]
    entry = to_host(_prefilled(model, head, decode_steps), held)
    assert entry.tokens == tuple(held)
    restored = from_host(entry)
    assert [type(c) for c in restored] == [type(c) for c in make_prompt_cache(model)]
    want = _continue(model, _prefilled(model, head, decode_steps), rest, DECODE_STEPS)
    got = _continue(model, restored, rest, DECODE_STEPS)
    assert len(got) == len(want) == DECODE_STEPS + 1
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))


@pytest.mark.parametrize("name", list(MODELS))
def test_the_host_copy_is_bit_exact_and_stable(name: str) -> None:
    """to_host(from_host(e)) equals e: same arrays to the bit, same metadata, the layout recorded."""
    model = MODELS[name]()
    entry = to_host(_prefilled(model, PROMPT[:SPLIT], 3), PROMPT[:SPLIT + 3])
    again = to_host(from_host(entry), entry.tokens)
    assert same_entry(again, entry)
    assert entry.nbytes == sum(a.nbytes for a in entry.arrays.values()) > 0
    assert cache_layout(from_host(entry)) == model_cache_layout(model) == LAYOUTS[name]


def test_bfloat16_travels_as_uint16_bits() -> None:
    """numpy has no bfloat16: the host copy keeps the raw bits as uint16 and the rebuilt cache is bfloat16."""
    caches = _prefilled(_llama_bf16(), PROMPT[:SPLIT])
    entry = to_host(caches, PROMPT[:SPLIT])
    assert {a.dtype for a in entry.arrays.values()} == {np.dtype(np.uint16)}
    restored = from_host(entry)
    assert restored[0].keys.dtype == mx.bfloat16
    assert mx.array_equal(restored[0].keys, caches[0].keys[..., :SPLIT, :]).item()


def test_a_kv_cache_is_stored_without_its_unused_tail() -> None:
    """KVCache grows in steps of 256 positions; only the `offset` filled ones are copied."""
    caches = _prefilled(_llama(), PROMPT[:SPLIT])
    assert caches[0].keys.shape[2] == 256
    entry = to_host(caches, PROMPT[:SPLIT])
    assert {a.shape[2] for a in entry.arrays.values()} == {SPLIT}
    assert entry.nbytes < sum(c.nbytes for c in caches)


def test_empty_and_odd_states_round_trip() -> None:
    """None leaves, an empty KVCache and an ArraysCache with empty slots come back exactly."""
    arrays = ArraysCache(2)
    arrays[1] = mx.arange(6, dtype=mx.float32).reshape(1, 2, 3)
    rotating = RotatingKVCache(max_size=8, keep=2)
    caches = [KVCache(), arrays, rotating]
    restored = from_host(to_host(caches, []))
    assert restored[0].keys is None and restored[0].offset == 0
    assert restored[1].cache[0] is None and mx.array_equal(restored[1].cache[1], arrays[1]).item()
    assert restored[1].left_padding is None and restored[1].lengths is None
    assert (restored[2].keep, restored[2].max_size, restored[2].offset, restored[2]._idx) == (2, 8, 0, 0)


@pytest.mark.parametrize("bad", ["make_prompt_cache", "mx", "object", "NoSuchCache", 3])
def test_metadata_naming_anything_but_a_cache_class_is_refused(bad: Any) -> None:
    """A damaged file cannot make from_host call arbitrary names of mlx-lm's cache module."""
    entry = to_host([KVCache()], [])
    forged = attrs.evolve(entry, meta={**entry.meta, CLASSES: json.dumps([bad])})
    with pytest.raises(ValueError, match="not an mlx-lm cache class"):
        from_host(forged)


def test_a_state_leaf_that_cannot_be_stored_is_refused() -> None:
    """A state holding something other than arrays and plain scalars raises instead of writing garbage."""
    odd = ArraysCache(1)
    odd[0] = object()
    with pytest.raises(ValueError, match="unserialisable object"):
        to_host([odd], [])


def test_caches_must_hold_exactly_the_entry_tokens() -> None:
    """An offset that disagrees with the tokens would file the entry under a wrong key: refused both ways."""
    caches = _prefilled(_llama_swa(), PROMPT[:SPLIT])
    with pytest.raises(ValueError, match=f"holds {SPLIT} positions, the entry {SPLIT - 1} tokens"):
        to_host(caches, PROMPT[:SPLIT - 1])
    entry = to_host(caches, PROMPT[:SPLIT])
    with pytest.raises(ValueError, match="positions"):
        from_host(attrs.evolve(entry, tokens=entry.tokens + (1,)))


def test_host_entry_defaults_its_byte_count() -> None:
    """nbytes is the arrays' total unless given."""
    entry = HostEntry((1,), {"a": np.zeros(3, np.float32), "b": np.zeros(2, np.uint16)}, {})
    assert entry.nbytes == 16
