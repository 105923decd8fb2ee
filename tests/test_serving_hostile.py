"""Hostile and excessive traffic against `streamrec serve` over real HTTP, answered by the
serving process itself and through a front-end process: input that used to get a 500 (JSON nested too
deeply, invalid UTF-8 in a JSON string, a non-UTF-8 header byte) gets a 4xx or is served;
what the HTTP parser refuses gets the same JSON 400 as any bad request; an instance's strings
and ranges are bounded; stalled connections are closed after serving.read_timeout_s and idle
ones after serving.keep_alive_s; past serving.max_connections a
request gets a 503 while /healthz and /readyz answer, also under a flood of idle connections
bigger than the process's file-descriptor limit; an overloaded queue refuses at once (429) or
drops a request at its deadline (503; the server's or the client's own), never running it, and
counts both; and no client input leaves a
traceback in the server's log."""

import http.client
import logging
import math
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid

import orjson
import pyarrow.parquet as pq
import pytest

from conftest import REPO, copy_store, free_port, wait_ready
from streamrec.serving.http.guard import LogThrottle
from test_serving_http import TOKEN, call

pytestmark = pytest.mark.slow
READ_TIMEOUT_S, KEEP_ALIVE_S, MAX_CONNECTIONS, NOFILE = 2, 1, 8, 256
PREDICT = "/v1/models/ctr:predict"


class Server:
    """A `streamrec serve` process, its public port and everything it printed."""

    def __init__(self, published_model, tmp_path, env: dict, args: tuple = (), nofile: int | None = None) -> None:
        root = tmp_path / "models"
        copy_store(published_model[0], root)
        self.port = free_port()
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(root), "--port", str(self.port), "--device", "cpu",
             "--compile", "eager", *args],
            cwd=REPO, env={**os.environ, "STREAMREC_SERVING__ADMIN_TOKEN": TOKEN, "STREAMREC_SERVING__FOLLOW_UPDATES": "false",
                           "STREAMREC_SERVING__FEATURE_STORE_DIR": str(tmp_path / "features"), **env},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=limit)
        self.base = f"http://127.0.0.1:{self.port}"
        self.output: list[str] = []
        threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True).start()
        wait_ready(self.base, self.proc, 120, output=lambda: "".join(self.output)[-3000:])

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        time.sleep(0.2)  # the reader thread drains the pipe
        return "".join(self.output)


def limited_env(broker: str) -> dict:
    return {"STREAMREC_SERVING__READ_TIMEOUT_S": str(READ_TIMEOUT_S), "STREAMREC_SERVING__KEEP_ALIVE_S": str(KEEP_ALIVE_S),
            "STREAMREC_SERVING__MAX_CONNECTIONS": str(MAX_CONNECTIONS), "STREAMREC_KAFKA__BOOTSTRAP": broker,
            "STREAMREC_TOPICS__FEATURES": f"hostile-{uuid.uuid4().hex[:8]}.features",  # by ids: decoded before the store is read
            "STREAMREC_SERVING__FEATURE_STORE_READY_TIMEOUT_S": "1"}


@pytest.fixture(scope="module", params=["serving_process", "frontends"])
def server(request, published_model, broker, tmp_path_factory):
    """The serving process answering HTTP itself (with fewer file descriptors than the flood test's
    connections), or one front-end process answering for it."""
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "serving_process":
        s = Server(published_model, tmp, limited_env(broker), nofile=NOFILE)
    else:
        s = Server(published_model, tmp, limited_env(broker), ("--frontends", "1"))
    yield s
    output = s.stop()
    assert s.proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-5000:]  # no input above was a server error


@pytest.fixture(scope="module")
def instances(sample_run):
    return pq.read_table(sample_run / "samples.parquet").slice(60_000, 256).drop(["label", "click_ts"]).to_pylist()


def request(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body or None, headers={"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, orjson.loads(response.read())
    finally:
        conn.close()


def raw(port: int, data: bytes, timeout_s: float = 30) -> tuple[int, bytes]:
    """Send ``data`` as it is on a fresh connection; (status, body) of the answer."""
    status, _, body = raw_answer(port, data, timeout_s)
    return status, body


def raw_answer(port: int, data: bytes, timeout_s: float = 30) -> tuple[int, dict, bytes]:
    """(status, headers with lower-case names, body) of the answer to ``data`` sent as it is."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split(" ", 2)[1]), headers, body


def test_the_log_throttle_lets_one_record_of_a_kind_through_per_interval():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("test.throttle")
    logger.addHandler(handler)
    logger.propagate = False
    logger.addFilter(LogThrottle(interval_s=0.5))

    def fail(kind):
        try:
            raise kind("boom")
        except Exception:
            logger.exception("unexpected error")

    for _ in range(5):
        fail(ValueError)
    fail(KeyError)
    for _ in range(2):
        logger.warning("no traceback")
    assert [r.exc_info[0] if r.exc_info else r.msg for r in records] == [ValueError, KeyError, "no traceback", "no traceback"]
    time.sleep(0.6)
    fail(ValueError)
    assert records[-1].exc_info[0] is ValueError and "(4 more like it in the last" in records[-1].msg

    uvicorn_like = logging.getLogger("test.throttle.all")
    uvicorn_like.addFilter(LogThrottle(interval_s=60, tracebacks_only=False))
    for _ in range(3):
        uvicorn_like.warning("Invalid HTTP request received.")
    assert [r.msg for r in records[5:]] == ["Invalid HTTP request received."]


def test_deep_json_and_invalid_utf8_get_a_400(server):
    deep = b"[" * 100_000 + b"]" * 100_000
    bad = b"\"\xff\xfe\""
    by_ids = b'{"user_id": 5, "context": {"device": %s, "local_hour": 3}, "candidates": [{"item_id": 1, "category_id": 1, "advertiser_id": 1, "position": 0}]}'
    cases = [
        (PREDICT, b'{"instances": ' + deep + b"}", "nested too deeply"),
        (PREDICT, b'{"instances": [{"hist_item_ids": ' + deep + b"}]}", "nested too deeply"),
        (PREDICT, b'{"instances": [{"device": ' + bad + b"}]}", "not valid UTF-8"),
        (PREDICT, by_ids % bad, "not valid UTF-8"),
        (PREDICT, by_ids % deep, "by-ids"),
        ("/v1/models/ctr:rollback", b'{"reason": ' + deep + b"}", "not valid JSON"),
        ("/v1/models/ctr:reload", b'{"reason": ' + bad + b"}", "not valid JSON"),
    ]
    for path, body, says in cases:
        status, _, answer = request(server.port, "POST", path, body, {"authorization": f"Bearer {TOKEN}"})
        assert status == 400 and says in answer["error"]["message"], (path, body[:60], status, answer)


def test_non_utf8_header_bytes_are_served(server, instances):
    junk = b"x-junk: caf\xe9 \xff\xfe\r\n"
    status, body = raw(server.port, b"GET /healthz HTTP/1.1\r\nhost: x\r\n" + junk + b"connection: close\r\n\r\n")
    assert status == 200 and orjson.loads(body) == {"status": "ok"}
    status, body = raw(server.port, b"GET /v1/models/ctr HTTP/1.1\r\nhost: x\r\n" + junk + b"connection: close\r\n\r\n")
    assert status == 200 and orjson.loads(body)["model"] == "ctr"
    payload = orjson.dumps({"instances": instances[:4]})
    status, body = raw(server.port, b"POST %s HTTP/1.1\r\nhost: x\r\n%scontent-type: application/json\r\ncontent-length: %d\r\n"
                                    b"connection: close\r\n\r\n%s" % (PREDICT.encode(), junk, len(payload), payload))
    assert status == 200 and len(orjson.loads(body)["scores"]) == 4
    status, body = raw(server.port, b"POST /v1/models/ctr:rollback HTTP/1.1\r\nhost: x\r\nauthorization: Bearer \xff\xfe\r\n"
                                    b"content-length: 0\r\nconnection: close\r\n\r\n")
    assert status == 401 and b"Bearer" in body
    status, _ = raw(server.port, b"GET /healthz?q=%ff%fe HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert status == 200


def test_requests_the_http_parser_refuses_get_the_json_400(server):
    """What the HTTP parser refuses before any route sees the request is answered like every
    other 4xx: the JSON error body, saying what was wrong."""
    head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" % PREDICT.encode()
    cases = [
        (head + b"content-length: 12abc\r\n\r\n{}", "Content-Length"),
        (head + b"content-length: 2\r\ncontent-length: 3\r\n\r\n{}", "Content-Length"),
        (head + b"content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", "Transfer-Encoding"),
        (b"\x16\x03\x01\x02\x00 not http at all\r\n\r\n", "method"),
        (b"GET /healthz HTTP/9.9\r\nhost: x\r\n\r\n", "version"),
    ]
    for data, says in cases:
        status, headers, body = raw_answer(server.port, data)
        assert status == 400 and headers["content-type"] == "application/json", (data[:80], status, headers, body)
        error = orjson.loads(body)["error"]
        assert error["code"] == 400 and error["message"].startswith("invalid HTTP request: ") and says in error["message"], error
    assert request(server.port, "GET", "/healthz")[0] == 200  # only those connections were closed


def test_instance_strings_and_ranges_past_their_bounds_get_a_400_naming_the_field(server, instances):
    """An instance's strings are bounded as predict by ids bounds its device (an 8 MB device
    fits in serving.max_body_bytes), its hour and position are ranges; checked by the serving
    process and by a front-end, which decodes instances itself."""
    cases = [
        ({"device": "d" * 8_000_000}, "invalid_value:device"),
        ({"event_id": "e" * 100_000}, "invalid_value:event_id"),
        ({"request_id": "r" * 100_000}, "invalid_value:request_id"),
        ({"local_hour": 24}, "invalid_value:local_hour"),
        ({"position": -1}, "invalid_value:position"),
    ]
    for change, reason in cases:
        body = orjson.dumps({"instances": [instances[0], {**instances[1], **change}]})
        status, _, answer = request(server.port, "POST", PREDICT, body)
        assert status == 400 and f"1 invalid instance(s): instance 1: {reason} " in answer["error"]["message"], (reason, status, answer)
    status, _, answer = request(server.port, "POST", PREDICT, orjson.dumps({"instances": [{**instances[0], "device": "d" * 256}]}))
    assert status == 200 and len(answer["scores"]) == 1, answer


def test_a_clients_own_deadline_is_kept_and_a_bad_one_is_refused(server, instances):
    """``x-request-timeout-ms`` reaches the model runtime's queue (through a front-end too): one of
    1 us has passed before any batch closes, so the request is dropped unrun."""
    payload = orjson.dumps({"instances": instances[:2]})
    status, headers, answer = request(server.port, "POST", PREDICT, payload, {"x-request-timeout-ms": "0.001"})
    assert status == 503 and "x-request-timeout-ms" in answer["error"]["message"] and headers["retry-after"] == "1", answer
    for bad in ("soon", "0", "-5", "inf"):
        status, _, answer = request(server.port, "POST", PREDICT, payload, {"x-request-timeout-ms": bad})
        assert status == 400 and "x-request-timeout-ms" in answer["error"]["message"], (bad, answer)
    status, _, answer = request(server.port, "POST", PREDICT, payload, {"x-request-timeout-ms": "5000"})
    assert status == 200 and len(answer["scores"]) == 2


def closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes ``sock`` (reading and dropping what it sends)."""
    t0 = time.monotonic()
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:  # still open after the socket's timeout
        return math.inf
    return time.monotonic() - t0


def test_stalled_connections_are_closed(server):
    payload = b'{"instances": []}'
    stalls = {
        "sends nothing": b"",
        "half a request head": b"POST " + PREDICT.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-len",
        "half a body": b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (PREDICT.encode(), len(payload) + 100, payload),
        "a request head a byte a second": b"GET /healthz HTTP/1.1\r\n",
    }
    socks = {}
    for name, data in stalls.items():
        socks[name] = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        socks[name].sendall(data)
    trickle = socks["a request head a byte a second"]

    def drip():  # each byte arrives well within the timeout; the whole head never does
        for byte in b"x-slow: " + b"a" * 60:
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                return
            time.sleep(0.5)

    threading.Thread(target=drip, daemon=True).start()
    waited = {name: closed_after(sock) for name, sock in socks.items()}
    for sock in socks.values():
        sock.close()
    assert all(w < READ_TIMEOUT_S + 8 for w in waited.values()), waited  # closed, not left open (the socket timeout is 30 s)


def test_an_idle_keep_alive_connection_is_closed_after_keep_alive_s(server):
    """Timed from the response: kept open until serving.keep_alive_s (1 s here), closed well
    before uvicorn's and this project's default (5 s)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        waited = closed_after(sock)
    assert KEEP_ALIVE_S - 0.1 <= waited < KEEP_ALIVE_S + 3, waited


def test_past_max_connections_a_request_gets_503_and_health_checks_answer(server, instances):
    payload = orjson.dumps({"instances": instances[:2]})
    busy = []
    for _ in range(MAX_CONNECTIONS):  # requests in progress: their bodies never finish (until the read timeout)
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (PREDICT.encode(), len(payload), payload[:10]))
        busy.append(sock)
    time.sleep(0.5)
    status, headers, answer = request(server.port, "POST", PREDICT, payload)
    assert status == 503 and "serving.max_connections" in answer["error"]["message"] and headers["retry-after"] == "1", answer
    assert request(server.port, "GET", "/healthz")[0] == 200
    assert request(server.port, "GET", "/readyz")[0] == 200
    for sock in busy:
        sock.close()
    deadline = time.monotonic() + 30
    while request(server.port, "POST", PREDICT, payload)[0] != 200:  # the server recovers once they are gone
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_flood_of_idle_connections_leaves_health_checks_answering(server):
    """More idle connections than the serving process may open files (ulimit -n 256): the
    idle ones are closed for new ones, so a health check is always accepted and answered."""
    flood = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(NOFILE + 300)]
    try:
        for path in ("/healthz", "/readyz"):
            status, _, answer = request(server.port, "GET", path)
            assert status == 200, answer
    finally:
        for sock in flood:
            sock.close()


@pytest.fixture(scope="module")
def overloaded(published_model, tmp_path_factory):
    """One worker, room in the queue for two requests of 256 instances, and 30 ms at most in it."""
    s = Server(published_model, tmp_path_factory.mktemp("overloaded"), {
        "STREAMREC_SERVING__ADMIN_TOKEN": "",  # admin routes off (test_admin_routes_are_off_without_a_token)
        "STREAMREC_SERVING__FEATURE_STORE": "false", "STREAMREC_SERVING__WORKERS": "1", "STREAMREC_SERVING__MAX_INSTANCES": "256",
        "STREAMREC_SERVING__MAX_BATCH": "256", "STREAMREC_SERVING__MAX_QUEUE_INSTANCES": "512",
        "STREAMREC_SERVING__QUEUE_TIMEOUT_MS": "30", "STREAMREC_SERVING__MAX_DELAY_US": "1000"})
    yield s
    output = s.stop()
    assert s.proc.returncode == 0 and "Traceback" not in output, output[-3000:]


def test_overload_is_shed_with_a_503_and_counted_and_a_dropped_request_never_runs(overloaded, instances):
    """16 clients at once against a queue with room for two requests: the rest are refused at
    once. Requests that waited past the deadline (how many depends on the machine's speed;
    tests/test_serving_batcher.py drops one deterministically) are answered 503 and never run."""
    payload = orjson.dumps({"instances": instances})
    answers = []
    start = threading.Barrier(16)

    def client():
        start.wait()
        for _ in range(3):
            answers.append(request(overloaded.port, "POST", PREDICT, payload))

    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [a for a in answers if a[0] == 200]
    full = [a for a in answers if a[0] == 429 and "serving.max_queue_instances" in a[2]["error"]["message"]]
    late = [a for a in answers if a[0] == 503 and "serving.queue_timeout_ms" in a[2]["error"]["message"]]
    assert len(ok) + len(full) + len(late) == len(answers) == 48, [a for a in answers if a not in ok + full + late]
    assert full and all(a[1]["retry-after"] == "1" for a in full + late)
    assert all(len(a[2]["scores"]) == 256 for a in ok)
    batching = call(overloaded.base, "GET", "/v1/models/ctr")[1]["batching"]
    assert batching["shed"] == {"queue_full": len(full), "deadline": len(late)}
    assert batching["rows"] == 256 * len(ok)  # no refused or dropped request ran
    with urllib.request.urlopen(overloaded.base + "/metrics", timeout=30) as response:
        metrics = response.read().decode()
    assert f'streamrec_serving_shed_requests_total{{model="ctr",reason="queue_full"}} {float(len(full))}' in metrics
    assert f'streamrec_serving_shed_requests_total{{model="ctr",reason="deadline"}} {float(len(late))}' in metrics
    assert request(overloaded.port, "POST", PREDICT, payload)[0] == 200  # once the burst is over, requests are served


def test_admin_routes_are_off_without_a_token(overloaded):
    """No serving.admin_token configured: every admin call is a 403 that says how to turn them
    on, whatever Authorization it carries, and nothing changes."""
    before = call(overloaded.base, "GET", "/v1/models/ctr")[1]
    for route in (":reload", ":rollback"):
        for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer anything"}):
            status, _, answer = request(overloaded.port, "POST", f"/v1/models/ctr{route}", b"{}", headers)
            assert status == 403 and "serving.admin_token" in answer["error"]["message"], (route, headers, answer)
    after = call(overloaded.base, "GET", "/v1/models/ctr")[1]
    assert after["model_version"] == before["model_version"] and not after["pinned"]

