"""Model access over real HTTP with a real broker: a node serving two models, an experiment
between them (the same variant on two nodes, one with front-ends; a change at run time
reaching both), a fan-out equal to separate calls, a shadow model off the response path,
a caller held to its quota while others are served, and the prediction log on its topic."""

import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPConnection

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest

from conftest import REPO, copy_store, free_port, read_topic, wait_ready
from streamrec.contracts.predictions import decode_prediction
from streamrec.modelstore.store import ModelStore
from streamrec.plumbing.bus.topics import ensure_topics
from streamrec.plumbing.config import ExperimentEntry, VariantEntry
from streamrec.serving.access.experiments import OUTSIDE, Experiments
from test_serving_http import TOKEN

pytestmark = pytest.mark.slow

CONFIG = """
[serving]
anonymous_rate_per_s = 100000.0

[[serving.models]]
name = "ctr"
[[serving.models]]
name = "cvr"

[[serving.experiments]]
name = "ranking"
salt = "ranking-2026"
variants = [{name = "current", model = "ctr", share = 0.5}, {name = "candidate", model = "cvr", share = 0.5}]

[[serving.experiments]]
name = "shadowed"
variants = [{name = "only", model = "ctr", share = 1.0}]
shadow_model = "cvr"
shadow_share = 1.0

[[serving.callers]]
name = "metered"
key = "metered-key"
rate_per_s = 10
burst = 5

[[serving.callers]]
name = "flood"
key = "flood-key"
rate_per_s = 0

[[serving.callers]]
name = "batch-jobs"
key = "batch-key"
rate_per_s = 0
priority = "low"

[[serving.callers]]
name = "checkout"
key = "checkout-key"
rate_per_s = 0
priority = "high"
"""


def http(base: str, method: str, path: str, body=None, headers: dict | None = None):
    request = urllib.request.Request(base + path, data=orjson.dumps(body) if body is not None else None, method=method,
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, orjson.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read()), dict(exc.headers)


def by_ids(user: int, ts: int, **extra) -> dict:
    return {"user_id": user, "context": {"device": "ios", "local_hour": 9}, "ts": ts,
            "candidates": [{"item_id": 100 + k, "category_id": 3 + k % 4, "advertiser_id": 7, "position": k} for k in range(5)], **extra}


@pytest.fixture(scope="module")
def nodes(published_model, broker, tmp_path_factory):
    """Two nodes on one store with "ctr" (LATEST) and "cvr" (pinned to the first version):
    one answers HTTP itself, one through 2 front-ends."""
    tmp = tmp_path_factory.mktemp("access")
    root = copy_store(published_model[0], tmp / "models")
    shutil.copytree(root / "ctr", root / "cvr")
    versions = published_model[1]
    ModelStore(str(root), "cvr").pin(versions[0], by="test", reason="an older model as the candidate")
    name = f"access-{os.getpid()}"
    ensure_topics(broker, [f"{name}.features", f"{name}.predictions"], partitions=2)
    config = tmp / "streamrec.toml"
    config.write_text(CONFIG)
    env = {**os.environ, "STREAMREC_SERVING__ADMIN_TOKEN": TOKEN, "STREAMREC_SERVING__FOLLOW_UPDATES": "false",
           "STREAMREC_KAFKA__BOOTSTRAP": broker, "STREAMREC_TOPICS__FEATURES": f"{name}.features",
           "STREAMREC_TOPICS__PREDICTIONS": f"{name}.predictions", "STREAMREC_SERVING__PREDICTION_LOG": "true",
           "STREAMREC_SERVING__POLL_INTERVAL_S": "0.2", "STREAMREC_SERVING__MAX_QUEUE_INSTANCES": "4096"}
    procs, bases = [], []
    for frontends in (0, 2):
        port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "streamrec.cli", "serve", "--config", str(config), "--model-store", str(root), "--port", str(port),
             "--device", "cpu", "--compile", "eager", "--frontends", str(frontends)],
            cwd=REPO, env={**env, "STREAMREC_SERVING__FEATURE_STORE_DIR": str(tmp / f"features{frontends}")},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        bases.append(f"http://127.0.0.1:{port}")
    for proc, base in zip(procs, bases):
        wait_ready(base, proc, 180)
    yield bases, versions, f"{name}.predictions"
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=30)


def test_a_node_serves_two_models_each_with_its_own_version(nodes):
    (a, b), versions, _ = nodes
    status, listed, _ = http(a, "GET", "/v1/models")
    assert status == 200 and [m["model"] for m in listed["models"]] == ["ctr", "cvr"]
    assert {m["model"]: m["model_version"] for m in listed["models"]} == {"ctr": versions[-1], "cvr": versions[0]}
    assert http(b, "GET", "/v1/models/cvr")[1]["pinned"]
    ts = int(time.time() * 1000)
    ctr, cvr = (http(base, "POST", f"/v1/models/{m}:predict", by_ids(42, ts))[1] for base, m in ((a, "ctr"), (b, "cvr")))
    assert ctr["model_version"] == versions[-1] and cvr["model_version"] == versions[0]
    assert not np.allclose(ctr["scores"], cvr["scores"])  # two models, not one under two names
    status, error, _ = http(a, "POST", "/v1/models/nope:predict", by_ids(42, ts))
    assert status == 404 and "['ctr', 'cvr']" in error["error"]["message"]


def test_an_experiment_gives_a_user_the_same_variant_on_every_node_and_its_models_scores(nodes):
    (a, b), versions, _ = nodes
    ts = int(time.time() * 1000)
    reference = Experiments([ExperimentEntry("ranking", (VariantEntry("current", "ctr", 0.5), VariantEntry("candidate", "cvr", 0.5)),
                                             salt="ranking-2026")], ["ctr", "cvr"])
    seen = {"current": 0, "candidate": 0}
    for user in range(1, 61):
        answers = [http(base, "POST", "/v1/experiments/ranking:predict", by_ids(user, ts))[1] for base in (a, b)]
        want = reference.assign("ranking", user, "any")
        for answer in answers:
            assert "experiment" in answer, answer
            assert (answer["experiment"], answer["variant"], answer["model"]) == ("ranking", want.variant, want.model)
        direct = http(a, "POST", f"/v1/models/{want.model}:predict", by_ids(user, ts))[1]
        np.testing.assert_allclose(answers[0]["scores"], direct["scores"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(answers[1]["scores"], direct["scores"], rtol=0, atol=1e-6)
        seen[want.variant] += 1
    assert min(seen.values()) >= 15  # both variants served


def test_an_experiment_changed_at_run_time_reaches_every_node_and_its_frontends(nodes):
    (a, b), _, _ = nodes
    ts = int(time.time() * 1000)
    change = {"variants": [{"name": "current", "model": "ctr", "share": 0.1}, {"name": "candidate", "model": "cvr", "share": 0.9}],
              "salt": "ramp", "range_start": 0.0, "range_end": 0.5}
    assert http(a, "PUT", "/v1/experiments/ramp", change)[0] == 401  # admin only
    status, stored, _ = http(a, "PUT", "/v1/experiments/ramp", change, {"authorization": f"Bearer {TOKEN}"})
    assert status == 200 and stored["range_end"] == 0.5
    status, error, _ = http(a, "PUT", "/v1/experiments/bad", {"variants": [{"name": "x", "model": "nope", "share": 1.0}]},
                            {"authorization": f"Bearer {TOKEN}"})
    assert status == 400 and "nope" in error["error"]["message"]
    reference = Experiments([ExperimentEntry("ramp", (VariantEntry("current", "ctr", 0.1), VariantEntry("candidate", "cvr", 0.9)),
                                             salt="ramp", range_end=0.5)], ["ctr", "cvr"])
    deadline = time.monotonic() + 20
    while http(b, "POST", "/v1/experiments/ramp:predict", by_ids(1, ts))[0] != 200:  # b reads it from the store
        assert time.monotonic() < deadline, "node b never served the experiment node a created"
        time.sleep(0.2)
    variants = [http(b, "POST", "/v1/experiments/ramp:predict", by_ids(user, ts))[1]["variant"] for user in range(1, 41)]
    assert variants == [reference.assign("ramp", user, "k").variant for user in range(1, 41)]
    assert OUTSIDE in variants  # users outside the range get the control, named as outside
    listed = {e["name"]: e["source"] for e in http(a, "GET", "/v1/experiments")[1]["experiments"]}
    assert listed == {"ramp": "store", "ranking": "config", "shadowed": "config"}
    assert http(a, "DELETE", "/v1/experiments/ramp", headers={"authorization": f"Bearer {TOKEN}"})[0] == 200
    deadline = time.monotonic() + 20
    while http(b, "POST", "/v1/experiments/ramp:predict", by_ids(1, ts))[0] != 404:
        assert time.monotonic() < deadline, "node b kept serving a deleted experiment"
        time.sleep(0.2)


def test_a_fan_out_equals_separate_calls_to_each_model(nodes):
    (a, b), versions, _ = nodes
    ts = int(time.time() * 1000)
    for base in (a, b):
        status, answer, _ = http(base, "POST", "/v1/models/ctr:predict", by_ids(7, ts, models=["ctr", "cvr"]))
        assert status == 200 and set(answer["models"]) == {"ctr", "cvr"} and answer["ts"] == ts
        for model, version in (("ctr", versions[-1]), ("cvr", versions[0])):
            alone = http(base, "POST", f"/v1/models/{model}:predict", by_ids(7, ts))[1]
            assert answer["models"][model]["model_version"] == version
            np.testing.assert_allclose(answer["models"][model]["scores"], alone["scores"], rtol=0, atol=1e-6)
    status, error, _ = http(a, "POST", "/v1/models/ctr:predict", by_ids(7, ts, models=["ctr", "nope"]))
    assert status == 404


def test_a_caller_is_held_to_its_quota_while_others_are_served(nodes):
    (a, b), _, _ = nodes
    ts = int(time.time() * 1000)
    results: dict[str, list[int]] = {"metered": [], "other": []}

    def send(who: str, key: str | None, n: int) -> None:
        for _ in range(n):
            results[who].append(http(b, "POST", "/v1/models/ctr:predict", by_ids(3, ts), {"x-api-key": key} if key else {})[0])

    started = time.monotonic()
    threads = [threading.Thread(target=send, args=("metered", "metered-key", 60)), threading.Thread(target=send, args=("other", None, 30))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    admitted = results["metered"].count(200)
    assert set(results["metered"]) <= {200, 429} and results["metered"].count(429) > 0
    assert admitted <= 5 + 10 * elapsed + 1  # burst + rate x time
    assert results["other"] == [200] * 30
    for _ in range(20):  # the bucket (5 + 10/s) is empty again after a few fast requests
        status, error, headers = http(b, "POST", "/v1/models/ctr:predict", by_ids(3, ts), {"x-api-key": "metered-key"})
        if status != 200:
            break
    assert status == 429 and "'metered'" in error["error"]["message"] and int(headers["retry-after"]) >= 1
    assert http(b, "POST", "/v1/models/ctr:predict", by_ids(3, ts), {"x-priority": "urgent"})[0] == 400
    status, error, _ = http(b, "POST", "/v1/models/ctr:predict", by_ids(3, ts), {"x-prediction-log": "maybe"})
    assert status == 400 and "x-prediction-log" in error["error"]["message"]
    conn = HTTPConnection("127.0.0.1", int(b.rsplit(":", 1)[1]), timeout=30)  # a repeated key: which one counts?
    conn.putrequest("POST", "/v1/models/ctr:predict")
    for header, value in (("x-api-key", "metered-key"), ("x-api-key", "batch-key"), ("content-type", "application/json")):
        conn.putheader(header, value)
    data = orjson.dumps(by_ids(3, ts))
    conn.putheader("content-length", str(len(data)))
    conn.endheaders(data)
    response = conn.getresponse()
    assert response.status == 400 and b"more than one x-api-key" in response.read()
    metrics = urllib.request.urlopen(b + "/metrics", timeout=30).read().decode()
    assert 'streamrec_serving_caller_requests_total{caller="metered",outcome="over_quota"}' in metrics
    assert "metered-key" not in metrics


def test_the_prediction_log_records_answers_and_shadow_scores(nodes, broker, sample_run):
    (a, b), versions, topic = nodes
    ts = int(time.time() * 1000)
    answers = {}
    for base in (a, b):
        for user in (501, 502, 503):
            rid = f"{base[-5:]}-{user}"
            answers[rid] = http(base, "POST", "/v1/experiments/shadowed:predict", by_ids(user, ts), {"x-request-id": rid})[1]
        assert http(base, "POST", "/v1/models/ctr:predict", by_ids(504, ts), {"x-request-id": f"{base[-5:]}-quiet",
                                                                              "x-prediction-log": "off"})[0] == 200
    rows = pq.read_table(sample_run / "samples.parquet").slice(1000, 40).drop(["label", "click_ts"]).to_pylist()
    two_users = [dict(r, user_id=7001 + i % 2) for i, r in enumerate(rows)]
    mixed = http(b, "POST", "/v1/models/ctr:predict", {"instances": two_users}, {"x-request-id": "mixed"})[1]
    deadline = time.monotonic() + 30
    while True:
        records = [decode_prediction(r.value) for r in read_topic(broker, topic, committed=False)]
        mine = [r for r in records if r.request_id in answers]
        split = [r for r in records if r.request_id == "mixed"]
        if len([r for r in mine if r.shadow]) == len(answers) and len([r for r in mine if not r.shadow]) == len(answers) and len(split) == 2:
            break
        assert time.monotonic() < deadline, f"{len(mine)} of {2 * len(answers)} records, {len(split)} of 2 split ones on {topic}"
        time.sleep(0.5)
    assert not [r for r in records if r.request_id.endswith("-quiet")]  # x-prediction-log: off
    for record in split:  # one record per user of a mixed instances request, each with its own candidates and scores
        mine_rows = [i for i, r in enumerate(two_users) if r["user_id"] == record.user_id]
        assert record.item_ids.tolist() == [two_users[i]["item_id"] for i in mine_rows]
        assert record.ts == max(two_users[i]["ts"] for i in mine_rows)
        np.testing.assert_allclose(record.scores, [mixed["scores"][i] for i in mine_rows], rtol=0, atol=1e-6)
    for record in mine:
        answer = answers[record.request_id]
        assert record.experiment == "shadowed" and record.variant == "only" and record.ts == ts
        assert record.item_ids.tolist() == [100 + k for k in range(5)]
        if record.shadow:
            assert record.model == "cvr" and record.model_version == versions[0]
            direct = http(a, "POST", "/v1/models/cvr:predict", by_ids(record.user_id, ts))[1]
            np.testing.assert_allclose(record.scores, direct["scores"], rtol=0, atol=1e-6)
        else:
            assert record.model == "ctr" and record.model_version == answer["model_version"] == versions[-1]
            np.testing.assert_allclose(record.scores, answer["scores"], rtol=0, atol=1e-6)
    metrics = urllib.request.urlopen(a + "/metrics", timeout=30).read().decode()
    assert 'streamrec_serving_shadow_requests_total{model="cvr",outcome="scored"}' in metrics


def test_under_overload_low_priority_requests_are_shed_first(nodes, sample_run):
    (a, b), _, _ = nodes
    rows = pq.read_table(sample_run / "samples.parquet").slice(2000, 1000).drop(["label", "click_ts"]).to_pylist()
    body = {"instances": [dict(r, user_id=11) for r in rows]}  # 1,000 instances: 8 in flight fill the 4,096-instance queue
    outcomes: dict[str, list[tuple[int, str]]] = {"flood": [], "batch-jobs": [], "checkout": []}
    stop = time.monotonic() + 6

    def send(who: str, headers: dict) -> None:
        while time.monotonic() < stop:
            status, answer, _ = http(a, "POST", "/v1/models/ctr:predict", body, headers)
            outcomes[who].append((status, answer.get("error", {}).get("message", "")))

    threads = [threading.Thread(target=send, args=("flood", {"x-api-key": "flood-key"})) for _ in range(8)]
    threads += [threading.Thread(target=send, args=("batch-jobs", {"x-api-key": "batch-key"})),
                threading.Thread(target=send, args=("checkout", {"x-api-key": "checkout-key"}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    low = [m for s, m in outcomes["batch-jobs"] if s == 429]
    assert low and all("low-priority requests are shed" in m for m in low), outcomes["batch-jobs"][:5]
    assert not [m for s, m in outcomes["checkout"] if "priority" in m]  # high priority is never shed for its priority
    shed_share = {who: sum(s == 429 for s, _ in got) / max(len(got), 1) for who, got in outcomes.items()}
    assert shed_share["batch-jobs"] > shed_share["checkout"], shed_share
    metrics = urllib.request.urlopen(a + "/metrics", timeout=30).read().decode()
    assert 'streamrec_serving_caller_requests_total{caller="batch-jobs",outcome="shed"}' in metrics
