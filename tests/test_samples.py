"""The sample contract's reference builder: point-in-time features on a hand-built
sequence, labels exactly as the generator's truth says, one sample per impression."""

import json
from collections import Counter

import orjson
import pyarrow.parquet as pq
import pytest

from streamrec.generator.bad_events import EXPECTED_REASON
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.pipelines.samples import SampleBuilder, read_run
from tests.conftest import run_cli

NOW = 10**13


def imp(eid, ts, user, item, req, cat=1, pos=1):
    return orjson.dumps({"type": "impression", "event_id": eid, "ts": ts, "user_id": user, "item_id": item,
                         "request_id": req, "position": pos, "context": {"device": "ios", "local_hour": 3},
                         "item": {"category_id": cat, "advertiser_id": 9}})


def click(eid, ts, user, item, req):
    return orjson.dumps({"type": "click", "event_id": eid, "ts": ts, "user_id": user, "item_id": item, "request_id": req})


def build(events, **spec):
    builder = SampleBuilder(FeatureSpec(windows_s=(60,), **spec))
    for raw in events:
        builder.add(raw, NOW)
    table = builder.build()
    return {row["event_id"]: row for row in table.to_pylist()}, builder


def test_features_are_point_in_time():
    rows, _ = build([
        imp("i1", 1_000, user=7, item=100, req="r1", cat=5),
        click("c1", 2_000, user=7, item=100, req="r1"),           # user 7 clicks item 100 (cat 5) at t=2000
        imp("i2", 2_000, user=7, item=200, req="r2", cat=5),      # same ts as the click: must not see it
        imp("i3", 2_001, user=7, item=300, req="r3", cat=6),      # 1 ms later: sees it
        imp("i4", 62_000, user=7, item=400, req="r4", cat=5),     # exactly 60 s after: outside the 60 s window
        imp("i5", 61_999, user=7, item=500, req="r5", cat=5),     # just inside
    ])
    assert rows["i1"]["hist_item_ids"] == [] and rows["i1"]["user_imps_60s"] == 0
    assert rows["i2"]["hist_item_ids"] == [] and rows["i2"]["user_clicks_60s"] == 0
    assert rows["i2"]["user_imps_60s"] == 1  # i1 only; not itself
    assert rows["i3"]["hist_item_ids"] == [100] and rows["i3"]["hist_category_ids"] == [5]
    assert rows["i3"]["user_clicks_60s"] == 1 and rows["i3"]["item_clicks_60s"] == 0  # item 300 never clicked
    assert rows["i3"]["user_imps_60s"] == 2
    assert rows["i5"]["user_clicks_60s"] == 1 and rows["i5"]["category_clicks_60s"] == 1
    assert rows["i4"]["user_clicks_60s"] == 0 and rows["i4"]["hist_item_ids"] == [100]  # history has no window
    assert rows["i1"]["label"] == 1 and rows["i1"]["click_ts"] == 2_000
    assert [rows[i]["label"] for i in ("i2", "i3", "i4", "i5")] == [0, 0, 0, 0]


def test_history_is_most_recent_first_and_bounded():
    events = []
    for n in range(5):
        events += [imp(f"i{n}", 1000 * n, 1, 10 + n, f"r{n}", cat=n), click(f"c{n}", 1000 * n + 10, 1, 10 + n, f"r{n}")]
    events.append(imp("last", 10_000, 1, 99, "rl"))
    rows, _ = build(events, history_len=3)
    assert rows["last"]["hist_item_ids"] == [14, 13, 12] and rows["last"]["hist_category_ids"] == [4, 3, 2]


def test_attribution_window_duplicates_and_orphans():
    rows, builder = build([
        imp("i1", 1000, 1, 10, "r1"),
        imp("i1", 1000, 1, 10, "r1"),                # duplicate delivery of the same impression
        click("c-late", 11_001, 1, 10, "r1"),        # after the 10 s window: orphan, label stays 0
        imp("i2", 1000, 1, 11, "r1", pos=2),
        click("c-early", 1005, 1, 11, "r1"),
        click("c-double", 1007, 1, 11, "r1"),        # a second click on the same impression: still one sample
        click("c-none", 1005, 1, 12, "r1"),          # no such impression
        click("c-before", 1001, 2, 13, "r9"), imp("i3", 1002, 2, 13, "r9"),  # click earlier than its impression
    ], attribution_window_s=10)
    assert sorted(rows) == ["i1", "i2", "i3"] and builder.duplicates == 1
    assert rows["i1"]["label"] == 0 and rows["i2"]["label"] == 1 and rows["i2"]["click_ts"] == 1005
    assert rows["i3"]["label"] == 0
    orphans = sorted(orjson.loads(r.raw)["event_id"] for r in builder.rejected if r.reason.startswith("orphan_click"))
    assert orphans == ["c-before", "c-late", "c-none"]


@pytest.mark.slow
def test_labels_match_the_generator_truth_exactly(tmp_path):
    run = tmp_path / "run"
    assert run_cli("generate", "--out", str(run), "--duration", "30", "--rate", "3000", "--bad-fraction", "0.02",
                   "--start-ms", "1700000000000").returncode == 0
    result = run_cli("pipeline", "offline", str(run), "--attribution-window-s", "5", "--row-group-rows", "1000")
    assert result.returncode == 0, result.stderr
    samples = pq.read_table(run / "samples.parquet").to_pylist()
    assert pq.ParquetFile(run / "samples.parquet").metadata.num_row_groups == -(-len(samples) // 1000)
    truth = {r["event_id"]: r for r in pq.read_table(run / "truth.parquet").to_pylist()}
    end_ms = json.loads((run / "manifest.json").read_text())["end_ms"]
    assert sorted(s["event_id"] for s in samples) == sorted(truth)  # exactly one sample per impression
    for s in samples:
        t = truth[s["event_id"]]
        in_window = t["clicked"] and t["click_ts"] < end_ms and t["click_ts"] - t["ts"] <= 5000
        assert s["label"] == int(in_window), (s, t)
        assert s["click_ts"] == (t["click_ts"] if in_window else None)
    # every injected bad event is rejected with its documented reason
    rejected = [orjson.loads(line) for line in (run / "rejected.jsonl").read_bytes().splitlines()]
    bad = [orjson.loads(line) for line in (run / "bad_events.jsonl").read_bytes().splitlines()]
    by_raw = {r["raw"]: r["reason"] for r in rejected}
    for b in bad:
        if b["reason"] == "orphan_click":
            assert any(raw.startswith("{") and orjson.loads(raw)["event_id"] == orjson.loads(b["raw"])["event_id"]
                       for raw, reason in by_raw.items() if reason.startswith("orphan_click"))
        else:
            assert by_raw[b["raw"]].startswith(EXPECTED_REASON[b["reason"]])
    # real clicks later than the window are orphans too: together with the injected ones, exactly
    late = sum(1 for t in truth.values() if t["clicked"] and t["click_ts"] < end_ms and t["click_ts"] - t["ts"] > 5000)
    reasons = Counter(r["reason"].split(":")[0] for r in rejected)
    assert reasons["orphan_click"] == late + sum(b["reason"] == "orphan_click" for b in bad)
    assert "samples" in result.stdout and "rejected" in result.stdout


def test_read_run_refuses_incomplete_runs(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a complete generator run"):
        list(read_run(tmp_path))
