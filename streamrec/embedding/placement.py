"""Which tier each row lives in: bring-up, eviction and spill (the policy over tiers.py).

- a batch's rows are brought up into the top tier (the GPU cache on CUDA, else DRAM) from
  DRAM or SSD, and new keys are admitted and created there (``bring_up``);
- under a cache the least recently seen cache rows are written back to DRAM to make room
  (LRU by the caller's clock: ``make_room``, ``evict``); on CUDA DRAM's arrays are mapped for
  the GPU, so both directions are kernels that probe and copy in place;
- when DRAM holds more than ``dram_rows``, its least recently seen rows spill to SSD
  (``SpillClock``), never rows the current batch or the GPU cache holds (``held``), and come
  back on their next use with weights, optimizer state and clock intact.
"""

from __future__ import annotations

import torch

from streamrec.embedding import kernels
from streamrec.embedding.admission import CountMinSketch
from streamrec.embedding.spill import SpillClock
from streamrec.embedding.tiers import Tiers
from streamrec.embedding.tracking import DeltaTracker


def _gather(source: torch.Tensor, slots: torch.Tensor, pin: bool) -> torch.Tensor:
    """``source.index_select(0, slots)`` (a C-level gather), into pinned host memory if
    ``pin`` (so the copy to the GPU that follows does not block)."""
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


class Placement:
    """Moves the rows of one table's ``tiers``; creates admitted new rows on bring-up (their
    weights from ``generator``, their state from ``optimizer``) and reports them to ``tracker``."""

    def __init__(self, tiers: Tiers, config, optimizer, sketch: CountMinSketch | None, generator: torch.Generator,
                 tracker: DeltaTracker, stats: dict[str, int]) -> None:
        self.tiers, self.config, self.optimizer = tiers, config, optimizer
        self.sketch, self.generator, self.tracker, self.stats = sketch, generator, tracker, stats
        self.spill_clock = SpillClock()  # picks the DRAM rows that spill to SSD

    # ------------------------------------------------------------------ up
    def bring_up(self, keys: torch.Tensor, counts: torch.Tensor | None, now_ms: int, train: bool, protect: torch.Tensor) -> torch.Tensor:
        """Make ``keys`` resident in the top tier where they exist (or are admitted now, when
        ``train``); returns their top-tier slots, -1 for keys without a row. ``protect``: top
        slots of the batch's other rows (never evicted to make room)."""
        tiers = self.tiers
        if not tiers.dram.mapped:
            return self._bring_up_by_host(keys, counts, now_ms, train, protect)
        # keys DRAM holds come up by two kernels on the mapped DRAM tier: a probe of its
        # index, a copy of the rows into the cache; the rest (on SSD, or new) by the host
        dram_slots = kernels.probe(keys, tiers.dram.index)
        in_dram = dram_slots >= 0  # -2 (undecided probe) goes the host way
        up, rest = torch.nonzero(in_dram).squeeze(1), torch.nonzero(~in_dram).squeeze(1)
        slots = torch.full_like(keys, -1)
        if len(up):
            self.make_room(len(up), protect)
            placed = tiers.cache.add_from(keys[up], tiers.dram, dram_slots[up])
            slots[up] = placed
            protect = torch.cat([protect, placed])
        _sync(tiers.device)  # the host touches DRAM's arrays only once no kernel does
        if len(rest):  # (its spill covers rows the evictions above added to DRAM)
            slots[rest] = self._bring_up_by_host(keys[rest], counts[rest] if counts is not None else None, now_ms, train,
                                                 protect)
        else:  # evicting rows created in the cache gave them DRAM homes: keep DRAM within its budget
            self.spill_dram(protect=torch.empty(0, dtype=torch.int64))
        return slots

    def _bring_up_by_host(self, keys: torch.Tensor, counts: torch.Tensor | None, now_ms: int, train: bool,
                          protect: torch.Tensor) -> torch.Tensor:
        """``bring_up`` through the host: rows gathered from DRAM or read from SSD, new rows
        admitted and created, then copied up as one batch."""
        tiers, config = self.tiers, self.config
        cpu_keys = keys.cpu()
        have, found_w, found_s, found_t, below = self._take_from_lower(cpu_keys)
        found_k = cpu_keys[have]
        new_keys = cpu_keys[~have]
        from_below = len(found_k)
        if train and len(new_keys):
            if self.sketch is not None:
                new_counts = counts.cpu()[~have] if counts is not None else torch.ones(len(new_keys), dtype=torch.int32)
                estimate = self.sketch.add(new_keys, new_counts).cpu()
                new_keys = new_keys[estimate >= config.admit_after]
            n = len(new_keys)
            if n:
                init = torch.randn(n, config.dim, generator=self.generator) * config.init_std
                found_k = torch.cat([found_k, new_keys])
                found_w = torch.cat([found_w, init])
                found_s = torch.cat([found_s, self.optimizer.init_state(n, config.dim, torch.device("cpu"))])
                found_t = torch.cat([found_t, torch.full((n,), now_ms, dtype=torch.int64)])
                below = torch.cat([below, torch.full((n,), -1, dtype=torch.int64)])
                self.tracker.track(new_keys)
                self.stats["created"] += n
        if len(found_k):
            self.make_room(len(found_k), protect)
            created = torch.arange(len(found_k)) >= from_below  # new rows have no copy below: dirty
            tiers.top.add(found_k, found_w, found_s, found_t, dirty=created, below=below if tiers.cache is not None else None)
        # Spill only now, once every row of this batch is in the top tier: a spill earlier
        # could send a row to SSD that is about to be cached, leaving two copies.
        batch = torch.empty(0, dtype=torch.int64) if tiers.cache is not None else torch.cat([protect.cpu(), tiers.dram.slots_of(found_k)])
        self.spill_dram(protect=batch)
        return tiers.top.slots_of(keys)

    def _take_from_lower(self, keys: torch.Tensor):
        """Rows for CPU ``keys`` from the tiers below the top (SSD rows move up to DRAM when
        there is a cache, else they leave SSD for the top tier). Returns (found mask over
        ``keys``, then for the found keys in order: weights, state, last_seen, DRAM slot),
        gathered into pinned host memory when a GPU cache will receive them."""
        tiers = self.tiers
        n = len(keys)
        pin = tiers.cache is not None and tiers.cache.device.type == "cuda"
        have = torch.zeros(n, dtype=torch.bool)
        dram_slots = torch.full((n,), -1, dtype=torch.int64)
        if tiers.cache is not None:
            dram_slots = tiers.dram.slots_of(keys)
            have = dram_slots >= 0
        if tiers.ssd is not None and not bool(have.all()):
            rest = torch.nonzero(~have).squeeze(1)
            got_k, got_w, got_s, got_t = tiers.ssd.take(keys[rest])
            self.stats["ssd_reads"] += len(got_k)
            if len(got_k):
                hit = rest[torch.isin(keys[rest], got_k)]  # ssd.take answers in request order
                if tiers.cache is not None:  # DRAM stays the home of every row it brings up
                    dram_slots[hit] = tiers.dram.add(got_k, got_w, got_s, got_t)
                    have[hit] = True
                else:
                    return self._ssd_rows(n, hit, got_w, got_s, got_t)
        if tiers.cache is None:
            return self._ssd_rows(n, torch.empty(0, dtype=torch.int64), None, None, None)
        src = dram_slots[have]
        return (have, _gather(tiers.dram.weights, src, pin), _gather(tiers.dram.state, src, pin),
                _gather(tiers.dram.last_seen, src, pin), src)

    def _ssd_rows(self, n: int, hit: torch.Tensor, w, s, t):
        """``_take_from_lower``'s answer on a table without a cache (rows only from SSD)."""
        have = torch.zeros(n, dtype=torch.bool)
        have[hit] = True
        if w is None:
            w, s, t = torch.empty(0, self.config.dim), torch.empty(0, self.tiers.state_dim), torch.empty(0, dtype=torch.int64)
        return have, w, s, t, torch.full((len(hit),), -1, dtype=torch.int64)

    def warm(self, keys: torch.Tensor, now_ms: int = 0, complete_before: bool = False) -> int:
        """Bring existing rows of ``keys`` into the GPU cache while it has room, keeping their
        clocks; returns how many keys were considered. ``complete_before``: the cache held
        every row before ``keys`` were (re)loaded, so once all of them are cached it is
        complete again, with no scan of every row."""
        tiers = self.tiers
        cache = tiers.cache
        if cache is None or len(keys) == 0:
            return 0
        room = cache.capacity - len(cache)
        wanted = len(keys)
        keys = keys.to(torch.int64).cpu()[:max(room, 0)]
        if len(keys):
            slots = cache.slots_of(keys.to(tiers.device))
            absent = slots < 0
            if bool(absent.any()):
                self.bring_up(keys[absent.cpu()].to(tiers.device), None, now_ms, False, protect=slots[~absent])
        if complete_before and len(keys) == wanted and (tiers.ssd is None or not tiers.ssd.count) \
                and bool((cache.slots_of(keys.to(tiers.device)) >= 0).all()):
            tiers.cache_complete = True
        else:
            tiers.refresh_cache_complete()
        return len(keys)

    # ------------------------------------------------------------------ down
    def make_room(self, n: int, protect: torch.Tensor) -> None:
        """Under a cache: evict the least recently seen cache rows to fit ``n`` more."""
        cache = self.tiers.cache
        if cache is None:
            return
        overflow = len(cache) + n - cache.capacity
        if overflow > 0:
            if n + len(protect) > cache.capacity:  # the batch's own rows cannot be evicted
                raise RuntimeError(
                    f"table {self.config.name}: one batch needs {len(protect) + n} rows but the GPU cache holds "
                    f"{cache.capacity}; raise [ps] hbm_bytes"
                )
            self.evict(cache.coldest_slots(overflow, protect))

    def write_back(self, keys: torch.Tensor) -> None:
        """Evict ``keys`` (those present) from the GPU cache."""
        cache = self.tiers.cache
        slots = cache.slots_of(keys.to(cache.device))
        self.evict(slots[slots >= 0])

    def evict(self, slots: torch.Tensor) -> None:
        """Drop cache ``slots``. Dirty rows go down whole, by their DRAM slot (rows created
        in the cache get one now); clean rows (their DRAM copy is current) send only their
        clock, so expiry and LRU stay exact. Rows with a DRAM copy go down by one kernel into
        the mapped DRAM tier; the others by one device-to-host transfer, into pinned memory."""
        if len(slots) == 0:
            return
        self.stats["evicted"] += len(slots)
        tiers = self.tiers
        cache, dram = tiers.cache, tiers.dram
        tiers.cache_complete = False
        if dram.mapped:  # rows with a DRAM copy go down by one kernel (clock always, values if dirty)
            below = cache.below.index_select(0, slots)
            kernels.copy_rows(cache, slots, dram, below, values_where=cache.dirty.index_select(0, slots))
            homed = below >= 0
            cache.discard(cache.keys.index_select(0, slots[homed]))
            slots = slots[~homed]  # rows created in the cache: DRAM gets them through the host below
            _sync(tiers.device)
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

    def spill_dram(self, protect: torch.Tensor) -> None:
        """Move DRAM rows over the budget to SSD: approximately the least recently seen
        (``SpillClock``: the cost follows the rows spilled, not the size of DRAM), never
        those in ``protect`` (DRAM slots of the current batch) nor rows in the GPU cache."""
        budget, dram = self.config.dram_rows, self.tiers.dram
        if not budget or len(dram) <= budget:
            return
        protect = torch.unique(protect.cpu())  # sorted once: each window of the hand then binary-searches it
        victims = self.spill_clock.victims(dram, len(dram) - budget, lambda slots: self.held(slots, protect))
        self.tiers.ssd.put(*dram.pop(dram.keys.index_select(0, victims)), absent=True)  # a row lives in one tier
        self.stats["spilled"] += len(victims)

    def held(self, slots: torch.Tensor, protect: torch.Tensor) -> torch.Tensor:
        """Which DRAM ``slots`` must stay in DRAM (not spill, not expire): those in ``protect``
        (sorted), and rows the GPU cache holds (DRAM stays their home). Probes only the given
        slots' keys in the cache."""
        cache = self.tiers.cache
        if len(protect):
            keep = protect[torch.searchsorted(protect, slots).clamp_(max=len(protect) - 1)] == slots
        else:
            keep = torch.zeros(len(slots), dtype=torch.bool)
        if cache is not None and len(cache):
            keys = self.tiers.dram.keys.index_select(0, slots).to(cache.device)
            keep |= (cache.slots_of(keys) >= 0).cpu()
        return keep

    def add_below(self, keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, last_seen: torch.Tensor) -> None:
        """Rows (CPU tensors; keys without a row in any tier) into DRAM, under the cache, then
        DRAM back within its budget."""
        tiers = self.tiers
        tiers.dram.add(keys, weights, state, last_seen)
        if len(keys) and tiers.cache is not None:
            tiers.cache_complete = False  # rows now live below the cache only (warm() brings them up)
        self.spill_dram(protect=torch.empty(0, dtype=torch.int64))
