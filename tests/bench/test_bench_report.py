"""bench/report.py, bench/model_info.py, bench/servers.py helpers: table, JSON, plot fallback, EOS ids, URLs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mlx_trio.bench import report
from mlx_trio.bench.client import RequestResult
from mlx_trio.bench.metrics import summarize
from mlx_trio.bench.model_info import eos_logit_bias, eos_token_ids
from mlx_trio.bench.runner import RunRecord
from mlx_trio.bench.servers import free_port, normalize_url, server_argv


def _record(server: str, concurrency: int, tokens: int, ttft_s: float, *, fail: bool = False) -> RunRecord:
    ok = RequestResult(session_id="s", turn=0, tag="task", ok=True, start_s=0.0, end_s=1.0, ttft_s=ttft_s,
                       completion_tokens=tokens, prompt_tokens=50, cached_tokens=20, text="secret")
    bad = RequestResult(session_id="t", turn=0, tag="task", ok=False, start_s=0.0, end_s=0.5, error="ConnectError: x")
    return RunRecord(server, concurrency, 0, (ok, bad) if fail else (ok,), server_died=fail)


def _summaries(records: list[RunRecord]):  # type: ignore[no-untyped-def]
    return [summarize(r.server, r.concurrency, [r.results], server_died=r.server_died) for r in records]


def test_table_has_a_row_per_server_and_a_ratio_row_per_concurrency() -> None:
    """Rows per (concurrency, server) in order, then 'first/other' with ratios (tok/s 2.00×, TTFT 0.50×)."""
    records = [_record("ours", 1, 20, 0.1), _record("mlx_lm", 1, 10, 0.2), _record("ours", 4, 20, 0.1),
               _record("mlx_lm", 4, 10, 0.2, fail=True)]
    table = report.markdown_table(_summaries(records))
    lines = table.splitlines()
    assert lines[0].startswith("| conc | server | ok/failed | TTFT p50 ms")
    assert [line.split(" | ")[1] for line in lines[2:]] == [
        "ours", "mlx_lm", "**ours/mlx_lm**", "ours", "mlx_lm (died)", "**ours/mlx_lm**"]
    ratio_row = lines[4].split(" | ")
    assert ratio_row[3] == "0.50×" and ratio_row[-2] == "2.00×"
    assert "1/1" in lines[6]
    notes = report.notes(_summaries(records))
    assert "mlx_lm c=4: 1 × ConnectError: x" in notes and "died" in notes


def test_json_document_holds_summaries_ratios_and_requests_without_text(tmp_path: Path) -> None:
    """The JSON is loadable, has a ratio per concurrency, and leaves out generated text."""
    records = [_record("ours", 1, 20, 0.1), _record("mlx_lm", 1, 10, 0.2)]
    path = tmp_path / "out.json"
    report.write_json(path, report.document(_summaries(records), records, {"command": "x"}))
    doc = json.loads(path.read_text())
    assert doc["meta"] == {"command": "x"} and len(doc["summaries"]) == 2
    assert doc["ratios"][0]["output_tok_s"] == pytest.approx(2.0)
    assert "secret" not in path.read_text() and doc["runs"][0]["requests"][0]["completion_tokens"] == 20


def test_plot_is_skipped_with_a_message_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """No matplotlib: write_plot returns False, says how to install it, and writes nothing."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert report.write_plot(tmp_path / "p.png", _summaries([_record("a", 1, 1, 0.1)]), "t") is False
    assert "matplotlib" in capsys.readouterr().err and not (tmp_path / "p.png").exists()


def test_eos_ids_are_collected_from_every_model_file(tmp_path: Path) -> None:
    """generation_config, config and the tokenizer's eos_token (by tokenizer.json id) all count."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<end>"}}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 11, "content": "<end>"}]}))
    assert eos_token_ids(tmp_path) == (7, 9, 11)
    assert eos_logit_bias((7, 9)) == {7: -100.0, 9: -100.0}
    assert eos_token_ids(tmp_path / "missing") == () and eos_token_ids("org/hub-id") == ()


def test_urls_ports_and_server_commands() -> None:
    """/v1 and trailing slashes are dropped from URLs; servers listen on loopback with the same model."""
    assert normalize_url("http://h:1/v1/") == "http://h:1" and normalize_url("http://h:1") == "http://h:1"
    assert 0 < free_port() < 65536
    ours = server_argv("ours", "/m", 1234, python="py", extra_args=["--batch", "4"])
    theirs = server_argv("mlx_lm", "/m", 1235, python="py")
    assert ours[:4] == ["py", "-m", "mlx_trio.cli", "serve"] and ours[-2:] == ["--batch", "4"]
    assert theirs[:3] == ["py", "-m", "mlx_lm.server"]
    nocache = server_argv("ours-nocache", "/m", 1236, python="py")
    assert nocache[:6] == ["py", "-m", "mlx_trio.cli", "serve", "--prompt-cache-bytes", "0"]
    for argv, port in ((ours, "1234"), (theirs, "1235")):
        assert argv[argv.index("--model") + 1] == "/m" and argv[argv.index("--port") + 1] == port
        assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_ours_cudnn_and_ours_mlx_attention_are_ours_with_their_attention_backend_named(tmp_path: Path) -> None:
    import argparse

    from mlx_trio.bench.orchestrate import _servers

    args = argparse.Namespace(targets=[("serve", "ours-cudnn"), ("serve", "ours"), ("serve", "ours-mlx-attention")],
                              ours_args=["--batch", "8"], mlx_lm_args=[], python="py", startup_timeout_s=1.0)
    cudnn, ours, mlx_attention = _servers(args, "/m", tmp_path)
    assert cudnn.env == {"MLX_TRIO_ATTENTION_BACKEND": "cudnn-prefill"} and ours.env == {}
    assert mlx_attention.env == {"MLX_TRIO_ATTENTION_BACKEND": "mlx"}
    assert server_argv("ours-mlx-attention", "/m", 1, python="py", extra_args=mlx_attention.extra_args) == \
        server_argv("ours", "/m", 1, python="py", extra_args=ours.extra_args)
    assert server_argv("ours-cudnn", "/m", 1, python="py", extra_args=cudnn.extra_args) == \
        server_argv("ours", "/m", 1, python="py", extra_args=ours.extra_args)


def test_no_ratio_against_a_latency_that_rounds_to_zero() -> None:
    """Chunks that arrived together give a 0 ms ITL; the ratio row shows '–' there instead of a huge number."""
    def rec(server: str, gap_s: float) -> RunRecord:
        r = RequestResult(session_id="s", turn=0, tag="task", ok=True, start_s=0.0, end_s=1.0, ttft_s=0.1,
                          itl_s=(gap_s, gap_s), completion_tokens=3)
        return RunRecord(server, 1, 0, (r,))
    table = report.markdown_table(_summaries([rec("a", 0.01), rec("b", 0.0001)]))
    ratio_row = table.splitlines()[-1].split(" | ")
    itl_p50_column = 6
    assert ratio_row[itl_p50_column] == "–" and ratio_row[3] == "1.00×"


def test_every_stack_the_flags_offer_has_a_command_and_a_ready_path() -> None:
    """cli.STACKS and servers.py agree, so `--serve X` can always be started."""
    from mlx_trio.bench.cli import STACKS
    from mlx_trio.bench.servers import READY_PATHS

    assert set(STACKS) == set(READY_PATHS)
    for stack in STACKS:
        assert "--model" in server_argv(stack, "/m", 1)


def test_a_saved_document_reports_the_same_table_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """records_from_document inverts document(); `--from-json` prints the same table without starting anything."""
    from mlx_trio.bench.__main__ import main

    records = [_record("ours", 1, 20, 0.1), _record("mlx_lm", 1, 10, 0.2, fail=True)]
    summaries = _summaries(records)
    meta = {"workload": "agents", "workload_line": "w", "machine_line": "m", "command": "c"}
    path = tmp_path / "doc.json"
    report.write_json(path, report.document(summaries, records, meta))
    again = report.records_from_document(json.loads(path.read_text()))
    assert _summaries(again) == summaries
    assert main(["--from-json", str(path)]) == 0
    assert report.markdown_table(summaries) in capsys.readouterr().out
