"""A burst of short chats prepared at once: in worker threads, or on the Trio thread (issue #20).

Usage:
    python benchmarks/prepare_burst.py                 # the tiny random llama's tokenizer, this CPU, seconds
    python benchmarks/prepare_burst.py --model DIR --burst 64 --rounds 5

A closed loop's wave (c requests sent the moment the last ones ended) is
prepared (chat template, tokens: `LoadedModel.encode`, the bulk of
`Engine.prepare`) all at once. Each short prepare is a fraction of a
millisecond of GIL-bound Python; handed to `trio.to_thread` each also pays a
worker thread's hand-off both ways. This times `--burst` concurrent prepares
of ~8-word chats both ways, alternated over `--rounds`: when the last one is
done and the median one (ms from the burst's start). `Engine.prepare_off_loop`
prepares such prompts inline (api.py `prepares_inline`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import trio

from mlx_trio.engine.model.load import load_model
from mlx_trio.testing.tiny_models import LLAMA, tiny_model


def _chat(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"request {i}: alpha bravo charlie delta echo foxtrot golf"}]


async def burst(encode: Callable[[list[dict[str, str]]], list[int]], inline: bool, n: int) -> tuple[float, float]:
    """`n` concurrent prepares; (the last one's, the median one's) ms from the start."""
    start = time.perf_counter()
    done: list[float] = []

    async def one(i: int) -> None:
        if inline:
            await trio.lowlevel.checkpoint()
            encode(_chat(i))
        else:
            await trio.to_thread.run_sync(encode, _chat(i))
        done.append((time.perf_counter() - start) * 1e3)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return max(done), statistics.median(done)


async def main(args: argparse.Namespace) -> None:
    model = load_model(args.model or str(tiny_model(LLAMA)))
    for i in range(20):
        model.encode(_chat(i))
    results: dict[str, list[tuple[float, float]]] = {"thread": [], "inline": []}
    for r in range(args.rounds):
        for mode in (("thread", "inline") if r % 2 == 0 else ("inline", "thread")):
            results[mode].append(await burst(model.encode, mode == "inline", args.burst))
    print(f"| mode | burst | last done, ms (median of {args.rounds}) | median request, ms |")
    print("|---|---:|---:|---:|")
    for mode, runs in results.items():
        print(f"| {mode} | {args.burst} | {statistics.median(r[0] for r in runs):.1f} | "
              f"{statistics.median(r[1] for r in runs):.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the tiny random Llama)")
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    trio.run(main, parser.parse_args())
