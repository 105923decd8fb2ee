"""The Flink job on the embedded mini-cluster, with the real broker, against the exact
reference (pipelines/samples.py SampleBuilder) fed with the very records the job read."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import orjson
import pyarrow as pa
import pytest
from kafka import TopicPartition

from conftest import REPO, CheckedProducer, free_port, read_topic as _read, run_cli
from streamrec.contracts.events import MAX_FUTURE_SKEW_MS
from streamrec.pipelines.flink_rest import FlinkRest, FlinkUnreachable
from streamrec.generator.sinks import decode_truth_message
from streamrec.contracts.sample_wire import decode_samples
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.pipelines.samples import SampleBuilder
from streamrec.plumbing.bus.clients import make_consumer
from streamrec.plumbing.bus.topics import ensure_topics
from streamrec.plumbing.config import load_config
from streamrec.demo.resources import process_tree, threads_cpu_seconds

pytestmark = pytest.mark.slow
WINDOW_S = 5.0


def _env(broker, tmp_path, name):
    """Config of one isolated pipeline: its own topics, group, job name, checkpoints and REST port."""
    return {
        "STREAMREC_KAFKA__BOOTSTRAP": broker,
        "STREAMREC_TOPICS__EVENTS": f"{name}.events", "STREAMREC_TOPICS__SAMPLES": f"{name}.samples",
        "STREAMREC_TOPICS__DLQ": f"{name}.dlq", "STREAMREC_TOPICS__TRUTH": f"{name}.truth",
        "STREAMREC_TOPICS__FEATURES": f"{name}.features",
        "STREAMREC_FLINK__GROUP_ID": name, "STREAMREC_FLINK__JOB_NAME": name,
        "STREAMREC_FLINK__CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "STREAMREC_FLINK__REST_PORT": str(free_port()),
        "STREAMREC_FEATURES__ATTRIBUTION_WINDOW_S": str(WINDOW_S),
        "STREAMREC_FLINK__CHECKPOINT_INTERVAL_S": "1",
    }


SPEC = FeatureSpec(attribution_window_s=WINDOW_S)
GARBAGE = 50_000


def _oracle(broker, events_topic, spec: FeatureSpec = SPEC):
    """The reference samples and rejections of exactly what the events topic holds."""
    records = _read(broker, events_topic, committed=False)
    builder = SampleBuilder(spec).add_all((r.value, r.timestamp) for r in records)
    return builder.build(), builder


def _samples(broker, topic, spec: FeatureSpec = SPEC):
    values = [r.value for r in _read(broker, topic)]
    table, _, rejected = decode_samples(values, spec)
    assert not rejected, rejected[:3]  # the job's output passes the trainer's strict decoder
    return table


def _dlq(broker, topic):
    return sorted((dict(r.headers)["reason"].decode().split(":")[0], r.value) for r in _read(broker, topic))


def _assert_same(got: pa.Table, want: pa.Table):
    ids = got.column("event_id").to_pylist()
    assert len(ids) == len(set(ids)), "an impression yielded two samples"
    got_rows = {r["event_id"]: r for r in got.to_pylist()}
    want_rows = want.to_pylist()
    missing = [r["event_id"] for r in want_rows if r["event_id"] not in got_rows]
    assert not missing, f"{len(missing)} impressions without a sample, e.g. {missing[:3]}"
    assert len(got_rows) == len(want_rows)
    diffs = [(w["event_id"], k, w[k], got_rows[w["event_id"]][k]) for w in want_rows for k in w if got_rows[w["event_id"]][k] != w[k]]
    assert not diffs, f"{len(diffs)} differing fields, e.g. {diffs[:5]}"


def _want_dlq(builder):
    return sorted((r.reason.split(":")[0], r.raw) for r in builder.rejected)


def test_generator_to_samples_matches_the_reference_exactly(broker, tmp_path):
    name = f"pj-{uuid.uuid4().hex[:8]}"
    env = _env(broker, tmp_path, name)
    gen = run_cli("generate", "--duration", "30", "--rate", "1500", "--bad-fraction", "0.02", "--fast", env=env)
    assert gen.returncode == 0, gen.stderr
    run = run_cli("pipeline", "submit", "--bounded", "--fresh", env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "finished" in run.stdout

    want, builder = _oracle(broker, f"{name}.events")
    got = _samples(broker, f"{name}.samples")
    assert want.num_rows > 30_000 and sum(want.column("label").to_pylist()) > 500
    _assert_same(got, want)
    dlq = _dlq(broker, f"{name}.dlq")
    assert dlq == _want_dlq(builder)
    assert {reason for reason, _ in dlq} >= {"malformed_json", "missing_field", "wrong_type", "invalid_value",
                                             "future_timestamp", "orphan_click"}

    # labels are the generator's clicks: clicked within the window <=> label 1
    truth = {r["event_id"]: r for record in _read(broker, f"{name}.truth", committed=False)
             for r in decode_truth_message(record.value) if r["kind"] == "impression"}
    assert len(truth) == got.num_rows
    horizon = max(got.column("ts").to_pylist()) - WINDOW_S * 1000 - 5000  # clicks due after the run's end never came
    for row in (r for r in got.to_pylist() if r["ts"] < horizon):
        t = truth[row["event_id"]]
        clicked_in_window = bool(t["clicked"]) and t["click_ts"] - row["ts"] <= WINDOW_S * 1000
        assert row["label"] == int(clicked_in_window), row["event_id"]


def test_a_new_counter_window_is_a_config_change_only(broker, tmp_path):
    """[features] windows_s gains 3600 and history_len shrinks, by configuration alone: the job
    writes the new columns and its samples equal the reference builder's with that spec."""
    name = f"fs-{uuid.uuid4().hex[:8]}"
    env = {**_env(broker, tmp_path, name), "STREAMREC_FEATURES__WINDOWS_S": "60,600,3600", "STREAMREC_FEATURES__HISTORY_LEN": "5",
           "STREAMREC_MODEL__HISTORY_LEN": "5"}
    spec = FeatureSpec(history_len=5, windows_s=(60, 600, 3600), attribution_window_s=WINDOW_S)
    gen = run_cli("generate", "--duration", "15", "--rate", "1500", "--fast", env=env)
    assert gen.returncode == 0, gen.stderr
    run = run_cli("pipeline", "submit", "--bounded", "--fresh", env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    want, _ = _oracle(broker, f"{name}.events", spec)
    got = _samples(broker, f"{name}.samples", spec)
    assert got.schema.names == spec.schema().names and "user_clicks_3600s" in got.schema.names
    assert want.num_rows > 10_000 and max(len(h) for h in got.column("hist_item_ids").to_pylist()) == 5
    _assert_same(got, want)


def _imp(eid, ts, user, item, req, cat=1, pos=1):
    return orjson.dumps({"type": "impression", "event_id": eid, "ts": ts, "user_id": user, "item_id": item, "request_id": req,
                         "position": pos, "context": {"device": "ios", "local_hour": 3}, "item": {"category_id": cat, "advertiser_id": 9}})


def _click(eid, ts, user, item, req):
    return orjson.dumps({"type": "click", "event_id": eid, "ts": ts, "user_id": user, "item_id": item, "request_id": req})


def test_point_in_time_features_on_a_hand_built_sequence(broker, tmp_path):
    """Same-millisecond events are invisible, duplicates count once, a click arriving before its
    impression still joins, a click after the window is an orphan, sequences are most recent first
    and clicks of one millisecond are ordered by event id, not by arrival."""
    name = f"pit-{uuid.uuid4().hex[:8]}"
    env = _env(broker, tmp_path, name)
    t0 = int(time.time() * 1000) - 60_000
    u, v = 7, 8
    events = [  # (arrival order) user u's story, then user v for contrast
        _imp("i1", t0, u, 100, "r1", cat=11),
        _click("c1", t0 + 500, u, 100, "r1"),
        _imp("i2", t0 + 1000, u, 200, "r2", cat=22),
        _click("c2", t0 + 1500, u, 200, "r2"),
        _click("c2", t0 + 1500, u, 200, "r2"),  # duplicate delivery of the same click
        _imp("i3", t0 + 1500, u, 300, "r3", cat=11),  # same ms as c2: must not see it
        _imp("i3", t0 + 1500, u, 300, "r3", cat=11),  # duplicate impression: one sample
        _click("c4", t0 + 2200, u, 400, "r4"),  # arrives before its impression (disorder < watermark lag)
        _imp("i4", t0 + 2000, u, 400, "r4", cat=22),
        _imp("i5", t0 + 3000, u, 100, "r5", cat=11),  # sees c1 and c2 (sequence), c4 (2200 < 3000)
        _click("c6", t0 + 3000 + int(WINDOW_S * 1000) + 1, u, 100, "r5"),  # one ms past the window: orphan
        _imp("i6", t0 + 3000 + int(WINDOW_S * 1000) + 2, v, 100, "r6", cat=11),  # item 100 seen by another user
        b'{"type": "click", "broken',
        _imp("i7", t0 + 9000, u, 500, "r7", cat=33),
        _imp("i8", t0 + 9000, u, 600, "r8", cat=33),
        _click("c9", t0 + 9100, u, 500, "r7"),  # two clicks in one ms, arriving in the opposite
        _click("c10", t0 + 9100, u, 600, "r8"),  # order to their event ids ("c10" < "c9")
        _imp("i9", t0 + 9200, u, 700, "r9", cat=33),
    ]
    producer = CheckedProducer(broker)
    ensure_topics(broker, [f"{name}.events"], 2)
    for value in events:
        producer.send(f"{name}.events", key=b"%d" % (u if b'"user_id":7' in value or b"broken" in value else v), value=value)
    producer.flush()
    run = run_cli("pipeline", "submit", "--bounded", "--fresh", env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]

    want, builder = _oracle(broker, f"{name}.events")
    got = _samples(broker, f"{name}.samples")
    _assert_same(got, want)
    rows = {r["event_id"]: r for r in got.to_pylist()}
    assert sorted(rows) == ["i1", "i2", "i3", "i4", "i5", "i6", "i7", "i8", "i9"]
    assert rows["i1"]["label"] == 1 and rows["i1"]["click_ts"] == t0 + 500
    assert rows["i3"]["hist_item_ids"] == [100] and rows["i3"]["user_clicks_60s"] == 1  # c2 at the same ms: invisible
    assert rows["i3"]["user_imps_60s"] == 2  # i1, i2 (not itself, not its duplicate)
    assert rows["i4"]["label"] == 1  # the click arrived first and still joined
    assert rows["i5"]["hist_item_ids"] == [400, 200, 100] and rows["i5"]["hist_category_ids"] == [22, 22, 11]
    assert rows["i5"]["user_clicks_60s"] == 3 and rows["i5"]["user_imps_60s"] == 4
    assert rows["i5"]["label"] == 0  # its only click came 1 ms too late
    assert rows["i5"]["item_imps_60s"] == 1 and rows["i5"]["item_clicks_60s"] == 1  # i1 and c1 on item 100
    assert rows["i5"]["category_imps_60s"] == 2 and rows["i5"]["category_clicks_60s"] == 1  # i1, i3; c1
    assert rows["i6"]["user_imps_60s"] == 0 and rows["i6"]["hist_item_ids"] == []
    assert rows["i6"]["item_imps_60s"] == 2 and rows["i6"]["item_clicks_60s"] == 1  # i1, i5; c1 (c6 never joined)
    assert rows["i9"]["hist_item_ids"] == [500, 600, 400, 200, 100]  # "c9" > "c10": c9 is the more recent
    assert _dlq(broker, f"{name}.dlq") == sorted([("orphan_click", events[10]), ("malformed_json", events[12])])


def test_rejected_events_do_not_move_the_watermark(broker, tmp_path):
    """A rejected event is placed at its arrival (Kafka) time, which runs ahead of event time
    whenever the producer lags its events; valid events behind it must not become late."""
    name = f"wm-{uuid.uuid4().hex[:8]}"
    env = _env(broker, tmp_path, name)
    ensure_topics(broker, [f"{name}.events"], 1)  # one partition: its watermark is the job's
    job = _submit_in_background(env, "--fresh")
    try:
        FlinkRest(f"127.0.0.1:{env['STREAMREC_FLINK__REST_PORT']}").wait_running(name, 180, all_tasks=True)
        # while the input is empty the source's fetchers wait on the broker (fetch.max.wait.ms);
        # a fetcher that spun (a broker or client answering empty fetches at once) burns ~1 core
        fetcher_cpu = lambda: sum(cpu for thread, cpu in threads_cpu_seconds(process_tree(job.pid)).items()  # noqa: E731
                                  if thread.startswith("Source Data Fet"))
        before = fetcher_cpu()
        time.sleep(3.0)
        assert fetcher_cpu() - before < 0.5, "the Kafka source's fetcher spins while its input is empty"
        t0 = int(time.time() * 1000) - 30_000  # the producer runs 30 s behind its event time
        producer = CheckedProducer(broker)
        producer.send(f"{name}.events", key=b"1", value=_imp("i1", t0, 1, 100, "r1"))
        producer.send(f"{name}.events", key=b"1", value=b'{"type": "impression", "broken')  # arrival: now
        producer.flush()
        # committed in the DLQ: the job has read it, and watermarks have been emitted since
        _wait_for(lambda: len(_read(broker, f"{name}.dlq")) >= 1, 120, "the malformed event in the DLQ")
        producer.send(f"{name}.events", key=b"1", value=_imp("i2", t0 + 1000, 1, 200, "r2"))  # 29 s behind arrival
        producer.send(f"{name}.events", key=b"2", value=_imp("flush", t0 + 20_000, 2, 300, "r3"))  # closes i1, i2
        producer.flush()
        _wait_for(lambda: len(_read(broker, f"{name}.samples")) + len(_read(broker, f"{name}.dlq")) >= 3, 120,
                  "i1 and i2 as samples or in the DLQ")
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait(timeout=60)
    assert [reason for reason, _ in _dlq(broker, f"{name}.dlq")] == ["malformed_json"]
    assert sorted(_samples(broker, f"{name}.samples").column("event_id").to_pylist()) == ["i1", "i2"]


def test_a_bounded_run_never_treats_a_partition_as_idle(broker, tmp_path):
    """A backfill's partitions all end, so none may go idle. Here partition 0's reader first
    chews through rejected events (which are not activity) with a 1 ms idle timeout. With
    idleness, partition 1's reader finished (its watermark: the end of time) while partition 0's
    was idle, and partition 0's valid events and partition 1's event were lost: neither samples
    nor DLQ records (seen in CI as a bounded run missing its last few dozen samples)."""
    name = f"idle-{uuid.uuid4().hex[:8]}"
    env = {**_env(broker, tmp_path, name), "STREAMREC_FLINK__IDLE_TIMEOUT_S": "0.001"}
    ensure_topics(broker, [f"{name}.events"], 2)
    t0 = int(time.time() * 1000) - 7_200_000
    producer = CheckedProducer(broker)
    for k in range(GARBAGE):
        producer.send(f"{name}.events", partition=0, value=b'{"type": "impression", "broken %d' % k)
    backlog = [f"old{k}" for k in range(200)]
    for k, eid in enumerate(backlog):
        producer.send(f"{name}.events", partition=0, value=_imp(eid, t0 + 10 * k, 1 + k % 50, 100 + k % 7, f"r{eid}"))
    producer.send(f"{name}.events", partition=1, value=_imp("new", t0 + 3_600_000, 99, 100, "rnew"))
    producer.flush()
    run = run_cli("pipeline", "submit", "--bounded", "--fresh", env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert {reason for reason, _ in _dlq(broker, f"{name}.dlq")} == {"malformed_json"}
    assert sorted(_samples(broker, f"{name}.samples").column("event_id").to_pylist()) == sorted(backlog + ["new"])


def test_a_click_labels_its_sample_on_arrival_not_when_the_watermark_reaches_it(broker, tmp_path):
    """A clicked impression's sample leaves the job when its click arrives: its features were
    fixed at the impression, only the label waited. With 20 s of out-of-orderness the watermark
    never reaches the click in this test, so only the early label can produce the sample; the
    unclicked impression's sample still waits for its attribution window to close."""
    name = f"early-{uuid.uuid4().hex[:8]}"
    env = {**_env(broker, tmp_path, name), "STREAMREC_FLINK__OUT_OF_ORDERNESS_MS": "20000",
           "STREAMREC_FLINK__IDLE_TIMEOUT_S": "600"}
    ensure_topics(broker, [f"{name}.events"], 1)
    job = _submit_in_background(env, "--fresh")
    try:
        FlinkRest(f"127.0.0.1:{env['STREAMREC_FLINK__REST_PORT']}").wait_running(name, 180, all_tasks=True)
        t0 = int(time.time() * 1000) - 60_000
        producer = CheckedProducer(broker)
        for value in (_imp("i1", t0, 1, 100, "r1", cat=5), _imp("i2", t0 + 100, 1, 200, "r2", cat=5),
                      _imp("later", t0 + 21_600, 2, 300, "r3", cat=6)):  # moves the watermark to ~t0 + 1.6 s
            producer.send(f"{name}.events", key=b"1", value=value)
        producer.flush()
        # the category stage has applied i1 and i2 once it publishes their category's feature state
        _wait_for(lambda: any((r.key or b"").startswith(b"c/category/5/") for r in _read(broker, f"{name}.features")),
                  120, "the category stage to apply the impressions")
        sent = time.monotonic()
        producer.send(f"{name}.events", key=b"1", value=_click("c1", t0 + 3000, 1, 100, "r1"))
        producer.flush()
        _wait_for(lambda: len(_read(broker, f"{name}.samples")) >= 1, 60, "the clicked impression's sample")
        waited = time.monotonic() - sent
        time.sleep(2)  # anything else would be out by now
        rows = _samples(broker, f"{name}.samples").to_pylist()
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait(timeout=60)
    assert [(r["event_id"], r["label"], r["click_ts"]) for r in rows] == [("i1", 1, t0 + 3000)], rows
    assert rows[0]["category_imps_60s"] == 0 and rows[0]["user_imps_60s"] == 0  # the features of i1's own time
    print(f"clicked sample visible {waited:.2f} s after the click was sent")


def _submit_in_background(env, *flags) -> subprocess.Popen:
    """`streamrec pipeline submit` (unbounded) in its own process group, its output (the
    mini-cluster's log too) in a file beside the job's checkpoints: ``_job_output(job)``. Not a
    pipe: nobody reads one while the job runs, and a full pipe would block the job's logging."""
    work = Path(env["STREAMREC_FLINK__CHECKPOINT_DIR"]).parent
    work.mkdir(parents=True, exist_ok=True)
    log = work / f"submit-{time.monotonic_ns()}.log"
    with open(log, "w") as out:
        job = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "pipeline", "submit", *flags], cwd=REPO,
                               env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    job.log_path = log
    return job


def _job_output(job: subprocess.Popen) -> str:
    """What a job started by ``_submit_in_background`` has printed so far."""
    return job.log_path.read_text(errors="replace")


def _stop_resumed_job(job: subprocess.Popen) -> None:
    """Stop a resubmitted job (SIGTERM, SIGKILL if it lingers); it must have said it resumed
    from a checkpoint."""
    try:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    output = _job_output(job)
    assert "resumed from" in output, output[-3000:]


def _wait_for(predicate, timeout_s, what, context=None, poll_s=0.5):
    """Poll ``predicate`` until it holds; on a timeout, ``context()`` says what else was seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}" + (f" ({context()})" if context else ""))


def test_kill_and_restart_from_checkpoint_loses_and_duplicates_nothing(broker, tmp_path):
    name = f"kill-{uuid.uuid4().hex[:8]}"
    # a state cache far smaller than the key count: states leave it (written back) all the time,
    # and all but 50 of the category stage's waiting samples move to RocksDB, the rest are
    # checkpointed (and restored) with the stage's event buffer
    env = {**_env(broker, tmp_path, name), "STREAMREC_FLINK__STATE_CACHE_KEYS": "50"}
    job = _submit_in_background(env, "--fresh")
    gen = None
    try:
        FlinkRest(f"127.0.0.1:{env['STREAMREC_FLINK__REST_PORT']}").wait_running(name, 180)
        # paced, while the job runs: samples keep flowing, so the sink's transactions hold records
        # (a backlog is all committed within a few checkpoints, then the transactions are empty)
        gen = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "generate", "--duration", "25", "--rate", "1000",
                                "--bad-fraction", "0.01"], cwd=REPO, env={**os.environ, **env},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # the mini-cluster's JVM runs with flink.jvm_options, each one an argument of its command line
        jvm_options = load_config().flink.jvm_options.encode().split()
        assert jvm_options and any(set(jvm_options) <= set(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
                                   for pid in process_tree(job.pid)), jvm_options
        # kill -9 mid-stream: once checkpoints have committed some 1,000 samples, while the samples
        # sink has a transaction open or pre-committed (records written, not yet committed)
        with _EndOffsets(broker, f"{name}.samples") as ends:
            def committed_and_open() -> bool:
                high, stable = ends.offsets()
                return sum(stable.values()) > 1000 and any(high[tp] > stable[tp] for tp in ends.parts)

            _wait_for(committed_and_open, 240, "an open transaction after 1,000 committed samples", poll_s=0.05)
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
            assert ends.transaction_open(), "the kill landed between two transactions"  # none is ended now
        assert list((tmp_path / "checkpoints").glob("*/chk-*/_metadata")), "no completed checkpoint before the kill"
        assert gen.wait(120) == 0, gen.stderr.read()  # every event written before the restart
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        if gen is not None and gen.poll() is None:
            gen.kill()
    committed_before = len(_read(broker, f"{name}.samples"))

    # Restart unbounded: partitions restored from a checkpoint keep the stopping offsets of the
    # run that took it, so --bounded would not apply. One late "flush" impression per partition
    # moves the watermark past every window of the real traffic.
    job = _submit_in_background(env)
    try:
        want, builder = _flush_then_oracle(broker, name)
        assert committed_before < want.num_rows, "the kill came too late to test anything"
        _wait_for(lambda: len(_read(broker, f"{name}.samples")) >= want.num_rows, 300, "every sample after the restart")
        time.sleep(3)  # anything extra (a duplicate) would have arrived by now
    except BaseException:
        os.killpg(job.pid, signal.SIGKILL)
        raise
    _stop_resumed_job(job)
    _assert_same(_samples(broker, f"{name}.samples"), want)
    assert _dlq(broker, f"{name}.dlq") == _want_dlq(builder)
    # the feature state, written exactly once with the same checkpoints, rebuilds the samples' features
    from test_online_features import _clicks, materialise, mismatches

    store = materialise(broker, f"{name}.features", spec=SPEC)
    try:
        rows = want.to_pylist()
        assert store.status()["corrupt"] == 0 and mismatches(store, rows, _clicks(rows), SPEC) == []
    finally:
        store.close()


class _EndOffsets:
    """A topic's end offsets as read_uncommitted (the high watermark) and read_committed (the last
    stable offset) consumers see them; the two differ while a transaction has records on it."""

    def __init__(self, broker: str, topic: str) -> None:
        self.consumers = [make_consumer(broker, group_id=None, isolation_level=level)
                          for level in ("read_uncommitted", "read_committed")]
        self.parts = [TopicPartition(topic, p) for p in sorted(self.consumers[0].partitions_for_topic(topic) or [])]

    def offsets(self) -> tuple[dict, dict]:
        """(high watermarks, last stable offsets) by partition, read in that order: a transaction
        that commits in between cannot make a partition look open."""
        high, stable = (consumer.end_offsets(self.parts) for consumer in self.consumers)
        return high, stable

    def transaction_open(self) -> bool:
        """Some partition holds records of a transaction not yet committed or aborted."""
        high, stable = self.offsets()
        return any(high[tp] > stable[tp] for tp in self.parts)

    def __enter__(self) -> "_EndOffsets":
        return self

    def __exit__(self, *exc) -> None:
        for consumer in self.consumers:
            consumer.close()


def _flush_then_oracle(broker, name):
    """Send one late "flush" impression per partition, a minute after the latest event time of
    the traffic, so the watermark passes every attribution window of it; return the reference
    samples (those before the flush) and its builder (rejections)."""
    events = _read(broker, f"{name}.events", committed=False)
    flush_ts = _max_plausible_ts(events) + 60_000
    producer = CheckedProducer(broker)
    for p in sorted({r.partition for r in events}):
        producer.send(f"{name}.events", partition=p, value=_imp(f"flush-{p}", flush_ts, 10**9 + p, 1, f"flush-{p}"))
    producer.close()
    want, builder = _oracle(broker, f"{name}.events")
    return want.filter(pa.compute.less(want.column("ts"), flush_ts)), builder


def _max_plausible_ts(records) -> int:
    """The latest event time among records the job accepts (far-future ones go to the DLQ)."""
    best = 0
    for r in records:
        try:
            ts = orjson.loads(r.value).get("ts")
        except (orjson.JSONDecodeError, AttributeError):
            continue
        if isinstance(ts, int) and not isinstance(ts, bool) and ts < r.timestamp + MAX_FUTURE_SKEW_MS:
            best = max(best, ts)
    return best


def _checkpoints_completed(rest: str, job_id: str) -> int:
    with urllib.request.urlopen(f"http://{rest}/jobs/{job_id}/checkpoints", timeout=10) as response:
        return json.loads(response.read())["counts"]["completed"]


def _trigger_checkpoint(rest: str, job_id: str) -> None:
    request = urllib.request.Request(f"http://{rest}/jobs/{job_id}/checkpoints", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).close()


def test_at_least_once_samples_are_visible_at_once_and_a_crash_replays_those_after_the_checkpoint(broker: str, tmp_path: Path):
    """flink.delivery = "at-least-once": no transactions, so read_committed readers see samples
    before any checkpoint. After kill -9 and a restart from the last checkpoint, every impression
    has a sample equal to the reference's; the samples written before that checkpoint are there
    once, each one written after it twice (rebuilt from the replayed events)."""
    name = f"alo-{uuid.uuid4().hex[:8]}"
    # checkpoints only when the test triggers one, so it knows which samples the last one covers
    env = {**_env(broker, tmp_path, name), "STREAMREC_FLINK__DELIVERY": "at-least-once",
           "STREAMREC_FLINK__CHECKPOINT_INTERVAL_S": "3600"}
    rest = f"127.0.0.1:{env['STREAMREC_FLINK__REST_PORT']}"
    job = _submit_in_background(env, "--fresh")
    gen = None
    try:
        job_id = FlinkRest(rest).wait_running(name, 180, all_tasks=True).job_id
        gen = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "generate", "--duration", "20", "--rate", "1000"],
                               cwd=REPO, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _wait_for(lambda: len(_read(broker, f"{name}.samples")) >= 300, 120, "300 samples read_committed")
        assert _checkpoints_completed(rest, job_id) == 0, "a checkpoint came first: nothing shown about visibility"
        with _EndOffsets(broker, f"{name}.samples") as ends:
            covered = ends.offsets()[0]  # written before the checkpoint is triggered: all in it
            _trigger_checkpoint(rest, job_id)
            _wait_for(lambda: _checkpoints_completed(rest, job_id) >= 1, 60, "the triggered checkpoint")
            after = ends.offsets()[0]  # what the sink writes from here on came after the checkpoint
            _wait_for(lambda: sum(ends.offsets()[0].values()) >= sum(after.values()) + 300, 60, "samples after the checkpoint")
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
        assert gen.wait(120) == 0, gen.stderr.read()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        if gen is not None and gen.poll() is None:
            gen.kill()
    written = _read(broker, f"{name}.samples")
    once = {orjson.loads(r.value)["event_id"] for r in written if r.offset < covered[TopicPartition(r.topic, r.partition)]}
    twice = {orjson.loads(r.value)["event_id"] for r in written if r.offset >= after[TopicPartition(r.topic, r.partition)]}

    job = _submit_in_background(env)
    try:
        want, _ = _flush_then_oracle(broker, name)

        def replayed() -> bool:
            copies = Counter(_samples(broker, f"{name}.samples").column("event_id").to_pylist())
            return len(copies) >= want.num_rows and all(copies[e] >= 2 for e in twice)

        _wait_for(replayed, 300, "a sample of every impression, and the replay of those after the checkpoint")
    except BaseException:
        os.killpg(job.pid, signal.SIGKILL)
        raise
    _stop_resumed_job(job)
    got = _samples(broker, f"{name}.samples").to_pylist()
    want_rows = {r["event_id"]: r for r in want.to_pylist()}
    seen = Counter(r["event_id"] for r in got)
    assert seen.keys() == want_rows.keys(), (f"{len(want_rows.keys() - seen.keys())} impressions without a sample, "
                                             f"{len(seen.keys() - want_rows.keys())} samples of no impression")
    diffs = [(r["event_id"], k) for r in got for k in want_rows[r["event_id"]] if r[k] != want_rows[r["event_id"]][k]]
    assert not diffs, f"{len(diffs)} differing fields (a first copy or its replay), e.g. {diffs[:5]}"
    assert once and all(seen[e] == 1 for e in once), "a sample the checkpoint covered was written again"
    assert twice and all(seen[e] == 2 for e in twice), "a sample written after the checkpoint was not written exactly once more"


@pytest.fixture(scope="module")
def flink_cluster(tmp_path_factory):
    """A real standalone Flink cluster - a JobManager and one TaskManager, each its own JVM -
    from the Flink distribution inside the PyFlink wheel: what `--jobmanager` submits to."""
    import pyflink

    bin_dir = Path(pyflink.__file__).parent / "bin"
    work = tmp_path_factory.mktemp("flink-cluster")
    rest_port = free_port()
    conf = {"rest.port": rest_port, "rest.address": "127.0.0.1", "rest.bind-address": "127.0.0.1",
            "jobmanager.rpc.address": "127.0.0.1", "jobmanager.rpc.port": free_port(),
            "jobmanager.bind-host": "127.0.0.1", "taskmanager.bind-host": "127.0.0.1", "taskmanager.host": "127.0.0.1",
            "taskmanager.numberOfTaskSlots": 4}  # one per partition: a source reader each
    dynamic = [arg for key, value in conf.items() for arg in ("-D", f"{key}={value}")]
    env = {**os.environ, "FLINK_LOG_DIR": str(work / "log"), "FLINK_PID_DIR": str(work)}
    procs = [subprocess.Popen(["bash", str(bin_dir / script), "start-foreground", *dynamic], env=env,
                              stdout=(work / f"{script}.out").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
             for script in ("jobmanager.sh", "taskmanager.sh")]
    address = f"127.0.0.1:{rest_port}"
    try:
        def slots_up() -> bool:
            assert all(p.poll() is None for p in procs), f"the Flink cluster exited; see {work}"
            try:
                return FlinkRest(address, timeout_s=2).overview().get("slots-total", 0) >= 4
            except FlinkUnreachable:
                return False

        _wait_for(slots_up, 120, "the standalone Flink cluster's TaskManager")
        yield address
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def test_a_flink_cluster_runs_the_same_job_with_status_and_cancel(broker, tmp_path, flink_cluster):
    """`--jobmanager` ships the job graph and its jars to a separate cluster: the same samples
    as the reference, and `pipeline status` / `cancel` drive it through the cluster's REST API."""
    name = f"cl-{uuid.uuid4().hex[:8]}"
    # checkpoints as a URI, the way a cluster's shared storage is named (s3://, hdfs://)
    env = {**_env(broker, tmp_path, name), "STREAMREC_FLINK__CHECKPOINT_DIR": (tmp_path / "checkpoints").as_uri()}
    cluster = ["--jobmanager", flink_cluster]
    gen = run_cli("generate", "--duration", "10", "--rate", "1000", "--bad-fraction", "0.02", "--fast", env=env)
    assert gen.returncode == 0, gen.stderr
    submitted = run_cli("pipeline", "submit", "--fresh", "--parallelism", "2", *cluster, env=env, timeout=300)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr[-3000:]
    assert f"submitted to {flink_cluster}" in submitted.stdout and "task slots" not in submitted.stderr

    def jobs() -> list[dict]:
        result = run_cli("pipeline", "status", "--json", *cluster, env=env)
        assert result.returncode == 0, result.stderr
        return [j for j in json.loads(result.stdout) if j["name"] == name]

    _wait_for(lambda: any(j["state"] == "RUNNING" for j in jobs()), 120, "the job RUNNING on the cluster")
    want, builder = _flush_then_oracle(broker, name)
    _wait_for(lambda: len(_read(broker, f"{name}.samples")) >= want.num_rows, 240, "every sample from the cluster")

    cancelled = run_cli("pipeline", "cancel", *cluster, env=env)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled.stdout + cancelled.stderr
    _wait_for(lambda: [j["state"] for j in jobs()] == ["CANCELED"], 60, "the job CANCELED")
    _assert_same(_samples(broker, f"{name}.samples"), want)
    assert _dlq(broker, f"{name}.dlq") == _want_dlq(builder)
    assert list((tmp_path / "checkpoints").glob("*/chk-*/_metadata")), "the cluster wrote no checkpoint"

    again = run_cli("pipeline", "cancel", *cluster, env=env)  # nothing left to cancel: says so, no error
    assert again.returncode == 0 and "left to cancel" in again.stdout
    unknown = run_cli("pipeline", "cancel", "0123456789abcdef0123456789abcdef", *cluster, env=env)
    assert unknown.returncode != 0 and "no job 0123456789abcdef0123456789abcdef" in unknown.stderr


def test_an_unreachable_jobmanager_is_a_clear_error(broker, tmp_path):
    env = _env(broker, tmp_path, f"nojm-{uuid.uuid4().hex[:8]}")
    nowhere = f"127.0.0.1:{free_port()}"
    for args in (("status",), ("cancel",), ("submit",)):
        result = run_cli("pipeline", *args, "--jobmanager", nowhere, env=env)
        assert result.returncode != 0 and f"the cluster at {nowhere} does not answer" in result.stderr, result.stderr


def test_a_starting_jobmanager_answering_503_is_not_ready_not_an_error():
    """A JobManager that is up but still starting answers 503 on /overview: the client says
    "not ready yet" (FlinkUnreachable, which callers retry), never a failure."""
    import http.server
    import threading

    class Starting(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b'{"errors":["Service temporarily unavailable due to an ongoing leader election."]}')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Starting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(FlinkUnreachable, match="not ready yet"):
            FlinkRest(f"127.0.0.1:{server.server_address[1]}", timeout_s=5).overview()
    finally:
        server.shutdown()
