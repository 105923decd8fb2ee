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
  rows are written back to DRAM to make room (LRU by the caller's clock);
- when DRAM holds more than ``dram_rows``, its least recently seen rows spill to RocksDB,
  and come back on their next use with weights, optimizer state and clock intact.

Admission (``admit_after`` sightings before a row exists) and expiry (rows unseen for
``ttl_s``) shape what exists; both feed the delta: created/updated keys are "touched",
expired keys are "deleted". The table is single-writer: one pull/push loop at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ps import kernels
from ps.admission import CountMinSketch
from ps.optimizers import make_optimizer
from ps.ssd import SsdTier
from ps.storage import RowStorage


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
        self.dram = RowStorage(config.dim, self.state_dim, "cpu", capacity=1024, growable=True)
        use_cache = self.device.type == "cuda" and config.gpu_cache_rows > 0
        if self.device.type == "cuda" and not use_cache:
            raise ValueError(f"table {config.name}: on CUDA set gpu_cache_rows > 0 (the GPU cache is the top tier)")
        self.cache = RowStorage(config.dim, self.state_dim, self.device, config.gpu_cache_rows, growable=False) if use_cache else None
        self.ssd: SsdTier | None = None
        if config.dram_rows:
            if ssd_dir is None:
                raise ValueError(f"table {config.name}: dram_rows is set, so an ssd_dir is needed for spilled rows")
            self.ssd = SsdTier(Path(ssd_dir) / config.name, config.dim, self.state_dim)
        self.sketch = CountMinSketch(device=self.device) if config.admit_after > 1 else None
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._touched: list[torch.Tensor] = []
        self._deleted: list[torch.Tensor] = []
        self._generation = 0
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
        top = self.top
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

    def lookup(self, ids: torch.Tensor, now_ms: int) -> torch.Tensor:
        """Serving-style read: one embedding per id, zeros for ids without a row; never
        creates rows. On CUDA, when every id hits the GPU cache, this is one fused
        probe+gather kernel (ps/kernels.py); otherwise the general path brings rows up."""
        started = self.lookup_start(ids, now_ms)
        if started is not None and int(started[1].item()) == 0:  # the one host sync of the hit path
            return self.lookup_hit(started[0])
        return self.lookup_slow(ids, now_ms)

    @property
    def resident(self) -> bool:
        """Every row is in the GPU cache (DRAM is the home of every cached row, so equal
        counts mean no row lives only below): an id the cache lacks has no row at all."""
        return self.cache is not None and len(self.cache) >= len(self.dram) and (self.ssd is None or self.ssd.count == 0)

    def lookup_start(self, ids: torch.Tensor, now_ms: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused hit path without its host sync: (rows, pending [1]) where ``pending``
        counts the ids that need ``lookup_slow`` (cache misses; only undecided probes when the
        table is resident, since a miss then means "no row": zeros, already in ``rows``).
        None where there is no fused path (CPU). Lets a caller sync once for many tables."""
        if self.cache is None or not kernels.available(self.device):
            return None
        ids = ids.to(self.top.device, torch.int64).flatten()
        resident = self.resident
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

    def warm(self, keys: torch.Tensor, now_ms: int = 0) -> int:
        """Bring existing rows of ``keys`` into the GPU cache while it has room (serving
        does this at load and after each delta, so lookups take the fused path); returns
        how many were brought up."""
        if self.cache is None or len(keys) == 0:
            return 0
        room = self.cache.capacity - len(self.cache)
        keys = keys.to(torch.int64).cpu()[:max(room, 0)]
        if len(keys):
            self.pull(keys.to(self.top.device), now_ms, train=False)
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
        new_w, new_s = self.optimizer.step(
            top.weights.index_select(0, slots), top.state.index_select(0, slots), grad_rows.to(top.device, torch.float32)
        )
        top.weights.index_copy_(0, slots, new_w)
        top.state.index_copy_(0, slots, new_s)
        self._track(keys)

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
        cpu_keys = keys.cpu()
        found_k, found_w, found_s, found_t = self._take_from_lower(cpu_keys)
        have = torch.zeros(len(cpu_keys), dtype=torch.bool)
        if len(found_k):
            have = torch.isin(cpu_keys, found_k)
        new_keys = cpu_keys[~have]
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
                self._track(new_keys)
                self.stats["created"] += n
        if len(found_k):
            self._make_room(len(found_k), protect)
            self.top.add(found_k, found_w, found_s, found_t)
        # Spill only now, once every row of this batch is in the top tier: a spill earlier
        # could send a row to SSD that is about to be cached, leaving two copies.
        batch = torch.empty(0, dtype=torch.int64) if self.cache is not None else torch.cat([protect.cpu(), self.dram.slots_of(found_k)])
        self._spill_dram(protect=batch)
        return self.top.slots_of(keys)

    def _take_from_lower(self, keys: torch.Tensor):
        """Rows for ``keys`` from the tiers below the top (removing them from SSD)."""
        parts = []
        rest = keys
        if self.cache is not None:
            dram_slots = self.dram.slots_of(rest)
            hit = dram_slots >= 0
            s = dram_slots[hit]
            parts.append((rest[hit], self.dram.weights[s], self.dram.state[s], self.dram.last_seen[s]))
            rest = rest[~hit]
        if self.ssd is not None and len(rest):
            got = self.ssd.take(rest)
            self.stats["ssd_reads"] += len(got[0])
            if self.cache is not None and len(got[0]):
                self.dram.add(*got)  # DRAM stays the home of every cached row
            parts.append(got)
        if not parts:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.config.dim), torch.empty(0, self.state_dim), torch.empty(0, dtype=torch.int64)
        return tuple(torch.cat([p[i].cpu() for p in parts]) for i in range(4))

    def _make_room(self, n: int, protect: torch.Tensor) -> None:
        """On CUDA: write back and drop the least recently seen cache rows to fit ``n`` more."""
        cache = self.cache
        if cache is None:
            return
        overflow = len(cache) + n - cache.capacity
        if overflow > 0:
            if overflow > cache.capacity - len(protect):
                raise RuntimeError(
                    f"table {self.config.name}: one batch needs {len(protect) + n} rows but the GPU cache holds "
                    f"{cache.capacity}; raise gpu_cache_rows"
                )
            self._write_back(cache.coldest(overflow, protect))

    def _write_back(self, keys: torch.Tensor) -> None:
        k, w, s, t = self.cache.pop(keys)
        k, w, s, t = k.cpu(), w.cpu(), s.cpu(), t.cpu()
        slots = self.dram.slots_of(k)
        present = slots >= 0
        self.dram.weights[slots[present]] = w[present]
        self.dram.state[slots[present]] = s[present]
        self.dram.last_seen[slots[present]] = t[present]
        if bool((~present).any()):
            self.dram.add(k[~present], w[~present], s[~present], t[~present])

    def _spill_dram(self, protect: torch.Tensor) -> None:
        budget = self.config.dram_rows
        if not budget or len(self.dram) <= budget:
            return
        overflow = len(self.dram) - budget
        if self.cache is not None:  # rows in the GPU cache keep their DRAM home
            cached = self.dram.slots_of(self.cache.keys[self.cache.live_slots()].cpu())
            protect = torch.cat([protect, cached[cached >= 0]])
        victims = self.dram.coldest(overflow, protect)
        self.ssd.put(*self.dram.pop(victims))
        self.stats["spilled"] += len(victims)

    # ------------------------------------------------------------------ reading, expiry
    def read(self, keys: torch.Tensor, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Current values of ``keys`` from whichever tier holds them, without moving rows.
        Returns (found mask, values[found]), both on ``device`` (snapshots read into the GPU
        so the training thread pays a device-to-device copy, not a host transfer)."""
        device = torch.device(device)
        keys = keys.to(torch.int64)
        values = torch.zeros(len(keys), self.config.dim, device=device)
        found = torch.zeros(len(keys), dtype=torch.bool, device=device)
        for tier in (self.cache, self.dram):
            if tier is None:
                continue
            slots = tier.slots_of(keys.to(tier.device))
            hit = (slots >= 0) & ~found.to(tier.device)
            idx = torch.nonzero(hit).squeeze(1)
            values[idx.to(device)] = tier.weights.index_select(0, slots[idx]).to(device)
            found |= hit.to(device)
        missing = ~found.cpu()
        if self.ssd is not None and bool(missing.any()):
            idx = torch.nonzero(missing).squeeze(1)
            cpu_keys = keys.cpu()
            k, w, _, _ = self.ssd.get(cpu_keys[idx])
            if len(k):
                pos = idx[torch.isin(cpu_keys[idx], k)]
                order = {key: i for i, key in enumerate(k.tolist())}
                values[pos.to(device)] = w[[order[key] for key in cpu_keys[pos].tolist()]].to(device)
                found[pos.to(device)] = True
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
        live = self.dram.live_slots()
        stale = self.dram.keys[live[self.dram.last_seen[live] < cutoff]]
        if len(stale):
            expired.append(self.dram.pop(stale)[0])
        if self.ssd is not None:
            for k, _, _, t in self.ssd.items():
                old = k[t < cutoff]
                if len(old):
                    self.ssd.delete(old)
                    expired.append(old)
        keys = torch.cat(expired) if expired else torch.empty(0, dtype=torch.int64)
        if len(keys):
            self._deleted.append(keys.cpu())
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
        """Every row in every tier (each key once), in chunks: (keys, weights[, state, last_seen])."""
        seen_in_cache = torch.empty(0, dtype=torch.int64)
        if self.cache is not None and len(self.cache):
            s = self.cache.live_slots()
            seen_in_cache = self.cache.keys[s].cpu()
            yield self._pack(seen_in_cache, self.cache.weights[s].cpu(), self.cache.state[s].cpu(), self.cache.last_seen[s].cpu(), with_state)
        s = self.dram.live_slots()
        k = self.dram.keys[s]
        keep = ~torch.isin(k, seen_in_cache)
        for lo in range(0, int(keep.sum()), chunk):
            sel = s[keep][lo : lo + chunk]
            yield self._pack(self.dram.keys[sel], self.dram.weights[sel], self.dram.state[sel], self.dram.last_seen[sel], with_state)
        if self.ssd is not None:
            for k, w, st, t in self.ssd.items(chunk):
                yield self._pack(k, w, st, t, with_state)

    @staticmethod
    def _pack(k, w, s, t, with_state):
        return (k, w, s, t) if with_state else (k, w)

    def load_rows(self, keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor | None = None, last_seen: torch.Tensor | None = None) -> None:
        """Insert or overwrite rows (restore, or applying a delta at serving)."""
        keys = keys.to(torch.int64).cpu()
        n = len(keys)
        if state is None:
            state = self.optimizer.init_state(n, self.config.dim, torch.device("cpu"))
        if last_seen is None:
            last_seen = torch.zeros(n, dtype=torch.int64)
        self.remove(keys)
        self.dram.add(keys, weights.cpu().float(), state.cpu(), last_seen.cpu())
        self._spill_dram(protect=torch.empty(0, dtype=torch.int64))

    def remove(self, keys: torch.Tensor) -> None:
        keys = keys.to(torch.int64).cpu()
        if self.cache is not None:
            self.cache.pop(keys)
        self.dram.pop(keys)
        if self.ssd is not None:
            self.ssd.delete(keys)

    def close(self) -> None:
        if self.ssd is not None:
            self.ssd.close()
