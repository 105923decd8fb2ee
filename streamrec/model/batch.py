"""From checked sample rows (the pipelines/ schema) to the tensors the model consumes.

The same conversion serves training (batches of samples) and serving (predict
instances: the sample schema minus the label), so both see identical features.

Sparse tables and the ids that go into them:
- ``user``: user_id;  ``advertiser``: advertiser_id;
- ``item``: the candidate item_id *and* the behaviour-sequence item ids (shared rows, as
  in DIN: the history is compared with the candidate in the same space);
- ``category``: category_id and the sequence's category ids;
- ``context``: device, position and local hour, as ``field << 32 | value`` keys in one
  small table (one lookup instead of three).
Dense features: log1p of every windowed counter, plus smoothed click-through rates of
user, item and category per window.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import pyarrow as pa
import torch

from streamrec.model.columns import FeatureColumns, columns_from_table
from streamrec.contracts.feature_spec import COUNTER_ENTITIES, FeatureSpec
from streamrec.model.host_batch import (CONTEXT_FIELDS, CTR_PRIOR_IMPS, TABLES, Batch, HostBatch, host_batch_from_columns,
                                        host_dense_features)

__all__ = ["CONTEXT_FIELDS", "CTR_PRIOR_IMPS", "TABLES", "SampleBatch", "batch_from_columns", "batch_from_table", "dense_feature_names",
           "dense_features"]


@dataclass
class SampleBatch(Batch[torch.Tensor]):
    """A batch as tensors (model/host_batch.py ``Batch``: the fields)."""

    @classmethod
    def from_host(cls, host: HostBatch) -> "SampleBatch":
        """The tensors over ``host``'s arrays (no copy), its other fields as they are."""
        values = {f.name: getattr(host, f.name) for f in fields(host)}
        for name in host.arrays():
            values[name] = torch.from_numpy(values[name])
        return cls(**values)

    def _tensors(self) -> list[str]:
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def pin_memory(self) -> "SampleBatch":
        """Move the tensors into page-locked memory (so the step's host-to-device copies do
        not block): one pinned allocation for all of them, each tensor a view of it. A
        pinned allocation costs far more than the copy, and a batch has eleven tensors."""
        names = self._tensors()
        tensors = [getattr(self, name).contiguous() for name in names]
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + -(-size // 64) * 64)  # each view 64-byte aligned
        buffer = torch.empty(max(offsets[-1], 64), dtype=torch.uint8, pin_memory=True)
        for name, t, offset, size in zip(names, tensors, offsets, sizes):
            setattr(self, name, buffer[offset : offset + size].view(t.dtype).view(t.shape).copy_(t))
        self._pinned = (buffer, names, offsets)  # so that ``to`` moves them all in one copy
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> "SampleBatch":
        """The tensors on ``device``. A pinned batch crosses to a GPU as one copy of its
        buffer (each tensor a view of it there too): one transfer instead of one a tensor."""
        pinned = getattr(self, "_pinned", None)
        if pinned is not None and torch.device(device).type == "cuda":
            buffer, names, offsets = pinned
            if all(getattr(self, n).data_ptr() == buffer.data_ptr() + o for n, o in zip(names, offsets)):
                moved = buffer.to(device, non_blocking=non_blocking)
                for name, offset in zip(names, offsets):
                    t = getattr(self, name)
                    setattr(self, name, moved[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
                self._pinned = None
                return self
        for name in self._tensors():
            setattr(self, name, getattr(self, name).to(device, non_blocking=non_blocking))
        return self

    def max_ts(self) -> int:
        """The newest sample's time (a host sync when ``ts`` is on a GPU: ask before ``to``)."""
        return int(self.ts.max()) if len(self) else 0

    def longest_history(self) -> int:
        """Length of the longest behaviour sequence in the batch (entries are at ``j < length``)."""
        return int((self.hist_index % self.history_len).max()) + 1 if len(self.hist_index) else 0

    def with_history_len(self, length: int) -> "SampleBatch":
        """The same batch laid out for sequences of ``length`` (>= longest_history()): serving
        runs short sequences in a shorter bucket."""
        if length == self.history_len:
            return self
        rows, positions = self.hist_index // self.history_len, self.hist_index % self.history_len
        longest = int(positions.max()) + 1 if len(positions) else 0
        if length < longest:
            raise ValueError(f"history length {length} is shorter than the batch's longest sequence ({longest})")
        return replace(self, hist_index=rows * length + positions, history_len=length)


def dense_feature_names(spec: FeatureSpec) -> list[str]:
    names = [f"log1p_{c}" for c in spec.counter_columns()]
    names += [f"ctr_{entity}_{w}s" for w in spec.windows_s for entity in COUNTER_ENTITIES]
    return names


def dense_features(counters: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """float32 [B, F] (:func:`dense_feature_names`) of the counter columns [B, 6W] in
    ``FeatureSpec.counter_columns()`` order (window, entity, then impressions and clicks side
    by side): numpy on the host (no intra-op threads), torch where the counters are (serving
    on a GPU)."""
    if isinstance(counters, np.ndarray):
        return host_dense_features(counters)
    counters = counters.to(torch.float32)
    pairs = counters.view(len(counters), counters.shape[1] // 2, 2)
    return torch.cat([torch.log1p(counters), pairs[..., 1] / (pairs[..., 0] + CTR_PRIOR_IMPS)], dim=1)


def batch_from_table(table: pa.Table, spec: FeatureSpec, history_len: int, with_labels: bool = True) -> SampleBatch:
    """Tensors of a table of checked samples (see contracts.sample_wire.check_samples)."""
    return batch_from_columns(columns_from_table(table, spec, with_labels), spec, history_len)


def batch_from_columns(cols: FeatureColumns, spec: FeatureSpec, history_len: int, with_dense: bool = True) -> SampleBatch:
    """Tensors of checked columns (model/host_batch.py ``host_batch_from_columns``, wrapped)."""
    return SampleBatch.from_host(host_batch_from_columns(cols, history_len, with_dense))
