"""Every HTTP error path, over a live server with a fake engine: status, OpenAI shape, field named."""

from __future__ import annotations

from typing import Any

import pytest

from tests.http.fakes import FakeEngine
from tests.http.http_helpers import assert_openai_error, serve_fake

from mlx_trio.errors import ActorCrashed, EngineFailure, Overloaded

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
TEXT = {"prompt": "hello there", "max_tokens": 3}


async def test_unknown_endpoint_is_an_openai_404() -> None:
    """An unknown path is a JSON 404 (not quart's HTML page) naming the path."""
    async with serve_fake() as (_, client):
        error = assert_openai_error(await client.get("/v1/nope"), 404, code="not_found")
        assert "/v1/nope" in error["message"]
        assert_openai_error(await client.post("/v2/chat/completions", json=CHAT), 404)


async def test_wrong_method_is_an_openai_405_with_allow() -> None:
    """GET on a POST endpoint and POST on a GET endpoint are 405 with an Allow header."""
    async with serve_fake() as (_, client):
        response = await client.get("/v1/chat/completions")
        assert_openai_error(response, 405, code="method_not_allowed")
        assert response.headers["allow"] == "POST"
        response = await client.post("/health", json={})
        assert_openai_error(response, 405)
        assert "GET" in response.headers["allow"]


@pytest.mark.parametrize("body", [b"{not json", b"", b"\xff\xfe", b"[1, 2", b'{"a": NaN}', b'{"x": Infinity}',
                                  b"[" * 100_000 + b"]" * 100_000, b'{"max_tokens": 1' + b"0" * 5000 + b"}"])
async def test_invalid_json_is_400(body: bytes) -> None:
    """Malformed, non-UTF-8, NaN/Infinity, absurdly nested and over-long-integer JSON are 400 invalid_json."""
    async with serve_fake() as (_, client):
        assert_openai_error(await client.post("/v1/completions", content=body), 400, code="invalid_json")


@pytest.mark.parametrize("body", [b"[]", b'"text"', b"42", b"null"])
async def test_a_body_that_is_not_an_object_is_400(body: bytes) -> None:
    """Valid JSON that is not an object is 400 saying what it got."""
    async with serve_fake() as (_, client):
        assert_openai_error(await client.post("/v1/chat/completions", content=body), 400, code="invalid_body")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [1]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": "3"}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "top_p": 2}, "top_p"),
        ("/v1/chat/completions", {**CHAT, "top_k": 10**9}, "top_k"),
        ("/v1/chat/completions", {**CHAT, "min_p": [1]}, "min_p"),
        ("/v1/chat/completions", {**CHAT, "stop": 5}, "stop"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"1": 1000}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "seed": -1}, "seed"),
        ("/v1/chat/completions", {**CHAT, "seed": 2**64}, "seed"),
        ("/v1/chat/completions", {**CHAT, "n": 2}, "n"),
        ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
        ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"tokenize": False}},
         "chat_template_kwargs.tokenize"),
        ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {**TEXT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {**TEXT, "logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}},
         "response_format.json_schema"),
        ("/v1/chat/completions", {**CHAT, "model": 3}, "model"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": [{"role": "user", "content": "x"}]}, "prompt"),
        ("/v1/completions", {"prompt": [1, True]}, "prompt"),
        ("/v1/completions", {**TEXT, "echo": True}, "echo"),
        ("/v1/completions", {**TEXT, "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "bad-prompt"}, "prompt"),
    ],
)
async def test_bad_fields_are_400_naming_the_field(path: str, body: dict[str, Any], param: str) -> None:
    """Wrong types and out-of-range values are 400 with `param` set to the body key to fix."""
    async with serve_fake() as (_, client):
        error = assert_openai_error(await client.post(path, json=body), 400, param=param)
        assert error["type"] == "invalid_request_error"


async def test_a_prompt_that_fills_the_context_is_400_saying_the_limit() -> None:
    """A prompt with no room left for one token is 400 context_length_exceeded naming the prompt key."""
    async with serve_fake(FakeEngine(context_length=3)) as (_, client):
        error = assert_openai_error(await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 1}),
                                    400, code="context_length_exceeded", param="prompt")
        assert error["message"].startswith("prompt is too long: 3 tokens > 2 maximum")
        assert_openai_error(await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}] * 3, "max_tokens": 1}),
            400, code="context_length_exceeded", param="messages")


async def test_max_tokens_over_the_room_left_is_clamped_or_with_strict_refused() -> None:
    """max_tokens past the context ends with finish_reason "length" at the context; --strict-max-tokens: a 400."""
    body = {"prompt": "a b c", "max_tokens": 20}
    async with serve_fake(FakeEngine(context_length=10)) as (_, client):
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    choice, usage = response.json()["choices"][0], response.json()["usage"]
    assert choice["finish_reason"] == "length" and usage["prompt_tokens"] + usage["completion_tokens"] == 10
    async with serve_fake(FakeEngine(context_length=10), strict_max_tokens=True) as (_, client):
        error = assert_openai_error(await client.post("/v1/completions", json=body), 400,
                                    code="context_length_exceeded", param="prompt")
    assert "10" in error["message"]


async def test_harmless_openai_fields_are_accepted() -> None:
    """n=1, user, model, tools-free extras and max_completion_tokens are accepted (the last wins over max_tokens)."""
    engine = FakeEngine()
    async with serve_fake(engine) as (_, client):
        body = {**CHAT, "n": 1, "user": "u", "model": "whatever", "metadata": {"a": 1}, "max_tokens": 7,
                "max_completion_tokens": 2, "presence_penalty": 0.5, "stream_options": {}}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
        assert engine.prepared[-1][1]["presence_penalty"] == 0.5


async def test_body_over_the_limit_is_413_and_the_connection_stays_usable() -> None:
    """A body over max_body_bytes is 413; the client's next request still gets an answer."""
    async with serve_fake(max_body_bytes=1024) as (_, client):
        big = {"prompt": "x" * 4096}
        error = assert_openai_error(await client.post("/v1/completions", json=big), 413, code="request_too_large")
        assert "1024" in error["message"]
        huge = b'{"prompt": "' + b"x" * (2 * 1024 * 1024) + b'"}'
        assert_openai_error(await client.post("/v1/completions", content=huge), 413)
        assert (await client.get("/health")).status_code == 200


async def test_api_key_is_required_except_for_health() -> None:
    """With api_key set: no or wrong key is 401 (bearer challenge), the right key works, /health stays public."""
    async with serve_fake(api_key="sekret") as (_, client):
        response = await client.post("/v1/completions", json=TEXT)
        assert_openai_error(response, 401, code="invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"
        assert_openai_error(await client.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert_openai_error(await client.get("/v1/models", headers={"Authorization": "sekret"}), 401)
        assert_openai_error(await client.get("/stats"), 401)
        assert_openai_error(await client.get("/nope"), 401)  # no probing for endpoints without the key
        ok = await client.post("/v1/completions", json=TEXT, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_overloaded_is_503_with_retry_after(stream: bool) -> None:
    """A full engine queue is 503 with Retry-After, for streams too (no 200 is sent before the first event)."""
    engine = FakeEngine()
    engine.fail_before_start = Overloaded("the decode queue is full; retry shortly", retry_after_s=2.5)
    async with serve_fake(engine) as (_, client):
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert_openai_error(response, 503, code="overloaded")
        assert response.headers["retry-after"] == "3"


@pytest.mark.parametrize(("error", "status"),
                         [(EngineFailure("lease closed"), 503), (ActorCrashed("decoder died"), 500)])
async def test_engine_failures_map_to_5xx(error: Exception, status: int) -> None:
    """EngineFailure is 503 (retry later), ActorCrashed is 500; both OpenAI-shaped, server keeps serving."""
    engine = FakeEngine()
    engine.fail_with = error
    async with serve_fake(engine) as (_, client):
        assert_openai_error(await client.post("/v1/completions", json=TEXT), status)
        engine.fail_with = None
        assert (await client.post("/v1/completions", json=TEXT)).status_code == 200


async def test_a_stream_that_fails_sends_an_error_event_then_done() -> None:
    """Once the 200 is out, an engine error becomes an in-band error event, and [DONE] is still last."""
    engine = FakeEngine()
    engine.fail_with = ActorCrashed("decoder died")
    async with serve_fake(engine) as (_, client):
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert response.status_code == 200
        events = [e for e in response.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert '"code":"actor_crashed"' in events[-2]


async def test_model_loading_is_503_for_completions() -> None:
    """While the model loads, completions are 503 engine_unavailable, not 500."""
    async with serve_fake(FakeEngine(loaded=False)) as (_, client):
        response = await client.post("/v1/completions", json=TEXT)
        assert_openai_error(response, 503, code="engine_unavailable")
        assert "retry-after" in response.headers
