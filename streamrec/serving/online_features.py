"""The online features of a serving node: the Flink job's feature state (``streamrec.features``),
materialised in the node, so that :predict can take a user id and candidate ads.

A consumer thread reads every partition of the compacted topic from its beginning
(read_committed: only checkpointed state) and keeps each entity's state
(contracts/feature_state.py): counter event times by bucket, the user's click history,
and each stage's watermark per partition. Entities live in an :class:`EntityMemory`
(serving/entity_memory.py: memory up to a budget, spilled to RocksDB past it). A corrupt
message is counted and skipped.

:meth:`OnlineFeatures.assemble` computes one request's features with the samples'
semantics (events strictly before ``ts``, the spec's windows and history length); they
equal the job's sample for an impression at ``ts`` whenever ``ts <= as_of``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from kafka import TopicPartition

from streamrec.model.columns import FeatureColumns, device_hashes
from streamrec.contracts.feature_spec import INT_COLUMNS, FeatureSpec
from streamrec.contracts.feature_state import (CorruptFeatureMessage, CounterBucket, EntityCounts, History, StageWatermark, UserHistory,
                                               Watermarks, decode_message)
from streamrec.plumbing.bus.clients import make_consumer, poll_records
from streamrec.serving.entity_memory import EntityMemory

log = logging.getLogger("streamrec.serving.features")
# How far before ``features_as_of`` a request's ts may lie and still get the samples' exact
# features: event times are kept this much longer than the largest window.
REPLAY_HORIZON_MS = 120_000


@functools.lru_cache(maxsize=256)
def _device_hash(device: str) -> int:
    return int(device_hashes([device])[0])


@dataclass
class Assembled:
    """One request's features: the model's columns, and the values by name when asked."""

    columns: FeatureColumns
    ts: int
    as_of: int | None
    features: list[dict[str, Any]] | None = None


class OnlineFeatures:
    """The feature state of every entity, kept up to date from the features topic; the
    features of a request at any time from ``as_of`` - REPLAY_HORIZON_MS on."""

    def __init__(self, bootstrap: str, topic: str, spec: FeatureSpec, memory_mb: int, spill_dir: str | Path,
                 connect_timeout_s: float = 20.0) -> None:
        self.bootstrap, self.topic, self.spec = bootstrap, topic, spec
        self.memory = EntityMemory(memory_mb * 2**20, spill_dir)
        self.connect_timeout_s = connect_timeout_s
        self.windows_ms = tuple(w * 1000 for w in spec.windows_s)
        self.max_window_ms = max(self.windows_ms)
        self.keep_history = 2 * spec.history_len  # the job's list plus what it dropped since: see UserHistory
        self._lock = threading.Lock()
        self.watermarks = Watermarks()
        self.partitions = 0
        self.counts = {"messages": 0, "corrupt": 0}
        self.last_corrupt: str | None = None
        self._positions: dict[int, int] = {}
        self._ends: dict[int, int] = {}
        self._target: dict[int, int] | None = None  # end offsets at start: caught up once reached
        self.caught_up = threading.Event()
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="online-features", daemon=True)

    # ------------------------------------------------------------------ lifetime
    def start(self) -> "OnlineFeatures":
        self.memory.clear_spill()  # scratch of an earlier run
        self._thread.start()
        return self

    def wait_ready(self, timeout_s: float) -> bool:
        return self.caught_up.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.memory.clear_spill()

    def _run(self) -> None:
        consumer = None
        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = self._connect()
                    if consumer is None:
                        self._stop.wait(1.0)
                        continue
                self._poll(consumer)
                self.error = None
            except Exception as exc:  # noqa: BLE001 -- a broker outage must not end the consumer: retry
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("online features: %s (retrying)", self.error)
                if consumer is not None:
                    consumer.close()
                    consumer = None
                self._stop.wait(1.0)
        if consumer is not None:
            consumer.close()

    def _connect(self):
        consumer = make_consumer(self.bootstrap, group_id=None, timeout_s=self.connect_timeout_s, auto_offset_reset="earliest",
                                 isolation_level="read_committed", enable_auto_commit=False, max_partition_fetch_bytes=8 * 2**20)
        partitions = sorted(consumer.partitions_for_topic(self.topic) or [])
        if not partitions:
            consumer.close()
            self.error = f"topic {self.topic} does not exist yet (the pipeline job creates it); cold-start features until it does"
            self.caught_up.set()  # nothing to catch up with: readiness does not wait for a topic that may never come
            return None
        parts = [TopicPartition(self.topic, p) for p in partitions]
        consumer.assign(parts)
        for tp in parts:  # resume where this process got to (a reconnect); from the start otherwise
            if tp.partition in self._positions:
                consumer.seek(tp, self._positions[tp.partition])
            else:
                consumer.seek_to_beginning(tp)
        self.partitions = len(parts)
        ends = consumer.end_offsets(parts)
        self._ends = {tp.partition: off for tp, off in ends.items()}
        if self._target is None:
            self._target = dict(self._ends)
        self._next_ends_at = time.monotonic() + 1.0
        return consumer

    def _poll(self, consumer) -> None:
        batches = poll_records(consumer, 200)
        for tp, records in batches.items():
            self._apply_records(records)
            self._positions[tp.partition] = records[-1].offset + 1
        now = time.monotonic()
        if now >= self._next_ends_at:
            parts = [TopicPartition(self.topic, p) for p in range(self.partitions)]
            self._ends = {tp.partition: off for tp, off in consumer.end_offsets(parts).items()}
            for tp in parts:
                self._positions[tp.partition] = consumer.position(tp)
            self._next_ends_at = now + 1.0
        if not self.caught_up.is_set() and self._target is not None:
            if not batches:  # an empty poll: positions may have moved past control records
                for p in range(self.partitions):
                    self._positions[p] = consumer.position(TopicPartition(self.topic, p))
            if all(self._positions.get(p, 0) >= end for p, end in self._target.items()):
                self.caught_up.set()
                log.info("online features caught up: %s", self.summary())

    def _apply_records(self, records: Sequence) -> None:
        memory = self.memory
        with self._lock:
            as_of = self.as_of()  # once a batch: the expiry horizon moves with the watermarks, not per record
            for record in records:
                self.counts["messages"] += 1
                try:
                    message = decode_message(record.key, record.value)
                except CorruptFeatureMessage as exc:
                    self.counts["corrupt"] += 1
                    self.last_corrupt = f"partition {record.partition} offset {record.offset}: {exc}"
                    if self.counts["corrupt"] <= 10 or self.counts["corrupt"] % 1000 == 0:
                        log.warning("online features: skipped a corrupt message (%d so far): %s", self.counts["corrupt"], self.last_corrupt)
                    continue
                if isinstance(message, StageWatermark):
                    self.watermarks.put(message)
                elif isinstance(message, CounterBucket):
                    entity = memory.for_update((message.entity, message.entity_id))
                    if entity.counts is None:
                        entity.counts = EntityCounts()
                    entity.counts.put(message)
                    if as_of is not None:
                        entity.counts.expire(as_of - self.max_window_ms - REPLAY_HORIZON_MS)
                    memory.resized(entity)
                elif isinstance(message, History):
                    entity = memory.for_update(("user", message.user_id))
                    if entity.history is None:
                        entity.history = UserHistory()
                    entity.history.put(message, self.keep_history)
                    memory.resized(entity)
            memory.evict()

    # ------------------------------------------------------------------ requests
    def as_of(self) -> int | None:
        return self.watermarks.as_of(self.partitions) if self.partitions else None

    def assemble(self, user_id: int, ts: int, device: str, local_hour: int, candidates: Sequence, with_features: bool = False) -> Assembled:
        """The features of ``candidates`` (objects with item_id, category_id, advertiser_id,
        position) shown to ``user_id`` at ``ts``: unknown entities get cold-start features
        (zero counters, empty history)."""
        spec, n, w, windows, peek = self.spec, len(candidates), len(self.windows_ms), self.windows_ms, self.memory.peek
        zero = [0] * (2 * w)
        ids = np.array([(c.item_id, c.category_id, c.advertiser_id, c.position) for c in candidates], np.int64).reshape(n, 4)
        with self._lock:
            user = peek(("user", user_id))
            user_counts = user.counts.counts(ts, windows) if user is not None and user.counts is not None else zero
            items, categories = (user.history.before(ts, spec.history_len) if user is not None and user.history is not None
                                 else ([], []))
            per_entity = []
            for kind, column in (("item", 0), ("category", 1)):
                cache: dict[int, list[int]] = {}
                for entity_id in ids[:, column].tolist():
                    got = cache.get(entity_id)
                    if got is None:
                        entity = peek((kind, entity_id))
                        got = cache[entity_id] = entity.counts.counts(ts, windows) if entity is not None and entity.counts is not None else zero
                    per_entity.append(got)
            as_of = self.as_of()
        # counter columns: for each window, for user, item, category: (imps, clicks)
        grid = np.empty((n, w, 3, 2), np.int64)
        grid[:, :, 0, :] = np.array(user_counts, np.int64).reshape(w, 2)
        both = np.array(per_entity, np.int64).reshape(2, n, w, 2)
        grid[:, :, 1, :] = both[0]
        grid[:, :, 2, :] = both[1]
        counters = grid.reshape(n, w * 6)
        source = {  # a new integer input fails here (KeyError) rather than reaching the model unset
            "ts": np.full(n, ts, np.int64), "user_id": np.full(n, user_id, np.int64), "item_id": ids[:, 0],
            "position": ids[:, 3], "local_hour": np.full(n, local_hour, np.int64), "category_id": ids[:, 1],
            "advertiser_id": ids[:, 2],
        }
        ints = {name: source[name] for name in INT_COLUMNS}
        columns = FeatureColumns(
            ints=ints, counters=counters, device_hash=np.full(n, _device_hash(device), np.int64),
            hist_items=np.tile(np.array(items, np.int64), n), hist_categories=np.tile(np.array(categories, np.int64), n),
            hist_lengths=np.full(n, len(items), np.int64))
        features = None
        if with_features:
            names = spec.counter_columns()
            features = [{"ts": ts, "user_id": user_id, "item_id": c.item_id, "position": c.position, "device": device,
                         "local_hour": local_hour, "category_id": c.category_id, "advertiser_id": c.advertiser_id,
                         "hist_item_ids": items, "hist_category_ids": categories, **dict(zip(names, row))}
                        for c, row in zip(candidates, counters.tolist())]
        return Assembled(columns, ts, as_of, features)

    # ------------------------------------------------------------------ reporting
    def lag_records(self) -> int:
        return sum(max(0, end - self._positions.get(p, 0)) for p, end in self._ends.items())

    def status(self) -> dict[str, Any]:
        as_of, memory = self.as_of(), self.memory
        return {
            "topic": self.topic, "ready": self.caught_up.is_set(), "error": self.error,
            "features_as_of": as_of, "lag_ms": int(time.time() * 1000) - as_of if as_of is not None else None,
            "lag_records": self.lag_records(), "partitions": self.partitions,
            "entities": dict(memory.entities_by_kind), "in_memory": memory.in_memory, "spilled": memory.spilled,
            "memory_bytes": memory.bytes, "memory_budget_bytes": memory.budget, **self.counts, "spills": memory.spills,
            "reloads": memory.reloads, "last_corrupt": self.last_corrupt,
        }

    def summary(self) -> str:
        s = self.status()
        return (f"{s['messages']:,} messages, {sum(s['entities'].values()):,} entities "
                f"({', '.join(f'{k} {v:,}' for k, v in s['entities'].items())}), {s['memory_bytes'] / 2**20:.1f} MiB, "
                f"{s['spilled']:,} spilled, {s['corrupt']} corrupt, as of {s['features_as_of']}")
