"""The quantized-attention probe: right attention passes, an error or wrong values are reported (CPU runs it right)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

from mlx_trio.engine.kv import quantized_attention_probe as qap
from mlx_trio.testing.tiny_models import TinyModelSpec, tiny_model

GQA = (8, 2, 64)  # query heads, kv heads, head_dim


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("query_len", [1, 5])
@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_mlx_lm_and_folded_attention_pass_on_the_cpu(whole: bool, query_len: int, bits: int, group: int) -> None:
    for attention in (quantized_scaled_dot_product_attention, qap.folded_attention):
        assert qap.probe(*GQA, bits=bits, group_size=group, query_len=query_len, whole=whole,
                         attention=attention) is None


def _first_kv_head_for_all(queries: mx.array, q_keys: Any, q_values: Any, **kw: Any) -> mx.array:
    """What MLX's CUDA kernels would compute from a broadcast whole buffer: every head over kv head 0."""
    heads = q_keys[0].shape[1]
    first = [tuple(mx.repeat(p[:, :1], heads, axis=1) for p in x) for x in (q_keys, q_values)]
    return quantized_scaled_dot_product_attention(queries, first[0], first[1], **kw)


def _no_kernel(*args: Any, **kw: Any) -> mx.array:
    raise RuntimeError("[quantized_matmul] No implementation for problem shape: 1x509x64x16\nmore")


def test_wrong_values_and_errors_are_reported() -> None:
    why = qap.probe(*GQA, bits=8, group_size=64, query_len=1, whole=True, attention=_first_kv_head_for_all)
    assert why is not None and why.startswith("wrong values")
    why = qap.probe(*GQA, bits=8, group_size=64, query_len=1, whole=False, attention=_no_kernel)
    assert why == "[quantized_matmul] No implementation for problem shape: 1x509x64x16"


def test_serving_failure_checks_the_group_and_passes_right_attention() -> None:
    assert qap.serving_failure(GQA, bits=8, group_size=128) == "group size 128 does not divide head_dim 64"
    assert qap.serving_failure(GQA, bits=4, group_size=64) is None


def test_the_attention_shape_is_read_from_the_model() -> None:
    model = load(str(tiny_model(TinyModelSpec("llama", hidden_size=128, heads=2, kv_heads=1))))[0]
    assert qap.attention_shape(model) == (2, 1, 64)


def test_a_cache_hands_attention_a_non_contiguous_slice_between_growth_steps() -> None:
    """The layout the CUDA kernels refuse: what mlx-lm's QuantizedKVCache returns is its buffer's first positions."""
    cache = QuantizedKVCache(group_size=64, bits=8)
    kv = mx.zeros((1, 2, 3, 64))
    keys, _ = cache.update_and_fetch(kv, kv)
    assert keys[0].shape[2] == 3 and cache.keys[0].shape[2] == 256  # a view of 3 positions of 256
