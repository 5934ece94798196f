"""bench/metrics.py: percentiles, wall-clock throughput, pooled summaries and ratios."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_trio.bench.client import RequestResult
from mlx_trio.bench.metrics import (
    percentile,
    ratio,
    ratios,
    summarize,
    throughput_tok_s,
    time_per_output_token_s,
    wall_s,
)


def _result(start_s: float, end_s: float, *, ok: bool = True, tokens: int | None = 10, ttft_s: float | None = 0.1,
            itl_s: tuple[float, ...] = (), tag: str = "task", chunks: int = 0, finish: str = "length",
            error: str | None = None, cached: int | None = 0, prompt: int | None = 100) -> RequestResult:
    return RequestResult(session_id="s", turn=0, tag=tag, ok=ok, start_s=start_s, end_s=end_s, ttft_s=ttft_s,
                         itl_s=itl_s, completion_tokens=tokens, content_chunks=chunks, finish_reason=finish,
                         error=error, cached_tokens=cached, prompt_tokens=prompt)


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([1, 2, 3, 4], 50, 2.5),
    ([1, 2, 3, 4], 0, 1.0),
    ([1, 2, 3, 4], 100, 4.0),
    ([4, 1, 3, 2], 25, 1.75),  # order of the input does not matter
    (list(range(1, 101)), 95, 95.05),
    (list(range(1, 101)), 99, 99.01),
    ([7.0], 99, 7.0),
])
def test_percentile_interpolates_linearly_between_ranks(values: list[float], q: float, expected: float) -> None:
    """Percentiles match numpy's default ('linear') method on hand-checked cases."""
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_of_nothing_is_none_and_q_is_checked() -> None:
    """No samples give None (shown as '–'); q outside [0, 100] is a programming error."""
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100), st.floats(0, 100))
def test_percentile_is_monotone_in_q_and_within_the_range(values: list[float], q1: float, q2: float) -> None:
    """A higher q never gives a lower value, and every percentile lies within [min, max]."""
    low, high = sorted((q1, q2))
    p_low, p_high = percentile(values, low), percentile(values, high)
    assert p_low is not None and p_high is not None
    assert min(values) - 1e-6 <= p_low <= p_high + 1e-6 <= max(values) + 2e-6


def test_wall_clock_spans_first_send_to_last_end() -> None:
    """Wall time is max(end) - min(start), not the sum of request durations (overlap counts once)."""
    results = [_result(10.0, 12.0), _result(11.0, 15.0), _result(10.5, 11.0)]
    assert wall_s(results) == pytest.approx(5.0)
    assert wall_s([]) == 0.0
    assert throughput_tok_s(30, 5.0) == pytest.approx(6.0)
    assert throughput_tok_s(30, 0.0) is None


def test_summary_pools_rounds_and_counts_only_completed_tokens() -> None:
    """Throughput is completed usage tokens over the rounds' summed wall times; failures count separately."""
    round_a = [_result(0.0, 2.0, tokens=10, itl_s=(0.1, 0.3)), _result(1.0, 4.0, tokens=10),
               _result(0.0, 1.0, ok=False, tokens=99, error="HTTP 503: busy")]
    round_b = [_result(100.0, 101.0, tokens=20, ttft_s=0.5, itl_s=(0.2,))]
    s = summarize("ours", 4, [round_a, round_b])
    assert (s.num_ok, s.num_failed, s.rounds) == (3, 1, 2)
    assert s.output_tokens == 40
    assert s.wall_s == pytest.approx(4.0 + 1.0)  # not 101 - 0: the gap between rounds is not bench time
    assert s.output_tok_s == pytest.approx(40 / 5.0)
    assert s.itl_p50_s == pytest.approx(0.2)
    assert s.ttft_p50_s == pytest.approx(0.1)
    assert s.errors == (("HTTP 503: busy", 1),)


def test_summary_falls_back_to_chunks_without_usage_and_flags_early_stops() -> None:
    """No usage chunk: tokens are the content chunks seen; a 'stop' finish is counted as an early stop."""
    s = summarize("x", 1, [[_result(0.0, 1.0, tokens=None, chunks=7, finish="stop")]])
    assert s.output_tokens == 7 and s.num_stopped_early == 1


def test_decode_stall_is_the_longest_background_gap_overlapping_the_long_prefill() -> None:
    """Only gaps that overlap [long send, long first chunk] count; the long request's TTFT is reported apart."""
    # Background chunks at 1.0, 1.1, 3.6 (a 2.5 s gap across the window) and 3.7; another stream's 9 s gap is later.
    during = _result(0.0, 4.0, tag="background", ttft_s=1.0, itl_s=(0.1, 2.5, 0.1))
    after = _result(0.0, 20.0, tag="background", ttft_s=5.0, itl_s=(9.0,))
    long = _result(1.5, 4.0, tag="long", ttft_s=2.0)  # prefill window 1.5 .. 3.5
    s = summarize("ours", 2, [[during, after, long]])
    assert s.decode_stall_s == pytest.approx(2.5) and s.long_ttft_s == pytest.approx(2.0)


def test_no_stall_is_reported_when_no_stream_decoded_during_the_long_prefill() -> None:
    """Background streams that finished before the long prompt arrived measured nothing: None, not 0."""
    early = _result(0.0, 1.0, tag="background", ttft_s=0.1, itl_s=(0.1, 0.1))
    long = _result(2.0, 3.0, tag="long", ttft_s=0.5)
    assert summarize("ours", 1, [[early, long]]).decode_stall_s is None


def test_ratios_are_a_over_b_and_none_when_undefined() -> None:
    """ours/theirs per field; a missing value or a zero denominator gives None instead of a crash."""
    assert ratio(2.0, 4.0) == 0.5 and ratio(None, 1.0) is None and ratio(1.0, 0.0) is None
    a = summarize("a", 1, [[_result(0.0, 1.0, tokens=20, ttft_s=0.1)]])
    b = summarize("b", 1, [[_result(0.0, 2.0, tokens=20, ttft_s=0.4)]])
    r = ratios(a, b)
    assert r["output_tok_s"] == pytest.approx(2.0) and r["ttft_p50_s"] == pytest.approx(0.25)
    assert r["decode_stall_s"] is None


def test_time_per_output_token_is_decode_time_over_tokens_after_the_first() -> None:
    """TPOT = (e2e - TTFT) / (tokens - 1); undefined without a first token or with a single token."""
    assert time_per_output_token_s(_result(0.0, 2.0, tokens=11, ttft_s=1.0)) == pytest.approx(0.1)
    assert time_per_output_token_s(_result(0.0, 2.0, tokens=1, ttft_s=1.0)) is None
    assert time_per_output_token_s(_result(0.0, 2.0, tokens=5, ttft_s=None)) is None
    s = summarize("x", 1, [[_result(0.0, 2.0, tokens=11, ttft_s=1.0), _result(0.0, 3.0, tokens=11, ttft_s=1.0)]])
    assert s.tpot_p50_s == pytest.approx(0.15)


def test_agent_loop_prefill_stall_is_a_streams_longest_gap_over_another_requests_prefill() -> None:
    """A gap counts only while some other request's prompt prefilled (its send to its first chunk)."""
    running = attrs.evolve(_result(0.0, 5.0, tag="agent", ttft_s=0.5, itl_s=(0.1, 1.2, 0.1, 3.0)), turn=1)
    # Chunks at 0.5, 0.6, 1.8, 1.9, 4.9: the 1.2 s gap overlaps the next turn's prefill (1.0 .. 1.5),
    # the 3.0 s gap overlaps nothing.
    arriving = attrs.evolve(_result(1.0, 2.0, tag="agent", ttft_s=0.5, cached=80, prompt=100), turn=2)
    first = _result(0.0, 0.4, tag="agent", ttft_s=0.2, cached=0, prompt=100)
    s = summarize("ours", 2, [[running, arriving, first]])
    assert s.prefill_stall_s == pytest.approx(1.2)
    assert s.cached_fraction_by_turn == (0.0, 0.0, 0.8)
    assert summarize("ours", 1, [[_result(0.0, 1.0)]]).cached_fraction_by_turn == ()  # not agent-loop
