"""One tier's rows on one device: hash index + weights + optimizer state + last-seen clock.

The DRAM tier is a growable ``RowStorage`` on the CPU; the GPU cache is a fixed-size
one on CUDA. Rows live at a slot; the index maps key -> slot; freed slots are reused.
"""

from __future__ import annotations

import torch

from ps.hash_index import HashIndex


class TierFull(RuntimeError):
    """A fixed-capacity tier has no free slot left (the caller must evict first)."""


class RowStorage:
    def __init__(self, dim: int, state_dim: int, device: torch.device | str, capacity: int, growable: bool) -> None:
        self.dim, self.state_dim = dim, state_dim
        self.device = torch.device(device)
        self.growable = growable
        self.index = HashIndex(capacity, self.device)
        self.weights = torch.zeros(capacity, dim, device=self.device)
        self.state = torch.zeros(capacity, state_dim, device=self.device)
        self.last_seen = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self.keys = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self.live = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        self._free = torch.empty(0, dtype=torch.int64, device=self.device)
        self._high_water = 0

    @property
    def capacity(self) -> int:
        return self.weights.shape[0]

    def __len__(self) -> int:
        return self._high_water - len(self._free)

    def slots_of(self, keys: torch.Tensor) -> torch.Tensor:
        return self.index.lookup(keys)

    def add(self, keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, last_seen: torch.Tensor) -> torch.Tensor:
        """Store rows for keys that are not present (unique); returns their slots."""
        n = len(keys)
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        reuse = self._free[:n]
        self._free = self._free[n:]
        fresh = n - len(reuse)
        if self._high_water + fresh > self.capacity:
            if not self.growable:
                raise TierFull(f"tier on {self.device} holds {self.capacity} rows and is full")
            self._grow(max(2 * self.capacity, self._high_water + fresh))
        slots = torch.cat([reuse, torch.arange(self._high_water, self._high_water + fresh, device=self.device)])
        self._high_water += fresh
        self.weights[slots] = weights.to(self.device)
        self.state[slots] = state.to(self.device)
        self.last_seen[slots] = last_seen.to(self.device)
        self.keys[slots] = keys.to(self.device)
        self.live[slots] = True
        self.index.insert(keys, slots)
        return slots

    def pop(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove present keys; returns (keys, weights, state, last_seen) of those removed."""
        slots = self.index.remove(keys)
        found = slots >= 0
        slots = slots[found]
        out = (keys.to(self.device)[found], self.weights[slots].clone(), self.state[slots].clone(), self.last_seen[slots].clone())
        self.live[slots] = False
        self._free = torch.cat([self._free, slots])
        return out

    def coldest(self, n: int, protect: torch.Tensor | None = None) -> torch.Tensor:
        """Keys of the ``n`` least recently seen rows, never those in ``protect`` (slots)."""
        seen = torch.where(self.live, self.last_seen, torch.iinfo(torch.int64).max)
        if protect is not None and len(protect):
            seen = seen.clone()
            seen[protect] = torch.iinfo(torch.int64).max
        n = min(n, int(self.live.sum()) - (len(protect) if protect is not None else 0))
        if n <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        slots = torch.topk(seen[: self._high_water], n, largest=False).indices
        return self.keys[slots]

    def live_slots(self) -> torch.Tensor:
        return torch.nonzero(self.live[: self._high_water]).squeeze(1)

    def _grow(self, capacity: int) -> None:
        def grown(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)
            out[: t.shape[0]] = t
            return out

        self.weights, self.state = grown(self.weights), grown(self.state)
        self.last_seen, self.keys, self.live = grown(self.last_seen), grown(self.keys), grown(self.live)
