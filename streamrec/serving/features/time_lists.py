"""Sorted event-time lists of many entities in one arena: the counter state of the online
features (serving/features/entity_store.py), with ``EntityCounts``' semantics
(contracts/feature_state.py) per list.

Each slot owns a segment ``[start, start + cap)`` of one int64 array, of which the first
``length`` values are its times, ascending. An update that no longer fits moves the list to
the arena's end with half again its room (a hot entity's appends stay amortised O(1));
expiry only advances ``start``. What moves leaves waste behind, which :meth:`TimeLists.compact`
squeezes out once it outweighs the live times. A snapshot's list column loads as one
block: its offsets are the segments. 8 bytes a time, 16 a slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from streamrec.serving.features.growth import grown, no_huge_page_advice


CHANGES_KEPT = 1 << 16  # one-slot updates recorded for a mirror, at least, before it copies everything instead


@dataclass
class Changes:
    """The slots one-slot updates touched since a mirror (serving/features/device_counts.py) last
    copied: their live values and bounds are what it copies."""

    slots: list[int] = field(default_factory=list)


@dataclass
class Compacted:
    """A compacted arena, ready to install (:meth:`TimeLists.compacted`)."""

    slots: int
    values: np.ndarray
    start: np.ndarray  # the new start of slots 0..slots-1
    used: int


class TimeLists:
    """Per slot, a sorted list of int64 times."""

    def __init__(self, slots: int = 1024, values: int = 4096) -> None:
        self.values = np.empty(values, np.int64)
        self.used = 0  # values[:used] are segments (live or waste)
        self.waste = 0
        self.start = np.zeros(slots, np.int64)
        self.length = np.zeros(slots, np.int32)
        self.cap = np.zeros(slots, np.int32)
        self.generation = 0  # bumped by every change beyond one slot's but new slots: a mirror copies everything
        self.changes: Changes | None = None  # kept only while a mirror follows this arena

    def follow(self) -> Changes:
        """Start (or restart) recording one-slot updates; returns the record a mirror drains."""
        self.changes = Changes()
        return self.changes

    def _changed(self, slot: int) -> None:
        """A one-slot update, recorded while a mirror follows. A record that outgrows the
        arena's slots (no mirror copied for a long while) turns into one full copy: its size
        stays bounded however long no batch comes."""
        if self.changes is None:
            return
        self.changes.slots.append(slot)
        if len(self.changes.slots) > max(CHANGES_KEPT, len(self.start) // 4):
            self._changed_everything()

    def _changed_everything(self) -> None:
        self.generation += 1
        if self.changes is not None:
            self.changes.slots.clear()

    @property
    def nbytes(self) -> int:
        """Bytes in use (the arena's spare capacity is never touched: not resident)."""
        return 8 * self.used + self.start.nbytes + self.length.nbytes + self.cap.nbytes

    @property
    def live(self) -> int:
        return self.used - self.waste

    def ensure_slots(self, n: int) -> None:
        """Room for slots 0..n-1 (new ones empty)."""
        if n > len(self.start):
            old = len(self.start)
            self.start, self.length, self.cap = grown(self.start, n), grown(self.length, n), grown(self.cap, n)
            for column in (self.start, self.length, self.cap):
                column[old:] = 0  # (a mirror sees the new, empty slots by the bounds' length)

    def get(self, slot: int) -> np.ndarray:
        """The slot's times (a view: valid until the next update)."""
        s = int(self.start[slot])
        return self.values[s: s + int(self.length[slot])]

    # ------------------------------------------------------------------ updates
    def replace_range(self, slot: int, new: np.ndarray) -> None:
        """The held times within ``[new[0], new[-1]]`` replaced by ``new`` (ascending);
        nothing changes if ``new`` is empty (``EntityCounts.put``)."""
        if not len(new):
            return
        s, n, cap = int(self.start[slot]), int(self.length[slot]), int(self.cap[slot])
        held = self.values[s: s + n]
        lo = n if n == 0 or held[-1] < new[0] else int(held.searchsorted(new[0], "left"))
        hi = lo if lo == n else int(held.searchsorted(new[-1], "right"))
        size = n - (hi - lo) + len(new)
        if size <= cap:
            if hi != lo + len(new):
                self.values[s + lo + len(new): s + size] = held[hi:n].copy()
            self.values[s + lo: s + lo + len(new)] = new
        else:
            new_cap = max(4, size + size // 2)
            del held  # no view across the arena's growth (serving/features/growth.py)
            at = self._reserve(new_cap)
            held = self.values[s: s + n]
            v = self.values
            v[at: at + lo] = held[:lo]
            v[at + lo: at + lo + len(new)] = new
            v[at + lo + len(new): at + size] = held[hi:n]
            self.waste += new_cap
            self.start[slot], self.cap[slot] = at, new_cap
        self.waste -= size - n  # waste: the arena's values that are not in a list
        self.length[slot] = size
        self._changed(slot)

    def expire(self, slot: int, cutoff: int) -> None:
        """Forget the slot's times at or before ``cutoff``."""
        n = int(self.length[slot])
        if not n:
            return
        s = int(self.start[slot])
        if self.values[s] > cutoff:
            return
        k = int(self.values[s: s + n].searchsorted(cutoff, "right"))
        self.start[slot] = s + k
        self.length[slot] = n - k
        self.cap[slot] -= k
        self.waste += k
        self._changed(slot)

    def expire_all(self, cutoff: int, chunk: int = 1 << 20) -> None:
        """:meth:`expire` of every slot (numpy, ``chunk`` slots at a time)."""
        for lo in range(0, len(self.start), chunk):
            start, length = self.start[lo: lo + chunk], self.length[lo: lo + chunk]
            flat, owner = self.gather_flat(start, length)
            gone = np.bincount(owner, weights=flat <= cutoff, minlength=len(start)).astype(np.int64)
            start += gone
            length -= gone.astype(np.int32)
            self.cap[lo: lo + chunk] -= gone.astype(np.int32)
            self.waste += int(gone.sum())
        self._changed_everything()

    def load(self, slots: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> None:
        """Set ``slots``' lists (empty before) to ``values[offsets[k]:offsets[k + 1]]``."""
        base = int(offsets[0]) if len(offsets) else 0
        total = int(offsets[-1]) - base if len(offsets) else 0
        at = self._reserve(total)
        self.values[at: at + total] = values[base: base + total]
        lengths = np.diff(offsets).astype(np.int32)
        self.start[slots] = at + offsets[:-1] - base
        self.length[slots] = lengths
        self.cap[slots] = lengths
        self._changed_everything()

    def clear(self) -> None:
        self.used = self.waste = 0
        self.start[:] = 0
        self.length[:] = 0
        self.cap[:] = 0
        self._changed_everything()

    def compact(self, slots: int) -> None:
        """Squeeze the waste out: the live values of slots 0..slots-1 moved down, in arena
        order, capacity = length."""
        self.install(self.compacted(slots))

    def compacted(self, slots: int) -> "Compacted":
        """:meth:`compact`'s new arena, built without changing this one: readers may go on
        reading meanwhile (the owner's lock need not be held), as long as nothing writes
        these lists until :meth:`install`. A pass of byte marks over the arena (segments
        are disjoint), no index per value."""
        start, length = self.start[:slots].copy(), self.length[:slots].astype(np.int64)
        some = np.flatnonzero(length > 0)
        with no_huge_page_advice():
            marks = np.zeros(self.used + 1, np.int8)
            marks[start[some]] = 1
            marks[start[some] + length[some]] -= 1  # ends are distinct; one may be another's start
            live = np.cumsum(marks, dtype=np.int8)[: self.used].view(bool)
            before = np.cumsum(live, dtype=np.int64 if self.used >= 2**31 else np.int32)
            total = int(before[-1]) if self.used else 0
            values = np.empty(max(4096, total + total // 4), np.int64)
            np.compress(live, self.values[: self.used], out=values[:total])
        del live, marks
        start[some] = before[start[some]] - 1
        start[length == 0] = 0
        return Compacted(slots, values, start, total)

    def install(self, compacted: "Compacted") -> None:
        """Switch to a :meth:`compacted` arena (quick: no copy; under the owner's lock)."""
        slots = compacted.slots
        self.values = compacted.values
        self.start[:slots] = compacted.start
        self.cap[:slots] = self.length[:slots]
        self.used, self.waste = compacted.used, 0
        self._changed_everything()

    # ------------------------------------------------------------------ reads
    def gather_flat(self, start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The lists of segments (``start``, ``length``) back to back, and for each value the
        index of its segment."""
        index, owner, _ = segment_index(start, length)
        return self.values[index], owner

    # ------------------------------------------------------------------ internals
    def _reserve(self, n: int) -> int:
        """The start of ``n`` new values at the arena's end."""
        at = self.used
        if at + n > len(self.values):
            self.values = grown(self.values, at + n)
        self.used = at + n
        return at


def segment_index(start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For segments (``start``, ``length``) of some flat array, back to back: each element's
    index in that array, its segment's number, and its position within the segment."""
    length = np.asarray(length, np.int64)
    total = int(length.sum())
    owner = np.repeat(np.arange(len(length)), length)
    position = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
    return position + np.asarray(start, np.int64)[owner], owner, position
