"""The tool part of a completion, as every wire API's parser builds it: `ToolsRequest` and the tool history.

Each parser (`openai/tools.py`, `anthropic/requests.py`) turns its own tool
fields into OpenAI function tools and one of the choices "auto", "none",
"required" or "function", so calls are parsed and enforced alike. Wire
checks only: each tool is a function with a name and an object schema;
assistant `tool_calls` carry JSON arguments, which are decoded for the chat
template (templates render them with `tojson`, as under mlx_lm.server).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from mlx_trio.errors import InvalidParameter
from mlx_trio.http.completion.tool_choice import tool_choice_constraint
from mlx_trio.params import Constraint


@attrs.frozen
class ToolsRequest:
    """The tool part of one chat request.

    `choice` is "auto", "none", "required" or "function" (`function_name`
    says which). With "none" the template gets no tools and the output is not
    parsed for calls: the model answers in text. `schema_fields` names, in
    `tools` order, the body field that holds each tool's schema, so an error
    about one names it as the client wrote it (empty: OpenAI's own
    `tools[i].function.parameters`).

    `loaded` are tools the conversation loaded on the way (Anthropic's tool
    search: a `tool_reference` in a tool result): callable and parsed like
    `tools`, but not in the template's tool list, because the request renders
    their definitions where they were loaded; the prompt before that point
    stays as the previous turn had it, so its cached prefix still matches.
    `schema_fields` then covers `tools` and `loaded`, in that order.
    """

    tools: tuple[Mapping[str, Any], ...] = ()
    choice: str = "none"
    function_name: str | None = None
    parallel: bool = True
    schema_fields: tuple[str, ...] = ()
    loaded: tuple[Mapping[str, Any], ...] = ()

    @property
    def active(self) -> bool:
        """Tools go to the template and calls are parsed out of the output."""
        return bool(self.tools) and self.choice != "none"

    @property
    def call_names(self) -> tuple[str, ...]:
        """The functions the model may call: the named one, or every tool's (the loaded ones too)."""
        if self.choice == "function" and self.function_name is not None:
            return (self.function_name,)
        return tuple(tool["function"]["name"] for tool in (*self.tools, *self.loaded))

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [dict(t) for t in self.tools] if self.active else None

    @property
    def forced(self) -> bool:
        """The answer must be a call ("required" or a named function)."""
        return self.active and self.choice in ("required", "function")

    def callable_tools(self) -> list[dict[str, Any]] | None:
        """The tools a call may name: the template's and the loaded ones."""
        return [dict(t) for t in (*self.tools, *self.loaded)] if self.active else None

    def constraint(self, parser_kind: str | None, *, close_reasoning: str | None = None) -> Constraint | None:
        if not self.active:
            return None
        return tool_choice_constraint((*self.tools, *self.loaded), self.choice, parser_kind,
                                      function_name=self.function_name, parallel=self.parallel,
                                      schema_fields=self.schema_fields, close_reasoning=close_reasoning)


NO_TOOLS = ToolsRequest()


def checked_function(name: Any, parameters: Any, *, field: str) -> None:
    """A function's name and parameters schema, as every tool format needs them."""
    if not isinstance(name, str) or not name:
        raise InvalidParameter(f"{field}.name", "must be a non-empty string")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidParameter(f"{field}.parameters", "must be a JSON Schema object")


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for the chat template: assistant `tool_calls` checked, their JSON arguments decoded."""
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        calls = message.get("tool_calls")
        if calls is not None:
            if message.get("role") != "assistant" or not isinstance(calls, list):
                raise InvalidParameter(f"messages[{i}].tool_calls", "must be a list, on an assistant message")
            message["tool_calls"] = [_history_call(call, f"messages[{i}].tool_calls[{j}]")
                                     for j, call in enumerate(calls)]
        if message.get("role") == "tool" and not isinstance(message.get("tool_call_id", ""), str):
            raise InvalidParameter(f"messages[{i}].tool_call_id", "must be a string")
        out.append(message)
    return out


def _history_call(call: Any, field: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidParameter(field, 'must be {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}')
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise InvalidParameter(f"{field}.function.arguments", "must be a JSON object text") from None
    if not isinstance(arguments, dict):
        raise InvalidParameter(f"{field}.function.arguments", "must be a JSON object (or its JSON text)")
    return {**call, "function": {**function, "arguments": arguments}}
