"""`tool_choice` → a grammar `Constraint` on the model's tool-call syntax, or none.

The grammar engine (`SamplingParams.constraint`) then only lets the model
write what the choice allows, with arguments valid against each tool's
schema:

    format       auto                        required / named function
    generic      plain text, or a call object  a call object
    json_tools   (no grammar)                `<tool_call>` JSON, once or more
    others       (no grammar)                400: use "auto"

The generic format (models whose template has no tool format) is ours, so
its grammar is always on: a call the model starts is always one that
parses. For a native format we only write grammars for syntaxes we know;
the others are refused with a 400 for "required" and named functions,
never silently downgraded to "auto". Each tool's parameters travel with the
grammar labelled by their field (`Constraint.schemas`), so a schema the
grammar engine cannot enforce is a 400 naming that tool.

A forced call starts at once: nothing may come before it. On a prompt that
leaves the model inside a think span (templates that open `<think>` in the
generation prompt), `close_reasoning` makes the grammar write the think end
first, so that the call is read as a call, not as reasoning
(`completion/serve.py` decides, from the prepared prompt).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mlx_trio.errors import InvalidParameter
from mlx_trio.output_format import GENERIC_CALLS_KEY, GENERIC_TOOLS
from mlx_trio.params import Constraint

# mlx_lm.tool_parsers module names whose call syntax `_hermes_grammar` writes.
GRAMMAR_FORMATS = frozenset({"json_tools"})
# Compact JSON, as for response_format: flexible whitespace lets a weak model pad forever.
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def tool_choice_constraint(tools: Sequence[Mapping[str, Any]], tool_choice: str | None, parser_kind: str | None, *,
                           function_name: str | None = None, parallel: bool = True,
                           schema_fields: Sequence[str] = (), close_reasoning: str | None = None) -> Constraint | None:
    """The constraint that enforces `tool_choice`, or None when nothing needs enforcing.

    `tool_choice` is "auto", "none", "required" or "function" (then
    `function_name` names the one tool to call). `parser_kind` is the model's
    `OutputFormat.tool_parser_kind`. `parallel` False allows one call only
    (a named function always gets exactly one). `schema_fields` labels each
    tool's schema for errors (default `tools[i].function.parameters`).
    `close_reasoning` (a lark item: `lark_marker`'s) goes before a forced call.
    Raises `InvalidParameter` (field `tool_choice`) when the model's format
    cannot be enforced.
    """
    if tool_choice in (None, "none") or (tool_choice == "auto" and parser_kind != GENERIC_TOOLS):
        return None
    if parser_kind != GENERIC_TOOLS and parser_kind not in GRAMMAR_FORMATS:
        raise InvalidParameter(
            "tool_choice",
            f"'{tool_choice}' cannot be enforced for this model's tool-call format ({parser_kind or 'none'}); "
            "use tool_choice 'auto'",
        )
    functions = [(i, dict(tool["function"])) for i, tool in enumerate(tools)]
    if tool_choice == "function":
        functions = [(i, f) for i, f in functions if f["name"] == function_name]
        parallel = False
    if not functions:
        raise InvalidParameter("tool_choice", f"names function {function_name!r}, which is not in tools")
    schemas = tuple((schema_fields[i] if schema_fields else f"tools[{i}].function.parameters",
                     json.dumps(_parameters(f), ensure_ascii=False)) for i, f in functions)
    calls = [f for _, f in functions]
    if parser_kind == GENERIC_TOOLS:
        source = _generic_grammar(calls, text=tool_choice == "auto", parallel=parallel)
    else:
        source = _hermes_grammar(calls, parallel=parallel)
    if close_reasoning is not None and tool_choice != "auto":
        source = source.replace("\nstart: ", f"\nstart: {close_reasoning} ", 1)
    return Constraint("lark", source, schemas=schemas)


def lark_marker(text: str, token_ids: Sequence[int]) -> str:
    """A marker as a lark item: its special token when it is one (`<[id]>`), else its text."""
    return f"<[{token_ids[0]}]>" if len(token_ids) == 1 else json.dumps(text)


def _generic_grammar(functions: Sequence[Mapping[str, Any]], *, text: bool, parallel: bool) -> str:
    """Plain text (`text`) or `{"tool_calls":[{"name":...,"arguments":{...}},...]}`, and nothing after it.

    Text may not start with `{` (after blanks): that byte starts a call, so
    the reader in the output router knows from the first one which it is.
    """
    items = [_call_schema(f) for f in functions]
    calls: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                             "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    schema = {"type": "object", "properties": {GENERIC_CALLS_KEY: calls}, "required": [GENERIC_CALLS_KEY],
              "additionalProperties": False, **_COMPACT}
    lines = ["%llguidance {}", "start: (TEXT | calls)?" if text else "start: calls",
             f"calls: %json {json.dumps(schema, ensure_ascii=False)}"]
    if text:
        lines.append(r"TEXT: /\s*[^{\s](?s:.)*/")
    return "\n".join(lines) + "\n"


def _hermes_grammar(functions: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
    """`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, once or newline-separated.

    The markers are the tokenizer's special tokens (`<tool_call>` in lark is a
    token, not text), so the model cannot spell them out of pieces.
    """
    names = [f"fn_{i}" for i in range(len(functions))]
    lines = [
        "%llguidance {}",
        'start: call ("\\n" call)*' if parallel else "start: call",
        f'call: <tool_call> "\\n" ({" | ".join(names)}) "\\n" </tool_call>',
    ]
    for name, function in zip(names, functions):
        lines.append(f"{name}: %json {json.dumps({**_call_schema(function), **_COMPACT}, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": _parameters(function)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _parameters(function: Mapping[str, Any]) -> Mapping[str, Any]:
    return function.get("parameters") or {"type": "object"}
