"""Split one request's generated text into content, reasoning and tool calls.

The engine streams plain text; the model's markers (`<think>`, `<tool_call>`,
…, read from its tokenizer by mlx-lm) say which part is which. The router
drives mlx-lm's `TextStateMachine` over that text, which matches markers on
text (so a marker split across deltas, or merged with the next byte into one
token, still matches) and holds back text that may be the start of one.
Reasoning and content come out as soon as they are known; a tool call comes
out whole once its end marker arrives, parsed by mlx-lm's tool parser for
the model. Both the OpenAI and the Anthropic shapes, streamed or not, are
built from the same `Piece`s.

A call that max_tokens cut (the answer ended inside it) is still a call:
`ToolCall.complete` False, its name settled by what was written (or by the
only function the request may call), its arguments the JSON text written so
far (`cut_calls.py`). Each wire API says it was cut by its own finish
(`length`, `max_tokens`, `incomplete`). A cut call whose name is not settled
yet (several functions could still follow) is call syntax only: dropped.
A closed call that does not parse (malformed), or text after a call marker
that is no call object, is given back as content, markers included, so no
generated text is lost; so is every call when the request did not ask for
tool parsing.

A model in the generic tool format (no markers: its answer is text or one
JSON call object) has its content read by a `GenericCallReader`, which
gives out each call as soon as its object closes.

The router also counts reasoning tokens (`reasoning_tokens`): a delta's
tokens count when the text state machine passed through the reasoning
state while reading it, so both think markers count with the text between
them. Text may lag its token by one (a character cut across tokens), so
the count is exact up to the token at each boundary.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from mlx_trio.http.completion.cut_calls import read_cut_call
from mlx_trio.http.completion.generic_calls import CutCall, GenericCallReader, Item
from mlx_trio.output_format import NORMAL, REASONING, TOOL, OutputFormat

log = logging.getLogger("mlx_trio.http")


@attrs.frozen
class ToolCall:
    """One parsed call; `arguments` is JSON text (OpenAI's `function.arguments`).

    `complete` False: max_tokens cut the call, and `arguments` is only a
    prefix of a JSON object (`cut_calls.partial_json` reads it).
    """

    id: str
    name: str
    arguments: str
    complete: bool = True


@attrs.frozen
class Content:
    text: str


@attrs.frozen
class Reasoning:
    text: str


@attrs.frozen
class ToolCallMade:
    """The `index`-th call of this response (0-based, counting every call so far)."""

    index: int
    call: ToolCall


Piece = Content | Reasoning | ToolCallMade


class OutputRouter:
    """One per request: `feed` each text delta, then `finish` once; both return the new pieces."""

    def __init__(self, fmt: OutputFormat, *, prompt_ids: Sequence[int] = (), parse_tool_calls: bool = False,
                 tools: Sequence[Mapping[str, Any]] | None = None, call_names: Sequence[str] | None = None,
                 forced: bool = False, id_prefix: str = "call_", id_seed: str | None = None) -> None:
        # `id_seed` (the response id): each call's id follows from it and the call's index, so the same
        # answer always names its calls the same way.
        self._fmt = fmt
        self._parse = parse_tool_calls and fmt.has_tool_calling
        self._generic = GenericCallReader() if parse_tool_calls and fmt.generic_tools else None
        self._tools = [dict(t) for t in tools] if tools else None
        # The functions the model may call (a named tool_choice: that one); they settle a cut call's name.
        self._call_names = tuple(call_names if call_names is not None else
                                 [t["function"]["name"] for t in self._tools or () if "function" in t])
        # The grammar makes the answer a call ("required" / a named function): one cut before its first
        # byte (by a think end the grammar wrote first, or a budget of one token) is still a cut call.
        self._forced = forced and (self._parse or self._generic is not None)
        self._id_prefix = id_prefix
        self._id_seed = id_seed
        self._current = fmt.initial_state(prompt_ids)
        self._sm_state = fmt.splitter.make_state(self._current) if fmt.splitter is not None else None
        # Invariant: the body of the call being read, while `_current` is "tool".
        self._tool_text = ""
        # Whitespace written after a call, held back: between calls (Qwen puts "\n" there) and at
        # the end it is call syntax and dropped; before more text it is content.
        self._after_call: str | None = None
        self.num_tool_calls = 0
        self.reasoning_tokens = 0

    def feed(self, text: str, tokens: int = 0) -> list[Piece]:
        """The pieces of one delta's `text`, which `tokens` generated tokens produced (EOS not among them)."""
        if self._sm_state is None:
            return self._content(text) if text else []
        self._sm_state, segments = self._fmt.splitter.split(self._sm_state, text)
        if any(state == REASONING for state, _ in segments):
            self.reasoning_tokens += tokens
        return self._route(segments)

    def finish(self) -> list[Piece]:
        """Flush held-back text; a call left open (no end marker) is parsed as it stands.

        Flushed, not dropped: the engine never puts EOS or a stop string into
        the text, so what is held back here is the model's own output.
        """
        pieces: list[Piece] = []
        if self._sm_state is not None:
            self._sm_state, held, state = self._fmt.splitter.flush(self._sm_state)
            pieces = self._route([(state, held)])
            if self._current == TOOL:
                pieces.extend(self._end_call(closed=False))
            self._after_call = None
        if self._generic is not None:
            pieces.extend(self._pieces(self._generic.finish()))
        if self._forced and not self.num_tool_calls:
            pieces.extend(self._cut_call("") or [])
        return pieces

    def _content(self, text: str) -> list[Piece]:
        """Content text as pieces: in the generic tool format, read for calls first."""
        if self._generic is None:
            return [Content(text)]
        return self._pieces(self._generic.feed(text))

    def _pieces(self, items: list[Item]) -> list[Piece]:
        pieces: list[Piece] = []
        for item in items:
            if isinstance(item, str):
                pieces.append(Content(item))
                continue
            if isinstance(item, CutCall):
                cut = self._cut_call(item.text)
                pieces.extend([Content(item.text)] if cut is None else cut)
                continue
            try:
                call = self._call(item, self.num_tool_calls)
            except ValueError as exc:
                log.warning("a tool call did not parse (%s); returned as content", exc)
                pieces.append(Content(json.dumps(item, ensure_ascii=False)))
                continue
            pieces.append(ToolCallMade(self.num_tool_calls, call))
            self.num_tool_calls += 1
        return pieces

    def _route(self, segments: list[tuple[str | None, str]]) -> list[Piece]:
        pieces: list[Piece] = []
        for state, text in segments:
            if self._current == TOOL and state != TOOL:
                pieces.extend(self._end_call(closed=True))
            self._current = state or NORMAL
            if state == TOOL:
                self._after_call = None
                self._tool_text += text
            elif not text:
                continue
            elif state == REASONING:
                pieces.append(Reasoning(text))
            elif state == NORMAL or state is None:
                if self._after_call is not None:
                    if not text.strip():
                        self._after_call += text
                        continue
                    text, self._after_call = self._after_call + text, None
                pieces.extend(self._content(text))
            # Other states belong to a response format's framing (headers): not shown, as in mlx_lm.server.
        return pieces

    def _end_call(self, *, closed: bool) -> list[Piece]:
        body, self._tool_text = self._tool_text, ""
        raw = (self._fmt.tool_call_start or "") + body + ((self._fmt.tool_call_end or "") if closed else "")
        if not self._parse:
            return [Content(raw)]
        cut_json = not closed and self._fmt.tool_parser_kind in _JSON_CALL_FORMATS
        calls = self._parsed(body, quiet=cut_json)
        if calls is None:
            cut = self._cut_call(body) if cut_json else None
            if cut is not None:
                return cut
            return [Content(raw)]
        pieces: list[Piece] = []
        for call in calls:
            pieces.append(ToolCallMade(self.num_tool_calls, call))
            self.num_tool_calls += 1
        self._after_call = ""
        return pieces

    def _cut_call(self, text: str) -> list[Piece] | None:
        """A cut call's piece (none while its name is not settled); None when `text` is no call object's start."""
        cut = read_cut_call(text, self._call_names)
        if cut is None:
            return None
        name, arguments = cut
        if name is None:
            return []
        unique = self._call_id({}, self.num_tool_calls)
        piece = ToolCallMade(self.num_tool_calls, ToolCall(unique, name, arguments, complete=False))
        self.num_tool_calls += 1
        return [piece]

    def _parsed(self, body: str, *, quiet: bool = False) -> list[ToolCall] | None:
        assert self._fmt.parse_tool_call is not None  # `_parse` is only set for formats with a parser
        try:
            parsed = self._fmt.parse_tool_call(body, self._tools)
            items = parsed if isinstance(parsed, list) else [parsed]
            return [self._call(item, self.num_tool_calls + i) for i, item in enumerate(items)]
        except Exception as exc:  # noqa: BLE001  (mlx-lm's parsers raise whatever their parsing hits)
            if not quiet:
                log.warning("a tool call did not parse (%s: %s); returned as content", type(exc).__name__, exc)
            return None

    def _call(self, item: Any, index: int) -> ToolCall:
        name, arguments = item["name"], item.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise ValueError(f"no function name in {item!r:.80}")
        if isinstance(arguments, str):
            json.loads(arguments)  # arguments must be JSON text; a ValueError makes the call content
        else:
            arguments = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(self._call_id(item, index), name, arguments)

    def _call_id(self, item: Mapping[str, Any], index: int) -> str:
        if isinstance(item.get("id"), str):
            return item["id"]
        unique = uuid.uuid4() if self._id_seed is None else uuid.uuid5(uuid.NAMESPACE_URL,
                                                                       f"{self._id_seed}/{index}")
        return f"{self._id_prefix}{unique.hex[:24]}"


# Native formats whose call body is one `{"name": ..., "arguments": ...}` JSON object (`tool_choice.py`).
_JSON_CALL_FORMATS = frozenset({"json_tools"})
