"""Snapshots of a collection's tables for publishing, read in chunks between training steps.

Publishing snapshots first (each table's touched rows are copied, which takes
milliseconds) and writes afterwards, optionally on a background thread, so training
continues while a version is written.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch

from streamrec.contracts.delta import SparseDelta
from streamrec.embedding.table import EmbeddingTable


class VersionPublisher(Protocol):
    """A version writer's ``publish`` (streamrec.modelstore.writer), which this package does not import."""

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

    def __init__(self, tables: dict[str, EmbeddingTable], kind: str) -> None:
        self.kind = kind
        self.rows_total = 0
        self._queue: list[tuple[str, torch.Tensor]] = []
        self._parts: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._tables = tables
        for name, table in tables.items():
            if kind == "full":
                table.tracking.begin_delta()  # a full version supersedes the pending delta
                keys = table.tiers.all_keys()
            else:
                keys = table.tracking.begin_delta()
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
            # keys and values stay on the top tier's device (HBM on CUDA)
            self._parts[name].append(table.export(chunk, table.tiers.top.device, try_cache=True))
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
            device = table.tiers.top.device
            keys = torch.cat([p[0] for p in parts]) if parts else torch.empty(0, dtype=torch.int64, device=device)
            values = torch.cat([p[1] for p in parts]) if parts else torch.empty(0, dim, device=device)
            deleted = torch.cat([p[2] for p in parts]) if parts and self.kind == "delta" else torch.empty(0, dtype=torch.int64)
            out[name] = SparseDelta(keys, values, deleted)
        return out
