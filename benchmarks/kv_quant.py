"""Quantized KV (`--kv-bits`, issue #22): rows a fixed KV budget admits, and batched decode speed, bf16 vs 8 vs 4 bits.

Usage:
    python benchmarks/kv_quant.py --model /tmp/mlx-trio-gpu-models/llama-1b     # H200 (benchmarks/gpu.sh, PARTS=kvquant)
    PYTHONPATH=$PWD python benchmarks/kv_quant.py --tiny                         # CPU shape check, < 1 min

Three tables:

* **admission**: at `--kv-budget`, how many rows of 8k and 32k tokens admission
  admits per KV format: the budget over `KvLayout.row_bytes` (engine/kv/layout.py,
  measured from the model's own caches, what the engine's admission projects),
  for `--quantized-kv-start` 0 and mlx-lm's 5000. No decode needed.
* **which formats run**: every `--kv-bits` x `--kv-group-size` that divides the
  model's head_dim, through the engine's load check (`check_quantized_attention`)
  and, case by case, mlx-lm's quantized SDPA at the model's head shapes
  (engine/kv/quantized_attention_probe.py): decode and prefill, over a buffer's
  first positions (what a cache hands attention between growth steps) and over a
  whole buffer; and the same with the GQA repeats folded into the queries
  (`folded`, not what mlx-lm runs). Each cell: ok, wrong values, or MLX's error.
* **decode and TTFT**: for bf16 and each format the load check passes, aggregate
  decode tok/s of B rows holding `--context` tokens each, through the engine's
  `DecodeBatch` (rows quantized from the start), and one row alone (the serial
  graph: `generate_step`'s, which is what mlx_lm.server gives every `--kv-bits`
  request, one at a time); TTFT of one `--context`-token prompt quantized from its
  first chunk (`--quantized-kv-start 0`). One prompt is prefilled once per format;
  every row starts from a prompt-cache hit on it, so rows are unpadded and prefill
  costs one prompt, not B.

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
Format = tuple[int, int] | None  # (bits, group size); None: the model's dtype


def _name(bits: int | None) -> str:
    return "unquantized" if bits is None else f"{bits}-bit"  # unquantized: the model's dtype (bf16; f32 --tiny)


def _format_name(fmt: Format) -> str:
    return "unquantized" if fmt is None else f"{fmt[0]}-bit g{fmt[1]}"


def quantized_formats(head_dim: int) -> list[tuple[int, int]]:
    from mlx_trio.engine.kv.kv_scheme import BITS, GROUP_SIZES

    return [(bits, group) for bits in sorted(BITS, reverse=True) for group in GROUP_SIZES if head_dim % group == 0]


PROBE_CASES = (("decode, slice", 1, False), ("decode, whole", 1, True), ("prefill, slice", 16, False),
               ("prefill, whole", 16, True))


def which_run(model: Any, formats: list[tuple[int, int]], label: str, budget_s: float) -> list[dict[str, Any]]:
    """Per format: the engine's load check, and each probe case for mlx-lm's attention and the folded one.

    Prints the table row by row (a cut run keeps what it measured); formats not reached within `budget_s`
    (first-use kernels compile on CUDA) are listed as not tried.
    """
    from mlx_trio.engine.kv import quantized_attention_probe as qap
    from mlx_trio.engine.kv.kv_scheme import KvScheme
    from mlx_trio.engine.kv.layout import check_quantized_attention

    shape = qap.attention_shape(model)
    assert shape is not None, "no full-attention layer"
    attentions = (("mlx-lm", qap.quantized_scaled_dot_product_attention), ("folded", qap.folded_attention))
    names = [f"{attn} {name}" for attn, _ in attentions for name, _, _ in PROBE_CASES]
    print(f"\n### which quantized formats run, {label}, heads (query, kv, dim) {shape}: the engine's load check, "
          "then mlx-lm's quantized SDPA at these head shapes (slice: a buffer's first positions; whole: a full "
          "buffer; folded: GQA repeats in the query axis, not what mlx-lm runs)\n")
    print("| format | load check | " + " | ".join(names) + " | s |\n|---|---|" + "---|" * (len(names) + 1), flush=True)
    out: list[dict[str, Any]] = []
    began = time.perf_counter()
    for bits, group in formats:
        if time.perf_counter() - began > budget_s:
            print(f"| {bits}-bit g{group} | not tried (--probe-budget-s {budget_s:g} spent) |", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            check_quantized_attention(model, KvScheme(bits=bits, group_size=group, start=0))
            check = None
        except ValueError as exc:
            check = str(exc)
        cases = {f"{attn} {name}": qap.probe(*shape, bits=bits, group_size=group, query_len=q, whole=whole,
                                             attention=fn)
                 for attn, fn in attentions for name, q, whole in PROBE_CASES}
        out.append({"bits": bits, "group": group, "serves": check is None, "check": check, "cases": cases})
        cells = ["ok" if why is None else why[:70].replace("|", "/") for why in cases.values()]
        print(f"| {bits}-bit g{group} | {'serves' if check is None else 'refused'} | " + " | ".join(cells)
              + f" | {time.perf_counter() - t0:.1f} |", flush=True)
    for r in out:
        if r["check"]:
            print(f"\n{r['bits']}-bit g{r['group']} refusal: {r['check']}")
    return out


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


def _ttft(model: Any, prompt: list[int], params: Any, fmt: Format, prefill_step: int) -> float:
    """Seconds from nothing to token 0 of one prompt, quantized from its first chunk (start 0)."""
    from mlx_trio.engine.batch.solo_row import SoloRow
    from mlx_trio.engine.kv.kv_scheme import KvScheme

    scheme = KvScheme() if fmt is None else KvScheme(bits=fmt[0], group_size=fmt[1], start=0)
    start = time.perf_counter()
    row = SoloRow(model, "ttft", prompt, params, prefill_step_size=prefill_step, kv_scheme=scheme)
    while row.prefill_chunk():
        pass
    row.first_token()
    wall = time.perf_counter() - start
    row.close()
    return wall


def decode_rates(model: Any, *, formats: list[Format], batches: list[int], context: int, steps: int,
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
    for fmt in formats:
        scheme = KvScheme() if fmt is None else KvScheme(bits=fmt[0], group_size=fmt[1], start=0)
        _ttft(model, prompt[: 2 * prefill_step + 1], params, fmt, prefill_step)  # first-use kernels
        ttft = _ttft(model, prompt, params, fmt, prefill_step)
        # The shared prompt is prefilled unquantized and each row converts at its token-0 step: this part is
        # about decode (TTFT above prefills quantized).
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
            out.append({"format": _format_name(fmt), "B": B, "context": context, "tok_s": B * steps / wall,
                        "ttft_s": ttft, "kv_bytes": batch.nbytes, "quantized": batch.is_quantized})
            print(f"  {_format_name(fmt)} B={B}: {B * steps / wall:.1f} tok/s", flush=True)
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
    parser.add_argument("--formats", default=None, help="bits/group pairs to try, e.g. 8/64,4/32 (default: all)")
    parser.add_argument("--probe-budget-s", type=float, default=75.0,
                        help="stop trying further formats after this long (CUDA compiles first-use kernels)")
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
    from mlx_trio.engine.kv import quantized_attention_probe as qap

    shape = qap.attention_shape(model)
    formats = quantized_formats(shape[2]) if shape else []
    if args.formats:
        formats = [f for f in formats if f"{f[0]}/{f[1]}" in args.formats.split(",")]
    ran = which_run(model, formats, label, args.probe_budget_s)
    serving: list[Format] = [None, *((r["bits"], r["group"]) for r in ran if r["serves"])]
    rates = decode_rates(model, formats=serving, batches=[int(b) for b in batches.split(",")], context=context,
                         steps=steps, prefill_step=2048)
    base = {r["B"]: r for r in rates if r["format"] == "unquantized"}
    alone = {r["format"]: r["tok_s"] for r in rates if r["B"] == 1}
    print(f"\n### aggregate decode and TTFT, {context}-token rows, {steps} steps, {label}; B=1 is the serial graph "
          "(mlx_lm.server runs --kv-bits requests one at a time); formats the load check refuses are left out\n")
    print("| B | format | tok/s | vs unquantized | vs one row of this format | TTFT (start 0) | vs unquantized | "
          "KV bytes |\n|---|---|---|---|---|---|---|---|")
    for r in rates:
        b = base[r["B"]]
        print(f"| {r['B']} | {r['format']} | {r['tok_s']:.1f} | {r['tok_s'] / b['tok_s']:.2f}× | "
              f"{r['tok_s'] / alone[r['format']]:.2f}× | {r['ttft_s'] * 1000:.0f} ms | "
              f"{r['ttft_s'] / b['ttft_s']:.2f}× | "
              f"{r['kv_bytes'] / 2**20:.1f} MiB |")
    if args.json:
        args.json.write_text(json.dumps({"model": label, "budget_bytes": budget, "admission": admitted,
                                         "which_run": ran, "decode": rates}, indent=1))


if __name__ == "__main__":
    main()
