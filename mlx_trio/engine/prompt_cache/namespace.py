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
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

# Token ids are below 2**32; namespaces are multiples of it (int64 keys: at most 2**28 + 1 of them).
_TOKEN_BITS = 32
_NAMESPACE_HEX_DIGITS = 7


def adapter_namespace(name: str, revision: str) -> int:
    """The offset of an adapter revision's keys (never 0: that is the base model's)."""
    digest = hashlib.sha256(f"{name}\0{revision}".encode()).hexdigest()
    return (int(digest[:_NAMESPACE_HEX_DIGITS], 16) + 1) << _TOKEN_BITS


def in_namespace(tokens: Sequence[int], namespace: int) -> tuple[int, ...]:
    """`tokens` as keys of `namespace`."""
    return tuple(t + namespace for t in tokens) if namespace else tuple(tokens)
