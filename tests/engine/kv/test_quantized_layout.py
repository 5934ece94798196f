"""KvLayout with quantized KV: the bytes admission projects are the bytes the rows hold, and more rows fit."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from mlx_lm import load

from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.engine.kv.layout import check_quantized_attention, measure_layout
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, TinyModelSpec, tiny_model

LLAMA_Q = TinyModelSpec("llama", hidden_size=128, heads=2, kv_heads=1)


@cache
def _model(spec: TinyModelSpec) -> Any:
    return load(str(tiny_model(spec)))[0]


def _row_nbytes(model: Any, scheme: KvScheme, n: int) -> int:
    """What a row's caches hold after prefilling `n` tokens (n a multiple of the 256-position buffer step)."""
    row = SoloRow(model, "a", [(7 * i) % 500 + 3 for i in range(n + 1)], SamplingParams(), prefill_step_size=n,
                  kv_scheme=scheme)
    row.prefill_chunk()
    try:
        return row.nbytes
    finally:
        row.close()


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32), (4, 64)])
def test_quantized_rows_hold_what_the_layout_projects(bits: int, group: int) -> None:
    model = _model(LLAMA_Q)
    scheme = KvScheme(bits=bits, group_size=group, start=0)
    layout, bf16 = measure_layout(model, scheme), measure_layout(model)
    assert layout.full_bytes_per_token == bf16.full_bytes_per_token
    assert layout.row_bytes(512) == _row_nbytes(model, scheme, 512)
    assert bf16.row_bytes(512) == _row_nbytes(model, KvScheme(), 512)
    # Unquantized: the model's dtype a value (float32 here, bf16 for real models); quantized: `bits` plus a
    # scale and a bias of that dtype per group.
    value_bits = 8 * layout.activation_bytes
    assert layout.quantized_bytes_per_token * value_bits == bf16.full_bytes_per_token * (bits + 2 * value_bits / group)


def test_before_the_start_a_row_is_bf16_and_the_peak_counts_it() -> None:
    model = _model(LLAMA_Q)
    layout = measure_layout(model, KvScheme(bits=4, group_size=64, start=1000))
    per, q = layout.full_bytes_per_token, layout.quantized_bytes_per_token
    assert layout.row_bytes(999) == 999 * per
    assert layout.row_bytes(1000) == 999 * per  # the bf16 row just before the start is larger
    assert layout.row_bytes(8000) == 8000 * q > 999 * per


def test_a_fixed_budget_admits_more_rows_quantized() -> None:
    """At least bf16's 1.88x (8 bits) and 3.55x (4 bits, groups of 64); this float32 model gains more."""
    model = _model(LLAMA_Q)
    budget, context = 1 << 30, 8192
    rows = {bits: budget // measure_layout(model, KvScheme(bits=bits, start=0)).row_bytes(context)
            for bits in (None, 8, 4)}
    assert rows[8] / rows[None] > 1.85 and rows[4] / rows[None] > 3.4


def test_sliding_window_layers_stay_bf16_in_the_layout() -> None:
    model = _model(TinyModelSpec("llama", hidden_size=128, heads=2, kv_heads=1, sliding_window=16))
    layout, bf16 = measure_layout(model, KvScheme(bits=8, start=0)), measure_layout(model)
    assert layout.window_bytes_per_token == bf16.window_bytes_per_token > 0
    assert 0 < layout.quantized_bytes_per_token < bf16.full_bytes_per_token


def test_a_group_that_does_not_divide_the_heads_fails_at_load() -> None:
    with pytest.raises(ValueError):
        measure_layout(_model(LLAMA), KvScheme(bits=8, group_size=64, start=0))  # 16-dim heads
    with pytest.raises(ValueError):
        KvScheme(bits=3)


class _NoQuantizedAttention:
    """The real model, but attention over quantized KV fails as MLX's CUDA backend (0.32.4) fails it."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.args = model.args
        self.parameters = model.parameters

    def __call__(self, inputs: Any, cache: Any = None) -> Any:
        if cache and any(hasattr(c, "bits") for c in cache):
            raise RuntimeError("[quantized_matmul] No implementation for problem shape: 1x8193x64x32")
        return self._model(inputs, cache=cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_a_backend_that_cannot_attend_over_quantized_kv_is_refused_at_load_naming_the_flag() -> None:
    model = _NoQuantizedAttention(_model(LLAMA_Q))
    with pytest.raises(ValueError, match=r"--kv-bits 8 .*cannot run right on .*No implementation.*no --kv-bits/"
                       r"--kv-group-size pair passes here; serve without --kv-bits"):
        check_quantized_attention(model, KvScheme(bits=8, group_size=32, start=0))  # type: ignore[arg-type]
    check_quantized_attention(model, KvScheme())  # bf16 never probes  # type: ignore[arg-type]
    assert measure_layout(model, KvScheme()).quantized_bytes_per_token == 0  # type: ignore[arg-type]


class _NoGroupOf32(_NoQuantizedAttention):
    """Attention over quantized KV fails for groups of 32 only."""

    def __call__(self, inputs: Any, cache: Any = None) -> Any:
        if cache and any(getattr(c, "group_size", None) == 32 for c in cache):
            raise RuntimeError("[quantized_matmul] No implementation for problem shape: 1x6x64x2")
        return self._model(inputs, cache=cache)


def test_the_refusal_names_the_formats_that_pass_on_this_backend() -> None:
    model = _NoGroupOf32(_model(LLAMA_Q))  # 64-dim heads: groups of 32 and 64 divide them, 128 does not
    with pytest.raises(ValueError, match=r"--kv-bits 4 --kv-group-size 32: .*these pass here: "
                       r"--kv-bits 4 --kv-group-size 64, --kv-bits 8 --kv-group-size 64; serve without"):
        check_quantized_attention(model, KvScheme(bits=4, group_size=32, start=0))  # type: ignore[arg-type]
    check_quantized_attention(model, KvScheme(bits=8, group_size=64, start=0))  # type: ignore[arg-type]


def test_mlx_lm_has_no_serial_quantized_sliding_window_run_to_check_ours_against() -> None:
    """Why sliding-window layers stay bf16 (docs/design.md §6.4): if mlx-lm gains a quantized rotating cache,
    this fails and they can quantize."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model = _model(TinyModelSpec("llama", hidden_size=128, heads=2, kv_heads=1, sliding_window=16))
    steps = generate_step(mx.array([5, 6, 7, 8]), model, max_tokens=2, kv_bits=8, kv_group_size=64,
                          quantized_kv_start=0)
    with pytest.raises(NotImplementedError, match="RotatingKVCache Quantization NYI"):
        next(steps)
