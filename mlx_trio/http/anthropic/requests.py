"""Anthropic Messages bodies (`POST /v1/messages`) → the same engine call a chat completion makes.

Anthropic's content blocks become the OpenAI-style messages chat templates
expect: `system` → a system message, `tool_use` blocks → the assistant's
`tool_calls`, `tool_result` blocks → `tool` messages, text blocks → content.
Its tools (`name`, `input_schema`) become function tools and its
`tool_choice` (`auto`, `any`, `tool`, `none`) the OpenAI choices, so tool
calls are parsed and enforced exactly as for chat completions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mlx_trio.errors import InvalidParameter
from mlx_trio.http.completion.call import CompletionCall, template_kwargs
from mlx_trio.http.completion.tools import ToolsRequest, checked_function, template_messages
from mlx_trio.http.server.body import is_int, json_type, optional_field

# Anthropic's sampling fields and ours (SamplingParams) where the names differ.
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop_sequences": "stop"}
# Blocks a model here cannot take; a 400 says so rather than dropping them.
_UNSUPPORTED_BLOCKS = frozenset({"image", "document", "search_result", "server_tool_use", "web_search_tool_result",
                                 "container_upload"})


def parse_messages(body: Mapping[str, Any], *, template_defaults: Mapping[str, Any]) -> CompletionCall:
    """Validate a Messages body; errors name the Anthropic field."""
    optional_field(body, "model", str)
    max_tokens = body.get("max_tokens")
    if not is_int(max_tokens) or max_tokens < 1:
        raise InvalidParameter("max_tokens", f"is required: an integer >= 1, got {max_tokens!r:.40}")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidParameter("messages", f"must be a non-empty list of messages, got {json_type(raw)}")
    messages = [*_system(body.get("system"))]
    for i, message in enumerate(raw):
        messages.extend(_message(message, i))
    sampling: dict[str, Any] = {"max_tokens": max_tokens}
    for name, ours in _SAMPLING.items():
        if body.get(name) is not None:
            sampling[ours] = body[name]
    if "stop" in sampling and not (isinstance(sampling["stop"], list)
                                   and all(isinstance(s, str) and s for s in sampling["stop"])):
        raise InvalidParameter("stop_sequences", "must be a list of non-empty strings")
    return CompletionCall(chat=True, prompt=template_messages(messages), sampling=sampling,
                          chat_template_kwargs=template_kwargs({**body, **_thinking(body)}, template_defaults),
                          stream=bool(optional_field(body, "stream", bool)), include_usage=True, tools=_tools(body))


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        return [{"role": "system", "content": "".join(_text_block(b, f"system[{i}]") for i, b in enumerate(system))}]
    raise InvalidParameter("system", f"must be a string or a list of text blocks, got {json_type(system)}")


def _message(message: Any, index: int) -> list[dict[str, Any]]:
    field = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise InvalidParameter(f"{field}.role", "must be 'user' or 'assistant'")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidParameter(f"{field}.content", f"must be a string or a list of blocks, got {json_type(content)}")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{field}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not shown to the model again, as chat templates drop it
        elif kind in _UNSUPPORTED_BLOCKS:
            raise InvalidParameter(f"{where}.type", f"'{kind}' blocks are not supported by this server")
        else:
            raise InvalidParameter(f"{where}.type", f"a {role} message cannot hold a block of type {kind!r:.40}")
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            out["tool_calls"] = calls
        return [out]
    # Tool results answer the previous assistant turn, so they come before this turn's text.
    return [*results, *([{"role": "user", "content": "".join(texts)}] if texts or not results else [])]


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise InvalidParameter(where, 'must be a text block {"type": "text", "text": ...}')
    return block["text"]


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise InvalidParameter(where, "a tool_use block needs a string id and name")
    if not isinstance(block.get("input", {}), dict):
        raise InvalidParameter(f"{where}.input", "must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": block.get("input", {})}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise InvalidParameter(f"{where}.tool_use_id", "must be a string")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_block(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidParameter(f"{where}.content", "must be a string or a list of text blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _thinking(body: Mapping[str, Any]) -> dict[str, Any]:
    """Anthropic's `thinking` switch → the templates' `enable_thinking` (a budget is not enforced)."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled"):
        raise InvalidParameter("thinking.type", "must be 'enabled' or 'disabled'")
    given = body.get("chat_template_kwargs") or {}
    return {"chat_template_kwargs": {"enable_thinking": kind == "enabled", **given}}


def _tools(body: Mapping[str, Any]) -> ToolsRequest:
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise InvalidParameter("tools", f"must be a list of tools, got {json_type(raw)}")
    tools = []
    for i, tool in enumerate(raw or []):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            raise InvalidParameter(f"tools[{i}]", "only custom tools (name, description, input_schema) are supported")
        checked_function(tool.get("name"), tool.get("input_schema"), field=f"tools[{i}]")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if choice is None:
        return ToolsRequest(tuple(tools), "auto" if tools else "none")
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use"))
    names = [t["function"]["name"] for t in tools]
    if kind == "tool":
        if choice.get("name") not in names:
            raise InvalidParameter("tool_choice.name", f"must name one of the tools ({', '.join(names) or 'none'})")
        return ToolsRequest(tuple(tools), "function", choice["name"], parallel=False)
    mapping = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in mapping:
        raise InvalidParameter("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
    if kind == "any" and not tools:
        raise InvalidParameter("tool_choice", "'any' needs at least one tool in tools")
    return attrs.evolve(ToolsRequest(tuple(tools), mapping[kind]), parallel=parallel)
