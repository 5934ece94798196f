"""All but the last prompt token into a cache, one chunk per call, as mlx-lm does, or on a shape grid.

The solo prefill of a row (`SoloRow`, engine/batch/solo_row.py) feeds its
prompt through this: the same chunk sizes, the same `mx.eval` of the cache
state and the same allocator clearing as mlx-lm's `generate_step`, which is
what keeps a lone row token-identical to mlx-lm; with a quantized KV scheme,
also its conversion, at the very token count where mlx-lm's chunks convert it
(`KvScheme.conversion_point`), however this prefill is split.

**The shape grid** (`grid` > 0; on by default on a GPU, `--prefill-grid`).
MLX's CUDA backend pays for each attention shape it has not run before:
cuDNN builds a plan per exact shape of queries and keys (~45 ms on an
H200, then 0.3 ms a run), and MLX's own kernels, which the lease selects
(engine/lease_thread.py), cost less extra but still some (a 512-token
chunk at ~6k context: 24-38 ms on a new context, 16-27 ms on a seen one;
docs/lab-notes/2026-12-01-h200-pass09.md). A chunk's key length is the context it
ends at, new for nearly every chunk of every prompt. On the grid, every chunk ends
at a multiple of `grid` tokens and holds a multiple of `grid` (one of
`GRID_MULTIPLES`), so prompts walk the same few shapes again; a chunk asked
for less than a step (a small `--prefill-chunk-ms`) still takes a whole one.
A piece shorter than a grid step (the prompt's tail, or up to a
snapshot boundary) is padded to one with dummy tokens, computed and then
trimmed from the cache: causal attention keeps them out of every real
token's result, and the next chunk overwrites their slots. The rest of a
prompt that one listed chunk of at most twice the asked size holds goes in
that chunk, padded, instead of a whole-step chunk and a padded tail (`grid_chunk`):
one forward instead of two, where a forward costs mostly its launches. A chunk that
starts off the grid (after a prompt-cache hit) ends at the next grid
point, one irregular shape per request. The keys' strides are part of a
shape too (cuDNN plans by them): mlx-lm's cache grows its buffer in
256-token steps from wherever it stands, so after such a chunk (or a
cache hit whose buffer is any length) every later buffer would end off the
grid, a new plan for each chunk of that request; `align_buffers` cuts the
buffer back to its offset at a grid point so growth starts on it again. Under prefill-only
cuDNN (engine/kv/decode_layout.py active) a start off the grid steps back to the grid point below
instead, and so does a snapshot boundary: every chunk is then one of the grid's listed shapes, whose
plans are built ahead (engine/batch/prefill_plans.py). Only caches that trim exactly
(plain `KVCache` layers) use it; sliding windows and recurrent state,
which a dummy token would change, keep mlx-lm's chunks. The grid changes
chunk boundaries and a tail's matmul shapes, so its logits can differ from
mlx-lm's in the last bits, like any other chunking: it is off on the CPU,
where the goldens are checked bit for bit.

A paged row (`PagedRowCache` layers, engine/kv/blocks/) walks the same grid
when the grid step is a multiple of the block size: its chunks then end on
grid points, which are block boundaries, and its attention gathers its keys
contiguous in the layout of a `KVCache` buffer on the grid, so a paged chunk
is the very shape, strides included, a padded chunk is, and the plans built
ahead serve both. Its dummy tokens are attended but never written into
blocks, allocated, keyed or counted in the row (`RowForward.dummies`), so
there is nothing to trim. Where a padded row would step back to the grid
point below (prefill-only cuDNN), a paged row, whose cached blocks may be
shared (a prefix found at its start, or a sibling's blocks caught up with),
keeps them: its next chunk feeds the tokens from that grid point again as its
first queries (`RowForward.lead`), attended over the row's own K/V and not
written, so the chunk is a listed shape and no block is dropped, copied or
allocated beyond what the row holds anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_trio.engine.kv import decode_layout
from mlx_trio.engine.kv.blocks.layer_cache import row_forward_of
from mlx_trio.engine.kv.kv_scheme import KvScheme

# mlx-lm's `generate_step` default.
DEFAULT_PREFILL_STEP_SIZE = 2048
# The grid step on a GPU: mlx-lm's KVCache grows its buffers by 256 tokens, so grid-aligned chunks also
# keep the keys' strides (the buffer's length) on the grid.
GPU_GRID = 256
# A gridded chunk holds one of these many grid steps: few lengths (fewer plans), close enough together
# that a chunk sized for a target time loses at most a third of it.
GRID_MULTIPLES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def resolve_grid(setting: int | None) -> int:
    """The grid step for a `--prefill-grid` setting: None means `GPU_GRID` on a GPU and off (0) elsewhere."""
    if setting is not None:
        return setting
    return GPU_GRID if mx.default_device() == mx.gpu else 0


def grid_chunk(fed: int, n: int, grid: int, *, rest: int | None = None, cap: int | None = None) -> tuple[int, int]:
    """(tokens to take, dummy tokens to add) for a chunk of at most `n` after `fed`, on a `grid`.

    Off the grid: up to the next grid point (no padding). On it: the
    largest multiple of `grid` in `GRID_MULTIPLES` that fits `n`; or, when
    `n` is less than one step, `n` padded to one step. `rest`: the tokens
    left until the prefill ends (or reaches its snapshot boundary): when the
    smallest listed chunk that holds them all is at most `2 n` (and `cap`)
    tokens, they go in that one chunk, padded, rather than in a whole-step
    chunk and a padded tail after it: a chunk on a GPU costs mostly its
    launches (H200, 1B shape: ~9 ms for 512 tokens, docs/lab-notes/), so
    one padded forward is cheaper than two.
    """
    if fed % grid:
        return min(n, grid - fed % grid), 0
    if rest is not None and rest > 0:
        whole = min((m * grid for m in GRID_MULTIPLES if m * grid >= rest), default=None)
        if whole is not None and whole <= 2 * n and (cap is None or whole <= cap):
            return rest, whole - rest
    steps = max((m for m in GRID_MULTIPLES if m * grid <= n), default=0)
    if steps:
        return steps * grid, 0
    return n, grid - n


def align_buffers(caches: Sequence[Any], grid: int) -> None:
    """At a grid point: each buffer longer than its offset, cut back to it (a view; no copy).

    mlx-lm's growth then allocates from the grid point, so a chunk of whole grid steps ends its
    buffer exactly at its end, and the keys' strides follow the chunk's shape (see above). A longer
    buffer on the grid too (a cache hit's): mlx-lm grows a buffer by appending to all of it.
    """
    for c in caches:
        if c.keys is not None and c.keys.shape[2] > c.offset:
            c.keys, c.values = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]


def trims_exactly(caches: Sequence[Any]) -> bool:
    """Whether a dummy token can be computed and trimmed away with no trace (plain KVCache layers only)."""
    return bool(caches) and all(type(c) is KVCache for c in caches)


class ChunkedPrefill:
    """The prompt tokens whose KV is not in `caches` yet, and how to feed them."""

    def __init__(self, model: Callable[..., Any], caches: list[Any], prompt_ids: Sequence[int], step_size: int, *,
                 start: int = 0, split_at: int | None = None, grid: int | None = 0,
                 kv_scheme: KvScheme = KvScheme()) -> None:
        # `start`: prompt tokens whose KV `caches` already hold (a prompt-cache hit).
        # `model`: the row's forward (the model, or the model with the row's adapter: engine/adapters/forward.py).
        # `split_at`: a prompt position no chunk may straddle, so that the caches hold
        # exactly that prefix after some chunk (where a boundary snapshot is taken).
        # `grid`: the shape grid's step (module docstring; None: `resolve_grid`'s default); 0, or caches
        # that cannot trim, keep mlx-lm's chunks.
        self._model = model
        self._caches = caches
        self._step_size = step_size
        self._kv_scheme = kv_scheme
        grid = resolve_grid(grid)
        # A paged row's forward (None: mlx-lm caches): pads without trimming, leads instead of stepping back.
        self._paged = row_forward_of(caches)
        self._prompt_ids = prompt_ids
        paddable = trims_exactly(caches) or (self._paged is not None and grid % self._paged.kv.block_size == 0)
        self._grid = grid if grid > 0 and paddable else 0
        if self._grid and decode_layout.is_active():
            # Prefill-only cuDNN: every chunk on the grid, so that each is a shape whose plan is built
            # (engine/batch/prefill_plans.py). A start off the grid (a cache hit) steps back to the grid
            # point below (at most a grid step less of the hit: a few ms, against a plan's 60-90 ms), and
            # a snapshot boundary moves to the grid point below it, where those hits then start.
            back = start % self._grid
            if back and self._paged is None:  # a paged row leads its next chunk instead (`chunk`)
                for c in caches:
                    c.trim(back)
                start -= back
            split_at = split_at // self._grid * self._grid if split_at is not None else None
        self.fed = start
        self._split_at = split_at if split_at is not None and start < split_at < len(prompt_ids) else None
        # Where mlx-lm's generate_step converts this prompt's KV (None: never in prefill). No chunk straddles
        # it and nothing converts before it, whatever splits the prefill (engine/kv/kv_scheme.py).
        self._convert_at = kv_scheme.conversion_point(len(prompt_ids), step_size)
        self._convert_if_due()
        # Invariant: pending holds the prompt tokens whose KV is not yet in the caches
        # (prompt_ids[fed:]).
        self.pending = mx.array(list(prompt_ids[start:]))  # int32, as mlx-lm builds it
        # On the grid: the last chunk's (tokens computed, dummy ones included; keys attended), the
        # attention shape cuDNN plans by (actors/chunk_sizer.py tells first visits from repeats); else None.
        self.last_shape: tuple[int, int] | None = None

    @property
    def split_at(self) -> int | None:
        """The prompt position no chunk straddles (a snapshot's), as this prefill keeps it; None: none."""
        return self._split_at

    def split_later(self, at: int) -> int | None:
        """Make `at` the position no chunk straddles from now on, if it still lies ahead; returns the split kept.

        For a sibling that arrived while this prefill ran (actors/siblings.py):
        only a split not yet reached is replaced (one snapshot per prefill), and
        under prefill-only cuDNN it moves to the grid point below, as at start.
        """
        if self._grid and decode_layout.is_active():
            at = at // self._grid * self._grid
        pending = self._split_at is not None and self.fed < self._split_at
        if not pending and self.fed < at < self.fed + int(self.pending.size):
            self._split_at = at
        return self._split_at

    @property
    def step_size(self) -> int:
        """The most tokens one chunk feeds (`--prefill-step-size`)."""
        return self._step_size

    @property
    def remaining(self) -> int:
        """Tokens still to prefill before the first sampling step (the last one is that step's input)."""
        return max(int(self.pending.size) - 1, 0)

    def chunk(self, limit: int | None = None, *, evaluate: bool = True) -> mx.array | None:
        """Prefill up to `step_size` (or `limit`, if smaller) tokens into the caches; return them, or None when done.

        `evaluate=False`: the chunk is launched (`mx.async_eval`) and the allocator not cleared, so the
        caller builds its next forward while the device runs this one; it evaluates at the end.
        """
        # `stretch`: the tokens up to the prompt's end or its snapshot boundary; `most`: what the prompt
        # allows (that, within the step size); `limit` only asks.
        stretch = self.remaining
        if self._split_at is not None and self.fed < self._split_at:
            stretch = min(stretch, self._split_at - self.fed)
        if self._convert_at is not None and self.fed < self._convert_at:
            stretch = min(stretch, self._convert_at - self.fed)
        most = min(self._step_size, stretch)
        n = min(most, limit or self._step_size)
        if n == 0:
            return None
        pad = lead = 0
        if self._grid:
            # A paged row off the grid under prefill-only cuDNN feeds its tokens from the grid point below
            # again (`lead`; module docstring), so the chunk is planned from that point.
            if self._paged is not None and decode_layout.is_active():
                lead = self.fed % self._grid
            # A gridded chunk computes at least one grid step (or up to the next grid point) whatever
            # `limit` asks, so it holds real tokens there where the prompt has them: a smaller `limit`
            # padded to a step cost the same and left the next chunks off the grid, each a new shape
            # (H200: a chunk sizer fitted to cuDNN's plan builds asked for 32 tokens; docs/lab-notes/).
            rest = stretch + lead
            n, pad = grid_chunk(self.fed - lead, max(n + lead, min(most + lead, self._grid)), self._grid,
                                rest=rest if rest <= self._step_size else None, cap=self._step_size)
            n -= lead
            if self.fed % self._grid == 0 and self._paged is None:
                align_buffers(self._caches, self._grid)
        chunk = self.take(n)
        self.last_shape = (lead + n + pad, self.fed + pad) if self._grid else None
        if self._paged is not None and (lead or pad):
            # The row's last `lead` tokens again, then the chunk, then dummy tokens: only the chunk's K/V
            # are written (`RowForward`); causal attention keeps the dummies out of every real result.
            again = mx.array(list(self._prompt_ids[self.fed - n - lead : self.fed - n]), dtype=chunk.dtype)
            self._paged.lead, self._paged.dummies = lead, pad
            try:
                self._model(mx.concatenate([again, chunk, mx.zeros((pad,), dtype=chunk.dtype)])[None],
                            cache=self._caches)
            finally:
                self._paged.lead = self._paged.dummies = 0
        elif pad:
            # Dummy tokens after the real ones: causal attention keeps them out of the real tokens'
            # results; their KV is trimmed below and overwritten by the next chunk.
            self._model(mx.concatenate([chunk, mx.zeros((pad,), dtype=chunk.dtype)])[None], cache=self._caches)
            for c in self._caches:
                c.trim(pad)
        else:
            self._model(chunk[None], cache=self._caches)
        self._convert_if_due()
        if not evaluate:
            mx.async_eval([c.state for c in self._caches])
            return chunk
        mx.eval([c.state for c in self._caches])
        mx.clear_cache()
        return chunk

    def _convert_if_due(self) -> None:
        """The caches to the scheme's format once they hold the tokens mlx-lm converts at (idempotent)."""
        if self._convert_at is not None and self.fed >= self._convert_at:
            self._kv_scheme.convert_all(self._caches)

    def take(self, n: int) -> mx.array:
        """The next `n` prompt tokens, counted as fed: the caller runs them into the caches now.

        `chunk()` runs them through this prefill's own caches; a cohort
        (engine/batch/cohort_prefill.py) runs several rows' tokens as one batch.
        """
        if not 0 < n <= self.remaining:
            raise ValueError(f"take({n}) with {self.remaining} tokens left to prefill")
        taken = self.pending[:n]
        self.pending = self.pending[n:]
        self.fed += n
        return taken

    def take_rest(self) -> mx.array:
        """The token(s) left for the first sampling step; afterwards nothing is pending."""
        if self.remaining:
            raise RuntimeError("the prompt is not prefilled yet")
        rest = self.pending
        self.fed += int(rest.size)
        self.release()
        return rest

    def release(self) -> None:
        """Forget the caches and the pending tokens: whoever owns the caches decides their life."""
        self._caches = []
        self.pending = self.pending[:0]
