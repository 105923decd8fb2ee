"""Shared fixtures: a real embedded broker for the session, free ports, the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq
import pytest
from filelock import FileLock
from kafka import TopicPartition

from streamrec.generator.world import WorldConfig
from streamrec.plumbing.bus.broker import EmbeddedBroker, free_port  # noqa: F401 - tests import it from here
from streamrec.plumbing.bus.clients import make_consumer, make_producer
from streamrec.plumbing.config import default_config_text

REPO = Path(__file__).resolve().parent.parent

# The suite's JVMs (Kafka nodes, the Flink mini-cluster of each job) live seconds to minutes on
# small inputs: the C1 compiler alone, and for Flink the serial collector, spend about a third
# less CPU on each than the C2 compiler and parallel GC (the defaults, for long runs at full
# speed). Set for every process the tests start; a value from the environment wins.
os.environ.setdefault("KAFKA_OPTS", "-XX:TieredStopAtLevel=1")
os.environ.setdefault("STREAMREC_FLINK__JVM_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")

# With pytest-xdist workers taking whole files in collection order (`--dist loadfile
# --no-loadscope-reorder`, README), the files that take longest come first, so no worker is
# left with a long one at the end.
LONGEST_FIRST = ("test_pipeline_job.py", "test_store_safety.py", "test_distributed.py", "test_trainer_kafka.py",
                 "test_serving_http.py", "test_trainer.py", "test_online_features.py", "test_reader.py",
                 "test_prediction_log.py", "test_trainer_disk_full.py", "test_ps.py", "test_generator_delivery.py",
                 "test_broker.py")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 120, output: Callable[[], str] | None = None) -> None:
    """Until the serving node at ``base`` answers ``/readyz`` with 200; its output if it exits
    first (``output()``: what a reader thread of its stdout has collected, if one does)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=10) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (
            output() if output else proc.stdout.read() if proc.poll() is not None else "not ready")
        time.sleep(0.2)


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real `streamrec` entry point in a subprocess (as a user would)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "streamrec.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO,
    )


class CheckedProducer:
    """A producer whose ``flush``/``close`` fail the test when Kafka refused or never
    acknowledged a record sent through it: a test that then counts records counts real ones."""

    def __init__(self, broker: str, **settings) -> None:
        self._producer = make_producer(broker, **settings)
        self._pending: list = []

    def send(self, topic: str, **kwargs):
        future = self._producer.send(topic, **kwargs)
        self._pending.append(future)
        return future

    def flush(self, timeout: float = 60) -> None:
        self._producer.flush(timeout=timeout)
        pending, self._pending = self._pending, []
        for future in pending:
            future.get(timeout=timeout)  # raises the send's own error

    def close(self) -> None:
        self.flush()
        self._producer.close()

    def __getattr__(self, name: str):  # transactions and the rest: the producer's own
        return getattr(self._producer, name)


def read_topic(broker: str, topic: str, committed: bool = True, timeout_s: float = 60) -> list:
    """Every record a topic shows a reader now: read to its end offsets, not to a quiet spell.

    ``committed``: read_committed, whose end is the last stable offset (an open transaction's
    records are not there yet); otherwise the high watermark. Reading "until nothing came for
    a while" undercounts on a loaded machine and was flaky.
    """
    consumer = make_consumer(broker, group_id=None, auto_offset_reset="earliest",
                             isolation_level="read_committed" if committed else "read_uncommitted")
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        if not parts:
            return []
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        end = consumer.end_offsets(parts)
        out, deadline = [], time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in parts):
            assert time.monotonic() < deadline, f"could not read {topic} to its end in {timeout_s} s"
            for records in consumer.poll(500).values():
                out.extend(records)
        return out
    finally:
        consumer.close()


S3_BUCKET = "streamrec-models"


@pytest.fixture(scope="module")
def s3_endpoint():
    """A real S3 API server (moto's, over HTTP) with the bucket S3_BUCKET; yields host:port."""
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    endpoint = f"127.0.0.1:{port}"
    pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1",
                      allow_bucket_creation=True).create_dir(S3_BUCKET)
    yield endpoint
    server.stop()


@pytest.fixture(scope="session")
def broker(tmp_path_factory) -> str:
    """One embedded Apache Kafka node for the whole session; yields its bootstrap address."""
    embedded = EmbeddedBroker(tmp_path_factory.mktemp("kafka"), port=free_port())
    state, started = embedded.up(timeout_s=60)
    assert started
    yield state.bootstrap
    embedded.down()


@pytest.fixture(scope="session")
def world_config() -> WorldConfig:
    return WorldConfig(**tomllib.loads(default_config_text())["generator"]["world"])


def make_sample_run(path: Path, duration_s: int, seed: int = 11, rate: int = 3000) -> Path:
    """A generator run with samples.parquet built by the reference pipeline."""
    result = run_cli("generate", "--out", str(path), "--duration", str(duration_s), "--rate", str(rate), "--seed", str(seed),
                     "--start-ms", "1700000000000")
    assert result.returncode == 0, result.stderr
    result = run_cli("pipeline", "offline", str(path))
    assert result.returncode == 0, result.stderr
    return path


@contextmanager
def built_once(tmp_path_factory, name: str):
    """A directory every test worker shares (pytest-xdist runs several): the first worker to
    get the lock builds into it (the body runs when it holds no ``.done`` mark), the others
    wait for it and reuse what it built. Yields (directory, whether to build)."""
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else tmp_path_factory.getbasetemp()
    path, done = shared / name, shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        path.mkdir(exist_ok=True)
        yield path, not done.exists()
        done.touch()


@pytest.fixture(scope="session")
def sample_run(tmp_path_factory) -> Path:
    """60 s of traffic (~175k samples) with truth and samples."""
    with built_once(tmp_path_factory, "samples") as (root, build):
        if build:
            make_sample_run(root / "run", 60)
    return root / "run"


@pytest.fixture(scope="session")
def published_model(sample_run, tmp_path_factory):
    """(model store root, versions): a trainer's full version followed by a chain of deltas."""
    from streamrec.modelstore.store import ModelStore
    from streamrec.plumbing.config import load_config
    from streamrec.trainer.driver import Trainer, TrainOptions

    with built_once(tmp_path_factory, "published") as (root, build):
        if build:
            cfg = load_config(overrides={"trainer.model_store": str(root / "models"), "trainer.work_dir": str(root / "work"),
                                         "trainer.publish_interval_s": 0.3, "trainer.full_every": 1000,
                                         "trainer.warmup_samples": 10**9, "trainer.progress_interval_s": 3600.0,
                                         "trainer.device": "cpu"}, environ={})
            Trainer(cfg, TrainOptions(files=[str(sample_run)], max_samples=40000, progress=False)).run()
    store = ModelStore(str(root / "models"), "ctr")
    versions = store.versions()
    assert len(versions) >= 4 and store.manifest(versions[0])["kind"] == "full"
    assert all(store.manifest(v)["kind"] == "delta" for v in versions[1:])
    yield root / "models", versions
    assert store.pinned() is None, "a test pinned the shared store: give it copy_store(...) instead"


def copy_store(root: Path, dest: Path) -> Path:
    """A private copy of a shared model store, for tests that write pins or versions into it."""
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns("PIN"))
    return dest


def train_cli(out: Path, run: Path, *extra: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`streamrec train` on CPU over every sample of the file ``run``, into ``out/models`` and
    ``out/work``: a version every 3 s, no frozen baseline, one evaluation window over the whole
    run, the summary as JSON."""
    return run_cli("train", "--samples", str(run), "--model-store", str(out / "models"), "--work-dir", str(out / "work"),
                   "--device", "cpu", "--no-frozen", "--publish-interval", "3", "--json", *extra,
                   env={"STREAMREC_TRAINER__EVAL_WINDOW": "1000000", **(env or {})}, timeout=timeout)


@pytest.fixture(scope="session")
def same_steps_run(sample_run, tmp_path_factory) -> Path:
    """The run's first 96 steps of 1,024 samples in row groups of 512 rows (``pipeline offline
    --row-group-rows 512``): each rank's batch of 512 is a whole group, so two ranks train
    exactly the steps of one rank at 1024 (docs/distributed.md), the last one included."""
    with built_once(tmp_path_factory, "same_steps") as (root, build):
        if build:
            pq.write_table(pq.read_table(sample_run / "samples.parquet").slice(0, 96 * 1024), root / "samples.parquet",
                           compression="zstd", row_group_size=512)
    return root / "samples.parquet"


@pytest.fixture(scope="session")
def two_ranks_run(same_steps_run, tmp_path_factory) -> tuple[Path, dict]:
    """Two gloo ranks (``--nproc-per-node 2``) at 512 samples a step each over every sample of
    ``same_steps_run`` (tests/test_distributed.py compares them with one rank, the launch
    test with two torchrun launchers): (the directory of their ``models`` and ``work``, the
    run's summary)."""
    with built_once(tmp_path_factory, "two_ranks") as (root, build):
        if build:
            done = train_cli(root, same_steps_run, "--batch-size", "512", "--nproc-per-node", "2")
            assert done.returncode == 0, done.stderr[-3000:]
            (root / "summary.json").write_text(done.stdout)
    return root, json.loads((root / "summary.json").read_text())
