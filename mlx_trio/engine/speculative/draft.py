"""A draft model's proposals for every row of a decode batch: its own batched KV, rolled back by row.

The draft runs beside the target on the lease thread with caches of its
own, aligned with the batch's rows (every row has a draft row, so join and
leave stay index for index; a row that does not speculate just has its
proposals dropped). Per row it keeps the tokens it has not been fed yet
(`pending`: at least the row's next input).

`proposals()` feeds each row's pending tokens in one right-padded forward,
rolls the pads back (engine/kv/row_rollback.py), takes the greedy token at
each row's last real position, then runs K-1 more one-token steps: K
proposals per row, built as one lazy graph and read once. The draft's KV
then holds the first K-1 proposals. `extend(emitted)` keeps the leading
proposals the target emitted too and rolls the rest back; what is left of
the emitted tokens becomes pending.

Proposals are the draft's argmax, a point mass, so the batch's acceptance
rule (accept while a proposal equals the target's draw) is the speculative
sampling rule for sampled rows as well (docs/design.md §9.3).

A joining row's draft KV is prefilled from its prompt at join, in chunks of
`prefill_step_size` (the target's prompt cache holds no draft KV: a hit is
re-prefilled here). Runs on the lease thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.kv import batch_caches, batch_kv, row_rollback
from mlx_trio.engine.speculative import verify

DEFAULT_PREFILL_STEP_SIZE = 2048


class DraftSpeculator:
    """The draft model's rows of one decode batch (the `Speculator` interface, batched)."""

    def __init__(self, model: nn.Module, num_draft_tokens: int, *,
                 prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE, vocab_size: int | None = None) -> None:
        # `vocab_size`: the target's; a draft whose head is wider (padded) never proposes an id past it,
        # which the target's embedding would read out of bounds.
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if not row_rollback.supports_rollback(make_prompt_cache(model)):
            raise TypeError("the draft model has layers whose KV cannot be rolled back (sliding window or recurrent)")
        self._model = model
        self._k = num_draft_tokens
        self._step = prefill_step_size
        self._vocab = vocab_size
        self._caches: list[Any] = []
        self._solo = False
        self._pending: list[list[int]] = []
        self._speculates: list[bool] = []
        # After `proposals()`: each row's proposals fed into the draft KV, until the next `extend`.
        self._fed: list[list[int]] | None = None

    @property
    def active(self) -> bool:
        return any(self._speculates)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._caches)

    def join(self, rows: Sequence[tuple[str, Sequence[int], bool]]) -> None:
        """Append rows (request id, prompt + token 0, whether it speculates): each prefills its draft KV now."""
        if not rows:
            return
        news = [self._prefilled(tokens[:-1]) for _, tokens, _ in rows]
        if not self._caches and len(news) == 1:
            self._caches, self._solo = news[0], True
        else:
            running, solo = (self._caches, self._solo) if self._caches else (news.pop(0), True)
            self._caches = [batch_caches.join_layer(layer, [new[i] for new in news], running_is_solo=solo)
                            for i, layer in enumerate(running)]
            batch_kv.share_offsets(self._caches)
            self._solo = False
        self._pending += [[tokens[-1]] for _, tokens, _ in rows]
        self._speculates += [speculates for _, _, speculates in rows]
        mx.eval([c.state for c in self._caches])

    def _prefilled(self, tokens: Sequence[int]) -> list[Any]:
        caches = make_prompt_cache(self._model)
        for start in range(0, len(tokens), self._step):
            self._model(mx.array([list(tokens[start:start + self._step])]), cache=caches)
            mx.eval([c.state for c in caches])
        return caches

    def keep(self, indices: Sequence[int]) -> None:
        if not indices:
            self.close()
            return
        if len(indices) != len(self._pending) and not self._solo:
            if len(indices) == 1 and batch_caches.can_extract(self._caches):
                self._caches = [batch_caches.extract_layer(c, indices[0]) for c in self._caches]
                self._solo = True
            else:
                for cache in self._caches:
                    batch_caches.filter_layer(cache, list(indices))
                batch_kv.share_offsets(self._caches)
            mx.eval([c.state for c in self._caches])
        self._pending = [self._pending[i] for i in indices]
        self._speculates = [self._speculates[i] for i in indices]
        if self._fed is not None:
            self._fed = [self._fed[i] for i in indices]

    def close(self) -> None:
        self._caches, self._solo, self._pending, self._speculates, self._fed = [], False, [], [], None

    def extend(self, emitted: Sequence[Sequence[int]]) -> None:
        """Each row's tokens emitted by one step: keep the fed proposals the row emitted, roll back the rest."""
        fed, self._fed = self._fed, None
        if fed is None:
            for pending, tokens in zip(self._pending, emitted, strict=True):
                pending += tokens
            return
        # The last emitted token is the row's next input: the draft is fed it again, for its logits.
        kept = [min(verify.accepted(f, tokens), len(tokens) - 1) for f, tokens in zip(fed, emitted, strict=True)]
        row_rollback.roll_back_rows(self._caches, [len(f) - m for f, m in zip(fed, kept)])
        self._pending = [list(tokens[m:]) for tokens, m in zip(emitted, kept)]

    def proposals(self) -> list[list[int]]:
        """K greedy draft tokens per speculating row ([] for the others); the draft KV then holds the first K-1."""
        if self._fed is not None:
            raise RuntimeError("proposals() twice without extend()")
        lengths = [len(p) for p in self._pending]
        width = max(lengths)
        inputs = mx.array([p + [p[-1]] * (width - len(p)) for p in self._pending], dtype=mx.uint32)
        logits = self._model(inputs, cache=self._caches)
        token = self._argmax(logits[mx.arange(len(lengths)), mx.array(lengths) - 1])
        row_rollback.roll_back_rows(self._caches, [width - n for n in lengths])
        drafted = [token]
        for _ in range(self._k - 1):
            token = self._argmax(self._model(token[:, None], cache=self._caches)[:, -1, :])
            drafted.append(token)
        proposals = mx.stack(drafted, axis=1)
        mx.eval(proposals, [c.state for c in self._caches])
        rows = proposals.tolist()
        self._fed = [row[:-1] for row in rows]
        self._pending = [[] for _ in rows]
        return [row if speculates else [] for row, speculates in zip(rows, self._speculates)]

    def _argmax(self, logits: mx.array) -> mx.array:
        return mx.argmax(logits[..., :self._vocab] if self._vocab is not None else logits, axis=-1)

