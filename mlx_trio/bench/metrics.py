"""Metric math: percentiles, wall-clock throughput, a summary per (server, concurrency), ratios.

Inter-token latency (ITL) is the gaps between content chunks as the client saw
them; a server that writes several tokens at once shows near-zero gaps and
then a long one. Time per output token (TPOT) is each request's decode pace,
(e2e - TTFT) / (tokens - 1), which chunking cannot distort.

Throughput is wall-clock: output tokens of the completed requests (the servers'
own `usage.completion_tokens`) divided by the time from the first request's
send to the last request's end, so bursts of chunks cannot inflate it. A
summary pools the samples of every round a server ran at one concurrency, and
its throughput is total tokens over the rounds' total wall time.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence

import attrs

from mlx_trio.bench.client import RequestResult

# Distinct error messages kept per summary (the rest are counted in `num_failed` only).
MAX_ERROR_KINDS = 5


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0 ≤ q ≤ 100) with linear interpolation between ranks (numpy's default); None if empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be within [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def wall_s(results: Sequence[RequestResult]) -> float:
    """Seconds from the first request's send to the last request's end (0 for no requests)."""
    if not results:
        return 0.0
    return max(r.end_s for r in results) - min(r.start_s for r in results)


def throughput_tok_s(total_tokens: int, total_wall_s: float) -> float | None:
    """Aggregate tokens per wall-clock second; None when no time passed."""
    return total_tokens / total_wall_s if total_wall_s > 0 else None


def time_per_output_token_s(result: RequestResult) -> float | None:
    """(e2e - TTFT) / (tokens - 1): one request's decode pace, immune to how the server groups chunks."""
    tokens = result.output_tokens
    if result.ttft_s is None or tokens < 2:
        return None
    return (result.e2e_s - result.ttft_s) / (tokens - 1)


def chunk_times_s(result: RequestResult) -> list[float]:
    """When each content chunk of `result` arrived, on the `start_s` clock."""
    if result.ttft_s is None:
        return []
    times = [result.start_s + result.ttft_s]
    for gap in result.itl_s:
        times.append(times[-1] + gap)
    return times


def decode_stall_s(results: Sequence[RequestResult]) -> float | None:
    """long-prompt: the longest gap between two chunks of a background stream that overlaps the long prompt's prefill.

    The prefill window runs from the long request's send to its first chunk.
    None when there is no completed long request, or no background stream was
    still decoding during the window (then nothing was measured: make the
    background outputs longer).
    """
    long = [r for r in results if r.tag == "long" and r.ok and r.ttft_s is not None]
    if not long:
        return None
    window_start_s, window_end_s = long[0].start_s, long[0].start_s + (long[0].ttft_s or 0.0)
    gaps = [b - a for r in results if r.tag == "background"
            for a, b in itertools.pairwise(chunk_times_s(r)) if a < window_end_s and b > window_start_s]
    return max(gaps) if gaps else None


def prefill_stall_s(results: Sequence[RequestResult]) -> float | None:
    """agent-loop: the longest gap between two chunks of a stream while another request's prompt prefilled.

    A request's prefill window runs from its send to its first chunk; a gap
    counts when it overlaps the window of a request other than its own. None
    when no gap overlapped any other prefill.
    """
    ok = [r for r in results if r.ok and r.ttft_s is not None]
    windows = [(r, r.start_s, r.start_s + (r.ttft_s or 0.0)) for r in ok]
    gaps = [b - a for r in ok for a, b in itertools.pairwise(chunk_times_s(r))
            if any(other is not r and a < end and b > start for other, start, end in windows)]
    return max(gaps) if gaps else None


def cached_fraction_by_turn(results: Sequence[RequestResult]) -> tuple[float | None, ...]:
    """For each turn index, the completed requests' cached prompt tokens over their prompt tokens."""
    ok = [r for r in results if r.ok and r.prompt_tokens]
    if not ok:
        return ()
    fractions: list[float | None] = []
    for turn in range(max(r.turn for r in ok) + 1):
        at = [r for r in ok if r.turn == turn]
        prompt = sum(r.prompt_tokens or 0 for r in at)
        fractions.append(sum(r.cached_tokens or 0 for r in at) / prompt if prompt else None)
    return tuple(fractions)


@attrs.frozen
class Summary:
    """One server at one concurrency, pooled over its rounds; latencies in seconds."""

    server: str
    concurrency: int
    rounds: int
    num_ok: int
    num_failed: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    tpot_p50_s: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    output_tokens: int
    wall_s: float
    output_tok_s: float | None
    prompt_tokens: int
    cached_tokens: int
    # Completed requests that finished with "stop" (EOS not suppressed, or a stop string).
    num_stopped_early: int = 0
    # long-prompt only: the background streams' largest gap during the long prefill, and the long prompt's TTFT.
    decode_stall_s: float | None = None
    long_ttft_s: float | None = None
    # agent-loop only: the largest gap of a running stream while another prompt prefilled, and
    # each turn's cached fraction of its prompt tokens (turn 0 first).
    prefill_stall_s: float | None = None
    cached_fraction_by_turn: tuple[float | None, ...] = ()
    errors: tuple[tuple[str, int], ...] = ()
    # Set when a managed server process exited during this concurrency's rounds.
    server_died: bool = False
    # The GPU's mean busy percentage over the rounds (nvidia-smi), None where it was not sampled.
    gpu_busy_percent: float | None = None


def summarize(server: str, concurrency: int, rounds: Sequence[Sequence[RequestResult]], *,
              server_died: bool = False, gpu_busy: Sequence[float] = ()) -> Summary:
    """Pool the results of each round (one list per round) into a `Summary`; `gpu_busy`: each round's mean busy %."""
    results = [r for run in rounds for r in run]
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    tpot = [t for r in ok if (t := time_per_output_token_s(r)) is not None]
    e2e = [r.e2e_s for r in ok]
    output_tokens = sum(r.output_tokens for r in ok)
    total_wall_s = sum(wall_s(run) for run in rounds)
    stalls = [s for run in rounds if (s := decode_stall_s(run)) is not None]
    long_ttft = [r.ttft_s for r in ok if r.tag == "long" and r.ttft_s is not None]
    agent_loop = any(r.tag == "agent" for r in results)
    prefill_stalls = [s for run in rounds if (s := prefill_stall_s(run)) is not None] if agent_loop else []
    errors = Counter(r.error or "unknown" for r in failed).most_common(MAX_ERROR_KINDS)
    return Summary(
        server=server, concurrency=concurrency, rounds=len(rounds), num_ok=len(ok), num_failed=len(failed),
        ttft_p50_s=percentile(ttft, 50), ttft_p95_s=percentile(ttft, 95), ttft_p99_s=percentile(ttft, 99),
        itl_p50_s=percentile(itl, 50), itl_p95_s=percentile(itl, 95), tpot_p50_s=percentile(tpot, 50),
        e2e_p50_s=percentile(e2e, 50), e2e_p95_s=percentile(e2e, 95),
        output_tokens=output_tokens, wall_s=total_wall_s, output_tok_s=throughput_tok_s(output_tokens, total_wall_s),
        prompt_tokens=sum(r.prompt_tokens or 0 for r in ok), cached_tokens=sum(r.cached_tokens or 0 for r in ok),
        num_stopped_early=sum(1 for r in ok if r.finish_reason == "stop"),
        decode_stall_s=max(stalls) if stalls else None,
        long_ttft_s=max(long_ttft) if long_ttft else None,
        prefill_stall_s=max(prefill_stalls) if prefill_stalls else None,
        cached_fraction_by_turn=cached_fraction_by_turn(results) if agent_loop else (),
        errors=tuple(errors), server_died=server_died,
        gpu_busy_percent=sum(gpu_busy) / len(gpu_busy) if gpu_busy else None,
    )


# Fields compared between servers, and whether higher is better (for the reader; the ratio is always a/b).
RATIO_FIELDS: tuple[tuple[str, bool], ...] = (
    ("output_tok_s", True), ("ttft_p50_s", False), ("ttft_p95_s", False), ("ttft_p99_s", False),
    ("itl_p50_s", False), ("itl_p95_s", False), ("tpot_p50_s", False), ("e2e_p50_s", False),
    ("e2e_p95_s", False),
    ("decode_stall_s", False), ("long_ttft_s", False), ("prefill_stall_s", False),
)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratios(a: Summary, b: Summary) -> dict[str, float | None]:
    """a/b for each of `RATIO_FIELDS` (ours/theirs when a is ours)."""
    return {name: ratio(getattr(a, name), getattr(b, name)) for name, _ in RATIO_FIELDS}
