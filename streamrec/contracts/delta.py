"""The files of a published model version: what the model store writes and every reader parses.

A version directory holds ``manifest.json`` (``format_version`` = :data:`FORMAT_VERSION`), one
Arrow IPC file per sparse table (or per table and shard) and ``dense.arrow``:

- sparse: ``key`` int64, ``deleted`` bool, ``value`` fixed_size_list<float32>[dim] -- rows
  upserted since the parent version, then keys erased (``deleted`` true, value zeros);
- dense: ``name`` string, ``shape`` list<int64>, ``values`` large_list<float32> (flattened).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:  # the tensors come from the caller: readers of the files need no torch
    import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass
class SparseDelta:
    """Rows of one table to write: upserts (keys, values) and deletions."""

    keys: torch.Tensor
    values: torch.Tensor
    deleted: torch.Tensor = field(default_factory=lambda: _no_keys())


def _no_keys() -> torch.Tensor:
    import torch

    return torch.empty(0, dtype=torch.int64)


def sparse_table(delta: SparseDelta, dim: int) -> pa.Table:
    keys = np.concatenate([delta.keys.cpu().numpy().astype(np.int64), delta.deleted.cpu().numpy().astype(np.int64)])
    n_up, n_del = len(delta.keys), len(delta.deleted)
    values = np.zeros((n_up + n_del, dim), dtype=np.float32)
    if n_up:
        values[:n_up] = delta.values.detach().cpu().numpy().astype(np.float32).reshape(n_up, dim)
    flags = np.zeros(n_up + n_del, dtype=bool)
    flags[n_up:] = True
    return pa.table({
        "key": pa.array(keys, pa.int64()),
        "deleted": pa.array(flags),
        "value": pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), dim),
    })


def dense_table(dense: Mapping[str, torch.Tensor]) -> pa.Table:
    names = sorted(dense)
    return pa.table({
        "name": pa.array(names, pa.string()),
        "shape": pa.array([list(dense[n].shape) for n in names], pa.list_(pa.int64())),
        "values": pa.array([dense[n].detach().cpu().float().reshape(-1).numpy() for n in names], pa.large_list(pa.float32())),
    })


def sparse_arrays(table: pa.Table, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys int64 [n], deleted bool [n], values float32 [n, dim]) of one sparse file's table."""
    values = table["value"].combine_chunks().flatten().to_numpy().reshape(-1, dim) if table.num_rows else np.zeros((0, dim), np.float32)
    return table["key"].to_numpy(), table["deleted"].to_numpy(zero_copy_only=False), values
