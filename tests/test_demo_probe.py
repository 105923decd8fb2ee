"""The demo's ad-server probe against a real `streamrec serve` node over HTTP (issue 52:
on 2 cores the probe fell minutes behind the events topic, its requests' ts passed what
the node keeps, and every refused request failed `make demo`): a request too far behind the
clock is skipped before it is sent, one the node refuses because its online features are
further ahead than they keep is skipped, and so is a replay older than the node keeps; each
is counted by reason and none fails the run. What does fail the demo is the system's
misbehaviour, each reason said.

The features topic is written by hand (its format is the contract, docs/features.md), as in
tests/test_serving_broker_outage.py: only the node's watermarks matter here."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
import uuid

import orjson
import pytest

from conftest import REPO, CheckedProducer, copy_store, free_port, wait_ready
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.feature_state import ENTITIES
from streamrec.demo import skew
from streamrec.demo.probe import ServingClient
from streamrec.demo.run import _failures
from streamrec.demo.skew import BEHIND, MAX_BEHIND_MS, REFUSED, REPLAY_TOO_OLD, AdServerProbe, probe_line
from streamrec.plumbing.bus.topics import ensure_topics
from streamrec.serving.features.online_features import REPLAY_HORIZON_MS
from test_pipeline_job import _imp
from test_serving_http import call

pytestmark = pytest.mark.slow
USER = 5151


def _publish_watermarks(bootstrap: str, topic: str, ahead_ms: list[int], stop: threading.Event) -> None:
    """The job's side: every stage's watermark at the clock plus ``ahead_ms[0]``."""
    producer = CheckedProducer(bootstrap)
    while not stop.is_set():
        wm = int(time.time() * 1000) + ahead_ms[0]
        for stage in ENTITIES:
            producer.send(topic, key=f"w/{stage}/0/0".encode(), value=orjson.dumps({"wm": wm, "n": 1}))
        producer.flush()
        stop.wait(0.3)
    producer.close()


def _wait(predicate, timeout_s: float, what: str, probe: AdServerProbe) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert probe.error is None, probe.error
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {probe.report()}, failed {probe.failed_requests}"
        time.sleep(0.2)


def test_the_ad_server_probe_skips_and_counts_what_the_node_no_longer_keeps(broker, published_model, tmp_path, monkeypatch):
    name = f"adprobe-{uuid.uuid4().hex[:8]}"
    events, samples, features = f"{name}.events", f"{name}.samples", f"{name}.features"
    ensure_topics(broker, [events, samples], 1)
    ensure_topics(broker, [features], 1, configs={features: {"cleanup.policy": "compact"}})
    ahead_ms, stop = [-500], threading.Event()  # the node's state first trails the clock, as the job's does
    clock = threading.Thread(target=_publish_watermarks, args=(broker, features, ahead_ms, stop), daemon=True)
    clock.start()
    port = free_port()
    node = subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(copy_store(published_model[0], tmp_path / "models")),
         "--port", str(port), "--device", "cpu", "--compile", "eager"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "STREAMREC_KAFKA__BOOTSTRAP": broker, "STREAMREC_TOPICS__FEATURES": features,
             "STREAMREC_SERVING__FOLLOW_UPDATES": "false", "STREAMREC_SERVING__FEATURE_STORE_DIR": str(tmp_path / "spill")})
    base = f"http://127.0.0.1:{port}"
    producer = CheckedProducer(broker)
    ids = itertools.count()

    def impressions(ts: int, n: int = 1) -> list[str]:
        """One ad request of ``n`` impressions at ``ts``; their event ids."""
        request, eids = f"r{next(ids)}", [f"i{next(ids)}" for _ in range(n)]
        for pos, eid in enumerate(eids, 1):
            producer.send(events, key=b"%d" % USER, value=_imp(eid, ts, USER, 600 + pos, request, pos=pos))
        producer.flush()
        return eids

    def sample(eid: str, ts: int) -> None:
        producer.send(samples, key=b"%d" % USER, value=orjson.dumps({
            "event_id": eid, "label": 0, "ts": ts, "user_id": USER, "device": "ios", "local_hour": 3,
            "item_id": 601, "category_id": 1, "advertiser_id": 9, "position": 1}))
        producer.flush()

    probe = None
    try:
        wait_ready(base, node)
        probe = AdServerProbe(broker, events, samples, [ServingClient(f"127.0.0.1:{port}", "ctr") for _ in range(2)],
                              FeatureSpec(), replay_every=1).start()

        # a request on time is asked and answered (sent again until the probe's consumer has its position)
        sent: dict[str, int] = {}

        def on_time() -> bool:
            ts = int(time.time() * 1000)
            sent[impressions(ts)[0]] = ts
            return len(probe.served) >= 2

        _wait(on_time, 60, "two impressions scored by ids", probe)
        (first, first_ts), (second, second_ts) = [(e, ts) for e, ts in sent.items() if e in probe.served][:2]

        # impressions read long after their time (the probe behind the topic): not asked
        impressions(int(time.time() * 1000) - 150_000, n=3)
        _wait(lambda: probe.skipped[BEHIND] >= 3, 60, "the late impressions skipped", probe)

        # the node's state now further ahead of the requests than it keeps: its 400s are the probe's lateness
        ahead_ms[0] = 200_000
        _wait(lambda: (call(base, "GET", "/v1/models/ctr")[1]["features"]["features_as_of"] or 0)
              > time.time() * 1000 + REPLAY_HORIZON_MS, 60, "the node's state ahead", probe)
        impressions(int(time.time() * 1000), n=2)
        _wait(lambda: probe.skipped[REFUSED] >= 2, 60, "the refused impressions counted", probe)
        refused = probe.skipped[REFUSED]
        _wait(lambda: sample(first, first_ts) or probe.skipped[REFUSED] > refused, 60, "the refused replay counted", probe)

        # a replay the probe would ask for later than the node keeps its ts: not asked
        monkeypatch.setattr(skew, "REPLAY_MAX_BEHIND_MS", 0)
        _wait(lambda: sample(second, second_ts) or probe.skipped[REPLAY_TOO_OLD] >= 1, 60, "the old replay skipped", probe)
    finally:
        stop.set()
        producer.close()
        if probe is not None:
            probe.stop()
        node.terminate()
        out, _ = node.communicate(timeout=60)
    assert probe.error is None and probe.failed_requests == 0, out[-3000:]
    report = probe.report()
    assert report["requests"] >= 3 and report["lag_ms"]["max"] < MAX_BEHIND_MS, report
    assert set(report["skipped_impressions"]) == {BEHIND, REFUSED, REPLAY_TOO_OLD}, report
    assert f"3 {BEHIND}" in probe_line(report), probe_line(report)
    assert len(probe.compared) >= 2 and not any("replayed" in c for c in probe.compared)
    assert _failures(_result(failed_by_ids=probe.failed_requests, ad_server_probe=report)) == []


def _result(failed_by_ids: int = 0, **changes) -> dict:
    """A finished run's result (run.json) with only what _failures reads, as it is when all went well."""
    return {"versions": {"published": 9, "applied": 8},
            "serving": {"failed_requests": 0, "failed_requests_by_ids": failed_by_ids, "failed_requests_experiment": 0},
            "rollback": {"done": True, "ok": True}, "quality": {"experiment": {"graded": {}}},
            "processes": {"serving": {"exit": 0, "left": 0}, "pipeline": {"exit": 0, "left": 0}}, **changes}


def test_the_demo_fails_on_the_systems_misbehaviour_each_reason_said():
    assert _failures(_result()) == []
    assert _failures(_result(versions={"published": 3, "applied": 0})) == ["the serving node applied no version"]
    assert _failures(_result(failed_by_ids=2)) == ["2 predict requests by ids failed (each logged with its status)"]
    bad = _result(rollback={"done": True, "ok": False, "from_version": 7, "to_version": 6, "pinned_held": False,
                            "released": True, "response": {}},
                  processes={"serving": {"exit": 0, "left": 2}, "pipeline": {"exit": 0, "left": 0}},
                  quality={"experiment": {"error": "the experiment could not be graded: TimeoutError: ..."}})
    assert _failures(bad) == ["the rollback v7 -> v6 failed (pinned held: False, released: True): {}",
                              "the experiment could not be graded: TimeoutError: ...", "serving left 2 processes running"]
    assert _failures(_result(rollback={"done": False})) == []  # a run too short for a rollback
