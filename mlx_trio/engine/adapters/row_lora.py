"""A Linear layer that adds each row's own adapter: base(x) + scale_r * (x @ A_r) @ B_r, one batched forward.

`RowLoraLinear` wraps a model's `Linear` (or `QuantizedLinear`) in place of
mlx-lm's `LoRALinear`, but holds no adapter of its own: `LayerSlots` keeps
every resident adapter's A and B for this layer stacked along a slot axis
(slot 0 is the base model: zeros), padded to `--max-lora-rank`, and the
`RowSelection` shared by every wrapped layer of the model says which slot
each row of the forward being built uses. mlx-lm's model call takes no
per-row argument, so whoever builds a forward sets the selection around it
(`selected`); the graph is built synchronously inside the call, on the
lease thread, so nothing else sees it.

Three ways through a layer, by the selection:
- None (every row is a base row): the wrapped layer alone, the same graph as
  without the wrapper.
- one slot for every row (a lone row, a cohort of one adapter): that
  adapter's own unpadded arrays, exactly mlx-lm's `LoRALinear` / `DoRALinear`
  arithmetic, so such a row is token-identical to `load(adapter_path=...)`.
- a slot per row: A and B gathered per row (`[B, in, R]`, `[B, R, out]`) and
  two batched matmuls. Base rows gather zeros and add exactly 0; padded rank
  columns are zeros too. DoRA rows scale by their magnitude over the adapted
  weight's norm, precomputed per slot (`factor`, 1 for LoRA and base rows).

Lease thread only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import attrs
import mlx.core as mx
import mlx.nn as nn

from mlx_trio.engine.adapters.adapter_files import LayerDelta


@attrs.frozen
class PerRow:
    """Each row's slot `[B]` (uint32), and the set of slots among them (to skip layers none of them touches)."""

    slots: mx.array = attrs.field(eq=False)
    present: frozenset[int]


class RowSelection:
    """The slot(s) of the forward being built: None (all base), one slot for every row, or `PerRow`."""

    def __init__(self) -> None:
        self.current: int | PerRow | None = None


def choice_of(slots: Sequence[int]) -> int | PerRow | None:
    """The selection for rows using `slots` (0: base): the cheapest form that gives each row its adapter."""
    distinct = set(slots)
    if distinct <= {0}:
        return None
    if len(distinct) == 1:
        return slots[0]
    return PerRow(mx.array(list(slots), dtype=mx.uint32), frozenset(distinct))


@contextmanager
def selected(selection: RowSelection | None, choice: int | PerRow | None) -> Iterator[None]:
    """Build a forward inside this block with `choice` as every wrapped layer's selection."""
    if selection is None or choice is None:
        yield
        return
    selection.current = choice
    try:
        yield
    finally:
        selection.current = None


@attrs.define(eq=False)
class _Exact:
    """One slot's own arrays for the one-slot path (mlx-lm's arithmetic)."""

    delta: LayerDelta
    scale: float


class LayerSlots:
    """One layer's resident adapters: stacked, rank-padded A `[S, in, R]`, B `[S, R, out]`, scales `[S]`,
    DoRA factors `[S, out]` (None until a DoRA adapter is resident), and each slot's exact arrays."""

    def __init__(self, num_slots: int, in_dims: int, out_dims: int, max_rank: int, dtype: mx.Dtype) -> None:
        self.a = mx.zeros((num_slots, in_dims, max_rank), dtype=dtype)
        self.b = mx.zeros((num_slots, max_rank, out_dims), dtype=dtype)
        self.scales = mx.zeros((num_slots,), dtype=dtype)
        self.factor: mx.array | None = None
        self.exact: dict[int, _Exact] = {}

    def put(self, slot: int, delta: LayerDelta | None, scale: float, weight: mx.array | None) -> None:
        """Slot `slot` now holds `delta` (None: the adapter leaves this layer alone); `weight`: the base weight
        (dequantized), needed for a DoRA delta's factor. Lazy: the caller evaluates `arrays()`."""
        self.exact.pop(slot, None)
        rank = 0 if delta is None else delta.a.shape[1]
        a = mx.zeros(self.a.shape[1:], dtype=self.a.dtype)
        b = mx.zeros(self.b.shape[1:], dtype=self.b.dtype)
        factor = mx.ones((self.b.shape[2],), dtype=mx.float32)
        if delta is not None:
            a[:, :rank] = delta.a.astype(self.a.dtype)
            b[:rank, :] = delta.b.astype(self.b.dtype)
            self.exact[slot] = _Exact(delta, scale)
            if delta.m is not None:
                assert weight is not None
                adapted = weight + (scale * delta.b.T) @ delta.a.T
                factor = (delta.m / mx.linalg.norm(adapted, axis=1)).astype(mx.float32)
        self.a[slot] = a
        self.b[slot] = b
        self.scales[slot] = scale if delta is not None else 0.0
        if delta is not None and delta.m is not None and self.factor is None:
            self.factor = mx.ones((self.a.shape[0], self.b.shape[2]), dtype=mx.float32)
        if self.factor is not None:
            self.factor[slot] = factor

    def arrays(self) -> list[mx.array]:
        return [self.a, self.b, self.scales, *([self.factor] if self.factor is not None else [])]


class RowLoraLinear(nn.Module):
    """`linear` plus the adapter of each row, as `selection` says (see the module docstring)."""

    def __init__(self, linear: nn.Module, selection: RowSelection, slots: LayerSlots) -> None:
        super().__init__()
        self.linear = linear
        # Plain attributes, not parameters: the model's weights stay the base model's.
        self.selection = selection
        self.slots = slots

    def __call__(self, x: mx.array) -> mx.array:
        choice = self.selection.current
        slots = self.slots
        if choice is None:
            return self.linear(x)
        if isinstance(choice, int):
            exact = slots.exact.get(choice)
            if exact is None:
                return self.linear(x)
            return self._dora(x, exact) if exact.delta.m is not None else self._lora(x, exact)
        if not any(slot in slots.exact for slot in choice.present):
            return self.linear(x)
        index = choice.slots
        z = (x @ slots.a[index]) @ slots.b[index]  # [B, L, in] @ [B, in, R] @ [B, R, out]
        delta = (slots.scales[index][:, None, None] * z).astype(x.dtype)
        y = self.linear(x)
        if slots.factor is None:
            return y + delta
        factor = slots.factor[index][:, None, :].astype(x.dtype)
        if "bias" in self.linear:
            bias = self.linear.bias
            return factor * (y - bias + delta) + bias
        return factor * (y + delta)

    def _lora(self, x: mx.array, exact: _Exact) -> mx.array:
        # mlx-lm's LoRALinear.__call__ (dropout is the identity at inference).
        y = self.linear(x)
        z = (x @ exact.delta.a) @ exact.delta.b
        return y + (exact.scale * z).astype(x.dtype)

    def _dora(self, x: mx.array, exact: _Exact) -> mx.array:
        # mlx-lm's DoRALinear.__call__.
        w = base_weight(self.linear)
        a, b, scale = exact.delta.a, exact.delta.b, exact.scale
        out = x @ w.T + (scale * ((x @ a) @ b)).astype(x.dtype)
        adapted = w + (scale * b.T) @ a.T
        denom = mx.linalg.norm(adapted, axis=1)
        out = (exact.delta.m / denom).astype(x.dtype) * out
        if "bias" in self.linear:
            out = out + self.linear.bias
        return out


def base_weight(linear: nn.Module) -> mx.array:
    """The layer's weight `[out, in]`, dequantized for a `QuantizedLinear` (as mlx-lm's DoRA does)."""
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(linear.weight, linear.scales, linear.biases, group_size=linear.group_size,
                             bits=linear.bits, mode=linear.mode)
    return linear.weight
