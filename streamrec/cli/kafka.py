"""`streamrec kafka up | down | prune | status`: the message bus."""

from __future__ import annotations

import argparse
import json
import sys
import time

from streamrec.cli.common import Commands, add_action
from streamrec.plumbing.config import Config


def add_parser(commands: Commands) -> None:
    kafka = commands.add("kafka", "start, stop and inspect the message bus", run)
    actions = kafka.add_subparsers(dest="kafka_command", metavar="ACTION", required=True)
    up = add_action(actions, "up", "start the embedded broker (unless --bootstrap) and create the topics",
                    "Start the embedded noida-db broker on loopback (unless --bootstrap points at "
                    "an external cluster), wait until it answers, and create the streamrec topics.")
    up.add_argument("--partitions", type=int, help="partitions per topic (kafka.partitions)")
    up.add_argument("--port", type=int, help="embedded broker port (kafka.embedded_port)")
    up.add_argument("--data-dir", help="embedded broker data/PID/log directory (kafka.data_dir)")
    prune = add_action(actions, "prune", "delete the topics of finished demo and bench runs",
                       "Delete topics whose names start with one of the prefixes (default: the "
                       "per-run topics of `demo` and `bench`: demo-, bench-). The configured topics "
                       "are never deleted. The embedded broker re-saves everything it holds on every "
                       "change, so old runs' data costs CPU (docs/kafka.md).")
    prune.add_argument("--prefix", action="append", help="topic name prefix to delete (repeatable; default demo- and bench-)")
    prune.add_argument("--data-dir", help="embedded broker data directory (kafka.data_dir)")
    for action, text in (("down", "stop the embedded broker"), ("status", "broker and topic status")):
        p = add_action(actions, action, text)
        p.add_argument("--port", type=int, help="embedded broker port (kafka.embedded_port)")
        p.add_argument("--data-dir", help="embedded broker data directory (kafka.data_dir)")
        if action == "status":
            p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.plumbing.bus.broker import EmbeddedBroker

    k = cfg.kafka
    broker = EmbeddedBroker(k.data_dir, k.embedded_host, k.embedded_port)
    action = {"up": up, "down": down, "prune": prune, "status": status}[args.kafka_command]
    return action(args, cfg, broker)


def up(args: argparse.Namespace, cfg: Config, broker) -> int:
    from streamrec.plumbing.bus.topics import COMPACTED, ensure_topics

    k = cfg.kafka
    if k.embedded:
        state, started = broker.up(k.connect_timeout_s)
        verb = "started" if started else "already running"
        print(f"embedded broker {verb}: {state.bootstrap} (pid {state.pid}, data {state.data_dir})")
        held = broker.store_bytes()
        if held > broker.LARGE_STORE_BYTES:
            print(f"warning: the embedded broker holds {held / 2**20:,.0f} MB and re-saves all of it on every change, "
                  f"which costs CPU; `streamrec kafka prune` deletes old demo/bench topics", file=sys.stderr)
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
    print("embedded broker stopped" if stopped else "embedded broker was not running")
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
    if k.embedded:
        time.sleep(1.0)  # the broker re-saves its store shortly after a change
        print(f"embedded broker store: {broker.store_bytes() / 2**20:,.1f} MB")
    return 0


def status(args: argparse.Namespace, cfg: Config, broker) -> int:
    """Exit 1 when the embedded broker is not running."""
    from streamrec.plumbing.bus.topics import describe_topics

    k = cfg.kafka
    state = broker.status() if k.embedded else None
    report: dict = {"bootstrap": k.bootstrap_servers, "embedded": k.embedded}
    if k.embedded:
        report["pid"] = state.pid if state else None
        report["running"] = state is not None
        report["store_mb"] = round(broker.store_bytes() / 2**20, 1)
    if k.embedded and state is None:
        report["topics"] = []
        rc = 1
    else:
        topics = describe_topics(k.bootstrap_servers, None, k.connect_timeout_s)
        report["topics"] = [t.__dict__ for t in topics]
        report["reachable"] = True
        rc = 0
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_status(report, state, k)
    return rc


def _print_status(report: dict, state, k) -> None:
    where = "embedded" if k.embedded else "external"
    if k.embedded and state is None:
        print(f"embedded broker: not running (expected at {k.bootstrap_servers}; start it with `streamrec kafka up`)")
    else:
        running = f"running, pid {state.pid}, store {report['store_mb']:,} MB" if state else "reachable"
        print(f"{where} broker at {k.bootstrap_servers}: {running}")
        for t in report["topics"]:
            print(f"  {t['name']}: {t['partitions']} partitions, {t['messages']} messages")
