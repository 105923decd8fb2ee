"""SIGTERM drains `streamrec serve`: every predict request in flight when the signal comes is
answered 200, then the process exits 0. Whether the serving process answers HTTP itself or
front-end processes do (they stop accepting and finish their requests, which the serving
process still scores).

The requests are held in flight by the batching window: serving.max_delay_us is long, so
they wait in the model runtime's queue (GET /v1/models/<model> counts them) when the signal comes.
"""

import http.client
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error

import orjson
import pyarrow.parquet as pq
import pytest

from conftest import REPO, free_port
from test_serving_http import call

pytestmark = pytest.mark.slow
WINDOW_US = 3_000_000  # the batching window that keeps the requests in flight; well within uvicorn's 10 s graceful shutdown
REQUESTS, ROWS = 8, 4


def start(store, frontends: int, new_session: bool = False) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(store), "--port", str(port), "--device", "cpu",
         "--compile", "eager", "--frontends", str(frontends)],
        cwd=REPO, env={**os.environ, "STREAMREC_SERVING__FOLLOW_UPDATES": "false", "STREAMREC_SERVING__FEATURE_STORE": "false",
                       "STREAMREC_SERVING__MAX_DELAY_US": str(WINDOW_US), "STREAMREC_SERVING__QUEUE_TIMEOUT_MS": "30000"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=new_session)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
    proc.output = output  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    while True:
        try:
            if call(f"http://127.0.0.1:{port}", "GET", "/readyz")[0] == 200:  # with front-ends: all of them connected
                return proc, port
        except (urllib.error.URLError, ConnectionError):
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "".join(output)[-3000:]
        time.sleep(0.2)


def predict(port: int, body: bytes) -> tuple[int | None, dict | str]:
    """(status, JSON answer), or (None, the error) when the connection fails instead."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/models/ctr:predict", body=body, headers={"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, orjson.loads(response.read())
    except (OSError, http.client.HTTPException) as exc:
        return None, repr(exc)
    finally:
        conn.close()


@pytest.mark.parametrize("frontends, signalled", [(0, "serving process"), (2, "serving process"), (2, "process group")])
def test_sigterm_answers_every_request_in_flight_then_exits_0(published_model, sample_run, frontends, signalled):
    """``process group``: the front-ends get the signal too, as from systemd (KillMode=control-group)
    or a terminal; each drains on its own while the serving process still scores."""
    rows = pq.read_table(sample_run / "samples.parquet").slice(0, REQUESTS * ROWS).drop(["label", "click_ts"]).to_pylist()
    proc, port = start(published_model[0], frontends, new_session=signalled == "process group")
    answers: list = []
    try:
        clients = [threading.Thread(target=lambda i=i: answers.append(
            predict(port, orjson.dumps({"instances": rows[i * ROWS:(i + 1) * ROWS]})))) for i in range(REQUESTS)]
        for t in clients:
            t.start()
        deadline = time.monotonic() + 30
        while call(f"http://127.0.0.1:{port}", "GET", "/v1/models/ctr")[1]["batching"]["queued_instances"] < REQUESTS * ROWS:
            assert time.monotonic() < deadline and not answers, answers  # all of them waiting in the batching window
            time.sleep(0.05)
        assert not answers  # none answered yet: every one is in flight when the signal comes
        if signalled == "serving process":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        for t in clients:
            t.join(timeout=60)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.2)  # the reader thread drains the pipe
    output = "".join(proc.output)
    assert [status for status, _ in answers] == [200] * REQUESTS, (answers, output[-3000:])
    assert all(len(body["scores"]) == ROWS for _, body in answers)
    assert code == 0, output[-3000:]
    assert "Traceback" not in output, output[-5000:]
