"""Generator throughput: events/s to files and to Kafka, against same-run baselines.

Baselines (run in the same process, same machine, same minute):
- ``naive_python``: a plain-Python per-event generator of the same event shape (random
  user/item draws by weight, a logistic click model, json.dumps per event) — what one
  writes without vectorising. Ratio = ours / naive.
- ``raw_producer``: kafka-python sending already-serialised event bytes, nothing else —
  the client's ceiling on this machine. Ratio = ours / raw (at most ~1).

Usage: streamrec bench generator [--seconds 20] [--rate 50000] [--bootstrap HOST:PORT]
Writes var/bench/generator-<time>.json and prints a table.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import platform
import random
import shutil
import tempfile
import time
import tomllib
from pathlib import Path


from streamrec.generator.runner import generate
from streamrec.generator.sinks import FileSink, KafkaSink
from streamrec.generator.traffic import Traffic, TrafficConfig
from streamrec.generator.world import WorldConfig
from streamrec.plumbing.bus.broker import EmbeddedBroker
from streamrec.plumbing.bus.clients import make_producer
from streamrec.plumbing.bus.topics import ensure_topics
from streamrec.plumbing.config import default_config_text

from output import write_result  # bench/ is on sys.path (script dir; `streamrec bench` adds it)

START_MS = 1_700_000_000_000


def traffic(rate: float, world: WorldConfig) -> Traffic:
    return Traffic(TrafficConfig(seed=1, rate=rate, bad_fraction=0.0, max_disorder_ms=300, world=world), START_MS)


def naive_python_events(n_events: int, world: WorldConfig, out) -> None:
    """Plain-Python baseline: one event at a time, no numpy."""
    rng = random.Random(1)
    users = [rng.randrange(1, 1 << 40) for _ in range(world.n_users)]
    items = [rng.randrange(1, 1 << 40) for _ in range(world.n_items)]
    item_bias = [rng.gauss(0, 0.5) for _ in items]
    cum, total = [], 0.0
    for r in range(1, world.n_items + 1):
        total += 1.0 / r ** world.zipf_exponent
        cum.append(total)
    written, request, ts = 0, 0, START_MS
    while written < n_events:
        request += 1
        ts += 1
        user = users[rng.randrange(len(users))]
        for position in range(1, rng.randint(1, world.max_slots) + 1):
            i = min(bisect.bisect_left(cum, rng.random() * total), len(items) - 1)
            p = 1 / (1 + math.exp(-(-3.5 + item_bias[i] - 0.7 * math.log(position))))
            event = {"type": "impression", "event_id": f"n-{written}", "ts": ts, "user_id": user, "item_id": items[i],
                     "request_id": f"r-{request}", "position": position,
                     "context": {"device": "ios", "local_hour": 12}, "item": {"category_id": 1, "advertiser_id": 1}}
            out.write(json.dumps(event).encode() + b"\n")
            written += 1
            if rng.random() < p:
                click = {"type": "click", "event_id": f"c-{written}", "ts": ts + 2000, "user_id": user,
                         "item_id": items[i], "request_id": f"r-{request}"}
                out.write(json.dumps(click).encode() + b"\n")
                written += 1


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="simulated seconds per file run")
    parser.add_argument("--kafka-seconds", type=float, default=5.0, help="simulated seconds for the Kafka run")
    parser.add_argument("--rate", type=float, default=50_000.0, help="events/s of simulated traffic")
    parser.add_argument("--bootstrap", help="external Kafka; default: a temporary embedded broker")
    parser.add_argument("--out", default="var/bench", help="directory of the JSON result (default: ./var/bench, under the current directory)")
    args = parser.parse_args()

    world = WorldConfig(**tomllib.loads(default_config_text())["generator"]["world"])
    results: dict = {"bench": "generator", "machine": platform.platform(), "cpus": __import__("os").cpu_count(),
                     "python": platform.python_version(), "rate": args.rate, "runs": {}}
    tmp = Path(tempfile.mkdtemp(prefix="bench-gen-"))
    try:
        for fmt in ("jsonl", "parquet"):
            summary = generate(traffic(args.rate, world), FileSink(tmp / fmt, fmt), args.seconds, pace=False)
            results["runs"][f"file_{fmt}"] = {"events": summary.events, "seconds": summary.wall_s, "events_per_s": summary.events_per_s}
        n = results["runs"]["file_jsonl"]["events"]
        with open(tmp / "naive.jsonl", "wb") as fh:
            seconds = timed(lambda: naive_python_events(n, world, fh))
        results["runs"]["naive_python_jsonl"] = {"events": n, "seconds": seconds, "events_per_s": n / seconds}

        broker = None
        bootstrap = args.bootstrap
        if not bootstrap:
            broker = EmbeddedBroker(tmp / "kafka", port=_free_port())
            bootstrap = broker.up()[0].bootstrap
        try:
            ensure_topics(bootstrap, ["bench.events", "bench.truth", "bench.raw"], partitions=4)
            summary = generate(traffic(args.rate, world), KafkaSink(make_producer(bootstrap), "bench.events", "bench.truth"),
                               args.kafka_seconds, pace=False)
            results["runs"]["kafka_with_truth"] = {"events": summary.events, "seconds": summary.wall_s, "events_per_s": summary.events_per_s}
            summary = generate(traffic(args.rate, world), KafkaSink(make_producer(bootstrap), "bench.events", None),
                               args.kafka_seconds, pace=False)
            results["runs"]["kafka_events_only"] = {"events": summary.events, "seconds": summary.wall_s, "events_per_s": summary.events_per_s}
            payload = [(e[1], e[2]) for b in traffic(args.rate, world).ticks(args.kafka_seconds) for e in b.events]
            producer = make_producer(bootstrap)

            def send_all() -> None:
                for key, value in payload:
                    producer.send("bench.raw", key=key, value=value)
                producer.flush()

            seconds = timed(send_all)
            producer.close()
            results["runs"]["raw_producer"] = {"events": len(payload), "seconds": seconds, "events_per_s": len(payload) / seconds}
        finally:
            if broker:
                broker.down()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    runs = results["runs"]
    results["ratios"] = {
        "file_jsonl_vs_naive_python": runs["file_jsonl"]["events_per_s"] / runs["naive_python_jsonl"]["events_per_s"],
        "file_parquet_vs_naive_python": runs["file_parquet"]["events_per_s"] / runs["naive_python_jsonl"]["events_per_s"],
        "kafka_events_only_vs_raw_producer": runs["kafka_events_only"]["events_per_s"] / runs["raw_producer"]["events_per_s"],
        "kafka_with_truth_vs_raw_producer": runs["kafka_with_truth"]["events_per_s"] / runs["raw_producer"]["events_per_s"],
    }
    for name, run in runs.items():
        print(f"{name:22s} {run['events']:>10,} events {run['seconds']:7.2f}s {run['events_per_s']:>10,.0f} events/s")
    for name, ratio in results["ratios"].items():
        print(f"{name:40s} {ratio:6.2f}x")
    write_result(args.out, "generator", results)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
