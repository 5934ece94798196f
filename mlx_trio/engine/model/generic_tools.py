"""Tool calling for a model whose chat template has none: the generic format, written into the chat itself.

The template never sees `tools` or `tool_calls` (it would drop them, or
refuse the `tool` role); the chat is rewritten into roles every template
takes, as llama.cpp's "generic" handler does:

    tools + instruction   → the system message: appended to the first one,
                            or a new one in front (`system_role=False`: the
                            top of the first user message instead, for
                            templates that refuse a system role)
    assistant tool_calls  → its content, the call object as the model writes
                            it (`generic_calls_text`), after any text
    tool results          → a user turn ("Tool result ..."), merged with the
                            user turns next to it, so roles still alternate

The answer's grammar (http/completion/tool_choice.py) holds the model to the
syntax the instruction shows; the output router reads it back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mlx_trio.output_format import generic_calls_text

INSTRUCTION = (
    "To call tools, reply with only a JSON object and nothing else:\n"
    '{"tool_calls":[{"name":"<tool name>","arguments":{<arguments>}}]}\n'
    "Otherwise reply in plain text. Tool results come back in messages that start with \"Tool result\"."
)


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system prompt's tool part: one JSON line per tool (name, description, parameters), then the instruction."""
    lines = ["You can use these tools:"]
    for tool in tools:
        function = tool["function"]
        entry = {"name": function["name"]}
        if function.get("description"):
            entry["description"] = function["description"]
        entry["parameters"] = function.get("parameters") or {"type": "object"}
        lines.append(json.dumps(entry, ensure_ascii=False))
    return "\n".join(lines) + "\n\n" + INSTRUCTION


def generic_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, *,
                 system_role: bool = True) -> list[dict[str, Any]]:
    """`messages` (contents already strings) rewritten for a template without tool support.

    Without `tools` only the history is rewritten (calls and results of
    earlier turns stay visible to the model).
    """
    names: dict[str, str] = {}  # call id → tool name, for the results that answer them
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            for call in calls:
                names[str(call.get("id"))] = call["function"]["name"]
            text = generic_calls_text([{"name": c["function"]["name"], "arguments": _arguments(c["function"])}
                                       for c in calls])
            out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif role == "tool":
            name = message.get("name") or names.get(str(message.get("tool_call_id")))
            _add_user(out, f"Tool result{f' from {name}' if name else ''}:\n{content}")
        elif role == "user":
            _add_user(out, content)
        else:
            out.append({key: value for key, value in message.items() if key != "tool_calls"})
    if tools:
        _add_tools(out, tools_prompt(tools), system_role=system_role)
    return out


def _add_user(out: list[dict[str, Any]], text: str) -> None:
    if out and out[-1]["role"] == "user":
        out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{text}"}
    else:
        out.append({"role": "user", "content": text})


def _add_tools(out: list[dict[str, Any]], prompt: str, *, system_role: bool) -> None:
    if out and out[0]["role"] == "system":
        system = out[0]["content"]
        out[0] = {**out[0], "content": f"{system}\n\n{prompt}" if system else prompt}
    elif system_role:
        out.insert(0, {"role": "system", "content": prompt})
    else:
        first_user = next((i for i, m in enumerate(out) if m["role"] == "user"), 0)
        if out and out[first_user]["role"] == "user":
            out[first_user] = {**out[first_user], "content": f"{prompt}\n\n{out[first_user]['content']}"}
        else:
            out.insert(0, {"role": "user", "content": prompt})


def _arguments(function: Mapping[str, Any]) -> Any:
    """A history call's arguments as a JSON value (HTTP decodes them already; embedders may pass the text)."""
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}
