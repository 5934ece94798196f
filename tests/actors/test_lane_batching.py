"""The lane end to end: admission → prefill → decode-step → sessions, rows batched, on tiny models."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.actors.admission import KvBudgetExceeded
from mlx_trio.actors.decode_step import MAX_UNHANDLED_REPORTS
from mlx_trio.errors import Overloaded
from mlx_trio.events import TextDelta
from tests.prompts import PROMPTS
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, QWEN3, TinyModelSpec, tiny_model



async def _solo_tokens(path: Path, prompts: list[str], max_tokens: int) -> list[tuple[int, ...]]:
    async with open_engine(str(path), batch=1) as engine:
        return [(await engine.complete(p, max_tokens=max_tokens)).token_ids for p in prompts]


def _restarts(tree: dict[str, Any]) -> int:
    return tree.get("restarts", 0) + sum(_restarts(c) for c in tree.get("children", []))


async def _wait_drained(engine) -> None:
    with trio.fail_after(10):
        while engine.status()["counters"]["kv_bytes"] or engine.status()["counters"]["active_rows"]:
            await trio.sleep(0.01)


@pytest.mark.parametrize("spec", [LLAMA, QWEN3, LLAMA_SWA], ids=["llama", "qwen3", "llama_swa"])
async def test_overlapping_requests_each_get_their_solo_greedy_tokens(spec: TinyModelSpec) -> None:
    """8 staggered requests at --batch 4 each produce exactly the tokens of their run alone (--batch 1)."""
    path = tiny_model(spec)
    expected = await _solo_tokens(path, PROMPTS, 24)
    got: dict[int, tuple[int, ...]] = {}
    async with open_engine(str(path), batch=4) as engine:
        async def one(i: int) -> None:
            await trio.sleep(0.003 * i)  # arrivals spread over the first steps: late joiners mid-decode
            got[i] = (await engine.complete(PROMPTS[i], max_tokens=24)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
        await _wait_drained(engine)
        stats = engine.status()["counters"]
        assert stats["mode"] == "batch" and stats["configured"] == 4
        assert stats["attention_backend"] == "mlx"  # the lease thread's choice (CPU: MLX's kernels), shown
        assert _restarts(engine.status()["tree"]) == 0
    assert [got[i] for i in range(len(PROMPTS))] == expected


async def _run_watching_rows(engine, prompts: list[str], max_tokens: int) -> tuple[list[tuple[int, ...]], int]:
    """Run the prompts concurrently; their token ids in order, and the most rows admission had in flight."""
    results: dict[int, tuple[int, ...]] = {}
    most_rows = 0

    async def one(i: int) -> None:
        results[i] = (await engine.complete(prompts[i], max_tokens=max_tokens)).token_ids

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
        while len(results) < len(prompts):
            most_rows = max(most_rows, engine.actors.lane.admission.statistics().in_flight_rows)
            await trio.sleep(0)
    return [results[i] for i in range(len(prompts))], most_rows


async def test_a_queue_that_cannot_fit_waits_then_runs() -> None:
    """With a budget for one request at a time, four requests still all finish, one after another."""
    path = tiny_model(LLAMA)
    prompts = [PROMPTS[0]] * 4  # equal sizes, so "room for one, never two" is one number
    expected = await _solo_tokens(path, prompts, 8)
    async with open_engine(str(path), batch=1) as probe:
        layout, n = probe.model.kv_layout, len(probe.prepare(prompts[0]).prompt_ids)
        need, row = layout.request_bytes(n, 8, 2048), layout.row_bytes(n + 8)
    # One row plus the (single) prefill transient fits; a second row's KV does not.
    budget = need + row // 2
    async with open_engine(str(path), batch=4, kv_budget_bytes=budget) as engine:
        results, most_in_flight = await _run_watching_rows(engine, prompts, 8)
        assert engine.actors.lane.admission.statistics().admitted == 4
        assert most_in_flight == 1
    assert results == expected


async def test_a_request_that_can_never_fit_is_refused_with_an_actionable_error() -> None:
    """A request whose worst case exceeds the whole budget fails at once, naming the budget flag."""
    async with open_engine(str(tiny_model(LLAMA)), batch=4, kv_budget_bytes=100_000) as engine:
        with pytest.raises(KvBudgetExceeded, match="--kv-budget"):
            await engine.complete(PROMPTS[0], max_tokens=500)
        assert _restarts(engine.status()["tree"]) == 0


async def test_a_full_queue_answers_overloaded() -> None:
    """With --max-queue 1 and one slot busy, a third request gets Overloaded (HTTP 503)."""
    async with open_engine(str(tiny_model(LLAMA)), batch=1, max_queue=1) as engine:
        errors: list[Exception] = []

        async def one() -> None:
            try:
                await engine.complete(PROMPTS[0], max_tokens=40)
            except Overloaded as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
        assert len(errors) >= 1


async def test_a_consumer_that_fails_evicts_only_its_own_row() -> None:
    """One caller raising mid-stream frees its row; its siblings finish with their solo tokens."""
    path = tiny_model(LLAMA)
    expected = await _solo_tokens(path, PROMPTS[:3], 16)
    async with open_engine(str(path), batch=4) as engine:
        results: dict[int, tuple[int, ...]] = {}

        async def good(i: int) -> None:
            results[i] = (await engine.complete(PROMPTS[i], max_tokens=16)).token_ids

        async def bad() -> None:
            with pytest.raises(RuntimeError):
                async for event in engine.generate(PROMPTS[3], max_tokens=200):
                    if isinstance(event, TextDelta):
                        raise RuntimeError("consumer bug")

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(good, i)
            nursery.start_soon(bad)
        await _wait_drained(engine)
        assert engine.actors.lane.admission.statistics().reserved_bytes == 0
    assert [results[i] for i in range(3)] == expected


def _fail_on_call(monkeypatch, cls: type, name: str, call: int, message: str) -> None:
    """Make `cls.name` raise RuntimeError(message) on its `call`-th call (counting from 1), and work otherwise."""
    original = getattr(cls, name)
    calls = {"n": 0}

    def flaky(self, *args):
        calls["n"] += 1
        if calls["n"] == call:
            raise RuntimeError(message)
        return original(self, *args)

    monkeypatch.setattr(cls, name, flaky)


async def _two_requests_through_a_fault(path: Path, **options: Any) -> tuple[list[tuple[int, ...]], dict[str, Any], int]:
    """Two concurrent requests at --batch 4 (and `options`): their tokens, the decode-step status node,
    admission's reserved bytes."""
    async with open_engine(str(path), batch=4, **options) as engine:
        results: dict[int, tuple[int, ...]] = {}

        async def one(i: int) -> None:
            results[i] = (await engine.complete(PROMPTS[i], max_tokens=30)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(one, i)
        await _wait_drained(engine)
        engine_tree = next(c for c in engine.status()["tree"]["children"] if c["id"] == "engine")
        decode = next(c for c in engine_tree["children"] if c["id"] == "decode-step")
        reserved = engine.actors.lane.admission.statistics().reserved_bytes
    return [results[0], results[1]], decode, reserved


async def test_a_failing_step_restarts_the_decoder_and_every_row_resumes_token_exact(monkeypatch) -> None:
    """A step that raises fails the batch; decode-step restarts and both streams resume to their solo tokens."""
    from mlx_trio.engine.batch.decode_batch import DecodeBatch

    path = tiny_model(LLAMA)
    expected = await _solo_tokens(path, PROMPTS[:2], 30)
    _fail_on_call(monkeypatch, DecodeBatch, "step_decoded", 6, "injected step failure")
    results, decode, reserved = await _two_requests_through_a_fault(path)
    assert decode["restarts"] == 1 and decode["state"] == "running"
    assert "injected step failure" in (decode["last_error"] or "")
    assert reserved == 0
    assert results == expected


async def test_an_error_while_emitting_reported_tokens_restarts_the_decoder_not_the_trio_run(monkeypatch) -> None:
    """Tokens are emitted from Trio's run loop; an error there is raised in the decoder's task and contained."""
    from mlx_trio.actors.decode_step import DecodeStepActor

    path = tiny_model(LLAMA)
    expected = await _solo_tokens(path, PROMPTS[:2], 30)
    _fail_on_call(monkeypatch, DecodeStepActor, "_emit", 8, "injected emit failure")
    results, decode, _ = await _two_requests_through_a_fault(path)
    assert decode["restarts"] == 1 and "injected emit failure" in (decode["last_error"] or "")
    assert results == expected


async def test_a_model_whose_caches_cannot_batch_runs_one_row_at_a_time(monkeypatch) -> None:
    """When a layer cache has no merge, the batch lane caps itself at one row and reports mode 'serial'."""
    import attrs

    import mlx_trio.engine.model.load as model_module

    measure = model_module.measure_layout
    monkeypatch.setattr(model_module, "measure_layout", lambda *a: attrs.evolve(measure(*a), batchable=False))
    path = tiny_model(LLAMA)
    expected = await _solo_tokens(path, PROMPTS[:3], 8)
    async with open_engine(str(path), batch=4) as engine:
        results, most_rows = await _run_watching_rows(engine, PROMPTS[:3], 8)
        counters = engine.status()["counters"]
        assert counters["mode"] == "serial" and counters["configured"] == 4
    assert most_rows == 1
    assert results == expected


async def test_requests_waiting_together_prefill_as_one_batch_and_keep_their_solo_tokens() -> None:
    """A lease job holds the thread while requests arrive; they then prefill as a cohort (engine/batch/cohort_prefill.py)."""
    import time

    path = tiny_model(LLAMA)
    prompts = PROMPTS[:5]
    expected = await _solo_tokens(path, prompts, 12)
    got: dict[int, tuple[int, ...]] = {}
    async with open_engine(str(path), batch=8) as engine:
        await engine.wait_ready()
        engine.actors.lane.lease.submit_nowait(time.sleep, 0.3)  # the first request's prefill waits behind it

        async def one(i: int) -> None:
            got[i] = (await engine.complete(prompts[i], max_tokens=12)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        await _wait_drained(engine)
        assert engine.actors.lane.prefill.statistics().cohort_rows >= 2
    assert [got[i] for i in range(len(prompts))] == expected


async def test_the_step_chain_stops_when_the_trio_thread_falls_behind() -> None:
    """A blocked Trio thread handles no reports: the lease runs at most MAX_UNHANDLED_REPORTS more step jobs.

    Without the bound the chain would keep decoding (a tiny model steps in
    about a millisecond) and feed rows far past what their sessions saw.
    """
    [expected] = await _solo_tokens(tiny_model(LLAMA), [PROMPTS[0]], 48)
    async with open_engine(str(tiny_model(LLAMA)), batch=4) as engine:
        lease = engine.actors.lane.lease
        tokens: list[int] = []
        blocked = False
        async for event in engine.generate(PROMPTS[0], max_tokens=48):
            if isinstance(event, TextDelta):
                tokens.extend(event.token_ids)
                if len(tokens) >= 8 and not blocked:
                    before = lease.statistics().jobs_run
                    time.sleep(0.3)  # block the Trio thread: no report is handled meanwhile
                    ran = lease.statistics().jobs_run - before
                    assert ran <= MAX_UNHANDLED_REPORTS + 1, ran
                    blocked = True
        assert blocked
    assert tuple(tokens) == expected
