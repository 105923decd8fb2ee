"""A batch of checked samples as numpy arrays: what the model's tensors are made of
(model/batch.py wraps them without a copy), built where torch need not be loaded.

The trainer's sample reader builds these in a process of its own (trainer/reader_process.py):
without torch that process starts in about a second instead of several.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Callable, Generic, Sequence, TypeVar

import numpy as np
import pyarrow as pa

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.model.columns import FeatureColumns, columns_from_table

TABLES = ("user", "item", "category", "advertiser", "context")
CONTEXT_FIELDS = ("device", "position", "local_hour")
CTR_PRIOR_IMPS = 10.0  # smoothing of the rate features: clicks / (imps + prior)
# the batch's arrays each sparse table is asked for, candidate ids first (DIN: the history
# shares the candidate's table)
TABLE_INPUTS = {"user": ("user",), "item": ("item", "hist_items"), "category": ("category", "hist_categories"),
                "advertiser": ("advertiser",), "context": ("context",)}


A = TypeVar("A")  # the arrays' type: numpy arrays (HostBatch) or torch tensors (model/batch.py's SampleBatch)


@dataclass
class Batch(Generic[A]):
    """One batch of samples; ``hist_index`` places each flat history id at ``row * L + j``
    (with ``hist_group``: at ``sequence * L + j``, rows sharing sequences)."""

    user: A  # [B] int64
    item: A
    category: A
    advertiser: A
    context: A  # [B, 3] int64 keys
    hist_items: A  # [n] int64, the real (unpadded) sequence ids
    hist_categories: A  # [n] int64
    hist_index: A  # [n] int64 in [0, B * L)
    dense: A  # [B, F] float32 ([0] when left to the caller)
    label: A  # [B] float32 (zeros at serving)
    ts: A  # [B] int64 event time
    history_len: int
    hist_group: A | None = None  # [B] int64: the sequence of each row, when rows share them
    history_groups: int = 0  # sequences, with hist_group
    event_ids: pa.Array | None = None  # impression ids (Arrow: turned into Python strings only when needed)
    positions: dict[int, int] = field(default_factory=dict)  # source position after this batch
    rejected: Counter = field(default_factory=Counter)  # rejected rows consumed with this batch, by reason
    plan: object | None = None  # the exchange's layout of its ids, made off the training thread (trainer/reader.py)

    def __len__(self) -> int:
        return len(self.user)


@dataclass
class HostBatch(Batch[np.ndarray]):
    """A batch as numpy arrays."""

    def arrays(self) -> list[str]:
        """The names of its arrays (SampleBatch's tensors)."""
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), np.ndarray)]


def table_ids(batch, concatenate: Callable[[Sequence], object] = np.concatenate) -> dict:
    """The ids each table is asked for (candidate ids first, then the history's), of a
    HostBatch or, with ``torch.cat``, a SampleBatch."""
    out = {}
    for table, names in TABLE_INPUTS.items():
        parts = [getattr(batch, name) for name in names]
        out[table] = parts[0].reshape(-1) if len(parts) == 1 else concatenate(parts)
    return out


def host_dense_features(counters: np.ndarray) -> np.ndarray:
    """float32 [B, F] of the counter columns [B, 6W] (model/batch.py ``dense_features``)."""
    counters = counters.astype(np.float32)
    pairs = counters.reshape(len(counters), counters.shape[1] // 2, 2)
    return np.concatenate([np.log1p(counters), pairs[..., 1] / (pairs[..., 0] + np.float32(CTR_PRIOR_IMPS))], axis=1)


def context_keys(device_hash: np.ndarray, position: np.ndarray, local_hour: np.ndarray) -> np.ndarray:
    """[B, 3] keys of the context table."""
    out = np.empty((len(position), 3), dtype=np.int64)
    for j, values in enumerate((device_hash, position.astype(np.int64), local_hour.astype(np.int64))):
        out[:, j] = (j + 1) << 32 | (values & 0xFFFFFFFF)
    return out


def _owned(values: np.ndarray, dtype: type) -> np.ndarray:
    """``values`` as a C-contiguous, writable array of ``dtype``, copied only when it must be
    (another dtype, a strided view, a read-only buffer such as Arrow's or a received frame's):
    columns_from_table's arrays are already fresh int64 copies."""
    return np.require(values, dtype, ["C", "W"])


def host_batch_from_columns(cols: FeatureColumns, history_len: int, with_dense: bool = True) -> HostBatch:
    """The arrays of checked columns; sequences longer than ``history_len`` keep their most
    recent (first) ``history_len`` ids. ``with_dense=False``: ``dense`` is left empty, for the
    caller to compute where the counters end up (serving, on the device)."""
    n = len(cols)
    lengths = cols.hist_lengths
    rows = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    position = np.arange(len(rows), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    kept = position < history_len
    hist_items, hist_categories = cols.hist_items, cols.hist_categories
    if not kept.all():
        rows, position, hist_items, hist_categories = rows[kept], position[kept], hist_items[kept], hist_categories[kept]
    ints = cols.ints
    label = cols.label if cols.label is not None else np.zeros(n, np.float32)
    return HostBatch(
        user=_owned(ints["user_id"], np.int64),
        item=_owned(ints["item_id"], np.int64),
        category=_owned(ints["category_id"], np.int64),
        advertiser=_owned(ints["advertiser_id"], np.int64),
        context=context_keys(cols.device_hash, ints["position"], ints["local_hour"]),
        hist_items=_owned(hist_items, np.int64),
        hist_categories=_owned(hist_categories, np.int64),
        hist_index=rows * history_len + position,
        dense=np.ascontiguousarray(host_dense_features(cols.counters)) if with_dense else np.empty(0, np.float32),
        label=_owned(label, np.float32),
        ts=_owned(ints["ts"], np.int64),
        history_len=history_len,
        hist_group=None if cols.hist_group is None else np.ascontiguousarray(cols.hist_group, np.int64),
        history_groups=len(lengths) if cols.hist_group is not None else 0,
        event_ids=cols.event_ids,
    )


def host_batch_from_table(table: pa.Table, spec: FeatureSpec, history_len: int, with_labels: bool = True) -> HostBatch:
    """The arrays of a table of checked samples (see contracts.sample_wire.check_samples)."""
    return host_batch_from_columns(columns_from_table(table, spec, with_labels), history_len)
