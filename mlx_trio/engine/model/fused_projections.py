"""Fuse each llama-family layer's q/k/v projections into one matmul and its gate/up into another, at load.

A decode step on CUDA is launch- and host-bound at small batches: every
projection is a kernel and a graph node (docs/design.md §4.8). Per layer
mlx-lm's llama / qwen2 / qwen3 run seven projection matmuls; with the rows of
q, k and v concatenated into one weight, and gate's and up's into another,
they run four, each fused output split by `mx.split` (views, no kernel).

`fuse` (at load, after `routed_attention.install`) changes the model in place:

- a `RoutedAttention` (engine/attention/routed_attention.py: it already
  reproduces the family's attention forward) gets one `qkv_proj` in place of
  q/k/v_proj (`RoutedAttention.fuse_qkv`); qwen2's q/k/v biases are
  concatenated too. Attention that install left as mlx-lm's (another
  architecture, or `MLX_TRIO_NO_RAGGED_ATTENTION=1`) keeps its projections.
- an MLP of the family (its `__call__` source pinned like the attention's)
  becomes a `FusedMLP` with one `gate_up_proj` and mlx-lm's `down_proj`.

Projections fuse when they are all `nn.Linear` (same dtype, bias on all or
none) or all `nn.QuantizedLinear` with the same mode, bits and group size
(weight, scales, biases and bias concatenated along the output rows: each row
keeps its own scales, so the fused layer is the same quantization). Anything
else stays unfused, with the reason in `Fused.unfused`: mixed quantization
(e.g. mlx-lm's mixed recipes give v_proj more bits), another layer type (an
adapter's wrapper, a tensor-parallel shard), or output rows that are not
`heads * head_dim` / `kv_heads * head_dim` (q/k/v) or equal (gate/up). The new
weights replace the old ones layer by layer (evaluated per layer, so the peak
is one layer's worth above the model).

On the CPU the fused model's logits are bit-identical to the unfused one's
(each output element's dot product is the same; tests/engine/model/
test_fused_projections.py); on CUDA a wider matmul may take another kernel and
round differently (benchmarks/cuda_graph_knobs.py reports greedy agreement).

The loader does not call `fuse` for what needs the separate projections:
served adapters (`RowLoraLinear` wraps q_proj/v_proj/... when an adapter is
loaded, at start or at run time) and a distributed group (`shard()` and
`pipeline()` replace projections by name). The draft model loads through its
own path (engine/model/draft_model.py) and stays unfused.
`MLX_TRIO_NO_FUSED_PROJECTIONS=1` fuses nothing (the kill switch). Lease thread only.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from mlx_trio.engine.attention.routed_attention import RoutedAttention, source_digest
from mlx_trio.engine.switches import switched_on

# Set to 1 to load every projection as mlx-lm made it (the kill switch).
KILL_SWITCH = "MLX_TRIO_NO_FUSED_PROJECTIONS"

# (module, class) -> sha256 prefix of its `__call__` source in mlx-lm 0.32.2 (`FusedMLP` reproduces it).
MLP_FAMILY: dict[tuple[str, str], str] = {
    ("mlx_lm.models.llama", "MLP"): "dc08d40bfdf18cf6",
    ("mlx_lm.models.qwen2", "MLP"): "dc08d40bfdf18cf6",
    ("mlx_lm.models.qwen3", "MLP"): "dc08d40bfdf18cf6",
}


@attrs.frozen
class Fused:
    """What `fuse` did: layers whose q/k/v and whose gate/up run as one matmul, and why others did not (once each)."""

    attention: int
    mlp: int
    unfused: tuple[str, ...] = ()


def killed() -> bool:
    return switched_on(KILL_SWITCH)


class FusedMLP(nn.Module):
    """mlx-lm 0.32.2's llama / qwen2 / qwen3 `MLP` with gate and up as one `gate_up_proj` matmul."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, hidden: int) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self._hidden = hidden  # gate's output rows: where the fused output splits

    @property
    def hidden(self) -> int:
        """Gate's output rows: where the fused output splits."""
        return self._hidden

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), [self._hidden], axis=-1)
        return self.down_proj(swiglu(gate, up))


def fuse(model: nn.Module) -> Fused:
    """Fuse `model`'s accepted layers in place (see the module docstring); nothing under the kill switch."""
    if killed():
        return Fused(0, 0)
    attention = mlp = 0
    unfused: list[str] = []
    for layer in getattr(model, "layers", None) or []:
        if layer is None:  # another rank's layer under pipeline()
            continue
        problem = _fuse_attention(layer.get("self_attn"))
        attention += problem is None
        if problem:
            unfused.append(f"attention: {problem}")
        problem = _fuse_mlp(layer)
        mlp += problem is None
        if problem:
            unfused.append(f"MLP: {problem}")
        mx.eval(layer.parameters())  # the concatenations, so the originals' arrays are freed now
    return Fused(attention, mlp, tuple(dict.fromkeys(unfused)))


def _fuse_attention(attention: nn.Module | None) -> str | None:
    """None if `attention` now runs one q/k/v matmul, else why not ("" for nothing to fuse)."""
    if not isinstance(attention, RoutedAttention):
        return "" if attention is None else f"{type(attention).__module__}.{type(attention).__qualname__} " \
                                            "is not routed attention"
    if attention.fused:
        return ""
    parts = [attention.get(name) for name in ("q_proj", "k_proj", "v_proj")]
    problem = why_not_one(parts)
    if problem is not None:
        return problem
    rows = [_out_dims(p) for p in parts]
    q_rows, k_rows, v_rows = rows
    head_dim = q_rows // attention.n_heads if q_rows else 0
    if (q_rows != attention.n_heads * head_dim or k_rows != v_rows or not head_dim
            or k_rows != attention.n_kv_heads * head_dim):
        return f"projection rows {rows} are not heads {attention.n_heads} / kv heads {attention.n_kv_heads} " \
               "times one head dim"
    attention.fuse_qkv(concatenated(parts), q_rows, q_rows + k_rows)
    return None


def _fuse_mlp(layer: nn.Module) -> str | None:
    """None if `layer.mlp` is now a `FusedMLP`, else why not ("" for nothing to fuse)."""
    mlp = layer.get("mlp")
    if mlp is None or isinstance(mlp, FusedMLP):
        return ""
    cls = type(mlp)
    digest = MLP_FAMILY.get((cls.__module__, cls.__qualname__))
    if digest is None or source_digest(cls) != digest:
        return f"{cls.__module__}.{cls.__qualname__} is not the llama family's MLP"
    gate, up = mlp.get("gate_proj"), mlp.get("up_proj")
    problem = why_not_one([gate, up])
    if problem is not None:
        return problem
    if _out_dims(gate) != _out_dims(up):
        return f"gate and up rows differ ({_out_dims(gate)}, {_out_dims(up)})"
    layer.mlp = FusedMLP(concatenated([gate, up]), mlp.down_proj, _out_dims(gate))
    layer.mlp.train(mlp.training)
    return None


def _out_dims(linear: nn.Module | None) -> int:
    weight = getattr(linear, "weight", None)
    return weight.shape[0] if isinstance(weight, mx.array) and weight.ndim == 2 else 0


def why_not_one(linears: Sequence[nn.Module | None]) -> str | None:
    """Why `linears` cannot be one layer (`concatenated`), or None if they can."""
    kinds = {type(p) for p in linears}
    if len(kinds) != 1 or kinds.pop() not in (nn.Linear, nn.QuantizedLinear):
        return f"layers {sorted({type(p).__qualname__ for p in linears})} are not all Linear or all QuantizedLinear"
    first = linears[0]
    assert first is not None
    keys = set(first.keys())
    if any(set(p.keys()) != keys for p in linears):
        return "some have a bias (or quantization biases) and some do not"
    if isinstance(first, nn.QuantizedLinear):
        settings = {(p.mode, p.bits, p.group_size) for p in linears}
        if len(settings) != 1:
            return f"mixed quantization (mode, bits, group size): {sorted(settings)}"
    if len({p.weight.shape[1] for p in linears}) != 1:
        return "input dims differ"
    if len({(key, p[key].dtype) for p in linears for key in keys}) != len(keys):
        return "dtypes differ"
    return None


def concatenated(linears: Sequence[nn.Module]) -> nn.Module:
    """One layer computing what `linears` do (`why_not_one` said they can be one), their outputs side by side.

    A shallow copy of the first layer (its class and attributes: quantization mode, bits and group
    size, frozen parameters) holding the concatenated arrays: built without a random init, which
    would move MLX's global random state.
    """
    first = linears[0]
    fused = copy.copy(first)
    fused._no_grad = set(first._no_grad)  # not shared with the original
    for key in first.keys():
        fused[key] = mx.concatenate([p[key] for p in linears], axis=0)
    return fused
