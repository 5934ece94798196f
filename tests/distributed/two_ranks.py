"""Run under `mlx.launch -n 2 --backend ring`: rank 0 serves concurrent greedy requests, rank 1 follows.

Rank 0 prints one JSON line, `{"tokens": [[...], ...], "world": {...}}`, the token ids of each
prompt in order; the tests compare them with a one-process engine's.

Usage: python -m tests.distributed.two_ranks MODEL_PATH BATCH MAX_TOKENS PROMPT_INDEX...
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


async def _serve(path: str, batch: int, max_tokens: int, prompts: list[str]) -> tuple[list[tuple[int, ...]], int]:
    got: dict[int, tuple[int, ...]] = {}
    async with open_engine(path, batch=batch) as engine:
        model = engine.actors.lane.model
        assert model is not None
        async def one(i: int) -> None:
            got[i] = (await engine.complete(prompts[i], max_tokens=max_tokens)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    return [got[i] for i in range(len(prompts))], model.weights_bytes


def main(argv: list[str]) -> int:
    path, batch, max_tokens = argv[0], int(argv[1]), int(argv[2])
    prompts = [PROMPTS[int(i)] for i in argv[3:]]
    world = join_world()
    if not world.leader:
        serve_follower(world)
        return 0
    leader = leader_for(world)
    assert leader is not None
    try:
        tokens, weights = trio.run(_serve, path, batch, max_tokens, prompts)
    finally:
        leader.stop_followers()
    print(json.dumps({"tokens": tokens, "world": {"size": world.size, "backend": world.backend},
                      "weights_bytes": weights, "jobs": leader.jobs, "bytes": leader.bytes_sent}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
