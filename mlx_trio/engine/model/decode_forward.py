"""A decode step's forward (one token a row) with a third fewer graph nodes than mlx-lm's, same numbers.

On CUDA a decode step is host-bound: the device finishes a step before the host has built and launched the
next, and the host's time grows with the graph's primitives (about 1.1 µs each to build and 1.5 µs to
launch on the H200: benchmarks/step_anatomy.py, docs/lab-notes/2026-12-01-h200-pass13.md). A fused llama
layer (engine/model/fused_projections.py) makes 38 primitives a step through mlx-lm's modules; 14 of them
do no arithmetic:

- each `nn.Linear` call transposes its weight (`x @ weight.T`, a node per
  call): here every weight is transposed once, an evaluated view of the same
  memory (no copy), which the matmul reads exactly as it read the per-step
  transpose;
- a `[B, 1, D]` input to a matmul is flattened before and unflattened after
  it: the step runs on `[B, D]` hidden states (the same `B x D` matmul);
- q, k and v go `[B, 1, H, hd]` and then transposed to `[B, H, 1, hd]`, and
  the attention's output back: with one query the reshape alone gives the
  same layout.

`DecodeForward.of(model)` is None unless the whole model is one this module
reproduces: mlx-lm 0.32.2's llama / qwen2 / qwen3 `Model`, inner model and
`TransformerBlock` (their `__call__` sources pinned by hash, as the attention's
are), every layer's attention a fused `RoutedAttention` and its MLP a
`FusedMLP`, no pipeline or tensor-parallel split. So served adapters and
distributed ranks (which keep their projections unfused) and every other
architecture step through the model itself. Quantized projections and
embeddings keep their own call (a quantized matmul has no transpose node).

Bit-identical to `model(tokens[:, None], cache=caches)[:, -1, :]` on the CPU
for every accepted tiny architecture (tests/engine/model/test_decode_forward.py);
on CUDA the same kernels run on the same operands. `MLX_TRIO_NO_LEAN_DECODE=1`
steps through the model as before (the kill switch). Lease thread only.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask

from mlx_trio.engine.attention.routed_attention import RoutedAttention, source_digest
from mlx_trio.engine.model.fused_projections import FusedMLP
from mlx_trio.engine.switches import switched_on

# Set to 1 to step through the model's own forward (the kill switch).
KILL_SWITCH = "MLX_TRIO_NO_LEAN_DECODE"

# (module, class) -> sha256 prefix of its `__call__` source in mlx-lm 0.32.2 (`DecodeForward` reproduces it).
FAMILY: dict[tuple[str, str], str] = {
    ("mlx_lm.models.llama", "Model"): "3178344d02019c2c",
    ("mlx_lm.models.llama", "LlamaModel"): "9c8dac3efe006dd6",
    ("mlx_lm.models.llama", "TransformerBlock"): "937a607a6e7ea3c9",
    ("mlx_lm.models.qwen2", "Model"): "3178344d02019c2c",
    ("mlx_lm.models.qwen2", "Qwen2Model"): "758b568a18a5e769",
    ("mlx_lm.models.qwen2", "TransformerBlock"): "937a607a6e7ea3c9",
    ("mlx_lm.models.qwen3", "Model"): "3178344d02019c2c",
    ("mlx_lm.models.qwen3", "Qwen3Model"): "6de30238213e9792",
    ("mlx_lm.models.qwen3", "TransformerBlock"): "937a607a6e7ea3c9",
}


def killed() -> bool:
    return switched_on(KILL_SWITCH)


@functools.cache
def _reproduced(cls: type) -> bool:
    """Whether `cls.__call__` is the mlx-lm 0.32.2 source this module reproduces (cached: getsource is slow)."""
    digest = FAMILY.get((cls.__module__, cls.__qualname__))
    return digest is not None and source_digest(cls) == digest


class Projection:
    """What an `nn.Linear` computes, with its weight transposed once; another layer (quantized) is called.

    The transposed weight is an evaluated view of the layer's weight (no copy), made again
    if the layer's weight array is replaced. A float `nn.Embedding` is taken as the tied LM
    head (`as_linear`: `x @ weight.T`, the arithmetic of a Linear without bias).
    """

    __slots__ = ("_layer", "_call", "_weight", "_transposed")

    def __init__(self, layer: nn.Module) -> None:
        self._layer = layer
        self._call = None
        if type(layer) is nn.Embedding:
            pass
        elif isinstance(layer, nn.Embedding | nn.QuantizedEmbedding):
            self._call = layer.as_linear
        elif type(layer) is not nn.Linear:
            self._call = layer
        self._weight: mx.array | None = None
        self._transposed: mx.array | None = None

    def __call__(self, x: mx.array) -> mx.array:
        layer = self._layer
        if self._call is not None:
            return self._call(x)
        weight = layer["weight"]
        if weight is not self._weight:
            self._transposed = weight.T
            mx.eval(self._transposed)  # a view: no kernel, no copy; evaluated, it leaves no node in a step's graph
            self._weight = weight
        if "bias" in layer:
            return mx.addmm(layer["bias"], x, self._transposed)
        return x @ self._transposed


class _Layer:
    """One accepted layer's modules and projections."""

    __slots__ = ("block", "attention", "qkv", "o", "gate_up", "down", "hidden", "sliding")

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.attention: RoutedAttention = block.self_attn
        self.qkv = Projection(self.attention.qkv_proj)
        self.o = Projection(self.attention.o_proj)
        mlp: FusedMLP = block.mlp
        self.gate_up = Projection(mlp.gate_up_proj)
        self.down = Projection(mlp.down_proj)
        self.hidden = mlp.hidden
        self.sliding = bool(getattr(block, "use_sliding", False))


class DecodeForward:
    """`model(tokens[:, None], cache=caches)[:, -1, :]` for an accepted model (see the module docstring)."""

    def __init__(self, model: nn.Module, layers: Sequence[_Layer]) -> None:
        self._inner = model.model
        self._layers = tuple(layers)
        self._fa_idx = int(getattr(self._inner, "fa_idx", 0))
        self._swa_idx = getattr(self._inner, "swa_idx", None)
        self._head = Projection(self._inner.embed_tokens if model.args.tie_word_embeddings else model.lm_head)

    @classmethod
    def of(cls, model: nn.Module) -> DecodeForward | None:
        """The lean forward of `model`, or None where the model steps through its own (see the module docstring)."""
        return None if killed() or why_not(model) is not None else cls(model, [_Layer(b) for b in model.model.layers])

    def __call__(self, tokens: mx.array, caches: Sequence[Any]) -> mx.array:
        """Logits `[B, V]` of one step feeding `tokens` `[B]` (one a row); mutates the caches as the model does."""
        inner = self._inner
        h = inner.embed_tokens(tokens)
        # The masks depend on the query length and the cache only; mlx-lm reads the length off `h`.
        one_token = h[:, None]
        fa_mask = create_attention_mask(one_token, caches[self._fa_idx])
        swa_mask = None
        if self._swa_idx is not None:
            swa_mask = create_attention_mask(one_token, caches[self._swa_idx], window_size=inner.sliding_window)
        for layer, cache in zip(self._layers, caches):
            block = layer.block
            r = self._attention(layer, block.input_layernorm(h), swa_mask if layer.sliding else fa_mask, cache)
            h = h + r
            gate, up = mx.split(layer.gate_up(block.post_attention_layernorm(h)), [layer.hidden], axis=-1)
            h = h + layer.down(swiglu(gate, up))
        return self._head(inner.norm(h))

    @staticmethod
    def _attention(layer: _Layer, x: mx.array, mask: Any, cache: Any) -> mx.array:
        """`RoutedAttention.__call__` for one query a row, on `[B, D]`."""
        attention = layer.attention
        B = x.shape[0]
        queries, keys, values = mx.split(layer.qkv(x), [attention.q_end, attention.k_end], axis=-1)
        # [B, 1, H, hd] transposed to [B, H, 1, hd] is this reshape: one query, the same order in memory.
        queries = queries.reshape(B, attention.n_heads, 1, -1)
        keys = keys.reshape(B, attention.n_kv_heads, 1, -1)
        if attention.qk_norm:
            queries = attention.q_norm(queries)
            keys = attention.k_norm(keys)
        values = values.reshape(B, attention.n_kv_heads, 1, -1)
        queries = attention.rope(queries, offset=cache.offset)
        keys = attention.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        output = attention.attend(queries, keys, values, cache, mask)
        return layer.o(output.reshape(B, -1))


def why_not(model: nn.Module) -> str | None:
    """Why `model` steps through its own forward (see the module docstring), or None if `DecodeForward` takes it."""
    inner = getattr(model, "model", None)
    if not _reproduced(type(model)) or inner is None or not _reproduced(type(inner)):
        return f"{type(model).__module__}.{type(model).__qualname__} is not a llama-family model this step reproduces"
    if getattr(inner, "pipeline_size", 1) != 1:
        return "a pipeline-parallel rank"
    layers = list(getattr(inner, "layers", None) or [])
    if not layers:
        return "no layers"
    for block in layers:
        if block is None or not _reproduced(type(block)):
            return "a layer is not the family's TransformerBlock"
        attention, mlp = block.get("self_attn"), block.get("mlp")
        if not isinstance(attention, RoutedAttention) or not attention.fused:
            return "attention is not fused routed attention (adapters, tensor parallel, a kill switch)"
        if not isinstance(mlp, FusedMLP):
            return "an MLP is not fused"
        if type(block.input_layernorm) is not nn.RMSNorm or type(block.post_attention_layernorm) is not nn.RMSNorm:
            return "a layer's norms are not RMSNorm"
    return None
