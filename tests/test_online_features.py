"""The online features against the real Flink job: the features they assemble for an
impression equal the job's sample for it (generated traffic and hand-built edge cases), a
restart rebuilds them from the topic without loss (or, past a small memory budget, exactly
for the entities it admitted), and
predict by ids works over real HTTP against online features fed by the live job."""

import os
import signal
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import numpy as np
import orjson
import pytest

from conftest import REPO, CheckedProducer, copy_store, free_port, read_topic, run_cli
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.feature_state import Candidate, differing_features, entity_partition
from streamrec.contracts.sample_wire import decode_samples
from streamrec.pipelines.flink_rest import FlinkRest
from streamrec.serving.by_ids import CANDIDATE_FIELDS, ByIdsQuery
from streamrec.serving.features.online_features import REPLAY_HORIZON_MS, OnlineFeatures
from streamrec.plumbing.bus.topics import ensure_topics
from test_pipeline_job import _click, _imp, _submit_in_background, _wait_for
from test_serving_http import call

pytestmark = pytest.mark.slow
SPEC = FeatureSpec()  # the published_model fixture's spec (attribution 10 s)
HISTORY = SPEC.history_len


def _env(broker, tmp_path, name):
    return {
        "STREAMREC_KAFKA__BOOTSTRAP": broker,
        **{f"STREAMREC_TOPICS__{t.upper()}": f"{name}.{t}" for t in ("events", "samples", "dlq", "truth", "features")},
        "STREAMREC_FLINK__GROUP_ID": name, "STREAMREC_FLINK__JOB_NAME": name,
        "STREAMREC_FLINK__CHECKPOINT_DIR": str(tmp_path / "checkpoints"), "STREAMREC_FLINK__REST_PORT": str(free_port()),
        "STREAMREC_FLINK__CHECKPOINT_INTERVAL_S": "1",
    }


def materialise(broker, topic, memory_mb=256, spill_dir=None, spec=SPEC) -> OnlineFeatures:
    features = OnlineFeatures(broker, topic, spec, memory_mb, spill_dir or f"/tmp/streamrec-fs-{uuid.uuid4().hex[:8]}").start()
    assert features.wait_ready(120), str(features.status())
    return features


def assembled(features, row) -> dict:
    c = Candidate(row["item_id"], row["category_id"], row["advertiser_id"], row["position"])
    return features.assemble(row["user_id"], row["ts"], row["device"], row["local_hour"], [c], with_features=True).features[0]


def _assembled_all(features, rows, chunk: int = 2048) -> list[dict]:
    """:func:`assembled` of every row, a chunk of one-candidate requests per call (a serving
    batch, as the node's batcher hands them over)."""
    out = []
    for start in range(0, len(rows), chunk):
        queries = [ByIdsQuery(r["user_id"], r["ts"], r["device"], r["local_hour"],
                              np.array([[r[f] for f in CANDIDATE_FIELDS]], np.int64), return_features=True)
                   for r in rows[start:start + chunk]]
        out.extend(candidates[0] for candidates in features.assemble_batch(queries).features)
    return out


def mismatches(features, rows, clicks, spec=SPEC) -> list:
    """(event_id, feature, served, sample) for every differing value. A sample's history is
    compared unless its user has more than history_len clicks in all and clicked after it:
    the job keeps the last history_len, so a request in the past may find fewer than the
    sample had (the online features merge the lists they saw; a bounded run coalesces many clicks into
    one list). docs/features.md says so."""
    out = []
    for row, served in zip(rows, _assembled_all(features, rows)):
        names = differing_features(spec, served, row)
        total, after = clicks(row)
        if total > spec.history_len and after > 0:
            names = [n for n in names if not n.startswith("hist_")]
        out.extend((row["event_id"], n, served[n], row[n]) for n in names)
    return out


def hand_built(t0: int) -> list[bytes]:
    """Edge cases on ids the generated world never uses (9000xx), in event-time order but for
    the one deliberate swap (well within the job's out-of-orderness): users may share a
    partition, and an event sent after a much later one there would be late by design."""
    u, v, w = 900001, 900002, 900003
    events = [
        # same millisecond: an impression at the ms of a click does not see it; a duplicate counts once
        _imp("h-i1", t0, u, 900100, "hr1", cat=900011), _click("h-c1", t0 + 400, u, 900100, "hr1"),
        _imp("h-i2", t0 + 400, u, 900200, "hr2", cat=900011), _imp("h-i2", t0 + 400, u, 900200, "hr2", cat=900011),
        # a click arriving before its impression still joins and counts
        _click("h-c3", t0 + 900, u, 900300, "hr3"), _imp("h-i3", t0 + 800, u, 900300, "hr3", cat=900022),
        _imp("h-i4", t0 + 1500, u, 900100, "hr4", cat=900011),
        # window edges (60 s), first event: see h-e2, h-e3 below
        _imp("h-e1", t0 + 2000, v, 900400, "he1", cat=900033),
    ]
    # history overflow: 55 clicked impressions, then one more that sees the last 50
    for k in range(55):
        ts = t0 + 3000 + 200 * k
        events += [_imp(f"h-o{k}", ts, w, 901000 + k, f"ho{k}", cat=900044), _click(f"h-oc{k}", ts + 50, w, 901000 + k, f"ho{k}")]
    events.append(_imp("h-olast", t0 + 3000 + 200 * 55, w, 900500, "holast", cat=900044))
    # window edges: 59,999 ms after h-e1 sees it, 60,000 ms after does not (open interval)
    events += [_imp("h-e2", t0 + 2000 + 59_999, v, 900400, "he2", cat=900033),
               _imp("h-e3", t0 + 2000 + 60_000, v, 900400, "he3", cat=900033)]
    return events


@pytest.fixture(scope="module")
def bounded_run(broker, tmp_path_factory):
    """Generated traffic, then the hand-built cases after its end; the bounded job over both."""
    tmp = tmp_path_factory.mktemp("online-features")
    name = f"of-{uuid.uuid4().hex[:8]}"
    env = _env(broker, tmp, name)
    start = int(time.time() * 1000)
    gen = run_cli("generate", "--duration", "20", "--rate", "1500", "--bad-fraction", "0.01", "--fast",
                  "--start-ms", str(start), env=env)
    assert gen.returncode == 0, gen.stderr
    producer = CheckedProducer(broker)
    for value in hand_built(start + 25_000):
        producer.send(f"{name}.events", key=b"%d" % orjson.loads(value)["user_id"], value=value)
    producer.close()
    # a bounded run returns once read_committed readers see all it wrote
    run = run_cli("pipeline", "submit", "--bounded", "--fresh", env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    table, _, rejected = decode_samples([r.value for r in read_topic(broker, f"{name}.samples")], SPEC)
    assert not rejected
    rows = table.to_pylist()
    imps = {orjson.loads(v)["event_id"] for v in hand_built(0) if b'"impression"' in v}
    missing = imps - {r["event_id"] for r in rows}
    if missing:
        dlq = {r.value.split(b'"event_id":"')[-1].split(b'"')[0].decode(errors="replace"): dict(r.headers)["reason"].decode()
               for r in read_topic(broker, f"{name}.dlq") if b'"event_id":"h-' in r.value}
        pytest.fail(f"{len(missing)} hand-built impressions without a sample, DLQ reasons: "
                    f"{sorted((e, dlq.get(e, 'not in the DLQ')) for e in missing)[:8]}")
    return SimpleNamespace(name=name, rows=rows, tmp=tmp)


def _clicks(rows):
    """A function: (the row's user's joined clicks in all, those at or after the row's ts)."""
    clicks: dict[int, list[int]] = {}
    for r in rows:
        if r["label"] == 1:
            clicks.setdefault(r["user_id"], []).append(r["click_ts"])
    return lambda row: (len(clicks.get(row["user_id"], ())), sum(1 for t in clicks.get(row["user_id"], ()) if t >= row["ts"]))


def test_online_features_equal_the_samples(broker, bounded_run):
    rows = bounded_run.rows
    by_id = {r["event_id"]: r for r in rows}
    assert len(rows) > 20_000 and {"h-i1", "h-i4", "h-e2", "h-e3", "h-olast"} <= set(by_id)
    features = materialise(broker, f"{bounded_run.name}.features")
    try:
        status = features.status()
        assert status["corrupt"] == 0 and status["entities"]["user"] > 1000 and status["features_as_of"] is not None
        # an entity's keys share its partition; each watermark record is on the partition it names
        for r in read_topic(broker, f"{bounded_run.name}.features"):
            kind, *rest = r.key.decode().split("/")
            want = int(rest[2]) if kind == "w" else entity_partition(rest[0], int(rest[1]), features.partitions)
            assert r.partition == want, (r.key, r.partition)
        assert mismatches(features, rows, _clicks(rows)) == []
        # the hand-built cases say what they test
        assert by_id["h-i2"]["user_clicks_60s"] == 0 and by_id["h-i2"]["user_imps_60s"] == 1  # c1 at its ms: invisible
        assert by_id["h-i4"]["user_imps_60s"] == 3 and by_id["h-i4"]["user_clicks_60s"] == 2
        assert by_id["h-i4"]["hist_item_ids"] == [900300, 900100]
        assert by_id["h-e2"]["user_imps_60s"] == 1 and by_id["h-e3"]["user_imps_60s"] == 1  # e1 left, e2 in
        assert by_id["h-e3"]["user_imps_600s"] == 2
        assert len(by_id["h-olast"]["hist_item_ids"]) == HISTORY and by_id["h-olast"]["hist_item_ids"][0] == 901054
        # cold start: unknown user and item get zero counters and no history
        cold = assembled(features, {**by_id["h-i1"], "user_id": 123456789, "item_id": 987654321, "category_id": 55555})
        assert cold["hist_item_ids"] == [] and all(cold[c] == 0 for c in SPEC.counter_columns())
    finally:
        features.close()


def test_a_restart_past_its_memory_budget_keeps_the_entities_it_admitted_exact(broker, bounded_run, tmp_path):
    """A second OnlineFeatures (a restarted node) with a 1 MiB budget: past it, new entities
    are refused (cold-start features); every sample whose user, item and category it
    admitted still gets the job's features, identically."""
    rows = bounded_run.rows
    features = materialise(broker, f"{bounded_run.name}.features", memory_mb=1, spill_dir=tmp_path / "spill")
    try:
        status = features.status()
        assert status["over_budget"] and status["refused"] > 1000 and status["memory_bytes"] <= 2 * 2**20
        store = features.store
        admitted = [r for r in rows if store.slot("user", r["user_id"]) >= 0 and store.slot("item", r["item_id"]) >= 0
                    and store.slot("category", r["category_id"]) >= 0]
        assert len(admitted) > 100
        assert mismatches(features, admitted, _clicks(rows)) == []
        refused = next(r for r in rows if store.slot("user", r["user_id"]) < 0)
        cold = assembled(features, refused)
        assert cold["hist_item_ids"] == [] and cold["user_imps_600s"] == 0
    finally:
        features.close()


def test_a_snapshot_start_equals_a_full_topic_replay(broker, bounded_run, tmp_path):
    """A node that starts from a snapshot of the first half of every partition and tails the
    rest holds, entity by entity, what a full replay of the topic holds (each cut to the
    replay horizon, which is all a request can see)."""
    topic = f"{bounded_run.name}.features"
    records = read_topic(broker, topic)
    by_partition: dict[int, list] = {}
    for r in records:
        by_partition.setdefault(r.partition, []).append(r)
    half = OnlineFeatures(broker, topic, SPEC, 256, tmp_path / "spill-half")
    positions = {}
    for partition, rs in by_partition.items():
        cut = len(rs) // 2
        for r in rs[:cut]:
            half._apply_records([r])
        positions[partition] = rs[cut].offset
    half.partitions, half._positions = max(by_partition) + 1, positions
    snapshot = tmp_path / "half.arrow"
    half.save_snapshot(snapshot)
    half.close()
    started = OnlineFeatures(broker, topic, SPEC, 256, tmp_path / "spill-started", snapshot=snapshot).start()
    full = materialise(broker, topic)
    try:
        assert started.wait_ready(120) and started.snapshot_as_of is not None
        assert started.counts["messages"] < len(records)  # it read only the tail
        assert started.as_of() == full.as_of()
        keys = sorted(full.store.keys())
        assert sorted(started.store.keys()) == keys and len(keys) > 1000
        cutoff = full.as_of() - REPLAY_HORIZON_MS  # both cut to the horizon: what any request may still see
        for features in (full, started):
            features.store.expire_all(cutoff - full.max_window_ms, cutoff)
        for key in keys:
            assert full.store.read(*key) == started.store.read(*key), key
    finally:
        started.close()
        full.close()


def test_predict_by_ids_over_http_against_the_live_job(broker, published_model, tmp_path):
    """A live (unbounded) job feeds a `streamrec serve` node (two HTTP front-ends: they decode
    by-ids bodies, the serving process assembles per batch); by-ids requests get the features
    of the job's samples and the same scores as the instances form; a late event is not
    counted (as in the samples); bad requests get 4xx answers."""
    root, versions = published_model
    name = f"ol-{uuid.uuid4().hex[:8]}"
    env = _env(broker, tmp_path, name)
    ensure_topics(broker, [f"{name}.events"], 2)
    job = _submit_in_background(env, "--fresh")
    store_root = tmp_path / "models"
    copy_store(root, store_root)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(store_root), "--port", str(port), "--device", "cpu",
         "--compile", "eager", "--frontends", "2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **env, "STREAMREC_SERVING__FOLLOW_UPDATES": "false",
             "STREAMREC_SERVING__FEATURE_STORE_DIR": str(tmp_path / "features"), "STREAMREC_SERVING__MAX_INSTANCES": "16"})
    base, model = f"http://127.0.0.1:{port}", "/v1/models/ctr"
    try:
        FlinkRest(f"127.0.0.1:{env['STREAMREC_FLINK__REST_PORT']}").wait_running(name, 180, all_tasks=True)
        _wait_for(lambda: _ready(base), 120, "the serving node ready")
        t0 = int(time.time() * 1000) - 120_000
        u, producer = 700001, CheckedProducer(broker)

        def send(*values):
            for value in values:
                producer.send(f"{name}.events", key=b"%d" % orjson.loads(value)["user_id"], value=value)
            producer.flush()

        def as_of():
            return (call(base, "GET", model)[1]["features"] or {}).get("features_as_of") or 0

        send(_imp("l-i1", t0, u, 700100, "lr1", cat=700011), _click("l-c1", t0 + 300, u, 700100, "lr1"),
             _imp("l-clock1", t0 + 6000, u + 1, 700900, "lclock1", cat=700099))
        _wait_for(lambda: as_of() > t0 + 3000, 120, "the feature state past t0 + 3 s")
        send(_imp("l-late", t0 + 1000, u, 700200, "lr2", cat=700011))  # behind the watermark: late
        _wait_for(lambda: any(r.value == _imp("l-late", t0 + 1000, u, 700200, "lr2", cat=700011)
                              for r in read_topic(broker, f"{name}.dlq")), 120, "the late event in the DLQ")
        send(_imp("l-i3", t0 + 4000 + 2000, u, 700300, "lr3", cat=700011),
             _imp("l-clock2", t0 + 30_000, u + 1, 700900, "lclock2", cat=700099))  # closes l-i3's attribution window
        _wait_for(lambda: len(read_topic(broker, f"{name}.samples")) >= 3, 120, "the samples of l-i1 and l-i3")
        samples, _, _ = decode_samples([r.value for r in read_topic(broker, f"{name}.samples")], SPEC)
        sample = next(r for r in samples.to_pylist() if r["event_id"] == "l-i3")
        assert sample["user_imps_60s"] == 1 and sample["hist_item_ids"] == [700100]  # the late event is not there
        # the node reads the features topic on its own: the samples topic can be ahead of it
        _wait_for(lambda: as_of() > sample["ts"], 120, "the serving node's features past l-i3")

        request = {"user_id": u, "ts": sample["ts"], "context": {"device": sample["device"], "local_hour": sample["local_hour"]},
                   "candidates": [{k: sample[k] for k in ("item_id", "category_id", "advertiser_id", "position")},
                                  {"item_id": 123456, "category_id": 700011, "advertiser_id": 5, "position": 2}],
                   "return_features": True}
        status, answer = call(base, "POST", f"{model}:predict", request)
        assert status == 200, answer
        assert answer["features_as_of"] > sample["ts"] and answer["ts"] == sample["ts"] and len(answer["scores"]) == 2
        assert differing_features(SPEC, answer["features"][0], sample) == []
        assert answer["features"][1]["item_imps_60s"] == 0 and answer["features"][1]["category_imps_60s"] == 1  # l-i1 (not the late one)
        instance = {k: v for k, v in sample.items() if k not in ("label", "click_ts")}
        status, by_instances = call(base, "POST", f"{model}:predict", {"instances": [instance]})
        assert status == 200 and abs(by_instances["scores"][0] - answer["scores"][0]) < 1e-6

        # without ts: now; an unknown user gets cold-start features
        status, cold = call(base, "POST", f"{model}:predict", {**request, "user_id": 31337, "ts": None})
        assert status == 200 and cold["features"][0]["hist_item_ids"] == [] and cold["features"][0]["user_imps_600s"] == 0
        assert abs(cold["ts"] - time.time() * 1000) < 60_000

        bad = [({k: v for k, v in request.items() if k != "user_id"}, 400, "user_id"),
               ({**request, "candidates": request["candidates"] * 9}, 413, "serving.max_instances"),
               ({**request, "candidates": []}, 400, "non-empty"),
               ({**request, "user_id": "7"}, 400, "user_id"),
               ({**request, "context": {"device": "ios"}}, 400, "local_hour"),
               ({**request, "ts": int(time.time() * 1000) + 3_600_000}, 400, "ahead of this server's clock"),
               ({**request, "ts": t0 - 3_600_000}, 400, "in the past"),
               ({**request, "colour": "red"}, 400, "colour")]
        for body, code, words in bad:
            status, answer = call(base, "POST", f"{model}:predict", body)
            assert status == code and words in answer["error"]["message"], (body, answer)

        status, info = call(base, "GET", model)
        features = info["features"]
        assert features["ready"] and features["entities"]["user"] >= 2 and features["corrupt"] == 0
        metrics = _get(base + "/metrics")
        assert "streamrec_features_lag_ms" in metrics and 'streamrec_features_entities{kind="item"}' in metrics
    finally:
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=60)
        os.killpg(job.pid, signal.SIGTERM)
        job.wait(timeout=60)
    assert server.returncode == 0, out[-3000:]


def _ready(base) -> bool:
    try:
        return call(base, "GET", "/readyz")[0] == 200
    except OSError:
        return False


def _get(url) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()
