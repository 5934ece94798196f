"""Anthropic Messages bodies (`POST /v1/messages`, `/count_tokens`) → the same engine call a chat completion makes.

Anthropic's content blocks become the OpenAI-style messages chat templates
expect: `system` → a system message, `role: "system"` messages stay system
messages (the engine places them: `engine/model/chat.py`), `tool_use`
blocks → the assistant's `tool_calls`, `tool_result` blocks → `tool`
messages, `thinking` blocks → the assistant's `reasoning_content` (which
templates with a reasoning slot render, and others ignore), text blocks →
content. Its tools (`name`, `input_schema`) become function tools and its
`tool_choice` (`auto`, `any`, `tool`, `none`) the OpenAI choices, so tool
calls are parsed and enforced exactly as for chat completions.

Prefix hygiene: a system block that changes on every request would sit in
front of the whole cached prompt, so `VOLATILE_SYSTEM_BLOCKS` are dropped
(unless `keep_billing_header`); docs/harnesses.md lists them.

Tool search: a tool with `defer_loading: true` is declared but not shown to
the model. A `tool_reference` block in a `tool_result` loads it: the
reference is rendered there, in the tool message, as the tool's definition
(a `<function>` line, the encoding Claude Code's ToolSearch tool describes),
and from then on the model may call it. The template's tool list holds the
non-deferred tools only, so loading a tool (and Claude Code adding it to
`tools`) changes nothing in front of the tool result: the previous turn's
prompt stays a prefix of this one. The server-side tool search tools
(`TOOL_SEARCH_TYPES`) need a search step inside the request, which this
server does not run: with one declared, every deferred tool is shown up
front instead, in request order (the same on every request of a
conversation, so the prefix is stable too), and the search tool's own
blocks in the history are dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from itertools import groupby
from typing import Any

import attrs

from mlx_trio.errors import InvalidParameter
from mlx_trio.http.completion.call import CompletionCall, template_kwargs
from mlx_trio.http.completion.tools import ToolsRequest, checked_function, template_messages
from mlx_trio.http.server.body import is_int, json_type, optional_field, type_field
from mlx_trio.params import Constraint

# Anthropic's sampling fields and ours (SamplingParams) where the names differ.
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop_sequences": "stop",
             "speculative": "speculative"}  # ours: false turns speculative decoding off for the request
# Blocks a model here cannot take; a 400 says so rather than dropping them.
_UNSUPPORTED_BLOCKS = frozenset({"image", "document", "search_result", "server_tool_use", "web_search_tool_result",
                                 "container_upload"})
# System text blocks that differ on every request, by their first characters. Claude Code's first
# block, `x-anthropic-billing-header: cc_version=…; cch=…;`, changes with each version and session.
VOLATILE_SYSTEM_BLOCKS = ("x-anthropic-billing-header:",)
# Anthropic's server-side tool search tools (regex and BM25 variants).
TOOL_SEARCH_TYPES = frozenset({"tool_search_tool_regex_20251119", "tool_search_tool_bm25_20251119"})
# `thinking.type` → the templates' `enable_thinking` (a budget is not enforced).
_THINKING = {"enabled": True, "adaptive": True, "disabled": False}


def parse_messages(body: Mapping[str, Any], *, template_defaults: Mapping[str, Any],
                   keep_billing_header: bool = False) -> CompletionCall:
    """Validate a Messages body; errors name the Anthropic field."""
    max_tokens = body.get("max_tokens")
    if not is_int(max_tokens) or max_tokens < 1:
        raise InvalidParameter("max_tokens", f"is required: an integer >= 1, got {max_tokens!r:.40}")
    sampling: dict[str, Any] = {"max_tokens": max_tokens}
    for name, ours in _SAMPLING.items():
        if body.get(name) is not None:
            sampling[ours] = body[name]
    if "stop" in sampling and not (isinstance(sampling["stop"], list)
                                   and all(isinstance(s, str) and s for s in sampling["stop"])):
        raise InvalidParameter("stop_sequences", "must be a list of non-empty strings")
    call = parse_count_tokens(body, template_defaults=template_defaults, keep_billing_header=keep_billing_header)
    return attrs.evolve(call, sampling={**call.sampling, **sampling}, stream=bool(optional_field(body, "stream", bool)))


def parse_count_tokens(body: Mapping[str, Any], *, template_defaults: Mapping[str, Any],
                       keep_billing_header: bool = False) -> CompletionCall:
    """The prompt part of a Messages body (`count_tokens` takes no `max_tokens`): system, messages, tools,
    thinking, and `output_config.format` (the one sampling field count_tokens takes)."""
    model = optional_field(body, "model", str)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidParameter("messages", f"must be a non-empty list of messages, got {json_type(raw)}")
    catalog = _tools(body)
    messages = [*_system(body.get("system"), keep_billing_header)]
    history = _History(catalog)
    for i, message in enumerate(raw):
        messages.extend(history.message(message, i))
    tools = _tool_choice(body.get("tool_choice"), history.tools_request())
    constraint = _output_format(body.get("output_config"))
    return CompletionCall(chat=True, prompt=template_messages(messages),
                          sampling={"constraint": constraint} if constraint is not None else {},
                          chat_template_kwargs=template_kwargs({**body, **_thinking(body)}, template_defaults),
                          stream=False, include_usage=True, tools=tools, model=model)


def _system(system: Any, keep_billing_header: bool) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise InvalidParameter("system", f"must be a string or a list of text blocks, got {json_type(system)}")
    texts = [_text_block(b, f"system[{i}]") for i, b in enumerate(system)]
    if not keep_billing_header:
        texts = [t for t in texts if not t.startswith(VOLATILE_SYSTEM_BLOCKS)]
    return [{"role": "system", "content": "".join(texts)}] if texts else []


@attrs.frozen
class _Tool:
    """A declared custom tool: the function tool the template and parsers take, and its schema's field."""

    function: dict[str, Any]
    field: str

    @property
    def name(self) -> str:
        return str(self.function["function"]["name"])

    def reference_text(self) -> str:
        """What a `tool_reference` to this tool renders as: one `<function>` line of its definition."""
        function = self.function["function"]
        return "<function>" + json.dumps({"description": function.get("description", ""), "name": function["name"],
                                          "parameters": function["parameters"]}, ensure_ascii=False) + "</function>"


@attrs.frozen
class _Catalog:
    """The request's tools: those shown to the model up front, the deferred ones, the tool search tools' names."""

    shown: tuple[_Tool, ...]
    deferred: Mapping[str, _Tool]
    search_names: frozenset[str]


@attrs.define
class _History:
    """Reads the messages in order, so a tool_use must name a declared tool and a tool_result a call before it;
    a tool_reference loads a deferred tool (`loaded`, in the order the conversation loaded them)."""

    catalog: _Catalog
    call_ids: set[str] = attrs.field(factory=set)
    search_ids: set[str] = attrs.field(factory=set)
    loaded: dict[str, _Tool] = attrs.field(factory=dict)

    def tools_request(self) -> ToolsRequest:
        shown, loaded = self.catalog.shown, tuple(self.loaded.values())
        return ToolsRequest(tuple(t.function for t in shown), loaded=tuple(t.function for t in loaded),
                            schema_fields=tuple(t.field for t in (*shown, *loaded)))

    def _declared(self, name: str) -> _Tool | None:
        return self.catalog.deferred.get(name) or next((t for t in self.catalog.shown if t.name == name), None)

    def message(self, message: Any, index: int) -> list[dict[str, Any]]:
        field = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise InvalidParameter(f"{field}.role", "must be 'user', 'assistant' or 'system'")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            return [{"role": role, "content": content}]
        if not isinstance(content, list):
            raise InvalidParameter(f"{field}.content", f"must be a string or a list of blocks, got {json_type(content)}")
        if role == "system":
            return [{"role": "system", "content": "".join(_text_block(b, f"{field}.content[{j}]")
                                                          for j, b in enumerate(content))}]
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            where = f"{field}.content[{j}]"
            kind = type_field(block, where)
            if kind == "text":
                texts.append(_text_block(block, where))
            elif kind == "tool_use" and role == "assistant":
                calls.append(self._tool_use(block, where))
            elif kind == "tool_result" and role == "user":
                results.append(self._tool_result(block, where))
            elif kind == "thinking" and role == "assistant":
                if not isinstance(block.get("thinking"), str):
                    raise InvalidParameter(f"{where}.thinking", "must be a string")
                reasoning.append(block["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by another server: nothing a local model can read
            elif kind in ("server_tool_use", "tool_search_tool_result") and role == "assistant" \
                    and self.catalog.search_names:
                self._tool_search_block(block, kind, where)  # its tools are shown up front: nothing to render
            elif kind in _UNSUPPORTED_BLOCKS:
                raise InvalidParameter(f"{where}.type", f"'{kind}' blocks are not supported: this server's model "
                                                        "reads text only; send the content as text")
            else:
                raise InvalidParameter(f"{where}.type", f"a {role} message cannot hold a block of type {kind!r:.40}")
        if role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if reasoning:
                out["reasoning_content"] = "".join(reasoning)
            if calls:
                out["tool_calls"] = calls
            return [out]
        # Tool results answer the previous assistant turn, so they come before this turn's text.
        return [*results, *([{"role": "user", "content": "".join(texts)}] if texts or not results else [])]

    def _tool_use(self, block: dict[str, Any], where: str) -> dict[str, Any]:
        if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
            raise InvalidParameter(where, "a tool_use block needs a string id and name")
        if not isinstance(block.get("input", {}), dict):
            raise InvalidParameter(f"{where}.input", "must be an object")
        if self._declared(block["name"]) is None:
            raise InvalidParameter(f"{where}.name", f"names the tool {block['name']!r:.60}, which is not in tools; "
                                                    "declare every tool the conversation uses")
        self.call_ids.add(block["id"])
        return {"id": block["id"], "type": "function",
                "function": {"name": block["name"], "arguments": block.get("input", {})}}

    def _tool_result(self, block: dict[str, Any], where: str) -> dict[str, Any]:
        if not isinstance(block.get("tool_use_id"), str):
            raise InvalidParameter(f"{where}.tool_use_id", "must be a string")
        if block["tool_use_id"] not in self.call_ids:
            raise InvalidParameter(f"{where}.tool_use_id", f"{block['tool_use_id']!r:.60} answers no tool_use "
                                                           "block of an earlier assistant message")
        content = block.get("content", "")
        if isinstance(content, list):
            content = self._result_parts(content, f"{where}.content")
        elif not isinstance(content, str):
            raise InvalidParameter(f"{where}.content", "must be a string or a list of text blocks")
        if block.get("is_error"):
            content = f"Error: {content}"
        return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}

    def _result_parts(self, content: list[Any], where: str) -> str:
        """A tool result's blocks as text: text as sent; each run of tool_reference blocks a `<functions>` block."""
        parts: list[tuple[bool, str]] = []
        for k, block in enumerate(content):
            at = f"{where}[{k}]"
            if type_field(block, at) == "tool_reference":
                parts.append((True, self._reference(block, at)))
            else:
                parts.append((False, _result_part(block, at)))
        segments = []
        for is_reference, run in groupby(parts, key=lambda part: part[0]):
            texts = [text for _, text in run]
            segments.append("<functions>\n" + "\n".join(texts) + "\n</functions>" if is_reference else "".join(texts))
        return "\n".join(segments)

    def _reference(self, block: dict[str, Any], where: str) -> str:
        name = block.get("tool_name")
        if not isinstance(name, str):
            raise InvalidParameter(f"{where}.tool_name", "must be a string naming a tool in tools")
        tool = self._declared(name)
        if tool is None:
            raise InvalidParameter(f"{where}.tool_name", f"names the tool {name!r:.60}, which is not in tools; "
                                                         "declare it (defer_loading: true keeps it unloaded)")
        if name in self.catalog.deferred:
            self.loaded.setdefault(name, tool)
        return tool.reference_text()

    def _tool_search_block(self, block: dict[str, Any], kind: str, where: str) -> None:
        """A server tool search's call or result, replayed from a conversation begun elsewhere: checked, dropped."""
        if kind == "server_tool_use":
            if block.get("name") not in self.catalog.search_names or not isinstance(block.get("id"), str):
                raise InvalidParameter(where, "a server_tool_use block needs a string id and the name of a tool "
                                              "search tool in tools")
            self.search_ids.add(block["id"])
        elif block.get("tool_use_id") not in self.search_ids:
            raise InvalidParameter(f"{where}.tool_use_id", "answers no server_tool_use block before it")


def _result_part(block: Any, where: str) -> str:
    kind = type_field(block, where)
    if kind in _UNSUPPORTED_BLOCKS:
        raise InvalidParameter(f"{where}.type", f"'{kind}' blocks in a tool_result are not supported: this "
                                                "server's model reads text only; return the result as text")
    if kind != "text":
        raise InvalidParameter(f"{where}.type", f"a tool_result cannot hold a block of type {kind!r:.40}: "
                                                "text and tool_reference blocks can")
    return _text_block(block, where)


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise InvalidParameter(where, 'must be a text block {"type": "text", "text": ...}')
    return block["text"]


def _thinking(body: Mapping[str, Any]) -> dict[str, Any]:
    """Anthropic's `thinking` switch → the templates' `enable_thinking` (a budget is not enforced)."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}
    kind = type_field(thinking, "thinking")
    if kind not in _THINKING:
        raise InvalidParameter("thinking.type", "must be 'enabled', 'adaptive' or 'disabled'")
    if kind == "enabled" and not is_int(thinking.get("budget_tokens")):
        raise InvalidParameter("thinking.budget_tokens", "is required with type 'enabled': an integer")
    given = body.get("chat_template_kwargs") or {}
    if not isinstance(given, dict):
        raise InvalidParameter("chat_template_kwargs", f"must be an object, got {json_type(given)}")
    return {"chat_template_kwargs": {"enable_thinking": _THINKING[kind], **given}}


def _output_format(config: Any) -> Constraint | None:
    """`output_config.format` (a JSON schema) → the constraint that enforces it; `effort` is not ours to use."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise InvalidParameter("output_config", f"must be an object, got {json_type(config)}")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise InvalidParameter("output_config.format", 'must be {"type": "json_schema", "schema": {...}}')
    return Constraint("json_schema", json.dumps(fmt["schema"]))


def _tools(body: Mapping[str, Any]) -> _Catalog:
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise InvalidParameter("tools", f"must be a list of tools, got {json_type(raw)}")
    declared: list[tuple[_Tool, bool]] = []
    search: set[str] = set()
    for i, tool in enumerate(raw or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidParameter(where, f"must be a tool object, got {json_type(tool)}")
        defer = tool.get("defer_loading", False)
        if not isinstance(defer, bool):
            raise InvalidParameter(f"{where}.defer_loading", f"must be a boolean, got {json_type(defer)}")
        kind = tool.get("type")
        if kind in TOOL_SEARCH_TYPES:
            if defer:
                raise InvalidParameter(f"{where}.defer_loading", "a tool search tool cannot be deferred")
            if not isinstance(tool.get("name"), str):
                raise InvalidParameter(f"{where}.name", "must be a string")
            search.add(tool["name"])
            continue
        if kind not in (None, "custom"):
            raise InvalidParameter(f"{where}.type", f"{kind!r:.60} tools are not supported: custom tools (name, "
                                                    "description, input_schema) and the tool search tools "
                                                    f"({', '.join(sorted(TOOL_SEARCH_TYPES))}) are")
        if not isinstance(tool.get("input_schema"), dict):
            raise InvalidParameter(f"{where}.input_schema", "must be a JSON Schema object")
        checked_function(tool.get("name"), tool["input_schema"], field=where)
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        declared.append((_Tool({"type": "function", "function": function}, f"{where}.input_schema"), defer))
    if declared and not search and all(defer for _, defer in declared):
        raise InvalidParameter("tools", "every tool has defer_loading: true; at least one must be loaded up front")
    # No search step here (module docstring): with a server tool search declared, deferred tools are shown.
    shown = tuple(t for t, defer in declared if not defer or search)
    deferred = {} if search else {t.name: t for t, defer in declared if defer}
    return _Catalog(shown, deferred, frozenset(search))


def _tool_choice(choice: Any, request: ToolsRequest) -> ToolsRequest:
    """`tool_choice` on the tools a call may name now (the shown ones and those loaded so far)."""
    tools = (*request.tools, *request.loaded)
    if choice is None:
        return attrs.evolve(request, choice="auto" if tools else "none")
    kind = type_field(choice, "tool_choice")
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use"))
    names = [t["function"]["name"] for t in tools]
    if kind == "tool":
        if choice.get("name") not in names:
            raise InvalidParameter("tool_choice.name", f"must name one of the tools ({', '.join(names) or 'none'})")
        return attrs.evolve(request, choice="function", function_name=choice["name"], parallel=False)
    mapping = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in mapping:
        raise InvalidParameter("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
    if kind == "any" and not tools:
        raise InvalidParameter("tool_choice", "'any' needs at least one tool in tools")
    return attrs.evolve(request, choice=mapping[kind], parallel=parallel)
