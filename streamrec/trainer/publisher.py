"""Publishing versions while training continues.

A publish has three phases: *begin* (on the training thread: fix the key set, copy the
dense parameters; microseconds plus a small dense copy), *snapshot* (on the training
thread, ``rows_per_step`` rows between steps, so no single pause is long), and *write*
(Arrow files, checksums, rename, LATEST; on a background thread). Right after the write,
the same thread announces the version on the model-updates topic.

A new serving node starts from the newest full version or compacted image and applies the
deltas after it. Every ``compact_every`` deltas a background thread compacts the chain into
an image (``VersionWriter.compact``) and deletes what the newest ``keep_fulls`` starting points
do not need, so a seconds cadence grows neither the store nor a node's start-up; a full
version every ``full_every`` deltas starts a new chain (rarely needed with compaction: the
full snapshot costs the training thread a pass over every row). A poisoned model (non-finite values) is never written: the write
checks every value it is about to publish and refuses.

A delta is built on the writer's own previous version, and the store refuses it unless
LATEST is that version; the next version is then a full one. This is also how a resumed
trainer makes the store equal its state: a store whose LATEST is not the checkpoint's
last version (versions published after the checkpoint by the run that crashed) gets a
full version first. A publish that fails is retried as a full version at the next
interval; ``max_failures`` failures in a row, or a lost writer lease, end training
(:class:`PublishFailed`): a trainer that cannot publish must not look healthy.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from streamrec.contracts.delta import SparseDelta
from streamrec.modelstore.store import CorruptVersion
from streamrec.modelstore.writer import VersionWriter
from streamrec.embedding.collection import EmbeddingCollection, SnapshotTask, to_host
from streamrec.modelstore.lease import LeaseLost
from streamrec.plumbing.config import TrainerConfig

log = logging.getLogger(__name__)


class PoisonedModel(RuntimeError):
    """The model holds NaN/inf values: it must not be published or checkpointed."""


class PublishFailed(RuntimeError):
    """Versions cannot be published (failures in a row, or the writer lease was lost)."""


@dataclass(frozen=True)
class PublishSettings:
    """How often and how a trainer publishes (``[trainer]`` keys of the config)."""

    interval_s: float  # publish_interval_s: seconds between versions
    full_every: int  # a full version after this many deltas
    rows_per_step: int  # publish_rows_per_step: rows snapshotted between two training steps
    keep_fulls: int = 3  # starting points (fulls, images) garbage collection keeps
    max_failures: int = 3  # max_publish_failures: failed publishes in a row that end training
    compact_every: int = 0  # deltas between compactions (0: never)
    collect_garbage: bool = True  # this writer compacts and deletes old versions (one per model: rank 0)

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.full_every < 1 or self.rows_per_step < 1 or self.max_failures < 1:
            raise ValueError("publish_interval_s must be > 0, full_every, publish_rows_per_step and max_publish_failures >= 1")

    @classmethod
    def from_config(cls, tcfg: TrainerConfig, collect_garbage: bool = True) -> "PublishSettings":
        return cls(tcfg.publish_interval_s, tcfg.full_every, tcfg.publish_rows_per_step, tcfg.keep_fulls,
                   tcfg.max_publish_failures, tcfg.compact_every, collect_garbage)


@dataclass(frozen=True)
class ChainPosition:
    """Where this trainer's version chain stands: saved in checkpoints (as state.json keys of
    the same names), so a resumed publisher continues the chain or starts a new one."""

    last_version: int | None = None
    deltas_since_full: int = 0
    force_full: bool = False  # the next version must be a full one

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "ChainPosition":
        return cls(state.get("last_version"), state.get("deltas_since_full", 0), state.get("force_full", False))


@dataclass
class _PendingVersion:
    """A version begun on the training thread, not yet handed to the writer thread."""

    kind: str
    dense: dict[str, torch.Tensor]  # host copy of the dense parameters
    meta: dict[str, Any]
    begin_s: float
    snapshot_s: float = 0.0


@dataclass
class PublishRecord:
    version: int
    kind: str
    rows: int
    begin_s: float  # training-thread time to begin (key set + dense copy)
    snapshot_s: float  # training-thread time spent stepping the snapshot
    write_s: float  # background time to write and rename
    trained_through_ms: int
    finished_at: float = field(default_factory=time.time)


# (version writer, kind, parent: the delta's base, tables, dense, meta, refusal) -> the version written
WriteVersion = Callable[[VersionWriter, str, "int | None", dict[str, SparseDelta], dict[str, torch.Tensor], dict[str, Any], "str | None"], int]


def _refusal(tables: dict[str, SparseDelta], dense: dict[str, torch.Tensor]) -> str | None:
    """Why these values must not be published (non-finite ones), or None."""
    for name, delta in tables.items():
        if len(delta.values) and not bool(torch.isfinite(delta.values).all()):
            return f"table {name} holds non-finite embedding values"
    for name, tensor in dense.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"dense parameter {name} holds non-finite values"
    return None


class Publisher:
    """Publishes the collection and the dense parameters as versions through ``writer``,
    continuing the chain at ``resumed`` (a checkpoint's) or starting one. ``announce`` is
    called with each version's manifest summary; ``write_version`` writes a version (the
    sharded trainer writes with every rank; default: this process alone)."""

    def __init__(self, embeddings: EmbeddingCollection, writer: VersionWriter, settings: PublishSettings,
                 resumed: ChainPosition = ChainPosition(), announce: Callable[[dict], None] | None = None,
                 write_version: "WriteVersion | None" = None) -> None:
        self.embeddings, self.writer, self.settings = embeddings, writer, settings
        self.model_store = writer.store  # where versions are read back: chains, manifests, retention
        self.announce = announce
        self.write_version = write_version or self._write_local
        last_version = resumed.last_version
        self.deltas_since_base = resumed.deltas_since_full
        self.compactions: list[dict[str, Any]] = []
        self._compactor: ThreadPoolExecutor | None = None
        self._compaction: Future | None = None
        self.last_version = last_version
        self.deltas_since_full = resumed.deltas_since_full
        self.failures, self.last_error = 0, ""
        self.force_full = resumed.force_full or last_version is None  # a chain starts with a full version
        newest, _ = self.model_store.resolve_latest()
        if last_version is not None and newest != last_version:
            self.force_full = True
            log.warning("the model store's newest version is %s, not %d (this trainer's last): the next version is a full one, "
                        "so the store equals this trainer's state again", newest, last_version)
        elif last_version is not None and not self.force_full:
            self._full_if_broken(last_version)
        self.records: list[PublishRecord] = []
        self.poisoned: str | None = None
        self._task: SnapshotTask | None = None
        self._future: Future | None = None
        self._pending: _PendingVersion | None = None
        self._last_begin = time.monotonic()

    # ------------------------------------------------------------------ state
    @property
    def busy(self) -> bool:
        return self._task is not None or self._future is not None

    def due(self) -> bool:
        return not self.busy and not self.poisoned and time.monotonic() - self._last_begin >= self.settings.interval_s

    def chain(self) -> ChainPosition:
        """Where the chain stands now (what a checkpoint saves)."""
        return ChainPosition(self.last_version, self.deltas_since_full, self.force_full)

    # ------------------------------------------------------------------ phases
    def begin(self, dense: dict[str, torch.Tensor], meta: dict[str, Any], kind: str | None = None) -> str:
        """Start a version now (training thread). Returns its kind."""
        if self.poisoned:
            raise PoisonedModel(self.poisoned)
        if self.busy:
            raise RuntimeError("a publish is already in progress")
        if kind is None:
            kind = "full" if self.force_full or self.deltas_since_full >= self.settings.full_every else "delta"
        t0 = time.perf_counter()
        self._task = self.embeddings.begin_snapshot(kind)
        dense_copy = {k: v.detach().to("cpu", copy=True) for k, v in dense.items()}
        self._pending = _PendingVersion(kind, dense_copy, dict(meta), begin_s=time.perf_counter() - t0)
        self._last_begin = time.monotonic()
        return kind

    def pump(self) -> PublishRecord | None:
        """Advance the current publish by one bounded slice; returns a record when a
        version has just become visible."""
        if self._task is not None:
            t0 = time.perf_counter()
            done = self._task.step(self.settings.rows_per_step)
            self._pending.snapshot_s += time.perf_counter() - t0
            if done:
                tables, pending = self._task.result(), self._pending
                self._task = None
                self._future = self.embeddings.writer.submit(self._write, pending, tables)
        if self._future is not None and self._future.done():
            future, self._future = self._future, None
            try:
                record = future.result()
            except PoisonedModel as exc:
                self.poisoned = str(exc)
                log.critical("NOT PUBLISHED: %s. Publishing is stopped; the last good version is %s.", exc, self.last_version)
                raise
            except LeaseLost as exc:
                raise PublishFailed(str(exc)) from None
            except Exception as exc:  # I/O: keep training, and make the next version a full one
                self.force_full = True
                self.failures, self.last_error = self.failures + 1, str(exc)
                if self.failures >= self.settings.max_failures:
                    raise PublishFailed(f"{self.failures} publishes in a row failed, the last with: {exc}") from None
                log.error("publishing failed (%s, %d of %d in a row); the next version will be a full one", exc,
                          self.failures, self.settings.max_failures)
                return None
            self.failures = 0
            self._finish(record)
            return record
        return None

    def flush(self) -> PublishRecord | None:
        """Finish the current publish (blocking)."""
        record = None
        while self.busy:
            if self._future is not None:
                self._future.exception()  # wait
            record = self.pump() or record
        return record

    def abandon(self, reason: str) -> None:
        """The model is poisoned: drop the snapshot in progress and publish nothing more."""
        self.poisoned = reason
        self._task = None
        if self._future is not None:
            self._future.cancel()

    # ------------------------------------------------------------------ writer thread
    def _write(self, pending: _PendingVersion, tables: dict[str, SparseDelta]) -> PublishRecord:
        t0 = time.perf_counter()
        tables = to_host(tables)
        kind, keep_fulls = pending.kind, self.settings.keep_fulls
        version = self.write_version(self.writer, kind, self.last_version, tables, pending.dense, pending.meta,
                                     _refusal(tables, pending.dense))
        self._announce(version)  # from here: the training thread learns of it only at its next pump
        if kind == "full" and keep_fulls and self.settings.collect_garbage:
            try:
                self.model_store.gc(keep_fulls=keep_fulls)
            except Exception as exc:  # the version is out: old ones are deleted at the next full
                log.warning("deleting old versions failed: %s", exc)
        rows = sum(len(d.keys) + len(d.deleted) for d in tables.values())
        return PublishRecord(version, kind, rows, pending.begin_s, pending.snapshot_s, time.perf_counter() - t0,
                             int(pending.meta.get("trained_through_ms", 0)))

    def _write_local(self, writer: VersionWriter, kind: str, parent: int | None, tables: dict[str, SparseDelta],
                     dense: dict[str, torch.Tensor], meta: dict[str, Any], refusal: str | None) -> int:
        if refusal:
            raise PoisonedModel(refusal)
        return self.embeddings.write(writer, kind, tables, dense, meta, parent)

    def _finish(self, record: PublishRecord) -> None:
        self.last_version = record.version
        if record.kind == "full":
            self.deltas_since_full, self.force_full, self.deltas_since_base = 0, False, 0
        else:
            self.deltas_since_full += 1
            self.deltas_since_base += 1
            self._maybe_compact(record.version)
        self.records.append(record)
        log.info("published version %d (%s, %d rows; training paused %.1f ms, write %.0f ms)", record.version, record.kind,
                 record.rows, 1000 * (record.begin_s + record.snapshot_s), 1000 * record.write_s)

    def _maybe_compact(self, version: int) -> None:
        """Compact the chain up to ``version`` in the background, one compaction at a time."""
        settings = self.settings
        if not (settings.compact_every and settings.collect_garbage and self.deltas_since_base >= settings.compact_every):
            return
        if self._compaction is not None and not self._compaction.done():
            return  # the next delta tries again
        self.deltas_since_base = 0
        if self._compactor is None:
            self._compactor = ThreadPoolExecutor(1, thread_name_prefix="compactor")
        self._compaction = self._compactor.submit(self._compact, version)

    def _full_if_broken(self, version: int) -> None:
        """Make the next version a full one when ``version``'s chain cannot be loaded (a delta
        deleted or damaged): every delta built on it would be refused by every node."""
        try:
            self.model_store.check_present(version)
        except CorruptVersion as exc:
            self._broken_chain(version, exc)
        except OSError as exc:  # the store unreadable now: the first publish says so, or the next compaction notices
            log.warning("could not check the chain of version %d (%s)", version, exc)

    def _broken_chain(self, version: int, exc: Exception) -> None:
        self.force_full = True
        log.error("the chain of version %d is broken (%s): the next version is a full one, so serving nodes stranded "
                  "behind the break catch up", version, exc)

    def _compact(self, version: int) -> None:
        t0 = time.perf_counter()
        try:
            rows = self.writer.compact(version)
            keep_fulls = self.settings.keep_fulls
            deleted = self.model_store.gc(keep_fulls=keep_fulls) if keep_fulls else []
        except CorruptVersion as exc:  # compaction reads the whole chain: the first to notice a break
            self._broken_chain(version, exc)
            return
        except Exception as exc:  # the chain stays longer until the next try; versions are unaffected
            log.warning("compacting the chain up to version %d failed: %s", version, exc)
            return
        seconds = time.perf_counter() - t0
        self.compactions.append({"version": version, "rows": rows, "seconds": seconds, "deleted_versions": len(deleted)})
        log.info("compacted the chain up to version %d (%d rows, %.2f s); %d old versions deleted", version, rows, seconds, len(deleted))

    def close(self) -> None:
        """Wait for a compaction in progress (it is atomic either way: this just finishes it)."""
        if self._compactor is not None:
            self._compactor.shutdown(wait=True)

    def _announce(self, version: int) -> None:
        """Tell serving nodes (model-updates topic) that ``version`` is in the store (writer thread)."""
        if self.announce is None:
            return
        try:
            manifest = self.model_store.manifest(version)
            self.announce({k: manifest.get(k) for k in ("model", "version", "kind", "parent", "created_at", "trained_through_ms")})
        except Exception as exc:  # the store is the source of truth; pollers still find it
            log.warning("announcing version %d failed: %s", version, exc)

    def stall_ms_per_million_rows(self) -> float:
        rows = sum(r.rows for r in self.records)
        paused = sum(r.begin_s + r.snapshot_s for r in self.records)
        return math.nan if rows == 0 else 1000 * paused / rows * 1e6


class TopicAnnouncer:
    """Announces versions on the model-updates topic, keyed by the model's name (the
    publisher calls it on its writer thread, right after a version is in the store).

    Best effort by design: the store is the source of truth and serving nodes also poll it.
    An announcement the producer gives up on is counted (``failed``) and logged, never raised.
    """

    FLUSH_S = 10.0  # how long one announcement may hold up the writer thread
    CLOSE_S = 5.0

    def __init__(self, bootstrap: str, topic: str, model: str, timeout_s: float) -> None:
        from streamrec.plumbing.bus.clients import make_producer

        self.producer = make_producer(bootstrap, timeout_s=timeout_s)
        self.topic, self.key = topic, model.encode()
        self.sent = self.delivered = self.failed = 0

    def __call__(self, message: dict) -> None:
        import orjson
        from kafka.errors import KafkaError, KafkaTimeoutError

        version = message.get("version")
        self.sent += 1
        try:  # send blocks (max_block_ms) only while the topic's metadata or buffer space is missing
            future = self.producer.send(self.topic, key=self.key, value=orjson.dumps(message))
        except KafkaError as exc:
            self._failed(version, exc)
            return
        future.add_callback(self._delivered).add_errback(self._failed, version)
        try:
            self.producer.flush(timeout=self.FLUSH_S)
        except KafkaTimeoutError:
            log.warning("announcing version %s: no acknowledgement within %g s; the producer keeps trying",
                        version, self.FLUSH_S)

    def _delivered(self, _metadata) -> None:
        self.delivered += 1

    def _failed(self, version: int | None, exc: BaseException) -> None:
        self.failed += 1
        log.warning("announcing version %s on %s failed, %d announcements lost so far (nodes still find "
                    "versions by polling the store): %s", version, self.topic, self.failed, exc)  # kafka's errors name their type

    def close(self) -> None:
        from kafka.errors import KafkaError

        try:
            self.producer.close(timeout=self.CLOSE_S)
        except KafkaError as exc:  # kafka-python's close flushes first; its I/O thread is a daemon
            log.warning("%d announcements were not acknowledged before shutdown: %s",
                        self.sent - self.delivered - self.failed, exc)
