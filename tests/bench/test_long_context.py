"""The long-context workload (issue #46): its shape, its report (TTFT percentiles, prefill under load, the rate
sweep), and one tiny end-to-end sweep against our server."""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_trio.bench import workloads
from mlx_trio.bench.client import RequestResult
from mlx_trio.bench.long_context import highest_rate, markdown, summarize_load
from mlx_trio.bench.workloads import (LONG_MAX_OUTPUT, LONG_MAX_WORDS, LONG_MIN_OUTPUT, LONG_MIN_WORDS,
                                      WorkloadParams, heavy_tailed_words)


def test_prompt_lengths_are_heavy_tailed_from_1k_to_100k_with_a_mean_near_12k() -> None:
    rng = random.Random(7)
    drawn = [heavy_tailed_words(rng) for _ in range(20_000)]
    assert min(drawn) == LONG_MIN_WORDS and max(drawn) == LONG_MAX_WORDS
    assert 11_000 < statistics.mean(drawn) < 13_500 and statistics.median(drawn) < 0.6 * statistics.mean(drawn)
    scaled = [heavy_tailed_words(rng, 0.01) for _ in range(2_000)]
    assert min(scaled) == 10 and max(scaled) <= 1000


def test_the_workload_shares_a_system_prefix_reuses_turns_and_arrives_at_the_rate() -> None:
    params = WorkloadParams(num_requests=400, seed=3, rate_per_s=4.0, length_scale=1.0, max_turns=3)
    workload = workloads.build("long-context", params, 1000)
    assert workload.num_requests == 400 and workload.max_in_flight == 1000
    assert len({s.system for s in workload.sessions}) == 1
    assert {len(s.turns) for s in workload.sessions} == {1, 2, 3}
    outputs = [t.max_tokens for s in workload.sessions for t in s.turns]
    assert LONG_MIN_OUTPUT <= min(outputs) and max(outputs) <= LONG_MAX_OUTPUT
    arrivals = [s.arrival_s for s in workload.sessions]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    gaps = statistics.mean(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
    assert 0.2 < gaps < 0.3  # 1 / rate
    first_words = [len(s.turns[0].user.split()) - 2 for s in workload.sessions]
    assert 8_000 < statistics.mean(first_words) < 16_000
    assert workload == workloads.build("long-context", params, 1000)  # one seed, one workload
    tiny = workloads.build("long-context", attrs_evolve(params, length_scale=0.01), 8)
    assert max(len(s.turns[0].user.split()) for s in tiny.sessions) <= 1002
    assert max(t.max_tokens for s in tiny.sessions for t in s.turns) <= 9


def attrs_evolve(params: WorkloadParams, **changes: object) -> WorkloadParams:
    import attrs  # noqa: PLC0415

    return attrs.evolve(params, **changes)


def _result(start: float, ttft: float | None, prompt: int, cached: int = 0, ok: bool = True) -> RequestResult:
    return RequestResult(session_id="s", turn=0, tag="long-context", ok=ok, start_s=start,
                         end_s=start + (ttft or 0.0) + 1.0, ttft_s=ttft, prompt_tokens=prompt, cached_tokens=cached,
                         completion_tokens=10)


def test_the_load_summary_counts_computed_prompt_tokens_over_the_prefill_window() -> None:
    """Two rounds: round 1 prefills 1000 + (3000 - 1000 cached) tokens between 0 s and 4 s, round 2 500 tokens in
    1 s: 3500 tokens over 5 s. TTFTs 1, 3, 1 (and one failure): p50 1, 2 of 4 within a 2 s target."""
    run1 = [_result(0.0, 1.0, 1000), _result(1.0, 3.0, 3000, cached=1000)]
    run2 = [_result(10.0, 1.0, 500), _result(10.5, None, 800, ok=False)]
    summary = summarize_load("ours", 2.0, [run1, run2], ttft_target_s=2.0)
    assert summary.requests == 4 and summary.failed == 1
    assert summary.prefill_tok_s == pytest.approx(3500 / 5.0)
    assert summary.ttft_p50_s == 1.0 and summary.ttft_p90_s == pytest.approx(2.6) and summary.within_target == 0.5


def test_the_highest_rate_is_the_last_that_kept_p90_within_the_target_without_failures() -> None:
    fast = [_result(0.0, 0.5, 100)]
    slow = [_result(0.0, 9.0, 100)]
    failed = [_result(0.0, 0.5, 100), _result(0.0, None, 100, ok=False)]
    summaries = [summarize_load("ours", 1.0, [fast]), summarize_load("ours", 2.0, [fast]),
                 summarize_load("ours", 4.0, [slow]), summarize_load("mlx_lm", 1.0, [fast]),
                 summarize_load("mlx_lm", 2.0, [failed])]
    assert highest_rate(summaries, "ours") == 2.0 and highest_rate(summaries, "mlx_lm") == 1.0
    assert highest_rate(summaries, "ours", ttft_target_s=10.0) == 4.0
    assert highest_rate([summarize_load("x", 1.0, [slow])], "x") is None
    text = markdown(summaries)
    assert "ours: highest rate with TTFT p90 <= 5 s and no failure: 2/s" in text


@pytest.mark.slow
def test_a_tiny_rate_sweep_against_our_server(tmp_path: Path) -> None:
    """--workload long-context --rates 2,4 at a tiny scale: every request completes, each run remembers its rate,
    and the report has a row per rate and the sweep's answer."""
    from mlx_trio.testing.tiny_models import LLAMA, tiny_model  # noqa: PLC0415

    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "mlx_trio.bench", "--serve", "ours", "--model", str(tiny_model(LLAMA)),
         "--workload", "long-context", "--length-scale", "0.005", "--rates", "2,4", "--requests", "4",
         "--concurrency", "64", "--rounds", "1", "--ttft-target", "60", "--out", str(out),
         "--log-dir", str(tmp_path / "logs"), "--no-progress"],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^\| ours \| 2 \| 4 \| 0 \|", done.stdout, re.M), done.stdout
    assert re.search(r"^\| ours \| 4 \| 4 \| 0 \|", done.stdout, re.M), done.stdout
    assert "ours: highest rate with TTFT p90 <= 60 s and no failure: 4/s" in done.stdout
    assert re.search(r"^start-up \(launch to ready\): ours \d+\.\d s$", done.stdout, re.M), done.stdout
    doc = json.loads(out.read_text())
    assert [run["rate_per_s"] for run in doc["runs"]] == [2.0, 4.0] and doc["meta"]["servers"][0]["startup_s"] > 0
    assert all(r["ok"] and r["prompt_tokens"] > 0 for run in doc["runs"] for r in run["requests"])
