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

JSON is encoded by `orjson` where it is installed (a dependency; several
times faster than `json` per chunk, on the Trio thread once per event), else
by `json`: the same compact JSON, raw UTF-8, parsing to the same values (floats
may be spelled differently: `1e-05` against `1e-5`; a non-finite float, which
no chunk carries, would be `null` against `json`'s non-standard `-Infinity`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - a dependency; the fallback keeps the same content
    orjson = None  # type: ignore[assignment]

HEADERS = {
    "Cache-Control": "no-cache",
    # nginx and similar proxies buffer responses unless told not to.
    "X-Accel-Buffering": "no",
}


# The line breaks of `str.splitlines` that JSON does not escape (it escapes every one below U+0020), as UTF-8.
_UNICODE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def dumps(value: Any) -> bytes:
    """Compact JSON of `value` as UTF-8 (non-ASCII raw), its line breaks for `str.splitlines` escaped."""
    if orjson is not None:
        try:
            data = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:  # e.g. an int over 64 bits: json can
            data = _json_dumps(value)
    else:
        data = _json_dumps(value)
    for raw, escaped in _UNICODE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def _json_dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def event(payload: Mapping[str, Any], *, name: str | None = None) -> bytes:
    data = b"data: " + dumps(payload) + b"\n\n"
    return data if name is None else b"event: " + name.encode() + b"\n" + data


# The slot of a `StringTemplate`: a private-use character, which no payload of ours carries.
SLOT = "\ue000"
_SLOT_JSON = b'"\xee\x80\x80"'


class StringTemplate:
    """An SSE event whose payload differs from one event to the next in one string only.

    Built once per stream from a payload holding `SLOT` where that string goes
    (e.g. a chat chunk's `delta.content`); `fill` then encodes only the
    string, not the whole chunk: the same bytes as `event` of the payload with
    the string in place of `SLOT` (a JSON object's text is its parts' texts
    in order, and `dumps` escapes the line breaks inside the string itself).
    """

    def __init__(self, payload: Mapping[str, Any], *, name: str | None = None) -> None:
        head, slot, tail = event(payload, name=name).partition(_SLOT_JSON)
        if not slot or _SLOT_JSON in tail:
            raise ValueError("a template's payload holds SLOT exactly once, as a whole string")
        self._head, self._tail = head, tail

    def fill(self, text: str) -> bytes:
        return self._head + dumps(text) + self._tail


def typed_events(payloads: Iterable[Mapping[str, Any]]) -> list[bytes]:
    """One SSE event per payload, named by its `type` (as Anthropic and the Responses API frame them)."""
    return [event(payload, name=payload["type"]) for payload in payloads]


def comment(text: str) -> bytes:
    # A comment line must not contain a line break, or the rest would be parsed as fields.
    return b": " + " ".join(text.splitlines()).encode() + b"\n\n"
