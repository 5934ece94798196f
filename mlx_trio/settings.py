"""The flag table of `mlx-trio serve`: each setting declared once.

A `Setting` names its flag (mlx_lm.server's or vLLM's name where one means
the same), its type, help and help group, and the config field(s) it feeds
(`engine.<field>` of `EngineConfig`, `server.<field>` of `ServerConfig`,
`sampling.<field>` of the request defaults; none: the command line itself).
Its default is the config field's own default unless the table gives one
(the CLI starts where a library caller would not, e.g. one front process).

From this one table: the argparse options (`add_to`), the configs
(`configs`), and the effective-settings report `/health?settings=1` serves
(`resolve`: each value and where it came from). docs/http.md's flag list is
written by hand and checked against it (tests/test_settings.py).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from mlx_trio.argtypes import non_negative_float, non_negative_int, positive_float, positive_int, size
from mlx_trio.config import KV_LAYOUTS, EngineConfig, parse_batch
from mlx_trio.engine.model.chat import check_template_args
from mlx_trio.errors import InvalidParameter
from mlx_trio.http.server.config import ServerConfig
from mlx_trio.params import SamplingParams

# The default is the fed config field's own.
FROM_CONFIG: Any = object()
# Where a value came from, as /health reports it.
DEFAULT, FLAG, ENVIRONMENT = "default", "flag", "environment"
_CONFIGS: dict[str, type] = {"engine": EngineConfig, "server": ServerConfig, "sampling": SamplingParams}


@attrs.frozen
class Setting:
    """One flag: its option strings, what it feeds, how it parses, how `--help` shows it."""

    flag: str
    feeds: tuple[str, ...]
    group: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = FROM_CONFIG
    # The "(default: ...)" text where the value alone would not say it (None derived, an env fallback).
    shown_default: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    nargs: str | None = None
    metavar: str | None = None
    switch: bool = False  # a store_true flag
    env: str | None = None  # read when the flag is not given
    secret: bool = False  # reported as "***"
    # The flag's value -> the fed field's value, where they differ in form.
    to_config: Callable[[Any], Any] | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def default_value(self) -> Any:
        if self.default is not FROM_CONFIG:
            return self.default
        config, _, field = self.feeds[0].partition(".")
        return attrs.fields_dict(_CONFIGS[config])[field].default


def _lora_module(value: str) -> tuple[str, str]:
    """`NAME=PATH` of --lora-modules (vLLM's form)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def _user_path(text: str) -> Path:
    """A directory that may start with `~` (as $MLX_TRIO_CACHE_DIR was always read)."""
    return Path(text).expanduser()


def _template_args(text: str) -> dict[str, Any]:
    """A JSON object of template variables the engine lets a request set (else every chat would be a 400)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    try:
        check_template_args(value)
    except InvalidParameter as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


MODEL, HTTP, BATCH, PREFILL, SAMPLING, CACHE, SPEC, LORA, FAULTS, SCALE = (
    "model and logging", "HTTP", "batching and KV", "prefill", "request defaults", "prompt cache", "speculative decoding",
    "adapters", "supervision and faults", "scale-out")

TABLE: tuple[Setting, ...] = (
    # model
    Setting("--model", ("engine.model",), MODEL, shown_default="the bundled SmolLM2-135M-Instruct",
            help="mlx-lm model directory or hub id"),
    Setting("--cache-dir", ("engine.cache_dir",), MODEL, type=_user_path, env="MLX_TRIO_CACHE_DIR",
            shown_default="$MLX_TRIO_CACHE_DIR, else $XDG_CACHE_HOME/mlx-trio/models, else ~/.cache/mlx-trio/models",
            help="where the default model is converted to"),
    Setting("--log-level", (), MODEL, type=str.upper, default="INFO",
            choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), help="log verbosity"),
    # HTTP
    Setting("--host", ("server.host",), HTTP, help="address to listen on"),
    Setting("--port", ("server.port",), HTTP, type=int, help="port to listen on; 0 picks a free one"),
    Setting("--api-server-count", ("server.api_server_count",), HTTP, type=non_negative_int, default=1,
            help="front processes that serve HTTP, each over a local socket to the engine's own process (vLLM's "
                 "flag): their HTTP work does not share the engine's GIL; 0 serves HTTP in the engine's process "
                 "(refused with --tensor-parallel/--pipeline-parallel: ranks are served by fronts). "
                 "The fronts share one /v1/responses store (in the engine's process); with more than 1, each keeps "
                 "its own HTTP metrics"),
    Setting("--api-key", ("server.api_key",), HTTP, env="MLX_TRIO_API_KEY", secret=True, to_config=lambda k: k or None,
            shown_default="$MLX_TRIO_API_KEY; unset: no key", help="require 'Authorization: Bearer KEY'"),
    Setting("--allowed-origins", ("server.allowed_origins",), HTTP, nargs="*", default=(),
            shown_default="same-origin only",
            help="browser origins allowed by CORS, space- or comma-separated; '*' for any"),
    Setting("--max-body-bytes", ("server.max_body_bytes",), HTTP, type=positive_int,
            help="largest request body accepted; larger gets 413"),
    Setting("--write-timeout", ("server.write_timeout_s",), HTTP, type=positive_float,
            help="seconds a response may wait for a client that does not read before the stream is ended and "
                 "its request freed"),
    Setting("--body-timeout", ("server.body_timeout_s",), HTTP, type=positive_float,
            help="seconds after a request's start by which its whole body must be in; a client that stalls or "
                 "trickles it gets 408"),
    Setting("--shutdown-timeout", ("server.shutdown_timeout_s",), HTTP, type=non_negative_float,
            help="on SIGTERM/SIGINT, seconds running requests get to finish before they are cut"),
    Setting("--responses-store-bytes", ("server.responses_store_bytes",), HTTP, type=size, shown_default="64MiB",
            help="RAM for stored /v1/responses results (previous_response_id, GET); 0 stores nothing"),
    Setting("--strict-max-tokens", ("server.strict_max_tokens",), HTTP, switch=True,
            shown_default="lower it to that room",
            help="refuse (400) a max_tokens over the room the prompt leaves in the context"),
    Setting("--keep-billing-header", ("server.keep_billing_header",), HTTP, switch=True,
            shown_default="drop it, so the prompt cache's prefix survives across requests",
            help="keep Claude Code's x-anthropic-billing-header system block in the prompt"),
    Setting("--chat-template-args", ("server.chat_template_args",), HTTP, type=_template_args, default={},
            shown_default="none",
            help='JSON object of chat template variables, e.g. \'{"enable_thinking": false}\''),
    # batching and KV
    Setting("--batch", ("engine.batch", "server.batch"), BATCH, aliases=("--decode-concurrency",),
            type=parse_batch, shown_default="auto, from the KV budget and the model (docs/design.md §1.2)",
            help="requests decoded together (the concurrency cap), or 'auto'; 1 decodes one request at a time "
                 "with no prompt cache, so its tokens depend on no other request"),
    Setting("--max-queue", ("engine.max_queue",), BATCH, type=positive_int,
            help="requests waiting for the decoder before new ones get 503 + Retry-After"),
    Setting("--kv-budget", ("engine.kv_budget_bytes",), BATCH, type=positive_int,
            shown_default="device memory minus weights and headroom",
            help="bytes of KV cache admission may reserve"),
    Setting("--kv-bits", ("engine.kv_bits",), BATCH, type=int, choices=(4, 8), shown_default="bf16",
            help="store full-attention KV quantized to this many bits once a request holds --quantized-kv-start "
                 "tokens: more rows and context in the same --kv-budget"),
    Setting("--kv-group-size", ("engine.kv_group_size",), BATCH, type=int, choices=(32, 64, 128),
            help="values per quantization group with --kv-bits"),
    Setting("--quantized-kv-start", ("engine.quantized_kv_start",), BATCH, type=non_negative_int,
            help="with --kv-bits, tokens a request holds before its KV is quantized; 0: after the first prefill "
                 "chunk, as mlx-lm"),
    Setting("--kv-layout", ("engine.kv_layout",), BATCH, choices=KV_LAYOUTS,
            help="where full-attention KV lives: 'paged' in fixed-size blocks of one pool the size of --kv-budget, "
                 "allocated at start (a row holds its own tokens' blocks, no padding to the longest row; requests "
                 "with a common prompt prefix share its cached blocks, which replace the prompt cache; llama-family "
                 "models without sliding windows; an error at start with --kv-bits, --draft-model, "
                 "--prompt-cache-dir or --batch 1); 'padded' each batch padded to its longest row; 'auto' paged "
                 "where the model, these flags and the backend's paged decode kernel allow it, else padded (the log "
                 "and /v1/status say which and why)"),
    Setting("--no-compile", ("engine.compile_decode",), BATCH, switch=True, default=False,
            to_config=lambda off: False if off else None,
            shown_default="a lone row's steps compiled on the CPU where the model's caches allow, never on a GPU "
                          "or while adapters are served",
            help="run every decode step's forward uncompiled, as before compiled steps"),
    # prefill
    Setting("--prefill-step-size", ("engine.prefill_step_size",), PREFILL, type=positive_int,
            help="most prompt tokens per prefill chunk; a lone request with nothing else running uses exactly "
                 "this (mlx-lm's chunks)"),
    Setting("--prefill-chunk-ms", ("engine.prefill_chunk_ms",), PREFILL, type=positive_float,
            help="while other requests decode or wait, size each prefill chunk from its measured cost so it "
                 "takes about this long: the longest stall a prefill adds to the running streams"),
    Setting("--prefill-grid", ("engine.prefill_grid",), PREFILL, type=non_negative_int,
            shown_default="256 on a GPU, off on the CPU",
            help="prefill chunks end on multiples of this many tokens, so attention meets a few shapes again "
                 "instead of a new one per chunk (MLX's CUDA backend pays for each new shape); 0 turns it off"),
    Setting("--prompt-concurrency", ("engine.prompt_concurrency",), PREFILL, type=positive_int,
            help="prompts prefilled at once, their chunks interleaved shortest first, so a short prompt never "
                 "waits for a long one"),
    Setting("--cudnn-warm-tokens", ("engine.cudnn_warm_tokens",), PREFILL, type=non_negative_int,
            help="with MLX_TRIO_ATTENTION_BACKEND=cudnn-prefill on CUDA: build cuDNN's plans for the prefill chunk "
                 "shapes of contexts up to this many tokens while idle (never before the first request: a chunk at a "
                 "new shape meanwhile builds its own), so later requests don't pay for planning them; 0 turns it off"),
    # request defaults
    Setting("--max-tokens", ("sampling.max_tokens",), SAMPLING, type=positive_int,
            help="default max_tokens of a request"),
    Setting("--temp", ("sampling.temperature",), SAMPLING, type=float,
            help="default sampling temperature; 0 is greedy"),
    Setting("--top-p", ("sampling.top_p",), SAMPLING, type=float, help="default nucleus sampling threshold"),
    Setting("--top-k", ("sampling.top_k",), SAMPLING, type=int, help="default top-k; 0 is off"),
    Setting("--min-p", ("sampling.min_p",), SAMPLING, type=float, help="default min-p; 0 is off"),
    # prompt cache
    Setting("--prompt-cache-bytes", ("engine.prompt_cache_bytes",), CACHE, type=size,
            shown_default="a quarter of the KV budget; live requests take it back when they need it",
            help="RAM for reusable prompt KV, e.g. 2GB or 512MiB; 0 turns the prompt cache off"),
    Setting("--prompt-cache-size", ("engine.prompt_cache_size",), CACHE, type=non_negative_int,
            help="most prompt-cache entries kept in RAM"),
    Setting("--prompt-cache-dir", ("engine.prompt_cache_dir",), CACHE, type=Path, shown_default="RAM only",
            help="directory for the prompt cache's SSD tier; survives restarts"),
    Setting("--prompt-cache-ssd-bytes", ("engine.prompt_cache_ssd_bytes",), CACHE, type=size,
            shown_default="16GiB", help="most bytes the SSD tier keeps on disk"),
    Setting("--prompt-cache-io-timeout", ("engine.prompt_cache_io_timeout_s",), CACHE, type=positive_float,
            help="seconds one SSD-tier file read or write may take; past it the disk counts as hung and the SSD "
                 "tier is turned off, the prompt cache going on in RAM"),
    # speculative decoding
    Setting("--prompt-lookup", ("engine.prompt_lookup",), SPEC, switch=True,
            help="speculative decoding by prompt lookup: each request verifies up to --num-draft-tokens tokens "
                 "per step that followed its last tokens earlier in its prompt or output (same tokens, fewer "
                 "steps when the answer repeats the prompt); a request may send \"speculative\": false"),
    Setting("--prompt-lookup-ngram", ("engine.prompt_lookup_ngram",), SPEC, type=positive_int,
            help="longest suffix (in tokens) prompt lookup matches"),
    Setting("--draft-model", ("engine.draft_model",), SPEC, shown_default="none",
            help="speculative decoding with a draft model (directory or hub id) sharing the model's tokenizer: "
                 "it proposes --num-draft-tokens tokens per row and step, verified in the batch"),
    Setting("--num-draft-tokens", ("engine.num_draft_tokens",), SPEC, type=positive_int,
            help="tokens proposed per row and step when speculating"),
    # adapters
    Setting("--lora-modules", ("engine.lora_modules",), LORA, nargs="+", type=_lora_module, default=(),
            metavar="NAME=PATH", shown_default="none",
            help="LoRA/DoRA adapters (mlx-lm adapter directories) served next to the base model; a request "
                 "selects one with model=NAME"),
    Setting("--max-loras", ("engine.max_loras",), LORA, type=positive_int,
            help="adapters resident at once; beyond, the least recently used one no request holds is replaced"),
    Setting("--max-lora-rank", ("engine.max_lora_rank",), LORA, type=positive_int,
            help="largest adapter rank served"),
    Setting("--enable-lora-admin", ("engine.enable_lora_admin", "server.enable_lora_admin"), LORA, switch=True,
            help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) to change adapters at "
                 "run time"),
    # supervision and faults
    Setting("--max-restarts", ("engine.max_restarts",), FAULTS, type=non_negative_int,
            help="engine actor restarts allowed within --restart-period before the engine gives up; it is then "
                 "down (503s, /health says why) and starts again after a backoff"),
    Setting("--restart-period", ("engine.restart_period_s",), FAULTS, type=positive_float,
            help="seconds over which --max-restarts counts"),
    Setting("--step-watchdog", ("engine.step_watchdog_s",), FAULTS, type=positive_float,
            help="seconds one GPU job may run before the lease thread counts as hung and is replaced, and the "
                 "engine restarts under its requests"),
    Setting("--enable-fault-injection", ("server.enable_fault_injection",), FAULTS, switch=True,
            help="serve GET/POST /v1/admin/faults, which make actors fail on purpose (tests and drills only)"),
    # scale-out
    Setting("--tensor-parallel", (), SCALE, type=positive_int, default=1,
            help="split the model over this many local ranks (tensor parallel, mlx.distributed's ring backend); "
                 "under mlx.launch, the number of ranks it started (docs/scale-out.md)"),
    Setting("--pipeline-parallel", (), SCALE, type=positive_int, default=1,
            help="split the model's layers over this many local ranks instead (pipeline parallel: model types "
                 "with pipeline() in mlx-lm, e.g. qwen2, qwen3_moe, deepseek_v3); not with --tensor-parallel"),
    Setting("--collective-timeout", ("engine.collective_timeout_s",), SCALE, type=positive_float,
            help="seconds within which every rank must answer rank 0's heartbeat (queued behind other GPU jobs) "
                 "before the group counts as lost and /health says so"),
)


def add_to(parser: argparse.ArgumentParser, table: Sequence[Setting] = TABLE) -> None:
    """Add the table's flags to `parser` in help groups, each help ending with its default.

    Every default is argparse.SUPPRESS: a flag not given leaves no attribute, so
    `resolve` can tell a given value from a default one (and from the environment).
    """
    groups: dict[str, Any] = {}
    for setting in table:
        if setting.group not in groups:
            groups[setting.group] = parser.add_argument_group(setting.group)
        shown = setting.shown_default if setting.shown_default is not None else _shown(setting.default_value)
        text = f"{setting.help} (default: {shown})" if not setting.switch or setting.shown_default else setting.help
        options: dict[str, Any] = {"dest": setting.dest, "default": argparse.SUPPRESS, "help": text}
        if setting.switch:
            options["action"] = "store_true"
        else:
            options.update({k: v for k, v in (("type", setting.type), ("choices", setting.choices),
                                              ("nargs", setting.nargs), ("metavar", setting.metavar)) if v})
        groups[setting.group].add_argument(setting.flag, *setting.aliases, **options)


def _shown(value: Any) -> str:
    return "none" if value is None else str(value)


@attrs.frozen
class Resolved:
    """Every setting's value by dest, and where each came from."""

    values: dict[str, Any]
    sources: dict[str, str]

    def report(self, table: Sequence[Setting] = TABLE) -> tuple[tuple[str, Any, str], ...]:
        """(flag, value, source) of every setting, secrets masked: what /health?settings=1 lists."""
        def shown(setting: Setting) -> Any:
            value = self.values[setting.dest]
            return "***" if setting.secret and value else value
        return tuple((s.flag, shown(s), self.sources[s.dest]) for s in table)


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
            table: Sequence[Setting] = TABLE) -> Resolved:
    """Each setting's value: the flag if given, else its environment variable if set, else the default.

    Fills `args` with the values, so `args.<dest>` reads as a plain namespace afterwards.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    given = getattr(args, "_given", None)
    if given is None:  # the first call: what argparse left is what was given
        given = {s.dest for s in table if hasattr(args, s.dest)}
        args._given = frozenset(given)
    for setting in table:
        if setting.dest in given:
            value, source = getattr(args, setting.dest), FLAG
        elif setting.env and environ.get(setting.env):
            text = environ[setting.env]
            value, source = (setting.type(text) if setting.type else text), ENVIRONMENT
        else:
            value, source = setting.default_value, DEFAULT
        values[setting.dest], sources[setting.dest] = value, source
        setattr(args, setting.dest, value)
    return Resolved(values, sources)


def configs(resolved: Resolved, table: Sequence[Setting] = TABLE) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the HTTP server's configs the settings feed; raises InvalidParameter, ValueError."""
    fields: dict[str, dict[str, Any]] = {"engine": {}, "server": {}, "sampling": {}}
    for setting in table:
        value = resolved.values[setting.dest]
        if setting.to_config is not None:
            value = setting.to_config(value)
        for target in setting.feeds:
            config, _, field = target.partition(".")
            fields[config][field] = value
    engine = EngineConfig(**fields["engine"], defaults=SamplingParams.from_kwargs(fields["sampling"]))
    server = ServerConfig(**fields["server"], settings=resolved.report(table))
    return engine, server
