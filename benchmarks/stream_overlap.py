"""Can a prefill chunk on a second GPU stream overlap the decode steps of running rows? (issue #19 experiment)

Usage: python benchmarks/stream_overlap.py --shape llama-1b [--chunk 2048 --context 6144 --rows 4 --steps 30]

Sequential: `--steps` decode steps of `--rows` rows, then one prefill chunk of `--chunk` tokens after
`--context` cached ones, each evaluated in turn (the lease today). Overlapped: the chunk is handed
to the GPU on its own stream (`mx.async_eval` under `mx.stream(s)`), and the decode steps run on the
default stream meanwhile. Prints per-step latency (p50/max) in both and the total time; if the
GPU overlaps the two streams, the steps during the chunk stay near their solo cost and the total
falls below the sequential sum.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.testing.shaped_models import resolve_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-1b")
    p.add_argument("--model")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--context", type=int, default=6144)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, _label = resolve_model(Path(tmp), shape=None if args.model else args.shape, model=args.model,
                             num_layers=args.num_layers)
        model, _ = load(str(path))
    vocab = model.args.vocab_size

    def fresh_prefix() -> list:
        cache = make_prompt_cache(model)
        tokens = mx.random.randint(0, vocab, (1, args.context))
        for i in range(0, args.context, 2048):
            model(tokens[:, i:i + 2048], cache=cache)
            mx.eval([c.state for c in cache])
        return cache

    dec_cache = make_prompt_cache(model)
    model(mx.random.randint(0, vocab, (args.rows, 256)), cache=dec_cache)
    mx.eval([c.state for c in dec_cache])
    tok = mx.zeros((args.rows, 1), dtype=mx.int32)

    def step() -> float:
        nonlocal tok
        t = time.perf_counter()
        tok = mx.argmax(model(tok, cache=dec_cache)[:, -1:], axis=-1).astype(mx.int32)
        mx.eval(tok)
        return time.perf_counter() - t

    side = mx.new_stream(mx.default_device())
    chunk_tokens = mx.random.randint(0, vocab, (1, args.chunk))
    for _ in range(3):
        step()
    for rep in range(args.repeats):  # the chunk alone, as ChunkedPrefill runs it: with and without clear_cache
        for clear in (False, True):
            cache = fresh_prefix()
            mx.synchronize()
            times = []
            for i in range(3):
                t = time.perf_counter()
                model(chunk_tokens, cache=cache)
                mx.eval([c.state for c in cache])
                if clear:
                    mx.clear_cache()
                times.append(time.perf_counter() - t)
            print(f"{rep} chunk alone, clear_cache={clear}: {[round(x * 1e3, 1) for x in times]} ms", flush=True)
    for rep in range(args.repeats):
        for mode in ("sequential", "overlapped"):
            cache = fresh_prefix()
            mx.synchronize()
            start = time.perf_counter()
            if mode == "sequential":
                steps = [step() for _ in range(args.steps)]
                t = time.perf_counter()
                out = model(chunk_tokens, cache=cache)
                mx.eval(out, [c.state for c in cache])
                chunk_s = time.perf_counter() - t
            else:
                t = time.perf_counter()
                with mx.stream(side):
                    out = model(chunk_tokens, cache=cache)
                    mx.async_eval(out, [c.state for c in cache])
                steps = [step() for _ in range(args.steps)]
                mx.eval(out)
                chunk_s = time.perf_counter() - t
            total = time.perf_counter() - start
            print(f"{rep} {mode:10s} total {total * 1e3:7.1f} ms  chunk done after {chunk_s * 1e3:7.1f} ms  "
                  f"step p50 {statistics.median(steps) * 1e3:5.2f} max {max(steps) * 1e3:6.2f} ms  "
                  f"first 5 {[round(s * 1e3, 1) for s in steps[:5]]}", flush=True)


if __name__ == "__main__":
    main()
