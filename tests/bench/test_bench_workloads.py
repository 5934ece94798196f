"""bench/workloads.py: deterministic sessions for a seed; agents share a prompt; arrivals; long-prompt shape."""

from __future__ import annotations

import itertools
import random
import statistics

import attrs
import pytest

from mlx_trio.bench import workloads
from mlx_trio.bench.workloads import WorkloadParams, build, poisson_arrivals


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_same_seed_same_workload_other_seed_other_prompts(name: str) -> None:
    """Two builds with one seed are equal; another seed changes the prompts (so runs never share a cache)."""
    params = WorkloadParams(num_requests=10, seed=3, rate_per_s=2.0, system_words=50, prompt_words=20,
                            long_prompt_words=100)
    assert build(name, params, 4) == build(name, params, 4)
    other = build(name, attrs.evolve(params, seed=4), 4)
    assert [s.turns for s in other.sessions] != [s.turns for s in build(name, params, 4).sessions]


def test_agents_share_one_system_prompt_with_tools_and_send_distinct_tasks() -> None:
    """Every agent session carries the identical system prompt (with the tool schemas) and its own task."""
    w = build("agents", WorkloadParams(num_requests=12, system_words=300), 4)
    systems = {s.system for s in w.sessions}
    assert len(systems) == 1
    (system,) = systems
    assert system is not None and all(tool["name"] in system for tool in workloads.TOOL_SCHEMAS)
    assert len(system.split()) > 300
    tasks = [s.turns[0].user for s in w.sessions]
    assert len(set(tasks)) == len(tasks)


def test_agents_have_two_turns_per_session_and_n_requests() -> None:
    """ceil(N/2) sessions of two turns each: a task, then a follow-up that the runner sends with the history."""
    w = build("agents", WorkloadParams(num_requests=7, output_tokens=16), 3)
    assert len(w.sessions) == 4 and w.num_requests == 8 and w.max_in_flight == 3
    assert all(len(s.turns) == 2 and all(t.max_tokens == 16 for t in s.turns) for s in w.sessions)
    assert all(s.turns[1].user.startswith("Check your answer") for s in w.sessions)


def test_poisson_arrivals_start_at_zero_grow_and_have_the_given_rate() -> None:
    """Arrival offsets are non-decreasing from 0 with mean gap 1/rate; no rate means all at once."""
    arrivals = poisson_arrivals(random.Random(0), 4000, 5.0)
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert statistics.mean(gaps) == pytest.approx(1 / 5.0, rel=0.1)
    assert poisson_arrivals(random.Random(0), 3, None) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(random.Random(0), 3, 0.0)


def test_agents_arrivals_follow_the_rate() -> None:
    """Agent sessions arrive staggered when a rate is given."""
    w = build("agents", WorkloadParams(num_requests=20, rate_per_s=10.0), 2)
    offsets = [s.arrival_s for s in w.sessions]
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets[-1] > 0


def test_uniform_is_n_single_turn_requests_of_fixed_size() -> None:
    """Uniform: N one-turn sessions, each prompt about prompt_words words, each max_tokens output_tokens."""
    w = build("uniform", WorkloadParams(num_requests=5, prompt_words=40, output_tokens=9), 2)
    assert w.num_requests == 5 and w.max_in_flight == 2
    for s in w.sessions:
        (turn,) = s.turns
        assert s.system is None and turn.max_tokens == 9 and 40 <= len(turn.user.split()) <= 43


def test_long_prompt_is_c_background_streams_then_one_late_long_prompt() -> None:
    """long-prompt: C background decoders, and one long prompt that waits until all C have a first token."""
    p = WorkloadParams(long_prompt_words=500, long_output_tokens=64, output_tokens=8)
    w = build("long-prompt", p, 4)
    background = [s for s in w.sessions if s.tag == "background"]
    (late,) = [s for s in w.sessions if s.tag == "long"]
    assert len(background) == 4 and w.max_in_flight == 5
    assert all(s.turns[0].max_tokens == 64 for s in background)
    assert late.after_first_tokens == 4 and len(late.turns[0].user.split()) > 500


def test_unknown_workload_or_bad_concurrency_is_refused() -> None:
    """Bad names and concurrency < 1 raise ValueError (the CLI checks both before anything starts)."""
    with pytest.raises(ValueError):
        build("nope", WorkloadParams(), 1)
    with pytest.raises(ValueError):
        build("agents", WorkloadParams(), 0)


def test_agent_loop_agents_share_a_system_prompt_and_send_tool_results_with_no_think_time() -> None:
    w = build("agent-loop", WorkloadParams(num_requests=12, system_words=100, tool_result_words=300), 4)
    assert w.max_in_flight == 4 and len(w.sessions) == 4 and w.num_requests == 12
    assert len({s.system for s in w.sessions}) == 1
    assert all(s.arrival_s == 0.0 and s.tag == "agent" and len(s.turns) == 3 for s in w.sessions)
    for session in w.sessions:
        assert session.turns[0].user.startswith("Task ")
        assert all(t.user.startswith("Tool result ") and len(t.user.split()) > 300 for t in session.turns[1:])


def test_serving_draws_lengths_outputs_kinds_and_options_in_a_fixed_order_from_its_seed() -> None:
    """Re-derived from random.Random(seed) in order: arrivals, then per request length, output, kind, options."""
    params = WorkloadParams(num_requests=40, seed=5, rate_per_s=2.0, min_prompt_words=100, max_prompt_words=10_000,
                            output_tokens=128, max_output_tokens=512)
    w = build("serving", params, 8)
    rng = random.Random(5)
    assert [s.arrival_s for s in w.sessions] == poisson_arrivals(rng, 40, 2.0)
    for i, session in enumerate(w.sessions):
        (turn,) = session.turns
        n_words = workloads.log_uniform_int(rng, 100, 10_000)
        assert turn.max_tokens == rng.randint(128, 512)
        kind = rng.choice(workloads.SERVING_KINDS)
        sampling, bias = workloads.serving_options(rng, kind)
        assert (session.tag, dict(turn.sampling), dict(turn.logit_bias)) == (kind, sampling, bias)
        assert turn.user == f"Request {i}: {workloads.words(rng, n_words)}."
        assert len(turn.user.split()) == n_words + 2
        assert session.system is None and session.session_id == f"serving-{i}"
    assert w.max_in_flight == 8


def test_serving_options_per_kind() -> None:
    rng = random.Random(1)
    assert workloads.serving_options(rng, "greedy") == ({}, {})
    assert workloads.serving_options(rng, "penalties") == ({"presence_penalty": 0.5, "frequency_penalty": 0.5}, {})
    sampling, bias = workloads.serving_options(rng, "sampled")
    assert (sampling["temperature"], sampling["top_p"], bias) == (0.7, 0.9, {})
    assert isinstance(sampling["seed"], int)
    sampling, bias = workloads.serving_options(rng, "logit_bias")
    assert sampling == {} and sorted(bias.values()) == [-2.0, 2.0] and len(bias) == 2
    assert all(k in workloads.BIAS_TOKEN_IDS for k in bias)


def test_serving_lengths_span_the_range_log_uniformly_and_every_kind_appears() -> None:
    w = build("serving", WorkloadParams(num_requests=400, min_prompt_words=100, max_prompt_words=10_000), 8)
    lengths = [len(s.turns[0].user.split()) - 2 for s in w.sessions]
    assert min(lengths) >= 100 and max(lengths) <= 10_000
    below_1k = sum(n < 1000 for n in lengths)
    assert 150 <= below_1k <= 250  # log-uniform: half the mass below the geometric mean (1000)
    assert {s.tag for s in w.sessions} == set(workloads.SERVING_KINDS)
    assert all(128 <= s.turns[0].max_tokens <= 512 for s in w.sessions)


def test_log_uniform_int_stays_in_bounds_and_refuses_a_bad_range() -> None:
    rng = random.Random(0)
    assert {workloads.log_uniform_int(rng, 7, 7) for _ in range(5)} == {7}
    with pytest.raises(ValueError):
        workloads.log_uniform_int(rng, 0, 5)


def test_uniform_greedy_sends_no_options_and_each_kind_keeps_the_prompts() -> None:
    """--options: greedy requests carry nothing; every other kind carries its fields on the same prompts."""
    params = WorkloadParams(num_requests=8, seed=2, prompt_words=12, output_tokens=5)
    greedy = build("uniform", params, 4)
    assert all(s.tag == "task" and not s.turns[0].sampling and not s.turns[0].logit_bias for s in greedy.sessions)
    for kind in ("logit_bias", "penalties", "sampled", "mixed"):
        other = build("uniform", attrs.evolve(params, options=kind), 4)
        assert [s.turns[0].user for s in other.sessions] == [s.turns[0].user for s in greedy.sessions]
        rng = random.Random(f"options-{params.seed}")
        for i, session in enumerate(other.sessions):
            row_kind = workloads.SERVING_KINDS[i % 4] if kind == "mixed" else kind
            sampling, bias = workloads.serving_options(rng, row_kind)
            (turn,) = session.turns
            assert (dict(turn.sampling), dict(turn.logit_bias)) == (sampling, bias)
            assert session.tag == ("task" if row_kind == "greedy" else row_kind)


def test_uniform_option_kinds_put_their_fields_in_the_request_bodies() -> None:
    """What reaches the server: 2 logit_bias tokens, both penalties, temperature/top_p/seed; mixed in turn."""
    from mlx_trio.bench.client import RequestSpec, messages

    def bodies(kind: str) -> list[dict[str, object]]:
        w = build("uniform", WorkloadParams(num_requests=8, prompt_words=4, options=kind), 8)
        return [RequestSpec(messages(None, [], s.turns[0].user), s.turns[0].max_tokens,
                            logit_bias=s.turns[0].logit_bias, sampling=s.turns[0].sampling).body()
                for s in w.sessions]

    assert all("logit_bias" not in b and "presence_penalty" not in b and "top_p" not in b for b in bodies("greedy"))
    assert all(len(b["logit_bias"]) == 2 for b in bodies("logit_bias"))  # type: ignore[arg-type]
    assert all(b["presence_penalty"] == b["frequency_penalty"] == 0.5 for b in bodies("penalties"))
    assert all((b["temperature"], b["top_p"]) == (0.7, 0.9) and isinstance(b["seed"], int) for b in bodies("sampled"))
    mixed = bodies("mixed")
    assert ["logit_bias" in b for b in mixed] == [False, True, False, False] * 2
    assert ["presence_penalty" in b for b in mixed] == [False, False, True, False] * 2
    assert ["seed" in b for b in mixed] == [False, False, False, True] * 2


def test_uniform_refuses_an_unknown_options_kind() -> None:
    with pytest.raises(ValueError, match="options"):
        build("uniform", WorkloadParams(options="beam"), 1)
