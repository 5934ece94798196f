"""Whether a loaded model can hold its KV paged, and the block pool it gets: the load-time rule.

Paged KV covers plain full-attention models whose every attention layer the
routed attention wraps (routed_attention.py: the llama family), since only
there does a `PagedLayerCache` reach the paged attention. Anything else keeps
today's padded layout, by rule and with the reason said: sliding-window
layers (their ring is a layout of its own), recurrent state, architectures the
route refuses. Features not yet on the paged layout (speculation, LoRA rows,
quantized KV) are the caller's to refuse (docs/design.md §6.5).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_trio.engine.attention.routed_attention import RoutedAttention
from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.engine.kv.blocks.storage import DEFAULT_BLOCK_SIZE, BlockStorage, LayerShape

__all__ = ["BlockStorage", "layer_shapes", "paged_kv_for", "refusal"]


def refusal(model: nn.Module) -> str | None:
    """Why `model` cannot hold paged KV, or None when it can."""
    layers = [layer for layer in getattr(model, "layers", None) or [] if layer is not None]
    if not layers:
        return "the model has no layers list the paged layout can read"
    for i, layer in enumerate(layers):
        if getattr(layer, "use_sliding", False):
            return f"layer {i} is a sliding-window layer: rings keep their own layout"
        if not isinstance(getattr(layer, "self_attn", None), RoutedAttention):
            return f"layer {i}'s attention is not one the routed attention wraps (the llama family)"
    return None


def layer_shapes(model: nn.Module) -> list[LayerShape]:
    """Each layer's KV heads and head size (qwen3 keeps no `head_dim`: its scale is head_dim ** -0.5)."""
    out = []
    for layer in model.layers:
        attention: Any = layer.self_attn
        head_dim = getattr(attention, "head_dim", None) or round(float(attention.scale) ** -2)
        out.append(LayerShape(int(attention.n_kv_heads), int(head_dim)))
    return out


def model_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of the model's first floating parameter: what its K/V come out as."""
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float16


def paged_kv_for(model: nn.Module, budget_bytes: int, model_identity: str, *, adapter_revision: str = "",
                 block_size: int = DEFAULT_BLOCK_SIZE) -> PagedKV:
    """The model's block pool: as many blocks as `budget_bytes` holds; ValueError naming why when it cannot page."""
    reason = refusal(model)
    if reason is not None:
        raise ValueError(f"paged KV refused: {reason}")
    storage = BlockStorage.from_budget(layer_shapes(model), budget_bytes, block_size, model_dtype(model))
    return PagedKV(storage, model_identity, adapter_revision)
