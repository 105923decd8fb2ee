"""The candidates' counts on the device (serving/device_counts.py): the mirrors follow the
host arenas through every kind of change, their counts equal the host's
(``counts_until_many``) to the ms, and a by-ids batch counted on the device scores as the
host-counted one. The torch path runs here on CPU; the Triton kernel and the CUDA mirrors in
the ``gpu`` tests."""

import random

import numpy as np
import pytest
import torch

from tests.test_segment_counts import WINDOWS_MS, random_lists
from streamrec.serving.device_counts import DeviceCounts, DeviceLists, _segment_counts, counters_on_device, segment_counts_torch
from streamrec.serving.entity_store import EntityStore
from streamrec.serving.segment_counts import counts_until_many
from streamrec.serving.time_lists import TimeLists

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


def _lists_of(mirror: DeviceLists, slots: int) -> list[list[int]]:
    values, start, length = mirror.values.cpu().numpy(), mirror.start.cpu().numpy(), mirror.length.cpu().numpy()
    return [values[start[s]: start[s] + length[s]].tolist() for s in range(slots)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_mirror_follows_puts_expiry_growth_compaction_and_clearing(device):
    rng = random.Random(4)
    lists, mirror = TimeLists(slots=4, values=8), DeviceLists(torch.device(device))
    lists.ensure_slots(30)
    slots = 30
    for step in range(1500):
        action = rng.random()
        slot = rng.randrange(slots)
        if action < 0.7:
            start = 10_000 * rng.randrange(0, 40)
            times = sorted(start + rng.randrange(0, 10_000) for _ in range(rng.choice((0, 1, 3, 40, 300))))
            lists.replace_range(slot, np.array(times, np.int64))
        elif action < 0.85:
            lists.expire(slot, rng.randrange(0, 400_000))
        elif action < 0.9:
            lists.compact(slots)
        elif action < 0.93:
            lists.expire_all(rng.randrange(0, 200_000))
        elif action < 0.96:
            slots += 20
            lists.ensure_slots(slots)
        elif action < 0.965:
            lists.clear()
        if step % 7 == 0:
            mirror.sync(lists)
            assert _lists_of(mirror, slots) == [lists.get(s).tolist() for s in range(slots)], step
    assert mirror.full_copies < 150  # most syncs copied only what changed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [1, 2])
def test_counts_on_the_device_equal_the_hosts_at_window_edges(device, seed):
    rng = np.random.default_rng(seed)
    imps, clicks, _ = random_lists(rng, 60)
    slots = rng.integers(-1, 60, 3_000)
    ts = rng.integers(-1_000, 1_600_000, 3_000)
    for k in range(0, 3_000, 4):  # at an event, one ms after it, a window's length after it
        if slots[k] >= 0 and len(held := imps.get(int(slots[k]))):
            ts[k] = held[rng.integers(len(held))] + rng.choice([0, 1, -1, WINDOWS_MS[0], WINDOWS_MS[1], WINDOWS_MS[0] + 1])
    ts = ts.astype(np.int64)
    known = slots >= 0
    want = np.zeros((len(slots), 4), np.int64)
    want[known] = counts_until_many((imps, clicks), slots[known], ts[known], WINDOWS_MS)[0]
    dev = torch.device(device)
    windows = torch.tensor(WINDOWS_MS, device=dev)
    for k, lists in enumerate((imps, clicks)):
        mirror = DeviceLists(dev)
        mirror.sync(lists)
        t_slots, t_ts = torch.from_numpy(slots).to(dev), torch.from_numpy(ts).to(dev)
        got = segment_counts_torch(mirror.values, mirror.start, mirror.length, t_slots, t_ts, windows)
        assert (got.cpu().numpy() == want[:, k::2]).all()
        # into the batch's counter columns as the engine does: the kernel on CUDA, torch on CPU
        out = torch.full((len(slots) + 3, 12), -7, dtype=torch.int64, device=dev)
        _segment_counts(mirror, t_slots, t_ts, windows, out, 3, 2 + k)
        assert (out[3:, 2 + k::6].cpu().numpy() == want[:, k::2]).all()
        assert (out[:, [c for c in range(12) if c % 6 != 2 + k]] == -7).all() and (out[:3] == -7).all()


@pytest.mark.parametrize("device", DEVICES)
def test_a_batchs_counter_columns_are_completed_on_the_device(device):
    """``counters_on_device``: the host's user columns kept, the items' and categories' filled
    from the store's arenas for the by-ids rows only, the rows before them untouched."""
    rng = np.random.default_rng(5)
    store = EntityStore(history_len=50, budget_bytes=1 << 30)
    for kind in ("item", "category"):
        for entity in range(20):
            slot = store.slot_for_update(kind, 1000 + entity)
            times = np.sort(rng.integers(0, 900_000, int(rng.integers(0, 200)))).astype(np.int64)
            store.put_bucket(kind, slot, times, times[::5].copy(), None)
    counts = DeviceCounts(torch.device(device), WINDOWS_MS)
    counts.sync(store)
    host = rng.integers(0, 9, (50, 12)).astype(np.int64)
    first, n = 10, 40
    items = np.array([store.slot("item", 1000 + int(e)) if e < 20 else -1 for e in rng.integers(0, 25, n)], np.int64)
    categories = np.array([store.slot("category", 1000 + int(e)) for e in rng.integers(0, 20, n)], np.int64)
    ts = rng.integers(0, 1_200_000, n).astype(np.int64)
    got = counters_on_device(counts, host, first, {"item": items, "category": categories, "ts": ts}).cpu().numpy()
    assert (got[:first] == host[:first]).all()
    for c in range(12):
        entity = (c % 6) // 2
        if entity == 0:
            assert (got[:, c] == host[:, c]).all()
    for e, (kind, slots) in enumerate((("item", items), ("category", categories)), start=1):
        state = store.kinds[kind]
        known = slots >= 0
        want = np.zeros((n, 4), np.int64)
        want[known] = counts_until_many((state.imps, state.clicks), slots[known], ts[known], WINDOWS_MS)[0]
        for w in range(2):
            for k in range(2):
                assert (got[first:, w * 6 + 2 * e + k] == want[:, 2 * w + k]).all(), (kind, w, k)
    # later updates reach the device at the next sync, copying only what changed
    slot = store.slot("item", 1000)
    store.put_bucket("item", slot, np.array([899_000, 899_500], np.int64), np.zeros(0, np.int64), None)
    counts.sync(store)
    again = counters_on_device(counts, host[:1], 0, {"item": np.array([slot]), "category": np.array([-1]), "ts": np.array([899_800])})
    state = store.kinds["item"]
    want = counts_until_many((state.imps, state.clicks), np.array([slot]), np.array([899_800]), WINDOWS_MS)[0][0]
    assert again[0, 2].item() == want[0] and again[0, 8].item() == want[2]
    assert counts.full_copies == 4  # the first sync of each arena only
