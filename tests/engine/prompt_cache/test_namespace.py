"""Prompt-cache adapter namespaces: a namespaced key shares no prefix with another namespace's or a plain one."""

from __future__ import annotations

import numpy as np

from mlx_trio.engine.prompt_cache.namespace import adapter_namespace, in_namespace
from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry, PromptCache


def test_namespaces_are_distinct_per_name_and_revision_and_never_the_base() -> None:
    spaces = {adapter_namespace(n, r) for n in ("a", "b") for r in ("rev1", "rev2")}
    assert len(spaces) == 4 and 0 not in spaces
    assert all(s % 2**32 == 0 and s < 2**62 for s in spaces)
    assert in_namespace((1, 2), 0) == (1, 2)


def test_a_namespaced_entry_serves_only_its_namespace() -> None:
    cache = PromptCache(max_bytes=10**9, max_entries=8)
    tokens = tuple(range(3, 40))
    space = adapter_namespace("a", "rev1")
    cache.put(CacheEntry(in_namespace(tokens, space), [], 1, True))
    assert cache.lookup(tokens + (5,)) is None  # the base model's prompt
    assert cache.lookup(in_namespace(tokens + (5,), adapter_namespace("a", "rev2"))) is None
    hit = cache.lookup(in_namespace(tokens + (5,), space))
    assert hit is not None and hit.usable == len(tokens)
    assert np.asarray(in_namespace(tokens, space)).dtype == np.int64
