"""The candidates' counts on the device (serving/features/device_counts.py): the mirrors follow the
host arenas through every kind of change, their counts equal the host's
(``counts_until_many``) to the ms, and a by-ids batch counted on the device scores as the
host-counted one. The torch path runs here on CPU; the Triton kernel and the CUDA mirrors in
the ``gpu`` tests."""

import random

import numpy as np
import pytest
import torch

from tests.test_segment_counts import WINDOWS_MS, random_lists
from streamrec.model.batch import dense_features
from streamrec.serving.features.device_counts import DeviceCounts, DeviceLists, segment_counts_torch
from streamrec.serving.features.entity_store import EntityStore
from streamrec.serving.features.segment_counts import counts_until_many
from streamrec.serving.features.time_lists import CHANGES_KEPT, TimeLists

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


def _lists_of(mirror: DeviceLists, slots: int) -> list[list[int]]:
    values, start, length = mirror.values.cpu().numpy(), mirror.start.cpu().numpy(), mirror.length.cpu().numpy()
    return [values[start[s]: start[s] + length[s]].tolist() for s in range(slots)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_mirror_follows_puts_expiry_growth_compaction_and_clearing(device):
    """Synced after every step: one-slot puts and expiries (cutoffs inside the slot's own
    times) are copied slot by slot, new slots by their bounds, a grown arena grows on the
    device; only compaction, expiry of every slot and clearing copy the whole arena."""
    rng = random.Random(4)
    lists, mirror = TimeLists(slots=4, values=8), DeviceLists(torch.device(device))
    lists.ensure_slots(30)
    slots, whole, expired = 30, 1, 0
    mirror.sync(lists)
    for step in range(1500):
        action = rng.random()
        slot = rng.randrange(slots)
        if action < 0.6:
            start = 10_000 * rng.randrange(0, 40)
            times = sorted(start + rng.randrange(0, 10_000) for _ in range(rng.choice((0, 1, 3, 40, 300))))
            lists.replace_range(slot, np.array(times, np.int64))
        elif action < 0.9:
            some = np.flatnonzero(lists.length[:slots])
            if len(some):
                slot = int(some[rng.randrange(len(some))])
                held = lists.get(slot)
                lists.expire(slot, int(held[rng.randrange(len(held))]))
                expired += 1
        elif action < 0.95:
            slots += 20
            lists.ensure_slots(slots)
        elif action < 0.97:
            lists.compact(slots)
            whole += 1
        elif action < 0.99:
            lists.expire_all(rng.randrange(0, 200_000))
            whole += 1
        else:
            lists.clear()
            whole += 1
        mirror.sync(lists)
        assert _lists_of(mirror, slots) == [lists.get(s).tolist() for s in range(slots)], step
    assert expired > 200 and mirror.full_copies == whole


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [1, 2])
def test_dense_features_on_the_device_equal_the_hosts_at_window_edges(device, seed):
    """``DeviceCounts.dense``: instance rows first (their counters as given), then by-ids rows
    whose item and category counts come from the mirrors: equal to the host's counts
    (``counts_until_many``) to the ms, at an event, one ms either side of it, a window's
    length after it; same-ms events, empty lists, unknown slots. Then the dense features."""
    rng = np.random.default_rng(seed)
    store = EntityStore(history_len=50, budget_bytes=1 << 30)
    for kind in ("item", "category"):
        imps, clicks, _ = random_lists(rng, 60)
        state = store.kinds[kind]
        for entity in range(60):
            store.slot_for_update(kind, 1000 + entity)
        state.imps, state.clicks = imps, clicks
    counts = DeviceCounts(torch.device(device), WINDOWS_MS).warm_up()
    counts.sync(store)
    first, n = 7, 3_000
    items, categories = rng.integers(-1, 60, n), rng.integers(-1, 60, n)
    ts = rng.integers(-1_000, 1_600_000, n)
    for k in range(0, n, 3):
        if items[k] >= 0 and len(held := store.kinds["item"].imps.get(int(items[k]))):
            ts[k] = held[rng.integers(len(held))] + rng.choice([0, 1, -1, WINDOWS_MS[0], WINDOWS_MS[1], WINDOWS_MS[0] + 1])
    ts = ts.astype(np.int64)
    host = rng.integers(0, 50, (first + n, 12)).astype(np.int64)
    want = host.copy()
    want[first:, [2, 3, 4, 5, 8, 9, 10, 11]] = 0
    for e, (kind, slots) in enumerate((("item", items), ("category", categories)), start=1):
        state, known = store.kinds[kind], slots >= 0
        got = np.zeros((n, 4), np.int64)
        got[known] = counts_until_many((state.imps, state.clicks), slots[known], ts[known], WINDOWS_MS)[0]
        for w in range(2):
            want[first:, 6 * w + 2 * e: 6 * w + 2 * e + 2] = got[:, 2 * w: 2 * w + 2]
    host[first:, [2, 3, 4, 5, 8, 9, 10, 11]] = 0  # as assemble_batch leaves them
    dense = counts.dense(host, first, {"item": items, "category": categories, "ts": ts}).cpu().numpy()
    np.testing.assert_allclose(dense, dense_features(want), rtol=1e-6, atol=1e-7)
    assert counts.batches == 1


@pytest.mark.parametrize("device", DEVICES)
def test_searches_as_torch_ops_equal_the_hosts(device):
    """The torch path (CPU serving with candidate_counts = device) on any device."""
    rng = np.random.default_rng(3)
    imps, clicks, _ = random_lists(rng, 40)
    slots, ts = rng.integers(-1, 40, 2_000), rng.integers(-1_000, 1_600_000, 2_000).astype(np.int64)
    known = slots >= 0
    want = np.zeros((len(slots), 4), np.int64)
    want[known] = counts_until_many((imps, clicks), slots[known], ts[known], WINDOWS_MS)[0]
    dev = torch.device(device)
    for k, lists in enumerate((imps, clicks)):
        mirror = DeviceLists(dev)
        mirror.sync(lists)
        got = segment_counts_torch(mirror.values, mirror.start, mirror.length, torch.from_numpy(slots).to(dev),
                                   torch.from_numpy(ts).to(dev), torch.tensor(WINDOWS_MS, device=dev))
        assert (got.cpu().numpy() == want[:, k::2]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_updates_reach_the_device_at_the_next_sync_copying_only_what_changed(device):
    rng = np.random.default_rng(5)
    store = EntityStore(history_len=50, budget_bytes=1 << 30)
    for kind in ("item", "category"):
        for entity in range(20):
            slot = store.slot_for_update(kind, 1000 + entity)
            times = np.sort(rng.integers(0, 900_000, int(rng.integers(0, 200)))).astype(np.int64)
            store.put_bucket(kind, slot, times, times[::5].copy(), None)
    counts = DeviceCounts(torch.device(device), WINDOWS_MS)
    counts.sync(store)
    slot = store.slot("item", 1000)
    store.put_bucket("item", slot, np.array([899_000, 899_500], np.int64), np.zeros(0, np.int64), None)
    store.put_bucket("category", store.slot("category", 1003), np.array([899_100], np.int64), np.array([899_100], np.int64), 850_000)
    counts.sync(store)
    assert counts.full_copies == 4  # the first sync of each arena only
    cat = store.slot("category", 1003)
    dense = counts.dense(np.zeros((1, 12), np.int64), 0, {"item": np.array([slot]), "category": np.array([cat]),
                                                         "ts": np.array([899_800])}).cpu().numpy()
    want = np.zeros((1, 12), np.int64)
    for e, (kind, s) in enumerate((("item", slot), ("category", cat)), start=1):
        state = store.kinds[kind]
        got = counts_until_many((state.imps, state.clicks), np.array([s]), np.array([899_800]), WINDOWS_MS)[0][0]
        want[0, [2 * e, 2 * e + 1, 6 + 2 * e, 7 + 2 * e]] = got
    assert want[0, 2] >= 2 and want[0, 5] >= 1  # the new times are counted
    np.testing.assert_allclose(dense, dense_features(want), rtol=1e-6)


def test_the_change_record_stays_bounded_while_no_mirror_copies():
    """A node whose by-ids traffic stops keeps tailing the topic: its arenas' change records
    must not grow without bound; past the bound the next sync copies everything."""
    lists, mirror = TimeLists(slots=4, values=8), DeviceLists(torch.device("cpu"))
    lists.ensure_slots(10)
    mirror.sync(lists)
    copies = mirror.full_copies
    for step in range(CHANGES_KEPT + 10):
        lists.replace_range(step % 10, np.array([step], np.int64))
    assert len(lists.changes.slots) <= CHANGES_KEPT + 1
    mirror.sync(lists)
    assert mirror.full_copies == copies + 1
    assert _lists_of(mirror, 10) == [lists.get(s).tolist() for s in range(10)]
