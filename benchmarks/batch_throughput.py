"""Aggregate decode throughput of the batch lane against mlx-lm and a bare loop (issue 4, "Benchmark").

Usage:
    python benchmarks/batch_throughput.py --shape tiny --batches 1,4,8 --max-tokens 64
    python benchmarks/batch_throughput.py --model default --batches 1,4,8     # SmolLM2-135M
    python benchmarks/batch_throughput.py --shape llama-1b --batches 1,4,8,16 --json out.json
    python benchmarks/batch_throughput.py --shape llama-1b --long-prompts 8x12600
    python benchmarks/batch_throughput.py --shape llama-1b --batches 1,8 --pairs 20 --pair-tokens 64

For every B of ``--batches``, in one process, on the same weights and the same
B prompts (random token ids, equal length, greedy, ``max_tokens`` fixed):

* ``engine``   our batch lane: B concurrent ``engine.generate`` calls on an
               engine opened with ``batch=max(--batches)`` (so B rows run);
* ``direct``   the engine's own `DecodeBatch` driven in one lease job with no
               actors, sessions or lease hops (rows prefilled alone, then all
               joined before the first step): the graph and per-step host work
               of the engine without its Trio side;
* ``batchgen`` mlx-lm ``BatchGenerator`` (insert B prompts, ``next_generated``
               until every row finished);
* ``bare``     one batched cache (B=1: mlx-lm ``KVCache``; B>1: ``BatchKVCache``,
               no padding), model forward + argmax, ``mx.async_eval`` one step
               ahead, ``tolist`` of the previous step, nothing else;
* at B=1 also ``batch1`` (an engine opened with ``batch=1``: the same
               lane capped at one row, no prompt cache) and ``stream_gen`` (mlx-lm ``stream_generate``).

Every baseline runs as one job on the engine's GPU-lease thread, so they use the
engine's evaluated weights, and no two measurements overlap. Each measurement
is warmed up once (same work, not recorded); then ``--repeats`` rounds run the
methods in turn (paired: a noisy neighbour hits all of them alike) and the
tables show medians.

``--pairs N`` adds, after each B's rounds, N short interleaved pairs
(``--pair-tokens``, default 64): the engine's B requests then the bare loop
on the same prompts, in ABBA order (engine,bare then bare,engine ...); at B=1
also one greedy request through the engine and one through the ``batch=1``
engine. Host speed drifts over seconds, so adjacent short runs in alternating
order judge a ratio far better than whole rounds do. Reported: the median and
interquartile range of the per-pair decode ratios, and the ratio of medians.

Two rates per run, both counted in generated tokens (token 0 included):

* ``e2e``: all tokens / (first submit -> last token), prefill and ramp included;
* ``dec``: decode only, the window in which every row is decoding: from the
  moment the last row got its first decoded token (its second token: token 0
  comes from its prefill, and on the engine a join follows it) to the moment
  the first row got its last token, tokens arriving inside the window / its
  length.

Every model directory is used through a copy whose configs declare no EOS token
(weights are symlinked), so every run generates exactly ``max_tokens`` tokens per
row; the generated counts are checked and printed anyway.

``--long-prompts RxN`` instead sends R concurrent requests of N-token prompts
(``--long-max-tokens``, default 64) to the engine at ``batch=R`` and reports
completion, peak device memory and the admission / KV-budget behaviour.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

from mlx_trio import open_engine
from mlx_trio.events import Finished, TextDelta
from mlx_trio.testing.shaped_models import SHAPES, resolve_model

# mlx-trio serve sets this (mlx_trio/cli.py SWITCH_INTERVAL_S); open_engine does not.
SERVE_SWITCH_INTERVAL_S = 0.001
PROMPT_ID_LIMIT = 512  # the tiny tokenizer's vocabulary: ids below it exist in every model used here
FIRST_PROMPT_ID = 3  # skip the special tokens 0-2


# -- measurement records ---------------------------------------------------------------------------

def summarize(t0: float, t1: float, times: Sequence[Sequence[float]], **extra: Any) -> dict[str, Any]:
    """Rates of one run from each row's token arrival times (see the module docstring)."""
    counts = [len(ts) for ts in times]
    total = sum(counts)
    out: dict[str, Any] = {"tokens": total, "min_row_tokens": min(counts), "max_row_tokens": max(counts),
                           "wall_s": t1 - t0, "e2e_tok_s": total / (t1 - t0),
                           "ttft_ms_mean": 1e3 * statistics.fmean(ts[0] - t0 for ts in times if ts)}
    # Each row's first decoded token: token 0 is the prefill's, and what follows it (the engine's join) is not decode.
    start = max(ts[min(1, len(ts) - 1)] for ts in times if ts)
    end = min(ts[-1] for ts in times if ts)
    inside = sum(1 for ts in times for t in ts if start < t <= end)
    out["dec_window_s"] = max(end - start, 0.0)
    out["dec_start"], out["dec_end"] = start, end
    out["dec_tok_s"] = inside / (end - start) if end > start and inside else None
    out.update(extra)
    return out


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


# -- baselines: each runs as ONE job on the lease thread ---------------------------------------------

def bare_loop(model: Any, prompts: list[list[int]], max_tokens: int, prefill_step_size: int) -> dict[str, Any]:
    """Batched prefill, then forward + argmax with async_eval one step ahead; nothing else."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    B = len(prompts)
    t0 = time.perf_counter()
    cache = make_prompt_cache(model) if B == 1 else [BatchKVCache([0] * B) for _ in model.layers]
    x = mx.array(prompts, dtype=mx.int32)
    pos = 0
    while x.shape[1] - pos > 1:
        n = min(prefill_step_size, x.shape[1] - 1 - pos)
        model(x[:, pos:pos + n], cache=cache)
        mx.eval([c.state for c in cache])
        pos += n
    mx.clear_cache()
    y = mx.argmax(model(x[:, pos:], cache=cache)[:, -1, :], axis=-1)
    mx.async_eval(y)
    stamps: list[float] = []
    cpu_stamps: list[float] = []
    build_s = launch_s = wait_s = 0.0
    for i in range(max_tokens):
        a = time.perf_counter()
        if i + 1 < max_tokens:
            nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            b = time.perf_counter()
            mx.async_eval(nxt)
        else:
            b = a
        c = time.perf_counter()
        y.tolist()
        stamps.append(time.perf_counter())
        cpu_stamps.append(time.thread_time())
        if i:  # step 0 waits for the prefill's last token
            build_s, launch_s, wait_s = build_s + b - a, launch_s + c - b, wait_s + stamps[-1] - c
        y = nxt
    t1 = time.perf_counter()
    del cache, y, nxt
    mx.clear_cache()
    # Per step, host side: Python graph building, async_eval (encode + launch), waiting for the previous step.
    n = max(max_tokens - 1, 1)
    return summarize(t0, t1, [stamps] * B, build_ms=1e3 * build_s / n, launch_ms=1e3 * launch_s / n,
                     wait_ms=1e3 * wait_s / n,
                     lease_cpu_us_per_step=1e6 * (cpu_stamps[-1] - cpu_stamps[0]) / max(len(stamps) - 1, 1))


def decode_batch_direct(model: Any, prompts: list[list[int]], max_tokens: int,
                        prefill_step_size: int) -> dict[str, Any]:
    """The engine's SoloRow + DecodeBatch without actors: prefill each row alone, join all, step."""
    import mlx.core as mx
    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow
    from mlx_trio.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    times: list[list[float]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    batch = DecodeBatch(model)
    for i, ids in enumerate(prompts):
        row = SoloRow(model, f"direct-{i}", ids, params, prefill_step_size=prefill_step_size)
        while row.prefill_remaining:
            row.prefill_chunk()
        token0 = row.first_token()
        times[i].append(time.perf_counter())
        batch.join_many([(row, token0)])
    step_host_s = 0.0
    for _ in range(max_tokens - 1):
        s = time.perf_counter()
        decoded = batch.step_decoded()
        now = time.perf_counter()
        step_host_s += now - s
        if decoded is not None:
            for ts in times:
                ts.append(now)
    decoded = batch.flush_decoded()
    now = time.perf_counter()
    if decoded is not None:
        for ts in times:
            ts.append(now)
    t1 = time.perf_counter()
    batch.close()
    mx.clear_cache()
    return summarize(t0, t1, times, step_ms=1e3 * step_host_s / max(max_tokens - 1, 1))


def batch_generator(model: Any, prompts: list[list[int]], max_tokens: int,
                    prefill_step_size: int) -> dict[str, Any]:
    """mlx-lm's BatchGenerator with its defaults (prefill_batch_size 8), no stop tokens."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    B = len(prompts)
    t0 = time.perf_counter()
    gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=max(32, B),
                         prefill_step_size=prefill_step_size)
    uids = gen.insert([list(p) for p in prompts], [max_tokens] * B)
    index = {uid: i for i, uid in enumerate(uids)}
    times: list[list[float]] = [[] for _ in prompts]
    finished = 0
    while finished < B:
        responses = gen.next_generated()
        now = time.perf_counter()
        if not responses:
            break
        for r in responses:
            times[index[r.uid]].append(now)
            if r.finish_reason is not None:
                finished += 1
    t1 = time.perf_counter()
    gen.close()
    del gen
    mx.clear_cache()
    return summarize(t0, t1, times)


def stream_gen(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int,
               prefill_step_size: int) -> dict[str, Any]:
    """mlx-lm's stream_generate (generate_step + detokenizer), B=1."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    stamps: list[float] = []
    t0 = time.perf_counter()
    for _ in stream_generate(model, tokenizer, list(prompt), max_tokens=max_tokens,
                             prefill_step_size=prefill_step_size):
        stamps.append(time.perf_counter())
    t1 = time.perf_counter()
    mx.clear_cache()
    return summarize(t0, t1, [stamps])


def machine_info() -> dict[str, Any]:
    import mlx.core as mx

    info = {k: v for k, v in mx.device_info().items()}
    return {"device": str(mx.default_device()), "device_info": info}


# -- engine runs -----------------------------------------------------------------------------------

async def engine_run(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """B concurrent requests; token arrival times at the consumer; lease and decoder counters."""
    lease, decoder = engine.actors.lane.lease, engine.actors.lane.decode_step
    l0, d0 = lease.statistics(), decoder.statistics()
    times: list[list[float]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)
    usage: list[int] = [0] * len(prompts)

    lease_clock = time.pthread_getcpuclockid(lease.statistics().thread_id)
    # (wall, lease thread CPU, Trio thread CPU) at each of row 0's token arrivals.
    clocks: list[tuple[float, float, float]] = []

    async def one(i: int, ids: list[int]) -> None:
        async for event in engine.generate(list(ids), max_tokens=max_tokens):
            now = time.perf_counter()
            if isinstance(event, TextDelta):
                times[i].extend([now] * len(event.token_ids))
                if i == 0:
                    clocks.append((now, time.clock_gettime(lease_clock), time.thread_time()))
            elif isinstance(event, Finished):
                reasons[i], usage[i] = event.finish_reason, event.usage.completion_tokens

    lease.job_log = []
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i, ids in enumerate(prompts):
            nursery.start_soon(one, i, ids)
    t1 = time.perf_counter()
    job_log, lease.job_log = lease.job_log, None
    l1, d1 = lease.statistics(), decoder.statistics()
    jobs = l1.jobs_run - l0.jobs_run
    busy = l1.busy_s - l0.busy_s
    chains = getattr(d1, "chains", 0) - getattr(d0, "chains", 0)
    steps = getattr(d1, "steps", None)
    steps = steps - d0.steps if steps is not None else max(usage)  # no step counter: one job per token
    out = summarize(
        t0, t1, times, lease_jobs=jobs, step_chains=chains, lease_busy_s=busy, decode_steps=steps,
        lease_gap_us_per_job=1e6 * (t1 - t0 - busy) / max(jobs, 1),
        lease_gap_us_per_step=1e6 * (t1 - t0 - busy) / max(steps, 1),
        finish_reasons=sorted(set(r or "none" for r in reasons)), usage_tokens=sum(usage),
    )
    return out | window_cpu(clocks, out, len(prompts)) | window_jobs(job_log, out, len(prompts))


def window_jobs(job_log: list[tuple[str, float, float]], run: dict[str, Any], rows: int) -> dict[str, Any]:
    """Inside the decode window: the step jobs' median duration per step, and the lease thread's idle share."""
    from mlx_trio.actors.decode_step import steps_per_job

    start, end = run["dec_start"], run["dec_end"]
    inside = [(name, a, b) for name, a, b in job_log if a >= start and b <= end]
    steps = [b - a for name, a, b in inside if name == "_steps_then"]  # the step chain's links (actors/decode_step.py)
    if not steps or end <= start:
        return {}
    busy = sum(max(0.0, min(b, end) - max(a, start)) for _, a, b in job_log)  # jobs clipped to the window
    return {"job_ms_per_step": 1e3 * statistics.median(steps) / steps_per_job(rows),
            "lease_idle_frac": 1 - busy / (end - start)}


def window_cpu(clocks: list[tuple[float, float, float]], run: dict[str, Any], rows: int) -> dict[str, Any]:
    """CPU µs per decode step of the lease and Trio threads, inside the decode window (see summarize)."""
    inside = [c for c in clocks if run["dec_start"] <= c[0] <= run["dec_end"]]
    if len(inside) < 2 or not run["dec_tok_s"]:
        return {}
    (w0, l0, r0), (w1, l1, r1) = inside[0], inside[-1]
    step_s = rows / run["dec_tok_s"]  # every row gets one token per step
    return {"lease_cpu_us_per_step": 1e6 * step_s * (l1 - l0) / (w1 - w0),
            "trio_cpu_us_per_step": 1e6 * step_s * (r1 - r0) / (w1 - w0)}


async def interleaved(a: Callable[[], Awaitable[dict[str, Any]]], b: Callable[[], Awaitable[dict[str, Any]]],
                      n: int) -> dict[str, Any]:
    """N pairs of runs of `a` and `b` back to back, ABBA order; the decode tok/s ratios a/b and their spread."""
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    for i in range(n):
        # Alternate which goes first so a linear drift in host speed cancels over each two pairs.
        for name in ("a", "b") if i % 2 == 0 else ("b", "a"):
            runs[name].append(await (a if name == "a" else b)())
    ratios = dec_ratios(runs["a"], runs["b"])
    # Inclusive quartiles stay inside the observed range, which matters for small N.
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (None, None, None)
    return {"ratios": ratios, "runs": runs, "median": statistics.median(ratios) if ratios else None,
            "q1_q3": [q1, q3], "iqr": q3 - q1 if q1 is not None else None,
            "ratio_of_medians": _r(median_of(runs["a"], "dec_tok_s"), median_of(runs["b"], "dec_tok_s"))}


def pick_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(PROMPT_ID_LIMIT, vocab)
    return [[rng.randrange(FIRST_PROMPT_ID, hi) for _ in range(length)] for _ in range(n)]


async def bench_batches(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    batches = args.batches
    M, step = args.max_tokens, args.prefill_step_size
    results: dict[str, Any] = {"rows": []}
    async with open_engine(str(model_dir), batch=max(batches), kv_budget_bytes=args.kv_budget,
                           prefill_step_size=step, prompt_cache_bytes=args.prompt_cache_bytes) as engine:
        async with contextlib.AsyncExitStack() as stack:
            batch1 = None
            if 1 in batches:  # an engine opened with batch=1, for the B=1 comparison
                batch1 = await stack.enter_async_context(open_engine(str(model_dir), batch=1, prefill_step_size=step))
            lease = engine.actors.lane.lease
            loaded = engine.model
            results["machine"] = await lease.run(machine_info)
            model = loaded.model
            prompts_all = pick_prompts(max(batches), args.prompt_tokens, loaded.vocab_size, args.seed)
            for B in batches:
                prompts = prompts_all[:B]
                methods: dict[str, Callable[[], Any]] = {
                    "engine": partial(engine_run, engine, prompts, M),
                    "direct": partial(lease.run, partial(decode_batch_direct, model, prompts, M, step)),
                    "batchgen": partial(lease.run, partial(batch_generator, model, prompts, M, step)),
                    "bare": partial(lease.run, partial(bare_loop, model, prompts, M, step)),
                }
                if B == 1 and batch1 is not None:
                    methods["batch1"] = partial(engine_run, batch1, prompts, M)
                    methods["stream_gen"] = partial(lease.run, partial(stream_gen, model, loaded.tokenizer,
                                                                       prompts[0], M, step))
                if not args.repeats:  # --pairs only: warm up just what the pairs run
                    methods = {k: v for k, v in methods.items() if k in ("engine", "bare", "batch1")}
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in methods}
                t_b = time.perf_counter()
                for name, fn in methods.items():  # warm-up: the same work, not recorded
                    await fn()
                for _ in range(args.repeats):
                    for name, fn in methods.items():
                        runs[name].append(await fn())
                row = {"B": B, "runs": runs, "median": {
                    name: {k: median_of(rs, k) for k in ("e2e_tok_s", "dec_tok_s", "ttft_ms_mean", "wall_s",
                                                         "lease_gap_us_per_job", "lease_gap_us_per_step",
                                                         "lease_jobs", "decode_steps", "step_ms",
                                                         "build_ms", "launch_ms", "wait_ms")}
                    for name, rs in runs.items()}}
                tokens_ok = {name: (min(r["min_row_tokens"] for r in rs), max(r["max_row_tokens"] for r in rs))
                             for name, rs in runs.items() if rs}  # --repeats 0: pairs only
                row["row_tokens_min_max"] = tokens_ok
                if "batch1" in runs:  # paired ratio per round, then the median
                    pairs = dec_ratios(runs["engine"], runs["batch1"])
                    row["b1_engine_over_batch1_paired"] = statistics.median(pairs) if pairs else None
                    row["b1_pairs"] = pairs
                    if args.pairs > 0:
                        pair = await interleaved(partial(engine_run, engine, prompts[:1], args.pair_tokens),
                                                 partial(engine_run, batch1, prompts[:1], args.pair_tokens),
                                                 args.pairs)
                        row.update({"b1_pairs_interleaved": pair["ratios"], "b1_pair_tokens": args.pair_tokens,
                                    "b1_interleaved_median": pair["median"], "b1_interleaved_q1_q3": pair["q1_q3"],
                                    "b1_interleaved_iqr": pair["iqr"],
                                    "b1_interleaved_ratio_of_medians": pair["ratio_of_medians"]})
                if args.pairs > 0:  # engine/bare, the issue's target, judged the same way
                    row["bare_pairs"] = await interleaved(
                        partial(engine_run, engine, prompts, args.pair_tokens),
                        partial(lease.run, partial(bare_loop, model, prompts, args.pair_tokens, step)), args.pairs)
                    row["bare_pairs"]["tokens"] = args.pair_tokens
                results["rows"].append(row)
                print_row(row, M, time.perf_counter() - t_b)
    return results


def dec_ratios(a_runs: list[dict[str, Any]], b_runs: list[dict[str, Any]]) -> list[float]:
    """Decode tok/s of each `a` run over the `b` run measured beside it (same round or pair)."""
    pairs = (_r(x["dec_tok_s"], y["dec_tok_s"]) for x, y in zip(a_runs, b_runs))
    return [v for v in pairs if v]


def paired_ratio(row: dict[str, Any], a: str, b: str) -> float | None:
    """Median over rounds of `a`/`b` decode tok/s measured in the same round.

    The host's speed drifts over seconds (the H200's bare loop moved 2x between
    machine instances), and the methods of one round run back to back, so a
    ratio within a round cancels more of the drift than a ratio of medians.
    """
    values = dec_ratios(row["runs"].get(a, []), row["runs"].get(b, []))
    return statistics.median(values) if values else None


def _r(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_row(row: dict[str, Any], M: int, took: float) -> None:
    med = row["median"]
    parts = [f"B={row['B']:>2}"]
    for name in med:
        parts.append(f"{name} {fmt(med[name]['e2e_tok_s'])}/{fmt(med[name]['dec_tok_s'])}")
    print("  " + " | ".join(parts) + f"   (e2e/dec tok/s; {took:.0f} s)", flush=True)
    bad = {k: v for k, v in row["row_tokens_min_max"].items() if v != (M, M)}
    if bad:
        print(f"  !! rows did not all generate {M} tokens: {bad}", flush=True)


def print_tables(results: dict[str, Any], args: argparse.Namespace) -> None:
    rows = results["rows"]
    print()
    print(f"## {results['label']}: prompt {args.prompt_tokens} tokens, max_tokens {args.max_tokens}, "
          f"greedy, {f'median of {args.repeats}' if args.repeats else 'interleaved pairs only'}")
    print(f"## {results['machine_line']}")
    if not args.repeats:  # --pairs only
        print_pairs(rows)
        return
    print()
    print("aggregate tok/s, end to end (submit -> last token; prefill included)")
    print("| B | engine | direct DecodeBatch | BatchGenerator | bare loop | engine/bare | engine/BatchGen |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        m = row["median"]
        e, d, g, b = (m[k]["e2e_tok_s"] for k in ("engine", "direct", "batchgen", "bare"))
        print(f"| {row['B']} | {fmt(e)} | {fmt(d)} | {fmt(g)} | {fmt(b)} | {fmt(_r(e, b), '.2f')} | "
              f"{fmt(_r(e, g), '.2f')} |")
    print()
    print("decode tok/s (window in which every row decodes)")
    print("| B | engine | direct DecodeBatch | BatchGenerator | bare loop | engine/bare | engine/bare paired "
          "| engine/BatchGen | direct/bare | lease gap µs/job | lease gap µs/step | lease jobs/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        m = row["median"]
        e, d, g, b = (m[k]["dec_tok_s"] for k in ("engine", "direct", "batchgen", "bare"))
        jobs, steps = m["engine"]["lease_jobs"], m["engine"]["decode_steps"]
        print(f"| {row['B']} | {fmt(e)} | {fmt(d)} | {fmt(g)} | {fmt(b)} | {fmt(_r(e, b), '.2f')} | "
              f"{fmt(paired_ratio(row, 'engine', 'bare'), '.2f')} | "
              f"{fmt(_r(e, g), '.2f')} | {fmt(_r(d, b), '.2f')} | {fmt(m['engine']['lease_gap_us_per_job'], '.0f')} | "
              f"{fmt(m['engine']['lease_gap_us_per_step'], '.0f')} | {fmt(_r(jobs, steps), '.2f')} |")
    print_pairs(rows)
    print()
    print("per decode step (ms): bare loop host split, and the engine's DecodeBatch.step_decoded() host time (direct)")
    print("| B | bare step | bare: build graph | bare: async_eval | bare: wait for device | direct step() |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        m = row["median"]
        b = m["bare"]
        step = 1e3 * row["B"] / b["dec_tok_s"] if b["dec_tok_s"] else None
        print(f"| {row['B']} | {fmt(step, '.2f')} | {fmt(b.get('build_ms'), '.2f')} | {fmt(b.get('launch_ms'), '.2f')} | "
              f"{fmt(b.get('wait_ms'), '.2f')} | {fmt(m['direct'].get('step_ms'), '.2f')} |")
    for row in rows:
        if row["B"] == 1 and "batch1" in row["median"]:
            m = row["median"]
            print()
            print("B=1: engine vs --batch 1 engine vs mlx-lm stream_generate (decode tok/s; e2e tok/s)")
            print("| engine | --batch 1 | stream_generate | bare loop | engine/batch1 (paired median) "
                  "| batch1/bare | stream_generate/bare |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
            e, s, sg, b = (m[k]["dec_tok_s"] for k in ("engine", "batch1", "stream_gen", "bare"))
            ee, se = m["engine"]["e2e_tok_s"], m["batch1"]["e2e_tok_s"]
            print(f"| {fmt(e)} ({fmt(ee)}) | {fmt(s)} ({fmt(se)}) | {fmt(sg)} | {fmt(b)} | "
                  f"{fmt(row['b1_engine_over_batch1_paired'], '.3f')} | {fmt(_r(s, b), '.2f')} | "
                  f"{fmt(_r(sg, b), '.2f')} |")
            print(f"  paired engine/batch1 ratios: {', '.join(f'{x:.3f}' for x in row['b1_pairs'])}")


def print_pairs(rows: list[dict[str, Any]]) -> None:
    """The interleaved-pair results (--pairs): engine/bare per B, and engine/batch1 at B=1."""
    paired = [row for row in rows if row.get("bare_pairs")]
    if paired:
        tokens = paired[0]["bare_pairs"]["tokens"]
        print()
        print(f"engine/bare decode, interleaved ABBA pairs ({len(paired[0]['bare_pairs']['ratios'])} x {tokens} tokens)")
        print("(per step, medians: decode wall ms, and CPU µs of the lease thread and of the Trio thread inside the "
              "decode window)")
        print("| B | median | quartiles | ratio of medians | pairs at or above 0.9 | step ms engine / bare "
              "| lease CPU engine / bare | Trio CPU | step job ms | lease idle | step chains |")
        print("|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|")
        for row in paired:
            pair = row["bare_pairs"]
            q1, q3 = pair["q1_q3"]
            quartiles = f"{q1:.3f}-{q3:.3f}" if q1 is not None else "-"
            above = sum(r >= 0.9 for r in pair["ratios"])
            engine, bare = pair["runs"]["a"], pair["runs"]["b"]
            step_ms = [_r(1e3 * row["B"], median_of(runs, "dec_tok_s")) for runs in (engine, bare)]
            print(f"| {row['B']} | {fmt(pair['median'], '.3f')} | {quartiles} | "
                  f"{fmt(pair['ratio_of_medians'], '.3f')} | {above}/{len(pair['ratios'])} | "
                  f"{fmt(step_ms[0], '.2f')} / {fmt(step_ms[1], '.2f')} | "
                  f"{fmt(median_of(engine, 'lease_cpu_us_per_step'), '.0f')} / "
                  f"{fmt(median_of(bare, 'lease_cpu_us_per_step'), '.0f')} | "
                  f"{fmt(median_of(engine, 'trio_cpu_us_per_step'), '.0f')} | "
                  f"{fmt(median_of(engine, 'job_ms_per_step'), '.2f')} | {fmt(median_of(engine, 'lease_idle_frac'), '.3f')} | "
                  f"{fmt(median_of(engine, 'step_chains'), '.0f')} |")
    for row in rows:
        if row.get("b1_pairs_interleaved") is not None:  # the key names predate --pairs
            q1, q3 = row["b1_interleaved_q1_q3"]
            quartiles = f" ({q1:.3f}-{q3:.3f})" if q1 is not None else ""
            print()
            print(f"B=1 engine vs --batch 1 engine, interleaved ABBA pairs ({len(row['b1_pairs_interleaved'])} x "
                  f"{row['b1_pair_tokens']} tokens): engine/batch1 median {fmt(row['b1_interleaved_median'], '.3f')}, "
                  f"IQR {fmt(row['b1_interleaved_iqr'], '.3f')}{quartiles}, "
                  f"ratio of medians {fmt(row['b1_interleaved_ratio_of_medians'], '.3f')}")


# -- long prompts ----------------------------------------------------------------------------------

async def bench_long_prompts(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    import mlx.core as mx

    rows, length = (int(x) for x in args.long_prompts.lower().split("x"))
    M = args.long_max_tokens
    out: dict[str, Any] = {"requests": rows, "prompt_tokens": length, "max_tokens": M}
    async with open_engine(str(model_dir), batch=rows, kv_budget_bytes=args.kv_budget,
                           prefill_step_size=args.prefill_step_size) as engine:
        lease, loaded = engine.actors.lane.lease, engine.model
        out["machine"] = await lease.run(machine_info)
        prompts = pick_prompts(rows, length, loaded.vocab_size, args.seed + 1)
        out["projected_bytes_per_request"] = loaded.kv_layout.request_bytes(length, M, args.prefill_step_size)
        out["kv_bytes_per_row_final"] = loaded.kv_layout.row_bytes(length + M)
        out["weights_bytes"] = loaded.weights_bytes
        await lease.run(mx.reset_peak_memory)
        peaks = {"in_flight_rows": 0, "reserved_bytes": 0, "pending": 0, "decode_rows": 0, "kv_bytes": 0}
        results: list[dict[str, Any]] = [{} for _ in prompts]
        done = trio.Event()

        async def watch() -> None:
            while not done.is_set():
                a = engine.actors.lane.admission.statistics()
                d = engine.actors.lane.decode_step.statistics()
                counters = engine.status()["counters"]
                peaks["in_flight_rows"] = max(peaks["in_flight_rows"], a.in_flight_rows)
                peaks["reserved_bytes"] = max(peaks["reserved_bytes"], a.reserved_bytes)
                peaks["pending"] = max(peaks["pending"], a.mailbox_depth)
                peaks["decode_rows"] = max(peaks["decode_rows"], d.active_rows)
                peaks["kv_bytes"] = max(peaks["kv_bytes"], counters["kv_bytes"])
                out["budget_bytes"] = a.budget_bytes
                await trio.sleep(0.005)

        async def one(i: int, ids: list[int]) -> None:
            first = None
            n = 0
            try:
                async for event in engine.generate(ids, max_tokens=M):
                    if isinstance(event, TextDelta) and event.token_ids:
                        first = first or time.perf_counter()
                        n += len(event.token_ids)
                    elif isinstance(event, Finished):
                        results[i] = {"finish_reason": event.finish_reason,
                                      "completion_tokens": event.usage.completion_tokens,
                                      "ttft_s": first - t0 if first else None,
                                      "done_s": time.perf_counter() - t0}
            except Exception as exc:  # report, do not hide: a failed request is a result
                results[i] = {"error": repr(exc)}

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as requests:
                for i, ids in enumerate(prompts):
                    requests.start_soon(one, i, ids)
            done.set()
        out["wall_s"] = time.perf_counter() - t0
        out["peak_memory_bytes"] = await lease.run(mx.get_peak_memory)
        out["active_memory_bytes"] = await lease.run(mx.get_active_memory)
        out["peaks"] = peaks
        out["requests_detail"] = results
        out["completed"] = sum(1 for r in results if r.get("completion_tokens") == M)
        out["lease"] = {"jobs_run": lease.statistics().jobs_run, "jobs_failed": lease.statistics().jobs_failed}
    gib = 2**30
    print(f"\n## long prompts: {rows} x {length} tokens, max_tokens {M}, engine batch={rows}")
    print(f"completed {out['completed']}/{rows} (reasons {sorted({r.get('finish_reason', r.get('error')) for r in results})})"
          f" in {out['wall_s']:.1f} s; peak memory {out['peak_memory_bytes'] / gib:.2f} GiB"
          f" (weights {out['weights_bytes'] / gib:.2f} GiB)")
    print(f"KV budget {out.get('budget_bytes', 0) / gib:.1f} GiB; projected per request "
          f"{out['projected_bytes_per_request'] / gib:.2f} GiB (final KV {out['kv_bytes_per_row_final'] / gib:.3f} GiB);"
          f" max in-flight rows {peaks['in_flight_rows']}, max reserved {peaks['reserved_bytes'] / gib:.2f} GiB,"
          f" max queued {peaks['pending']}, max decode rows {peaks['decode_rows']},"
          f" max live KV {peaks['kv_bytes'] / gib:.2f} GiB")
    ttfts = [r.get("ttft_s") for r in results if r.get("ttft_s") is not None]
    if ttfts:
        print(f"TTFT min/median/max {min(ttfts):.2f}/{statistics.median(ttfts):.2f}/{max(ttfts):.2f} s")
    return out


# -- main ------------------------------------------------------------------------------------------

def versions() -> dict[str, str]:
    out = {}
    for name in ("mlx", "mlx-lm", "mlx-metal", "mlx-cpu", "mlx-cuda-13", "mlx-cuda-12", "trio"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def machine_line(info: dict[str, Any], vers: dict[str, str]) -> str:
    di = info.get("device_info", {})
    name = di.get("device_name") or di.get("architecture") or "?"
    mem = di.get("total_memory") or di.get("memory_size")
    mem_s = f", {mem / 2**30:.0f} GiB" if isinstance(mem, int) else ""
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {info.get('device')} = {name}{mem_s}; "
            f"{', '.join(f'{k} {v}' for k, v in vers.items())}; Python {platform.python_version()}; "
            f"{datetime.date.today().isoformat()}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="an mlx-lm model directory, or 'default' for SmolLM2-135M (the default)")
    src.add_argument("--shape", choices=["tiny", *SHAPES], help="a random-weight model of this shape")
    p.add_argument("--num-layers", type=int, help="override the shape's layer count (smoke tests)")
    p.add_argument("--batches", default="1,4,8,16", help="comma-separated B values (default 1,4,8,16)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3,
                   help="measured rounds per B after one warm-up (default 3; 0 with --pairs: pairs only)")
    p.add_argument("--pairs", type=int, default=0,
                   help="after each B's rounds, N interleaved (ABBA) engine/bare pairs, and at B=1 engine/batch1 "
                        "single-request pairs (default 0: off)")
    p.add_argument("--pair-tokens", type=int, default=64, help="max_tokens of each --pairs run (default 64)")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--kv-budget", type=int, default=None, help="engine kv_budget_bytes (default: derived)")
    p.add_argument("--prompt-cache-bytes", type=int, default=None,
                   help="engine prompt_cache_bytes (default: the engine's; 0: off, so no run reuses another's KV)")
    p.add_argument("--long-prompts", metavar="RxN", help="e.g. 8x12600: R concurrent N-token prompts instead")
    p.add_argument("--long-max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--switch-interval", type=float, default=SERVE_SWITCH_INTERVAL_S,
                   help="sys.setswitchinterval, as `mlx-trio serve` sets it (default 0.001)")
    p.add_argument("--json", type=Path, help="write every run's numbers here")
    p.add_argument("--render", type=Path, metavar="JSON", help="print the tables of an earlier --json file and exit")
    args = p.parse_args(argv)
    args.batches = sorted({int(b) for b in args.batches.split(",")})
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        results = json.loads(args.render.read_text())
        if "rows" in results:
            print_tables(results, argparse.Namespace(**{**results["args"], "batches": results["args"]["batches"]}))
        else:
            print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=1))
        return 0
    sys.setswitchinterval(args.switch_interval)
    with tempfile.TemporaryDirectory(prefix="mlx-trio-bench-") as tmp:
        model_dir, label = resolve_model(Path(tmp), shape=args.shape, model=args.model,
                                         num_layers=args.num_layers)
        vers = versions()
        print(f"# {label}; {platform.platform()}; {vers}", flush=True)
        if args.long_prompts:
            results = trio.run(bench_long_prompts, args, model_dir)
        else:
            results = trio.run(bench_batches, args, model_dir)
        results["label"] = label
        results["versions"] = vers
        results["machine_line"] = machine_line(results["machine"], vers)
        results["platform"] = platform.platform()
        results["date"] = datetime.date.today().isoformat()
        results["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        if not args.long_prompts:
            print_tables(results, args)
        else:
            print(f"## {results['machine_line']}")
    write_json(args.json, results)
    return 0


def write_json(path: Path | None, results: dict[str, Any]) -> None:
    """Every run's numbers to `path` (--json), if given."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
