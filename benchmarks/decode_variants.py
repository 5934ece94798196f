"""Where a batched decode step's host time goes: the same pipelined loop over different caches and samplers.

Usage:
    python benchmarks/decode_variants.py --shape llama-1b --batches 1,4,16,64
    python benchmarks/decode_variants.py --shape tiny --batches 4 --steps 32     # a CPU shape check

Every variant is the bare loop of batch_throughput.py (forward + argmax,
``async_eval`` one step ahead, ``tolist`` of the previous step) on B equal
prompts, differing in one thing:

* ``kvcache``    mlx-lm ``KVCache`` with B rows: no padding, no mask at L=1;
* ``batchkv``    mlx-lm ``BatchKVCache`` without padding: an all-true array mask every step
                 (batch_throughput.py's ``bare`` at B>1, and mlx-lm's BatchGenerator);
* ``hostpadded`` our ``HostPaddedBatchKVCache`` without padding: no mask (engine/batch_kv.py);
* ``padded``     ``HostPaddedBatchKVCache`` with row 0 one token shorter: a mask it needs;
* ``lse``        ``hostpadded`` with ``logsumexp`` before the argmax (the engine's greedy path);
* ``direct``     the engine's ``DecodeBatch`` (rows prefilled alone, joined together), ``step()``.

Variants run in turn, ``--repeats`` rounds (host speed drifts: a round sees
them all alike); the table shows medians of ms per step over the steps after
the first eight, and for the loops the host split (graph build, ``async_eval``,
waiting for the device).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")  # as the engine's lease thread (engine/lease_thread.py)

from batch_throughput import SHAPES, build_shape, run_in_mlx_thread, tiny_tokenizer_dir  # noqa: E402

VARIANTS = ("kvcache", "batchkv", "hostpadded", "padded", "lse", "direct")
SKIP = 8  # steps not timed: buffer growth and first-use kernels


def loop(model: Any, prompts: list[list[int]], steps: int, variant: str) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from mlx_trio.engine.batch_kv import HostPaddedBatchKVCache

    B = len(prompts)
    if variant == "kvcache":
        cache = make_prompt_cache(model)
    elif variant == "batchkv":
        cache = [BatchKVCache([0] * B) for _ in model.layers]
    elif variant == "padded":
        cache = [HostPaddedBatchKVCache([1] + [0] * (B - 1)) for _ in model.layers]
        prompts = [[0, *prompts[0][1:]], *prompts[1:]]  # row 0: one pad token, masked
    else:
        cache = [HostPaddedBatchKVCache([0] * B) for _ in model.layers]
    x = mx.array(prompts, dtype=mx.int32)
    model(x[:, :-1], cache=cache)
    mx.eval([c.state for c in cache])

    def pick(logits: mx.array) -> mx.array:
        if variant == "lse":
            logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(logits, axis=-1)

    y = pick(model(x[:, -1:], cache=cache)[:, -1, :])
    mx.async_eval(y)
    build = launch = wait = 0.0
    t0 = 0.0
    for i in range(steps):
        if i == SKIP:
            t0, build, launch, wait = time.perf_counter(), 0.0, 0.0, 0.0
        a = time.perf_counter()
        nxt = pick(model(y[:, None], cache=cache)[:, -1, :])
        b = time.perf_counter()
        mx.async_eval(nxt)
        c = time.perf_counter()
        y.tolist()
        build, launch, wait = build + b - a, launch + c - b, wait + time.perf_counter() - c
        y = nxt
    n = steps - SKIP
    out = {"ms": 1e3 * (time.perf_counter() - t0) / n, "build": 1e3 * build / n, "launch": 1e3 * launch / n,
           "wait": 1e3 * wait / n}
    del cache, y, nxt
    mx.clear_cache()
    return out


def direct(model: Any, prompts: list[list[int]], steps: int) -> dict[str, float]:
    import mlx.core as mx

    from mlx_trio.engine.batch import DecodeBatch
    from mlx_trio.engine.rows import SoloRow
    from mlx_trio.params import SamplingParams

    params = SamplingParams(max_tokens=steps + 1)
    rows = []
    for i, ids in enumerate(prompts):
        row = SoloRow(model, f"v{i}", ids, params)
        while row.prefill_remaining:
            row.prefill_chunk()
        rows.append((row, row.first_token()))
    batch = DecodeBatch(model)
    batch.join_many(rows)
    t0 = 0.0
    for i in range(steps):
        if i == SKIP:
            t0 = time.perf_counter()
        batch.step()
    ms = 1e3 * (time.perf_counter() - t0) / (steps - SKIP)
    batch.close()
    mx.clear_cache()
    return {"ms": ms}


def run(model_dir: Path, batches: Sequence[int], steps: int, prompt_tokens: int, repeats: int) -> None:
    import mlx.core as mx
    from mlx_lm import load

    model = load(str(model_dir))[0]
    mx.eval(model.parameters())
    vocab = model.args.vocab_size
    print(f"# device {mx.default_device()}; prompt {prompt_tokens}, {steps} steps ({SKIP} untimed), "
          f"median of {repeats} rounds", flush=True)
    print("| B | variant | ms/step | build | async_eval | wait | vs batchkv |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for B in batches:
        prompts = [[(97 * r + 31 * j) % (vocab - 3) + 3 for j in range(prompt_tokens)] for r in range(B)]
        fns: dict[str, Callable[[], dict[str, float]]] = {
            v: (lambda v=v: direct(model, prompts, steps) if v == "direct" else loop(model, prompts, steps, v))
            for v in VARIANTS
        }
        for fn in fns.values():  # warm-up
            fn()
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in fns}
        for _ in range(repeats):
            for v, fn in fns.items():
                runs[v].append(fn())
        med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
        base = med["batchkv"]["ms"]
        for v, m in med.items():
            split = " | ".join(f"{m[k]:.2f}" if k in m else "" for k in ("build", "launch", "wait"))
            print(f"| {B} | {v} | {m['ms']:.2f} | {split} | {base / m['ms']:.2f} |", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--steps", type=int, default=72)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="mlx-trio-variants-") as tmp:
        model_dir = tiny_tokenizer_dir() if args.shape == "tiny" else build_shape(args.shape, Path(tmp), None)
        run_in_mlx_thread(lambda: run(model_dir, batches, args.steps, args.prompt_tokens, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
