"""All but the last prompt token into a cache, one chunk per call, exactly as mlx-lm does.

The solo prefill of a row (`SoloRow`, engine/batch/solo_row.py) feeds its
prompt through this: the same chunk sizes, the same `mx.eval` of the cache
state and the same allocator clearing as mlx-lm's `generate_step`, which is
what keeps a lone row token-identical to mlx-lm; with a quantized KV scheme,
also its conversion after each chunk (engine/kv/kv_scheme.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_trio.engine.kv.kv_scheme import KvScheme

# mlx-lm's `generate_step` default.
DEFAULT_PREFILL_STEP_SIZE = 2048


class ChunkedPrefill:
    """The prompt tokens whose KV is not in `caches` yet, and how to feed them."""

    def __init__(self, model: nn.Module, caches: list[Any], prompt_ids: Sequence[int], step_size: int, *,
                 start: int = 0, split_at: int | None = None, kv_scheme: KvScheme = KvScheme()) -> None:
        # `start`: prompt tokens whose KV `caches` already hold (a prompt-cache hit).
        # `split_at`: a prompt position no chunk may straddle, so that the caches hold
        # exactly that prefix after some chunk (where a boundary snapshot is taken).
        self._model = model
        self._caches = caches
        self._step_size = step_size
        self._kv_scheme = kv_scheme
        self.fed = start
        self._split_at = split_at if split_at is not None and start < split_at < len(prompt_ids) else None
        # Invariant: pending holds the prompt tokens whose KV is not yet in the caches
        # (prompt_ids[fed:]).
        self.pending = mx.array(list(prompt_ids[start:]))  # int32, as mlx-lm builds it

    @property
    def remaining(self) -> int:
        """Tokens still to prefill before the first sampling step (the last one is that step's input)."""
        return max(int(self.pending.size) - 1, 0)

    def chunk(self, limit: int | None = None) -> mx.array | None:
        """Prefill up to `step_size` (or `limit`, if smaller) tokens into the caches; return them, or None when done."""
        n = min(self._step_size, self.remaining, limit or self._step_size)
        if self._split_at is not None and self.fed < self._split_at:
            n = min(n, self._split_at - self.fed)
        if n == 0:
            return None
        chunk = self.take(n)
        self._model(chunk[None], cache=self._caches)
        self._kv_scheme.convert_due(self._caches)  # where generate_step calls maybe_quantize_kv_cache
        mx.eval([c.state for c in self._caches])
        mx.clear_cache()
        return chunk

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
