"""The embedded runner's sweep for hanging transactions (pipelines/hanging.py and the job's
HangingTransactions.java), against the real broker: a transaction its coordinator has open
is never aborted, however old; the sweep only reads when nothing hangs."""

from __future__ import annotations

import threading
import uuid
from dataclasses import replace

import pytest

from streamrec.pipelines import hanging
from streamrec.pipelines.flink_runner import RunOptions, job_jars
from streamrec.pipelines.hanging import HangingTransactionSweeper
from streamrec.plumbing.bus.clients import make_producer
from streamrec.plumbing.bus.topics import ensure_topics, open_transactions
from streamrec.plumbing.config import load_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def jars(tmp_path_factory) -> list[str]:
    """The job's jar URLs, as `pipeline submit` loads them."""
    return job_jars(replace(RunOptions.from_config(load_config()), checkpoint_dir=tmp_path_factory.mktemp("checkpoints")))


def _sweep_on_a_thread(sweeper: HangingTransactionSweeper) -> list[str]:
    """One sweep on a thread of its own, as the runner's sweeper thread makes it."""
    done: list = []
    thread = threading.Thread(target=lambda: done.append(sweeper.sweep()))
    thread.start()
    thread.join(60)
    assert done, "the sweep raised or hung (its thread's output above)"
    return done[0]


def test_an_open_transaction_its_coordinator_knows_is_never_aborted(broker, jars, monkeypatch):
    topic = f"hang-{uuid.uuid4().hex[:8]}"
    ensure_topics(broker, [topic], 2)
    producer = make_producer(broker, transactional_id=topic)
    producer.init_transactions()
    producer.begin_transaction()
    producer.send(topic, partition=1, value=b"in a transaction").get(timeout=30)
    try:
        assert open_transactions(broker, [topic]) == [f"{topic}:1"]
        monkeypatch.setattr(hanging, "MIN_AGE_S", 0.0)  # old enough at once: only the coordinator's answer keeps it
        assert _sweep_on_a_thread(HangingTransactionSweeper(broker, [topic], jars)) == []
        assert open_transactions(broker, [topic]) == [f"{topic}:1"]
        producer.commit_transaction()
        assert _sweep_on_a_thread(HangingTransactionSweeper(broker, [topic], jars)) == []
        assert open_transactions(broker, [topic]) == []
    finally:
        producer.close(timeout=10)
