"""`streamrec generate` against a broker that dies and stays down: the events the producer
gives up on are counted, shown on the progress line, and fail the run (exit 3), never a
quiet exit 0 with a frozen topic; every event it counted acknowledged is in the topic, and
an --atomic run's events never become visible to read_committed readers.

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
from pathlib import Path

import orjson
import pytest
from kafka import TopicPartition

from streamrec.plumbing.bus.broker import EmbeddedBroker, free_port
from streamrec.plumbing.processes import process_alive
from streamrec.plumbing.bus.clients import make_consumer
from tests.conftest import REPO, read_topic

pytestmark = pytest.mark.slow

CONNECT_TIMEOUT_S = 2  # the producer gives up on a record 6 x this (12 s) after sending it
RESTART_CONNECT_TIMEOUT_S = 10  # 60 s: a broker restart on a loaded box fits in it
EVENTS_TOPIC = "streamrec.events"


def _events_in_topic(bootstrap: str, committed: bool = False) -> int:
    """The topic's end offsets summed: all records written, or (``committed``) up to the last
    stable offset, which an open transaction holds back at its first record."""
    consumer = make_consumer(bootstrap, group_id=None, timeout_s=5,
                             isolation_level="read_committed" if committed else "read_uncommitted")
    try:
        parts = [TopicPartition(EVENTS_TOPIC, p) for p in sorted(consumer.partitions_for_topic(EVENTS_TOPIC) or [])]
        return sum(consumer.end_offsets(parts).values()) if parts else 0
    finally:
        consumer.close()


def _number(text: str) -> int:
    return int(text.replace(",", ""))


@contextmanager
def _generating(tmp_path, duration_s: int, *flags: str, connect_timeout_s: float = CONNECT_TIMEOUT_S):
    """A broker of its own and `streamrec generate` at 300 events/s into it, once the first
    second of events is in the topic; yields (broker, its state, the process, its stdout/stderr paths)."""
    broker = EmbeddedBroker(tmp_path / "kafka", port=free_port())
    state, started = broker.up(timeout_s=30)
    assert started
    env = {**os.environ, "STREAMREC_KAFKA__BOOTSTRAP": state.bootstrap,
           "STREAMREC_KAFKA__CONNECT_TIMEOUT_S": str(connect_timeout_s)}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamrec.cli", "generate", "--rate", "300", "--duration", str(duration_s), "--seed", "5", *flags],
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
    while process_alive(state.pid):
        time.sleep(0.05)


def _event_ids(bootstrap: str, committed: bool) -> set[str]:
    return {orjson.loads(r.value)["event_id"] for r in read_topic(bootstrap, EVENTS_TOPIC, committed=committed)}


@pytest.mark.parametrize("atomic", [False, True], ids=["at-least-once", "atomic"])
def test_events_lost_in_a_broker_outage_fail_the_run(tmp_path: Path, atomic: bool):
    """Exit 3 with the loss counted, and nothing acknowledged is missing once the broker is back
    (restarted on its data dir). An --atomic run's transaction cannot be aborted while the broker
    is down: the run gives up on the abort after the request timeout, and read_committed readers
    of the restarted broker see none of its events (the broker aborts the transaction itself
    after its timeout, docs/generator.md)."""
    with _generating(tmp_path, 90, *(["--atomic"] if atomic else [])) as (broker, state, proc, out, err):
        delivered = _events_in_topic(state.bootstrap)
        _kill(state)  # and it stays down, past the producer's delivery timeout
        killed_at = time.monotonic()
        returncode = proc.wait(timeout=60)
        took_s = time.monotonic() - killed_at
        assert broker.up(timeout_s=60)[1], "the broker did not come back on its data dir"
        in_topic = _event_ids(state.bootstrap, committed=False)
        visible = _event_ids(state.bootstrap, committed=True) if atomic else set()
    out, err = out.read_text(), err.read_text()

    assert returncode == 3, f"exit {returncode}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lost = re.search(r"streamrec: error: ([\d,]+) of ([\d,]+) events.* were not delivered to Kafka: [^(]*\((.*?)\)", err)
    assert lost, err[-3000:]
    n_lost, n_sent = _number(lost[1]), _number(lost[2])
    assert 0 < n_lost <= n_sent and n_sent > delivered
    assert lost[3] == ("the run's transaction was not committed: read_committed consumers see none of its events" if atomic
                       else f"they are missing from {EVENTS_TOPIC}")
    # the progress line said so before the run ended, with the delivered count apart from the sent one
    progress = re.findall(r"generate -> Kafka .*?, ([\d,]+) events sent, ([\d,]+) delivered \([\d,]+ events/s\), ([\d,]+) failed", err)
    assert progress and _number(progress[-1][2]) > 0, err[-3000:]
    sent_then, delivered_then, failed_then = map(_number, progress[-1])
    assert delivered_then + failed_then <= sent_then and delivered_then < sent_then
    assert "impressions" not in out  # no success summary
    # the delivery timeout (12 s), a tick, the rest of what was in flight; atomic: the abort's 5 s
    assert took_s < (45 if atomic else 40)
    assert len(in_topic) >= n_sent - n_lost, f"{len(in_topic)} distinct events in the topic, {n_sent - n_lost} acknowledged"
    if atomic:
        assert "aborting the run's Kafka transaction failed (no answer from Kafka within 5 s)" in err, err[-3000:]
        assert not visible, f"read_committed readers saw {len(visible)} events of an aborted run"


def test_a_broker_restart_within_the_delivery_timeout_loses_nothing(tmp_path):
    """Retries cover a short outage (kill -9, restart): the run ends with exit 0 and every
    event it counted acknowledged is in the topic, once per event id or more (at-least-once)."""
    with _generating(tmp_path, 15, connect_timeout_s=RESTART_CONNECT_TIMEOUT_S) as (broker, state, proc, out, err):
        _kill(state)
        time.sleep(3)
        restarted_at = time.monotonic()
        assert broker.up(timeout_s=45)[1], "the broker did not come back on its data dir"
        print(f"the broker took {time.monotonic() - restarted_at:.1f} s to restart")
        returncode = proc.wait(timeout=120)
        event_ids = _event_ids(state.bootstrap, committed=False)
    out, err = out.read_text(), err.read_text()

    assert returncode == 0, f"exit {returncode}\n{err[-3000:]}"
    assert "not delivered" not in err and "Traceback" not in err, err[-3000:]
    summary = re.search(r"run \S+ seed 5: ([\d,]+) events in", out)
    assert summary, out
    assert len(event_ids) == _number(summary[1]), f"{len(event_ids)} distinct events in the topic, {summary[1]} acknowledged"
