"""`mlx-trio serve`: the OpenAI-compatible server on one model.

Flags keep mlx_lm.server's names where they mean the same thing. The server
process is one `trio.run`: the engine's supervision tree with the HTTP server
as an extra child, so `/health` answers (503) while the model loads.

MLX, mlx-lm and quart are imported only once the flags are read and the
port is known to be free (`check_port`): a typo or a busy port is reported
in a fraction of a second, not after seconds of imports and a model load.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from mlx_trio import __version__, profiling, scale_out
from mlx_trio.argtypes import non_negative_float, non_negative_int, positive_float, positive_int, size
from mlx_trio.bench import cli as bench_cli
from mlx_trio.config import DEFAULT_PREFILL_CHUNK_MS, DEFAULT_PROMPT_CONCURRENCY, EngineConfig, parse_batch
from mlx_trio.engine.model.chat import check_template_args
from mlx_trio.errors import InvalidParameter, ModelLoadError, MlxTrioError
from mlx_trio.front.protocol import SECRET_ENV as FRONT_SECRET_ENV
from mlx_trio.http.server.config import DEFAULT_MAX_BODY_BYTES, DEFAULT_RESPONSES_STORE_BYTES, ServerConfig
from mlx_trio.params import SamplingParams

if TYPE_CHECKING:
    from mlx_trio.api import Engine
    from mlx_trio.http.server.http_server import HttpServer

log = logging.getLogger("mlx_trio.cli")

# How often "still loading" is logged while the model loads (a first default-model
# start converts a GGUF, which takes a while on a small machine).
LOAD_PROGRESS_EVERY_S = 5.0
# docs/design.md §8.4: bounds how long the Trio thread waits for the GIL held by the lease thread.
SWITCH_INTERVAL_S = 0.001


EXAMPLES = """examples:
  mlx-trio serve                                  the bundled SmolLM2-135M-Instruct on http://127.0.0.1:8080
  mlx-trio serve --model mlx-community/Qwen3-4B-4bit --api-key sekret
  mlx-trio bench --serve ours --concurrency 1,8   load-test it (pip install 'mlx-trio[bench]')

Once it serves, open http://127.0.0.1:8080/status for the live supervision tree."""
_ENGINE = attrs.fields(EngineConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-trio", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="An LLM serving engine on MLX built as supervised Trio actors: "
                                                 "an OpenAI- and Anthropic-compatible HTTP server on one model.")
    parser.add_argument("--version", action="version", version=f"mlx-trio {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser("serve", help="serve an OpenAI- and Anthropic-compatible HTTP API",
                                description="Serve one model over HTTP: /v1/chat/completions, /v1/completions, "
                                            "/v1/messages, /health, /metrics and a live status page at /status.")
    arg = serve.add_argument
    arg("--model", default=None,
        help="mlx-lm model directory or hub id (default: the bundled SmolLM2-135M-Instruct)")
    arg("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    arg("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default: %(default)s)")
    arg("--batch", "--decode-concurrency", dest="batch", type=parse_batch, default=None,
        help="requests decoded together (the concurrency cap); 1 decodes one request at a time with no "
             "prompt cache, so its tokens depend on no other request (default: auto, from the KV budget)")
    arg("--kv-budget", dest="kv_budget", type=positive_int, default=None,
        help="bytes of KV cache admission may reserve (default: device memory minus weights and headroom)")
    arg("--kv-bits", type=int, choices=(4, 8), default=None,
        help="store full-attention KV quantized to this many bits once a request holds --quantized-kv-start "
             "tokens: more rows and context in the same --kv-budget (default: bf16)")
    arg("--kv-group-size", type=int, choices=(32, 64, 128), default=_ENGINE.kv_group_size.default,
        help="values per quantization group with --kv-bits (default: %(default)s)")
    arg("--quantized-kv-start", type=non_negative_int, default=_ENGINE.quantized_kv_start.default,
        help="with --kv-bits, tokens a request holds before its KV is quantized; 0: after the first prefill "
             "chunk, as mlx-lm (default: %(default)s)")
    arg("--no-compile", action="store_true",
        help="run every decode step's forward uncompiled, as before compiled steps (so does the environment "
             "variable MLX_TRIO_NO_COMPILE=1; default: a lone row's steps compiled on the CPU where the model's caches "
             "allow, never on a GPU or while adapters are served)")
    arg("--max-tokens", type=positive_int, default=512, help="default max_tokens of a request (default: %(default)s)")
    arg("--temp", type=float, default=0.0, help="default sampling temperature; 0 is greedy (default: %(default)s)")
    arg("--top-p", type=float, default=1.0, help="default nucleus sampling threshold (default: %(default)s)")
    arg("--top-k", type=int, default=0, help="default top-k; 0 is off (default: %(default)s)")
    arg("--min-p", type=float, default=0.0, help="default min-p; 0 is off (default: %(default)s)")
    arg("--chat-template-args", type=_template_args, default={},
        help='JSON object of chat template variables, e.g. \'{"enable_thinking": false}\' (default: none)')
    arg("--strict-max-tokens", action="store_true",
        help="refuse (400) a max_tokens over the room the prompt leaves in the context "
             "(default: lower it to that room)")
    arg("--keep-billing-header", action="store_true",
        help="keep Claude Code's x-anthropic-billing-header system block in the prompt "
             "(default: drop it, so the prompt cache's prefix survives across requests)")
    arg("--api-key", default=os.environ.get("MLX_TRIO_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $MLX_TRIO_API_KEY; unset: no key)")
    arg("--allowed-origins", nargs="*", default=[],
        help="browser origins allowed by CORS, space- or comma-separated; '*' for any (default: same-origin only)")
    arg("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted; larger gets 413 (default: %(default)s)")
    arg("--prefill-step-size", type=positive_int, default=2048,
        help="most prompt tokens per prefill chunk; a lone request with nothing else running uses "
             "exactly this (mlx-lm's chunks) (default: %(default)s)")
    arg("--prefill-chunk-ms", type=positive_float, default=DEFAULT_PREFILL_CHUNK_MS,
        help="while other requests decode or wait, size each prefill chunk from its measured cost so it "
             "takes about this long: the longest stall a prefill adds to the running streams "
             "(default: %(default)s)")
    arg("--prefill-grid", type=non_negative_int, default=None,
        help="prefill chunks end on multiples of this many tokens, so attention meets a few shapes again "
             "instead of a new one per chunk (MLX's CUDA backend pays for each new shape); 0 turns it off "
             "(default: 256 on a GPU, off on the CPU)")
    arg("--cudnn-warm-tokens", type=non_negative_int, default=_ENGINE.cudnn_warm_tokens.default,
        help="with MLX_TRIO_ATTENTION_BACKEND=cudnn-prefill on CUDA: build cuDNN's plans for the prefill chunk "
             "shapes of contexts up to this many tokens before the first request, and those up to 4x as far "
             "while idle, so no request pays for planning them; 0 turns it off (default: %(default)s)")
    arg("--prompt-concurrency", type=positive_int, default=DEFAULT_PROMPT_CONCURRENCY,
        help="prompts prefilled at once, their chunks interleaved shortest first, so a short prompt "
             "never waits for a long one (default: %(default)s)")
    arg("--max-queue", type=positive_int, default=256,
        help="requests waiting for the decoder before new ones get 503 + Retry-After (default: %(default)s)")
    arg("--prompt-cache-bytes", type=size, default=None,
        help="RAM for reusable prompt KV, e.g. 2GB or 512MiB; 0 turns the prompt cache off "
             "(default: a quarter of the KV budget; live requests take it back when they need it)")
    arg("--prompt-cache-size", type=non_negative_int, default=64,
        help="most prompt-cache entries kept in RAM (default: %(default)s)")
    arg("--prompt-cache-dir", type=Path, default=None,
        help="directory for the prompt cache's SSD tier; survives restarts (default: RAM only)")
    arg("--prompt-cache-ssd-bytes", type=size, default=16 * 2**30,
        help="most bytes the SSD tier keeps on disk (default: 16GiB)")
    arg("--prompt-cache-io-timeout", type=positive_float, default=_ENGINE.prompt_cache_io_timeout_s.default,
        help="seconds one SSD-tier file read or write may take; past it the disk counts as hung and the "
             "SSD tier is turned off, the prompt cache going on in RAM (default: %(default)s)")
    arg("--cache-dir", type=Path, default=None,
        help="where the default model is converted to "
             "(default: $MLX_TRIO_CACHE_DIR, else $XDG_CACHE_HOME/mlx-trio/models, else ~/.cache/mlx-trio/models)")
    arg("--shutdown-timeout", type=non_negative_float, default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests get to finish before they are cut (default: %(default)s)")
    arg("--responses-store-bytes", type=size, default=DEFAULT_RESPONSES_STORE_BYTES,
        help="RAM for stored /v1/responses results (previous_response_id, GET); 0 stores nothing (default: 64MiB)")
    arg("--max-restarts", type=non_negative_int, default=_ENGINE.max_restarts.default,
        help="engine actor restarts allowed within --restart-period before the engine gives up; it is then "
             "down (503s, /health says why) and starts again after a backoff (default: %(default)s)")
    arg("--restart-period", type=positive_float, default=_ENGINE.restart_period_s.default,
        help="seconds over which --max-restarts counts (default: %(default)s)")
    arg("--step-watchdog", type=positive_float, default=_ENGINE.step_watchdog_s.default,
        help="seconds one GPU job may run before the lease thread counts as hung and is replaced, and the "
             "engine restarts under its requests (default: %(default)s)")
    arg("--api-server-count", type=non_negative_int, default=1,
        help="front processes that serve HTTP, each over a local socket to the engine's own process (vLLM's flag): "
             "their HTTP work does not share the engine's GIL; 0 serves HTTP in the engine's process. The fronts "
             "share one /v1/responses store (in the engine's process); with more than 1, each keeps its own "
             "HTTP metrics (default: %(default)s)")
    arg("--write-timeout", type=positive_float, default=attrs.fields(ServerConfig).write_timeout_s.default,
        help="seconds a response may wait for a client that does not read before the stream is ended and "
             "its request freed (default: %(default)s)")
    arg("--body-timeout", type=positive_float, default=attrs.fields(ServerConfig).body_timeout_s.default,
        help="seconds after a request's start by which its whole body must be in; a client that stalls or "
             "trickles it gets 408 (default: %(default)s)")
    arg("--prompt-lookup", action="store_true",
        help="speculative decoding by prompt lookup: each request verifies up to --num-draft-tokens tokens "
             "per step that followed its last tokens earlier in its prompt or output (same tokens, fewer "
             "steps when the answer repeats the prompt); a request may send \"speculative\": false")
    arg("--prompt-lookup-ngram", type=positive_int, default=_ENGINE.prompt_lookup_ngram.default,
        help="longest suffix (in tokens) prompt lookup matches (default: %(default)s)")
    arg("--draft-model", default=None,
        help="speculative decoding with a draft model (directory or hub id) sharing the model's tokenizer: "
             "it proposes --num-draft-tokens tokens per row and step, verified in the batch (default: none)")
    arg("--num-draft-tokens", type=positive_int, default=_ENGINE.num_draft_tokens.default,
        help="tokens proposed per row and step when speculating (default: %(default)s)")
    arg("--tensor-parallel", type=positive_int, default=1,
        help="split the model over this many local ranks (tensor parallel, mlx.distributed's ring backend); "
             "under mlx.launch, the number of ranks it started (docs/scale-out.md) (default: %(default)s)")
    arg("--pipeline-parallel", type=positive_int, default=1,
        help="split the model's layers over this many local ranks instead (pipeline parallel: model types "
             "with pipeline() in mlx-lm, e.g. qwen2, qwen3_moe, deepseek_v3); not with --tensor-parallel "
             "(default: %(default)s)")
    arg("--collective-timeout", type=positive_float, default=_ENGINE.collective_timeout_s.default,
        help="seconds within which every rank must answer rank 0's heartbeat (queued behind other GPU jobs) "
             "before the group counts as lost and /health says so (default: %(default)s)")
    arg("--enable-fault-injection", action="store_true",
        help="serve GET/POST /v1/admin/faults, which make actors fail on purpose (tests and drills only)")
    arg("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
        help="LoRA/DoRA adapters (mlx-lm adapter directories) served next to the base model; a request "
             "selects one with model=NAME (default: none)")
    arg("--max-loras", type=positive_int, default=_ENGINE.max_loras.default,
        help="adapters resident at once; beyond, the least recently used one no request holds is replaced "
             "(default: %(default)s)")
    arg("--max-lora-rank", type=positive_int, default=_ENGINE.max_lora_rank.default,
        help="largest adapter rank served (default: %(default)s)")
    arg("--enable-lora-admin", action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) to change adapters at run time")
    arg("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="log verbosity (default: %(default)s)")
    bench_cli.add_parser(commands)
    return parser


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Split the flags into the engine's and the HTTP server's configuration; raises InvalidParameter."""
    defaults = SamplingParams.from_kwargs({
        "max_tokens": args.max_tokens, "temperature": args.temp, "top_p": args.top_p,
        "top_k": args.top_k, "min_p": args.min_p,
    })
    engine = EngineConfig(model=args.model, cache_dir=args.cache_dir, prefill_step_size=args.prefill_step_size,
                          prefill_chunk_ms=args.prefill_chunk_ms, prefill_grid=args.prefill_grid,
                          prompt_concurrency=args.prompt_concurrency, cudnn_warm_tokens=args.cudnn_warm_tokens,
                          max_queue=args.max_queue, defaults=defaults, batch=args.batch,
                          kv_budget_bytes=args.kv_budget, prompt_cache_bytes=args.prompt_cache_bytes,
                          prompt_cache_size=args.prompt_cache_size, prompt_cache_dir=args.prompt_cache_dir,
                          prompt_cache_ssd_bytes=args.prompt_cache_ssd_bytes, max_restarts=args.max_restarts,
                          restart_period_s=args.restart_period, step_watchdog_s=args.step_watchdog,
                          prompt_cache_io_timeout_s=args.prompt_cache_io_timeout,
                          kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                          quantized_kv_start=args.quantized_kv_start,
                          num_draft_tokens=args.num_draft_tokens, prompt_lookup=args.prompt_lookup,
                          prompt_lookup_ngram=args.prompt_lookup_ngram, draft_model=args.draft_model,
                          lora_modules=args.lora_modules, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                          enable_lora_admin=args.enable_lora_admin,
                          collective_timeout_s=args.collective_timeout,
                          compile_decode=False if args.no_compile else None)
    origins = [o for item in args.allowed_origins for o in item.split(",")]
    server = ServerConfig(host=args.host, port=args.port, api_key=args.api_key or None, allowed_origins=origins,
                          max_body_bytes=args.max_body_bytes, chat_template_args=args.chat_template_args,
                          batch=args.batch, shutdown_timeout_s=args.shutdown_timeout,
                          enable_fault_injection=args.enable_fault_injection,
                          strict_max_tokens=args.strict_max_tokens, keep_billing_header=args.keep_billing_header,
                          responses_store_bytes=args.responses_store_bytes, write_timeout_s=args.write_timeout,
                          body_timeout_s=args.body_timeout,
                          enable_lora_admin=args.enable_lora_admin, api_server_count=args.api_server_count)
    return engine, server


def _lora_module(value: str) -> tuple[str, str]:
    """`NAME=PATH` of --lora-modules (vLLM's form)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def check_port(host: str, port: int) -> None:
    """Raise `OSError` if `host:port` cannot be bound now (in use, or not an address of this machine).

    Binds and closes a probe socket with SO_REUSEADDR, as hypercorn binds, so a
    port still in TIME_WAIT from a previous run counts as free. Port 0 always is.
    """
    if port == 0:
        return
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)


async def serve(engine_config: EngineConfig, server_config: ServerConfig, *,
                task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the engine with the HTTP server as its child until cancelled (with `api_server_count` > 0: the
    launcher of the engine's process and the front processes, mlx_trio/link/launcher.py).

    `started(server)` once the model is loaded and the server listens. Raises
    `ModelLoadError` if the model cannot be loaded (after stopping the tree).
    """
    if server_config.api_server_count > 0:  # the engine and HTTP in processes of their own; none here
        await _serve_from_fronts(engine_config, server_config, task_status=task_status)
        return
    # Here, not at the top: these load MLX, mlx-lm and quart (seconds), which `main` checks the port before.
    from mlx_trio.api import Engine  # noqa: PLC0415
    from mlx_trio.http.server.http_server import HttpServer  # noqa: PLC0415

    server = HttpServer(server_config)
    engine = Engine(engine_config, extra_children=[server.child_spec])
    server.attach(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        log.info("listening on %s; loading model %s", server.url, engine_config.model or "(default)")
        try:
            await _wait_ready_with_progress(engine)
        except ModelLoadError:
            nursery.cancel_scope.cancel()
            raise
        profiling.watch_counters(engine.actors.counters)  # MLX_TRIO_PROFILE's steps, tokens, requests
        if os.environ.get(FRONT_SECRET_ENV):  # rank 0 behind the front: the front's line is the "serving" one
            print(f"mlx-trio: rank 0 ready behind the front at {server.url} ({engine.model_id})", flush=True)
        else:
            print(f"mlx-trio: serving {engine.model_id} at {server.url}/v1 "
                  f"(status page: {server.url}/status, health: {server.url}/health)", flush=True)
        task_status.started(server)


async def _serve_from_fronts(engine_config: EngineConfig, server_config: ServerConfig, *,
                             task_status: trio.TaskStatus[Any]) -> None:
    """`serve` as a launcher (mlx_trio/link/launcher.py): the engine in a process of its own, HTTP in
    `--api-server-count` front processes; `started(launcher)` once the model is ready."""
    from mlx_trio.link.launcher import Launcher  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="mlx-trio-link-") as workdir:
        await Launcher(engine_config, server_config, Path(workdir)).run(task_status=task_status)


async def _wait_ready_with_progress(engine: Engine) -> None:
    start_s = trio.current_time()
    async with trio.open_nursery() as nursery:
        async def ticker() -> None:
            while True:
                await trio.sleep(LOAD_PROGRESS_EVERY_S)
                log.info("still loading the model (%.0f s)", trio.current_time() - start_s)

        nursery.start_soon(ticker)
        await engine.wait_ready()
        nursery.cancel_scope.cancel()
    log.info("model %s ready in %.1f s", engine.model_id, trio.current_time() - start_s)


async def serve_until_signalled(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """`serve` until SIGINT or SIGTERM, then drain, flush and stop the tree; a second signal stops at once.

    A signal while the model still loads stops at once: nothing is running yet.
    """
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            ready: list[HttpServer] = []

            async def start() -> None:
                ready.append(await nursery.start(serve, engine_config, server_config))
                # Everything loaded by now (model, tokenizer, libraries: ~100k objects) lives as long
                # as the process. Frozen, the collector stops scanning it: a full collection, which
                # holds the GIL and so stalls every stream, fell from 45 ms to nothing (SmolLM2, this
                # box). Only here, where the process is ours (not in `serve`, which tests embed).
                gc.freeze()

            nursery.start_soon(start)
            async for signum in signals:
                if ready:
                    log.info("%s received: draining (send it again to stop at once)", signal.Signals(signum).name)
                    await _drain_unless_signalled(ready[0], signals)
                else:
                    log.info("%s received while loading: stopping", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


async def _drain_unless_signalled(server: HttpServer, signals: AsyncIterator[int]) -> None:
    """Drain the server, then flush what the engine persists; a second signal skips what is left."""
    async with trio.open_nursery() as nursery:
        async def second_signal() -> None:
            async for signum in signals:
                log.warning("%s received again: stopping now", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                return

        nursery.start_soon(second_signal)
        report = await server.drain()
        log.info("drain done in %.1f s: %d request(s) were in flight, %d cut",
                 report.elapsed_s, report.in_flight_at_start, report.cut)
        # The SSD write queue of the prompt cache (test fakes of the engine may have none).
        drain_persistence = getattr(server.engine, "drain_persistence", None)
        if drain_persistence is not None:
            with trio.move_on_after(server.config.shutdown_timeout_s) as flush:
                await drain_persistence()
            if flush.cancelled_caught:
                log.warning("persistence flush still running after %.1f s: stopping anyway",
                            server.config.shutdown_timeout_s)
        nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "bench":
        return bench_cli.run(args)
    try:
        engine_config, server_config = configs_from_args(args)
    except (InvalidParameter, ValueError, TypeError) as exc:
        print(f"mlx-trio: invalid option: {exc}", file=sys.stderr)
        return 2
    if args.tensor_parallel > 1 and args.pipeline_parallel > 1:
        print("mlx-trio: invalid option: --tensor-parallel and --pipeline-parallel cannot be combined yet",
              file=sys.stderr)
        return 2
    ranks = max(args.tensor_parallel, args.pipeline_parallel)
    if ranks > 1 and not scale_out.launched():
        return scale_out.launch_local_ranks(ranks, list(argv if argv is not None else sys.argv[1:]),
                                            host=args.host, port=args.port, label=args.model or "the model")
    if scale_out.launched():
        with scale_out.joined_group(stop_timeout_s=args.collective_timeout,
                                    pipeline=args.pipeline_parallel > 1) as (rank, size):
            if rank > 0:
                return 0  # a follower's whole life ran in joined_group
            refused = scale_out.refusal(ranks, size, engine_config)
            if refused is not None:
                print(f"mlx-trio: invalid option: {refused}", file=sys.stderr)
                return 2
            # Rank 0 serves its front (mlx_trio/front/) in its own process, as it always has.
            return _serve_main(engine_config, attrs.evolve(server_config, api_server_count=0))
    return _serve_main(engine_config, server_config)


def _serve_main(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    try:
        check_port(server_config.host, server_config.port)
    except OSError as exc:
        print(f"mlx-trio: {_cannot_listen(server_config, exc)}", file=sys.stderr)
        return 1
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        # MLX_TRIO_PROFILE=PATH: docs/benchmarks.md ("Server-side profile"); with front processes the engine's
        # process profiles itself (mlx_trio/link/engine_process.py), and this one, the launcher, forwards the marks.
        environ = os.environ if server_config.api_server_count == 0 else {}
        with profiling.from_environment(environ):
            trio.run(serve_until_signalled, engine_config, server_config)
    except KeyboardInterrupt:
        log.info("stopped")
        return 0
    except BaseException as exc:  # noqa: BLE001  (a CLI turns every failure into a message and an exit code)
        print(f"mlx-trio: {_describe(exc, server_config)}", file=sys.stderr)
        log.debug("details", exc_info=exc)
        return 1
    return 0


def _describe(exc: BaseException, config: ServerConfig) -> str:
    leaves = list(error_leaves(exc))
    # Most specific first: a supervisor's "gave up" wraps the error that made it give up.
    for leaf in leaves:
        if isinstance(leaf, ModelLoadError):
            return f"the model failed to load: {leaf}"
    for leaf in leaves:
        if isinstance(leaf, OSError):
            return _cannot_listen(config, leaf)
    for leaf in leaves:
        if isinstance(leaf, MlxTrioError):
            return str(leaf)
    return "; ".join(f"{type(e).__name__}: {e}" for e in leaves) or repr(exc)


def _cannot_listen(config: ServerConfig, error: OSError) -> str:
    return f"cannot listen on {config.host}:{config.port}: {error.strerror or error}"


def error_leaves(exc: BaseException) -> Any:
    """Every error inside `exc`: the leaves of its exception groups, each followed by its causes."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from error_leaves(inner)
    else:
        # Supervisors wrap a child's failure; its cause is the useful part.
        yield exc
        if exc.__cause__ is not None:
            yield from error_leaves(exc.__cause__)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _template_args(text: str) -> dict[str, Any]:
    """A JSON object of template variables the engine lets a request set (else every chat would be a 400)."""
    value = _json_object(text)
    try:
        check_template_args(value)
    except InvalidParameter as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


if __name__ == "__main__":
    sys.exit(main())
