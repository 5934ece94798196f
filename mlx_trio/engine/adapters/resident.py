"""The adapters a model serves: the known ones, the `--max-loras` resident in slots (LRU), and who uses which.

`ResidentAdapters` owns the model's `RowLoraLinear` wrappers (installed the
first time an adapter touches a layer; never without an adapter, so a server
without `--lora-modules` runs the plain model) and their slots. A row takes
its adapter with `acquire` when its prefill starts (a lease job: an adapter
not resident is written into a free slot, or into the least recently used
one no row holds) and gives it back with `AdapterUse.release` when it ends.
A slot a row holds is never overwritten, so a running row's adapter never
changes under it, and loading one costs one lease job (a few small copies):
the running rows wait at most that one job.

`names` (a tuple replaced, never mutated), `revisions` (a mapping replaced,
never mutated) and `statistics` are for the Trio side;
every other method runs on the lease thread.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlx_trio.engine.adapters.adapter_files import AdapterWeights, linear_dims, read_adapter
from mlx_trio.engine.adapters.row_lora import LayerSlots, PerRow, RowLoraLinear, RowSelection, base_weight, choice_of
from mlx_trio.config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS
from mlx_trio.errors import AdapterError, Overloaded



@attrs.define(eq=False)
class AdapterUse:
    """A row's hold on a resident adapter's slot; `release` (idempotent) gives it back."""

    owner: ResidentAdapters
    name: str
    slot: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.owner.release(self.slot)


class ResidentAdapters:
    """The model's adapters by name, `max_loras` of them resident in slots 1..max_loras (slot 0: the base)."""

    def __init__(self, model: nn.Module, *, max_loras: int = DEFAULT_MAX_LORAS,
                 max_rank: int = DEFAULT_MAX_LORA_RANK) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_rank must be at least 1")
        self._model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.selection = RowSelection()
        self._known: dict[str, AdapterWeights] = {}
        self.names: tuple[str, ...] = ()
        # name -> the revision served under it: the root of its rows' KV blocks, read off the lease thread.
        self.revisions: Mapping[str, str] = MappingProxyType({})
        self._layers: dict[str, RowLoraLinear] = {}
        # _slot_of[name] = slot, _in_slot[slot] = name; _holds[slot] = rows holding it.
        self._slot_of: dict[str, int] = {}
        self._in_slot: dict[int, str] = {}
        self._holds: collections.Counter[int] = collections.Counter()
        self._recent: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU order of filled slots

    def statistics(self) -> dict[str, object]:
        """Plain data for `Engine.status()`: what is served, what is resident, and how many rows hold each."""
        return {"served": list(self.names), "max_loras": self.max_loras, "max_lora_rank": self.max_rank,
                "resident": {name: self._holds[slot] for name, slot in dict(self._slot_of).items()}}

    def revision(self, name: str) -> str:
        return self._known[name].revision

    def known(self, name: str) -> AdapterWeights | None:
        return self._known.get(name)

    def load(self, name: str, path: str) -> AdapterWeights:
        """Read the adapter at `path` (checked against this model) and serve it as `name`; raises `AdapterError`."""
        weights = read_adapter(name, path, self.base_modules(), max_rank=self.max_rank)
        self.register(weights)
        return weights

    def base_modules(self) -> dict[str, nn.Module]:
        """The model's modules by path, the wrapped layers as the base model has them (their `linear`)."""
        modules = dict(self._model.named_modules())
        for path, layer in self._layers.items():
            modules[path] = layer.linear
            modules.pop(f"{path}.linear", None)
        return modules

    def register(self, weights: AdapterWeights) -> None:
        """Serve `weights` under its name (replacing an older revision no row holds); not resident until acquired."""
        if weights.rank > self.max_rank:
            raise AdapterError(f"adapter {weights.name!r}: rank {weights.rank} is over --max-lora-rank {self.max_rank}")
        if self.in_use(weights.name):
            raise AdapterError(f"adapter {weights.name!r} is in use by running requests; unload it first")
        self._evict(weights.name)
        self._known[weights.name] = weights
        self._published()

    def unregister(self, name: str) -> None:
        """Stop serving `name`; its slot is freed. The caller waits until no row holds it (`in_use`)."""
        if self.in_use(name):
            raise AdapterError(f"adapter {name!r} is in use by running requests")
        self._evict(name)
        self._known.pop(name, None)
        self._published()

    def _published(self) -> None:
        """Replace what the Trio side reads (never mutated in place: a reader sees the old or the new whole)."""
        self.names = tuple(self._known)
        self.revisions = MappingProxyType({name: weights.revision for name, weights in self._known.items()})

    def in_use(self, name: str) -> bool:
        slot = self._slot_of.get(name)
        return slot is not None and self._holds[slot] > 0

    def can_hold(self, names: Sequence[str]) -> bool:
        """Whether rows of all these adapters could hold slots at once now (an unknown name: yes, it fails
        at `acquire`). Read by the Trio side to hold back a request until a slot is free."""
        wanted = {name for name in names if name in self._known}
        needed = sum(1 for name in wanted if name not in self._slot_of)
        free = self.max_loras - len(self._in_slot)
        idle = sum(1 for slot, name in dict(self._in_slot).items() if self._holds[slot] == 0 and name not in wanted)
        return needed <= free + idle

    def acquire(self, name: str) -> AdapterUse:
        """Hold `name`'s slot for a row, writing it into one first if it is not resident (one lease job)."""
        weights = self._known.get(name)
        if weights is None:
            raise AdapterError(f"adapter {name!r} is not loaded")
        slot = self._slot_of.get(name)
        if slot is None:
            slot = self._free_slot()
            self._write(slot, weights)
            self._slot_of[name], self._in_slot[slot] = slot, name
        self._holds[slot] += 1
        self._recent[slot] = None
        self._recent.move_to_end(slot)
        return AdapterUse(self, name, slot)

    def release(self, slot: int) -> None:
        self._holds[slot] -= 1

    def _free_slot(self) -> int:
        for slot in range(1, self.max_loras + 1):
            if slot not in self._in_slot:
                return slot
        for slot in self._recent:  # least recently used first
            if self._holds[slot] == 0:
                self._evict(self._in_slot[slot])
                return slot
        raise Overloaded(f"all {self.max_loras} adapter slots (--max-loras) hold adapters of running requests; "
                         "retry when one finishes")

    def _evict(self, name: str) -> None:
        slot = self._slot_of.pop(name, None)
        if slot is None:
            return
        del self._in_slot[slot]
        self._recent.pop(slot, None)
        for layer in self._layers.values():
            layer.slots.put(slot, None, 0.0, None)

    def _write(self, slot: int, weights: AdapterWeights) -> None:
        """Put `weights` in `slot` of every wrapped layer (wrapping the layers it is the first to touch)."""
        for path in weights.layers:
            if path not in self._layers:
                self._wrap(path, weights)
        for path, layer in self._layers.items():
            delta = weights.layers.get(path)
            weight = base_weight(layer.linear) if delta is not None and delta.m is not None else None
            layer.slots.put(slot, delta, weights.scale, weight)
        mx.eval([layer.slots.arrays() for layer in self._layers.values()])

    def _wrap(self, path: str, weights: AdapterWeights) -> None:
        modules = dict(self._model.named_modules())
        base = modules[path]
        dims = linear_dims(base)
        assert dims is not None, f"{path} was checked to be a Linear when {weights.name!r} was read"
        slots = LayerSlots(self.max_loras + 1, dims[0], dims[1], self.max_rank, weights.layers[path].a.dtype)
        wrapper = RowLoraLinear(base, self.selection, slots)
        self._model.update_modules(tree_unflatten([(path, wrapper)]))
        self._layers[path] = wrapper

    def choice(self, uses: Sequence[AdapterUse | None]) -> int | PerRow | None:
        """The selection for rows holding `uses` (None: a base row), in batch order."""
        return choice_of([use.slot if use is not None else 0 for use in uses])
