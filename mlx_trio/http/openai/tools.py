"""OpenAI `tools`, `tool_choice` and `parallel_tool_calls` of a chat completion body → a `ToolsRequest`.

Wire checks only: each tool is `{"type": "function", "function": {...}}`
with a name and an object schema; `tool_choice` is a choice string or names
a known function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlx_trio.errors import InvalidParameter
from mlx_trio.http.completion.tools import ToolsRequest, checked_function

CHOICES = ("auto", "none", "required")


def parse_openai_tools(body: Mapping[str, Any]) -> ToolsRequest:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat completion body."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise InvalidParameter("tools", f"must be a list of tool objects, got {type(raw).__name__}")
    tools = tuple(_function_tool(tool, i) for i, tool in enumerate(raw or []))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidParameter("parallel_tool_calls", "must be a boolean")
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    return ToolsRequest(tools, choice, name, parallel is not False)


def _function_tool(tool: Any, index: int) -> dict[str, Any]:
    field = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidParameter(field, 'must be {"type": "function", "function": {...}}; only function tools are supported')
    function = tool["function"]
    checked_function(function.get("name"), function.get("parameters"), field=f"{field}.function")
    return tool


def _tool_choice(choice: Any, tools: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise InvalidParameter("tool_choice", f"must be one of {', '.join(CHOICES)} or a function, got {choice!r:.40}")
        if choice == "required" and not tools:
            raise InvalidParameter("tool_choice", "'required' needs at least one tool in tools")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidParameter("tool_choice", 'must be a string or {"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise InvalidParameter("tool_choice", f"names function {name!r:.60}, which is not in tools ({', '.join(names) or 'none'})")
    return "function", name
