#!/usr/bin/env python3
"""A reference replay of a continuous-batching schedule, built only from mlx-lm's own pieces.

The oracle for `mlx_trio.engine.batch.DecodeBatch` (tests/engine/test_batch_dynamic.py):

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
  sample with `RowSampler` (its own key; tests/engine/test_row_sampler.py
  pins it to mlx-lm's `make_sampler` under `mx.random.seed`).

`run_schedule` is that driver: a minimal scheduler loop (admit arrivals at a
step index, prefill, token 0, flush + join, pipelined steps, leave on EOS or
max_tokens) that also records every forward's logits per row.

Usage: python scripts/batch_reference.py  (prints per-model parity numbers)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mlx_trio.engine.batch import DecodeBatch  # noqa: E402
from mlx_trio.engine.row_sampler import RowSampler  # noqa: E402
from mlx_trio.engine.rows import SoloRow  # noqa: E402
from mlx_trio.params import SamplingParams  # noqa: E402


class RecordingModel:
    """Calls the model and keeps the last logits `[B, V]` (evaluated) for the parity check."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.last: mx.array | None = None

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        out = self.model(inputs, cache=cache)
        self.last = out[:, -1, :]
        return out


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
        self.token0 = self.sampler.sample(logits, last).item()
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

    def join(self, row: ReferenceRow, token0: int) -> None:
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

    def step(self) -> list[int] | None:
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

    def flush(self) -> list[int] | None:
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
    """What a schedule produced: tokens per request, logits per (request, token index), padding seen."""

    tokens: dict[str, list[int]]
    logits: dict[tuple[str, int], mx.array]
    padded: dict[tuple[str, int], bool]
    max_batch: int
    final_nbytes: int


class _Batch(Protocol):
    request_ids: list[str]
    size: int
    is_flushed: bool
    nbytes: int

    def num_fed(self, request_id: str) -> int: ...
    def join(self, row: Any, token0: int) -> None: ...
    def step(self) -> list[int] | None: ...
    def flush(self) -> list[int] | None: ...
    def leave(self, request_ids: Collection[str]) -> None: ...
    def close(self) -> None: ...


def ours(model: nn.Module, *, prefill_step_size: int = 2048) -> tuple[Callable[..., Any], _Batch, RecordingModel]:
    """mlx-trio's SoloRow + DecodeBatch, the batch forward recorded."""
    recorder = RecordingModel(model)
    def make_row(a: Arrival) -> SoloRow:
        return SoloRow(model, a.request_id, a.prompt_ids, a.params, prefill_step_size=prefill_step_size)
    return make_row, DecodeBatch(recorder), recorder


def reference(model: nn.Module, *, prefill_step_size: int = 2048) -> tuple[Callable[..., Any], ReferenceBatch, None]:
    def make_row(a: Arrival) -> ReferenceRow:
        return ReferenceRow(model, a.request_id, a.prompt_ids, a.params, prefill_step_size=prefill_step_size)
    return make_row, ReferenceBatch(model), None


def run_schedule(engine: tuple[Callable[..., Any], Any, RecordingModel | None], arrivals: Sequence[Arrival],
                 *, eos: Collection[int] = (), on_step: Callable[[Any], None] | None = None) -> Replay:
    """Replay `arrivals` on one engine; rows leave (unflushed, as mlx-lm does) after EOS or max_tokens."""
    make_row, batch, recorder = engine
    pending = sorted(arrivals, key=lambda a: a.at_step)
    by_id = {a.request_id: a for a in arrivals}
    out = Replay({a.request_id: [] for a in arrivals}, {}, {}, 0, 0)

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

    num_steps = 0
    while pending or batch.size:
        while pending and pending[0].at_step <= num_steps:
            a = pending.pop(0)
            row = make_row(a)
            while row.prefill_chunk():
                pass
            out.tokens[a.request_id].append(row.first_token())
            if finished(a.request_id):
                row.close()  # stops at token 0: never joins
                continue
            record(batch.flush())
            batch.join(row, out.tokens[a.request_id][0])
        if not batch.size:
            num_steps = pending[0].at_step if pending else num_steps
            continue
        fed = [(rid, batch.num_fed(rid)) for rid in batch.request_ids]
        padded = {rid: any(p > 0 for p in batch.left_padding(rid)) for rid, _ in fed} \
            if isinstance(batch, ReferenceBatch) else {}
        previous = batch.step()
        logits = batch.last_logits if recorder is None else recorder.last
        out.max_batch = max(out.max_batch, len(fed))
        for i, (rid, num_fed) in enumerate(fed):
            index = num_fed + 1 - len(by_id[rid].prompt_ids)  # the token this forward samples
            out.logits[(rid, index)] = logits[i]
            out.padded[(rid, index)] = padded.get(rid, False)
        num_steps += 1
        if on_step is not None:
            on_step(batch)
        record(previous)
    out.final_nbytes = batch.nbytes
    batch.close()
    return out


def compare(got: Replay, want: Replay) -> tuple[float, float, list[tuple[str, int]]]:
    """Max |logit diff| over unpadded and padded (per the reference) rows, and keys that differ in tokens."""
    exact = padded = 0.0
    for key, ref_logits in want.logits.items():
        if key not in got.logits:
            continue
        diff = mx.abs(got.logits[key] - ref_logits).max().item()
        if want.padded[key]:
            padded = max(padded, diff)
        else:
            exact = max(exact, diff)
    bad = [(rid, i) for rid in want.tokens for i, (a, b) in
           enumerate(zip(got.tokens[rid], want.tokens[rid])) if a != b]
    return exact, padded, bad


def main() -> None:
    from mlx_lm import load

    from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, QWEN3, tiny_model

    for name, spec in (("llama", LLAMA), ("qwen3", QWEN3), ("llama_swa", LLAMA_SWA)):
        model, _ = load(str(tiny_model(spec)))
        arrivals = [
            Arrival(f"r{i}", at, tuple((11 * i + 5 * j) % 500 + 3 for j in range(n)), SamplingParams(max_tokens=m))
            for i, (at, n, m) in enumerate([(0, 30, 24), (0, 7, 20), (3, 19, 12), (5, 40, 30), (9, 2, 6),
                                            (12, 25, 16), (13, 11, 22), (20, 33, 10)])
        ]
        got = run_schedule(ours(model, prefill_step_size=8), arrivals)
        want = run_schedule(reference(model, prefill_step_size=8), arrivals)
        exact, padded, bad = compare(got, want)
        print(f"{name:10s} max B={want.max_batch}  unpadded max|dlogit|={exact:.3g}  "
              f"padded max|dlogit|={padded:.3g}  token mismatches={len(bad)}")


if __name__ == "__main__":
    main()
