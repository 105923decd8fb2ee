"""The trainer on the real broker: kill -9 mid-training and mid-publish, resume, nothing lost."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
from kafka import TopicPartition

import pause_points
from conftest import REPO, CheckedProducer
from streamrec.contracts.sample_wire import encode_samples
from streamrec.modelstore.store import ModelStore
from streamrec.plumbing.bus.clients import make_consumer
from streamrec.plumbing.bus.topics import ensure_topics

pytestmark = pytest.mark.slow
N_SAMPLES = 80_000


def _train(broker, tmp_path, env, *extra, arm_file=None):
    """``streamrec train``; with ``arm_file``, with the pause points of tests/pause_points.py installed."""
    args = ["train", "--bootstrap", broker, "--model-store", str(tmp_path / "models"),
            "--work-dir", str(tmp_path / "work"), "--batch-size", "512", "--publish-interval", "0.3",
            "--checkpoint-interval", "1", "--no-frozen", *extra]
    argv, env = ((pause_points.streamrec_argv(*args), pause_points.child_env(arm_file, env)) if arm_file
                 else ([sys.executable, "-m", "streamrec.cli", *args], {**os.environ, **env}))
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _state(tmp_path):
    latest = tmp_path / "work" / "ctr" / "checkpoints" / "LATEST"
    if not latest.is_file():
        return None
    return json.loads((latest.parent / latest.read_text().strip() / "state.json").read_text())


def test_kill9_then_resume_trains_every_sample_exactly_once(broker, sample_run, tmp_path):
    topic, updates = f"t.samples.{uuid.uuid4().hex[:6]}", f"t.updates.{uuid.uuid4().hex[:6]}"
    ensure_topics(broker, [topic, updates], partitions=3)
    table = pq.read_table(sample_run / "samples.parquet").slice(0, N_SAMPLES)
    messages = encode_samples(table)
    bad = {100: b"{not json", 20_000: orjson.dumps({**orjson.loads(messages[1]), "sample_version": 7}),
           50_000: orjson.dumps({**orjson.loads(messages[2]), "user_id": "u1"})}
    producer = CheckedProducer(broker)
    users = table["user_id"].to_pylist()
    for i, value in enumerate(messages):
        producer.send(topic, key=str(users[i]).encode(), value=bad.get(i, value))
    producer.flush()
    producer.close()
    env = {"STREAMREC_TOPICS__SAMPLES": topic, "STREAMREC_TOPICS__MODEL_UPDATES": updates,
           "STREAMREC_TRAINER__GROUP": f"g-{topic}"}

    # Kill -9 twice, each time after a new checkpoint and inside the write of a version trained
    # past it, at a pause point (tests/pause_points.py; a sleep could land between publishes):
    # first on a torn sparse file in the staging dir, then with a version complete in place
    # but LATEST not yet moved to it (the next run must number past it).
    store = ModelStore(str(tmp_path / "models"), "ctr")
    arm_file = tmp_path / "arm"
    for point in ("sparse", "latest"):
        proc = _train(broker, tmp_path, env, arm_file=arm_file)
        before = (_state(tmp_path) or {}).get("step", -1)
        deadline = time.monotonic() + 120
        # a checkpoint of this run with samples in it (a run starts with one of step 0), and a
        # version in the store (a checkpoint due at the first batch is taken before any version)
        while (_state(tmp_path) or {}).get("step", -1) <= max(before, 0) or store.latest() is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate() if proc.poll() is not None else "no checkpoint"
            time.sleep(0.05)
        pause_points.arm(arm_file, point)
        paused = pause_points.wait_paused(arm_file, proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        # the kill landed where it was meant to: after this run's checkpoint, mid-stream, inside
        # the write of a later version, whose partial state is on disk and not visible
        state, latest = _state(tmp_path), store.latest()
        assert state["step"] > before and 0 < state["samples"] < N_SAMPLES - len(bad), state
        assert os.path.getsize(paused["path"]) == (paused["bytes"] // 2 if point == "sparse" else paused["bytes"])
        if point == "sparse":
            staged = Path(paused["path"]).parent.parent
            assert staged.name.startswith(f".tmp-{latest + 1:012d}-") and not (staged / "manifest.json").exists()
            assert store.versions()[-1] == latest
        else:
            assert store.versions()[-1] == latest + 1  # complete and listed, LATEST still on the one before

    # No torn version is visible: every complete version verifies, LATEST loads.
    store = ModelStore(str(tmp_path / "models"), "ctr")
    for v in store.versions():
        store.read_version(v)
    assert store.load().version == store.latest()

    proc = _train(broker, tmp_path, env, "--idle-exit", "3", "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    state = _state(tmp_path)
    # Exactly once along the resumed path: every good sample counted once, none skipped.
    assert state["samples"] == summary["samples"] == N_SAMPLES - len(bad)
    assert state["rejected"] == {"malformed_json": 1, "unknown_sample_version": 1, "wrong_type": 1}
    # ... and kept: each refused message's raw bytes and reason (at least once across the kills)
    kept = [json.loads(line) for line in (tmp_path / "work" / "ctr" / "rejected" / "rank-00000.jsonl").read_text().splitlines()]
    assert {(r["reason"], r["value"]) for r in kept} == {("malformed_json", bad[100].decode()),
                                                          ("unknown_sample_version", bad[20_000].decode()),
                                                          ("wrong_type:user_id", bad[50_000].decode())}
    assert all(r["topic"] == topic and r["encoding"] == "utf-8" for r in kept)
    consumer = make_consumer(broker, group_id=f"g-{topic}")
    tps = [TopicPartition(topic, p) for p in range(3)]
    ends = consumer.end_offsets(tps)
    assert {int(p): o for p, o in state["positions"].items()} == {tp.partition: ends[tp] for tp in tps}
    assert {tp.partition: consumer.committed(tp) for tp in tps} == {tp.partition: ends[tp] for tp in tps}
    consumer.close()
    # Versions continue the chain across the kills and are announced in order. (A version written
    # just before a kill -9 may miss its announcement: serving also polls LATEST.)
    versions = store.versions()
    assert store.latest() == versions[-1] and store.load().manifest["samples_trained"] == N_SAMPLES - len(bad)
    reader = make_consumer(broker, updates, group_id=None)
    announced = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (not announced or announced[-1] != versions[-1]):
        for records in reader.poll(500).values():
            announced += [orjson.loads(r.value)["version"] for r in records]
    reader.close()
    # (older ones may be garbage-collected by now: keep_fulls)
    assert announced == sorted(set(announced)) and announced[-1] == versions[-1]


def test_ranks_split_the_partitions_and_fewer_partitions_than_ranks_is_refused(broker):
    from streamrec.contracts.feature_spec import FeatureSpec
    from streamrec.trainer.sources import KafkaSampleSource

    topic = f"t.samples.{uuid.uuid4().hex[:6]}"
    ensure_topics(broker, [topic], partitions=3)
    owned = []
    for rank in range(2):
        source = KafkaSampleSource(broker, topic, f"g-{topic}", FeatureSpec(), shard=(rank, 2))
        owned.append(sorted(tp.partition for tp in source.assignment))
        source.close()
    assert owned == [[0, 2], [1]]
    with pytest.raises(ValueError, match="has 3 partitions, fewer than the 4 training ranks"):
        KafkaSampleSource(broker, topic, f"g-{topic}", FeatureSpec(), shard=(0, 4))
