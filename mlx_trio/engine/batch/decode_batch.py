"""The running decode batch: join, pipelined step, flush, leave, hand a row's KV to the prompt cache.

This is mlx-lm's `GenerationBatch` rebuilt around rows that prefilled alone
(engine/batch/solo_row.py) and with per-row state in one record:

- **Join** takes a `SoloRow` after its token 0. Into an empty batch the row's
  solo caches are *adopted* (zero copy), so a lone row runs exactly the
  serial graph (`generate_step`'s, bit for bit). A later joiner merges or
  extends per layer (engine/kv/batch_caches.py); from then on mlx-lm's batch
  caches supply the left padding, per-row masks and per-row RoPE offsets.
- **Step** is `GenerationBatch._step`'s pipeline: forward every row from the
  unread token register, sample every row at once (engine/sampling/batch_sampler.py:
  each option a per-row array, each feature one batched op), `async_eval` the new register, and
  only then read the previous one. The device computes step n+1 while the
  caller handles step n's tokens.
- **Constrained rows** (a grammar) need their previous token on the host
  before their next mask exists, so while one is in the batch a step first
  reads the register, then queues the next step. The device still computes
  step n+1 while the caller handles step n; only the graph build waits.
  Without one, the step is exactly the pipeline above.
- **Quantized KV** (a `KvScheme` with `bits`): the batch holds one format;
  it converts every row when one reaches the scheme's start (checked after
  each step's forward, as mlx-lm converts after each forward), and a join
  into a quantized batch, or of a quantized row, converts all rows first
  (engine/kv/kv_scheme.py says what that keeps token-identical).
- **Leave** filters the rows out; full-attention layers drop the padding all
  survivors share. When one row remains it is extracted back to solo caches,
  so B=1 is the serial graph again (measured in `leave`).
- **Row slots** (engine/kv/row_slots.py): on plain float full-attention
  layers, with no speculation, quantized KV or adapters, a leave only frees
  the row's slot and a join writes the joiner into a free one, so neither
  copies the other rows' KV. A freed slot decodes junk until it is reused:
  the forward runs over every slot (a gather maps the rows' inputs to their
  slots and the slots' logits back to the rows, only while some row is not in
  its own slot), and the rows' state stays in row order as without slots.
  When more than `MAX_FREE_SLOTS` of the slots are free, a leave compacts them
  (mlx-lm's `filter`, the path without slots). Every other layout takes that path.

Invariant: every row's KV cache holds exactly the tokens fed so far: its
prompt, then every token that has been a forward's input (`DecodeBatch.num_fed`
counts them). The register holds tokens sampled but not yet fed.

A plain step's own Python does not grow with the batch (issues #20, #25: on
an H200 the host builds and launches each step slower than the device runs
it): what every row does alike is counted once for the batch (`BatchRow`),
and what a step would check row by row is settled at join and leave
(`_convert_at`).

**Speculative steps** (with a `Speculator`, engine/speculative/): while some
row has a proposal, a step reads the register first, feeds every row its
input and its proposal in one `[B, 1 + Kmax]` forward, keeps each row's
longest verified prefix plus the target's own next token, and rolls each
row's rejected tail out of the KV (engine/kv/row_rollback.py). Such a step
is not pipelined (its proposals need the previous tokens on the host); so
when no row has a proposal, plain pipelined steps run for a while (1, 2, 4,
... up to `MAX_QUIET_STEPS`) before the next look.

**Paged KV** (`paged=`, engine/kv/blocks/): the rows' full-attention KV lives
in blocks of the model's pool, one block table a row; a join copies the
joiner's own KV into fresh blocks, a leave releases the leaver's, and neither
touches another row's KV; each step writes every row's new K/V into its last
block and attends over its own blocks (no padding to the longest row, no
slots, no solo phase); a speculative step's rejected tail is truncated off each
row's blocks (`PagedKV.truncate`); an adapter row's blocks are keyed under its
adapter's revision. Not yet with quantized KV: the constructor refuses it.

Every method runs on the lease thread; none hands out a lazy array.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_trio.engine.batch import compiled_step
from mlx_trio.engine.adapters.forward import BASE_ROWS, Selected, release_all, rows_selected
from mlx_trio.engine.adapters.resident import AdapterUse
from mlx_trio.engine.kv import batch_caches, batch_kv, cache_clone, decode_layout, row_blocks, row_rollback, row_slots
from mlx_trio.engine.kv.batch_kv import HostPaddedBatchKVCache
from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.engine.kv.blocks.row import PagedRow
from mlx_trio.engine.kv.blocks.pool import PoolExhausted
from mlx_trio.engine.kv.kv_scheme import KvScheme, is_quantized
from mlx_trio.engine.model.decode_forward import DecodeForward
from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry
from mlx_trio.engine.sampling.batch_sampler import BatchSampler
from mlx_trio.engine.batch.solo_row import SoloRow, adapter_revision
from mlx_trio.engine.sampling.token_logprobs import BatchLogprobs
from mlx_trio.engine.speculative import verify
from mlx_trio.engine.speculative.speculator import SpeculationConfig
from mlx_trio.logprobs import SampledLogprobs
from mlx_trio.engine.spans import span

# mlx-lm's generate_step frees the allocator's cache every 256 tokens; so do we.
_CLEAR_CACHE_EVERY = 256
# After a speculative step finds no proposal anywhere, this many plain (pipelined) steps at most
# run before proposals are looked for again (the wait doubles from 1 while none are found).
MAX_QUIET_STEPS = 8
# A join that copied running rows holding at least this much KV gives the replaced buffers back to the device
# (`mx.clear_cache`); smaller copies stay in MLX's buffer cache for the next steps and joins. A wave that
# joined an empty or one-row batch cleared it every time: 7-9 ms, and the next cohort job allocated from the
# device again (H200, 1B shape, c=64; docs/lab-notes/2026-12-04-h200-pass19.md).
JOIN_CLEAR_MIN_BYTES = 256 << 20
# Row slots (see the module docstring): the slots grow by this fraction of theirs (at least one) when a
# join finds too few free, and a leave compacts them once more than this share is free. A free slot costs
# a row's forward every step until a joiner takes it; a compaction copies every row's KV once.
SLOT_GROWTH = 8
MAX_FREE_SLOTS = 0.25
# A read of the register that waited longer than this for the device means the device is the
# bottleneck: the next reported step reads after its launch (see DecodeBatch.step_decoded).
DEVICE_BOUND_WAIT_S = 1e-4


@attrs.define
class BatchRow:
    """One request's state in the batch; the list of them is aligned with the cache's batch axis (its sampling
    state lives in the batch's `BatchSampler`, aligned the same way)."""

    request_id: str
    # Tokens in this row's KV cache less the batch's steps (`DecodeBatch._fed_steps`): a step feeds
    # every row one token, so it is counted once for the batch, not once a row.
    fed_offset: int
    # Quantized KV: the tokens its prompt-cache entry keeps (`KvScheme.entry_cut`: where the row converted, unless
    # at the first full chunk); None: all.
    kv_cut: int | None = None


@attrs.frozen
class Decoded:
    """One step's tokens in batch order, with the logprobs of the rows that ask (None elsewhere).

    A speculative step emits up to `1 + Kmax` tokens per row: it is reported
    as that many `Decoded` in a row, the `j`-th holding each row's `j`-th
    token, None for a row that emitted fewer. `forwards` counts the model
    forwards behind it (1 for the first of a step, 0 for the rest);
    `proposed` / `accepted` are each row's proposal and accepted counts
    (empty for a plain step).
    """

    token_ids: tuple[int | None, ...]
    logprobs: tuple[SampledLogprobs | None, ...]
    forwards: int = 1
    proposed: tuple[int, ...] = ()
    accepted: tuple[int, ...] = ()


# Takes consecutive steps' tokens on the lease thread as soon as they are read (DecodeBatch.steps_decoded).
Report = Callable[[list[Decoded]], None]


class DecodeBatch:
    """The rows decoding together and their caches; one instance per decode actor.

    Register protocol: `step_decoded()` queues a step and returns the tokens
    of the step before it (None right after a flush or a join: those were
    already returned); `steps_decoded()` runs several in one lease job.
    `flush_decoded()` returns the queued step's tokens without queueing
    another; they become the next inputs. `join_many` needs a flushed batch
    (the row set and its inputs are settled); `leave` works either way.
    """

    def __init__(self, model: nn.Module, kv_scheme: KvScheme = KvScheme(),
                 speculation: SpeculationConfig | None = None, *, compile_decode: bool | None = False,
                 max_rows: int | None = None, paged: PagedKV | None = None) -> None:
        if paged is not None and kv_scheme.quantized:
            raise ValueError("quantized KV (--kv-bits) is not on the paged KV layout yet: run it without paged KV")
        self._model = model
        # Paged KV (see the module docstring): the pool, and each row's block table, aligned with _rows.
        self._paged = paged
        self._paged_rows: list[PagedRow] = []
        # Row slots (engine/kv/row_slots.py): grown by an eighth, up to `max_rows` (the lane's row cap) when given.
        self._max_rows = max_rows
        # The slot of each row (aligned with _rows), or None: row i is in slot i and every slot holds a row.
        self._slots: list[int] | None = None
        self._num_slots = 0
        # While _slots: (each slot's row, or the dummy row B; each row's slot) as index arrays for the forward.
        self._slot_take: tuple[mx.array, mx.array] | None = None
        # The step's forward as a compiled graph where the caches allow (engine/batch/compiled_step.py).
        self._compiled = (compiled_step.CompiledForward(model)
                          if compiled_step.compile_wanted(compile_decode) and paged is None else None)
        # The default (None) compiles a lone row's steps only: over a batch the compiled forward attends the
        # whole masked buffer, which cost more than it saved at B=64 (this CPU: 1.3x the host CPU per streamed
        # token at c=64, 0.73x the tok/s; H200: 0.65x the bare loop; docs/lab-notes/). True compiles both.
        self._compile_batches = compile_decode is True
        # Else the step's forward with a third fewer graph nodes where the model allows (engine/model/decode_forward.py).
        self._lean = DecodeForward.of(model)
        self._kv_scheme = kv_scheme
        # Speculation needs caches whose rows can drop a tail (full attention, bf16 or quantized); else none.
        self._speculator = (speculation.speculator() if speculation is not None
                            and row_rollback.supports_rollback(make_prompt_cache(model)) else None)
        self._rows: list[BatchRow] = []
        # Per layer: one row's serial-class caches while `_solo`, else mlx-lm batch caches.
        self._caches: list[Any] = []
        self._solo = False
        # The next forward's inputs `[B]` (uint32, like sampled tokens).
        self._inputs: mx.array | None = None
        # Invariant: _unread iff _inputs came from a step and were not yet returned.
        self._unread = False
        # Every row's sampling options and state, aligned with _rows.
        self._sampler = BatchSampler()
        # While _unread: the logprobs of the unread tokens (None: no row asked).
        self._unread_logprobs: BatchLogprobs | None = None
        self._num_steps = 0
        # Steps run since the batch was made, each of which fed every row one token (a speculative step
        # feeds a row its accepted tokens too: those go into the row's `fed_offset`). With a row's
        # `fed_offset`, the tokens in its KV cache.
        self._fed_steps = 0
        # While a bf16 batch of a quantized scheme waits to convert: the `_fed_steps` after which it does
        # (its longest row then holds `start` tokens); else None. Settled at join, leave and speculative steps.
        self._convert_at: int | None = None
        # Plain steps to run before looking for proposals again, and the last such wait (see MAX_QUIET_STEPS).
        self._quiet_steps = self._quiet_wait = 0
        # Whether the last read of the register waited for the device (see step_decoded).
        self._device_bound = False
        # Each row's hold on its adapter (None: a base row), aligned with _rows, and the selection
        # every step's forward sets from them (engine/adapters/): recomputed at each join and leave.
        self._adapters: list[AdapterUse | None] = []
        self._selected: Selected = BASE_ROWS

    @property
    def request_ids(self) -> list[str]:
        return [row.request_id for row in self._rows]

    @property
    def size(self) -> int:
        return len(self._rows)

    @property
    def row_slots(self) -> list[int]:
        """Each row's index on the batch axis of the caches and of the model's forward (row slots: see above)."""
        return list(self._slots) if self._slots is not None else list(range(len(self._rows)))

    @property
    def nbytes(self) -> int:
        """The rows' KV bytes, a draft model's included."""
        drafts = self._speculator.nbytes if self._speculator is not None else 0
        if self._paged is not None:
            return self._paged.bytes_held(self._paged_rows) + drafts
        return sum(c.nbytes for c in self._caches) + drafts

    @property
    def is_flushed(self) -> bool:
        return not self._unread

    @property
    def speculates(self) -> bool:
        """Whether some row may decode speculatively (then `steps_decoded` runs speculative steps).

        Not while a quantized-KV batch is still bf16 (below `--quantized-kv-start`): a verify forward
        that crossed the start would attend its later positions over bf16 KV where the plain run has
        converted after the step that reached it (`_convert_when_due`). Plain steps until then keep the
        conversion on the plain run's step; from there every step is quantized in both.
        """
        if self._speculator is None or not self._speculator.active:
            return False
        return not self._kv_scheme.quantized or self.is_quantized

    @property
    def is_paged(self) -> bool:
        """Whether the rows' KV lives in a block pool (`paged=`): every row can join, whatever its caches."""
        return self._paged is not None

    @property
    def is_solo(self) -> bool:
        """One row on serial-class caches: each step is exactly the serial graph."""
        return self._solo

    def num_fed(self, request_id: str) -> int:
        """Tokens in the row's KV cache (prompt + fed); what `cache_entry` hands over holds exactly these."""
        return self._num_fed(self._rows[self._index(request_id)])

    def join_many(self, joiners: Sequence[tuple[SoloRow, int]]) -> None:
        """Add each row (in order) as the last rows; its token 0 is its next input. Takes their caches and samplers.

        One row into an empty batch is adopted (zero copy: it keeps the serial
        graph); with row slots the joiners are written into free slots (the
        running rows' KV is not copied unless a re-layout is due); otherwise
        every layer takes all the joiners in one merge or extend, so the
        running rows' KV is copied once per settle, not once per joiner. Rows
        that a cohort handed back from one cache (`SoloRow.block`) are copied
        out of it once a layer, into slots or after the running rows
        (engine/kv/row_blocks.py); rows of several cohorts join run by run.
        Requires `is_flushed`. Raises TypeError if a layer cannot batch (the
        batch is unchanged then); the caller keeps such models serial.
        """
        if self._unread:
            raise RuntimeError("join_many() needs a flushed batch")
        runs = _block_runs(joiners)
        if len(runs) > 1:  # rows of several cohorts' forwards: each run joins from its own block
            for run in runs:
                self.join_many(run)
            return
        rows = [row for row, _ in joiners]
        ids = [row.request_id for row in rows]
        if any(not row.holds_kv or row.token0 is None for row in rows):
            raise RuntimeError("join_many() takes a row after first_token() and before close()")
        if len(set(ids)) != len(ids) or set(ids) & set(self.request_ids):
            raise ValueError(f"requests already in the batch or given twice: {ids}")
        if not rows:
            return
        # Where each joiner's entry is cut if the batch is quantized once it joined (a bf16 joiner then converted
        # at its prompt's end). Quantized rows never prefill as a cohort, so `caches` cuts nothing out of a block.
        scheme = self._kv_scheme
        cuts = [scheme.entry_cut(row.num_prompt_tokens, row.prefill_step_size) if is_quantized(row.caches)
                else row.num_prompt_tokens for row in rows] if scheme.quantized else [None] * len(rows)
        self._convert_for_join(rows)
        block = self._block_of(rows)
        copied = True  # whether the running rows' KV was copied (then the replaced buffers are freed below)
        running_bytes = self.nbytes if self._rows else 0
        if self._paged is not None:
            with span(f"join.paged x{len(rows)}"):
                self._join_paged(joiners)
            copied = False
        elif self._rows and not self._solo and self._slots_usable(rows):
            with span(f"join.slots x{len(rows)} block={block is not None}"):
                copied = self._join_slots(rows, block)
        elif not self._rows and len(rows) == 1:
            self._caches = rows[0].caches  # adopt: the lone row keeps its serial graph
            self._solo = True
            self._num_slots = 1
        elif block is not None:
            with span(f"join.block x{len(rows)}"):
                self._join_block(*block)
        else:
            if not all(batch_caches.can_batch(row.caches) for row in rows):
                raise TypeError("this model's caches cannot batch")
            with span("join.compact"):
                self._compact()
            if self._rows:
                running, news, solo = self._caches, rows, self._solo
            else:  # several rows into an empty batch: the first plays the running (solo) row
                running, news, solo = rows[0].caches, rows[1:], True
            self._caches = [
                batch_caches.join_layer(layer, [row.caches[i] for row in news], running_is_solo=solo)
                for i, layer in enumerate(running)
            ]
            self._num_slots = len(self._rows) + len(news) + (0 if self._rows else 1)
            batch_kv.share_offsets(self._caches)
            self._solo = False
        tokens = mx.array([token0 for _, token0 in joiners], dtype=mx.uint32)
        self._inputs = tokens if self._inputs is None else mx.concatenate([self._inputs, tokens])
        self._sampler.join([row.sampler for row in rows], [row.num_prompt_tokens for row in rows])
        if self._speculator is not None:
            self._speculator.join([
                (row.request_id, (*row.prompt_ids, token0), row.params.speculative)
                for row, token0 in joiners])
        quantized = self.is_quantized
        for row, cut in zip(rows, cuts, strict=True):
            self._rows.append(BatchRow(row.request_id, row.num_prompt_tokens - self._fed_steps,
                                       cut if quantized else None))
            self._adapters.append(row.adapter)
            row.caches = []  # owned by the batch now (adopted or copied by merge)
            row.block = None
            row.adapter = None  # the batch releases it when the row leaves
        self._selected = rows_selected(self._adapters)
        self._settle_conversion()
        # A join that copies a large batch KV (pad + concat): give the replaced buffers back to the
        # device now, or the allocator's cache holds one stale copy per join. A join into free slots
        # replaced none, and a small batch's copy is reused by the next steps and joins: the allocator
        # keeps its cache for them.
        with span(f"join.eval copied={copied}"):
            mx.eval(self._caches_state())
        if copied and running_bytes >= JOIN_CLEAR_MIN_BYTES:
            with span("join.clear_cache"):
                mx.clear_cache()

    def _join_paged(self, joiners: Sequence[tuple[SoloRow, int]]) -> None:
        """Take each joiner's block table: as it is when it prefilled into this pool, else its own KV copied into
        fresh blocks (all or none: PoolExhausted leaves the batch and the joiners unchanged)."""
        paged = self._paged
        assert paged is not None
        copies: dict[int, PagedRow] = {}
        try:
            for i, (row, _) in enumerate(joiners):
                if row.paged_row is None or row.paged_kv is not paged:
                    copies[i] = paged.adopt(row.caches, row.prompt_ids[: row.num_prompt_tokens],
                                            adapter_revision(row.adapter))
        except PoolExhausted:
            for paged_row in copies.values():
                paged.leave(paged_row)
            raise
        for i, (row, token0) in enumerate(joiners):
            paged_row = copies.get(i)
            if paged_row is None:  # prefilled into our blocks: taken as it is
                paged_row, row.paged_row = row.paged_row, None
            elif row.paged_row is not None and row.paged_kv is not None:  # another pool's: released there
                row.paged_kv.leave(row.paged_row)
                row.paged_row = None
            assert paged_row is not None
            if len(paged_row.tokens) <= paged_row.length:
                paged.note_tokens(paged_row, [token0])  # the next input: its block is keyed once full
            self._paged_rows.append(paged_row)
        self._num_slots = len(self._paged_rows)

    def _slots_usable(self, joiners: Sequence[SoloRow] = ()) -> bool:
        """Whether the batch (and these joiners) can take row slots; else mlx-lm's filter / extend."""
        return (self._speculator is None and not self._kv_scheme.quantized
                and all(use is None for use in self._adapters) and all(row.adapter is None for row in joiners)
                and row_slots.supports_slots(self._caches)
                # A cohort's row is a filled bf16 batch row of its block: its own slices need not be cut to tell.
                and row_slots.can_fill([row.caches for row in joiners if row.block is None]))

    def _block_of(self, rows: Sequence[SoloRow]) -> tuple[Sequence[Any], list[int]] | None:
        """The cohort cache all of these joiners sit in and their rows in it (engine/kv/row_blocks.py), when they
        can join from it: two or more, every layer of the batch a plain bf16 batch layer (or the solo row's
        `KVCache`), no KV conversion due; else None (they join by their own caches)."""
        if len(rows) < 2 or self._kv_scheme.quantized:
            return None
        found = row_blocks.shared_block([row.block for row in rows])
        if found is None or (self._rows and len(found[0]) != len(self._caches)):
            return None
        plain = (KVCache,) if self._solo else (HostPaddedBatchKVCache,)
        if self._rows and not all(type(layer) in plain for layer in self._caches):
            return None
        return found

    def _join_block(self, layers: Sequence[Any], index: list[int]) -> None:
        """The joiners, rows `index` of one cohort's `layers`, copied out once a layer: into an empty batch as the
        batch, else after the running rows (mlx-lm's extend; a solo row is made a batch of one first)."""
        self._compact()
        news = [row_blocks.take_rows(layer, index) for layer in layers]
        if self._rows:
            running = [batch_caches.merge_rows([layer]) for layer in self._caches] if self._solo else self._caches
            for layer, new in zip(running, news, strict=True):
                layer.extend(new)
            news = running
        self._caches = news
        self._num_slots = len(self._rows) + len(index)
        batch_kv.share_offsets(self._caches)
        self._solo = False

    def _join_slots(self, rows: Sequence[SoloRow], block: tuple[Sequence[Any], list[int]] | None = None) -> bool:
        """Write the joiners into free slots (more slots when too few are free); whether every row was copied.

        `block`: the joiners are these rows of one cohort's cache (`_block_of`): one scatter a layer."""
        slots = self._slots if self._slots is not None else list(range(len(self._rows)))
        taken = set(slots)
        free = [s for s in range(self._num_slots) if s not in taken]
        num_slots = self._num_slots
        if len(free) < len(rows):
            need = num_slots + len(rows) - len(free)
            num_slots = max(need, min(num_slots + max(1, num_slots // SLOT_GROWTH), self._max_rows or need))
            free += list(range(self._num_slots, num_slots))
        if block is not None:
            copied = row_blocks.write_block(self._caches, free[:len(rows)], block[0], block[1], num_slots)
        else:
            copied = row_slots.write_rows(self._caches, free[:len(rows)], [row.caches for row in rows], num_slots)
        self._num_slots = num_slots
        self._set_slots([*slots, *free[:len(rows)]])
        return copied

    def _leave_slots(self, keep: list[int]) -> bool:
        """The rows `keep` stay in their slots, compacted (mlx-lm's filter) once `MAX_FREE_SLOTS` are free;
        whether every row was copied (compacted, or its shared front cut)."""
        slots = self._slots if self._slots is not None else list(range(len(self._rows)))
        kept = [slots[i] for i in keep]
        if self._num_slots - len(kept) > MAX_FREE_SLOTS * self._num_slots:
            for cache in self._caches:
                batch_caches.filter_layer(cache, kept)
            batch_kv.share_offsets(self._caches)
            self._num_slots = len(kept)
            self._set_slots(None)
            return True
        trimmed = row_slots.trim_front(self._caches, kept)
        self._set_slots(kept)
        return trimmed

    def _compact(self) -> None:
        """Back to one row per slot, in row order (mlx-lm's filter), before a path that knows no slots."""
        if self._slots is not None:
            for cache in self._caches:
                batch_caches.filter_layer(cache, self._slots)
            batch_kv.share_offsets(self._caches)
            self._num_slots = len(self._slots)
            self._set_slots(None)

    def _set_slots(self, slots: list[int] | None) -> None:
        if slots is not None and slots == list(range(self._num_slots)):
            slots = None
        self._slots = slots
        if slots is None:
            self._slot_take = None
            return
        row_of = [len(slots)] * self._num_slots  # a free slot reads the dummy input after the rows'
        for row, slot in enumerate(slots):
            row_of[slot] = row
        self._slot_take = mx.array(row_of), mx.array(slots)

    def _slot(self, index: int) -> int:
        return self._slots[index] if self._slots is not None else index

    def steps_decoded(self, count: int, report: Report | None = None) -> list[Decoded | None]:
        """`step_decoded()` `count` times in a row (one lease job; see actors/decode_step.steps_per_job).

        With `report`, every token these steps read goes to `report` in one
        call, made just before the last step is launched (see `step_decoded`),
        and the list returned holds only None.

        While `speculates`, these are `count` speculative steps instead
        (`step_speculative`): their tokens are returned (or reported, once,
        after the last step) as one flat list.
        """
        if self.speculates:
            decoded: list[Decoded] = []
            for _ in range(count):
                if self._quiet_steps:
                    self._quiet_steps -= 1
                    plain = self.step_decoded()
                    decoded += [plain] if plain is not None else []
                else:
                    decoded += self.step_speculative()
            if report is None:
                return list(decoded)
            if decoded:
                report(decoded)
            return [None] * count
        if report is None:
            return [self.step_decoded() for _ in range(count)]
        held = [d for d in (self.step_decoded() for _ in range(count - 1)) if d is not None]

        def last(decoded: Decoded) -> None:
            report([*held, decoded])
            held.clear()

        self.step_decoded(last)
        if held:  # the last step had nothing to read (the first after a join or flush)
            report(held)
        return [None] * count

    def step_decoded(self, report: Callable[[Decoded], None] | None = None) -> Decoded | None:
        """Queue one decode step for every row; return the previous step's tokens (batch order).

        Mutates the caches (one token per row). Returns None when the
        previous tokens were already returned (by `flush`, or as token 0).

        With `report`, the previous tokens go to `report` instead. While the
        host is the bottleneck they are read after this step's graph is built
        and reported before it is launched: the caller (another thread)
        handles them while `async_eval` launches the step with the GIL
        released, rather than while the next graph is built with it held,
        and the read costs nothing (the device finished them during the
        build). While the device is the bottleneck, that read would wait for
        it and leave it idle until the next launch, so they are read after
        the launch, as without `report` (H200, Llama-8B, B=1: 0.85 vs 1.03 of
        the bare loop; docs/lab-notes/2026-11-29-h200-pass05.md). Which one it is, the
        last read tells: it waited for the device longer than
        `DEVICE_BOUND_WAIT_S`, or it did not.
        """
        if not self._rows:
            raise RuntimeError("step_decoded() on an empty batch")
        previous: Decoded | None = None
        if self._unread and self._sampler.is_constrained:
            # A grammar's mask for this step needs the previous token consumed: read it first.
            previous = self._read()
        inputs = self._inputs
        if self._selected is BASE_ROWS:
            logits = self._forward(inputs)
        else:
            with self._selected.applied():
                logits = self._forward(inputs)
        sampled, state, logprobs = self._sampler.sample(logits, inputs)
        self._fed_steps += 1
        self._convert_when_due()
        if report is not None and not self._device_bound:
            previous = self._hand_on(previous, report)
        # Start the next step on the device before reading the current one (pipelining).
        mx.async_eval(sampled, state, *(logprobs.arrays() if logprobs is not None else ()))
        previous = self._hand_on(previous, report)
        self._inputs = sampled
        self._unread_logprobs = logprobs
        self._unread = True
        self._num_steps += 1
        if self._num_steps % _CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return previous

    def _forward(self, inputs: mx.array) -> mx.array:
        """One step's logits `[B, V]` (rows in row order), over every slot while some row is not in its own."""
        if self._slot_take is None:
            return self._forward_slots(inputs)
        row_of, slots = self._slot_take
        padded = mx.concatenate([inputs, mx.zeros((1,), inputs.dtype)])
        return self._forward_slots(padded[row_of])[slots]

    def _forward_slots(self, inputs: mx.array) -> mx.array:
        """One step's logits `[slots, V]`: compiled where it covers the caches, else the lean or the model's own graph.

        While a row holds an adapter, the model's own graph: a compiled trace keeps the adapter selection it
        was traced under as a constant (replayed for another mix of rows at the same shapes, it gave a row
        another row's adapter, or none), and the lean forward holds the layers it was built over (a layer
        wrapped since is not called). Traces of base rows only stay right: unselected, a wrapper is its layer.
        """
        if self._paged is not None:
            return self._forward_paged(inputs)
        decode_layout.keep_vector_decode(self._caches)  # prefill-only cuDNN: decode on the vector kernel
        if self._selected is not BASE_ROWS:
            return self._model(inputs[:, None], cache=self._caches)[:, -1, :]
        if (self._compiled is not None and (self._compile_batches or self._solo)
                and compiled_step.covers(self._caches)):
            logits = self._compiled(inputs, self._caches)
            if logits is not None:
                return logits
        if self._lean is not None:
            return self._lean(inputs, self._caches)
        return self._model(inputs[:, None], cache=self._caches)[:, -1, :]

    def _forward_paged(self, inputs: mx.array) -> mx.array:
        """One step over the rows' block tables: each row's new K/V into its last block (allocated as needed)."""
        assert self._paged is not None
        step = self._paged.step(self._paged_rows, 1)
        caches = self._paged.caches(step)  # the lean forward calls the same cache protocol and attention
        # While a row holds an adapter, the model's own graph (`_forward_slots` says why).
        lean = self._lean if self._selected is BASE_ROWS else None
        logits = lean(inputs, caches) if lean is not None else self._model(inputs[:, None], cache=caches)[:, -1, :]
        self._paged.commit(step)
        return logits

    def _convert_when_due(self) -> None:
        """A bf16 batch converts every row once one holds `start` tokens (after the forward, as mlx-lm does)."""
        if self._convert_at is None or self._fed_steps < self._convert_at:
            return
        self._kv_scheme.convert_all(self._caches)
        self._cut_where_converted()
        batch_kv.share_offsets(self._caches)
        self._settle_conversion()

    def _cut_where_converted(self) -> None:
        """The batch's rows converted now (early, each at its own count): their entries keep only that much."""
        for row in self._rows:
            row.kv_cut = self._num_fed(row)

    def _num_fed(self, row: BatchRow) -> int:
        return row.fed_offset + self._fed_steps

    def _settle_conversion(self) -> None:
        """After the rows changed: the plain step after which a bf16 batch of a quantized scheme converts
        (its longest row then holds `start` tokens), so that a step checks one number, not every row."""
        self._convert_at = None
        scheme = self._kv_scheme
        if scheme.quantized and self._rows and not self.is_quantized:
            self._convert_at = scheme.start - max(row.fed_offset for row in self._rows)

    def _convert_for_join(self, rows: Sequence[SoloRow]) -> None:
        """One format per layer: if the running rows or any joiner are quantized, all convert before merging.

        (A row that is due is quantized already: its prefill or `_convert_when_due` converted it.)
        """
        scheme = self._kv_scheme
        if not scheme.quantized or len(rows) + len(self._rows) < 2:
            return
        solo_caches = [row.caches for row in rows]
        if self.is_quantized or any(is_quantized(c) for c in solo_caches):
            if not self.is_quantized:
                self._cut_where_converted()
            for caches in [self._caches, *solo_caches]:
                scheme.convert_all(caches)  # in place: a row's list is its prefill's too

    @property
    def is_quantized(self) -> bool:
        """Whether the rows' full-attention KV is stored quantized."""
        return is_quantized(self._caches)

    def step_speculative(self) -> list[Decoded]:
        """One speculative step: the register's tokens if unread, then each row's verified tokens.

        Rows without a proposal (or with speculation off) emit one token, as a
        plain step would. When no row has a proposal, this is a plain step
        whose tokens are read by the next call (or `flush_decoded`).
        """
        if not self._rows:
            raise RuntimeError("step_speculative() on an empty batch")
        assert self._speculator is not None
        out = [self._read()] if self._unread else []
        # A token the grammar forbids is rejected before it is verified: the proposal ends before it.
        proposals = self._sampler.allowed_proposals(self._speculator.proposals())
        if not any(proposals):
            self._quiet_wait = self._quiet_steps = min(max(1, 2 * self._quiet_wait), MAX_QUIET_STEPS)
            self.step_decoded()
            return out
        self._quiet_wait = 0
        assert self._inputs is not None
        inputs = mx.array(verify.padded_inputs(self._inputs.tolist(), proposals), dtype=mx.uint32)
        paged_step = self._paged.step(self._paged_rows, inputs.shape[1]) if self._paged is not None else None
        with self._selected.applied():  # the target verifies with each row's adapter (the draft proposes without)
            logits = self._model(inputs, cache=self._caches if paged_step is None else self._paged.caches(paged_step))
        # Each position is sampled as the plain step at that point would be (its input joins the
        # penalty history, its draw splits the row's key); a row keeps the draws it emits (`rewind`).
        width = inputs.shape[1]
        masks = self._sampler.masks_along(proposals, logits.shape[-1])
        drawn, state, logprobs, checkpoints = [], [], [], []
        for j in range(width):
            tokens, arrays, lp = self._sampler.sample(logits[:, j, :], inputs[:, j],
                                                      mask=masks[j] if masks is not None else None)
            drawn.append(tokens)
            state += arrays
            logprobs.append(lp)
            checkpoints.append(self._sampler.checkpoint())
        verified_tokens = mx.stack(drawn, axis=1)
        mx.eval(verified_tokens, state, *(a for lp in logprobs if lp is not None for a in lp.arrays()))
        verified = verified_tokens.tolist()
        accepted = [verify.accepted(p, v) for p, v in zip(proposals, verified)]
        self._sampler.rewind(checkpoints, accepted)
        emitted = [v[:a + 1] for v, a in zip(verified, accepted)]
        self._sampler.accept_runs(emitted)
        if self._paged is not None:
            assert paged_step is not None
            self._paged.commit(paged_step)
            for paged_row, a, tokens in zip(self._paged_rows, accepted, emitted):
                self._paged.truncate(paged_row, width - 1 - a)
                self._paged.note_tokens(paged_row, tokens)  # the accepted proposals, then the next input
        else:
            row_rollback.roll_back_rows(self._caches, [width - 1 - a for a in accepted])
        self._fed_steps += 1
        for row, a in zip(self._rows, accepted):
            row.fed_offset += a
        self._settle_conversion()
        self._speculator.extend(emitted)
        self._inputs = mx.array([tokens[-1] for tokens in emitted], dtype=mx.uint32)
        self._unread = False
        self._unread_logprobs = None
        self._num_steps += 1
        if self._num_steps % _CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        longest = max(len(tokens) for tokens in emitted)
        steps = []
        for j in range(longest):
            records = logprobs[j].records() if logprobs[j] is not None else (None,) * len(emitted)
            steps.append(Decoded(tuple(t[j] if j < len(t) else None for t in emitted),
                                 tuple(r if j < len(t) else None for r, t in zip(records, emitted)),
                                 forwards=int(j == 0)))
        steps[0] = attrs.evolve(steps[0], proposed=tuple(len(p) for p in proposals), accepted=tuple(accepted))
        return [*out, *steps]

    def flush_decoded(self) -> Decoded | None:
        """Return the queued step's tokens (batch order) without queueing another; None if none are unread."""
        if not self._unread:
            return None
        return self._read()

    def _hand_on(self, previous: Decoded | None, report: Callable[[Decoded], None] | None) -> Decoded | None:
        """The previous tokens, read now if still unread: given to `report` (then None) or returned."""
        if self._unread:
            previous = self._read()
        if report is not None and previous is not None:
            report(previous)
            return None
        return previous

    def _read(self) -> Decoded:
        """Read the register (waiting for its step), advance the rows' grammars, mark it returned."""
        assert self._inputs is not None
        start = time.perf_counter()
        tokens = self._inputs.tolist()
        self._device_bound = time.perf_counter() - start > DEVICE_BOUND_WAIT_S
        self._sampler.accept(tokens)
        if self._paged is not None:  # the next inputs: their ids key the rows' blocks once full
            for paged_row, token in zip(self._paged_rows, tokens):
                self._paged.note_tokens(paged_row, (token,))
        if self._speculator is not None:
            self._speculator.extend([(t,) for t in tokens])
        logprobs = self._unread_logprobs
        records = logprobs.records() if logprobs is not None else (None,) * len(tokens)
        self._unread = False
        self._unread_logprobs = None
        return Decoded(tuple(tokens), records)

    def leave(self, request_ids: Collection[str]) -> None:
        """Drop these rows (unknown ids raise KeyError, leaving the batch unchanged).

        Unflushed, the leavers' queued tokens are discarded and the others'
        stay unread (mlx-lm's `filter` after `next()`). When exactly one row
        remains it is extracted to fresh serial-class caches: one copy of its
        KV, after which each step is the serial graph again (no per-row mask
        or RoPE offset arrays). Measured on an H200 (bf16, random weights,
        mlx_trio/testing/batch_reference.py --bench-b1): a lone row decodes at 1.95 vs
        3.16 ms/step (Llama-1B shape, 1k context), 2.30 vs 4.05 (8k), 5.54 vs
        6.59 (8B shape) on solo vs B=1 batch caches; the leave step costs the
        same either way. A drained batch often runs alone for long, so we pay
        the copy.
        """
        leaving = set(request_ids)
        unknown = leaving - set(self.request_ids)
        if unknown:
            raise KeyError(f"not in the batch: {sorted(unknown)}")
        keep = [i for i, row in enumerate(self._rows) if row.request_id not in leaving]
        if not keep:
            self.close()
            return
        if len(keep) == len(self._rows):
            return
        copied = not self._solo and self._paged is None
        if self._paged is not None:  # the leavers' blocks go back; no other row's KV moves
            kept_rows = set(keep)
            for i, paged_row in enumerate(self._paged_rows):
                if i not in kept_rows:
                    self._paged.leave(paged_row)
            self._paged_rows = [self._paged_rows[i] for i in keep]
            self._num_slots = len(keep)
        elif not self._solo:
            if len(keep) == 1 and batch_caches.can_extract(self._caches):
                self._caches = [batch_caches.extract_layer(c, self._slot(keep[0])) for c in self._caches]
                self._solo = True
                self._num_slots = 1
                self._set_slots(None)
            elif self._slots_usable():
                copied = self._leave_slots(keep)
            else:
                for cache in self._caches:
                    batch_caches.filter_layer(cache, [self._slot(i) for i in keep])
                batch_kv.share_offsets(self._caches)
                self._num_slots = len(keep)
                self._set_slots(None)
        self._rows = [self._rows[i] for i in keep]
        kept = set(keep)
        release_all([use for i, use in enumerate(self._adapters) if i not in kept])
        self._adapters = [self._adapters[i] for i in keep]
        self._selected = rows_selected(self._adapters)
        self._sampler.keep(keep)
        self._settle_conversion()
        if self._speculator is not None:
            self._speculator.keep(keep)
        self._inputs = self._inputs[mx.array(keep)]
        if self._unread_logprobs is not None:
            self._unread_logprobs = self._unread_logprobs.keep(keep)
        mx.eval(self._caches_state())
        if copied:
            mx.clear_cache()  # as in join: the filtered-out copies go back to the device

    def _caches_state(self) -> list[Any]:
        if self._paged is not None:
            return [*self._paged.storage.keys, *self._paged.storage.values]
        return [c.state for c in self._caches]

    def cache_entry(self, request_id: str, tokens: tuple[int, ...]) -> CacheEntry | None:
        """The row's KV as a prompt-cache entry keyed by the first `num_fed` of `tokens` (its prompt + generated).

        Call right before the row leaves (after a flush). A lone row on its
        own (adopted or extracted) caches hands them over without a copy: it
        leaves next, and nothing writes them again. A batched row is
        extracted (a pure slice + copy of its unpadded KV) before the filter.
        A row fed tokens its caller never saw (a step queued before the row
        finished) is trimmed back to `tokens`, and a quantized row to its `kv_cut`; None when that cannot be done.
        """
        index = self._index(request_id)
        num_fed = self._num_fed(self._rows[index])
        if self._paged is not None:
            caches = self._paged.extract(self._paged_rows[index], num_fed)
        elif self._solo:
            caches = list(self._caches)
        else:
            caches = [batch_caches.extract_layer(c, self._slot(index)) for c in self._caches]
        row = self._rows[index]
        kept = min(num_fed, len(tokens), row.kv_cut if row.kv_cut is not None else num_fed)
        excess = num_fed - kept
        if excess > 0:
            if not cache_clone.trimmable(caches):
                return None
            for cache in caches:
                cache.trim(excess)
        return cache_clone.entry(tokens[:kept], caches)

    def close(self) -> None:
        """Drop every row and array (in the lease thread, which owns them)."""
        self._rows = []
        if self._paged is not None:
            for paged_row in self._paged_rows:
                self._paged.leave(paged_row)
            self._paged_rows = []
        release_all(self._adapters)
        self._adapters = []
        self._selected = BASE_ROWS
        self._caches = []
        self._solo = False
        self._num_slots = 0
        self._set_slots(None)
        self._inputs = None
        self._unread = False
        self._unread_logprobs = None
        self._convert_at = None
        self._sampler.close()
        if self._speculator is not None:
            self._speculator.close()

    def _index(self, request_id: str) -> int:
        for i, row in enumerate(self._rows):
            if row.request_id == request_id:
                return i
        raise KeyError(request_id)


def _block_runs(joiners: Sequence[tuple[SoloRow, int]]) -> list[list[tuple[SoloRow, int]]]:
    """The joiners cut into runs of consecutive rows from one cohort's cache (`SoloRow.block`; rows from none
    run together): each run joins in one `join_many` (engine/kv/row_blocks.py)."""
    def block_of(joiner: tuple[SoloRow, int]) -> int | None:
        block = joiner[0].block
        return id(block.layers) if block is not None else None

    return [list(run) for _, run in itertools.groupby(joiners, key=block_of)]
