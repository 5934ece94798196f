"""`--batch auto`: the row cap chosen from the KV budget and the model (docs/design.md §1.2).

    rows = clamp(budget // row_bytes(AUTO_CONTEXT_TOKENS), AUTO_FLOOR, AUTO_CEILING)

- `budget` is the KV budget configured at start (`--kv-budget`, or what the
  device had free after the weights): the ceiling memory allows, not the
  budget a squeezed device leaves later (actors/memory_budget.py moves that,
  and admission follows it row by row; the cap stays).
- `row_bytes(n)` is the model's KV for one row of n tokens (engine/kv/layout.py,
  quantized KV included), so a model with fewer or smaller KV heads gets more rows.
- AUTO_CONTEXT_TOKENS = 8192: a typical agent turn (a system prompt with tool
  definitions of a few thousand tokens, the conversation so far, a few hundred
  tokens out). Rows whose context is longer are still bounded by admission's
  KV check, shorter ones leave room that more rows would use.
- AUTO_FLOOR = 8, the old fixed default: admission's KV check already keeps a
  small device from holding more than fits, so auto never caps below it.
- AUTO_CEILING = 64, the largest batch measured on the H200 (docs/benchmarks.md):
  every decode step carries every row, so a larger batch makes each token
  slower for all of them; past it rows queue, as mlx_lm.server's
  `--decode-concurrency` (32) makes them.

On the H200 with Llama-1B (32 KiB of bf16 KV a token) a 100 GiB budget fits
400 rows of 8k tokens: 64. SmolLM2-135M on a 16 GiB Mac (about 8 GiB of
budget, 22.5 KiB a token): 45. An 8B model (128 KiB a token) in 12 GiB: 12.
"""

from __future__ import annotations

from collections.abc import Callable

AUTO_CONTEXT_TOKENS = 8192
AUTO_FLOOR = 8
AUTO_CEILING = 64


def auto_row_cap(budget_bytes: int, row_bytes: Callable[[int], int]) -> int:
    """The rows `--batch auto` allows: see the module docstring; always within [AUTO_FLOOR, AUTO_CEILING]."""
    per_row = max(row_bytes(AUTO_CONTEXT_TOKENS), 1)
    return max(AUTO_FLOOR, min(AUTO_CEILING, budget_bytes // per_row))


def row_bound(batch: int | None) -> int:
    """The most rows a lane with this `--batch` may ever hold (auto: the ceiling), known before the model loads:
    what sizes the channels between the actors, which carry at most one message per row in flight."""
    return AUTO_CEILING if batch is None else batch
