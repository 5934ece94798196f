"""The process layer: how `mlx-trio serve` starts, keeps and restarts its processes (docs/architecture.md).

With `--api-server-count N` (N > 0, the default 1) `mlx-trio serve` is a launcher
that holds neither MLX nor HTTP. It keeps the engine (one engine process, or the
N rank processes of `--tensor-parallel N` / `--pipeline-parallel N`, whose rank 0
runs the engine and the link server) and N front processes, which serve HTTP
over the engine link (mlx_trio/link/, the protocol). Whatever loses the engine
(its process died, a rank died, rank 0 lost its group) ends that engine's
processes and starts them again; a front sees one thing, its link breaking,
and resumes each stream on the next engine (link/remote_engine.py). With
`--api-server-count 0` none of this runs: HTTP is served in the engine's process.

    launcher.py        the launcher: the keeper, the front pool, its own link to watch the engine
    engine_keeper.py   the engine's process or its ranks: started, watched, all ended and started again
    engine_process.py  the engine's process's main (`python -m mlx_trio.processes.engine_process`), or a rank's
    front_pool.py      the public socket and the front processes, restarted when they die
    front_process.py   a front process's main (`python -m mlx_trio.processes.front_process`)
    orphan.py          how those processes notice the launcher is gone
"""
