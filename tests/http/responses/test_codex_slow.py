"""Codex CLI (`codex exec`, npm `@openai/codex`) against the server: the slow tier, skipped without the binary.

Install it with `npm install --prefix /tmp/npm @openai/codex` (or put
`codex` on PATH, or set MLX_TRIO_CODEX to the binary). The scripted engine
(QWEN3_TOOLS markers) answers the first turn with a call of Codex's
`exec_command` tool, so the whole agent loop runs over the wire: Codex
runs the command, sends its output back as a `function_call_output`, and
prints the second answer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import trio
from tests.http.fakes import ScriptedEngine
from tests.http.http_helpers import serve_fake

from mlx_trio.output_format import OutputFormat

pytestmark = pytest.mark.slow


def codex_binary() -> str | None:
    for candidate in (os.environ.get("MLX_TRIO_CODEX"), shutil.which("codex"), "/tmp/npm/node_modules/.bin/codex"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def codex_config(home: Path, url: str) -> None:
    """A Codex home whose provider is this server over the Responses wire API."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "mlxtrio"\n\n[model_providers.mlxtrio]\nname = "mlx-trio"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\n')


async def run_codex(binary: str, home: Path, workdir: Path, prompt: str) -> trio.CompletedProcess[bytes]:
    env = {**os.environ, "CODEX_HOME": str(home)}
    return await trio.run_process([binary, "exec", "--skip-git-repo-check", prompt], cwd=workdir, env=env,
                                  stdin=b"", capture_stdout=True, capture_stderr=True, check=False)


async def test_codex_exec_runs_a_tool_loop(tools_format: OutputFormat, tmp_path: Path) -> None:
    binary = codex_binary()
    if binary is None:
        pytest.skip("codex is not installed (npm install --prefix /tmp/npm @openai/codex)")
    call = {"name": "exec_command", "arguments": {"cmd": "echo mlx-trio-was-here"}}
    engine = ScriptedEngine(tools_format, [f"<tool_call>\n{json.dumps(call)}\n</tool_call>", "All done."])
    async with serve_fake(engine) as (server, _):
        codex_config(tmp_path / "home", server.url)
        (tmp_path / "work").mkdir()
        result = await run_codex(binary, tmp_path / "home", tmp_path / "work", "run echo")
    output = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0, output
    assert "All done." in result.stdout.decode()
    assert len(engine.prepared) == 2, output
    first_prompt, first_kwargs = engine.prepared[0]
    assert first_prompt[0]["role"] == "system" and first_prompt[-1] == {"role": "user", "content": "run echo"}
    assert "exec_command" in {t["function"]["name"] for t in first_kwargs["tools"]}
    history: list[dict[str, Any]] = engine.prepared[1][0]
    assert history[-2]["tool_calls"][0]["function"] == {"name": "exec_command", "arguments": call["arguments"]}
    assert history[-1]["role"] == "tool" and "mlx-trio-was-here" in history[-1]["content"]


def test_codex_exec_on_the_real_engine(tmp_path: Path) -> None:
    """A real tiny tools model with Codex's ~25k-token prompt: one turn that ends (EOS is biased), exit 0."""
    binary = codex_binary()
    if binary is None:
        pytest.skip("codex is not installed (npm install --prefix /tmp/npm @openai/codex)")
    import subprocess  # noqa: PLC0415

    from mlx_lm.tokenizer_utils import load  # noqa: PLC0415
    from tests.http.http_helpers import ServerThread  # noqa: PLC0415

    from mlx_trio.config import EngineConfig  # noqa: PLC0415
    from mlx_trio.http import ServerConfig  # noqa: PLC0415
    from mlx_trio.params import SamplingParams  # noqa: PLC0415
    from mlx_trio.testing.tiny_models import TinyModelSpec, tiny_model  # noqa: PLC0415

    # Codex's instructions and tools are far longer than the tiny models' usual 4k context.
    path = tiny_model(TinyModelSpec("qwen3", tools=True, max_position_embeddings=65536))
    eos = load(path).convert_tokens_to_ids("<|im_end|>")
    config = EngineConfig(model=str(path), defaults=SamplingParams(max_tokens=16, logit_bias=((eos, 100.0),)))
    with ServerThread(config, ServerConfig(port=0)) as server:
        codex_config(tmp_path / "home", server.url)
        (tmp_path / "work").mkdir()
        result = subprocess.run([binary, "exec", "--skip-git-repo-check", "say hi"], cwd=tmp_path / "work",
                                env={**os.environ, "CODEX_HOME": str(tmp_path / "home")}, stdin=subprocess.DEVNULL,
                                capture_output=True, timeout=600, check=False)
    output = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0, output
    assert "tokens used" in output and "ERROR" not in output, output
