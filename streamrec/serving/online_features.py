"""The online feature store: the Flink job's feature state (``streamrec.features``),
materialised in the serving node, so that :predict can take a user id and candidate ads.

A consumer thread reads every partition of the compacted topic from its beginning
(read_committed: only checkpointed state) and keeps each entity's state
(pipelines/feature_state.py): counter event times by bucket, the user's click history,
and each stage's watermark per partition. Entities live in memory up to
``serving.feature_store_memory_mb``; past it the least recently used spill to RocksDB
(``feature_store_dir``, scratch: the topic is the source of truth and a start rebuilds
from it). A corrupt message is counted and skipped.

:meth:`OnlineFeatureStore.assemble` computes one request's features with the samples'
semantics (events strictly before ``ts``, the spec's windows and history length); they
equal the job's sample for an impression at ``ts`` whenever ``ts <= as_of``.
"""

from __future__ import annotations

import functools
import logging
from array import array
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import orjson
from kafka import TopicPartition

from streamrec.model.columns import FeatureColumns, device_hashes
from streamrec.contracts.feature_spec import INT_COLUMNS, FeatureSpec
from streamrec.contracts.feature_state import (ENTITIES, CorruptFeatureMessage, CounterBucket, EntityCounts, History, StageWatermark,
                                     UserHistory, Watermarks, decode_message)
from streamrec.plumbing.bus.clients import make_consumer, poll_records

log = logging.getLogger("streamrec.serving.features")
# How far before ``features_as_of`` a request's ts may lie and still get the samples' exact
# features: the store keeps event times this much longer than the largest window.
REPLAY_HORIZON_MS = 120_000


@functools.lru_cache(maxsize=256)
def _device_hash(device: str) -> int:
    return int(device_hashes([device])[0])


class _Entity:
    __slots__ = ("counts", "history", "nbytes")

    def __init__(self) -> None:
        self.counts: EntityCounts | None = None
        self.history: UserHistory | None = None
        self.nbytes = 0

    def size(self) -> int:
        return 64 + (self.counts.nbytes() if self.counts else 0) + (self.history.nbytes() if self.history else 0)

    def to_bytes(self) -> bytes:
        c, h = self.counts, self.history
        return orjson.dumps({"i": list(c.imps) if c else None, "c": list(c.clicks) if c else None,
                             "h": h.flat.tolist() if h else None})

    @classmethod
    def from_bytes(cls, data: bytes) -> "_Entity":
        raw, entity = orjson.loads(data), cls()
        if raw["i"] is not None:
            entity.counts = EntityCounts(array("q", raw["i"]), array("q", raw["c"]))
        if raw["h"] is not None:
            entity.history = UserHistory(array("q", raw["h"]))
        entity.nbytes = entity.size()
        return entity


@dataclass
class Assembled:
    """One request's features: the model's columns, and the values by name when asked."""

    columns: FeatureColumns
    ts: int
    as_of: int | None
    features: list[dict[str, Any]] | None = None


class OnlineFeatureStore:
    def __init__(self, bootstrap: str, topic: str, spec: FeatureSpec, memory_mb: int, spill_dir: str | Path,
                 connect_timeout_s: float = 20.0) -> None:
        self.bootstrap, self.topic, self.spec = bootstrap, topic, spec
        self.budget = memory_mb * 2**20
        self.spill_dir = Path(spill_dir)
        self.connect_timeout_s = connect_timeout_s
        self.windows_ms = tuple(w * 1000 for w in spec.windows_s)
        self.max_window_ms = max(self.windows_ms)
        self.keep_history = 2 * spec.history_len  # the job's list plus what it dropped since: see UserHistory
        self._entities: OrderedDict[tuple[str, int], _Entity] = OrderedDict()  # least recently updated first
        self._spilled: set[tuple[str, int]] = set()
        self._spill = None  # rocksdict.Rdict, opened at the first spill
        self._bytes = 0
        self._lock = threading.Lock()
        self.watermarks = Watermarks()
        self.partitions = 0
        self.counts = {"messages": 0, "corrupt": 0, "spills": 0, "reloads": 0}
        self.entity_counts = {e: 0 for e in ENTITIES}
        self.last_corrupt: str | None = None
        self._positions: dict[int, int] = {}
        self._ends: dict[int, int] = {}
        self._target: dict[int, int] | None = None  # end offsets at start: caught up once reached
        self.caught_up = threading.Event()
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feature-store", daemon=True)

    # ------------------------------------------------------------------ lifetime
    def start(self) -> "OnlineFeatureStore":
        shutil.rmtree(self.spill_dir, ignore_errors=True)  # scratch of an earlier run
        self._thread.start()
        return self

    def wait_ready(self, timeout_s: float) -> bool:
        return self.caught_up.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if self._spill is not None:
            self._spill.close()
            self._spill = None
        shutil.rmtree(self.spill_dir, ignore_errors=True)

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
            except Exception as exc:  # noqa: BLE001 -- a broker outage must not end the store: retry
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("feature store: %s (retrying)", self.error)
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
                log.info("feature store caught up: %s", self.summary())

    def _apply_records(self, records: Sequence) -> None:
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
                        log.warning("feature store: skipped a corrupt message (%d so far): %s", self.counts["corrupt"], self.last_corrupt)
                    continue
                if isinstance(message, StageWatermark):
                    self.watermarks.put(message)
                elif isinstance(message, CounterBucket):
                    entity = self._entity((message.entity, message.entity_id))
                    if entity.counts is None:
                        entity.counts = EntityCounts()
                    entity.counts.put(message)
                    if as_of is not None:
                        entity.counts.expire(as_of - self.max_window_ms - REPLAY_HORIZON_MS)
                    self._resized(entity)
                elif isinstance(message, History):
                    entity = self._entity(("user", message.user_id))
                    if entity.history is None:
                        entity.history = UserHistory()
                    entity.history.put(message, self.keep_history)
                    self._resized(entity)
            self._evict()

    # ------------------------------------------------------------------ memory
    def _entity(self, key: tuple[str, int]) -> _Entity:
        """The entity under ``key`` for an update (made the most recently updated), from
        memory, the spill, or new."""
        entity = self._entities.get(key)
        if entity is not None:
            self._entities.move_to_end(key)
            return entity
        entity = self._reload(key)
        if entity is None:
            entity = _Entity()
            self.entity_counts[key[0]] += 1
            self._entities[key] = entity
        return entity

    def _peek(self, key: tuple[str, int]) -> _Entity | None:
        """The entity under ``key`` for a request: reads do not reorder the memory's LRU
        (a move per lookup cost a fifth of an assembly), updates do."""
        entity = self._entities.get(key)
        if entity is None and key in self._spilled:
            entity = self._reload(key)
        return entity

    def _reload(self, key: tuple[str, int]) -> _Entity | None:
        if key not in self._spilled:
            return None
        name = f"{key[0]}/{key[1]}"
        entity = _Entity.from_bytes(self._spill[name])
        self._spilled.discard(key)
        del self._spill[name]
        self.counts["reloads"] += 1
        self._entities[key] = entity
        self._bytes += entity.nbytes
        return entity

    def _resized(self, entity: _Entity) -> None:
        size = entity.size()
        self._bytes += size - entity.nbytes
        entity.nbytes = size

    def _evict(self) -> None:
        while self._bytes > self.budget and len(self._entities) > 1:
            if self._spill is None:
                from rocksdict import Rdict  # the SSD tier's library (ps/ssd.py)

                self.spill_dir.mkdir(parents=True, exist_ok=True)
                self._spill = Rdict(str(self.spill_dir))
            key, entity = self._entities.popitem(last=False)
            self._spill[f"{key[0]}/{key[1]}"] = entity.to_bytes()
            self._spilled.add(key)
            self._bytes -= entity.nbytes
            self.counts["spills"] += 1

    # ------------------------------------------------------------------ requests
    def as_of(self) -> int | None:
        return self.watermarks.as_of(self.partitions) if self.partitions else None

    def assemble(self, user_id: int, ts: int, device: str, local_hour: int, candidates: Sequence, with_features: bool = False) -> Assembled:
        """The features of ``candidates`` (objects with item_id, category_id, advertiser_id,
        position) shown to ``user_id`` at ``ts``: unknown entities get cold-start features
        (zero counters, empty history)."""
        spec, n, w, windows = self.spec, len(candidates), len(self.windows_ms), self.windows_ms
        zero = [0] * (2 * w)
        ids = np.array([(c.item_id, c.category_id, c.advertiser_id, c.position) for c in candidates], np.int64).reshape(n, 4)
        with self._lock:
            user = self._peek(("user", user_id))
            user_counts = user.counts.counts(ts, windows) if user is not None and user.counts is not None else zero
            items, categories = (user.history.before(ts, spec.history_len) if user is not None and user.history is not None
                                 else ([], []))
            per_entity = []
            for kind, column in (("item", 0), ("category", 1)):
                cache: dict[int, list[int]] = {}
                for entity_id in ids[:, column].tolist():
                    got = cache.get(entity_id)
                    if got is None:
                        entity = self._peek((kind, entity_id))
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
        as_of = self.as_of()
        return {
            "topic": self.topic, "ready": self.caught_up.is_set(), "error": self.error,
            "features_as_of": as_of, "lag_ms": int(time.time() * 1000) - as_of if as_of is not None else None,
            "lag_records": self.lag_records(), "partitions": self.partitions,
            "entities": dict(self.entity_counts), "in_memory": len(self._entities), "spilled": len(self._spilled),
            "memory_bytes": self._bytes, "memory_budget_bytes": self.budget, **self.counts, "last_corrupt": self.last_corrupt,
        }

    def summary(self) -> str:
        s = self.status()
        return (f"{s['messages']:,} messages, {sum(s['entities'].values()):,} entities "
                f"({', '.join(f'{k} {v:,}' for k, v in s['entities'].items())}), {s['memory_bytes'] / 2**20:.1f} MiB, "
                f"{s['spilled']:,} spilled, {s['corrupt']} corrupt, as of {s['features_as_of']}")
