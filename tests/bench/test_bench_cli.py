"""bench/cli.py: flags, the `mlx-trio bench` hook, and the rule that the bench never imports mlx."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_trio.bench.__main__ import main
from mlx_trio.bench.cli import add_arguments, add_parser, run, workload_params

BENCH = Path(__file__).resolve().parents[2] / "mlx_trio" / "bench"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_targets_keep_their_order_and_flags_parse() -> None:
    """--serve and --url interleave in one list (the first is A); lists and server flags are parsed."""
    args = _parse("--serve", "mlx_lm", "--url", "x=http://h:1/v1", "--serve", "ours", "--concurrency", "1,8",
                  "--ours-args", "--batch 32", "--eos-id", "2", "--eos-id", "0")
    assert args.targets == [("serve", "mlx_lm"), ("url", "x=http://h:1/v1"), ("serve", "ours")]
    assert args.concurrency == [1, 8] and args.ours_args == ["--batch", "32"] and args.eos_id == [2, 0]
    assert args.workload == "agents" and args.rounds == 2


def test_agents_default_to_poisson_arrivals_and_inf_means_all_at_once() -> None:
    """Agents arrive at 4/s unless --rate says otherwise; --rate inf and other workloads start all at once."""
    assert workload_params(_parse()).rate_per_s == 4.0
    assert workload_params(_parse("--rate", "inf")).rate_per_s is None
    assert workload_params(_parse("--workload", "uniform")).rate_per_s is None


def test_options_flag_reaches_the_workload_params_and_defaults_to_greedy() -> None:
    assert workload_params(_parse()).options == "greedy"
    assert workload_params(_parse("--workload", "uniform", "--options", "mixed")).options == "mixed"


@pytest.mark.parametrize("argv", [["--serve", "vllm"], ["--concurrency", "0"], ["--concurrency", ","],
                                  ["--workload", "chat"], ["--requests", "0"],
                                  ["--options", "beam"]])
def test_bad_flags_are_usage_errors(argv: list[str]) -> None:
    """Unknown stacks, workloads and non-positive counts exit with status 2 before anything starts."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_no_target_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --url or --serve there is nothing to measure: status 2 and a message."""
    assert run(_parse()) == 2
    assert "--url or --serve" in capsys.readouterr().err


def test_add_parser_hooks_bench_into_a_subcommand_parser() -> None:
    """What mlx_trio/cli.py calls: `bench` parses under a `command` subparser and carries --log-level."""
    parser = argparse.ArgumentParser(prog="mlx-trio")
    commands = parser.add_subparsers(dest="command", required=True)
    add_parser(commands)
    args = parser.parse_args(["bench", "--url", "http://h:1", "--workload", "uniform"])
    assert args.command == "bench" and args.targets == [("url", "http://h:1")] and args.log_level == "WARNING"


def test_bench_sources_never_import_mlx() -> None:
    """The bench talks HTTP only, so it works against any server: no module of it imports mlx or mlx_lm."""
    files = sorted(BENCH.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.split(".")[0] in {"mlx", "mlx_lm"}], path.name


def test_importing_the_bench_loads_no_mlx_and_its_flags_load_no_http_client() -> None:
    """The bench leaves mlx out of sys.modules; its flags alone (what `mlx-trio serve` imports) leave httpx out."""
    code = ("import sys, mlx_trio.bench.cli; assert 'httpx' not in sys.modules, 'httpx imported'; "
            "import mlx_trio.bench.orchestrate, mlx_trio.bench.__main__; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')], 'mlx imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
