"""The client side of `stall_profile.py --http`: SSE streams, then long prompts, timed on the shared clock.

Run by stall_profile.py as a separate process, so that parsing SSE does not
compete for the server's GIL (as with a real client). Times are
`time.perf_counter()`, which on Linux is CLOCK_MONOTONIC and so comparable
with the server process's lease job log. Prints one JSON object:
`{"streams": [[t, ...], ...], "tokens": [n, ...], "rounds": [[arrived, first], ...]}`,
where `tokens` are the usage counts of the streams (against their content chunks:
how many tokens the streaming detokenizer released per chunk).
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import httpx
import trio

from mlx_trio.bench.client import RequestResult, RequestSpec, messages, stream_chat
from mlx_trio.bench.metrics import chunk_times_s
from mlx_trio.bench.workloads import words


async def run(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(0)
    results: list[RequestResult | None] = [None] * args.streams
    started = [False] * args.streams
    all_started = trio.Event()
    if not args.streams:
        all_started.set()
    timeout = httpx.Timeout(600.0, connect=10.0, pool=None)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=args.streams + 2)) as client:

        async def stream(i: int) -> None:
            def first() -> None:
                started[i] = True
                if all(started):
                    all_started.set()

            spec = RequestSpec(messages(None, (), f"Write about {words(rng, 48)}."), args.stream_tokens)
            results[i] = await stream_chat(client, args.url, spec, tag="background", on_first_token=first)

        rounds: list[tuple[float, float]] = []
        async with trio.open_nursery() as nursery:
            for i in range(args.streams):
                nursery.start_soon(stream, i)
            await all_started.wait()
            for _ in range(args.rounds):
                await trio.sleep(0.5)
                spec = RequestSpec(messages(None, (), f"Summarize: {words(rng, args.long_words)}."), 8)
                long = await stream_chat(client, args.url, spec, tag="long")
                if long.ttft_s is None:
                    raise RuntimeError(f"the long prompt failed: {long.error}")
                rounds.append((long.start_s, long.start_s + long.ttft_s))
                await trio.sleep(1.0)
            # The streams run to their end (not cancelled), so their usage counts arrive.
    streams = [result for result in results if result is not None]
    if failed := [result.error for result in streams if not result.ok]:
        raise RuntimeError(f"background streams failed: {failed}")
    if any(result.end_s < rounds[-1][1] + 1.0 for result in streams):
        print("stall_client: a stream ended before the last round: raise --stream-tokens", file=sys.stderr)
    return {"streams": [chunk_times_s(result) for result in streams],
            "tokens": [result.completion_tokens for result in streams], "rounds": rounds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=1024)
    p.add_argument("--long-words", type=int, default=2500)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(json.dumps(trio.run(run, args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
