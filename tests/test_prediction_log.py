"""The prediction log and the grading report, through a real broker: records round-trip
with their keys; a dead or restarted broker never holds up `record`, and what is lost is
counted; the report's join and figures equal a direct computation on known data."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import defaultdict

import msgspec
import numpy as np
import pyarrow as pa
import pytest

from streamrec.contracts.predictions import (CorruptPrediction, Prediction, decode_prediction, encode_prediction,
                                             prediction_key)
from streamrec.contracts.sample_wire import encode_samples
from streamrec.plumbing.bus.broker import EmbeddedBroker
from streamrec.plumbing.bus.topics import ensure_topics
from streamrec.plumbing.config import load_config
from streamrec.analysis.grading import Track, grade, join_latest
from streamrec.analysis.grading_input import read_for_grading
from streamrec.serving.access.prediction_log import PredictionLog
from tests.conftest import CheckedProducer, free_port, read_topic, run_cli

SPEC = load_config().features
T0 = 28_333_334 * 60_000  # a whole minute, 2023-11-14
WINDOW_S = 300


def _prediction(i: int, **kw) -> Prediction:
    fields = dict(request_id=f"r{i}", ts=T0 + i, user_id=i % 13, item_ids=np.arange(i % 5 + 1, dtype=np.int64) + i,
                  scores=np.linspace(0, 1, i % 5 + 1, dtype=np.float32), model="ctr", model_version=7 + i % 2,
                  experiment="exp" if i % 3 else None, variant="B" if i % 3 == 2 else "A" if i % 3 else None,
                  features_as_of=T0 - 5 if i % 2 else None, shadow=i % 4 == 0)
    return Prediction(**{**fields, **kw})


def _same(a: Prediction, b: Prediction) -> bool:
    return all((np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y)
               for x, y in ((getattr(a, f), getattr(b, f)) for f in Prediction.__slots__))


def _wait_for(check, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---------------------------------------------------------------------- the record contract
def test_encoding_round_trips_and_corrupt_records_are_named():
    p = _prediction(5, item_ids=np.array([3, -1, 2**62, 7], np.int64), scores=np.array([0.25, 1e-9, 1.0, 0.5], np.float32))
    assert _same(decode_prediction(encode_prediction(p)), p)
    assert prediction_key(-42) == b"-42"
    with pytest.raises(ValueError, match="4 item_ids has 1 scores"):
        encode_prediction(_prediction(1, item_ids=np.arange(4), scores=np.array([0.1], np.float32)))
    uneven = msgspec.msgpack.encode({**msgspec.msgpack.decode(encode_prediction(p)), "scores": b"\0" * 12})
    bad = [b"", b"\xc1", b'{"json": 1}', encode_prediction(_prediction(1, scores=np.array([1.5, 0.1], np.float32))), uneven]
    for value, why in zip(bad, ("empty", "not a prediction record", "not a prediction record", "outside \\[0, 1\\]",
                                "item_ids but")):
        with pytest.raises(CorruptPrediction, match=why):
            decode_prediction(value)
    assert issubclass(CorruptPrediction, ValueError)


# ---------------------------------------------------------------------- the log
def test_records_round_trip_through_the_broker(broker):
    topic = f"pl-{uuid.uuid4().hex[:6]}.predictions"
    ensure_topics(broker, [topic], partitions=4)
    log = PredictionLog(broker, topic, queue_size=10_000, connect_timeout_s=5)
    _wait_for(lambda: log.counters()["connected"] == 1, 30)  # the sender process is up
    sent = [_prediction(i) for i in range(500)]
    for p in sent:
        log.record(p)
    counters = log.close(timeout_s=20)
    assert counters == {"queued": 500, "sent": 500, "dropped": 0, "failed": 0, "pending": 0, "backlog": 0, "connected": 1}
    records = read_topic(broker, topic, committed=False)
    assert len(records) == 500
    by_id = {p.request_id: p for p in sent}
    partitions, order = defaultdict(set), defaultdict(list)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        got = decode_prediction(r.value)
        assert _same(got, by_id[got.request_id]) and r.key == prediction_key(got.user_id)
        partitions[got.user_id].add(r.partition)
        order[got.user_id].append(int(got.request_id[1:]))
    assert all(len(ps) == 1 for ps in partitions.values())  # a user's predictions on one partition, in order
    assert all(ids == sorted(ids) for ids in order.values())


def test_a_dead_broker_never_holds_up_record_and_losses_are_counted():
    log = PredictionLog(f"127.0.0.1:{free_port()}", "pl.nowhere", queue_size=1000, connect_timeout_s=1)
    p = _prediction(3)
    started = time.perf_counter()
    for _ in range(10_000):
        log.record(p)
    assert time.perf_counter() - started < 2.0  # a sanity bound: each record is one non-blocking send
    _wait_for(lambda: log.counters()["dropped"] == 9000, 30)  # the socket's or the sender's queue full
    assert log.counters() == {"queued": 10_000 - log._dropped, "sent": 0, "dropped": 9000, "failed": 0, "pending": 1000,
                              "backlog": 1000, "connected": 0}
    counters = log.close(timeout_s=10)
    assert counters["dropped"] == 10_000 and counters["sent"] == counters["failed"] == counters["pending"] == 0
    log.record(p)  # after close: dropped, not raised
    assert log.counters()["dropped"] == 10_001


@pytest.mark.slow
def test_the_log_connects_when_the_broker_comes_and_rides_out_a_restart(tmp_path):
    port = free_port()
    bootstrap, topic = f"127.0.0.1:{port}", "pl.restart"
    # the producer retries a record for 6 x the connect timeout (30 s): longer than a broker's
    # stop and start on a loaded 2-core box, which the restart below must fit in
    log = PredictionLog(bootstrap, topic, queue_size=1000, connect_timeout_s=5, retry_s=0.2)
    for i in range(100):
        log.record(_prediction(i))
    # the sender process started and took them; its connects fail meanwhile: they wait in its queue
    _wait_for(lambda: log.counters()["backlog"] == 100, 30)
    time.sleep(1.0)  # a few failed connects later, still nothing connected or sent
    assert log.counters()["connected"] == 0 and log.counters()["backlog"] == 100 and log.counters()["sent"] == 0
    embedded = EmbeddedBroker(tmp_path / "kafka", port=port)
    try:
        embedded.up(timeout_s=30)
        ensure_topics(bootstrap, [topic], partitions=2)
        _wait_for(lambda: log.counters()["sent"] == 100, 30)
        embedded.down()
        for i in range(100, 150):
            log.record(_prediction(i))
        _wait_for(lambda: log.counters()["backlog"] == 0, 30)  # in the producer, waiting for the broker
        embedded.up(timeout_s=30)
        _wait_for(lambda: log.counters()["sent"] == 150, 30)  # kafka-python retried them on the restarted broker
        counters = log.close(timeout_s=10)
        assert counters["dropped"] == counters["failed"] == counters["pending"] == 0
        assert sorted(int(decode_prediction(r.value).request_id[1:]) for r in read_topic(bootstrap, topic, committed=False)) \
            == list(range(150))
    finally:
        log.close(timeout_s=1)
        embedded.down()


# ---------------------------------------------------------------------- the join
def test_join_takes_the_latest_prediction_at_or_before_the_sample_within_the_window():
    pred = dict(pred_user=np.array([1, 1, 1, 1, 2]), pred_item=np.array([5, 5, 5, 6, 5]),
                pred_ts=np.array([100, 200, 200, 150, 100]))
    samples = dict(sample_user=np.array([1, 1, 1, 1, 2, 3]), sample_item=np.array([5, 5, 5, 6, 5, 5]),
                   sample_ts=np.array([199, 250, 1000, 150, 99, 100]))
    found = join_latest(**samples, **pred, window_ms=300)
    # 199: the one at 100; 250: the later of the two at 200; 1000: past the window; 99: before any; user 3: none
    assert found.tolist() == [0, 2, -1, 3, -1, -1]


# ---------------------------------------------------------------------- the report on known data
def _sample_row(user: int, item: int, ts: int, label: int) -> dict:
    row = {"sample_version": 1, "event_id": f"e{user}-{item}", "request_id": "r", "ts": ts, "user_id": user,
           "item_id": item, "position": 0, "device": "phone", "local_hour": 12, "category_id": 1, "advertiser_id": 1,
           "hist_item_ids": [], "hist_category_ids": [], "label": label, "click_ts": ts + 500 if label else None}
    return {**row, **{c: 0 for c in SPEC.counter_columns()}}


def _world(seed: int = 3):
    """Predictions and samples with the expected grade of each sample: its variant's score
    (None: not this experiment's) and its shadow score."""
    rng = np.random.default_rng(seed)
    predictions, samples, expected = [], [], []
    for user in range(400):
        variant = "AB"[user % 2]
        for r in range(3):
            ts = T0 + r * 60_000 + user * 10
            items = np.array([user * 100 + r * 10 + j for j in range(5)], np.int64)
            scores = rng.uniform(0.02, 0.98, 5).astype(np.float32)
            shadow_scores = rng.uniform(0.02, 0.98, 5).astype(np.float32)
            rid = f"u{user}r{r}"
            predictions.append(Prediction(rid, ts - 5000, user, items[:1], np.array([0.5], np.float32), f"ctr-{variant}", 1,
                                          "exp1", variant))  # superseded by the one below
            predictions.append(Prediction(rid, ts, user, items, scores, f"ctr-{variant}", 2, "exp1", variant, ts - 100))
            predictions.append(Prediction(rid, ts, user, items, shadow_scores, "shadow-m", 9, "exp1", variant, shadow=True))
            other = user % 10 == 8 and r == 1
            if other:  # another experiment answered last for this user's items
                predictions.append(Prediction(rid + "x", ts + 1, user, items, np.full(5, 0.3, np.float32), "ctr-x", 1,
                                              "exp2", "X"))
            for j in range(2):
                sample_ts = ts + 1000 * (j + 1)
                late = user % 10 == 9 and r == 2 and j == 0
                if late:
                    sample_ts = ts + WINDOW_S * 1000 + 1
                predictions.append(Prediction(rid + "future", sample_ts + 1, user, items[j:j + 1],
                                              np.array([0.999], np.float32), f"ctr-{variant}", 2, "exp1", variant))
                label = int(rng.random() < scores[j])
                samples.append(_sample_row(user, int(items[j]), sample_ts, label))
                expected.append((variant, None if late or other else float(scores[j]),
                                 None if late else float(shadow_scores[j]), label, sample_ts))
    order = rng.permutation(len(samples))  # samples come in label order, not event time
    return predictions, [samples[i] for i in order], [expected[i] for i in order]


def _auc(scores, labels) -> float:
    """Every (clicked, unclicked) pair, ties half."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg)))


def _direct(rows) -> dict:
    s = np.array([r[0] for r in rows], np.float64)
    y = np.array([r[1] for r in rows], np.int64)
    p = np.clip(s, 1e-7, 1 - 1e-7)
    return {"count": len(y), "clicks": int(y.sum()), "auc": _auc(s, y),
            "logloss": float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()), "calibration": float(s.mean() / y.mean())}


def _expected_tracks(expected) -> dict:
    by = defaultdict(list)
    for variant, served, shadow, label, ts in expected:
        if served is not None:
            by[variant].append((served, label, ts))
        if shadow is not None:
            by[f"{variant} (shadow)"].append((shadow, label, ts))
    return by


@pytest.fixture(scope="module")
def graded_topics(broker):
    prefix = f"pl-{uuid.uuid4().hex[:6]}"
    topics = {"samples": f"{prefix}.samples", "predictions": f"{prefix}.predictions"}
    ensure_topics(broker, list(topics.values()), partitions=4)
    predictions, samples, expected = _world()
    producer = CheckedProducer(broker)
    for p in predictions:
        producer.send(topics["predictions"], key=prediction_key(p.user_id), value=encode_prediction(p))
    producer.send(topics["predictions"], key=b"1", value=b"\x93garbage")
    for row, value in zip(samples, encode_samples(pa.Table.from_pylist(samples, schema=SPEC.schema()))):
        producer.send(topics["samples"], key=b"%d" % row["user_id"], value=value)
    producer.send(topics["samples"], key=b"1", value=b'{"not": "a sample"}')
    producer.flush()
    producer.close()
    return topics, expected


def _check_grade(got: dict, want: dict) -> None:
    assert got["count"] == want["count"] and got["clicks"] == want["clicks"]
    for name in ("auc", "logloss", "calibration"):
        assert got[name] == pytest.approx(want[name], rel=1e-6), name


def test_report_equals_a_direct_computation_per_variant_and_minute(broker, graded_topics):
    topics, expected = graded_topics
    labels, rows, counts = read_for_grading(broker, topics["samples"], topics["predictions"], SPEC, since_s=0,
                                            window_s=WINDOW_S, connect_timeout_s=10, read_timeout_s=60)
    assert (counts.samples, counts.rejected_samples, counts.corrupt_predictions) == (2400, 1, 1)
    report = grade(labels, rows, WINDOW_S, lambda t: t.experiment == "exp1").to_json()
    want = _expected_tracks(expected)
    assert [t["track"]["name"] for t in report["tracks"]] == ["A", "B", "A (shadow)", "B (shadow)"]
    assert report["unmatched"] == 40 and report["other"] == 80  # 40 late samples; 40 users x 2 samples to exp2
    for t in report["tracks"]:
        rows_here = want[t["track"]["name"]]
        _check_grade(t["total"], _direct(rows_here))
        assert t["requests"] == (600 if t["track"]["shadow"] else 2400)  # 200 users x 3 requests x (1 or 4)
        for m in t["minutes"]:
            _check_grade(m, _direct([r for r in rows_here if r[2] // 60_000 * 60_000 == m["minute_ms"]]))
        assert sum(m["count"] for m in t["minutes"]) == t["total"]["count"]
    exp2 = grade(labels, rows, WINDOW_S, lambda t: t.experiment == "exp2")
    assert [(t.track, t.total.count) for t in exp2.tracks] == [(Track("exp2", "X", "ctr-x", False), 80)]


@pytest.mark.slow
def test_cli_report_prints_the_variants(broker, graded_topics):
    topics, expected = graded_topics
    env = {"STREAMREC_KAFKA__BOOTSTRAP": broker, "STREAMREC_TOPICS__SAMPLES": topics["samples"],
           "STREAMREC_TOPICS__PREDICTIONS": topics["predictions"]}
    result = run_cli("experiments", "report", "exp1", env=env)
    assert result.returncode == 0, result.stderr
    for name in ("A", "B", "A (shadow)", "B (shadow)"):
        assert re.search(rf"^ +{re.escape(name)} +(ctr-|shadow-m)", result.stdout, re.M), name
    assert "1 rejected samples, 1 corrupt predictions" in result.stdout
    result = run_cli("experiments", "report", "exp1", "--json", "--window-s", "300", env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    want = _expected_tracks(expected)
    for t in report["tracks"]:
        _check_grade(t["total"], _direct(want[t["track"]["name"]]))
    missing = run_cli("experiments", "report", "nope", env=env)
    assert missing.returncode == 1 and "no predictions of experiment nope" in missing.stderr and "exp1, exp2" in missing.stderr
    dead = run_cli("experiments", "report", "exp1", env={**env, "STREAMREC_KAFKA__BOOTSTRAP": f"127.0.0.1:{free_port()}",
                                                           "STREAMREC_KAFKA__CONNECT_TIMEOUT_S": "1"})
    assert dead.returncode == 2 and "cannot reach Kafka" in dead.stderr
