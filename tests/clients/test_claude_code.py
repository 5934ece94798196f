"""Claude Code (`claude -p`) completes a turn against `mlx-trio serve` (issues #17, #18).

The model always answers REPLY, so the JSON result must be exactly that text.
Claude Code's default model name decides the request's shape (today's default
sends `thinking: {"type": "adaptive"}`, `output_config.effort`,
`max_tokens: 64000` and, with its tools, a mid-conversation `role: "system"`
message); the server must take whatever name it is sent.

A turn that uses a tool needs a model that writes a call, which the scripted
model cannot (its chain needs distinct tokens, and a call's JSON repeats
them): there the scripted engine of tests/http (`ScriptedEngine`) plays the
model behind the real HTTP stack, answering the first request with a call of
Claude Code's `Bash` tool, in the native (Hermes `<tool_call>`) or the generic
format, and the request that carries the tool's output with text.

Claude Code 2.1.332 defers some of its tools (`defer_loading: true`) and
loads them with its `ToolSearch` tool, whose result is a `tool_reference`
block: the tool-search turn checks that loop (issue #44).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from tests.clients.clients import client_marks, claude_argv, claude_env, find_cli, run_cli
from tests.clients.conftest import REPLY, Served
from tests.clients.turns import ConversationEngine, native_call
from tests.http.fakes import ScriptedEngine
from tests.http.http_helpers import serve_fake

from mlx_trio.output_format import GENERIC, OutputFormat, generic_calls_text

CLAUDE = find_cli("claude")

pytestmark = client_marks("claude")


def test_claude_code_without_tools_prints_the_reply(served: Served, tmp_path: Path) -> None:
    """No tools (`--tools ""`): one request, and the result is the model's text, not an error."""
    _assert_one_clean_turn(served, tmp_path, "--tools", "")


def test_claude_code_with_its_default_tools_prints_the_reply(served: Served, tmp_path: Path) -> None:
    """The default tool set (25 tools, a `system` message after the first user turn)."""
    _assert_one_clean_turn(served, tmp_path)


# What the tool prints: it reaches the second request only if Claude Code ran the command.
MARKER = "mlx-trio-was-here"
BASH_CALL = {"name": "Bash", "arguments": {"command": f"echo {MARKER}", "description": "Print a marker"}}
FINAL = "All done."


async def test_claude_code_runs_a_native_tool_call(tools_format: OutputFormat, tmp_path: Path) -> None:
    """The model's own format (QWEN3_TOOLS: `<tool_call>` JSON) → a `tool_use` block Claude Code runs."""
    await _assert_tool_turn(tools_format, f"<tool_call>\n{json.dumps(BASH_CALL)}\n</tool_call>", tmp_path)


async def test_claude_code_runs_a_generic_tool_call(tmp_path: Path) -> None:
    """A model without a tool template (the generic format's call object) → the same `tool_use` block."""
    await _assert_tool_turn(GENERIC, generic_calls_text([BASH_CALL]), tmp_path)


async def _assert_tool_turn(fmt: OutputFormat, call_text: str, tmp_path: Path) -> None:
    """Two requests: the call, then (after Claude Code ran it) the text; the result is that text."""
    assert CLAUDE is not None
    engine = ScriptedEngine(fmt, [call_text, FINAL])
    # `echo` is read-only: Claude Code runs it without asking (the JSON result lists any permission_denials).
    argv = claude_argv(CLAUDE, "Run echo.")
    async with serve_fake(engine) as (server, _):
        done = await trio.to_thread.run_sync(run_cli, argv, claude_env(server.url, tmp_path / "home"),
                                             tmp_path / "work")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    result = json.loads(done.stdout)
    assert (result["is_error"], result["stop_reason"], result["num_turns"], result["result"]) == (
        False, "end_turn", 2, FINAL)
    assert result["permission_denials"] == []
    assert len(engine.prepared) == 2
    first_tools = {tool["function"]["name"] for tool in engine.prepared[0][1]["tools"]}
    assert "Bash" in first_tools
    history: list[dict[str, Any]] = engine.prepared[1][0]
    call = history[-2]["tool_calls"][0]
    assert call["function"] == {"name": "Bash", "arguments": BASH_CALL["arguments"]}
    assert history[-1] == {"role": "tool", "tool_call_id": call["id"], "content": MARKER}


async def test_claude_code_loads_a_deferred_tool_through_tool_search(tools_format: OutputFormat,
                                                                    tmp_path: Path) -> None:
    """ToolSearch `select:WebFetch`: Claude Code answers with a tool_reference, which the server renders as
    WebFetch's definition in the tool message; the tools shown to the model stay those of the first request."""
    assert CLAUDE is not None
    engine = ConversationEngine(tools_format, native_call("ToolSearch", {"query": "select:WebFetch"}), FINAL)
    async with serve_fake(engine) as (server, _):
        done = await trio.to_thread.run_sync(run_cli, claude_argv(CLAUDE, "Find the web fetch tool."),
                                             claude_env(server.url, tmp_path / "home"), tmp_path / "work")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    result = json.loads(done.stdout)
    assert (result["is_error"], result["num_turns"], result["result"]) == (False, 2, FINAL)
    assert engine.answers == [engine.call, engine.final]
    first_tools, second_tools = (kwargs["tools"] for _, kwargs in engine.prepared)
    shown = {tool["function"]["name"] for tool in first_tools}
    assert "ToolSearch" in shown and "WebFetch" not in shown and "DeferredToolPlaceholder" not in shown
    assert second_tools == first_tools
    [loaded] = engine.tool_results()
    assert loaded["content"].startswith("<functions>\n<function>{") and '"name": "WebFetch"' in loaded["content"]


def _assert_one_clean_turn(served: Served, tmp_path: Path, *extra: str) -> None:
    assert CLAUDE is not None
    done = run_cli(claude_argv(CLAUDE, "Say pong.", *extra), claude_env(served.url, tmp_path / "home"),
                   tmp_path / "work")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    result = json.loads(done.stdout)
    assert result["type"] == "result" and result["subtype"] == "success"
    assert result["is_error"] is False, result["result"]
    assert result["stop_reason"] == "end_turn"
    assert result["num_turns"] == 1
    assert result["result"] == REPLY
