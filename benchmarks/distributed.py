"""Scale-out (issue #27): R ranks vs 1 on one model: tok/s, TTFT, and the broadcast's cost per lease job.

Usage:
    PYTHONPATH=$PWD python benchmarks/distributed.py --tiny                 # CPU, ring over loopback, < 1 min
    PYTHONPATH=$PWD python benchmarks/distributed.py --model PATH --ranks 2 [--backend ring|nccl]

A mechanism check, not a speed claim: on one CPU the ranks share the same cores, so tensor
parallel can only cost (every layer adds two `all_sum`s; every lease job one more for its
broadcast). The numbers say what the seam costs: `broadcast_ms/job` is the time rank 0's lease
spends sending each job to the followers (engine/distributed/frames.py), `bytes/job` its size.

Each configuration runs in a fresh process: 1 rank as a plain process, R ranks under
`mlx.launch -n R`. In each, `--requests` greedy requests arrive together (batched, --batch equal
to them) after one warm-up request; prints a markdown table, `--json PATH` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORDS = ("Write a short story about a lighthouse keeper who finds a message in a bottle, and what "
         "the message says about the sea, the sky and the keeper's long nights alone.")


async def _workload(model: str, requests: int, tokens: int) -> dict[str, Any]:
    import trio

    from mlx_trio import open_engine
    from mlx_trio.events import Finished, TextDelta

    # A long collective deadline: ranks that share two loaded cores may miss the default's heartbeat.
    async with open_engine(model, batch=requests, collective_timeout_s=120.0) as engine:
        await engine.complete(_chat(WORDS), max_tokens=4)  # warm-up: the first graphs
        ttft: list[float] = []
        generated = 0

        async def one(i: int) -> None:
            nonlocal generated
            start = time.perf_counter()
            first = True
            async for event in engine.generate(_chat(f"{i}: {WORDS}"), max_tokens=tokens, temperature=0.0):
                if isinstance(event, TextDelta) and first:
                    ttft.append(time.perf_counter() - start)
                    first = False
                elif isinstance(event, Finished):
                    generated += event.usage.completion_tokens

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(requests):
                nursery.start_soon(one, i)
        wall = time.perf_counter() - start
        weights = engine.actors.lane.model.weights_bytes
    return {"tok_s": generated / wall, "ttft_ms": 1000 * sum(ttft) / len(ttft), "wall_s": wall,
            "tokens": generated, "weights_mib": weights / 2**20}


def _chat(text: str) -> list[dict[str, str]]:
    """One user message: an instruct model answers it (a bare prompt may end at once on its EOS)."""
    return [{"role": "user", "content": text}]


def worker(args: argparse.Namespace) -> None:
    """One configuration, in this process: 1 rank, or one rank of mlx.launch's group."""
    import trio

    from mlx_trio.engine.distributed.follower import serve_follower
    from mlx_trio.engine.distributed.leader import leader_for
    from mlx_trio.engine.distributed.world import join_world

    world = join_world(pipeline=args.pipeline)
    if not world.leader:
        serve_follower(world)
        return
    leader = leader_for(world)
    try:
        result = trio.run(_workload, args.model, args.requests, args.tokens)
    finally:
        if leader is not None:
            leader.stop_followers()
    if leader is not None:
        result |= {"jobs": leader.jobs, "broadcast_ms_per_job": 1000 * leader.broadcast_s / max(leader.jobs, 1),
                   "bytes_per_job": leader.bytes_sent / max(leader.jobs, 1)}
    split = "pipeline" if args.pipeline and world.size > 1 else "tensor" if world.size > 1 else "-"
    print("RESULT " + json.dumps({"ranks": world.size, "split": split, **result}), flush=True)


def _run(command: list[str]) -> dict[str, Any]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{' '.join(command[:6])}... failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default with --tiny: the tiny Llama)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight Llama (CPU check)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", default="ring")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--pipeline", action="store_true",
                        help="pipeline parallel (mlx-lm's pipeline(): qwen2, ...); with --tiny a tiny qwen2")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny and args.model is None:
        from mlx_trio.testing.tiny_models import LLAMA, TinyModelSpec, tiny_model

        args.model = str(tiny_model(TinyModelSpec("qwen2") if args.pipeline else LLAMA))
    if args.worker:
        worker(args)
        return
    here = [sys.executable, __file__, "--worker", "--model", args.model, "--requests", str(args.requests),
            "--tokens", str(args.tokens), *(["--pipeline"] if args.pipeline else [])]
    launcher = [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
                "-n", str(args.ranks), "--backend", args.backend, "--python", sys.executable, "--"]
    rows = [_run(here), _run(launcher + here[1:])]
    keys = ["ranks", "split", "tok_s", "ttft_ms", "weights_mib", "jobs", "broadcast_ms_per_job", "bytes_per_job"]
    print(f"\nmodel {args.model}, {args.requests} concurrent greedy requests x {args.tokens} tokens, "
          f"backend {args.backend}\n")
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(_cell(row.get(k)) for k in keys) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def _cell(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")  # as the engine's lease thread
    main()
