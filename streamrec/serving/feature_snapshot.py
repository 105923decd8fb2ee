"""A snapshot of a node's online features: every entity's state, the stage watermarks, and
the topic positions it is complete to, in one Arrow IPC file. A node starts from it and
tails the features topic from those positions instead of replaying the whole topic, and
keeps serving by ids from it when the broker cannot be reached at start.

Columns, one row per entity: ``kind`` (user | item | category), ``id`` (int64), ``imps`` and
``clicks`` (list<int64>: absolute event times, ascending; null: no counters), ``history``
(list<int64>: the user's clicks as flat (item_id, category_id, ts) triples, most recent
first; null: none). Schema metadata ``streamrec``: JSON with ``format``, ``topic``,
``positions`` {partition: next offset}, ``partitions``, ``watermarks``
[[partition, stage, subtask, wm], ...] with ``parallelism`` {stage: n}, and ``spec``
{windows_s, history_len}: a node with other windows or history length cannot start from it
(the times and lists it kept would not be enough) and replays the topic instead.

Replaying a record the snapshot already holds is harmless (a bucket's content replaces its
range, a history list replaces the held one's head, a watermark only moves on), so the
positions may lag the state by the records of one poll.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.ipc as ipc

from streamrec.contracts.feature_state import ENTITIES, Watermarks

FORMAT = 1
TEMPORARY = ".tmp"  # suffix of a snapshot being written (never read)
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


def _lists(parts: list[np.ndarray | None]) -> pa.ListArray:
    """A list<int64> column of ``parts`` (None: a null list), built from one flat buffer."""
    lengths = np.fromiter((0 if p is None else len(p) for p in parts), np.int64, len(parts))
    offsets = np.zeros(len(parts) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    present = [p for p in parts if p is not None and len(p)]
    values = pa.array(np.concatenate(present) if present else np.zeros(0, np.int64), pa.int64())
    mask = pa.array([p is None for p in parts], pa.bool_())
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, mask=mask)


def entity_batch(kinds: list[str], ids: np.ndarray, imps: list, clicks: list, histories: list) -> pa.RecordBatch:
    """One record batch of entity rows (arrays of times per entity, or None)."""
    as_np = lambda xs: [None if x is None else np.frombuffer(x, np.int64) if not isinstance(x, (np.ndarray, list))  # noqa: E731
                        else np.asarray(x, np.int64) for x in xs]
    codes = {kind: k for k, kind in enumerate(ENTITIES)}
    kind = pa.DictionaryArray.from_arrays(pa.array([codes[k] for k in kinds], pa.int8()), _KINDS)  # one dictionary for every batch
    return pa.record_batch([kind, pa.array(ids, pa.int64()),
                            _lists(as_np(imps)), _lists(as_np(clicks)), _lists(as_np(histories))], schema=SCHEMA)


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
        with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, SCHEMA.with_metadata({"streamrec": orjson.dumps(meta)})) as writer:
            for batch in batches:
                writer.write_batch(batch)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def remove_stale_temporaries(path: str | Path) -> None:
    """Delete what writers of ``path`` that died mid-write left behind."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*{TEMPORARY}"):
        stale.unlink(missing_ok=True)


def read_snapshot(path: str | Path) -> tuple[SnapshotHeader, Iterator[pa.RecordBatch]]:
    """The header and the entity batches of a snapshot; CorruptSnapshot says what is wrong."""
    try:
        reader = ipc.open_file(pa.memory_map(str(path)))
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
    return header, (reader.get_batch(i) for i in range(reader.num_record_batches))


def batch_rows(batch: pa.RecordBatch) -> Iterator[tuple[str, int, np.ndarray | None, np.ndarray | None, np.ndarray | None]]:
    """(kind, id, imps, clicks, history) per row; arrays are views of the batch's buffers."""
    kinds = batch.column(0).to_pylist()
    ids = batch.column(1).to_numpy()
    columns = []
    for j in (2, 3, 4):
        column = batch.column(j)
        offsets = column.offsets.to_numpy()
        values = column.values.to_numpy()
        valid = np.asarray(column.is_valid().to_numpy(zero_copy_only=False))
        columns.append((offsets, values, valid))
    for r in range(len(ids)):
        out = []
        for offsets, values, valid in columns:
            out.append(values[offsets[r]: offsets[r + 1]] if valid[r] else None)
        yield kinds[r], int(ids[r]), out[0], out[1], out[2]
