"""Prefill throughput under load against a lone prompt's (issue #46 point 2: at least 0.8x).

Usage:
    PYTHONPATH=$PWD python benchmarks/prefill_budget.py                     # CPU, a small random llama
    python benchmarks/prefill_budget.py --model DIR --tokens 12288 --step 2048   # a device (benchmarks/gpu.sh)

Prefills `--prompts` prompts of `--tokens` tokens one after another and reports prompt tokens per second from
submit to token 0: alone (nothing decodes; full --prefill-step-size chunks, as mlx-lm), and beside `--batch` - 2
rows decoding (the busy prefill budget, docs/design.md §2.2.3), for each `--batches`, with the ratio to the lone rate.
Speed only; the tests check tokens. (The A/B against one chunk per busy job is decided: docs/design.md §2.2.3.)
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import attrs
import trio

from mlx_trio import open_engine
from mlx_trio.events import TextDelta
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

MODEL = attrs.evolve(LLAMA, max_position_embeddings=16384)


def _prompt(n: int, seed: int) -> list[int]:
    """Random token ids: no prompt starts with another's whole prompt, which would make its cache lookup wait for
    that row's finish-time put (docs/design.md §6.3's pending puts; an arithmetic sequence did, a second a
    prompt)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 503) for _ in range(n)]


async def _prefill_rate(engine: Any, prompts: list[list[int]]) -> float:
    tokens = seconds = 0.0
    for prompt in prompts:
        start = time.perf_counter()
        async for event in engine.generate(prompt, max_tokens=2):
            if isinstance(event, TextDelta):
                seconds += time.perf_counter() - start
                tokens += len(prompt)
                break
    return tokens / seconds


async def _run(args: argparse.Namespace, batch: int, load: int) -> float:
    prompts = [_prompt(args.tokens, seed) for seed in range(args.prompts)]
    model = args.model or str(tiny_model(MODEL))
    async with open_engine(model, batch=batch, prefill_step_size=args.step) as engine:
        await _prefill_rate(engine, [_prompt(args.tokens, 99)])  # warm: compile, the sizer's first samples
        async with trio.open_nursery() as nursery:
            started = trio.Event()
            running = [0]

            async def decoder(seed: int) -> None:
                async for event in engine.generate(_prompt(16, 1000 + seed), max_tokens=12000):
                    if isinstance(event, TextDelta):
                        running[0] += 1
                        if running[0] >= load:
                            started.set()
                        break
                async for _ in engine.generate(_prompt(16, 1000 + seed), max_tokens=12000):
                    pass

            for seed in range(load):
                nursery.start_soon(decoder, seed)
            if load:
                with trio.move_on_after(120):
                    while engine.actors.lane.decoding_rows < load:
                        await trio.sleep(0.05)
            rate = await _prefill_rate(engine, prompts)
            nursery.cancel_scope.cancel()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--step", type=int, default=64, help="--prefill-step-size (below the 100 ms target here)")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--model", help="a model directory (default: a small random llama built here)")
    args = parser.parse_args()
    lone = trio.run(_run, args, 8, 0)
    print(f"lone prompt ({args.tokens} tokens): {lone:,.0f} tok/s")
    for batch in args.batches:
        rate = trio.run(_run, args, batch, batch - 2)
        print(f"--batch {batch} ({batch - 2} rows decoding): {rate:,.0f} tok/s = {rate / lone:.2f} x lone")


if __name__ == "__main__":
    main()
