"""The engine's process under `mlx-trio serve`: the engine and its link, no HTTP; or one rank of its group.

    python -m mlx_trio.processes.engine_process --link SOCKET --config FILE --error-file FILE [--pipeline]

Started only by the launcher's `EngineKeeper` (engine_keeper.py), which starts
it again when it dies: the fronts keep their clients' connections meanwhile
and resume their streams on the new one (link/remote_engine.py). Its tree is
the engine's own (api.py) with `link` (`LinkServer`) as its extra child. It
writes nothing to stdout (the launcher's "serving" line is the one a caller
reads); a model that cannot load is written to `--error-file` and exits 3.
SIGTERM flushes the prompt cache's SSD tier (bounded) and exits 0; SIGINT is
the launcher's to act on (a terminal's Ctrl-C reaches the whole group). It
exits when the launcher is gone (killed outright: nobody would restart or
stop it). MLX_TRIO_PROFILE profiles this process (SIGUSR1 marks, forwarded by
the launcher).

With `MLX_RANK` set (`--tensor-parallel N`, `--pipeline-parallel N`: the
keeper starts N of these), it first joins the group (mlx_trio/scale_out.py):
rank 0 goes on as above, every other rank runs the follower loop until rank 0
stops it or is gone, and exits.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import pickle
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from mlx_trio import profiling, scale_out
from mlx_trio.api import Engine
from mlx_trio.config import EngineConfig
from mlx_trio.errors import ModelLoadError, error_leaves
from mlx_trio.link.link_server import LinkServer
from mlx_trio.processes.orphan import until_orphaned

log = logging.getLogger("mlx_trio.processes")

# docs/design.md §8.4, as `mlx-trio serve` sets it.
SWITCH_INTERVAL_S = 0.001
# How long SIGTERM lets the SSD tier finish what it was offered.
FLUSH_LIMIT_S = 30.0
MODEL_LOAD_EXIT = 3


async def serve_engine(config: EngineConfig, link_path: str, responses_store_bytes: int) -> None:
    """Run the engine and its link until SIGTERM; raises `ModelLoadError` if the model cannot load.

    The link server also keeps the fronts' one /v1/responses store, of `responses_store_bytes`."""
    parent = os.getppid()
    link = LinkServer(None, link_path, responses_store_bytes=responses_store_bytes)
    engine = Engine(config, extra_children=[link.child_spec])
    link.attach(engine)
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            async def orphaned() -> None:
                await until_orphaned(parent)
                log.error("the launcher is gone; the engine's process exits")
                nursery.cancel_scope.cancel()

            nursery.start_soon(orphaned)
            await nursery.start(engine.run)
            try:
                await engine.wait_ready()
            except ModelLoadError:
                nursery.cancel_scope.cancel()
                raise
            profiling.watch_counters(engine.actors.counters)
            gc.freeze()  # as `mlx-trio serve` does: what lives as long as the process is no longer scanned
            log.info("engine ready: %s", engine.model_id)
            async for _ in signals:
                with trio.move_on_after(FLUSH_LIMIT_S):
                    await engine.drain_persistence()
                nursery.cancel_scope.cancel()
                break


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlx_trio.processes.engine_process")
    parser.add_argument("--link", required=True, help="the engine link's Unix socket")
    parser.add_argument("--config", required=True, help="the pickled EngineConfig")
    parser.add_argument("--error-file", required=True, help="where a model that cannot load is described")
    parser.add_argument("--responses-store-bytes", type=int, required=True, help="the fronts' /v1/responses store")
    parser.add_argument("--pipeline", action="store_true", help="a rank of a pipeline-parallel group")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config: EngineConfig = pickle.loads(Path(args.config).read_bytes())
    if not scale_out.launched():
        return _serve(config, args)
    try:
        with scale_out.joined_group(stop_timeout_s=config.collective_timeout_s, pipeline=args.pipeline,
                                    relayed_output=False) as (rank, _):
            if rank > 0:
                return 0  # a follower's whole life ran in joined_group
            return _serve(config, args)
    except RuntimeError as exc:  # the group did not form, or a follower's rank 0 is gone
        log.error("this rank leaves its group: %s", exc)
        error = Path(args.error_file)
        if not error.exists():  # the launcher's words if the group never served (the first rank's to fail)
            error.write_text(f"rank {os.environ.get(scale_out.RANK_ENV)}: {exc}")
        return 1


def _serve(config: EngineConfig, args: argparse.Namespace) -> int:
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        with profiling.from_environment():
            trio.run(serve_engine, config, args.link, args.responses_store_bytes)
    except BaseException as exc:  # noqa: BLE001  (the launcher reads what went wrong from the file)
        load = _model_load_error(exc)
        Path(args.error_file).write_text(str(load) if load is not None else f"{type(exc).__name__}: {exc}")
        log.error("the engine stopped: %r", exc, exc_info=load is None)
        return MODEL_LOAD_EXIT if load is not None else 1
    return 0


def _model_load_error(exc: BaseException) -> ModelLoadError | None:
    return next((leaf for leaf in error_leaves(exc) if isinstance(leaf, ModelLoadError)), None)


if __name__ == "__main__":
    sys.exit(main())
