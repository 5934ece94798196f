"""The long-context workload's report: TTFT percentiles, prefill under load, a rate sweep (issue #46).

One `LoadSummary` per (server, arrival rate) pools every round at that rate:

- TTFT p50 / p90 / p99 of the requests that got a first token;
- `within_target`: the share of all requests (failed ones count as missed)
  whose TTFT was at most the target (`--ttft-target`, 5 s by default);
- `prefill_tok_s`: prompt tokens the server had to compute (usage's
  prompt_tokens less its cached_tokens where it reports them) over the time it
  had prompts to prefill: per run, from the first request's send to the last
  first token, summed over the rounds. Under load that is the server's prefill
  rate; compare it with a lone prompt's (one request, `--rate` low enough that
  none overlap).

`highest_rate` is the sweep's answer: the highest rate at which TTFT p90 stayed
within the target and no request failed.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from mlx_trio.bench.client import RequestResult
from mlx_trio.bench.metrics import percentile

DEFAULT_TTFT_TARGET_S = 5.0


@attrs.frozen
class LoadSummary:
    server: str
    rate_per_s: float | None
    requests: int
    failed: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    within_target: float | None  # 0..1, None for no requests
    prefill_tok_s: float | None
    prompt_tokens_mean: float | None


def prefill_window_s(results: Sequence[RequestResult]) -> float:
    """One run's prefill window: from the first send to the last first token (0 when none had one)."""
    firsts = [r.start_s + r.ttft_s for r in results if r.ttft_s is not None]
    return max(firsts) - min(r.start_s for r in results) if firsts else 0.0


def computed_prompt_tokens(result: RequestResult) -> int:
    """Prompt tokens the server computed for `result`: its prompt less what its prefix cache supplied."""
    return max((result.prompt_tokens or 0) - (result.cached_tokens or 0), 0)


def summarize_load(server: str, rate_per_s: float | None, runs: Sequence[Sequence[RequestResult]], *,
                   ttft_target_s: float = DEFAULT_TTFT_TARGET_S) -> LoadSummary:
    """Pool the rounds `runs` (each one run's results) of `server` at one rate."""
    results = [r for run in runs for r in run]
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    window = sum(prefill_window_s(run) for run in runs if run)
    computed = sum(computed_prompt_tokens(r) for r in results if r.ok)
    prompts = [r.prompt_tokens for r in results if r.ok and r.prompt_tokens is not None]
    return LoadSummary(
        server=server, rate_per_s=rate_per_s, requests=len(results), failed=sum(not r.ok for r in results),
        ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90), ttft_p99_s=percentile(ttfts, 99),
        within_target=sum(t <= ttft_target_s for t in ttfts) / len(results) if results else None,
        prefill_tok_s=computed / window if window > 0 else None,
        prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None,
    )


def highest_rate(summaries: Sequence[LoadSummary], server: str, *,
                 ttft_target_s: float = DEFAULT_TTFT_TARGET_S) -> float | None:
    """The highest swept rate of `server` with TTFT p90 within the target and no failure; None if no rate held."""
    held = [s.rate_per_s for s in summaries
            if s.server == server and s.rate_per_s is not None and s.failed == 0
            and s.ttft_p90_s is not None and s.ttft_p90_s <= ttft_target_s]
    return max(held) if held else None


def markdown(summaries: Sequence[LoadSummary], *, ttft_target_s: float = DEFAULT_TTFT_TARGET_S) -> str:
    """One row per (server, rate), then each server's highest rate within the target."""
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [f"| server | rate/s | requests | failed | TTFT p50 s | p90 s | p99 s | TTFT <= {ttft_target_s:g} s "
             "| prefill tok/s under load | mean prompt tok |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for x in summaries:
        within = "-" if x.within_target is None else f"{100 * x.within_target:.0f}%"
        prefill = "-" if x.prefill_tok_s is None else f"{x.prefill_tok_s:.0f}"
        mean = "-" if x.prompt_tokens_mean is None else f"{x.prompt_tokens_mean:.0f}"
        lines.append(f"| {x.server} | {'all at once' if x.rate_per_s is None else f'{x.rate_per_s:g}'} "
                     f"| {x.requests} | {x.failed} | {s(x.ttft_p50_s)} | {s(x.ttft_p90_s)} | {s(x.ttft_p99_s)} "
                     f"| {within} | {prefill} | {mean} |")
    for server in dict.fromkeys(x.server for x in summaries):
        rate = highest_rate(summaries, server, ttft_target_s=ttft_target_s)
        lines.append(f"\n{server}: highest rate with TTFT p90 <= {ttft_target_s:g} s and no failure: "
                     f"{'none of those swept' if rate is None else f'{rate:g}/s'}")
    return "\n".join(lines)
