"""Run under `mlx.launch -n 2 --backend ring`: rank 0 serves concurrent greedy requests, rank 1 follows.

Rank 0 prints one JSON line, `{"rounds": [[[...], ...], [...]], "world": {...}, ...}`: the token ids
of each prompt in order, for two rounds (the second from the prompt cache); the tests compare them
with a one-process engine's.

Usage: python -m tests.distributed.two_ranks MODEL_PATH BATCH MAX_TOKENS ENGINE_OPTIONS_JSON PROMPT_INDEX...
(ENGINE_OPTIONS_JSON: keyword arguments of `open_engine`, e.g. '{"prompt_lookup": true}', and
"pipeline": true for pipeline parallel instead of tensor parallel)
"""

from __future__ import annotations

import json
import sys

import trio

from mlx_trio import open_engine
from mlx_trio.engine.distributed.leader import leader_for
from mlx_trio.engine.distributed.follower import serve_follower
from mlx_trio.engine.distributed.world import join_world
from tests.prompts import PROMPTS

# ~300 tokens before each prompt: long enough that a batched row's KV goes to the prompt cache when it
# finishes (actors/decode_step.py, EXTRACT_MIN_PROMPT_TOKENS), so the second round starts from hits.
SHARED = (" ".join(PROMPTS) + " ") * 4


def prompt(index: int) -> str:
    return SHARED + PROMPTS[index]


async def _serve(path: str, batch: int, max_tokens: int, options: dict, prompts: list[str]) -> tuple[list[list[tuple[int, ...]]], int, dict]:
    """Two rounds of the prompts at once: the second starts from the first's prompt-cache entries."""
    rounds: list[list[tuple[int, ...]]] = []
    async with open_engine(path, batch=batch, **options) as engine:
        model = engine.actors.lane.model
        assert model is not None
        for _ in range(2):
            got: dict[int, tuple[int, ...]] = {}

            async def one(i: int) -> None:
                got[i] = (await engine.complete(prompts[i], max_tokens=max_tokens)).token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            rounds.append([got[i] for i in range(len(prompts))])
        status = engine.status()
    return rounds, model.weights_bytes, status


def main(argv: list[str]) -> int:
    path, batch, max_tokens, options = argv[0], int(argv[1]), int(argv[2]), json.loads(argv[3])
    prompts = [prompt(int(i)) for i in argv[4:]]
    world = join_world(pipeline=options.pop("pipeline", False))
    if not world.leader:
        serve_follower(world)
        return 0
    leader = leader_for(world)
    assert leader is not None
    try:
        rounds, weights, status = trio.run(_serve, path, batch, max_tokens, options, prompts)
    finally:
        leader.stop_followers()
    print(json.dumps({"rounds": rounds, "cache_hits": status["prompt_cache"]["hits"],
                      "speculative_proposed": status["counters"]["speculative_proposed"],
                      "world": {"size": world.size, "backend": world.backend},
                      "weights_bytes": weights, "jobs": leader.jobs, "bytes": leader.bytes_sent}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
