"""The engine link: `mlx-trio serve --api-server-count N` serves HTTP from N front processes.

The engine's process (the lease, the actors, the sessions and `Engine.stream`)
holds no HTTP; each front process runs the same quart-trio app on hypercorn
against a `RemoteEngine` that reaches the engine over one local socket. A
front's HTTP work (parsing, rendering, SSE writes: most of a streamed token's
CPU outside the lease) then no longer shares the engine process's GIL with the
lease thread (docs/architecture.md "Front processes").

    wire.py            frames of pickled messages over a Trio stream
    link_server.py     the engine process's side: a child of the engine's root
    remote_engine.py   the front's side: the `EngineLike` the HTTP app serves
    remote_store.py    the front's side of the /v1/responses store every front shares
    front_pool.py      the public socket and the front processes, restarted when they die
    front_process.py   a front process's main (`python -m mlx_trio.link.front_process`)
    engine_process.py  the engine's process's main (`python -m mlx_trio.link.engine_process`)
    launcher.py        `mlx-trio serve`'s own process: the engine's process and the pool, kept running
    orphan.py          how those processes notice the launcher is gone
"""
