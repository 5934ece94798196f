"""bench/client.py and bench/runner.py against a scripted OpenAI-compatible server (httpx.MockTransport)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import trio

from mlx_trio.bench import workloads
from mlx_trio.bench.client import RequestSpec, messages, stream_chat
from mlx_trio.bench.runner import RunOptions, RunRecord, run_matrix, run_seed, run_workload
from mlx_trio.bench.workloads import WorkloadParams

URL = "http://bench.test"


def _sse(*events: Any) -> bytes:
    """SSE body: dicts become data events, strings are sent as they are (comments), then [DONE]."""
    parts = [e if isinstance(e, str) else f"data: {json.dumps(e)}\n\n" for e in events]
    return ("".join(parts) + "data: [DONE]\n\n").encode()


def _chunk(content: str | None = None, *, role: bool = False, finish: str | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion,
                                     "prompt_tokens_details": {"cached_tokens": cached}}}


def _echo_server(bodies: list[dict[str, Any]]) -> Callable[[httpx.Request], httpx.Response]:
    """Answers each chat request with 'ans(<last user message>)' in two chunks, after a keepalive."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        answer = f"ans({body['messages'][-1]['content'][:12]})"
        stream = _sse(_chunk("", role=True), ": keepalive 5/10\n\n", _chunk(answer[:4]), _chunk(answer[4:]),
                      _chunk(finish="length"), _usage(10, body["max_tokens"], 3))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream)

    return handle


def _options(handler: Callable[[httpx.Request], httpx.Response], **kw: Any) -> RunOptions:
    return RunOptions(transport=httpx.MockTransport(handler), **kw)


async def _one(handler: Callable[[httpx.Request], httpx.Response], spec: RequestSpec | None = None):  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        return await stream_chat(client, URL, spec or RequestSpec(messages(None, [], "hi"), 5))


async def test_a_stream_is_timed_from_content_chunks_and_counted_from_usage() -> None:
    """TTFT is the first content chunk (not the role chunk or a keepalive); tokens and cache come from usage."""
    bodies: list[dict[str, Any]] = []
    result = await _one(_echo_server(bodies))
    assert result.ok and result.error is None
    assert result.text == "ans(hi)" and result.content_chunks == 2 and len(result.itl_s) == 1
    assert result.ttft_s is not None and 0 <= result.ttft_s <= result.e2e_s
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (10, 5, 3)
    assert result.finish_reason == "length"
    assert bodies[0]["stream"] is True and bodies[0]["stream_options"] == {"include_usage": True}
    assert "model" not in bodies[0]  # mlx_lm.server would try to load any other model name


async def test_logit_bias_is_sent_with_string_keys() -> None:
    """EOS suppression goes out as a JSON logit_bias {"<id>": -100}."""
    bodies: list[dict[str, Any]] = []
    await _one(_echo_server(bodies), RequestSpec(messages(None, [], "hi"), 3, logit_bias={2: -100.0}))
    assert bodies[0]["logit_bias"] == {"2": -100.0}


async def test_failures_become_failed_results_not_exceptions() -> None:
    """A 5xx, a reset, an in-band error, a stream cut before [DONE] and a 200 with no text each fail, with a reason."""
    def status_503(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "busy"}})

    def reset(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    def in_band(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(_chunk("x"), {"error": {"message": "actor crashed"}}))

    def cut(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=f"data: {json.dumps(_chunk('x'))}\n\n".encode())

    def no_tokens(request: httpx.Request) -> httpx.Response:  # a 200 whose stream holds only the role chunk
        return httpx.Response(200, content=_sse(_chunk("", role=True), _chunk(finish="stop"), _usage(10, 0, 0)))

    reasons = {}
    for handler in (status_503, reset, in_band, cut, no_tokens):
        result = await _one(handler)
        assert not result.ok
        reasons[handler.__name__] = result.error or ""
    assert reasons["status_503"].startswith("HTTP 503")
    assert "RemoteProtocolError" in reasons["reset"]
    assert "actor crashed" in reasons["in_band"]
    assert reasons["cut"] == "stream ended before [DONE]"
    assert reasons["no_tokens"] == "HTTP 200 with no tokens"


async def test_second_turn_resends_the_conversation_with_the_servers_answer() -> None:
    """Turn 2 of an agent carries system, user 1, the server's streamed answer to it, then user 2."""
    bodies: list[dict[str, Any]] = []
    workload = workloads.build("agents", WorkloadParams(num_requests=4, system_words=10, output_tokens=4), 2)
    results = await run_workload(URL, workload, _options(_echo_server(bodies)))
    assert len(results) == 4 and all(r.ok for r in results)
    for session in workload.sessions:
        mine = [b for b in bodies if session.turns[0].user in json.dumps(b["messages"])]
        first, second = sorted(mine, key=lambda b: len(b["messages"]))
        assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
        assert second["messages"][:2] == first["messages"]
        assert second["messages"][2]["content"] == f"ans({session.turns[0].user[:12]})"
        assert second["messages"][3]["content"] == session.turns[1].user


async def test_a_failed_first_turn_fails_the_rest_of_its_session_unsent() -> None:
    """When turn 1 fails, turn 2 is recorded as failed and never sent (its history does not exist)."""
    sent: list[httpx.Request] = []

    def always_503(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(503)

    workload = workloads.build("agents", WorkloadParams(num_requests=2, system_words=5), 1)
    results = await run_workload(URL, workload, _options(always_503))
    assert len(sent) == 1 and [r.ok for r in results] == [False, False]
    assert results[1].error == "an earlier turn of the session failed"


async def test_long_prompt_waits_until_the_background_streams_have_started() -> None:
    """The long prompt is sent only after every background stream has received its first token."""
    order: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        order.append("long" if body["messages"][-1]["content"].startswith("Summarize") else "background")
        return httpx.Response(200, content=_sse(_chunk("t"), _usage(1, 1, 0)))

    workload = workloads.build("long-prompt", WorkloadParams(long_prompt_words=20), 3)
    results = await run_workload(URL, workload, _options(handler))
    assert all(r.ok for r in results) and order == ["background"] * 3 + ["long"]


class _FakeServer:
    def __init__(self, name: str) -> None:
        self.name, self.url, self.checks = name, URL, 0

    async def ensure_up(self) -> None:
        self.checks += 1

    def exited(self) -> bool:
        return False


async def test_matrix_alternates_servers_a_b_a_b_with_one_seed_per_round() -> None:
    """Each round runs every server in order; both servers of a round get the same prompts, rounds differ."""
    bodies: list[dict[str, Any]] = []
    servers = [_FakeServer("A"), _FakeServer("B")]
    records = await run_matrix(servers, "uniform", WorkloadParams(num_requests=2, prompt_words=5), [1, 2], 2,
                               _options(_echo_server(bodies)))
    assert [(r.concurrency, r.round, r.server) for r in records] == [
        (1, 0, "A"), (1, 0, "B"), (1, 1, "A"), (1, 1, "B"), (2, 0, "A"), (2, 0, "B"), (2, 1, "A"), (2, 1, "B")]
    prompts = [sorted(b["messages"][-1]["content"] for b in bodies[i:i + 2]) for i in range(0, 16, 2)]
    assert prompts[0] == prompts[1] and prompts[0] != prompts[2]
    assert all(s.checks == 4 for s in servers)
    assert len({run_seed(0, c, r) for c in range(3) for r in range(3)}) == 9


async def test_requests_per_stream_scales_a_run_with_its_concurrency() -> None:
    """--requests-per-stream K makes a run at concurrency C send max(N, K*C) requests."""
    bodies: list[dict[str, Any]] = []
    records = await run_matrix([_FakeServer("A")], "uniform", WorkloadParams(num_requests=2, prompt_words=3), [1, 4],
                               1, _options(_echo_server(bodies)), requests_per_stream=3)
    assert [len(r.results) for r in records] == [3, 12]


async def test_a_cancelled_matrix_keeps_the_runs_that_finished(autojump_clock: Any) -> None:
    """Runs land in the caller's list as they end: cancelling mid-run (SIGTERM, a time limit) keeps the done ones."""
    bodies: list[dict[str, Any]] = []
    echo = _echo_server(bodies)

    async def hang_on_second_concurrency(request: httpx.Request) -> httpx.Response:
        if len(bodies) >= 2:  # the c=1 run's two requests are answered; c=2 hangs
            await trio.sleep_forever()
        return echo(request)

    records: list[RunRecord] = []
    with trio.move_on_after(60.0):  # virtual time: the hang is skipped at once
        await run_matrix([_FakeServer("A")], "uniform", WorkloadParams(num_requests=2, prompt_words=3), [1, 2], 1,
                         _options(hang_on_second_concurrency), records=records)
    assert [(r.concurrency, len(r.results)) for r in records] == [(1, 2)]


async def test_serving_requests_carry_their_own_sampling_fields_and_bias_beside_the_eos_bias() -> None:
    """Each body has the run's EOS bias plus the row's own bias and fields; greedy rows send temperature 0 alone."""
    bodies: list[dict[str, Any]] = []
    params = WorkloadParams(num_requests=24, min_prompt_words=3, max_prompt_words=9, output_tokens=4,
                            max_output_tokens=6)
    workload = workloads.build("serving", params, 8)
    results = await run_workload(URL, workload, _options(_echo_server(bodies), logit_bias={2: -100.0}))
    assert len(results) == 24 and all(r.ok for r in results)
    by_user = {b["messages"][-1]["content"]: b for b in bodies}
    for session in workload.sessions:
        turn = session.turns[0]
        body = by_user[turn.user]
        assert body["max_tokens"] == turn.max_tokens
        assert body["logit_bias"] == {"2": -100.0, **{str(k): v for k, v in turn.logit_bias.items()}}
        assert {k: body[k] for k in turn.sampling} == dict(turn.sampling)
        assert body["temperature"] == turn.sampling.get("temperature", 0.0)
        if session.tag == "greedy":
            assert set(body) == {"messages", "max_tokens", "temperature", "stream", "stream_options", "logit_bias"}
