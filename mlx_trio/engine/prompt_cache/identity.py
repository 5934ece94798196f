"""What makes a prompt-cache entry on disk usable by this server: model, tokenizer, cache layout.

A stored KV cache is only valid for the exact weights that computed it, fed
token ids that mean the same text, into the same per-layer cache classes.
`CacheIdentity` names those three facts (plus our file-format version); the
SSD tier (engine/prompt_cache/ssd_files.py) writes it into every file and drops files
whose identity differs. Plain files and hashlib only: no MLX here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

# Bump when the file layout written by engine/prompt_cache/ssd_files.py changes: older files are then removed at scan.
FORMAT_VERSION = 1

# Files whose bytes decide what a token id means. tokenizer_config.json is in on purpose: its
# added_tokens_decoder defines special tokens (a changed chat template also invalidates, harmlessly).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model")
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")
# Sampled windows per weight file: a fine-tune keeps every size and shape but changes many weights.
# 256 spread windows (1 MiB read per file) miss one that retrained a tenth of a file with odds
# 0.9**256 ~ 2e-12, without reading gigabytes at startup.
_SAMPLES_PER_FILE = 256
_SAMPLE_BYTES = 4096


@attrs.frozen
class CacheIdentity:
    """The facts a stored entry must share with this server to be restored."""

    model_hash: str  # `model_identity` of the model directory (config + sampled weights)
    tokenizer_hash: str  # `tokenizer_identity` of the same directory
    layout: str  # `cache_layout` of the model's fresh caches, e.g. "KVCache*4"
    format_version: int = FORMAT_VERSION

    def to_metadata(self) -> dict[str, str]:
        return {"model": self.model_hash, "tokenizer": self.tokenizer_hash, "layout": self.layout,
                "format": str(self.format_version)}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> CacheIdentity:
        """Raises KeyError or ValueError when a field is missing or malformed."""
        return cls(meta["model"], meta["tokenizer"], meta["layout"], int(meta["format"]))

    def key(self, tokens: Sequence[int], start: int = 0) -> str:
        """The entry key (and file name stem) of `tokens` under this identity: 32 hex digits. `start`: where the
        entry's arrays begin (a run of paged KV blocks, which shares its tokens with a longer run of the chain)."""
        h = hashlib.sha256(json.dumps(self.to_metadata(), sort_keys=True).encode())
        h.update(b"\0")
        h.update(",".join(map(str, tokens)).encode())
        if start:
            h.update(f"\0start={start}".encode())
        return h.hexdigest()[:32]


def identity_of_directory(path: str | Path, layout: str) -> CacheIdentity:
    """The `CacheIdentity` of the model directory `path` whose caches have `layout`. Raises OSError."""
    return CacheIdentity(model_identity(path), tokenizer_identity(path), layout)


def model_identity(path: str | Path) -> str:
    """sha256 of a model directory's config.json and its weight files' names, sizes and sampled bytes.

    Reads 1 MiB per weight file, so it is cheap at startup for any model
    size. Raises OSError when the directory cannot be read.
    """
    root = Path(path)
    h = hashlib.sha256()
    config = root / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for weights in sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)):
        size = weights.stat().st_size
        h.update(f"\0{weights.name}\0{size}\0".encode())
        with weights.open("rb") as f:
            for i in range(_SAMPLES_PER_FILE):
                f.seek(max(0, size - _SAMPLE_BYTES) * i // (_SAMPLES_PER_FILE - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def tokenizer_identity(path: str | Path) -> str:
    """sha256 of the tokenizer files present in a model directory (names and full contents)."""
    root = Path(path)
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        file = root / name
        if file.is_file():
            h.update(f"\0{name}\0".encode())
            h.update(file.read_bytes())
    return h.hexdigest()


def cache_layout(caches: Sequence[Any]) -> str:
    """The per-layer cache class names, runs collapsed: "KVCache*4", "RotatingKVCache,KVCache"."""
    runs: list[list[Any]] = []
    for name in (type(c).__name__ for c in caches):
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return ",".join(name if n == 1 else f"{name}*{n}" for name, n in runs)
