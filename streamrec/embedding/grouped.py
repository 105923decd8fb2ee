"""Table-batched find_or_insert and apply_gradients: every table of a step in one
find-or-insert launch and one optimizer launch (as FBGEMM's table-batched embeddings do
for lookups); and serving's fused read, every table's probe + gather in one launch.

Why: the trainer's step is bound by its host thread, and per table a step costs a Triton
launch through Triton's Python launcher, scratch and counter buffers and a few small ops
for the find-or-insert, and another launch for the optimizer. Grouped, the tables' unique
keys, rows, slots and gradients are each one tensor (one group per table, one after
another) and each kernel reads a small table of per-group pointers.

Applies on CUDA while every table inserts its rows on the device (every row cached, no
admission sketch: ``EmbeddingTable.inserts_on_device``) and the tables agree on row shape,
optimizer and initialisation (``groupable``); otherwise ``EmbeddingCollection`` goes table
by table. The read (``find_start_grouped``) only needs every table cached on one CUDA
device with one row width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from streamrec.embedding import kernels
from streamrec.embedding.optimizer_kernels import OptimizerGroups
from streamrec.embedding.table import BatchRows, EmbeddingTable, PendingInsert, finish_inserts
from streamrec.embedding.unique import unique_concat


@dataclass
class GroupedRows:
    """One step's rows of several tables (all in HBM); ``by_table`` holds each table's share as views."""

    tables: list[EmbeddingTable]
    by_table: dict[str, BatchRows]
    rows: torch.Tensor  # float32 [unique keys of all tables, dim]
    slots: torch.Tensor  # int64: cache slot per unique key
    inverse: torch.Tensor  # int64, for every input id (tables one after another): its row in ``rows``
    id_counts: list[int]  # input ids per table
    key_counts: list[int]  # unique keys per table


def groupable(tables: list[EmbeddingTable], id_counts: list[int]) -> bool:
    """Whether a training find_or_insert of these tables (up to ``id_counts`` keys each) can be grouped."""
    if not tables or not kernels.available(tables[0].device):
        return False
    settings = tables[0].creation_settings
    return all(t.creation_settings == settings for t in tables) and \
        all(t.inserts_on_device(n) for t, n in zip(tables, id_counts))


def find_or_insert_grouped(tables: dict[str, EmbeddingTable], ids: Mapping[str, torch.Tensor], now_ms: int) -> GroupedRows | None:
    """The training find_or_insert of every table in ``ids``: one unique over all of them (one
    host sync), one find-or-insert launch, one host sync for what it created. None where
    ``groupable`` says no."""
    names = list(ids)
    group = [tables[n] for n in names]
    flat = [ids[n].to(group[0].device, torch.int64).reshape(-1) for n in names]
    id_counts = [len(f) for f in flat]
    if not groupable(group, id_counts):
        return None
    keys, inverse, counts, key_counts = unique_concat(flat)
    fresh, seeds = zip(*(t.find_or_insert_prepare(n) for t, n in zip(group, key_counts)))
    counters = torch.zeros(len(group), 2, dtype=torch.int32, device=keys.device)
    _, _, _, init_std, state_fill = group[0].creation_settings
    rows, slots = kernels.find_or_insert_grouped(keys, key_counts, [t.tiers.cache for t in group], list(fresh), counters, now_ms,
                                                 list(seeds), init_std, state_fill)
    pending, first_key, first_id = [], 0, 0
    for g, (n_keys, n_ids) in enumerate(zip(key_counts, id_counts)):
        own = slice(first_key, first_key + n_keys)  # each table's share: views of the grouped tensors
        pending.append(PendingInsert(keys[own], inverse[first_id:first_id + n_ids] - first_key, counts[own], rows[own], slots[own],
                                     counters[g], now_ms))
        first_key, first_id = first_key + n_keys, first_id + n_ids
    finished = finish_inserts(group, pending, counters)  # fixes up undecided keys in place (views)
    return GroupedRows(group, dict(zip(names, finished)), rows, slots, inverse, id_counts, key_counts)


def apply_gradients_grouped(grouped: GroupedRows, grad: torch.Tensor) -> None:
    """The optimizer over every table's rows (grad: float32 [unique keys of all tables, dim],
    in HBM) in one launch; table by table where a find_or_insert since has moved some
    table's rows."""
    by_table = list(grouped.by_table.values())
    if not all(t.current(r) for t, r in zip(grouped.tables, by_table)):
        first = 0
        for table, r, n in zip(grouped.tables, by_table, grouped.key_counts):
            table.apply_gradients(r, grad[first:first + n])
            first += n
        return
    groups = OptimizerGroups([t.tiers.cache for t in grouped.tables], grouped.key_counts, grad.shape[1], grad.device)
    grouped.tables[0].optimizer.update_grouped_(groups, grouped.slots, grad)
    for table, r in zip(grouped.tables, by_table):
        table.gradients_applied(r)


def find_start_grouped(tables: dict[str, EmbeddingTable], ids: Mapping[str, torch.Tensor],
                       now_ms: int) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
    """``EmbeddingTable.find_start`` of every table in ``ids`` (table -> int64 [n], any
    device, repeats allowed) in one probe + gather launch, with the same effects (the clock
    of the rows hit moves to ``now_ms``; nothing else changes). Returns (table -> rows
    float32 [n, dim], views of one tensor in HBM; pending int32 [tables] in HBM, in ``ids``'
    order, each what that table's ``find_start`` counts), or None unless every table is
    cached on one CUDA device with one row width. Ids in host memory cross to the device
    as one copy."""
    names = list(ids)
    group = [tables[n] for n in names]
    caches = [t.tiers.cache for t in group]
    if not group or any(c is None or not kernels.available(c.device) for c in caches):
        return None
    device, dim = caches[0].device, caches[0].dim
    if any(c.device != device or c.dim != dim for c in caches):
        return None
    flat = [ids[n].reshape(-1) for n in names]
    home = flat[0].device if all(f.device == flat[0].device for f in flat) else device
    keys = torch.cat([f.to(home, torch.int64) for f in flat]).to(device)
    counts = [len(f) for f in flat]
    rows, pending = kernels.probe_gather_grouped(keys, counts, caches, now_ms, [not t.tiers.cache_complete for t in group])
    return dict(zip(names, rows.split(counts))), pending
