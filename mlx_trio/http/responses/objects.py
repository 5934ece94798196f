"""Response objects and output items of the Responses API, as plain dicts.

`ResponseShape` holds what a response and all its stream events share (id,
created_at, model, the echoed request fields) and builds the response
object in any status. Output items are built and grown by `events.py`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from mlx_trio.events import Usage
from mlx_trio.http.server.errors import ApiError
from mlx_trio.logprobs import TokenLogprob


def usage_object(usage: Usage) -> dict[str, Any]:
    """Responses usage; `reasoning_tokens` as the output router counted them (`Usage.reasoning_tokens`)."""
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_tokens}


def logprobs_object(items: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Responses' `logprobs`: per token `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`."""
    return [{"token": item.token, "logprob": item.logprob, "bytes": list(item.bytes),
             "top_logprobs": [{"token": top.token, "logprob": top.logprob, "bytes": list(top.bytes)}
                              for top in item.top_logprobs]}
            for item in items]


def error_object(error: ApiError) -> dict[str, Any]:
    """A failed response's `error`: OpenAI names engine-side failures "server_error"."""
    return {"code": "server_error" if error.status >= 500 else "invalid_prompt", "message": error.message}


@attrs.frozen
class ResponseShape:
    """The fields shared by one response object and all its stream events."""

    model: str
    echo: Mapping[str, Any] = attrs.field(hash=False)
    id: str = attrs.field(factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = attrs.field(factory=lambda: int(time.time()))

    def response(self, status: str, output: Sequence[Mapping[str, Any]] = (), *,
                 usage: dict[str, Any] | None = None, incomplete_reason: str | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object; `status` is in_progress, completed, incomplete or failed."""
        done = status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "model": self.model,
            "output": [dict(item) for item in output],
            "usage": usage if done else None,
            **self.echo,
        }
