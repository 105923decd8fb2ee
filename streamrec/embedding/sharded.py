"""Embedding tables sharded row-wise across the ranks of a torch.distributed group.

Each key has one owner rank (``owner_of``: a hash of the key, so Zipf-skewed ids still
spread evenly), and only its owner stores the row, in the owner's own ``EmbeddingStore``
with its own HBM/DRAM/SSD tiers, admission and expiry. A training step, for all tables
at once::

    requester: every id of every table, grouped by (owner, table)
    all_to_all  counts (owner x table), then ids            -> owners
    owner:      EmbeddingStore.pull of what it received: one de-duplication of the ids
                of all ranks, rows created/admitted there, one row per id received
    all_to_all  rows                                         -> requesters
    ... forward, backward on the requester ...
    all_to_all  the gradient of each id                      -> owners
    owner:      sums the gradients of each key (over its ids from every rank), averages
                over ranks (as DDP averages dense gradients), applies the optimizer

The requester sends its ids as they are, not de-duplicated: the owner has to de-duplicate
what several ranks sent anyway, and one de-duplication means one host sync less per step
and admission sees every sighting, as on one rank. Four collectives and three host syncs
per step (the split sizes, and the owner's pull), whatever the number of tables. Tables
must share one dim (the rows travel as one tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from streamrec.embedding.collection import EmbeddingStore
from streamrec.embedding.table import Pulled

_MIX = -4658895280553007687  # 0xBF58476D1CE4E5B9 as a signed int64 (splitmix64's multiplier)


def owner_of(keys: torch.Tensor, world: int) -> torch.Tensor:
    """The rank that owns each key. A different mix than the hash index's (which takes the
    top bits of ``key * 0x9E37...``), so one shard's keys do not crowd one part of its index."""
    mixed = (keys ^ (keys >> 31)) * _MIX
    return ((mixed >> 32) & 0x7FFFFFFF) % world


@dataclass
class ShardedPull:
    """One step's exchange: what the requester got, and what the owner must update."""

    names: list[str]
    rows: dict[str, torch.Tensor]  # requester: one row per input id of each table, [n_t, dim]
    order: torch.Tensor  # requester: the ids of all tables in send order (by owner, then table)
    send_splits: list[int]  # rows sent to / received back from each rank
    recv_splits: list[int]  # rows received from / sent back to each rank
    by_table: torch.Tensor  # owner: received rows in table order
    table_sizes: list[int]  # owner: rows received per table
    owned: dict[str, Pulled]  # owner: the local pulls, handed to push


class ShardedEmbeddings:
    """The tables of ``store`` (this rank's shard) as one logical set of tables over
    ``group`` (the default group when None)."""

    def __init__(self, store: EmbeddingStore, group: dist.ProcessGroup | None = None) -> None:
        dims = {t.config.dim for t in store.tables.values()}
        if len(dims) != 1:
            raise ValueError(f"sharded tables must share one dim, got {sorted(dims)}")
        self.store, self.group = store, group
        self.dim = dims.pop()
        self.world = dist.get_world_size(group)
        self.device = store.device

    def pull(self, ids: dict[str, torch.Tensor], now_ms: int, train: bool = True) -> ShardedPull:
        names, world, device = list(ids), self.world, self.device
        n_tables = len(names)
        flat = [ids[n].to(device, torch.int64).reshape(-1) for n in names]
        sizes = [len(f) for f in flat]
        keys = torch.cat(flat)
        tables = torch.cat([torch.full((size,), t, dtype=torch.int64, device=device) for t, size in enumerate(sizes)])
        code = owner_of(keys, world) * n_tables + tables
        order = torch.argsort(code, stable=True)
        # a count per (owner, table): index_add, not bincount (which waits for the device to size its output)
        send_counts = torch.zeros(world * n_tables, dtype=torch.int64, device=device).index_add_(0, code, torch.ones_like(code))
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        counts = torch.stack([send_counts, recv_counts]).view(2, world, n_tables).cpu()  # host sync: the split sizes
        send_splits, recv_splits = counts[0].sum(1).tolist(), counts[1].sum(1).tolist()
        received = torch.empty(sum(recv_splits), dtype=torch.int64, device=device)
        dist.all_to_all_single(received, keys[order], recv_splits, send_splits, group=self.group)
        # received: for each source rank, its ids of table 0, then table 1, ...; regroup by table
        tag = torch.arange(n_tables, device=device).repeat(world)
        recv_table = torch.repeat_interleave(tag, recv_counts, output_size=len(received))
        by_table = torch.argsort(recv_table, stable=True)
        table_sizes = counts[1].sum(0).tolist()
        wanted = dict(zip(names, torch.split(received[by_table], table_sizes)))
        owned = self.store.pull(wanted, now_ms, train)  # its unique counts and created rows: the other two host syncs on CUDA
        served = torch.empty(len(received), self.dim, device=device)
        served[by_table] = torch.cat([owned[n].embeddings() for n in names])
        back = torch.empty(len(keys), self.dim, device=device)
        dist.all_to_all_single(back, served, send_splits, recv_splits, group=self.group)
        rows = torch.empty_like(back)
        rows[order] = back
        return ShardedPull(names, dict(zip(names, torch.split(rows, sizes))), order, send_splits, recv_splits, by_table,
                           table_sizes, owned)

    def push(self, pulled: ShardedPull, grads: dict[str, torch.Tensor | None]) -> None:
        """Send each table's gradient of each input id's row (None: no gradient) to the
        owners, which apply the optimizers. Collective: every rank calls it every step."""
        parts = [grads.get(n) if grads.get(n) is not None else torch.zeros_like(pulled.rows[n]) for n in pulled.names]
        sent = torch.cat(parts).index_select(0, pulled.order) if parts else torch.empty(0, self.dim, device=self.device)
        received = torch.empty(sum(pulled.recv_splits), self.dim, device=self.device)
        dist.all_to_all_single(received, sent.contiguous(), pulled.recv_splits, pulled.send_splits, group=self.group)
        for name, grad in zip(pulled.names, torch.split(received.index_select(0, pulled.by_table), pulled.table_sizes)):
            owned = pulled.owned[name]
            summed = torch.zeros(len(owned.keys), self.dim, device=grad.device).index_add_(0, owned.inverse, grad)
            self.store[name].push(owned, summed.div_(self.world))
