"""Decoding and batching on a thread (the trainer runs it inside its sample reader process,
trainer/reader.py).

A background thread cuts the source's chunks into batches of ``batch_size`` samples,
converts them to arrays (model/host_batch.py: no torch) and keeps up to ``depth`` batches queued. Another reads the
chunks (decoded, checked) up to ``CHUNKS_AHEAD`` ahead of it: decoding runs mostly in
pyarrow without the GIL, so it overlaps the batching's Python and numpy work instead of
adding to it.
A partial batch whose oldest sample has waited ``max_delay_s`` is released (checked at
every chunk the source yields, an empty one included): an online learner should not sit on
fresh samples waiting for a full batch. ``max_delay_s=None`` (sample files) never releases a
partial batch but the last, so a file run cuts the same batches run after run.

Each batch carries the source *position after it*: for every partition, the first row
not yet handed to the trainer (rows still buffered here count as not consumed), so a
checkpoint taken after a batch resumes without skipping or repeating anything.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from streamrec.model.host_batch import HostBatch, host_batch_from_table
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.trainer.sources import Rejection, SampleChunk, SampleSource

END = "end"  # the source is exhausted
IDLE = "idle"  # nothing to train on right now
CHUNKS_AHEAD = 2  # chunks read ahead of the batching


@dataclass
class Skipped:
    """Only rejected rows were consumed since the last batch: advance positions, count them."""

    positions: dict[int, int]
    rejected: Counter


class Prefetcher:
    """``prepare``: more work on each batch in this thread (the trainer's reader lays out the
    exchange's ids here: ``embedding.sharded.layout_on_host``)."""

    def __init__(self, source: SampleSource, spec: FeatureSpec, batch_size: int, history_len: int, depth: int = 4,
                 max_delay_s: float | None = None,
                 prepare: Callable[[HostBatch], None] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.source, self.spec, self.batch_size, self.history_len = source, spec, batch_size, history_len
        self.max_delay_s, self.prepare = max_delay_s, prepare
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.rejected: Counter = Counter()  # every reason decoded so far (batches carry their own share)
        self.decode_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainer-prefetch", daemon=True)
        self._chunks: queue.Queue = queue.Queue(maxsize=CHUNKS_AHEAD)
        self._reader = threading.Thread(target=self._read_chunks, name="trainer-chunks", daemon=True)

    def start(self) -> "Prefetcher":
        self._reader.start()
        self._thread.start()
        return self

    def get(self, timeout: float | None = None):
        """The next HostBatch, IDLE, or END; re-raises a failure of the reading thread."""
        try:
            item = self.queue.get(timeout=timeout)
        except queue.Empty:
            return IDLE
        if isinstance(item, BaseException):
            raise item
        return item

    def poll(self, timeout: float) -> object | None:
        """The next item as the reading thread queued it (a HostBatch, Skipped, IDLE, END or
        the thread's failure, not raised), or None if none came within ``timeout``."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self) -> None:
        """Stop both threads (the source is not touched after this returns: it may be closed)."""
        self._stop.set()
        while self._thread.is_alive() or self._reader.is_alive():
            try:
                self.queue.get_nowait()  # unblock a put
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)
            self._reader.join(timeout=0.05)

    def _put(self, item, into: queue.Queue | None = None) -> bool:
        into = self.queue if into is None else into
        while not self._stop.is_set():
            try:
                into.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _read_chunks(self) -> None:
        """The source's chunks, then END (or the source's failure), into ``_chunks``."""
        try:
            for chunk in self.source.chunks():
                if not self._put(chunk, self._chunks):
                    return
            self._put(END, self._chunks)
        except BaseException as exc:  # the batching thread hands it on
            self._put(exc, self._chunks)

    def _chunks_read(self) -> Iterator[SampleChunk]:
        """What ``_read_chunks`` read, in order; raises its failure."""
        while not self._stop.is_set():
            try:
                item = self._chunks.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _run(self) -> None:
        tables: list[pa.Table] = []
        parts: list[np.ndarray] = []
        offs: list[np.ndarray] = []
        buffered = 0
        consumed: dict[int, int] = {}
        rejects: list[Rejection] = []  # not yet handed to the trainer
        oldest = None
        try:
            for chunk in self._chunks_read():
                if self._stop.is_set():
                    return
                t0 = time.perf_counter()
                rejects += chunk.rejected
                for rejection in chunk.rejected:
                    self.rejected[rejection.reason.split(":")[0]] += 1
                for p, o in chunk.consumed.items():
                    consumed[p] = max(consumed.get(p, 0), o)
                if chunk.table.num_rows:
                    tables.append(chunk.table)
                    parts.append(chunk.partitions)
                    offs.append(chunk.offsets)
                    buffered += chunk.table.num_rows
                    oldest = oldest or time.monotonic()
                self.decode_s += time.perf_counter() - t0
                flush_partial = bool(buffered) and self.max_delay_s is not None and time.monotonic() - oldest >= self.max_delay_s
                while buffered >= self.batch_size or flush_partial:
                    t0 = time.perf_counter()
                    table = pa.concat_tables(tables)
                    part, off = np.concatenate(parts), np.concatenate(offs)
                    n = min(self.batch_size, buffered)
                    batch = host_batch_from_table(table.slice(0, n), self.spec, self.history_len)
                    batch.positions = self._positions(consumed, part[n:], off[n:])
                    batch.rejected, rejects = self._settle(rejects, batch.positions)
                    self._ready(batch)
                    tables, parts, offs = [table.slice(n)], [part[n:]], [off[n:]]
                    buffered -= n
                    oldest = time.monotonic() if buffered else None
                    flush_partial = False
                    self.decode_s += time.perf_counter() - t0
                    if not self._put(batch):
                        return
                if not buffered and rejects:
                    settled, rejects = self._settle(rejects, consumed)
                    if not self._put(Skipped(dict(consumed), settled)):
                        return
                if chunk.empty and not buffered and not self._put(IDLE):
                    return
            if buffered:
                table = pa.concat_tables(tables)
                batch = host_batch_from_table(table, self.spec, self.history_len)
                batch.positions, batch.rejected = dict(consumed), _count_reasons(rejects)
                self._put(self._ready(batch))
            elif rejects:
                self._put(Skipped(dict(consumed), _count_reasons(rejects)))
            self._put(END)
        except BaseException as exc:  # hand the failure to the training thread
            self._put(exc)

    def _ready(self, batch: HostBatch) -> HostBatch:
        """The batch as the trainer takes it: prepared."""
        if self.prepare is not None:
            self.prepare(batch)
        return batch

    @staticmethod
    def _positions(consumed: dict[int, int], rest_parts: np.ndarray, rest_offsets: np.ndarray) -> dict[int, int]:
        positions = dict(consumed)
        for p in np.unique(rest_parts).tolist():  # buffered rows are not consumed yet
            positions[p] = int(rest_offsets[rest_parts == p].min())
        return positions

    @staticmethod
    def _settle(rejects: list[Rejection], positions: dict[int, int]) -> tuple[Counter, list[Rejection]]:
        """Rejected rows before ``positions`` belong to this hand-over; the rest wait."""
        done, later = Counter(), []
        for r in rejects:
            if r.offset < positions.get(r.partition, 0):
                done[r.reason.split(":")[0]] += 1
            else:
                later.append(r)
        return done, later


def _count_reasons(rejects: list[Rejection]) -> Counter:
    """Rejections by reason (the part of ``reason: detail`` before the colon)."""
    return Counter(r.reason.split(":")[0] for r in rejects)
