"""One streamed chat completion against an OpenAI-compatible server, timed.

The clock starts when the request is sent. TTFT ends at the first SSE chunk
that carries content (the role-only first delta and `: keepalive` comments
do not count); inter-token latency is the gaps between later content chunks
(a chunk may hold several tokens, so these are what a user sees, not per-token
times); end-to-end ends at `data: [DONE]`. Token counts come from the final
usage chunk (`stream_options.include_usage`), because content chunks undercount.

Every failure (connect error, reset, non-200 status, an in-band error, a
stream cut before `[DONE]`, a 200 that streamed no text, a timeout) becomes a failed `RequestResult`:
the bench counts failures and never crashes on them.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import httpx

# How much of an error body or message is kept in a result.
MAX_ERROR_CHARS = 200


@attrs.frozen
class RequestResult:
    """What one request measured; times in seconds, `start_s` on `time.perf_counter`'s clock."""

    session_id: str
    turn: int
    tag: str
    ok: bool
    start_s: float
    end_s: float
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    content_chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    text: str = attrs.field(default="", repr=False)

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the server's usage count, else the content chunks seen (an undercount)."""
        return self.completion_tokens if self.completion_tokens is not None else self.content_chunks


@attrs.frozen
class RequestSpec:
    """Everything sent for one request besides the connection."""

    messages: tuple[Mapping[str, str], ...]
    max_tokens: int
    # Sent as `model` when set. mlx_lm.server loads any name other than its own on demand, so leave it out.
    model: str | None = None
    # token id -> bias; {eos: -100} suppresses EOS so every output has max_tokens tokens.
    logit_bias: Mapping[int, float] = attrs.field(factory=dict)
    temperature: float = 0.0
    # More body fields (top_p, seed, penalties; a temperature here wins over the one above).
    sampling: Mapping[str, Any] = attrs.field(factory=dict)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": [dict(m) for m in self.messages],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.sampling,
        }
        if self.model is not None:
            body["model"] = self.model
        if self.logit_bias:
            body["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return body


def messages(system: str | None, history: Sequence[tuple[str, str]], user: str) -> tuple[dict[str, str], ...]:
    """The chat messages of a turn: system, earlier (user, assistant) pairs, the new user message."""
    out: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    for asked, answered in history:
        out += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    out.append({"role": "user", "content": user})
    return tuple(out)


async def stream_chat(client: httpx.AsyncClient, base_url: str, spec: RequestSpec, *,
                      session_id: str = "", turn: int = 0, tag: str = "task",
                      on_first_token: Any = None) -> RequestResult:
    """POST `spec` to `{base_url}/v1/chat/completions` as a stream and time it; never raises `Exception`.

    `on_first_token()` is called once, when the first content chunk arrives.
    Cancellation (trio.Cancelled) propagates and closes the connection.
    """
    state = _StreamState(session_id, turn, tag, start_s=time.perf_counter())
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=spec.body()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                return state.result(ok=False, error=f"HTTP {response.status_code}: {body[:MAX_ERROR_CHARS]}")
            async for line in response.aiter_lines():
                if state.feed(line, on_first_token):
                    break
    except httpx.HTTPError as exc:
        return state.result(ok=False, error=_describe(exc))
    except (ValueError, KeyError, TypeError) as exc:  # malformed JSON or chunk shape
        return state.result(ok=False, error=f"bad chunk: {_describe(exc)}")
    if state.error is not None:
        return state.result(ok=False, error=state.error)
    if not state.done:
        return state.result(ok=False, error="stream ended before [DONE]")
    if not state.chunk_times_s:
        # A 200 that streamed no text served nothing: counting it as done would flatter its server.
        return state.result(ok=False, error="HTTP 200 with no tokens")
    return state.result(ok=True, error=None)


@attrs.define
class _StreamState:
    """What has been read from one SSE stream so far; times are relative to `start_s`."""

    session_id: str
    turn: int
    tag: str
    start_s: float
    chunk_times_s: list[float] = attrs.field(factory=list)
    texts: list[str] = attrs.field(factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False

    def feed(self, line: str, on_first_token: Any) -> bool:
        """Take one SSE line; True once the stream is over (`[DONE]` or an in-band error)."""
        if not line.startswith("data:"):
            return False  # blank separators, `: keepalive` comments, event/id fields
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            self.error = f"in-band error: {json.dumps(chunk['error'])[:MAX_ERROR_CHARS]}"
            return True
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if text:
                self.chunk_times_s.append(time.perf_counter() - self.start_s)
                self.texts.append(text)
                if len(self.chunk_times_s) == 1 and on_first_token is not None:
                    on_first_token()
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return False

    def result(self, *, ok: bool, error: str | None) -> RequestResult:
        times = self.chunk_times_s
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return RequestResult(
            session_id=self.session_id, turn=self.turn, tag=self.tag, ok=ok, start_s=self.start_s,
            end_s=time.perf_counter(),
            ttft_s=times[0] if times else None,
            itl_s=tuple(b - a for a, b in itertools.pairwise(times)),
            prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
            cached_tokens=details.get("cached_tokens"), content_chunks=len(times),
            finish_reason=self.finish_reason, error=error, text="".join(self.texts),
        )


def _describe(exc: BaseException) -> str:
    text = str(exc) or "(no message)"
    return f"{type(exc).__name__}: {text}"[:MAX_ERROR_CHARS]
