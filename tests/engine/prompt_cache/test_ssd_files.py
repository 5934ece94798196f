"""Tests for `mlx_trio.engine.prompt_cache.ssd_files`: the SSD tier's entry files (numpy only, no MLX)."""

from __future__ import annotations

import errno
import logging
import os
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from mlx_trio.engine.prompt_cache.ssd_files import SUFFIX, CacheFileStore
from mlx_trio.engine.prompt_cache.identity import FORMAT_VERSION, CacheIdentity, cache_layout, identity_of_directory
from mlx_trio.engine.prompt_cache.host_entry import CLASSES, STATES, HostEntry, same_entry
from mlx_trio.testing.tiny_models import LLAMA, QWEN3, tiny_model

IDENTITY = CacheIdentity("model-a", "tok-a", "KVCache*2")
MiB = 2**20


def entry(tokens: tuple[int, ...], n: int = 64, seed: int = 0) -> HostEntry:
    rng = np.random.default_rng(seed)
    arrays = {"0.0": rng.standard_normal((1, 2, n, 4)).astype(np.float32),
              "0.1": rng.integers(0, 2**16, (1, 2, n, 4)).astype(np.uint16)}
    return HostEntry(tokens, arrays, {CLASSES: '["KVCache"]', STATES: '[[{"array": "0.0"}, {"array": "0.1"}, 3]]'})


def store(directory: Path, *, max_bytes: int = MiB, identity: CacheIdentity = IDENTITY) -> CacheFileStore:
    s = CacheFileStore(directory, max_bytes=max_bytes, identity=identity)
    s.scan()
    return s


def visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_entry_survives_a_restart(tmp_path: Path) -> None:
    """Write, then a new store on the same directory scans it and reads back the same tokens and bits."""
    e = entry((5, 6, 7))
    info = store(tmp_path).write(e)
    assert info is not None and visible(tmp_path) == [f"{info.key}{SUFFIX}"]
    assert info.file_bytes == (tmp_path / f"{info.key}{SUFFIX}").stat().st_size
    again = store(tmp_path)
    assert again.entries == [info] and again.nbytes == info.file_bytes
    got = again.read(info.key)
    assert got is not None and same_entry(got, e)


def test_the_key_is_the_identity_and_the_tokens(tmp_path: Path) -> None:
    """Same tokens under another identity, or other tokens, give another file name."""
    keys = {IDENTITY.key((1, 2)), IDENTITY.key((1, 2, 3)), attrs.evolve(IDENTITY, layout="KVCache*3").key((1, 2))}
    assert len(keys) == 3 and all(len(k) == 32 for k in keys)
    assert store(tmp_path).write(entry((1, 2))).key == IDENTITY.key((1, 2))


def test_longest_prefix(tmp_path: Path) -> None:
    """The longest stored prefix wins; non-prefixes never match; max_len caps the length."""
    s = store(tmp_path)
    for tokens in [(1,), (1, 2), (1, 2, 3, 4), (1, 3), (2, 2)]:
        s.write(entry(tokens))
    assert s.longest_prefix([1, 2, 3, 4, 5]).tokens == (1, 2, 3, 4)
    assert s.longest_prefix([1, 2, 3, 4]).tokens == (1, 2, 3, 4)
    assert s.longest_prefix([1, 2, 3, 4], max_len=3).tokens == (1, 2)
    assert s.longest_prefix([1, 2, 3]).tokens == (1, 2)
    assert s.longest_prefix([1, 9]).tokens == (1,)
    assert s.longest_prefix([3, 1]) is None
    assert s.longest_prefix([]) is None


def test_writing_a_stored_key_again_keeps_the_file_and_refreshes_it(tmp_path: Path) -> None:
    """A second write of the same tokens writes nothing and makes the entry most recently used."""
    s = store(tmp_path)
    first = s.write(entry((1,), seed=1))
    s.write(entry((2,)))
    assert s.write(entry((1,), seed=2)) == first
    assert [i.tokens for i in s.entries] == [(2,), (1,)]
    assert same_entry(s.read(first.key), entry((1,), seed=1))


def test_least_recently_used_files_go_first_to_stay_under_the_cap(tmp_path: Path) -> None:
    """With room for two entries, a third evicts the least recently used (a read counts as a use)."""
    size = store(tmp_path / "probe").write(entry((0,))).file_bytes
    s = store(tmp_path / "c", max_bytes=2 * size + size // 2)
    a, b = s.write(entry((1,))), s.write(entry((2,)))
    assert s.read(a.key) is not None  # a is now more recent than b
    c = s.write(entry((3,)))
    assert [i.key for i in s.entries] == [a.key, c.key]
    assert visible(tmp_path / "c") == sorted(f"{k}{SUFFIX}" for k in (a.key, c.key))
    assert s.nbytes == 2 * size <= s.max_bytes
    assert s.read(b.key) is None


def test_an_entry_larger_than_the_cap_is_not_written(tmp_path: Path) -> None:
    """write returns None and leaves the directory and the other entries alone."""
    s = store(tmp_path, max_bytes=40_000)
    kept = s.write(entry((1,), n=16))
    assert s.write(entry((2,), n=4096)) is None
    assert s.entries == [kept] and visible(tmp_path) == [f"{kept.key}{SUFFIX}"]


def test_a_smaller_cap_evicts_at_scan(tmp_path: Path) -> None:
    """Restarting with a smaller --prompt-cache-ssd-bytes trims the oldest files at scan."""
    s = store(tmp_path)
    infos = [s.write(entry((i,))) for i in range(3)]
    for age, info in enumerate(infos):  # mtime order is the LRU order a restart sees
        os.utime(info.path, (1000 + age, 1000 + age))
    again = store(tmp_path, max_bytes=infos[0].file_bytes + 1)
    assert again.entries == [infos[2]] and visible(tmp_path) == [f"{infos[2].key}{SUFFIX}"]


@pytest.mark.parametrize("damage", ["truncate", "flip_data", "flip_header", "empty"])
def test_a_damaged_file_is_read_as_a_miss_and_removed_with_one_warning(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    """Truncated, bit-flipped or emptied after indexing: read returns None, the file is gone, one warning."""
    s = store(tmp_path)
    info = s.write(entry((1, 2, 3)))
    raw = bytearray(info.path.read_bytes())
    header_len = struct.unpack("<Q", raw[:8])[0]
    if damage == "truncate":
        raw = raw[:-7]
    elif damage == "flip_data":
        raw[8 + header_len + 100] ^= 0x01
    elif damage == "flip_header":
        at = raw.index(b'"tokens":"') + len(b'"tokens":"')
        raw[at] = ord("B") if raw[at] != ord("B") else ord("C")
    else:
        raw = bytearray()
    info.path.write_bytes(bytes(raw))
    assert s.read(info.key) is None
    assert s.read(info.key) is None
    assert visible(tmp_path) == [] and s.entries == [] and s.nbytes == 0
    assert len(warnings(caplog)) == 1 and info.path.name in warnings(caplog)[0]


@pytest.mark.parametrize("damage", ["truncate", "flip_header_length", "garbage"])
def test_scan_removes_damaged_files_with_one_warning(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    """A restart indexes the good files and removes the damaged ones, with one warning for all."""
    s = store(tmp_path)
    good, bad = s.write(entry((1,))), s.write(entry((2,)))
    raw = bytearray(bad.path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip_header_length":
        raw[1] ^= 0x40
    else:
        raw = bytearray(b"not a safetensors file at all")
    bad.path.write_bytes(bytes(raw))
    again = store(tmp_path)
    assert again.entries == [good] and visible(tmp_path) == [f"{good.key}{SUFFIX}"]
    assert len(warnings(caplog)) == 1 and "1 damaged" in warnings(caplog)[0]


@pytest.mark.parametrize("change", ["model_hash", "tokenizer_hash", "layout", "format_version"])
def test_files_of_another_identity_are_removed_at_scan(
        tmp_path: Path, change: str, caplog: pytest.LogCaptureFixture) -> None:
    """Another model, tokenizer, cache layout or format version: skipped and removed, never read."""
    store(tmp_path).write(entry((1, 2)))
    other = attrs.evolve(IDENTITY, **{change: 2 if change == "format_version" else "other"})
    s = store(tmp_path, identity=other)
    assert s.entries == [] and visible(tmp_path) == [] and s.longest_prefix([1, 2, 3]) is None
    assert len(warnings(caplog)) == 1 and "1 from another model" in warnings(caplog)[0]


def test_a_file_whose_tokens_do_not_match_its_name_is_removed(tmp_path: Path) -> None:
    """Token ids are part of the key: a file renamed to another key is not trusted."""
    info = store(tmp_path).write(entry((1, 2)))
    forged = tmp_path / f"{IDENTITY.key((9, 9))}{SUFFIX}"
    info.path.rename(forged)
    s = store(tmp_path)
    assert s.entries == [] and visible(tmp_path) == [] and s.longest_prefix([9, 9]) is None


def test_scan_removes_unfinished_writes_and_leaves_other_files_alone(tmp_path: Path) -> None:
    """A `.tmp` left by a killed writer is removed; files that are not ours stay."""
    info = store(tmp_path).write(entry((1,)))
    leftover = tmp_path / f".{info.key}.0123abcd.tmp"
    leftover.write_bytes(info.path.read_bytes()[:100])
    (tmp_path / "README").write_text("mine")
    (tmp_path / "notakey.safetensors").write_bytes(b"x")
    s = store(tmp_path)
    assert s.entries == [info]
    assert visible(tmp_path) == sorted([f"{info.key}{SUFFIX}", "README", "notakey.safetensors"])


class _FullDisk:
    """`Path.open` whose files take `limit` bytes, then fail with ENOSPC: a disk filling mid-write."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.real_open = Path.open
        self.partial: list[Path] = []

    def __call__(self, path: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = self.real_open(path, mode, *args, **kwargs)
        if "w" not in mode:
            return f
        self.partial.append(path)
        limit, real_write = self.limit, f.write

        def write(data: Any) -> int:
            nonlocal limit
            data = memoryview(data).cast("B")
            if len(data) > limit:
                real_write(data[:limit])
                f.flush()
                assert path.stat().st_size > 0  # the partial file exists, under its tmp name only
                raise OSError(errno.ENOSPC, "No space left on device")
            limit -= len(data)
            return real_write(data)

        f.write = write
        return f


def test_a_disk_filling_mid_write_leaves_no_file_and_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC halfway through: OSError reaches the caller, neither the entry nor its tmp file is visible."""
    s = store(tmp_path)
    kept = s.write(entry((1,)))
    full = _FullDisk(limit=1000)
    monkeypatch.setattr(Path, "open", lambda path, *args, **kwargs: full(path, *args, **kwargs))
    with pytest.raises(OSError) as raised:
        s.write(entry((2,)))
    assert raised.value.errno == errno.ENOSPC
    assert len(full.partial) == 1 and full.partial[0].name.endswith(".tmp")
    assert visible(tmp_path) == [f"{kept.key}{SUFFIX}"] and s.entries == [kept]


def test_a_removed_directory_makes_writes_raise_and_reads_miss_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Directory removed mid-run: write raises OSError, read and longest_prefix just miss, no warning."""
    directory = tmp_path / "cache"
    s = store(directory)
    info = s.write(entry((1, 2)))
    for p in directory.iterdir():
        p.unlink()
    directory.rmdir()
    with pytest.raises(OSError):
        s.write(entry((3,)))
    assert s.read(info.key) is None
    assert s.longest_prefix([1, 2]) is None and s.nbytes == 0
    assert warnings(caplog) == []


def test_an_unusable_directory_fails_the_scan(tmp_path: Path) -> None:
    """A path that cannot be a directory raises OSError from scan (the caller degrades to RAM only)."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        store(tmp_path / "file")
    with pytest.raises(OSError):
        store(tmp_path / "file" / "below")


def test_reading_an_unknown_key_is_a_miss(tmp_path: Path) -> None:
    """Nothing indexed under the key: None, no file touched."""
    assert store(tmp_path).read(IDENTITY.key((4,))) is None


def test_remove(tmp_path: Path) -> None:
    """remove forgets the entry and deletes its file; removing twice is harmless."""
    s = store(tmp_path)
    info = s.write(entry((1,)))
    s.remove(info.key)
    s.remove(info.key)
    assert s.entries == [] and s.nbytes == 0 and visible(tmp_path) == []


def test_identity_of_a_model_directory(tmp_path: Path) -> None:
    """Same directory, same identity; other weights or another tokenizer change their hash."""
    llama, qwen = tiny_model(LLAMA), tiny_model(QWEN3)
    a, b = identity_of_directory(llama, "KVCache*2"), identity_of_directory(llama, "KVCache*2")
    assert a == b and a.layout == "KVCache*2" and a.format_version == FORMAT_VERSION
    other = identity_of_directory(qwen, "KVCache*2")
    assert other.model_hash != a.model_hash and other.tokenizer_hash == a.tokenizer_hash  # same trained tokenizer
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in llama.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert identity_of_directory(copy, "KVCache*2") == a
    weights = bytearray((copy / "model.safetensors").read_bytes())
    for i in range(len(weights) // 2, len(weights), 4096):  # same size and header, a tenth of it retrained
        if i % 40960 < 4096:
            weights[i] ^= 0x01
    (copy / "model.safetensors").write_bytes(bytes(weights))
    assert identity_of_directory(copy, "KVCache*2").model_hash != a.model_hash


def test_cache_layout_collapses_runs() -> None:
    """Runs of one class are written once with a count."""
    class KVCache: ...
    class ArraysCache: ...
    assert cache_layout([KVCache(), KVCache(), ArraysCache(), KVCache()]) == "KVCache*2,ArraysCache,KVCache"
    assert cache_layout([]) == ""


def test_zero_dimensional_and_strided_arrays_keep_their_shapes(tmp_path: Path) -> None:
    """A 0-d array stays 0-d (np.ascontiguousarray would make it 1-d) and a transposed one reads back equal."""
    e = HostEntry((1,), {"0.0": np.array(7, np.int64), "0.1": np.arange(6, dtype=np.float32).reshape(2, 3).T},
                  {CLASSES: "[]", STATES: "[]"})
    info = store(tmp_path).write(e)
    got = store(tmp_path).read(info.key)
    assert got is not None and got.arrays["0.0"].shape == () and same_entry(got, e)


def test_names_that_are_not_regular_files_are_skipped_never_opened_and_left_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A FIFO and a symlink under entry names: the scan skips them with one warning and keeps them;
    a FIFO swapped in for an indexed file later reads as a miss (an open of it would wait for a writer)."""
    kept = store(tmp_path).write(entry((1,)))
    fifo, link = tmp_path / f"{'a' * 32}{SUFFIX}", tmp_path / f"{'b' * 32}{SUFFIX}"
    os.mkfifo(fifo)
    link.symlink_to(kept.path)
    s = store(tmp_path)
    assert s.entries == [kept] and fifo.exists() and link.is_symlink()
    assert [w for w in warnings(caplog) if "not regular files" in w] == [
        f"prompt cache {tmp_path}: skipped 2 entry names that are not regular files (never opened)"]
    os.unlink(kept.path)
    os.mkfifo(kept.path)
    assert s.read(kept.key) is None and s.entries == [] and kept.path.exists()
    assert any("is not a regular file" in w for w in warnings(caplog))


def test_an_entry_with_empty_arrays_round_trips(tmp_path: Path) -> None:
    """Zero-size arrays share their offset with the next array: the header parser still accepts them."""
    e = HostEntry((4, 2), {"0.0": np.zeros((1, 2, 0, 4), np.float32), "0.1": np.ones((1, 2, 3, 4), np.float16),
                           "0.2": np.zeros((0,), np.int32)},
                  {CLASSES: '["KVCache"]', STATES: '[[{"array": "0.0"}, {"array": "0.1"}, {"array": "0.2"}]]'})
    info = store(tmp_path).write(e)
    got = store(tmp_path).read(info.key)
    assert got is not None and same_entry(got, e)


def test_keys_past_int32_are_stored_wide_and_read_back_exactly(tmp_path: Path) -> None:
    """An adapter's namespaced tokens (multiples of 2**32 added) survive a restart; plain keys keep int32."""
    wide = tuple(t + (7 << 32) for t in (5, 6, 7))
    info = store(tmp_path).write(entry(wide))
    plain = store(tmp_path).write(entry((5, 6, 7), seed=1))
    assert info is not None and plain is not None and info.key != plain.key
    again = store(tmp_path)
    assert sorted(e.tokens for e in again.entries) == sorted([wide, (5, 6, 7)])
    got = again.read(info.key)
    assert got is not None and same_entry(got, entry(wide))
    assert again.longest_prefix((5, 6, 7, 8)) == plain  # a plain prompt never matches the wide key
