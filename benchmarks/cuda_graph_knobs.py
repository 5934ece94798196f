"""What MLX's CUDA-graph knobs, and the engine's fused projections, do to a decode step's time (issues #20, #25).

Usage (H200, after benchmarks/gpu.sh built the model):
    python benchmarks/cuda_graph_knobs.py --model /tmp/mlx-trio-gpu-models/llama-1b
    python benchmarks/cuda_graph_knobs.py --model /tmp/mlx-trio-gpu-models/llama-1b --settings fused,unfused --rounds 3
    python benchmarks/cuda_graph_knobs.py --tiny                  # a CPU shape check (the knobs do nothing there)

MLX's CUDA backend records kernels into CUDA graphs of at most
`MLX_MAX_OPS_PER_BUFFER` nodes (100 on Hopper), looks each graph up in a cache
(`MLX_CUDA_GRAPH_CACHE_SIZE`) and updates or instantiates it before launching;
`MLX_USE_CUDA_GRAPHS=0` launches kernels one by one. These are read once per
process, so each setting runs in a child process of its own (`--child`),
rounds alternating the settings. A child measures, on the lease thread's
settings (`prepare_thread`) and the engine's loaded model (ragged kernel
included): the bare loop at B=1 (mlx-lm `KVCache`, forward + argmax, one step
ahead), the engine's `DecodeBatch.step_decoded` at B=1/8/64 with rows of
different lengths (padded: the serving case), and one 512-token solo prefill
chunk. Prints ms per step (median of the timed steps) per setting.

"fused" (the default: q/k/v and gate/up as one matmul each, engine/model/fused_projections.py)
against "unfused" (`MLX_TRIO_NO_FUSED_PROJECTIONS=1`): a wider matmul may take another kernel on
CUDA and round differently, so the parent also compares the greedy tokens of the engine's B=8 run
(token 0 from each row's prefill, then every decode step) of each setting with the first setting's,
and each setting's rounds with each other (the run-to-run floor): rows identical, and where the
first row diverges. "lean" (the default: the decode step's own forward, engine/model/decode_forward.py)
against "nolean" (`MLX_TRIO_NO_LEAN_DECODE=1`: the model's forward) the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "default": {},
    "ops300": {"MLX_MAX_OPS_PER_BUFFER": "300"},
    "ops1000": {"MLX_MAX_OPS_PER_BUFFER": "1000"},
    "ops40": {"MLX_MAX_OPS_PER_BUFFER": "40"},
    "nographs": {"MLX_USE_CUDA_GRAPHS": "0"},
    "fused": {},
    "unfused": {"MLX_TRIO_NO_FUSED_PROJECTIONS": "1"},
    "lean": {},
    "nolean": {"MLX_TRIO_NO_LEAN_DECODE": "1"},
}
DEFAULT_SETTINGS = ("default", "ops300", "ops1000", "ops40", "nographs")
# The batch whose greedy tokens the parent compares between settings.
AGREEMENT_BATCH = 8


def child(model_dir: str, batches: list[int], steps: int) -> dict[str, object]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow
    from mlx_trio.engine.lease_thread import prepare_thread
    from mlx_trio.engine.model.load import load_model
    from mlx_trio.params import SamplingParams

    prepare_thread()
    loaded = load_model(model_dir)
    model = loaded.model
    out: dict[str, object] = {}

    # Bare loop, B=1.
    cache = make_prompt_cache(model)
    y = mx.array([[5 + i for i in range(32)]])
    logits = model(y, cache=cache)[:, -1, :]
    tok = mx.argmax(logits, axis=-1)
    times = []
    for i in range(steps + 8):
        t = time.perf_counter()
        nxt = mx.argmax(model(tok[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(nxt)
        tok.item()
        tok = nxt
        if i >= 8:
            times.append(time.perf_counter() - t)
    out["bare_b1_ms"] = 1e3 * statistics.median(times)

    params = SamplingParams(max_tokens=1 << 20)
    for B in batches:
        decode = DecodeBatch(model)
        joiners = []
        for r in range(B):
            row = SoloRow(model, f"r{r}", [10 + (7 * r + j) % 400 for j in range(24 + (r * 5) % 40)], params)
            while row.prefill_chunk():
                pass
            joiners.append((row, row.first_token()))
        decode.join_many(joiners)
        steps_out = [decode.step_decoded() for _ in range(8)]
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            steps_out.append(decode.step_decoded())
            times.append(time.perf_counter() - t)
        steps_out.append(decode.flush_decoded())
        decode.close()
        out[f"engine_b{B}_ms"] = 1e3 * statistics.median(times)
        if B == AGREEMENT_BATCH:  # each row's greedy tokens: token 0, then every step's
            rows = [[token0] for _, token0 in joiners]
            for decoded in filter(None, steps_out):
                for r, token in enumerate(decoded.token_ids):
                    rows[r].append(token)
            out["tokens"] = rows
        mx.clear_cache()

    times = []
    for i in range(6):
        row = SoloRow(model, f"p{i}", [10 + (3 * j + i) % 400 for j in range(1024)], params, prefill_step_size=512)
        row.prefill_chunk()  # the first chunk's shape at offset 0
        t = time.perf_counter()
        row.prefill_chunk()
        times.append(time.perf_counter() - t)
        row.close()
    out["prefill_512_ms"] = 1e3 * statistics.median(times[1:])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--settings", default=",".join(DEFAULT_SETTINGS), help=f"of {', '.join(SETTINGS)}")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(child(args.model, batches, args.steps)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.tiny or model is None:
            from mlx_trio.testing.shaped_models import resolve_model
            model = str(resolve_model(Path(tmp), shape="tiny", model=None, num_layers=None)[0])
        names = args.settings.split(",")
        results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        tokens: dict[str, list[list[list[int]]]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                env = {**os.environ, **SETTINGS[name]}
                proc = subprocess.run([sys.executable, __file__, "--child", "--model", model, "--batches", args.batches,
                                       "--steps", str(args.steps)], env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{name}: failed\n{proc.stderr[-2000:]}", flush=True)
                    continue
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                if "tokens" in row:
                    tokens[name].append(row.pop("tokens"))
                results[name].append(row)
                print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    keys = next((rows[0].keys() for rows in results.values() if rows), [])
    print("\n| setting | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, rows in results.items():
        if rows:
            print(f"| {name} | " + " | ".join(f"{statistics.median(r[k] for r in rows):.2f}" for k in keys) + " |")
    agreement = token_agreement(tokens)
    if args.json:
        args.json.write_text(json.dumps({"ms": results, "agreement": agreement}, indent=2) + "\n")
    return 0


def token_agreement(tokens: dict[str, list[list[list[int]]]]) -> dict[str, str]:
    """Print and return, per setting, how its B=8 greedy tokens compare with the first setting's (first rounds)
    and between its own rounds."""
    runs = {name: rounds for name, rounds in tokens.items() if rounds}
    if not runs:
        return {}
    base_name, base = next(iter(runs.items()))
    print(f"\n| B={AGREEMENT_BATCH} greedy tokens | vs {base_name} (first rounds) | across its own rounds |")
    print("|---|---|---|")
    found = {}
    for name, rounds in runs.items():
        across = "; ".join(compare(rounds[0], other) for other in rounds[1:]) or "one round"
        found[name] = versus = compare(base[0], rounds[0])
        print(f"| {name} | {versus} | {across} |")
    return found


def compare(a: list[list[int]], b: list[list[int]]) -> str:
    """Rows whose tokens are identical, and the earliest step where a row's tokens part (greedy: the rest follow)."""
    same = sum(x == y for x, y in zip(a, b))
    parts = [(next(i for i, (s, t) in enumerate(zip(x, y)) if s != t), r)
             for r, (x, y) in enumerate(zip(a, b)) if x != y]
    tail = f"; first divergence at token {min(parts)[0]} (row {min(parts)[1]})" if parts else ""
    return f"{same}/{len(a)} rows identical ({len(a[0])} tokens each){tail}"


if __name__ == "__main__":
    raise SystemExit(main())
