"""--kv-layout paged: admission credits an adapter row's cached prefix too (docs/design.md §6.5).

An adapter row's blocks are keyed under its adapter's revision, so the pin (admission, a lease job) and the join
(the row's lease job) must read one revision: `Engine.load_adapter` refuses to replace a name while a request
names it. Siblings of one adapter with a long shared prefix run together where the conservative count queued
them, each with that adapter's tokens alone (mlx-lm `load(adapter_path=)` + `generate_step`); a base request and
an adapter request (or two adapters) of one prompt never share a block; and every pool and pin is idle after.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
import trio
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_trio import open_engine
from mlx_trio.errors import AdapterError
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.actors.test_admission_prefix_credit import BUDGET, MAX_TOKENS, PREFIX, SIBLINGS
from tests.actors.test_paged_cohort import _idle_pool
from tests.engine.adapters.test_row_lora import _adapter_dir

BLOCK = 16
CACHED = len(PREFIX)  # 10 full blocks


def _modules(*names: str) -> dict[str, str]:
    return {name: str(_adapter_dir("llama", name)) for name in names}


def _mlx_lm(adapter: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, ...]]:
    """Each prompt's greedy tokens from mlx-lm with the adapter, alone (EOS left out, as `token_ids` does)."""
    model, tokenizer = load(str(tiny_model(LLAMA)), adapter_path=str(_adapter_dir("llama", adapter)))
    out = []
    for prompt in prompts:
        tokens = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
            if int(token) in tokenizer.eos_token_ids:
                break
            tokens.append(int(token))
        out.append(tuple(tokens))
    return out


async def _complete(engine, prompt: list[int], model: str | None, max_tokens: int = MAX_TOKENS):
    return await engine.complete(prompt, model=model, max_tokens=max_tokens, temperature=0)


async def test_adapter_siblings_sharing_a_cached_prefix_are_admitted_together_with_that_adapters_tokens() -> None:
    expected = _mlx_lm("qv", SIBLINGS, MAX_TOKENS)
    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="paged", kv_budget_bytes=BUDGET,
                           lora_modules=_modules("qv")) as engine:
        # The budget admits 8 credited rows (10 shared + 8 x 7 own blocks), not 8 conservative ones (8 x 17):
        # see test_admission_prefix_credit.py, whose numbers these are.
        first = await _complete(engine, SIBLINGS[0], "qv")
        assert first.token_ids == expected[0] and first.usage.cached_tokens == 0
        await _idle_pool(engine)
        admission = engine.actors.lane.admission

        async def one(i: int) -> None:
            out[i] = await _complete(engine, SIBLINGS[i], "qv")

        out: list = [None] * len(SIBLINGS)
        peak = 0
        async with trio.open_nursery() as nursery:
            for i in range(len(SIBLINGS)):
                nursery.start_soon(one, i)
            while any(o is None for o in out):
                peak = max(peak, admission.statistics().in_flight_rows)
                await trio.sleep(0)
        assert peak == len(SIBLINGS), f"only {peak} adapter siblings were admitted together"
        assert [o.token_ids for o in out] == expected
        assert all(o.usage.cached_tokens >= CACHED for o in out)  # each referenced its revision's prefix
        await _idle_pool(engine)


async def test_a_base_request_and_adapter_requests_of_one_prompt_never_share_blocks() -> None:
    prompt = SIBLINGS[0]
    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="paged", kv_budget_bytes=BUDGET,
                           lora_modules=_modules("qv", "mlp")) as engine:
        cached = []
        for model in (None, "qv", "mlp"):
            cached.append((await _complete(engine, prompt, model, max_tokens=2)).usage.cached_tokens)
            await _idle_pool(engine)
        assert cached == [0, 0, 0]  # each under its own root: nobody's prefix served another
        blocks = engine.status()["counters"]["kv_blocks"]
        assert blocks["cached"] >= 3 * CACHED // BLOCK  # three copies of the prefix, one a root
        again = [(await _complete(engine, prompt, model, max_tokens=2)).usage.cached_tokens
                 for model in ("mlp", None, "qv")]
        assert again == [CACHED] * 3  # and each root's own blocks serve its own rows
        await _idle_pool(engine)


async def test_an_adapter_row_whose_revision_cached_its_prefix_prefills_solo_computing_its_tail() -> None:
    """The cohort choice looks the first block up under the adapter's revision: a cached one keeps the row off a
    cohort (which would recompute the prefix), so it prefills solo and computes only its tail."""
    from tests.actors.test_paged_cohort import FRESH

    sibling = SIBLINGS[1]
    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="paged", kv_budget_bytes=BUDGET,
                           lora_modules=_modules("qv")) as engine:
        await _complete(engine, SIBLINGS[0], "qv", max_tokens=2)  # the prefix cached under qv's revision
        await _idle_pool(engine)
        prefill = engine.actors.lane.prefill
        # Unpinned (the pin is what admission gives it): the cohort choice alone decides.
        lane = engine.actors.lane
        cmd = SimpleNamespace(request_id="x", adapter="qv", prompt_ids=tuple(sibling))
        assert not prefill._starts_uncached(cmd, [])
        assert prefill._starts_uncached(SimpleNamespace(request_id="y", adapter="qv", prompt_ids=tuple(FRESH[0])), [])
        # Not cached under the base model's root: a base row of the same prompt may cohort.
        assert prefill._starts_uncached(SimpleNamespace(request_id="z", adapter=None, prompt_ids=tuple(sibling)), [])
        assert not lane.pins
        usage = await _complete(engine, sibling, "qv", max_tokens=2)
        assert usage.usage.cached_tokens == CACHED
        await _idle_pool(engine)


async def test_load_adapter_is_refused_while_a_request_names_it_and_accepted_after() -> None:
    """Refused while a request naming the adapter waits for a slot (`--max-loras 1`, held by another adapter's
    row: the register job's own in-use check would pass, and the revision could change between the request's
    pin and its join), while it runs, and while a pin of its revision is held; accepted once nothing names it,
    the new revision's tokens from then on."""

    async with open_engine(str(tiny_model(LLAMA)), batch=2, max_loras=1, kv_layout="paged",
                           kv_budget_bytes=BUDGET, lora_modules=_modules("qv", "mlp")) as engine:
        lane = engine.actors.lane
        await engine.wait_ready()
        started = trio.Event()
        other = _adapter_dir("llama", "dora")

        async def long(model: str) -> None:
            async for _ in engine.generate(SIBLINGS[0], model=model, max_tokens=MAX_TOKENS, temperature=0):
                started.set()
                await trio.sleep(0.01)  # keep it in flight while the loads are tried

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long, "mlp")  # holds the one adapter slot: a qv row waits for it
            await started.wait()
            nursery.start_soon(long, "qv")
            with trio.fail_after(5):
                while not any(cmd.adapter == "qv" for cmd in [*lane.admission.queued(), *lane.in_flight()]):
                    await trio.sleep(0.005)
            assert not lane.adapters.in_use("qv")
            with pytest.raises(AdapterError, match="'qv' is named by queued or running requests: unload it first"):
                await engine.load_adapter("qv", str(other))
        # A pin of qv's revision (its request between admission and the prefill actor's inbox): still refused.
        paged = lane.model.paged_kv
        from mlx_trio.engine.prompt_cache.namespace import kv_revision

        lane.pins["between"] = SimpleNamespace(root=paged.peek_root(kv_revision("qv", lane.adapters.revisions["qv"])))
        try:
            with pytest.raises(AdapterError, match="'qv' is named by"):
                await engine.load_adapter("qv", str(other))
        finally:
            del lane.pins["between"]
        await _idle_pool(engine)
        before = lane.adapters.revisions["qv"]
        await engine.load_adapter("qv", str(other))  # nothing names it now
        assert lane.adapters.revisions["qv"] != before
        expected = _mlx_lm("dora", [SIBLINGS[0]], 4)
        replaced = await _complete(engine, SIBLINGS[0], "qv", max_tokens=4)
        assert replaced.token_ids == expected[0]
        assert replaced.usage.cached_tokens == 0  # the old revision's blocks serve no row of the new one
        await _idle_pool(engine)


async def test_an_adapter_sibling_of_its_cached_prefix_prefills_its_tail_alone_while_fresh_adapter_prompts_cohort(
) -> None:
    """test_paged_cohort.py's wave with every row under one adapter: the sibling of a prefix cached under the
    adapter's revision is pinned and credited, prefills solo and computes only its tail; the fresh ones cohort."""
    import threading

    from tests.actors.test_paged_cohort import FRESH, MAX_TOKENS as COHORT_TOKENS, PREFIX as SHORT_PREFIX, SIBLING

    wave = [*FRESH[:4], SIBLING]
    expected = _mlx_lm("qv", wave, COHORT_TOKENS)
    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="paged", kv_budget_bytes=16 << 20,
                           lora_modules=_modules("qv")) as engine:
        await _complete(engine, SHORT_PREFIX + [7], "qv", max_tokens=2)  # caches the prefix under qv's revision
        await _idle_pool(engine)
        lane = engine.actors.lane
        before, admitted = lane.prefill.statistics(), lane.admission.statistics().admitted
        release = threading.Event()
        lane.lease.submit_nowait(release.wait, 30.0)  # hold the lease until the whole wave is queued
        out: list = [None] * len(wave)

        async def one(i: int) -> None:
            out[i] = await _complete(engine, wave[i], "qv", max_tokens=COHORT_TOKENS)

        try:
            async with trio.open_nursery() as nursery:
                for i in range(len(wave)):
                    nursery.start_soon(one, i)
                with trio.move_on_after(10):
                    while len(lane.admission.queued()) + lane.admission.statistics().admitted - admitted < len(wave):
                        await trio.sleep(0.005)
                release.set()
        finally:
            release.set()
        after = lane.prefill.statistics()
        assert [o.token_ids for o in out] == expected
        assert out[-1].usage.cached_tokens == len(SHORT_PREFIX)  # the sibling computed only its tail
        assert [o.usage.cached_tokens for o in out[:-1]] == [0] * 4
        assert after.cohort_rows - before.cohort_rows >= 3  # the fresh ones (all but one at most) as a cohort
        await _idle_pool(engine)
