"""Codex CLI (`codex exec`) prints the model's answer from `mlx-trio serve` (issue #17).

Codex speaks only the Responses API (`POST /v1/responses`, streamed). The model
always answers REPLY, so the last message Codex writes must be exactly that text.
"""

from __future__ import annotations

from pathlib import Path

from tests.clients.clients import client_marks, codex_argv, codex_env, find_cli, run_cli
from tests.clients.conftest import REPLY, Served

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
