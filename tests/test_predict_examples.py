"""The predict examples of README.md and docs/serving.md, run as a newcomer pastes them
against a live `streamrec serve` node, so they cannot go stale.

Every ```sh block right after a ``<!-- predict-example -->`` line is run by bash as written
(heredoc, ``$(date +%s%3N)`` and all), only its ``localhost:8500`` pointed at the test's node.
Its ``curl`` is the real one where installed, and a urllib stand-in (:func:`send_like_curl`)
either way, so the examples hold on a machine without curl too. The node serves the published
test model and online features fed from a small topic of the session's broker (predict by ids
needs them, and the Flink job that writes them in production would cost minutes): a history and
impressions for the examples' user, so by ids is seen to answer from the store, not cold-start.

Run as a script, this file is the stand-in: ``python tests/test_predict_examples.py CURL_ARGS``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/serving.md")
MARK = "<!-- predict-example -->"
DOC_ADDRESS = "localhost:8500"
USER = 1001  # the examples' user: the node's features topic holds a history for it
HISTORY = [(2003, 32), (2002, 31)]  # (item, category) clicked, most recent first
IMPRESSIONS = 3  # of USER in the last ten minutes


def send_like_curl(argv: list[str]) -> None:
    """The curl options the examples use (-s, -H, -d/--data[-binary] with @- or @file, -X),
    sent with urllib; prints the body, a newline and the status, as ``curl -w '\\n%{http_code}'``.
    Any other option is refused, so an example cannot come to need real curl unnoticed."""
    url, method, data, headers = None, None, None, {}
    args = iter(argv)
    for arg in args:
        if arg in ("-s", "--silent"):
            continue
        if arg in ("-H", "--header"):
            name, _, value = next(args).partition(":")
            headers[name.strip()] = value.strip()
        elif arg in ("-d", "--data", "--data-binary"):
            data = _curl_data(next(args), strip=arg != "--data-binary")
        elif arg in ("-X", "--request"):
            method = next(args)
        elif arg.startswith("-"):
            sys.exit(f"the urllib stand-in for curl does not know option {arg}")
        else:
            url = arg if "://" in arg else f"http://{arg}"
    request = urllib.request.Request(url, data=data, headers=headers, method=method or ("POST" if data is not None else "GET"))
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    sys.stdout.write(f"{body.decode()}\n{status}")


def _curl_data(value: str, strip: bool) -> bytes:
    """What curl sends for ``-d value``: ``@-`` stdin, ``@path`` a file, each without its
    line breaks (curl strips them for ``-d``, not for ``--data-binary``)."""
    if not value.startswith("@"):
        return value.encode()
    data = sys.stdin.buffer.read() if value == "@-" else Path(value[1:]).read_bytes()
    return data.replace(b"\r", b"").replace(b"\n", b"") if strip else data


def examples(doc: str) -> list[str]:
    """The shell block after each MARK line of a markdown file of the repository."""
    return re.findall(re.escape(MARK) + r"\n```sh\n(.*?)\n```", (REPO / doc).read_text(), re.S)


def bash(script: str) -> str:
    """``script``'s stdout, run by bash as a pasted block runs; fails the test on a nonzero exit."""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, (script, done.stdout, done.stderr)
    return done.stdout


def body_of(example: str) -> dict:
    """The JSON body the example sends, its shell expansions done (curl replaced by ``cat``)."""
    return json.loads(bash("curl() { cat; }\n" + example))


CURLS = {  # the `curl` an example's block calls, printing the body, a newline and the status
    "curl": "curl() { command curl -w '\\n%{http_code}' \"$@\"; }\n",
    "urllib": f"curl() {{ {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} \"$@\"; }}\n",
}


def run_example(example: str, port: int, curl: str) -> tuple[int, dict]:
    """(status, answer) of the example sent to the node at ``port``."""
    assert DOC_ADDRESS in example, example
    out = bash(CURLS[curl] + example.replace(DOC_ADDRESS, f"127.0.0.1:{port}"))
    body, _, status = out.rpartition("\n")
    return int(status), json.loads(body)


def test_both_docs_show_both_forms_of_predict():
    """Each doc has an instances example and a by-ids one asking for its features."""
    for doc in DOCS:
        bodies = [body_of(example) for example in examples(doc)]
        assert [("instances" in b, b.get("return_features")) for b in bodies] == [(False, True), (True, None)], (doc, bodies)


def _feature_records(now_ms: int) -> list[tuple[bytes, bytes]]:
    """(key, value) records of the features topic (docs/features.md) for USER: a history and
    impressions, and every stage's watermark just before now, so ``features_as_of`` is set."""
    bucket = now_ms // 10_000 * 10_000 - 10_000
    history = [[item, category, now_ms - 20_000 - 5_000 * k] for k, (item, category) in enumerate(HISTORY)]
    records = [(f"h/user/{USER}", {"h": history}), (f"c/user/{USER}/{bucket}", {"i": list(range(IMPRESSIONS)), "c": []})]
    records += [(f"w/{stage}/0/0", {"wm": now_ms - 1_000, "n": 1}) for stage in ("user", "item", "category")]
    return [(key.encode(), json.dumps(value).encode()) for key, value in records]


@pytest.fixture(scope="module")
def node(broker, published_model, tmp_path_factory):
    """(port, served version): `streamrec serve` on CPU over a copy of the published store,
    its online features read from a one-partition topic holding :func:`_feature_records`."""
    from conftest import CheckedProducer, copy_store, free_port, wait_ready  # here: the curl stand-in needs neither
    from streamrec.plumbing.bus.topics import ensure_topics

    root, versions = published_model
    tmp = tmp_path_factory.mktemp("predict-examples")
    topic = f"examples-{uuid.uuid4().hex[:8]}.features"
    ensure_topics(broker, [topic], 1)
    producer = CheckedProducer(broker)
    for key, value in _feature_records(int(time.time() * 1000)):
        producer.send(topic, key=key, value=value)
    producer.close()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(copy_store(root, tmp / "models")),
         "--port", str(port), "--device", "cpu", "--compile", "eager"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "STREAMREC_KAFKA__BOOTSTRAP": broker, "STREAMREC_TOPICS__FEATURES": topic,
             "STREAMREC_SERVING__FOLLOW_UPDATES": "false", "STREAMREC_SERVING__FEATURE_STORE_DIR": str(tmp / "features")})
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        yield port, versions[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("curl", ["curl", "urllib"])
@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_predict_examples_run_against_a_live_node(node, doc, curl):
    if curl == "curl" and shutil.which("curl") is None:
        pytest.skip("curl is not installed: the urllib case runs the examples")
    port, version = node
    for example in examples(doc):
        sent = body_of(example)
        status, answer = run_example(example, port, curl)
        assert status == 200, (doc, answer)
        if "instances" in sent:
            assert set(answer) == {"model_version", "scores"} and answer["model_version"] == version, answer
            _assert_scores(answer["scores"], len(sent["instances"]))
        else:
            _assert_by_ids(sent, answer, version)
            assert _scores_of_instances(port, answer["features"]) == pytest.approx(answer["scores"], abs=1e-6)


def _scores_of_instances(port: int, instances: list[dict]) -> list[float]:
    """The instances form's scores: by ids' returned features are instances as they stand."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models/ctr:predict", method="POST",
                                     data=json.dumps({"instances": instances}).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["scores"]


def _assert_scores(scores: list, n: int) -> None:
    assert len(scores) == n and all(0.0 < s < 1.0 for s in scores), scores


def _assert_by_ids(sent: dict, answer: dict, version: int) -> None:
    """One score and one feature row per candidate; the user's features from the node's store."""
    assert sent["user_id"] == USER and answer["model_version"] == version, answer
    assert 0 <= answer["ts"] - sent["ts"] < 60_000, (answer, sent)  # the request's own $(date): a moment after ``sent``'s
    assert isinstance(answer["features_as_of"], int), answer
    candidates, features = sent["candidates"], answer["features"]
    _assert_scores(answer["scores"], len(candidates))
    assert [(f["item_id"], f["position"]) for f in features] == [(c["item_id"], c["position"]) for c in candidates]
    user = features[0]
    assert list(zip(user["hist_item_ids"], user["hist_category_ids"])) == HISTORY, user
    assert user["user_imps_600s"] == IMPRESSIONS and user["device"] == sent["context"]["device"], user


if __name__ == "__main__":
    send_like_curl(sys.argv[1:])
