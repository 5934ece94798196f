"""Copy mlx-lm prompt caches to the host (`to_host`) and rebuild them from it (`from_host`).

Both run on the lease thread: they are the only MLX work of the SSD tier, so
the lease is held just for evaluating and copying arrays; file IO happens on
a worker thread (engine/prompt_cache/ssd_files.py). The state of each cache is mlx-lm's
own (`state` / `from_state`, as `save_prompt_cache` uses), written as an
explicit JSON tree rather than a dotted flattening, so empty lists and
`None` leaves come back exactly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import cache as mlx_cache
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache, make_prompt_cache

from mlx_trio.engine.prompt_cache.identity import cache_layout
from mlx_trio.engine.prompt_cache.host_entry import CLASSES, STATES, HostEntry

_ARRAY = "array"  # a state tree node {"array": name} stands for arrays[name]
_SCALARS = (int, float, bool, str, type(None))


def to_host(caches: Sequence[Any], tokens: Sequence[int]) -> HostEntry:
    """Evaluate `caches` and copy their state into a `HostEntry` holding `tokens`. Lease thread.

    Reads the caches, never changes them. A `KVCache` is cut to its `offset`
    (its buffer grows in steps of 256 positions, the tail holds nothing). Raises
    ValueError when a layer's `offset` is not `len(tokens)` (the entry would be
    stored under the wrong key), or for a state leaf that is neither an array
    nor a plain scalar.
    """
    _check_offsets(caches, len(tokens))
    states = [_compact_state(c) for c in caches]
    mx.eval([leaf for s in states for leaf in _leaves(s) if isinstance(leaf, mx.array)])
    arrays: dict[str, np.ndarray] = {}

    def encode(node: Any, layer: int) -> Any:
        if isinstance(node, mx.array):
            name = f"{layer}.{len(arrays)}"  # unique, and says which layer it belongs to
            if node.dtype == mx.bfloat16:  # numpy has no bfloat16: keep the bits, tag the dtype
                arrays[name] = np.array(node.view(mx.uint16))
                return {_ARRAY: name, "dtype": "bfloat16"}
            arrays[name] = np.array(node)
            return {_ARRAY: name}
        if isinstance(node, (list, tuple)):
            return [encode(child, layer) for child in node]
        if isinstance(node, _SCALARS):
            return node
        raise ValueError(f"cache state of layer {layer} holds an unserialisable {type(node).__name__}")

    trees = [encode(state, i) for i, state in enumerate(states)]
    meta = {CLASSES: json.dumps([type(c).__name__ for c in caches]), STATES: json.dumps(trees)}
    return HostEntry(tuple(tokens), arrays, meta)


@attrs.frozen
class CacheShapes:
    """What the model's caches hold: per layer, its class name and each state array's dtype and shape.

    The token axis (-2 of arrays of 3 or more dimensions: mlx-lm's caches are
    [batch, heads, tokens, head_dim]) is -1, since entries differ there. An
    entry that passed its checksum can still not fit (written by a build
    whose model differs in head_dim, layer count or dtype under the same
    files): `from_host` compares it with these before it is used.
    """

    layers: tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]], ...]
    layout: str  # `model_cache_layout` of the same caches: the class names and the KV format
    # With quantized KV, a layer may also hold the quantized form of its cache (an entry stored after
    # its row converted): per layer, that form's shapes, or None where a layer never converts.
    quantized: tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]] | None, ...] = ()

    @classmethod
    def of(cls, caches: Sequence[Any]) -> CacheShapes:
        return cls(tuple((type(c).__name__, tuple((str(a.dtype), _free_token_axis(a.shape)) for a in _arrays(c)))
                         for c in caches), cache_layout(caches))

    def mismatch(self, caches: Sequence[Any]) -> str | None:
        """Why `caches` do not fit the model, or None when they do."""
        got = CacheShapes.of(caches).layers
        if len(got) != len(self.layers):
            return f"{len(got)} layers, the model has {len(self.layers)}"
        for i, (have, want) in enumerate(zip(got, self.layers)):
            if have != want and not (self.quantized and have == self.quantized[i]):
                return f"layer {i} holds {have}, the model's caches {want}"
        return None


def cache_shapes(model: nn.Module, kv_format: str = "", quantize: tuple[int, int] | None = None) -> CacheShapes:
    """The `CacheShapes` of `model`'s caches after one token. Lease thread; lazy, so nothing is computed.

    `kv_format` is `KvScheme.key()` (see `model_cache_layout`); `quantize` its (bits, group size)
    when KV is quantized, so entries stored in the quantized form fit too.
    """
    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    plain = CacheShapes.of(caches)
    layout = f"{plain.layout};{kv_format}" if kv_format else plain.layout
    quantized: tuple[Any, ...] = ()
    if quantize is not None:
        bits, group_size = quantize
        quantized = tuple(CacheShapes.of([c.to_quantized(group_size=group_size, bits=bits)]).layers[0]
                          if type(c) is KVCache else None for c in caches)
    return attrs.evolve(plain, layout=layout, quantized=quantized)


def from_host(entry: HostEntry, shapes: CacheShapes | None = None) -> list[Any]:
    """Rebuild the mlx-lm caches of `entry` with each class's `from_state`; evaluated. Lease thread.

    Raises ValueError (or KeyError, TypeError) when the metadata does not
    describe a valid list of mlx-lm caches, e.g. a class that is not one,
    or when they do not match `shapes` (the model's, see `cache_shapes`).
    """
    classes = json.loads(entry.meta[CLASSES])
    trees = json.loads(entry.meta[STATES])
    if not isinstance(classes, list) or not isinstance(trees, list) or len(classes) != len(trees):
        raise ValueError("cache metadata: classes and states differ in length")

    def decode(node: Any) -> Any:
        if isinstance(node, dict):
            array = mx.array(entry.arrays[node[_ARRAY]])
            return array.view(mx.bfloat16) if node.get("dtype") == "bfloat16" else array
        if isinstance(node, list):
            return [decode(child) for child in node]
        return node

    caches = [_cache_class(name).from_state(decode(tree)) for name, tree in zip(classes, trees)]
    _check_offsets(caches, len(entry.tokens))
    wrong = shapes.mismatch(caches) if shapes is not None else None
    if wrong is not None:
        raise ValueError(f"the entry does not fit this model's caches: {wrong}")
    mx.eval([a for c in caches for a in _arrays(c)])
    return caches


def model_cache_layout(model: nn.Module, kv_format: str = "") -> str:
    """`cache_layout` of the caches mlx-lm makes for `model` (empty: no arrays), and the KV format. Lease thread.

    `kv_format` is `KvScheme.key()` (engine/kv/kv_scheme.py), so that a server restarted with other
    `--kv-bits`, group size or start misses every file stored under the old one; bf16's is "" and adds
    nothing: its layouts are what they were.
    """
    layout = cache_layout(make_prompt_cache(model))
    return f"{layout};{kv_format}" if kv_format else layout


def _compact_state(cache: Any) -> Any:
    if type(cache) is KVCache and cache.keys is not None and cache.keys.shape[2] > cache.offset:
        n = cache.offset
        return cache.keys[..., :n, :], cache.values[..., :n, :], n
    if type(cache) is QuantizedKVCache and cache.keys is not None and cache.keys[0].shape[2] > cache.offset:
        # Stored as quantized, cut to its offset like a KVCache: packed values, scales and biases as they are.
        n = cache.offset
        keys, values = tree_map(lambda x: x[..., :n, :], (cache.keys, cache.values))
        return keys, values, n, cache.group_size, cache.bits
    return cache.state


def _check_offsets(caches: Sequence[Any], num_tokens: int) -> None:
    # Layers that count positions must hold exactly the entry's tokens (recurrent state has no count).
    wrong = [i for i, c in enumerate(caches) if getattr(c, "offset", num_tokens) != num_tokens]
    if wrong:
        raise ValueError(f"layer {wrong[0]} holds {caches[wrong[0]].offset} positions, the entry {num_tokens} tokens")


def _cache_class(name: Any) -> type:
    # Only mlx-lm's own cache classes: a damaged file must not name anything else in that module.
    cls = getattr(mlx_cache, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, _BaseCache)):
        raise ValueError(f"cache metadata names {name!r}, not an mlx-lm cache class")
    return cls


def _arrays(cache: Any) -> list[mx.array]:
    return [leaf for leaf in _leaves(cache.state) if isinstance(leaf, mx.array)]


def _free_token_axis(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(-1 if len(shape) >= 3 and axis == len(shape) - 2 else n for axis, n in enumerate(shape))


def _leaves(node: Any) -> list[Any]:
    if isinstance(node, (list, tuple)):
        return [leaf for child in node for leaf in _leaves(child)]
    return [node]
