"""Responses input items → the chat messages a chat template renders, naming the item on error.

The item list is the conversation: `message` items (roles user, assistant,
system, developer; text parts only), the model's earlier `function_call` /
`custom_tool_call` items with their `*_output` answers, and `reasoning`
items. Calls join the assistant message before them (a chat message holds
its `tool_calls`); outputs become `tool` messages and must answer a call
made earlier in the list. Reasoning text goes on the next assistant message
as `reasoning_content`, which is where reasoning chat templates read it.
`instructions` and the leading system/developer messages become one system
message: many templates allow a system turn only first.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from mlx_trio.errors import InvalidParameter
from mlx_trio.http.server.body import json_type, type_field

# Content parts that carry text, by the role that may send them.
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"})
_MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})
_ROLES = ("user", "assistant", "system", "developer")
# Items the API defines that this server cannot act on (hosted tools, references into OpenAI's storage).
_UNSUPPORTED_ITEMS = frozenset({
    "item_reference", "file_search_call", "web_search_call", "computer_call", "computer_call_output",
    "code_interpreter_call", "image_generation_call", "local_shell_call", "local_shell_call_output",
    "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output", "mcp_call",
    "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "compaction",
})
ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "custom_tool_call": "ctc", "reasoning": "rs",
                 "function_call_output": "fco", "custom_tool_call_output": "ctco"}


def item_id(kind: str, *, of: str | None = None) -> str:
    """A fresh id for an item of `kind`; with `of` (a response id and the item's place in it) always the same
    one, so that a resumed response names its items as the stream its client had (`ResponseEvents`)."""
    unique = uuid.uuid4() if of is None else uuid.uuid5(uuid.NAMESPACE_URL, of)
    return f"{ITEM_PREFIXES.get(kind, 'item')}_{unique.hex}"


def with_id(item: Mapping[str, Any]) -> dict[str, Any]:
    """`item` with an `id` (items are listed by id); a client's own id is kept."""
    return dict(item) if isinstance(item.get("id"), str) else {"id": item_id(str(item.get("type"))), **item}


def normalized_input(value: Any) -> list[dict[str, Any]]:
    """`input` as a list of typed items: a string is one user message; a bare `{role, content}` is a message.

    A message's string content becomes one text part, as OpenAI stores it.
    """
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list):
        raise InvalidParameter("input", f"must be a string or a list of items, got {json_type(value)}")
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidParameter(f"input[{i}]", f"must be an object, got {json_type(item)}")
        if item.get("type") is None and "role" in item:
            item = {"type": "message", **item}
        if item.get("type") == "message" and isinstance(item.get("content"), str):
            # Stored and listed as OpenAI lists them: content as parts.
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item = {**item, "content": [{"type": kind, "text": item["content"]}]}
        items.append(item)
    return items


def chat_messages(items: Sequence[Mapping[str, Any]], *, instructions: str | None,
                  first_input: int = 0) -> list[dict[str, Any]]:
    """The messages for `items`; `first_input` is where this request's own items start (for error names)."""
    builder = _Messages()
    if instructions:
        builder.system(instructions)
    for i, item in enumerate(items):
        where = f"input[{i - first_input}]" if i >= first_input else f"previous_response_id (item {i})"
        builder.add(item, where)
    return builder.messages


class _Messages:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._calls: set[str] = set()
        self._reasoning: list[str] = []

    def system(self, text: str) -> None:
        # Leading system text merges into one turn; a later one stays where it was said.
        if self.messages and self.messages[-1]["role"] == "system" and len(self.messages) == 1:
            self.messages[-1]["content"] += "\n\n" + text
        else:
            self.messages.append({"role": "system", "content": text})

    def add(self, item: Mapping[str, Any], where: str) -> None:
        kind = type_field(item, where)
        if kind == "message":
            self._message(item, where)
        elif kind in ("function_call", "custom_tool_call"):
            self._call(item, where, custom=kind == "custom_tool_call")
        elif kind in ("function_call_output", "custom_tool_call_output"):
            self._output(item, where)
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                self._reasoning.append(text)
        elif kind in _UNSUPPORTED_ITEMS:
            raise InvalidParameter(f"{where}.type", f"'{kind}' items are not supported by this server")
        else:
            raise InvalidParameter(f"{where}.type", f"unknown item type {kind!r:.40}; expected message, "
                                                    "function_call, function_call_output, custom_tool_call, "
                                                    "custom_tool_call_output or reasoning")

    def _message(self, item: Mapping[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidParameter(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r:.40}")
        text = _content_text(item.get("content"), f"{where}.content")
        if role in ("system", "developer"):
            self.system(text)
        elif role == "assistant":
            self._assistant()["content"] += text
        else:
            self._reasoning.clear()  # reasoning before a user turn answered nothing the model sees again
            self.messages.append({"role": "user", "content": text})

    def _assistant(self) -> dict[str, Any]:
        """The assistant message to extend: the last one unless a turn came after it."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self._reasoning:
            last = {"role": "assistant", "content": ""}
            if self._reasoning:
                last["reasoning_content"] = "\n".join(self._reasoning)
                self._reasoning.clear()
            self.messages.append(last)
        return last

    def _call(self, item: Mapping[str, Any], where: str, *, custom: bool) -> None:
        call_id, name = item.get("call_id"), item.get("name")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidParameter(f"{where}.call_id", "must be a non-empty string")
        if not isinstance(name, str) or not name:
            raise InvalidParameter(f"{where}.name", "must be a non-empty string")
        if custom:
            text = item.get("input")
            if not isinstance(text, str):
                raise InvalidParameter(f"{where}.input", f"must be a string, got {json_type(text)}")
            arguments: Any = {"input": text}
        else:
            arguments = _arguments(item.get("arguments"), f"{where}.arguments")
        message = self._assistant()
        message.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        self._calls.add(call_id)

    def _output(self, item: Mapping[str, Any], where: str) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or call_id not in self._calls:
            raise InvalidParameter(f"{where}.call_id", f"no earlier function_call or custom_tool_call has call_id "
                                                       f"{call_id!r:.60}; send the call before its output")
        output = item.get("output")
        text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameter(where, f"must be a string or a list of content parts, got {json_type(content)}")
    texts = []
    for j, part in enumerate(content):
        kind = type_field(part, f"{where}[{j}]")
        if kind in _MEDIA_PARTS:
            raise InvalidParameter(f"{where}[{j}].type", f"'{kind}' parts are not supported: this server serves "
                                                          "a text-only model (images and files are not supported)")
        text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(text, str):
            raise InvalidParameter(f"{where}[{j}]", 'must be a text part {"type": "input_text", "text": ...}')
        texts.append(text)
    return "".join(texts)


def _arguments(arguments: Any, where: str) -> dict[str, Any]:
    """A call's JSON arguments text, decoded for the template (templates render them with `tojson`)."""
    if not isinstance(arguments, str):
        raise InvalidParameter(where, f"must be a string of JSON, got {json_type(arguments)}")
    try:
        decoded = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        raise InvalidParameter(where, "must be the JSON text of an object") from None
    if not isinstance(decoded, dict):
        raise InvalidParameter(where, "must be the JSON text of an object")
    return decoded


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    """A reasoning item's text: its `content` (reasoning_text parts), else its summary; may be empty."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts:
            return _content_text(parts, f"{where}.{key}")
    return ""
