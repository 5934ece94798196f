"""Where a prompt leaves its closest prompt-cache entry (engine/prompt_cache/divergence.py)."""

from __future__ import annotations

from collections.abc import Sequence

from mlx_trio.engine.prompt_cache.divergence import Divergence, Divergences, closest_divergence
from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry
from mlx_trio.events import CacheDivergence


def _entry(tokens: Sequence[int], trimmable: bool = True) -> CacheEntry:
    return CacheEntry(tuple(tokens), [object()], 10, trimmable)


def test_the_entry_sharing_the_longest_prefix_names_the_first_different_token() -> None:
    """Position, the entry's length and up to `context` tokens on each side, from the closest entry."""
    entries = [_entry(range(0, 5)), _entry([*range(0, 12), 99, 98, 97, 96]), _entry([0, 1, 50])]
    prompt = [*range(0, 12), 7, 8, 9, 10, 11]  # leaves the second entry at 12
    assert closest_divergence(entries, prompt, context=3) == Divergence(
        position=12, entry_tokens=16, before=(9, 10, 11), cached=(99, 98, 97), prompt=(7, 8, 9))


def test_the_context_is_cut_at_either_end() -> None:
    """Near the start only what there is before it; near the prompt's end only what the lookup compares."""
    assert closest_divergence([_entry([1, 2, 3])], [1, 9, 4], context=8) == Divergence(1, 3, (1,), (2, 3), (9,))


def test_nothing_lost_is_no_divergence() -> None:
    """No entry, none sharing a token, an entry the prompt continues, or a prompt the entry continues: None."""
    assert closest_divergence([], [1, 2, 3]) is None
    assert closest_divergence([_entry([5, 6])], [1, 2, 3]) is None
    assert closest_divergence([_entry([1, 2])], [1, 2, 3, 4]) is None  # a multi-turn chat's next turn
    # The lookup leaves the last token to compute: an entry holding the rest of the prompt lost nothing.
    assert closest_divergence([_entry([1, 2, 3, 4, 5])], [1, 2, 3, 9]) is None


def test_an_entry_is_close_when_it_agrees_at_half_the_positions_or_more() -> None:
    """A few tokens changed near the start, the rest the same (a billing header): reported, at the first one.
    Another conversation that only shares the template's first tokens: not close, not reported."""
    body = list(range(100, 140))
    header = _entry([1, 2, 7, 7, *body])
    assert closest_divergence([header], [1, 2, 8, 8, *body, 0], context=2) == Divergence(2, 44, (1, 2), (7, 7), (8, 8))
    other = _entry([1, 2, *range(200, 240)])
    assert closest_divergence([other], [1, 2, *body, 0]) is None


def test_an_entry_used_whole_outranks_one_that_diverges_at_the_same_token() -> None:
    """A boundary snapshot the prompt continues, next to a longer row it leaves there: the snapshot is used whole."""
    assert closest_divergence([_entry([1, 2]), _entry([1, 2, 3, 4])], [1, 2, 7, 8]) is None
    assert closest_divergence([_entry([1, 2, 3, 4]), _entry([1, 2])], [1, 2, 7, 8]) is None


def test_a_longer_shared_prefix_in_a_row_that_diverges_beats_a_shorter_snapshot() -> None:
    """The hit is short (the snapshot's 2 tokens) of what the closest entry held (5): that is the divergence."""
    divergence = closest_divergence([_entry([1, 2]), _entry([1, 2, 3, 4, 5, 6], trimmable=False)],
                                    [1, 2, 3, 4, 5, 9, 9], context=2)
    assert divergence == Divergence(5, 6, (4, 5), (6,), (9,))


def test_divergences_are_taken_once_per_prompt_and_the_last_one_stays_for_stats() -> None:
    log = Divergences(capacity=2)
    entries = [_entry([1, 2, 3, 4])]
    log.note(entries, (1, 2, 9, 9))
    log.note(entries, (1, 2, 3, 4, 5))  # a full hit: nothing to report, the last divergence stays
    assert log.last is not None and log.last.position == 2
    assert log.take((1, 2, 3, 4, 5)) is None
    assert log.take((1, 2, 9, 9)) == log.last and log.take((1, 2, 9, 9)) is None
    for prompt in ((1, 7, 0), (1, 8, 0), (1, 9, 0)):  # capacity 2: the oldest is dropped
        log.note(entries, prompt)
    assert log.take((1, 7, 0)) is None and log.take((1, 9, 0)) is not None


def test_described_decodes_each_side() -> None:
    divergence = Divergence(3, 10, (1, 2), (3,), (4, 5))
    assert divergence.described(lambda ids: "".join(chr(96 + i) for i in ids)) == CacheDivergence(3, 10, "ab", "c", "de")
