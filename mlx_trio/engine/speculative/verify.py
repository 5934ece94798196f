"""Batched verification of per-row proposals: the host side of one speculative step.

A step feeds every row `[input, p_1 .. p_k]`, right-padded to `1 + Kmax`
(`padded_inputs`), in one forward. Causal attention means no real position
sees a pad after it, and the pads' KV is rolled back with the rejected tail
(engine/kv/row_rollback.py). The target's token at position `j` is
`v_j` (`v_0` is the token plain decoding would emit now). The row accepts
proposals while `p_{j+1} == v_j` (`accepted`); it emits `v_0 .. v_a`
(`a + 1` tokens, the last one the correction or bonus token), and `v_a` is
its next input. Its KV keeps `1 + a` of the `1 + Kmax` positions written.
"""

from __future__ import annotations

from collections.abc import Sequence


def padded_inputs(inputs: Sequence[int], proposals: Sequence[Sequence[int]]) -> list[list[int]]:
    """`[B, 1 + Kmax]` rows `[input, *proposal]`, right-padded by repeating the input (any token would do)."""
    width = 1 + max((len(p) for p in proposals), default=0)
    return [[x, *p, *([x] * (width - 1 - len(p)))] for x, p in zip(inputs, proposals, strict=True)]


def accepted(proposal: Sequence[int], verified: Sequence[int]) -> int:
    """How many leading proposals the target agrees with: `proposal[j] == verified[j]` for each `j` before it."""
    count = 0
    for proposed, target in zip(proposal, verified):
        if proposed != target:
            break
        count += 1
    return count
