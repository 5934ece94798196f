"""The Responses stream: router pieces → output items and the events that build them, in the reference's order.

`ResponseEvents` is one response's renderer. `start` gives
`response.created` and `response.in_progress`; `pieces` turns the router's
pieces into output items, opening and closing them as the kind of text
changes (reasoning → `reasoning` item, content → `message` item, a call →
`function_call` or `custom_tool_call` item), each with its events:
`output_item.added`, `content_part.added`, the deltas, their `.done`,
`content_part.done`, `output_item.done`; `finish` closes what is open and
ends with `response.completed` (or `response.incomplete` at
max_output_tokens); `fail` ends with `error` and `response.failed`. Every
event carries its `type` and a strictly increasing `sequence_number`.
`whole` is the same object for a call that is not streamed, so streamed and
whole answers are the same items.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any


from mlx_trio.events import Finished
from mlx_trio.http.completion.output_router import Content, Piece, Reasoning, ToolCallMade
from mlx_trio.http.responses.items import item_id
from mlx_trio.http.responses.objects import ResponseShape, error_object, logprobs_object, usage_object
from mlx_trio.http.server.errors import ApiError
from mlx_trio.logprobs import TokenLogprob

Event = dict[str, Any]


class ResponseEvents:
    """One response's events and items.

    `custom_tools` are the names whose calls are `custom_tool_call`s;
    `namespaces` names the namespace of tools given in one.
    """

    def __init__(self, shape: ResponseShape, *, custom_tools: Collection[str] = (),
                 namespaces: Mapping[str, str] | None = None) -> None:
        self.shape = shape
        self.output: list[dict[str, Any]] = []
        self.response: dict[str, Any] = shape.response("in_progress")
        self._custom = frozenset(custom_tools)
        self._namespaces = dict(namespaces or {})
        self._sequence = 0
        # Invariant: the last output item is still open (takes more text) while this is True.
        self._open = False
        self._logprobs: list[TokenLogprob] = []  # of text not yet sent as content

    def _item_id(self, kind: str) -> str:
        return item_id(kind, of=f"{self.shape.id}/{len(self.output)}")

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def pieces(self, pieces: Sequence[Piece], *, logprobs: Sequence[TokenLogprob] = ()) -> list[Event]:
        """Events for the pieces of one text delta (with its tokens' `logprobs`, when asked for)."""
        self._logprobs.extend(logprobs)
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, ToolCallMade):
                self._logprobs.clear()  # the call's tokens: Responses reports logprobs for output text only
                events.extend(self._call(piece))
            else:
                events.extend(self._text(piece))
        return events

    def finish(self, finished: Finished) -> list[Event]:
        """Close what is open; `response.completed`, or `response.incomplete` when max_output_tokens cut it."""
        cut = finished.finish_reason == "length"
        events = self._close(status="incomplete" if cut else "completed")  # the item max_output_tokens cut
        usage = usage_object(finished.usage)
        if cut:
            self.response = self.shape.response("incomplete", self.output, usage=usage,
                                                incomplete_reason="max_output_tokens")
            return [*events, self._event("response.incomplete", response=self.response)]
        self.response = self.shape.response("completed", self.output, usage=usage)
        return [*events, self._event("response.completed", response=self.response)]

    def fail(self, error: ApiError) -> list[Event]:
        """The end of a stream the engine could not finish: `error`, then `response.failed`."""
        self.response = self.shape.response("failed", self.output, error=error_object(error))
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=self.response)]

    def whole(self, pieces: Sequence[Piece], finished: Finished, *,
              logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        """The finished response object of a call that is not streamed."""
        self.start()
        self.pieces(pieces, logprobs=logprobs)
        self.finish(finished)
        return self.response

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return event

    def _added(self, item: dict[str, Any]) -> Event:
        self.output.append(item)
        # A copy: the item grows after this event is built (its content list included).
        added = {**item, "content": []} if "content" in item else dict(item)
        return self._event("response.output_item.added", output_index=len(self.output) - 1, item=added)

    def _ids(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _text(self, piece: Content | Reasoning) -> list[Event]:
        kind = "message" if isinstance(piece, Content) else "reasoning"
        events: list[Event] = []
        if not (self._open and self.output[-1]["type"] == kind):
            events = self._close()
            if kind == "message":
                item = {"id": self._item_id("message"), "type": "message", "status": "in_progress", "content": [],
                        "role": "assistant"}
                part: dict[str, Any] = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
            else:
                item = {"id": self._item_id("reasoning"), "type": "reasoning", "status": "in_progress", "summary": [],
                        "content": [], "encrypted_content": None}
                part = {"type": "reasoning_text", "text": ""}
            events.append(self._added(item))
            self._open = True
            events.append(self._event("response.content_part.added", **self._ids(), content_index=0,
                                      part={**part, **({"logprobs": []} if kind == "message" else {})}))
            item["content"].append(part)
        part = self.output[-1]["content"][0]
        part["text"] += piece.text
        if kind == "reasoning":
            self._logprobs.clear()
            events.append(self._event("response.reasoning_text.delta", **self._ids(), content_index=0,
                                      delta=piece.text))
            return events
        shaped = logprobs_object(self._logprobs)
        self._logprobs.clear()
        part["logprobs"].extend(shaped)
        events.append(self._event("response.output_text.delta", **self._ids(), content_index=0, delta=piece.text,
                                  logprobs=shaped))
        return events

    def _close(self, status: str = "completed") -> list[Event]:
        """Close the open message or reasoning item, if any, with `status`."""
        if not self._open:
            return []
        self._open = False
        item = self.output[-1]
        part = item["content"][0]
        if item["type"] == "message":
            done = self._event("response.output_text.done", **self._ids(), content_index=0, text=part["text"],
                               logprobs=list(part["logprobs"]))
        else:
            done = self._event("response.reasoning_text.done", **self._ids(), content_index=0, text=part["text"])
        item["status"] = status
        return [done, self._event("response.content_part.done", **self._ids(), content_index=0, part=dict(part)),
                self._event("response.output_item.done", output_index=len(self.output) - 1, item=_copy(item))]

    def _call(self, piece: ToolCallMade) -> list[Event]:
        call = piece.call
        events = self._close()
        if call.name in self._custom:
            text = custom_input(call.arguments)
            item: dict[str, Any] = {"id": self._item_id("custom_tool_call"), "type": "custom_tool_call",
                                    "status": "in_progress", "call_id": call.id, "name": call.name, "input": ""}
            events.append(self._added(item))
            events.append(self._event("response.custom_tool_call_input.delta", **self._ids(), delta=text))
            events.append(self._event("response.custom_tool_call_input.done", **self._ids(), input=text))
            item["input"] = text
        else:
            item = {"id": self._item_id("function_call"), "type": "function_call", "status": "in_progress",
                    "arguments": "", "call_id": call.id, "name": call.name}
            if call.name in self._namespaces:
                item["namespace"] = self._namespaces[call.name]
            events.append(self._added(item))
            events.append(self._event("response.function_call_arguments.delta", **self._ids(), delta=call.arguments))
            events.append(self._event("response.function_call_arguments.done", **self._ids(),
                                      arguments=call.arguments))
            item["arguments"] = call.arguments
        # A call max_tokens cut: its item is "incomplete", as the response is (`finish`).
        item["status"] = "completed" if call.complete else "incomplete"
        events.append(self._event("response.output_item.done", output_index=len(self.output) - 1, item=dict(item)))
        return events


def custom_input(arguments: str) -> str:
    """A custom tool's input from the call's JSON arguments (`{"input": "..."}`, as the template was told)."""
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(decoded, dict) and isinstance(decoded.get("input"), str) and len(decoded) == 1:
        return decoded["input"]
    return arguments


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(part) for part in item["content"]]}
