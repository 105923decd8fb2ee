"""The three tiers of one table, and reading across them without moving rows.

- the GPU cache (HBM, a ``RowStorage`` on the device; on CUDA, or in host memory on CPU
  when the table sets ``cpu_cache``, so that its policy runs without a GPU): the top tier
  there, holding every row a batch uses;
- DRAM (a ``RowStorage`` in host memory, mapped for the GPU under a cache so a miss is a
  kernel, not a host round trip: host_memory.py): the home of every row not on SSD, and the
  top tier without a cache;
- SSD (RocksDB, ssd.py): the rows DRAM's budget (``dram_rows``) has no room for.

Which rows move between them, and when, is placement.py's business. ``cache_complete``
(every row of the table is in the GPU cache, so a cache miss is a new key) lets the
device take its fast paths; only this package changes it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import torch

from streamrec.embedding import host_memory, kernels
from streamrec.embedding.budget import tier_keys
from streamrec.embedding.ssd import SsdTier
from streamrec.embedding.tier_rows import RowStorage

log = logging.getLogger(__name__)


class Tiers:
    def __init__(self, config, state_dim: int, device: torch.device, ssd_dir: Path | None) -> None:
        """``config``: the table's ``TableConfig`` (its budgets and name)."""
        self.name, self.dim, self.state_dim, self.device = config.name, config.dim, state_dim, device
        # a DRAM budget is reserved up front (on CPU address space only: RowStorage writes pages
        # as rows arrive), with room for one batch's rows above it before the spill
        use_cache = config.gpu_cache_rows > 0 and (device.type == "cuda" or config.cpu_cache)
        dram_slots = tier_keys(config.dram_rows) if config.dram_rows else 1024
        # under a GPU cache, DRAM is mapped for the GPU (a miss is a kernel, not a host round
        # trip); a mapped tier's arrays are locked in RAM when allocated, its budget at once
        self.dram = RowStorage(config.dim, state_dim, "cpu", capacity=dram_slots, growable=True,
                               index_keys=dram_slots if config.dram_rows else None,
                               mapped=use_cache and kernels.available(device) and host_memory.mappable())
        if device.type == "cuda" and not use_cache:
            raise ValueError(f"table {config.name}: on CUDA set gpu_cache_rows > 0 ([ps] hbm_bytes: the GPU cache is the top tier)")
        if use_cache and config.dram_rows and config.gpu_cache_rows >= config.dram_rows:
            # a row brought up from DRAM keeps its DRAM slot while cached, and cached rows never spill
            log.warning("table %s: the DRAM budget (%d rows, [ps] dram_bytes) is not above the GPU cache (%d rows, [ps] hbm_bytes): "
                        "DRAM may hold more rows than its budget while the cache holds them", config.name, config.dram_rows,
                        config.gpu_cache_rows)
        self.cache = RowStorage(config.dim, state_dim, device, config.gpu_cache_rows, growable=False,
                                index_keys=tier_keys(config.gpu_cache_rows)) if use_cache else None
        self.ssd: SsdTier | None = None
        if config.dram_rows:
            if ssd_dir is None:
                raise ValueError(f"table {config.name}: dram_rows is set, so an ssd_dir is needed for spilled rows")
            self.ssd = SsdTier(Path(ssd_dir) / config.name, config.dim, state_dim, by_time=config.ttl_s > 0)
        # every row of the table is in the GPU cache: a cache miss is a new key (kept by
        # the code that moves rows below the cache; see refresh_cache_complete)
        self.cache_complete = self.cache is not None
        self._pulls_since_refresh = 0

    @property
    def top(self) -> RowStorage:
        """The tier lookups and optimizer updates run on: the GPU cache, else DRAM."""
        return self.cache if self.cache is not None else self.dram

    def __len__(self) -> int:
        """Rows that exist in any tier, each counted once (a cached row may also have a DRAM copy)."""
        return len(self.dram) + (self.ssd.count if self.ssd else 0) + self.cache_only()

    def cache_only(self) -> int:
        """Rows in the GPU cache without a DRAM copy (created there, never evicted)."""
        if self.cache is None or len(self.cache) == 0:
            return 0
        keys = self.cache.keys[self.cache.live_slots()]
        return int((self.dram.slots_of(keys) < 0).sum())

    # ------------------------------------------------------------------ cache completeness
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

    def maybe_refresh_cache_complete(self, every: int = 100) -> None:
        """Every ``every`` find_or_insert calls while the cache is not known whole (after a restore or an
        eviction), check whether it has become whole, when its row count allows it."""
        if self.cache is None or self.cache_complete:
            return
        self._pulls_since_refresh += 1
        if self._pulls_since_refresh >= every and (self.ssd is None or self.ssd.count == 0) and len(self.cache) >= len(self.dram):
            self._pulls_since_refresh = 0
            self.refresh_cache_complete()

    # ------------------------------------------------------------------ reading in place
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
        Returns (found mask, values[found]), both on ``device``. Each tier is asked only for
        the keys the tiers above it lack: a snapshot of cached rows never probes the DRAM
        index on the host."""
        device = torch.device(device)
        keys = keys.to(torch.int64)
        values = torch.zeros(len(keys), self.dim, device=device)
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

    def all_keys(self) -> torch.Tensor:
        """Every key with a row, in any tier (for full versions), on the top tier's device."""
        device = self.top.device
        parts = [self.dram.keys[self.dram.live_slots()].to(device)]
        if self.cache is not None and len(self.cache):
            parts.append(self.cache.keys[self.cache.live_slots()])
        if self.ssd is not None:
            parts += [k.to(device) for k, _, _, _ in self.ssd.items()]
        return torch.unique(torch.cat(parts))

    def iter_rows(self, chunk: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every row in every tier (each key once), tier by tier in chunks of at most
        ``chunk`` slots or rows, on CPU: (keys, weights, state, last_seen)."""
        cache = self.cache
        for tier in (cache, self.dram):
            if tier is None:
                continue
            for lo in range(0, tier.high_water, chunk):
                s = lo + torch.nonzero(tier.live[lo : lo + chunk]).squeeze(1)
                if tier is self.dram and cache is not None and len(cache):  # the cache holds the current value
                    s = s[(cache.slots_of(tier.keys.index_select(0, s).to(cache.device)) < 0).cpu()]
                if len(s):
                    yield tuple(x.index_select(0, s).cpu() for x in (tier.keys, tier.weights, tier.state, tier.last_seen))
        if self.ssd is not None:
            yield from self.ssd.items(chunk)

    # ------------------------------------------------------------------ writing in place
    def overwrite(self, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """New weights for the rows of CPU ``keys`` that live in DRAM, written where they are
        (the DRAM slot, and the GPU cache slot when cached: a clean cached row evicted later
        still finds its DRAM copy current); slots, clocks and optimizer state stay. Returns
        the mask of keys written; the others (new rows, rows on SSD) need inserting."""
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
        """Drop the rows of CPU ``keys`` from every tier (absent keys are ignored)."""
        if self.cache is not None:
            self.cache.discard(keys.to(self.cache.device))
        self.dram.discard(keys)
        if self.ssd is not None:
            self.ssd.delete(keys)

    def close(self) -> None:
        if self.ssd is not None:
            self.ssd.close()
