"""Apache Kafka killed under the whole loop: a single node ten times with kill -9, and the node
leading the samples topic in a three-node cluster. Nothing acknowledged may be lost, the
samples stay exactly the reference's (read_committed: none missing, none twice), and every
process recovers by itself. One known defect (docs/pipeline.md): when the runner's sweep had to
abort hanging transactions, their samples are missing; the ten-kill test then still checks
everything else, that every visible sample is the reference's and none is there twice, and
reports the loss as an expected failure (xfail) with its size."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import orjson
import pyarrow as pa
import pytest
from kafka import TopicPartition
from kafka.errors import KafkaConnectionError

from conftest import REPO, free_port, read_topic, run_cli
from streamrec.modelstore.store import ModelStore
from streamrec.pipelines.flink_rest import FlinkRest, FlinkUnreachable
from streamrec.plumbing.bus.broker import EmbeddedBroker, port_in_use
from streamrec.plumbing.bus.clients import make_admin, make_consumer
from streamrec.plumbing.bus.topics import open_transactions
from test_pipeline_job import _assert_same, _env, _flush_then_oracle, _job_output, _oracle, _samples, _submit_in_background, _wait_for

pytestmark = [pytest.mark.slow, pytest.mark.serial]


def _free_ports(n: int) -> int:
    """A first port with the n - 1 after it free too (a local cluster's nodes take consecutive ports)."""
    while True:
        base = free_port()
        if base + n < 65536 and not any(port_in_use("127.0.0.1", base + i) for i in range(1, n)):
            return base


def _start(env: dict, log: Path, *argv: str) -> subprocess.Popen:
    """`streamrec <argv>` in its own process group, output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "streamrec.cli", *argv], cwd=REPO, env={**os.environ, **env},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def _wait_job_running(env: dict, job: subprocess.Popen, name: str) -> None:
    """Until every task of the submitted job runs; the submit's own output if it exits first."""
    rest = FlinkRest(f"127.0.0.1:{env['STREAMREC_FLINK__REST_PORT']}")

    def running() -> bool:
        assert job.poll() is None, f"pipeline submit exited {job.returncode}:\n{_job_output(job)[-3000:]}"
        try:
            return any(j.name == name and j.state == "RUNNING" and j.tasks_running for j in rest.jobs())
        except FlinkUnreachable:  # the mini-cluster is still starting
            return False

    _wait_for(running, 180, f"job {name} running")


def _end_offsets(bootstrap: str, topic: str, isolation_level: str = "read_uncommitted", retry_s: float = 20.0) -> int:
    """The sum of ``topic``'s partitions' end offsets: high watermarks, or the last stable
    offsets (what a read_committed reader sees) with ``read_committed``. Right after a node's
    kill the metadata still names it as leader, and kafka-python raises at its refused
    connection rather than wait for the new leader: asked again, until ``retry_s`` has passed."""
    deadline = time.monotonic() + retry_s
    while True:
        consumer = make_consumer(bootstrap, group_id=None, isolation_level=isolation_level, timeout_s=10)
        try:
            parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
            return sum(consumer.end_offsets(parts).values()) if parts else 0
        except KafkaConnectionError:
            if time.monotonic() > deadline:
                raise
        finally:
            consumer.close()
        time.sleep(0.5)


def _distinct_events(bootstrap: str, topic: str) -> int:
    return len({orjson.loads(r.value)["event_id"] for r in read_topic(bootstrap, topic, committed=False)})


def _generated(log: Path) -> int:
    """The events `streamrec generate` counted acknowledged, from its summary line."""
    text = log.read_text()
    line = next((ln for ln in text.splitlines() if " events in " in ln and ln.startswith("run ")), None)
    assert line, text[-3000:]
    return int(line.split(": ", 1)[1].split(" events in")[0].replace(",", ""))


def _assert_exact_samples(bootstrap: str, name: str, job: subprocess.Popen, flink_log: Path | None = None) -> int:
    """The job's samples are the reference's over every event in the topic: none missing, none
    twice. Waits as long as samples keep coming (a job catching up on a loaded box), and fails
    after two minutes without a new one, saying where the rest are."""
    want, _ = _flush_then_oracle(bootstrap, name)

    def got() -> pa.Table:
        table = _samples(bootstrap, f"{name}.samples")
        ids = table.column("event_id").to_pylist()
        assert len(ids) == len(set(ids)), "an impression yielded two samples"
        return table.filter(pa.compute.is_in(table.column("event_id"), want.column("event_id")))

    def seen_instead() -> str:
        reasons = Counter(dict(r.headers)["reason"].decode().split(":")[0] for r in read_topic(bootstrap, f"{name}.dlq"))
        written = _end_offsets(bootstrap, f"{name}.samples")
        log = _job_output(job)[-2000:]
        for f in sorted(flink_log.glob("*.log")) if flink_log else []:  # the job's restarts and errors, if any
            lines = [ln for ln in f.read_text(errors="replace").splitlines()
                     if " ERROR " in ln or "switched from state" in ln or "Caused by" in ln]
            log += f"\n--- {f.name}:\n" + "\n".join(ln[:300] for ln in lines[-25:])
        return (f"{got().num_rows:,} of {want.num_rows:,} samples visible, {written:,} written; open transactions "
                f"{open_transactions(bootstrap, [f'{name}.samples'])}; the DLQ's reasons {dict(reasons)}; the job's "
                f"output ends:\n{log}")

    _wait_while_growing(lambda: got().num_rows, want.num_rows, 120, "the samples of every event", seen_instead)
    _assert_same(got(), want)
    return want.num_rows


def _samples_short_only_by_aborts(bootstrap: str, name: str) -> int:
    """After the sweep aborted hanging transactions: every visible sample is the reference's,
    field for field, and none is there twice; returns how many are missing."""
    want, _ = _oracle(bootstrap, f"{name}.events")
    want = want.filter(pa.compute.invert(pa.compute.starts_with(want.column("event_id"), "flush-")))
    got = _samples(bootstrap, f"{name}.samples")
    got = got.filter(pa.compute.is_in(got.column("event_id"), want.column("event_id")))
    ids = got.column("event_id").to_pylist()
    assert len(ids) == len(set(ids)), "an impression yielded two samples"
    want_rows = {r["event_id"]: r for r in want.to_pylist()}
    diffs = [(r["event_id"], k) for r in got.to_pylist() for k in r if r[k] != want_rows[r["event_id"]][k]]
    assert not diffs, f"{len(diffs)} differing fields, e.g. {diffs[:5]}"
    return want.num_rows - got.num_rows


def _wait_while_growing(count, target: int, stall_s: float, what: str, context) -> None:
    """Poll ``count()`` until it reaches ``target``; fail once it has not grown for ``stall_s``."""
    best, grew_at = -1, time.monotonic()
    while (n := count()) < target:
        if n > best:
            best, grew_at = n, time.monotonic()
        elif time.monotonic() - grew_at > stall_s:
            raise AssertionError(f"timed out waiting for {what}: none new for {stall_s:.0f} s ({context()})")
        time.sleep(1)


def _fault_env(bootstrap: str, tmp_path: Path, name: str) -> dict:
    """A pipeline whose partitions all get traffic, so no reader is ever idle in truth: the idle
    timeout is set above any outage here. An outage longer than it (a broker restart plus the
    job's restart, on a loaded 2-core box) would let the first reader back run the watermark
    ahead and send the others' events to the DLQ as late (docs/pipeline.md)."""
    return {**_env(bootstrap, tmp_path, name), "STREAMREC_FLINK__IDLE_TIMEOUT_S": "300"}


def _loop_env(bootstrap: str, tmp_path: Path, name: str, serve_port: int) -> dict:
    """One isolated loop: the job's topics and checkpoints, a trainer publishing every 2 s and a
    serving node over the same store."""
    store = str(tmp_path / "models")
    return {**_fault_env(bootstrap, tmp_path, name), "FLINK_LOG_DIR": str(tmp_path / "flink-log"),
            "STREAMREC_TOPICS__MODEL_UPDATES": f"{name}.model-updates",
            "STREAMREC_TRAINER__MODEL_STORE": store, "STREAMREC_TRAINER__WORK_DIR": str(tmp_path / "trainer"),
            "STREAMREC_TRAINER__GROUP": name, "STREAMREC_TRAINER__PUBLISH_INTERVAL_S": "2",
            "STREAMREC_TRAINER__WARMUP_SAMPLES": "500", "STREAMREC_TRAINER__BATCH_SIZE": "256",
            "STREAMREC_SERVING__MODEL_STORE": store, "STREAMREC_SERVING__PORT": str(serve_port),
            "STREAMREC_SERVING__POLL_INTERVAL_S": "0.5",
            "STREAMREC_SERVING__FEATURE_STORE_DIR": str(tmp_path / "serving-features"),
            "OMP_NUM_THREADS": "1"}


def _http(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except OSError:
        return 0, {}


def test_ten_kill_9s_of_the_broker_lose_nothing_and_every_process_recovers(tmp_path):
    kafka = EmbeddedBroker(tmp_path / "kafka", port=free_port())
    bootstrap = kafka.up(timeout_s=60)[0].bootstrap
    name, serve_port = f"k9-{uuid.uuid4().hex[:8]}", free_port()
    env = _loop_env(bootstrap, tmp_path, name, serve_port)
    with ExitStack() as stack:
        stack.callback(kafka.down)
        job = _submit_in_background(env, "--fresh")
        stack.callback(_stop, job)
        _wait_job_running(env, job, name)
        processes = {"trainer": _start(env, tmp_path / "trainer.log", "train"),
                     "serving": _start(env, tmp_path / "serving.log", "serve", "--host", "127.0.0.1")}
        for proc in processes.values():
            stack.callback(_stop, proc)
        gen_log = tmp_path / "generate.log"
        gen = _start(env, gen_log, "generate", "--duration", "600", "--rate", "300", "--seed", "3")  # stopped after the kills
        stack.callback(_stop, gen)
        _wait_for(lambda: _end_offsets(bootstrap, f"{name}.samples", "read_committed") > 300, 120, "the job's first samples")

        outages, inside_a_transaction = [], 0
        for kill in range(10):
            events_before = _end_offsets(bootstrap, f"{name}.events")
            inside_a_transaction += bool(open_transactions(bootstrap, [f"{name}.samples"]))
            killed_at = time.monotonic()
            kafka.kill_node(1)
            time.sleep(2)
            kafka.up(timeout_s=60)
            # the generator writes again before the next kill
            assert gen.poll() is None, f"the generator ended before kill {kill + 1}: {gen_log.read_text()[-2000:]}"
            _wait_for(lambda: _end_offsets(bootstrap, f"{name}.events") > events_before + 100, 60,
                      f"events flowing again after kill {kill + 1}")
            outages.append(time.monotonic() - killed_at)
        print("kill -9 to events flowing again, s:", " ".join(f"{s:.1f}" for s in outages))
        # the job's sink had samples in an open transaction when the broker died: the kills hit
        # the exactly-once path, not a quiet moment between checkpoints
        assert inside_a_transaction >= 3, f"only {inside_a_transaction} of 10 kills found a transaction open"
        last_up = time.time()
        events_before = _end_offsets(bootstrap, f"{name}.events")
        _wait_for(lambda: _end_offsets(bootstrap, f"{name}.events") > events_before + 1500, 60, "5 s of events after the kills")
        gen.terminate()  # ends the run after its current tick, every event confirmed
        assert gen.wait(timeout=60) == 0, gen_log.read_text()[-3000:]
        acknowledged = _generated(gen_log)
        assert _distinct_events(bootstrap, f"{name}.events") == acknowledged

        try:
            assert _assert_exact_samples(bootstrap, name, job, tmp_path / "flink-log") > 5000
            missing = 0
        except AssertionError:
            if "aborted a hanging Kafka transaction" not in _job_output(job):
                raise
            missing = _samples_short_only_by_aborts(bootstrap, name)
        aborted = _job_output(job).count("aborted a hanging Kafka transaction")
        print("hanging transactions the runner aborted:", aborted)
        store = ModelStore(env["STREAMREC_TRAINER__MODEL_STORE"], "ctr")
        _wait_for(lambda: any(store.manifest(v)["created_at"] > last_up for v in store.versions()), 120,
                  "a version published after the last restart", lambda: (tmp_path / "trainer.log").read_text()[-2000:])
        base = f"http://127.0.0.1:{serve_port}"
        _wait_for(lambda: _http(f"{base}/v1/models/ctr")[1].get("model_version") == store.versions()[-1], 60,
                  "the node serving the newest version", lambda: (tmp_path / "serving.log").read_text()[-2000:])
        assert _http(f"{base}/readyz")[0] == 200
        status = run_cli("pipeline", "status", "--json", env=env)
        assert status.returncode == 0 and [j["state"] for j in json.loads(status.stdout)] == ["RUNNING"], status.stdout
        assert all(p.poll() is None for p in (job, *processes.values())), {n: p.poll() for n, p in processes.items()}
    if missing:  # everything else held; the one known way samples go missing (docs/pipeline.md)
        pytest.xfail(f"known defect: the sweep aborted {aborted} hanging transactions holding {missing:,} samples")


def _leader_of_most(bootstrap: str, topic: str) -> tuple[int, dict[int, int]]:
    """The node leading most of ``topic``'s partitions, and each partition's in-sync replica count."""
    admin = make_admin(bootstrap)
    try:
        (described,) = admin.describe_topics([topic])
    finally:
        admin.close()
    leaders = [p["leader_id"] for p in described["partitions"]]
    return max(set(leaders), key=leaders.count), {p["partition_index"]: len(p["isr_nodes"]) for p in described["partitions"]}


def test_a_three_node_cluster_rides_out_the_samples_leader_s_kill_9(tmp_path):
    port, data = _free_ports(3), tmp_path / "kafka"
    flags = ["--brokers", "3", "--port", str(port), "--data-dir", str(data)]
    up = run_cli("kafka", "up", *flags, timeout=180)
    kafka = EmbeddedBroker(data, port=port, brokers=3)
    with ExitStack() as stack:
        stack.callback(kafka.down)
        assert up.returncode == 0 and "(3 nodes" in up.stdout, up.stdout + up.stderr
        bootstrap = kafka.status().bootstrap
        admin = make_admin(bootstrap)
        try:
            (events,) = admin.describe_topics(["streamrec.events"])
            assert {len(p["replica_nodes"]) for p in events["partitions"]} == {3}
        finally:
            admin.close()

        name = f"ha-{uuid.uuid4().hex[:8]}"
        env = _fault_env(bootstrap, tmp_path, name)
        job = _submit_in_background(env, "--fresh")
        stack.callback(_stop, job)
        _wait_job_running(env, job, name)
        gen_log = tmp_path / "generate.log"
        gen = _start(env, gen_log, "generate", "--duration", "600", "--rate", "300", "--seed", "4")  # stopped 35 s after the kill
        stack.callback(_stop, gen)
        samples = f"{name}.samples"
        _wait_for(lambda: _end_offsets(bootstrap, samples, "read_committed") > 300, 120, "the job's first samples")

        leader, _ = _leader_of_most(bootstrap, samples)
        kafka.kill_node(leader)
        killed_at, last_growth, count, stalls = time.monotonic(), time.monotonic(), 0, []
        while time.monotonic() - killed_at < 35:  # the committed samples keep growing: no stall over 30 s
            assert gen.poll() is None, gen_log.read_text()[-3000:]
            now_count = _end_offsets(bootstrap, samples, "read_committed")
            if now_count > count:
                stalls.append(time.monotonic() - last_growth)
                count, last_growth = now_count, time.monotonic()
            assert time.monotonic() - last_growth < 30, f"no sample committed for 30 s after node {leader}'s kill"
            time.sleep(0.5)
        gen.terminate()  # ends the run after its current tick, every event confirmed
        assert gen.wait(timeout=60) == 0, gen_log.read_text()[-3000:]
        assert count > 0
        assert _distinct_events(bootstrap, f"{name}.events") == _generated(gen_log)
        assert _assert_exact_samples(bootstrap, name, job) > 3000

        assert run_cli("kafka", "up", *flags, timeout=180).returncode == 0  # the killed node rejoins ...
        _wait_for(lambda: set(_leader_of_most(bootstrap, samples)[1].values()) == {3}, 120,
                  "every samples partition back to 3 in-sync replicas")  # ... and catches up
        print(f"longest wait between committed samples after the kill: {max(stalls):.1f} s")
