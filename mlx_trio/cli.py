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
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from mlx_trio import __version__, profiling, scale_out, settings
from mlx_trio.bench import cli as bench_cli
from mlx_trio.config import EngineConfig
from mlx_trio.errors import InvalidParameter, ModelLoadError, MlxTrioError, error_leaves
from mlx_trio.http.server.config import ServerConfig

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-trio", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="An LLM serving engine on MLX built as supervised Trio actors: "
                                                 "an OpenAI- and Anthropic-compatible HTTP server on one model.")
    parser.add_argument("--version", action="version", version=f"mlx-trio {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser("serve", help="serve an OpenAI- and Anthropic-compatible HTTP API",
                                description="Serve one model over HTTP: /v1/chat/completions, /v1/completions, "
                                            "/v1/messages, /health, /metrics and a live status page at /status.")
    settings.add_to(serve)
    bench_cli.add_parser(commands)
    return parser


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the HTTP server's configs from `serve`'s flags (mlx_trio/settings.py's table, each
    flag's environment variable where it has one); raises InvalidParameter."""
    return settings.configs(settings.resolve(args))


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


async def serve(engine_config: EngineConfig, server_config: ServerConfig, *, ranks: int = 1, pipeline: bool = False,
                task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the engine with the HTTP server as its child until cancelled (with `api_server_count` > 0: the
    launcher of the engine's process, or of its `ranks` rank processes, and of the front processes,
    mlx_trio/processes/launcher.py).

    `started(server)` once the model is loaded and the server listens. Raises
    `ModelLoadError` if the model cannot be loaded (after stopping the tree).
    """
    if server_config.api_server_count > 0:  # the engine and HTTP in processes of their own; none here
        await _serve_from_fronts(engine_config, server_config, ranks=ranks, pipeline=pipeline, task_status=task_status)
        return
    assert ranks == 1, "ranks are served only from front processes"
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
        print(f"mlx-trio: serving {engine.model_id} at {server.url}/v1 "
              f"(status page: {server.url}/status, health: {server.url}/health)", flush=True)
        task_status.started(server)


async def _serve_from_fronts(engine_config: EngineConfig, server_config: ServerConfig, *, ranks: int, pipeline: bool,
                             task_status: trio.TaskStatus[Any]) -> None:
    """`serve` as a launcher (mlx_trio/processes/launcher.py): the engine in a process of its own (or `ranks`),
    HTTP in `--api-server-count` front processes; `started(launcher)` once the model is ready."""
    from mlx_trio.processes.launcher import Launcher  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="mlx-trio-link-") as workdir:
        await Launcher(engine_config, server_config, Path(workdir), ranks=ranks,
                       pipeline=pipeline).run(task_status=task_status)


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


async def serve_until_signalled(engine_config: EngineConfig, server_config: ServerConfig, *, ranks: int = 1,
                                pipeline: bool = False) -> None:
    """`serve` until SIGINT or SIGTERM, then drain, flush and stop the tree; a second signal stops at once.

    A signal while the model still loads stops at once: nothing is running yet.
    """
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            ready: list[HttpServer] = []

            async def start() -> None:
                ready.append(await nursery.start(partial(serve, engine_config, server_config, ranks=ranks,
                                                         pipeline=pipeline)))
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
        # With every request ended, a pool still held is a leak: logged on the leak log (mlx_trio.api.leaks_log) (docs/design.md §7.3).
        report_leaks = getattr(server.engine, "report_leaks", None)
        if report_leaks is not None:
            await report_leaks()
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
    if args.command == "serve":
        settings.resolve(args)  # fills the flags not given: args.log_level and the rest read plainly below
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
        # The launcher keeps the N ranks as the fronts' engine (mlx_trio/processes/engine_keeper.py).
        refused = scale_out.refusal(ranks, ranks, engine_config)
        if server_config.api_server_count == 0:
            refused = ("--api-server-count 0 serves HTTP in the engine's process, which a lost scale-out group "
                       "ends; --tensor-parallel and --pipeline-parallel serve from front processes (1 or more)")
        if refused is not None:
            print(f"mlx-trio: invalid option: {refused}", file=sys.stderr)
            return 2
        return _serve_main(engine_config, server_config, ranks=ranks, pipeline=args.pipeline_parallel > 1)
    if scale_out.launched():
        with scale_out.joined_group(stop_timeout_s=args.collective_timeout,
                                    pipeline=args.pipeline_parallel > 1) as (rank, size):
            if rank > 0:
                return 0  # a follower's whole life ran in joined_group
            refused = scale_out.refusal(ranks, size, engine_config)
            if refused is not None:
                print(f"mlx-trio: invalid option: {refused}", file=sys.stderr)
                return 2
            # Under mlx.launch, which starts no lost group again, rank 0 serves HTTP in its own process.
            return _serve_main(engine_config, attrs.evolve(server_config, api_server_count=0))
    return _serve_main(engine_config, server_config)


def _serve_main(engine_config: EngineConfig, server_config: ServerConfig, *, ranks: int = 1,
                pipeline: bool = False) -> int:
    try:
        check_port(server_config.host, server_config.port)
    except OSError as exc:
        print(f"mlx-trio: {_cannot_listen(server_config, exc)}", file=sys.stderr)
        return 1
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        # MLX_TRIO_PROFILE=PATH: docs/profiling.md; with front processes the engine's
        # process profiles itself (mlx_trio/processes/engine_process.py), and this one, the launcher,
        # forwards the marks.
        environ = os.environ if server_config.api_server_count == 0 else {}
        with profiling.from_environment(environ):
            trio.run(partial(serve_until_signalled, engine_config, server_config, ranks=ranks, pipeline=pipeline))
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


if __name__ == "__main__":
    sys.exit(main())
