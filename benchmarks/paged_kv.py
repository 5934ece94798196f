"""Paged KV (issue #45) on the engine's own path: prefix sharing, bytes held per token, block size, step time.

Usage:
    PYTHONPATH=$PWD python benchmarks/paged_kv.py                 # CPU, the tiny llama: about a minute
    PYTHONPATH=$PWD python benchmarks/paged_kv.py --model PATH    # any llama-family mlx-lm model (the H200)

Every part runs under the attention backend the server's lease thread chooses (engine/lease_thread.py:
prefill-only cuDNN on CUDA unless MLX_TRIO_ATTENTION_BACKEND says otherwise), as the server would.

Parts (`--parts`, default all but kernel):

* ``siblings``  8 rows sharing a `--prefix` (2,000) token prefix with distinct 64-token tails: prompt tokens
  computed, paged vs today's layout, with the rows arriving one after another (each prefills, samples token 0
  and joins before the next starts) and all at once (their 256-token chunks interleaved, as the prefill actor
  runs concurrent prompts: each chunk first takes the blocks the others cached meanwhile).
* ``memory``    one `--long` (3,000) token row decoding beside 15 rows of 100 tokens (`--batch 16`): KV bytes
  the batch holds (`DecodeBatch.nbytes`, what `/stats` `batch.kv_bytes` reports) over the bytes of the tokens
  it holds, paged vs today's padded layout.
* ``equal``     ms per decode step of `--equal-batches` (8,16) rows of one length (512 tokens), paged vs padded,
  alternated.
* ``block``     ms per decode step of a paged batch of 16 rows (300..1,200 tokens) for block sizes 16..256,
  against today's padded step on the same rows; and the same paged step with a pool 32x larger (a step
  that copied its pool instead of writing in place would slow down with it).
* ``prefill``   one lone prompt of each `--prefill-tokens` (default 8192,32768 on a GPU, 1000 on the CPU)
  prefilled as the server does (`SoloRow` chunks of `--prefill-step-size` (2048), and chunks the chunk sizer
  asks smaller when rows are decoding: `--prefill-limits`, default 0 = the step size, and 512), on the shape
  grid where the backend uses it (`--prefill-grid`; the attention backend chosen as the lease thread does),
  paged vs padded, alternated: prompt tokens a second each (cold: the first run, cuDNN plans included; warm:
  the median of the rest) and paged/padded. Token 0 and the next 3 greedy tokens must be equal: exits 1 if not.
* ``kernel``    the paged decode kernel (CUDA: engine/attention/paged_kernel.py) alone, no model: max abs error
  against the float32 MLX-ops reference and µs per call, kernel vs reference vs MLX's dense SDPA over the same
  tokens (rows copied into one [B, Hkv, T, D] array), at B = 1/8/64, rows of 512 tokens and rows spread over
  100..30,000 (`--kernel-max-len`), D = 64/128 (32 query heads, 8 kv heads), bfloat16 and float32. Exits 1 on
  an error past the self-check's bound, or if the kernel does not build (the error printed; `--verbose`
  prints the generated source). Needs MLX's CUDA backend.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import mlx.core as mx
from mlx_lm import load

from mlx_trio.engine import lease_thread
from mlx_trio.engine.attention import paged_kernel, paged_layout, ragged_kernel, routed_attention
from mlx_trio.engine.attention.paged_reference import gather_rows, reference_paged_attention
from mlx_trio.engine.batch.chunked_prefill import resolve_grid
from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.params import SamplingParams


def _kv(model: Any, blocks: int, block_size: int) -> PagedKV:
    shapes = paged_layout.layer_shapes(model)
    dtype = paged_layout.model_dtype(model)
    budget = blocks * paged_layout.BlockStorage.block_bytes(shapes, block_size, dtype)
    return paged_layout.paged_kv_for(model, budget, "bench", block_size=block_size)


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [(131 * seed + 7 * j + j * j) % (vocab - 10) + 3 for j in range(n)]


def _row(model: Any, rid: str, prompt: list[int], kv: PagedKV | None) -> tuple[SoloRow, int]:
    row = SoloRow(model, rid, prompt, SamplingParams(max_tokens=1 << 20), prefill_step_size=512, paged=kv)
    while row.prefill_chunk():
        pass
    return row, row.first_token()


def siblings(model: Any, vocab: int, prefix: int, block_size: int) -> None:
    common = _prompt(999, prefix, vocab)
    prompts = [common + _prompt(i, 64, vocab) for i in range(8)]
    for mode in ("paged-after", "paged-together", "padded"):
        kv = _kv(model, 4 * (prefix + 8 * 64) // block_size + 64, block_size) if mode != "padded" else None
        batch = DecodeBatch(model, paged=kv)
        start = time.perf_counter()
        if mode == "paged-together":  # all start at once; chunks interleaved as the prefill actor runs them
            rows = [SoloRow(model, f"s{i}", p, SamplingParams(max_tokens=1 << 20), paged=kv)
                    for i, p in enumerate(prompts)]
            while any(row.prefill_remaining for row in rows):
                for row in rows:
                    if row.prefill_remaining:
                        row.prefill_chunk(256)
            joined = [(row, row.first_token()) for row in rows]
        else:  # one after another: each prefills and joins before the next starts
            joined = []
            for i, p in enumerate(prompts):
                joined.append(_row(model, f"s{i}", p, kv))
        computed = sum(len(row.prompt_ids) - row.cached_tokens for row, _ in joined)
        batch.join_many(joined)
        seconds = time.perf_counter() - start
        batch.close()
        print(f"siblings {mode:14s}: prompt tokens computed {computed} of {8 * (prefix + 64)} "
              f"(target: at most {1.3 * (prefix + 8 * 64):.0f}), {seconds:.2f} s")


def memory(model: Any, vocab: int, long: int, batch_size: int, block_size: int) -> None:
    lengths = [long] + [100] * (batch_size - 1)
    for paged in (True, False):
        kv = _kv(model, sum(n + 64 for n in lengths) // block_size + 2 * batch_size, block_size) if paged else None
        batch = DecodeBatch(model, paged=kv)
        for i, n in enumerate(lengths):
            batch.join_many([_row(model, f"m{i}", _prompt(i, n, vocab), kv)])
        for _ in range(32):
            batch.step_decoded()
        batch.flush_decoded()
        tokens = sum(batch.num_fed(rid) for rid in batch.request_ids)
        per_token = (kv.storage.bytes_per_block // block_size if kv is not None
                     else _kv(model, 1, 1).storage.bytes_per_block)
        held = batch.nbytes
        print(f"memory {'paged ' if paged else 'padded'}: {held / 1e6:.2f} MB of KV held for {tokens} tokens "
              f"({tokens * per_token / 1e6:.2f} MB worth): {held / (tokens * per_token):.2f}x the tokens")
        batch.close()


def _step_ms(batch: DecodeBatch, steps: int) -> float:
    times = []
    for _ in range(5):
        tic = time.perf_counter()
        for _ in range(steps):
            batch.step_decoded()
        batch.flush_decoded()
        times.append((time.perf_counter() - tic) * 1e3 / steps)
    return statistics.median(times)


def block(model: Any, vocab: int, steps: int) -> None:
    lengths = [300 + 60 * i for i in range(16)]
    prefilled = [_row(model, f"b{i}", _prompt(i, n, vocab), None) for i, n in enumerate(lengths)]

    def batch_of(kv: PagedKV | None) -> DecodeBatch:
        batch = DecodeBatch(model, paged=kv)
        for row, token0 in prefilled:  # each batch copies the rows' KV (a paged one into its blocks)
            keep = row.caches
            batch.join_many([(row, token0)])
            row.caches = keep
        return batch

    padded = batch_of(None)
    print(f"block: padded step {_step_ms(padded, steps):.2f} ms (B=16, 300..1,200 tokens)")
    padded.close()
    for size in (16, 32, 64, 128, 256):
        need = sum(n + 6 * steps for n in lengths) // size + 2 * 16
        for scale in (1, 32) if size == 16 else (1,):
            batch = batch_of(_kv(model, scale * need, size))
            print(f"block: paged step {_step_ms(batch, steps):.2f} ms, block size {size}, pool {scale * need} blocks")
            batch.close()


def equal(model: Any, vocab: int, steps: int, batches: list[int], length: int) -> None:
    """Rows of one `length` (the short-prompt load the paged step must not slow): ms a step at each batch size."""
    for batch_size in batches:
        prefilled = [_row(model, f"e{i}", _prompt(i, length, vocab), None) for i in range(batch_size)]
        times: dict[str, list[float]] = {"padded": [], "paged": []}
        for _ in range(3):  # alternated: this machine's load drifts
            for mode in ("padded", "paged"):
                kv = _kv(model, batch_size * (length + 8 * steps) // 16 + 4 * batch_size, 16) if mode == "paged" else None
                batch = DecodeBatch(model, paged=kv)
                for row, token0 in prefilled:
                    keep = row.caches
                    batch.join_many([(row, token0)])
                    row.caches = keep
                times[mode].append(_step_ms(batch, steps))
                batch.close()
        padded, paged = statistics.median(times["padded"]), statistics.median(times["paged"])
        print(f"equal B={batch_size} x {length} tokens: padded {padded:.2f} ms, paged {paged:.2f} ms a step "
              f"(paged/padded {paged / padded:.3f}; target <= 1.05)")


def _prefill_once(model: Any, prompt: list[int], kv: PagedKV | None, step_size: int, limit: int,
                  grid: int | None) -> tuple[float, list[int]]:
    """Seconds to prefill `prompt` alone and sample token 0 (as the prefill actor's jobs do), and the first 4
    greedy tokens (token 0 and 3 decode steps)."""
    mx.synchronize()
    tic = time.perf_counter()
    row = SoloRow(model, "p", prompt, SamplingParams(max_tokens=8), prefill_step_size=step_size, paged=kv,
                  prefill_grid=grid)
    while row.prefill_chunk(limit or None):
        pass
    token0 = row.first_token()
    seconds = time.perf_counter() - tic
    batch = DecodeBatch(model, paged=kv)
    batch.join_many([(row, token0)])
    decoded = [batch.step_decoded() for _ in range(3)] + [batch.flush_decoded()]
    batch.close()
    mx.clear_cache()
    return seconds, [token0] + [d.token_ids[0] for d in decoded if d is not None]


def prefill(model: Any, vocab: int, lengths: list[int], limits: list[int], step_size: int, block_size: int,
            grid: int | None, runs: int) -> bool:
    """A lone prompt's prefill, paged vs padded (see `prefill` above); True when their first tokens agree."""
    ok = True
    for n in lengths:
        prompt = _prompt(5, n, vocab)
        for limit in limits:
            seconds: dict[str, list[float]] = {"padded": [], "paged": []}
            tokens: dict[str, list[int]] = {}
            for _ in range(runs):  # alternated: the load drifts
                for mode in ("padded", "paged"):
                    kv = _kv(model, (n + 64) // block_size + 8, block_size) if mode == "paged" else None
                    took, first = _prefill_once(model, prompt, kv, step_size, limit, grid)
                    seconds[mode].append(took)
                    if tokens.setdefault(mode, first) != first:
                        print(f"prefill {mode}: run-to-run tokens differ: {tokens[mode]} then {first}")
                        ok = False
                    del kv
            rate = {m: (n / t[0], n / statistics.median(t[1:] or t)) for m, t in seconds.items()}
            same = tokens["paged"] == tokens["padded"]
            ok &= same
            print(f"prefill {n} tokens, chunks of {limit or step_size}: tok/s cold/warm padded "
                  f"{rate['padded'][0]:.0f}/{rate['padded'][1]:.0f}, paged {rate['paged'][0]:.0f}/"
                  f"{rate['paged'][1]:.0f}; paged/padded warm {rate['paged'][1] / rate['padded'][1]:.3f} "
                  f"(target >= 0.95); first tokens {'equal' if same else 'DIFFER'} {tokens['paged']}"
                  + ("" if same else f" vs padded {tokens['padded']}"))
    return ok


def _us(fn: Any, calls: int = 20) -> float:
    """Median µs of one call of `fn` (evaluated), after a warm-up call."""
    mx.eval(fn())
    times = []
    for _ in range(5):
        tic = time.perf_counter()
        for _ in range(calls):
            mx.eval(fn())
        times.append((time.perf_counter() - tic) * 1e6 / calls)
    return statistics.median(times)


def kernel(max_len: int, verbose: bool) -> bool:
    """The paged decode kernel against the reference (error) and the reference and dense SDPA (µs): see `kernel` above.
    True when every case is within the self-check's bound."""
    ok = True
    def spread(B: int) -> list[int]:  # 100 .. max_len, geometric (one row: max_len)
        return [round(100 * (max_len / 100) ** (i / (B - 1))) for i in range(B)] if B > 1 else [max_len]

    for D in (64, 128):
        for dtype in (mx.bfloat16, mx.float32):
            for B in (1, 8, 64):
                for name, lengths in (("512", [512] * B), ("spread", spread(B))):
                    q, k, v, tables, lens = paged_kernel.check_case(32, 8, D, dtype, lengths, seed=B)
                    scale = D**-0.5
                    try:
                        err = paged_kernel.max_error(q, k, v, tables, lens, scale)
                    except Exception as exc:  # NVRTC's error, or no CUDA backend
                        print(f"kernel: D={D} {dtype} B={B}: the kernel did not build or run:\n{exc}")
                        if verbose:
                            paged_kernel.paged_decode_attention(q, k, v, tables, lens, scale, verbose=True)
                        return False
                    bound = ragged_kernel.SELF_CHECK_TOLERANCE  # float32 too (the ragged kernel: 1.6e-3 on an H200)
                    ok &= err <= bound
                    T = tables.shape[1] * k.shape[1]
                    dense_k, dense_v = gather_rows(k, tables), gather_rows(v, tables)  # [B, Hkv, T, D], copied once
                    mask = None if len(set(lengths)) == 1 and lengths[0] == T else (
                        mx.arange(T)[None, None, None, :] < lens[:, None, None, None])
                    mx.eval(dense_k, dense_v)
                    us_kernel = _us(lambda: paged_kernel.paged_decode_attention(q, k, v, tables, lens, scale))
                    us_ref = _us(lambda: reference_paged_attention(q, k, v, tables, lens, scale))
                    us_dense = _us(lambda: mx.fast.scaled_dot_product_attention(q, dense_k, dense_v, scale=scale,
                                                                                mask=mask))
                    print(f"kernel: D={D} {str(dtype):14s} B={B:2d} rows {name:6s} ({min(lengths)}..{max(lengths)}): "
                          f"max abs err {err:.2e} {'ok' if err <= bound else f'MISMATCH (> {bound})'}; "
                          f"µs kernel {us_kernel:8.1f}, reference {us_ref:8.1f}, dense SDPA {us_dense:8.1f}")
                    del q, k, v, dense_k, dense_v
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model directory (default: the tiny llama)")
    parser.add_argument("--parts", default="siblings,memory,block,equal,prefill")
    parser.add_argument("--prefix", type=int, default=2000)
    parser.add_argument("--long", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--equal-batches", default="8,16", help="batch sizes of the equal part (the H200: 8,64)")
    parser.add_argument("--equal-length", type=int, default=512)
    parser.add_argument("--kernel-max-len", type=int, default=30000)
    parser.add_argument("--verbose", action="store_true", help="kernel: print the generated source on a build error")
    parser.add_argument("--prefill-tokens", help="prefill: prompt lengths (default 8192,32768 on a GPU, 1000 else)")
    parser.add_argument("--prefill-limits", default="0,512", help="prefill: chunk sizes asked (0: the step size)")
    parser.add_argument("--prefill-step-size", type=int, default=2048)
    parser.add_argument("--prefill-grid", type=int, default=None, help="prefill: the grid step (default: the server's)")
    parser.add_argument("--prefill-runs", type=int, default=3, help="prefill: runs of each layout (the first cold)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    lease_thread.prepare_thread()  # the attention backend the server's lease thread chooses (cuDNN for prefill)
    if "kernel" in parts:
        print(f"device {mx.default_device()}")
        if not kernel(args.kernel_max_len, args.verbose):
            sys.exit(1)
        if parts == ["kernel"]:
            return
    if args.model is None:
        from mlx_trio.testing.tiny_models import LLAMA, tiny_model

        args.model = str(tiny_model(LLAMA))
    model = load(args.model)[0]
    routed_attention.install(model)
    vocab = model.args.vocab_size
    print(f"model {args.model}, device {mx.default_device()}")
    if "siblings" in parts:
        siblings(model, vocab, args.prefix, args.block_size)
    if "memory" in parts:
        memory(model, vocab, args.long, args.batch, args.block_size)
    if "block" in parts:
        block(model, vocab, args.steps)
    if "equal" in parts:
        equal(model, vocab, args.steps, [int(b) for b in args.equal_batches.split(",")], args.equal_length)
    if "prefill" in parts:
        print(f"prefill: attention backend {lease_thread.chosen_backend()}, grid "
              f"{resolve_grid(args.prefill_grid)}, block size {args.block_size}")
        lengths = args.prefill_tokens or ("8192,32768" if mx.default_device() == mx.gpu else "1000")
        if not prefill(model, vocab, [int(n) for n in lengths.split(",")],
                       [int(n) for n in args.prefill_limits.split(",")], args.prefill_step_size, args.block_size,
                       args.prefill_grid, args.prefill_runs):
            sys.exit(1)


if __name__ == "__main__":
    main()
