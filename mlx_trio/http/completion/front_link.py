"""Rank 0's side of the front (mlx_trio/front/protocol.py): a request the front sent, maybe a resumed one.

Only under `mlx-trio serve --tensor-parallel N`, whose front proxies every request to rank 0 with the
launch's secret; a request without it (any other client, any other launcher) is served as always.
For the front's requests the shared completion path (`serve.py`) calls a `Link` at each point of a
streamed answer, and answers a request that meets a lost group with `lost_response` (the front sends
it again to the next generation):

* a streamed answer carries `LINK_HEADER` (the response id and created time) and every chunk ends
  with a commit comment naming the token ids it covers (none for the opening or a keep-alive);
* a resumed request (`Resume`, from the body's `RESUME_KEY`) continues the answer its client already
  has: the same id and created time (`Renderer.continuing`), the delivered tokens replayed by the
  session (`Engine.stream`'s `replay`) and rendered as before, but not sent (`delta` drops them),
  nor the opening if it was delivered; what follows continues the client's stream exactly;
* a stream that fails because the group is lost ends with `: lost` instead of its error event.

A stream that asked for logprobs is linked too: its replayed tokens' logprobs are not needed (those
chunks were delivered, and are not sent again), and what follows carries the new generation's.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

import attrs
from quart import Response, request

from mlx_trio.front.protocol import LINK_HEADER, LOST, LOST_HEADER, RESUME_KEY, SECRET_ENV, SECRET_HEADER, commit
from mlx_trio.http.completion.renderer import Renderer
from mlx_trio.http.server.body import decode_json_object
from mlx_trio.http.server.errors import HttpError
from mlx_trio.http.server.state import AppState


@attrs.frozen
class Resume:
    """What the client of a resumed request already has: the answer's id and created time, whether its
    opening reached it, and the token ids of each chunk it received."""

    id: str
    created: int
    opened: bool
    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def parse(cls, value: Any) -> Resume:
        try:
            resume = cls(value["id"], value["created"], value["opened"],
                         tuple(tuple(group) for group in value["groups"]))
        except (TypeError, KeyError) as exc:
            raise HttpError(400, f"{RESUME_KEY} is malformed: {exc!r:.80}", param=RESUME_KEY) from None
        if not (isinstance(resume.id, str) and isinstance(resume.created, int) and isinstance(resume.opened, bool)
                and all(isinstance(t, int) for group in resume.groups for t in group)):
            raise HttpError(400, f"{RESUME_KEY} is malformed", param=RESUME_KEY)
        return resume


class Link:
    """One request as the front sent it (`state` None: not the front's, `NO_LINK`); `spliced` when its
    stream goes through the front's splice; `resume` when it continues an answer."""

    def __init__(self, state: AppState | None, *, spliced: bool = False, resume: Resume | None = None) -> None:
        self._state = state
        self.spliced = spliced
        self.resume = resume
        # The delivered tokens still to replay unseen.
        self._replay_left = sum(len(g) for g in resume.groups) if resume is not None else 0

    def lost(self) -> bool:
        """Whether this rank 0's group is lost (for good: the front goes on with the next generation)."""
        return self._state is not None and self._state.engine.group_lost is not None

    def replay(self) -> dict[str, Any]:
        """`Engine.stream`'s keywords: the tokens the session relays first, chunk by chunk, as it first did."""
        return {"replay": self.resume.groups} if self.resume is not None and self.resume.groups else {}

    def headers(self, renderer: Renderer) -> dict[str, str]:
        return {LINK_HEADER: f"{renderer.id} {renderer.created}"} if self.spliced else {}

    def opening(self, frames: list[bytes]) -> list[bytes]:
        if not self.spliced:
            return frames
        return [] if self.resume is not None and self.resume.opened else [*frames, commit(())]

    def event(self, frames: list[bytes], token_ids: tuple[int, ...] = ()) -> list[bytes]:
        """One event's frames (a delta covering `token_ids`, or a keep-alive), committed; none while replaying."""
        if not self.spliced:
            return frames
        if self._replay_left > 0:
            self._replay_left -= len(token_ids)
            return []
        return [*frames, commit(token_ids)]

    def failed(self, frames: list[bytes], error: list[bytes]) -> list[bytes]:
        """A stream's last frames after a failure: `: lost` when the group is lost (the front carries on)."""
        return [LOST] if self.spliced and self.lost() else [*frames, *error]


NO_LINK = Link(None)


async def link_of(state: AppState, *, stream: bool) -> Link:
    """The link of the request being served: `NO_LINK` unless the front sent it (with the launch's secret)."""
    secret = os.environ.get(SECRET_ENV, "")
    if not secret or not hmac.compare_digest(request.headers.get(SECRET_HEADER, "").encode(), secret.encode()):
        return NO_LINK
    if not stream:
        return Link(state)
    value = decode_json_object(await request.get_data()).get(RESUME_KEY)
    return Link(state, spliced=True, resume=Resume.parse(value) if value is not None else None)


def lost_response() -> Response:
    """What rank 0 answers the front when its group is lost before the answer began."""
    return Response(b"", status=503, headers={LOST_HEADER: "1"})
