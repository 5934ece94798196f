"""NgramLookup: the longest suffix's latest earlier occurrence, its continuation up to k tokens."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_trio.engine.speculative import verify
from mlx_trio.engine.speculative.prompt_lookup import NgramLookup


def test_proposes_what_followed_the_latest_occurrence() -> None:
    lookup = NgramLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3], max_ngram=3)
    # "1 2 3" occurred at the start, followed by 4 5; the later "2 3" (followed by 7) is a shorter match.
    assert lookup.propose(2) == [4, 5]
    lookup.extend([7])  # now "2 3 7" ... "3 7" matches the middle: 8 1 2 follow
    assert lookup.propose(3) == [8, 1, 2]


def test_shorter_suffix_and_no_match() -> None:
    lookup = NgramLookup([5, 6, 7], max_ngram=3)
    assert lookup.propose(3) == []
    lookup.extend([6])
    assert lookup.propose(3) == [7, 6]  # "6" followed by 7 6 (the continuation runs into the suffix)
    assert NgramLookup([], max_ngram=2).propose(2) == []
    with pytest.raises(ValueError):
        NgramLookup([1], max_ngram=0)


def _brute_force(tokens: list[int], max_ngram: int, k: int) -> list[int]:
    for n in range(min(max_ngram, len(tokens)), 0, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 4), st.integers(1, 5), st.integers(0, 40))
def test_matches_a_brute_force_search(tokens: list[int], max_ngram: int, k: int, split: int) -> None:
    lookup = NgramLookup(tokens[:split], max_ngram=max_ngram)
    lookup.extend(tokens[split:])  # incremental growth indexes exactly what one pass does
    assert lookup.tokens == tokens
    assert lookup.propose(k) == _brute_force(tokens, max_ngram, k)


def test_verification_helpers() -> None:
    assert verify.padded_inputs([4, 9], [[1, 2], []]) == [[4, 1, 2], [9, 9, 9]]
    assert verify.padded_inputs([4], [[]]) == [[4]]
    assert verify.accepted([1, 2, 3], [1, 2, 5, 6]) == 2
    assert verify.accepted([1, 2, 3], [1, 2, 3, 6]) == 3
    assert verify.accepted([], [5]) == 0
    assert verify.accepted([7], [5, 7]) == 0
