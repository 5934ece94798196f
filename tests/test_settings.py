"""The flag table (mlx_trio/settings.py): one declaration per flag feeds argparse, the configs, the docs and /health."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest
from tests.http.http_helpers import serve_fake

from mlx_trio import settings
from mlx_trio.cli import build_parser, configs_from_args
from mlx_trio.config import EngineConfig
from mlx_trio.http.server.config import ServerConfig

DOCS = Path(__file__).parents[1] / "docs"


def _flags_section() -> str:
    text = (DOCS / "http.md").read_text()
    return text[text.index("## Flags"):text.index("## Differences from mlx_lm.server")]


def test_docs_http_lists_every_flag_of_the_table_and_no_other() -> None:
    """docs/http.md's flag list names each flag (and alias) of the table; every flag it names exists."""
    section = _flags_section()
    names = {name for s in settings.TABLE for name in (s.flag, *s.aliases)}
    missing = sorted(n for n in names if not re.search(re.escape(n) + r"(?![\w-])", section))
    assert missing == []
    listed = set(re.findall(r"^\| `(--[a-z][a-z-]*)`", section, re.M))
    listed |= set(re.findall(r"`, `(--[a-z][a-z-]*)`", section))
    assert sorted(listed - names) == []


def test_each_setting_is_declared_once_and_feeds_real_fields() -> None:
    """No flag twice; every feed names a field of EngineConfig, ServerConfig or the sampling defaults."""
    flags = [name for s in settings.TABLE for name in (s.flag, *s.aliases)]
    assert len(flags) == len(set(flags))
    fields = {"engine": attrs.fields_dict(EngineConfig), "server": attrs.fields_dict(ServerConfig),
              "sampling": {"max_tokens", "temperature", "top_p", "top_k", "min_p"}}
    for setting in settings.TABLE:
        for target in setting.feeds:
            config, _, field = target.partition(".")
            assert field in fields[config], f"{setting.flag} feeds {target}"


def test_no_flags_give_the_configs_own_defaults_where_the_table_sets_none() -> None:
    """A flag without its own default starts where a library caller's config does."""
    engine, server = configs_from_args(build_parser().parse_args(["serve"]))
    assert attrs.evolve(engine, defaults=EngineConfig().defaults) == EngineConfig(compile_decode=None)
    assert (server.api_server_count, server.batch) == (1, engine.batch)  # the table's own two


def test_the_report_says_where_each_value_came_from() -> None:
    """Given on the command line: flag; from its variable: environment (a key masked); else default."""
    args = build_parser().parse_args(["serve", "--port", "8080", "--batch", "3"])
    resolved = settings.resolve(args, environ={"MLX_TRIO_API_KEY": "sekret"})
    report = {name: (value, source) for name, value, source in resolved.report()}
    assert report["--port"] == (8080, "flag")  # the default's value, but given
    assert report["--batch"] == (3, "flag")
    assert report["--api-key"] == ("***", "environment")
    assert report["--max-tokens"] == (512, "default")
    assert report["--tensor-parallel"] == (1, "default") and args.tensor_parallel == 1
    engine, server = settings.configs(resolved)
    assert server.api_key == "sekret" and engine.batch == server.batch == 3
    assert len(server.settings) == len(settings.TABLE)


def test_a_flag_wins_over_its_environment_variable(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--cache-dir", str(tmp_path)])
    resolved = settings.resolve(args, environ={"MLX_TRIO_CACHE_DIR": "/elsewhere"})
    assert (resolved.values["cache_dir"], resolved.sources["cache_dir"]) == (tmp_path, "flag")
    resolved = settings.resolve(build_parser().parse_args(["serve"]), environ={"MLX_TRIO_CACHE_DIR": "/elsewhere"})
    assert (resolved.values["cache_dir"], resolved.sources["cache_dir"]) == (Path("/elsewhere"), "environment")


def test_help_shows_every_flag_with_its_default(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --help` names each flag, grouped, with its default unless it is a plain on/off switch."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for setting in settings.TABLE:
        shown = setting.shown_default if setting.shown_default is not None else str(setting.default_value)
        entry = text[text.index(f"  {setting.flag}"):]
        entry = entry[:entry.index("\n  --", 1) if "\n  --" in entry[1:] else len(entry)]
        if setting.switch and setting.shown_default is None:
            assert "(default: " not in entry, setting.flag
        else:
            assert f"(default: {shown})" in entry, setting.flag
    assert "\nscale-out:\n" in text and "\nprompt cache:\n" in text


async def test_health_lists_the_settings_only_when_asked() -> None:
    """/health stays small for probes; ?settings=1 adds each flag's value and source."""
    _, server = configs_from_args(build_parser().parse_args(["serve", "--max-queue", "7"]))
    async with serve_fake(settings=server.settings) as (_, client):
        assert (await client.get("/health")).json() == {"status": "ok"}
        body = (await client.get("/health", params={"settings": "1"})).json()
    assert body["status"] == "ok"
    by_name = {entry["name"]: entry for entry in body["settings"]}
    assert by_name["--max-queue"] == {"name": "--max-queue", "value": 7, "source": "flag"}
    assert by_name["--host"] == {"name": "--host", "value": "127.0.0.1", "source": "default"}


def test_the_report_reaches_a_front_process_with_the_rest_of_the_config() -> None:
    """A front rebuilds its ServerConfig from the pickled fields (processes/front_pool.py): the report comes along."""
    import pickle

    _, server = configs_from_args(build_parser().parse_args(["serve", "--api-key", "k", "--allowed-origins", "*"]))
    fields = {**attrs.asdict(server, recurse=False), "chat_template_args": {}}  # as front_pool sends them
    fields = pickle.loads(pickle.dumps(fields))
    again = ServerConfig(**fields)
    assert again.settings == server.settings and ("--api-key", "***", "flag") in again.settings
