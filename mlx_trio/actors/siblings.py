"""Siblings: requests whose prompts share a long prefix prefill it once (docs/design.md §2.6.1).

Sub-agents of one agent arrive together with one long shared prefix (a system
prompt, a file, an earlier conversation) and distinct tails. Prefilled side by
side, each computes and holds the prefix on its own. Instead the prefill actor
lets one of them store a snapshot where the prompts part (their longest common
prefix), and the others wait for that snapshot and start from the prompt cache
(actors/prefill.py `_startable`). This module only measures prompts: which
prefix a request shares with which others, and where a snapshot would serve
them. It works on token ids alone (pure Python, the Trio thread).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mlx_trio.actors.messages import Generate


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens `a` and `b` share.

    Compares slices (C speed) and halves the unsure span, so two 100k-token
    prompts cost a few slice comparisons rather than a Python loop over every
    token.
    """
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def shared_with(cmd: Generate, other: Generate) -> int:
    """The prefix `cmd` and `other` could share through one snapshot: their common prefix, short of each
    prompt's last token (a row always computes that one itself), and 0 across adapters (their KV differs)."""
    if other is cmd or other.adapter != cmd.adapter:
        return 0
    return min(common_prefix(cmd.prompt_ids, other.prompt_ids), len(cmd.prompt_ids) - 1, len(other.prompt_ids) - 1)


def sibling_point(cmd: Generate, others: Iterable[Generate], *, start: int, minimum: int) -> int | None:
    """Where a snapshot of `cmd`'s prefill saves its waiting siblings the most prefill, or None.

    A sibling waits for a snapshot only if the snapshot is a prefix of its own
    prompt, so a point `p` saves `p` tokens for each sibling that shares at
    least `p` with `cmd`: the point chosen is the shared length with the most
    saved in all (one sibling that shares one token more than six others would
    otherwise leave the six to prefill alone). Only points at least `minimum`
    tokens past `start` (what `cmd` already has cached) count: a shorter shared
    stretch costs less to prefill twice than a split prefill and a snapshot.
    """
    shared = sorted((n for n in (shared_with(cmd, other) for other in others) if n - start >= minimum), reverse=True)
    # shared[i] is served, with every longer one, by a snapshot at shared[i]: i + 1 siblings.
    best = max(((i + 1) * point, point) for i, point in enumerate(shared)) if shared else None
    return best[1] if best is not None else None
