"""Sparse features through the embedding store: a SampleBatch in, the model's input tensors out.

Training asks the collection for the unique rows of each table (``find_or_insert``
de-duplicates the batch's ids before any lookup, so a popular item costs one row, not one
per sample), lets autograd sum the per-sample gradients back onto those rows, and hands
them to the fused optimizers (``apply_gradients``). Inference (serving, the frozen
baseline) uses ``find``, which never creates rows: unknown ids read as zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrec.embedding.collection import TrainingCollection, TrainingRows
from streamrec.model.batch import SampleBatch
from streamrec.model.host_batch import table_ids
from streamrec.plumbing.locks import RWLock


@dataclass
class ModelInputs:
    fields: torch.Tensor  # [B, 7, D]
    history: torch.Tensor  # [B, L, 2D]
    history_mask: torch.Tensor  # [B, L] bool
    dense: torch.Tensor  # [B, F]

    def as_args(self) -> tuple[torch.Tensor, ...]:
        return self.fields, self.history, self.history_mask, self.dense


class SparseFeatures:
    """The model's sparse inputs from ``collection``: an ``EmbeddingCollection``, or a
    ``ShardedCollection`` when the tables are spread over ranks (chosen once, by the trainer)."""

    def __init__(self, collection: TrainingCollection) -> None:
        self.collection = collection

    @staticmethod
    def table_ids(batch: SampleBatch) -> dict[str, torch.Tensor]:
        """The ids each table is asked for (candidate ids first, then the history's)."""
        return table_ids(batch, torch.cat)

    def training_inputs(self, batch: SampleBatch, now_ms: int) -> tuple[ModelInputs, TrainingRows]:
        """Training lookup: rows are created/admitted as needed and will receive gradients;
        hand the second result to :meth:`apply_gradients` after backward."""
        rows = self.collection.find_or_insert(self.table_ids(batch), now_ms)
        return self._assemble(batch, rows.embeddings), rows

    def apply_gradients(self, rows: TrainingRows) -> None:
        """The fused optimizers over the rows of :meth:`training_inputs`, with backward's gradients."""
        self.collection.apply_gradients(rows)

    def lookup(self, batch: SampleBatch, now_ms: int, guard: RWLock | None = None) -> ModelInputs:
        """Inference lookup through an ``EmbeddingCollection`` (inference is never sharded):
        never creates rows; ids without a row embed as zeros. ``guard``: concurrent serving
        workers' lock (see ``EmbeddingCollection.find``)."""
        return self._assemble(batch, self.collection.find(self.table_ids(batch), now_ms, guard))

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
        sequences = b if batch.hist_group is None else batch.history_groups
        history = torch.zeros(sequences * length, 2 * d, device=device, dtype=flat.dtype).index_copy(0, hist_index, flat)
        # index_fill_, not ``mask[hist_index] = True``: that assignment waits for the device (a
        # host sync every step, which on several ranks also waits for the others' rows)
        mask = torch.zeros(sequences * length, dtype=torch.bool, device=device).index_fill_(0, hist_index, True)
        history, mask = history.view(sequences, length, 2 * d), mask.view(sequences, length)
        if batch.hist_group is not None:  # rows sharing sequences: each row gets its own copy here, on the device
            group = batch.hist_group.to(device)
            history, mask = history.index_select(0, group), mask.index_select(0, group)
        return ModelInputs(fields, history, mask, batch.dense.to(device))
