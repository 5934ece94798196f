"""Decode at B rows whose prompts are all one length against rows whose prompts differ (issue #20).

Usage:
    python benchmarks/padded_rows.py --tiny                                 # this CPU, a few seconds a run
    python benchmarks/padded_rows.py --model /tmp/mlx-trio-gpu-models/llama-1b   # the H200

`serve_vs_engine.py`'s engine reference decodes B prompts of exactly 32
tokens: they join as one cohort of equal rows, so every decode step is an
unpadded one (no mask, shared offsets). A serving load's prompts differ by a
few tokens, so its batch is left-padded and every step is a padded one (an
array mask, or the ragged kernel on CUDA). This measures what that costs the
engine alone: `engine_run` (batch_throughput.py) at B rows, prompts of
`--tokens` each ("equal") against prompts spread over tokens ± `--spread`
("ragged"), rounds alternated, the decode window's tok/s, the step jobs' ms a
step, and the lease and Trio threads' CPU µs a step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from mlx_trio import open_engine
from mlx_trio.testing.shaped_models import resolve_model

from batch_throughput import FIRST_PROMPT_ID, PROMPT_ID_LIMIT, SERVE_SWITCH_INTERVAL_S, engine_run

KEYS = ("dec_tok_s", "job_ms_per_step", "lease_cpu_us_per_step", "trio_cpu_us_per_step")


def prompts(rows: int, tokens: int, spread: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(PROMPT_ID_LIMIT, vocab)
    return [[rng.randrange(FIRST_PROMPT_ID, hi) for _ in range(tokens + rng.randint(-spread, spread))]
            for _ in range(rows)]


async def bench(model: str, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {"equal": [], "ragged": []}
    async with open_engine(model, batch=args.rows, cudnn_warm_tokens=0) as engine:
        vocab = engine.model.vocab_size
        for kind, spread in (("equal", 0), ("ragged", args.spread)):  # warm-up: first visits outside the rounds
            await engine_run(engine, prompts(args.rows, args.tokens, spread, vocab, 10**6), 8)
        for r in range(args.rounds):
            order = [("equal", 0), ("ragged", args.spread)]
            for kind, spread in order if r % 2 == 0 else order[::-1]:
                out = await engine_run(engine, prompts(args.rows, args.tokens, spread, vocab, r), args.output_tokens)
                runs[kind].append(out)
                print(f"  round {r + 1} {kind}: " + ", ".join(f"{k} {out.get(k) or 0:.1f}" for k in KEYS), flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tiny random llama on this CPU")
    p.add_argument("--model", default=None)
    p.add_argument("--shape", default=None)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--spread", type=int, default=8, help="ragged prompts: tokens ± this many")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.rows, args.output_tokens, args.rounds = "tiny", 16, 24, 2
    sys.setswitchinterval(SERVE_SWITCH_INTERVAL_S)
    with tempfile.TemporaryDirectory(prefix="mlx-trio-padded-rows-") as tmp:
        model_dir, label = resolve_model(Path(tmp), shape=args.shape, model=args.model, num_layers=None)
        print(f"# padded rows: {label}; B={args.rows}, {args.tokens} ± {args.spread} prompt tokens, "
              f"{args.output_tokens} tokens, {args.rounds} rounds", flush=True)
        runs = trio.run(bench, str(model_dir), args)
    print("\n| prompts | " + " | ".join(KEYS) + " |\n|---|" + "---:|" * len(KEYS))
    for kind, rs in runs.items():
        cells = [statistics.median(r.get(k) or 0.0 for r in rs) for k in KEYS]
        print(f"| {kind} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
