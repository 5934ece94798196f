"""`mlx-trio serve`: flags map onto the configs, and startup failures exit non-zero with a clear message."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.http.http_helpers import tiny_engine_config

from mlx_trio.cli import build_parser, configs_from_args, main


@pytest.fixture(autouse=True)
def restore_switch_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def _configs(*argv: str):  # type: ignore[no-untyped-def]
    return configs_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults_match_mlx_lm_server() -> None:
    """No flags: loopback:8080, 512 max tokens, greedy, no key, no CORS origins, batch auto, derived KV budget."""
    engine, server = _configs()
    assert (server.host, server.port, server.api_key, server.allowed_origins, server.batch) == (
        "127.0.0.1", 8080, None, (), None)
    assert engine.batch is None and engine.kv_budget_bytes is None
    assert engine.model is None and engine.defaults.max_tokens == 512 and engine.defaults.temperature == 0.0
    assert engine.prefill_step_size == 2048 and engine.max_queue == 256
    assert server.shutdown_timeout_s == 30.0 and server.enable_fault_injection is False


def test_flags_reach_the_configs() -> None:
    """Every flag lands in the engine or the server config under its meaning."""
    engine, server = _configs(
        "--model", "m", "--host", "0.0.0.0", "--port", "0", "--max-tokens", "7", "--temp", "0.5", "--top-p", "0.9",
        "--top-k", "5", "--min-p", "0.1", "--chat-template-args", '{"enable_thinking": false}', "--api-key", "k",
        "--allowed-origins", "http://a.example,http://b.example", "http://c.example/", "--prefill-step-size", "64",
        "--max-queue", "3", "--cache-dir", "/tmp/x", "--max-body-bytes", "1000",
        "--shutdown-timeout", "2.5", "--enable-fault-injection", "--max-restarts", "9", "--restart-period", "4",
        "--step-watchdog", "12.5", "--write-timeout", "7", "--body-timeout", "8", "--prompt-cache-io-timeout", "2",
    )
    assert (engine.max_restarts, engine.restart_period_s, engine.step_watchdog_s) == (9, 4.0, 12.5)
    assert (server.write_timeout_s, server.body_timeout_s, engine.prompt_cache_io_timeout_s) == (7.0, 8.0, 2.0)
    assert engine.model == "m" and engine.prefill_step_size == 64 and engine.max_queue == 3
    assert engine.cache_dir == Path("/tmp/x")
    d = engine.defaults
    assert (d.max_tokens, d.temperature, d.top_p, d.top_k, d.min_p) == (7, 0.5, 0.9, 5, 0.1)
    assert (server.host, server.port, server.api_key, server.max_body_bytes) == ("0.0.0.0", 0, "k", 1000)
    assert server.allowed_origins == ("http://a.example", "http://b.example", "http://c.example")
    assert dict(server.chat_template_args) == {"enable_thinking": False}
    assert server.shutdown_timeout_s == 2.5 and server.enable_fault_injection is True


def test_lora_flags_reach_the_configs() -> None:
    """--lora-modules NAME=PATH (vLLM's form), --max-loras, --max-lora-rank, --enable-lora-admin."""
    engine, server = _configs("--lora-modules", "a=/x/a", "b=/y/b=c", "--max-loras", "3", "--max-lora-rank", "32",
                              "--enable-lora-admin")
    assert engine.lora_modules == (("a", "/x/a"), ("b", "/y/b=c"))
    assert (engine.max_loras, engine.max_lora_rank, engine.enable_lora_admin) == (3, 32, True)
    assert server.enable_lora_admin is True and engine.serves_adapters
    engine, server = _configs()
    assert engine.lora_modules == () and not engine.serves_adapters and not server.enable_lora_admin
    assert (engine.max_loras, engine.max_lora_rank) == (8, 16)


@pytest.mark.parametrize("flag", ["--batch", "--decode-concurrency"])
def test_batch_and_its_alias_are_accepted(flag: str) -> None:
    """--batch N and mlx_lm.server's --decode-concurrency N both set the configured batch (and the engine's)."""
    engine, server = _configs(flag, "3")
    assert server.batch == 3
    assert getattr(engine, "batch", 3) == 3


def test_batch_defaults_to_auto() -> None:
    """No --batch, or --batch auto: the engine chooses the cap from the KV budget (None in the configs)."""
    for argv in ((), ("--batch", "auto")):
        engine, server = _configs(*argv)
        assert engine.batch is None and server.batch is None


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--chat-template-args", "[1]"], ["--chat-template-args", "{x"],
                                  ["--port", "http"], ["--max-tokens", "-1"], ["--shutdown-timeout", "-1"],
                                  ["--shutdown-timeout", "nan"], ["--restart-period", "0"],
                                  ["--step-watchdog", "inf"], ["--write-timeout", "-1"], ["--max-restarts", "-1"], ["--chat-template-args", '{"chat_template": "x"}'],
                                  ["--body-timeout", "0"], ["--prompt-cache-io-timeout", "-1"],
                                  ["--lora-modules", "nopath"], ["--batch", "many"], ["--lora-modules", "=p"], ["--max-loras", "0"],
                                  ["--chat-template-args", '{"tokenize": false}']])
def test_bad_flags_exit_2(argv: list[str]) -> None:
    """Invalid flag values are usage errors (exit status 2) before anything starts."""
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    assert info.value.code == 2


def test_a_model_that_fails_to_load_exits_1_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model directory mlx-lm cannot load: exit status 1 and a one-line reason on stderr."""
    assert main(["serve", "--model", str(tmp_path), "--port", "0", "--log-level", "ERROR"]) == 1
    err = capsys.readouterr().err
    assert "the model failed to load" in err and str(tmp_path) in err


def test_a_port_in_use_exits_1_saying_so(capsys: pytest.CaptureFixture[str]) -> None:
    """A port another process listens on: exit status 1 and "cannot listen"."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        model = tiny_engine_config().model
        assert main(["serve", "--model", str(model), "--port", str(port), "--log-level", "ERROR"]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_serve_prints_the_url_and_stops_cleanly_on_sigterm() -> None:
    """The real entry point: prints the URL once ready, serves /health, exits 0 on SIGTERM."""
    runner = "import sys; from mlx_trio.cli import main; sys.exit(main())"
    model = str(tiny_engine_config().model)
    proc = subprocess.Popen(
        [sys.executable, "-c", runner, "serve", "--model", model, "--port", "0",
         "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
    )
    watchdog = threading.Timer(60, proc.kill)  # a server that never gets ready must not hang the suite
    watchdog.start()
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert "serving" in line, line + proc.stderr.read()
        url = line.split(" at ")[1].split("/v1")[0]
        assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bare_mlx_trio_prints_help_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """No command: the help (both commands, examples, the status page), not a usage error."""
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "serve" in out and "bench" in out and "/status" in out


def test_version_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`mlx-trio --version` prints the version pyproject.toml declares."""
    import tomllib  # noqa: PLC0415

    declared = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mlx-trio {declared}"


def test_help_states_the_defaults_the_code_uses(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--cache-dir names where default_cache_dir() looks; bench --help is for users, not a module docstring."""
    monkeypatch.setenv("COLUMNS", "500")  # argparse wraps at hyphens too
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    serve_help = capsys.readouterr().out
    assert "$MLX_TRIO_CACHE_DIR, else $XDG_CACHE_HOME/mlx-trio/models, else ~/.cache/mlx-trio/models" in serve_help
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    bench_help = capsys.readouterr().out
    assert "examples:" in bench_help and "run(args)" not in bench_help and "orchestrate" not in bench_help


def test_a_busy_port_fails_before_anything_heavy_loads(tmp_path: Path) -> None:
    """The port is checked right after the flags: no model load, not even MLX or quart imported."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        runner = ("import sys; from mlx_trio.cli import main; rc = main(sys.argv[1:]); "
                  "print(sorted(m for m in ('mlx', 'mlx_lm', 'quart', 'mlx_trio.api') if m in sys.modules)); "
                  "sys.exit(rc)")
        # A model directory that does not exist: reaching the load would say so instead.
        proc = subprocess.run([sys.executable, "-c", runner, "serve", "--model", str(tmp_path / "absent"),
                               "--port", str(port)], capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).parents[2])
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "failed to load" not in proc.stderr
    assert proc.stdout.strip() == "[]"
