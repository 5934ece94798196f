"""Codex CLI (`codex exec`) prints the model's answer from `mlx-trio serve` (issues #17, #44).

Codex speaks only the Responses API (`POST /v1/responses`, streamed). The model
always answers REPLY, so the last message Codex writes must be exactly that text.
The tool turn runs on the scripted engine (`turns.py`): a call of Codex's
`exec_command`, then, once its output came back, the final text.
"""

from __future__ import annotations

from pathlib import Path

import trio
from tests.clients.clients import client_marks, codex_argv, codex_env, find_cli, run_cli
from tests.clients.conftest import REPLY, Served
from tests.clients.turns import ConversationEngine, native_call
from tests.http.http_helpers import serve_fake

from mlx_trio.output_format import OutputFormat

CODEX = find_cli("codex")

pytestmark = client_marks("codex")


def test_codex_exec_prints_the_reply(served: Served, tmp_path: Path) -> None:
    """One `codex exec` turn: exit 0, the reply on stdout and in `--output-last-message`."""
    assert CODEX is not None
    last = tmp_path / "last-message.txt"
    done = run_cli(codex_argv(CODEX, "Say pong.", last), codex_env(served.url, tmp_path / "home"),
                   tmp_path / "work")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert last.read_text(encoding="utf-8").strip() == REPLY
    assert REPLY in done.stdout


MARKER = "mlx-trio-was-here"
FINAL = "All done."


async def test_codex_exec_runs_a_tool_call(tools_format: OutputFormat, tmp_path: Path) -> None:
    """`exec_command` runs `echo` (read-only sandbox, no approval asked), its output comes back, then the text."""
    assert CODEX is not None
    engine = ConversationEngine(tools_format, native_call("exec_command", {"cmd": f"echo {MARKER}"}), FINAL)
    last = tmp_path / "last-message.txt"
    async with serve_fake(engine) as (server, _):
        done = await trio.to_thread.run_sync(run_cli, codex_argv(CODEX, "Run echo.", last),
                                             codex_env(server.url, tmp_path / "home", model="tiny"), tmp_path / "work")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert last.read_text(encoding="utf-8").strip() == FINAL
    assert engine.answers == [engine.call, engine.final]
    assert "exec_command" in {t["function"]["name"] for t in engine.prepared[0][1]["tools"]}
    [result] = engine.tool_results()
    assert MARKER in result["content"]
