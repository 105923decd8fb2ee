"""Table-batched training pulls and pushes: every table of a step in one find-or-insert
launch and one optimizer launch (as FBGEMM's table-batched embeddings do for lookups).

Why: the trainer's step is bound by its host thread. Per table, a pull cost a Triton launch
through Triton's Python launcher, scratch and counter buffers, an index_select and a
subtraction; a push another launch. Five tables, ten launches and some fifty small ops a
step. Grouped, the tables' unique keys, rows, slots and gradients are each one tensor
(one group per table, one after another) and each kernel reads a small table of per-group
pointers.

Applies on CUDA while every table creates its rows on the device (every row cached, no
admission sketch: ``EmbeddingTable.creates_on_device``) and the tables agree on row shape,
optimizer and initialisation; otherwise ``EmbeddingStore.pull`` serves, table by table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrec.embedding import kernels
from streamrec.embedding.optimizer_kernels import OptimizerGroups
from streamrec.embedding.table import EmbeddingTable, PendingPull, Pulled
from streamrec.embedding.unique import unique_concat


@dataclass
class GroupedPull:
    """One step's rows of several tables; ``pulled`` holds each table's share as views."""

    tables: list[EmbeddingTable]
    pulled: dict[str, Pulled]
    rows: torch.Tensor  # [unique keys of all tables, dim]
    slots: torch.Tensor  # cache slot per unique key
    inverse: torch.Tensor  # for every input id (tables one after another): its row in ``rows``
    id_counts: list[int]  # input ids per table
    key_counts: list[int]  # unique keys per table


def groupable(tables: list[EmbeddingTable], id_counts: list[int]) -> bool:
    """Whether a training pull of these tables (up to ``id_counts`` keys each) can be grouped."""
    if not tables or not kernels.available(tables[0].device):
        return False
    settings = tables[0].creation_settings()
    return all(t.creation_settings() == settings for t in tables) and \
        all(t.creates_on_device(n) for t, n in zip(tables, id_counts))


def pull_grouped(tables: dict[str, EmbeddingTable], ids: dict[str, torch.Tensor], now_ms: int) -> GroupedPull | None:
    """The training pull of every table in ``ids``: one unique over all of them (one host
    sync), one find-or-insert launch, one host sync for what it created. None where
    ``groupable`` says no."""
    names = list(ids)
    group = [tables[n] for n in names]
    flat = [ids[n].to(group[0].device, torch.int64).reshape(-1) for n in names]
    id_counts = [len(f) for f in flat]
    if not groupable(group, id_counts):
        return None
    keys, inverse, counts, key_counts = unique_concat(flat)
    fresh, seeds = zip(*(t.prepare_create(n) for t, n in zip(group, key_counts)))
    counters = torch.zeros(len(group), 2, dtype=torch.int32, device=keys.device)
    _, _, _, init_std, state_fill = group[0].creation_settings()
    rows, slots = kernels.find_or_insert_grouped(keys, key_counts, [t.cache for t in group], list(fresh), counters, now_ms,
                                                 list(seeds), init_std, state_fill)
    done = counters.tolist()  # the one host sync for every table's creations
    pulled, first_key, first_id = {}, 0, 0
    for g, (name, table, n_keys, n_ids) in enumerate(zip(names, group, key_counts, id_counts)):
        own = slice(first_key, first_key + n_keys)
        pending = PendingPull(keys[own], inverse[first_id:first_id + n_ids] - first_key, counts[own], rows[own], slots[own],
                              counters[g], now_ms)
        pulled[name] = table.pull_finish(pending, done[g])  # fixes up undecided keys in place (views)
        first_key, first_id = first_key + n_keys, first_id + n_ids
    return GroupedPull(group, pulled, rows, slots, inverse, id_counts, key_counts)


def push_grouped(grouped: GroupedPull, grad: torch.Tensor) -> None:
    """The optimizer over every table's rows (grad: [unique keys of all tables, dim]) in one
    launch; table by table where a pull since has moved some table's rows."""
    pulled = list(grouped.pulled.values())
    if not all(t.current(p) for t, p in zip(grouped.tables, pulled)):
        first = 0
        for table, p, n in zip(grouped.tables, pulled, grouped.key_counts):
            table.push(p, grad[first:first + n])
            first += n
        return
    groups = OptimizerGroups([t.cache for t in grouped.tables], grouped.key_counts, grad.shape[1], grad.device)
    grouped.tables[0].optimizer.update_grouped_(groups, grouped.slots, grad)
    for table, p in zip(grouped.tables, pulled):
        table.pushed(p)
