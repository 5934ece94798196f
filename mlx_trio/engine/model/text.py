"""Token ids → text deltas, with stop strings matched on the decoded text.

Pure Python (no MLX): the session actor runs it on the Trio thread, keeping
detokenization and string work off the lease thread (docs/design.md §8.4).

Stop strings are matched on detokenized text, not on token ids, so a stop
word that tokenizes differently in context (" Paris" vs "Paris") still stops.
Text that could be the start of a stop string is held back until it is known
not to be one, so the caller never sees a stop string, even partially.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs


@attrs.frozen
class TextUpdate:
    """What one token added: visible text and whether a stop string completed."""

    text: str
    stopped: bool = False
    # Which stop string matched, when `stopped`.
    stop: str | None = None


_NOTHING = TextUpdate("")  # a token that shows no text yet (frozen: one instance serves all)

# mlx-lm's detokenizers whose `text` only grows inside `add_token` (reading `last_segment` has no effect
# but to move its offset), so that one read after several tokens is their segments joined. The naive one's
# `text` property decodes and flushes at each read: it must be read after every token. By name: this
# module stays free of mlx-lm imports (the session actor, which may not import it, uses it).
_APPEND_ONLY = frozenset({"BPEStreamingDetokenizer", "SPMStreamingDetokenizer"})


class TextStream:
    """Incremental detokenizer plus stop-string matcher for one request."""

    def __init__(self, detokenizer: Any, stop: Sequence[str] = ()) -> None:
        # `detokenizer` is an mlx-lm StreamingDetokenizer (add_token/finalize/last_segment).
        self._detokenizer = detokenizer
        self._stop = tuple(stop)
        # Longest stop-string prefix that may still be completing at the tail.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self._stopped = False
        # Whether `add_many` may feed a message's tokens at once: no stop string to find token by token.
        self.batches = not self._stop and type(detokenizer).__name__ in _APPEND_ONLY

    def add(self, token_id: int) -> TextUpdate:
        """Feed one generated token id; returns the text that may be shown now."""
        if self._stopped:
            raise RuntimeError("add() after a stop string was matched")
        self._detokenizer.add_token(token_id)
        segment = self._detokenizer.last_segment
        if not self._stop:  # nothing to hold back or match: the common case, once per token and row
            return TextUpdate(segment) if segment else _NOTHING
        self._pending += segment
        return self._release(final=False)

    def add_many(self, token_ids: Sequence[int]) -> str:
        """Feed several token ids at once (only when `batches`); returns the text they show, read once.

        The same text as `add` of each in turn, joined, with one read of the
        detokenizer and no per-token update objects (the session feeds a whole
        decode message, usually several tokens per row, this way).
        """
        if not self.batches:
            raise RuntimeError("add_many() on a stream that must go token by token")
        for token_id in token_ids:
            self._detokenizer.add_token(token_id)
        return self._detokenizer.last_segment

    def finish(self) -> TextUpdate:
        """Flush what the detokenizer still holds; call once when generation ends."""
        if self._stopped:
            return TextUpdate("", stopped=True)
        self._detokenizer.finalize()
        self._pending += self._detokenizer.last_segment
        return self._release(final=True)

    def _release(self, *, final: bool) -> TextUpdate:
        hit = self._first_stop()
        if hit is not None:
            cut, stop = hit
            out, self._pending, self._stopped = self._pending[:cut], "", True
            return TextUpdate(out, stopped=True, stop=stop)
        keep = 0 if final else self._held_tail()
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(out) :]
        return TextUpdate(out)

    def _first_stop(self) -> tuple[int, str] | None:
        hits = [(i, s) for i, s in ((self._pending.find(s), s) for s in self._stop) if i >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _held_tail(self) -> int:
        """Length of the longest suffix of pending text that begins some stop string."""
        if not self._stop:
            return 0
        for n in range(min(self._hold, len(self._pending)), 0, -1):
            tail = self._pending[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
