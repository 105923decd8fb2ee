"""Sparse features through ps/ tables: a SampleBatch in, the model's input tensors out.

Training pulls the unique rows of each table (``EmbeddingTable.pull`` de-duplicates the
batch's ids before any lookup, so a popular item costs one row, not one per sample),
lets autograd sum the per-sample gradients back onto those rows, and hands them to the
table's fused optimizer. Inference (serving, the frozen baseline) uses ``lookup``, which
never creates rows: unknown ids read as zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ps.store import EmbeddingStore
from ps.table import EmbeddingTable, Pulled
from trainer.features import SampleBatch


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


class SparseFeatures:
    def __init__(self, store: EmbeddingStore) -> None:
        self.store = store

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

    def pull(self, batch: SampleBatch, now_ms: int) -> tuple[ModelInputs, list[PulledRows]]:
        """Training lookup: rows are created/admitted as needed and will receive gradients."""
        embeddings, handles = {}, []
        for name, ids in self.table_ids(batch).items():
            table = self.store[name]
            pulled = table.pull(ids, now_ms)
            rows = pulled.rows.detach().requires_grad_(True)
            embeddings[name] = pulled.embeddings(rows)
            handles.append(PulledRows(table, pulled, rows))
        return self._assemble(batch, embeddings), handles

    @staticmethod
    def push(handles: list[PulledRows]) -> None:
        for h in handles:
            if h.rows.grad is not None:
                h.table.push(h.pulled, h.rows.grad)

    def lookup(self, batch: SampleBatch, now_ms: int) -> ModelInputs:
        """Inference lookup: never creates rows; ids without a row embed as zeros."""
        embeddings = {name: self.store[name].lookup(ids, now_ms) for name, ids in self.table_ids(batch).items()}
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
