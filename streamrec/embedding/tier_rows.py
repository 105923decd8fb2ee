"""One tier's rows on one device: hash index + weights + optimizer state + last-seen clock.

The DRAM tier is a growable ``RowStorage`` on the CPU; the GPU cache is a fixed-size
one on CUDA. Rows live at a slot; the index maps key -> slot; freed slots are reused.

A growable tier's row arrays past the slots in use are left uninitialised (nothing reads
a slot past ``high_water``), so its capacity costs memory only as rows are written: a
DRAM budget can be reserved up front without being paid for until it fills, and without
copies as it fills. A *mapped* tier (the DRAM tier under a GPU cache, host_memory.py) is
the exception: its arrays are locked in RAM when allocated. Its index starts small and
grows with the rows.
"""

from __future__ import annotations

import torch

from streamrec.embedding import kernels
from streamrec.embedding.hash_index import HashIndex
from streamrec.embedding.host_memory import mapped_empty


class TierFull(RuntimeError):
    """A fixed-capacity tier has no free slot left (the caller must evict first)."""


class RowStorage:
    def __init__(self, dim: int, state_dim: int, device: torch.device | str, capacity: int, growable: bool,
                 index_keys: int | None = None, mapped: bool = False) -> None:
        """``index_keys``: the most keys the tier holds (a budgeted tier): its index is sized
        for them once and never grows (budget.py counts it so); None: it grows with the rows.
        ``mapped``: a host tier whose index, weights, state and clocks GPU kernels read and
        write in place (the DRAM tier under a GPU cache: misses never round-trip the host)."""
        self.dim, self.state_dim = dim, state_dim
        self.device = torch.device(device)
        self.growable = growable
        self.mapped = mapped
        self.index = (HashIndex(index_keys, self.device, fixed=True, mapped=mapped) if index_keys
                      else HashIndex(min(capacity, 1024), self.device, mapped=mapped))
        rows = torch.empty if growable else torch.zeros
        self.weights, self.state, self.last_seen = self._row_arrays(capacity)
        self.keys = rows(capacity, dtype=torch.int64, device=self.device)
        self.live = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        # 1 = the row differs from (or has no) copy in the tier below; the GPU cache writes
        # back only dirty rows on eviction (int8: kernels store to it)
        self.dirty = torch.zeros(capacity, dtype=torch.int8, device=self.device)
        # the GPU cache's pointer to each row's DRAM copy (-1: none), so eviction writes back
        # by slot without probing the DRAM index; the DRAM tier (growable) has nothing below it
        # that is addressed by slot, so it keeps none (its capacity would pay for it up front)
        self.below = torch.full((0 if growable else capacity,), -1, dtype=torch.int64, device=self.device)
        self._free = torch.empty(0, dtype=torch.int64, device=self.device)
        self._high_water = 0

    def _row_arrays(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights, state, last_seen) for ``capacity`` rows: zeros on a fixed tier, left
        uninitialised on a growable one, mapped for the GPU on a mapped one (see the module
        docstring)."""
        shapes = ((capacity, self.dim), (capacity, self.state_dim), (capacity,))
        dtypes = (torch.float32, torch.float32, torch.int64)
        if self.mapped:
            return tuple(mapped_empty(shape, dtype) for shape, dtype in zip(shapes, dtypes))
        make = torch.empty if self.growable else torch.zeros
        return tuple(make(shape, dtype=dtype, device=self.device) for shape, dtype in zip(shapes, dtypes))

    @property
    def capacity(self) -> int:
        return self.weights.shape[0]

    def __len__(self) -> int:
        return self._high_water - len(self._free)

    @property
    def high_water(self) -> int:
        """Slots ever used: every live row sits below it."""
        return self._high_water

    def slots_of(self, keys: torch.Tensor) -> torch.Tensor:
        return self.index.lookup(keys)

    def add(self, keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, last_seen: torch.Tensor,
            dirty: bool | torch.Tensor = False, below: torch.Tensor | None = None) -> torch.Tensor:
        """Store rows for keys that are not present (unique); returns their slots. Host
        tensors in pinned memory are copied without blocking."""
        slots = self._take_slots(len(keys))
        if len(slots) == 0:
            return slots
        self.weights.index_copy_(0, slots, weights.to(self.device, non_blocking=True))
        self.state.index_copy_(0, slots, state.to(self.device, non_blocking=True))
        self.last_seen.index_copy_(0, slots, last_seen.to(self.device, non_blocking=True))
        self._place(keys, slots, dirty, below)
        return slots

    def add_from(self, keys: torch.Tensor, source: "RowStorage", source_slots: torch.Tensor) -> torch.Tensor:
        """Store copies of ``source``'s rows at ``source_slots`` (a mapped host tier) for
        absent, unique ``keys``, by one kernel that reads them where they are; the copies are
        clean and point at their source slot. Returns their slots."""
        slots = self._take_slots(len(keys))
        if len(slots):
            kernels.copy_rows(source, source_slots, self, slots)
            self._place(keys, slots, False, source_slots)
        return slots

    def _take_slots(self, n: int) -> torch.Tensor:
        """Slots for ``n`` new rows (free list first), growing a growable tier."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        fresh = n - min(n, len(self._free))
        if self.growable and self._high_water + fresh > self.capacity:
            self._grow(max(2 * self.capacity, self._high_water + fresh))
        slots = self.free_slots(n)  # a full fixed tier raises TierFull here, before anything is taken
        self.claim(n)
        return slots

    def _place(self, keys: torch.Tensor, slots: torch.Tensor, dirty: bool | torch.Tensor, below: torch.Tensor | None) -> None:
        """Everything of a new row but its values: key, liveness, dirty bit, DRAM slot, index entry."""
        self.keys.index_copy_(0, slots, keys.to(self.device, non_blocking=True))
        if below is not None:
            self.below.index_copy_(0, slots, below.to(self.device, non_blocking=True))
        self.live[slots] = True
        if isinstance(dirty, torch.Tensor):
            self.dirty[slots] = dirty.to(self.device, torch.int8)
        else:
            self.dirty[slots] = int(dirty)
        self.index.insert(keys, slots)

    def free_slots(self, n: int) -> torch.Tensor:
        """The slots the next ``n`` rows would take (free list first), without taking them:
        a kernel creating rows takes a prefix of them, then ``claim`` records how many."""
        reuse = self._free[:n]
        fresh = n - len(reuse)
        if self._high_water + fresh > self.capacity:
            raise TierFull(f"tier on {self.device} holds {self.capacity} rows and has room for {self.capacity - len(self)}")
        new = torch.arange(self._high_water, self._high_water + fresh, device=self.device)
        return torch.cat([reuse, new]) if len(reuse) else new  # (a launch less per table and step)

    def claim(self, n: int) -> None:
        """Record that the first ``n`` of ``free_slots`` now hold rows."""
        reused = min(n, len(self._free))
        self._free = self._free[reused:]
        self._high_water += n - reused

    def pop(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove present keys; returns (keys, weights, state, last_seen) of those removed."""
        slots = self.index.lookup(keys)
        found = slots >= 0
        slots = slots[found]
        out = (keys.to(self.device)[found], self.weights[slots].clone(), self.state[slots].clone(), self.last_seen[slots].clone())
        self.discard(out[0])
        return out

    def discard(self, keys: torch.Tensor) -> None:
        """Remove present keys without reading their rows (a key given twice is freed once)."""
        slots = self.index.remove(torch.unique(keys))
        slots = slots[slots >= 0]
        self.live[slots] = False
        self.dirty[slots] = 0
        if not self.growable:
            self.below[slots] = -1
        self._free = torch.cat([self._free, slots])

    def coldest_slots(self, n: int, protect: torch.Tensor | None = None) -> torch.Tensor:
        """Slots of the ``n`` least recently seen rows, never those in ``protect`` (slots)."""
        seen = torch.where(self.live, self.last_seen, torch.iinfo(torch.int64).max)
        if protect is not None and len(protect):
            seen[protect] = torch.iinfo(torch.int64).max
        n = min(n, int(self.live.sum()) - (len(protect) if protect is not None else 0))
        if n <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.topk(seen[: self._high_water], n, largest=False).indices

    def live_slots(self) -> torch.Tensor:
        return torch.nonzero(self.live[: self._high_water]).squeeze(1)

    def _grow(self, capacity: int) -> None:
        if self.mapped:  # the old arrays are unregistered once replaced: no kernel may still use them
            torch.cuda.synchronize()
        used = self._high_water

        def carried(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
            new[:used] = old[:used]
            return new

        olds = (self.weights, self.state, self.last_seen)
        self.weights, self.state, self.last_seen = (carried(new, old) for new, old in zip(self._row_arrays(capacity), olds))
        self.keys = carried(torch.empty(capacity, dtype=torch.int64, device=self.device), self.keys)
        self.live, self.dirty = (carried(torch.zeros(capacity, dtype=t.dtype, device=self.device), t) for t in (self.live, self.dirty))
