"""A joiner's prefill on its own caches: the first half of continuous batching.

A request never prefills inside the running batch. It prefills alone, in
chunks (one lease job each, so the decode steps of the running rows are
interleaved and stall at most one chunk), then feeds its last prompt token
as an L=1 step that samples token 0 on the same solo caches (mlx-lm's
convention, and what keeps B=1 bit-exact with `generate_step`). Only then
does it join the `DecodeBatch` (engine/batch/decode_batch.py), which takes its caches and
sampler. Because solo state never sees a pad token, recurrent (SSM) layers
need no padding mask when they later batch.

With paged KV (`paged=`, engine/kv/blocks/) the row's caches are its block
table's: its prompt first references the cached full blocks it starts with
(another row's prefix, shared, not recomputed), only the rest is prefilled,
into blocks of its own, and the decode batch takes the row without a copy.

Every method runs on the lease thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.adapters.forward import adapted
from mlx_trio.engine.adapters.resident import AdapterUse
from mlx_trio.engine.kv import cache_clone, decode_layout
from mlx_trio.engine.kv.blocks.paged_kv import PagedKV, PrefixPin
from mlx_trio.engine.kv.blocks.row import PagedRow
from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.engine.kv.row_blocks import RowBlock
from mlx_trio.engine.batch.chunked_prefill import DEFAULT_PREFILL_STEP_SIZE, ChunkedPrefill
from mlx_trio.engine.prompt_cache.namespace import kv_revision
from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry, CacheHit
from mlx_trio.engine.sampling.grammar import GrammarMatcher
from mlx_trio.engine.sampling.row_sampler import RowSampler
from mlx_trio.engine.sampling.token_logprobs import LogprobArrays, arrays_of, to_record
from mlx_trio.logprobs import SampledLogprobs
from mlx_trio.params import SamplingParams


def adapter_revision(adapter: AdapterUse | None) -> str:
    """The revision a row's KV is computed under: its adapter's ("" for the base model)."""
    return "" if adapter is None else kv_revision(adapter.name, adapter.owner.revision(adapter.name))


class SoloRow:
    """One request from its prompt to token 0, on caches of its own.

    Lifecycle (one lease job each): `prefill_chunk()` until it returns 0,
    then `first_token()` once, then either `DecodeBatch.join(row, token0)`
    (which takes `caches` and `sampler`) or, when token 0 already ends the
    request, `close()`.
    """

    def __init__(
        self,
        model: nn.Module,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
        rng_draws: int = 0,
        hit: CacheHit | None = None,
        snapshot_at: int | None = None,
        grammar_tokenizer: Any = None,
        resumed_tokens: int = 0,
        prefill_grid: int | None = 0,
        kv_scheme: KvScheme = KvScheme(),
        adapter: AdapterUse | None = None,
        paged: PagedKV | None = None,
        pin: PrefixPin | None = None,
    ) -> None:
        # `hit`: start from a prompt-cache entry (cloned, never consumed); with a quantized `kv_scheme`, one the
        # lookup cut with `kv_scheme.hit_limit`, or the row may not convert where mlx-lm does. `snapshot_at`:
        # a prompt position where `snapshot()` should be taken (a message boundary).
        # `grammar_tokenizer`: the model's llguidance tokenizer, needed when `params.constraint`
        # is set. `resumed_tokens`: the tail of `prompt_ids` this request generated before a
        # resume, which its grammar has already seen. `prefill_grid`: the shape grid's step
        # (engine/batch/chunked_prefill.py; 0 = mlx-lm's chunks, None = on a GPU only).
        # `kv_scheme`: the KV format, converted to after each forward as mlx-lm's generate_step does
        # (engine/kv/kv_scheme.py).
        # `adapter`: the row's hold on its adapter's slot (None: the base model); every forward of this
        # row uses it, and `DecodeBatch.join_many` takes it.
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if hit is not None and hit.usable >= len(prompt_ids):
            raise ValueError("a cache hit must leave the last prompt token to compute")
        if paged is not None and (hit is not None or snapshot_at is not None):
            raise ValueError("a paged row's prompt cache is its shared blocks: no entry hit or snapshot")
        if paged is not None and kv_scheme.quantized:
            raise ValueError("quantized KV is not on the paged KV layout yet")
        # Paged KV: the pool and the row's block table (None once the decode batch took it, or unpaged); an adapter
        # row's blocks are keyed under its adapter's revision. `pin`: the prefix admission pinned and credited
        # (`PagedKV.pin_prefix`), whose references the row takes over.
        self.paged_kv = paged
        self.paged_row: PagedRow | None = (paged.join(prompt_ids, adapter_revision(adapter), pin=pin)
                                           if paged is not None else None)
        self.adapter = adapter
        self._model = adapted(model, adapter)
        self.request_id = request_id
        self.params = params
        self.kv_scheme = kv_scheme
        self._prompt_ids = tuple(prompt_ids)
        self.cached_tokens = hit.usable if hit is not None else 0
        self._caches: list[Any] | None = (
            cache_clone.take(hit.caches, hit.trim) if hit is not None else make_prompt_cache(model)
        )
        if paged is not None:
            assert self.paged_row is not None
            self.cached_tokens = self.paged_row.length  # its shared prefix blocks
            self._caches = list(paged.row_caches(self.paged_row))
        matcher = GrammarMatcher.for_row(params.constraint, grammar_tokenizer,
                                         prompt_ids[len(prompt_ids) - resumed_tokens:] if resumed_tokens else ())
        self.sampler = RowSampler(params, prompt_ids, rng_draws=rng_draws, matcher=matcher)
        self.num_prompt_tokens = len(prompt_ids)
        self._prefill = ChunkedPrefill(self._model, self.caches, prompt_ids, prefill_step_size,
                                       start=self.cached_tokens, split_at=snapshot_at, grid=prefill_grid,
                                       kv_scheme=kv_scheme)
        # As the prefill keeps them: under prefill-only cuDNN a hit and a snapshot move to the grid point below.
        self.cached_tokens = self._prefill.fed
        self.snapshot_at = self._prefill.split_at
        self.token0: int | None = None
        # Token 0's logprobs, when the request asks for them (set by `first_token`).
        self.token0_logprobs: SampledLogprobs | None = None
        # Between `draw_token0` and `read_token0`: the lazy token 0 and its logprob arrays.
        self._token0: mx.array | None = None
        self._token0_logprobs: LogprobArrays | None = None
        # Set by a cohort that handed `caches` back as slices of its own cache: where they sit in it, so the
        # rows that join together copy out of it once a layer (engine/kv/row_blocks.py). None otherwise.
        self.block: RowBlock | None = None

    @property
    def caches(self) -> list[Any]:
        """The row's KV, one cache a layer. A cohort row's are cut out of its cohort's cache on first use
        (`take_block`): rows that join the decode batch from the block never need their own."""
        if self._caches is None:
            assert self.block is not None, "a row without caches has a block"
            self._caches = [layer.extract(self.block.index) for layer in self.block.layers]
        return self._caches

    @caches.setter
    def caches(self, value: list[Any]) -> None:
        self._caches = value

    @property
    def holds_kv(self) -> bool:
        """Whether the row has KV to hand over: caches of its own, or a place in its cohort's cache."""
        return bool(self._caches) if self._caches is not None else self.block is not None

    def take_block(self, block: RowBlock) -> None:
        """The row's KV is now row `block.index` of its cohort's cache (engine/batch/cohort_prefill.py).

        Its own caches (merged into that cache) are dropped, in place: its prefill holds the list. Each
        row's slice of every layer would be an operation per row per layer (H200, 64 rows: ~9 ms of the
        lease thread a cohort), so they are cut only if something asks for `caches`.
        """
        if self._caches:
            self._caches.clear()
        self._caches = None
        self.block = block

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self._prompt_ids

    @property
    def prefill_step_size(self) -> int:
        """The most prompt tokens one of this row's forwards feeds (`--prefill-step-size`)."""
        return self._prefill.step_size

    @property
    def prefill_remaining(self) -> int:
        """Prompt tokens still to prefill before token 0 can be sampled (excludes the last)."""
        return self._prefill.remaining

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @property
    def fed(self) -> int:
        """Prompt tokens whose KV the caches hold."""
        return self._prefill.fed

    @property
    def last_chunk_shape(self) -> tuple[int, int] | None:
        """The last prefill chunk's attention shape on the grid (tokens computed, keys), else None."""
        return self._prefill.last_shape

    def take_prefill(self, n: int) -> mx.array:
        """The next `n` prompt tokens, counted as fed: a cohort runs them into `caches` (engine/batch/cohort_prefill.py)."""
        return self._prefill.take(n)

    def snapshot_later(self, at: int) -> int | None:
        """Take the snapshot at prompt position `at` too, if the prefill has not reached it and none is due
        before; returns the position the row will snapshot at (None: none). Lease thread only."""
        self.snapshot_at = self._prefill.split_later(at)
        return self.snapshot_at

    def snapshot(self) -> CacheEntry:
        """An evaluated copy of the caches as they stand, keyed by the prompt tokens they hold."""
        return cache_clone.snapshot(self._prompt_ids[: self.fed], self.caches)

    def prefill_chunk(self, limit: int | None = None, *, evaluate: bool = True) -> int:
        """Prefill up to `prefill_step_size` (or `limit`) prompt tokens into `caches`; returns how many remain.

        The same chunks, evaluation and allocator clearing as mlx-lm's
        `generate_step`. The last
        prompt token is never prefilled here: it is `first_token()`'s input.
        `evaluate=False` only launches the chunk (`ChunkedPrefill.chunk`); the same kernels, so the same numbers.
        """
        if self.paged_row is not None:
            limit = self._paged_limit(limit)
            if not self.prefill_remaining:
                return 0
        self._prefill.chunk(limit, evaluate=evaluate)
        return self.prefill_remaining

    def _paged_limit(self, limit: int | None) -> int:
        """Before a paged chunk: take the blocks other rows cached since (`PagedKV.catch_up`: skipped here, counted
        as cached), and end the chunk on a block boundary unless it is the prompt's last, so the next one can."""
        assert self.paged_kv is not None and self.paged_row is not None
        gained = self.paged_kv.catch_up(self.paged_row)
        if gained:
            self._prefill.take(gained)
            self.cached_tokens += gained
        prefill = self._prefill
        n = min(limit or prefill.step_size, prefill.step_size, prefill.remaining)
        over = (prefill.fed + n) % self.paged_kv.block_size
        return n - over if n < prefill.remaining and n > over else n

    def first_token(self) -> int:
        """Feed the last prompt token (an L=1 step on `caches`) and return token 0, evaluated."""
        mx.eval(*self.launch_token0())
        return self.read_token0()

    def launch_token0(self) -> list[mx.array]:
        """`first_token()`'s step and draw, launched (`mx.async_eval`) but not read: then `read_token0()`.

        Returns the arrays to evaluate before reading.
        """
        last = self.last_input()
        decode_layout.keep_vector_decode(self.caches)  # an L=1 step: the vector kernel under prefill-only cuDNN
        logits = self._model(last[None], cache=self.caches)[:, -1, :]
        self.kv_scheme.convert_due(self.caches)  # as generate_step's _step, after its forward
        arrays = self.draw_token0(logits, last)
        mx.async_eval(*arrays)
        return arrays

    def last_input(self) -> mx.array:
        """Token 0's input, the last prompt token; afterwards nothing is pending. Needs the prompt prefilled."""
        if self.prefill_remaining:
            raise RuntimeError("first_token() before the prompt was prefilled")
        if self.token0 is not None:
            raise RuntimeError("first_token() was already called")
        return self._prefill.take_rest()

    def draw_token0(self, logits: mx.array, last: mx.array) -> list[mx.array]:
        """Sample token 0 from `logits` `[1, V]` of the step that fed `last`; returns the arrays to evaluate.

        Then `read_token0()`. Split so a cohort evaluates all its rows' token 0 at once.
        """
        self._token0 = self.sampler.sample(logits, last)
        self._token0_logprobs = self.sampler.last_logprobs
        context = self.sampler.context
        return [self._token0, *([context] if context is not None else []), *arrays_of(self._token0_logprobs)]

    def read_token0(self) -> int:
        """Token 0 drawn by `draw_token0` (evaluated by now), read on the host and accepted by the sampler."""
        assert self._token0 is not None, "read_token0() before draw_token0()"
        self.token0 = self._token0.item()
        self.sampler.accept(self.token0)
        if self._token0_logprobs is not None:
            self.token0_logprobs = to_record(self._token0_logprobs)
        self._token0_logprobs = None
        return self.token0

    def accept_token0(self, token: int) -> int:
        """Token 0 of a plain greedy row (`sampler.is_plain_greedy`), drawn by its cohort's one batched argmax.

        What `draw_token0` then `read_token0` give such a row: the argmax of its own logits, read on the host.
        """
        if not self.sampler.is_plain_greedy:
            raise RuntimeError("accept_token0() is for plain greedy rows: others draw with their own sampler")
        self.token0 = token
        self.sampler.accept(token)
        return token

    def adopt_into(self, paged: PagedKV) -> None:
        """Move a row prefilled on its own caches (a cohort's, with token 0) into fresh blocks of `paged`, keyed as
        they fill (`PagedKV.adopt`), and drop its own caches: the decode batch then takes its table without a copy.

        Lazy: the caller evaluates the pool's arrays (`paged.storage`) once for all the rows it adopts, in the lease
        job that made their caches, so those (outside the pool) are freed by its end. Raises PoolExhausted (the row
        unchanged) when the pool lacks the blocks, which admission's count prevents.
        """
        if self.paged_row is not None or self.token0 is None:
            raise RuntimeError("adopt_into() takes an unpaged row after first_token()")
        self.paged_row = paged.adopt(self.caches, self._prompt_ids[: self.num_prompt_tokens],
                                     adapter_revision(self.adapter))
        self.paged_kv = paged
        self.block = None
        self._prefill.release()
        self._caches = list(paged.row_caches(self.paged_row))

    def close(self) -> None:
        """Drop the row's caches and its adapter's slot (in the lease thread, which owns them); also done by `join`."""
        self.caches = []
        self.block = None
        if self.paged_row is not None:
            assert self.paged_kv is not None
            self.paged_kv.leave(self.paged_row)
            self.paged_row = None
        if self.adapter is not None:
            self.adapter.release()
            self.adapter = None
        self._prefill.release()

