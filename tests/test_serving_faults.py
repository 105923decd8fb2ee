"""Faults an operator found in a live fleet (issue 55), over real HTTP against two real nodes on
one model store: node A serves `--model ctr` out of a configuration listing ctr and ctr2 and
answers HTTP itself; node B serves both through a front-end process.

- a corrupt or deeply nested record under `_experiments/` is reported by every node
  (`ignored`, one log line, no traceback) while both serve the experiment a PUT just added;
- a caller cannot step around its quota and low priority by sending no key or an unknown one;
- a path with a trailing slash is a 404 on the serving process and through a front-end, never
  a redirect to the serving process's private port, and a relayed answer has one `date` and `server`;
- the `Authorization` scheme is case-insensitive;
- `serve --model ctr` serves ctr alone, and a model the configuration lacks fails at once.
"""

import http.client
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import orjson
import pyarrow.parquet as pq
import pytest

from conftest import REPO, copy_store, free_port, run_cli, wait_ready
from streamrec.plumbing.config import ConfigError, load_config
from test_serving_http import TOKEN

pytestmark = pytest.mark.slow

CONFIG = """
[[serving.models]]
name = "ctr"
[[serving.models]]
name = "ctr2"

[[serving.callers]]
name = "batchjob"
key = "batch-key"
rate_per_s = 2
priority = "low"

[[serving.callers]]
name = "tester"
key = "tester-key"
rate_per_s = 0
"""
TESTER = {"x-api-key": "tester-key"}


class Node:
    """A `streamrec serve` process, its base URL and everything it printed."""

    def __init__(self, config, root, *args: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamrec.cli", "serve", "--config", str(config), "--model-store", str(root),
             "--port", str(self.port), "--device", "cpu", "--compile", "eager", *args],
            cwd=REPO, env={**os.environ, "STREAMREC_SERVING__ADMIN_TOKEN": TOKEN, "STREAMREC_SERVING__FOLLOW_UPDATES": "false",
                           "STREAMREC_SERVING__FEATURE_STORE": "false", "STREAMREC_SERVING__POLL_INTERVAL_S": "0.2"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        self.reader = threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def wait_ready(self, timeout_s: float = 180) -> None:
        wait_ready(self.base, self.proc, timeout_s, output=lambda: "".join(self.output)[-3000:])

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.reader.join(timeout=10)
        return "".join(self.output)


def request(base: str, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, list, dict]:
    """(status, headers as a list of (lower-case name, value), JSON body) over a fresh connection."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body or None, headers={"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = response.read()
        return response.status, [(k.lower(), v) for k, v in response.getheaders()], orjson.loads(data) if data else None
    finally:
        conn.close()


def wait_for(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet(published_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    root = copy_store(published_model[0], tmp / "models")
    shutil.copytree(root / "ctr", root / "ctr2")
    config = tmp / "streamrec.toml"
    config.write_text(CONFIG)
    a = Node(config, root, "--model", "ctr")
    b = Node(config, root, "--frontends", "1")
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b, root, config
    finally:
        outputs = [node.stop() for node in (a, b)]
    for node, output in zip((a, b), outputs):
        assert node.proc.returncode == 0, output[-3000:]
        assert "Traceback" not in output, output[-5000:]


@pytest.fixture(scope="module")
def row(sample_run) -> dict:
    return pq.read_table(sample_run / "samples.parquet").slice(0, 1).drop(["label", "click_ts"]).to_pylist()[0]


def test_a_corrupt_experiment_record_is_reported_and_every_node_serves_the_others(fleet, row):
    a, b, root, _ = fleet
    folder = root / "_experiments"
    folder.mkdir(exist_ok=True)
    (folder / "nul.json").write_bytes(b"garbage{{")
    (folder / "deep.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)
    experiment = orjson.dumps({"variants": [{"name": "all", "model": "ctr", "share": 1.0}]})
    status, _, answer = request(a.base, "PUT", "/v1/experiments/newone", experiment, {"authorization": f"Bearer {TOKEN}"})
    assert status == 200, answer
    # a PUT that succeeded is served by every node: B reads it from the store within its poll
    wait_for(lambda: request(b.base, "GET", "/v1/experiments/newone")[0] == 200, "node B never served the experiment A took")
    for node in (a, b):
        status, _, answer = request(node.base, "POST", "/v1/experiments/newone:predict", orjson.dumps({"instances": [row]}), TESTER)
        assert status == 200 and answer["experiment"] == "newone", answer
        ignored = request(node.base, "GET", "/v1/experiments")[2]["ignored"]
        assert "nul.json is not valid JSON" in ignored.get("nul", ""), ignored
        assert "deep.json is JSON nested too deeply" in ignored.get("deep", ""), ignored
        wait_for(lambda: any("'deep'" in line and "not served" in line for line in node.output), "no log line names deep.json")
    # fixing a record through the API: DELETE replaces it with a tombstone, and nothing is left to report
    for name in ("nul", "deep", "newone"):
        assert request(a.base, "DELETE", f"/v1/experiments/{name}", headers={"authorization": f"Bearer {TOKEN}"})[0] == 200
    wait_for(lambda: request(b.base, "GET", "/v1/experiments")[2]["ignored"] == {}, "node B still reports the deleted records")


def test_a_caller_cannot_step_around_its_quota_by_sending_no_key_or_an_unknown_one(fleet, row):
    a, b, _, _ = fleet
    body = orjson.dumps({"instances": [row]})
    for node in (a, b):
        statuses: list[int] = []
        while 429 not in statuses and len(statuses) < 20:  # 2/s, burst 2: the third of a quick run is refused
            statuses.append(request(node.base, "POST", "/v1/models/ctr:predict", body, {"x-api-key": "batch-key"})[0])
        assert statuses[:2] == [200, 200] and statuses[-1] == 429, statuses
        status, _, answer = request(node.base, "POST", "/v1/models/ctr:predict", body)
        assert status == 401 and "no API key" in answer["error"]["message"], answer
        status, _, answer = request(node.base, "POST", "/v1/models/ctr:predict", body, {"x-api-key": "nonexistent"})
        assert status == 401 and "unknown API key" in answer["error"]["message"] and "nonexistent" not in answer["error"]["message"]
        assert request(node.base, "POST", "/v1/models/ctr:predict", body, TESTER)[0] == 200
        metrics = urllib.request.urlopen(node.base + "/metrics", timeout=30).read().decode()
        assert 'streamrec_serving_caller_requests_total{caller="anonymous",outcome="refused"} 2.0' in metrics
    assert request(a.base, "POST", "/v1/models/ctr:predict", body, {**TESTER, "x-priority": "urgent"})[0] == 400


def test_a_trailing_slash_is_a_404_everywhere_and_relayed_answers_carry_one_date_and_server(fleet):
    a, b, _, _ = fleet
    for node in (a, b):
        for method, path in (("POST", "/v1/models/ctr:rollback/"), ("GET", "/v1/models/"), ("GET", "/v1/models/ctr/")):
            status, headers, answer = request(node.base, method, path, b"{}" if method == "POST" else b"",
                                              {"authorization": f"Bearer {TOKEN}"})
            assert status == 404 and answer["error"]["code"] == 404, (node.base, path, status, answer)
            assert not [v for k, v in headers if k == "location"], headers
        status, headers, _ = request(node.base, "GET", "/v1/models/ctr")
        names = [k for k, _ in headers]
        assert status == 200 and names.count("date") == 1 and names.count("server") == 1, headers


def test_the_authorization_scheme_is_case_insensitive(fleet):
    a, b, _, _ = fleet
    for node in (a, b):
        for scheme in ("bearer", "BEARER", "Bearer"):
            status, _, answer = request(node.base, "POST", "/v1/models/ctr:reload", b"{}", {"authorization": f"{scheme} {TOKEN}"})
            assert status == 200, (scheme, answer)
        for value in ("bearer wrong", f"Basic {TOKEN}", "bearer", TOKEN):
            assert request(node.base, "POST", "/v1/models/ctr:reload", b"{}", {"authorization": value})[0] == 401, value


def test_serve_model_serves_that_model_alone_and_refuses_one_not_configured(fleet, tmp_path):
    a, b, root, config = fleet
    assert [m["model"] for m in request(a.base, "GET", "/v1/models")[2]["models"]] == ["ctr"]
    assert [m["model"] for m in request(b.base, "GET", "/v1/models")[2]["models"]] == ["ctr", "ctr2"]
    done = run_cli("serve", "--config", str(config), "--model-store", str(root), "--port", str(free_port()), "--device", "cpu",
                   "--model", "nope", timeout=120)
    assert done.returncode == 2 and "--model nope: not among serving.models ['ctr', 'ctr2']" in done.stderr, done.stderr[-2000:]
    with_experiment = tmp_path / "streamrec.toml"
    with_experiment.write_text(CONFIG + '\n[[serving.experiments]]\nname = "ab"\nvariants = [{name = "a", model = "ctr", share = 0.5}, '
                               '{name = "b", model = "ctr2", share = 0.5}]\n')
    from streamrec.cli.serve import only_model  # here: the other tests of this file must not need it

    with pytest.raises(ConfigError, match=r"serving.experiments \{'ab': \['ctr2'\]\} need other models"):
        only_model(load_config(with_experiment, environ={}), "ctr")
