"""Produce/consume through the real broker: keys, partitions, consumer groups, committed offsets."""

from collections import defaultdict

from kafka import TopicPartition

from streamrec.plumbing.bus.clients import make_consumer
from streamrec.plumbing.bus.topics import describe_topics, ensure_topics
from tests.conftest import CheckedProducer, read_topic

N = 2000


def test_topic_creation_is_idempotent(broker):
    assert ensure_topics(broker, ["rt.idem"], partitions=3) == ["rt.idem"]
    assert ensure_topics(broker, ["rt.idem", "rt.idem2"], partitions=2) == ["rt.idem2"]
    info = {t.name: t.partitions for t in describe_topics(broker, ["rt.idem", "rt.idem2"])}
    assert info == {"rt.idem": 3, "rt.idem2": 2}


def test_consumer_group_resumes_from_committed_offsets(broker):
    topic = "rt.groups"
    ensure_topics(broker, [topic], partitions=4)
    producer = CheckedProducer(broker)
    for i in range(N):
        producer.send(topic, key=f"user{i % 37}".encode(), value=str(i).encode())
    producer.flush()
    producer.close()

    # First member reads about half and commits exactly what it read, then leaves.
    first = make_consumer(broker, topic, group_id="rt-g1")
    seen: list[tuple[int, int, str, int]] = []
    while len(seen) < N // 2:
        for tp, records in first.poll(timeout_ms=1000, max_records=100).items():
            seen.extend((tp.partition, r.offset, r.key.decode(), int(r.value)) for r in records)
    first.commit()
    committed = {p: first.committed(TopicPartition(topic, p)) for p in range(4)}
    first.close()
    for p in range(4):
        read_here = [o for (q, o, _, _) in seen if q == p]
        assert committed[p] == (max(read_here) + 1 if read_here else 0)  # the position: next to read

    # A new member of the same group continues after the commit: nothing lost, nothing twice.
    second = make_consumer(broker, topic, group_id="rt-g1", consumer_timeout_ms=3000)
    rest = [(r.partition, r.offset, r.key.decode(), int(r.value)) for r in second]
    second.commit()
    end = second.end_offsets([TopicPartition(topic, p) for p in range(4)])
    assert all(second.committed(tp) == end[tp] for tp in end)
    second.close()

    values = sorted(v for *_, v in seen + rest)
    assert values == list(range(N))

    # Keys stick to one partition, order within a key is production order, and the keys spread.
    partitions_of_key = defaultdict(set)
    for p, _, key, _ in seen + rest:
        partitions_of_key[key].add(p)
    assert all(len(ps) == 1 for ps in partitions_of_key.values())
    assert len({next(iter(ps)) for ps in partitions_of_key.values()}) == 4
    by_key = defaultdict(list)
    for p, o, key, v in sorted(seen + rest, key=lambda r: (r[0], r[1])):
        by_key[key].append(v)
    assert all(vs == sorted(vs) for vs in by_key.values())


def test_independent_group_reads_everything(broker):
    topic = "rt.groups2"
    ensure_topics(broker, [topic], partitions=2)
    producer = CheckedProducer(broker)
    for i in range(100):
        producer.send(topic, value=str(i).encode())
    producer.flush()
    for group in ("rt-a", "rt-b"):
        consumer = make_consumer(broker, topic, group_id=group, consumer_timeout_ms=3000)
        assert sorted(int(r.value) for r in consumer) == list(range(100))
        consumer.close()


def test_a_transaction_is_seen_whole_when_committed_and_never_when_aborted(broker):
    """The transactional producer (the Flink job's sinks and `generate --atomic` rely on it)."""
    topic = "rt.txn"
    ensure_topics(broker, [topic], partitions=2)
    producer = CheckedProducer(broker, transactional_id="rt-txn")
    producer.init_transactions()
    for outcome in ("commit", "abort"):
        producer.begin_transaction()
        for i in range(50):
            producer.send(topic, key=f"k{i}".encode(), value=f"{outcome}-{i}".encode())
        producer.flush()  # on the broker, inside the open transaction, before it ends
        producer.commit_transaction() if outcome == "commit" else producer.abort_transaction()
    producer.close()
    committed = sorted(r.value.decode() for r in read_topic(broker, topic))
    assert committed == sorted(f"commit-{i}" for i in range(50))
    everything = {r.value.decode().split("-")[0] for r in read_topic(broker, topic, committed=False)}
    assert everything == {"commit", "abort"}
