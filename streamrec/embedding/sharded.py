"""Embedding tables sharded row-wise across the ranks of a torch.distributed group.

Each key has one owner rank (``owner_of``: a hash of the key, so Zipf-skewed ids still
spread evenly), and only its owner stores the row, in the owner's own
``EmbeddingCollection`` with its own HBM/DRAM/SSD tiers, admission and expiry. A training
step, for all tables at once::

    requester: each table's distinct ids (keys), grouped by (owner, table); its counts
                per (owner, table), and the keys themselves, go in the step's agreement
                (plan, keys_out, agreed)                           -> owners
    owner:      find_or_insert of what it received: one de-duplication of the keys of
                all ranks, rows created/admitted there, one row per key received
    all_to_all  rows                                         -> requesters
    requester:  one row per input id (an index_select of the rows by each id's key)
    ... forward, backward on the requester (which sums the gradients of a key's ids) ...
    all_to_all  the gradient of each key                     -> owners
    owner:      sums the gradients of each key (over the ranks that sent it), averages
                over ranks (as the dense gradients are averaged), applies the optimizer

The requester sends each key once: a batch asks for most keys many times (a popular
item in many histories, a handful of categories and contexts in every sample), so the
ids, rows and gradients that cross ranks, and the owner's de-duplication, shrink by that
factor, and a hot key no longer loads its owner with every sighting. Tables whose
admission sketch counts every sighting (``every_sighting``) send every id instead. The
trainer lays the keys out on the host, off its step's thread (``layout_on_host``, in its
sample reader process: a hash de-duplication per table), so neither the de-duplication nor
the counts cost a device sync; laid out on the device (``plan`` without ``host``) the
counts cost one. The split sizes need every rank's counts; they ride in the per-step
agreement (trainer/distributed.py), and so do the keys where every rank laid them out on
the host: the agreement is a round of messages between the ranks' hosts anyway, and the
keys are a few thousand integers, so the ids need no collective (and the owner no
regrouping of them on the device). Two collectives (rows, gradients) and two host syncs
per step (the owner's find_or_insert), whatever the number of tables; a third collective
sends the keys where they were laid out on the device. A caller that does not agree first
(``find_or_insert`` without ``plan``/``agreed``) gets the counts sent in an all_gather of
their own, then to the host: one more.

Replicated tables (``replicated``; ``plan_placement`` picks them): small tables every
sample asks for are held whole by every rank and trained data-parallel instead. Each
rank's unique ids of them (and how often each came) go to every rank (one all_to_all, its
sizes in the agreement too); every rank runs the same find_or_insert over their union, in
rank order, so every replica creates, admits and moves the same rows (the replicas start
equal, with rank 0's random state); each rank reads its own ids' rows locally; after
backward one all_reduce sums the union rows' gradients, averaged over ranks as above, and
every rank applies the same update. The union goes into the owner's find_or_insert and
update (one launch each for all tables where table-batched), so it adds no host sync there.

The owner's side is table-batched wherever ``EmbeddingCollection``'s own step would be
(grouped.py: one find-or-insert launch and one optimizer launch for all tables; the rows
and the gradients of all tables as one tensor each, indexed in the order the ids arrived,
so neither is regrouped by table), else table by table (``find_or_insert_each``), with
the same host syncs. Why: the step is bound by its host thread, and table by table the
owner pays each table's launches, buffers and small ops on both verbs. The requester's
rows are one tensor as well (one autograd leaf; each table's embeddings are views of it).
Tables must share one dim (the rows travel as one tensor). Inference is never sharded: it
reads an ``EmbeddingCollection`` loaded from a published version.

Pipelined (``prefetch``): the next step's ids go to their owners while this step's dense
work runs, and each owner's find_or_insert for them (rows created, slots taken) runs then
too, where it cannot move a row of this step (``_rows_stay``); the next step's rows are
read again, and sent, only by its own find_or_insert, after this step's update has landed.
So a step's rows, updates and created rows are those of the unpipelined step: the same
find_or_inserts in the same order, with the same random draws. On CUDA the work ahead runs
on a side stream that waits for this step's rows exchange only (not the dense work queued
after it), and the device's stream waits for it before anything it queues later.

``ShardedCollection.stats`` counts what each rank's exchange sent and received, from the
split sizes the step brings to the host anyway (no device sync of its own), and the host
time of each part of the exchange (exact per part with ``sync_timings``, which waits for
the device at each boundary; benchmarks only).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Collection, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist

from streamrec.embedding.host_layout import lay_out, owner_of
from streamrec.embedding.grouped import GroupedRows, apply_gradients_grouped, find_or_insert_grouped
from streamrec.embedding.table import BatchRows
from streamrec.embedding.unique import unique_per_group, unique_tagged

if TYPE_CHECKING:
    from streamrec.embedding.collection import EmbeddingCollection
    from streamrec.embedding.table import TableConfig

log = logging.getLogger(__name__)

EXCHANGE_PARTS = ("ids", "owner_find_or_insert", "rows", "grads", "owner_update")
# apply_gradients' all_to_all also averages a dense buffer where each rank's whole copy to every
# other rank, (world - 1) x its bytes, stays this small (a ring all_reduce sends under 2x them)
AVERAGE_MAX_BYTES = 8 << 20
SHARDED, REPLICATED = "sharded", "replicated"


def plan_placement(configs: "list[TableConfig]", world: int, estimated_rows: Mapping[str, int], replicate_below_rows: int,
                   overrides: Mapping[str, str], on_gpu: bool) -> dict[str, str]:
    """Where each table's rows live on ``world`` ranks: ``replicated`` (every rank holds the
    whole table and trains it data-parallel: no ids or rows cross ranks for it but its unique
    ids and one gradient all_reduce) or ``sharded`` (row-wise by key, ``owner_of``). A table
    is replicated when its estimated rows are below ``replicate_below_rows`` and, on GPUs, fit
    its GPU cache (its share of ``[ps] hbm_bytes``: every rank holds all of it); a table
    without an estimate is sharded. ``overrides`` (table -> placement) win. One table at
    least stays sharded."""
    names = [c.name for c in configs]
    unknown = sorted(set(estimated_rows) - set(names)) + sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(f"placement: no table named {', '.join(unknown)} (tables: {', '.join(names)})")
    bad = {n: p for n, p in overrides.items() if p not in (SHARDED, REPLICATED)}
    if bad:
        raise ValueError(f"placement: {bad} is neither {SHARDED!r} nor {REPLICATED!r}")
    out = {}
    for c in configs:
        rows = estimated_rows.get(c.name)
        small = world > 1 and rows is not None and rows < replicate_below_rows and (not on_gpu or rows <= c.gpu_cache_rows)
        out[c.name] = overrides.get(c.name, REPLICATED if small else SHARDED)
    if world > 1 and all(p == REPLICATED for p in out.values()):
        raise ValueError("placement: every table would be replicated; one at least must stay sharded")
    return out if world > 1 else dict.fromkeys(names, SHARDED)


@dataclass
class Route:
    """Where one step's ids went: the requester's side, and the owner's."""

    names: list[str]
    sizes: list[int]  # requester: input ids per table
    inverse: torch.Tensor  # requester: each input id's place among the keys sent (and the rows back)
    send_splits: list[int]  # rows sent to / received back from each rank
    recv_splits: list[int]  # rows received from / sent back to each rank
    recv_grid: list[list[int]]  # owner: keys received from each rank (rows) of each table (columns)
    table_sizes: list[int]  # owner: rows received per table

    def to_table_order(self, arrived: torch.Tensor) -> torch.Tensor:
        """Rows in the order they arrived (rank by rank, each rank's table by table) regrouped
        table by table (each table's rank by rank): a block transpose, one concatenation."""
        grid, world, tables = self.recv_grid, len(self.recv_grid), len(self.names)
        chunks = arrived.split([n for row in grid for n in row])
        return torch.cat([chunks[r * tables + t] for t in range(tables) for r in range(world)])

    def to_arrival_order(self, by_table: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_table_order``."""
        grid, world, tables = self.recv_grid, len(self.recv_grid), len(self.names)
        chunks = by_table.split([grid[r][t] for t in range(tables) for r in range(world)])
        return torch.cat([chunks[t * world + r] for r in range(world) for t in range(tables)])


@dataclass
class HostPlan:
    """A step's sharded ids laid out for their owners on the host, off the training thread
    (``layout_on_host``): what ``plan`` would compute on the device, without the device sync
    for the counts."""

    names: list[str]
    sizes: list[int]  # input ids per table
    routed: torch.Tensor  # int64 [keys + ids]: the keys in send order (by owner, table, key), then each input id's place among them
    send_counts: list[int]  # keys to each (owner, table), owner-major


@dataclass
class Plan:
    """A step's ids laid out for their owners ahead of its exchange (``ShardedCollection.plan``)."""

    names: list[str]
    sizes: list[int]  # input ids per table
    keys: torch.Tensor  # int64: the keys sent, in send order (by owner, table, key): each table's distinct ids, or every id
    inverse: torch.Tensor  # int64 [input ids]: each input id's place in ``keys``
    send_counts: list[int]  # keys to each (owner, table), owner-major
    recv_counts: list[int] | None = None  # keys from each (rank, table), rank-major; known once agreed
    asked: list[str] = field(default_factory=list)  # every table asked for, replicated ones included, in order
    replicated: "ReplicatedPlan | None" = None  # the ids of the replicated tables
    host_keys: np.ndarray | None = None  # ``keys`` on the host (laid out there, or none at all): they can ride in the agreement
    received: torch.Tensor | None = None  # owner: every rank's keys for it, table by table (each rank by rank), on the host; once agreed with them

    def counts(self) -> list[int]:
        """What the agreement carries for this rank: the sharded tables' counts per (owner,
        table), then the replicated tables' unique ids per table."""
        return self.send_counts + (self.replicated.sizes if self.replicated is not None else [])


@dataclass
class ReplicatedPlan:
    """A step's ids of the tables every rank holds whole (``replicated``): this rank's unique
    ids of each, which every rank receives, so that all run the same find_or_insert."""

    names: list[str]
    unique: list[torch.Tensor]  # per table: this rank's unique ids
    inverse: list[torch.Tensor]  # per table: each input id's position in ``unique``
    sightings: list[torch.Tensor]  # per table: how often each unique id came (admission counts every sighting)
    sizes: list[int]  # unique ids per table
    by_rank: list[list[int]] | None = None  # every rank's ``sizes``, once agreed


@dataclass
class ReplicatedRows:
    """The replicated tables' rows of a step: the same union of every rank's ids on every rank."""

    leaf: torch.Tensor  # the union's unique rows, tables one after another [keys, dim]; requires grad
    owned: dict[str, BatchRows]
    key_counts: list[int]  # unique rows per table in ``leaf``
    first_key: int  # table-batched: where ``leaf``'s rows begin in the step's ``grouped.rows`` (after the sharded tables')


@dataclass
class ShardedRows:
    """``ShardedCollection.find_or_insert``'s rows: what the requester got, and what the owner must update."""

    embeddings: dict[str, torch.Tensor]  # requester: one row per input id of each table, [n_t, dim]; ``leaf``'s rows by ``route.inverse``
    leaf: torch.Tensor  # requester: one row per key sent, in send order [keys, dim]; requires grad
    route: Route
    owned: dict[str, BatchRows]  # owner: its find_or_insert of what it received, per table
    grouped: GroupedRows | None = None  # owner: the same, table-batched (``owned`` then holds views of it)
    served: torch.Tensor | None = None  # owner, table-batched: each received id's row in ``grouped.rows``, in received order
    replicated: ReplicatedRows | None = None  # the replicated tables' rows (their embeddings are in ``embeddings`` too)


@dataclass
class Ahead:
    """A step's ids sent to their owners before its turn (``ShardedCollection.prefetch``)."""

    route: Route
    wanted: dict[str, torch.Tensor]  # owner: what it received, by table
    now_ms: int
    owned: dict[str, BatchRows] | None = None  # owner: its find_or_insert, when that ran ahead too
    grouped: GroupedRows | None = None


@dataclass
class ExchangeStats:
    """One rank's exchange, summed over steps. Bytes count what left this rank for the other
    ranks (what it sends itself is a local copy); the id and key counts include its own, so
    that ``ids_received`` across ranks shows how evenly the owners are loaded."""

    steps: int = 0
    ids_asked: int = 0  # ids of this rank's batches (sharded tables), before de-duplication
    ids_sent: int = 0  # keys this rank asked their owners for (each table's distinct ids)
    ids_received: int = 0  # keys this rank served as their owner
    ids_bytes_out: int = 0  # ids and their counts to the other owners
    rows_bytes_out: int = 0  # rows this owner sent back to the other requesters
    grads_bytes_out: int = 0  # gradients this requester sent to the other owners
    ahead: int = 0  # steps whose ids went to their owners during the step before (prefetch)
    found_ahead: int = 0  # of those, steps whose owner's find_or_insert ran then too
    counts_exchanged: int = 0  # steps whose split sizes took a counts all_gather of their own (no agreed plan)
    keys_agreed: int = 0  # steps whose keys rode in the agreement (no ids all_to_all)
    replicated_rows: int = 0  # unique rows of the replicated tables' union (every rank's ids), its gradient all_reduce's rows
    replicated_bytes_out: int = 0  # this rank's unique ids of the replicated tables (and their counts) to the other ranks
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(EXCHANGE_PARTS, 0.0))

    def per_step(self) -> dict[str, Any]:
        """The figures of an average step (bytes and ids per step, host ms per part)."""
        steps = max(1, self.steps)
        return {"steps": self.steps, "ahead": self.ahead, "found_ahead": self.found_ahead, "counts_exchanged": self.counts_exchanged,
                "keys_agreed": self.keys_agreed,
                "ids_asked": self.ids_asked / steps, "ids_sent": self.ids_sent / steps, "ids_received": self.ids_received / steps,
                "bytes_out": {"ids": self.ids_bytes_out / steps, "rows": self.rows_bytes_out / steps,
                              "grads": self.grads_bytes_out / steps, "replicated_ids": self.replicated_bytes_out / steps},
                "replicated_rows": self.replicated_rows / steps,
                "ms": {part: 1000 * s / steps for part, s in self.seconds.items()}}


def layout_on_host(ids: Mapping[str, torch.Tensor], world: int, pin: bool = False,
                   every_sighting: Collection[str] = ()) -> HostPlan:
    """``ShardedCollection.plan``'s layout of ``ids`` (table -> int64 [n] in host memory) over
    ``world`` ranks (embedding/host_layout.py ``lay_out``); ``pin``: the result in page-locked
    memory, for one asynchronous copy to the device."""
    routed: list[torch.Tensor] = []

    def allocate(n: int) -> np.ndarray:
        routed.append(torch.empty(n, dtype=torch.int64, pin_memory=pin))
        return routed[0].numpy()

    laid = lay_out({name: t.reshape(-1).to(torch.int64).numpy() for name, t in ids.items()}, world, every_sighting, allocate)
    return HostPlan(laid.names, laid.sizes, routed[0], laid.send_counts)


def _split_counts(array: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """``array`` cut into consecutive views of ``counts`` elements each."""
    return np.split(array, np.cumsum(counts[:-1]).tolist())


class ShardedCollection:
    """The tables of ``local`` (this rank's shard) as one logical collection over ``group``
    (the default group when None). Every verb is collective: every rank calls it every step."""

    def __init__(self, local: "EmbeddingCollection", group: dist.ProcessGroup | None = None,
                 replicated: Collection[str] = ()) -> None:
        dims = {t.config.dim for t in local.tables.values()}
        if len(dims) != 1:
            raise ValueError(f"sharded tables must share one dim, got {sorted(dims)}")
        unknown = set(replicated) - set(local.tables)
        if unknown or len(set(replicated)) == len(local.tables):
            raise ValueError(f"replicated tables must be tables of the collection, and one at least must stay sharded: "
                             f"{sorted(replicated)} of {list(local.tables)}")
        self.local, self.group = local, group
        self.replicated = [n for n in local.tables if n in set(replicated)]  # in the collection's order
        # tables whose owner must see every id, not each key once: an admission sketch counts sightings
        self.every_sighting = [n for n, t in local.tables.items() if t.sketch is not None]
        self.dim = dims.pop()
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = local.device
        self.stats = ExchangeStats()
        self.sync_timings = False  # wait for the device at each part's end: exact times, slower steps
        self._ahead: Ahead | None = None  # the next step's exchange, begun by prefetch
        self._plan: Plan | None = None  # the next exchange's ids and split sizes, from plan (and agreed)
        self._pending: ShardedRows | None = None  # the rows handed out whose gradients have not come back
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._sent: torch.cuda.Event | None = None  # on CUDA: the last step's rows have gone out
        if self.replicated:
            self._start_replicas_equal()

    def _start_replicas_equal(self) -> None:
        """Every rank's replicated tables start equal (collective, at construction): the
        same rows on every rank (fresh, or from checkpoints of one run; else this refuses),
        and rank 0's random state for new rows, so that the same find_or_inserts create the
        same rows everywhere."""
        rows = torch.tensor([len(self.local[n]) for n in self.replicated], dtype=torch.int64, device=self.device)
        every = [torch.empty_like(rows) for _ in range(self.world)]
        dist.all_gather(every, rows, group=self.group)
        if any(not torch.equal(r, every[0]) for r in every):
            raise RuntimeError(f"the replicated tables {self.replicated} hold different rows on different ranks "
                               f"({[r.tolist() for r in every]}): they were not trained replicated")
        for name in self.replicated:
            generator = self.local[name].generator
            state = generator.get_state().to(self.device)
            dist.broadcast(state, src=0, group=self.group)
            generator.set_state(state.cpu())

    def _lap(self, part: str, since: float) -> float:
        """Add the time since ``since`` to ``part`` (after the device's queue drains, with
        ``sync_timings`` on CUDA); returns now, the next part's start."""
        if self.sync_timings and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.stats.seconds[part] += now - since
        return now

    def find_or_insert(self, ids: Mapping[str, torch.Tensor], now_ms: int) -> ShardedRows:
        """Rows for ``ids`` (table -> int64 [n]) from their owners, created/admitted there;
        one row per input id (float32 [n, dim], on this rank's device). The owner's
        find_or_insert is table-batched where ``EmbeddingCollection.find_or_insert`` would be
        (``grouped.groupable``, decided each step), else table by table; the same host syncs.
        After a ``prefetch``, ``ids`` must be the ids prefetched: their exchange is finished."""
        ahead, self._ahead = self._ahead, None
        t0 = time.perf_counter()
        replicated = None
        if ahead is None:
            plan = self._take_plan(ids)
            route, wanted = self._send_ids(plan)
            union, positions = self._replicated_union(plan.replicated) if plan.replicated is not None else ({}, [])
            t0 = self._lap("ids", t0)
            # one find_or_insert for the sharded tables' received ids and the replicated tables' union
            owned, grouped = self._owner_find_or_insert({**wanted, **union}, now_ms)
            if plan.replicated is not None:
                replicated = self._replicated_rows(plan.replicated, union, positions, owned, grouped, sum(route.table_sizes))
                owned = {n: owned[n] for n in route.names}
        else:
            route, wanted = self._check_ahead(ahead, ids, now_ms), ahead.wanted
            if ahead.owned is None:
                owned, grouped = self._owner_find_or_insert(wanted, now_ms)
            else:
                owned, grouped = ahead.owned, ahead.grouped
                self._read_again(owned, grouped)
        served = None
        if grouped is not None:
            # grouped.inverse follows the ids by table; served follows them as they arrived (rank by
            # rank), so the rows go out and the gradients come back without a regrouping by table
            served = route.to_arrival_order(grouped.inverse[:sum(route.table_sizes)])  # the sharded tables' ids come first
            outgoing = grouped.rows.index_select(0, served)
        else:
            outgoing = route.to_arrival_order(torch.cat([owned[n].embeddings() for n in route.names]))
        t1 = self._lap("owner_find_or_insert", t0)
        leaf = self._send_rows(route, outgoing).requires_grad_(True)
        self._lap("rows", t1)
        if self._side is not None:
            self._sent = torch.cuda.Event()
            self._sent.record(torch.cuda.current_stream(self.device))
        # one row per input id (backward sums the gradients of a key's ids into its row of the leaf)
        embeddings = dict(zip(route.names, leaf.index_select(0, route.inverse).split(route.sizes)))
        if replicated is not None:
            embeddings.update(replicated[0])
            embeddings = {n: embeddings[n] for n in ids}
        self._pending = ShardedRows(embeddings, leaf, route, owned, grouped, served, replicated[1] if replicated else None)
        return self._pending

    @contextlib.contextmanager
    def ahead_stream(self) -> Iterator[None]:
        """Where to run a ``prefetch`` (and the copy of its batch to the device): on CUDA a
        side stream that waits for the last step's rows exchange only, so it overlaps the
        dense work queued since; the device's stream waits for all of it afterwards. On CPU,
        in program order."""
        if self._side is None:
            yield
            return
        if self._sent is not None:
            self._side.wait_event(self._sent)
        with torch.cuda.stream(self._side):
            yield
        torch.cuda.current_stream(self.device).wait_stream(self._side)

    def prefetch(self, ids: Mapping[str, torch.Tensor], now_ms: int) -> None:
        """Begin the next step's ``find_or_insert`` now, between this step's find_or_insert
        and its apply_gradients (collective: every rank calls it at the same point): its ids
        go to their owners, and each owner runs its find_or_insert of them now where no row
        can move by it (``_rows_stay``; else that waits for the next find_or_insert). The
        rows are read again, and sent, by the next find_or_insert, which must be of these
        ``ids`` at this ``now_ms``."""
        if self._ahead is not None:
            raise RuntimeError("a prefetch is pending already: find_or_insert its ids first")
        if self.replicated:
            raise RuntimeError("a prefetch needs every table sharded: replicated tables train in their step's turn")
        t0 = time.perf_counter()
        route, wanted = self._send_ids(self._take_plan(ids))
        t1 = self._lap("ids", t0)
        self.stats.ahead += 1
        self._ahead = Ahead(route, wanted, now_ms)
        if not self._rows_stay(wanted):
            return
        pending = self._pending
        current = {n: self.local[n].current(r) for n, r in pending.owned.items()} if pending is not None else {}
        moves = self._moves()
        self._ahead.owned, self._ahead.grouped = self._owner_find_or_insert(wanted, now_ms)
        self.stats.found_ahead += 1
        if self._moves() != moves:  # _rows_stay promised otherwise: the update goes the tables' own slower way
            log.warning("a find_or_insert run ahead moved rows; the step in flight updates them by key")
        elif pending is not None:
            for name, is_current in current.items():  # its slots still hold its rows: its update needs no lookup
                if is_current:
                    pending.owned[name].generation = self._ahead.owned[name].generation
        self._lap("owner_find_or_insert", t1)

    def _owner_find_or_insert(self, wanted: dict[str, torch.Tensor], now_ms: int) -> tuple[dict[str, BatchRows], GroupedRows | None]:
        """The owner's find_or_insert of what it received: table-batched where it can be (the
        owner's unique counts and created rows: the step's other two host syncs on CUDA)."""
        grouped = find_or_insert_grouped(self.local.tables, wanted, now_ms) if self.local.table_batched else None
        if grouped is not None:
            return grouped.by_table, grouped
        return self.local.find_or_insert_each(wanted, now_ms), None

    def _check_ahead(self, ahead: Ahead, ids: Mapping[str, torch.Tensor], now_ms: int) -> Route:
        """The prefetched exchange's route, once ``ids`` are seen to be those prefetched (by
        their shapes: a check of their values would cost a device sync)."""
        sizes = [ids[n].numel() for n in ahead.route.names] if list(ids) == ahead.route.names else None
        if sizes != ahead.route.sizes or now_ms != ahead.now_ms:
            raise RuntimeError("find_or_insert after a prefetch must be of the prefetched ids, at the prefetched time")
        return ahead.route

    def _rows_stay(self, wanted: Mapping[str, torch.Tensor]) -> bool:
        """Whether a find_or_insert of ``wanted`` leaves every existing row where it is: each
        table either keeps all its rows in one tier without a budget, or creates its new rows
        in free slots of a GPU cache that holds every row (``inserts_on_device``: no eviction)."""
        for name, keys in wanted.items():
            table = self.local[name]
            if not (table.tiers.cache is None and not table.config.dram_rows) and not table.inserts_on_device(len(keys)):
                return False
        return True

    def _moves(self) -> int:
        """Rows moved between tiers so far (evicted from the GPU cache, spilled to SSD), all tables."""
        return sum(t.stats["evicted"] + t.stats["spilled"] for t in self.local.tables.values())

    def _read_again(self, owned: dict[str, BatchRows], grouped: GroupedRows | None) -> None:
        """The rows of a find_or_insert that ran ahead, read again from their slots now that
        the update before them has landed (what it read may predate that update)."""
        if grouped is not None:
            slots = grouped.slots.split(grouped.key_counts)
            grouped.rows.copy_(torch.cat([t.tiers.top.weights.index_select(0, s) for t, s in zip(grouped.tables, slots)]))
            return
        for name, rows in owned.items():
            weights = self.local[name].tiers.top.weights
            if rows.all_admitted:
                rows.rows.copy_(weights.index_select(0, rows.slots))
            elif len(rows.slots):
                rows.rows[rows.admitted] = weights.index_select(0, rows.slots).to(rows.rows.device)

    def can_average(self, dense: torch.Tensor) -> bool:
        """Whether ``apply_gradients`` can average ``dense`` over the ranks in its all_to_all:
        a flat float32 tensor on this rank's device, whose copies to the other ranks come to
        at most ``AVERAGE_MAX_BYTES`` (each rank sends its whole copy to every rank: one
        collective fewer is worth that while it is small; beyond it an all_reduce of its own)."""
        return dense.dim() == 1 and dense.dtype == torch.float32 and dense.device == self.device and \
            (self.world - 1) * dense.numel() * dense.element_size() <= AVERAGE_MAX_BYTES

    def apply_gradients(self, rows: ShardedRows, average: torch.Tensor | None = None) -> None:
        """Send the gradient of each key's row (its ids' gradients, summed by backward; zeros
        where it left none) to the owners, which sum them per key over the ranks, average them
        over ranks and apply the optimizers
        (one launch for all tables where ``find_or_insert`` was table-batched).
        ``average`` (``can_average``; every rank's own, e.g. the dense model's gradients)
        rides in the same all_to_all and becomes the mean over the ranks, in place: one
        collective a step fewer than an all_reduce of its own."""
        t0 = time.perf_counter()
        route, grad = rows.route, rows.leaf.grad
        sent = grad if grad is not None else torch.zeros_like(rows.leaf)  # one gradient per key sent, summed over its ids
        if average is None:
            received = torch.empty(sum(route.recv_splits), self.dim, device=self.device)
            dist.all_to_all_single(received, sent.contiguous(), route.recv_splits, route.send_splits, group=self.group)
        else:
            received = self._send_averaging(sent, route, average)
        self.stats.grads_bytes_out += self._off_rank(route.send_splits) * self.dim * received.element_size()
        replicated = rows.replicated
        if replicated is not None:
            # the union's rows, the same on every rank: their gradients summed over the ranks
            rep_grad = replicated.leaf.grad if replicated.leaf.grad is not None else torch.zeros_like(replicated.leaf)
            if len(rep_grad):  # the same union on every rank: all skip it together
                dist.all_reduce(rep_grad, group=self.group)
        t1 = self._lap("grads", t0)
        if rows.grouped is not None:  # one optimizer launch for every table, sharded and replicated
            # each key's gradients summed over the ranks that sent it, averaged over the ranks
            mean = torch.zeros(len(rows.grouped.rows), self.dim, device=received.device).index_add_(0, rows.served, received,
                                                                                                   alpha=1 / self.world)
            if replicated is not None:
                mean[replicated.first_key:].add_(rep_grad, alpha=1 / self.world)
            apply_gradients_grouped(rows.grouped, mean)
        else:
            for name, grad in zip(route.names, torch.split(route.to_table_order(received), route.table_sizes)):
                owned = rows.owned[name]
                summed = torch.zeros(len(owned.keys), self.dim, device=grad.device).index_add_(0, owned.inverse, grad)
                self.local[name].apply_gradients(owned, summed.div_(self.world))
            if replicated is not None:  # averaged over ranks as the sharded rows' and the dense gradients are
                for (name, owned), g in zip(replicated.owned.items(), rep_grad.div_(self.world).split(replicated.key_counts)):
                    self.local[name].apply_gradients(owned, g)
        self._lap("owner_update", t1)
        if rows is self._pending:
            self._pending = None

    def _send_averaging(self, sent: torch.Tensor, route: Route, average: torch.Tensor) -> torch.Tensor:
        """The gradients' all_to_all with all of ``average`` behind each rank's share: returns
        the gradients received (one row per key, in arrival order); ``average`` becomes the
        mean of every rank's, in place."""
        if not self.can_average(average) or sent.dtype != average.dtype:
            raise ValueError(f"cannot average a {average.dtype} tensor of shape {tuple(average.shape)} on {average.device} "
                             f"over {self.world} ranks in the all_to_all of {sent.dtype} gradients")
        dim, n = self.dim, average.numel()
        out_sizes = [keys * dim + n for keys in route.send_splits]
        in_sizes = [keys * dim + n for keys in route.recv_splits]
        outgoing = torch.cat([piece for share in sent.split(route.send_splits) for piece in (share.reshape(-1), average)])
        arrived = torch.empty(sum(in_sizes), dtype=sent.dtype, device=self.device)
        dist.all_to_all_single(arrived, outgoing, in_sizes, out_sizes, group=self.group)
        chunks = arrived.split([size for keys in route.recv_splits for size in (keys * dim, n)])
        if self.world == 2:  # the mean of two in one operation
            torch.lerp(chunks[1], chunks[3], 0.5, out=average)
        else:
            torch.sum(torch.stack(chunks[1::2]), 0, out=average)
            average.div_(self.world)
        return torch.cat(chunks[0::2]).view(-1, dim)

    def _off_rank(self, splits: list[int]) -> int:
        """The rows of ``splits`` (one count per rank) that go to or come from other ranks."""
        return sum(splits) - splits[self.rank]

    def plan(self, ids: Mapping[str, torch.Tensor] | None, host: HostPlan | None = None) -> list[int]:
        """Lay out a step's ids before the step, and return this rank's counts for the step's
        agreement (int, on the host): its keys per (owner, sharded table), then its unique ids
        per replicated table. Laid out here on the device, the counts cost a host sync;
        ``host`` (``layout_on_host`` of the same ``ids``, made off the training thread) costs
        none, only one copy of its ids to the device. The caller sends the counts in the
        agreement (``trainer.distributed.agree``), then hands every rank's list to ``agreed``:
        the exchange then goes out with known split sizes, with no collective of its own for
        them. Collective only through that agreement; the next find_or_insert or prefetch
        must be of these ``ids``."""
        t0 = time.perf_counter()
        if host is not None:
            routed = host.routed.to(self.device, non_blocking=True)
            n_keys = sum(host.send_counts)
            self._plan = Plan(host.names, host.sizes, routed[:n_keys], routed[n_keys:], host.send_counts, asked=list(host.names),
                              host_keys=host.routed.numpy()[:n_keys])
        else:
            self._plan = self._layout(ids)
            if not sum(self._plan.send_counts):  # nothing to send (an empty batch): nothing to copy back either
                self._plan.host_keys = np.empty(0, np.int64)
        self._lap("ids", t0)
        return self._plan.counts()

    def keys_out(self) -> list[np.ndarray] | None:
        """The planned step's keys for each owner, rank by rank (int64 host arrays, each owner's
        table by table), for the agreement to carry (``agree(to_each=...)``); None where they
        are on the device only (laid out there), so the exchange sends them itself."""
        plan = self._plan
        if plan is None or plan.host_keys is None:
            return None
        t0 = time.perf_counter()
        width = len(plan.names)
        out = _split_counts(plan.host_keys, [sum(plan.send_counts[r * width:(r + 1) * width]) for r in range(self.world)])
        self._lap("ids", t0)
        return out

    def _layout(self, ids: Mapping[str, torch.Tensor]) -> Plan:
        """``layout_on_host`` on the device: the sharded tables' keys in send order (by owner,
        table, key; distinct but for the ``every_sighting`` tables), each input id's place
        among them, and the replicated tables' unique ids; their counts on the host."""
        names, world, device = [n for n in ids if n not in self.replicated], self.world, self.device
        flat = [ids[n].to(device, torch.int64).reshape(-1) for n in names]
        sizes = [len(f) for f in flat]
        every_id = torch.cat(flat)
        tables = torch.cat([torch.full((size,), t, dtype=torch.int64, device=device) for t, size in enumerate(sizes)])
        counted = None  # the ids of the tables whose every id is sent
        if any(n in self.every_sighting for n in names):
            counted = torch.cat([torch.full((size,), n in self.every_sighting, dtype=torch.bool, device=device)
                                 for n, size in zip(names, sizes)])
        # keys in (owner, table, key) order: the code's order; with their counts per code on the host (a host sync)
        keys, inverse, _, send_counts = unique_tagged(every_id, owner_of(every_id, world) * len(names) + tables,
                                                      world * len(names), counted)
        replicated = None
        rep_names = [n for n in ids if n in self.replicated]
        if rep_names:
            rep_flat = [ids[n].to(device, torch.int64).reshape(-1) for n in rep_names]
            if device.type == "cuda":  # one host sync for all of them
                uniques = unique_per_group(rep_flat)
            else:
                uniques = [torch.unique(f, return_inverse=True, return_counts=True) for f in rep_flat]
            unique, rep_inverse, sightings = (list(x) for x in zip(*uniques))
            replicated = ReplicatedPlan(rep_names, unique, rep_inverse, sightings, [len(u) for u in unique])
        return Plan(names, sizes, keys, inverse, send_counts, asked=list(ids), replicated=replicated)

    def agreed(self, counts_by_rank: list[list[int]], keys_from: list[np.ndarray] | None = None) -> None:
        """Every rank's ``plan`` counts, as the agreement brought them (rank by rank): what
        each rank sends this one, per table, fixes the ids all_to_all's receive splits, and
        every rank's unique ids per replicated table the replicated ids' exchange.
        ``keys_from``: every rank's ``keys_out`` for this one, where the agreement carried
        them (on every rank alike): the exchange then sends no ids of its own."""
        t0 = time.perf_counter()
        plan = self._plan
        width = len(plan.names) if plan is not None else 0
        if plan is None or len(counts_by_rank) != self.world or any(len(c) != len(plan.counts()) for c in counts_by_rank):
            raise RuntimeError("agreed needs every rank's plan counts, after this rank's plan")
        lo = self.rank * width
        plan.recv_counts = [n for counts in counts_by_rank for n in counts[lo:lo + width]]
        if plan.replicated is not None:
            plan.replicated.by_rank = [list(counts[self.world * width:]) for counts in counts_by_rank]
        if keys_from is not None:
            plan.received = self._by_table(keys_from, [counts[lo:lo + width] for counts in counts_by_rank])
        self._lap("ids", t0)

    def _by_table(self, keys_from: list[np.ndarray], grid: list[list[int]]) -> torch.Tensor:
        """Every rank's keys for this owner (``grid``: how many of each table each rank sent),
        table by table, each table's rank by rank, as the exchange regroups what arrives: one
        host tensor (page-locked on CUDA, for one asynchronous copy to the device)."""
        if [len(k) for k in keys_from] != [sum(row) for row in grid]:
            raise RuntimeError(f"the agreement brought {[len(k) for k in keys_from]} keys from the ranks, their counts say "
                               f"{[sum(row) for row in grid]}")
        parts = [_split_counts(keys, row) for keys, row in zip(keys_from, grid)]
        received = torch.empty(sum(map(len, keys_from)), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        if len(received):
            np.concatenate([parts[r][t] for t in range(len(grid[0])) for r in range(self.world)], out=received.numpy())
        return received

    def _take_plan(self, ids: Mapping[str, torch.Tensor]) -> Plan:
        """The agreed plan of ``ids`` (checked by their tables and sizes: a check of their
        values would cost a device sync), taken. Without one (a caller that does not agree
        on counts first) the counts go to every rank in an all_gather of their own, then to
        the host."""
        plan, self._plan = self._plan, None
        if plan is None or plan.recv_counts is None:
            plan = self._layout(ids)
            mine = torch.tensor(plan.counts(), dtype=torch.int64, device=self.device)
            every = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(every, mine, group=self.group)
            self._plan = plan
            self.agreed(torch.stack(every).tolist())  # host sync: the split sizes
            self._plan = None
            self.stats.counts_exchanged += 1
            self.stats.ids_bytes_out += (self.world - 1) * len(mine) * mine.element_size()
            return plan
        if list(ids) != plan.asked or [ids[n].numel() for n in plan.names] != plan.sizes or \
                (plan.replicated is not None and [ids[n].numel() for n in plan.replicated.names] != [len(i) for i in plan.replicated.inverse]):
            raise RuntimeError("find_or_insert after an agreed plan must be of the planned ids")
        return plan

    def _send_ids(self, plan: Plan) -> tuple[Route, dict[str, torch.Tensor]]:
        """The sharded tables' keys to their owners, one all_to_all with the agreed split
        sizes, or none where the agreement brought them: (the route, what this rank owns of
        every rank's keys, by table)."""
        world, device = self.world, self.device
        names, n_tables = plan.names, len(plan.names)
        recv_grid = [plan.recv_counts[r * n_tables:(r + 1) * n_tables] for r in range(world)]
        send_splits = [sum(plan.send_counts[r * n_tables:(r + 1) * n_tables]) for r in range(world)]
        recv_splits = [sum(row) for row in recv_grid]
        route = Route(names, plan.sizes, plan.inverse, send_splits, recv_splits, recv_grid,
                      [sum(row[t] for row in recv_grid) for t in range(n_tables)])
        if plan.received is not None:  # the agreement brought them, already by table
            by_table = plan.received.to(device, non_blocking=True)
            self.stats.keys_agreed += 1
        else:
            received = torch.empty(sum(recv_splits), dtype=torch.int64, device=device)
            dist.all_to_all_single(received, plan.keys, recv_splits, send_splits, group=self.group)
            # received: for each source rank, its ids of table 0, then table 1, ...; regroup by table
            by_table = route.to_table_order(received)
        wanted = dict(zip(names, torch.split(by_table, route.table_sizes)))
        stats = self.stats
        stats.steps += 1
        stats.ids_asked += sum(plan.sizes)
        stats.ids_sent += sum(send_splits)
        stats.ids_received += sum(recv_splits)
        stats.ids_bytes_out += self._off_rank(send_splits) * plan.keys.element_size()
        return route, wanted

    def _replicated_union(self, plan: ReplicatedPlan) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """Every rank's unique ids of the replicated tables (and how often each came), on
        every rank (one all_to_all): their union per table, rank by rank, the same on every
        rank, for one find_or_insert that every replica runs alike (so every replica
        creates, admits and moves the same rows); and where this rank's ids are in it."""
        world, device, by_rank = self.world, self.device, plan.by_rank
        totals = [sum(sizes) for sizes in by_rank]  # unique ids of each rank, every table
        received = torch.empty(2 * sum(totals), dtype=torch.int64, device=device)
        if sum(totals):
            mine = torch.cat([*plan.unique, *plan.sightings])  # ids of every table, then their sightings
            dist.all_to_all_single(received, mine.repeat(world), [2 * t for t in totals], [len(mine)] * world, group=self.group)
            self.stats.replicated_bytes_out += (world - 1) * len(mine) * mine.element_size()
        union: dict[str, list[torch.Tensor]] = {n: [] for n in plan.names}
        seen: dict[str, list[torch.Tensor]] = {n: [] for n in plan.names}
        for sizes, chunk in zip(by_rank, received.split([2 * t for t in totals])):
            ids, sightings = chunk.split([sum(sizes)] * 2)
            for name, i, c in zip(plan.names, ids.split(sizes), sightings.split(sizes)):
                union[name].append(i)
                seen[name].append(c)
        wanted, positions = {}, []
        for t, name in enumerate(plan.names):
            keys, counts = torch.cat(union[name]), torch.cat(seen[name])
            at = plan.inverse[t] + sum(by_rank[r][t] for r in range(self.rank))  # after the ids of the ranks before
            if self.local[name].sketch is not None:  # admission counts every sighting, as on one rank
                wanted[name] = torch.repeat_interleave(keys, counts)
                at = (torch.cumsum(counts, 0) - counts)[at]
            else:
                wanted[name] = keys
            positions.append(at)
        return wanted, positions

    def _replicated_rows(self, plan: ReplicatedPlan, union: dict[str, torch.Tensor], positions: list[torch.Tensor],
                         owned: dict[str, BatchRows], grouped: GroupedRows | None, first_id: int) -> tuple[dict[str, torch.Tensor], ReplicatedRows]:
        """This rank's embeddings of the replicated tables (views of one grad-requiring leaf
        of the union's rows), from the step's find_or_insert (``owned``/``grouped``, the
        union's ids after the sharded tables' ``first_id`` received ids)."""
        if grouped is not None:
            first_key = sum(grouped.key_counts[:len(grouped.key_counts) - len(plan.names)])
            key_counts = grouped.key_counts[len(grouped.key_counts) - len(plan.names):]
            rows, start, index = grouped.rows[first_key:], first_id, []
            for name, at in zip(plan.names, positions):
                index.append(grouped.inverse[start + at] - first_key)
                start += len(union[name])
        else:
            first_key, key_counts = 0, [len(owned[n].keys) for n in plan.names]
            rows = torch.cat([owned[n].rows for n in plan.names])
            offsets = [sum(key_counts[:t]) for t in range(len(key_counts))]
            index = [owned[n].inverse[at] + off for n, at, off in zip(plan.names, positions, offsets)]
        leaf = rows.detach().requires_grad_(True)
        self.stats.replicated_rows += len(leaf)
        embeddings = {n: leaf.index_select(0, i) for n, i in zip(plan.names, index)}
        return embeddings, ReplicatedRows(leaf, {n: owned[n] for n in plan.names}, key_counts, first_key)

    def _send_rows(self, route: Route, outgoing: torch.Tensor) -> torch.Tensor:
        """The owner's rows for what it received (``outgoing``: one per id received, in the
        order received) back to the requesters: one row per key sent, in send order."""
        back = torch.empty(sum(route.send_splits), self.dim, device=self.device)
        dist.all_to_all_single(back, outgoing, route.send_splits, route.recv_splits, group=self.group)
        self.stats.rows_bytes_out += self._off_rank(route.recv_splits) * self.dim * outgoing.element_size()
        return back
