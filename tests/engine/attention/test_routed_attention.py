"""The ragged route: wrapped llama-family attention equals mlx-lm's module, and routed padded decode steps equal mlx-lm's.

On the CPU the CUDA kernel cannot run, so the route is either unset (every call
is mlx-lm's own: the wrapped model must compute bit for bit what the unwrapped
one does) or set to the pure-MLX reference (engine/attention/ragged_reference.py:
the padded batch's decode steps take it, and the greedy tokens and logits must
equal mlx-lm's own batch replay, mlx_trio/testing/batch_reference.py).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models import llama

from mlx_trio.engine.attention import routed_attention
from mlx_trio.engine.attention.ragged_reference import reference_decode_attention
from mlx_trio.engine.attention.routed_attention import RoutedAttention
from mlx_trio.params import SamplingParams
from mlx_trio.testing import batch_reference as ref
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, QWEN3, TinyModelSpec, tiny_model

SPECS = {"llama": LLAMA, "qwen3": QWEN3, "qwen2": TinyModelSpec("qwen2"), "llama_swa": LLAMA_SWA}
# Rows of very different lengths (1 to 150 tokens), joining mid-decode and leaving (row slots reuse their slots).
SCHEDULE = [(0, 60, 20), (1, 3, 15), (2, 150, 10), (4, 7, 12), (6, 33, 9), (9, 1, 14), (11, 90, 6), (12, 12, 18)]


@cache
def _path(name: str) -> str:
    return str(tiny_model(SPECS[name]))


def _wrapped(name: str) -> tuple[nn.Module, routed_attention.Installed]:
    model = load(_path(name))[0]
    return model, routed_attention.install(model)


def _arrivals() -> list[ref.Arrival]:
    return [ref.Arrival(f"r{i}", at, tuple((11 * i + 5 * j + j * j) % 509 + 3 for j in range(n)),
                        SamplingParams(max_tokens=m)) for i, (at, n, m) in enumerate(SCHEDULE)]


def _ours(model: nn.Module) -> ref.Replay:
    return ref.run_schedule(ref.ours(model, prefill_step_size=8), _arrivals(), eos=(), max_batch=8)


@pytest.mark.parametrize("name", list(SPECS))
def test_install_wraps_every_full_attention_layer_under_the_same_names(name: str) -> None:
    plain = load(_path(name))[0]
    model, installed = _wrapped(name)
    assert installed.wrapped == len(model.layers) and installed.refused == ()
    assert all(isinstance(layer.self_attn, RoutedAttention) for layer in model.layers)
    assert installed.route is routed_attention.route_of(model) and installed.route.attend is None  # the CPU
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert names == [k for k, _ in tree_flatten(plain.parameters())]
    assert all(mx.array_equal(a, b) for (_, a), (_, b) in zip(tree_flatten(model.parameters()),
                                                               tree_flatten(plain.parameters())))
    assert routed_attention.install(model).wrapped == 0  # a second install leaves the wrappers alone


@pytest.mark.parametrize("name", list(SPECS))
def test_unrouted_wrapper_is_bit_exact_with_mlx_lm_modules(name: str) -> None:
    """Route unset: every forward (prefill, padded and unpadded decode, joins, leaves) equals the unwrapped model's."""
    model, _ = _wrapped(name)
    got, want = _ours(model), _ours(load(_path(name))[0])
    assert got.tokens == want.tokens
    diffs = ref.logit_diffs(got, want)
    assert diffs and max(diffs.values()) == 0.0


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen2", "llama_swa"])
def test_routed_padded_steps_equal_mlx_lm(name: str) -> None:
    """Route set to the reference: padded decode steps take it, and the greedy tokens equal mlx-lm's batch replay."""
    model, installed = _wrapped(name)
    calls: list[tuple[int, ...]] = []

    def counting(q: mx.array, k: mx.array, v: mx.array, start: mx.array, scale: float) -> mx.array:
        calls.append(q.shape)
        return reference_decode_attention(q, k, v, start, scale)

    installed.route.attend = counting
    got = _ours(model)
    want = ref.run_schedule(ref.reference(load(_path(name))[0], prefill_step_size=8), _arrivals(), eos=(), max_batch=8)
    assert got.tokens == want.tokens
    diffs = ref.logit_diffs(got, want)
    tolerance = 1e-4 if name == "llama_swa" else 1e-5  # the sliding layers' rings are laid out differently
    assert diffs and max(diffs.values()) <= tolerance
    full_layers = sum(not getattr(layer, "use_sliding", False) for layer in model.layers)
    assert calls and len(calls) % full_layers == 0 and all(shape[2] == 1 and shape[0] > 1 for shape in calls)


def test_a_route_that_ignores_the_padding_changes_the_tokens() -> None:
    """The routed calls are the ones that matter: attending the padding too (start 0) moves padded rows' logits."""
    model, installed = _wrapped("llama")
    installed.route.attend = lambda q, k, v, start, scale: reference_decode_attention(q, k, v, mx.zeros_like(start), scale)
    got, want = _ours(model), _ours(load(_path("llama"))[0])
    assert max(ref.logit_diffs(got, want).values()) > 1.0


def test_other_architectures_are_refused_by_name() -> None:
    """A hybrid model's attention class is not the llama family's: it stays mlx-lm's, and install names it."""
    model = ref.tiny_qwen3_next()
    installed = routed_attention.install(model)
    assert installed.route is None and installed.wrapped == 0
    assert installed.refused == ("mlx_lm.models.qwen3_next.Qwen3NextAttention",)
    assert not any(isinstance(getattr(layer, "self_attn", None), RoutedAttention) for layer in model.layers)


def test_a_changed_call_source_is_refused() -> None:
    """The family is pinned to the source it reproduces: a subclass (or another mlx-lm version) is refused."""

    class Patched(llama.Attention):
        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            return super().__call__(x, mask, cache) * 2

    model = load(_path("llama"))[0]
    model.layers[0].self_attn.__class__ = Patched
    installed = routed_attention.install(model)
    assert installed.wrapped == len(model.layers) - 1
    assert installed.refused == (f"{__name__}.test_a_changed_call_source_is_refused.<locals>.Patched",)
    assert routed_attention.qk_norm_of(model.layers[1].self_attn) is None  # already wrapped: not an mlx-lm class


def test_kill_switch_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(routed_attention.KILL_SWITCH, "1")
    model = load(_path("llama"))[0]
    assert routed_attention.install(model) == routed_attention.Installed(None, 0, ())
    assert not any(isinstance(layer.self_attn, RoutedAttention) for layer in model.layers)


def test_shard_after_install_replaces_the_wrappers_projections() -> None:
    """mlx-lm's `shard()` sets projections and head counts on whatever module is `self_attn`: ours then runs them."""
    model, installed = _wrapped("llama")
    before = _ours(model)
    model.shard(mx.distributed.init())  # a group of one: shard_linear rebuilds every projection, heads // 1
    layer = model.layers[0].self_attn
    assert isinstance(layer, RoutedAttention) and type(layer.q_proj).__name__ != "Linear"
    after = _ours(model)
    assert after.tokens == before.tokens


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, kernel: Any) -> None:
    """As on MLX's CUDA backend, with `kernel` (CPU code) in the CUDA kernel's place."""
    monkeypatch.setattr(routed_attention, "on_cuda", lambda: True)
    monkeypatch.setattr(routed_attention.ragged_kernel, "ragged_decode_attention", kernel)


def _bf16(name: str) -> Any:
    """The tiny model in bfloat16, as a CUDA model would be (a float32 one keeps mlx-lm's attention)."""
    model = load(_path(name))[0]
    model.set_dtype(mx.bfloat16)
    return model


def test_on_cuda_the_kernel_is_routed_once_its_self_check_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, reference_decode_attention)
    installed = routed_attention.install(_bf16("qwen3"))
    assert installed.kernel_off is None and installed.route.attend is reference_decode_attention


def test_on_cuda_a_float32_model_keeps_mlx_lms_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, reference_decode_attention)
    installed = routed_attention.install(load(_path("llama"))[0])  # the tiny models are float32
    assert installed.route.attend is None and "float32" in installed.kernel_off


def _raises(*_: Any) -> mx.array:
    raise RuntimeError("nvrtc: error: identifier 'x' is undefined")


def _wrong(q: mx.array, k: mx.array, v: mx.array, start: mx.array, scale: float) -> mx.array:
    return reference_decode_attention(q, k, v, mx.zeros_like(start), scale)  # attends the padding too


@pytest.mark.parametrize(("kernel", "why"), [(_raises, "did not build or run: nvrtc"), (_wrong, "max abs error")])
def test_a_kernel_that_fails_its_self_check_stays_off(monkeypatch: pytest.MonkeyPatch, kernel: Any, why: str) -> None:
    """A kernel that does not build, or computes wrong values, leaves every call on mlx-lm's attention."""
    _fake_cuda(monkeypatch, kernel)
    model = _bf16("llama")
    installed = routed_attention.install(model)
    assert installed.wrapped == len(model.layers) and installed.route.attend is None
    assert why in installed.kernel_off
