"""Users' click histories for the online features (serving/features/entity_store.py): fixed-width
numpy rows, so that a batch of requests gathers its users' histories with fancy indexing.

What a user keeps: the job's list (most recent first) merged with the older clicks it has
since dropped (``UserHistory.put``, contracts/feature_state.py), cut to what a request at
``ts >= cutoff`` (the reader's horizon: ``features_as_of - REPLAY_HORIZON_MS``) can see:
the clicks at or after the cutoff plus ``history_len`` before them (:func:`kept`), and at
most ``2 * history_len``. The job's lists are in descending time, so such a request skips
only clicks at or after the cutoff: its features equal those of the whole merged list.

A row holds ``history_len + MARGIN`` clicks: item and category ids (int32 until an id needs
int64: then that column, for every row), times as uint32 ms offsets from the row's oldest
time. A user whose kept clicks are more (many in the horizon, or the cutoff not known yet)
or span more than 2**32 ms lives in a side table of int64 triples, and comes back to its
row when a later cutoff makes it fit.
"""

from __future__ import annotations

import numpy as np

from streamrec.serving.features.growth import grown, resized
from streamrec.serving.features.time_lists import segment_index

MARGIN = 4  # clicks at or after the cutoff that a row has room for
_SPAN = 2**32 - 1
_INT32 = np.iinfo(np.int32)
OVERFLOW = -1  # a row's length when its clicks are in the side table


def merged(held: np.ndarray | None, new: np.ndarray, keep: int) -> np.ndarray:
    """``UserHistory.put``: the job's list ``new`` ([k, 3] triples, most recent first) and
    the held clicks older than its oldest, at most ``keep``."""
    if len(new) and held is not None and len(held):
        older = np.flatnonzero(held[:, 2] < new[-1, 2])
        if len(older):
            new = np.concatenate([new, held[older[0]:]])
    return new[:keep]


def kept(ts: np.ndarray, lengths: np.ndarray, cutoff: int | None, history_len: int, keep: int) -> np.ndarray:
    """Per merged list (``ts`` [m, K], descending, the first ``lengths`` valid), how many of
    its first clicks to keep for requests at ``ts >= cutoff``: those before the first older
    than the cutoff, then ``history_len`` more (what such a request sees); then the rest of
    the last one's millisecond and one more per click that shares a millisecond with the
    one before it. The job's list may end inside a millisecond and drop some of its clicks;
    a later merge then reaches that far past them into the held list. At most ``keep``."""
    lengths = np.asarray(lengths, np.int64)
    m, width = ts.shape
    if cutoff is None or width <= history_len:  # nothing to cut: a list this short is all seen
        return np.minimum(lengths, keep)
    position = np.arange(width)
    inside = position < lengths[:, None]
    below = inside & (ts < cutoff)
    base = np.minimum(np.where(below.any(1), below.argmax(1), lengths) + history_len, lengths)
    edge = ts[np.arange(m), np.maximum(base - 1, 0)]
    upto = np.where(base > 0, base + ((ts == edge[:, None]) & inside & (position >= base[:, None])).sum(1), 0)
    repeats = np.zeros((m, width), bool)
    repeats[:, 1:] = (ts[:, 1:] == ts[:, :-1]) & inside[:, 1:]
    more = (repeats & (position < upto[:, None])).sum(1)
    return np.minimum(np.minimum(upto + more, lengths), keep)


def _kept_one(history: np.ndarray, cutoff: int | None, history_len: int, keep: int) -> int:
    """:func:`kept` of one list, in a few numpy calls unless it is cut where clicks share a
    millisecond."""
    ts = history[:, 2]
    if cutoff is None:
        return min(len(ts), keep)
    below = np.flatnonzero(ts < cutoff)
    base = (int(below[0]) if len(below) else len(ts)) + history_len
    if base >= len(ts) or not (ts[1:] == ts[:-1]).any():
        return min(len(ts), keep, base)
    return int(kept(ts[None, :], np.array([len(ts)]), cutoff, history_len, keep)[0])


class HistoryRows:
    """Per user slot: no history, or a list of (item_id, category_id, ts), most recent first."""

    def __init__(self, history_len: int, capacity: int = 1024) -> None:
        self.history_len, self.keep, self.width = history_len, 2 * history_len, history_len + MARGIN
        self.row_of = np.full(capacity, -1, np.int32)  # user slot -> row
        self.rows = 0
        self.length = np.zeros(capacity, np.int16)
        self.base = np.zeros(capacity, np.int64)
        self.items = np.zeros((capacity, self.width), np.int32)
        self.categories = np.zeros((capacity, self.width), np.int32)
        self.offsets = np.zeros((capacity, self.width), np.uint32)
        self.overflow: dict[int, np.ndarray] = {}  # row -> [k, 3] int64
        self._overflow_bytes = 0
        self._scratch = np.empty(0, np.int64)  # export's output, reused

    @property
    def nbytes(self) -> int:
        """Bytes in use (rows past :attr:`rows` are never touched: not resident)."""
        row = 2 + 8 + self.width * (self.items.itemsize + self.categories.itemsize + 4)
        return self.row_of.nbytes + self.rows * row + self._overflow_bytes

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows in all (a snapshot's users: no copies while it loads). An
        empty store takes fresh columns with an eighth more room, never touched (so not
        resident) until used: the users that arrive after a snapshot need no growth."""
        if rows <= len(self.length):
            return
        if self.rows:
            self._grow_rows(rows)
            return
        rows += rows // 8
        self.length, self.base = np.empty(rows, np.int16), np.empty(rows, np.int64)
        self.items = np.empty((rows, self.width), self.items.dtype)
        self.categories = np.empty((rows, self.width), self.categories.dtype)
        self.offsets = np.empty((rows, self.width), np.uint32)

    def ensure_slots(self, n: int) -> None:
        if n > len(self.row_of):
            old = len(self.row_of)
            self.row_of = grown(self.row_of, n)
            self.row_of[old:] = -1

    def clear(self) -> None:
        self.row_of[:] = -1
        self.rows = 0
        self.overflow.clear()
        self._overflow_bytes = 0

    # ------------------------------------------------------------------ one user
    def get(self, slot: int) -> np.ndarray | None:
        """The user's clicks as [k, 3] int64 (a copy), or None: no history."""
        row = int(self.row_of[slot])
        if row < 0:
            return None
        n = int(self.length[row])
        if n == OVERFLOW:
            return self.overflow[row].copy()
        out = np.empty((n, 3), np.int64)
        out[:, 0], out[:, 1] = self.items[row, :n], self.categories[row, :n]
        out[:, 2] = self.base[row] + self.offsets[row, :n]
        return out

    def put(self, slot: int, new: np.ndarray, cutoff: int | None) -> None:
        """Apply the job's list ``new`` ([k, 3] int64) to the user's history."""
        held = self.get(slot)
        history = merged(held, new, self.keep)
        self._set(slot, history[: _kept_one(history, cutoff, self.history_len, self.keep)])

    def retrim_overflow(self, cutoff: int) -> None:
        """Cut the side table's lists to ``cutoff`` (a later horizon): most fit their rows again."""
        for row, history in list(self.overflow.items()):
            n = _kept_one(history, cutoff, self.history_len, self.keep)
            if n < len(history):
                self._off_side_table(row)
                self._store(row, history[:n])

    def trim_all(self, cutoff: int, chunk: int = 1 << 18) -> None:
        """Cut every list to what requests at ``ts >= cutoff`` need (:func:`kept`)."""
        self.retrim_overflow(cutoff)
        for lo in range(0, self.rows, chunk):
            hi = min(self.rows, lo + chunk)
            length = self.length[lo:hi].astype(np.int64)
            ts = self.base[lo:hi, None] + self.offsets[lo:hi].astype(np.int64)
            cut = kept(ts, np.maximum(length, 0), cutoff, self.history_len, self.keep)
            self.length[lo:hi] = np.where(length == OVERFLOW, OVERFLOW, cut)

    # ------------------------------------------------------------------ many users
    def before(self, slots: np.ndarray, ts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per (user slot, ts): the items and categories of the last ``n`` clicks strictly
        before ``ts`` (``UserHistory.before``), back to back, and their counts. A slot of -1
        has none."""
        q = len(slots)
        rows = np.where(slots >= 0, self.row_of[np.maximum(slots, 0)], -1).astype(np.int64)
        r = np.maximum(rows, 0)
        length = np.where(rows >= 0, self.length[r], 0).astype(np.int64)
        over = np.flatnonzero(length == OVERFLOW)
        length[over] = 0
        skip = np.zeros(q, np.int64)
        some = np.flatnonzero(length > 0)
        if len(some):
            rs = r[some]
            times = self.base[rs, None] + self.offsets[rs].astype(np.int64)
            later = (times >= ts[some, None]) & (np.arange(self.width) < length[some, None])
            skip[some] = np.where(later.all(1), self.width, (~later).argmax(1))
        count = np.clip(length - skip, 0, n)
        overflowed = {}
        for k in over.tolist():
            history = self.overflow[int(r[k])]
            later = history[:, 2] >= ts[k]
            first = int(np.argmin(later)) if not later.all() else len(history)
            overflowed[k] = history[first: first + n]
            count[k] = len(overflowed[k])
        ends = np.cumsum(count)
        items, categories = np.empty(int(ends[-1]) if q else 0, np.int64), np.empty(int(ends[-1]) if q else 0, np.int64)
        from_rows = some[count[some] > 0]
        if len(from_rows):
            columns, owner, position = segment_index(skip[from_rows], count[from_rows])
            at = (ends[from_rows] - count[from_rows])[owner] + position
            row = r[from_rows][owner]
            items[at], categories[at] = self.items[row, columns], self.categories[row, columns]
        for k, history in overflowed.items():
            items[ends[k] - count[k]: ends[k]], categories[ends[k] - count[k]: ends[k]] = history[:, 0], history[:, 1]
        return items, categories, count

    def load(self, slots: np.ndarray, offsets: np.ndarray, valid: np.ndarray, values: np.ndarray, cutoff: int | None) -> None:
        """Set the histories of new ``slots`` from a snapshot's column: per slot, flat
        triples ``values[offsets[k]:offsets[k + 1]]`` (most recent first), none where not
        ``valid``; each cut as :meth:`put` cuts. Lists of one length (the usual snapshot: every
        user with a full history) go in as one block."""
        offsets = offsets.astype(np.int64)
        lengths = np.where(valid, np.diff(offsets), 0)
        if np.any(lengths % 3):
            raise ValueError("a history list's length is not a multiple of 3")
        slots, starts, k = slots[valid], offsets[:-1][valid], (lengths // 3)[valid]
        if not len(slots):
            return
        if np.array_equal(starts[1:], starts[:-1] + 3 * k[:-1]):
            triples = values[starts[0]: starts[0] + 3 * int(k.sum())].reshape(-1, 3)  # a view: the lists lie back to back
        else:
            triples = values[segment_index(starts, 3 * k)[0]].reshape(-1, 3)
        rows = self._new_rows(slots)
        self._widen(triples[:, :2])
        if k.min() == k.max():
            self._load_block(rows, triples.reshape(len(k), int(k[0]), 3), cutoff)
        else:
            self._load_lists(rows, triples, k, cutoff)

    def _load_block(self, rows: np.ndarray, lists: np.ndarray, cutoff: int | None) -> None:
        """:meth:`load` of [m, K, 3] lists of one length."""
        m, width = lists.shape[0], lists.shape[1]
        ts = lists[:, :, 2]
        keep = kept(ts, np.full(m, width), cutoff, self.history_len, self.keep)
        if not width:
            oldest = newest = np.zeros(m, np.int64)
        elif keep.min() == width:  # nothing cut (the usual: lists no longer than history_len)
            oldest, newest = ts.min(1), ts.max(1)
        else:
            inside = np.arange(width) < keep[:, None]
            oldest = np.where(inside, ts, np.iinfo(np.int64).max).min(1)
            newest = np.where(inside, ts, np.iinfo(np.int64).min).max(1)
            oldest, newest = np.where(keep > 0, oldest, 0), np.where(keep > 0, newest, 0)
        fits = (keep <= self.width) & (newest - oldest <= _SPAN)
        self.length[rows] = np.where(fits, keep, OVERFLOW)
        self.base[rows] = oldest
        w = min(width, self.width)
        into = rows if fits.all() else rows[fits]
        block = lists if fits.all() else lists[fits]
        if len(into) and into[-1] - into[0] == len(into) - 1:
            into = slice(int(into[0]), int(into[-1]) + 1)  # consecutive rows: a block copy
        self.items[into, :w] = block[:, :w, 0]
        self.categories[into, :w] = block[:, :w, 1]
        if isinstance(into, slice):  # straight into the rows: no temporary
            np.subtract(block[:, :w, 2], oldest[fits][:, None], out=self.offsets[into, :w], casting="unsafe")
        else:
            self.offsets[into, :w] = (block[:, :w, 2] - oldest[fits][:, None]).astype(np.uint32)
        for j in np.flatnonzero(~fits).tolist():
            self._to_side_table(int(rows[j]), lists[j, : keep[j]])

    def _load_lists(self, rows: np.ndarray, triples: np.ndarray, k: np.ndarray, cutoff: int | None) -> None:
        """:meth:`load` of lists of any lengths ``k``, back to back in ``triples``."""
        _, owner, position = segment_index(np.zeros(len(k), np.int64), k)
        padded = np.zeros((len(k), int(k.max())), np.int64)
        padded[owner, position] = triples[:, 2]
        keep = kept(padded, k, cutoff, self.history_len, self.keep)
        stay = position < keep[owner]
        triples, owner, position = triples[stay], owner[stay], position[stay]
        oldest, newest = np.zeros(len(k), np.int64), np.zeros(len(k), np.int64)
        some = np.flatnonzero(keep > 0)
        if len(some):
            starts = (np.cumsum(keep) - keep)[some]
            oldest[some] = np.minimum.reduceat(triples[:, 2], starts)
            newest[some] = np.maximum.reduceat(triples[:, 2], starts)
        fits = (keep <= self.width) & (newest - oldest <= _SPAN)
        self.length[rows] = np.where(fits, keep, OVERFLOW)
        self.base[rows] = oldest
        into = fits[owner]
        flat = rows[owner[into]] * self.width + position[into]
        self.items.reshape(-1)[flat] = triples[into, 0]
        self.categories.reshape(-1)[flat] = triples[into, 1]
        self.offsets.reshape(-1)[flat] = (triples[into, 2] - oldest[owner[into]]).astype(np.uint32)
        ends = np.cumsum(keep)
        for j in np.flatnonzero(~fits).tolist():
            self._to_side_table(int(rows[j]), triples[ends[j] - keep[j]: ends[j]])

    def export(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per user slot: its list's length in clicks (-1: no history) and the lists' flat
        triples back to back (a snapshot's column); the triples may be a view of a buffer
        the next call overwrites (fresh pages per chunk cost more than the copy)."""
        rows = self.row_of[slots].astype(np.int64)
        r = np.maximum(rows, 0)
        stored = np.where(rows >= 0, self.length[r], 0).astype(np.int64)
        over = np.flatnonzero(stored == OVERFLOW)
        length = np.where(rows >= 0, stored, -1)
        for k in over.tolist():
            length[k] = len(self.overflow[int(r[k])])
        count = np.maximum(length, 0)
        if len(count) and not len(over) and (rows >= 0).all() and count.min() == count.max():  # one block
            rs, n = r, int(count[0])
            if len(self._scratch) < len(rs) * n * 3:
                self._scratch = np.empty(len(rs) * n * 3, np.int64)
            out = self._scratch[: len(rs) * n * 3].reshape(len(rs), n, 3)
            out[:, :, 0], out[:, :, 1] = self.items[rs, :n], self.categories[rs, :n]
            out[:, :, 2] = self.base[rs, None] + self.offsets[rs, :n]
            return length, out.reshape(-1)
        ends = np.cumsum(count)
        out = np.empty((int(ends[-1]) if len(ends) else 0, 3), np.int64)
        from_rows = np.flatnonzero((count > 0) & (stored != OVERFLOW))
        if len(from_rows):
            columns, owner, position = segment_index(np.zeros(len(from_rows), np.int64), count[from_rows])
            at = (ends[from_rows] - count[from_rows])[owner] + position
            row = r[from_rows][owner]
            out[at, 0], out[at, 1] = self.items[row, columns], self.categories[row, columns]
            out[at, 2] = self.base[row] + self.offsets[row, columns]
        for k in over.tolist():
            out[ends[k] - count[k]: ends[k]] = self.overflow[int(r[k])]
        return length, out.reshape(-1)

    # ------------------------------------------------------------------ internals
    def _set(self, slot: int, history: np.ndarray) -> None:
        row = int(self.row_of[slot])
        if row < 0:
            row = self.rows
            if row == len(self.length):
                self._grow_rows(len(grown(self.length, row + 1)))
            self.rows, self.row_of[slot] = row + 1, row
        elif self.overflow:
            self._off_side_table(row)
        self._store(row, history)

    def _store(self, row: int, history: np.ndarray) -> None:
        n = len(history)
        if not n:
            self.length[row] = 0
            return
        lows, highs = history.min(0).tolist(), history.max(0).tolist()
        if n > self.width or highs[2] - lows[2] > _SPAN:
            self._to_side_table(row, history)
            return
        if min(lows[:2]) < _INT32.min or max(highs[:2]) > _INT32.max:
            self._widen(history[:, :2])
        base = lows[2]
        self.length[row], self.base[row] = n, base
        self.items[row, :n], self.categories[row, :n] = history[:, 0], history[:, 1]
        self.offsets[row, :n] = (history[:, 2] - base).astype(np.uint32)

    def _to_side_table(self, row: int, history: np.ndarray) -> None:
        """Put a row's clicks in the side table (its length says so)."""
        self._off_side_table(row)
        self.overflow[row] = history.copy()
        self._overflow_bytes += history.nbytes + 120
        self.length[row] = OVERFLOW

    def _off_side_table(self, row: int) -> None:
        history = self.overflow.pop(row, None)
        if history is not None:
            self._overflow_bytes -= history.nbytes + 120

    def _new_rows(self, slots: np.ndarray) -> np.ndarray:
        first, k = self.rows, len(slots)
        if first + k > len(self.length):
            self._grow_rows(len(grown(self.length, first + k)))
        self.rows = first + k
        rows = np.arange(first, first + k, dtype=np.int64)
        self.row_of[slots] = rows
        self.length[rows] = 0
        return rows

    def _grow_rows(self, need: int) -> None:
        """Every row column to ``need`` rows, in place (serving/features/growth.py)."""
        self.length, self.base = resized(self.length, need), resized(self.base, need)
        self.items, self.categories = resized(self.items, need), resized(self.categories, need)
        self.offsets = resized(self.offsets, need)

    def _widen(self, ids: np.ndarray) -> None:
        """Item and category columns wide enough for ``ids`` ([k, 2]): int64 once an id needs it."""
        if not len(ids) or (self.items.dtype == np.int64 and self.categories.dtype == np.int64):
            return
        if _INT32.min <= ids.min() and ids.max() <= _INT32.max:
            return
        for j, name in enumerate(("items", "categories")):
            column = getattr(self, name)
            if column.dtype == np.int32 and (ids[:, j].min() < _INT32.min or ids[:, j].max() > _INT32.max):
                setattr(self, name, column.astype(np.int64))
