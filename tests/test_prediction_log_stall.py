"""The prediction log never makes an answer wait for Kafka: with the node's broker frozen
(SIGSTOP) every predict request is still answered and every record is queued or counted as
dropped, and once the broker is thawed the log sends again and every record's fate is known. Real node, real HTTP, a
private embedded broker (the session's is shared by other tests)."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pyarrow.parquet as pq
import pytest

from conftest import REPO, free_port, run_cli, wait_ready
from test_model_access import http

pytestmark = [pytest.mark.slow, pytest.mark.serial]


def log_counts(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("streamrec_serving_prediction_log_records{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_frozen_broker_never_holds_an_answer_and_the_log_recovers(published_model, sample_run, tmp_path):
    port, data = free_port(), tmp_path / "kafka"
    up = run_cli("kafka", "up", "--partitions", "1", "--port", str(port), "--data-dir", str(data))
    assert up.returncode == 0, up.stderr
    broker_group = os.getpgid(json.loads((data / "node-1" / "broker.pid").read_text())["pid"])
    http_port = free_port()
    node = subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(published_model[0]), "--port", str(http_port),
         "--device", "cpu", "--compile", "eager"],
        cwd=REPO, env={**os.environ, "STREAMREC_KAFKA__BOOTSTRAP": f"127.0.0.1:{port}", "STREAMREC_SERVING__FEATURE_STORE": "false",
                       "STREAMREC_SERVING__FOLLOW_UPDATES": "false", "STREAMREC_SERVING__PREDICTION_LOG": "true",
                       "STREAMREC_SERVING__PREDICTION_LOG_QUEUE": "50", "STREAMREC_KAFKA__CONNECT_TIMEOUT_S": "2"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{http_port}"
    rows = pq.read_table(sample_run / "samples.parquet").slice(500, 4).drop(["label", "click_ts"]).to_pylist()
    body = {"instances": rows}
    try:
        wait_ready(base, node)
        for _ in range(20):
            assert http(base, "POST", "/v1/models/ctr:predict", body)[0] == 200
        deadline = time.monotonic() + 60
        while log_counts(base).get("sent", 0) < 20:
            assert time.monotonic() < deadline, f"the log never sent its first records: {log_counts(base)}"
            time.sleep(0.2)
        before = log_counts(base)

        os.killpg(broker_group, signal.SIGSTOP)
        statuses, took = [], []
        for _ in range(300):
            started = time.monotonic()
            statuses.append(http(base, "POST", "/v1/models/ctr:predict", body)[0])
            took.append(time.monotonic() - started)
        assert statuses == [200] * 300
        # a log that waited for the broker would hold an answer for its 2 s connect timeout or
        # the producer's 1 s max_block_ms at least
        assert max(took) < 0.9, f"slowest answers during the freeze: {sorted(took)[-5:]}"
        stalled = log_counts(base)
        made = stalled["queued"] - before["queued"] + stalled["dropped"] - before["dropped"]
        assert made >= 300  # every answer was taken by the log (queued) or counted as dropped: none waited
        assert stalled["sent"] == before["sent"]  # a frozen broker acknowledges nothing

        os.killpg(broker_group, signal.SIGCONT)
        for _ in range(20):
            assert http(base, "POST", "/v1/models/ctr:predict", body)[0] == 200
        deadline = time.monotonic() + 90
        while not ((now := log_counts(base))["sent"] > stalled["sent"] and now["sent"] + now["failed"] >= now["queued"]):
            assert time.monotonic() < deadline, f"the log never settled after the broker thawed: {now}"
            time.sleep(0.5)  # every queued record's fate known: sent, or failed and counted
    finally:
        os.killpg(broker_group, signal.SIGCONT)
        node.terminate()
        node.wait(timeout=30)
        run_cli("kafka", "down", "--port", str(port), "--data-dir", str(data))
