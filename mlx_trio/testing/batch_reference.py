#!/usr/bin/env python3
"""A reference replay of a continuous-batching schedule, built only from mlx-lm's own pieces.

The oracle for `mlx_trio.engine.batch.decode_batch.DecodeBatch` (tests/engine/batch/test_batch_dynamic.py):

- `ReferenceRow` prefills one request alone exactly as mlx-lm's
  `generate_step` does (chunks of all but the last prompt token, then an
  L=1 forward of the last one that samples token 0).
- `ReferenceBatch` is mlx-lm's `GenerationBatch` semantics written out
  plainly: every joiner becomes `merge([solo])` and is `extend`ed into the
  running batch cache (every cache kind, as `GenerationBatch.extend` does),
  a leaver is `filter`ed out, and the batch never goes back to solo caches.
  It evaluates each step synchronously but presents the same pipelined
  register protocol as `DecodeBatch` (step returns the previous step's
  tokens), so one driver replays one schedule on both.
- Greedy rows take the argmax of their own row's log-softmax; other rows
  sample with `RowSampler` (its own key; tests/engine/sampling/test_row_sampler.py
  pins it to mlx-lm's `make_sampler` under `mx.random.seed`).

`run_schedule` is that driver: a minimal scheduler loop (admit arrivals at a
step index, prefill, token 0, flush + join, pipelined steps, leave on EOS or
max_tokens) that also records every forward's logits per row.

Usage: python -m mlx_trio.testing.batch_reference               (per-model parity numbers)
       python -m mlx_trio.testing.batch_reference --bench-b1    (B=1 decode: extracted solo vs batch caches)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.batch.decode_batch import DecodeBatch, Decoded
from mlx_trio.engine.sampling.row_sampler import RowSampler
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.params import SamplingParams


class RecordingModel:
    """Calls the model and keeps its last-position logits `[B, V]` (lazy) for the parity check."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.last: mx.array | None = None

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        out = self.model(inputs, cache=cache)
        self.last = out[:, -1, :]
        return out

    def __getattr__(self, name: str) -> Any:  # make_prompt_cache reads `make_cache` / `layers`
        return getattr(self.model, name)


class ReferenceRow:
    """generate_step's prefill and first step on fresh per-layer caches."""

    def __init__(self, model: nn.Module, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                 *, prefill_step_size: int = 2048) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.caches = make_prompt_cache(model)
        self.token0: int | None = None
        self._model = model
        self._step = prefill_step_size
        self._done = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def prefill_chunk(self) -> int:
        remaining = len(self.prompt_ids) - 1 - self._done
        n = min(self._step, remaining)
        if n > 0:
            self._model(mx.array(self.prompt_ids[self._done:self._done + n])[None], cache=self.caches)
            mx.eval([c.state for c in self.caches])
            self._done += n
        return len(self.prompt_ids) - 1 - self._done

    def first_token(self) -> int:
        self.sampler = RowSampler(self.params, self.prompt_ids)
        last = mx.array(self.prompt_ids[-1:])
        logits = self._model(last[None], cache=self.caches)[:, -1, :]
        self.last_logits = logits
        # A fresh slice: mlx-lm's repetition penalty writes into the logits it is given.
        self.token0 = self.sampler.sample(logits[0:1], last).item()
        return self.token0

    def close(self) -> None:
        self.caches = []


@attrs.define
class _RefRow:
    request_id: str
    sampler: RowSampler
    greedy: bool
    num_fed: int


class ReferenceBatch:
    """mlx-lm GenerationBatch cache semantics, synchronous, behind DecodeBatch's register protocol."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._rows: list[_RefRow] = []
        self._caches: list[Any] = []
        self._next: list[int] = []
        self._unread = False
        self.last_logits: mx.array | None = None

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self._rows]

    @property
    def size(self) -> int:
        return len(self._rows)

    @property
    def is_flushed(self) -> bool:
        return not self._unread

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._caches)

    def num_fed(self, request_id: str) -> int:
        return self._rows[self.request_ids.index(request_id)].num_fed

    def left_padding(self, request_id: str) -> list[int]:
        """The row's left padding in every layer that has one (for choosing the tolerance)."""
        i = self.request_ids.index(request_id)
        return [int(c.left_padding[i].item()) for c in self._caches
                if getattr(c, "left_padding", None) is not None]

    def join_many(self, joiners: Sequence[tuple[ReferenceRow, int]]) -> None:
        """`DecodeBatch.join_many`'s interface: each row joins in turn (mlx-lm's extend)."""
        for row, token0 in joiners:
            self._join(row, token0)

    def _join(self, row: ReferenceRow, token0: int) -> None:
        assert not self._unread
        solo_batch = [c.merge([c]) for c in row.caches]  # PromptProcessingBatch's _merge_caches
        if not self._rows:
            self._caches = solo_batch
        else:
            for running, new in zip(self._caches, solo_batch):  # GenerationBatch.extend
                running.extend(new)
        self._rows.append(_RefRow(row.request_id, row.sampler, row.sampler.is_plain_greedy, row.num_prompt_tokens))
        self._next.append(token0)
        row.caches = []

    def step_decoded(self) -> Decoded | None:
        return _decoded(self._step())

    def flush_decoded(self) -> Decoded | None:
        return _decoded(self._flush())

    def _step(self) -> list[int] | None:
        inputs = mx.array(self._next, dtype=mx.uint32)
        logits = self._model(inputs[:, None], cache=self._caches)[:, -1, :]
        tokens = []
        for i, row in enumerate(self._rows):
            row_logits = logits[i:i + 1]
            if row.greedy:
                logprobs = row_logits - mx.logsumexp(row_logits, keepdims=True)
                tokens.append(mx.argmax(logprobs, axis=-1).item())
            else:
                tokens.append(row.sampler.sample(row_logits, inputs[i:i + 1]).item())
            row.num_fed += 1
        mx.eval(logits)
        self.last_logits = logits
        previous = list(self._next) if self._unread else None
        self._next = tokens
        self._unread = True
        return previous

    def _flush(self) -> list[int] | None:
        if not self._unread:
            return None
        self._unread = False
        return list(self._next)

    def leave(self, request_ids: Collection[str]) -> None:
        keep = [i for i, r in enumerate(self._rows) if r.request_id not in set(request_ids)]
        if not keep:
            self.close()
            return
        for c in self._caches:
            c.filter(keep)
        self._rows = [self._rows[i] for i in keep]
        self._next = [self._next[i] for i in keep]

    def extract(self, request_id: str) -> list[Any]:
        i = self.request_ids.index(request_id)
        return [c.extract(i) for c in self._caches]

    def close(self) -> None:
        self._rows, self._caches, self._next, self._unread = [], [], [], False


@attrs.frozen
class Arrival:
    """A request that is admitted once `at_step` decode steps have run."""

    request_id: str
    at_step: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@attrs.define
class Replay:
    """What a schedule produced. Logits are keyed by (request id, index of the token they sample)."""

    tokens: dict[str, list[int]] = attrs.Factory(dict)
    logits: dict[tuple[str, int], mx.array] = attrs.Factory(dict)
    # Per logits key: the row had left padding in some layer (reference only) ...
    padded: dict[tuple[str, int], bool] = attrs.Factory(dict)
    # ... or had already been in a one-row forward (where ours runs solo caches, mlx-lm a B=1 batch).
    alone: dict[tuple[str, int], bool] = attrs.Factory(dict)
    never_joined: set[str] = attrs.Factory(set)
    max_batch: int = 0
    final_nbytes: int = -1


def ours(model: nn.Module, *, prefill_step_size: int = 2048) -> tuple[Callable[..., Any], DecodeBatch, RecordingModel]:
    """mlx-trio's SoloRow + DecodeBatch, the batch forward recorded."""
    recorder = RecordingModel(model)

    def make_row(a: Arrival) -> SoloRow:
        return SoloRow(recorder, a.request_id, a.prompt_ids, a.params, prefill_step_size=prefill_step_size)
    return make_row, DecodeBatch(recorder), recorder


def reference(model: nn.Module, *, prefill_step_size: int = 2048) -> tuple[Callable[..., Any], ReferenceBatch, None]:
    """The mlx-lm-semantics reference (no recorder: it keeps its own logits)."""

    def make_row(a: Arrival) -> ReferenceRow:
        return ReferenceRow(model, a.request_id, a.prompt_ids, a.params, prefill_step_size=prefill_step_size)
    return make_row, ReferenceBatch(model), None


def run_schedule(engine: tuple[Callable[..., Any], Any, RecordingModel | None], arrivals: Sequence[Arrival],
                 *, eos: Collection[int] = (), max_batch: int | None = None,
                 on_step: Callable[[int, Any], None] | None = None) -> Replay:
    """Replay `arrivals` on one engine; rows leave (unflushed, as mlx-lm does) after EOS or max_tokens.

    Each loop turn: admit the arrivals due, first come first served while
    fewer than `max_batch` rows run (prefill, token 0; a row done at token 0
    is closed, else flush + join), then one pipelined `step()` whose returned
    tokens may finish rows. `on_step(num_steps, batch)` runs after each step.
    """
    make_row, batch, recorder = engine
    pending = sorted(arrivals, key=lambda a: a.at_step)
    by_id = {a.request_id: a for a in arrivals}
    out = Replay(tokens={a.request_id: [] for a in arrivals})
    ever_alone: set[str] = set()

    def finished(rid: str) -> bool:
        toks = out.tokens[rid]
        return len(toks) >= by_id[rid].params.max_tokens or toks[-1] in eos

    def record(tokens: list[int] | None) -> None:
        if tokens is None:
            return
        ids = batch.request_ids
        for rid, token in zip(ids, tokens):
            out.tokens[rid].append(token)
        done = [rid for rid in ids if finished(rid)]
        if done:
            batch.leave(done)

    def keep_logits(rid: str, index: int, logits: mx.array, padded: bool) -> None:
        out.logits[(rid, index)] = logits
        out.padded[(rid, index)] = padded
        out.alone[(rid, index)] = rid in ever_alone

    num_steps = 0
    while pending or batch.size:
        while pending and pending[0].at_step <= num_steps and (max_batch is None or batch.size < max_batch):
            a = pending.pop(0)
            row = make_row(a)
            while row.prefill_chunk():
                pass
            out.tokens[a.request_id].append(row.first_token())
            keep_logits(a.request_id, 0, (row.last_logits if recorder is None else recorder.last)[0], False)
            if finished(a.request_id):
                row.close()  # stops at token 0: never joins
                out.never_joined.add(a.request_id)
                continue
            record(_ids(batch.flush_decoded()))
            batch.join_many([(row, out.tokens[a.request_id][0])])
        if not batch.size:
            num_steps = pending[0].at_step if pending else num_steps
            continue
        fed = [(rid, batch.num_fed(rid)) for rid in batch.request_ids]
        if len(fed) == 1:
            ever_alone.add(fed[0][0])
        previous = _ids(batch.step_decoded())
        logits = batch.last_logits if recorder is None else recorder.last
        # The forward runs over the batch's row slots (engine/kv/row_slots.py): row i's logits are its slot's.
        slots = batch.row_slots if recorder is not None else list(range(len(fed)))
        out.max_batch = max(out.max_batch, len(fed))
        for i, (rid, num_fed) in enumerate(fed):
            padded = isinstance(batch, ReferenceBatch) and any(p > 0 for p in batch.left_padding(rid))
            keep_logits(rid, num_fed + 1 - len(by_id[rid].prompt_ids), logits[slots[i]], padded)
        num_steps += 1
        if on_step is not None:
            on_step(num_steps, batch)
        record(previous)
    out.final_nbytes = batch.nbytes
    batch.close()
    return out


def _decoded(tokens: list[int] | None) -> Decoded | None:
    return Decoded(tuple(tokens), (None,) * len(tokens)) if tokens is not None else None


def _ids(decoded: Decoded | None) -> list[int] | None:
    return list(decoded.token_ids) if decoded is not None else None


def logit_diffs(got: Replay, want: Replay) -> dict[tuple[str, int], float]:
    """Max |logit difference| per key both replays computed (a finished row's wasted step included)."""
    return {key: mx.abs(got.logits[key] - ref).max().item() for key, ref in want.logits.items() if key in got.logits}


def tiny_qwen3_next(seed: int = 0, head_dim: int = 16) -> nn.Module:
    """A random-weight hybrid model: `ArraysCache` (gated delta net) layers and full-attention layers.

    `head_dim` of the attention layers: 32 or more lets their KV quantize (mx.quantize's smallest group).
    """
    from mlx_lm.models import qwen3_next

    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=0, num_experts_per_tok=1, decoder_sparse_step=1, shared_expert_intermediate_size=64,
        mlp_only_layers=[], moe_intermediate_size=64, rms_norm_eps=1e-6, vocab_size=256, rope_theta=10000.0,
        partial_rotary_factor=0.5, max_position_embeddings=4096, full_attention_interval=2,
    )
    mx.random.seed(seed)  # the module initializers draw from the global key
    model = qwen3_next.Model(args)
    mx.eval(model.parameters())
    return model


def parity_report() -> None:
    """Replay one churning schedule (solo phases, late joiners, a token-0 finisher) on each tiny model."""
    from mlx_lm import load

    from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, QWEN3, tiny_model

    models = [(name, load(str(tiny_model(spec)))[0], 512)
              for name, spec in (("llama", LLAMA), ("qwen3", QWEN3), ("llama_swa", LLAMA_SWA))]
    models.append(("qwen3_next", tiny_qwen3_next(), 256))
    schedule = [(0, 30, 40), (4, 7, 6), (5, 41, 24), (6, 1, 1), (7, 19, 12), (8, 3, 30), (9, 2, 6), (12, 25, 16),
                (13, 11, 22), (20, 33, 10), (22, 16, 9), (45, 5, 8)]
    for name, model, vocab in models:
        arrivals = [Arrival(f"r{i}", at, tuple((11 * i + 5 * j) % (vocab - 3) + 3 for j in range(n)),
                            SamplingParams(max_tokens=m)) for i, (at, n, m) in enumerate(schedule)]
        got = run_schedule(ours(model, prefill_step_size=8), arrivals, max_batch=8)
        want = run_schedule(reference(model, prefill_step_size=8), arrivals, max_batch=8)
        diffs = logit_diffs(got, want)
        exact = max((d for k, d in diffs.items() if not (want.padded[k] or want.alone[k])), default=0.0)
        padded = max((d for k, d in diffs.items() if want.padded[k]), default=0.0)
        alone = max((d for k, d in diffs.items() if want.alone[k] and not want.padded[k]), default=0.0)
        print(f"{name:10s} max B={want.max_batch} logits compared={len(diffs)}  max|dlogit|: unpadded and never "
              f"alone {exact:.3g}, padded {padded:.3g}, once alone {alone:.3g}; tokens equal: "
              f"{got.tokens == want.tokens}")


def bench_b1(hidden: int, layers: int, *, vocab: int, prompt_len: int, steps: int, dtype: str) -> None:
    """Decode step time of a lone row left by a B=2 batch: extracted to solo caches vs kept batched (B=1)."""
    import time

    from mlx_lm.models import llama

    from mlx_trio.engine.kv import batch_caches

    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=hidden * 4, num_attention_heads=hidden // 64, rms_norm_eps=1e-5,
                           vocab_size=vocab, num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=False)
    model = llama.Model(args)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    can_extract = batch_caches.can_extract
    times: dict[bool, list[float]] = {True: [], False: []}
    for extract in (True, False) * 3:
        batch_caches.can_extract = can_extract if extract else (lambda caches: False)  # type: ignore[assignment]
        try:
            batch = DecodeBatch(model)
            for rid in ("a", "b"):
                row = SoloRow(model, rid, [(7 * j + len(rid)) % vocab for j in range(prompt_len)], SamplingParams())
                while row.prefill_chunk():
                    pass
                batch.join_many([(row, row.first_token())])
            batch.step_decoded()
            batch.step_decoded()
            tic = time.perf_counter()
            batch.leave(["b"])
            batch.step_decoded()
            batch.flush_decoded()
            leave_ms = (time.perf_counter() - tic) * 1e3
            assert batch.is_solo == extract
            for _ in range(20):
                batch.step_decoded()
            batch.flush_decoded()
            tic = time.perf_counter()
            for _ in range(steps):
                batch.step_decoded()
            batch.flush_decoded()
            times[extract].append((time.perf_counter() - tic) / steps * 1e3)
            print(f"  extract={extract!s:5s} leave+1 step {leave_ms:7.2f} ms   decode {times[extract][-1]:.3f} ms/step")
            batch.close()
        finally:
            batch_caches.can_extract = can_extract
    solo, batched = min(times[True]), min(times[False])
    print(f"hidden={hidden} layers={layers} {dtype} prompt={prompt_len} on {mx.default_device()}: solo {solo:.3f} "
          f"ms/step, B=1 batch caches {batched:.3f} ms/step, solo/batched {solo / batched:.3f}")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--bench-b1", action="store_true", help="time B=1 decode: solo caches vs batch caches")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if args.bench_b1:
        bench_b1(args.hidden, args.layers, vocab=args.vocab, prompt_len=args.prompt, steps=args.steps,
                 dtype=args.dtype)
    else:
        parity_report()


if __name__ == "__main__":
    main()
