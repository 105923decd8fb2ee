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

import zlib
from collections import Counter
from dataclasses import dataclass, field, fields, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from pipelines.samples import SampleSpec

TABLES = ("user", "item", "category", "advertiser", "context")
CONTEXT_FIELDS = ("device", "position", "local_hour")
CTR_PRIOR_IMPS = 10.0  # smoothing of the rate features: clicks / (imps + prior)


@dataclass
class SampleBatch:
    """One batch as tensors; ``hist_index`` places each flat history id at ``row * L + j``."""

    user: torch.Tensor  # [B] int64
    item: torch.Tensor
    category: torch.Tensor
    advertiser: torch.Tensor
    context: torch.Tensor  # [B, 3] int64 keys
    hist_items: torch.Tensor  # [n] int64, the real (unpadded) sequence ids
    hist_categories: torch.Tensor  # [n] int64
    hist_index: torch.Tensor  # [n] int64 in [0, B * L)
    dense: torch.Tensor  # [B, F] float32
    label: torch.Tensor  # [B] float32 (zeros at serving)
    ts: torch.Tensor  # [B] int64 event time
    history_len: int
    event_ids: pa.Array | None = None  # impression ids (Arrow: turned into Python strings only when needed)
    positions: dict[int, int] = field(default_factory=dict)  # source position after this batch
    rejected: Counter = field(default_factory=Counter)  # rejected rows consumed with this batch, by reason

    def __len__(self) -> int:
        return len(self.user)

    def _tensors(self) -> list[str]:
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def pin_memory(self) -> "SampleBatch":
        for name in self._tensors():
            setattr(self, name, getattr(self, name).pin_memory())
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> "SampleBatch":
        for name in self._tensors():
            setattr(self, name, getattr(self, name).to(device, non_blocking=non_blocking))
        return self

    def max_ts(self) -> int:
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


def dense_feature_names(spec: SampleSpec) -> list[str]:
    names = [f"log1p_{c}" for c in spec.counter_columns()]
    names += [f"ctr_{entity}_{w}s" for w in spec.windows_s for entity in ("user", "item", "category")]
    return names


def context_keys(device: pa.Array, position: np.ndarray, local_hour: np.ndarray) -> np.ndarray:
    """[B, 3] keys of the context table; device strings hash with crc32 (stable across runs)."""
    uniques = pc.unique(device)
    codes = np.array([zlib.crc32(s.encode()) for s in uniques.to_pylist()], dtype=np.int64)
    device_hash = codes[pc.index_in(device, uniques).to_numpy()] if len(codes) else np.zeros(len(device), np.int64)
    out = np.empty((len(position), 3), dtype=np.int64)
    for j, values in enumerate((device_hash, position.astype(np.int64), local_hour.astype(np.int64))):
        out[:, j] = (j + 1) << 32 | (values & 0xFFFFFFFF)
    return out


def batch_from_table(table: pa.Table, spec: SampleSpec, history_len: int, with_labels: bool = True) -> SampleBatch:
    """Tensors of a table of checked samples (see pipelines.sample_wire.check_samples)."""
    n = table.num_rows

    def ints(name: str) -> np.ndarray:
        return table[name].to_numpy().astype(np.int64)  # a writable copy for torch

    # most recent first: keep the head of each list
    items, categories = (pc.list_slice(table[name], 0, history_len) for name in ("hist_item_ids", "hist_category_ids"))
    hist = [pc.list_flatten(col).to_numpy().astype(np.int64) for col in (items, categories)]  # writable copies for torch
    lengths = pc.list_value_length(items).to_numpy().astype(np.int64)
    rows = np.repeat(np.arange(n, dtype=np.int64), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    hist_index = rows * history_len + (np.arange(len(rows), dtype=np.int64) - starts)

    counters = np.stack([table[c].to_numpy().astype(np.float32) for c in spec.counter_columns()], axis=1) if n else np.zeros((0, len(spec.counter_columns())), np.float32)
    rates = []
    for w in spec.windows_s:
        for entity in ("user", "item", "category"):
            imps = table[f"{entity}_imps_{w}s"].to_numpy().astype(np.float32)
            clicks = table[f"{entity}_clicks_{w}s"].to_numpy().astype(np.float32)
            rates.append(clicks / (imps + CTR_PRIOR_IMPS))
    dense = np.concatenate([np.log1p(counters), np.stack(rates, axis=1) if n else np.zeros((0, len(rates)), np.float32)], axis=1)

    label = table["label"].to_numpy().astype(np.float32) if with_labels and "label" in table.column_names else np.zeros(n, np.float32)
    ts = ints("ts")
    event_ids = table["event_id"].combine_chunks() if "event_id" in table.column_names else None
    return SampleBatch(
        user=torch.from_numpy(ints("user_id")),
        item=torch.from_numpy(ints("item_id")),
        category=torch.from_numpy(ints("category_id")),
        advertiser=torch.from_numpy(ints("advertiser_id")),
        context=torch.from_numpy(context_keys(table["device"], table["position"].to_numpy(), table["local_hour"].to_numpy())),
        hist_items=torch.from_numpy(hist[0]),
        hist_categories=torch.from_numpy(hist[1]),
        hist_index=torch.from_numpy(hist_index),
        dense=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        label=torch.from_numpy(label),
        ts=torch.from_numpy(ts.copy()),
        history_len=history_len,
        event_ids=event_ids,
    )
