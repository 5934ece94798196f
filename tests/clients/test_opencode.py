"""OpenCode (`opencode run`, npm `opencode-ai`) against the server over Chat Completions (issue #44).

OpenCode reaches the server through an OpenAI-compatible provider in its
`opencode.json` (`clients.opencode_config`). One `opencode run` sends the main
request (its tools, streamed) and, beside it, a title request without tools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from tests.clients.clients import client_marks, find_cli, opencode_argv, opencode_env, run_cli
from tests.clients.conftest import REPLY, Served
from tests.clients.turns import ConversationEngine, native_call
from tests.http.http_helpers import serve_fake

from mlx_trio.output_format import OutputFormat

OPENCODE = find_cli("opencode")

pytestmark = client_marks("opencode")

MARKER = "mlx-trio-was-here"
BASH_CALL = {"command": f"echo {MARKER}", "description": "Print a marker"}
FINAL = "All done."


def _parts(stdout: str) -> list[dict[str, Any]]:
    """`--format json`'s events, one JSON object a line."""
    return [json.loads(line) for line in stdout.splitlines() if line.strip().startswith("{")]


def test_opencode_run_prints_the_reply(served: Served, tmp_path: Path) -> None:
    """The scripted tiny model behind `mlx-trio serve`: the only text part is its reply."""
    assert OPENCODE is not None
    done = run_cli(opencode_argv(OPENCODE, "Say pong."), opencode_env(served.url, tmp_path / "home"), tmp_path / "work")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    texts = [e["part"]["text"] for e in _parts(done.stdout) if e["type"] == "text"]
    assert texts == [REPLY]


async def test_opencode_runs_a_tool_call(tools_format: OutputFormat, tmp_path: Path) -> None:
    """A call of OpenCode's `bash` tool: OpenCode runs it, sends the output back, prints the final text."""
    assert OPENCODE is not None
    engine = ConversationEngine(tools_format, native_call("bash", BASH_CALL), FINAL)
    async with serve_fake(engine) as (server, _):
        done = await trio.to_thread.run_sync(run_cli, opencode_argv(OPENCODE, "Run echo."),
                                             opencode_env(server.url, tmp_path / "home"), tmp_path / "work")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    parts = _parts(done.stdout)
    [tool] = [e["part"] for e in parts if e["type"] == "tool_use"]
    assert (tool["tool"], tool["state"]["status"], tool["state"]["input"]) == ("bash", "completed", BASH_CALL)
    assert [e["part"]["text"] for e in parts if e["type"] == "text"] == [FINAL]
    # The main turn's two requests (call, final), and the title request beside them.
    assert sorted(engine.answers) == sorted([engine.call, engine.final, engine.side])
    [result] = engine.tool_results()
    assert result["content"].strip() == MARKER
    main = [kwargs for _, kwargs in engine.prepared if kwargs["tools"]]
    assert "bash" in {t["function"]["name"] for t in main[0]["tools"]}
