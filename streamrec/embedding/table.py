"""One logical embedding table over three tiers: GPU HBM cache > CPU DRAM > SSD (RocksDB).

Training uses it in two steps per batch::

    pulled = table.pull(ids, now_ms)        # unique rows, created/admitted/promoted as needed
    rows = pulled.rows.requires_grad_()
    emb = pulled.embeddings(rows)            # one row per input id

    ... loss.backward() ...
    table.push(pulled, rows.grad)           # fused optimizer over the unique rows

Where rows live:
- the *top tier* (the GPU cache on CUDA, else DRAM) holds every row a batch uses; lookups
  and optimizer updates run there and never leave the device for cache hits;
- on CUDA, misses are fetched from DRAM in one batch, and the least recently seen cache
  rows are written back to DRAM to make room (LRU by the caller's clock); DRAM's arrays are
  mapped for the GPU (ps/host_memory.py), so both are kernels that probe and copy in place;
- when DRAM holds more than ``dram_rows``, its least recently seen rows spill to RocksDB,
  and come back on their next use with weights, optimizer state and clock intact.

Admission (``admit_after`` sightings before a row exists) and expiry (rows unseen for
``ttl_s``) shape what exists; both feed the delta: created/updated keys are "touched",
expired keys are "deleted". The table is single-writer: one pull/push loop at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from streamrec.embedding import host_memory, kernels
from streamrec.embedding.admission import CountMinSketch
from streamrec.embedding.optimizers import make_optimizer
from streamrec.embedding.spill import SpillClock
from streamrec.embedding.ssd import SsdTier
from streamrec.embedding.budget import tier_keys
from streamrec.embedding.tier_rows import RowStorage

log = logging.getLogger(__name__)


def _gather(source: torch.Tensor, slots: torch.Tensor, pin: bool) -> torch.Tensor:
    """``source.index_select(0, slots)`` (a C-level gather), into pinned memory if ``pin``
    (so the copy to the GPU that follows does not block)."""
    if not pin:
        return source.index_select(0, slots)
    out = torch.empty((len(slots), *source.shape[1:]), dtype=source.dtype, pin_memory=True)
    return torch.index_select(source, 0, slots, out=out)


def _sync(device: torch.device) -> None:
    """Wait for the device's current stream: kernels that read or write the mapped DRAM tier
    are done before the host reads or changes it."""
    torch.cuda.current_stream(device).synchronize()


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device tensors to pinned host memory with one synchronisation for all."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu() for t in tensors]
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for o, t in zip(out, tensors):
        o.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return out


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
    gpu_cache_rows: int = 1_000_000  # HBM cache capacity in rows; used only on CUDA (0 = no cache)

    def validate(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"invalid table name {self.name!r}")
        if self.dim < 1 or self.admit_after < 1 or self.ttl_s < 0 or self.dram_rows < 0 or self.gpu_cache_rows < 0:
            raise ValueError(f"invalid table config {self}")


@dataclass
class PendingPull:
    """A device find-or-insert in flight: ``counters`` (rows created, keys undecided)
    are still on the GPU; ``EmbeddingTable.pull_finish`` completes it."""

    keys: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor
    counters: torch.Tensor
    now_ms: int


@dataclass
class Pulled:
    """The unique rows of one batch, as handed to the model and back to ``push``."""

    keys: torch.Tensor  # unique keys
    inverse: torch.Tensor  # position of each input id in ``keys``
    rows: torch.Tensor  # [unique, dim] values (zeros where not admitted)
    admitted: torch.Tensor  # bool per unique key: has a row
    slots: torch.Tensor  # top-tier slot per admitted key
    generation: int
    all_admitted: bool = False  # every key has a row (lets push skip a boolean gather)

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
        # a DRAM budget is reserved up front (on CPU address space only: RowStorage writes pages
        # as rows arrive), with room for one batch's rows above it before the spill
        use_cache = self.device.type == "cuda" and config.gpu_cache_rows > 0
        dram_slots = tier_keys(config.dram_rows) if config.dram_rows else 1024
        # under a GPU cache, DRAM is mapped for the GPU (a miss is a kernel, not a host round
        # trip); a mapped tier's arrays are locked in RAM when allocated, its budget at once
        self.dram = RowStorage(config.dim, self.state_dim, "cpu", capacity=dram_slots, growable=True,
                               index_keys=dram_slots if config.dram_rows else None,
                               mapped=use_cache and kernels.available(self.device) and host_memory.mappable())
        self.spill_clock = SpillClock()  # picks the DRAM rows that spill to SSD
        if self.device.type == "cuda" and not use_cache:
            raise ValueError(f"table {config.name}: on CUDA set gpu_cache_rows > 0 ([ps] hbm_bytes: the GPU cache is the top tier)")
        if use_cache and config.dram_rows and config.gpu_cache_rows >= config.dram_rows:
            # a row brought up from DRAM keeps its DRAM slot while cached, and cached rows never spill
            log.warning("table %s: the DRAM budget (%d rows, [ps] dram_bytes) is not above the GPU cache (%d rows, [ps] hbm_bytes): "
                        "DRAM may hold more rows than its budget while the cache holds them", config.name, config.dram_rows,
                        config.gpu_cache_rows)
        self.cache = RowStorage(config.dim, self.state_dim, self.device, config.gpu_cache_rows, growable=False,
                                index_keys=tier_keys(config.gpu_cache_rows)) if use_cache else None
        self.ssd: SsdTier | None = None
        if config.dram_rows:
            if ssd_dir is None:
                raise ValueError(f"table {config.name}: dram_rows is set, so an ssd_dir is needed for spilled rows")
            self.ssd = SsdTier(Path(ssd_dir) / config.name, config.dim, self.state_dim, by_time=config.ttl_s > 0)
        self.sketch = CountMinSketch(device=self.device) if config.admit_after > 1 else None
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._touched: list[torch.Tensor] = []
        self._deleted: list[torch.Tensor] = []
        self._generation = 0
        # every row of the table is in the GPU cache: a cache miss is a new key (kept by
        # the code that moves rows below the cache; see refresh_cache_complete)
        self.cache_complete = self.cache is not None
        self._pulls_since_refresh = 0
        fill = self.optimizer.init_state(1, config.dim, torch.device("cpu"))
        self._state_fill = float(fill[0, 0]) if bool((fill == fill[0, 0]).all()) else None
        self.stats = {"lookups": 0, "cache_hits": 0, "fused_hits": 0, "created": 0, "not_admitted": 0, "ssd_reads": 0, "spilled": 0, "expired": 0}

    @property
    def top(self) -> RowStorage:
        return self.cache if self.cache is not None else self.dram

    def __len__(self) -> int:
        """Rows that exist in any tier, each counted once (a cached row may also have a DRAM copy)."""
        return len(self.dram) + (self.ssd.count if self.ssd else 0) + self._cache_only()

    def _cache_only(self) -> int:
        if self.cache is None or len(self.cache) == 0:
            return 0
        keys = self.cache.keys[self.cache.live_slots()]
        return int((self.dram.slots_of(keys) < 0).sum())

    # ------------------------------------------------------------------ pull / push
    def pull(self, ids: torch.Tensor, now_ms: int, train: bool = True) -> Pulled:
        ids = ids.to(self.top.device, torch.int64).flatten()
        keys, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        started = self.pull_start(keys, inverse, counts, now_ms, train)
        return started if isinstance(started, Pulled) else self.pull_finish(started, started.counters.tolist())

    def pull_start(self, keys: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor, now_ms: int,
                   train: bool = True) -> "Pulled | PendingPull":
        """``pull`` of batch-unique ``keys``. On CUDA, while every row of the table is in the
        GPU cache, this launches one find-or-insert kernel and returns a PendingPull whose
        ``counters`` the caller reads (one host sync for many tables) and hands to
        ``pull_finish``; otherwise it returns the finished Pulled."""
        top = self.top
        self._maybe_refresh_cache_complete()
        if self._can_create_on_device(len(keys), train):
            counters = torch.zeros(2, dtype=torch.int32, device=keys.device)
            fresh, seed = self.prepare_create(len(keys))
            rows, slots = kernels.find_or_insert(keys, self.cache, fresh, counters, now_ms, seed, self.config.init_std,
                                                 self._state_fill)
            return PendingPull(keys, inverse, counts, rows, slots, counters, now_ms)
        self.stats["lookups"] += len(keys)
        if self.cache is not None and kernels.available(self.device):
            # Steady state on CUDA: every key is cached. One fused probe+gather launch and
            # one host sync (the miss count) instead of probe rounds and boolean indexing.
            rows, slots, misses = kernels.probe_gather(keys, self.cache.index, self.cache.weights, self.cache.last_seen, now_ms)
            n_missing = int(misses.item())
            self.stats["cache_hits"] += len(keys) - n_missing
            if n_missing == 0:
                if self.sketch is not None and train:
                    self.sketch.add(keys, counts)
                self._generation += 1
                admitted = torch.ones(len(keys), dtype=torch.bool, device=keys.device)
                return Pulled(keys, inverse, rows, admitted, slots, self._generation, all_admitted=True)
            undecided = slots == -2
            slots[undecided] = top.slots_of(keys[undecided])
        else:
            slots = top.slots_of(keys)
            self.stats["cache_hits"] += int((slots >= 0).sum())
        missing = slots < 0
        if bool(missing.any()):
            slots[missing] = self._bring_up(keys[missing], counts[missing] if self.sketch else None, now_ms, train, protect=slots[~missing])
        admitted = slots >= 0
        if self.sketch is not None and train:
            self.sketch.add(keys[~missing], counts[~missing])  # keep counting present keys too
        # index_select, not weights[slots]: advanced indexing takes a 2-4x slower path on CPU.
        rows = top.weights.index_select(0, torch.where(admitted, slots, 0))
        all_admitted = bool(admitted.all())
        if not all_admitted:
            rows.masked_fill_(~admitted.unsqueeze(1), 0.0)
        top.last_seen.index_fill_(0, slots if all_admitted else slots[admitted], now_ms)
        self.stats["not_admitted"] += int((~admitted).sum())
        self._generation += 1
        return Pulled(keys, inverse.to(rows.device), rows, admitted, slots if all_admitted else slots[admitted],
                      self._generation, all_admitted)

    def creates_on_device(self, n: int) -> bool:
        """Whether a training pull of up to ``n`` keys is one find-or-insert on the device
        (``prepare_create``, then ``pull_finish``); a grouped pull asks every table. (While it
        says no for want of a complete cache, ``pull_start`` refreshes that flag.)"""
        return self._can_create_on_device(n, True)

    def prepare_create(self, n: int) -> tuple[torch.Tensor, int]:
        """Before a find-or-insert of ``n`` batch-unique keys: room in the cache index, and
        (the row slots it may take, the seed of the new rows' weights)."""
        self.stats["lookups"] += n
        self.cache.index.reserve(n)
        return self.cache.free_slots(n), int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))

    def creation_settings(self) -> tuple:
        """What rows created on the device depend on besides their keys: tables that agree on
        it can share one find-or-insert and one optimizer launch."""
        return (self.config.dim, self.state_dim, self.optimizer, self.config.init_std, self._state_fill)

    def _maybe_refresh_cache_complete(self, every: int = 100) -> None:
        """Every ``every`` pulls while the cache is not known whole (after a restore or an
        eviction), check whether it has become whole, when its row count allows it."""
        if self.cache is None or self.cache_complete:
            return
        self._pulls_since_refresh += 1
        if self._pulls_since_refresh >= every and (self.ssd is None or self.ssd.count == 0) and len(self.cache) >= len(self.dram):
            self._pulls_since_refresh = 0
            self.refresh_cache_complete()

    def _can_create_on_device(self, n: int, train: bool) -> bool:
        """Misses can be created by the find-or-insert kernel: nothing lives below the cache
        (a miss is a new key), no admission sketch to consult, the state has one fill
        value, and the batch fits the cache without evicting."""
        cache = self.cache
        return (train and cache is not None and kernels.available(self.device) and self.cache_complete
                and self.sketch is None and self._state_fill is not None and len(cache) + n <= cache.capacity)

    def pull_finish(self, pending: "PendingPull", counters: list[int]) -> Pulled:
        """Finish a ``pull_start`` of the device path, given its ``counters`` on the host."""
        created, undecided = counters
        cache = self.cache
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
                found[absent] = self._bring_up(pending.keys[lost][absent], None, pending.now_ms, True, protect=slots[slots >= 0])
            slots[lost] = found
            rows[lost] = cache.weights.index_select(0, found)
            cache.last_seen.index_fill_(0, found, pending.now_ms)
        if created:
            self._track(pending.keys)  # new rows reach the next delta even if never pushed
        self._generation += 1
        admitted = torch.ones(len(pending.keys), dtype=torch.bool, device=slots.device)
        return Pulled(pending.keys, pending.inverse, rows, admitted, slots, self._generation, all_admitted=True)

    def lookup(self, ids: torch.Tensor, now_ms: int) -> torch.Tensor:
        """Serving-style read: one embedding per id, zeros for ids without a row; never
        creates rows. On CUDA, when every id hits the GPU cache, this is one fused
        probe+gather kernel (ps/kernels.py); otherwise the general path brings rows up."""
        started = self.lookup_start(ids, now_ms)
        if started is not None and int(started[1].item()) == 0:  # the one host sync of the hit path
            return self.lookup_hit(started[0])
        return self.lookup_slow(ids, now_ms)

    def refresh_cache_complete(self) -> bool:
        """Recompute ``cache_complete`` exactly (every DRAM row also cached, nothing on SSD):
        one probe of the DRAM keys in the cache index. Called after changes that may have
        made the cache whole again (warming, expiry)."""
        if self.cache is None:
            self.cache_complete = False
        elif self.ssd is not None and self.ssd.count:
            self.cache_complete = False
        else:
            keys = self.dram.keys[self.dram.live_slots()].to(self.device)
            self.cache_complete = bool((self.cache.slots_of(keys) >= 0).all()) if len(keys) else True
        return self.cache_complete

    def lookup_start(self, ids: torch.Tensor, now_ms: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused hit path without its host sync: (rows, pending [1]) where ``pending``
        counts the ids that need ``lookup_slow`` (cache misses; only undecided probes when the
        table is resident, since a miss then means "no row": zeros, already in ``rows``).
        None where there is no fused path (CPU). Lets a caller sync once for many tables."""
        if self.cache is None or not kernels.available(self.device):
            return None
        ids = ids.to(self.top.device, torch.int64).flatten()
        resident = self.cache_complete
        rows, slots, misses = kernels.probe_gather(ids, self.cache.index, self.cache.weights, self.cache.last_seen, now_ms,
                                                   count_misses=not resident)
        if resident:
            misses = (slots == -2).sum().view(1).to(torch.int32)
        return rows, misses

    def lookup_hit(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` of a fused lookup that needed no slow path (counted as fused hits)."""
        self.stats["fused_hits"] += len(rows)
        return rows

    def lookup_slow(self, ids: torch.Tensor, now_ms: int) -> torch.Tensor:
        """The general path: rows below the cache are brought up (the cache changes)."""
        return self.pull(ids.to(self.top.device, torch.int64).flatten(), now_ms, train=False).embeddings()

    def warm(self, keys: torch.Tensor, now_ms: int = 0, complete_before: bool = False) -> int:
        """Bring existing rows of ``keys`` into the GPU cache while it has room (serving
        does this at load and after each delta, so lookups take the fused path), keeping
        their clocks; returns how many keys were considered. ``complete_before``: the cache
        held every row before ``keys`` were (re)loaded, so once all of them are cached it
        is complete again, with no scan of every row (a delta's apply stays short)."""
        if self.cache is None or len(keys) == 0:
            return 0
        room = self.cache.capacity - len(self.cache)
        wanted = len(keys)
        keys = keys.to(torch.int64).cpu()[:max(room, 0)]
        if len(keys):
            slots = self.cache.slots_of(keys.to(self.device))
            absent = slots < 0
            if bool(absent.any()):
                self._bring_up(keys[absent.cpu()].to(self.device), None, now_ms, False, protect=slots[~absent])
        if complete_before and len(keys) == wanted and (self.ssd is None or not self.ssd.count) \
                and bool((self.cache.slots_of(keys.to(self.device)) >= 0).all()):
            self.cache_complete = True
        else:
            self.refresh_cache_complete()
        return len(keys)

    def push(self, pulled: Pulled, grad: torch.Tensor) -> None:
        """Apply the optimizer to the admitted rows of ``pulled`` (grad: [unique, dim])."""
        grad = grad.to(self.top.device)
        if pulled.generation != self._generation:
            # another pull may have evicted or moved rows since: find them again
            slots = self.top.slots_of(pulled.keys[pulled.admitted])
            keep = slots >= 0
            slots, grad_rows = slots[keep], grad[pulled.admitted][keep]
            keys = pulled.keys[pulled.admitted][keep]
        elif pulled.all_admitted:
            slots, grad_rows, keys = pulled.slots, grad, pulled.keys
        else:
            slots, grad_rows, keys = pulled.slots, grad[pulled.admitted], pulled.keys[pulled.admitted]
        if len(slots) == 0:
            return
        top = self.top
        self.optimizer.update_(top.weights, top.state, top.dirty, slots, grad_rows.to(top.device))
        self._track(keys)

    def current(self, pulled: Pulled) -> bool:
        """No pull since ``pulled`` has moved rows: its slots still hold its keys."""
        return pulled.generation == self._generation

    def pushed(self, pulled: Pulled) -> None:
        """A grouped push updated ``pulled``'s rows in place: they reach the next delta."""
        self._track(pulled.keys)

    def _track(self, keys: torch.Tensor) -> None:
        """Remember updated/created keys for the next delta, on the top tier's device (no
        host sync per step); compacted now and then so memory follows distinct keys."""
        self._touched.append(keys.to(self.top.device))
        if len(self._touched) >= 64:
            self._touched = [torch.unique(torch.cat(self._touched))]

    def tracked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(touched, deleted) keys pending for the next delta, on CPU (for checkpoints)."""
        touched = torch.unique(torch.cat(self._touched)).cpu() if self._touched else torch.empty(0, dtype=torch.int64)
        deleted = torch.cat(self._deleted) if self._deleted else torch.empty(0, dtype=torch.int64)
        return touched, deleted

    def set_tracked(self, touched: torch.Tensor, deleted: torch.Tensor) -> None:
        self._touched = [touched.to(self.top.device)] if len(touched) else []
        self._deleted = [deleted.cpu()] if len(deleted) else []

    def _bring_up(self, keys: torch.Tensor, counts: torch.Tensor | None, now_ms: int, train: bool, protect: torch.Tensor) -> torch.Tensor:
        """Make ``keys`` resident in the top tier where they exist (or are admitted now);
        returns their top-tier slots, -1 for keys without a row."""
        if not self.dram.mapped:
            return self._bring_up_by_host(keys, counts, now_ms, train, protect)
        # keys DRAM holds come up by two kernels on the mapped DRAM tier: a probe of its
        # index, a copy of the rows into the cache; the rest (on SSD, or new) by the host
        dram_slots = kernels.probe(keys, self.dram.index)
        in_dram = dram_slots >= 0  # -2 (undecided probe) goes the host way
        up, rest = torch.nonzero(in_dram).squeeze(1), torch.nonzero(~in_dram).squeeze(1)
        slots = torch.full_like(keys, -1)
        if len(up):
            self._make_room(len(up), protect)
            placed = self.cache.add_from(keys[up], self.dram, dram_slots[up])
            slots[up] = placed
            protect = torch.cat([protect, placed])
        _sync(self.device)  # the host touches DRAM's arrays only once no kernel does
        if len(rest):  # (its spill covers rows the evictions above added to DRAM)
            slots[rest] = self._bring_up_by_host(keys[rest], counts[rest] if counts is not None else None, now_ms, train,
                                                 protect)
        else:  # evicting rows created in the cache gave them DRAM homes: keep DRAM within its budget
            self._spill_dram(protect=torch.empty(0, dtype=torch.int64))
        return slots

    def _bring_up_by_host(self, keys: torch.Tensor, counts: torch.Tensor | None, now_ms: int, train: bool,
                          protect: torch.Tensor) -> torch.Tensor:
        """``_bring_up`` through the host: rows gathered from DRAM or read from SSD, new rows
        admitted and created, then copied up as one batch."""
        cpu_keys = keys.cpu()
        have, found_w, found_s, found_t, below = self._take_from_lower(cpu_keys)
        found_k = cpu_keys[have]
        new_keys = cpu_keys[~have]
        from_below = len(found_k)
        if train and len(new_keys):
            if self.sketch is not None:
                new_counts = counts.cpu()[~have] if counts is not None else torch.ones(len(new_keys), dtype=torch.int32)
                estimate = self.sketch.add(new_keys, new_counts).cpu()
                new_keys = new_keys[estimate >= self.config.admit_after]
            n = len(new_keys)
            if n:
                init = torch.randn(n, self.config.dim, generator=self.generator) * self.config.init_std
                found_k = torch.cat([found_k, new_keys])
                found_w = torch.cat([found_w, init])
                found_s = torch.cat([found_s, self.optimizer.init_state(n, self.config.dim, torch.device("cpu"))])
                found_t = torch.cat([found_t, torch.full((n,), now_ms, dtype=torch.int64)])
                below = torch.cat([below, torch.full((n,), -1, dtype=torch.int64)])
                self._track(new_keys)
                self.stats["created"] += n
        if len(found_k):
            self._make_room(len(found_k), protect)
            created = torch.arange(len(found_k)) >= from_below  # new rows have no copy below: dirty
            self.top.add(found_k, found_w, found_s, found_t, dirty=created, below=below if self.cache is not None else None)
        # Spill only now, once every row of this batch is in the top tier: a spill earlier
        # could send a row to SSD that is about to be cached, leaving two copies.
        batch = torch.empty(0, dtype=torch.int64) if self.cache is not None else torch.cat([protect.cpu(), self.dram.slots_of(found_k)])
        self._spill_dram(protect=batch)
        return self.top.slots_of(keys)

    def _take_from_lower(self, keys: torch.Tensor):
        """Rows for CPU ``keys`` from the tiers below the top (SSD rows move up to DRAM when
        there is a cache, else they leave SSD for the top tier). Returns (found mask over
        ``keys``, then for the found keys in order: weights, state, last_seen, DRAM slot),
        gathered into pinned memory when a GPU cache will receive them."""
        n = len(keys)
        pin = self.cache is not None and torch.cuda.is_available()
        have = torch.zeros(n, dtype=torch.bool)
        dram_slots = torch.full((n,), -1, dtype=torch.int64)
        if self.cache is not None:
            dram_slots = self.dram.slots_of(keys)
            have = dram_slots >= 0
        if self.ssd is not None and not bool(have.all()):
            rest = torch.nonzero(~have).squeeze(1)
            got_k, got_w, got_s, got_t = self.ssd.take(keys[rest])
            self.stats["ssd_reads"] += len(got_k)
            if len(got_k):
                hit = rest[torch.isin(keys[rest], got_k)]  # ssd.take answers in request order
                if self.cache is not None:  # DRAM stays the home of every row it brings up
                    dram_slots[hit] = self.dram.add(got_k, got_w, got_s, got_t)
                    have[hit] = True
                else:
                    return self._ssd_rows(n, hit, got_w, got_s, got_t)
        if self.cache is None:
            return self._ssd_rows(n, torch.empty(0, dtype=torch.int64), None, None, None)
        src = dram_slots[have]
        return (have, _gather(self.dram.weights, src, pin), _gather(self.dram.state, src, pin),
                _gather(self.dram.last_seen, src, pin), src)

    def _ssd_rows(self, n: int, hit: torch.Tensor, w, s, t):
        """``_take_from_lower``'s answer on a table without a cache (rows only from SSD)."""
        have = torch.zeros(n, dtype=torch.bool)
        have[hit] = True
        if w is None:
            w, s, t = torch.empty(0, self.config.dim), torch.empty(0, self.state_dim), torch.empty(0, dtype=torch.int64)
        return have, w, s, t, torch.full((len(hit),), -1, dtype=torch.int64)

    def _make_room(self, n: int, protect: torch.Tensor) -> None:
        """On CUDA: evict the least recently seen cache rows to fit ``n`` more."""
        cache = self.cache
        if cache is None:
            return
        overflow = len(cache) + n - cache.capacity
        if overflow > 0:
            if n + len(protect) > cache.capacity:  # the batch's own rows cannot be evicted
                raise RuntimeError(
                    f"table {self.config.name}: one batch needs {len(protect) + n} rows but the GPU cache holds "
                    f"{cache.capacity}; raise [ps] hbm_bytes"
                )
            self._evict(cache.coldest_slots(overflow, protect))

    def _write_back(self, keys: torch.Tensor) -> None:
        """Evict ``keys`` (those present) from the GPU cache."""
        slots = self.cache.slots_of(keys.to(self.cache.device))
        self._evict(slots[slots >= 0])

    def _evict(self, slots: torch.Tensor) -> None:
        """Drop cache ``slots``. Dirty rows go down whole, by their DRAM slot (rows created
        in the cache get one now); clean rows (their DRAM copy is current) send only their
        clock, so expiry and LRU stay exact. Rows with a DRAM copy go down by one kernel into
        the mapped DRAM tier; the others by one device-to-host transfer, into pinned memory."""
        if len(slots) == 0:
            return
        cache, dram = self.cache, self.dram
        self.cache_complete = False
        if dram.mapped:  # rows with a DRAM copy go down by one kernel (clock always, values if dirty)
            below = cache.below.index_select(0, slots)
            kernels.copy_rows(cache, slots, dram, below, values_where=cache.dirty.index_select(0, slots))
            homed = below >= 0
            cache.discard(cache.keys.index_select(0, slots[homed]))
            slots = slots[~homed]  # rows created in the cache: DRAM gets them through the host below
            _sync(self.device)
            if len(slots) == 0:
                return
        dirty = cache.dirty.index_select(0, slots).bool()
        d = slots[dirty]
        parts = [cache.keys.index_select(0, slots), cache.below.index_select(0, slots), cache.last_seen.index_select(0, slots),
                 dirty, cache.weights.index_select(0, d), cache.state.index_select(0, d)]
        keys, below, seen, dirty, w, s = _to_host(parts)
        cache.discard(cache.keys.index_select(0, slots))
        home = below >= 0
        dram.last_seen.index_copy_(0, below[home], seen[home])
        below_d, keys_d, seen_d = below[dirty], keys[dirty], seen[dirty]
        homed = below_d >= 0
        if bool(homed.any()):
            dram.weights.index_copy_(0, below_d[homed], w[homed])
            dram.state.index_copy_(0, below_d[homed], s[homed])
        if not bool(homed.all()):
            dram.add(keys_d[~homed], w[~homed], s[~homed], seen_d[~homed])

    def _spill_dram(self, protect: torch.Tensor) -> None:
        """Move DRAM rows over the budget to SSD: approximately the least recently seen
        (``SpillClock``: the cost follows the rows spilled, not the size of DRAM), never
        those in ``protect`` (DRAM slots of the current batch) nor rows in the GPU cache."""
        budget = self.config.dram_rows
        if not budget or len(self.dram) <= budget:
            return
        protect = torch.unique(protect.cpu())  # sorted once: each window of the hand then binary-searches it
        victims = self.spill_clock.victims(self.dram, len(self.dram) - budget, lambda slots: self._pinned(slots, protect))
        self.ssd.put(*self.dram.pop(self.dram.keys.index_select(0, victims)), absent=True)  # a row lives in one tier
        self.stats["spilled"] += len(victims)

    def _pinned(self, slots: torch.Tensor, protect: torch.Tensor) -> torch.Tensor:
        """Which DRAM ``slots`` must not spill: those in ``protect`` (sorted), and rows the
        GPU cache holds (DRAM stays their home). Probes only the given slots' keys in the cache."""
        if len(protect):
            keep = protect[torch.searchsorted(protect, slots).clamp_(max=len(protect) - 1)] == slots
        else:
            keep = torch.zeros(len(slots), dtype=torch.bool)
        if self.cache is not None and len(self.cache):
            keys = self.dram.keys.index_select(0, slots).to(self.cache.device)
            keep |= (self.cache.slots_of(keys) >= 0).cpu()
        return keep

    # ------------------------------------------------------------------ reading, expiry
    def read_cached(self, keys: torch.Tensor) -> torch.Tensor | None:
        """Current values of ``keys`` (on the cache's device) when the GPU cache holds every
        one, else None: one fused probe + gather launch and one host sync, the common case
        of a publish's snapshot (the rows a delta touched were just trained in the cache)."""
        if self.cache is None or not kernels.available(self.device):
            return None
        rows, _, misses = kernels.probe_gather(keys.to(self.device, torch.int64), self.cache.index, self.cache.weights,
                                               self.cache.last_seen, 0, update_clock=False)
        return rows if int(misses.item()) == 0 else None

    def read(self, keys: torch.Tensor, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Current values of ``keys`` from whichever tier holds them, without moving rows.
        Returns (found mask, values[found]), both on ``device`` (snapshots read into the GPU
        so the training thread pays a device-to-device copy, not a host transfer). Each tier
        is asked only for the keys the tiers above it lack: a snapshot of cached rows never
        probes the DRAM index on the host."""
        device = torch.device(device)
        keys = keys.to(torch.int64)
        values = torch.zeros(len(keys), self.config.dim, device=device)
        found = torch.zeros(len(keys), dtype=torch.bool, device=device)
        rest = torch.arange(len(keys), device=keys.device)  # positions no tier above has answered
        for tier in (self.cache, self.dram):
            if tier is None or len(rest) == 0:
                continue
            slots = tier.slots_of(keys.index_select(0, rest).to(tier.device))
            hit = slots >= 0
            where = rest.to(tier.device)[hit].to(device)
            values.index_copy_(0, where, tier.weights.index_select(0, slots[hit]).to(device))
            found[where] = True
            rest = rest[(~hit).to(rest.device)]
        if self.ssd is not None and len(rest):
            rest = rest.cpu()
            asked = keys.cpu().index_select(0, rest)
            k, w, _, _ = self.ssd.get(asked)  # the present keys, in request order
            if len(k):
                where = rest[torch.isin(asked, k)].to(device)
                values.index_copy_(0, where, w.to(device))
                found[where] = True
        return found, values[found]

    def expire(self, now_ms: int) -> int:
        """Delete rows unseen for ``ttl_s``; their keys go to the next delta as deletions."""
        if not self.config.ttl_s:
            return 0
        cutoff = now_ms - int(self.config.ttl_s * 1000)
        expired = []
        if self.cache is not None:
            live = self.cache.live_slots()
            stale = self.cache.keys[live[self.cache.last_seen[live] < cutoff]]
            if len(stale):
                self._write_back(stale)  # the DRAM copy is then expired below
        top = self.dram.high_water
        stale = torch.nonzero(self.dram.live[:top] & (self.dram.last_seen[:top] < cutoff)).squeeze(1)
        if len(stale):  # a row still cached was seen since (its DRAM clock lags): it stays
            stale = stale[~self._pinned(stale, torch.empty(0, dtype=torch.int64))]
            expired.append(self.dram.pop(self.dram.keys.index_select(0, stale))[0])
        if self.ssd is not None:
            expired.append(self.ssd.expire(cutoff))  # reads only the expiring rows (by clock)
        keys = torch.cat(expired) if expired else torch.empty(0, dtype=torch.int64)
        if len(keys):
            self._deleted.append(keys.cpu())
        if self.cache is not None and not self.cache_complete:
            self.refresh_cache_complete()  # expired cache rows were evicted first: the cache may be whole again
        self.stats["expired"] += len(keys)
        return len(keys)

    # ------------------------------------------------------------------ deltas and snapshots
    def begin_delta(self) -> torch.Tensor:
        """Keys changed (updated, created or deleted) since the last call, on the top tier's
        device; resets the tracking. Read their values with :meth:`read` (in chunks, if the
        caller wants to bound the pause): a key missing by then is a deletion."""
        device = self.top.device
        touched = torch.unique(torch.cat(self._touched)) if self._touched else torch.empty(0, dtype=torch.int64, device=device)
        deleted = torch.cat(self._deleted).to(device) if self._deleted else None
        self._touched, self._deleted = [], []
        return touched if deleted is None else torch.unique(torch.cat([touched, deleted]))

    def all_keys(self) -> torch.Tensor:
        """Every key with a row, in any tier (for full versions), on the top tier's device."""
        device = self.top.device
        parts = [self.dram.keys[self.dram.live_slots()].to(device)]
        if self.cache is not None and len(self.cache):
            parts.append(self.cache.keys[self.cache.live_slots()])
        if self.ssd is not None:
            parts += [k.to(device) for k, _, _, _ in self.ssd.items()]
        return torch.unique(torch.cat(parts))

    def iter_rows(self, with_state: bool = False, chunk: int = 65536):
        """Every row in every tier (each key once), tier by tier in chunks of at most
        ``chunk`` slots or rows, on CPU: (keys, weights[, state, last_seen]). A caller that
        writes each chunk out holds one chunk at a time, never a copy of the table."""
        cache = self.cache
        for tier in (cache, self.dram):
            if tier is None:
                continue
            for lo in range(0, tier.high_water, chunk):
                s = lo + torch.nonzero(tier.live[lo : lo + chunk]).squeeze(1)
                if tier is self.dram and cache is not None and len(cache):  # the cache holds the current value
                    s = s[(cache.slots_of(tier.keys.index_select(0, s).to(cache.device)) < 0).cpu()]
                if len(s):
                    yield self._pack(*(x.index_select(0, s).cpu() for x in (tier.keys, tier.weights, tier.state, tier.last_seen)),
                                     with_state)
        if self.ssd is not None:
            for k, w, st, t in self.ssd.items(chunk):
                yield self._pack(k, w, st, t, with_state)

    @staticmethod
    def _pack(k, w, s, t, with_state):
        return (k, w, s, t) if with_state else (k, w)

    def load_rows(self, keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor | None = None, last_seen: torch.Tensor | None = None,
                  new: bool = False) -> None:
        """Insert or overwrite rows (restore, or applying a delta at serving). ``new``: no
        key has a row yet (a restore into a fresh table), so none is looked for in the
        tiers first (on SSD that read is most of the cost of a load)."""
        keys = keys.to(torch.int64).cpu()
        n = len(keys)
        if state is None:
            state = self.optimizer.init_state(n, self.config.dim, torch.device("cpu"))
        if last_seen is None:
            last_seen = torch.zeros(n, dtype=torch.int64)
        if not new:
            self.remove(keys)
        self.dram.add(keys, weights.cpu().float(), state.cpu(), last_seen.cpu())
        if n and self.cache is not None:
            self.cache_complete = False  # rows now live below the cache only (warm() brings them up)
        self._spill_dram(protect=torch.empty(0, dtype=torch.int64))

    def overwrite(self, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """New weights for the rows of ``keys`` that live in DRAM, written where they are (the
        DRAM slot, and the GPU cache slot when cached: a clean cached row evicted later still
        finds its DRAM copy current); slots, clocks and optimizer state stay. Two index
        writes per tier instead of a remove, an insert and a bring-up: serving applies a
        delta's updated rows this way. Returns the mask of keys written; the others (new
        rows, rows on SSD) need :meth:`load_rows`."""
        keys = keys.to(torch.int64).cpu()
        dslots = self.dram.slots_of(keys)
        done = dslots >= 0
        if not bool(done.any()):
            return done
        idx = torch.nonzero(done).squeeze(1)
        values = weights.index_select(0, idx).float()
        self.dram.weights.index_copy_(0, dslots[idx], values.to(self.dram.weights.device))
        if self.cache is not None:
            cslots = self.cache.slots_of(keys[idx].to(self.cache.device))
            cached = torch.nonzero(cslots >= 0).squeeze(1)
            self.cache.weights.index_copy_(0, cslots[cached], values.to(self.cache.device, non_blocking=True)[cached])
        return done

    def remove(self, keys: torch.Tensor) -> None:
        keys = keys.to(torch.int64).cpu()
        if self.cache is not None:
            self.cache.discard(keys.to(self.cache.device))
        self.dram.discard(keys)
        if self.ssd is not None:
            self.ssd.delete(keys)

    def close(self) -> None:
        if self.ssd is not None:
            self.ssd.close()
