"""`tool_choice` "required" or a named function → a grammar `Constraint` on the model's tool-call syntax.

The grammar engine (`SamplingParams.constraint`) then only lets the model
write tool calls, so "required" really yields at least one call and a named
function really calls that function with arguments matching its schema.
Only formats whose syntax we can write as a grammar are supported; for the
others "required" and named functions are refused with a 400, never
silently downgraded to "auto".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mlx_trio.errors import InvalidParameter
from mlx_trio.params import Constraint

# mlx_lm.tool_parsers module names whose call syntax `_hermes_grammar` writes.
GRAMMAR_FORMATS = frozenset({"json_tools"})


def tool_choice_constraint(tools: Sequence[Mapping[str, Any]], tool_choice: str | None, parser_kind: str | None, *,
                           function_name: str | None = None, parallel: bool = True) -> Constraint | None:
    """The constraint that enforces `tool_choice`, or None when nothing needs enforcing.

    `tool_choice` is "auto", "none", "required" or "function" (then
    `function_name` names the one tool to call). `parser_kind` is the model's
    `OutputFormat.tool_parser_kind`. `parallel` False allows one call only
    (a named function always gets exactly one). Raises `InvalidParameter`
    (field `tool_choice`) when the model's format cannot be enforced.
    """
    if tool_choice in (None, "auto", "none"):
        return None
    if parser_kind not in GRAMMAR_FORMATS:
        raise InvalidParameter(
            "tool_choice",
            f"'{tool_choice}' needs a grammar for this model's tool-call format ({parser_kind or 'none'}), "
            f"and only {', '.join(sorted(GRAMMAR_FORMATS))} (Hermes/Qwen <tool_call> JSON) is supported; "
            "use tool_choice 'auto'",
        )
    functions = [dict(tool["function"]) for tool in tools]
    if tool_choice == "function":
        functions = [f for f in functions if f["name"] == function_name]
        parallel = False
    if not functions:
        raise InvalidParameter("tool_choice", f"names function {function_name!r}, which is not in tools")
    return Constraint("lark", _hermes_grammar(functions, parallel=parallel))


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
        lines.append(f"{name}: %json {json.dumps(_call_schema(function), ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        # Compact JSON, as for response_format: flexible whitespace lets a weak model pad forever.
        "x-guidance": {"whitespace_flexible": False},
    }
