"""The online features of a serving node: the Flink job's feature state (``streamrec.features``),
materialised in the node, so that :predict can take a user id and candidate ads.

A consumer thread reads every partition of the compacted topic from its beginning
(read_committed: only checkpointed state) and keeps each entity's state
(contracts/feature_state.py): counter event times by bucket, the user's click history,
and each stage's watermark per partition. Entities live in an :class:`EntityStore`
(serving/features/entity_store.py: columns in memory, up to a budget). A corrupt message is
counted and skipped.

:meth:`OnlineFeatures.assemble` computes one request's features with the samples'
semantics (events strictly before ``ts``, the spec's windows and history length); they
equal the job's sample for an impression at ``ts`` whenever ``ts <= as_of``.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import torch
from kafka import TopicPartition

from streamrec.model.columns import FeatureColumns, device_hashes
from streamrec.contracts.feature_spec import INT_COLUMNS, FeatureSpec
from streamrec.contracts.feature_state import (ENTITIES, CorruptFeatureMessage, CounterBucket, History, StageWatermark, Watermarks,
                                               decode_message)
from streamrec.plumbing.bus.clients import make_consumer
from streamrec.serving.by_ids import CANDIDATE_FIELDS, ByIdsQuery
from streamrec.serving.features.counter_cache import CounterCache
from streamrec.serving.features.device_counts import DeviceCounts
from streamrec.serving.features.entity_store import EntityStore
from streamrec.serving.features.growth import no_huge_page_advice
from streamrec.serving.features.feature_snapshot import (CorruptSnapshot, SnapshotHeader, batch_columns, entity_batch, read_snapshot,
                                                remove_stale_temporaries, write_snapshot)

log = logging.getLogger("streamrec.serving.features")
# How far before ``features_as_of`` a request's ts may lie and still get the samples' exact
# features: event times are kept this much longer than the largest window.
REPLAY_HORIZON_MS = 120_000
_NO_TIMES = np.zeros(0, np.int64)


@dataclass
class AssembledBatch:
    """A batch of by-ids queries' features: one block of columns, and per query its values by
    name when it asked (``return_features``)."""

    columns: FeatureColumns
    as_of: int | None
    features: list[list[dict[str, Any]] | None]
    # with counts on the device: the candidates' item and category slots (int64 [n], -1:
    # unknown) and times, whose counter columns are left at zero for DeviceCounts.dense
    candidate_slots: dict[str, np.ndarray] | None = None


@dataclass
class Assembled:
    """One request's features: the model's columns, and the values by name when asked."""

    columns: FeatureColumns
    ts: int
    as_of: int | None
    features: list[dict[str, Any]] | None = None


class OnlineFeatures:
    """The feature state of every entity, kept up to date from the features topic; the
    features of a request at any time from ``as_of`` - REPLAY_HORIZON_MS on.

    ``memory_mb``: the store's budget (entity_store.py: once reached, new entities are
    refused, and logged). ``spill_dir``: scratch that a node which spilled its state may have left;
    removed at start."""

    def __init__(self, bootstrap: str, topic: str, spec: FeatureSpec, memory_mb: int, spill_dir: str | Path,
                 connect_timeout_s: float = 20.0, snapshot: str | Path | None = None, snapshot_interval_s: float = 0.0) -> None:
        self.bootstrap, self.topic, self.spec = bootstrap, topic, spec
        self.snapshot = Path(snapshot) if snapshot else None
        self.snapshot_as_of: int | None = None  # features_as_of of the snapshot this node started from
        self.started_from_snapshot = False
        self.snapshot_refused: str | None = None  # why the snapshot was not used (the topic is replayed instead)
        self._serves_by_ids = False
        self._snapshot_writer = threading.Lock()
        self._snapshot_thread: threading.Thread | None = None
        self.snapshot_interval_s = snapshot_interval_s
        self._next_snapshot_at = time.monotonic() + snapshot_interval_s
        self.store = EntityStore(spec.history_len, memory_mb * 2**20)
        self.spill_dir = Path(spill_dir)
        self._refusals_logged = 0
        self._retrimmed_at: int | None = None  # the history cutoff of the last retrim of the store's side table
        self.connect_timeout_s = connect_timeout_s
        self.windows_ms = tuple(w * 1000 for w in spec.windows_s)
        self.max_window_ms = max(self.windows_ms)
        self._lock = threading.Lock()
        self.watermarks = Watermarks()
        self._counters = {kind: CounterCache(2 * len(self.windows_ms)) for kind in ("item", "category")}  # candidates' entities
        self._device_counts: DeviceCounts | None = None
        self._device_counts_made = threading.Lock()
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
        """Start reading (from the snapshot first, when there is one) on a thread of its own."""
        shutil.rmtree(self.spill_dir, ignore_errors=True)
        if self.snapshot is not None:
            remove_stale_temporaries(self.snapshot)
        self._thread.start()
        return self

    def serves_by_ids(self) -> bool:
        """Caught up with the topic once; or started from a snapshot while the broker cannot
        be reached (answers then say how stale they are). Once true, it stays true: a broker
        that comes back does not take the node out while it catches up."""
        if not self._serves_by_ids and (self.caught_up.is_set() or (self.started_from_snapshot and self.error is not None)):
            self._serves_by_ids = True
        return self._serves_by_ids

    def load_snapshot(self, path: Path) -> None:
        """Start from a snapshot (serving/features/feature_snapshot.py) and tail the topic from its
        positions. CorruptSnapshot (the state is then empty again) if it cannot be used."""
        t0 = time.monotonic()
        try:
            entities = self._load(path)
        except CorruptSnapshot:
            self._forget()
            raise
        except (pa.ArrowException, OSError, KeyError, ValueError, IndexError) as exc:  # a torn or damaged file
            self._forget()
            raise CorruptSnapshot(f"{path} cannot be read: {type(exc).__name__}: {exc}") from None
        log.info("online features: %s entities from %s in %.1f s, as of %s; tailing %s from there", f"{entities:,}", path,
                 time.monotonic() - t0, self.snapshot_as_of, self.topic)

    def _load(self, path: Path) -> int:
        header, batches = read_snapshot(path)
        if header.topic != self.topic:
            raise CorruptSnapshot(f"{path} holds {header.topic}, not {self.topic}")
        spec = {"windows_s": list(self.spec.windows_s), "history_len": self.spec.history_len}
        if header.spec != spec:  # other windows or history: the times and lists it kept are not enough
            raise CorruptSnapshot(f"{path} was written for feature spec {header.spec}, this node serves {spec}")
        as_of = header.watermarks.as_of(header.partitions) if header.partitions else None
        cutoff = as_of - REPLAY_HORIZON_MS if as_of is not None else None
        entities = 0
        with self._lock, no_huge_page_advice():
            self.store.reserve(batches.kind_counts())
            for batch in batches:
                batch.validate(full=True)  # offsets within their values: a damaged file fails here, not in an index
                codes, _, _ = batch_columns(batch)
                for k, kind in enumerate(ENTITIES):
                    part = batch if (codes == k).all() else batch.filter(pa.array(codes == k)) if (codes == k).any() else None
                    if part is not None:
                        _, ids, (imps, clicks, history) = batch_columns(part)
                        entities += self.store.load(kind, ids, imps, clicks, history if kind == "user" else None, cutoff)
            self.watermarks, self.partitions = header.watermarks, header.partitions
            self._positions = dict(header.positions)
            self.snapshot_as_of, self.started_from_snapshot = self.as_of(), True
        self._log_refusals()
        return entities

    def _forget(self) -> None:
        """Back to an empty state (a snapshot that failed halfway): the topic is replayed."""
        with self._lock:
            self.store.clear()
            self.watermarks, self.partitions, self._positions = Watermarks(), 0, {}
            for cache in self._counters.values():
                cache.clear()

    def save_snapshot(self, path: Path, chunk: int = 32_768) -> int:
        """Write the state to ``path`` (atomically), ``chunk`` entities per lock hold (copied
        out as columns) so requests keep being answered. The positions and watermarks are
        taken first: entities written later may be newer, which a replay from those
        positions makes consistent. One writer at a time."""
        with self._snapshot_writer:
            with self._lock:
                header = SnapshotHeader(self.topic, self.partitions, dict(self._positions),
                                        Watermarks(dict(self.watermarks.marks), dict(self.watermarks.parallelism)),
                                        {"windows_s": list(self.spec.windows_s), "history_len": self.spec.history_len})
                counts = self.store.entities()

            def batches():
                for kind in ENTITIES:
                    for lo in range(0, counts[kind], chunk):
                        with self._lock:
                            columns = self.store.export(kind, lo, min(counts[kind], lo + chunk))
                        history = columns.get("history")
                        if history is not None:
                            history = (np.where(history[0] < 0, -1, 3 * history[0]), history[1])
                        yield entity_batch(kind, columns["ids"], columns["imps"], columns["clicks"], history)
            return write_snapshot(path, header, batches())

    def wait_ready(self, timeout_s: float) -> bool:
        return self.caught_up.wait(timeout_s)

    def close(self) -> None:
        """Stop reading; write the snapshot (if configured)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        writer = self._snapshot_thread
        if writer is not None and writer.is_alive():
            writer.join()  # a periodic snapshot in progress: finish it (the final one follows)
        if self.snapshot is not None and self.partitions:
            self._write_snapshot()

    def _periodic_snapshot(self) -> None:
        try:
            self._write_snapshot()
        finally:
            self._next_snapshot_at = time.monotonic() + self.snapshot_interval_s

    def _write_snapshot(self) -> None:
        t0 = time.monotonic()
        try:
            size = self.save_snapshot(self.snapshot)
            log.info("online features: snapshot %s written (%.1f MiB, %.1f s)", self.snapshot, size / 2**20, time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 -- a full disk loses the snapshot, not the node: the topic is the source of truth
            log.warning("online features: snapshot %s not written: %s: %s", self.snapshot, type(exc).__name__, exc)

    def _run(self) -> None:
        if self.snapshot is not None and self.snapshot.exists():
            try:
                self.load_snapshot(self.snapshot)
            except CorruptSnapshot as exc:
                self.snapshot_refused = str(exc)
                log.warning("online features: %s; replaying %s from its start instead", exc, self.topic)
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
                if self.snapshot is not None and self.snapshot_interval_s > 0 and time.monotonic() >= self._next_snapshot_at:
                    # its own thread: reading the topic goes on while the snapshot is written
                    self._next_snapshot_at = float("inf")
                    self._snapshot_thread = threading.Thread(target=self._periodic_snapshot, name="features-snapshot", daemon=True)
                    self._snapshot_thread.start()
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
        batches = consumer.poll(200)
        for tp, records in batches.items():
            self._apply_records(records)
            with self._lock:  # a snapshot takes the positions under it
                self._positions[tp.partition] = records[-1].offset + 1
        now = time.monotonic()
        if now >= self._next_ends_at:
            parts = [TopicPartition(self.topic, p) for p in range(self.partitions)]
            self._ends = {tp.partition: off for tp, off in consumer.end_offsets(parts).items()}
            positions = {tp.partition: consumer.position(tp) for tp in parts}
            with self._lock:
                self._positions.update(positions)
            self._next_ends_at = now + 1.0
        if not self.caught_up.is_set() and self._target is not None:
            if not batches:  # an empty poll: positions may have moved past control records
                positions = {p: consumer.position(TopicPartition(self.topic, p)) for p in range(self.partitions)}
                with self._lock:
                    self._positions.update(positions)
            if all(self._positions.get(p, 0) >= end for p, end in self._target.items()):
                self.caught_up.set()
                log.info("online features caught up: %s", self.summary())

    def _apply_records(self, records: Sequence) -> None:
        store = self.store
        with self._lock:
            as_of = self.as_of()  # once a batch: the expiry horizon moves with the watermarks, not per record
            expire_at = as_of - self.max_window_ms - REPLAY_HORIZON_MS if as_of is not None else None
            cutoff = as_of - REPLAY_HORIZON_MS if as_of is not None else None
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
                    slot = store.slot_for_update(message.entity, message.entity_id)
                    if slot < 0:
                        continue
                    imps = np.frombuffer(message.imps, np.int64) if message.imps is not None else _NO_TIMES
                    clicks = np.frombuffer(message.clicks, np.int64) if message.clicks is not None else _NO_TIMES
                    store.put_bucket(message.entity, slot, imps, clicks, expire_at)
                    if message.entity in self._counters:
                        self._counters[message.entity].invalidate(slot)
                elif isinstance(message, History):
                    slot = store.slot_for_update("user", message.user_id)
                    if slot >= 0:
                        flat = np.fromiter(chain.from_iterable(message.clicks), np.int64, 3 * len(message.clicks))
                        store.put_history(slot, flat.reshape(-1, 3), cutoff)
            if cutoff is not None and (self._retrimmed_at is None or cutoff - self._retrimmed_at >= REPLAY_HORIZON_MS // 4):
                store.history.retrim_overflow(cutoff)
                self._retrimmed_at = cutoff
        store.compact_wasteful(self._lock)  # outside the lock but for the switch: requests go on meanwhile
        self._log_refusals()

    def _log_refusals(self) -> None:
        """A warning at the first entity refused over budget, then at every tenfold more."""
        refused = self.store.refused
        if refused and refused >= 10 * self._refusals_logged:
            self._refusals_logged = max(1, refused)
            log.warning("online features: over the memory budget (serving.feature_store_memory_mb, %.0f of %.0f MiB): "
                        "%s records of new entities refused so far; requests for them get cold-start features",
                        self.store.nbytes / 2**20, self.store.budget / 2**20, f"{refused:,}")

    # ------------------------------------------------------------------ requests
    def as_of(self) -> int | None:
        return self.watermarks.as_of(self.partitions) if self.partitions else None

    def counts_on(self, device) -> DeviceCounts:
        """The candidates' counts on ``device`` (serving/features/device_counts.py), for
        :meth:`assemble_batch` ``on_device``: one mirror per store, shared by its models."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._device_counts_made:
            if self._device_counts is None or self._device_counts.device != device:
                self._device_counts = DeviceCounts(device, self.windows_ms).warm_up()
            return self._device_counts

    def assemble_batch(self, queries: Sequence[ByIdsQuery], on_device: DeviceCounts | None = None) -> AssembledBatch:
        """The features of every candidate of ``queries``, as one block of columns (rows in
        query order). The users' slots, counts and histories in numpy for the whole batch;
        the items' and categories' counts gathered from :class:`CounterCache`, or, with
        ``on_device`` (and no query asking for its features back), left for the device:
        its mirror is brought up to date here and the answer says which slots to count.
        Unknown entities get cold-start features (zero counters, empty history)."""
        windows, store, nq = self.windows_ms, self.store, len(queries)
        sizes = np.fromiter(map(len, queries), np.int64, nq)
        ids = np.concatenate([q.candidates for q in queries]) if queries else np.zeros((0, 4), np.int64)
        query_ts = np.fromiter((q.ts for q in queries), np.int64, nq)
        user_ids = np.fromiter((q.user_id for q in queries), np.int64, nq)
        ts = np.repeat(query_ts, sizes)
        if on_device is not None and any(q.return_features for q in queries):
            on_device = None  # the named features are read on the host
        n, w = len(ids), len(windows)
        # counter columns: for each window, for user, item, category: (imps, clicks)
        grid = np.zeros((n, w, 3, 2), np.int64)
        slots = None
        with self._lock:
            users = store.slots("user", user_ids)
            user_counts = store.user_counts(users, query_ts, windows)
            hist_items, hist_categories, lengths = store.histories_before(users, query_ts)
            if on_device is None:
                grid[:, :, 1, :] = self._counters["item"].gather(store.slots("item", ids[:, 0]), ts, self._compute_for("item")).reshape(n, w, 2)
                grid[:, :, 2, :] = self._counters["category"].gather(store.slots("category", ids[:, 1]), ts,
                                                                    self._compute_for("category")).reshape(n, w, 2)
            else:
                slots = {"item": store.slots("item", ids[:, 0]), "category": store.slots("category", ids[:, 1]), "ts": ts}
                on_device.sync(store)
            as_of = self.as_of()
        grid[:, :, 0, :] = np.repeat(user_counts, sizes, axis=0).reshape(n, w, 2)
        counters = grid.reshape(n, w * 6)
        source = {  # a new integer input fails here (KeyError) rather than reaching the model unset
            "ts": ts, "user_id": np.repeat(user_ids, sizes),
            "item_id": ids[:, 0], "position": ids[:, 3],
            "local_hour": np.repeat(np.fromiter((q.local_hour for q in queries), np.int64, nq), sizes),
            "category_id": ids[:, 1], "advertiser_id": ids[:, 2],
        }
        columns = FeatureColumns(
            ints={name: source[name] for name in INT_COLUMNS}, counters=counters,
            device_hash=np.repeat(device_hashes([q.device for q in queries]), sizes),
            hist_items=hist_items, hist_categories=hist_categories,
            hist_lengths=lengths, hist_group=np.repeat(np.arange(nq, dtype=np.int64), sizes))
        features: list[list[dict[str, Any]] | None] = []
        at, hist_at = 0, 0
        for q, m, k in zip(queries, sizes.tolist(), lengths.tolist()):
            features.append(self._named(q, hist_items[hist_at: hist_at + k].tolist(), hist_categories[hist_at: hist_at + k].tolist(),
                                        counters[at: at + m]) if q.return_features else None)
            at, hist_at = at + m, hist_at + k
        return AssembledBatch(columns, as_of, features, slots)

    def assemble(self, user_id: int, ts: int, device: str, local_hour: int, candidates: Sequence, with_features: bool = False) -> Assembled:
        """One request's features (:meth:`assemble_batch` of one query): ``candidates`` are
        objects with item_id, category_id, advertiser_id, position."""
        ids = np.array([[getattr(c, f) for f in CANDIDATE_FIELDS] for c in candidates], np.int64).reshape(len(candidates), 4)
        batch = self.assemble_batch([ByIdsQuery(user_id, ts, device, local_hour, ids, with_features)])
        return Assembled(batch.columns, ts, batch.as_of, batch.features[0])

    def _compute_for(self, kind: str):
        store, windows = self.store, self.windows_ms

        def compute(slots: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return store.counts_until_many(kind, slots, ts, windows)
        return compute

    def _named(self, q: ByIdsQuery, items: list[int], categories: list[int], counters: np.ndarray) -> list[dict[str, Any]]:
        """The feature values by name, per candidate (``return_features``)."""
        names = self.spec.counter_columns()
        return [{"ts": q.ts, "user_id": q.user_id, "item_id": c[0], "position": c[3], "device": q.device, "local_hour": q.local_hour,
                 "category_id": c[1], "advertiser_id": c[2], "hist_item_ids": items, "hist_category_ids": categories,
                 **dict(zip(names, row))} for c, row in zip(q.candidates.tolist(), counters.tolist())]

    # ------------------------------------------------------------------ reporting
    def not_ready_reason(self) -> str:
        """Why the store has not caught up with its topic yet."""
        if self.error is not None and not self._ends:
            return f"the online feature store cannot read {self.topic} yet: {self.error}"
        if not self._ends:
            return f"the online feature store is connecting to the broker to read {self.topic}"
        behind = f"the online feature store is catching up with {self.topic} ({self.lag_records():,} records behind)"
        return f"{behind}; last error: {self.error}" if self.error is not None else behind

    def lag_records(self) -> int:
        return sum(max(0, end - self._positions.get(p, 0)) for p, end in self._ends.items())

    def status(self) -> dict[str, Any]:
        as_of, store = self.as_of(), self.store
        entities = store.entities()
        return {
            "topic": self.topic, "ready": self.serves_by_ids(), "caught_up": self.caught_up.is_set(), "error": self.error,
            "features_as_of": as_of, "lag_ms": int(time.time() * 1000) - as_of if as_of is not None else None,
            "lag_records": self.lag_records(), "partitions": self.partitions,
            "entities": entities, "in_memory": sum(entities.values()),
            "memory_bytes": store.nbytes, "memory_budget_bytes": store.budget, "over_budget": store.refusing,
            "refused": store.refused, "history_overflow": len(store.history.overflow), **self.counts,
            "last_corrupt": self.last_corrupt,
            "snapshot": str(self.snapshot) if self.snapshot else None, "started_from_snapshot_as_of": self.snapshot_as_of,
            "snapshot_refused": self.snapshot_refused,
            "counter_cache": {kind: {"entities": len(c), "bytes": c.nbytes, "hits": c.hits, "misses": c.misses}
                              for kind, c in self._counters.items()},
            "device_counts": None if (d := self._device_counts) is None else {
                "device": str(d.device), "bytes": d.nbytes, "full_copies": d.full_copies, "batches": d.batches},
        }

    def summary(self) -> str:
        s = self.status()
        return (f"{s['messages']:,} messages, {sum(s['entities'].values()):,} entities "
                f"({', '.join(f'{k} {v:,}' for k, v in s['entities'].items())}), {s['memory_bytes'] / 2**20:.1f} MiB, "
                f"{s['refused']:,} refused over budget, {s['corrupt']} corrupt, as of {s['features_as_of']}")
