"""The SSD tier's files: one safetensors file per prompt-cache entry, in one directory, under a byte cap.

A file is `<key>.safetensors`, where key = `CacheIdentity.key(tokens)`. Its
string metadata holds the identity (model, tokenizer, cache layout, format
version), the token ids, the cache layout of `HostEntry.meta` and a sha256
checksum over all of it and every array's bytes. Writes go to a dot-named
`.tmp` file that is renamed into place, so a crash or a full disk never
leaves a partial entry visible; leftovers are removed at `scan`. A file
that turns out truncated, damaged, or written for another model or format
is removed and read as a miss, never raised.

Only regular files are ever read: anything else under an entry's name (a
FIFO, a socket, a device, a symlink) is skipped with a warning and left
alone, and every open is non-blocking and checked with `fstat` before a
byte is read, so a FIFO planted between a scan and a read cannot block
either. Files are read with plain `os` calls, which release the GIL while
the disk works: a hung disk blocks only the worker thread that reads it
(the cache-persistence actor gives up on it, see `--prompt-cache-io-timeout`),
never the Trio thread or the lease. (safetensors' own reader keeps the GIL
while it opens and reads, freezing every thread on a FIFO or a hung disk;
the format is simple enough to parse here, as `_header` writes it.)

Numpy and plain files only, no MLX: every method may run on any thread (the
cache-persistence actor calls them from `trio.to_thread`), and one lock
keeps the index consistent between a writer and concurrent readers.
"""

from __future__ import annotations

import base64
import collections
import errno
import io
import json
import logging
import math
import os
import re
import secrets
import stat
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import numpy as np

from mlx_trio.engine.prompt_cache.identity import CacheIdentity
from mlx_trio.engine.prompt_cache.host_entry import LAYOUT_KEYS, START, HostEntry, checksum

log = logging.getLogger("mlx_trio.cache_files")

SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
_KEY = re.compile(r"[0-9a-f]{32}")
_TOKENS, _CHECKSUM = "tokens", "checksum"
# Keys with ids past int32 (an adapter's namespaced tokens, engine/prompt_cache/namespace.py) are stored
# as int64 under their own name, so every file written before stays readable as it was.
_WIDE_TOKENS = "tokens64"
_INT32 = (-(2**31), 2**31 - 1)
# safetensors dtype names of the numpy dtypes a HostEntry holds (bfloat16 travels as uint16).
_DTYPES = {np.dtype(t): name for t, name in [
    (np.float64, "F64"), (np.float32, "F32"), (np.float16, "F16"), (np.int64, "I64"), (np.int32, "I32"),
    (np.int16, "I16"), (np.int8, "I8"), (np.uint64, "U64"), (np.uint32, "U32"), (np.uint16, "U16"),
    (np.uint8, "U8"), (np.bool_, "BOOL"), (np.complex64, "C64")]}
_NUMPY_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
# A header longer than this is damage, not an entry (safetensors' own limit).
_MAX_HEADER_BYTES = 100_000_000
# What a damaged file raises while we parse it: it is removed and read as a miss.
_DAMAGED = (ValueError, KeyError, TypeError, AttributeError, IndexError, struct.error)


@attrs.frozen
class StoredEntryInfo:
    """An entry on disk, as the in-memory index knows it (from `scan` or `write`)."""

    key: str
    tokens: tuple[int, ...]
    file_bytes: int
    path: Path
    start: int = 0  # the first position its arrays hold (a run of paged KV blocks; 0: a whole prefix)


class CacheFileStore:
    """The entry files of one directory, their index (LRU order) and their byte cap.

    Nothing touches the disk until `scan` (call it first: it creates the
    directory and builds the index). `write` and `scan` raise OSError when
    the directory is unusable (full, read-only, removed); the caller decides
    to stop writing. `read` never raises for a bad or missing file.

    Args:
      directory: where the entry files live (created by `scan`).
      max_bytes: cap on the files' total size; the least recently used go first.
      identity: this server's model, tokenizer and cache layout; other files are removed.
    """

    def __init__(self, directory: str | Path, *, max_bytes: int, identity: CacheIdentity) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.identity = identity
        self._lock = threading.Lock()
        # Invariant: oldest use first; _nbytes == sum of file_bytes; guarded by _lock.
        self._index: collections.OrderedDict[str, StoredEntryInfo] = collections.OrderedDict()
        self._nbytes = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def entries(self) -> list[StoredEntryInfo]:
        """The indexed entries, least recently used first."""
        with self._lock:
            return list(self._index.values())

    def holds(self, key: str) -> bool:
        """Whether `key` is indexed (stored, as far as this store knows)."""
        with self._lock:
            return key in self._index

    def scan(self) -> list[StoredEntryInfo]:
        """Index the directory's entry files from their headers; remove what cannot be used.

        Removes unfinished writes (`.tmp`), truncated or damaged files, and
        files of another identity or format version, with one warning for
        all of them; then evicts down to `max_bytes`. Files that are not
        ours (other names) are left alone. Returns the index, LRU first.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, StoredEntryInfo]] = []
        removed: collections.Counter[str] = collections.Counter()
        skipped = 0
        with os.scandir(self.directory) as listing:
            for item in listing:
                path = Path(item.path)
                if item.name.startswith(".") and item.name.endswith(TMP_SUFFIX):
                    removed["unfinished write"] += _unlink(path)
                elif item.name.endswith(SUFFIX) and _KEY.fullmatch(item.name[: -len(SUFFIX)]):
                    try:
                        if not item.is_file(follow_symlinks=False):
                            skipped += 1  # not ours to remove, and never opened
                            continue
                        found.append(self._read_header(path))
                    except FileNotFoundError:
                        continue
                    except _NotRegular:
                        skipped += 1  # replaced by a FIFO or the like since the listing
                    except _Unusable as exc:
                        removed[exc.reason] += _unlink(path)
        if +removed:  # unary + drops the reasons whose files could not be removed
            log.warning("prompt cache %s: removed %s", self.directory,
                        ", ".join(f"{n} {reason}" for reason, n in sorted((+removed).items())))
        if skipped:
            log.warning("prompt cache %s: skipped %d entry names that are not regular files (never opened)",
                        self.directory, skipped)
        with self._lock:
            self._index.clear()
            self._nbytes = 0
            for _, info in sorted(found, key=lambda item: item[0]):
                self._index[info.key] = info
                self._nbytes += info.file_bytes
        self._evict(0)  # the cap may have shrunk since the files were written
        return self.entries

    def write(self, entry: HostEntry) -> StoredEntryInfo | None:
        """Store `entry` atomically (tmp file, then rename), evicting LRU files to stay under `max_bytes`.

        Returns the stored entry's info; the existing one (now most recently
        used) if its key is already stored; None, writing nothing, when the
        entry alone is larger than `max_bytes`. Raises OSError when the
        directory cannot be written: no partial file is left behind.
        """
        layout = _layout(entry.meta)
        start = int(layout.get(START, 0))
        key = self.identity.key(entry.tokens, start)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return self._index[key]
        # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
        arrays = {name: np.asarray(a, order="C") for name, a in entry.arrays.items()}
        meta = {**self.identity.to_metadata(), **layout, **_encode_tokens(entry.tokens),
                _CHECKSUM: checksum(layout, entry.tokens, arrays)}
        header = _header(arrays, meta)
        file_bytes = 8 + len(header) + sum(a.nbytes for a in arrays.values())
        if file_bytes > self.max_bytes:
            return None
        self._evict(file_bytes)  # make room first: a size-capped disk gets the space it needs
        path = self.directory / f"{key}{SUFFIX}"
        tmp = self.directory / f".{key}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            # No fsync: a file torn by a power cut fails its checksum and is read as a miss.
            with tmp.open("wb") as f:
                f.write(struct.pack("<Q", len(header)))
                f.write(header)
                for name in sorted(arrays):
                    f.write(arrays[name].reshape(-1).view(np.uint8))
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        info = StoredEntryInfo(key, entry.tokens, file_bytes, path, start)
        with self._lock:
            self._index[key] = info
            self._nbytes += file_bytes
        self._evict(0, keep=key)  # only needed if something else was stored meanwhile
        return info

    def read(self, key: str) -> HostEntry | None:
        """The entry stored under `key`, verified; None if it is not stored or not usable.

        A file that fails verification (truncated, damaged, another identity,
        tokens that do not match its key, a wrong checksum) is removed with a
        warning. A file that vanished (evicted, directory removed) is a quiet miss.
        """
        with self._lock:
            info = self._index.get(key)
        if info is None:
            return None
        try:
            entry = self._load(info)
        except FileNotFoundError:
            self._forget(key)
            return None
        except _NotRegular:
            log.warning("prompt cache file %s is not a regular file: skipped, left alone", info.path.name)
            self._forget(key)
            return None
        except (_Unusable, OSError) as exc:
            log.warning("prompt cache file %s is unusable (%s): removed", info.path.name, exc)
            self.remove(key)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        try:
            os.utime(info.path)  # the LRU order survives a restart: scan sorts by mtime
        except OSError:
            pass
        return entry

    def longest_prefix(self, tokens: Sequence[int], *, max_len: int | None = None) -> StoredEntryInfo | None:
        """The longest indexed entry whose tokens are a prefix of `tokens` (and at most `max_len` long)."""
        tokens = tuple(tokens)
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        best: StoredEntryInfo | None = None
        with self._lock:
            for info in self._index.values():
                n = len(info.tokens)
                if n <= limit and (best is None or n > len(best.tokens)) and tokens[:n] == info.tokens:
                    best = info
        return best

    def remove(self, key: str) -> None:
        """Forget `key` and delete its file, if either exists."""
        info = self._forget(key)
        if info is not None:
            _unlink(info.path)

    def _forget(self, key: str) -> StoredEntryInfo | None:
        with self._lock:
            info = self._index.pop(key, None)
            if info is not None:
                self._nbytes -= info.file_bytes
            return info

    def _evict(self, room: int, *, keep: str | None = None) -> None:
        """Drop least recently used entries until `room` more bytes fit under the cap."""
        paths: list[Path] = []
        with self._lock:
            for key in [k for k in self._index if k != keep]:
                if self._nbytes + room <= self.max_bytes:
                    break
                info = self._index.pop(key)
                self._nbytes -= info.file_bytes
                paths.append(info.path)
        for path in paths:  # outside the lock: a reader never waits on file system calls
            _unlink(path)

    def _read_header(self, path: Path) -> tuple[float, StoredEntryInfo]:
        """The entry file at `path` as the index holds it, from its header alone, and its mtime (the LRU order)."""
        try:
            with _open_regular(path) as f:
                status = os.fstat(f.fileno())
                prefix = _read_exactly(f, 8)
                header = _read_exactly(f, _header_length(prefix, status.st_size))
            meta, _ = _parse_header(header, status.st_size - 8 - len(header))  # it covers the whole file
            tokens, start = self._check_identity(meta, path.name[: -len(SUFFIX)])
        except _DAMAGED as exc:
            raise _Unusable("damaged") from exc
        return status.st_mtime, StoredEntryInfo(path.name[: -len(SUFFIX)], tokens, status.st_size, path, start)

    def _check_identity(self, meta: Mapping[str, str], key: str) -> tuple[tuple[int, ...], int]:
        """The file's tokens and start, if its identity is ours and they hash to its key; else raise _Unusable."""
        if CacheIdentity.from_metadata(dict(meta)) != self.identity:
            raise _Unusable("from another model, tokenizer, cache layout or format version")
        tokens = _decode_tokens(meta)
        start = int(meta.get(START, 0))
        if self.identity.key(tokens, start) != key:
            raise _Unusable("damaged (tokens do not match the file name)")
        return tokens, start

    def _load(self, info: StoredEntryInfo) -> HostEntry:
        try:
            # Read, not mmap: a file truncated under us must raise, not SIGBUS.
            with _open_regular(info.path) as f:
                data = f.read()
            header = data[8: 8 + _header_length(data[:8], len(data))]
            meta, table = _parse_header(header, len(data) - 8 - len(header))
            body = memoryview(data)[8 + len(header):]
            arrays = {name: np.frombuffer(body[start:end], dtype=dtype).reshape(shape)
                      for name, (dtype, shape, start, end) in table.items()}
            tokens, _ = self._check_identity(meta, info.key)
            layout = _layout(meta)
            if checksum(layout, tokens, arrays) != meta[_CHECKSUM]:
                raise _Unusable("damaged (checksum mismatch)")
        except _DAMAGED as exc:
            raise _Unusable(f"damaged ({exc})") from exc
        return HostEntry(tokens, arrays, layout)


class _Unusable(Exception):
    """A file that exists but cannot be used; `reason` says why (for the scan's summary)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _NotRegular(Exception):
    """An entry name that is no regular file (a FIFO, socket, device or symlink): skipped and left alone."""


def _open_regular(path: Path) -> io.FileIO:
    """`path` open for reading, when it is a regular file; else `_NotRegular`, with nothing read.

    O_NONBLOCK makes the open of a FIFO or a device return at once (a plain
    open of a FIFO waits for a writer); O_NOFOLLOW refuses a symlink. A
    regular file ignores O_NONBLOCK, so reads then work as usual.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _NotRegular(path.name) from exc
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _NotRegular(path.name)
        return io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def _read_exactly(f: io.FileIO, n: int) -> bytes:
    data = f.read(n)
    if data is None or len(data) != n:
        raise ValueError(f"file ends after {len(data or b'')} of {n} bytes")
    return data


def _header_length(prefix: bytes, file_bytes: int) -> int:
    """The header length that the first 8 bytes state, if the file can hold it; else ValueError."""
    (n,) = struct.unpack("<Q", prefix)
    if n > min(_MAX_HEADER_BYTES, file_bytes - 8):
        raise ValueError(f"header of {n} bytes in a file of {file_bytes}")
    return int(n)


def _parse_header(header: bytes, data_bytes: int) -> tuple[dict[str, str], dict[str, tuple[np.dtype, tuple[int, ...], int, int]]]:
    """A safetensors header's metadata and its arrays (dtype, shape, start, end), checked as safetensors does.

    The arrays must tile the `data_bytes` after the header exactly, in
    order, each as long as its dtype and shape say; anything else raises
    ValueError (or KeyError, TypeError: the file is damaged).
    """
    table = json.loads(header)
    meta = table.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("header metadata is not a string map")
    arrays: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
    offset = 0
    # By (start, end): an empty array may share its start with the next one.
    for name, spec in sorted(table.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        dtype, shape = _NUMPY_DTYPES[spec["dtype"]], tuple(int(d) for d in spec["shape"])
        start, end = (int(o) for o in spec["data_offsets"])
        if start != offset or end - start != dtype.itemsize * math.prod(shape) or min(shape, default=0) < 0:
            raise ValueError(f"array {name}: offsets {start}..{end} do not fit dtype {dtype} and shape {shape}")
        arrays[name] = (dtype, shape, start, end)
        offset = end
    if offset != data_bytes:
        raise ValueError(f"arrays cover {offset} of {data_bytes} data bytes")
    return meta, arrays


def _header(arrays: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> bytes:
    """A safetensors header: the JSON table of arrays (sorted, contiguous) and metadata, padded to 8 bytes."""
    table: dict[str, object] = {"__metadata__": dict(meta)}
    offset = 0
    for name in sorted(arrays):
        a = arrays[name]
        if a.dtype not in _DTYPES or a.dtype.byteorder == ">":
            raise ValueError(f"array {name}: dtype {a.dtype} cannot be stored")
        table[name] = {"dtype": _DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(table, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _encode_tokens(tokens: Sequence[int]) -> dict[str, str]:
    """The metadata entry of `tokens`: int32 under "tokens", or int64 under "tokens64" when one does not fit."""
    wide = any(not _INT32[0] <= t <= _INT32[1] for t in tokens)
    raw = np.asarray(tokens, dtype="<i8" if wide else "<i4").tobytes()
    return {_WIDE_TOKENS if wide else _TOKENS: base64.b64encode(raw).decode("ascii")}


def _decode_tokens(meta: dict[str, str]) -> tuple[int, ...]:
    """Raises ValueError (binascii.Error) for bad base64 or a length that is not whole ints, KeyError if none."""
    wide = _WIDE_TOKENS in meta
    raw = base64.b64decode(meta[_WIDE_TOKENS] if wide else meta[_TOKENS], validate=True)
    return tuple(int(t) for t in np.frombuffer(raw, dtype="<i8" if wide else "<i4"))


def _layout(meta: Mapping[str, str]) -> dict[str, str]:
    """The metadata an entry's checksum covers besides tokens and arrays: its layout, and its start if it has one."""
    layout = {k: meta[k] for k in LAYOUT_KEYS}
    if START in meta:
        layout[START] = meta[START]
    return layout


def _unlink(path: Path) -> int:
    """Remove `path` if possible; 1 if it was removed. Never raises: a vanished directory is no error here."""
    try:
        path.unlink()
        return 1
    except OSError:
        return 0
