"""Checked samples as numpy columns (:class:`FeatureColumns`), without torch: the form
both a table of training samples and a batch of predict instances take before
``model.batch.batch_from_columns`` makes tensors of them. Kept free of torch so the
serving front-end processes, which build columns, do not load it."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from streamrec.contracts.feature_spec import HISTORY_COLUMNS, INT_COLUMNS, FeatureSpec


@dataclass
class FeatureColumns:
    """Checked samples as numpy arrays: the one form that both a table of training samples
    and a batch of decoded predict instances take on their way to the model, so training
    and serving features come out of the same conversion (:func:`batch_from_columns`)."""

    ints: dict[str, np.ndarray]  # INT_COLUMNS -> [B] int64
    counters: np.ndarray  # [B, C] in FeatureSpec.counter_columns() order
    device_hash: np.ndarray  # [B] int64, crc32 of the device string
    hist_items: np.ndarray  # flat int64, each sequence (most recent first)
    hist_categories: np.ndarray
    hist_lengths: np.ndarray  # [B] int64; with hist_group: [G], per shared sequence
    label: np.ndarray | None = None
    event_ids: pa.Array | None = None
    # [B] int64: the sequence each row uses, when rows share them (a by-ids request's
    # candidates all have its user's history: it travels and is looked up once, not per row)
    hist_group: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.counters)

    def grouped(self) -> np.ndarray:
        """``hist_group``, or each row its own sequence."""
        return self.hist_group if self.hist_group is not None else np.arange(len(self), dtype=np.int64)

    @staticmethod
    def concat(parts: list["FeatureColumns"]) -> "FeatureColumns":
        """Rows of several parts (e.g. the requests of one serving batch), in order; labels and ids dropped."""
        if len(parts) == 1:
            return parts[0]
        group = None
        if any(p.hist_group is not None for p in parts):
            starts = np.cumsum([0] + [len(p.hist_lengths) for p in parts[:-1]])
            group = np.concatenate([p.grouped() + start for p, start in zip(parts, starts)])
        return FeatureColumns(
            ints={name: np.concatenate([p.ints[name] for p in parts]) for name in parts[0].ints},
            counters=np.concatenate([p.counters for p in parts]),
            device_hash=np.concatenate([p.device_hash for p in parts]),
            hist_items=np.concatenate([p.hist_items for p in parts]),
            hist_categories=np.concatenate([p.hist_categories for p in parts]),
            hist_lengths=np.concatenate([p.hist_lengths for p in parts]),
            hist_group=group,
        )


def device_hashes(device: pa.Array | pa.ChunkedArray | list[str]) -> np.ndarray:
    """crc32 of each device string (stable across runs and processes), hashed once per distinct value."""
    if isinstance(device, list):
        codes = {s: zlib.crc32(s.encode()) for s in set(device)}
        return np.fromiter(map(codes.__getitem__, device), np.int64, len(device))
    uniques = pc.unique(device)
    codes = np.array([zlib.crc32(s.encode()) for s in uniques.to_pylist()], dtype=np.int64)
    return codes[pc.index_in(device, uniques).to_numpy()] if len(codes) else np.zeros(len(device), np.int64)


def columns_from_table(table: pa.Table, spec: FeatureSpec, with_labels: bool = True) -> FeatureColumns:
    """The columns of a table of checked samples (see contracts.sample_wire.check_samples)."""
    n = table.num_rows
    items, categories = HISTORY_COLUMNS
    counters = (np.stack([table[c].to_numpy() for c in spec.counter_columns()], axis=1) if n
                else np.zeros((0, len(spec.counter_columns())), np.int64))
    return FeatureColumns(
        ints={name: table[name].to_numpy().astype(np.int64) for name in INT_COLUMNS},
        counters=counters,
        device_hash=device_hashes(table["device"]),
        hist_items=pc.list_flatten(table[items]).to_numpy().astype(np.int64),
        hist_categories=pc.list_flatten(table[categories]).to_numpy().astype(np.int64),
        hist_lengths=pc.list_value_length(table[items]).to_numpy().astype(np.int64),
        label=table["label"].to_numpy().astype(np.float32) if with_labels and "label" in table.column_names else None,
        event_ids=table["event_id"].combine_chunks() if "event_id" in table.column_names else None,
    )
