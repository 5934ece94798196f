"""Messages bodies shaped like Claude Code's, written from the Anthropic API reference (not from a capture).

What docs/harnesses.md says Claude Code sends, field by field: `system` as
text blocks led by the per-request `x-anthropic-billing-header` block, the
rest with `cache_control`; a user turn of two text blocks; a `role:
"system"` message after it (mid-conversation system messages); adaptive
thinking; `max_tokens` 64000; `output_config.effort`; `context_management`;
`metadata.user_id`; and 20+ custom tools. `with_history` adds a finished
tool turn: an assistant message with a signed `thinking` block, a
`redacted_thinking` block and a `tool_use`, then the `tool_result` (as a
block list, `is_error`).
"""

from __future__ import annotations

import copy
from typing import Any

BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27",
         "mid-conversation-system-2026-04-07"]
SYSTEM_PROMPT = "You are an agent for software tasks. Use the tools to read and change files. Be brief."
MID_SYSTEM = "Available agent types: general-purpose. Available skills: none."
TOOL_NAMES = ("Agent", "Bash", "Edit", "Glob", "Grep", "Read", "Write", "WebFetch", "WebSearch", "TodoWrite",
              "NotebookEdit", "BashOutput", "KillShell", "ExitPlanMode", "Skill", "SlashCommand", "TaskCreate",
              "TaskGet", "TaskList", "TaskUpdate", "CronCreate", "CronDelete", "CronList", "Workflow")


def tool(name: str) -> dict[str, Any]:
    """A custom tool: name, description, an object input_schema (one required string)."""
    return {"name": name, "description": f"{name} tool.",
            "input_schema": {"type": "object", "properties": {"arg": {"type": "string", "description": "input"}},
                             "required": ["arg"], "additionalProperties": False,
                             "$schema": "http://json-schema.org/draft-07/schema#"}}


def claude_code_body(prompt: str = "Say pong.", *, session: str = "s1", version: str = "2.1.197.495",
                     with_history: bool = False) -> dict[str, Any]:
    """One Claude-Code-shaped request body (without `model`/`stream`, which callers add)."""
    ephemeral = {"type": "ephemeral"}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Today's date is 2026-05-01.</system-reminder>"},
            {"type": "text", "text": prompt, "cache_control": ephemeral}]},
        {"role": "system", "content": MID_SYSTEM},
    ]
    if with_history:
        messages += [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "The user wants a file listing.", "signature": "c2lnbmF0dXJl"},
                {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"arg": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "is_error": True,
                 "content": [{"type": "text", "text": "ls: permission denied"}]},
                {"type": "text", "text": "Try again."}]},
        ]
    return {
        "max_tokens": 64000,
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint=sdk-cli; "
                                     f"cch={session};"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": ephemeral},
            {"type": "text", "text": SYSTEM_PROMPT, "cache_control": ephemeral}],
        "messages": messages,
        "tools": [tool(name) for name in TOOL_NAMES],
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": f'{{"device_id": "d1", "session_id": "{session}"}}'},
    }


def without(body: dict[str, Any], *fields: str) -> dict[str, Any]:
    out = copy.deepcopy(body)
    for field in fields:
        out.pop(field, None)
    return out
