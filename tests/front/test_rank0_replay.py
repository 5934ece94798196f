"""Rank 0's side of the scale-out front (http/completion/front_link.py) on a tiny real model, no ranks: a
stream the front sent commits every chunk, and the same request resumed from any of its commits (the
token ids of the chunks before it replayed) sends exactly the rest of the uninterrupted stream, for
every wire API; a client without the secret gets none of it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from mlx_trio.config import EngineConfig
from mlx_trio.front.protocol import LINK_HEADER, RESUME_KEY, SECRET_ENV, SECRET_HEADER
from mlx_trio.front.splice import Splice
from mlx_trio.http import HttpServer, ServerConfig
from mlx_trio.params import SamplingParams

SECRET = "the-launch-secret"
_CHAT = [{"role": "user", "content": "Tell me a story about a cat"}]
# (path, body): every wire API, streamed; greedy, and one seeded sampled row.
CASES = {
    "chat": ("/v1/chat/completions", {"messages": _CHAT, "max_tokens": 20, "temperature": 0,
                                      "stream_options": {"include_usage": True}}),
    "chat-logprobs": ("/v1/chat/completions", {"messages": _CHAT, "max_tokens": 20, "temperature": 0,
                                               "logprobs": True, "top_logprobs": 2}),
    "chat-seeded": ("/v1/chat/completions", {"messages": _CHAT, "max_tokens": 20, "temperature": 1.0, "seed": 7}),
    "text-stop": ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0,
                                      "stop": ["zzz-never"]}),
    "messages": ("/v1/messages", {"model": "m", "messages": _CHAT, "max_tokens": 20, "temperature": 0}),
    "responses": ("/v1/responses", {"input": "Tell me a story about a cat", "max_output_tokens": 20,
                                    "temperature": 0}),
}


@pytest.fixture
async def rank0(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[httpx.AsyncClient]:
    """A tiny Llama behind the HTTP server, as rank 0 of a front (the launch's secret in its environment).
    No prompt cache: a resumed answer's usage counts no cached tokens (the first prefill's count went with
    the old group), and so must the uninterrupted one it is compared with."""
    from mlx_trio.api import Engine  # noqa: PLC0415  (imports MLX)
    from mlx_trio.testing.tiny_models import LLAMA, tiny_model  # noqa: PLC0415

    monkeypatch.setenv(SECRET_ENV, SECRET)
    server = HttpServer(ServerConfig(port=0))
    engine = Engine(EngineConfig(model=str(tiny_model(LLAMA)), prompt_cache_bytes=0,
                                 defaults=SamplingParams(max_tokens=8)), extra_children=[server.child_spec])
    server.attach(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        with trio.fail_after(60):
            await engine.wait_ready()
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            yield client
        nursery.cancel_scope.cancel()


async def _linked(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[str, bytes]:
    """(the link header, the raw body) of a stream sent as the front sends it."""
    response = await client.post(path, json={**body, "stream": True}, headers={SECRET_HEADER: SECRET})
    assert response.status_code == 200, response.text
    return response.headers[LINK_HEADER], response.content


def _commits(raw: bytes) -> list[tuple[bytes, list[int]]]:
    """Each committed chunk's client bytes and token ids, then the tail (the bytes after the last commit)."""
    splice, chunks, start = Splice(), [], 0
    while (end := raw.find(b": ids", start)) >= 0:
        end = raw.index(b"\n\n", end) + 2
        before = len(splice.groups)
        out = splice.feed(raw[start:end])
        chunks.append((out, splice.groups[-1] if len(splice.groups) > before else []))
        start = end
    return [*chunks, (splice.feed(raw[start:]) + splice.end(), [])]


def _events(data: bytes) -> list[tuple[str | None, Any]]:
    """The SSE events of `data` as (name, JSON or the raw line), consecutive text deltas of one shape merged
    into one: where the session cut a stream into deltas depends on timing (its coalescing), not on the request.
    The Responses API's sequence numbers are checked to run 0, 1, 2... first, then left out. Chat chunks'
    logprobs (their own chunks, cut where the text is) are taken out in order and compared as one list at the end."""
    events: list[tuple[str | None, Any]] = []
    logprobs: list[Any] = []
    sequence = 0
    for frame in data.decode().split("\n\n"):
        if not frame or frame.startswith(":"):
            continue  # a keep-alive comment
        name = frame.split("\n")[0].removeprefix("event: ") if frame.startswith("event: ") else None
        line = frame.split("data: ", 1)[1]
        payload = json.loads(line) if line.startswith("{") else line
        if isinstance(payload, dict) and "sequence_number" in payload:
            assert payload.pop("sequence_number") == sequence
            sequence += 1
        if isinstance(payload, dict) and "completed_at" in payload.get("response", {}):
            payload["response"]["completed_at"] = 0  # the second it finished
        choice = payload["choices"][0] if isinstance(payload, dict) and payload.get("choices") else None
        if isinstance(choice, dict) and choice.get("logprobs") is not None:
            logprobs.extend(choice["logprobs"]["content"])
            choice["logprobs"] = None
            if not choice["delta"] and choice.get("finish_reason") is None:
                continue  # a chunk of logprobs alone
        text = _text(payload)
        if text is not None and events and (previous := _text(events[-1][1])) is not None \
                and _blank(events[-1][1]) == _blank(payload):
            _set_text(events[-1][1], previous[1] + text[1])
            continue
        events.append((name, payload))
    return [*events, ("logprobs", logprobs)] if logprobs else events


def _text(payload: Any) -> tuple[list[Any], str] | None:
    """(where, the text) of a text delta of any wire API, None for any other event."""
    if not isinstance(payload, dict):
        return None
    if payload.get("type") == "content_block_delta" and payload["delta"].get("type") == "text_delta":
        return ["delta", "text"], payload["delta"]["text"]
    if payload.get("type") == "response.output_text.delta":
        return ["delta"], payload["delta"]
    choices = payload.get("choices") or [{}]
    if choices[0].get("finish_reason") is None and set(choices[0].get("delta", {})) == {"content"}:
        return ["choices", 0, "delta", "content"], choices[0]["delta"]["content"]
    if choices[0].get("finish_reason") is None and isinstance(choices[0].get("text"), str):
        return ["choices", 0, "text"], choices[0]["text"]
    return None


def _set_text(payload: Any, text: str) -> None:
    where = _text(payload)
    assert where is not None
    *path, last = where[0]
    for key in path:
        payload = payload[key]
    payload[last] = text


def _blank(payload: Any) -> Any:
    copy = json.loads(json.dumps(payload))
    _set_text(copy, "")
    return copy


@pytest.mark.parametrize("case", CASES)
async def test_a_resumed_stream_sends_exactly_the_rest_of_the_uninterrupted_one(rank0: httpx.AsyncClient,
                                                                               case: str) -> None:
    """Cut after the opening alone, after the first tokens, mid-answer and after the last token: what the
    client had plus what the resumed request sends is the uninterrupted answer (its text, ids, indices,
    sequence numbers, finish and usage); the replayed part is never sent again."""
    path, body = CASES[case]
    link, raw = await _linked(rank0, path, body)
    chunks = _commits(raw)
    assert sum(len(ids) for _, ids in chunks) >= 10  # tokens to cut between
    whole = b"".join(out for out, _ in chunks)
    assert b": ids" not in whole
    response_id, created = link.split(" ")
    token_chunks = [i for i, (_, ids) in enumerate(chunks) if ids]
    for cut in sorted({0, token_chunks[0], token_chunks[len(token_chunks) // 2], token_chunks[-1]}):
        delivered = chunks[:cut + 1]
        resume = {"id": response_id, "created": int(created), "opened": True,
                  "groups": [ids for _, ids in delivered if ids]}
        again_link, again = await _linked(rank0, path, {**body, RESUME_KEY: resume})
        assert again_link == link
        rest = b"".join(out for out, _ in _commits(again))
        assert _events(b"".join(out for out, _ in delivered) + rest) == _events(whole), f"cut after chunk {cut}"


async def test_a_request_without_the_secret_is_served_as_always(rank0: httpx.AsyncClient) -> None:
    """No commits, no link header, and a resume key in the body is no instruction (it is ignored)."""
    path, body = CASES["chat"]
    plain = await rank0.post(path, json={**body, "stream": True})
    wrong = await rank0.post(path, json={**body, "stream": True, RESUME_KEY: {"id": "x", "created": 1,
                                                                             "opened": True, "groups": [[1, 2]]}},
                             headers={SECRET_HEADER: "a-guess"})
    for response in (plain, wrong):
        assert LINK_HEADER not in response.headers and b": ids" not in response.content
        assert response.content.count(b"data: ") > 10  # the whole answer, from its first chunk
