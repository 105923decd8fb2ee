"""`streamrec serve` over real HTTP: predictions equal the trainer's model, shape buckets are
compiled at load and an out-of-bucket batch gets its own bucket in the background, bad
requests get clear 4xx answers (an experiment request naming several users too), a node with
no version yet answers 503, new versions are hot-swapped under load with no failed request,
rollback restores the previous predictions exactly, and a pin the store refuses is a 503 after
which the node serves what it served before.

One node runs ``torch.compile`` buckets (the CPU form of bucket pre-compilation; CUDA graphs
are checked on the GPU by bench/bench_serving_runtime.py) for the tests about compiled mode;
the others share an eager node (the CPU default), where the versions they swap in are not
compiled again (seconds each on 2 cores with a cold inductor cache)."""

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest

from conftest import REPO, CheckedProducer, copy_store, free_port, wait_ready
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.modelstore.store import ModelStore
from streamrec.model.batch import batch_from_table
from streamrec.model.inference import InferenceModel

pytestmark = pytest.mark.slow
TOKEN = "test-token"
N_INSTANCES = 64


def publish_in_turn(root: Path, store_root: Path, versions: list[int], base: str) -> None:
    """Publish ``versions`` of the store at ``root`` into ``store_root`` as the trainer does (the
    version's directory appears, then LATEST moves), half a second apart, while a node at ``base``
    serves; return once it serves the last one and has answered a little longer on it."""
    for v in versions:
        shutil.copytree(root / "ctr" / "versions" / f"{v:012d}", store_root / "ctr" / "versions" / f"{v:012d}")
        tmp = store_root / "ctr" / ".LATEST.tmp"
        tmp.write_text(f"{v}\n")
        tmp.replace(store_root / "ctr" / "LATEST")
        time.sleep(0.5)
    deadline = time.monotonic() + 30
    while call(base, "GET", "/v1/models/ctr")[1]["model_version"] != versions[-1]:
        assert time.monotonic() < deadline, f"the node never served version {versions[-1]}"
        time.sleep(0.1)
    time.sleep(0.3)


def call(base, method, path, body=None, token=None, raw=None):
    data = raw if raw is not None else (orjson.dumps(body) if body is not None else None)
    request = urllib.request.Request(base + path, data=data, method=method, headers={"content-type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, orjson.loads(response.read()) if "json" in response.headers.get("content-type", "") else None
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())


@pytest.fixture(scope="module")
def instances(sample_run):
    table = pq.read_table(sample_run / "samples.parquet").slice(60_000, N_INSTANCES)
    return table.drop(["label", "click_ts"])


@pytest.fixture(scope="module")
def expected(published_model, instances):
    """Reference scores of every version: the trainer's model loaded directly."""
    root, versions = published_model
    batch = batch_from_table(instances, FeatureSpec(), 50, with_labels=False)
    out = {}
    for v in versions:
        model = InferenceModel.load(ModelStore(str(root), "ctr"), v)
        out[v] = model.predict(batch)
        model.close()
    return out


def first_two_versions(root: Path, versions: list[int], dest: Path) -> Path:
    """A copy of the store at ``root`` as it was when its second version was published: the
    later ones are left for a test to publish (:func:`publish_in_turn`)."""
    copy_store(root, dest)
    for v in versions[2:]:
        shutil.rmtree(dest / "ctr" / "versions" / f"{v:012d}")
    (dest / "ctr" / "LATEST").write_text(f"{versions[1]}\n")
    return dest


def start_node(store_root: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """A real `streamrec serve` on CPU over ``store_root``, without online features and without
    following a model-updates topic (it polls LATEST): (process, base URL)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(store_root), "--port", str(port), "--device", "cpu", *args],
        cwd=REPO, env={**os.environ, "STREAMREC_SERVING__FEATURE_STORE": "false", "STREAMREC_SERVING__FOLLOW_UPDATES": "false",
                       **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def stop_node(proc: subprocess.Popen) -> None:
    """SIGTERM, which a node must survive into a clean exit (status 0)."""
    proc.terminate()
    proc.wait(timeout=30)
    assert proc.returncode == 0


@pytest.fixture(scope="module")
def compiled_server(published_model):
    """A node with torch.compile buckets over the trainer's store as published (read only: no
    admin token), for the tests about compiled mode."""
    root, versions = published_model
    proc, base = start_node(root, "--compile", "compile", "--workers", "2",
                            env={"STREAMREC_SERVING__BATCH_BUCKETS": "8,16", "STREAMREC_SERVING__HISTORY_BUCKETS": "16",
                                 "STREAMREC_SERVING__MAX_EXTRA_BUCKETS": "3"})
    try:
        wait_ready(base, proc, 240)  # compiling the buckets on 2 cores with a cold inductor cache: ~30 s
        yield base, versions
    finally:
        stop_node(proc)


@pytest.fixture(scope="module")
def server(published_model, tmp_path_factory):
    """An eager node started on a store that holds only the first two versions."""
    root, versions = published_model
    store_root = first_two_versions(root, versions, tmp_path_factory.mktemp("serving") / "models")
    proc, base = start_node(store_root, "--poll-interval", "0.2", "--compile", "eager", "--workers", "2",
                            env={"STREAMREC_SERVING__ADMIN_TOKEN": TOKEN})
    try:
        wait_ready(base, proc)
        yield base, store_root, versions
    finally:
        stop_node(proc)


def test_predictions_equal_the_trainers_model(compiled_server, instances, expected):
    """Compiled buckets answer with the trainer's model's scores, batches merged or not."""
    base, versions = compiled_server
    rows = instances.to_pylist()
    results = {}

    def client(i):  # 8 concurrent clients of 8 instances: the batcher merges them
        status, body = call(base, "POST", "/v1/models/ctr:predict", {"instances": rows[i * 8:(i + 1) * 8]})
        results[i] = (status, body)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (status, body) in results.items():
        assert status == 200 and body["model_version"] == versions[-1]
        np.testing.assert_allclose(body["scores"], expected[versions[-1]][i * 8:(i + 1) * 8], rtol=0, atol=1e-6)
    status, info = call(base, "GET", "/v1/models/ctr")
    assert status == 200 and info["model_version"] == versions[-1] and info["trained_through_ms"] > 0


def test_buckets_compile_at_load_and_an_out_of_bucket_batch_gets_its_own(compiled_server, instances, expected):
    base, versions = compiled_server
    runtime = call(base, "GET", "/v1/models/ctr")[1]["runtime"]
    assert runtime["mode"] == "compile"
    assert {k for k, b in runtime["buckets"].items() if b["origin"] == "load"} == {"8x16", "8x50", "16x16", "16x50"}
    rows, want = instances.to_pylist()[:40], expected[versions[-1]][:40]
    eager_before = runtime["eager_batches"]
    status, body = call(base, "POST", "/v1/models/ctr:predict", {"instances": rows})  # 40 > 16: no bucket fits
    assert status == 200
    np.testing.assert_allclose(body["scores"], want, rtol=0, atol=1e-6)
    deadline = time.monotonic() + 120
    while True:  # answered eagerly at once; its bucket (64 rows) is built in the background
        runtime = call(base, "GET", "/v1/models/ctr")[1]["runtime"]
        built = [k for k, b in runtime["buckets"].items() if b["origin"] == "async" and k.startswith("64x")]
        if built or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # (the merged batches of the test before may have had a bucket built too, e.g. 32x50)
    assert runtime["eager_batches"] > eager_before and built, runtime
    status, body = call(base, "POST", "/v1/models/ctr:predict", {"instances": rows})
    np.testing.assert_allclose(body["scores"], want, rtol=0, atol=1e-6)
    runtime = call(base, "GET", "/v1/models/ctr")[1]["runtime"]
    assert runtime["buckets"][built[0]]["batches"] >= 1 and runtime["buckets"][built[0]]["padded_rows"] >= 24


@pytest.mark.parametrize("path, body, raw, status, message", [
    ("/v1/models/nope:predict", {"instances": [{}]}, None, 404, "unknown model 'nope'"),
    ("/v1/models/ctr:predict", None, b"{not json", 400, "not valid JSON"),
    ("/v1/models/ctr:predict", None, b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/models/ctr:predict", {"rows": []}, None, 400, "needs 'instances'"),
    ("/v1/models/ctr:predict", {"instances": []}, None, 400, "needs 'instances'"),
    ("/v1/models/ctr:predict", {"instances": [1, 2]}, None, 400, "are not JSON objects"),
    ("/v1/models/ctr:predict", {"instances": [{}] * 1025}, None, 413, "serving.max_instances"),
    # the form comes from the top-level keys, not from a string that says "instances"
    ("/v1/models/ctr:predict", {"user_id": 1, "context": {"device": "instances"}, "candidates": [{"item_id": 2}]}, None,
     400, "no online feature store"),
])
def test_bad_requests_get_a_clear_4xx(server, path, body, raw, status, message):
    base = server[0]
    got, answer = call(base, "POST", path, body, raw=raw)
    assert got == status and message in answer["error"]["message"], answer


def test_an_oversize_body_is_refused_before_it_is_read(server):
    import http.client

    host, port = server[0].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/models/ctr:predict")
    conn.putheader("content-type", "application/json")
    conn.putheader("content-length", str(64 << 20))  # announced, never sent
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and "max_body_bytes" in orjson.loads(response.read())["error"]["message"]
    conn.close()


def test_bad_instances_name_the_instance_and_field(server, instances):
    base = server[0]
    rows = instances.to_pylist()[:4]
    rows[1] = {**rows[1], "user_id": "u-1"}
    rows[2] = {k: v for k, v in rows[2].items() if k != "item_id"}
    rows[3] = {**rows[3], "hist_item_ids": [1, 2], "hist_category_ids": [3]}
    status, answer = call(base, "POST", "/v1/models/ctr:predict", {"instances": rows})
    message = answer["error"]["message"]
    assert status == 400 and "instance 1: wrong_type:user_id" in message and "instance 2: missing_field:item_id" in message
    assert "instance 3: invalid_value:hist_category_ids" in message
    assert call(base, "GET", "/healthz") == (200, {"status": "ok"})  # the server shrugs it off


def test_predict_before_any_version_is_loaded_is_a_503(tmp_path, instances):
    """A node over a store with nothing published yet is up but cannot score: 503, telling the
    client to try again and where to look (/readyz), not a 500 or a 404."""
    empty = tmp_path / "models"
    empty.mkdir()
    proc, base = start_node(empty, "--compile", "eager")
    try:
        deadline = time.monotonic() + 120
        while True:  # never ready: wait until it answers at all
            try:
                status, readiness = call(base, "GET", "/readyz")
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.monotonic() < deadline, "the node did not start"
                time.sleep(0.2)
        assert status == 503, readiness
        status, answer = call(base, "POST", "/v1/models/ctr:predict", {"instances": instances.to_pylist()[:2]})
        message = answer["error"]["message"]
        assert status == 503 and "no model version is loaded yet" in message and "try again" in message and "/readyz" in message, answer
    finally:
        stop_node(proc)


def test_an_experiment_request_names_one_user(server, instances):
    """A user's variant picks the model, so an experiment request whose instances name several
    users has no one model: 400, while several instances of one user are scored."""
    base = server[0]
    rows = instances.to_pylist()
    other = next(row for row in rows if row["user_id"] != rows[0]["user_id"])
    experiment = {"variants": [{"name": "all", "model": "ctr", "share": 1.0}]}
    assert call(base, "PUT", "/v1/experiments/one_user", experiment, token=TOKEN)[0] == 200
    try:
        status, answer = call(base, "POST", "/v1/experiments/one_user:predict", {"instances": [rows[0], rows[0]]})
        assert status == 200 and (answer["experiment"], answer["variant"], answer["model"]) == ("one_user", "all", "ctr"), answer
        assert len(answer["scores"]) == 2
        status, answer = call(base, "POST", "/v1/experiments/one_user:predict", {"instances": [rows[0], other]})
        assert status == 400 and "one user" in answer["error"]["message"], answer
    finally:
        assert call(base, "DELETE", "/v1/experiments/one_user", token=TOKEN)[0] == 200


def test_admin_routes_need_the_token(server):
    base = server[0]
    assert call(base, "POST", "/v1/models/ctr:rollback")[0] == 401
    assert call(base, "POST", "/v1/models/ctr:reload", {}, token="wrong")[0] == 401
    status, answer = call(base, "POST", "/v1/models/ctr:rollback", {"version": "x"}, token=TOKEN)
    assert status == 400 and "positive integer" in answer["error"]["message"]


def test_hot_swap_under_load_then_rollback_and_reload(server, published_model, instances, expected):
    base, store_root, versions = server
    root = published_model[0]
    body = {"instances": instances.to_pylist()}
    answers, failures, stop = [], [], threading.Event()

    def load():
        while not stop.is_set():
            status, answer = call(base, "POST", "/v1/models/ctr:predict", body)
            if status != 200:
                failures.append(answer)
            else:
                answers.append(answer)

    clients = [threading.Thread(target=load) for _ in range(4)]
    for c in clients:
        c.start()
    publish_in_turn(root, store_root, versions[2:], base)
    stop.set()
    for c in clients:
        c.join()
    assert not failures, failures[:3]
    seen = {a["model_version"] for a in answers}
    assert versions[-1] in seen and len(seen) >= 3
    for a in answers:  # every response is exactly one version's scores
        np.testing.assert_allclose(a["scores"], expected[a["model_version"]], rtol=0, atol=1e-6)

    status, answer = call(base, "POST", "/v1/models/ctr:rollback", {}, token=TOKEN)
    assert status == 200 and answer["model_version"] == versions[-2] and answer["pinned"]
    np.testing.assert_allclose(call(base, "POST", "/v1/models/ctr:predict", body)[1]["scores"], expected[versions[-2]], rtol=0, atol=1e-6)
    time.sleep(0.5)  # pinned: the watcher does not move it forward
    assert call(base, "GET", "/v1/models/ctr")[1]["model_version"] == versions[-2]
    status, answer = call(base, "POST", "/v1/models/ctr:reload", {}, token=TOKEN)
    assert status == 200 and answer["model_version"] == versions[-1] and not answer["pinned"]
    status, metrics = 200, urllib.request.urlopen(base + "/metrics").read().decode()
    assert "streamrec_serving_requests_total" in metrics and f'streamrec_serving_model_version{{model="ctr"}} {float(versions[-1])}' in metrics
    assert json.loads(urllib.request.urlopen(base + "/openapi.json").read())["info"]["title"] == "streamrec serving"


def _admin_with_two_tokens(base: str, path: str) -> tuple[int, dict]:
    """POST ``path`` with two Authorization headers (a wrong one, then the right one)."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Authorization", "Bearer wrong")
        conn.putheader("Authorization", f"Bearer {TOKEN}")
        conn.putheader("Content-Length", "2")
        conn.endheaders(b"{}")
        response = conn.getresponse()
        return response.status, orjson.loads(response.read())
    finally:
        conn.close()


def test_a_failed_reload_or_rollback_pins_nothing_and_a_typo_is_refused(server):
    """An operator's :reload/:rollback to a version that does not load changes nothing: no
    PIN in the store (every node would stop following LATEST), the same version served; an
    admin body with an unknown key is a 400, not a release of the pin; an admin call with two
    Authorization headers is refused, whichever of them is right."""
    base, store_root, versions = server
    model_dir = store_root / "ctr"
    status, before = call(base, "GET", "/v1/models/ctr")
    assert status == 200 and not before["pinned"] and not (model_dir / "PIN").exists()
    served = before["model_version"]
    broken = versions[1]
    sparse = sorted((model_dir / "versions" / f"{broken:012d}" / "sparse").rglob("*.arrow"))[0]
    saved = sparse.read_bytes()
    sparse.unlink()
    try:
        for route in (":rollback", ":reload"):
            status, answer = call(base, "POST", f"/v1/models/ctr{route}", {"version": broken}, token=TOKEN)
            assert status == 422, (route, status, answer)
            assert not (model_dir / "PIN").exists(), f"a failed {route} wrote a pin"
            status, now = call(base, "GET", "/v1/models/ctr")
            assert now["model_version"] == served and not now["pinned"], (route, now)
    finally:
        sparse.write_bytes(saved)

    status, answer = call(base, "POST", "/v1/models/ctr:rollback", {"version": versions[0]}, token=TOKEN)
    assert status == 200 and answer["pinned"] and (model_dir / "PIN").exists()
    status, answer = call(base, "POST", "/v1/models/ctr:reload", {"versoin": 3}, token=TOKEN)
    assert status == 400 and "'versoin'" in answer["error"]["message"], answer
    assert (model_dir / "PIN").exists() and call(base, "GET", "/v1/models/ctr")[1]["pinned"]  # still pinned
    status, answer = _admin_with_two_tokens(base, "/v1/models/ctr:reload")
    assert status == 400 and "more than one Authorization" in answer["error"]["message"], answer
    status, answer = call(base, "POST", "/v1/models/ctr:reload", {}, token=TOKEN)
    assert status == 200 and not answer["pinned"] and not (model_dir / "PIN").exists()
    deadline = time.monotonic() + 30
    while call(base, "GET", "/v1/models/ctr")[1]["model_version"] != served and time.monotonic() < deadline:
        time.sleep(0.1)
    assert call(base, "GET", "/v1/models/ctr")[1]["model_version"] == served


def test_a_pin_the_store_refuses_is_a_503_and_the_node_goes_back(server, instances, expected):
    """:rollback/:reload to a sound version whose pin the store does not take answers 503: no
    pin anywhere, and the node serves (and says it serves) the version it served before, so it
    does not sit on a version other nodes will not follow. The store refuses the pin because
    PIN is a directory (no write replaces it; tests run as root, where chmod stops nothing)."""
    base, store_root, versions = server
    pin_path = store_root / "ctr" / "PIN"
    status, before = call(base, "GET", "/v1/models/ctr")
    served = before["model_version"]
    assert status == 200 and not before["pinned"] and served != versions[0]
    body = {"instances": instances.to_pylist()}
    pin_path.mkdir()
    try:
        for route in (":rollback", ":reload"):
            status, answer = call(base, "POST", f"/v1/models/ctr{route}", {"version": versions[0]}, token=TOKEN)
            message = answer["error"]["message"]
            assert status == 503 and "could not be written" in message and f"back on version {served}" in message, (route, answer)
            assert pin_path.is_dir(), f"{route} replaced the PIN path"
            status, now = call(base, "GET", "/v1/models/ctr")
            assert now["model_version"] == served and not now["pinned"], (route, now)
            status, scored = call(base, "POST", "/v1/models/ctr:predict", body)
            assert status == 200 and scored["model_version"] == served
            np.testing.assert_allclose(scored["scores"], expected[served], rtol=0, atol=1e-6)
    finally:
        pin_path.rmdir()


def test_an_announced_version_is_applied_without_waiting_for_the_poll(published_model, broker, tmp_path):
    """With a 60 s LATEST poll, a version announced on the model-updates topic is still
    applied within seconds: the server follows the topic."""
    from streamrec.plumbing.bus.topics import ensure_topics

    root, versions = published_model
    store_root = tmp_path / "models"
    copy_store(root, store_root)
    shutil.rmtree(store_root / "ctr" / "versions" / f"{versions[-1]:012d}")
    (store_root / "ctr" / "LATEST").write_text(f"{versions[-2]}\n")
    topic = f"updates-{time.time_ns()}"
    ensure_topics(broker, [topic], partitions=1)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(store_root), "--port", str(port), "--device", "cpu",
         "--poll-interval", "60"],
        cwd=REPO, env={**os.environ, "STREAMREC_KAFKA__BOOTSTRAP": broker, "STREAMREC_TOPICS__MODEL_UPDATES": topic,
                       "STREAMREC_SERVING__FOLLOW_UPDATES": "true"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, 60)
        time.sleep(3)  # the listener connects on its own thread
        v = versions[-1]
        shutil.copytree(root / "ctr" / "versions" / f"{v:012d}", store_root / "ctr" / "versions" / f"{v:012d}")
        (store_root / "ctr" / "LATEST").write_text(f"{v}\n")
        producer = CheckedProducer(broker)
        producer.send(topic, key=b"ctr", value=orjson.dumps({"model": "ctr", "version": v}))
        producer.flush(timeout=10)
        producer.close()
        announced = time.monotonic()
        while call(base, "GET", "/v1/models/ctr")[1]["model_version"] != v:
            assert time.monotonic() - announced < 15, "the announced version was not applied (the poll is 60 s)"
            time.sleep(0.1)
    finally:
        proc.terminate()
        print(proc.communicate(timeout=30)[0])  # the server's log, shown when the test fails
