"""Compiled vs uncompiled decode steps against the bare MLX loop (issue #25), A/B alternated in one process.

Usage:
    PYTHONPATH=$PWD python benchmarks/compiled_decode.py --tiny                  # CPU shape check, < 1 min
    python benchmarks/compiled_decode.py --model /tmp/mlx-trio-gpu-models/llama-1b --batches 1,8,64
    python benchmarks/compiled_decode.py --model /tmp/mlx-trio-gpu-models/llama-8b --batches 1,8

One process opens two engines on the same model directory (a no-EOS copy,
so every row runs `--max-tokens`): one with compiled decode steps
(engine/batch/compiled_step.py), one with `compile_decode=False` (what
`--no-compile` and `MLX_TRIO_NO_COMPILE=1` give), both with the prompt cache
off so no run reuses another's KV. For every B the three methods run once
to warm up, then `--rounds` rounds in alternating order (compiled, uncompiled,
bare; then bare, uncompiled, compiled; ...), so a drift in host or device
speed hits them alike:

* ``compiled``    B concurrent `engine.generate` calls, compiled steps;
* ``uncompiled``  the same on the uncompiled engine;
* ``bare``        batch_throughput.py's bare loop (forward + argmax, one step
                  ahead, nothing else) on the compiled engine's lease thread.

Then the same greedy rows (prompts cut to lengths that differ by up to 6
tokens, so the batch is padded) decode `--max-tokens` tokens through the
engine's `DecodeBatch` directly, compiled and not: the table says how many
rows got exactly the same tokens (on the CPU all do: the logits are
bit-identical; on a GPU fused kernels may round differently).

Reported per B: decode tok/s (batch_throughput.py's window in which every
row decodes; medians over the rounds), the ratios, and at B=1 the fraction
of the HBM limit (weights read once per step: weights bytes x tok/s over
`--peak-bytes-s`, the H200's 4.8 TB/s by default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

from mlx_trio import open_engine
from mlx_trio.testing.shaped_models import resolve_model

from batch_throughput import (SERVE_SWITCH_INTERVAL_S, bare_loop, engine_run, machine_info, machine_line, pick_prompts,
                              versions, write_json)

METHODS = ("compiled", "uncompiled", "bare")
H200_PEAK_BYTES_S = 4.8e12  # HBM3e by the datasheet (benchmarks/gpu.sh)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


async def bench(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    batches, T = args.batches, args.max_tokens
    common = dict(batch=max(batches), prompt_cache_bytes=0, prefill_step_size=args.prefill_step_size)
    out: dict[str, Any] = {"rows": []}
    async with open_engine(str(model_dir), compile_decode=True, **common) as compiled, \
            open_engine(str(model_dir), compile_decode=False, **common) as uncompiled:
        lease, loaded = compiled.actors.lane.lease, compiled.model
        out["machine"] = await lease.run(machine_info)
        out["weights_bytes"] = loaded.weights_bytes
        prompts_all = pick_prompts(max(batches), args.prompt_tokens, loaded.vocab_size, args.seed)
        for B in batches:
            prompts = prompts_all[:B]
            methods = {
                "compiled": partial(engine_run, compiled, prompts, T),
                "uncompiled": partial(engine_run, uncompiled, prompts, T),
                "bare": partial(lease.run, partial(bare_loop, loaded.model, prompts, T, args.prefill_step_size)),
            }
            start = time.perf_counter()
            for fn in methods.values():  # warm-up (a new B: new traces and shapes), not recorded
                await fn()
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in METHODS}
            for r in range(args.rounds):
                for name in METHODS if r % 2 == 0 else METHODS[::-1]:
                    runs[name].append(await methods[name]())
            median = {name: statistics.median(x["dec_tok_s"] for x in runs[name] if x["dec_tok_s"])
                      for name in METHODS}
            tokens = {name: sorted({x["min_row_tokens"] for x in runs[name]}) for name in METHODS}
            row = {"B": B, "dec_tok_s": median, "row_tokens": tokens, "seconds": time.perf_counter() - start,
                   "rounds": {name: [x["dec_tok_s"] for x in runs[name]] for name in METHODS}}
            want, got = [await lease.run(partial(greedy_tokens, loaded.model, prompts, T, flag))
                         for flag in (False, True)]
            row["agreement"] = agreement(want, got)
            out["rows"].append(row)
            print(f"B={B}: " + ", ".join(f"{n} {_fmt(median[n])} tok/s" for n in METHODS)
                  + f" ({row['seconds']:.0f} s)", flush=True)
    return out


def greedy_tokens(model: Any, prompts: list[list[int]], max_tokens: int, compile_decode: bool) -> list[list[int]]:
    """Each prompt's greedy tokens from rows prefilled alone and joined into one `DecodeBatch` (lease thread)."""
    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow
    from mlx_trio.params import SamplingParams

    batch = DecodeBatch(model, compile_decode=compile_decode)
    joiners = []
    for i, ids in enumerate(prompts):
        row = SoloRow(model, f"agree-{i}", ids[:len(ids) - i % 7], SamplingParams(max_tokens=max_tokens))
        while row.prefill_chunk():
            pass
        token0 = row.first_token()
        joiners.append((row, token0))
    batch.join_many(joiners)
    tokens = [[token0] for _, token0 in joiners]
    for decoded in [*(batch.step_decoded() for _ in range(max_tokens - 1)), batch.flush_decoded()]:
        for row_tokens, token in zip(tokens, decoded.token_ids if decoded is not None else ()):
            row_tokens.append(token)
    batch.close()
    return tokens


def agreement(want: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Rows with identical tokens, and where each other row first differs."""
    first = [next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), None) for w, g in zip(want, got)]
    return {"rows": len(want), "equal_rows": sum(f is None for f in first),
            "first_differences": [f for f in first if f is not None]}


def print_agreement(results: dict[str, Any]) -> None:
    print("\ngreedy tokens, compiled vs uncompiled DecodeBatch (padded rows):")
    for row in results["rows"]:
        a = row["agreement"]
        print(f"  B={row['B']}: {a['equal_rows']}/{a['rows']} rows equal"
              + (f"; the others first differ at tokens {a['first_differences']}" if a["first_differences"] else ""))


def print_table(results: dict[str, Any], peak_bytes_s: float) -> None:
    print_agreement(results)
    print(f"\n### compiled decode: {results['label']}, {results['weights_bytes'] / 1e9:.2f} GB weights, "
          f"{results['args']['prompt_tokens']}-token prompts, {results['args']['max_tokens']} tokens, "
          f"{results['args']['rounds']} alternated rounds (decode tok/s, medians)")
    print(f"({results['machine_line']})")
    print("| B | compiled | uncompiled (--no-compile) | bare loop | compiled/bare | uncompiled/bare "
          "| compiled/uncompiled | HBM limit, compiled / bare |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in results["rows"]:
        c, u, b = (row["dec_tok_s"][n] for n in METHODS)
        hbm = "-"
        if row["B"] == 1:
            limit = peak_bytes_s / results["weights_bytes"]  # tok/s with the weights read once per step
            hbm = f"{c / limit:.0%} / {b / limit:.0%} (limit {limit:.0f} tok/s)"
        print(f"| {row['B']} | {_fmt(c)} | {_fmt(u)} | {_fmt(b)} | {_fmt(_ratio(c, b), '.2f')} | "
              f"{_fmt(_ratio(u, b), '.2f')} | {_fmt(_ratio(c, u), '.2f')} | {hbm} |")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="an mlx-lm model directory (benchmarks/gpu.sh builds llama-1b / llama-8b)")
    src.add_argument("--tiny", action="store_true", help="the tiny random model: a CPU check of this script")
    p.add_argument("--batches", default="1,8,64", help="comma-separated B values (default 1,8,64)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4, help="measured rounds per B after one warm-up (default 4)")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-bytes-s", type=float, default=H200_PEAK_BYTES_S,
                   help="memory bandwidth for the HBM-limit column (default: the H200's 4.8e12)")
    p.add_argument("--json", type=Path, help="write every run's numbers here")
    args = p.parse_args(argv)
    args.batches = sorted({int(b) for b in args.batches.split(",")})
    if args.tiny:  # small enough for the CPU in well under a minute
        args.max_tokens, args.prompt_tokens, args.rounds = min(args.max_tokens, 32), min(args.prompt_tokens, 32), 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sys.setswitchinterval(SERVE_SWITCH_INTERVAL_S)  # as `mlx-trio serve` sets it
    with tempfile.TemporaryDirectory(prefix="mlx-trio-compiled-") as tmp:
        model_dir, label = resolve_model(Path(tmp), shape="tiny" if args.tiny else None, model=args.model,
                                         num_layers=None)
        results = trio.run(bench, args, model_dir)
    results["label"] = label
    results["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results["machine_line"] = machine_line(results["machine"], versions())
    print_table(results, args.peak_bytes_s)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
