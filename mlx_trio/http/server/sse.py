"""Server-sent events framing, the same for every wire API.

An event is `data: <compact JSON>\\n\\n`, preceded by `event: <name>\\n` when
the wire API names its events (Anthropic's, the Responses API's). A comment
(`: text\\n\\n`) is ignored by every SSE client; the shared completion path
sends one per `PromptProgress`, so proxies and idle timeouts do not close a
stream during a long prefill. JSON may hold U+0085, U+2028 and U+2029 raw, but
clients that split a stream with `str.splitlines` (httpx `iter_lines`, several
SDK wrappers) take each for a line break, so `data:` lines carry them escaped
and comments carry a space instead. What the events say is each wire API's renderer's
(`openai/render.py`, `anthropic/render.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

HEADERS = {
    "Cache-Control": "no-cache",
    # nginx and similar proxies buffer responses unless told not to.
    "X-Accel-Buffering": "no",
}


# The line breaks of `str.splitlines` that JSON does not escape (it escapes every one below U+0020).
_UNICODE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def event(payload: Mapping[str, Any], *, name: str | None = None) -> bytes:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_UNICODE_BREAKS)
    data = b"data: " + text.encode() + b"\n\n"
    return data if name is None else f"event: {name}\n".encode() + data


def typed_events(payloads: Iterable[Mapping[str, Any]]) -> list[bytes]:
    """One SSE event per payload, named by its `type` (as Anthropic and the Responses API frame them)."""
    return [event(payload, name=payload["type"]) for payload in payloads]


def comment(text: str) -> bytes:
    # A comment line must not contain a line break, or the rest would be parsed as fields.
    return b": " + " ".join(text.splitlines()).encode() + b"\n\n"
