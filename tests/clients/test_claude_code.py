"""Claude Code (`claude -p`) completes a turn against `mlx-trio serve` (issues #17, #18).

The model always answers REPLY, so the JSON result must be exactly that text.
Claude Code's default model name decides the request's shape (today's default
sends `thinking: {"type": "adaptive"}`, `output_config.effort`,
`max_tokens: 64000` and, with its tools, a mid-conversation `role: "system"`
message); the server must take whatever name it is sent. A turn that uses a
tool needs a model that writes a call; the scripted model only says REPLY
(its chain needs distinct tokens, and a call's JSON repeats them), so that
turn waits for the generic tool format's grammar (issue #18, point 3).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.clients.clients import client_marks, claude_argv, claude_env, find_cli, run_cli
from tests.clients.conftest import REPLY, Served

CLAUDE = find_cli("claude")

pytestmark = client_marks("claude")


def test_claude_code_without_tools_prints_the_reply(served: Served, tmp_path: Path) -> None:
    """No tools (`--tools ""`): one request, and the result is the model's text, not an error."""
    _assert_one_clean_turn(served, tmp_path, "--tools", "")


def test_claude_code_with_its_default_tools_prints_the_reply(served: Served, tmp_path: Path) -> None:
    """The default tool set (25 tools, a `system` message after the first user turn)."""
    _assert_one_clean_turn(served, tmp_path)


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
