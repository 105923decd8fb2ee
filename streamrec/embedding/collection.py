"""Many embedding tables as one collection: the only entry streamrec.model uses.

``EmbeddingCollection`` holds this process's tables and speaks the table verbs for all
of them at once (``find_or_insert``, ``apply_gradients``, ``find``), with the fewest
launches and host syncs: table-batched launches (grouped.py) where the tables allow it,
else table by table with one host sync for all. It also publishes (snapshot.py) and
checkpoints (checkpoint_files.py). A trainer spread over ranks trains through
``ShardedCollection`` (sharded.py) instead, which speaks the same training verbs; the
trainer picks one or the other once, with :func:`training_collection`.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping, Protocol

import torch

from streamrec.contracts.delta import SparseDelta
from streamrec.embedding.checkpoint_files import read_checkpoint, read_configs, write_checkpoint
from streamrec.embedding.grouped import GroupedRows, apply_gradients_grouped, find_or_insert_grouped, find_start_grouped
from streamrec.embedding.sharded import ShardedCollection
from streamrec.embedding.snapshot import SnapshotTask, VersionPublisher, to_host
from streamrec.embedding.table import BatchRows, EmbeddingTable, PendingInsert, TableConfig, finish_inserts
from streamrec.embedding.unique import unique_per_group
from streamrec.plumbing.locks import RWLock

__all__ = ["EmbeddingCollection", "LocalRows", "SnapshotTask", "TrainingCollection", "TrainingRows", "to_host",
           "training_collection"]


class TrainingRows(Protocol):
    """What ``find_or_insert`` hands the model: one embedding per input id of each table
    (float32 [ids, dim], on the collection's device), in the autograd graph of rows that
    ``apply_gradients`` later updates with the gradients backward left on them."""

    embeddings: dict[str, torch.Tensor]


class TrainingCollection(Protocol):
    """The verbs a trainer's step uses, over every table at once (local or sharded)."""

    def find_or_insert(self, ids: Mapping[str, torch.Tensor], now_ms: int) -> TrainingRows:
        """Rows for ``ids`` (table -> int64 [n] ids, repeats allowed), created/admitted as needed."""

    def apply_gradients(self, rows: TrainingRows) -> None:
        """The fused optimizers over the rows of ``rows``, with the gradients backward left there."""


@dataclass
class LocalRows:
    """``EmbeddingCollection.find_or_insert``'s rows: table-batched (``grouped``) or table by table (``by_table``)."""

    embeddings: dict[str, torch.Tensor]  # one row per input id, [ids, dim]
    leaves: list[torch.Tensor]  # the unique rows that require grad (one grouped tensor, or one per table)
    grouped: GroupedRows | None = None
    by_table: dict[str, BatchRows] = field(default_factory=dict)


class EmbeddingCollection:
    table_batched = True  # False: every training step table by table (benchmarks compare the two)

    def __init__(self, configs: list[TableConfig], device: torch.device | str = "cpu", work_dir: Path | None = None, seed: int = 0) -> None:
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names in {names}")
        self.device = torch.device(device)
        self.work_dir = Path(work_dir) if work_dir else None
        ssd_dir = self.work_dir / "ssd" if self.work_dir else None
        self.tables = {c.name: EmbeddingTable(c, self.device, ssd_dir, seed=seed + i) for i, c in enumerate(configs)}
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedding-publish")  # versions are written here
        self.last_snapshot_s = 0.0

    def __getitem__(self, name: str) -> EmbeddingTable:
        return self.tables[name]

    # ------------------------------------------------------------------ training
    def find_or_insert(self, ids: Mapping[str, torch.Tensor], now_ms: int) -> LocalRows:
        """``EmbeddingTable.find_or_insert`` of every table in ``ids`` (table -> int64 [n]),
        ready for autograd: one find-or-insert launch and one optimizer launch for all tables
        where ``grouped.groupable`` allows (decided each step: it depends on the caches'
        room), else table by table (``find_or_insert_each``). Rows live in the top tier
        (HBM on CUDA); the embeddings are views of grad-requiring copies of them."""
        grouped = find_or_insert_grouped(self.tables, ids, now_ms) if self.table_batched else None
        if grouped is not None:
            leaf = grouped.rows.detach().requires_grad_(True)
            per_table = leaf.index_select(0, grouped.inverse).split(grouped.id_counts)
            return LocalRows(dict(zip(ids, per_table)), [leaf], grouped=grouped)
        embeddings, leaves, by_table = {}, [], self.find_or_insert_each(ids, now_ms)
        for name, rows in by_table.items():
            leaf = rows.rows.detach().requires_grad_(True)
            embeddings[name] = rows.embeddings(leaf)
            leaves.append(leaf)
        return LocalRows(embeddings, leaves, by_table=by_table)

    def find_or_insert_each(self, ids: Mapping[str, torch.Tensor], now_ms: int) -> dict[str, BatchRows]:
        """``EmbeddingTable.find_or_insert`` for several tables, table by table. On CUDA: one
        sort-based unique over every table's ids and one find-or-insert launch per table,
        with one host sync for the unique counts and one for what the kernels created (not
        two per table)."""
        names = list(ids)
        flat = [ids[n].to(self.tables[n].tiers.top.device, torch.int64).reshape(-1) for n in names]
        if self.device.type == "cuda":
            uniques = unique_per_group(flat)
        else:  # no host syncs to save; torch.unique per table is the cheaper sort on CPU
            uniques = [torch.unique(f, return_inverse=True, return_counts=True) for f in flat]
        started: dict[str, BatchRows | PendingInsert] = {}
        try:
            for n, (k, inv, c) in zip(names, uniques):
                started[n] = self.tables[n].find_or_insert_start(k, inv, c, now_ms)
        finally:  # a launched kernel has claimed index slots: finish it even if a later table failed
            pending = {n: p for n, p in started.items() if isinstance(p, PendingInsert)}
            if pending:
                counters = torch.stack([p.counters for p in pending.values()])
                finished = finish_inserts([self.tables[n] for n in pending], list(pending.values()), counters)
                started.update(zip(pending, finished))
        return started

    def apply_gradients(self, rows: LocalRows) -> None:
        """The optimizers over ``rows`` (from ``find_or_insert``), with the gradients on its leaves."""
        if rows.grouped is not None:
            grad = rows.leaves[0].grad
            if grad is not None:
                apply_gradients_grouped(rows.grouped, grad)
            return
        for (name, batch_rows), leaf in zip(rows.by_table.items(), rows.leaves):
            if leaf.grad is not None:
                self.tables[name].apply_gradients(batch_rows, leaf.grad)

    # ------------------------------------------------------------------ serving reads
    def find(self, ids: Mapping[str, torch.Tensor], now_ms: int, guard: RWLock | None = None) -> dict[str, torch.Tensor]:
        """``EmbeddingTable.find`` of every table in ``ids``: one embedding per id, zeros for
        ids without a row; never creates rows.

        On CUDA every table's fused probe is launched first, in one table-batched launch
        where the tables allow it (``grouped.find_start_grouped``: every table cached, one
        row width) else table by table, and their pending counts come back in one host
        sync (not one per table). Tables that need the general path (rows below the GPU
        cache) change their cache: with a ``guard`` (concurrent serving workers) that part
        runs under its exclusive side, the probes under the shared one, so no probe reads
        a cache that is being changed."""
        embeddings: dict[str, torch.Tensor] = {}
        with guard.read() if guard is not None else nullcontext():
            grouped = find_start_grouped(self.tables, ids, now_ms)
            if grouped is not None:
                (fused, pending), slow = grouped, []
            else:
                started = {name: self.tables[name].find_start(t, now_ms) for name, t in ids.items()}
                slow = [name for name, s in started.items() if s is None]
                fused = {name: s[0] for name, s in started.items() if s is not None}
                pending = torch.cat([s[1] for s in started.values() if s is not None]) if fused else None
            if fused:
                for (name, rows), p in zip(fused.items(), pending.tolist()):  # the one host sync
                    if p:
                        slow.append(name)
                    else:
                        embeddings[name] = self.tables[name].find_hit(rows)
            cpu_only = [name for name in slow if self.tables[name].tiers.cache is None]
            for name in cpu_only:  # no cache to change: shared side is enough
                embeddings[name] = self.tables[name].find_slow(ids[name], now_ms)
        cached = [name for name in slow if name not in embeddings]
        if cached:
            with guard.write() if guard is not None else nullcontext():
                for name in cached:
                    embeddings[name] = self.tables[name].find_slow(ids[name], now_ms)
        return embeddings

    # ------------------------------------------------------------------ publishing
    def begin_snapshot(self, kind: str) -> SnapshotTask:
        """Start a snapshot of what a version of ``kind`` needs; resets delta tracking.
        Advance it with ``step`` between training steps to bound each pause."""
        if kind not in ("full", "delta"):
            raise ValueError(f"kind must be 'full' or 'delta', got {kind!r}")
        return SnapshotTask(self.tables, kind)

    def snapshot(self, kind: str) -> dict[str, SparseDelta]:
        """The whole snapshot in one call (no I/O), in host memory."""
        t0 = time.perf_counter()
        task = self.begin_snapshot(kind)
        while not task.step(1 << 62):
            pass
        self.last_snapshot_s = time.perf_counter() - t0
        return to_host(task.result())

    def write(self, version_writer: VersionPublisher, kind: str, tables: dict[str, SparseDelta], dense: Mapping[str, torch.Tensor] | None,
              meta: Mapping[str, Any] | None, parent: int | None = None) -> int:
        """Write a finished snapshot as a version (the publisher calls this on :attr:`writer`);
        a delta's ``parent`` is the version it was built on."""
        dims = {name: t.config.dim for name, t in self.tables.items()}
        return version_writer.publish(kind, to_host(tables), dims, dense, meta, parent)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, path: Path, extra: Mapping[str, Any] | None = None) -> Path:
        """Write a complete checkpoint directory atomically (checkpoint_files.py)."""
        return write_checkpoint(self.tables, path, extra)

    @classmethod
    def restore(cls, path: Path, device: torch.device | str = "cpu", work_dir: Path | None = None) -> tuple["EmbeddingCollection", dict]:
        """The collection a ``checkpoint`` wrote, and its ``extra``."""
        configs, extra = read_configs(path)
        collection = cls(configs, device, work_dir)
        read_checkpoint(collection.tables, path)
        return collection, extra

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        for table in self.tables.values():
            table.close()


def training_collection(local: EmbeddingCollection, sharded: bool, group=None, replicated: Collection[str] = ()) -> TrainingCollection:
    """What a trainer trains through, chosen once at start: ``local`` itself, or, when the
    tables are sharded over ranks, ``local`` as this rank's shard of a ``ShardedCollection``
    over ``group`` (torch.distributed's default group when None), with the ``replicated``
    tables whole on every rank."""
    return ShardedCollection(local, group, replicated) if sharded else local
