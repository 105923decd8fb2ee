"""Batched by-ids assembly against the per-entity reference: the counter cache gives every
candidate the counts its entity's event times give at the request's ts, whatever the order
of the requests' times and the updates between them."""

import random
from array import array
from types import SimpleNamespace

import numpy as np

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.feature_state import END_OF_INPUT, CounterBucket, EntityCounts
from streamrec.serving.by_ids import ByIdsQuery
from streamrec.serving.features.online_features import REPLAY_HORIZON_MS, OnlineFeatures

WINDOWS = (60_000, 600_000)


def test_counts_hold_exactly_until_the_first_change():
    rng = random.Random(3)
    for _ in range(300):
        imps = sorted(rng.randrange(0, 2_000_000) for _ in range(rng.randrange(0, 30)))
        clicks = sorted(rng.choice(imps) for _ in range(rng.randrange(0, len(imps) + 1))) if imps else []
        counts = EntityCounts(array("q", imps), array("q", clicks))
        ts = rng.choice(imps + [rng.randrange(0, 2_700_000)]) if imps else rng.randrange(0, 2_700_000)
        got, until = counts.counts_until(ts, WINDOWS)
        assert got == counts.counts(ts, WINDOWS)
        if until < END_OF_INPUT:
            assert until > ts
            assert counts.counts(until - 1, WINDOWS) == got, (imps, clicks, ts, until)
            assert counts.counts(until, WINDOWS) != got, (imps, clicks, ts, until)
        else:
            assert counts.counts(ts + 10**9, WINDOWS) == got


def record(key: str, value: bytes | None):
    return SimpleNamespace(key=key.encode(), value=value, partition=0, offset=0)


def test_a_batch_equals_the_reference_through_updates_and_requests_in_any_order(tmp_path):
    """Against EntityCounts fed the same buckets and expired on the same horizon."""
    rng = random.Random(7)
    store = OnlineFeatures("unused:0", "t", FeatureSpec(), 64, tmp_path / "spill")
    store.partitions = 1
    windows = store.windows_ms
    reference: dict[tuple[str, int], EntityCounts] = {}

    def bucket(kind: str, entity: int, start: int) -> None:
        offsets = sorted(rng.randrange(0, 10_000) for _ in range(rng.randrange(1, 12)))
        clicks = sorted(rng.sample(offsets, rng.randrange(0, len(offsets) + 1)))
        as_of = store.as_of()
        store._apply_records([record(f"c/{kind}/{entity}/{start}", b'{"i":%s,"c":%s}' % (str(offsets).encode(), str(clicks).encode()))])
        counts = reference.setdefault((kind, entity), EntityCounts())
        counts.put(CounterBucket(kind, entity, start, array("q", [start + o for o in offsets]), array("q", [start + o for o in clicks])))
        if as_of is not None:
            counts.expire(as_of - store.max_window_ms - REPLAY_HORIZON_MS)

    for step in range(40):
        for stage in ("user", "item", "category"):  # watermarks move on: old times expire past the horizon
            store._apply_records([record(f"w/{stage}/0/0", b'{"wm":%d,"n":1}' % (10_000 * step))])
        for _ in range(rng.randrange(1, 6)):  # updates between batches: some entities change
            bucket(rng.choice(("item", "category")), rng.randrange(1, 15), 10_000 * rng.randrange(0, 30))
        queries = []
        for _ in range(rng.randrange(1, 5)):
            n = rng.randrange(1, 40)
            ids = np.array([[rng.randrange(1, 20), rng.randrange(1, 20), 3, rng.randrange(0, 5)] for _ in range(n)], np.int64)
            queries.append(ByIdsQuery(rng.randrange(1, 4), rng.randrange(0, 400_000), "ios", 3, ids))
        batch = store.assemble_batch(queries)
        names = store.spec.counter_columns()
        at = 0
        for q in queries:
            for row in q.candidates.tolist():
                want = {}
                for kind, entity in (("item", row[0]), ("category", row[1])):
                    counts = reference.get((kind, entity))
                    values = counts.counts(q.ts, windows) if counts is not None else [0] * 4
                    for k, w in enumerate(store.spec.windows_s):
                        want[store.spec.counter_name(kind, "imps", w)] = values[2 * k]
                        want[store.spec.counter_name(kind, "clicks", w)] = values[2 * k + 1]
                got = dict(zip(names, batch.columns.counters[at].tolist()))
                assert {k: got[k] for k in want} == want, (step, q.ts, row)
                at += 1
    cache = store._counters["item"]
    assert cache.hits > 0 and cache.misses > 0  # both paths ran
    store.close()


def test_a_snapshot_restores_every_entity_and_the_watermarks(tmp_path):
    from streamrec.serving.features.feature_snapshot import CorruptSnapshot, read_snapshot

    rng = random.Random(5)
    store = OnlineFeatures("unused:0", "t", FeatureSpec(), 64, tmp_path / "spill")
    records = [record("w/user/0/0", b'{"wm":5000,"n":1}'), record("w/item/0/0", b'{"wm":6000,"n":1}'),
               record("w/category/0/0", b'{"wm":7000,"n":1}'), record("h/user/2", b'{"h":[[9,4,1003],[8,3,900]]}')]
    for k in range(300):
        kind = rng.choice(("user", "item", "category"))
        records.append(record(f"c/{kind}/{rng.randrange(1, 60)}/{10_000 * rng.randrange(0, 5)}",
                              b'{"i":[%d,%d],"c":[%d]}' % (k, k + 7, k + 7)))
    store._apply_records(records)
    store.partitions, store._positions = 1, {0: 304}
    snapshot = tmp_path / "features.arrow"
    store.save_snapshot(snapshot, chunk=16)  # many chunks
    restored = OnlineFeatures("unused:0", "t", FeatureSpec(), 64, tmp_path / "spill2")
    restored.load_snapshot(snapshot)
    assert restored.as_of() == store.as_of() == 5001 and restored._positions == {0: 304}
    keys = store.store.keys()
    assert sorted(restored.store.keys()) == sorted(keys) and len(keys) > 100
    assert store.store.read("user", 2)[2] == [9, 4, 1003, 8, 3, 900]
    for key in keys:
        assert restored.store.read(*key) == store.store.read(*key), key
    (tmp_path / "other.arrow").write_bytes(snapshot.read_bytes()[:100])  # a torn copy is refused, never half-read
    try:
        read_snapshot(tmp_path / "other.arrow")
        raise AssertionError("a torn snapshot was read")
    except CorruptSnapshot as exc:
        assert "not a feature snapshot" in str(exc)
    store.close()
    restored.close()


def test_a_damaged_or_foreign_snapshot_is_refused_and_leaves_nothing_behind(tmp_path):
    from streamrec.serving.features.feature_snapshot import CorruptSnapshot

    store = OnlineFeatures("unused:0", "t", FeatureSpec(), 64, tmp_path / "spill")
    store._apply_records([record(f"c/user/{k}/0", b'{"i":[1,2],"c":[2]}') for k in range(1, 3000)])
    store.partitions, store._positions = 1, {0: 3000}
    snapshot = tmp_path / "features.arrow"
    store.save_snapshot(snapshot, chunk=500)
    data = bytearray(snapshot.read_bytes())
    data[len(data) // 2: len(data) // 2 + 4096] = bytes(4096)  # damaged in the middle, footer intact
    damaged = tmp_path / "damaged.arrow"
    damaged.write_bytes(bytes(data))
    other_spec = OnlineFeatures("unused:0", "t", FeatureSpec(windows_s=(60, 3600)), 64, tmp_path / "spill3")
    for target, path, words in ((OnlineFeatures("unused:0", "t", FeatureSpec(), 64, tmp_path / "spill2"), damaged, "cannot be read"),
                                (other_spec, snapshot, "feature spec"),
                                (OnlineFeatures("unused:0", "other", FeatureSpec(), 64, tmp_path / "spill4"), snapshot, "holds t")):
        try:
            target.load_snapshot(path)
            raise AssertionError(f"{path} was loaded")
        except CorruptSnapshot as exc:
            assert words in str(exc), exc
        assert target.store.keys() == [] and target._positions == {} and not target.started_from_snapshot
        target.close()
    assert not list(tmp_path.glob(".features.arrow.*"))  # no temporary left by the writer
    store.close()
