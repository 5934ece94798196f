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
