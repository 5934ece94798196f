"""A tool call that max_tokens cut: its name and the arguments written so far, read from a JSON prefix.

A forced call (`tool_choice.py`'s grammars) is a JSON object
`{"name": ..., "arguments": {...}}`; when the token budget ends inside it,
the text is a valid prefix of such an object, never the whole. It is still
the call the client asked for, so it is reported as one (marked cut), not
as text:

    read_cut_call    the call's name, once the prefix settles it (its whole
                     string, or a start only one callable name has), and
                     the arguments' text so far
    partial_json     a JSON prefix's value, as a streaming client reads it:
                     what is not complete yet (a string, a literal, a
                     number without digits, a key without its value) is
                     left out, open containers are closed

`partial_json` gives what the Anthropic SDK's stream reader gives for the
same text (jiter's `from_json(..., partial_mode=True)`), so a streamed cut
`tool_use` and a non-streamed one have the same `input`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

_BLANK = " \t\r\n"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_START = re.compile(r"-?\d*(?:\.\d*)?(?:[eE][+-]?\d*)?")


class _Cut(Exception):  # noqa: N818  (not an error: the text ended inside a value)
    """The text ended inside a value that is not whole yet."""


def read_cut_call(text: str, names: Sequence[str]) -> tuple[str | None, str] | None:
    """`(name, arguments text)` of a cut call object's `text`; None when `text` is not such a prefix.

    `name` is None while the prefix does not settle it among `names` (the
    functions the request may call). The arguments text is what the model
    wrote of that value ("" before it began).
    """
    text = text.lstrip(_BLANK)
    if not text:
        return (_settled("", names), "")
    if not text.startswith("{"):
        return None
    fields = _top_level_fields(text)
    if fields is None:
        return None
    name_text = fields.get("name")
    name = None
    if not name_text:
        name = _settled("", names)
    elif name_text.startswith('"'):
        try:
            name = json.loads(name_text)
        except ValueError:  # the string is cut: a start of the name
            name = _settled(name_text[1:].rstrip("\\"), names)
    arguments = fields.get("arguments", "")
    if arguments and not arguments.startswith("{"):
        return None
    return (name if isinstance(name, str) and name in names else None, arguments)


def partial_json(text: str) -> Any:
    """The value of the JSON prefix `text` (see the module docstring); `{}` for blanks alone."""
    reader = _Reader(text)
    reader.blanks()
    if reader.pos == len(text):
        return {}
    try:
        return reader.value()
    except (_Cut, ValueError):  # ValueError: not a JSON prefix after all (no grammar wrote it)
        return {}


def _settled(start: str, names: Sequence[str]) -> str | None:
    matching = [name for name in names if name.startswith(start)]
    return matching[0] if len(set(matching)) == 1 else None


def _top_level_fields(text: str) -> dict[str, str] | None:
    """The raw text of each top-level field of the object prefix `text` (the last one may be cut); None if malformed."""
    fields: dict[str, str] = {}
    depth = 0
    in_string = escaped = False
    key_start = value_start = -1
    key: str | None = None
    for pos, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 1 and value_start < 0:
                    key = text[key_start:pos + 1]
            continue
        if char == '"':
            in_string = True
            if depth == 1 and value_start < 0:
                key_start = pos
        elif char == ":" and depth == 1 and value_start < 0:
            if key is None:
                return None
            value_start = pos + 1
        elif char in "{[":
            depth += 1
        elif char in "}]" or (char == "," and depth == 1):
            if char != ",":
                depth -= 1
            if depth == 1 and char == "," or depth == 0:
                if key is not None and value_start >= 0:
                    fields[json.loads(key)] = text[value_start:pos].strip(_BLANK)
                key, key_start, value_start = None, -1, -1
                if depth == 0:
                    return fields
    if key is not None and value_start >= 0:
        fields[json.loads(key)] = text[value_start:].strip(_BLANK)
    return fields


class _Reader:
    """A recursive-descent reader of one JSON prefix; raises `_Cut` where the text ends inside a value."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def blanks(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _BLANK:
            self.pos += 1

    def value(self) -> Any:
        self.blanks()
        if self.pos == len(self.text):
            raise _Cut
        char = self.text[self.pos]
        if char == "{":
            return self._object()
        if char == "[":
            return self._array()
        if char == '"':
            return self._string()
        for literal, value in (("true", True), ("false", False), ("null", None)):
            if self.text.startswith(literal, self.pos):
                self.pos += len(literal)
                return value
            if literal.startswith(self.text[self.pos:]):
                raise _Cut
        return self._number()

    def _object(self) -> dict[str, Any]:
        out: dict[str, Any] = {}

        def member() -> bool:
            key = self._string()
            self.blanks()
            if self._at_end():
                return False
            self._expect(":")
            out[key] = self.value()
            return True

        return self._members("}", member, out)

    def _array(self) -> list[Any]:
        out: list[Any] = []
        return self._members("]", lambda: out.append(self.value()) or True, out)

    def _members(self, close: str, member: Callable[[], bool], out: Any) -> Any:
        """An object's or array's members up to `close`, each read by `member` (False: the text ended in it);
        a cut inside a member ends the container with what it holds so far."""
        self.pos += 1
        while True:
            self.blanks()
            if self._at_end():
                return out
            if self.text[self.pos] == close:
                self.pos += 1
                return out
            if self.text[self.pos] == ",":
                self.pos += 1
                continue
            try:
                if not member():
                    return out
            except _Cut:
                self.pos = len(self.text)
                return out

    def _string(self) -> str:
        self._expect('"')
        start = self.pos - 1
        escaped = False
        while self.pos < len(self.text):
            char = self.text[self.pos]
            self.pos += 1
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                return json.loads(self.text[start:self.pos])
        raise _Cut

    def _number(self) -> float | int:
        start = _NUMBER_START.match(self.text, self.pos)
        assert start is not None  # the pattern matches the empty string
        whole = _NUMBER.fullmatch(start.group())
        if whole is None and start.end() == len(self.text):
            raise _Cut  # "-", "1." or "1e": not a number yet
        if whole is None:
            raise ValueError(f"not JSON at {self.pos}: {self.text[self.pos:self.pos + 10]!r}")
        self.pos = start.end()
        return json.loads(whole.group())

    def _at_end(self) -> bool:
        return self.pos >= len(self.text)

    def _expect(self, char: str) -> None:
        if self._at_end():
            raise _Cut
        if self.text[self.pos] != char:
            raise ValueError(f"expected {char!r} at {self.pos}")
        self.pos += 1
