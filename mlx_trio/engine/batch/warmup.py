"""Run the batch lane's operations once at load, so that no request pays for compiling them.

MLX's CUDA backend compiles a kernel the first time an operation meets a new
dtype or layout (the compiled code is cached on disk for later processes).
On a fresh H200 machine (1B shape, docs/lab-notes/) the first time a row
left a batch that held an 8.5k-token row, `leave` and the next step took
2.3 s each, and every running stream stalled for 4.6 s. A few random rows
taken through every batch-lane operation at load (a cohort prefill, adopt,
join with padding, reported steps, leave, extract) compile those kernels before any
request arrives. The CPU backend compiles nothing at first use, so the
engine warms up only on a GPU (`warm_up_gpu`). With quantized KV the rows
go through twice: bf16 (rows before the start) and quantized from the start.
A server that speculates (`--prompt-lookup`, `--draft-model`) takes the rows
through speculative steps too: verify forwards of K+1 queries, per-row
rollback, the draft's own prefill and steps. Without that, the first
speculative requests on a fresh H200 paid the compiles: a same-model draft
decoded at 58 tok/s over its first 256 tokens where the warm steps ran at
about 150 (benchmarks/speculative.py, docs/lab-notes/).

Runs on the lease thread.
"""

from __future__ import annotations

import random
from functools import partial

import attrs
import mlx.core as mx
import mlx.nn as nn

from mlx_trio.engine.kv import batch_caches
from mlx_trio.engine.batch.decode_batch import DecodeBatch, Decoded
from mlx_trio.engine.batch.cohort_prefill import prefill_rows
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.engine.speculative.speculator import SpeculationConfig
from mlx_trio.params import SamplingParams

# Prompt lengths: past one 256-token KV buffer step and one token (these two prefill as a cohort),
# then a short prompt alone.
_PROMPT_TOKENS = (300, 1, 40)
_STEPS = 3


def warm_up_gpu(model: nn.Module, vocab_size: int, kv_scheme: KvScheme = KvScheme(),
                compile_decode: bool | None = False, speculation: SpeculationConfig | None = None,
                paged: PagedKV | None = None) -> bool:
    """`warm_up` when MLX runs on a GPU; nothing on the CPU. Returns whether it ran.

    With `paged` (--kv-layout paged) the rows warm the paged path instead: prefill into blocks, steps over tables.
    """
    if mx.default_device().type != mx.DeviceType.gpu:
        return False
    warm_up(model, vocab_size, compile_decode=compile_decode, paged=paged)
    if kv_scheme.quantized:
        warm_up(model, vocab_size, attrs.evolve(kv_scheme, start=0), compile_decode=compile_decode)
    if speculation is not None:
        warm_up(model, vocab_size, kv_scheme, compile_decode=compile_decode, speculation=speculation, paged=paged)
    return True


def warm_up(model: nn.Module, vocab_size: int, kv_scheme: KvScheme = KvScheme(), *,
            compile_decode: bool | None = False, speculation: SpeculationConfig | None = None,
            paged: PagedKV | None = None) -> None:
    """Take a few random rows through prefill, join, steps and leave, then free everything.

    With `paged` each row prefills alone into the pool's blocks (the solo paged path; a paged cohort,
    `prefill_rows_into`, is not warmed here: the first wave pays its shapes) and the batch decodes over block
    tables; the blocks go back to the pool (their keys stay cached, evictable).

    With `compile_decode` the steps run compiled, so the fused kernels are built here (a new
    `(B, capacity)` later only retraces: engine/batch/compiled_step.py). With `speculation`
    the steps are speculative; prompt lookup is stood in for by a proposer that always
    proposes (a random prompt may give lookup nothing to propose, and the verify forward,
    not the lookup, is what compiles), a draft model proposes itself.
    """
    rng = random.Random(0)
    top = max(min(vocab_size, 1000), 4)
    params = [SamplingParams(max_tokens=_STEPS * 4), SamplingParams(max_tokens=_STEPS * 4),
              SamplingParams(max_tokens=_STEPS * 4, temperature=0.7, top_p=0.9, seed=0)]
    if speculation is not None and speculation.draft_model is None:
        speculation = attrs.evolve(speculation, proposers=partial(_Proposing, token=top - 1))
    makers = [partial(SoloRow, model, f"warm-up-{i}", [rng.randrange(3, top) for _ in range(n)], p,
                      kv_scheme=kv_scheme, paged=paged)
              for i, (n, p) in enumerate(zip(_PROMPT_TOKENS, params))]
    outcomes = [*prefill_rows(model, makers[:2]), *prefill_rows(model, makers[2:])]  # paged rows: each alone
    rows = [row for row in outcomes if isinstance(row, SoloRow)]
    batch = DecodeBatch(model, kv_scheme, speculation, compile_decode=compile_decode, paged=paged)
    try:
        for failed in outcomes:
            if isinstance(failed, Exception):
                raise failed
        _decode(batch, rows)
    finally:
        batch.close()
        for row in rows:
            row.close()
        mx.clear_cache()


def _decode(batch: DecodeBatch, rows: list[SoloRow]) -> None:
    """Adopt one row, join the rest (padded), step, let one leave (filter), then one more (extract)."""
    first, *others = rows
    batch.join_many([(first, _token0(first))])
    _steps(batch)
    if not batch.is_paged and not batch_caches.can_batch(others[0].caches):
        return  # this model decodes one row at a time: nothing more to compile
    batch.join_many([(row, _token0(row)) for row in others])
    _steps(batch)
    batch.leave([others[0].request_id])
    _steps(batch)
    batch.leave([first.request_id])
    _steps(batch)


class _Proposing:
    """A row proposer that always proposes `k` copies of one token (the warm-up's prompt lookup)."""

    def __init__(self, _request_id: str, _tokens: object, *, token: int) -> None:
        self._token = token

    def extend(self, _tokens: object) -> None:
        pass

    def propose(self, k: int) -> list[int]:
        return [self._token] * k


def _token0(row: SoloRow) -> int:
    assert row.token0 is not None
    return row.token0


def _steps(batch: DecodeBatch) -> None:
    for _ in range(_STEPS):
        batch.steps_decoded(1, _ignore)
    batch.flush_decoded()


def _ignore(decoded: list[Decoded]) -> None:
    """Warm-up tokens go nowhere (the decode-step actor's report, without a session)."""
