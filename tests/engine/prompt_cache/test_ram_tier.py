"""The RAM tier's bookkeeping (engine/prompt_cache/ram_tier.py) against a plain model of entries, LRU order and bytes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry, PromptCache

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=8).map(tuple)


def _entry(tokens: tuple[int, ...], nbytes: int = 10, trimmable: bool = True) -> CacheEntry:
    return CacheEntry(tokens, [object()], nbytes, trimmable)


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_lookup_leaves_the_last_prompt_token_to_compute() -> None:
    cache = PromptCache(max_bytes=100, max_entries=10)
    cache.put(_entry((1, 2, 3, 4)))
    hit = cache.lookup((1, 2, 3, 4))
    assert hit is not None and hit.usable == 3 and hit.trim == 1


def test_a_non_trimmable_entry_is_used_only_whole() -> None:
    cache = PromptCache(max_bytes=100, max_entries=10)
    cache.put(_entry((1, 2, 3, 4), trimmable=False))
    assert cache.lookup((1, 2, 3, 4)) is None  # whole would leave nothing to compute
    assert cache.lookup((1, 2, 3, 5, 6)) is None  # diverges inside the entry
    hit = cache.lookup((1, 2, 3, 4, 9))
    assert hit is not None and hit.usable == 4 and hit.trim == 0


def test_a_diverging_trimmable_entry_is_trimmed_to_the_common_prefix() -> None:
    cache = PromptCache(max_bytes=100, max_entries=10)
    cache.put(_entry((1, 2, 3, 4, 5)))
    hit = cache.lookup((1, 2, 9, 9))
    assert hit is not None and hit.usable == 2 and hit.trim == 3


def test_a_trimmable_put_drops_its_prefixes_and_eviction_is_lru_by_bytes() -> None:
    evicted: list[tuple[int, ...]] = []
    cache = PromptCache(max_bytes=30, max_entries=10, on_evict=lambda e: evicted.append(e.tokens))
    cache.put(_entry((1, 2)))
    cache.put(_entry((1, 2, 3)))
    assert evicted == [(1, 2)] and len(cache) == 1
    cache.put(_entry((5, 5)))
    cache.put(_entry((6, 6)))
    cache.lookup((1, 2, 3, 7))  # refreshes (1, 2, 3)
    cache.put(_entry((7, 7)))
    assert evicted[-1] == (5, 5) and cache.nbytes == 30
    assert not cache.put(_entry((8,), nbytes=31))  # never fits: refused, handed back
    assert evicted[-1] == (8,)


class PromptCacheMachine(RuleBasedStateMachine):
    """Random puts, lookups and trims; the model is a dict in LRU order."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = PromptCache(max_bytes=60, max_entries=4, on_evict=self._evicted)
        self.model: dict[tuple[int, ...], CacheEntry] = {}  # insertion order = LRU order
        self.freed: list[CacheEntry] = []

    def _evicted(self, entry: CacheEntry) -> None:
        self.freed.append(entry)

    @rule(tokens=TOKENS, nbytes=st.integers(1, 70), trimmable=st.booleans())
    def put(self, tokens: tuple[int, ...], nbytes: int, trimmable: bool) -> None:
        entry = _entry(tokens, nbytes, trimmable)
        kept = self.cache.put(entry)
        if nbytes > 60:
            assert not kept and self.freed[-1] is entry
            return
        self.model.pop(tokens, None)
        self.model[tokens] = entry
        if trimmable:
            for other in [t for t in self.model if t != tokens and tokens[: len(t)] == t]:
                del self.model[other]
        while sum(e.nbytes for e in self.model.values()) > 60 or len(self.model) > 4:
            del self.model[next(iter(self.model))]
        assert kept == (tokens in self.model)

    @rule(prompt=TOKENS)
    def lookup(self, prompt: tuple[int, ...]) -> None:
        hit = self.cache.lookup(prompt)
        target = prompt[:-1]
        # What each entry can serve: all of it when it is a prefix of the target, else (trimmed) the
        # shared prefix when it is trimmable; the lookup must find the most.
        usable = {t: (len(t) if _lcp(t, target) == len(t) else _lcp(t, target) if e.trimmable else 0)
                  for t, e in self.model.items()}
        best = max(usable.values(), default=0)
        if hit is None:
            assert best == 0
            return
        tokens = hit.entry.tokens
        assert self.model.get(tokens) is hit.entry
        assert hit.usable == usable[tokens] == best and tokens[: hit.usable] == target[: hit.usable]
        assert hit.trim == 0 or hit.entry.trimmable
        self.model[tokens] = self.model.pop(tokens)  # most recently used now

    @rule(limit=st.integers(0, 60))
    def trim_to(self, limit: int) -> None:
        self.cache.trim_to(limit)
        while sum(e.nbytes for e in self.model.values()) > limit:
            del self.model[next(iter(self.model))]

    @invariant()
    def same_entries_and_bytes(self) -> None:
        assert len(self.cache) == len(self.model)
        assert all(t in self.cache for t in self.model)
        assert self.cache.nbytes == sum(e.nbytes for e in self.model.values()) <= 60
        stats = self.cache.statistics()
        assert stats.entries == len(self.model) and stats.bytes == self.cache.nbytes


PromptCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestPromptCacheMachine = PromptCacheMachine.TestCase


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=12), st.lists(st.integers(0, 2), max_size=12))
def test_shared_prefix_counts_the_leading_tokens_in_common(entry_tokens: list[int], prompt: list[int]) -> None:
    want = 0
    while want < min(len(entry_tokens), len(prompt)) and entry_tokens[want] == prompt[want]:
        want += 1
    entry = CacheEntry(tuple(entry_tokens), [], 1, True)
    assert entry.shared_prefix(np.asarray(prompt, dtype=np.int64)) == want
