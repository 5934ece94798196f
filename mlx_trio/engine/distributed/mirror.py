"""Jobs as bytes: a lease job's function and arguments, with engine objects sent by key, not by value.

Every rank holds its own engine objects (rows, batches, caches: the KV of its shard). An object a
job returns gets the next key on every rank, in the same order (`keys_in`: a walk of the result
that is the same on every rank because the job is), so rank 0 can name it in a later job's
arguments and each follower finds its own copy. What crosses is therefore only what rank 0's Trio
side put in the arguments: token ids, parameters, request ids, keys. A callback into rank 0's
actors (a decode step's report) becomes a no-op on the followers: only rank 0 has a Trio side.

When rank 0's object is garbage collected its key is dropped (`LeaderMirror.take_dropped`, sent
with the next job), so the followers free their copies too.
"""

from __future__ import annotations

import enum
import io
import pickle
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

_PLAIN = (type(None), bool, int, float, complex, str, bytes, enum.Enum, range)
_CODE = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)
# Objects of these modules are engine state: by key or not at all, never copied by value.
_STATE_MODULES = ("mlx_lm.", "mlx_trio.engine.")


class NotMirrored(TypeError):
    """A job's argument is engine state that no earlier job returned: the followers have no copy of it."""


class Desynchronised(RuntimeError):
    """A follower's keys no longer match rank 0's: its jobs would not compute the same thing."""


def keys_in(result: Any) -> Iterator[Any]:
    """The objects of a job's result that get keys, in a fixed order.

    Containers (tuples, lists, dicts) and frozen attrs records are walked, not keyed: they are
    values, rebuilt on each rank from their parts. Everything else that is not a plain scalar
    is an engine object and gets a key.
    """
    if isinstance(result, _PLAIN) or isinstance(result, _CODE):
        return
    if isinstance(result, tuple) or type(result) is list:
        for item in result:
            yield from keys_in(item)
    elif type(result) is dict:  # not a dict subclass: an nn.Module is one, and it is an engine object
        for item in result.values():
            yield from keys_in(item)
    elif attrs.has(type(result)) and _frozen(type(result)):
        for field in attrs.fields(type(result)):
            yield from keys_in(getattr(result, field.name))
    else:
        yield result


def ignored(*_: Any, **__: Any) -> None:
    """What a callback into rank 0's actors is on a follower."""


class LeaderMirror:
    """Rank 0's side: which of its objects have keys; pickles jobs with them.

    Thread-safe: keys are made on the lease thread, dropped by the garbage collector on any thread.
    """

    def __init__(self) -> None:
        # Re-entrant: the collector may run a drop (a finalizer) on the thread that holds it.
        self._lock = threading.RLock()
        self._next = 0
        self._keys: dict[int, int] = {}  # id(object) -> key, while the object lives
        self._pinned: list[Any] = []  # objects without weak references: kept (and keyed) for good
        self._dropped: list[int] = []

    @property
    def next_key(self) -> int:
        return self._next

    def __len__(self) -> int:
        return len(self._keys)

    def add_result(self, result: Any) -> None:
        """Give a key to every new object `keys_in(result)` finds (after the job ran on this rank)."""
        for obj in keys_in(result):
            with self._lock:
                if id(obj) in self._keys:
                    continue
                key, self._next = self._next, self._next + 1
                self._keys[id(obj)] = key
            try:
                weakref.finalize(obj, self._drop, id(obj), key)
            except TypeError:
                self._pinned.append(obj)

    def key_of(self, obj: Any) -> int | None:
        with self._lock:
            return self._keys.get(id(obj))

    def take_dropped(self) -> list[int]:
        """The keys dropped since the last call: the followers free those copies."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def dumps(self, message: Any) -> bytes:
        """`message` pickled with engine objects by key.

        Raises:
          NotMirrored: it holds engine state without a key.
        """
        buffer = io.BytesIO()
        _LeaderPickler(buffer, self).dump(message)
        return buffer.getvalue()

    def _drop(self, object_id: int, key: int) -> None:
        with self._lock:
            if self._keys.get(object_id) == key:
                del self._keys[object_id]
            self._dropped.append(key)


class FollowerMirror:
    """A follower's side: its copy of every keyed object, found by the key rank 0 sends."""

    def __init__(self) -> None:
        self._next = 0
        self._objects: dict[int, Any] = {}
        self._key_of: dict[int, int] = {}  # id(object) -> key

    def __len__(self) -> int:
        return len(self._objects)

    def check(self, leader_next: int) -> None:
        """Raises `Desynchronised` unless this rank made exactly as many keys as rank 0."""
        if leader_next != self._next:
            raise Desynchronised(f"rank 0 has made {leader_next} keys, this rank {self._next}")

    def add_result(self, result: Any) -> None:
        for obj in keys_in(result):
            if id(obj) in self._key_of:
                continue
            key, self._next = self._next, self._next + 1
            self._objects[key] = obj
            self._key_of[id(obj)] = key

    def drop(self, keys: list[int]) -> None:
        for key in keys:
            obj = self._objects.pop(key, None)
            if obj is not None:
                del self._key_of[id(obj)]

    def loads(self, data: bytes) -> Any:
        return _FollowerUnpickler(io.BytesIO(data), self).load()

    def object(self, key: int) -> Any:
        try:
            return self._objects[key]
        except KeyError:
            raise Desynchronised(f"rank 0 named key {key}, which this rank does not hold") from None


class _LeaderPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, mirror: LeaderMirror) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._mirror = mirror

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _PLAIN) or isinstance(obj, _CODE):
            return None
        key = self._mirror.key_of(obj)
        if key is not None:
            return ("key", key)
        if isinstance(obj, types.MethodType) and self._mirror.key_of(obj.__self__) is None \
                and not _is_state(obj.__self__):
            return ("ignored",)  # a bound method of a rank-0 actor: its callback
        if _is_state(obj):
            raise NotMirrored(f"a {type(obj).__module__}.{type(obj).__qualname__} that no lease job returned "
                              "cannot be named to the followers")
        return None


class _FollowerUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, mirror: FollowerMirror) -> None:
        super().__init__(file)
        self._mirror = mirror

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "key":
            return self._mirror.object(pid[1])
        return ignored


def _is_state(obj: Any) -> bool:
    if isinstance(obj, (mx.array, nn.Module)):
        return True
    cls = type(obj)
    if attrs.has(cls) and _frozen(cls):
        return False
    return cls.__module__.startswith(_STATE_MODULES) and not isinstance(obj, enum.Enum)


def _frozen(cls: type) -> bool:
    params = getattr(cls, "__attrs_attrs__", None)
    return params is not None and getattr(cls.__setattr__, "__name__", "") == "_frozen_setattrs"

