"""A broker outage does not take a serving node out: under by-ids load the broker is killed
(-9) and restarted; every answer is a 200, `features_as_of` stops and the answers say they
are stale past serving.features_max_lag_s, then catch up once the broker is back. A node
started while the broker is down serves instances at once and by ids from the snapshot the
previous node wrote at shutdown.

The features topic is written by hand here (its format is the contract, docs/features.md):
what is under test is the node, not the job (tests/test_online_features.py runs the job)."""

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import orjson
import pytest

from conftest import REPO, copy_store, free_port
from streamrec.contracts.feature_state import ENTITIES
from streamrec.plumbing.bus.broker import EmbeddedBroker
from streamrec.plumbing.bus.clients import make_producer
from streamrec.plumbing.bus.topics import ensure_topics
from test_serving_http import call

pytestmark = [pytest.mark.slow, pytest.mark.serial]
TOPIC = f"outage-{uuid.uuid4().hex[:6]}.features"
USER, ITEM, CATEGORY = 4242, 777, 55


def _publish_clock(bootstrap: str, stop: threading.Event, t0: int) -> None:
    """The job's side: an entity's counters once, then every stage's watermark moving with the clock."""
    producer = None
    while not stop.is_set():
        try:
            if producer is None:
                producer = make_producer(bootstrap, timeout_s=3)
                for kind, entity in (("user", USER), ("item", ITEM), ("category", CATEGORY)):
                    producer.send(TOPIC, key=f"c/{kind}/{entity}/{t0}".encode(), value=b'{"i":[0,5,9],"c":[9]}')
                producer.send(TOPIC, key=f"h/user/{USER}".encode(), value=b'{"h":[[%d,%d,%d]]}' % (ITEM, CATEGORY, t0 + 9))
            now = int(time.time() * 1000)
            for stage in ENTITIES:
                producer.send(TOPIC, key=f"w/{stage}/0/0".encode(), value=orjson.dumps({"wm": now - 500, "n": 1}))
            producer.flush(timeout=3)
        except Exception:  # noqa: BLE001 -- the broker is down: try again, as the job would after its restart
            if producer is not None:
                try:
                    producer.close(timeout=0)
                except Exception:  # noqa: BLE001 -- what it still held is resent by the next one
                    pass
            producer = None
        stop.wait(0.3)
    if producer is not None:
        producer.close(timeout=1)


def _serve(store, port, bootstrap, snapshot, spill) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(store), "--port", str(port), "--device", "cpu",
         "--compile", "eager"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "STREAMREC_KAFKA__BOOTSTRAP": bootstrap, "STREAMREC_TOPICS__FEATURES": TOPIC,
             "STREAMREC_KAFKA__CONNECT_TIMEOUT_S": "3", "STREAMREC_SERVING__FOLLOW_UPDATES": "false",
             "STREAMREC_SERVING__FEATURES_MAX_LAG_S": "3", "STREAMREC_SERVING__FEATURE_SNAPSHOT": str(snapshot),
             "STREAMREC_SERVING__FEATURE_SNAPSHOT_INTERVAL_S": "2",
             "STREAMREC_SERVING__FEATURE_STORE_DIR": str(spill), "STREAMREC_SERVING__FEATURE_STORE_READY_TIMEOUT_S": "600"})


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _by_ids(base):
    return call(base, "POST", "/v1/models/ctr:predict", {
        "user_id": USER, "context": {"device": "ios", "local_hour": 3},
        "candidates": [{"item_id": ITEM, "category_id": CATEGORY, "advertiser_id": 5, "position": 1}], "return_features": True})


def test_a_broker_outage_leaves_by_ids_answers_flowing_and_stale_then_caught_up(published_model, sample_run, tmp_path):
    kafka = EmbeddedBroker(tmp_path / "kafka", port=free_port())
    state, _ = kafka.up(timeout_s=30)
    bootstrap = state.bootstrap
    ensure_topics(bootstrap, [TOPIC], 1, configs={TOPIC: {"cleanup.policy": "compact"}})
    t0 = int(time.time() * 1000) - 20_000
    stop = threading.Event()
    clock = threading.Thread(target=_publish_clock, args=(bootstrap, stop, t0), daemon=True)
    clock.start()
    store = copy_store(published_model[0], tmp_path / "models")
    snapshot, port = tmp_path / "features.arrow", free_port()
    base = f"http://127.0.0.1:{port}"
    node = _serve(store, port, bootstrap, snapshot, tmp_path / "spill")
    answers: list[tuple[int, dict]] = []
    load_on = threading.Event()

    def load() -> None:
        while load_on.is_set():
            try:
                answers.append(_by_ids(base))
            except OSError as exc:  # a refused connection would be an outage of the node: counted as a failure
                answers.append((0, {"error": str(exc)}))
            time.sleep(0.05)

    try:
        _wait(lambda: call(base, "GET", "/readyz")[0] == 200, 180, "the node ready")
        _wait(lambda: _by_ids(base)[1].get("features_stale") is False, 60, "fresh features")
        status, answer = _by_ids(base)
        # the 10-minute window: the impressions, 20 s old at the start, stay in it however long a loaded box takes
        assert status == 200 and answer["features"][0]["user_imps_600s"] == 3 and answer["features"][0]["hist_item_ids"] == [ITEM]
        load_on.set()
        loader = threading.Thread(target=load, daemon=True)
        loader.start()

        os.killpg(state.pid, signal.SIGKILL)  # the broker dies
        killed_at = time.monotonic()
        _wait(lambda: bool(answers) and answers[-1][1].get("features_stale") is True, 60, "answers saying the features are stale")
        during = [a for _, a in answers[-5:]]
        assert all(a["features"][0]["user_imps_600s"] == 3 for a in during)  # the last state, still served
        status, info = call(base, "GET", "/v1/models/ctr")
        assert info["features"]["lag_ms"] > 3000 and call(base, "GET", "/readyz")[0] == 200
        with urllib.request.urlopen(base + "/metrics", timeout=30) as metrics:
            assert b"streamrec_features_lag_ms" in metrics.read()
        stale_as_of = during[-1]["features_as_of"]
        time.sleep(max(0.0, 3 - (time.monotonic() - killed_at)))

        kafka.up(timeout_s=30)  # back, same port, same data
        _wait(lambda: answers[-1][1].get("features_stale") is False and answers[-1][1]["features_as_of"] > stale_as_of + 3000,
              120, "the features caught up after the broker came back")
        load_on.clear()
        loader.join(10)
        failed = [(s, a) for s, a in answers if s != 200]
        assert not failed, failed[:3]
        assert len(answers) > 20
        _wait(snapshot.exists, 30, "a periodic snapshot")  # written while the node runs, not only at its shutdown
    finally:
        load_on.clear()
        node.send_signal(signal.SIGTERM)
        out, _ = node.communicate(timeout=60)
    assert node.returncode == 0, out[-3000:]
    assert "snapshot" in out and snapshot.exists(), out[-3000:]  # written again at the clean shutdown

    # a node started while the broker is down: instances at once, by ids from the snapshot
    stop.set()
    clock.join(10)
    os.killpg(kafka.status().pid, signal.SIGKILL)
    node = _serve(store, port, bootstrap, snapshot, tmp_path / "spill2")
    try:
        _wait(lambda: call(base, "GET", "/readyz?form=instances")[0] == 200, 180, "instances ready with the broker down")
        status, answer = call(base, "POST", "/v1/models/ctr:predict", {"instances": [_instance(sample_run)]})
        assert status == 200 and len(answer["scores"]) == 1
        _wait(lambda: call(base, "GET", "/readyz?form=by_ids")[0] == 200, 60, "by ids ready from the snapshot")
        status, answer = _by_ids(base)
        assert status == 200 and answer["features_stale"] is True and answer["features"][0]["user_imps_600s"] == 3
        ready = call(base, "GET", "/readyz")[1]
        assert ready["forms"] == {"instances": "ready", "by_ids": "ready"}
        info = call(base, "GET", "/v1/models/ctr")[1]["features"]
        assert info["started_from_snapshot_as_of"] == answer["features_as_of"] and "error" in info and info["error"]
    finally:
        node.send_signal(signal.SIGTERM)
        out, _ = node.communicate(timeout=60)
        kafka.down()
    assert node.returncode == 0, out[-3000:]


def _instance(sample_run) -> dict:
    import pyarrow.parquet as pq

    from streamrec.trainer.sources import sample_files

    row = pq.read_table(sample_files([str(sample_run)])[0]).slice(0, 1).to_pylist()[0]
    return {k: v for k, v in row.items() if k not in ("label", "click_ts")}
