"""Benchmark workloads: deterministic lists of sessions for a seed.

A session is one conversation whose turns run in order; each turn resends the
whole conversation so far (system prompt, earlier user turns and the server's
own earlier answers), the way an agent loop calls a chat API. Prompts are made
of common English words so that one word is about one token on BPE tokenizers;
the servers' `usage.prompt_tokens` gives the exact counts.

* **agents**: every session shares one long system prompt (prose plus tool
  schemas, the part a prefix cache can reuse), sends a distinct task, then a
  second turn; sessions arrive as a Poisson process.
* **uniform**: single-turn requests with fixed prompt and output lengths,
  each with the per-row sampling options of `WorkloadParams.options`
  (`OPTION_KINDS`: greedy, the default, sends none; `mixed` cycles through
  `SERVING_KINDS`), so a closed-loop run can set one kind against greedy.
* **long-prompt**: `concurrency` streams decode while one very long prompt
  arrives; the streams' largest inter-token gap is the decode stall.
* **agent-loop**: `concurrency` agents share one system prompt; each sends
  its next turn the moment the last one ends (zero think time), each turn a
  tool result of a few hundred tokens: per-turn cached fraction, TTFT, and
  the prefill stall (the running streams' largest gap while another prompt
  prefills) (issue #19).
* **serving**: what a shared endpoint sees (issue #20): independent requests
  arriving as a Poisson process, prompts log-uniform between
  `min_prompt_words` and `max_prompt_words`, outputs uniform between
  `output_tokens` and `max_output_tokens`, and per-row sampling options
  mixed: a quarter each greedy, a 2-token `logit_bias`, presence/frequency
  penalties, temperature/top_p with a seed (`SERVING_KINDS`).
* **long-context**: a long-context chat trace's shape (issue #46): sessions
  arriving as a Poisson process at `rate_per_s`, each opening with a prompt
  whose length is heavy-tailed (log-normal, median 6.5k, clamped to 1k-100k
  words: mean about 12k) behind one shared system prefix, then up to
  `max_turns - 1` follow-ups that resend the conversation (multi-turn reuse);
  outputs log-uniform in 50-900 tokens. `length_scale` shrinks every length
  (prompts, system prefix, outputs) for a CPU; mlx_trio/bench/long_context.py
  reports TTFT percentiles, prefill tokens/s under load and the rate sweep.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from typing import Any

import attrs

WORKLOADS = ("agents", "uniform", "long-prompt", "agent-loop", "serving", "long-context")

# Roughly one token each (with the leading space) on Llama/SmolLM-style BPE vocabularies.
_WORDS = tuple("""
the of and to in is was for on that with as by at from this be are have not or one all were an which
they but more other new some time there about many these can like use first two may any most such
people also year water long make world work day part number place over right back small after good
city system data file page list name value state group report table record search result order
check plan task agent tool call step answer query source error update read write open close send
build test merge review branch commit issue server client request reply token model batch cache
green blue red light sea river town house road tree stone paper glass metal wind rain snow
""".split())

TOOL_SCHEMAS = (
    {"name": "search", "description": "Search the document store and return the best matching passages.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
                    "required": ["query"]}},
    {"name": "read_file", "description": "Read a file from the workspace and return its text.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "offset": {"type": "integer"}},
                    "required": ["path"]}},
    {"name": "run_tests", "description": "Run the test suite and report failures with their messages.",
     "parameters": {"type": "object", "properties": {"selector": {"type": "string"}}, "required": []}},
    {"name": "send_message", "description": "Send a short message to another agent of the team.",
     "parameters": {"type": "object", "properties": {"to": {"type": "string"}, "text": {"type": "string"}},
                    "required": ["to", "text"]}},
)


@attrs.frozen
class Turn:
    """One request of a session: the user message it adds, its fixed output length, its own sampling options.

    `sampling` holds request-body fields (temperature, top_p, seed, penalties),
    sent as they are; `logit_bias` is merged with the run's EOS bias.
    """

    user: str
    max_tokens: int
    sampling: Mapping[str, Any] = attrs.field(factory=dict)
    logit_bias: Mapping[int, float] = attrs.field(factory=dict)


@attrs.frozen
class Session:
    """A conversation; `arrival_s` is when it may start, from the run's start.

    `after_first_tokens` > 0 makes it wait instead until that many other streams
    of the run have received their first token (long-prompt's late arrival).
    `tag` groups requests in the summary ("task", "background", "long").
    """

    session_id: str
    system: str | None
    turns: tuple[Turn, ...]
    arrival_s: float = 0.0
    tag: str = "task"
    after_first_tokens: int = 0


@attrs.frozen
class Workload:
    """The sessions of one run and how many may be in flight at once."""

    name: str
    sessions: tuple[Session, ...]
    max_in_flight: int

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@attrs.frozen
class WorkloadParams:
    """Sizes shared by the generators (words ≈ tokens; output lengths are exact with EOS suppressed)."""

    num_requests: int = 64
    seed: int = 0
    # Sessions (or requests) per second, Poisson; None: all may start at once.
    rate_per_s: float | None = None
    output_tokens: int = 128
    system_words: int = 2000
    task_words: int = 48
    followup_words: int = 24
    prompt_words: int = 512
    long_prompt_words: int = 7500
    # Long enough that the background streams still decode while the long prompt is prefilled.
    long_output_tokens: int = 512
    # agent-loop: each turn after the first adds a tool result this long.
    tool_result_words: int = 300
    # serving: prompt words drawn log-uniform in [min, max]; outputs uniform in [output_tokens, max_output_tokens].
    min_prompt_words: int = 100
    max_prompt_words: int = 10_000
    max_output_tokens: int = 512
    # uniform: the per-row sampling options of every request (one of `OPTION_KINDS`).
    options: str = "greedy"
    # long-context: every length times this (1.0 on a GPU; 0.01 makes the prompts 10-1000 words for a CPU).
    length_scale: float = 1.0
    # long-context: turns per session at most (the first, then follow-ups that resend the conversation).
    max_turns: int = 3


def words(rng: random.Random, count: int) -> str:
    """`count` words drawn from the fixed vocabulary, as one sentence-like string."""
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def poisson_arrivals(rng: random.Random, count: int, rate_per_s: float | None) -> list[float]:
    """Arrival offsets (s) of a Poisson process starting at 0; all zero when `rate_per_s` is None."""
    if rate_per_s is None or math.isinf(rate_per_s):
        return [0.0] * count
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    arrivals, t = [], 0.0
    for _ in range(count):
        arrivals.append(t)
        t += rng.expovariate(rate_per_s)
    return arrivals


def system_prompt(rng: random.Random, num_words: int) -> str:
    """The agents' shared system prompt: instructions, prose of `num_words` words, tool schemas."""
    tools = "\n".join(json.dumps(tool, sort_keys=True) for tool in TOOL_SCHEMAS)
    return (
        "You are one agent of a team working on a shared code base. Use the tools below; answer briefly.\n\n"
        f"Background notes: {words(rng, num_words)}.\n\n# Tools\n{tools}\n"
    )


def agents(params: WorkloadParams, concurrency: int) -> Workload:
    """K = `concurrency` agents in flight; ceil(N/2) two-turn sessions sharing one system prompt."""
    rng = random.Random(params.seed)
    shared = system_prompt(rng, params.system_words)
    num_sessions = max(1, math.ceil(params.num_requests / 2))
    arrivals = poisson_arrivals(rng, num_sessions, params.rate_per_s)
    sessions = []
    for i, arrival_s in enumerate(arrivals):
        task = Turn(f"Task {i}: {words(rng, params.task_words)}.", params.output_tokens)
        followup = Turn(f"Check your answer to task {i}, then continue: {words(rng, params.followup_words)}.",
                        params.output_tokens)
        sessions.append(Session(f"agent-{i}", shared, (task, followup), arrival_s=arrival_s))
    return Workload("agents", tuple(sessions), max_in_flight=concurrency)


def uniform(params: WorkloadParams, concurrency: int) -> Workload:
    """N single-turn requests of `prompt_words` words and `output_tokens` tokens, `concurrency` at once.

    Each request carries the sampling options of `params.options` (request i
    of `mixed` gets `SERVING_KINDS[i % 4]`) and is tagged with its kind; greedy
    requests carry none and keep the tag "task". The options come from their
    own random stream, so every kind sends the same prompts for one seed.
    """
    if params.options not in OPTION_KINDS:
        raise ValueError(f"unknown options kind {params.options!r}; choose one of {', '.join(OPTION_KINDS)}")
    rng = random.Random(params.seed)
    options_rng = random.Random(f"options-{params.seed}")
    arrivals = poisson_arrivals(rng, params.num_requests, params.rate_per_s)
    sessions = []
    for i, arrival_s in enumerate(arrivals):
        prompt = f"Request {i}: {words(rng, params.prompt_words)}."
        kind = SERVING_KINDS[i % len(SERVING_KINDS)] if params.options == "mixed" else params.options
        sampling, bias = serving_options(options_rng, kind)
        turn = Turn(prompt, params.output_tokens, sampling=sampling, logit_bias=bias)
        sessions.append(Session(f"uniform-{i}", None, (turn,), arrival_s=arrival_s,
                                tag="task" if kind == "greedy" else kind))
    return Workload("uniform", tuple(sessions), max_in_flight=concurrency)


def long_prompt(params: WorkloadParams, concurrency: int) -> Workload:
    """`concurrency` background streams decode; once all have a first token, one long prompt arrives.

    `num_requests` is not used: the scenario is one long prompt per run.
    """
    rng = random.Random(params.seed)
    background = tuple(
        Session(f"background-{i}", None, (Turn(f"Stream {i}: {words(rng, 32)}.", params.long_output_tokens),),
                tag="background")
        for i in range(concurrency)
    )
    long_turn = Turn(f"Summarize: {words(rng, params.long_prompt_words)}.", params.output_tokens)
    late = Session("long-0", None, (long_turn,), tag="long", after_first_tokens=concurrency)
    return Workload("long-prompt", (*background, late), max_in_flight=concurrency + 1)


def agent_loop(params: WorkloadParams, concurrency: int) -> Workload:
    """K = `concurrency` agents at once, ceil(N/K) turns each (at least 2), zero think time.

    Every agent shares one system prompt; its first turn is a task, each later
    one a tool result of `tool_result_words` words. The runner sends a
    session's next turn as soon as the last one ended, so each turn races the
    server's finish-time prompt-cache put of the previous one.
    """
    rng = random.Random(params.seed)
    shared = system_prompt(rng, params.system_words)
    turns_each = max(2, math.ceil(params.num_requests / concurrency))
    sessions = []
    for i in range(concurrency):
        task = Turn(f"Task {i}: {words(rng, params.task_words)}.", params.output_tokens)
        results = tuple(Turn(f"Tool result {t} for agent {i}: {words(rng, params.tool_result_words)}.",
                             params.output_tokens) for t in range(1, turns_each))
        sessions.append(Session(f"agent-{i}", shared, (task, *results), tag="agent"))
    return Workload("agent-loop", tuple(sessions), max_in_flight=concurrency)


# serving: the per-row sampling options, one kind per request, drawn with equal odds.
SERVING_KINDS = ("greedy", "logit_bias", "penalties", "sampled")
# uniform: one of these for every request; mixed is the four in turn.
OPTION_KINDS = (*SERVING_KINDS, "mixed")
# Token ids a logit_bias row biases: below 500, so they exist in every vocabulary the bench meets.
BIAS_TOKEN_IDS = range(10, 500)


def serving_options(rng: random.Random, kind: str) -> tuple[dict[str, Any], dict[int, float]]:
    """(body fields, logit_bias) of one serving request of `kind` (one of `SERVING_KINDS`)."""
    if kind == "logit_bias":
        first, second = rng.sample(BIAS_TOKEN_IDS, 2)
        return {}, {first: 2.0, second: -2.0}
    if kind == "penalties":
        return {"presence_penalty": 0.5, "frequency_penalty": 0.5}, {}
    if kind == "sampled":
        return {"temperature": 0.7, "top_p": 0.9, "seed": rng.randrange(2**31)}, {}
    return {}, {}


def log_uniform_int(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high] whose logarithm is uniform (as many 100-1k prompts as 1k-10k ones)."""
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got {low}, {high}")
    return min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high))))))


def serving(params: WorkloadParams, concurrency: int) -> Workload:
    """N single-turn requests, Poisson arrivals, mixed prompt and output lengths and sampling options.

    Each request's `tag` is its sampling kind, so the summary can compare them.
    """
    rng = random.Random(params.seed)
    arrivals = poisson_arrivals(rng, params.num_requests, params.rate_per_s)
    sessions = []
    for i, arrival_s in enumerate(arrivals):
        prompt_words = log_uniform_int(rng, params.min_prompt_words, params.max_prompt_words)
        max_tokens = rng.randint(params.output_tokens, max(params.output_tokens, params.max_output_tokens))
        kind = rng.choice(SERVING_KINDS)
        sampling, bias = serving_options(rng, kind)
        turn = Turn(f"Request {i}: {words(rng, prompt_words)}.", max_tokens, sampling=sampling, logit_bias=bias)
        sessions.append(Session(f"serving-{i}", None, (turn,), arrival_s=arrival_s, tag=kind))
    return Workload("serving", tuple(sessions), max_in_flight=concurrency)


# long-context: prompt words, log-normal around this median with this sigma (mean about 12k once clamped),
# clamped to [LONG_MIN_WORDS, LONG_MAX_WORDS]; outputs log-uniform in [LONG_MIN_OUTPUT, LONG_MAX_OUTPUT];
# the shared system prefix and each follow-up turn's words.
LONG_MEDIAN_WORDS = 6500
LONG_SIGMA = 1.15
LONG_MIN_WORDS, LONG_MAX_WORDS = 1000, 100_000
LONG_MIN_OUTPUT, LONG_MAX_OUTPUT = 50, 900
LONG_SYSTEM_WORDS = 1000
LONG_FOLLOWUP_WORDS = 200


def heavy_tailed_words(rng: random.Random, scale: float = 1.0) -> int:
    """One long-context prompt length in words: log-normal, clamped to 1k-100k, times `scale` (at least 1)."""
    drawn = min(LONG_MAX_WORDS, max(LONG_MIN_WORDS, rng.lognormvariate(math.log(LONG_MEDIAN_WORDS), LONG_SIGMA)))
    return max(1, round(drawn * scale))


def long_context(params: WorkloadParams, concurrency: int) -> Workload:
    """Poisson sessions at `rate_per_s` (all at once when None), ceil(N / mean turns) of them, about N requests.

    Session i has 1 + (i-th draw of 0..max_turns-1) turns; the first sends the
    shared system prefix and a heavy-tailed document, each later one a short
    follow-up after the whole conversation so far, so a prefix cache can reuse
    the earlier turns. `concurrency` caps the sessions in flight (make it
    large for an open loop).
    """
    if params.length_scale <= 0:
        raise ValueError(f"length_scale must be > 0, got {params.length_scale}")
    rng = random.Random(params.seed)
    scale = params.length_scale
    shared = f"You answer questions about long documents. Notes: {words(rng, max(1, round(LONG_SYSTEM_WORDS * scale)))}."
    turns_each = [1 + rng.randrange(max(1, params.max_turns)) for _ in range(params.num_requests)]
    sessions: list[Session] = []
    total = 0
    for i, arrival_s in enumerate(poisson_arrivals(rng, params.num_requests, params.rate_per_s)):
        if total >= params.num_requests:
            break
        num_turns = min(turns_each[i], params.num_requests - total)
        total += num_turns

        def output() -> int:
            return max(1, round(log_uniform_int(rng, LONG_MIN_OUTPUT, LONG_MAX_OUTPUT) * scale))

        first = Turn(f"Document {i}: {words(rng, heavy_tailed_words(rng, scale))}.", output())
        later = tuple(Turn(f"Follow-up {t} on document {i}: "
                           f"{words(rng, max(1, round(LONG_FOLLOWUP_WORDS * scale)))}.", output())
                      for t in range(1, num_turns))
        sessions.append(Session(f"long-{i}", shared, (first, *later), arrival_s=arrival_s, tag="long-context"))
    return Workload("long-context", tuple(sessions), max_in_flight=concurrency)


def build(name: str, params: WorkloadParams, concurrency: int) -> Workload:
    """The named workload (one of `WORKLOADS`) for one run at `concurrency`."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    generators = {"agents": agents, "uniform": uniform, "long-prompt": long_prompt, "agent-loop": agent_loop,
                  "serving": serving, "long-context": long_context}
    if name not in generators:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return generators[name](params, concurrency)
