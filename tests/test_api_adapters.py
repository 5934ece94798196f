"""Adapters through the embeddable API: `open_engine(lora_modules=...)`, `model=NAME`, per-row in one batch.

Each request's greedy tokens equal mlx-lm's `load(model, adapter_path=...)` +
`generate_step` for its adapter (the base model's for base requests), alone
(`batch=1`) and batched with rows of another adapter and base rows; the
prompt cache never serves one adapter's KV to another or to the base; a
resume after a decode-step crash keeps the request's adapter; an unknown name
is `ModelNotFound` naming the served models; runtime load and unload.
"""

from __future__ import annotations

from functools import cache

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load

from mlx_trio import open_engine
from mlx_trio.errors import AdapterError, ModelNotFound
from mlx_trio.testing.tiny_models import LLAMA, TinyModelSpec, tiny_model
from tests.engine.adapters.test_adapter_mixes import prompt_of, reference_tokens
from tests.engine.adapters.test_row_lora import MAX_TOKENS, _adapter_dir, _mlx_lm_tokens, _prompt


def _modules(*names: str) -> dict[str, str]:
    return {name: str(_adapter_dir("llama", name)) for name in names}


async def _tokens(engine, prompt: tuple[int, ...], model: str | None, max_tokens: int = MAX_TOKENS) -> tuple[int, ...]:
    done = await engine.complete(list(prompt), model=model, max_tokens=max_tokens)
    return done.token_ids


@cache
def _eos() -> frozenset[int]:
    return frozenset(load(str(tiny_model(LLAMA)))[1].eos_token_ids)


def _want(name: str | None, prompt: tuple[int, ...]) -> tuple[int, ...]:
    """mlx-lm's tokens for the adapter, without a final EOS (the engine's `token_ids` do not show it)."""
    tokens = _mlx_lm_tokens("llama", name, prompt)
    return tokens[:-1] if tokens and tokens[-1] in _eos() else tokens


@pytest.mark.parametrize("batch", [1, 8])
async def test_requests_name_adapters_and_each_equals_mlx_lm(batch: int) -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=batch, lora_modules=_modules("qv", "dora")) as engine:
        assert engine.served_adapters() == ("qv", "dora")
        plan = [("qv", 1), (None, 2), ("dora", 3), ("qv", 4), (None, 5), ("dora", 6)]
        got: dict[int, tuple[int, ...]] = {}

        async def one(name: str | None, i: int) -> None:
            got[i] = await _tokens(engine, _prompt(i), name)

        async with trio.open_nursery() as nursery:
            for name, i in plan:
                nursery.start_soon(one, name, i)
        for name, i in plan:
            assert got[i] == _want(name, _prompt(i)), (name, i)
        status = engine.status()["adapters"]
        assert status["served"] == ["qv", "dora"] and set(status["resident"]) == {"qv", "dora"}
        with trio.fail_after(10):  # a row gives its slot back when it leaves the batch, after its last event
            while any(engine.status()["adapters"]["resident"].values()):
                await trio.sleep(0.01)
        # The base model keeps its own name (and "default").
        assert await _tokens(engine, _prompt(2), engine.model_id) == _want(None, _prompt(2))
        assert await _tokens(engine, _prompt(2), "default") == _want(None, _prompt(2))


# A prefix long enough for the prompt cache to keep (a snapshot, a batched row's finish-time entry: 256 tokens).
LONG_PREFIX = tuple((3 * j + 2) % 500 + 3 for j in range(260))
SIX_ROWS = st.lists(st.tuples(st.sampled_from([None, "qv", "dora"]), st.integers(1, 40), st.booleans(),
                              st.sampled_from([0.0, 0.0, 0.002, 0.02]), st.integers(1, MAX_TOKENS)),
                    min_size=6, max_size=6)


@settings(max_examples=10, deadline=None)
@given(batch=st.sampled_from([1, 2, 3, 4, 8]), rows=SIX_ROWS, order=st.permutations(range(6)), salt=st.integers(0, 10_000),
       max_loras=st.sampled_from([1, 2]), prompt_lookup=st.booleans())
async def test_six_requests_on_two_adapters_and_the_base_each_equal_mlx_lm(batch: int, rows, order, salt: int,
                                                                          max_loras: int, prompt_lookup: bool) -> None:
    """Issue #44: every mix of adapters, prompt lengths (some sharing a long prefix across adapters), arrival orders
    and `--batch` (with one adapter slot or two, speculating or not); each request's tokens are mlx-lm's for its
    adapter. The same six again then find the first wave's prompt-cache entries, each only its own adapter's
    (another's KV would change the tokens)."""
    plan = [(name, (LONG_PREFIX if shared else ()) + prompt_of(salt + i, length, False), delay, max_tokens)
            for i, (name, length, shared, delay, max_tokens) in enumerate(rows)]
    got: list[dict[int, tuple[int, ...]]] = [{}, {}]
    async with open_engine(str(tiny_model(LLAMA)), batch=batch, lora_modules=_modules("qv", "dora"),
                           max_loras=max_loras, prompt_lookup=prompt_lookup) as engine:
        for wave in range(2):

            async def one(i: int, wave: int = wave) -> None:
                name, prompt, delay, max_tokens = plan[i]
                await trio.sleep(delay)
                got[wave][i] = await _tokens(engine, prompt, name, max_tokens)

            async with trio.open_nursery() as nursery:
                for i in order:
                    nursery.start_soon(one, i)
        lane = engine.actors.lane
        with trio.fail_after(10):  # back to idle: every row gave its adapter's slot, its place and its KV back
            while (any(engine.status()["adapters"]["resident"].values()) or lane.in_flight()
                   or lane.admission.statistics().reserved_bytes):
                await trio.sleep(0.01)
    for i, (name, prompt, _, max_tokens) in enumerate(plan):
        want = reference_tokens(name, prompt)[:max_tokens]
        want = want[:-1] if want and want[-1] in _eos() else want  # the engine's tokens do not show the EOS
        assert (got[0][i], got[1][i]) == (want, want), (i, name, len(prompt))


async def test_an_engine_that_serves_adapters_never_compiles_its_decode_step() -> None:
    """A compiled trace would hold the wrapped layers and per-row adapter arrays as constants."""
    async with open_engine(str(tiny_model(LLAMA)), batch=2, lora_modules=_modules("qv"), compile_decode=True) as engine:
        assert engine.model.compile_decode is False
    async with open_engine(str(tiny_model(LLAMA)), batch=2, compile_decode=True) as engine:
        assert engine.model.compile_decode is True


async def test_an_unknown_model_name_is_model_not_found_naming_the_served_ones() -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=2, lora_modules=_modules("qv")) as engine:
        with pytest.raises(ModelNotFound) as info:
            await engine.complete("hi", model="nope", max_tokens=2)
        assert info.value.served == (engine.model_id, "qv") and "'nope'" in str(info.value)
    async with open_engine(str(tiny_model(LLAMA)), batch=2) as engine:  # no adapters: any name is the base
        assert await _tokens(engine, _prompt(1), "gpt-4o", 4) == _want(None, _prompt(1))[:4]


async def test_the_prompt_cache_never_crosses_adapters() -> None:
    """Each adapter reuses its own entries only: same prompt under base, qv, mlp, then each again."""
    long_prompt = tuple((3 * j + 1) % 500 + 3 for j in range(300))
    async with open_engine(str(tiny_model(LLAMA)), batch=4, lora_modules=_modules("qv", "mlp")) as engine:
        prefill = engine.actors.lane.prefill
        cached: list[int] = []
        for name in (None, "qv", "mlp", None, "qv", "mlp"):
            before = prefill.statistics().cached_tokens
            assert await _tokens(engine, long_prompt, name, 6) == _want(name, long_prompt)[:6], name
            cached.append(prefill.statistics().cached_tokens - before)
        # The first request of each (base, qv, mlp) found nothing: another's KV never served it.
        # A repeat found its own prompt (all but the last token).
        assert cached == [0, 0, 0, len(long_prompt) - 1, len(long_prompt) - 1, len(long_prompt) - 1]


async def test_adapter_entries_reach_the_ssd_tier_and_serve_only_their_adapter_after_a_restart(tmp_path) -> None:
    """Stored by one engine, restored by the next from disk: by the same adapter only, never by the base or another.

    The follow-up turn extends the first turn's stored KV (prompt + answer), as an agent's next turn does.
    """
    long_prompt = tuple((5 * j + 2) % 500 + 3 for j in range(300))
    options = dict(batch=4, lora_modules=_modules("qv", "mlp"), prompt_cache_dir=tmp_path)
    async with open_engine(str(tiny_model(LLAMA)), **options) as engine:
        answer = await _tokens(engine, long_prompt, "qv", 6)
        assert answer == _want("qv", long_prompt)[:6]
        with trio.fail_after(60):
            while engine.status()["prompt_cache"]["ssd"]["writes"] < 1:
                await trio.sleep(0.05)
    follow_up = (*long_prompt, *answer, 9, 10, 11)
    async with open_engine(str(tiny_model(LLAMA)), **options) as engine:
        prefill = engine.actors.lane.prefill
        cached = []
        for name in (None, "mlp", "qv"):
            before = prefill.statistics().cached_tokens
            assert await _tokens(engine, follow_up, name, 6) == _want(name, follow_up)[:6], name
            cached.append(prefill.statistics().cached_tokens - before)
        assert cached[:2] == [0, 0] and cached[2] >= len(long_prompt)  # only qv's own entry, read back from disk
        assert engine.status()["prompt_cache"]["ssd"]["reads"] == 1


async def test_a_resume_after_a_decode_step_crash_keeps_the_adapter() -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=4, lora_modules=_modules("qv")) as engine:
        prompt = _prompt(7)
        tokens: list[int] = []
        armed = False
        async for event in engine.generate(list(prompt), model="qv", max_tokens=MAX_TOKENS):
            tokens.extend(getattr(event, "token_ids", ()))
            if len(tokens) >= 3 and not armed:
                engine.faults.arm("decode-step", "raise")
                armed = True
        assert engine.faults.fired
        assert tuple(tokens) == _want("qv", prompt)


async def test_load_and_unload_at_run_time(tmp_path) -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=4, enable_lora_admin=True) as engine:
        assert engine.served_adapters() == ()
        await engine.load_adapter("qv", str(_adapter_dir("llama", "qv")))
        assert await _tokens(engine, _prompt(1), "qv") == _want("qv", _prompt(1))
        narrow = tiny_model(TinyModelSpec("llama", hidden_size=32, heads=2, kv_heads=1))
        from mlx_trio.testing.tiny_adapters import write_adapter
        with pytest.raises(AdapterError, match="the base model needs"):
            await engine.load_adapter("bad", str(write_adapter(narrow, tmp_path / "bad", seed=1)))
        # An unload waits for the rows using the adapter; a request after it is ModelNotFound.
        def using() -> bool:
            return any(cmd.adapter == "qv" for cmd in engine.actors.lane.in_flight())

        while using():  # the first request's row may still be leaving
            await trio.sleep(0.001)
        async with trio.open_nursery() as nursery:
            results: list[tuple[int, ...]] = []

            async def run() -> None:
                results.append(await _tokens(engine, _prompt(2), "qv"))

            nursery.start_soon(run)
            while not using():
                await trio.sleep(0.001)
            await engine.unload_adapter("qv")
            assert results == [_want("qv", _prompt(2))]
        with pytest.raises(ModelNotFound):
            await engine.complete("hi", model="qv", max_tokens=2)
        assert await _tokens(engine, _prompt(1), None) == _want(None, _prompt(1))


async def test_a_request_waits_for_an_adapter_slot_held_by_running_rows() -> None:
    """--max-loras 1: a request for a second adapter waits until the first one's rows leave; base rows go on."""
    async with open_engine(str(tiny_model(LLAMA)), batch=4, max_loras=1, lora_modules=_modules("qv", "mlp")) as engine:
        plan = [("qv", 1), ("mlp", 2), (None, 3), ("qv", 4), ("mlp", 5)]
        got: dict[int, tuple[int, ...]] = {}

        async def one(name: str | None, i: int) -> None:
            got[i] = await _tokens(engine, _prompt(i), name)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for name, i in plan:
                    nursery.start_soon(one, name, i)
        for name, i in plan:
            assert got[i] == _want(name, _prompt(i)), (name, i)


async def test_adapter_rows_speculate_with_their_adapter() -> None:
    """--prompt-lookup: the verifying forward uses each row's adapter, so greedy tokens stay mlx-lm's."""
    repetitive = tuple([5, 9, 13, 17, 21, 25] * 6)
    async with open_engine(str(tiny_model(LLAMA)), batch=4, prompt_lookup=True,
                           lora_modules=_modules("qv", "dora")) as engine:
        plan = [("qv", repetitive), ("dora", repetitive), (None, repetitive), ("qv", _prompt(3))]
        got: dict[int, tuple[int, ...]] = {}

        async def one(i: int, name: str | None, prompt: tuple[int, ...]) -> None:
            got[i] = await _tokens(engine, prompt, name)

        async with trio.open_nursery() as nursery:
            for i, (name, prompt) in enumerate(plan):
                nursery.start_soon(one, i, name, prompt)
        for i, (name, prompt) in enumerate(plan):
            assert got[i] == _want(name, prompt), (i, name)
        assert engine.status()["counters"]["speculative_proposed"] > 0  # the rows did speculate
