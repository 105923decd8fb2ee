"""The columnar entity store of the online features (serving/features/entity_store.py and its parts)
against the per-entity reference semantics of contracts/feature_state.py: ``EntityCounts``
for counter times, ``UserHistory`` (keeping twice the history length) for click histories.
Randomized: window edges, same-ms events, tombstones, expiry, history overflow, long time
spans, wide ids, unknown ids, a snapshot in the middle, and the memory budget."""

import logging
import random
from array import array
from types import SimpleNamespace

import numpy as np
import orjson
import pyarrow as pa
import pytest

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.feature_state import END_OF_INPUT, CounterBucket, EntityCounts, History, UserHistory, Watermarks
from streamrec.serving.by_ids import ByIdsQuery
from streamrec.serving.features.entity_store import EntityStore
from streamrec.serving.features.feature_snapshot import SCHEMA, CorruptSnapshot, SnapshotHeader, write_snapshot
from streamrec.serving.features.history_rows import HistoryRows
from streamrec.serving.features.id_index import IdIndex
from streamrec.serving.features.online_features import REPLAY_HORIZON_MS, OnlineFeatures
from streamrec.serving.features.segment_counts import counts_until_many
from streamrec.serving.features.time_lists import TimeLists

SPEC = FeatureSpec(history_len=8, windows_s=(60, 600))
WINDOWS = tuple(w * 1000 for w in SPEC.windows_s)


def record(key: str, value) -> SimpleNamespace:
    return SimpleNamespace(key=key.encode(), value=None if value is None else orjson.dumps(value), partition=0, offset=0)


def test_the_id_index_maps_every_id_to_its_slot_and_nothing_else():
    rng = random.Random(1)
    index, want = IdIndex(capacity=16), {}
    extremes = [0, -1, 2**63 - 1, -(2**63), 2**32, -(2**31)]
    for step in range(30):
        if step % 3 == 0:  # a batch of new ids (a snapshot's)
            fresh = list({rng.randrange(-(2**63), 2**63) for _ in range(rng.randrange(1, 3000))} - set(want))
            if step == 0:
                fresh = extremes + [i for i in fresh if i not in extremes]
            slots = index.add_new(np.array(fresh, np.int64))
            want.update(zip(fresh, slots.tolist()))
        for _ in range(rng.randrange(1, 200)):  # single ids, some known (a topic's records)
            entity = rng.choice(list(want)) if rng.random() < 0.3 else rng.randrange(-1000, 1000)
            slot = index.add(entity)
            assert want.setdefault(entity, slot) == slot
        probe = list(want)[:: 7] + [rng.randrange(-(2**63), 2**63) for _ in range(500)]
        got = index.lookup(np.array(probe, np.int64)).tolist()
        assert got == [want.get(i, -1) for i in probe]
        assert all(index.get(i) == want.get(i, -1) for i in probe[:300])
    assert len(index) == len(want) and sorted(want.values()) == list(range(len(want)))
    assert index.ids[: len(index)].tolist() == sorted(want, key=want.get)


def test_history_rows_grow_in_place_and_keep_every_users_list():
    """Rows past the first capacity, lists longer than a row (side table) and shorter ones,
    ids past int32 arriving late: every user's list reads back as it was put."""
    rng = random.Random(5)
    rows, want = HistoryRows(history_len=8, capacity=4), {}
    for user in range(5000):
        rows.ensure_slots(user + 1)
        n = rng.choice((0, 1, 8, 12, 20))
        wide = 2**40 if user > 4000 and rng.random() < 0.1 else 0
        clicks = np.array([[rng.randrange(1, 99) + wide, rng.randrange(-9, 9), 10**12 - 1000 * k] for k in range(n)], np.int64).reshape(-1, 3)
        rows.put(user, clicks, None)
        want[user] = clicks[:16]
    assert rows.rows == 5000 and rows.overflow and rows.items.dtype == np.int64
    for user, clicks in want.items():
        assert rows.get(user).tolist() == clicks.tolist(), user


def test_time_lists_follow_entity_counts_through_puts_expiry_and_compaction():
    rng = random.Random(2)
    lists, reference = TimeLists(slots=4, values=8), {}
    lists.ensure_slots(40)
    for step in range(3000):
        slot = rng.randrange(40)
        ref = reference.setdefault(slot, EntityCounts())
        action = rng.random()
        if action < 0.7:
            start = 10_000 * rng.randrange(0, 40)
            n = rng.choice((0, 1, 2, 5, 30, 300))  # empty, small, and hot buckets (past the list threshold)
            times = sorted(start + rng.randrange(0, 10_000 if rng.random() < 0.8 else 3) for _ in range(n))  # some same-ms
            lists.replace_range(slot, np.array(times, np.int64))
            ref.put(CounterBucket("item", slot, start, array("q", times), array("q")))
        elif action < 0.9:
            cutoff = rng.randrange(0, 400_000)
            lists.expire(slot, cutoff)
            ref.expire(cutoff)
        elif action < 0.95:
            lists.compact(40)
        else:
            cutoff = rng.randrange(0, 200_000)
            lists.expire_all(cutoff)
            for r in reference.values():
                r.expire(cutoff)
        if step % 50 == 0:
            for s, r in reference.items():
                assert lists.get(s).tolist() == list(r.imps), (step, s)
            assert lists.waste == lists.used - int(lists.length[:40].sum())
    slots = np.array([rng.randrange(-1, 40) for _ in range(200)], np.int64)
    ts = np.array([rng.choice((rng.randrange(0, 450_000), *(list(reference.get(int(s), EntityCounts()).imps) or [5])))
                   for s in slots], np.int64)
    known = slots >= 0
    got = np.zeros((len(slots), 2 * len(WINDOWS)), np.int64)  # the list counted as both kinds: its columns 0, 2, ...
    got[known] = counts_until_many((lists, lists), slots[known], ts[known], WINDOWS)[0]
    for k, (s, t) in enumerate(zip(slots.tolist(), ts.tolist())):
        want = reference[s].counts(t, WINDOWS)[0::2] if s in reference else [0, 0]
        assert got[k, 0::2].tolist() == want, (s, t)


def test_counts_until_equals_the_reference_at_window_edges():
    rng = random.Random(3)
    store = OnlineFeatures("unused:0", "t", SPEC, 64, "/tmp/unused-spill")
    for entity in range(200):
        imps = sorted(rng.randrange(0, 2_000_000) for _ in range(rng.randrange(0, 30)))
        clicks = sorted(rng.choice(imps) for _ in range(rng.randrange(0, len(imps) + 1))) if imps else []
        slot = store.store.slot_for_update("item", entity)
        store.store.put_bucket("item", slot, np.array(imps, np.int64), np.array(clicks, np.int64), None)
        ref = EntityCounts(array("q", imps), array("q", clicks))
        edges = [t + d for t in imps[:3] for d in (-1, 0, 1)] + [t + w + d for t in imps[:3] for w in WINDOWS for d in (-1, 0, 1)]
        for ts in edges + [rng.randrange(0, 2_700_000)]:
            got = store.store.counts_until("item", slot, ts, WINDOWS)
            assert got == ref.counts_until(ts, WINDOWS), (imps, clicks, ts)
            assert got[1] == END_OF_INPUT or got[1] > ts


class World:
    """A job's published state for a few users: click streams with the job's history lists
    (head of the current ms + history_len, most recent first), counter buckets, watermarks;
    every record also applied to the references."""

    def __init__(self, rng: random.Random, users: int, wide_ids: bool) -> None:
        self.rng, self.users, self.now = rng, users, 1_000_000
        self.wide = wide_ids
        self.job_lists: dict[int, list[tuple[int, int, int]]] = {}
        self.histories: dict[int, UserHistory] = {}
        self.counts: dict[int, EntityCounts] = {}
        self.as_of: int | None = None

    def records(self, steps: int) -> list:
        """One ``_apply_records`` call's worth: its expiry horizon is the as_of before it."""
        rng, out, as_of = self.rng, [], self.as_of
        for _ in range(steps):
            self.now += rng.choice((0, 0, 1, 7, 500, 5_000, 40_000, 3_000_000_000 if rng.random() < 0.01 else 1))
            user = rng.randrange(1, self.users + 1)
            burst = rng.choice((1, 1, 1, 3, 12))  # 12: more clicks in the horizon than a row has room for
            for _ in range(burst):
                item = rng.randrange(1, 50) + (2**40 if self.wide and rng.random() < 0.3 else 0)
                category = rng.randrange(-5, 20) - (2**35 if self.wide and rng.random() < 0.2 else 0)
                held = self.job_lists.setdefault(user, [])
                head = sum(1 for c in held if c[2] == self.now)
                held.insert(0, (item, category, self.now))
                del held[head + 1 + SPEC.history_len:]
            if rng.random() < 0.7:  # the job publishes (else the next publication coalesces these clicks)
                out.append(record(f"h/user/{user}", {"h": [list(c) for c in self.job_lists[user]]}))
                self.histories.setdefault(user, UserHistory()).put(History(user, tuple(self.job_lists[user])), 2 * SPEC.history_len)
            if rng.random() < 0.5:
                start = self.now // 10_000 * 10_000
                imps = sorted(rng.randrange(start, self.now + 1) for _ in range(rng.randrange(0, 6)))
                clicks = imps[: rng.randrange(0, len(imps) + 1)]
                value = None if rng.random() < 0.1 else {"i": [t - start for t in imps], "c": [t - start for t in clicks]}
                out.append(record(f"c/user/{user}/{start}", value))
                ref = self.counts.setdefault(user, EntityCounts())
                ref.put(CounterBucket("user", user, start, None if value is None else array("q", imps), array("q", clicks)))
                if as_of is not None:
                    ref.expire(as_of - max(WINDOWS) - REPLAY_HORIZON_MS)
            if rng.random() < 0.3:  # the watermarks move up to the present
                self.as_of = self.now - rng.randrange(0, 3000)
                out += [record(f"w/{stage}/0/0", {"wm": self.as_of - 1, "n": 1}) for stage in ("user", "item", "category")]
        return out

    def check(self, features: OnlineFeatures, queries: int = 300) -> None:
        """Users' counters and histories of a batch of requests at ts >= as_of - horizon."""
        rng = self.rng
        low = (self.as_of if self.as_of is not None else 0) - REPLAY_HORIZON_MS
        qs = []
        for _ in range(queries):
            user = rng.randrange(0, self.users + 3)  # 0 and past the last: unknown
            known = [c[2] for c in self.job_lists.get(user, [])]
            ts = rng.choice([low, low + 1, self.now + 1, rng.randrange(low, self.now + 2)] + [t + d for t in known[:12] for d in (0, 1)])
            qs.append(ByIdsQuery(user, max(ts, low), "ios", 3, np.array([[1, 1, 1, 0]], np.int64), return_features=True))
        batch = features.assemble_batch(qs)
        for q, got in zip(qs, batch.features):
            got = got[0]
            history = self.histories.get(q.user_id)
            want_items, want_categories = history.before(q.ts, SPEC.history_len) if history else ([], [])
            assert (got["hist_item_ids"], got["hist_category_ids"]) == (want_items, want_categories), (q.user_id, q.ts)
            counts = self.counts[q.user_id].counts(q.ts, WINDOWS) if q.user_id in self.counts else [0] * 4
            assert [got[f"user_{c}_{w}s"] for w in SPEC.windows_s for c in ("imps", "clicks")] == counts, (q.user_id, q.ts)


@pytest.mark.parametrize("wide_ids", [False, True])
def test_users_features_equal_the_reference_through_updates_and_a_snapshot(tmp_path, wide_ids):
    """Every request at ts >= as_of - REPLAY_HORIZON_MS gets the reference's counters and
    history, on the node that read every record and on one that started from a snapshot
    taken halfway; both also after cutting the state to the horizon (``expire_all``)."""
    rng = random.Random(11 + wide_ids)
    world = World(rng, users=60, wide_ids=wide_ids)
    first = OnlineFeatures("unused:0", "t", SPEC, 64, tmp_path / "a")
    first.partitions = 1
    for _ in range(15):
        first._apply_records(world.records(40))
        world.check(first)
    assert first.store.history.overflow, "no list went to the side table: the test does not reach it"
    snapshot = tmp_path / "half.arrow"
    first.save_snapshot(snapshot, chunk=7)
    second = OnlineFeatures("unused:0", "t", SPEC, 64, tmp_path / "b")
    second.load_snapshot(snapshot)
    world.check(second)
    for _ in range(15):
        records = world.records(40)
        first._apply_records(records)
        second._apply_records(records)
        world.check(first)
        world.check(second)
    cutoff = first.as_of() - REPLAY_HORIZON_MS
    for features in (first, second):
        features.store.expire_all(cutoff - max(WINDOWS), cutoff)
        world.check(features)
    assert sorted(first.store.keys()) == sorted(second.store.keys())
    for key in first.store.keys():  # cut to the same horizon, the two states are the same
        assert first.store.read(*key) == second.store.read(*key), key
    items = first.store.history.items
    assert items.dtype == (np.int64 if wide_ids else np.int32)


def test_a_snapshot_from_a_mixed_batch_of_kinds_loads_and_a_repeated_id_is_refused(tmp_path):
    """Batches may hold several kinds (the row-per-entity writer's); an id twice is no snapshot of ours."""
    kinds = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0, 2], pa.int8()), pa.array(["user", "item", "category"]))
    times = pa.array([[5, 9], [7], None, [1, 2, 3]], pa.list_(pa.int64()))
    history = pa.array([[11, 3, 900, 10, 2, 800], None, None, None], pa.list_(pa.int64()))
    header = SnapshotHeader("t", 1, {0: 4}, Watermarks(), {"windows_s": [60, 600], "history_len": 8})
    for ids, good in (([1, 1, 2, 1], True), ([1, 1, 1, 1], False)):
        batch = pa.record_batch([kinds, pa.array(ids, pa.int64()), times, times, history], schema=SCHEMA)
        path = tmp_path / f"s{good}.arrow"
        write_snapshot(path, header, [batch])
        features = OnlineFeatures("unused:0", "t", SPEC, 64, tmp_path / "spill")
        if good:
            features.load_snapshot(path)
            assert features.store.read("user", 1) == ([5, 9], [5, 9], [11, 3, 900, 10, 2, 800])
            assert features.store.read("user", 2) == ([], [], None) and features.store.read("item", 1) == ([7], [7], None)
            assert features.store.read("category", 1) == ([1, 2, 3], [1, 2, 3], None) and features.store.read("item", 2) is None
        else:
            with pytest.raises(CorruptSnapshot, match="appears twice"):
                features.load_snapshot(path)
            assert features.store.keys() == []


def test_past_the_budget_new_entities_are_refused_and_known_ones_stay_exact(tmp_path, caplog):
    rng = random.Random(4)
    world = World(rng, users=3000, wide_ids=False)
    features = OnlineFeatures("unused:0", "t", SPEC, 1, tmp_path / "spill")  # 1 MiB
    features.partitions = 1
    with caplog.at_level(logging.WARNING, logger="streamrec.serving.features"):
        for _ in range(40):
            features._apply_records(world.records(400))
    status = features.status()
    assert status["over_budget"] and status["refused"] > 0 and 0 < status["entities"]["user"] < 3000
    assert any("over the memory budget" in r.getMessage() for r in caplog.records)
    admitted = {i for kind, i in features.store.keys() if kind == "user"}
    more = world.records(400)  # the admitted ones keep updating, exactly
    features._apply_records([r for r in more if r.key.startswith(b"w/") or int(r.key.split(b"/")[2]) in admitted])
    refused = (set(world.job_lists) | set(world.counts)) - admitted
    assert refused
    for user in refused:  # requests for them: cold start
        world.histories.pop(user, None)
        world.counts.pop(user, None)
    world.check(features, queries=2000)
    assert features.status()["entities"]["user"] == len(admitted)


def test_a_snapshot_larger_than_the_first_capacities_round_trips(tmp_path):
    """Thousands of entities: loading grows every column past its first size."""
    rng = random.Random(6)
    store = OnlineFeatures("unused:0", "t", SPEC, 64, tmp_path / "a")
    records = [record(f"w/{stage}/0/0", {"wm": 5_000_000, "n": 1}) for stage in ("user", "item", "category")]
    for entity in range(1, 5001):
        kind = ("user", "item", "category")[entity % 3]
        times = sorted(rng.randrange(0, 10_000) for _ in range(rng.randrange(0, 9)))
        records.append(record(f"c/{kind}/{entity}/4990000", {"i": times, "c": times[:1]}))
        if kind == "user":
            records.append(record(f"h/user/{entity}", {"h": [[entity, k, 4_999_000 - k] for k in range(rng.randrange(0, 12))]}))
    store._apply_records(records)
    store.partitions = 1
    store.save_snapshot(tmp_path / "s.arrow", chunk=999)
    restored = OnlineFeatures("unused:0", "t", SPEC, 64, tmp_path / "b")
    restored.load_snapshot(tmp_path / "s.arrow")
    keys = store.store.keys()
    assert len(keys) == 5000 and sorted(restored.store.keys()) == sorted(keys)
    for key in keys:
        assert restored.store.read(*key) == store.store.read(*key), key


def test_a_compaction_is_built_outside_the_lock_and_keeps_every_list():
    """The store's one writer squeezes a wasteful arena while requests go on: the new arena is
    built with the lock free, the lock is taken only to switch to it, and every list reads the
    same after."""
    rng = np.random.default_rng(4)
    store = EntityStore(history_len=8, budget_bytes=2**30)
    slots = [store.slot_for_update("item", i) for i in range(300)]
    for round_ in range(40):  # lists that grow move to the arena's end: waste behind them
        for slot in slots:
            times = np.sort(rng.integers(0, 10_000, int(rng.integers(1, 20)))) + 10_000 * round_
            store.put_bucket("item", slot, times.astype(np.int64), times[::5].astype(np.int64), None)
    state = store.kinds["item"]
    assert state.wasteful(), (state.imps.waste, state.imps.live)
    before = {slot: (state.imps.get(slot).tolist(), state.clicks.get(slot).tolist()) for slot in slots}

    class Lock:
        held = 0
        entered = 0

        def __enter__(self):
            Lock.held += 1
            Lock.entered += 1

        def __exit__(self, *exc):
            Lock.held -= 1

    built = []
    compacted = TimeLists.compacted

    def watched(lists, n):
        built.append(Lock.held)
        return compacted(lists, n)

    TimeLists.compacted = watched
    try:
        store.compact_wasteful(Lock())
    finally:
        TimeLists.compacted = compacted
    assert built and built == [0] * len(built) and Lock.entered == len(built)  # built lock-free, switched under it
    assert not state.wasteful() and state.imps.waste == 0
    for slot, (imps, clicks) in before.items():
        assert state.imps.get(slot).tolist() == imps and state.clicks.get(slot).tolist() == clicks
