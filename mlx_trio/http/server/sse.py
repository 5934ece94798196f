"""Server-sent events framing, the same for every wire API.

An event is `data: <compact JSON>\\n\\n`, preceded by `event: <name>\\n` when
the wire API names its events (Anthropic's, the Responses API's). A comment
(`: text\\n\\n`) is ignored by every SSE client; the shared completion path
sends one per `PromptProgress`, so proxies and idle timeouts do not close a
stream during a long prefill. What the events say is each wire API's renderer's
(`openai/render.py`, `anthropic/render.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

HEADERS = {
    "Cache-Control": "no-cache",
    # nginx and similar proxies buffer responses unless told not to.
    "X-Accel-Buffering": "no",
}


def event(payload: Mapping[str, Any], *, name: str | None = None) -> bytes:
    data = b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    return data if name is None else f"event: {name}\n".encode() + data


def comment(text: str) -> bytes:
    # A comment line must not contain a newline, or the rest would be parsed as fields.
    return b": " + text.replace("\n", " ").encode() + b"\n\n"
