"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of a row's last n tokens.

Agents echo what is already in their prompt (a file they edit, code they
quote), so the continuation of the row's last few tokens is often written
earlier in its own prompt or output. `NgramLookup` keeps, for every
n-gram of length 1..`max_ngram` of the row's tokens, where it last ended
*with a continuation known*; a proposal tries the longest suffix first and
returns up to `k` of the tokens that followed it. Updating costs
`max_ngram` dictionary writes per token and a proposal `max_ngram` lookups,
so neither grows with the context. Pure Python (no MLX): it runs on the
lease thread between a step's read and the next verification.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramLookup:
    """One row's tokens (prompt, then output) and its n-gram index; `propose()` reads it, `extend()` grows it."""

    def __init__(self, tokens: Sequence[int], *, max_ngram: int) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self._max_ngram = max_ngram
        self._tokens: list[int] = []
        # n-gram → the index of its last token, for its latest occurrence that some token follows.
        self._ends: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def extend(self, tokens: Sequence[int]) -> None:
        """Append the row's next tokens (in order)."""
        history, ends = self._tokens, self._ends
        for token in tokens:
            end = len(history) - 1  # the n-grams ending here now have a continuation: `token`
            for n in range(1, min(self._max_ngram, end + 1) + 1):
                ends[tuple(history[end - n + 1:end + 1])] = end
            history.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix ([] if none)."""
        history = self._tokens
        for n in range(min(self._max_ngram, len(history)), 0, -1):
            end = self._ends.get(tuple(history[-n:]))
            if end is not None:
                return history[end + 1:end + 1 + k]
        return []
