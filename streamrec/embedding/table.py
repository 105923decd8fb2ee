"""One logical embedding table over three tiers (GPU HBM cache > CPU DRAM > SSD), speaking
a few verbs, as NVIDIA HierarchicalKV's hash table does.

Training, per batch::

    rows = table.find_or_insert(ids, now_ms)   # unique rows, created/admitted/brought up as needed
    leaf = rows.rows.requires_grad_()
    emb = rows.embeddings(leaf)                 # one row per input id
    ... loss.backward() ...
    table.apply_gradients(rows, leaf.grad)      # fused optimizer over the unique rows

Serving reads with ``find`` (never creates rows: unknown ids read as zeros) and applies a
delta with ``upsert`` and ``erase``; snapshots and checkpoints read with ``export`` and
``export_all``, and restore with ``load_rows``.

Where memory lives: ``top`` is the GPU cache (HBM) on CUDA (or a cache in host memory on
CPU with ``cpu_cache``), else DRAM (pageable host memory; mapped and page-locked for the GPU
under a GPU cache). Rows a batch uses are in the top tier; lookups and optimizer updates run
there (tiers.py, placement.py). Admission (``admit_after`` sightings before a row exists)
and expiry (rows unseen for ``ttl_s``) shape what exists; both feed the delta (tracking.py).
The table is single-writer: one find_or_insert/apply_gradients loop at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from streamrec.embedding import kernels
from streamrec.embedding.admission import CountMinSketch
from streamrec.embedding.optimizers import make_optimizer
from streamrec.embedding.placement import Placement
from streamrec.embedding.tiers import Tiers
from streamrec.embedding.tracking import DeltaTracker, expire_rows


@dataclass(frozen=True)
class TableConfig:
    name: str
    dim: int
    optimizer: str = "adagrad"
    lr: float = 0.05
    init_std: float = 0.01
    admit_after: int = 1  # sightings before a row is created; 1 = at first sight
    ttl_s: float = 0.0  # expire rows unseen this long (caller's clock); 0 = never
    dram_rows: int = 0  # DRAM budget in rows; 0 = unlimited (no SSD tier)
    gpu_cache_rows: int = 1_000_000  # HBM cache capacity in rows; used on CUDA, or on CPU with cpu_cache (0 = no cache)
    # a cache tier over DRAM on a CPU device too: its policy (bring-up, LRU eviction, warming)
    # then runs, and is tested, without a GPU; off, a CPU table's top tier is DRAM
    cpu_cache: bool = False

    def validate(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"invalid table name {self.name!r}")
        if self.dim < 1 or self.admit_after < 1 or self.ttl_s < 0 or self.dram_rows < 0 or self.gpu_cache_rows < 0:
            raise ValueError(f"invalid table config {self}")
        if self.cpu_cache and not self.gpu_cache_rows:
            raise ValueError(f"table {self.name}: cpu_cache needs gpu_cache_rows > 0 (the cache's capacity)")


@dataclass
class PendingInsert:
    """A device find-or-insert in flight (``find_or_insert_start``): ``counters`` (int32 [2]:
    rows created, keys undecided) are still in HBM; ``find_or_insert_finish`` completes it."""

    keys: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor
    counters: torch.Tensor
    now_ms: int


@dataclass
class BatchRows:
    """The unique rows of one batch, as ``find_or_insert`` hands them to the model and the
    model hands them back to ``apply_gradients``. Every tensor is on the top tier's device."""

    keys: torch.Tensor  # int64 [unique]
    inverse: torch.Tensor  # int64 [ids]: position of each input id in ``keys``
    rows: torch.Tensor  # float32 [unique, dim] values (zeros where not admitted)
    admitted: torch.Tensor  # bool [unique]: has a row
    slots: torch.Tensor  # int64: top-tier slot per admitted key
    generation: int
    all_admitted: bool = False  # every key has a row (lets apply_gradients skip a boolean gather)

    def embeddings(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """One embedding per input id (``rows`` may be a grad-requiring copy of ``self.rows``)."""
        return (self.rows if rows is None else rows).index_select(0, self.inverse)


class EmbeddingTable:
    def __init__(self, config: TableConfig, device: torch.device | str = "cpu", ssd_dir: Path | None = None, seed: int = 0) -> None:
        config.validate()
        self.config = config
        self.device = torch.device(device)
        self.optimizer = make_optimizer(config.optimizer, lr=config.lr)
        self.state_dim = self.optimizer.state_dim(config.dim)
        self.tiers = Tiers(config, self.state_dim, self.device, ssd_dir)
        self.tracking = DeltaTracker(self.tiers.top.device)
        self.sketch = CountMinSketch(device=self.device) if config.admit_after > 1 else None
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.stats = {"lookups": 0, "cache_hits": 0, "fused_hits": 0, "created": 0, "not_admitted": 0, "ssd_reads": 0, "spilled": 0, "expired": 0, "evicted": 0}
        self.placement = Placement(self.tiers, config, self.optimizer, self.sketch, self.generator, self.tracking, self.stats)
        self._generation = 0
        fill = self.optimizer.init_state(1, config.dim, torch.device("cpu"))
        self._state_fill = float(fill[0, 0]) if bool((fill == fill[0, 0]).all()) else None
        # what rows created on the device depend on besides their keys: tables that agree on
        # it can share one find-or-insert and one optimizer launch (grouped.py)
        self.creation_settings = (config.dim, self.state_dim, self.optimizer, config.init_std, self._state_fill)

    def __len__(self) -> int:
        """Rows that exist in any tier, each counted once."""
        return len(self.tiers)

    # ------------------------------------------------------------------ find_or_insert (training)
    def find_or_insert(self, ids: torch.Tensor, now_ms: int) -> BatchRows:
        """The training pull. ``ids``: int64 [n], any device, repeats allowed. Rows are
        created (admitted) for new keys and brought into the top tier; returns the batch's
        unique rows (float32 [unique, dim]) and where each id's row is, on the top tier's
        device (HBM on CUDA)."""
        return self._pull(ids, now_ms, train=True)

    def _pull(self, ids: torch.Tensor, now_ms: int, train: bool) -> BatchRows:
        ids = ids.to(self.tiers.top.device, torch.int64).flatten()
        keys, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        started = self.find_or_insert_start(keys, inverse, counts, now_ms, train)
        return self.find_or_insert_finish(started, started.counters.tolist()) if isinstance(started, PendingInsert) else started

    def find_or_insert_start(self, keys: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor, now_ms: int,
                             train: bool = True) -> BatchRows | PendingInsert:
        """``find_or_insert`` of batch-unique ``keys`` (with ``torch.unique``'s inverse and
        counts, on the top tier's device). On CUDA, while every row of the table is in the GPU
        cache, this launches one find-or-insert kernel and returns a PendingInsert whose
        ``counters`` the caller reads (one host sync for many tables) and hands to
        ``find_or_insert_finish``; otherwise it returns the finished BatchRows. ``train=False``
        (serving's general path): no row is created or admitted, nothing is counted."""
        tiers = self.tiers
        top, cache = tiers.top, tiers.cache
        tiers.maybe_refresh_cache_complete()
        if self.inserts_on_device(len(keys), train):
            counters = torch.zeros(2, dtype=torch.int32, device=keys.device)
            fresh, seed = self.find_or_insert_prepare(len(keys))
            rows, slots = kernels.find_or_insert(keys, cache, fresh, counters, now_ms, seed, self.config.init_std,
                                                 self._state_fill)
            return PendingInsert(keys, inverse, counts, rows, slots, counters, now_ms)
        self.stats["lookups"] += len(keys)
        if cache is not None and kernels.available(self.device):
            # Steady state on CUDA: every key is cached. One fused probe+gather launch and
            # one host sync (the miss count) instead of probe rounds and boolean indexing.
            rows, slots, misses = kernels.probe_gather(keys, cache.index, cache.weights, cache.last_seen, now_ms)
            n_missing = int(misses.item())
            self.stats["cache_hits"] += len(keys) - n_missing
            if n_missing == 0:
                if self.sketch is not None and train:
                    self.sketch.add(keys, counts)
                self._generation += 1
                admitted = torch.ones(len(keys), dtype=torch.bool, device=keys.device)
                return BatchRows(keys, inverse, rows, admitted, slots, self._generation, all_admitted=True)
            undecided = slots == -2
            slots[undecided] = top.slots_of(keys[undecided])
        else:
            slots = top.slots_of(keys)
            self.stats["cache_hits"] += int((slots >= 0).sum())
        missing = slots < 0
        if bool(missing.any()):
            slots[missing] = self.placement.bring_up(keys[missing], counts[missing] if self.sketch else None, now_ms, train,
                                                     protect=slots[~missing])
        admitted = slots >= 0
        if self.sketch is not None and train:
            self.sketch.add(keys[~missing], counts[~missing])  # keep counting present keys too
        # index_select, not weights[slots]: advanced indexing takes a slower path on CPU.
        rows = top.weights.index_select(0, torch.where(admitted, slots, 0))
        all_admitted = bool(admitted.all())
        if not all_admitted:
            rows.masked_fill_(~admitted.unsqueeze(1), 0.0)
        top.last_seen.index_fill_(0, slots if all_admitted else slots[admitted], now_ms)
        self.stats["not_admitted"] += int((~admitted).sum())
        self._generation += 1
        return BatchRows(keys, inverse.to(rows.device), rows, admitted, slots if all_admitted else slots[admitted],
                         self._generation, all_admitted)

    def inserts_on_device(self, n: int, train: bool = True) -> bool:
        """Whether a training find_or_insert of up to ``n`` keys is one find-or-insert kernel
        (``find_or_insert_prepare``, the launch, then ``find_or_insert_finish``): nothing lives
        below the cache (a miss is a new key), no admission sketch to consult, the state has
        one fill value, and the batch fits the cache without evicting. (While it says no for
        want of a complete cache, ``find_or_insert_start`` refreshes that knowledge.)"""
        cache = self.tiers.cache
        return (train and cache is not None and kernels.available(self.device) and self.tiers.cache_complete
                and self.sketch is None and self._state_fill is not None and len(cache) + n <= cache.capacity)

    def find_or_insert_prepare(self, n: int) -> tuple[torch.Tensor, int]:
        """Before a find-or-insert launch of ``n`` batch-unique keys: room in the cache index,
        and (the cache slots it may take, int64 in HBM; the seed of the new rows' weights)."""
        self.stats["lookups"] += n
        self.tiers.cache.index.reserve(n)
        return self.tiers.cache.free_slots(n), int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))

    def find_or_insert_finish(self, pending: PendingInsert, counters: list[int]) -> BatchRows:
        """Finish a launched find-or-insert, given its ``counters`` on the host."""
        created, undecided = counters
        cache = self.tiers.cache
        cache.claim(created)
        cache.index.note_inserted(created)
        self.stats["created"] += created
        self.stats["cache_hits"] += len(pending.keys) - created - undecided
        slots, rows = pending.slots, pending.rows
        if undecided:  # probe chains longer than the kernel's limit, or reserved keys: the torch path decides
            lost = torch.nonzero(slots == -2).squeeze(1)
            found = cache.slots_of(pending.keys[lost])
            absent = found < 0
            if bool(absent.any()):
                found[absent] = self.placement.bring_up(pending.keys[lost][absent], None, pending.now_ms, True,
                                                        protect=slots[slots >= 0])
            slots[lost] = found
            rows[lost] = cache.weights.index_select(0, found)
            cache.last_seen.index_fill_(0, found, pending.now_ms)
        if created:
            self.tracking.track(pending.keys)  # new rows reach the next delta even if never updated
        self._generation += 1
        admitted = torch.ones(len(pending.keys), dtype=torch.bool, device=slots.device)
        return BatchRows(pending.keys, pending.inverse, rows, admitted, slots, self._generation, all_admitted=True)

    # ------------------------------------------------------------------ apply_gradients (training)
    def apply_gradients(self, rows: BatchRows, grad: torch.Tensor) -> None:
        """The fused optimizer over the admitted rows of ``rows``, in place in the top tier.
        ``grad``: float32 [unique, dim], one gradient per row of ``rows.rows``."""
        grad = grad.to(self.tiers.top.device)
        if rows.generation != self._generation:
            # another find_or_insert may have evicted or moved rows since: find them again
            slots = self.tiers.top.slots_of(rows.keys[rows.admitted])
            keep = slots >= 0
            slots, grad_rows = slots[keep], grad[rows.admitted][keep]
            keys = rows.keys[rows.admitted][keep]
        elif rows.all_admitted:
            slots, grad_rows, keys = rows.slots, grad, rows.keys
        else:
            slots, grad_rows, keys = rows.slots, grad[rows.admitted], rows.keys[rows.admitted]
        if len(slots) == 0:
            return
        top = self.tiers.top
        self.optimizer.update_(top.weights, top.state, top.dirty, slots, grad_rows.to(top.device))
        self.tracking.track(keys)

    def current(self, rows: BatchRows) -> bool:
        """No find_or_insert since ``rows`` has moved rows: its slots still hold its keys."""
        return rows.generation == self._generation

    def gradients_applied(self, rows: BatchRows) -> None:
        """A table-batched optimizer launch updated ``rows`` in place: they reach the next delta."""
        self.tracking.track(rows.keys)

    # ------------------------------------------------------------------ find (serving reads)
    def find(self, ids: torch.Tensor, now_ms: int) -> torch.Tensor:
        """Serving read: float32 [n, dim], one embedding per id of ``ids`` (int64 [n], any
        device), on the top tier's device; zeros for ids without a row; never creates rows.
        On CUDA, when every id hits the GPU cache, one fused probe+gather kernel
        (``find_start`` + ``find_hit``); otherwise ``find_slow`` brings rows up."""
        started = self.find_start(ids, now_ms)
        if started is not None and int(started[1].item()) == 0:  # the one host sync of the hit path
            return self.find_hit(started[0])
        return self.find_slow(ids, now_ms)

    def find_start(self, ids: torch.Tensor, now_ms: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused hit path without its host sync: (rows [n, dim], pending int32 [1]) in HBM,
        where ``pending`` counts the ids that need ``find_slow`` (cache misses; only undecided
        probes when the cache holds every row, since a miss then means "no row": zeros,
        already in ``rows``). None where there is no fused path (CPU). Lets a caller sync
        once for many tables. Reads the cache only (safe beside other ``find_start``s)."""
        tiers = self.tiers
        if tiers.cache is None or not kernels.available(self.device):
            return None
        ids = ids.to(tiers.top.device, torch.int64).flatten()
        resident = tiers.cache_complete
        rows, slots, misses = kernels.probe_gather(ids, tiers.cache.index, tiers.cache.weights, tiers.cache.last_seen, now_ms,
                                                   count_misses=not resident)
        if resident:
            misses = (slots == -2).sum().view(1).to(torch.int32)
        return rows, misses

    def find_hit(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` of a ``find_start`` that needed no slow path (counted as fused hits)."""
        self.stats["fused_hits"] += len(rows)
        return rows

    def find_slow(self, ids: torch.Tensor, now_ms: int) -> torch.Tensor:
        """The general path of ``find``: rows below the cache are brought up (the tiers change)."""
        return self._pull(ids.to(self.tiers.top.device, torch.int64).flatten(), now_ms, train=False).embeddings()

    # ------------------------------------------------------------------ upsert / erase (deltas)
    def upsert(self, keys: torch.Tensor, weights: torch.Tensor, fresh: bool = False) -> None:
        """A delta's rows onto a serving copy. ``keys``: int64 [n], ``weights``: float32
        [n, dim], both in host memory. Rows that exist in DRAM are written where they are
        (and in the GPU cache when cached); new rows go into DRAM and up into the GPU cache
        while it has room, so lookups keep the fused path. ``fresh``: the table has no rows
        yet (a version loaded into a new table)."""
        if len(keys) == 0:
            return
        if fresh:
            self.load_rows(keys, weights)
            self.placement.warm(keys)
            return
        complete = self.tiers.cache_complete
        new = ~self.tiers.overwrite(keys.to(torch.int64).cpu(), weights)
        if bool(new.any()):
            new_keys = keys[new]
            self.load_rows(new_keys, weights[new])
            self.placement.warm(new_keys, complete_before=complete)

    def erase(self, keys: torch.Tensor) -> None:
        """Remove the rows of ``keys`` (int64 [n], any device; absent keys are ignored) from every tier."""
        self.tiers.remove(keys.to(torch.int64).cpu())

    def load_rows(self, keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor | None = None,
                  last_seen: torch.Tensor | None = None, new: bool = False) -> None:
        """Insert or overwrite whole rows into DRAM, under the GPU cache (a restore).
        ``keys`` int64 [n], ``weights`` float32 [n, dim], ``state`` float32 [n, state_dim]
        (default: the optimizer's initial state), ``last_seen`` int64 [n] (default 0), any
        device. ``new``: no key has a row yet (a restore into a fresh table), so none is
        looked for in the tiers first (on SSD that read is most of the cost of a load)."""
        keys = keys.to(torch.int64).cpu()
        n = len(keys)
        if state is None:
            state = self.optimizer.init_state(n, self.config.dim, torch.device("cpu"))
        if last_seen is None:
            last_seen = torch.zeros(n, dtype=torch.int64)
        if not new:
            self.erase(keys)
        self.placement.add_below(keys, weights.cpu().float(), state.cpu(), last_seen.cpu())

    # ------------------------------------------------------------------ export (snapshots, checkpoints)
    def export(self, keys: torch.Tensor, device: torch.device | str = "cpu",
               try_cache: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Current weights of ``keys`` (int64 [n]) from whichever tier holds them, moving no
        rows: (keys with a row [k], their weights float32 [k, dim] on ``device``, keys without
        a row). ``try_cache``: first one fused probe+gather over the GPU cache, which answers
        alone when it holds every key (a publish's common case: the values stay in HBM)."""
        if try_cache:
            values = self.tiers.read_cached(keys)
            if values is not None:
                return keys, values, keys[:0]
        found, values = self.tiers.read(keys, device)
        found = found.to(keys.device)  # (a no-op where ``device`` is the keys')
        return keys[found], values, keys[~found]

    def export_all(self, with_state: bool = False, chunk: int = 65536) -> Iterator[tuple[torch.Tensor, ...]]:
        """Every row in every tier (each key once), tier by tier in chunks of at most ``chunk``
        slots or rows, in host memory: (keys int64 [k], weights float32 [k, dim][, state
        float32 [k, state_dim], last_seen int64 [k]]). A caller that writes each chunk out
        holds one chunk at a time, never a copy of the table."""
        for k, w, s, t in self.tiers.iter_rows(chunk):
            yield (k, w, s, t) if with_state else (k, w)

    # ------------------------------------------------------------------ expiry, lifetime
    def expire(self, now_ms: int) -> int:
        """Delete rows unseen for ``ttl_s``; their keys go to the next delta as deletions."""
        if not self.config.ttl_s:
            return 0
        n = len(expire_rows(self.placement, self.config.ttl_s, now_ms))
        self.stats["expired"] += n
        return n

    def close(self) -> None:
        self.tiers.close()


def finish_inserts(tables: list[EmbeddingTable], pending: list[PendingInsert], counters: torch.Tensor) -> list[BatchRows]:
    """Finish launched find-or-inserts of several tables with one host sync: ``counters`` is
    int32 [len(tables), 2] in HBM (each pending's counters, stacked or shared)."""
    done = counters.tolist()  # the one host sync for every table's creations
    return [table.find_or_insert_finish(p, c) for table, p, c in zip(tables, pending, done)]
