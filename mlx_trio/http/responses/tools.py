"""Responses `tools`, `tool_choice` and `parallel_tool_calls` → the shared `ToolsRequest`, plus custom tools.

Function tools come in the flat Responses shape (`name`, `parameters`,
`strict` beside `type`) and go to the chat template in the nested chat
shape. A custom (freeform) tool takes one string: the template sees it as a
function with a single string parameter `input`, and a call of it comes
back as a `custom_tool_call` whose input is that string. When a custom tool
with a grammar (`format.type` "grammar", syntax lark or regex) is forced
(`tool_choice` names it, or "required" with only it), the whole answer is
its input, enforced by that grammar: no tool-call syntax around it.
A `namespace` tool groups function and custom tools (Codex sends its
sub-agent tools so): its tools are offered as they are, and a call of one
names its namespace. Hosted tools (file search, computers, MCP, …) run on
OpenAI's side; this server has none, so they are a 400 naming the type,
except web search, which Codex CLI sends with every request: it is left
out of what the model is offered, so the harness keeps working.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from mlx_trio.errors import InvalidParameter
from mlx_trio.http.completion.tools import ToolsRequest, checked_function
from mlx_trio.http.server.body import json_type, type_field
from mlx_trio.params import Constraint

_CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
# Hosted tools a harness sends whether or not the server can run them: not offered to the model.
IGNORED_HOSTED = frozenset({"web_search", "web_search_preview"})
CHOICES = ("auto", "none", "required")


@attrs.frozen
class ResponsesTools:
    """The tool part of one Responses request.

    `request` is what the shared completion path needs; `custom` maps each
    custom tool's name to its input grammar (None: free text);
    `namespaces` maps the name of each tool given in a namespace to it; `forced`
    is the constraint for the answer when a custom tool with a grammar is
    forced (then `forced_name` is that tool and `request.choice` is "auto").
    """

    request: ToolsRequest
    custom: Mapping[str, Constraint | None] = attrs.field(factory=dict)
    namespaces: Mapping[str, str] = attrs.field(factory=dict)
    forced: Constraint | None = None
    forced_name: str | None = None


def parse_tools(body: Mapping[str, Any]) -> ResponsesTools:
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise InvalidParameter("tools", f"must be a list of tools, got {json_type(raw)}")
    tools: list[dict[str, Any]] = []
    custom: dict[str, Constraint | None] = {}
    namespaces: dict[str, str] = {}
    fields: dict[str, str] = {}  # tool name → the body field of its schema, for errors
    for i, tool in enumerate(raw or []):
        kind = type_field(tool, f"tools[{i}]")
        if kind in IGNORED_HOSTED:
            continue
        nested = _namespace(tool, f"tools[{i}]") if kind == "namespace" else [(tool, f"tools[{i}]")]
        for entry, where in nested:
            template_tool, grammar, is_custom = _tool(entry, where)
            tools.append(template_tool)
            name = template_tool["function"]["name"]
            fields[name] = where if is_custom else f"{where}.parameters"
            if is_custom:
                custom[name] = grammar
            if entry is not tool:
                namespaces[name] = tool["name"]
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidParameter("parallel_tool_calls", f"must be a boolean, got {json_type(parallel)}")
    choice, name, tools = _choice(body.get("tool_choice"), tools)
    schema_fields = tuple(fields[tool["function"]["name"]] for tool in tools)
    forced_name = name if choice == "function" else None
    if choice == "required" and len(tools) == 1:
        forced_name = tools[0]["function"]["name"]
    if forced_name is not None and custom.get(forced_name) is not None:
        request = ToolsRequest(tuple(tools), "auto", None, parallel=False, schema_fields=schema_fields)
        return ResponsesTools(request, custom, namespaces, custom[forced_name], forced_name)
    request = ToolsRequest(tuple(tools), choice, name, parallel is not False, schema_fields=schema_fields)
    return ResponsesTools(request, custom, namespaces)


def _namespace(tool: Mapping[str, Any], where: str) -> list[tuple[Any, str]]:
    """A namespace's tools, each with its field name."""
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidParameter(f"{where}.name", "must be a non-empty string")
    nested = tool.get("tools")
    if not isinstance(nested, list):
        raise InvalidParameter(f"{where}.tools", f"must be a list of tools, got {json_type(nested)}")
    return [(entry, f"{where}.tools[{j}]") for j, entry in enumerate(nested)]


def _tool(tool: Any, where: str) -> tuple[dict[str, Any], Constraint | None, bool]:
    """(the template's function tool, the custom tool's grammar, whether it is custom)."""
    kind = type_field(tool, where)
    if kind not in ("function", "custom"):
        if kind is None:
            raise InvalidParameter(f"{where}.type", "is required: 'function' or 'custom'")
        raise InvalidParameter(f"{where}.type", f"'{kind}' tools are not supported by this server (it runs no "
                                                "hosted tools); send function or custom tools")
    name, description = tool.get("name"), tool.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidParameter(f"{where}.description", f"must be a string, got {json_type(description)}")
    if kind == "function":
        checked_function(name, tool.get("parameters"), field=where)
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise InvalidParameter(f"{where}.strict", f"must be a boolean, got {json_type(tool['strict'])}")
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        grammar = None
    else:
        checked_function(name, None, field=where)
        parameters = _CUSTOM_PARAMETERS
        grammar = _custom_format(tool.get("format"), f"{where}.format")
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}, grammar, kind == "custom"


def _custom_format(value: Any, where: str) -> Constraint | None:
    """A custom tool's `format`: free text (None) or a grammar the input must follow."""
    if value is None:
        return None
    kind = type_field(value, where)
    if kind == "text":
        return None
    if kind != "grammar":
        raise InvalidParameter(f"{where}.type", f"must be 'text' or 'grammar', got {kind!r:.40}")
    syntax, definition = value.get("syntax"), value.get("definition")
    if not isinstance(definition, str) or not definition.strip():
        raise InvalidParameter(f"{where}.definition", "must be a non-empty grammar")
    if syntax == "lark":
        return Constraint("lark", definition)
    if syntax == "regex":
        # One lark regex terminal: a "/" the regex does not escape would end it early.
        return Constraint("lark", "start: /" + re.sub(r"(?<!\\)/", r"\/", definition) + "/\n")
    raise InvalidParameter(f"{where}.syntax", f"must be 'lark' or 'regex', got {syntax!r:.40}")


def _choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None, list[dict[str, Any]]]:
    """(shared choice, the named tool, the tools the model may call) for a Responses `tool_choice`."""
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return ("auto" if tools else "none"), None, tools
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise InvalidParameter("tool_choice", f"must be one of {', '.join(CHOICES)} or an object, "
                                                  f"got {choice!r:.40}")
        if choice == "required" and not tools:
            raise InvalidParameter("tool_choice", "'required' needs at least one tool in tools")
        return choice, None, tools
    kind = type_field(choice, "tool_choice")
    if kind in ("function", "custom"):
        name = choice.get("name")
        if name not in names:
            raise InvalidParameter("tool_choice.name", f"must name one of the tools ({', '.join(names) or 'none'}), "
                                                       f"got {name!r:.60}")
        return "function", name, tools
    if kind == "allowed_tools":
        return _allowed(choice, tools, names)
    raise InvalidParameter("tool_choice", "must be 'auto', 'none', 'required', {\"type\": \"function\" or "
                                          "\"custom\", \"name\": ...} or allowed_tools; hosted tools are not "
                                          "supported")


def _allowed(choice: Mapping[str, Any], tools: list[dict[str, Any]],
             names: Sequence[str]) -> tuple[str, str | None, list[dict[str, Any]]]:
    mode, allowed = choice.get("mode"), choice.get("tools")
    if mode not in ("auto", "required"):
        raise InvalidParameter("tool_choice.mode", f"must be 'auto' or 'required', got {mode!r:.40}")
    if not isinstance(allowed, list) or not allowed:
        raise InvalidParameter("tool_choice.tools", "must be a non-empty list of {\"type\", \"name\"}")
    wanted = set()
    for i, entry in enumerate(allowed):
        name = entry.get("name") if isinstance(entry, dict) else None
        if name not in names:
            raise InvalidParameter(f"tool_choice.tools[{i}].name", f"must name one of the tools, got {name!r:.60}")
        wanted.add(name)
    return mode, None, [t for t in tools if t["function"]["name"] in wanted]
