"""What the front and rank 0 tell each other about a request, beyond plain HTTP (docs/scale-out.md "Recovery").

Rank 0 honours these only on a request that carries `SECRET_HEADER` with the launch's secret (its
`SECRET_ENV`); the front strips that header from every client request, and `RESUME_KEY` from their
bodies, so no client can ask for them.

Rank 0, on such a request:
* a streamed answer it can resume gets `LINK_HEADER` (its value: the response id and created time),
  and every body chunk ends with a commit comment, `: ids 12 345` (the token ids that chunk covers,
  maybe none): the front forwards a chunk once its commit arrives, never a part of one;
* when its group is lost, a stream ends with `: lost` (the front resumes it) and an answer not yet
  begun is a 503 with `LOST_HEADER` (the front sends the request again to the next generation).

The front, resuming a stream, sends the request again with `RESUME_KEY` in its JSON body: the response
id and created time, whether the opening was delivered, and the token ids of every committed chunk,
chunk by chunk. Rank 0 replays them (docs/scale-out.md) and sends only what follows.
"""

from __future__ import annotations

SECRET_ENV = "MLX_TRIO_FRONT_SECRET"
SECRET_HEADER = "x-mlx-trio-front"
LINK_HEADER = "x-mlx-trio-link"
LOST_HEADER = "x-mlx-trio-lost"
RESUME_KEY = "mlx_trio_resume"

COMMIT = b": ids"
LOST = b": lost\n\n"


def commit(token_ids: tuple[int, ...] | list[int]) -> bytes:
    """The comment that ends a chunk covering `token_ids` (SSE clients skip comments; the front strips it)."""
    return COMMIT + b"".join(b" %d" % t for t in token_ids) + b"\n\n"
