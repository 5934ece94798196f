"""Which rows of a decode batch speculate, and their proposals: one proposer per row (prompt lookup).

A `Speculator` is aligned with its `DecodeBatch`'s rows (join appends,
`keep` filters, as the batch does) and holds one `RowProposer` per row that
speculates, None for a row whose request said `"speculative": false`.
Proposers see every token their row emits, in order (`extend`), and
propose from there. A draft model proposes for all rows at once instead
(`DraftSpeculator`, engine/speculative/draft.py); both are a `BatchProposer`,
and `SpeculationConfig.speculator()` builds the one a batch uses.

Every other row speculates, greedy, sampled or constrained: the batch
draws the target's own token at each verified position with the row's
sampler (its key, penalties, filters, grammar mask), and a proposal is
accepted when it equals that draw. For a proposal that is one token (a
point mass, as prompt lookup's and a greedy draft's are) this is the
speculative sampling rule itself (accept with probability p(token), else a
draw from p without it), and it emits exactly the tokens plain decoding
would (docs/design.md §9.3). Runs on the lease thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from mlx_trio.engine.speculative.draft import DraftSpeculator
from mlx_trio.engine.speculative.prompt_lookup import NgramLookup


class RowProposer(Protocol):
    """One row's proposal source: `extend` with each token the row emits, `propose` up to k next tokens."""

    def extend(self, tokens: Sequence[int]) -> None: ...

    def propose(self, k: int) -> list[int]: ...


# (request id, the row's tokens so far: its prompt then token 0) → its proposer.
ProposerFactory = Callable[[str, Sequence[int]], RowProposer]


class BatchProposer(Protocol):
    """Proposals for every row of a decode batch, aligned with its rows (`Speculator`, `DraftSpeculator`)."""

    @property
    def active(self) -> bool: ...

    @property
    def nbytes(self) -> int:
        """Device bytes the proposer holds for its rows (a draft's KV)."""
        ...

    def join(self, rows: Sequence[tuple[str, Sequence[int], bool]]) -> None: ...

    def keep(self, indices: Sequence[int]) -> None: ...

    def close(self) -> None: ...

    def extend(self, emitted: Sequence[Sequence[int]]) -> None: ...

    def proposals(self) -> list[list[int]]: ...


@attrs.frozen
class SpeculationConfig:
    """How a batch speculates: `num_draft_tokens` proposals per row and step, from `proposers` (one per row)
    or from `draft_model` (a second model, batched: engine/speculative/draft.py)."""

    num_draft_tokens: int
    proposers: ProposerFactory | None = None
    draft_model: Any = None
    prefill_step_size: int = 2048
    # The target's vocabulary size: a draft proposes no id past it (None: the draft's own head decides).
    vocab_size: int | None = None

    @classmethod
    def prompt_lookup(cls, num_draft_tokens: int, max_ngram: int) -> SpeculationConfig:
        # A partial of a module function, not a lambda: scale-out sends it to the follower ranks by pickle.
        return cls(num_draft_tokens, functools.partial(_ngram_lookup, max_ngram=max_ngram))

    @classmethod
    def draft(cls, model: Any, num_draft_tokens: int, *, prefill_step_size: int = 2048,
              vocab_size: int | None = None) -> SpeculationConfig:
        return cls(num_draft_tokens, draft_model=model, prefill_step_size=prefill_step_size, vocab_size=vocab_size)

    def speculator(self) -> BatchProposer:
        """A fresh proposer for one decode batch (lease thread)."""
        if self.draft_model is not None:
            return DraftSpeculator(self.draft_model, self.num_draft_tokens, prefill_step_size=self.prefill_step_size,
                                   vocab_size=self.vocab_size)
        return Speculator(self)


class Speculator:
    """Per-row proposers of one decode batch, aligned with its rows."""

    def __init__(self, config: SpeculationConfig) -> None:
        if config.proposers is None:
            raise ValueError("a per-row Speculator needs proposers")
        if config.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {config.num_draft_tokens}")
        self._config = config
        self._rows: list[RowProposer | None] = []

    @property
    def active(self) -> bool:
        """Some row speculates."""
        return any(row is not None for row in self._rows)

    @property
    def nbytes(self) -> int:
        return 0  # host lists only

    def join(self, rows: Sequence[tuple[str, Sequence[int], bool]]) -> None:
        """Append rows: (request id, prompt + token 0, whether it speculates)."""
        proposers = self._config.proposers
        assert proposers is not None
        self._rows += [proposers(rid, tokens) if speculates else None for rid, tokens, speculates in rows]

    def keep(self, indices: Sequence[int]) -> None:
        self._rows = [self._rows[i] for i in indices]

    def close(self) -> None:
        self._rows = []

    def extend(self, emitted: Sequence[Sequence[int]]) -> None:
        """Each row's tokens emitted by one step (batch order)."""
        for row, tokens in zip(self._rows, emitted, strict=True):
            if row is not None and tokens:
                row.extend(tokens)

    def proposals(self) -> list[list[int]]:
        """Each row's proposal for the next verification (batch order; [] for rows that do not speculate)."""
        k = self._config.num_draft_tokens
        return [[] if row is None else row.propose(k)[:k] for row in self._rows]


def _ngram_lookup(_request_id: str, tokens: Sequence[int], *, max_ngram: int) -> NgramLookup:
    return NgramLookup(tokens, max_ngram=max_ngram)
