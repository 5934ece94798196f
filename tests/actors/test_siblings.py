"""Siblings that share a long prefix prefill it once (actors/siblings.py, docs/design.md §2.6.1), with the tokens
each prompt gets alone."""

from __future__ import annotations

import trio
from hypothesis import given
from hypothesis import strategies as st

from mlx_trio import open_engine
from mlx_trio.actors.siblings import common_prefix, shared_with, sibling_point
from mlx_trio.events import Finished, TextDelta
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.prompts import run_to_end
from mlx_trio.actors.messages import Generate
from mlx_trio.params import SamplingParams

PREFIX = "The shared context of every sibling agent, a long file they all read. " * 30
TAILS = [f" Task {i}: " + f"item {i} " * 9 for i in range(8)]


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_counts_the_leading_tokens_two_prompts_share(a: list[int], b: list[int]) -> None:
    naive = 0
    while naive < min(len(a), len(b)) and a[naive] == b[naive]:
        naive += 1
    assert common_prefix(tuple(a), tuple(b)) == naive


def generate(request_id: str, prompt_ids: tuple[int, ...], adapter: str | None = None) -> Generate:
    send, _ = trio.open_memory_channel(0)
    return Generate(request_id, prompt_ids, SamplingParams(), send, adapter=adapter)


def test_a_sibling_point_needs_a_long_enough_stretch_the_same_adapter_and_stops_before_the_last_token() -> None:
    base = generate("a", tuple(range(600)) + (1,))
    sibling = generate("b", tuple(range(600)) + (2, 3))
    prefix_only = generate("c", tuple(range(600)))
    other_adapter = generate("d", tuple(range(600)) + (2, 3), adapter="tuned")
    assert shared_with(base, sibling) == 600
    assert shared_with(base, prefix_only) == 599  # each prompt's last token is its own row's to compute
    assert shared_with(base, base) == 0 and shared_with(base, other_adapter) == 0
    assert sibling_point(base, [base, sibling, other_adapter], start=0, minimum=256) == 600
    assert sibling_point(base, [sibling], start=400, minimum=256) is None  # 200 tokens past the cached 400
    # One sibling shares 600, three share 590: a snapshot at 590 serves all four.
    near = [generate(f"n{i}", tuple(range(590)) + (7, i)) for i in range(3)]
    assert sibling_point(base, [sibling, *near], start=0, minimum=256) == 590
    # Two share 600, one shares 300: 1200 tokens saved at 600 against 900 at 300.
    far = generate("f", tuple(range(300)) + (9,))
    assert sibling_point(base, [sibling, generate("s2", sibling.prompt_ids + (4,)), far], start=0, minimum=256) == 600


async def _alone(prompts: list[str], max_tokens: int) -> list[tuple[int, ...]]:
    """Each prompt on an engine of its own, no prompt cache: the tokens a sibling must get."""
    out = []
    for prompt in prompts:
        async with open_engine(str(tiny_model(LLAMA)), batch=1, prompt_cache_bytes=0) as engine:
            out.append((await run_to_end(engine, prompt, max_tokens))[0])
    return out


async def _idle(engine) -> None:
    """Every row and reservation is given back once the last stream ended (the last leave is a step behind)."""
    lane = engine.actors.lane
    with trio.move_on_after(5):
        while lane.in_flight() or lane.admission.statistics().reserved_bytes:
            await trio.sleep(0.01)
    assert not lane.in_flight()
    assert lane.admission.statistics().reserved_bytes == 0 and lane.admission.statistics().in_flight_rows == 0


async def test_eight_siblings_arriving_together_prefill_their_shared_prefix_once() -> None:
    prompts = [PREFIX + tail for tail in TAILS]
    results: dict[int, tuple[tuple[int, ...], Finished]] = {}
    async with open_engine(str(tiny_model(LLAMA)), batch=16) as engine:
        lengths = [len(engine.prepare(p).prompt_ids) for p in prompts]
        prefix = common_prefix(engine.prepare(prompts[0]).prompt_ids, engine.prepare(prompts[1]).prompt_ids)
        assert prefix > 1000 and engine.prepare(prompts[0]).snapshot_at is None  # no message boundary to help

        async def one(i: int) -> None:
            results[i] = await run_to_end(engine, prompts[i], 6)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        prefilled = engine.actors.lane.prefill.statistics().prefill_tokens
        await _idle(engine)
    cached = [results[i][1].usage.cached_tokens for i in range(len(prompts))]
    assert sorted(cached)[0] == 0 and all(c >= prefix - 1 for c in sorted(cached)[1:])
    # Every prompt token but each prompt's last was prefilled or cached: the prefix was prefilled once.
    assert prefilled == sum(n - 1 for n in lengths) - sum(cached)
    assert prefilled <= 1.3 * (prefix + sum(n - prefix for n in lengths))
    assert [results[i][0] for i in range(len(prompts))] == await _alone(prompts, 6)


async def test_a_sibling_arriving_while_the_first_prefills_waits_for_its_prefix() -> None:
    """Small chunks: the first prompt is still prefilling when its sibling comes; the sibling prefills only its tail."""
    prompts = [PREFIX * 2 + TAILS[0], PREFIX * 2 + TAILS[1]]
    results: dict[int, tuple[tuple[int, ...], Finished]] = {}
    async with open_engine(str(tiny_model(LLAMA)), batch=4, prefill_step_size=128) as engine:
        prefix = common_prefix(engine.prepare(prompts[0]).prompt_ids, engine.prepare(prompts[1]).prompt_ids)
        started = trio.Event()

        async def first() -> None:
            ids: list[int] = []
            async for event in engine.generate(prompts[0], max_tokens=6):
                started.set()  # prefill progress: the first chunks ran
                if isinstance(event, TextDelta):
                    ids.extend(event.token_ids)
                elif isinstance(event, Finished):
                    results[0] = (tuple(ids), event)

        async def second() -> None:
            await started.wait()
            results[1] = await run_to_end(engine, prompts[1], 6)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            nursery.start_soon(second)
        await _idle(engine)
    assert results[0][1].usage.cached_tokens == 0
    assert results[1][1].usage.cached_tokens >= prefix - 128  # at most the chunk it came in
    assert [results[i][0] for i in range(2)] == await _alone(prompts, 6)
