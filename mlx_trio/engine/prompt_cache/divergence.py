"""Why did my cache miss? Where a prompt leaves the prompt-cache entry closest to it (issue #18 point 6).

A prompt that changes a token the cache holds (a harness field that varies
per request, a template that renders an earlier turn differently) reuses
only what comes before that token, or nothing. At each lookup the RAM tier's
entries are compared with the prompt (the part a lookup may use: all but the
last token): the entry sharing the longest prefix is the closest, and
where the prompt first differs from it is the divergence, kept with a few
token ids on each side. None when that entry is a prefix of the prompt (it
is used whole) or the prompt a prefix of it: nothing the cache held was
lost, so a multi-turn chat whose new turn follows a cached turn is not a
divergence. None too when the entry is not close: it must agree with the
prompt at `CLOSE_AGREEMENT` of the positions both have. A prompt that
changes a few tokens near its start (Claude Code's per-request billing
header) still agrees almost everywhere after them, so it is reported; an
unrelated conversation that only shares the chat template's first tokens
is not.

Plain numpy over the entries' token arrays (`CacheEntry.ids`), like the
lookup itself; the Trio side turns the ids into text (`described`) with the
model's tokenizer, for the request's log line and `/stats.prompt_cache`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence

import attrs
import numpy as np

from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry
from mlx_trio.events import CacheDivergence

# Tokens shown on each side of the divergence.
CONTEXT_TOKENS = 8
# The share of positions at which an entry and a prompt must hold the same token to be close.
CLOSE_AGREEMENT = 0.5
# Recent lookups whose divergence is kept for their request to collect (the rest are dropped, oldest first).
RECENT_LOOKUPS = 256


@attrs.frozen
class Divergence:
    """`prompt` left the entry of `entry_tokens` tokens at `position` (the first token that differs).

    `before` are the shared tokens just before `position`; `cached` and
    `prompt` the entry's and the prompt's tokens from `position` on (a few each).
    """

    position: int
    entry_tokens: int
    before: tuple[int, ...]
    cached: tuple[int, ...]
    prompt: tuple[int, ...]

    def described(self, decode: Callable[[Sequence[int]], str]) -> CacheDivergence:
        """The same, with the token ids decoded to text by `decode` (the model's tokenizer)."""
        return CacheDivergence(self.position, self.entry_tokens, decode(self.before), decode(self.cached),
                               decode(self.prompt))


def closest_divergence(entries: Iterable[CacheEntry], prompt: Sequence[int], *, context: int = CONTEXT_TOKENS,
                       shared: Sequence[tuple[int, CacheEntry]] | None = None) -> Divergence | None:
    """Where `prompt` (all but its last token) first differs from the entry sharing the longest prefix with it.

    Among entries sharing that longest prefix, one that is a prefix of the
    prompt wins (then None: it is used whole); else the most recently used
    (`entries` are least recently used first). None also when that entry is
    not close (see the module docstring). `shared`: each entry with its shared prefix, when the lookup
    already measured them (`PromptCache.shared_prefixes`); `entries` are then not read.
    """
    target = np.asarray(prompt[:-1], dtype=np.int64)
    if shared is None:
        shared = [(entry.shared_prefix(target), entry) for entry in entries]
    most = max((n for n, _ in shared), default=0)
    closest = [entry for n, entry in shared if n == most]
    if not most or most == len(target) or any(len(entry.ids) == most for entry in closest):
        return None
    entry = closest[-1]
    both = min(len(entry.ids), len(target))
    if np.count_nonzero(entry.ids[:both] == target[:both]) < CLOSE_AGREEMENT * both:
        return None
    return Divergence(most, len(entry.ids), _ids(target[max(0, most - context):most]),
                      _ids(entry.ids[most:most + context]), _ids(target[most:most + context]))


class Divergences:
    """The divergence of each recent lookup, by prompt, for its request to `take`; and the last one seen.

    A prompt is keyed by its length and hash, not held: the cache must not
    keep long prompts alive. A later lookup of the same prompt replaces the
    earlier one's (the last lookup is the one whose hit the prefill used).
    """

    def __init__(self, capacity: int = RECENT_LOOKUPS) -> None:
        self._capacity = capacity
        self._recent: collections.OrderedDict[tuple[int, int], Divergence | None] = collections.OrderedDict()
        self.last: Divergence | None = None

    def note(self, entries: Iterable[CacheEntry], prompt: Sequence[int], *,
             shared: Sequence[tuple[int, CacheEntry]] | None = None) -> None:
        """Compare `prompt` with `entries` (the RAM tier's, at a lookup) and keep what diverged (`shared`:
        as for `closest_divergence`)."""
        divergence = closest_divergence(entries, prompt, shared=shared)
        key = _key(prompt)
        self._recent.pop(key, None)
        self._recent[key] = divergence
        while len(self._recent) > self._capacity:
            self._recent.popitem(last=False)
        if divergence is not None:
            self.last = divergence

    def take(self, prompt: Sequence[int]) -> Divergence | None:
        """The divergence noted at `prompt`'s last lookup (then forgotten); None if none or not looked up."""
        return self._recent.pop(_key(prompt), None)


def _ids(array: np.ndarray) -> tuple[int, ...]:
    return tuple(int(t) for t in array)


def _key(prompt: Sequence[int]) -> tuple[int, int]:
    return len(prompt), hash(tuple(prompt))
