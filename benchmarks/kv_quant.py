"""Quantized KV (`--kv-bits`, issue #22): rows a fixed KV budget admits, and batched decode speed, bf16 vs 8 vs 4 bits.

Usage:
    python benchmarks/kv_quant.py --model /tmp/mlx-trio-gpu-models/llama-1b     # H200 (benchmarks/gpu.sh, PARTS=kvquant)
    PYTHONPATH=$PWD python benchmarks/kv_quant.py --tiny                         # CPU shape check, < 1 min

Two tables:

* **admission**: at `--kv-budget`, how many rows of 8k and 32k tokens admission
  admits per KV format: the budget over `KvLayout.row_bytes` (engine/kv/layout.py,
  measured from the model's own caches, what the engine's admission projects),
  for `--quantized-kv-start` 0 and mlx-lm's 5000. No decode needed.
* **decode**: aggregate decode tok/s of B rows holding `--context` tokens each,
  through the engine's `DecodeBatch` (rows quantized from the start), per format;
  and one row alone (the serial graph: `generate_step`'s, which is what
  mlx_lm.server gives every `--kv-bits` request, one at a time). One prompt is
  prefilled once per format; every row starts from a prompt-cache hit on it, so
  rows are unpadded and prefill costs one prompt, not B.

Prints markdown tables; `--json PATH` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")  # as the engine's lease thread (engine/lease_thread.py)

FORMATS: tuple[int | None, ...] = (None, 8, 4)
GIB = 2**30


def _name(bits: int | None) -> str:
    return "unquantized" if bits is None else f"{bits}-bit"  # unquantized: the model's dtype (bf16; f32 --tiny)


def admission_rows(model: Any, budget: int, contexts: list[int], group: int) -> list[dict[str, Any]]:
    from mlx_trio.engine.kv.kv_scheme import KvScheme
    from mlx_trio.engine.kv.layout import measure_layout

    rows = []
    for start in (0, 5000):
        base = None
        for bits in FORMATS:
            layout = measure_layout(model, KvScheme(bits=bits, group_size=group, start=start))
            for ctx in contexts:
                n = budget // layout.row_bytes(ctx)
                if bits is None:
                    base = base or {}
                    base[ctx] = n
                rows.append({"start": start, "format": _name(bits), "context": ctx, "row_bytes": layout.row_bytes(ctx),
                             "rows": n, "vs_bf16": n / base[ctx] if base and base.get(ctx) else None})
    return rows


def decode_rates(model: Any, *, batches: list[int], context: int, steps: int, group: int,
                 prefill_step: int) -> list[dict[str, Any]]:
    import mlx.core as mx

    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow
    from mlx_trio.engine.kv import cache_clone
    from mlx_trio.engine.kv.kv_scheme import KvScheme
    from mlx_trio.engine.prompt_cache.ram_tier import CacheHit
    from mlx_trio.params import SamplingParams

    vocab = int(model.args.vocab_size)
    prompt = [(7 * j + 3) % (vocab - 3) + 3 for j in range(context)]
    params = SamplingParams(max_tokens=steps + 16, logit_bias=())
    out = []
    for bits in FORMATS:
        scheme = KvScheme(bits=bits, group_size=group, start=0)
        # The shared prompt is prefilled unquantized and each row converts at its token-0 step: MLX's CUDA
        # backend (0.32.4) has no quantized matmul for prefill-sized attention ("No implementation for
        # problem shape: 2048x4096x64x32"; docs/benchmarks.md, ninth pass), and this table is about decode.
        first = SoloRow(model, "prefill", prompt, params, prefill_step_size=prefill_step)
        while first.prefill_chunk():
            pass
        entry = cache_clone.snapshot(prompt[:-1], first.caches)
        first.close()
        for B in [1, *batches]:
            batch = DecodeBatch(model, scheme)
            joiners = []
            for i in range(B):
                row = SoloRow(model, f"r{i}", prompt, params, kv_scheme=scheme,
                              hit=CacheHit(entry, context - 1))
                joiners.append((row, row.first_token()))
            batch.join_many(joiners)
            for _ in range(4):  # first-use kernels, buffer growth
                batch.step_decoded()
            batch.flush_decoded()
            start = time.perf_counter()
            for _ in range(steps):
                batch.step_decoded()
            batch.flush_decoded()
            wall = time.perf_counter() - start
            out.append({"format": _name(bits), "B": B, "context": context, "tok_s": B * steps / wall,
                        "kv_bytes": batch.nbytes, "quantized": batch.is_quantized})
            batch.close()
            mx.clear_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/tmp/mlx-trio-gpu-models/llama-1b")
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama on the CPU: a shape check")
    parser.add_argument("--kv-budget-gib", type=float, default=None, help="default: 40 (H200), 1 with --tiny")
    # The default context must stay under the tiny model's 4096 positions with --tiny.
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--batches", default=None, help="default: 8,32 (2,4 with --tiny)")
    parser.add_argument("--context", type=int, default=None, help="tokens each decoding row holds (default 8192)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 64)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from mlx_lm import load

    if args.tiny:
        from mlx_trio.testing.tiny_models import TinyModelSpec, tiny_model

        path = str(tiny_model(TinyModelSpec("llama", hidden_size=128, heads=2, kv_heads=1)))
        budget_gib, batches, context, steps = args.kv_budget_gib or 1, args.batches or "2,4", args.context or 512, \
            args.steps or 16
    else:
        path = args.model
        budget_gib, batches, context, steps = args.kv_budget_gib or 40, args.batches or "8,32", \
            args.context or 8192, args.steps or 64
    import mlx.core as mx

    model, _ = load(path)
    budget = int(budget_gib * GIB)
    label = f"{Path(path).name} on {mx.default_device()}"
    admitted = admission_rows(model, budget, [8192, 32768], args.group_size)
    print(f"\n### rows admitted at --kv-budget {budget_gib:g} GiB, {label} (group {args.group_size})\n")
    print("| --quantized-kv-start | format | context | bytes/row | rows | vs unquantized |\n|---|---|---|---|---|---|")
    for r in admitted:
        ratio = f"{r['vs_bf16']:.2f}×" if r["vs_bf16"] else ""
        print(f"| {r['start']} | {r['format']} | {r['context']} | {r['row_bytes'] / 2**20:.1f} MiB | {r['rows']} | "
              f"{ratio} |")
    rates = decode_rates(model, batches=[int(b) for b in batches.split(",")], context=context, steps=steps,
                         group=args.group_size, prefill_step=2048)
    base = {r["B"]: r["tok_s"] for r in rates if r["format"] == "unquantized"}
    print(f"\n### aggregate decode, {context}-token rows, {steps} steps, {label}; B=1 is the serial graph "
          "(mlx_lm.server runs --kv-bits requests one at a time)\n")
    print("| B | format | tok/s | vs unquantized | vs one row of this format | KV bytes |\n|---|---|---|---|---|---|")
    alone = {r["format"]: r["tok_s"] for r in rates if r["B"] == 1}
    for r in sorted(rates, key=lambda r: (r["B"], FORMATS.index(None if r["format"] == "unquantized"
                                                                  else int(r["format"].split("-")[0])))):
        print(f"| {r['B']} | {r['format']} | {r['tok_s']:.1f} | {r['tok_s'] / base[r['B']]:.2f}× | "
              f"{r['tok_s'] / alone[r['format']]:.2f}× | {r['kv_bytes'] / 2**20:.1f} MiB |")
    if args.json:
        args.json.write_text(json.dumps({"model": label, "budget_bytes": budget, "admission": admitted,
                                         "decode": rates}, indent=1))


if __name__ == "__main__":
    main()
