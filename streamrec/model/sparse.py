"""Sparse features through ps/ tables: a SampleBatch in, the model's input tensors out.

Training pulls the unique rows of each table (``EmbeddingTable.pull`` de-duplicates the
batch's ids before any lookup, so a popular item costs one row, not one per sample),
lets autograd sum the per-sample gradients back onto those rows, and hands them to the
table's fused optimizer. Inference (serving, the frozen baseline) uses ``lookup``, which
never creates rows: unknown ids read as zeros.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from streamrec.model.batch import SampleBatch
from streamrec.embedding.grouped import GroupedPull, pull_grouped, push_grouped
from streamrec.plumbing.locks import RWLock
from streamrec.embedding.sharded import ShardedEmbeddings, ShardedPull
from streamrec.embedding.collection import EmbeddingStore
from streamrec.embedding.table import EmbeddingTable, Pulled


@dataclass
class ModelInputs:
    fields: torch.Tensor  # [B, 7, D]
    history: torch.Tensor  # [B, L, 2D]
    history_mask: torch.Tensor  # [B, L] bool
    dense: torch.Tensor  # [B, F]

    def as_args(self) -> tuple[torch.Tensor, ...]:
        return self.fields, self.history, self.history_mask, self.dense


@dataclass
class PulledRows:
    table: EmbeddingTable
    pulled: Pulled
    rows: torch.Tensor  # requires grad


@dataclass
class GroupedRows:
    pulled: GroupedPull
    rows: torch.Tensor  # every table's unique rows; requires grad


@dataclass
class ShardedRows:
    pulled: ShardedPull
    rows: dict[str, torch.Tensor]  # one per input id; requires grad


class SparseFeatures:
    """``sharded``: the tables are this rank's shard of tables spread over ranks; training
    pulls and pushes go through the exchange (ps/sharded.py) instead of the local store."""

    def __init__(self, store: EmbeddingStore, sharded: ShardedEmbeddings | None = None) -> None:
        self.store, self.sharded = store, sharded

    @staticmethod
    def table_ids(batch: SampleBatch) -> dict[str, torch.Tensor]:
        """The ids each table is asked for (candidate ids first, then the history's)."""
        return {
            "user": batch.user,
            "item": torch.cat([batch.item, batch.hist_items]),
            "category": torch.cat([batch.category, batch.hist_categories]),
            "advertiser": batch.advertiser,
            "context": batch.context.reshape(-1),
        }

    def pull(self, batch: SampleBatch, now_ms: int) -> tuple[ModelInputs, list[PulledRows] | GroupedRows | ShardedRows]:
        """Training lookup: rows are created/admitted as needed and will receive gradients.
        Table-batched (ps/grouped.py) where the tables allow it, else table by table."""
        ids = self.table_ids(batch)
        if self.sharded is not None:
            pulled = self.sharded.pull(ids, now_ms)
            rows = {name: r.detach().requires_grad_(True) for name, r in pulled.rows.items()}
            return self._assemble(batch, rows), ShardedRows(pulled, rows)  # one row per id already
        grouped = pull_grouped(self.store.tables, ids, now_ms)
        if grouped is not None:
            rows = grouped.rows.detach().requires_grad_(True)
            per_table = rows.index_select(0, grouped.inverse).split(grouped.id_counts)
            return self._assemble(batch, dict(zip(ids, per_table))), GroupedRows(grouped, rows)
        embeddings, handles = {}, []
        for name, pulled in self.store.pull(ids, now_ms).items():
            rows = pulled.rows.detach().requires_grad_(True)
            embeddings[name] = pulled.embeddings(rows)
            handles.append(PulledRows(self.store[name], pulled, rows))
        return self._assemble(batch, embeddings), handles

    def push(self, handles: list[PulledRows] | GroupedRows | ShardedRows) -> None:
        if isinstance(handles, ShardedRows):  # collective: every rank pushes every step
            self.sharded.push(handles.pulled, {name: r.grad for name, r in handles.rows.items()})
            return
        if isinstance(handles, GroupedRows):
            if handles.rows.grad is not None:
                push_grouped(handles.pulled, handles.rows.grad)
            return
        for h in handles:
            if h.rows.grad is not None:
                h.table.push(h.pulled, h.rows.grad)

    def lookup(self, batch: SampleBatch, now_ms: int, guard: RWLock | None = None) -> ModelInputs:
        """Inference lookup: never creates rows; ids without a row embed as zeros.

        On CUDA every table's fused probe is launched first and their pending counts come
        back in one host sync (not one per table). Tables that need the general path
        (rows below the GPU cache) change their cache: with a ``guard`` (concurrent
        serving workers) that part runs under its exclusive side, the probes under the
        shared one, so no probe reads a cache that is being changed."""
        ids = self.table_ids(batch)
        embeddings: dict[str, torch.Tensor] = {}
        with guard.read() if guard is not None else nullcontext():
            started = {name: self.store[name].lookup_start(t, now_ms) for name, t in ids.items()}
            slow = [name for name, s in started.items() if s is None]
            fused = {name: s for name, s in started.items() if s is not None}
            if fused:
                pending = torch.cat([s[1] for s in fused.values()]).tolist()  # the one host sync
                for (name, (rows, _)), p in zip(fused.items(), pending):
                    if p:
                        slow.append(name)
                    else:
                        embeddings[name] = self.store[name].lookup_hit(rows)
            cpu_only = [name for name in slow if self.store[name].cache is None]
            for name in cpu_only:  # no cache to change: shared side is enough
                embeddings[name] = self.store[name].lookup_slow(ids[name], now_ms)
        cached = [name for name in slow if name not in embeddings]
        if cached:
            with guard.write() if guard is not None else nullcontext():
                for name in cached:
                    embeddings[name] = self.store[name].lookup_slow(ids[name], now_ms)
        return self._assemble(batch, embeddings)

    @staticmethod
    def _assemble(batch: SampleBatch, emb: dict[str, torch.Tensor]) -> ModelInputs:
        b, length = len(batch), batch.history_len
        item, category = emb["item"], emb["category"]
        d = item.shape[1]
        device = item.device
        context = emb["context"].reshape(b, 3, d)
        fields = torch.stack([emb["user"], item[:b], category[:b], emb["advertiser"], context[:, 0], context[:, 1], context[:, 2]], dim=1)
        hist_index = batch.hist_index.to(device)
        flat = torch.cat([item[b:], category[b:]], dim=1)
        history = torch.zeros(b * length, 2 * d, device=device, dtype=flat.dtype).index_copy(0, hist_index, flat)
        mask = torch.zeros(b * length, dtype=torch.bool, device=device)
        mask[hist_index] = True
        return ModelInputs(fields, history.view(b, length, 2 * d), mask.view(b, length), batch.dense.to(device))
