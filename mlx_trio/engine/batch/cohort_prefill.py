"""Prefill several solo rows as one batch: one right-padded forward (docs/design.md §2.4).

Requests that arrive together (an agent's sub-agents fanning out) would
otherwise prefill one after another: B forwards of a short prompt, each as
slow as the host's graph launch, then B L=1 steps for token 0. Here the
cohort is prompted as mlx-lm's `BatchGenerator` prompts a batch: every row's
uncached tokens right-padded to the longest and fed together (the causal
mask keeps each real token from the padding after it), the padding rolled to
the left afterwards, then one batched L=1 step feeds every row its last
prompt token, and each row samples token 0 from its own logits with its own
sampler. Rows that start at different offsets (prompt-cache hits of
different lengths) are left-padded in the KV by mlx-lm's `BatchKVCache.merge`
and masked, exactly as a decode batch is.

The rows end on their own caches, as `SoloRow` leaves them, so joining the
decode batch is unchanged. A cohort row's tokens may differ from a solo
prefill's in the last bits (a `[B, n]` forward with an array mask instead of
a `[1, n]` one with a causal mask), as any batched step does; a request alone
never takes this path. Only models whose every layer is a plain `KVCache`
prefill together, and only with bf16 KV (a quantized scheme converts each row
after its own forwards, engine/kv/kv_scheme.py); others prefill each row alone.
Under prefill-only cuDNN prompts of up to `COHORT_CUDNN_MAX_CONTEXT` tokens
do, on a `CohortKVCache` whose attention the routed layers run on MLX's plain
ops (`can_prefill_together`), in bounded groups (`forward_groups`) at bucketed
shapes (`cohort_shape`); the others there prefill in sequence.

Runs on the lease thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlx_trio.engine.adapters.forward import rows_selected
from mlx_trio.engine.attention import routed_attention
from mlx_trio.engine.kv import decode_layout
from mlx_trio.engine.kv.batch_caches import merge_rows
from mlx_trio.engine.kv.batch_kv import CohortKVCache
from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.engine.kv.row_blocks import RowBlock, batch_index
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.spans import span

# Under prefill-only cuDNN, the longest prompt whose cohort shares its forwards (`can_prefill_together`), the
# most rows and padded tokens (rows x the longest) one forward takes, the prompt columns one forward feeds
# (`prefill_together`), and the most query-key pairs a head of one forward scores (rows x columns x keys,
# cached prefixes included: `forward_groups`). The plain attention holds them all at once: 2^22 pairs are 256
# MiB of bf16 scores at 32 heads (4 rows of 2048 tokens, or 64 short prompts of 64, fit). 64 rows: a closed
# loop's wave at the default --batch in one forward (H200, 1B shape: 32-row groups took a wave two forwards,
# two token-0 steps and a group of 2-7 stragglers at a shape of its own;
# docs/lab-notes/2026-12-04-h200-pass18.md).
COHORT_CUDNN_MAX_ROWS = 64
COHORT_CUDNN_MAX_CONTEXT = 2048
COHORT_CUDNN_MAX_TOKENS = 8192
COHORT_CUDNN_COLUMNS = 512
COHORT_CUDNN_MAX_SCORES = 1 << 22
# There, a shared forward's prompt tokens are padded to a multiple of this (`cohort_shape`), and its rows to
# a power of two only up to this longest prompt (past it an empty row costs a long prompt's compute).
COHORT_TOKEN_QUANTUM = 32
COHORT_ROW_BUCKET_MAX_TOKENS = 256
# A shared forward of fewer padded tokens leaves MLX's buffer cache as it is (mlx-lm clears it after each
# prefill chunk, whose activations are large): a wave of short prompts is small, and its buffers serve the
# next steps and cohorts, which a cleared cache would allocate from the device again (~3 ms a cohort job to
# clear on an H200).
COHORT_CLEAR_MIN_TOKENS = 8192


def prefill_rows(model: nn.Module, makers: Sequence[Callable[[], SoloRow]]) -> list[SoloRow | Exception]:
    """Make the rows, prefill them and sample each token 0: one lease job for a cohort of short prompts.

    Rows that can go together prefill as one batch (`prefill_together`); the
    rest each alone, exactly as `prefill_chunk()` until done then
    `first_token()` (under prefill-only cuDNN launched one after another:
    `prefill_in_sequence`). An error is returned in place of the rows it touched
    (their caches dropped); the other rows go on.
    """
    outcomes: list[SoloRow | Exception] = []
    with span(f"cohort.make x{len(makers)}"):
        for make in makers:
            try:
                outcomes.append(make())
            except Exception as exc:
                outcomes.append(exc)
    made = [row for row in outcomes if isinstance(row, SoloRow)]
    together = made if can_prefill_together(made, model) else []
    for group in forward_groups(together):
        try:
            prefill_together(model, group)
        except Exception as exc:
            outcomes = [_failed(row, exc) if row in group else row for row in outcomes]
    alone = [row for row in made if row not in together]
    if len(alone) > 1 and can_prefill_in_sequence(alone):
        try:
            prefill_in_sequence(alone)
        except Exception as exc:
            outcomes = [_failed(row, exc) if row in alone else row for row in outcomes]
        return outcomes
    for i, row in enumerate(outcomes):
        if isinstance(row, SoloRow) and row not in together:
            try:
                while row.prefill_remaining:
                    row.prefill_chunk()
                row.first_token()
            except Exception as exc:
                outcomes[i] = _failed(row, exc)
    return outcomes


def prefill_rows_into(paged: PagedKV, model: nn.Module,
                      makers: Sequence[Callable[[], SoloRow]]) -> list[SoloRow | Exception]:
    """`prefill_rows` on the rows' own caches, then each row adopted into `paged`'s blocks (`SoloRow.adopt_into`)
    in the same lease job (--kv-layout paged: docs/design.md §6.5).

    A cohort's own caches are outside the block pool, which holds the whole KV budget: adopting them here, not
    at the decoder's join, keeps them a transient of this one job (never several cohorts' waiting for a join).
    A row that cannot be adopted is closed and its error returned in its place, as `prefill_rows` does.
    """
    outcomes = prefill_rows(model, makers)
    try:
        with span(f"cohort.adopt x{sum(isinstance(row, SoloRow) for row in outcomes)}"):
            for i, row in enumerate(outcomes):
                if isinstance(row, SoloRow):
                    try:
                        row.adopt_into(paged)
                    except Exception as exc:
                        outcomes[i] = _failed(row, exc)
            mx.eval(paged.storage.keys, paged.storage.values)
    except BaseException:
        for row in outcomes:  # nobody else holds these rows: their blocks go back here, or they leak
            if isinstance(row, SoloRow):
                row.close()
        raise
    return outcomes


def forward_groups(rows: Sequence[SoloRow]) -> list[list[SoloRow]]:
    """The rows in order, cut into the groups that share one forward each.

    Under prefill-only cuDNN a group holds at most `COHORT_CUDNN_MAX_ROWS` rows,
    `COHORT_CUDNN_MAX_TOKENS` padded tokens (its rows x its longest remaining
    prompt) and `COHORT_CUDNN_MAX_SCORES` query-key pairs a head (its rows x the
    columns a forward feeds x its longest context, cached prefix included): the
    plain attention's scores stay bounded. Elsewhere all rows are one group.
    """
    if not decode_layout.is_active():
        return [list(rows)] if rows else []
    groups: list[list[SoloRow]] = []
    longest = keys = 0  # the last group's longest remaining prompt and longest context
    for row in rows:
        own_n, own_k = max(row.prefill_remaining, 1), row.fed + row.prefill_remaining + 1
        n, k, size = max(longest, own_n), max(keys, own_k), len(groups[-1]) + 1 if groups else 0
        if (groups and size <= COHORT_CUDNN_MAX_ROWS and size * n <= COHORT_CUDNN_MAX_TOKENS
                and size * min(n, COHORT_CUDNN_COLUMNS) * k <= COHORT_CUDNN_MAX_SCORES):
            groups[-1].append(row)
        else:
            groups.append([row])
            n, k = own_n, own_k
        longest, keys = n, k
    return groups


def can_prefill_in_sequence(rows: Sequence[SoloRow]) -> bool:
    """Rows that prefill alone under prefill-only cuDNN, on plain bf16 caches, none storing a snapshot part-way."""
    return decode_layout.is_active() and _plain(rows)


def _plain(rows: Sequence[SoloRow]) -> bool:
    """Every row on plain full-attention bf16 caches (`KVCache` layers), none storing a snapshot part-way."""
    return all(row.snapshot_at is None and not row.kv_scheme.quantized and all(type(c) is KVCache for c in row.caches)
               for row in rows)


def prefill_in_sequence(rows: Sequence[SoloRow]) -> None:
    """Each row's chunks and token-0 step alone, one row after another, launched without waiting for each.

    The same forwards as `prefill_chunk()` until done then `first_token()`
    for each row (the same kernels: the same numbers), but each forward is
    launched (`mx.async_eval`) and the host builds the next one while the
    device runs it; every token 0 is read at the end. A cohort of short
    prompts under prefill-only cuDNN is host-bound forwards one after
    another (H200, 1B shape: ~9 ms a 512-token chunk, docs/lab-notes/),
    so the device's time of each but the last is hidden. An error leaves
    the rows unusable (the caller closes them all): they share the evaluation.
    """
    arrays: list[mx.array] = []
    for row in rows:
        while row.prefill_remaining:
            row.prefill_chunk(evaluate=False)
        arrays.extend(row.launch_token0())
    mx.eval(arrays, [c.state for row in rows for c in row.caches])
    for row in rows:
        row.read_token0()
    mx.clear_cache()


def _failed(row: SoloRow | Exception, exc: Exception) -> Exception:
    if isinstance(row, SoloRow):
        row.close()
    return exc


def can_prefill_together(rows: Sequence[SoloRow], model: nn.Module | None = None) -> bool:
    """Two or more rows, all on plain full-attention bf16 caches, none storing a snapshot part-way.

    Under prefill-only cuDNN (engine/kv/decode_layout.py active) a batched forward with an array mask
    would be a new cuDNN shape per cohort, a plan build each (60-90 ms on an H200). There the rows
    share their forwards only when `model`'s every attention layer is routed (engine/attention/
    routed_attention.py: it runs a `CohortKVCache`'s attention on MLX's plain ops, no cuDNN), there
    every prompt is at most `COHORT_CUDNN_MAX_CONTEXT` tokens (the plain attention holds rows x heads x
    queries x keys scores; `prefill_rows` bounds each forward's rows and tokens: `forward_groups`);
    otherwise each row prefills alone on the grid's planned chunks (`prefill_in_sequence`).
    """
    if len(rows) < 2 or not _plain(rows):
        return False
    if not decode_layout.is_active():
        return True
    return (model is not None and shares_forwards(model)
            and all(row.num_prompt_tokens <= COHORT_CUDNN_MAX_CONTEXT for row in rows))


def shares_forwards(model: nn.Module) -> bool:
    """Under prefill-only cuDNN: whether `model`'s cohort rows of at most `COHORT_CUDNN_MAX_CONTEXT` tokens
    share the cohort's forwards.

    What `can_prefill_together` asks there of the model, not of each row: its
    attention routed. The prefill actor sizes such a
    cohort by its padded tokens, not by the rows' prefills one after another
    (actors/prefill.py `_cohort`).
    """
    return routed_attention.covers(model)


def prefill_together(model: nn.Module, rows: Sequence[SoloRow]) -> None:
    """Prefill every row's prompt and sample its token 0, batched; `can_prefill_together(rows)` must hold.

    As mlx-lm's `BatchGenerator` prompts a batch: the rows' caches merged
    (left-padded to the longest cached prefix), their uncached tokens
    right-padded to the longest and fed in forwards of at most the step
    size (under prefill-only cuDNN `COHORT_CUDNN_COLUMNS`: the plain
    attention's scores grow with the columns fed; the causal mask keeps
    every real token from the padding after it), the right padding then rolled to the left (`finalize`), and one
    batched L=1 step of each row's last prompt token, from whose logits
    each row samples token 0 with its own sampler. So a cohort costs about
    one forward however its prompt lengths differ. Under prefill-only cuDNN
    the forwards run at bucketed shapes (`cohort_shape`): empty rows and
    more padding make every cohort one of a few shapes the device has run
    before. Afterwards each row is where `prefill_chunk()` until done then
    `first_token()` leaves it. An error leaves the rows unusable (the caller
    closes them all): they share every forward.
    """
    lengths = [row.prefill_remaining for row in rows]
    batch, longest = cohort_shape(len(rows), max(lengths)) if decode_layout.is_active() else (len(rows), max(lengths))
    spare = batch - len(rows)  # empty rows that only round the batch up to its bucket
    with span(f"cohort.merge {len(rows)}/{batch}x{longest}"):
        caches = _merge([*(row.caches for row in rows), *([KVCache() for _ in rows[0].caches] for _ in range(spare))])
    uses = [*(row.adapter for row in rows), *([None] * spare)]
    lengths += [0] * spare  # batch order: the rows, then the empty ones
    with rows_selected(uses).applied():  # each row with its own adapter
        if longest:
            taken = [row.take_prefill(n) if n else None for row, n in zip(rows, lengths)]
            inputs = mx.stack([_right_padded(tokens, longest) for tokens in [*taken, *([None] * spare)]])
            for layer in caches:
                layer.prepare(lengths=lengths, right_padding=[longest - n for n in lengths])
            step = COHORT_CUDNN_COLUMNS if decode_layout.is_active() else rows[0].prefill_step_size
            for start in range(0, longest, step):
                with span(f"cohort.forward {batch}x{min(step, longest - start)}"):
                    model(inputs[:, start : start + step], cache=caches)
                    mx.eval([c.state for c in caches])
            for layer in caches:
                layer.finalize()
        with span(f"cohort.token0 {batch}"):
            lasts = [row.last_input() for row in rows]
            decode_layout.keep_vector_decode(caches)  # token 0 is an L=1 step: the vector kernel (engine/kv/decode_layout.py)
            logits = model(mx.stack([*lasts, *(_right_padded(None, 1) for _ in range(spare))]), cache=caches)[:, -1, :]
    with span(f"cohort.sample+eval {len(rows)}"):
        # Plain greedy rows take one argmax over the batch (each row's own argmax: the same token), not a
        # sampler graph each (~1 ms of the lease thread a row on an H200; docs/lab-notes/2026-12-04-h200-pass18.md).
        greedy = [i for i, row in enumerate(rows) if row.sampler.is_plain_greedy]
        arrays = [a for i, row in enumerate(rows) if not row.sampler.is_plain_greedy
                  for a in row.draw_token0(logits[i : i + 1], lasts[i])]
        picked = _argmax_rows(logits, greedy)
        mx.eval(arrays, picked, [c.state for c in caches])
    with span(f"cohort.hand_back {len(rows)}"):
        _hand_back(rows, caches, range(len(rows)))
        tokens = dict(zip(greedy, picked.tolist())) if picked is not None else {}
        for i, row in enumerate(rows):
            if i in tokens:
                row.accept_token0(tokens[i])
            else:
                row.read_token0()
    if batch * longest >= COHORT_CLEAR_MIN_TOKENS:
        with span("cohort.clear_cache"):
            mx.clear_cache()


def _argmax_rows(logits: mx.array, rows: Sequence[int]) -> mx.array | None:
    """The argmax of each of `rows` of `logits` `[B, V]` (lazy), in that order; None for no rows."""
    return mx.argmax(logits[batch_index(rows)], axis=-1) if rows else None


def cohort_shape(rows: int, longest: int) -> tuple[int, int]:
    """A shared cohort's forward shape on the GPU: the tokens up to a multiple of `COHORT_TOKEN_QUANTUM`, and for
    prompts of at most `COHORT_ROW_BUCKET_MAX_TOKENS` the rows up to a power of two.

    Each padded shape the device meets the first time costs a cohort job
    about 12-15 ms more than a shape it ran before (H200, 1B shape: 27 ms
    against 12 ms for 2 rows of ~50 tokens, whether or not MLX records CUDA
    graphs; docs/lab-notes/2026-12-01-h200-pass14.md), while a row of a short
    prompt adds under 1 ms. So short prompts meet at most 6 x 8 shapes; a
    longer prompt's empty row would cost its compute, so those keep their rows.
    """
    tokens = -(-longest // COHORT_TOKEN_QUANTUM) * COHORT_TOKEN_QUANTUM
    batch = 1 << max(rows - 1, 0).bit_length() if tokens <= COHORT_ROW_BUCKET_MAX_TOKENS else rows
    return batch, tokens


def _right_padded(tokens: mx.array | None, length: int) -> mx.array:
    """`tokens` (1-D) followed by zeros up to `length` (the padding's ids are never attended to)."""
    if tokens is None:
        return mx.zeros((length,), mx.int32)
    pad = length - int(tokens.size)
    return mx.pad(tokens, (0, pad)) if pad else tokens


def _merge(caches: Sequence[Sequence[Any]]) -> list[Any]:
    """Per layer, the rows' caches (one list per row) as one batch cache, left-padded to the longest; theirs stay intact.

    Under prefill-only cuDNN a `CohortKVCache`, whose attention the routed layers keep off cuDNN.
    """
    merge = CohortKVCache.merge if decode_layout.is_active() else merge_rows
    return [merge([row[i] for row in caches]) for i in range(len(caches[0]))]


def _hand_back(rows: Sequence[SoloRow], caches: list[Any], indices: Sequence[int]) -> None:
    """Give each row its KV as batch row `indices[k]` of `caches` for `rows[k]` (`SoloRow.take_block`): rows that
    join the decode batch together copy out of the cohort's cache once a layer (engine/kv/row_blocks.py), and a
    row's own slices are cut only where something needs them."""
    for row, i in zip(rows, indices, strict=True):
        row.take_block(RowBlock(caches, i))
