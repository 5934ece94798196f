"""Prompt-cache keys of requests with an adapter: their tokens moved into a token space of the adapter's own.

A KV cache computed with an adapter's weights must never serve the base
model or another adapter (nor another revision of the same adapter). The
cache matches entries by token prefix, so each adapter revision gets a
namespace, an offset added to every token id of its keys: offsets are
multiples of 2**32 (token ids are smaller) derived from the name and the
revision, so a namespaced key shares no first token, hence no prefix, with
a key of any other namespace or with a plain one (the base model's, offset
0). Entries keep their length, so every prefix rule of the cache holds
unchanged inside a namespace.

The paged layout keys an adapter row's blocks under `kv_revision` (the name
served and its files' revision: `PagedKV.root_of`), and the SSD tier's block
runs (engine/kv/blocks/block_files.py) take the namespace of that string
alone (`revision_namespace`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

# Token ids are below 2**32; namespaces are multiples of it (int64 keys: at most 2**28 + 1 of them).
_TOKEN_BITS = 32
_NAMESPACE_HEX_DIGITS = 7


def adapter_namespace(name: str, revision: str) -> int:
    """The offset of an adapter revision's keys (never 0: that is the base model's)."""
    return _offset(f"{name}\0{revision}")


def kv_revision(name: str, revision: str) -> str:
    """What the paged KV blocks of a row of adapter `name` serving files of `revision` are keyed under."""
    return f"{name}@{revision}"


def revision_namespace(revision: str) -> int:
    """The offset of the block runs of rows keyed under `revision` (a `kv_revision`); 0 for "" (the base model)."""
    return _offset(f"\0{revision}") if revision else 0


def namespace_of(tokens: Sequence[int]) -> int | None:
    """The namespace `tokens` are keys of (0: plain ids), or None when they are not all of one."""
    if not tokens:
        return 0
    namespace = tokens[0] >> _TOKEN_BITS << _TOKEN_BITS
    if namespace < 0 or any(t >> _TOKEN_BITS << _TOKEN_BITS != namespace for t in tokens):
        return None
    return namespace


def out_of_namespace(tokens: Sequence[int], namespace: int) -> tuple[int, ...]:
    """The token ids of keys of `namespace` (`in_namespace` undone)."""
    return tuple(t - namespace for t in tokens) if namespace else tuple(tokens)


def _offset(text: str) -> int:
    digest = hashlib.sha256(text.encode()).hexdigest()
    return (int(digest[:_NAMESPACE_HEX_DIGITS], 16) + 1) << _TOKEN_BITS


def in_namespace(tokens: Sequence[int], namespace: int) -> tuple[int, ...]:
    """`tokens` as keys of `namespace`."""
    return tuple(t + namespace for t in tokens) if namespace else tuple(tokens)
