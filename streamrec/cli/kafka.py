"""`streamrec kafka up | down | prune | status`: the message bus."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from streamrec.cli.common import Commands, add_action
from streamrec.plumbing.config import Config


def add_parser(commands: Commands) -> None:
    kafka = commands.add("kafka", "start, stop and inspect the message bus", run)
    actions = kafka.add_subparsers(dest="kafka_command", metavar="ACTION", required=True)
    up = add_action(actions, "up", "start the embedded Kafka (unless --bootstrap) and create the topics",
                    "Start the embedded Apache Kafka (KRaft) on loopback, unless --bootstrap points at "
                    "an external cluster; start again any of its nodes that died; wait until every node "
                    "answers; create the streamrec topics.")
    up.add_argument("--partitions", type=int, help="partitions per topic (kafka.partitions)")
    prune = add_action(actions, "prune", "delete the topics of finished demo and bench runs",
                       "Delete topics whose names start with one of the prefixes (default: the "
                       "per-run topics of `demo` and `bench`: demo-, bench-). The configured topics "
                       "are never deleted.")
    prune.add_argument("--prefix", action="append", help="topic name prefix to delete (repeatable; default demo- and bench-)")
    down = add_action(actions, "down", "stop the embedded Kafka")
    status = add_action(actions, "status", "broker and topic status")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    for p in (up, prune, down, status):
        p.add_argument("--port", type=int, help="embedded Kafka's first port (kafka.embedded_port)")
        p.add_argument("--brokers", type=int, help="embedded Kafka nodes: 1, or 3 for a local cluster (kafka.embedded_brokers)")
        p.add_argument("--data-dir", help="embedded Kafka's data, log and PID directory (kafka.data_dir)")


def run(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.plumbing.bus.broker import EmbeddedBroker

    k = cfg.kafka
    broker = EmbeddedBroker(k.data_dir, k.embedded_host, k.embedded_port, k.embedded_brokers, k.embedded_heap_mb)
    action = {"up": up, "down": down, "prune": prune, "status": status}[args.kafka_command]
    return action(args, cfg, broker)


def up(args: argparse.Namespace, cfg: Config, broker) -> int:
    from streamrec.plumbing.bus.topics import COMPACTED, ensure_topics

    k = cfg.kafka
    if k.embedded:
        state, started = broker.up(max(k.connect_timeout_s, 60.0))
        verb = "started" if started else "already running"
        nodes = "one node" if len(state.nodes) == 1 else f"{len(state.nodes)} nodes"
        print(f"embedded Kafka {verb}: {state.bootstrap} ({nodes}, pid {' '.join(map(str, state.pids))}, data {state.data_dir})")
    else:
        print(f"using external Kafka at {k.bootstrap_servers} (nothing to start)")
    created = ensure_topics(k.bootstrap_servers, cfg.topics.all(), k.partitions, k.replication_factor, k.connect_timeout_s,
                            configs={cfg.topics.features: COMPACTED})
    for name in cfg.topics.all():
        print(f"  topic {name}: {'created' if name in created else 'exists'}")
    return 0


def down(args: argparse.Namespace, cfg: Config, broker) -> int:
    k = cfg.kafka
    if not k.embedded:
        print(f"external Kafka at {k.bootstrap_servers} is not managed by streamrec; nothing to stop", file=sys.stderr)
        return 2
    stopped = broker.down()
    print("embedded Kafka stopped" if stopped else "embedded Kafka was not running")
    return 0


def prune(args: argparse.Namespace, cfg: Config, broker) -> int:
    from streamrec.plumbing.bus.topics import delete_topics, list_topics

    k = cfg.kafka
    prefixes = tuple(args.prefix or ("demo-", "bench-"))
    keep = set(cfg.topics.all())
    doomed = [t for t in list_topics(k.bootstrap_servers, k.connect_timeout_s) if t.startswith(prefixes) and t not in keep]
    deleted = delete_topics(k.bootstrap_servers, doomed, k.connect_timeout_s)
    print(f"deleted {len(deleted)} topics starting with {', '.join(prefixes)}")
    for name in deleted:
        print(f"  {name}")
    return 0


def status(args: argparse.Namespace, cfg: Config, broker) -> int:
    """Exit 1 when the embedded Kafka is not running (any of its nodes down)."""
    from streamrec.plumbing.bus.topics import describe_topics

    k = cfg.kafka
    state = broker.status() if k.embedded else None
    report: dict = {"bootstrap": k.bootstrap_servers, "embedded": k.embedded}
    if k.embedded:
        report["running"] = bool(state and state.running)
        report["pid"] = state.pid if state else None
        report["nodes"] = [dataclasses.asdict(n) for n in state.nodes] if state else []
        report["disk_mb"] = round(broker.disk_bytes() / 2**20, 1)
    if k.embedded and state is None:
        report["topics"] = []
    else:
        report["topics"] = [t.__dict__ for t in describe_topics(k.bootstrap_servers, None, k.connect_timeout_s)]
        report["reachable"] = True
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_status(report, state, k)
    return 0 if (not k.embedded or report["running"]) else 1


def _print_status(report: dict, state, k) -> None:
    if k.embedded and state is None:
        print(f"embedded Kafka: not running (expected at {k.bootstrap_servers}; start it with `streamrec kafka up`)")
        return
    if k.embedded:
        print(f"embedded Kafka at {k.bootstrap_servers}: {'running' if state.running else 'DEGRADED'}, "
              f"data {report['disk_mb']:,} MB")
        for n in state.nodes:
            print(f"  node {n.node_id} on port {n.port}: " + (f"pid {n.pid}" if n.pid else "NOT RUNNING (`streamrec kafka up` restarts it)"))
    else:
        print(f"external Kafka at {k.bootstrap_servers}: reachable")
    for t in report["topics"]:
        print(f"  {t['name']}: {t['partitions']} partitions, {t['messages']} messages")
