"""The prefill grid's chunk shapes, and one chunk run at a shape so that cuDNN plans it before a request does.

Under prefill-only cuDNN attention (`MLX_TRIO_ATTENTION_BACKEND=cudnn-prefill`,
engine/lease_thread.py) MLX's CUDA backend builds one cuDNN plan per exact
(query, key, value shapes and strides, mask, causal) it meets and caches it
per thread (docs/design.md §4.6): ~60-90 ms the first time (H200, Llama-1B
shape), 6-10 ms a chunk afterwards. On the shape grid (docs/design.md §2.2,
engine/batch/chunked_prefill.py) a prefill that starts on a grid point runs
only chunks of `tokens` = one of `GRID_MULTIPLES` grid steps after `context`
= a grid point, its keys the whole buffer (`context + tokens` slots, which
is also what fixes their strides). So those pairs are a short list
(`grid_shapes`), and `PlanWarmer.warm` runs one of them through `ChunkedPrefill`
itself, on caches filled with `context` zero keys laid out as a real
prefill leaves them (a buffer of exactly `context` slots): the same model
forward, so the same attention call, shapes, strides and mask, and cuDNN
plans it. The values are zeros; the plan does not depend on them.

A prefill that would start off the grid (a prompt-cache hit) or split off it
(a snapshot boundary) steps back to the grid point below under prefill-only
cuDNN (`ChunkedPrefill`), so its chunks are listed shapes too, and a cohort
(docs/design.md §2.4) prefills each row alone (`can_prefill_together`).

Runs on the lease thread: cuDNN's plan cache is per thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.batch.chunked_prefill import GRID_MULTIPLES, ChunkedPrefill, resolve_grid, trims_exactly
from mlx_trio.engine.kv import decode_layout


@attrs.frozen(order=True)
class ChunkShape:
    """A prefill chunk of `tokens` computed tokens after `context` cached ones: its keys are `context + tokens`."""

    context: int
    tokens: int

    @property
    def keys(self) -> int:
        return self.context + self.tokens


def chunk_sizes(grid: int, step_size: int) -> list[int]:
    """The chunk lengths a prefill on `grid` computes from a grid point, with chunks of at most `step_size`.

    Whole grid steps of `GRID_MULTIPLES` that fit the step size, and always
    one step (a chunk asked for less still computes a whole one: `ChunkedPrefill.chunk`).
    """
    return sorted({grid, *(m * grid for m in GRID_MULTIPLES if m * grid <= step_size)})


def grid_shapes(grid: int, step_size: int, max_keys: int) -> list[ChunkShape]:
    """Every chunk a prefill on `grid` runs from a grid point with its keys ending at most at `max_keys`.

    Ordered by key length, then the longest chunk first: short prompts
    are the common case, so a bounded warm-up that stops part-way has planned them.
    """
    if grid <= 0:
        return []
    shapes = [ChunkShape(context, tokens) for tokens in chunk_sizes(grid, step_size)
              for context in range(0, max_keys - tokens + 1, grid)]
    return sorted(shapes, key=lambda s: (s.keys, -s.tokens))


def plans_wanted(model: Callable[..., Any], grid: int) -> bool:
    """Whether prefill chunks of `model` on `grid` run on cuDNN's planned attention in this process.

    Prefill-only cuDNN is on (the lease thread turned decode's layout on:
    engine/kv/decode_layout.py), the grid is on, and the model's caches take it
    (plain `KVCache` layers only).
    """
    return decode_layout.is_active() and grid > 0 and trims_exactly(make_prompt_cache(model))


class PlanWarmer:
    """Runs prefill chunks at given shapes on scratch caches, so that cuDNN plans them (lease thread)."""

    def __init__(self, model: Callable[..., Any], grid: int) -> None:
        self._model = model
        self._grid = grid
        self._layouts: list[tuple[int, int, mx.Dtype]] | None = None

    def warm(self, shape: ChunkShape) -> None:
        """One prefill chunk at `shape` (evaluated, then freed): cuDNN plans its attention.

        The caches hold `shape.context` zero positions in buffers of exactly
        that many slots, as a prefill on the grid leaves them at a grid point,
        and the chunk is `ChunkedPrefill.chunk`'s own, so its attention call is
        a real prefill's at that shape.
        """
        caches = make_prompt_cache(self._model)
        if shape.context:
            for cache, (heads, dim, dtype) in zip(caches, self._layer_layouts(), strict=True):
                zeros = mx.zeros((1, heads, shape.context, dim), dtype)
                cache.keys, cache.values, cache.offset = zeros, zeros, shape.context
        prompt = [0] * (shape.keys + 1)  # one more: the last prompt token is token 0's step, never a chunk's
        prefill = ChunkedPrefill(self._model, caches, prompt, max(shape.tokens, self._grid), start=shape.context,
                                 grid=self._grid)
        prefill.chunk(shape.tokens)
        if prefill.fed != shape.keys:
            raise AssertionError(f"a warm-up chunk at {shape} fed up to {prefill.fed}")
        prefill.release()
        mx.clear_cache()

    def _layer_layouts(self) -> list[tuple[int, int, mx.Dtype]]:
        """Each layer's (kv heads, head dim, dtype), from a one-token forward (not a cuDNN call: under 256 keys)."""
        if self._layouts is None:
            caches = make_prompt_cache(self._model)
            self._model(mx.zeros((1, 1), mx.int32), cache=caches)
            mx.eval([c.state for c in caches])
            self._layouts = [(c.keys.shape[1], c.keys.shape[3], c.keys.dtype) for c in caches]
        return self._layouts


def plan_list(model: Callable[..., Any], grid_setting: int | None, step_size: int,
              max_keys: int) -> tuple[PlanWarmer | None, list[ChunkShape]]:
    """A warmer for `model` and the grid's shapes up to `max_keys`, or (None, []) where no plan is wanted.

    `grid_setting`: `--prefill-grid` (None: `resolve_grid`'s default). See `plans_wanted`.
    """
    grid = resolve_grid(grid_setting)
    if not plans_wanted(model, grid):
        return None, []
    return PlanWarmer(model, grid), grid_shapes(grid, step_size, max_keys)
