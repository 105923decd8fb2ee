"""Windowed counts of many entities for a whole serving batch at once.

A candidate's counters are the counts of its item's and category's events in each window
before the request's ``ts``. Computing them per candidate (bisects over the entity's event
times) costs microseconds of Python each; a batch of a thousand candidates would spend
milliseconds there. But an entity's counts change only when an event enters or leaves a
window, or the entity gets an update: :class:`CounterCache` keeps, per entity, the counts
computed at some ``ts`` and the first ms they stop holding
(``EntityCounts.counts_until``), and a batch gathers every candidate's counts with numpy,
recomputing only the entities whose counts expired, changed, or are asked for a ``ts``
before the one they were computed at. Not thread-safe: the owner's lock guards it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from streamrec.serving.features.growth import grown

INT64_MIN = np.iinfo(np.int64).min


class CounterCache:
    """Per entity slot of one kind (serving/features/entity_store.py): counts ``[2W]`` at
    ``computed_at``, valid before ``valid_until``.

    Indexed by the store's slots, so a batch's candidates are looked up in numpy (the
    store's id index), not a dict per id. Memory: ``8 * (2W + 2)`` bytes per slot up to the
    highest one requested (:attr:`nbytes`); the store's own budget bounds the slots, and an
    unknown id gets zeros and no row, so a client cannot grow it with made-up ids."""

    def __init__(self, width: int, capacity: int = 1024) -> None:
        self.width = width
        self._counts = np.zeros((capacity, width), np.int64)
        self._computed_at = np.zeros(capacity, np.int64)
        self._valid_until = np.full(capacity, INT64_MIN, np.int64)
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return int(np.count_nonzero(self._valid_until != INT64_MIN))

    @property
    def nbytes(self) -> int:
        return self._counts.nbytes + self._computed_at.nbytes + self._valid_until.nbytes

    def clear(self) -> None:
        """Forget every entity's counts."""
        self._valid_until[:] = INT64_MIN

    def invalidate(self, slot: int) -> None:
        """The entity changed: its cached counts no longer hold."""
        if slot < len(self._valid_until):
            self._valid_until[slot] = INT64_MIN

    def gather(self, slots: np.ndarray, ts: np.ndarray, compute: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """``[n, width]`` counts of the entities in ``slots`` ``[n]`` (-1: unknown, zeros)
        at times ``ts`` ``[n]`` (int64). ``compute(slots, ts)`` gives, for many (slot, ts)
        at once, (counts ``[q, width]``, valid until ``[q]``) from the entities' state: one
        call per batch for every entity whose cached counts no longer hold."""
        n = len(slots)
        if n and int(slots.max()) >= len(self._valid_until):
            self._grow(int(slots.max()) + 1)
        known = slots >= 0
        safe = np.where(known, slots, 0)
        fresh = known & (self._computed_at[safe] <= ts) & (ts < self._valid_until[safe])
        out = self._counts[safe]
        out[~known] = 0
        stale = np.flatnonzero(known & ~fresh)
        self.hits += n - len(stale)
        self.misses += len(stale)
        if len(stale):
            asked_slots, asked_ts, where = _distinct(slots[stale], ts[stale])
            counts, until = compute(asked_slots, asked_ts)
            out[stale] = counts[where]
            self._keep(asked_slots, asked_ts, counts, until)
        return out

    def _keep(self, slots: np.ndarray, ts: np.ndarray, counts: np.ndarray, until: np.ndarray) -> None:
        """Cache fresh counts (``slots`` ascending, then ``ts``): per slot, those of its latest
        ``ts``, unless the cache holds a later one still valid (requests come in any order)."""
        last = np.append(slots[1:] != slots[:-1], True)
        slots, ts, counts, until = slots[last], ts[last], counts[last], until[last]
        newer = (ts >= self._computed_at[slots]) | (self._valid_until[slots] == INT64_MIN)
        slots = slots[newer]
        self._counts[slots], self._computed_at[slots], self._valid_until[slots] = counts[newer], ts[newer], until[newer]

    def _grow(self, need: int) -> None:
        old = len(self._valid_until)
        self._counts, self._computed_at = grown(self._counts, need), grown(self._computed_at, need)
        self._valid_until = grown(self._valid_until, need)
        self._valid_until[old:] = INT64_MIN


def _distinct(slots: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (slot, ts) pairs, ordered by slot then ts, and each input's index among
    them. One int64 key per pair when the batch's times span less than 2**31 ms (always, in
    practice): a 1-d unique, several times cheaper than ``np.unique(axis=0)``."""
    base = int(ts.min())
    span = int(ts.max()) - base
    if span < 2**31 and int(slots.max()) < 2**31:
        keys, where = np.unique((slots.astype(np.int64) << 31) | (ts - base), return_inverse=True)
        return keys >> 31, (keys & (2**31 - 1)) + base, where
    pairs, where = np.unique(np.stack([slots, ts], axis=1), axis=0, return_inverse=True)
    return pairs[:, 0], pairs[:, 1], where.reshape(-1)
