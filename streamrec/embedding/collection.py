"""Many embedding tables as one store: publishing to the model store, checkpoint/restore.

Publishing snapshots first (each table's touched rows are copied, which takes
milliseconds) and writes afterwards, optionally on a background thread, so training
continues while a version is written. Checkpoints hold everything needed to resume
exactly: every row in every tier with its optimizer state and clock, the admission
sketch, and the delta tracking not yet published.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from streamrec.contracts.delta import SparseDelta
from streamrec.embedding.table import EmbeddingTable, PendingPull, Pulled, TableConfig
from streamrec.embedding.unique import unique_per_group

CHECKPOINT_FORMAT = 1


class VersionPublisher(Protocol):
    """The model store's ``publish`` (streamrec.modelstore), which this package does not import."""

    def publish(self, kind: str, tables: dict[str, SparseDelta], dims: dict[str, int], dense: Mapping[str, torch.Tensor] | None,
                meta: Mapping[str, Any] | None, parent: int | None = None) -> int: ...


def to_host(tables: dict[str, SparseDelta]) -> dict[str, SparseDelta]:
    """Move snapshot values to host memory without stalling training: on CUDA the copy
    runs on a side stream into pinned buffers (the caller is the writer thread)."""
    out = {}
    for name, delta in tables.items():
        values = delta.values
        if values.device.type == "cuda":
            side = torch.cuda.Stream(device=values.device)
            side.wait_stream(torch.cuda.current_stream(values.device))  # the snapshot kernels are done first
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            with torch.cuda.stream(side):
                host.copy_(values, non_blocking=True)
            side.synchronize()
            values = host
        out[name] = SparseDelta(delta.keys.cpu(), values, delta.deleted.cpu())
    return out


class SnapshotTask:
    """A snapshot read in chunks, so training can run between chunks.

    The key set is fixed when the task begins (touched + deleted keys for a delta, every
    key for a full). Each key's value is read when its chunk is stepped, so it is at
    least as new as the moment the task began; a key changed in between is also tracked
    for the next delta, so nothing is ever lost. A key without a row when read is
    published as deleted (delta) or left out (full).
    """

    def __init__(self, store: "EmbeddingStore", kind: str) -> None:
        self.kind = kind
        self.rows_total = 0
        self._queue: list[tuple[str, torch.Tensor]] = []
        self._parts: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._tables = store.tables
        for name, table in store.tables.items():
            if kind == "full":
                table.begin_delta()  # a full version supersedes the pending delta
                keys = table.all_keys()
            else:
                keys = table.begin_delta()
            self._queue.append((name, keys))
            self._parts[name] = []
            self.rows_total += len(keys)
        self.rows_done = 0

    @property
    def done(self) -> bool:
        return not self._queue

    def step(self, max_rows: int) -> bool:
        """Read up to ``max_rows`` more rows; True when the snapshot is complete."""
        budget = max(1, max_rows)
        while self._queue and budget > 0:
            name, keys = self._queue[0]
            chunk, rest = keys[:budget], keys[budget:]
            table = self._tables[name]
            values = table.read_cached(chunk)
            if values is None:
                found, values = table.read(chunk, device=table.top.device)  # keys and values stay on the device
                self._parts[name].append((chunk[found], values, chunk[~found]))
            else:
                self._parts[name].append((chunk, values, chunk[:0]))
            budget -= len(chunk)
            self.rows_done += len(chunk)
            if len(rest):
                self._queue[0] = (name, rest)
            else:
                self._queue.pop(0)
        return self.done

    def result(self) -> dict[str, SparseDelta]:
        """The snapshot; values may still be on the GPU (see :func:`to_host`)."""
        if not self.done:
            raise RuntimeError("snapshot not complete: step() it until it returns True")
        out = {}
        for name, parts in self._parts.items():
            table = self._tables[name]
            dim = table.config.dim
            device = table.top.device
            keys = torch.cat([p[0] for p in parts]) if parts else torch.empty(0, dtype=torch.int64, device=device)
            values = torch.cat([p[1] for p in parts]) if parts else torch.empty(0, dim, device=device)
            deleted = torch.cat([p[2] for p in parts]) if parts and self.kind == "delta" else torch.empty(0, dtype=torch.int64)
            out[name] = SparseDelta(keys, values, deleted)
        return out


class EmbeddingStore:
    def __init__(self, configs: list[TableConfig], device: torch.device | str = "cpu", work_dir: Path | None = None, seed: int = 0) -> None:
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names in {names}")
        self.device = torch.device(device)
        self.work_dir = Path(work_dir) if work_dir else None
        ssd_dir = self.work_dir / "ssd" if self.work_dir else None
        self.tables = {c.name: EmbeddingTable(c, self.device, ssd_dir, seed=seed + i) for i, c in enumerate(configs)}
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-publish")  # versions are written here
        self.last_snapshot_s = 0.0

    def __getitem__(self, name: str) -> EmbeddingTable:
        return self.tables[name]

    def pull(self, ids: Mapping[str, torch.Tensor], now_ms: int, train: bool = True) -> dict[str, Pulled]:
        """``EmbeddingTable.pull`` for several tables at once. On CUDA: one sort-based unique
        over every table's ids and one find-or-insert launch per table, with one host sync
        for the unique counts and one for what the kernels created (not two per table)."""
        names = list(ids)
        flat = [ids[n].to(self.tables[n].top.device, torch.int64).reshape(-1) for n in names]
        if self.device.type == "cuda":
            uniques = unique_per_group(flat)
        else:  # no host syncs to save; torch.unique per table is the cheaper sort on CPU
            uniques = [torch.unique(f, return_inverse=True, return_counts=True) for f in flat]
        started: dict[str, Pulled | PendingPull] = {}
        try:
            for n, (k, inv, c) in zip(names, uniques):
                started[n] = self.tables[n].pull_start(k, inv, c, now_ms, train)
        finally:  # a launched kernel has claimed index slots: finish it even if a later table failed
            pending = {n: p for n, p in started.items() if isinstance(p, PendingPull)}
            if pending:
                counters = torch.stack([p.counters for p in pending.values()]).tolist()  # the one sync
                for (n, p), c in zip(pending.items(), counters):
                    started[n] = self.tables[n].pull_finish(p, c)
        return started

    def begin_snapshot(self, kind: str) -> "SnapshotTask":
        """Start a snapshot of what a version of ``kind`` needs; resets delta tracking.
        Advance it with ``step`` between training steps to bound each pause."""
        if kind not in ("full", "delta"):
            raise ValueError(f"kind must be 'full' or 'delta', got {kind!r}")
        return SnapshotTask(self, kind)

    def snapshot(self, kind: str) -> dict[str, SparseDelta]:
        """The whole snapshot in one call (no I/O)."""
        t0 = time.perf_counter()
        task = self.begin_snapshot(kind)
        while not task.step(1 << 62):
            pass
        self.last_snapshot_s = time.perf_counter() - t0
        return to_host(task.result())

    def write(self, model_store: VersionPublisher, kind: str, tables: dict[str, SparseDelta], dense: Mapping[str, torch.Tensor] | None,
              meta: Mapping[str, Any] | None, parent: int | None = None) -> int:
        """Write a finished snapshot as a version (the publisher calls this on :attr:`writer`);
        a delta's ``parent`` is the version it was built on."""
        dims = {name: t.config.dim for name, t in self.tables.items()}
        return model_store.publish(kind, to_host(tables), dims, dense, meta, parent)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, path: Path, extra: Mapping[str, Any] | None = None) -> Path:
        """Write a complete checkpoint directory atomically (temp dir + rename)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, table in self.tables.items():
            _write_rows(tmp / f"{name}.arrow", table)
            touched, deleted = table.tracked()
            tracking = {"touched": touched.numpy(), "deleted": deleted.numpy()}
            tracking["init_rng"] = table.generator.get_state().numpy()  # new rows resume the same init stream
            if table.sketch is not None:
                tracking["sketch"] = table.sketch.counts.cpu().numpy()
            np.savez(tmp / f"{name}.tracking.npz", **tracking)
        meta = {"format": CHECKPOINT_FORMAT, "tables": [asdict(t.config) for t in self.tables.values()], "extra": dict(extra or {})}
        (tmp / "checkpoint.json").write_text(json.dumps(meta, indent=2))
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
        return path

    @classmethod
    def restore(cls, path: Path, device: torch.device | str = "cpu", work_dir: Path | None = None) -> tuple["EmbeddingStore", dict]:
        path = Path(path)
        try:
            meta = json.loads((path / "checkpoint.json").read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no checkpoint.json)") from None
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: checkpoint format {meta.get('format')} is not supported")
        store = cls([TableConfig(**c) for c in meta["tables"]], device, work_dir)
        for name, table in store.tables.items():
            _read_rows(path / f"{name}.arrow", table)
            tracking = np.load(path / f"{name}.tracking.npz")
            table.set_tracked(torch.from_numpy(tracking["touched"]), torch.from_numpy(tracking["deleted"]))
            table.generator.set_state(torch.from_numpy(tracking["init_rng"]))
            if table.sketch is not None and "sketch" in tracking:
                table.sketch.counts.copy_(torch.from_numpy(tracking["sketch"]))
        return store, meta["extra"]

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        for table in self.tables.values():
            table.close()


def _row_schema(table: EmbeddingTable) -> pa.Schema:
    return pa.schema([("key", pa.int64()), ("weight", pa.list_(pa.float32(), table.config.dim)),
                      ("state", pa.list_(pa.float32(), table.state_dim)), ("last_seen", pa.int64())])


def _write_rows(path: Path, table: EmbeddingTable) -> None:
    """Every row of ``table`` as Arrow IPC, one record batch per chunk of ``iter_rows``:
    memory holds one chunk, not the table."""
    schema = _row_schema(table)
    with ipc.new_file(str(path), schema) as writer:
        for k, w, s, t in table.iter_rows(with_state=True):
            writer.write_batch(pa.record_batch([
                pa.array(k.numpy()),
                pa.FixedSizeListArray.from_arrays(pa.array(w.float().reshape(-1).numpy()), table.config.dim),
                pa.FixedSizeListArray.from_arrays(pa.array(s.float().reshape(-1).numpy()), table.state_dim),
                pa.array(t.numpy()),
            ], schema=schema))


def _read_rows(path: Path, table: EmbeddingTable) -> None:
    """Load the rows of a ``_write_rows`` file into a fresh ``table`` one record batch at a
    time: each ``get_batch`` reads that batch from the file, so memory holds one batch.
    A checkpoint lists each key once, so every row is new to the table."""
    with pa.OSFile(str(path)) as source:
        reader = ipc.open_file(source)
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            n = batch.num_rows
            if n == 0:
                continue
            w = batch.column("weight").flatten().to_numpy().reshape(n, table.config.dim)
            s = batch.column("state").flatten().to_numpy().reshape(n, table.state_dim)
            table.load_rows(torch.from_numpy(batch.column("key").to_numpy().copy()), torch.from_numpy(w.copy()),
                            torch.from_numpy(s.copy()), torch.from_numpy(batch.column("last_seen").to_numpy().copy()), new=True)
