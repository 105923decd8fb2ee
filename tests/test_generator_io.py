"""The generator's outputs for real: `streamrec generate` into the broker and into files."""

import json
import os
import subprocess
import sys
import time

import orjson
import pyarrow.parquet as pq
import pytest

from streamrec.contracts import events as ev
from streamrec.generator.sinks import FileSink, decode_truth_message
from streamrec.generator.traffic import Traffic, TrafficConfig
from streamrec.generator.runner import generate
from streamrec.plumbing.bus.topics import describe_topics
from tests.conftest import REPO, read_topic, run_cli


@pytest.mark.slow
def test_generate_to_kafka_is_paced_and_complete(broker, tmp_path):
    events_topic, truth_topic = "gen.events", "gen.truth"
    env = {"STREAMREC_TOPICS__EVENTS": events_topic, "STREAMREC_TOPICS__TRUTH": truth_topic}
    result = run_cli("--bootstrap", broker, "generate", "--duration", "4", "--rate", "1500",
                     "--bad-fraction", "0.02", "--seed", "3", "--json", env=env)
    assert result.returncode == 0, result.stderr
    done_ms = time.time() * 1000
    summary = json.loads(result.stdout)
    # Paced to wall-clock time, not as fast as possible: the last events were sent no earlier
    # than their event time. (Not summary["wall_s"]: a slow start-up is caught up at once.)
    assert done_ms >= summary["start_ms"] + 3500
    assert 4 * 1500 * 0.8 < summary["events"] < 4 * 1500 * 1.2

    records = read_topic(broker, events_topic)
    assert len(records) == summary["events"]
    valid = []
    for r in records:
        try:
            valid.append(ev.validate_event(r.value))
        except ev.InvalidEvent:
            pass
    impressions = [e for e in valid if e["type"] == "impression"]
    assert len(impressions) == summary["impressions"]
    ts = sorted(e["ts"] for e in impressions)
    assert 3000 <= ts[-1] - ts[0] <= 4000  # event time spans the run
    assert sum(summary["bad_events"].values()) >= len(records) - len(valid)

    rows = [row for r in read_topic(broker, truth_topic) for row in decode_truth_message(r.value)]
    truth = [r for r in rows if r["kind"] == "impression"]
    assert sorted(r["event_id"] for r in truth) == sorted(e["event_id"] for e in impressions)
    assert sum(r["kind"] == "bad" for r in rows) == sum(summary["bad_events"].values())
    (end,) = [r for r in rows if r["kind"] == "end"]
    assert end["counts"]["impressions"] == summary["impressions"] and end["end_ms"] == summary["end_ms"]
    # Emitted clicks are exactly the truth's clicks that happened before the stream ended.
    clicks = {(e["request_id"], e["item_id"]) for e in valid if e["type"] == "click" and "orphan" not in e["request_id"]}
    expected = {(r["request_id"], r["item_id"]) for r in truth if r["clicked"] and r["click_ts"] < end["end_ms"]}
    assert clicks == expected


@pytest.mark.slow
def test_sigterm_ends_a_live_run_early_and_complete(broker):
    """A live run told to stop (SIGTERM; Ctrl-C alike) ends after its current tick as a shorter
    run: exit 0, every event it counted is in the topic, the truth's end record names the
    shorter duration, and the summary says it stopped early."""
    events_topic, truth_topic = "gen-stop.events", "gen-stop.truth"
    env = {**os.environ, "STREAMREC_KAFKA__BOOTSTRAP": broker, "STREAMREC_TOPICS__EVENTS": events_topic,
           "STREAMREC_TOPICS__TRUTH": truth_topic}
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "generate", "--duration", "600", "--rate", "500",
                             "--json"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while sum(t.messages for t in describe_topics(broker, [events_topic])) < 1000:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "no events"
            time.sleep(0.2)
        stopped_at = time.monotonic()
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert time.monotonic() - stopped_at < 15  # a tick and the last acknowledgements, not the 600 s
    summary = json.loads(out)
    assert summary["stopped_early"] and summary["failed"] == 0 and summary["delivered"] == summary["events"]
    assert len({orjson.loads(r.value)["event_id"] for r in read_topic(broker, events_topic)}) == summary["events"]
    (end,) = [row for r in read_topic(broker, truth_topic) for row in decode_truth_message(r.value) if row["kind"] == "end"]
    assert end["end_ms"] == summary["end_ms"] and end["duration_s"] == (summary["end_ms"] - summary["start_ms"]) / 1000 < 600


@pytest.mark.slow
def test_atomic_generate_is_one_transaction(broker):
    """read_committed readers (the pipeline job) see nothing of an --atomic run until it ends, then all of it."""
    topic = "gen.atomic"
    env = {"STREAMREC_TOPICS__EVENTS": topic, "STREAMREC_KAFKA__BOOTSTRAP": broker}
    # 12 s of paced traffic: room for a slow interpreter start on a loaded CI box and for the
    # reads below, which must both happen while the transaction is still open.
    run = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "generate", "--atomic", "--no-truth", "--duration", "12",
                            "--rate", "500", "--json"], cwd=REPO, env={**os.environ, **env},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def visible(committed: bool) -> int:
        return len(read_topic(broker, topic, committed=committed))

    # Wait for the run's first (uncommitted) records instead of guessing its start-up time.
    deadline = time.monotonic() + 60
    while (uncommitted := visible(committed=False)) == 0:
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline, "the generator wrote nothing in 60 s"
        time.sleep(0.2)
    committed = visible(committed=True)
    assert run.poll() is None, "the run ended before its open transaction could be checked"
    assert uncommitted > 0 and committed == 0
    out, err = run.communicate(timeout=60)
    assert run.returncode == 0, err
    assert visible(committed=True) == json.loads(out)["events"] > 3000
    bad = run_cli("generate", "--atomic", "--out", "x", "--duration", "1")
    assert bad.returncode != 0 and "--atomic" in bad.stderr and "--out" in bad.stderr


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_generate_to_files(tmp_path, fmt):
    out = tmp_path / "run"
    result = run_cli("generate", "--out", str(out), "--format", fmt, "--duration", "10", "--rate", "5000",
                     "--bad-fraction", "0.01", "--start-ms", "1700000000000", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["events"] == summary["events"] and manifest["seed"] == 7
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", "bad_events.jsonl", f"events.{fmt}", f"truth.{fmt}"])
    if fmt == "parquet":
        events = pq.read_table(out / "events.parquet").column("value").to_pylist()
        truth = pq.read_table(out / "truth.parquet").to_pylist()
    else:
        events = (out / "events.jsonl").read_bytes().splitlines()
        truth = [orjson.loads(line) for line in (out / "truth.jsonl").read_bytes().splitlines()]
    assert len(events) == summary["events"] and len(truth) == summary["impressions"]
    bad = [orjson.loads(line) for line in (out / "bad_events.jsonl").read_bytes().splitlines()]
    assert len(bad) == sum(summary["bad_events"].values())
    assert {b["raw"].encode() for b in bad} <= set(events)


def test_same_seed_gives_identical_files(tmp_path):
    args = ["generate", "--format", "parquet", "--duration", "3", "--rate", "3000", "--start-ms", "1700000000000"]
    for name in ("a", "b"):
        assert run_cli(*args, "--out", str(tmp_path / name)).returncode == 0
    for f in ("events.parquet", "truth.parquet"):
        assert pq.read_table(tmp_path / "a" / f).equals(pq.read_table(tmp_path / "b" / f))


def test_existing_output_is_never_overwritten(tmp_path):
    (tmp_path / "run").mkdir()
    result = run_cli("generate", "--out", str(tmp_path / "run"), "--duration", "1")
    assert result.returncode == 2 and "already exists" in result.stderr


def test_failed_run_leaves_nothing_visible(tmp_path, world_config):
    """A run that dies half-way must not leave a directory a reader could mistake for complete."""

    class Exploding(Traffic):
        def next_tick(self, final=False):
            if self.now_ms - self.start_ms >= 2000:
                raise RuntimeError("simulated crash")
            return super().next_tick(final)

    traffic = Exploding(TrafficConfig(1, 2000, 0.0, 100, world_config), 1_700_000_000_000)
    with pytest.raises(RuntimeError, match="simulated crash"):
        generate(traffic, FileSink(tmp_path / "run", "parquet"), 5, pace=False)
    assert list(tmp_path.iterdir()) == []
