"""The features-topic reader on hand-made records: corrupt records are counted and skipped,
never fatal, and a bucket's updates keep the semantics the job's state has."""

from types import SimpleNamespace

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.feature_state import ENTITIES, StageWatermark, Watermarks
from streamrec.serving.features.online_features import OnlineFeatures


def record(key, value, offset=0):
    return SimpleNamespace(key=key, value=value, partition=0, offset=offset)


def test_corrupt_records_are_counted_and_skipped(tmp_path):
    store = OnlineFeatures("unused:0", "t", FeatureSpec(), 16, tmp_path / "spill")
    bad = [record(None, b"{}"), record(b"\xff\xfe", b"{}"), record(b"c/user/1/0", b"not json"),
           record(b"c/user/x/0", b'{"i":[],"c":[]}'), record(b"c/user/1/0", b'{"i":[5,3],"c":[]}'),
           record(b"c/user/1/0", b'{"i":[-1],"c":[]}'), record(b"h/user/1", b'{"h":[[1,2]]}'),
           record(b"w/user/0/0", b'{"wm":"soon","n":1}'), record(b"x/y", b"{}"), record(b"c/user/1/0", b"[1]"),
           record(b"h/user/1", b'{"h":[[1,2,18446744073709551615]]}'), record(b"c/user/9223372036854775808/0", b'{"i":[1],"c":[]}'),
           record(b"c/user/1/9223372036854775800", b'{"i":[100],"c":[]}'), record(b"h/user/1", b'{"h":[[1,true,3]]}')]
    good = [record(b"c/user/1/10000", b'{"i":[0,0,7],"c":[3]}'), record(b"h/user/1", b'{"h":[[9,4,10003]]}')]
    store._apply_records(bad + good)
    status = store.status()
    assert status["corrupt"] == len(bad) and status["messages"] == len(bad) + len(good)
    assert "partition 0 offset 0" in status["last_corrupt"]
    features = store.assemble(1, 10_008, "ios", 3, [SimpleNamespace(item_id=5, category_id=6, advertiser_id=7, position=1)],
                              with_features=True).features[0]
    assert features["user_imps_60s"] == 3 and features["user_clicks_60s"] == 1 and features["hist_item_ids"] == [9]
    assert store.assemble(1, 10_007, "ios", 3, [SimpleNamespace(item_id=5, category_id=6, advertiser_id=7, position=1)],
                          with_features=True).features[0]["user_imps_60s"] == 2  # the event at 10,007 ms is not before it
    store.close()


def test_an_expired_prefix_is_kept_until_the_readers_horizon(tmp_path):
    """The job drops a bucket's oldest times when they leave its largest window; a request in
    the past still counts them (serving.features.online_features.REPLAY_HORIZON_MS)."""
    store = OnlineFeatures("unused:0", "t", FeatureSpec(), 16, tmp_path / "spill")
    store._apply_records([record(b"c/item/5/0", b'{"i":[1,2,3],"c":[]}'), record(b"c/item/5/0", b'{"i":[3,4],"c":[]}'),
                          record(b"c/item/5/0", None)])  # then a tombstone: the reader keeps the times
    c = SimpleNamespace(item_id=5, category_id=6, advertiser_id=7, position=1)
    assert store.assemble(1, 100, "ios", 3, [c], with_features=True).features[0]["item_imps_60s"] == 4  # 1, 2, 3, 4
    store.close()


def test_features_as_of_follows_every_watermark_it_is_asked_after():
    """``Watermarks.as_of`` is kept between watermarks (serving asks it per request): every
    put is seen by the next ask, for each partition count asked."""
    marks = Watermarks()
    assert marks.as_of(2) is None
    for p in range(2):
        for stage in ENTITIES:
            marks.put(StageWatermark(stage, 0, p, 1_000, 1))
    assert marks.as_of(2) == marks.as_of(2) == 1_001 and marks.as_of(1) == 1_001
    marks.put(StageWatermark("item", 0, 1, 900, 1))
    assert marks.as_of(2) == 901 and marks.as_of(1) == 1_001
    for stage in ENTITIES:
        marks.put(StageWatermark(stage, 0, 1, 2_000, 1))
    assert marks.as_of(2) == 1_001
    marks.put(StageWatermark("user", 1, 0, 5, 2))  # a stage's second subtask reports, to partition 0 only
    assert marks.as_of(1) == 6 and marks.as_of(2) is None
