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


def test_a_quantized_entry_serves_rows_converting_at_or_before_its_point() -> None:
    """Entries are cut where they converted (`KvScheme.entry_cut`): a 19-token one (a 20-token prompt's) serves
    the same prompt again, and a shorter prompt up to that prompt's own point, but no longer one."""
    entry = _entry(PROMPT[:19], quantized=True)
    assert _lookup(entry) == 19
    assert _lookup(entry, prompt=PROMPT[:10]) == 9
    assert _lookup(entry, prompt=PROMPT + (5, 6, 7)) == 0


def test_a_quantized_entry_past_the_first_full_chunk_serves_all_it_shares() -> None:
    """With chunks of 16 an entry longer than 16 converted at 16, as does every prompt longer than 17."""
    prompt = PROMPT + tuple(range(100, 140))
    cache = PromptCache(max_bytes=1000, max_entries=10)
    cache.put(_entry(prompt[:40], quantized=True))
    limit = KvScheme(8, 64, 0).hit_limit
    assert cache.lookup(prompt, limit=limit(len(prompt), 16)).usable == 40
    assert cache.lookup(prompt[:12], limit=limit(12, 16)).usable == 11


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
