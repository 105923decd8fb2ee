"""The embedded Apache Kafka for laptops, tests and CI: one KRaft node, or a local cluster.

Each node is one JVM running ``kafka.Kafka`` in combined mode (broker and controller) on
loopback, in its own process group (``start_new_session``), so it outlives the command that
started it and ``down`` stops it whole. The jars come from Maven Central through
``kafka_dist`` (resolved once into the user cache). Under ``data_dir``:

- ``cluster.json``: the cluster id and each node's id and ports, fixed when the cluster is
  first formatted (a restart reuses them: Kafka's own metadata remembers them);
- ``log4j2.yaml``: the nodes' logging (warnings and the start-up line);
- ``node-<id>/``: ``server.properties``, ``data/`` (the node's log dirs and metadata log),
  ``broker.log`` and ``broker.pid`` (JSON: pid, started_at).

A node that died (``kill -9``) is started again by the next ``up``; its data is recovered
by Kafka itself.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import shlex
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from streamrec.plumbing.bus.clients import make_admin
from streamrec.plumbing.processes import process_alive
from streamrec.plumbing.bus.kafka_dist import KAFKA_VERSION, KafkaJarsError, default_jars_dir, java_binary, verify_kafka_jars


class BrokerError(RuntimeError):
    """The embedded Kafka could not be started, found or stopped."""


@dataclass(frozen=True)
class NodeState:
    node_id: int
    port: int
    controller_port: int
    pid: int | None  # None: not running


@dataclass(frozen=True)
class BrokerState:
    """The embedded cluster as found: its nodes, running or not."""

    host: str
    data_dir: str
    nodes: tuple[NodeState, ...]

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{self.host}:{n.port}" for n in self.nodes)

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes if n.pid is not None]

    @property
    def pid(self) -> int | None:
        """The first running node's pid (the only one of a single-node broker)."""
        return self.pids[0] if self.pids else None

    @property
    def running(self) -> bool:
        return all(n.pid is not None for n in self.nodes)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it), for a child server to bind."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on host:port (SO_REUSEADDR ignores TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise BrokerError(f"cannot use {host}:{port}: {exc}") from None
    return False


def _new_cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()


LOG4J2 = """\
Configuration:
  Appenders:
    Console:
      name: STDOUT
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
  Loggers:
    Root:
      level: WARN
      AppenderRef:
        - ref: STDOUT
    Logger:
      - name: kafka.server.KafkaRaftServer
        level: INFO
"""


class EmbeddedBroker:
    """Start, stop and inspect the embedded Kafka: ``brokers`` KRaft nodes on loopback, node
    ``i`` listening on ``port + i`` (clients) and a controller port chosen when the cluster is
    formatted."""

    def __init__(self, data_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 9092, brokers: int = 1,
                 heap_mb: int = 512, jars_dir: str | os.PathLike | None = None) -> None:
        if brokers < 1:
            raise BrokerError(f"brokers must be at least 1, not {brokers}")
        self.data_dir = Path(data_dir).resolve()
        self.host, self.port, self.brokers, self.heap_mb = host, port, brokers, heap_mb
        self.jars_dir = Path(jars_dir) if jars_dir else default_jars_dir()
        self.layout_file = self.data_dir / "cluster.json"

    # ------------------------------------------------------------------ layout
    def node_dir(self, node_id: int) -> Path:
        return self.data_dir / f"node-{node_id}"

    def _layout(self) -> dict | None:
        try:
            layout = json.loads(self.layout_file.read_text())
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise BrokerError(f"{self.layout_file} is unreadable ({exc}); remove {self.data_dir} if no broker runs") from None
        nodes = layout["nodes"]
        if len(nodes) != self.brokers or nodes[0]["port"] != self.port or layout["host"] != self.host:
            raise BrokerError(
                f"{self.data_dir} holds a {len(nodes)}-node cluster on {layout['host']}:{nodes[0]['port']}, not the "
                f"{self.brokers}-node one on {self.host}:{self.port} asked for; use its settings, another --data-dir, "
                f"or remove {self.data_dir} (its topics go with it)")
        return layout

    def _new_layout(self) -> dict:
        nodes = []
        for i in range(self.brokers):
            port = self.port + i
            if port_in_use(self.host, port):
                raise BrokerError(
                    f"port {port} on {self.host} is already in use by another process; stop it, or pick another port "
                    f"(--port / kafka.embedded_port), or use that broker with --bootstrap {self.host}:{port}")
            nodes.append({"node_id": i + 1, "port": port, "controller_port": free_port(self.host)})
        return {"cluster_id": _new_cluster_id(), "host": self.host, "kafka_version": KAFKA_VERSION, "nodes": nodes}

    def _server_properties(self, layout: dict, node: dict) -> str:
        n = len(layout["nodes"])
        min_isr = 2 if n >= 3 else 1
        voters = ",".join(f"{m['node_id']}@{self.host}:{m['controller_port']}" for m in layout["nodes"])
        settings = {
            "process.roles": "broker,controller",
            "node.id": node["node_id"],
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://{self.host}:{node['port']},CONTROLLER://{self.host}:{node['controller_port']}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{node['port']}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.node_dir(node["node_id"]) / "data"),
            # every replica of every topic, the internal ones included; acks=all waits for min ISR
            "default.replication.factor": n,
            "min.insync.replicas": min_isr,
            "offsets.topic.replication.factor": n,
            "transaction.state.log.replication.factor": n,
            "transaction.state.log.min.isr": min_isr,
            "share.coordinator.state.topic.replication.factor": n,
            "share.coordinator.state.topic.min.isr": min_isr,
            # a local broker: fewer internal partitions start faster and cost less when idle
            "offsets.topic.num.partitions": 8,
            "transaction.state.log.num.partitions": 8,
            "group.initial.rebalance.delay.ms": 0,
            # A node back from a kill -9 waits for its old registration's session to end, so the
            # session is shorter than Kafka's 9 s; but a controller that misses its nodes'
            # heartbeats that long fences them (every partition leaderless until the next one),
            # and on a loaded 2-core box its events can take 5 s: 6 s, heartbeats every 0.5 s.
            "broker.session.timeout.ms": 6000,
            "broker.heartbeat.interval.ms": 500,
            # the producers' max_request_size (plumbing/bus/clients.py)
            "message.max.bytes": 8 * 2**20,
            # the job's exactly-once sinks take a new transactional id every checkpoint: kept an
            # hour, not Kafka's 7 days, an always-on local job's ids stay a few thousand
            "transactional.id.expiration.ms": 3_600_000,
        }
        return "".join(f"{k}={v}\n" for k, v in settings.items())

    def _prepare(self) -> dict:
        """The cluster's layout, formatting each node's storage the first time."""
        verify_kafka_jars(self.jars_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "log4j2.yaml").write_text(LOG4J2)
        layout = self._layout()
        if layout is None:
            layout = self._new_layout()
            tmp = self.layout_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(layout, indent=2))
            tmp.replace(self.layout_file)
        for node in layout["nodes"]:
            node_dir = self.node_dir(node["node_id"])
            node_dir.mkdir(exist_ok=True)
            (node_dir / "server.properties").write_text(self._server_properties(layout, node))
            if not (node_dir / "data" / "meta.properties").is_file():
                self._format(layout["cluster_id"], node_dir)
        return layout

    def _java(self, *args: str) -> list[str]:
        """A JVM command line for Kafka's ``args``; ``$KAFKA_OPTS`` adds JVM options, as in
        Kafka's own scripts (``-XX:TieredStopAtLevel=1``, say: quicker starts, slower peak)."""
        return [java_binary(), f"-Xmx{self.heap_mb}m", "-Xms64m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
                "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.yaml'}", *shlex.split(os.environ.get("KAFKA_OPTS", "")),
                "-cp", str(self.jars_dir / "*"), *args]

    def _format(self, cluster_id: str, node_dir: Path) -> None:
        # one argument each: a cluster id may start with "-" (URL-safe base64)
        cmd = self._java("kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}",
                         f"--config={node_dir / 'server.properties'}")
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise BrokerError(f"formatting Kafka's storage in {node_dir} failed:\n{(result.stdout + result.stderr).strip()[-2000:]}")

    # ------------------------------------------------------------------ processes
    def _node_pid(self, node_id: int) -> int | None:
        pid_file = self.node_dir(node_id) / "broker.pid"
        try:
            pid = int(json.loads(pid_file.read_text())["pid"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            raise BrokerError(f"PID file {pid_file} is unreadable ({exc}); remove it if no broker runs") from None
        if process_alive(pid):
            return pid
        pid_file.unlink(missing_ok=True)
        return None

    def status(self) -> BrokerState | None:
        """The embedded cluster with each node's pid (None: not running); None when no node runs."""
        layout = self._layout()
        if layout is None:
            return None
        nodes = tuple(NodeState(m["node_id"], m["port"], m["controller_port"], self._node_pid(m["node_id"]))
                      for m in layout["nodes"])
        state = BrokerState(self.host, str(self.data_dir), nodes)
        return state if state.pids else None

    def up(self, timeout_s: float = 30.0) -> tuple[BrokerState, bool]:
        """Start every node that is not running; wait until the cluster answers a metadata
        request that lists all its brokers. Returns the state and whether this call started
        any node."""
        try:
            layout = self._prepare()
        except KafkaJarsError as exc:
            raise BrokerError(str(exc)) from None
        started = []
        for node in layout["nodes"]:
            if self._node_pid(node["node_id"]) is None:
                started.append(self._start_node(node))
        try:
            self._wait_ready(started, timeout_s)
        except BaseException:
            for node_id, proc in started:
                self._stop_pid(proc.pid, 5.0)
                (self.node_dir(node_id) / "broker.pid").unlink(missing_ok=True)
            raise
        state = self.status()
        assert state is not None
        return state, bool(started)

    def _start_node(self, node: dict) -> tuple[int, subprocess.Popen]:
        for port in (node["port"], node["controller_port"]):
            if port_in_use(self.host, port):
                raise BrokerError(f"port {port} on {self.host}, node {node['node_id']}'s, is in use by another process; "
                                  f"stop it, or remove {self.data_dir} to lay the cluster out again")
        node_dir = self.node_dir(node["node_id"])
        with open(node_dir / "broker.log", "ab") as log:
            proc = subprocess.Popen(self._java("kafka.Kafka", str(node_dir / "server.properties")), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        tmp = node_dir / "broker.pid.tmp"
        tmp.write_text(json.dumps({"pid": proc.pid, "started_at": time.time()}))
        tmp.replace(node_dir / "broker.pid")
        return node["node_id"], proc

    def _wait_ready(self, started: list[tuple[int, subprocess.Popen]], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        bootstrap = ",".join(f"{self.host}:{self.port + i}" for i in range(self.brokers))
        while time.monotonic() < deadline:
            for node_id, proc in started:
                if proc.poll() is not None:
                    raise BrokerError(f"Kafka node {node_id} exited with code {proc.returncode} during start-up; "
                                      f"last log lines:\n{self.log_tail(node_id)}")
            if not all(port_in_use(self.host, self.port + i) for i in range(self.brokers)):
                time.sleep(0.1)  # not listening yet: a client now would back off for seconds
                continue
            try:
                admin = make_admin(bootstrap, timeout_s=max(1.0, min(5.0, deadline - time.monotonic())))
                try:
                    if len(admin.describe_cluster()["brokers"]) == self.brokers:
                        return
                finally:
                    admin.close()
            except Exception:  # noqa: BLE001 - not up yet (BusUnavailable, a Kafka error): ask again
                pass
            time.sleep(0.2)
        raise BrokerError(f"Kafka did not answer with all {self.brokers} broker(s) at {bootstrap} within {timeout_s:g}s; "
                          f"last log lines:\n" + "\n".join(self.log_tail(n) for n, _ in started))

    def kill_node(self, node_id: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to one node (a failover test's ``kill -9``); returns its pid."""
        pid = self._node_pid(node_id)
        if pid is None:
            raise BrokerError(f"Kafka node {node_id} is not running")
        os.killpg(pid, sig)
        deadline = time.monotonic() + 30
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        return pid

    def down(self, timeout_s: float = 30.0) -> bool:
        """Stop every node (SIGTERM, then SIGKILL); returns False when none was running."""
        state = self.status()
        if state is None:
            return False
        for node in state.nodes:
            if node.pid is not None:
                os.killpg(node.pid, signal.SIGTERM)
        for node in state.nodes:
            if node.pid is not None:
                self._stop_pid(node.pid, timeout_s)
                (self.node_dir(node.node_id) / "broker.pid").unlink(missing_ok=True)
        deadline = time.monotonic() + timeout_s
        while any(port_in_use(self.host, n.port) for n in state.nodes) and time.monotonic() < deadline:
            time.sleep(0.05)
        return True

    @staticmethod
    def _stop_pid(pid: int, timeout_s: float) -> None:
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if not process_alive(pid):
                    return
                time.sleep(0.05)
        raise BrokerError(f"Kafka process {pid} survived SIGKILL")

    def disk_bytes(self) -> int:
        """Bytes the cluster's nodes hold on disk (allocated blocks: index files are sparse)."""
        return sum(p.stat().st_blocks * 512 for p in self.data_dir.glob("node-*/data/**/*") if p.is_file())

    def log_tail(self, node_id: int = 1, lines: int = 20) -> str:
        try:
            text = (self.node_dir(node_id) / "broker.log").read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text[-lines:]) if text else "(empty log)"
