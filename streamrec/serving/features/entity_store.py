"""The online features' entity state in columns: per kind (user, item, category) an id
index (serving/features/id_index.py) and the counter times (serving/features/time_lists.py), and the users'
click histories (serving/features/history_rows.py). About 0.8 KB a user with a full history and a
few event times, against ~2 KB as Python objects; a snapshot loads as whole columns.

Memory budget: once past ``budget_bytes``, no new entity is admitted until the store is
cleared (a restart): their records are skipped and counted, requests for them get
cold-start features, while the known ones keep updating exactly. Refusing from then on,
not only while over, keeps every admitted entity whole: none misses records of its own.
:attr:`EntityStore.refusing` and ``refused`` say so; the owner logs it. Nothing spills.

Not thread-safe: :class:`OnlineFeatures` holds its lock around every call.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import numpy as np

from streamrec.contracts.feature_state import ENTITIES
from streamrec.serving.features.growth import resized
from streamrec.serving.features.history_rows import HistoryRows
from streamrec.serving.features.id_index import IdIndex
from streamrec.serving.features.segment_counts import counts_until_many
from streamrec.serving.features.time_lists import TimeLists, segment_index


_CHECK_EVERY = 16


class KindState:
    """One kind's entities: id -> slot, and per slot impression and click times."""

    def __init__(self) -> None:
        self.index = IdIndex()
        self.imps, self.clicks = TimeLists(), TimeLists()

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self.imps.nbytes + self.clicks.nbytes

    def slots_added(self) -> None:
        for lists in (self.imps, self.clicks):
            lists.ensure_slots(len(self.index.ids))

    def wasteful(self) -> list[TimeLists]:
        """The arenas whose waste outweighs their live times: to squeeze (amortised: a copy
        per doubling of what moved)."""
        return [lists for lists in (self.imps, self.clicks) if lists.waste > max(1 << 16, lists.live)]


class EntityStore:
    """Every entity's counter times and every user's history."""

    def __init__(self, history_len: int, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.history_len = history_len
        self.kinds = {kind: KindState() for kind in ENTITIES}
        self.history = HistoryRows(history_len)
        self.refused = 0  # records of entities not admitted (over budget)
        self.refusing = False  # the budget was reached: no new entity from then on
        self._unchecked = 0  # entities admitted since the budget was last checked

    # ------------------------------------------------------------------ accounting
    @property
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self.kinds.values()) + self.history.nbytes

    def _admits(self, check: bool = False) -> bool:
        """Whether a new entity may come in; the size is summed once per ``_CHECK_EVERY``
        entities (a few KiB past the budget at most), or when ``check``."""
        if self.refusing:
            return False
        self._unchecked -= 1
        if self._unchecked < 0 or check:
            self._unchecked = _CHECK_EVERY
            self.refusing = self.nbytes > self.budget
        return not self.refusing

    def entities(self) -> dict[str, int]:
        return {kind: state.index.n for kind, state in self.kinds.items()}

    def clear(self) -> None:
        self.kinds = {kind: KindState() for kind in ENTITIES}
        self.history = HistoryRows(self.history_len)
        self.refused, self.refusing, self._unchecked = 0, False, 0

    # ------------------------------------------------------------------ one entity
    def slot(self, kind: str, entity_id: int) -> int:
        """The entity's slot, or -1: unknown."""
        return self.kinds[kind].index.get(entity_id)

    def slot_for_update(self, kind: str, entity_id: int) -> int:
        """The entity's slot, a new one if unknown and the budget allows; -1 when refused."""
        state = self.kinds[kind]
        slot = state.index.get(entity_id)
        if slot >= 0:
            return slot
        if not self._admits():
            self.refused += 1
            return -1
        slot = state.index.add(entity_id)
        state.slots_added()
        if kind == "user":
            self.history.ensure_slots(len(state.index.ids))
        return slot

    def put_bucket(self, kind: str, slot: int, imps: np.ndarray, clicks: np.ndarray, expire_at: int | None) -> None:
        """A counter bucket's times (``EntityCounts.put``), then expiry at ``expire_at``."""
        state = self.kinds[kind]
        state.imps.replace_range(slot, imps)
        state.clicks.replace_range(slot, clicks)
        if expire_at is not None:
            state.imps.expire(slot, expire_at)
            state.clicks.expire(slot, expire_at)

    def compact_wasteful(self, lock: AbstractContextManager) -> None:
        """Squeeze the arenas that need it, ``lock`` (the owner's, which readers take) held only
        to install each new arena: building one takes seconds at 10M users, and requests
        keep reading the old one meanwhile. Call from the one thread that writes the store."""
        for state in self.kinds.values():
            for lists in state.wasteful():
                compacted = lists.compacted(state.index.n)
                with lock:
                    lists.install(compacted)

    def put_history(self, slot: int, clicks: np.ndarray, cutoff: int | None) -> None:
        """The job's history list for a user ([k, 3] int64), kept to ``cutoff`` (history_rows.py)."""
        self.history.put(slot, clicks, cutoff)

    def times(self, kind: str, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(imps, clicks) of a slot: views, valid until the next update."""
        state = self.kinds[kind]
        return state.imps.get(slot), state.clicks.get(slot)

    def counts_until(self, kind: str, slot: int, ts: int, windows_ms: tuple[int, ...]) -> tuple[list[int], int]:
        """``EntityCounts.counts_until`` of a slot's times."""
        counts, until = self.counts_until_many(kind, np.array([slot], np.int64), np.array([ts], np.int64), windows_ms)
        return counts[0].tolist(), int(until[0])

    def counts_until_many(self, kind: str, slots: np.ndarray, ts: np.ndarray, windows_ms: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`counts_until` of many (slot, ts) at once (serving/features/segment_counts.py):
        (counts int64 [q, 2W], valid until int64 [q])."""
        state = self.kinds[kind]
        return counts_until_many((state.imps, state.clicks), slots, ts, windows_ms)

    def keys(self) -> list[tuple[str, int]]:
        """Every entity's (kind, id)."""
        return [(kind, int(i)) for kind, state in self.kinds.items() for i in state.index.ids[: state.index.n]]

    def read(self, kind: str, entity_id: int) -> tuple[list[int], list[int], list[int] | None] | None:
        """An entity's (imps, clicks, history as flat triples or None), or None: unknown."""
        slot = self.slot(kind, entity_id)
        if slot < 0:
            return None
        imps, clicks = self.times(kind, slot)
        history = self.history.get(slot) if kind == "user" else None
        return imps.tolist(), clicks.tolist(), None if history is None else history.reshape(-1).tolist()

    # ------------------------------------------------------------------ many users
    def slots(self, kind: str, ids: np.ndarray) -> np.ndarray:
        """The slots of ``ids`` (-1: unknown), in numpy."""
        return self.kinds[kind].index.lookup(ids)

    def user_counts(self, slots: np.ndarray, ts: np.ndarray, windows_ms: tuple[int, ...]) -> np.ndarray:
        """``[n, 2W]``: per (user slot, ts), ``EntityCounts.counts``; zeros for -1."""
        out = np.zeros((len(slots), 2 * len(windows_ms)), np.int64)
        known = np.flatnonzero(slots >= 0)
        if len(known):
            out[known] = self.counts_until_many("user", slots[known], ts[known], windows_ms)[0]
        return out

    def histories_before(self, slots: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per (user slot, ts): the history a request sees (history_rows.py ``before``)."""
        return self.history.before(slots, ts, self.history_len)

    # ------------------------------------------------------------------ whole state
    def expire_all(self, counter_cutoff: int, history_cutoff: int) -> None:
        """Every entity's times and histories cut to what requests at the horizon see (the
        expiry an update of each would do): a canonical form of the state."""
        for state in self.kinds.values():
            for lists in (state.imps, state.clicks):
                lists.expire_all(counter_cutoff)
        self.history.trim_all(history_cutoff)

    def reserve(self, counts: dict[str, int]) -> None:
        """Room for this many more entities per kind (a snapshot about to load)."""
        for kind, n in counts.items():
            state = self.kinds[kind]
            need = state.index.n + n
            if need > len(state.index.ids):
                state.index.ids = resized(state.index.ids, need + need // 8)
            state.index.reserve(need)
            state.slots_added()
            if kind == "user":
                self.history.ensure_slots(need)
                self.history.reserve(self.history.rows + n)

    def load(self, kind: str, ids: np.ndarray, imps: tuple, clicks: tuple, history: tuple | None, cutoff: int | None) -> int:
        """Add a snapshot's entities of one kind: ids (new, distinct: else ValueError) and
        per column (offsets, valid, values) of its list column. Returns those admitted
        (none past the budget)."""
        state = self.kinds[kind]
        if not self._admits(check=True):
            self.refused += len(ids)
            return 0
        if len(np.unique(ids)) != len(ids) or (state.index.lookup(ids) >= 0).any():
            raise ValueError(f"a {kind} id appears twice")
        slots = state.index.add_new(ids)
        state.slots_added()
        for lists, column in ((state.imps, imps), (state.clicks, clicks)):
            lists.load(slots, *_ascending(*column))
        if history is not None:
            self.history.ensure_slots(len(state.index.ids))
            offsets, valid, values = history
            self.history.load(slots, offsets, valid, values, cutoff)
        return len(ids)

    def export(self, kind: str, lo: int, hi: int) -> dict:
        """Slots lo..hi-1 of a kind as snapshot columns: ids, imps/clicks (lengths,
        flat), history (lengths, -1: none; flat triples) for users."""
        state = self.kinds[kind]
        slots = np.arange(lo, hi, dtype=np.int64)
        out = {"ids": state.index.ids[lo:hi].copy()}
        for name, lists in (("imps", state.imps), ("clicks", state.clicks)):
            length = lists.length[lo:hi].astype(np.int64)
            out[name] = (length, lists.gather_flat(lists.start[lo:hi], length)[0])
        if kind == "user":
            out["history"] = self.history.export(slots)
        return out


def _ascending(offsets: np.ndarray, valid: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A list column's (offsets, values) without null lists' values; ValueError unless
    every list is ascending."""
    offsets = offsets.astype(np.int64)
    lengths = np.where(valid, np.diff(offsets), 0)
    if not np.array_equal(lengths, np.diff(offsets)):
        index, _, _ = segment_index(offsets[:-1], lengths)
        values, offsets = values[index], np.concatenate([[0], np.cumsum(lengths)])
    block = values[offsets[0]: offsets[-1]]
    falls = np.flatnonzero(block[1:] < block[:-1]) + 1 + offsets[0]
    if len(falls) and not np.isin(falls, offsets).all():
        raise ValueError("event times of a list are not ascending")
    return offsets, values
