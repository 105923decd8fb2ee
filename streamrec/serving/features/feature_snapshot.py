"""A snapshot of a node's online features: every entity's state, the stage watermarks, and
the topic positions it is complete to, in one Arrow IPC file. A node starts from it and
tails the features topic from those positions instead of replaying the whole topic, and
keeps serving by ids from it when the broker cannot be reached at start.

Columns, one row per entity, each batch of one kind: ``kind`` (user | item | category),
``id`` (int64), ``imps`` and ``clicks`` (list<int64>: absolute event times, ascending; null or
empty: none), ``history`` (list<int64>: the user's clicks as flat (item_id, category_id, ts)
triples, most recent first, as the node kept them: serving/features/history_rows.py; null: none).
Written and read as whole columns (serving/features/entity_store.py), never entity by entity. Schema metadata ``streamrec``: JSON with ``format``, ``topic``,
``positions`` {partition: next offset}, ``partitions``, ``watermarks``
[[partition, stage, subtask, wm], ...] with ``parallelism`` {stage: n}, and ``spec``
{windows_s, history_len}: a node with other windows or history length cannot start from it
(the times and lists it kept would not be enough) and replays the topic instead.

The Arrow file is followed by a trailer: the sha256 of every byte before it, then MAGIC. A
reader hashes the whole file before Arrow parses any of it, so a damaged copy (one flipped
bit is enough to change event times, or to crash Arrow's reader) is refused as a whole and
the node replays the topic. sha256, as for model files, rather than zlib.crc32: on the CI
box a 1.2 GiB snapshot (1M users) takes 0.85 s to verify (crc32: 0.44 s) of a 3.4 s load,
and hashing while writing adds about as much to a save; a 10M-user node stays well inside
its 60 s start, and hashlib releases the GIL while requests are answered. A file ending in
Arrow's own magic has no trailer (written by a version without checksums, or cut short):
it is refused too, and the node rebuilds its state from the topic.

Replaying a record the snapshot already holds is harmless (a bucket's content replaces its
range, a history list replaces the held one's head, a watermark only moves on), so the
positions may lag the state by the records of one poll.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.ipc as ipc

from streamrec.contracts.feature_state import ENTITIES, Watermarks

FORMAT = 2
TEMPORARY = ".tmp"  # suffix of a snapshot being written (never read)
MAGIC = b"streamrec-sha256"  # the file's last bytes, after the digest
TRAILER = hashlib.sha256().digest_size + len(MAGIC)
_ARROW_MAGIC = b"ARROW1"  # an Arrow IPC file's last bytes
_CHUNK = 4 * 2**20
SCHEMA = pa.schema([("kind", pa.dictionary(pa.int8(), pa.string())), ("id", pa.int64()), ("imps", pa.list_(pa.int64())),
                    ("clicks", pa.list_(pa.int64())), ("history", pa.list_(pa.int64()))])

_KINDS = pa.array(list(ENTITIES), pa.string())


class CorruptSnapshot(ValueError):
    """A snapshot file that cannot be read as one (the node then replays the topic)."""


@dataclass
class SnapshotHeader:
    topic: str
    partitions: int
    positions: dict[int, int]
    watermarks: Watermarks
    spec: dict  # {"windows_s": [...], "history_len": n} of the feature spec the state was kept for


def _lists(lengths: np.ndarray, values: np.ndarray) -> pa.ListArray:
    """A list<int64> column: per row ``lengths[k]`` values of ``values`` (back to back); a
    negative length: a null list."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(np.maximum(lengths, 0), out=offsets[1:])
    if offsets[-1] < 2**31:
        offsets = offsets.astype(np.int32)
    else:
        raise ValueError("a snapshot batch holds more than 2**31 values: write fewer entities a batch")
    mask = pa.array(lengths < 0, pa.bool_()) if (lengths < 0).any() else None
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.int64()), mask=mask)


def entity_batch(kind: str, ids: np.ndarray, imps: tuple[np.ndarray, np.ndarray], clicks: tuple[np.ndarray, np.ndarray],
                 history: tuple[np.ndarray, np.ndarray] | None) -> pa.RecordBatch:
    """One record batch of entities of one kind; each list column as (lengths, flat values),
    a length of -1 a null list (a user without history; no history column: all null)."""
    codes = np.full(len(ids), ENTITIES.index(kind), np.int8)
    kinds = pa.DictionaryArray.from_arrays(pa.array(codes, pa.int8()), _KINDS)  # one dictionary for every batch
    hist = _lists(*history) if history is not None else pa.nulls(len(ids), pa.list_(pa.int64()))
    return pa.record_batch([kinds, pa.array(ids, pa.int64()), _lists(*imps), _lists(*clicks), hist], schema=SCHEMA)


def write_snapshot(path: str | Path, header: SnapshotHeader, batches: Iterable[pa.RecordBatch]) -> int:
    """Write the snapshot atomically (a temporary file renamed over ``path``: a reader never
    sees half of one). Returns its size in bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    marks = header.watermarks
    meta = {"format": FORMAT, "topic": header.topic, "partitions": header.partitions,
            "positions": {str(p): o for p, o in header.positions.items()},
            "watermarks": [[p, stage, subtask, wm] for (p, stage, subtask), wm in marks.marks.items()],
            "parallelism": marks.parallelism, "spec": header.spec}
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMPORARY, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        with open(tmp, "wb") as f:
            sink = _HashingSink(f)
            with pa.PythonFile(sink, mode="w") as stream, \
                    ipc.new_file(stream, SCHEMA.with_metadata({"streamrec": orjson.dumps(meta)})) as writer:
                for batch in batches:
                    writer.write_batch(batch)
            f.write(sink.digest.digest() + MAGIC)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


class _HashingSink:
    """A file that hashes what is written to it: the checksum costs no second read of a
    snapshot that may be larger than the page cache."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.digest, self.closed = f, hashlib.sha256(), False

    def write(self, data) -> int:
        self.digest.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:  # the caller closes the file, after the trailer
        self.closed = True


def _sha256(f: BinaryIO, length: int) -> bytes:
    """The sha256 of the first ``length`` bytes of ``f``, read in order (cut short: b"")."""
    digest, buffer = hashlib.sha256(), bytearray(_CHUNK)
    view = memoryview(buffer)
    f.seek(0)
    while length > 0:
        n = f.readinto(view[:min(_CHUNK, length)])
        if not n:
            return b""
        digest.update(view[:n])
        length -= n
    return digest.digest()


def _verify(path: str | Path) -> tuple[int, tuple[int, ...]]:
    """The length of the Arrow file ``path`` holds, and the file's identity, once its bytes
    match the checksum after them; CorruptSnapshot naming the file otherwise. Nothing of the
    file is parsed before this: damaged bytes never reach Arrow or the store."""
    try:
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            length = stat.st_size - TRAILER
            f.seek(max(0, length))
            trailer = f.read()
            if not trailer.endswith(MAGIC):
                raise _no_trailer(path, trailer)
            if _sha256(f, length) != trailer[:-len(MAGIC)]:
                raise CorruptSnapshot(f"{path} cannot be read: its content does not match its sha256 checksum "
                                      "(damaged on disk or in a copy)")
    except OSError as exc:
        raise CorruptSnapshot(f"{path} is not a feature snapshot: {exc}") from None
    return length, _identity(stat)


def _no_trailer(path: str | Path, tail: bytes) -> CorruptSnapshot:
    """Why a file that does not end in a checksum is refused: an Arrow file's end is a snapshot
    of a version without checksums (or one cut short by exactly its trailer)."""
    if tail.endswith(_ARROW_MAGIC):
        return CorruptSnapshot(f"{path} has no checksum: written by an older version of streamrec, or cut short; "
                               "delete it: the node rebuilds its features from the topic")
    return CorruptSnapshot(f"{path} is not a feature snapshot: it does not end in a checksum "
                           "(cut short, damaged, or another file)")


def _identity(stat: os.stat_result) -> tuple[int, ...]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _opened(path: str, source: pa.NativeFile, identity: tuple[int, ...]) -> pa.NativeFile:
    """``source``, just opened at ``path``, if that is still the file that was verified (a
    file put there since was not). Checked after opening: a file replaced after ``source``
    was opened is refused needlessly, never read unchecked."""
    if _identity(os.stat(path)) != identity:
        source.close()
        raise CorruptSnapshot(f"{path} was replaced while it was read: not the file whose checksum was checked")
    return source


def remove_stale_temporaries(path: str | Path) -> None:
    """Delete what writers of ``path`` that died mid-write left behind."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*{TEMPORARY}"):
        stale.unlink(missing_ok=True)


class SnapshotBatches:
    """A snapshot's entity batches, read from the file in order, the next one while the
    caller works on the current one (a thread: Arrow's reads release the GIL). Sequential
    reads beat faulting a mapped file in page by page, and two batches at most are held."""

    def __init__(self, path: str | Path, count: int, length: int, identity: tuple[int, ...]) -> None:
        self.path, self.count = str(path), count
        self.length, self.identity = length, identity  # of the Arrow file within path, verified

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        system = pa.system_memory_pool()  # a batch's memory goes back to the system once read: not held by a pool's cache
        with _opened(self.path, pa.OSFile(self.path, memory_pool=system), self.identity) as source, \
                ThreadPoolExecutor(1, thread_name_prefix="snapshot-read") as pool:
            reader = ipc.open_file(source, self.length, memory_pool=system)
            ahead = pool.submit(reader.get_batch, 0) if reader.num_record_batches else None
            for i in range(reader.num_record_batches):
                batch = ahead.result()
                ahead = pool.submit(reader.get_batch, i + 1) if i + 1 < reader.num_record_batches else None
                yield batch

    def kind_counts(self) -> dict[str, int]:
        """Entities per kind: only the kind column is read (of the mapped file)."""
        reader = ipc.open_file(_opened(self.path, pa.memory_map(self.path), self.identity), self.length)
        return kind_counts(reader.get_batch(i) for i in range(reader.num_record_batches))


def read_snapshot(path: str | Path) -> tuple[SnapshotHeader, SnapshotBatches]:
    """The header and the entity batches of a snapshot; CorruptSnapshot says what is wrong."""
    length, identity = _verify(path)
    try:
        reader = ipc.open_file(_opened(str(path), pa.memory_map(str(path)), identity), length)
        meta = orjson.loads((reader.schema.metadata or {}).get(b"streamrec", b"null"))
    except (pa.ArrowInvalid, OSError, orjson.JSONDecodeError) as exc:
        raise CorruptSnapshot(f"{path} is not a feature snapshot: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptSnapshot(f"{path}: unknown snapshot format {meta.get('format') if isinstance(meta, dict) else meta!r} "
                              f"(this version reads {FORMAT})")
    if not reader.schema.remove_metadata().equals(SCHEMA):
        raise CorruptSnapshot(f"{path}: columns {reader.schema.names} are not a feature snapshot's")
    marks = Watermarks()
    for partition, stage, subtask, wm in meta["watermarks"]:
        marks.marks[(partition, stage, subtask)] = wm
    marks.parallelism.update(meta["parallelism"])
    header = SnapshotHeader(meta["topic"], meta["partitions"], {int(p): o for p, o in meta["positions"].items()}, marks,
                            meta.get("spec", {}))
    return header, SnapshotBatches(path, reader.num_record_batches, length, identity)


ListColumn = tuple[np.ndarray, np.ndarray, np.ndarray]  # offsets [n + 1], valid [n], values (offsets index them)


def batch_columns(batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray, list[ListColumn]]:
    """A batch as numpy: kind per row (an index into ENTITIES), ids, and the imps, clicks
    and history columns (views of the batch's buffers)."""
    codes = _kind_codes(batch)
    columns = []
    for j in (2, 3, 4):
        column = batch.column(j)
        valid = np.asarray(column.is_valid().to_numpy(zero_copy_only=False))
        columns.append((column.offsets.to_numpy(), valid, column.values.to_numpy()))
    return codes, batch.column(1).to_numpy(), columns


def kind_counts(batches: Iterable[pa.RecordBatch]) -> dict[str, int]:
    """Entities per kind in ``batches``."""
    counts = np.zeros(len(ENTITIES), np.int64)
    for batch in batches:
        counts += np.bincount(_kind_codes(batch), minlength=len(ENTITIES))
    return {kind: int(n) for kind, n in zip(ENTITIES, counts)}


def _kind_codes(batch: pa.RecordBatch) -> np.ndarray:
    kind = batch.column(0)
    names = kind.dictionary.to_pylist()
    if any(name not in ENTITIES for name in names):
        raise CorruptSnapshot(f"entity kinds {names} are not {list(ENTITIES)}")
    return np.array([ENTITIES.index(name) for name in names], np.int64)[kind.indices.to_numpy(zero_copy_only=False)]
