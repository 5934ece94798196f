"""Drive a DecodeBatch the way the decode-step actor does, recording tokens and logprobs."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import attrs

from mlx_trio.engine.batch.decode_batch import DecodeBatch, Decoded
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry
from mlx_trio.engine.speculative.speculator import SpeculationConfig
from mlx_trio.logprobs import SampledLogprobs
from mlx_trio.params import SamplingParams

from mlx_trio.testing.batch_reference import Arrival  # one arrival record for the engine and the reference


@attrs.define
class Outcome:
    tokens: list[int] = attrs.Factory(list)
    logprobs: list[SampledLogprobs | None] = attrs.Factory(list)
    finish_reason: str | None = None


def token_ids(decoded: Decoded | None) -> list[int] | None:
    """One step's token ids in batch order (None: nothing was read)."""
    return list(decoded.token_ids) if decoded is not None else None


def run_schedule(model: Any, arrivals: list[Arrival], *, eos: Collection[int],
                 grammar_tokenizer: Any = None, prefill_step_size: int = 8, kv_scheme: KvScheme = KvScheme(),
                 converted_at: dict[str, int] | None = None,
                 speculation: SpeculationConfig | None = None,
                 entries: dict[str, CacheEntry | None] | None = None,
                 steps: list[Decoded] | None = None,
                 adapter_of: Callable[[str], Any] | None = None,
                 compile_decode: bool | None = False, paged: Any = None) -> dict[str, Outcome]:
    """Each arrival joins at its step (after prefilling alone); rows leave once finished, as in DecodeStepActor.

    `compile_decode` steps through the compiled forward where it covers the caches (engine/batch/compiled_step.py).

    `converted_at` (quantized schemes) gets each row's token count when it first sat in a quantized batch.

    With `speculation`, each step is `steps_decoded(1)` (speculative while a
    row speculates). With `entries`, each leaving row's KV is put there
    (`DecodeBatch.cache_entry`), keyed by request id. With `steps`, every
    `Decoded` the steps returned is appended there.
    `adapter_of(request_id)`: the row's `AdapterUse` (None: a base row), taken when its prefill starts.
    `paged`: a `PagedKV` the rows prefill into and decode on (engine/kv/blocks/).
    """
    params = {a.request_id: a.params for a in arrivals}
    params_prompt = {a.request_id: a.prompt_ids for a in arrivals}
    out = {a.request_id: Outcome() for a in arrivals}
    batch = DecodeBatch(model, kv_scheme, speculation, compile_decode=compile_decode, paged=paged)

    def note_format() -> None:
        if converted_at is not None and batch.size and batch.is_quantized:
            for rid in batch.request_ids:
                converted_at.setdefault(rid, batch.num_fed(rid))
    pending = sorted(arrivals, key=lambda a: a.at_step)

    def record(rid: str, token: int, logprobs: SampledLogprobs | None) -> None:
        row = out[rid]
        if row.finish_reason is not None:
            return  # the pipeline's wasted extra token
        row.tokens.append(token)
        row.logprobs.append(logprobs)
        if token in eos:
            row.finish_reason = "stop"
        elif len(row.tokens) >= params[rid].max_tokens:
            row.finish_reason = "length"

    def record_all(ids: list[str], decoded: Decoded | None) -> None:
        if decoded is not None:
            for rid, token, logprobs in zip(ids, decoded.token_ids, decoded.logprobs, strict=True):
                if token is not None:  # None: the row emitted fewer tokens in this speculative step
                    record(rid, token, logprobs)

    step = 0
    while pending or batch.size:
        joiners = [a for a in pending if a.at_step <= step]
        if joiners or any(out[rid].finish_reason for rid in batch.request_ids):
            if batch.size:
                record_all(batch.request_ids, batch.flush_decoded())
            leaving = [rid for rid in batch.request_ids if out[rid].finish_reason]
            if leaving:
                if entries is not None:
                    for rid in leaving:
                        entries[rid] = batch.cache_entry(rid, (*params_prompt[rid], *out[rid].tokens))
                batch.leave(leaving)
            for a in joiners:
                pending.remove(a)
                row = SoloRow(model, a.request_id, a.prompt_ids, a.params, prefill_step_size=prefill_step_size,
                              grammar_tokenizer=grammar_tokenizer, kv_scheme=kv_scheme,
                              adapter=adapter_of(a.request_id) if adapter_of is not None else None, paged=paged)
                while row.prefill_chunk():
                    pass
                record(a.request_id, row.first_token(), row.token0_logprobs)
                if out[a.request_id].finish_reason:
                    row.close()
                else:
                    batch.join_many([(row, row.token0)])
                    note_format()
        if batch.size:
            ids = batch.request_ids
            for decoded in batch.steps_decoded(1):
                if steps is not None and decoded is not None:
                    steps.append(decoded)
                record_all(ids, decoded)
            note_format()
        step += 1
    return out


def solo_run(model: Any, prompt_ids: tuple[int, ...], params: SamplingParams, *, eos: Collection[int],
             grammar_tokenizer: Any = None, prefill_step_size: int = 8) -> Outcome:
    """One request alone (`--batch 1`): its tokens and logprobs (mlx-lm's own graph: the goldens pin it)."""
    return run_schedule(model, [Arrival("solo", 0, prompt_ids, params)], eos=eos,
                        grammar_tokenizer=grammar_tokenizer, prefill_step_size=prefill_step_size)["solo"]
