"""Windowed counts of many (slot, ts) queries at once (serving/features/segment_counts.py) equal the
per-entity reference ``EntityCounts.counts_until`` on random event times: same-ms events,
empty lists, a ts before, inside and after an entity's times, window edges to the ms."""

from array import array

import numpy as np
import pytest

from streamrec.contracts.feature_state import EntityCounts
from streamrec.serving.features.segment_counts import counts_until_many, segment_searchsorted
from streamrec.serving.features.time_lists import TimeLists

WINDOWS_MS = (60_000, 600_000)


def random_lists(rng: np.random.Generator, entities: int) -> tuple[TimeLists, TimeLists, list[EntityCounts]]:
    imps, clicks, reference = TimeLists(slots=4, values=8), TimeLists(slots=4, values=8), []
    imps.ensure_slots(entities)
    clicks.ensure_slots(entities)
    for slot in range(entities):
        n = int(rng.choice([0, 1, 3, 40, 700]))
        times = np.sort(rng.integers(0, 900_000, n)).astype(np.int64)
        times[1::3] = times[0::3][: len(times[1::3])]  # ties: events at the same ms
        times.sort()
        clicked = np.sort(rng.choice(times, size=len(times) // 7, replace=False)) if len(times) else times[:0]
        imps.replace_range(slot, times)
        clicks.replace_range(slot, clicked.astype(np.int64))
        reference.append(EntityCounts(array("q", times.tolist()), array("q", clicked.tolist())))
    return imps, clicks, reference


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_counts_of_many_queries_equal_the_per_entity_reference(seed):
    rng = np.random.default_rng(seed)
    imps, clicks, reference = random_lists(rng, 60)
    slots = rng.integers(0, 60, 2_000)
    ts = rng.integers(-1_000, 1_600_000, 2_000)
    # exact edges: at an event, one ms after it, a window's length after it
    for k in range(0, 2_000, 5):
        held = imps.get(int(slots[k]))
        if len(held):
            ts[k] = held[rng.integers(len(held))] + rng.choice([0, 1, WINDOWS_MS[0], WINDOWS_MS[1], WINDOWS_MS[0] + 1])
    counts, until = counts_until_many((imps, clicks), slots, ts.astype(np.int64), WINDOWS_MS)
    for k, (slot, at) in enumerate(zip(slots.tolist(), ts.tolist())):
        want, want_until = reference[slot].counts_until(at, WINDOWS_MS)
        assert counts[k].tolist() == want and int(until[k]) == want_until, (slot, at)


def test_segment_search_equals_numpy_per_segment():
    rng = np.random.default_rng(7)
    values = np.concatenate([np.sort(rng.integers(0, 50, n)) for n in (0, 1, 5, 17, 64)]).astype(np.int64)
    starts = np.array([0, 0, 1, 6, 23], np.int64)
    lengths = np.array([0, 1, 5, 17, 64], np.int64)
    for target in range(-1, 52):
        got = segment_searchsorted(values, starts, lengths, np.full(5, target, np.int64))
        want = [np.searchsorted(values[s: s + n], target) for s, n in zip(starts, lengths)]
        assert got.tolist() == want
