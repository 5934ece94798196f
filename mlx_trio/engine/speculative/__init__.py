"""Speculative decoding in the batch lane: proposals per row, one batched verification, per-row rollback."""
