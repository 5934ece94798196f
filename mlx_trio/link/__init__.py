"""The engine link: `mlx-trio serve --api-server-count N` serves HTTP from N front processes.

The engine's process (the lease, the actors, the sessions and `Engine.stream`)
holds no HTTP; each front process runs the same quart-trio app on hypercorn
against a `RemoteEngine` that reaches the engine over one local socket. A
front's HTTP work (parsing, rendering, SSE writes: most of a streamed token's
CPU outside the lease) then no longer shares the engine process's GIL with the
lease thread (docs/architecture.md "Front processes").

    wire.py            frames of pickled messages over a Trio stream
    link_server.py     the engine process's side: a child of the engine's root
    remote_engine.py   the front's side: the `EngineLike` the HTTP app serves, resumed across engine restarts
    remote_store.py    the front's side of the /v1/responses store every front shares

The processes at either end, and who starts them, are mlx_trio/processes/.
"""
