"""Windowed counts of many entities at once, straight from the arena of sorted event times
(serving/features/time_lists.py): ``EntityCounts.counts_until`` (contracts/feature_state.py) for a
whole batch of (slot, ts) queries in numpy.

Why: a serving batch recomputes the counts of every candidate entity whose cached counts
stopped holding (serving/features/counter_cache.py). Under live traffic the request time moves on
every batch, so hot entities expire constantly and hundreds of them are recomputed per
batch; a Python call per entity (a few numpy calls on a short array each) then costs more
than the rest of the batch. Here every query's binary searches advance together: about
``log2(longest list)`` numpy steps over all queries and windows, whatever their number.
"""

from __future__ import annotations

import numpy as np

from streamrec.contracts.feature_state import END_OF_INPUT


def segment_searchsorted(values, starts, lengths, targets):
    """Per query ``i``: ``np.searchsorted(values[starts[i]: starts[i] + lengths[i]], targets[i])``
    (each segment ascending; side "left"), all queries at once. ``starts``, ``lengths``, ``targets``:
    int64 [q]; returns int64 [q] positions within the segments. Numpy arrays, or torch tensors
    on any device (serving/features/device_counts.py): only operators both share.

    Branch-free halving: every step halves each query's remaining range (whatever its answer),
    so there is no mask of finished queries to keep and no test of it per step."""
    base = targets * 0
    if not len(values) or not len(targets):
        return base
    remaining = lengths + 0  # a copy, int64
    last = len(values) - 1
    while True:
        half = remaining >> 1
        if not half.any():
            break
        below = values[_at_most(starts + base + half - 1, last)] < targets
        base += half * below
        remaining -= half
    return base + ((remaining > 0) & (values[_at_most(starts + base, last)] < targets)) * 1


def _at_most(positions, last: int):
    return np.minimum(positions, last) if isinstance(positions, np.ndarray) else positions.clamp(max=last)


def counts_until_many(lists: tuple, slots: np.ndarray, ts: np.ndarray, windows_ms: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``EntityCounts.counts_until`` of many queries: ``lists`` = (impressions, clicks)
    TimeLists of one entity kind, ``slots`` [q] (known entities), ``ts`` [q] int64.
    Returns (counts int64 [q, 2W] as [imps W0, clicks W0, imps W1, ...], valid until int64
    [q]: the first ms after ``ts`` at which any of the query's counts changes)."""
    q, w = len(slots), len(windows_ms)
    counts = np.empty((q, 2 * w), np.int64)
    until = np.full(q, END_OF_INPUT, np.int64)
    if not q:
        return counts, until
    windows = np.asarray(windows_ms, np.int64)
    # One search per list for ts and every window's start: times are integers, so "after
    # ts - W" (side right) is "at or after ts - W + 1" (side left); and ts - W < ts, so a
    # window's start searched in the whole list lands before ts's position anyway.
    starts_of = ts[:, None] - windows + 1
    for k, times in enumerate(lists):
        values = times.values[: max(times.used, 1)]
        last = len(values) - 1
        starts, lengths = times.start[slots].astype(np.int64), times.length[slots].astype(np.int64)
        # times before ts: all of them when the newest is (requests ask about now: nearly always), else searched
        hi = lengths.copy()
        later = np.flatnonzero((lengths > 0) & (values[np.minimum(starts + lengths - 1, last)] >= ts))
        if len(later):
            hi[later] = segment_searchsorted(values, starts[later], lengths[later], ts[later])
        # times at or before each window's start, searched among those before ts
        lows = segment_searchsorted(values, np.repeat(starts, w), np.repeat(hi, w), starts_of.reshape(-1)).reshape(q, w)
        counts[:, k::2] = hi[:, None] - lows
        entering = hi < lengths  # the next event enters every window
        until = np.where(entering, np.minimum(until, values[np.minimum(starts + hi, last)] + 1), until)
        counted = lows < hi[:, None]  # the oldest counted event leaves its window
        leaving = values[np.minimum(starts[:, None] + lows, last)] + windows
        until = np.minimum(until, np.where(counted, leaving, END_OF_INPUT).min(axis=1))
    return counts, until
