"""Read the generic tool format back out of an answer as it streams: plain text, or one call object.

The grammar (`tool_choice.py`) makes such an answer either text, which
cannot start with `{`, or `{"tool_calls":[{"name":...,"arguments":{...}},...]}`.
So the first byte that is not a blank decides: text goes on as text at
once; an object is held back, and each call in its array comes out as soon
as its own object closes (its arguments arrive with it, as one piece, not
token by token).

An object that max_tokens cut inside its calls ends in a `CutCall`: the
text of the call being written (empty when its object had not begun), for
the router to report as a cut call (`cut_calls.py`). The calls before it
came out whole.

Without the grammar (a `response_format` took its place) the reader is
lenient: a lone `{"name": ..., "arguments": ...}` or `{"tool_call": {...}}`
is a call too, and whatever does not parse is given back as text, so no
generated text is lost.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from mlx_trio.output_format import GENERIC_CALLS_KEY


@attrs.frozen
class CutCall:
    """The start of a call that the answer's end cut: `text` is a prefix of its call object."""

    text: str


# Text, one parsed call object ({"name": str, "arguments": ...}), or a cut call.
Item = str | dict[str, Any] | CutCall

_CALLS_OPEN = re.compile(r'\{\s*"' + GENERIC_CALLS_KEY + r'"\s*:\s*\[\Z')
_CALLS_OPENING = '{"' + GENERIC_CALLS_KEY + '":['  # blanks removed
_SYNTAX = " \t\r\n,]}"  # what may be left of a call object after its last call


class GenericCallReader:
    """One answer's reader: `feed` each piece of content text, then `finish` once; both return new items."""

    def __init__(self) -> None:
        self._mode = "start"  # start → text, or start → object → after
        # start: the blanks so far; object: the object's text so far; after: blanks after it.
        self._buffer = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._in_calls = False  # inside the "tool_calls" array
        self._call_start = -1  # where the call object being read starts in `_buffer`
        self._read_to = 0  # the end of the last call given out
        self._calls = 0

    def feed(self, text: str) -> list[Item]:
        if self._mode == "text":
            return [text] if text else []
        if self._mode == "after":
            return self._after(text)
        if self._mode == "start":
            self._buffer += text
            stripped = self._buffer.lstrip()
            if not stripped:
                return []
            if not stripped.startswith("{"):
                self._mode = "text"
                text, self._buffer = self._buffer, ""
                return [text]
            self._mode, self._buffer, text = "object", "", stripped
        return self._scan(text)

    def finish(self) -> list[Item]:
        """What is held back: blanks alone, or an object the answer never closed (cut by max_tokens)."""
        mode, self._mode = self._mode, "text"
        if mode == "start":
            return [self._buffer] if self._buffer else []
        if mode != "object":
            return []
        if self._call_start >= 0:
            return [CutCall(self._buffer[self._call_start:])]
        if not self._calls:
            # The first call is due once the object opened as a call object (it holds one at least).
            opened = "".join(self._buffer.split())
            if self._in_calls or _CALLS_OPENING.startswith(opened):
                return [CutCall("")]
            return [self._buffer]
        rest = self._buffer[self._read_to:].lstrip(" \t\r\n,")  # the calls before it came out whole
        return [rest] if rest.strip(_SYNTAX) else []

    def _scan(self, text: str) -> list[Item]:
        items: list[Item] = []
        start = len(self._buffer)
        self._buffer += text
        for pos in range(start, len(self._buffer)):
            char = self._buffer[pos]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
                if char == "[" and self._depth == 2 and _CALLS_OPEN.match(self._buffer, 0, pos + 1):
                    self._in_calls = True
                elif char == "{" and self._depth == 3 and self._in_calls:
                    self._call_start = pos
            elif char in "}]":
                self._depth -= 1
                if char == "}" and self._depth == 2 and self._call_start >= 0:
                    items.extend(self._call(self._buffer[self._call_start:pos + 1]))
                    self._call_start, self._read_to = -1, pos + 1
                elif self._depth == 1:
                    self._in_calls = False
                if self._depth == 0:
                    items.extend(self._closed(self._buffer[:pos + 1]))
                    rest = self._buffer[pos + 1:]
                    self._mode, self._buffer = "after", ""
                    return items + self._after(rest)
        return items

    def _call(self, text: str) -> list[Item]:
        try:
            call = json.loads(text)
        except ValueError:
            return [text]
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return [text]
        self._calls += 1
        return [call]

    def _closed(self, text: str) -> list[Item]:
        """The whole object: nothing more when its calls came out one by one, else read whole (leniently)."""
        if self._calls:
            return []
        try:
            value = json.loads(text)
        except ValueError:
            return [text]
        if isinstance(value, dict) and isinstance(value.get("tool_call"), dict):
            value = value["tool_call"]
        if isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value:
            self._calls += 1
            return [value]
        return [text]

    def _after(self, text: str) -> list[Item]:
        """Blanks after the object are syntax, dropped; text there (no grammar) is content."""
        self._buffer += text
        if not self._buffer.strip():
            return []
        self._mode = "text"
        text, self._buffer = self._buffer, ""
        return [text]
