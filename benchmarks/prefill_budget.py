"""Prefill throughput under load (issue #46 point 2): the busy prefill budget vs one chunk per lease job.

Usage:
    PYTHONPATH=$PWD python benchmarks/prefill_budget.py       # CPU, a small random llama: a few minutes

For each mode (``before``: one sized chunk per busy lease job, as before the budget; ``after``: chunks packed
up to the target, `plan_chunks`) it prefills `--prompts` prompts of `--tokens` tokens one after another and
reports prompt tokens per second from submit to token 0: alone (nothing decodes), and beside `--batch` - 2
rows decoding, for each `--batches`. Speed only; the tests check tokens.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import attrs
import trio

from mlx_trio import open_engine
from mlx_trio.actors import prefill as prefill_module
from mlx_trio.events import TextDelta
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

MODEL = attrs.evolve(LLAMA, max_position_embeddings=16384)


def _prompt(n: int, seed: int) -> list[int]:
    return [3 + (31 * i + 17 * seed) % 500 for i in range(n)]


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
    async with open_engine(str(tiny_model(MODEL)), batch=batch, prefill_step_size=args.step) as engine:
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


def _before() -> None:
    plan = prefill_module.plan_chunks
    prefill_module.plan_chunks = lambda *a, **k: plan(*a, **k)[:1]  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--step", type=int, default=64, help="--prefill-step-size (below the 100 ms target here)")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--mode", choices=["before", "after"], required=True)
    args = parser.parse_args()
    if args.mode == "before":
        _before()
    lone = trio.run(_run, args, 8, 0)
    print(f"{args.mode}: lone prompt {lone:,.0f} tok/s")
    for batch in args.batches:
        rate = trio.run(_run, args, batch, batch - 2)
        print(f"{args.mode}: --batch {batch} ({batch - 2} rows decoding) {rate:,.0f} tok/s = {rate / lone:.2f} x lone")


if __name__ == "__main__":
    main()
