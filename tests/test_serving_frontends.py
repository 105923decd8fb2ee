"""`streamrec serve --frontends 2` over real HTTP: the front-end processes share the port,
answer predict with exactly the serving process's scores, name bad instances themselves, relay
every other route (admin included) to the serving process, are restarted when one dies, and all
stop cleanly with the serving process."""

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import REPO, copy_store, free_port
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.modelstore.store import ModelStore
from streamrec.demo.resources import process_tree
from test_serving_http import TOKEN, call
from streamrec.model.batch import batch_from_table
from streamrec.model.inference import InferenceModel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def serving_process(published_model, tmp_path_factory):
    versions = published_model[1]
    root = copy_store(published_model[0], tmp_path_factory.mktemp("frontends") / "models")  # rollback pins it
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(root), "--port", str(port), "--device", "cpu",
         "--compile", "eager", "--frontends", "2"],
        cwd=REPO, env={**os.environ, "STREAMREC_SERVING__ADMIN_TOKEN": TOKEN, "STREAMREC_SERVING__FOLLOW_UPDATES": "false",
             "STREAMREC_SERVING__FEATURE_STORE": "false"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if call(base, "GET", "/readyz")[0] == 200:  # ready = model loaded and both front-ends connected
                break
        except (urllib.error.URLError, ConnectionError):
            pass
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "not ready"
        time.sleep(0.2)
    yield base, proc, versions
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)


def frontends(proc: subprocess.Popen) -> list[int]:
    """The pids of the serving process's front-end processes (from /proc)."""
    out = []
    for pid in process_tree(proc.pid)[1:]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"streamrec.serving.http.frontend" in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_frontends_answer_with_the_served_model(serving_process, published_model, sample_run):
    base, proc, versions = serving_process
    table = pq.read_table(sample_run / "samples.parquet").slice(60_000, 64).drop(["label", "click_ts"])
    model = InferenceModel.load(ModelStore(str(published_model[0]), "ctr"), versions[-1])
    want = model.predict(batch_from_table(table, FeatureSpec(), 50, with_labels=False))
    model.close()
    rows, answers = table.to_pylist(), {}

    def client(i):  # many connections: the kernel spreads them over both front-ends
        answers[i] = [call(base, "POST", "/v1/models/ctr:predict", {"instances": rows[i * 8:(i + 1) * 8]}) for _ in range(5)]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, results in answers.items():
        for status, body in results:
            assert status == 200 and body["model_version"] == versions[-1]
            np.testing.assert_allclose(body["scores"], want[i * 8:(i + 1) * 8], rtol=0, atol=1e-6)
    assert len(frontends(proc)) == 2


def test_frontends_refuse_bad_requests_and_relay_the_other_routes(serving_process, sample_run):
    base, _, versions = serving_process
    row = pq.read_table(sample_run / "samples.parquet").slice(0, 1).drop(["label", "click_ts"]).to_pylist()[0]
    status, answer = call(base, "POST", "/v1/models/ctr:predict", {"instances": [row, {**row, "user_id": "x"}]})
    assert status == 400 and "instance 1: wrong_type:user_id" in answer["error"]["message"]
    status, answer = call(base, "POST", "/v1/models/nope:predict", {"instances": [row]})
    assert status == 404 and "unknown model 'nope'" in answer["error"]["message"]
    status, info = call(base, "GET", "/v1/models/ctr")  # relayed to the serving process
    assert status == 200 and info["model_version"] == versions[-1] and info["batching"]["requests"] >= 40
    assert call(base, "POST", "/v1/models/ctr:rollback")[0] == 401
    # the serving process caught up to the last version at start-up: nothing to roll back to, and its
    # answer (status and message) comes back through the front-end unchanged
    status, answer = call(base, "POST", "/v1/models/ctr:rollback", {}, token=TOKEN)
    assert status == 409 and "roll back" in answer["error"]["message"], answer
    status, answer = call(base, "POST", "/v1/models/ctr:reload", {"version": versions[-2]}, token=TOKEN)
    assert status == 200 and answer["model_version"] == versions[-2] and answer["pinned"]
    time.sleep(1.5)  # an explicit version stays pinned: the store watcher (1 s polls) does not move on to LATEST
    assert call(base, "POST", "/v1/models/ctr:predict", {"instances": [row]})[1]["model_version"] == versions[-2]
    status, answer = call(base, "POST", "/v1/models/ctr:rollback", {}, token=TOKEN)
    assert status == 200 and answer["model_version"] == versions[-1] and answer["pinned"]


def test_a_dead_frontend_is_replaced_and_all_stop_with_the_serving_process(serving_process, sample_run):
    base, proc, _ = serving_process
    row = pq.read_table(sample_run / "samples.parquet").slice(0, 1).drop(["label", "click_ts"]).to_pylist()[0]
    victim = frontends(proc)[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not (len(now := [p for p in frontends(proc) if alive(p)]) == 2 and victim not in now and call(base, "GET", "/readyz")[0] == 200):
        assert time.monotonic() < deadline, "the dead front-end was not replaced"
        time.sleep(0.2)
    for _ in range(10):  # whichever front-end takes the connection answers
        assert call(base, "POST", "/v1/models/ctr:predict", {"instances": [row]})[0] == 200
    children = frontends(proc)
    proc.terminate()
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in children)
