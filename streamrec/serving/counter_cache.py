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

from itertools import repeat
from typing import Callable

import numpy as np

INT64_MIN = np.iinfo(np.int64).min


class CounterCache:
    """Per entity of one kind: counts ``[2W]`` at ``computed_at``, valid before ``valid_until``.

    Memory: ``8 * (2W + 2)`` bytes per cached entity plus a dict entry (:attr:`nbytes`); only
    entities that exist in the feature state are cached (an unknown id gets zeros and no
    row), so a client cannot grow it with made-up ids; past ``max_entities`` it starts over
    (the entities requested since come back at their first request)."""

    def __init__(self, width: int, capacity: int = 1024, max_entities: int = 1 << 20) -> None:
        self.width, self.max_entities = width, max_entities
        self._rows: dict[int, int] = {}
        self._counts = np.zeros((capacity, width), np.int64)
        self._computed_at = np.zeros(capacity, np.int64)
        self._valid_until = np.full(capacity, INT64_MIN, np.int64)
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        return self._counts.nbytes + self._computed_at.nbytes + self._valid_until.nbytes + 100 * len(self._rows)

    def clear(self) -> None:
        """Forget every entity's counts."""
        self._rows.clear()
        self._valid_until[:] = INT64_MIN

    def invalidate(self, entity_id: int) -> None:
        """The entity changed: its cached counts no longer hold."""
        row = self._rows.get(entity_id)
        if row is not None:
            self._valid_until[row] = INT64_MIN

    def gather(self, ids: np.ndarray, ts: np.ndarray, compute: Callable[[int, int], tuple[list[int], int] | None]) -> np.ndarray:
        """``[n, width]`` counts of entities ``ids`` ``[n]`` at times ``ts`` ``[n]`` (int64).

        ``compute(id, ts)`` gives (counts, valid until) from the entity's state, or None for an
        entity the state does not have (zeros)."""
        n = len(ids)
        rows = np.fromiter(map(self._rows.get, ids.tolist(), repeat(-1)), np.int64, n)
        known = rows >= 0
        safe = np.where(known, rows, 0)
        fresh = known & (self._computed_at[safe] <= ts) & (ts < self._valid_until[safe])
        out = self._counts[safe]
        stale = np.flatnonzero(~fresh)
        self.hits += n - len(stale)
        self.misses += len(stale)
        if len(stale):
            done: dict[tuple[int, int], np.ndarray] = {}
            for i, entity_id, at in zip(stale.tolist(), ids[stale].tolist(), ts[stale].tolist()):
                got = done.get((entity_id, at))
                if got is None:
                    got = done[(entity_id, at)] = self._refresh(entity_id, at, compute)
                out[i] = got
        return out

    def _refresh(self, entity_id: int, ts: int, compute: Callable[[int, int], tuple[list[int], int] | None]) -> np.ndarray:
        result = compute(entity_id, ts)
        if result is None:
            return np.zeros(self.width, np.int64)
        counts, until = result
        row = self._rows.get(entity_id)
        if row is None:
            if len(self._rows) >= self.max_entities:
                self.clear()
            row = self._rows[entity_id] = len(self._rows)
            if row == len(self._counts):
                self._grow()
        values = np.asarray(counts, np.int64)
        if ts >= self._computed_at[row] or self._valid_until[row] == INT64_MIN:  # keep the later of two requests' times
            self._counts[row], self._computed_at[row], self._valid_until[row] = values, ts, until
        return values

    def _grow(self) -> None:
        capacity = 2 * len(self._counts)
        self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
        self._computed_at = np.concatenate([self._computed_at, np.zeros(capacity // 2, np.int64)])
        self._valid_until = np.concatenate([self._valid_until, np.full(capacity // 2, INT64_MIN, np.int64)])
