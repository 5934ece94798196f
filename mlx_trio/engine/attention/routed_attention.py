"""Route a padded batch's decode attention to the ragged kernel, without patching mlx-lm.

mlx-lm's attention modules call `mlx_lm.models.base.scaled_dot_product_attention`
themselves, with the array mask their cache made, so a cache cannot choose the
kernel. `install` (at load) replaces each layer's `self_attn` of the llama
family (mlx-lm's llama (and so mistral), qwen2 and qwen3 modules) with a
`RoutedAttention`: a module of ours holding the original's very children
(q/k/v/o projections, RoPE, qwen3's q_norm/k_norm) and attributes (heads, scale),
under the same names, so weights, adapters (`RowLoraLinear` wraps the
projections: engine/adapters/row_lora.py), `shard()` (tensor parallel: it
replaces the projections and divides the head counts of whatever module sits
there) and the prompt cache see the same model. Its `__call__` is the original's,
line for line, except for the projections, which may be one fused `qkv_proj`
matmul split three ways (`fuse_qkv`, at load: engine/model/fused_projections.py),
and the attention call, which goes to the route's `attend` when

- a route is set (`RaggedRoute.attend`: the CUDA kernel when MLX runs on its
  CUDA backend, engine/attention/ragged_kernel.py; None on other backends, and
  then every call is mlx-lm's),
- the query is one token (a decode step) and the layer's cache is a
  `HostPaddedBatchKVCache` (a batch, float KV: not quantized, not a ring),
- the call carries a mask (some row is padded: without one MLX runs its own
  fused vector kernel already, engine/kv/batch_kv.py), and
- the kernel takes the shapes and dtype (`ragged_kernel.supports`).

Everything else (prefill, verify forwards, lone rows, rings, quantized KV, the
compiled step's stand-in caches, the CPU) calls mlx-lm's function as before.
The ragged call attends each row's positions `left_padding[b] <= j < T`,
exactly what the cache's mask keeps for one query (`create_causal_mask` with
`left_padding`; row slots and speculative rollback express every hole as left
padding: engine/kv/row_slots.py, engine/kv/row_rollback.py).

An attention class is accepted only if its `__call__` source is the one this
module reproduces (a hash of mlx-lm 0.32.2's): another mlx-lm version, or any
other architecture, is refused by name and keeps mlx-lm's module untouched.
`MLX_TRIO_NO_RAGGED_ATTENTION=1` installs nothing (the kill switch).

Tests route to `engine/attention/ragged_reference.py` instead (`route.attend`),
which runs on the CPU. Lease thread only.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

from mlx_trio.engine.attention import paged_attention, paged_kernel, paged_metal, ragged_kernel
from mlx_trio.engine.attention.unfused_attention import unfused_attention
from mlx_trio.engine.kv.batch_kv import CohortKVCache, HostPaddedBatchKVCache
from mlx_trio.engine.kv.blocks.layer_cache import PagedLayerCache
from mlx_trio.engine.lease_thread import on_cuda
from mlx_trio.engine.switches import switched_on

log = logging.getLogger(__name__)

# Set to 1 to leave every attention module as mlx-lm made it (the kill switch).
KILL_SWITCH = "MLX_TRIO_NO_RAGGED_ATTENTION"

# (module, class) -> (has q_norm/k_norm, sha256 prefix of its `__call__` source in mlx-lm 0.32.2).
FAMILY: dict[tuple[str, str], tuple[bool, str]] = {
    ("mlx_lm.models.llama", "Attention"): (False, "3b9b8774b647f7a4"),
    ("mlx_lm.models.qwen2", "Attention"): (False, "0d02f6cbda3a89f1"),
    ("mlx_lm.models.qwen3", "Attention"): (True, "789af9d8868081c1"),
}

Attend = Callable[[mx.array, mx.array, mx.array, mx.array, float], mx.array]


@attrs.define(eq=False)
class RaggedRoute:
    """Where routed calls go, shared by a model's `RoutedAttention` layers: `attend(q, k, v, start, scale)`, or None."""

    attend: Attend | None = None
    # A paged cache's decode steps: the CUDA kernel once its self-check passed (paged_kernel.py), else the reference.
    paged_decode: paged_attention.PagedDecode | None = None


@attrs.frozen
class Installed:
    """What `install` did: the route (None if it wrapped nothing), layers wrapped, the classes it refused,
    and why the kernel is off on CUDA (its load-time self-check failed), if it is; the same for the paged kernel."""

    route: RaggedRoute | None
    wrapped: int
    refused: tuple[str, ...]
    kernel_off: str | None = None
    paged_off: str | None = None


def killed() -> bool:
    return switched_on(KILL_SWITCH)


def class_name(attention: Any) -> str:
    cls = type(attention)
    return f"{cls.__module__}.{cls.__qualname__}"


def qk_norm_of(attention: Any) -> bool | None:
    """Whether this attention module has qwen3's q/k norms, or None if `RoutedAttention` cannot reproduce it."""
    cls = type(attention)
    known = FAMILY.get((cls.__module__, cls.__qualname__))
    if known is None:
        return None
    qk_norm, digest = known
    return qk_norm if source_digest(cls) == digest else None


def source_digest(cls: type) -> str:
    """The sha256 prefix of `cls.__call__`'s source: a wrapped mlx-lm class is the one its forward reproduces."""
    return hashlib.sha256(inspect.getsource(cls.__call__).encode()).hexdigest()[:16]


class RoutedAttention(nn.Module):
    """A llama-family attention module whose decode attention of a padded batch may take the ragged route.

    Holds the original's children and attributes under their own names (see the module docstring).
    """

    def __init__(self, original: nn.Module, qk_norm: bool, route: RaggedRoute) -> None:
        super().__init__()
        for key, value in vars(original).items():  # n_heads, n_kv_heads, scale, head_dim, training flags
            setattr(self, key, value)
        for key, value in original.items():  # the children: projections, rope, norms
            self[key] = value
        self._no_grad = set(original._no_grad)
        self._qk_norm = qk_norm
        self._route = route
        self._original_class = class_name(original)
        # Set by `fuse_qkv`: the fused projection's output is queries [0, q_end), keys [q_end, k_end), values.
        # Plain ints: a tuple would become a child entry of the module (nn.Module is a dict).
        self._q_end = 0
        self._k_end = 0

    @property
    def route(self) -> RaggedRoute:
        return self._route

    @property
    def q_end(self) -> int:
        """Where the fused projection's queries end (0 unfused)."""
        return self._q_end

    @property
    def k_end(self) -> int:
        """Where the fused projection's keys end (0 unfused)."""
        return self._k_end

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are normalised per head (qwen3's q_norm / k_norm)."""
        return self._qk_norm

    @property
    def fused(self) -> bool:
        """Whether q/k/v run as one `qkv_proj` matmul (`fuse_qkv`)."""
        return self._k_end > 0

    def fuse_qkv(self, qkv_proj: nn.Module, q_end: int, k_end: int) -> None:
        """Run q/k/v as `qkv_proj` (their rows concatenated), its output split at `q_end` and `k_end`; drops q/k/v_proj.

        After this, `shard()` and adapters no longer find the projections they replace: the loader
        fuses only where neither comes (engine/model/fused_projections.py).
        """
        for name in ("q_proj", "k_proj", "v_proj"):
            del self[name]
        self.qkv_proj = qkv_proj
        self._q_end, self._k_end = q_end, k_end

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        # mlx-lm 0.32.2's llama / qwen2 / qwen3 `Attention.__call__`, but for the projections and the attention call.
        B, L, D = x.shape

        if not self._k_end:
            queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:  # one matmul; the three parts are views of its output
            queries, keys, values = mx.split(self.qkv_proj(x), [self._q_end, self._k_end], axis=-1)

        if self._qk_norm:
            queries = self.q_norm(queries.reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
            keys = self.k_norm(keys.reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        else:
            queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)

        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)

        output = self.attend(queries, keys, values, cache, mask)
        output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(output)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, mask: Any) -> mx.array:
        """The attention of `queries` over the fetched `keys`/`values`: the ragged route where it applies, else mlx-lm's.

        A cohort's shared prefill (`CohortKVCache`: made only under prefill-only cuDNN) runs on MLX's
        plain ops (engine/attention/unfused_attention.py): on cuDNN each cohort's shape would be a new plan.
        A paged cache (engine/kv/blocks/paged_kv.py) holds the KV in its blocks, not in `keys`/`values`: its
        attention reads the rows' block tables (engine/attention/paged_attention.py), on every backend.
        """
        if isinstance(cache, PagedLayerCache):
            return paged_attention.attend(queries, cache, self.scale, self._route.paged_decode)
        if type(cache) is CohortKVCache:
            return unfused_attention(queries, keys, values, self.scale, mask)
        attend = self._route.attend
        if (attend is not None and mask is not None and type(cache) is HostPaddedBatchKVCache
                and ragged_kernel.supports(queries, keys, values)):
            return attend(queries, keys, values, cache.left_padding, self.scale)
        return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)


def install(model: nn.Module, attend: Attend | None = None) -> Installed:
    """Wrap every accepted attention layer of `model` in place; the route starts at `attend` or the backend's kernel.

    With `attend` None the route is the CUDA kernel on MLX's CUDA backend, once it passed its
    self-check for the model's attention shape (`ragged_kernel.self_check`: a kernel that does not
    build or computes wrong values stays off, logged and said in `kernel_off`), and unset elsewhere
    (the wrapped model then computes exactly what the original does). Layers whose attention is not of the
    llama family are left as they are and named in `refused`. Nothing happens under the kill switch.
    Call after any `shard()` or `pipeline()` (either may also come later: both change attributes of the module in place).
    """
    if killed():
        return Installed(None, 0, ())
    route = RaggedRoute(attend)
    wrapped: list[RoutedAttention] = []
    refused = []
    for layer in getattr(model, "layers", None) or []:
        attention = getattr(layer, "self_attn", None) if layer is not None else None
        if attention is None or isinstance(attention, RoutedAttention):
            continue
        qk_norm = qk_norm_of(attention)
        if qk_norm is None:
            refused.append(class_name(attention))
            continue
        layer.self_attn = RoutedAttention(attention, qk_norm, route)
        wrapped.append(layer.self_attn)
    kernel_off = paged_off = None
    if attend is None and wrapped and on_cuda():
        kernel_off = _check_kernel(wrapped)
        if kernel_off is None:
            route.attend = ragged_kernel.ragged_decode_attention
        else:
            log.warning("ragged decode attention stays off (mlx-lm's attention instead): %s", kernel_off)
        paged_off = _check_kernel(wrapped, paged_kernel.self_check)
        if paged_off is None:
            route.paged_decode = paged_kernel.paged_decode_attention
        else:
            log.warning("paged decode attention stays on the MLX-ops reference: %s", paged_off)
    elif attend is None and wrapped and on_metal():
        paged_off = _check_kernel(wrapped, paged_metal.self_check)
        if paged_off is None:
            route.paged_decode = paged_metal.paged_decode_attention
        else:
            log.warning("paged decode attention stays on the MLX-ops reference: %s", paged_off)
    return Installed(route if wrapped else None, len(wrapped), tuple(dict.fromkeys(refused)), kernel_off, paged_off)


def on_metal() -> bool:
    """Whether MLX runs on its Metal backend (the GPU device with Metal)."""
    return mx.default_device().type == mx.DeviceType.gpu and mx.metal.is_available()


def _check_kernel(layers: list[RoutedAttention], self_check: Callable[..., str | None] = ragged_kernel.self_check
                  ) -> str | None:
    """`self_check` (the ragged or paged kernel's) for each distinct attention shape (the scale gives the head dim).

    A float32 model keeps mlx-lm's attention: on the H200 the kernel's float32 results were 3e-5 to
    1.6e-3 off a float32 reference where MLX's masked attention is within 1e-7
    (docs/lab-notes/2026-12-01-h200-pass11.md), and a float32 model is asked for because its
    numbers matter.
    """
    weight = getattr(getattr(layers[0], "q_proj", None), "weight", None)
    if isinstance(weight, mx.array) and weight.dtype == mx.float32:
        return "a float32 model: the kernel's float32 error is past MLX's own; its decode keeps MLX's attention"
    for heads, kv_heads, scale in sorted({(a.n_heads, a.n_kv_heads, float(a.scale)) for a in layers}):
        problem = self_check(heads, kv_heads, round(scale**-2), scale)
        if problem is not None:
            return problem
    return None


def covers(model: nn.Module) -> bool:
    """Whether every attention layer of `model` is a `RoutedAttention` (so `attend` decides every layer's kernel)."""
    layers = [layer for layer in getattr(model, "layers", None) or [] if layer is not None]
    return bool(layers) and all(isinstance(getattr(layer, "self_attn", None), RoutedAttention) for layer in layers)


def route_of(model: nn.Module) -> RaggedRoute | None:
    """The route `install` gave `model`'s layers (None if it wrapped none): set its `attend` to switch."""
    for layer in getattr(model, "layers", None) or []:
        attention = getattr(layer, "self_attn", None) if layer is not None else None
        if isinstance(attention, RoutedAttention):
            return attention.route
    return None
