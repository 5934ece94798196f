"""Prompts shared by the engine-level tests (batch lane, faults): different lengths, plain English."""

PROMPTS = [
    "Once upon a time there was",
    "The wind over the water",
    "A story about a ship and the sea and the long shore",
    "Hello there",
    "the the the sea sea",
    "Item 4 is a small note",
    "Tell me about the sea.",
    "What is the capital",
]


def solo_tokens(max_tokens: int) -> list[tuple[int, ...]]:
    """Each of PROMPTS' undisturbed greedy tokens on the tiny llama at --batch 1 (no other request shares a step):
    what a stream must equal whatever happened around it (faults, memory pressure)."""
    import trio

    from mlx_trio import open_engine
    from mlx_trio.testing.tiny_models import LLAMA, tiny_model

    async def main() -> list[tuple[int, ...]]:
        async with open_engine(str(tiny_model(LLAMA)), batch=1) as engine:
            return [(await engine.complete(p, max_tokens=max_tokens)).token_ids for p in PROMPTS]

    return trio.run(main)


async def run_to_end(engine, prompt, max_tokens: int = 8):
    """One request's generated token ids and its `Finished` event."""
    from mlx_trio.events import Finished, TextDelta

    ids: list[int] = []
    async for event in engine.generate(prompt, max_tokens=max_tokens):
        if isinstance(event, TextDelta):
            ids.extend(event.token_ids)
        elif isinstance(event, Finished):
            return tuple(ids), event
    raise AssertionError("no Finished event")


async def complete_together(engine, prompts, max_tokens: int) -> dict[int, list[int]]:
    """Each prompt's greedy token ids, all requests sent at once (by index in `prompts`)."""
    import trio

    got: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        got[i] = list((await engine.complete(prompts[i], max_tokens=max_tokens)).token_ids)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return got
