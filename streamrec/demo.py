"""``streamrec demo``: the main job on the embedded defaults.

Today: start the broker, create the topics, stream live traffic into Kafka, read this
run's events and truth back through a consumer group, check every event against the
contract, and print a summary. Later issues grow it into the full loop (Flink job,
trainer, serving). Stops the broker it started, also on Ctrl-C or error.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from kafka import TopicPartition

from pipelines.events import InvalidEvent, validate_event
from pipelines.generator.scoring import auc
from pipelines.generator.sinks import decode_truth_message
from streamrec.bus.broker import EmbeddedBroker
from streamrec.bus.clients import make_consumer, make_producer
from streamrec.bus.topics import ensure_topics
from streamrec.config import Config


@dataclass
class Readback:
    """What came back out of Kafka for one run."""

    events_by_type: Counter = field(default_factory=Counter)
    rejected_by_reason: Counter = field(default_factory=Counter)
    per_partition: Counter = field(default_factory=Counter)
    truth_impressions: int = 0
    truth_bad: int = 0
    p: list[float] = field(default_factory=list)
    clicked: list[bool] = field(default_factory=list)


def end_offsets(bootstrap: str, topic: str, timeout_s: float) -> dict[TopicPartition, int]:
    consumer = make_consumer(bootstrap, group_id=None, timeout_s=timeout_s)
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        return consumer.end_offsets(parts)
    finally:
        consumer.close()


def read_range(bootstrap: str, group: str, start: dict[TopicPartition, int], end: dict[TopicPartition, int], timeout_s: float):
    """Yield the records between two offset snapshots, then commit the group's offsets."""
    consumer = make_consumer(bootstrap, group_id=group, timeout_s=timeout_s)
    try:
        parts = [tp for tp in end if end[tp] > start.get(tp, 0)]
        consumer.assign(parts)
        for tp in parts:
            consumer.seek(tp, start.get(tp, 0))
        remaining = {tp: end[tp] for tp in parts}
        deadline = time.monotonic() + timeout_s
        while remaining and time.monotonic() < deadline:
            for tp, records in consumer.poll(timeout_ms=500, max_records=5000).items():
                for record in records:
                    if record.offset < remaining.get(tp, -1):
                        yield record
                if consumer.position(tp) >= remaining.get(tp, 0):
                    remaining.pop(tp, None)
        if remaining:
            raise TimeoutError(f"read-back stopped short of the end offsets on {sorted(map(str, remaining))}")
        consumer.commit()
    finally:
        consumer.close()


def run_demo(args: argparse.Namespace, cfg: Config) -> int:
    from pipelines.generator.sinks import KafkaSink
    from pipelines.generator.traffic import Traffic, TrafficConfig
    from streamrec.cli import print_generate_summary, run_with_progress

    k, topics = cfg.kafka, cfg.topics
    broker = EmbeddedBroker(k.data_dir, k.embedded_host, k.embedded_port)
    started = False
    try:
        if k.embedded:
            state, started = broker.up(k.connect_timeout_s)
            print(f"[1/4] embedded Kafka broker {'started' if started else 'already running'} at {state.bootstrap}")
        else:
            print(f"[1/4] using external Kafka at {k.bootstrap_servers}")
        ensure_topics(k.bootstrap_servers, topics.all(), k.partitions, k.replication_factor, k.connect_timeout_s)
        print(f"[2/4] topics ready ({k.partitions} partitions each): {', '.join(topics.all())}")
        before_events = end_offsets(k.bootstrap_servers, topics.events, k.connect_timeout_s)
        before_truth = end_offsets(k.bootstrap_servers, topics.truth, k.connect_timeout_s)

        traffic_cfg = TrafficConfig(cfg.generator.seed, args.rate, args.bad_fraction, cfg.generator.max_disorder_ms, cfg.generator.world)
        traffic = Traffic(traffic_cfg, int(time.time() * 1000))
        sink = KafkaSink(make_producer(k.bootstrap_servers, k.connect_timeout_s), topics.events, topics.truth)
        print(f"[3/4] streaming {args.duration:g}s of live traffic at ~{args.rate:g} events/s into {topics.events}")
        summary = run_with_progress(traffic, sink, args.duration, True, "traffic")
        print_generate_summary(summary)

        print(f"[4/4] reading the run back from {topics.events} and {topics.truth}")
        rb = Readback()
        after_events = end_offsets(k.bootstrap_servers, topics.events, k.connect_timeout_s)
        now_ms = int(time.time() * 1000)
        for record in read_range(k.bootstrap_servers, "streamrec-demo-readback", before_events, after_events, k.connect_timeout_s):
            rb.per_partition[record.partition] += 1
            try:
                event = validate_event(record.value, now_ms)
                rb.events_by_type[event["type"]] += 1
            except InvalidEvent as exc:
                rb.rejected_by_reason[exc.reason.split(":")[0]] += 1
        after_truth = end_offsets(k.bootstrap_servers, topics.truth, k.connect_timeout_s)
        for record in read_range(k.bootstrap_servers, "streamrec-demo-readback", before_truth, after_truth, k.connect_timeout_s):
            for row in decode_truth_message(record.value):
                if row["kind"] == "impression":
                    rb.truth_impressions += 1
                    rb.p.append(row["p"])
                    rb.clicked.append(row["clicked"])
                elif row["kind"] == "bad":
                    rb.truth_bad += 1
        print_readback(rb, summary)
        ok = (
            rb.events_by_type["impression"] == summary.impressions
            and rb.truth_impressions == summary.impressions
            and sum(rb.per_partition.values()) == summary.events
        )
        print("demo OK: every produced event and truth row came back" if ok else "demo FAILED: read-back counts differ")
        return 0 if ok else 1
    finally:
        if started and not args.keep_broker:
            broker.down()
            print("embedded broker stopped (use --keep-broker to leave it running)")


def print_readback(rb: Readback, summary) -> None:
    total = sum(rb.per_partition.values())
    parts = ", ".join(f"p{p}={n}" for p, n in sorted(rb.per_partition.items()))
    rejected = ", ".join(f"{r}={n}" for r, n in sorted(rb.rejected_by_reason.items())) or "none"
    ctr = rb.events_by_type["click"] / max(1, rb.events_by_type["impression"])
    print(
        f"  read back {total:,} events of {summary.events:,} produced across partitions [{parts}]\n"
        f"  valid: {rb.events_by_type['impression']:,} impressions, {rb.events_by_type['click']:,} clicks (CTR {ctr:.2%});"
        f" rejected by the contract: {rejected}\n"
        f"  (orphan clicks pass a stateless check; the Flink label join rejects them)\n"
        f"  truth: {rb.truth_impressions:,} impression rows, {rb.truth_bad:,} bad-event records; "
        f"Bayes-optimal AUC from the truth topic {auc(np.array(rb.p), np.array(rb.clicked)):.4f}"
    )
