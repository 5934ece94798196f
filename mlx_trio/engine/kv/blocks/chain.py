"""Hash-chain keys of full KV blocks: what a block holds, named by every token before and in it.

A full block's KV depends on the tokens it holds and on every token before
them (attention mixes the whole prefix into each position), on the model's
weights and on the adapter that computed it. So a block's key is a hash of its
parent's key and its own token ids, and the chain's root is a hash of the
model identity and the adapter revision: two rows share a block exactly when
their prompts agree from the start through that block, under the same
weights. Keys are 16-byte blake2b digests (collisions are not a practical
concern at this size; vLLM and SGLang make the same trade).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from array import array

Key = bytes


def root_key(model_identity: str, adapter_revision: str = "") -> Key:
    """The chain's root: the model and adapter revision whose KV the blocks hold."""
    return _digest(b"root", model_identity.encode(), b"\0", adapter_revision.encode())


def block_key(parent: Key, tokens: Sequence[int]) -> Key:
    """The key of a full block holding `tokens`, after the block (or root) keyed `parent`."""
    return _digest(b"block", parent, array("q", tokens).tobytes())


def chain_keys(root: Key, tokens: Sequence[int], block_size: int) -> list[Key]:
    """The keys of the full blocks of `tokens`, from the start (a partial last block has none)."""
    keys: list[Key] = []
    parent = root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


def _digest(*parts: bytes) -> Key:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()
