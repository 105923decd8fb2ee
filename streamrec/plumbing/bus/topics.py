"""Create and describe topics on any Kafka cluster."""

from __future__ import annotations

from dataclasses import dataclass

from kafka import KafkaConsumer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from streamrec.plumbing.bus.clients import make_admin, make_consumer


@dataclass(frozen=True)
class TopicInfo:
    name: str
    partitions: int
    messages: int  # sum over partitions of (end offset - beginning offset)


COMPACTED = {"cleanup.policy": "compact"}  # a topic whose latest value per key is the state (streamrec.features)


def ensure_topics(bootstrap: str, names: list[str], partitions: int, replication_factor: int = 0, timeout_s: float = 20.0,
                  configs: dict[str, dict[str, str]] | None = None) -> list[str]:
    """Create the topics that do not exist yet (``configs``: topic settings by name); return
    the names created. ``replication_factor`` 0 takes the cluster's default.replication.factor.

    Existing topics are left as they are (even with another partition count: changing
    it would reshuffle keys, which is an operator's decision, not a side effect).
    """
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    admin = make_admin(bootstrap, timeout_s)
    try:
        existing = set(admin.list_topics())
        missing = [n for n in names if n not in existing]
        created = []
        for name in missing:
            try:
                admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=replication_factor or -1,
                                              topic_configs=(configs or {}).get(name, {}))])
                created.append(name)
            except TopicAlreadyExistsError:
                pass  # created concurrently by someone else: fine
        return created
    finally:
        admin.close()


def delete_topics(bootstrap: str, names: list[str], timeout_s: float = 20.0) -> list[str]:
    """Delete the topics that exist among ``names``; return the names deleted."""
    admin = make_admin(bootstrap, timeout_s)
    try:
        doomed = sorted(set(names) & set(admin.list_topics()))
        if doomed:
            admin.delete_topics(doomed)
        return doomed
    finally:
        admin.close()


def list_topics(bootstrap: str, timeout_s: float = 20.0) -> list[str]:
    admin = make_admin(bootstrap, timeout_s)
    try:
        return sorted(admin.list_topics())
    finally:
        admin.close()


def describe_topics(bootstrap: str, names: list[str] | None = None, timeout_s: float = 20.0) -> list[TopicInfo]:
    """Partition counts and message counts of the given (or all non-internal) topics."""
    consumer: KafkaConsumer = make_consumer(bootstrap, group_id=None, timeout_s=timeout_s)
    try:
        available = consumer.topics()
        wanted = sorted(n for n in (names or available) if n in available and not n.startswith("__"))
        out = []
        for name in wanted:
            parts = [TopicPartition(name, p) for p in sorted(consumer.partitions_for_topic(name) or [])]
            end = consumer.end_offsets(parts)
            begin = consumer.beginning_offsets(parts)
            out.append(TopicInfo(name, len(parts), sum(end[tp] - begin[tp] for tp in parts)))
        return out
    finally:
        consumer.close()


def open_transactions(bootstrap: str, names: list[str], timeout_s: float = 20.0) -> list[str]:
    """The partitions (``topic:p``) of ``names`` whose last stable offset is behind their high
    watermark: a transaction there is neither committed nor aborted yet, or its markers are not
    written yet, so read_committed readers do not see its records (nor any record after them)."""
    ends = {}
    for level in ("read_uncommitted", "read_committed"):  # high watermarks first: a commit in between cannot look open
        consumer: KafkaConsumer = make_consumer(bootstrap, group_id=None, isolation_level=level, timeout_s=timeout_s)
        try:
            parts = [TopicPartition(n, p) for n in names for p in sorted(consumer.partitions_for_topic(n) or [])]
            ends[level] = consumer.end_offsets(parts) if parts else {}
        finally:
            consumer.close()
    high, stable = ends["read_uncommitted"], ends["read_committed"]
    return [f"{tp.topic}:{tp.partition}" for tp in sorted(high) if high[tp] > stable.get(tp, high[tp])]
