"""Dynamic joins and leaves == a replay of the same schedule with mlx-lm's own cache operations.

The reference (mlx_trio/testing/batch_reference.py) is mlx-lm's `GenerationBatch`
written out: `merge([solo])` + `extend` per joiner for every cache kind,
`filter` per leaver, never back to solo caches. Both engines run the same
driver, so the same rows are in every forward; every forward's logits are
compared per row. Full-attention and hybrid models must match bit for bit
(padded rows included: float32 on the CPU is batch-invariant here).
Sliding-window models must match bit for bit for rows that were never
padded and never alone; elsewhere within 1e-4, because the ring is laid out
differently (mlx-lm's B=1 batch cache vs our serial-graph solo caches;
extend vs our re-merge), which only reorders attention sums.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import attrs
import mlx.core as mx
import pytest
from mlx_lm import load

from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, QWEN3, tiny_model

from mlx_trio.testing import batch_reference as ref

MODELS = ["llama", "qwen3", "llama_swa", "qwen3_next"]
PADDED_TOLERANCE = 1e-4


@cache
def _model(name: str) -> tuple[Any, tuple[int, ...], int]:
    """The model, its EOS ids and its vocabulary size."""
    if name == "qwen3_next":
        return ref.tiny_qwen3_next(), (), 256
    spec = {"llama": LLAMA, "qwen3": QWEN3, "llama_swa": LLAMA_SWA}[name]
    model, tokenizer = load(str(tiny_model(spec)))
    return model, tuple(tokenizer.eos_token_ids), 512


def _arrivals(schedule: list[tuple[int, int, int, dict[str, Any]]], vocab: int) -> list[ref.Arrival]:
    """(at_step, prompt length, max_tokens, sampling kwargs) per request, with distinct prompts."""
    return [
        ref.Arrival(f"r{i}", at, tuple((11 * i + 5 * j + j * j) % (vocab - 3) + 3 for j in range(n)),
                    SamplingParams(max_tokens=m, **kw))
        for i, (at, n, m, kw) in enumerate(schedule)
    ]


def _replay_both(name: str, arrivals: list[ref.Arrival], **kwargs: Any) -> tuple[ref.Replay, ref.Replay]:
    model, eos, _ = _model(name)
    got = ref.run_schedule(ref.ours(model, prefill_step_size=8), arrivals, eos=eos, max_batch=8, **kwargs)
    want = ref.run_schedule(ref.reference(model, prefill_step_size=8), arrivals, eos=eos, max_batch=8)
    return got, want


def assert_same_as_reference(name: str, got: ref.Replay, want: ref.Replay) -> None:
    assert got.tokens == want.tokens
    diffs = ref.logit_diffs(got, want)
    assert len(diffs) >= len(want.logits) - len(want.tokens)  # at most one wasted step missing per row
    for key, diff in diffs.items():
        if name != "llama_swa" or not (want.padded[key] or want.alone[key]):
            assert diff == 0.0, (key, diff)
        else:
            assert diff <= PADDED_TOLERANCE, (key, diff)
    assert got.final_nbytes == 0 and want.final_nbytes == 0


# A lone row, a late joiner mid-decode, a row done at token 0, a long prompt (past the
# window of 16, prefilled in chunks of 8), and a joiner while the survivor runs solo again.
LATE_JOINER = [
    (0, 21, 30, {}),
    (6, 9, 12, {}),
    (8, 5, 1, {}),
    (10, 37, 8, {}),
    (25, 3, 10, {}),
]


@pytest.mark.parametrize("name", MODELS)
def test_late_joiner_token0_finisher_and_solo_again(name: str) -> None:
    """Adopt, merge, extend, leave to one row (extracted to solo), re-join: all match the reference."""
    seen: list[tuple[tuple[str, ...], bool]] = []

    def watch(_: int, batch: DecodeBatch) -> None:
        seen.append((tuple(batch.request_ids), batch.is_solo))

    arrivals = _arrivals(LATE_JOINER, _model(name)[2])
    got, want = _replay_both(name, arrivals, on_step=watch)
    assert_same_as_reference(name, got, want)
    assert got.never_joined == {"r2"} and got.tokens["r2"] == want.tokens["r2"] and len(got.tokens["r2"]) == 1
    assert all("r2" not in ids for ids, _ in seen)
    assert (("r0",), True) in seen and (("r4",), True) in seen  # solo at the start and after the drain
    assert {len(ids) for ids, _ in seen} >= {1, 2, 3}
    assert all(solo == (len(ids) == 1) for ids, solo in seen)


SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 21}
PENALIZED = {"repetition_penalty": 1.4, "presence_penalty": 0.3}
TOP_K = {"temperature": 1.1, "top_k": 8, "min_p": 0.02, "seed": 5}
CHURN = [
    (0, 12, 16, {}), (0, 40, 9, SAMPLED), (1, 1, 6, {}), (2, 27, 14, PENALIZED),
    (3, 8, 1, {}), (3, 19, 12, TOP_K), (4, 33, 10, {}), (4, 2, 16, {}),
    (5, 16, 5, {}), (7, 38, 11, {}), (9, 6, 13, SAMPLED | {"seed": 99}), (10, 24, 7, {}),
    (12, 17, 16, PENALIZED), (15, 4, 9, {}),
]


@pytest.mark.parametrize("name", MODELS)
def test_eight_rows_churning_match_reference_and_solo(name: str) -> None:
    """14 requests, up to 8 rows, mixed greedy/seeded/penalized: reference-exact, and each row == its solo run."""
    arrivals = _arrivals(CHURN, _model(name)[2])
    got, want = _replay_both(name, arrivals)
    assert got.max_batch == 8
    assert_same_as_reference(name, got, want)
    model, eos, _ = _model(name)
    for a in arrivals:
        solo = ref.run_schedule(ref.ours(model, prefill_step_size=8), [attrs.evolve(a, at_step=0)], eos=eos)
        assert solo.tokens[a.request_id] == got.tokens[a.request_id]
        for key, diff in ref.logit_diffs(got, solo).items():
            # Against the serial graph only unpadded full-attention rows are promised bit-exactness
            # (CPU float32 measures 0 for padded rows too); ring layouts differ for sliding windows.
            exact = name != "llama_swa" and not want.padded[key]
            assert diff <= (0.0 if exact else PADDED_TOLERANCE), (key, diff)


def _cache_arrays(caches: list[Any]) -> list[mx.array]:
    """Every array a list of extracted per-layer caches holds (keys/values up to their offset, or recurrent state)."""
    arrays: list[mx.array] = []
    for c in caches:
        if hasattr(c, "caches"):
            arrays += _cache_arrays(list(c.caches))
        elif hasattr(c, "cache"):
            arrays += [a for a in c.cache if a is not None]
        else:
            full = c.offset >= c.keys.shape[2]  # a rotating window, or exactly a buffer's worth
            arrays += [c.keys if full else c.keys[..., : c.offset, :], c.values if full else c.values[..., : c.offset, :]]
    return arrays


@pytest.mark.parametrize("name", MODELS)
def test_extract_matches_reference_extract(name: str) -> None:
    """After every batched step, each row's extracted caches hold its num_fed tokens, equal to mlx-lm's extract."""
    extracted: dict[str, dict[tuple[int, str], tuple[int, list[mx.array]]]] = {"got": {}, "want": {}}

    def grab(which: str) -> Any:
        def on_step(step: int, batch: Any) -> None:
            if batch.size < 2:
                return  # a lone row hands its own caches over (no extract): nothing to compare
            for rid in batch.request_ids:
                if isinstance(batch, DecodeBatch):  # ours: the copy the prompt cache gets
                    entry = batch.cache_entry(rid, tuple(range(batch.num_fed(rid))))
                    assert entry is not None
                    caches = entry.caches
                else:
                    caches = batch.extract(rid)
                extracted[which][(step, rid)] = (batch.num_fed(rid), _cache_arrays(caches))
        return on_step

    model, eos, vocab = _model(name)
    arrivals = _arrivals(LATE_JOINER, vocab)
    ref.run_schedule(ref.ours(model, prefill_step_size=8), arrivals, eos=eos, on_step=grab("got"))
    ref.run_schedule(ref.reference(model, prefill_step_size=8), arrivals, eos=eos, on_step=grab("want"))
    assert extracted["got"].keys() == extracted["want"].keys()
    for key, (num_fed, arrays) in extracted["got"].items():
        want_fed, want_arrays = extracted["want"][key]
        assert num_fed == want_fed
        assert [a.shape for a in arrays] == [a.shape for a in want_arrays]
        for a, b in zip(arrays, want_arrays):
            diff = mx.abs(a - b).max().item()
            assert diff <= (PADDED_TOLERANCE if name == "llama_swa" else 0.0), (key, diff)
        if name in ("llama", "qwen3"):
            assert arrays[0].shape[2] == num_fed  # full attention: exactly the fed tokens, no padding
