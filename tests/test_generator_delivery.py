"""`streamrec generate` against a broker that dies and stays down: the events the producer
gives up on are counted, shown on the progress line, and fail the run (exit 3), never a
quiet exit 0 with a frozen topic.

The test starts its own broker (own data dir and port): the session's broker is shared.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import orjson
import pytest
from kafka import TopicPartition

from streamrec.plumbing.bus.broker import EmbeddedBroker, _alive, free_port
from streamrec.plumbing.bus.clients import make_consumer
from tests.conftest import REPO, read_topic

pytestmark = pytest.mark.slow

CONNECT_TIMEOUT_S = 2  # the producer gives up on a record 6 x this (12 s) after sending it
EVENTS_TOPIC = "streamrec.events"


def _events_in_topic(bootstrap: str) -> int:
    consumer = make_consumer(bootstrap, group_id=None, timeout_s=5)
    try:
        parts = [TopicPartition(EVENTS_TOPIC, p) for p in sorted(consumer.partitions_for_topic(EVENTS_TOPIC) or [])]
        return sum(consumer.end_offsets(parts).values()) if parts else 0
    finally:
        consumer.close()


def _number(text: str) -> int:
    return int(text.replace(",", ""))


@contextmanager
def _generating(tmp_path, duration_s: int):
    """A broker of its own and `streamrec generate` at 300 events/s into it, once the first
    second of events is in the topic; yields (broker, its state, the process, its stdout/stderr paths)."""
    broker = EmbeddedBroker(tmp_path / "kafka", port=free_port())
    state, started = broker.up(timeout_s=30)
    assert started
    env = {**os.environ, "STREAMREC_KAFKA__BOOTSTRAP": state.bootstrap,
           "STREAMREC_KAFKA__CONNECT_TIMEOUT_S": str(CONNECT_TIMEOUT_S)}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamrec.cli", "generate", "--rate", "300", "--duration", str(duration_s), "--seed", "5"],
            stdout=stdout, stderr=stderr, env=env, cwd=REPO,
        )
    try:
        deadline = time.monotonic() + 30
        while _events_in_topic(state.bootstrap) < 300:
            assert proc.poll() is None, f"generate exited early:\n{err.read_text()}"
            assert time.monotonic() < deadline, "generate delivered nothing within 30 s"
            time.sleep(0.5)
        yield broker, state, proc, out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        broker.down()


def _kill(state) -> None:
    os.killpg(state.pid, signal.SIGKILL)  # the broker's whole process group
    while _alive(state.pid):
        time.sleep(0.05)


def test_events_lost_in_a_broker_outage_fail_the_run(tmp_path):
    with _generating(tmp_path, duration_s=90) as (broker, state, proc, out, err):
        delivered = _events_in_topic(state.bootstrap)
        _kill(state)  # and it stays down, past the producer's delivery timeout
        killed_at = time.monotonic()
        returncode = proc.wait(timeout=45)
        took_s = time.monotonic() - killed_at
    out, err = out.read_text(), err.read_text()

    assert returncode == 3, f"exit {returncode}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lost = re.search(r"streamrec: error: ([\d,]+) of ([\d,]+) events.* were not delivered to Kafka", err)
    assert lost, err[-3000:]
    n_lost, n_sent = _number(lost[1]), _number(lost[2])
    assert 0 < n_lost <= n_sent and n_sent > delivered
    # the progress line said so before the run ended, with the delivered count apart from the sent one
    progress = re.findall(r"generate -> Kafka .*: (\d+) events sent, (\d+) delivered \(\d+ events/s\), (\d+) failed", err)
    assert progress and int(progress[-1][2]) > 0, err[-3000:]
    sent_then, delivered_then, failed_then = map(int, progress[-1])
    assert delivered_then + failed_then <= sent_then and delivered_then < sent_then
    assert "impressions" not in out  # no success summary
    assert took_s < 40  # the delivery timeout (12 s), a tick, then the rest of what was in flight


def test_a_broker_restart_within_the_delivery_timeout_loses_nothing(tmp_path):
    """Retries cover a short outage (kill -9, restart): the run ends with exit 0 and every
    event it counted acknowledged is in the topic, once per event id or more (at-least-once)."""
    with _generating(tmp_path, duration_s=15) as (broker, state, proc, out, err):
        _kill(state)
        time.sleep(3)
        broker.up(timeout_s=60)
        returncode = proc.wait(timeout=60)
        event_ids = {orjson.loads(r.value)["event_id"] for r in read_topic(state.bootstrap, EVENTS_TOPIC, committed=False)}
    out, err = out.read_text(), err.read_text()

    assert returncode == 0, f"exit {returncode}\n{err[-3000:]}"
    assert "not delivered" not in err and "Traceback" not in err, err[-3000:]
    summary = re.search(r"run \S+ seed 5: ([\d,]+) events in", out)
    assert summary, out
    assert len(event_ids) == _number(summary[1]), f"{len(event_ids)} distinct events in the topic, {summary[1]} acknowledged"
