"""Where samples come from: the ``streamrec.samples`` topic or sample files.

Both sources yield the same :class:`SampleChunk` (checked samples plus where each row
came from), so everything after decoding is one code path. A *position* is
``{partition: next offset}``: Kafka partitions and offsets, or, for files, the file's
index in the sorted list and a row number. Checkpoints store positions; a source
started from a position continues exactly after it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.sample_wire import check_samples, decode_samples
from streamrec.trainer.rejected import RejectedLog

log = logging.getLogger(__name__)


def _answered(call: Callable, timeout_s: float):
    """``call()``, retried through a broker that is away (restarting, a leader moving) for up
    to ``DELIVERY_TIMEOUTS × timeout_s``, the window a producer rides out too: a trainer that
    starts during a broker restart waits it out, one that cannot reach Kafka at all says so."""
    from kafka.errors import KafkaError

    from streamrec.plumbing.bus.clients import DELIVERY_TIMEOUTS, BusUnavailable

    window_s = DELIVERY_TIMEOUTS * timeout_s
    deadline, said = time.monotonic() + window_s, 0.0
    while True:
        try:
            return call()
        except (KafkaError, BusUnavailable) as exc:
            if (isinstance(exc, KafkaError) and not exc.retriable) or time.monotonic() > deadline:
                raise
            if time.monotonic() - said >= 5:
                said = time.monotonic()
                log.info("Kafka did not answer (%s); trying again for up to %.0f s", exc, deadline - said)
            time.sleep(0.5)


class Rejection(NamedTuple):
    """A row the checks refused: where it was read, and why (``reason: detail``)."""

    partition: int
    offset: int
    reason: str


@dataclass
class SampleChunk:
    table: pa.Table  # checked samples only
    partitions: np.ndarray  # [rows] source partition of each row
    offsets: np.ndarray  # [rows] offset of each row in its partition
    consumed: dict[int, int] = field(default_factory=dict)  # next position per partition, rejected rows included
    rejected: list[Rejection] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing was read (as opposed to: only rejected rows were read)."""
        return not self.consumed


class SampleSource(Protocol):
    def chunks(self) -> Iterator[SampleChunk]:
        """Chunks in order; an empty chunk means "nothing right now" (the caller may idle)."""

    def lag(self) -> int | None:
        """Samples behind the head (Kafka) or left to read (files); None if unknown."""

    def commit(self, positions: dict[int, int]) -> None:
        """Record positions where others can see them (the consumer group)."""

    def close(self) -> None: ...


def sample_files(paths: list[str]) -> list[Path]:
    """Parquet sample files from files or directories (a directory means its samples.parquet)."""
    out = []
    for p in map(Path, paths):
        f = p / "samples.parquet" if p.is_dir() else p
        if not f.is_file():
            raise FileNotFoundError(f"{f}: no sample file (run `streamrec pipeline offline RUN` to make one)")
        out.append(f)
    return out


STRIPE_ROWS = 64  # rows of a file that go to one rank in turn (several ranks, a file of few row groups)
GROUPS_PER_RANK = 4  # row groups a file needs per rank for each rank of several to read whole groups of its own


class FileSampleSource:
    """Parquet files of samples (``streamrec pipeline offline``), read in row order.

    ``shard=(rank, ranks)``: the ranks of a sharded trainer read disjoint shares of each
    file and move through its time together, as one rank would. A file of many row groups
    (at least ``GROUPS_PER_RANK`` a rank, as ``pipeline offline`` writes them) is shared by
    whole row groups: rank ``r`` reads groups ``r``, ``r + ranks``, ... and decodes nothing
    else (so it runs up to ``r`` groups ahead of rank 0). Any other file is shared by
    stripes: every ``ranks``-th stripe of ``STRIPE_ROWS`` rows, starting at the ``rank``-th,
    with every row decoded by every rank. A rank's position in a file is the row after the
    last one it read."""

    def __init__(self, paths: list[str], spec: FeatureSpec, start: dict[int, int] | None = None, chunk_rows: int = 16384,
                 loop: bool = False, shard: tuple[int, int] = (0, 1)) -> None:
        self.files = sample_files(paths)
        self.spec = spec
        self.start = dict(start or {})
        self.chunk_rows = chunk_rows
        self.loop = loop  # benchmarks: read the files again and again
        self.rank, self.ranks = shard
        total = sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)
        self._left = (total - sum(self.start.values())) // self.ranks  # exact for one rank, near for several

    def chunks(self) -> Iterator[SampleChunk]:
        while True:
            for part, path in enumerate(self.files):
                skip = self.start.get(part, 0)
                batches, file_rows, striped = self._decoded(pq.ParquetFile(path), skip)
                read = 0  # rows of ``batches`` so far
                for batch in batches:
                    table = pa.Table.from_batches([batch])
                    rows = file_rows(read, read + table.num_rows)
                    read += table.num_rows
                    if not len(rows) or rows[-1] < skip:
                        continue
                    if rows[0] < skip:  # resuming inside this batch (its rows ascend)
                        done = int(np.searchsorted(rows, skip))
                        table, rows = table.slice(done), rows[done:]
                    consumed = {part: int(rows[-1]) + 1}
                    if striped:  # this rank's stripes
                        mine = (rows // STRIPE_ROWS) % self.ranks == self.rank
                        table, rows = table.filter(pa.array(mine)), rows[mine]
                    good, reasons = check_samples(table, self.spec)
                    self._left -= table.num_rows
                    yield SampleChunk(table.filter(pa.array(good)) if reasons else table, np.full(int(good.sum()), part, np.int64),
                                      rows[good], consumed, [Rejection(part, int(rows[i]), r) for i, r in reasons])
            if not self.loop:
                return
            self.start = {}

    def _decoded(self, file: pq.ParquetFile, skip: int) -> tuple[Iterator[pa.RecordBatch], Callable[[int, int], np.ndarray], bool]:
        """What this rank decodes of ``file``: (its batches; the file's row numbers of their
        rows ``lo`` to ``hi``, counted across the batches; whether to keep only this rank's
        stripes of them). Row groups of other ranks, and of this rank's that end before
        ``skip``, are not read at all."""
        meta = file.metadata
        sizes = np.array([meta.row_group(g).num_rows for g in range(meta.num_row_groups)], np.int64)
        if self.ranks == 1 or len(sizes) < GROUPS_PER_RANK * self.ranks:
            return file.iter_batches(batch_size=self.chunk_rows), lambda lo, hi: np.arange(lo, hi, dtype=np.int64), self.ranks > 1
        ends = np.cumsum(sizes)
        groups = np.array([g for g in range(self.rank, len(sizes), self.ranks) if ends[g] > skip], np.int64)
        if not len(groups):
            return iter(()), lambda lo, hi: np.empty(0, np.int64), False
        firsts = ends[groups] - sizes[groups]  # each group's first row in the file
        read_ends = np.cumsum(sizes[groups])  # where each group ends in the batches
        shift = firsts - (read_ends - sizes[groups])  # a row's place in the file minus its place in the batches

        def file_rows(lo: int, hi: int) -> np.ndarray:
            at = np.arange(lo, hi, dtype=np.int64)
            return at + shift[np.searchsorted(read_ends, at, side="right")]

        return file.iter_batches(batch_size=self.chunk_rows, row_groups=groups.tolist()), file_rows, False

    def lag(self) -> int | None:
        return max(0, self._left)

    def commit(self, positions: dict[int, int]) -> None:
        pass  # files have no group to tell

    def close(self) -> None:
        pass


class KafkaSampleSource:
    """The samples topic through a kafka-python consumer group, offsets committed manually.

    Where to start: ``start`` positions (a checkpoint's) win; otherwise the group's
    committed offsets; otherwise the earliest retained sample.

    ``shard=(rank, ranks)``: this rank reads the partitions ``p`` with ``p % ranks == rank``
    (one consumer group for all ranks; each commits only its own partitions).

    KafkaConsumer is not thread-safe and ``chunks`` runs on the prefetch thread, so
    ``commit`` and ``lag`` never touch the consumer from the caller's thread: commits are
    handed to the polling loop (and done at ``close`` at the latest), lag is measured there.
    """

    def __init__(self, bootstrap: str, topic: str, group: str, spec: FeatureSpec, start: dict[int, int] | None = None,
                 timeout_s: float = 20.0, poll_ms: int = 200, max_records: int = 8192, shard: tuple[int, int] = (0, 1),
                 rejected_log: RejectedLog | None = None) -> None:
        from kafka import TopicPartition

        from streamrec.plumbing.bus.clients import make_consumer

        self.topic, self.spec, self.poll_ms, self.max_records = topic, spec, poll_ms, max_records
        self.rejected_log = rejected_log  # refused messages are kept there, not only counted
        self.consumer = _answered(lambda: make_consumer(bootstrap, group_id=group, timeout_s=timeout_s, auto_offset_reset="earliest",
                                                        isolation_level="read_committed",  # the pipeline writes in transactions
                                                        max_poll_records=max_records), timeout_s)
        partitions = _answered(lambda: self.consumer.partitions_for_topic(topic), timeout_s)
        if not partitions:
            self.consumer.close()
            raise FileNotFoundError(f"topic {topic!r} does not exist on {bootstrap} (run `streamrec kafka up`)")
        rank, ranks = shard
        if len(partitions) < ranks:
            self.consumer.close()
            raise ValueError(f"topic {topic!r} has {len(partitions)} partitions, fewer than the {ranks} training ranks: "
                             "give it at least as many partitions as ranks (each rank reads its own)")
        self.assignment = [TopicPartition(topic, p) for p in sorted(partitions) if p % ranks == rank]
        self.consumer.assign(self.assignment)  # this rank owns these partitions; checkpoints hold its positions
        committed = {tp.partition: _answered(lambda: self.consumer.committed(tp), timeout_s) for tp in self.assignment}
        for tp in self.assignment:
            where = (start or {}).get(tp.partition, committed.get(tp.partition))
            if where is None:
                self.consumer.seek_to_beginning(tp)
            else:
                self.consumer.seek(tp, where)
        self._lag: int | None = None
        self._lag_checked = 0.0
        self._to_commit: dict[int, int] | None = None

    def chunks(self) -> Iterator[SampleChunk]:
        while True:
            self._commit_pending()
            self._measure_lag()
            polled = self.consumer.poll(self.poll_ms, self.max_records)
            records = [r for recs in polled.values() for r in recs]
            if not records:
                yield SampleChunk(self.spec.schema().empty_table(), np.empty(0, np.int64), np.empty(0, np.int64))
                continue
            table, index, rejected = decode_samples([r.value for r in records], self.spec)
            partitions = np.array([r.partition for r in records], dtype=np.int64)
            offsets = np.array([r.offset for r in records], dtype=np.int64)
            consumed: dict[int, int] = {}
            for p, o in zip(partitions.tolist(), offsets.tolist()):
                consumed[p] = max(consumed.get(p, 0), o + 1)
            for i, reason in rejected:
                log.debug("rejected sample at %s:%d:%d: %s", self.topic, partitions[i], offsets[i], reason)
                if self.rejected_log is not None:
                    self.rejected_log.add(self.topic, int(partitions[i]), int(offsets[i]), reason, records[i].value)
            if rejected and self.rejected_log is not None:
                self.rejected_log.flush()
            yield SampleChunk(table, partitions[index], offsets[index], consumed,
                              [Rejection(int(partitions[i]), int(offsets[i]), reason) for i, reason in rejected])

    def _measure_lag(self) -> None:
        now = time.monotonic()
        if now - self._lag_checked > 2.0:
            self._lag_checked = now
            try:
                ends = self.consumer.end_offsets(self.assignment)
                self._lag = sum(max(0, ends[tp] - self.consumer.position(tp)) for tp in self.assignment)
            except Exception as exc:  # lag is informational; never stop training for it
                log.debug("lag check failed: %s", exc)

    def lag(self) -> int | None:
        return self._lag

    def commit(self, positions: dict[int, int]) -> None:
        self._to_commit = dict(positions)

    def _commit_pending(self) -> None:
        from kafka import OffsetAndMetadata, TopicPartition

        positions, self._to_commit = self._to_commit, None
        if positions:
            try:
                self.consumer.commit({TopicPartition(self.topic, p): OffsetAndMetadata(o, "", -1) for p, o in positions.items()})
            except Exception as exc:  # checkpoints hold the positions; the group's copy is for lag tools
                log.warning("committing offsets to group failed: %s", exc)

    def close(self) -> None:
        """Commit what the caller last asked for, then leave (call after the polling stopped)."""
        self._commit_pending()
        self.consumer.close()
        if self.rejected_log is not None:
            self.rejected_log.close()
