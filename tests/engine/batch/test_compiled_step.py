"""The compiled decode step (engine/batch/compiled_step.py): the same greedy tokens as the uncompiled step.

Each schedule runs twice on one model, compiled and not, and every row's
tokens must be equal: a lone row (solo KVCache, across a 256-token buffer
step), a padded batch built by joins at different steps, leaves down to one
row (extracted back to solo caches). Architectures the compiled step does
not cover (the qwen3-next hybrid's SSM state; batches of sliding-window
rows) must run their uncompiled step, and the test checks that the compiled
forward did not run for the hybrid at all. On the CPU the logits and the KV
are bit-identical too, float32 and bfloat16
(`test_compiled_logits_are_bit_identical_on_the_cpu`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_trio.engine.batch import compiled_step
from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.kv.batch_kv import HostPaddedBatchKVCache
from mlx_trio.params import SamplingParams
from mlx_trio.testing.batch_reference import Arrival, tiny_qwen3_next
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, QWEN3, tiny_model

from tests.engine.batch.batch_driver import run_schedule

# llama_swa: its lone rows compile (KVCache + RotatingKVCache); its batches step uncompiled.
COVERED = {"llama": LLAMA, "qwen3": QWEN3, "llama_swa": LLAMA_SWA}


@cache
def _load(name: str) -> Any:
    if name == "qwen3_next":
        return tiny_qwen3_next()
    spec = COVERED[name]
    model, _ = load(str(tiny_model(spec)))
    return model


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple((7 * seed + 13 * i) % 200 + 3 for i in range(n))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n)


# A lone row over a 256-token buffer step; then three rows joining at different steps (padded), leaving one by one.
SCHEDULES = {
    "solo": [Arrival("a", 0, _prompt(1, 250), _greedy(12))],
    "batch": [Arrival("a", 0, _prompt(1, 9), _greedy(24)), Arrival("b", 2, _prompt(2, 30), _greedy(10)),
              Arrival("c", 5, _prompt(3, 3), _greedy(16)), Arrival("d", 6, _prompt(4, 250), _greedy(14))],
}


class _Counting:
    """Counts the compiled forward's calls (it must run where it covers the caches, and only there)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.rows: list[int] = []  # each call's rows
        original = compiled_step.CompiledForward.__call__

        def counted(forward: compiled_step.CompiledForward, inputs: Any, caches: Any) -> Any:
            self.calls += 1
            self.rows.append(int(inputs.shape[0]))
            return original(forward, inputs, caches)

        monkeypatch.setattr(compiled_step.CompiledForward, "__call__", counted)


def _tokens(model: Any, schedule: str, *, compile_decode: bool) -> dict[str, list[int]]:
    out = run_schedule(model, SCHEDULES[schedule], eos=(), prefill_step_size=64, compile_decode=compile_decode)
    return {rid: o.tokens for rid, o in out.items()}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", COVERED)
def test_compiled_tokens_equal_uncompiled(name: str, schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _load(name)
    want = _tokens(model, schedule, compile_decode=False)
    counting = _Counting(monkeypatch)
    got = _tokens(model, schedule, compile_decode=True)
    assert got == want
    assert counting.calls > 0
    assert all(len(t) == a.params.max_tokens for t, a in zip(got.values(), SCHEDULES[schedule]))


def test_the_hybrid_architecture_steps_uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _load("qwen3_next")
    want = _tokens(model, "batch", compile_decode=False)
    counting = _Counting(monkeypatch)
    assert _tokens(model, "batch", compile_decode=True) == want
    assert counting.calls == 0


def test_covers_lone_rows_and_host_padded_batches_at_one_position() -> None:
    import mlx.core as mx

    def filled(cache: Any, n: int) -> Any:
        cache.update_and_fetch(mx.zeros((1, 2, n, 4)), mx.zeros((1, 2, n, 4)))
        return cache

    assert compiled_step.covers([filled(KVCache(), 3), filled(KVCache(), 3)])
    assert not compiled_step.covers([filled(KVCache(), 3), filled(KVCache(), 4)])  # positions differ
    assert not compiled_step.covers([KVCache()])  # nothing prefilled yet
    assert compiled_step.covers([filled(KVCache(), 3), filled(RotatingKVCache(max_size=8), 3)])  # a lone SWA row
    assert not compiled_step.covers([filled(KVCache(), 3), filled(RotatingKVCache(max_size=8, keep=4), 3)])
    assert not compiled_step.covers([filled(HostPaddedBatchKVCache([0]), 3), filled(KVCache(), 3)])
    assert compiled_step.covers([filled(HostPaddedBatchKVCache([0]), 3)])
    assert not compiled_step.covers([])


def test_compile_decode_false_keeps_the_uncompiled_step() -> None:
    """`--no-compile` (compile_decode=False) is the one way to turn the compiled step off."""
    model = _load("llama")
    assert DecodeBatch(model, compile_decode=True)._compiled is not None
    assert DecodeBatch(model)._compiled is None
    assert DecodeBatch(model, compile_decode=False)._compiled is None


def _prefilled(model: Any, n: int) -> list[Any]:
    import mlx.core as mx

    caches = model.make_cache()
    model(mx.array([_prompt(n, n)]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["solo", "padded", "unpadded", "ring", "ring-short"])
def test_compiled_logits_are_bit_identical_on_the_cpu(layout: str, dtype: str) -> None:
    """Every step's logits and KV equal the model's own forward bit for bit (the masked slots weigh exactly 0).

    Solo over a 256-token buffer step; batches from mlx-lm's merge of rows of 40 and 7 tokens
    (padded) or two of 40 (unpadded: no mask in the uncompiled step); a sliding-window row (window
    16) after a 40-token prefill (its ring over-full, trimmed, then wrapping) or a 5-token one (growing).
    """
    import mlx.core as mx

    ring = layout.startswith("ring")
    model, _ = load(str(tiny_model(LLAMA_SWA if ring else LLAMA)))  # its own copy: set_dtype changes the weights
    model.set_dtype(getattr(mx, dtype))
    forward = compiled_step.CompiledForward(model)

    def caches() -> list[Any]:
        if layout == "solo":
            return _prefilled(model, 250)
        if ring:
            return _prefilled(model, 5 if layout == "ring-short" else 40)
        second = 7 if layout == "padded" else 40
        merged = [HostPaddedBatchKVCache.merge([a, b]) for a, b in zip(_prefilled(model, 40), _prefilled(model, second))]
        assert merged[0].is_unpadded == (layout == "unpadded")
        return merged

    want_caches, got_caches = caches(), caches()
    rows = 2 if layout in ("padded", "unpadded") else 1
    tokens = mx.array([17] * rows, dtype=mx.uint32)
    for _ in range(24):  # past the ring's wrap (window 16) in the ring layouts
        want = model(tokens[:, None], cache=want_caches)[:, -1, :]
        assert compiled_step.covers(got_caches)
        got = forward(tokens, got_caches)
        assert got is not None and mx.array_equal(got, want).item()
        tokens = mx.argmax(want, axis=-1).astype(mx.uint32)
    for want_cache, got_cache in zip(want_caches, got_caches):
        for want_array, got_array in zip(want_cache.state, got_cache.state):
            if isinstance(want_array, mx.array):
                assert want_array.shape == got_array.shape and mx.array_equal(want_array, got_array).item()
            else:
                assert want_array == got_array


def test_a_window_narrower_than_its_ring_steps_uncompiled() -> None:
    """Rings longer than the model's window need mlx-lm's rolled mask: the trace refuses, the model steps as today."""
    import mlx.core as mx

    model = _load("llama_swa")
    window = model.model.sliding_window

    def caches() -> list[Any]:
        made = [RotatingKVCache(max_size=2 * window) if isinstance(c, RotatingKVCache) else KVCache()
                for c in model.make_cache()]
        model(mx.array([_prompt(1, 3 * window)]), cache=made)
        return made

    forward = compiled_step.CompiledForward(model)
    want_caches, got_caches = caches(), caches()
    tokens = mx.array([17], dtype=mx.uint32)
    assert forward(tokens, got_caches) is None and forward.broken
    want = model(tokens[:, None], cache=want_caches)[:, -1, :]
    got = model(tokens[:, None], cache=got_caches)[:, -1, :]  # what DecodeBatch does after None
    assert mx.array_equal(got, want).item()
    assert forward(tokens, got_caches) is None  # for good


def test_traces_are_bounded_and_rebuilt_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_TRACES shapes the compiled function is replaced (its traces freed); steps stay exact."""
    import mlx.core as mx

    monkeypatch.setattr(compiled_step, "MAX_TRACES", 1)
    model = _load("llama")
    forward = compiled_step.CompiledForward(model)
    want_caches, got_caches = _prefilled(model, 254), _prefilled(model, 254)
    tokens = mx.array([17], dtype=mx.uint32)
    functions: list[Any] = []  # held, so no id is reused
    for _ in range(4):  # capacities 256, then 512 after the buffer step: two shapes
        if not functions or functions[-1] is not forward._compiled:
            functions.append(forward._compiled)
        want = model(tokens[:, None], cache=want_caches)[:, -1, :]
        assert mx.array_equal(forward(tokens, got_caches), want).item()
        tokens = mx.argmax(want, axis=-1).astype(mx.uint32)
    assert forward._compiled is not functions[0] and len(forward._traced) == 1


def test_by_default_only_a_lone_row_steps_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_decode=None (the CPU's default) compiles a lone row's steps, not a batch's: over a batch the
    compiled forward attends the whole masked buffer, which cost more than it saved at B=64."""
    model = _load("llama")
    counting = _Counting(monkeypatch)
    run_schedule(model, SCHEDULES["batch"], eos=(), prefill_step_size=64, compile_decode=None)
    assert counting.rows and set(counting.rows) == {1}  # "a" decodes alone, then the batch steps uncompiled
    counting.rows.clear()
    run_schedule(model, SCHEDULES["batch"], eos=(), prefill_step_size=64, compile_decode=True)
    assert max(counting.rows) > 1
