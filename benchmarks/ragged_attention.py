"""The ragged decode-attention kernel (issues #20, #25): correctness, µs per call, and the engine's padded decode step.

Usage:
    PYTHONPATH=$PWD python benchmarks/ragged_attention.py --tiny     # CPU: the pure-MLX reference in its place, < 1 min
    python benchmarks/ragged_attention.py --model /tmp/mlx-trio-gpu-models/llama-1b     # the H200 (gpu.sh PARTS=ragged)

Three parts (`--parts`, default all):

* ``check``  the kernel (engine/attention/ragged_kernel.py) against MLX's own attention with the
  cache's array mask (`mx.fast.scaled_dot_product_attention`, mask = mlx-lm's left-padding mask for
  one query) and against the float32 reference (engine/attention/ragged_reference.py), for
  B in {1, 8, 64}, T in {256, 2048, 10000} keys (a slice of a longer buffer, as a cache holds them),
  random left paddings, GQA 32/8 at D=64 and D=128, bfloat16 and float32. Prints the max abs error
  of each; exits 1 past the tolerance (`TOLERANCE`). A kernel that does not build (NVRTC) prints the
  compiler's error and the generated source, and exits 2.
* ``time``   µs per call (20 calls per evaluation, median of 5) of the kernel, of MLX's attention with
  that mask (the unfused fallback on CUDA: matmul, softmax, matmul), and of MLX's attention with no
  mask over all T keys (its fused vector kernel: what an unpadded batch gets), bfloat16.
* ``engine`` `--rows` rows (64) with prompts of `--min-tokens`..`--max-tokens` tokens (100..10k,
  log-uniform), prefilled alone and joined into one `DecodeBatch` (the engine's own path: left padding
  to the longest row, row slots). Greedy tokens over `--steps` (64) decode steps with the kernel on
  and with it off (two batches from the same prompts, stepped in turn), and how many rows agree (in
  bfloat16 a near tie may round the other way, as padded rows against solo ones do); then ms per step,
  kernel on vs off, in alternating blocks of `--block` steps on one batch.

On the CPU (`--tiny`, or any machine without MLX's CUDA backend) the reference stands in for the
kernel in every part, at sizes that fit a minute: the script's shape check, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from mlx_trio.engine.attention import ragged_kernel, routed_attention
from mlx_trio.engine.attention.ragged_reference import reference_decode_attention
from mlx_trio.engine.lease_thread import on_cuda, prepare_thread

# Max abs error allowed against the float32 reference, by dtype (bf16: its own rounding of outputs ~1).
TOLERANCE = {mx.float32: 1e-4, mx.bfloat16: 2e-2, mx.float16: 5e-3}
# (query heads, kv heads, head dim): the Llama-3.2-1B and -8B attention shapes.
HEAD_SHAPES = ((32, 8, 64), (32, 8, 128))
TINY_HEAD_SHAPES = ((4, 2, 16), (32, 8, 64))


class KernelBuildError(Exception):
    """The kernel did not compile or launch (the message is MLX's, with NVRTC's log)."""


def agreement(want: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Rows with identical tokens, and where each other row first differs."""
    first = [next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), None) for w, g in zip(want, got)]
    return {"rows": len(want), "equal_rows": sum(f is None for f in first),
            "first_differences": [f for f in first if f is not None]}


def _case(B: int, H: int, Hkv: int, T: int, D: int, dtype: mx.Dtype, seed: int) -> tuple[mx.array, ...]:
    """Random q, k, v (k and v a slice of a buffer 256-rounded past T, as a cache's) and left paddings."""
    rng = random.Random(seed)
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    capacity = -(-(T + 1) // 256) * 256
    q = mx.random.normal((B, H, 1, D), key=kq).astype(dtype)
    k = mx.random.normal((B, Hkv, capacity, D), key=kk).astype(dtype)[..., :T, :]
    v = mx.random.normal((B, Hkv, capacity, D), key=kv).astype(dtype)[..., :T, :]
    starts = [0] + [rng.randrange(T) for _ in range(B - 1)]  # one row unpadded, as in a batch
    start = mx.array(starts, dtype=mx.int32)
    mx.eval(q, k, v, start)
    return q, k, v, start


def _masked(q: mx.array, k: mx.array, v: mx.array, start: mx.array, scale: float) -> mx.array:
    mask = create_causal_mask(1, offset=k.shape[2] - 1, left_padding=start)  # the cache's mask, before the update
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _attend_fn(cuda: bool) -> Callable[..., mx.array]:
    return ragged_kernel.ragged_decode_attention if cuda else reference_decode_attention


def _run_kernel(attend: Callable[..., mx.array], *args: Any) -> mx.array:
    try:
        out = attend(*args)
        mx.eval(out)
        return out
    except Exception as exc:  # an NVRTC error surfaces at the first evaluation
        raise KernelBuildError(str(exc)) from exc


def check(sizes: dict[str, Any], cuda: bool) -> tuple[list[dict[str, Any]], bool]:
    attend, rows, ok = _attend_fn(cuda), [], True
    print("\n### check: max abs error of the ragged kernel" + ("" if cuda else " (CPU: the reference stands in)"))
    print("| dtype | H/Hkv, D | B | T | vs float32 reference | vs MLX masked sdpa | masked sdpa vs reference | ok |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for dtype in (mx.bfloat16, mx.float32):
        for H, Hkv, D in sizes["heads"]:
            for B in sizes["batches"]:
                for T in sizes["keys"]:
                    q, k, v, start = _case(B, H, Hkv, T, D, dtype, seed=B * 7919 + T + D)
                    scale = D**-0.5
                    got = _run_kernel(attend, q, k, v, start, scale).astype(mx.float32)
                    exact = reference_decode_attention(q.astype(mx.float32), k.astype(mx.float32),
                                                       v.astype(mx.float32), start, scale)
                    masked = _masked(q, k, v, start, scale).astype(mx.float32)
                    err = mx.abs(got - exact).max().item()
                    err_masked = mx.abs(got - masked).max().item()
                    err_mlx = mx.abs(masked - exact).max().item()
                    # float32 is measured, not routed (engine/attention/routed_attention.py keeps MLX's attention).
                    good = math.isfinite(err) and (err <= TOLERANCE[dtype] or dtype == mx.float32)
                    ok &= good
                    rows.append(dict(dtype=str(dtype), H=H, Hkv=Hkv, D=D, B=B, T=T, err=err, err_vs_masked=err_masked,
                                     masked_err=err_mlx, ok=good))
                    print(f"| {dtype} | {H}/{Hkv}, {D} | {B} | {T} | {err:.2e} | {err_masked:.2e} | {err_mlx:.2e} | "
                          f"{'yes' if good else 'NO'} |", flush=True)
                    del q, k, v, start, got, exact, masked
    return rows, ok


def _time(fn: Callable[[], mx.array], repeats: int = 20, rounds: int = 5) -> float:
    """µs per call: `repeats` calls in one evaluation (launch cost amortised), median of `rounds`."""
    mx.eval(fn())
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(repeats)])
        times.append((time.perf_counter() - t0) / repeats)
    return 1e6 * statistics.median(times)


def time_calls(sizes: dict[str, Any], cuda: bool) -> list[dict[str, Any]]:
    attend, rows = _attend_fn(cuda), []
    print("\n### µs per attention call, bfloat16 (one query per row; random left paddings, one row unpadded)")
    print("| H/Hkv, D | B | T | ragged kernel | MLX, array mask | MLX, no mask (vector kernel, all T keys) "
          "| masked / ragged | unmasked / ragged |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for H, Hkv, D in sizes["heads"]:
        for B in sizes["batches"]:
            for T in sizes["keys"]:
                q, k, v, start = _case(B, H, Hkv, T, D, mx.bfloat16, seed=T + B)
                scale = D**-0.5
                _run_kernel(attend, q, k, v, start, scale)  # builds it (reports an NVRTC error as such)
                ragged = _time(lambda: attend(q, k, v, start, scale))
                masked = _time(lambda: _masked(q, k, v, start, scale))
                plain = _time(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale))
                rows.append(dict(H=H, Hkv=Hkv, D=D, B=B, T=T, ragged_us=ragged, masked_us=masked, unmasked_us=plain))
                print(f"| {H}/{Hkv}, {D} | {B} | {T} | {ragged:.1f} | {masked:.1f} | {plain:.1f} | "
                      f"{masked / ragged:.2f} | {plain / ragged:.2f} |", flush=True)
                del q, k, v, start
    return rows


def _prompt_lengths(rows: int, low: int, high: int, seed: int) -> list[int]:
    lengths = [round(low * (high / low) ** (i / max(1, rows - 1))) for i in range(rows)]
    random.Random(seed).shuffle(lengths)
    return lengths


def _batch(model: Any, lengths: Sequence[int], vocab: int, seed: int) -> tuple[Any, list[list[int]]]:
    """A `DecodeBatch` of rows prefilled alone (prompts of `lengths`) and joined at once; their tokens so far."""
    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow
    from mlx_trio.params import SamplingParams

    rng = random.Random(seed)
    joiners = []
    for i, n in enumerate(lengths):
        row = SoloRow(model, f"row-{i}", [rng.randrange(3, vocab) for _ in range(n)], SamplingParams(max_tokens=1 << 20))
        while row.prefill_chunk():
            pass
        joiners.append((row, row.first_token()))
    batch = DecodeBatch(model)
    batch.join_many(joiners)
    return batch, [[token0] for _, token0 in joiners]


def _record(tokens: list[list[int]], decoded: Any) -> None:
    for row_tokens, token in zip(tokens, decoded.token_ids if decoded is not None else ()):
        row_tokens.append(token)


def engine_step(args: argparse.Namespace, model_dir: str, cuda: bool) -> dict[str, Any]:
    from mlx_trio.engine.model.load import load_model

    loaded = load_model(model_dir)
    route = routed_attention.route_of(loaded.model)
    if route is None:
        raise SystemExit(f"{model_dir}: no attention layer was wrapped (not a llama-family model?)")
    if cuda and route.attend is None:
        print("engine: the kernel failed its load-time self-check (logged above); measuring it anyway")
    on, off = _attend_fn(cuda), None
    lengths = _prompt_lengths(args.rows, args.min_tokens, args.max_tokens, args.seed)
    t0 = time.perf_counter()
    batches = {name: _batch(loaded.model, lengths, loaded.vocab_size, args.seed) for name in ("on", "off")}
    prefill_s = time.perf_counter() - t0
    print(f"\n### engine: B={args.rows} rows of {min(lengths)}..{max(lengths)} prompt tokens "
          f"(padded to {max(lengths)}), prefilled and joined in {prefill_s:.1f} s", flush=True)
    # Greedy tokens, kernel on vs off: each batch steps with its own route (set before its graph is built).
    for _ in range(args.steps):
        for name, attend in (("on", on), ("off", off)):
            route.attend = attend
            batch, tokens = batches[name]
            _record(tokens, batch.step_decoded())
    for name, attend in (("on", on), ("off", off)):
        route.attend = attend
        batch, tokens = batches[name]
        _record(tokens, batch.flush_decoded())
    got, want = batches["on"][1], batches["off"][1]
    agree = agreement(want, got) | {"tokens_per_row": len(want[0]), "tokens": sum(len(w) for w in want),
                                    "equal_tokens": sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))}
    print(f"greedy tokens, kernel on vs off, {agree['tokens_per_row']} per row: {agree['equal_rows']}/{agree['rows']} "
          f"rows equal, {agree['equal_tokens']}/{agree['tokens']} tokens equal"
          + (f"; the others first differ at tokens {agree['first_differences']}" if agree["first_differences"] else ""))
    batches["on"][0].close()
    # ms per step, alternating blocks on one batch (the pipeline crosses a block boundary once: one step in 2 x block).
    batch = batches["off"][0]
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            route.attend = on if name == "on" else off
            batch.step_decoded()  # the boundary step
            t0 = time.perf_counter()
            for _ in range(args.block):
                batch.step_decoded()
            times[name].append(1e3 * (time.perf_counter() - t0) / args.block)
    batch.flush_decoded()
    batch.close()
    ms = {name: statistics.median(v) for name, v in times.items()}
    print(f"ms per decode step (median of {args.rounds} blocks of {args.block}): kernel on {ms['on']:.2f}, "
          f"off {ms['off']:.2f} (off / on {ms['off'] / ms['on']:.2f})")
    return {"lengths": lengths, "prefill_s": prefill_s, "agreement": agree, "ms_per_step": ms, "blocks_ms": times}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="an mlx-lm llama-family model directory (gpu.sh builds llama-1b)")
    src.add_argument("--tiny", action="store_true", help="the tiny random model and small sizes: a CPU check")
    p.add_argument("--parts", default="check,time,engine", help="comma-separated: check, time, engine")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=10_000)
    p.add_argument("--steps", type=int, default=64, help="greedy decode steps compared, kernel on vs off")
    p.add_argument("--block", type=int, default=16, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=4, help="timed blocks per setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every number here")
    args = p.parse_args(argv)
    args.parts = {s.strip() for s in args.parts.split(",") if s.strip()}
    return args


def shrink(args: argparse.Namespace) -> None:
    """Sizes for a CPU (the reference in the kernel's place): the script's shape check in well under a minute."""
    args.rows, args.min_tokens, args.max_tokens = min(args.rows, 8), 5, min(args.max_tokens, 300)
    args.steps, args.block, args.rounds = min(args.steps, 16), min(args.block, 4), min(args.rounds, 2)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prepare_thread()  # the attention backend and this thread's stream, as the lease thread sets them
    cuda = on_cuda()
    small = args.tiny or not cuda
    if small:
        shrink(args)
    sizes = ({"heads": TINY_HEAD_SHAPES, "batches": (1, 8), "keys": (64, 300)} if small
             else {"heads": HEAD_SHAPES, "batches": (1, 8, 64), "keys": (256, 2048, 10_000)})
    print(f"device {mx.default_device()} | CUDA backend: {cuda} | mlx {mx.__version__}")
    out: dict[str, Any] = {"cuda": cuda, "sizes": {k: list(v) for k, v in sizes.items()}}
    status = 0
    try:
        if "check" in args.parts:
            out["check"], ok = check(sizes, cuda)
            if not ok:
                print(f"\nragged_attention: the kernel's error is past the tolerance {TOLERANCE} (see the table)")
                status = 1
        if "time" in args.parts:
            out["time"] = time_calls(sizes, cuda)
        if "engine" in args.parts:
            if args.tiny:
                from mlx_trio.testing.tiny_models import LLAMA, tiny_model

                model_dir = str(tiny_model(LLAMA))
            else:
                model_dir = args.model
            out["engine"] = engine_step(args, model_dir, cuda)
    except KernelBuildError as exc:
        print("\nragged_attention: the kernel did not build or run. MLX / NVRTC said:\n" + str(exc))
        traceback.print_exc()
        print("\nThe generated CUDA source (split pass, then merge pass):", flush=True)
        try:
            q, k, v, start = _case(2, 32, 8, 300, 64, mx.bfloat16, seed=1)
            mx.eval(ragged_kernel.ragged_decode_attention(q, k, v, start, 0.125, verbose=True))
        except Exception as again:
            print(f"(again: {again})")
        status = 2
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
