"""Run the real agent CLIs (Claude Code, Codex, OpenCode) non-interactively against a loopback server.

Each client gets a fresh HOME (and CODEX_HOME) under the test's tmp_path, so no
user login, settings or session history leaks in or out, and an environment
that keeps every byte on loopback: the documented switches turn the clients'
own background traffic off, and every proxy variable points at a closed
loopback port, so whatever a new client version adds fails at once instead of
leaving the machine. docs/harnesses.md records what each client sends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# `make clients` installs here; MLX_TRIO_CLIENTS points elsewhere (an npm --prefix).
DEFAULT_PREFIX = REPO / ".clients"
# Nothing listens on the discard port: a proxied connection is refused at once.
DEAD_PROXY = "http://127.0.0.1:9"
# A slow tier on a loaded CPU prefills agent prompts of 15-60k tokens; the clients' own
# retries are off, so a timeout only ever means the server hung.
RUN_TIMEOUT_S = 600.0


def find_cli(name: str) -> Path | None:
    """The `name` binary from $MLX_TRIO_CLIENTS, then `make clients`' prefix, then PATH; None if absent."""
    prefixes = [Path(os.environ["MLX_TRIO_CLIENTS"])] if os.environ.get("MLX_TRIO_CLIENTS") else []
    for prefix in [*prefixes, DEFAULT_PREFIX]:
        candidate = prefix / "node_modules" / ".bin" / name
        if candidate.is_file():
            return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def client_marks(name: str) -> list[pytest.MarkDecorator]:
    """A client test's marks: the slow tier, skipped with the reason when the `name` CLI is missing."""
    return [pytest.mark.slow,
            pytest.mark.skipif(find_cli(name) is None, reason=f"the `{name}` CLI is not installed (`make clients`)")]


def loopback_env(home: Path) -> dict[str, str]:
    """A minimal environment with its own HOME whose proxies all lead to a closed loopback port."""
    home.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TERM": "dumb", "NO_COLOR": "1"}
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = DEAD_PROXY
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def claude_env(base_url: str, home: Path) -> dict[str, str]:
    """Claude Code against `base_url` with a dummy key, no login, no telemetry, no updater."""
    return {
        **loopback_env(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "sk-ant-dummy",  # with a key set, -p never asks for a login
        # Bootstrap, metrics, event logging, MCP registry, fast-mode and update checks:
        # without this, one `claude -p` tries api.anthropic.com seven times.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }


def claude_argv(binary: Path, prompt: str, *extra: str) -> list[str]:
    """One non-interactive turn whose final result comes back as one JSON object on stdout."""
    return [str(binary), "-p", prompt, "--output-format", "json", "--no-session-persistence", *extra]


CODEX_CONFIG = """\
model = "{model}"
model_provider = "mlx-trio"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false
web_search = "disabled"

[analytics]
enabled = false

[feedback]
enabled = false

# The curated-plugin sync clones github.com/openai/plugins; apps and remote plugins call chatgpt.com.
[features]
plugins = false
remote_plugin = false
apps = false

[model_providers.mlx-trio]
name = "mlx-trio"
base_url = "{base_url}/v1"
wire_api = "responses"
# No env_key: Codex sends no Authorization header. Retries off: a 404 fails in a second, not a minute.
request_max_retries = 0
stream_max_retries = 0
"""


def codex_env(base_url: str, home: Path, model: str = "mlx-trio") -> dict[str, str]:
    """Codex with a CODEX_HOME whose config.toml defines the loopback provider and nothing else."""
    env = loopback_env(home)
    codex_home = home / "codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(model=model, base_url=base_url), encoding="utf-8")
    return {**env, "CODEX_HOME": str(codex_home)}


def codex_argv(binary: Path, prompt: str, last_message: Path) -> list[str]:
    """`codex exec` for one prompt outside a git repository, nothing persisted, the answer in a file."""
    return [str(binary), "exec", "--skip-git-repo-check", "--ephemeral", "--color", "never",
            "-o", str(last_message), prompt]


# OpenCode's config (OPENCODE_CONFIG): one OpenAI-compatible provider, no sharing, no updates. Its
# `@ai-sdk/openai-compatible` provider ships inside the binary: nothing is installed at run time.
def opencode_config(base_url: str, model: str = "tiny") -> dict[str, object]:
    """An opencode.json whose only provider is the server's Chat Completions API, `model` its default."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "model": f"mlx-trio/{model}",
        "provider": {"mlx-trio": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "mlx-trio",
            "options": {"baseURL": f"{base_url}/v1", "apiKey": "unused"},
            "models": {model: {"name": model, "tool_call": True}},
        }},
    }


def opencode_env(base_url: str, home: Path, model: str = "tiny") -> dict[str, str]:
    """OpenCode with its config under `home` and its background traffic off (models.dev, updates, LSP downloads)."""
    env = loopback_env(home)
    config = home / "opencode.json"
    config.write_text(json.dumps(opencode_config(base_url, model), indent=2), encoding="utf-8")
    return {
        **env,
        "OPENCODE_CONFIG": str(config),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",  # the model catalogue from models.dev
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",  # default plugins are npm packages, installed on first use
        "OPENCODE_DISABLE_SHARE": "1",
    }


def opencode_argv(binary: Path, prompt: str) -> list[str]:
    """`opencode run` for one prompt; `--format json` prints each part (text, tool use) as a JSON line."""
    return [str(binary), "run", "--format", "json", prompt]


def run_cli(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a client to completion; stdin is closed (`codex exec` would otherwise wait on it)."""
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, check=False)
