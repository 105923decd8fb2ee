"""The embedded Kafka's lifecycle through the real CLI: up, status, down, errors, persistence."""

import json
import socket
import threading

import pytest

from streamrec.plumbing.bus.broker import EmbeddedBroker
from streamrec.plumbing.processes import process_alive
from streamrec.plumbing.bus.clients import BusUnavailable, make_admin, make_consumer, make_producer
from tests.conftest import CheckedProducer, free_port, read_topic, run_cli


def _flags(port: int, data_dir) -> list[str]:
    return ["--port", str(port), "--data-dir", str(data_dir)]


def test_up_status_down_cycle(tmp_path):
    port, data = free_port(), tmp_path / "kafka"
    up = run_cli("kafka", "up", "--partitions", "3", *_flags(port, data))
    assert up.returncode == 0, up.stderr
    assert f"embedded Kafka started: 127.0.0.1:{port} (one node" in up.stdout
    assert "topic streamrec.events: created" in up.stdout
    try:
        pid = json.loads((data / "node-1" / "broker.pid").read_text())["pid"]
        assert process_alive(pid)
        again = run_cli("kafka", "up", *_flags(port, data))
        assert again.returncode == 0 and "already running" in again.stdout and "exists" in again.stdout

        status = run_cli("kafka", "status", "--json", *_flags(port, data))
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["running"] and report["pid"] == pid
        topics = {t["name"]: t["partitions"] for t in report["topics"]}
        assert topics == {
            "streamrec.events": 3, "streamrec.events.dlq": 3, "streamrec.samples": 3,
            "streamrec.model-updates": 3, "streamrec.truth": 3, "streamrec.features": 3, "streamrec.predictions": 3,
        }
    finally:
        down = run_cli("kafka", "down", *_flags(port, data))
    assert down.returncode == 0 and "stopped" in down.stdout
    assert not process_alive(pid)
    assert not (data / "node-1" / "broker.pid").exists()
    with socket.socket() as sock:  # the port is free again
        sock.bind(("127.0.0.1", port))
    assert "not running" in run_cli("kafka", "down", *_flags(port, data)).stdout
    status = run_cli("kafka", "status", *_flags(port, data))
    assert status.returncode == 1 and "not running" in status.stdout


def test_port_taken_gives_clear_error(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_cli("kafka", "up", *_flags(port, tmp_path))
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "node-1" / "broker.pid").exists()


def test_missing_jars_or_java_give_clear_errors(tmp_path):
    """Without the resolved jars `up` names the set-up step; without a JVM, what to install."""
    result = run_cli("kafka", "up", *_flags(free_port(), tmp_path / "a"), env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is missing: run `streamrec setup kafka`" in result.stderr
    result = run_cli("kafka", "up", *_flags(free_port(), tmp_path / "b"), env={"PATH": str(tmp_path), "JAVA_HOME": ""})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "`java` not found" in result.stderr


def test_unreachable_external_broker_gives_clear_error():
    result = run_cli("--bootstrap", f"127.0.0.1:{free_port()}", "kafka", "status",
                     env={"STREAMREC_KAFKA__CONNECT_TIMEOUT_S": "2"}, timeout=60)
    assert result.returncode == 2
    assert "cannot reach Kafka at 127.0.0.1:" in result.stderr and "Traceback" not in result.stderr


def test_clients_that_cannot_reach_the_broker_leave_no_thread_behind():
    """A node retries its consumer through a broker outage: each failed attempt must not
    leave kafka-python's network thread running (thousands of threads over a long outage)."""
    def network_threads() -> int:
        return sum(t.name.startswith("kafka-io") for t in threading.enumerate())

    before, address = network_threads(), f"127.0.0.1:{free_port()}"
    for attempt in range(3):
        for make in (lambda: make_consumer(address, group_id=None, timeout_s=0.5), lambda: make_producer(address, timeout_s=0.5),
                     lambda: make_admin(address, timeout_s=0.5)):
            with pytest.raises(BusUnavailable):
                make()
    assert network_threads() == before


def test_down_refuses_external_cluster():
    result = run_cli("--bootstrap", "kafka.example:9092", "kafka", "down")
    assert result.returncode == 2 and "not managed by streamrec" in result.stderr


def test_data_survives_a_restart(tmp_path, monkeypatch):
    """Also: a cluster id that starts with "-" (one in 64 of the random ones) formats fine."""
    monkeypatch.setattr("streamrec.plumbing.bus.broker._new_cluster_id", lambda: "-Yx2kQh0Tj6s8E3nN1oWbA")
    broker = EmbeddedBroker(tmp_path, port=free_port())
    state, _ = broker.up()
    try:
        producer = CheckedProducer(state.bootstrap)
        for i in range(50):
            producer.send("persist", key=b"k", value=f"m{i}".encode())
        producer.flush()
        producer.close()
        assert broker.down()
        state, started = broker.up()
        assert started
        values = [r.value.decode() for r in read_topic(state.bootstrap, "persist")]
        assert values == [f"m{i}" for i in range(50)]
    finally:
        broker.down()


def test_stale_pid_file_is_ignored(tmp_path):
    broker = EmbeddedBroker(tmp_path, port=free_port())
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"cluster_id": "x", "host": "127.0.0.1", "kafka_version": "4", "nodes": [{"node_id": 1, "port": broker.port, "controller_port": 1}]}))
    (tmp_path / "node-1").mkdir()
    (tmp_path / "node-1" / "broker.pid").write_text(json.dumps({"pid": 2 ** 22 + 12345, "started_at": 0}))
    assert broker.status() is None
    assert not (tmp_path / "node-1" / "broker.pid").exists()


def test_a_data_dir_of_another_layout_is_refused(tmp_path):
    """A data dir holds one cluster: asking it for another node count says so, and starts nothing."""
    one = EmbeddedBroker(tmp_path, port=free_port())
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"cluster_id": "x", "host": "127.0.0.1", "kafka_version": "4", "nodes": [{"node_id": 1, "port": one.port, "controller_port": 1}]}))
    result = run_cli("kafka", "up", "--brokers", "3", *_flags(one.port, tmp_path))
    assert result.returncode == 2 and "holds a 1-node cluster" in result.stderr and "Traceback" not in result.stderr
