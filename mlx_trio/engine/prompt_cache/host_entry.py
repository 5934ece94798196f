"""`HostEntry`: a prompt-cache entry copied off the device, as numpy arrays plus metadata.

The bridge between the two halves of the SSD tier: `engine/prompt_cache/host_cache.py`
makes one from mlx-lm caches on the lease thread (and back), and
`engine/prompt_cache/ssd_files.py` writes and reads one on any thread. Numpy owns the
bytes, so a `HostEntry` may cross threads freely. No MLX here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import attrs
import numpy as np

# The metadata keys a HostEntry carries (engine/prompt_cache/host_cache.py writes them; the file store keeps them):
CLASSES = "classes"  # JSON list: the mlx-lm cache class name of each layer
STATES = "states"  # JSON list: each layer's `state` tree, arrays replaced by {"array": name[, "dtype"]}
LAYOUT_KEYS = (CLASSES, STATES)
# Optional: the first position the arrays hold, when they are not a whole prefix (a run of paged KV blocks,
# engine/kv/blocks/block_files.py); absent, 0.
START = "start"


@attrs.frozen(eq=False)  # numpy arrays have no boolean ==: compare with `same_entry`
class HostEntry:
    """One cached prefix on the host: the tokens its caches hold, and their state as numpy arrays."""

    tokens: tuple[int, ...]
    arrays: Mapping[str, np.ndarray]  # flattened cache state; bfloat16 arrays are stored as uint16 views
    meta: Mapping[str, str]  # LAYOUT_KEYS: how `arrays` rebuild the per-layer caches
    nbytes: int = attrs.field()  # bytes of `arrays`

    @nbytes.default
    def _nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def checksum(meta: Mapping[str, str], tokens: tuple[int, ...], arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over the layout metadata, the tokens and every array's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for key in sorted(meta):
        h.update(f"{key}\0{meta[key]}\0".encode())
    h.update(",".join(map(str, tokens)).encode())
    for name in sorted(arrays):
        a = np.asarray(arrays[name], order="C")  # ascontiguousarray would make 0-d arrays 1-d
        h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.reshape(-1).view(np.uint8))  # no copy; hashlib drops the GIL on large buffers
    return h.hexdigest()


def same_entry(a: HostEntry, b: HostEntry) -> bool:
    """Whether two entries hold the same tokens, metadata and bit-identical arrays."""
    return (a.tokens == b.tokens and dict(a.meta) == dict(b.meta) and a.arrays.keys() == b.arrays.keys()
            and all(a.arrays[k].dtype == b.arrays[k].dtype and a.arrays[k].shape == b.arrays[k].shape
                    and a.arrays[k].tobytes() == b.arrays[k].tobytes() for k in a.arrays))
