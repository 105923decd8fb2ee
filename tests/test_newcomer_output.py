"""What a newcomer sees: progress on long commands in words (not JSON), quiet Kafka clients,
a serving node that says where it listens and when it stops, and a `bench` that explains
itself."""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import orjson
import pyarrow.parquet as pq
import pytest

from streamrec.cli.bench import PARTS
from streamrec.contracts.sample_wire import encode_samples
from streamrec.plumbing.bus.topics import ensure_topics
from tests.conftest import REPO, CheckedProducer, free_port, read_topic, run_cli, wait_ready

# a line logged by kafka-python (the CLI's format: "<time> <LEVEL> <logger>: <message>")
KAFKA_LOG_LINE = re.compile(r"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) kafka[.:]", re.MULTILINE)


def _kafka_lines(stderr: str) -> list[str]:
    return [m.group(0) for m in KAFKA_LOG_LINE.finditer(stderr)]


# ---------------------------------------------------------------------- bench
def test_bench_help_describes_every_part_and_points_at_part_help():
    result = run_cli("bench", "--help")
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip() and line.split()[0] in PARTS}
    assert set(listed) == set(PARTS), result.stdout
    assert all(len(line.split()) > 3 for line in listed.values()), result.stdout  # a description beside each name
    assert "streamrec bench PART --help" in result.stdout
    assert "var/bench" in result.stdout


def test_bench_part_help_is_the_benchmarks_own_with_documented_flags():
    result = run_cli("bench", "trainer", "--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("usage: streamrec bench trainer"), out[:200]
    assert "python bench/" not in out and "bench/out" not in out
    for flag in ("--batch", "--steps", "--device"):
        assert re.search(rf"^  {flag} [A-Z]+ +\w", out, re.MULTILINE), (flag, out)  # a help text beside the flag
    assert "var/bench" in out


# ---------------------------------------------------------------------- generate
def test_generate_off_a_terminal_says_what_it_does_in_words(tmp_path):
    result = run_cli("generate", "--out", str(tmp_path / "run"), "--duration", "3", "--rate", "2000", "--seed", "3")
    assert result.returncode == 0, result.stderr
    first = result.stderr.splitlines()[0]
    assert "3 s of traffic at 2,000 events/s" in first and "about 6,000 events" in first, result.stderr


def test_generate_progress_lines_are_text_with_how_far_it_got(tmp_path, caplog, monkeypatch):
    from streamrec.cli import generate
    from streamrec.generator.sinks import FileSink
    from streamrec.generator.traffic import Traffic, TrafficConfig
    from streamrec.plumbing.config import load_config

    monkeypatch.setattr(generate, "PROGRESS_EVERY_S", 0.0)
    cfg = load_config(environ={})
    traffic = Traffic(TrafficConfig(seed=3, rate=2000, bad_fraction=0.0, max_disorder_ms=0, world=cfg.generator.world),
                      1_700_000_000_000)
    with caplog.at_level(logging.INFO, logger="streamrec"):
        generate.run_with_progress(traffic, FileSink(str(tmp_path / "run"), "jsonl"), 4, False, "generate -> files")
    lines = [r.getMessage() for r in caplog.records if r.name == "streamrec"]
    assert len(lines) >= 4, lines
    for line in lines:
        assert not line.lstrip().startswith("{"), line
    assert re.search(r"2 of 4 s \(50%\), [\d,]+ events", "\n".join(lines)), lines


# ---------------------------------------------------------------------- train
def test_trainer_progress_off_a_terminal_is_a_line_of_text(tmp_path, caplog):
    from streamrec.trainer.progress import ProgressReporter

    reporter = ProgressReporter(0.0, tmp_path / "eval.jsonl", stream=io.StringIO())
    status = {"samples": 12_345, "loss": 0.125, "auc_online": 0.75, "lag": 10, "version": 3, "tiers": {}}
    with caplog.at_level(logging.INFO, logger="streamrec.trainer"):
        reporter.report(status)
    reporter.close()
    [message] = [r.getMessage() for r in caplog.records]
    assert not message.startswith("{") and "12,345 samples" in message and "AUC online 0.7500" in message, message
    assert orjson.loads((tmp_path / "eval.jsonl").read_text())["samples"] == 12_345  # the file keeps the JSON rows


def _samples_topic(broker: str, sample_run, n: int) -> str:
    topic = f"nc.samples.{uuid.uuid4().hex[:6]}"
    ensure_topics(broker, [topic], partitions=2)
    table = pq.read_table(sample_run / "samples.parquet").slice(0, n)
    producer = CheckedProducer(broker)
    for user, value in zip(table["user_id"].to_pylist(), encode_samples(table)):
        producer.send(topic, key=str(user).encode(), value=value)
    producer.close()
    return topic


def test_train_from_the_topic_prints_no_kafka_client_lines(broker, sample_run, tmp_path):
    topic = _samples_topic(broker, sample_run, 3000)
    updates = f"nc.updates.{uuid.uuid4().hex[:6]}"
    result = run_cli("train", "--bootstrap", broker, "--model-store", str(tmp_path / "models"), "--work-dir", str(tmp_path / "work"),
                     "--device", "cpu", "--no-frozen", "--batch-size", "512", "--idle-exit", "8",
                     env={"STREAMREC_TOPICS__SAMPLES": topic, "STREAMREC_TOPICS__MODEL_UPDATES": updates,
                          "STREAMREC_TRAINER__GROUP": f"g-{topic}"})
    assert result.returncode == 0, result.stderr
    assert "trained 3,000 samples" in result.stdout, result.stdout
    assert _kafka_lines(result.stderr) == [], result.stderr


def test_train_from_files_announces_with_announce_and_says_so_without(broker, sample_run, tmp_path):
    updates = f"nc.updates.{uuid.uuid4().hex[:6]}"
    ensure_topics(broker, [updates], partitions=1)
    common = ("train", "--samples", str(sample_run), "--max-samples", "2000", "--batch-size", "512", "--device", "cpu",
              "--no-frozen", "--bootstrap", broker)
    env = {"STREAMREC_TOPICS__MODEL_UPDATES": updates}
    quiet = run_cli(*common, "--model-store", str(tmp_path / "a" / "models"), "--work-dir", str(tmp_path / "a" / "work"), env=env)
    assert quiet.returncode == 0, quiet.stderr
    assert "not announced" in quiet.stderr and "--announce" in quiet.stderr, quiet.stderr
    assert read_topic(broker, updates, committed=False) == []
    loud = run_cli(*common, "--announce", "--model-store", str(tmp_path / "b" / "models"), "--work-dir", str(tmp_path / "b" / "work"),
                   env=env)
    assert loud.returncode == 0, loud.stderr
    assert [orjson.loads(r.value)["model"] for r in read_topic(broker, updates, committed=False)][:1] == ["ctr"]
    assert _kafka_lines(loud.stderr) == [], loud.stderr


def test_max_samples_help_says_whole_batches():
    result = run_cli("train", "--help")
    assert result.returncode == 0, result.stderr
    assert "whole batch" in " ".join(result.stdout.split()) and "61,440" in result.stdout


# ---------------------------------------------------------------------- serve
def _predict(base: str, body: dict) -> int:
    request = urllib.request.Request(base + "/v1/models/ctr:predict", data=orjson.dumps(body),
                                     headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status


def test_serve_says_where_it_listens_and_when_it_stops_and_logs_predictions_quietly(broker, published_model, sample_run,
                                                                                     tmp_path):
    port, base = free_port(), ""
    predictions = f"nc.predictions.{uuid.uuid4().hex[:6]}"
    ensure_topics(broker, [predictions], partitions=1)
    node = subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(published_model[0]), "--port", str(port),
         "--device", "cpu", "--compile", "eager"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "STREAMREC_KAFKA__BOOTSTRAP": broker, "STREAMREC_SERVING__PREDICTION_LOG": "true",
             "STREAMREC_TOPICS__PREDICTIONS": predictions, "STREAMREC_SERVING__FOLLOW_UPDATES": "false",
             "STREAMREC_SERVING__FEATURE_STORE": "false"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(node.stdout), daemon=True)
    reader.start()
    rows = pq.read_table(sample_run / "samples.parquet").slice(0, 2).drop(["label", "click_ts"]).to_pylist()
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, node)
        assert [_predict(base, {"instances": rows}) for _ in range(3)] == [200] * 3
        deadline = time.monotonic() + 60  # logged with acks=all: in the topic
        while len(read_topic(broker, predictions, committed=False)) < 3:
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=60) == 0, "".join(lines)
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    reader.join(timeout=10)
    out = "".join(lines)
    assert re.search(rf"serving ctr on {base} \(predict: POST /v1/models/ctr:predict", out), out
    assert re.search(r"stopped after \d+ s: 3 predict requests answered", out.split(base, 1)[1]), out
    assert "Idempotence will be disabled" not in out and "acks" not in out, out
    assert _kafka_lines(out) == [], out


# ---------------------------------------------------------------------- docs
@pytest.mark.parametrize("doc, words", [
    ("docs/kafka.md", ["`streamrec.predictions`"]),
    ("docs/trainer.md", ["--announce", "whole batch"]),
])
def test_docs_name_what_the_commands_do(doc, words):
    text = " ".join((REPO / doc).read_text().split())
    for word in words:
        assert word in text, (doc, word)
