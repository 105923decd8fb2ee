"""Entity id -> dense slot, for the online feature state (serving/features/entity_store.py).

An open-addressing hash table in numpy (linear probing, load at most 1/2) whose buckets
hold slot numbers; the slots' ids live in :attr:`IdIndex.ids`. A batch of ids (a request
batch's users, a snapshot's rows) is looked up or inserted with a few numpy passes, not
per-id Python; a single id (a topic record) probes in Python. Slots are never freed:
an entity, once seen, stays. About 16 bytes per entity (8 for its id, 4 per bucket).
"""

from __future__ import annotations

import numpy as np

from streamrec.serving.features.growth import grown

_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing's multiplier (2**64 / golden ratio)
_MASK64 = 2**64 - 1
EMPTY = -1


class IdIndex:
    """Ids (int64) -> slots 0..n-1, in the order they were added."""

    def __init__(self, capacity: int = 1024) -> None:
        self.n = 0
        self.ids = np.empty(max(capacity, 16), np.int64)
        self._bits = 0
        self._table = np.empty(0, np.int32)
        self._resize(max(capacity, 16))

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        """Bytes in use (the ids' spare capacity is never touched: not resident)."""
        return 8 * self.n + self._table.nbytes

    # ------------------------------------------------------------------ one id
    def get(self, entity_id: int) -> int:
        """The slot of ``entity_id``, or -1."""
        table, ids, mask = self._table, self.ids, len(self._table) - 1
        b = (((entity_id & _MASK64) * _MIX) & _MASK64) >> (64 - self._bits)
        while True:
            slot = int(table[b])
            if slot == EMPTY or ids[slot] == entity_id:
                return slot
            b = (b + 1) & mask

    def add(self, entity_id: int) -> int:
        """The slot of ``entity_id``, a new one if it has none."""
        if 2 * (self.n + 1) > len(self._table):
            self._resize(self.n + 1)
        table, ids, mask = self._table, self.ids, len(self._table) - 1
        b = (((entity_id & _MASK64) * _MIX) & _MASK64) >> (64 - self._bits)
        while True:
            slot = int(table[b])
            if slot == EMPTY:
                break
            if ids[slot] == entity_id:
                return slot
            b = (b + 1) & mask
        slot = self.n
        if slot == len(self.ids):
            self.ids = grown(self.ids, slot + 1)
        self.ids[slot] = entity_id
        table[b] = slot
        self.n += 1
        return slot

    # ------------------------------------------------------------------ many ids
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slots of ``ids`` (int64), -1 where absent."""
        ids = np.ascontiguousarray(ids, np.int64)
        out = np.full(len(ids), EMPTY, np.int64)
        mask = len(self._table) - 1
        pending = np.arange(len(ids))
        buckets = self._buckets(ids)
        while len(pending):
            slots = self._table[buckets].astype(np.int64)
            occupied = slots != EMPTY
            found = occupied & (self.ids[np.where(occupied, slots, 0)] == ids[pending])
            out[pending[found]] = slots[found]
            go_on = occupied & ~found
            pending, buckets = pending[go_on], (buckets[go_on] + 1) & mask
        return out

    def add_new(self, ids: np.ndarray) -> np.ndarray:
        """Slots for ``ids``, none of which is in the index and no two equal (the caller
        checks): n..n+len-1, in order."""
        ids = np.ascontiguousarray(ids, np.int64)
        first, k = self.n, len(ids)
        if 2 * (first + k) > len(self._table):
            self._resize(first + k)
        if first + k > len(self.ids):
            self.ids = grown(self.ids, first + k)
        self.ids[first: first + k] = ids
        self.n = first + k
        self._place(np.arange(first, first + k, dtype=np.int64), self._buckets(ids))
        return np.arange(first, first + k, dtype=np.int64)

    def reserve(self, entities: int) -> None:
        """A table for ``entities`` in all (no rehash while that many are added)."""
        self._resize(entities)

    def clear(self) -> None:
        self.n = 0
        self._table[:] = EMPTY

    # ------------------------------------------------------------------ internals
    def _buckets(self, ids: np.ndarray) -> np.ndarray:
        mixed = ids.view(np.uint64) * np.uint64(_MIX)
        return (mixed >> np.uint64(64 - self._bits)).astype(np.int64)

    def _place(self, slots: np.ndarray, buckets: np.ndarray) -> None:
        """Put ``slots`` into the table from their home ``buckets`` on (linear probing): per
        round, each pending slot claims its bucket if empty; of several claiming one bucket
        the last write stays, the others move on."""
        table, mask = self._table, len(self._table) - 1
        while len(slots):
            free = table[buckets] == EMPTY
            table[buckets[free]] = slots[free]
            placed = free.copy()
            placed[free] = table[buckets[free]] == slots[free]
            slots, buckets = slots[~placed], (buckets[~placed] + 1) & mask

    def _resize(self, entities: int) -> None:
        """A table for at least ``entities`` at load <= 1/2 (its size doubled past that)."""
        bits = max(4, int(2 * entities - 1).bit_length())
        if bits <= self._bits:
            return
        self._bits = bits
        self._table = np.full(1 << bits, EMPTY, np.int32)
        if self.n:
            self._place(np.arange(self.n, dtype=np.int64), self._buckets(self.ids[: self.n]))
