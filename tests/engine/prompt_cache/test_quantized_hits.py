"""The RAM tier under a quantized KV scheme (issue #44 point 2): the lookup takes of each entry what
`KvScheme.hit_limit` allows, and an entry never supersedes a shorter one of the other format."""

from __future__ import annotations

from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry, PromptCache

PROMPT = tuple(range(1, 21))  # 20 tokens: with start 0, mlx-lm converts after the first 19


def _entry(tokens: tuple[int, ...], *, quantized: bool, trimmable: bool = True) -> CacheEntry:
    return CacheEntry(tokens, [object()], 10, trimmable, quantized=quantized)


def _lookup(*entries: CacheEntry, prompt: tuple[int, ...] = PROMPT, scheme: KvScheme = KvScheme(8, 64, 0)) -> int:
    cache = PromptCache(max_bytes=1000, max_entries=10)
    for entry in entries:
        cache.put(entry)
    hit = cache.lookup(prompt, limit=scheme.hit_limit(len(prompt), 2048))
    return hit.usable if hit is not None else 0


def test_a_quantized_entry_below_the_conversion_point_is_skipped_for_a_bf16_one() -> None:
    """An earlier turn's quantized entry shares 15 tokens; mlx-lm still attends those in bf16: the bf16 snapshot
    of the first 12 serves instead."""
    assert _lookup(_entry(PROMPT[:12], quantized=False), _entry(PROMPT[:15] + (99, 98), quantized=True)) == 12
    assert _lookup(_entry(PROMPT[:15] + (99, 98), quantized=True)) == 0


def test_a_quantized_entry_serves_from_the_conversion_point() -> None:
    """The same prompt again: its entry holds the 19 tokens mlx-lm converted at."""
    assert _lookup(_entry(PROMPT + (7, 7), quantized=True)) == 19


def test_a_bf16_entry_is_cut_to_the_conversion_point() -> None:
    """bf16 KV past the point (mlx-lm has quantized it by then): trimmed there, or skipped when it cannot be."""
    prompt = PROMPT + tuple(range(100, 140))  # 60 tokens; with step 16 mlx-lm converts after its first chunk
    scheme = KvScheme(8, 64, 0)
    cache = PromptCache(max_bytes=1000, max_entries=10)
    cache.put(_entry(prompt[:40], quantized=False))
    hit = cache.lookup(prompt, limit=scheme.hit_limit(len(prompt), 16))
    assert hit is not None and hit.usable == 16 and hit.trim == 24
    cache = PromptCache(max_bytes=1000, max_entries=10)
    cache.put(_entry(prompt[:40], quantized=False, trimmable=False))
    assert cache.lookup(prompt, limit=scheme.hit_limit(len(prompt), 16)) is None


def test_without_bits_there_is_no_limit() -> None:
    assert KvScheme().hit_limit(20, 2048) is None


def test_an_entry_supersedes_only_shorter_entries_of_its_format() -> None:
    cache = PromptCache(max_bytes=1000, max_entries=10)
    cache.put(_entry(PROMPT[:5], quantized=False))
    cache.put(_entry(PROMPT[:8], quantized=True))
    cache.put(_entry(PROMPT[:10], quantized=True))
    assert [PROMPT[:n] in cache for n in (5, 8, 10)] == [True, False, True]
    cache.put(_entry(PROMPT[:12], quantized=False))
    assert [PROMPT[:n] in cache for n in (5, 10, 12)] == [False, True, True]
