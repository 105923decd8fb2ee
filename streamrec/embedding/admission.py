"""Feature admission: a row is created only after its key has been seen ``threshold`` times.

Long-tail ids seen once or twice would otherwise fill memory with rows that never learn
anything (Monolith's frequency filter). Counting uses a count-min sketch: fixed memory,
never under-counts, over-counts rarely (depth x width counters).
"""

from __future__ import annotations

import torch

_SEEDS = (-7046029254386353131, -4658895280553007687, 7640891576956012809, -2624529493093616497)


class CountMinSketch:
    def __init__(self, width_bits: int = 20, depth: int = 4, device: torch.device | str = "cpu") -> None:
        if not 1 <= depth <= len(_SEEDS):
            raise ValueError(f"depth must be 1..{len(_SEEDS)}")
        self.bits, self.depth = width_bits, depth
        self.counts = torch.zeros(depth, 1 << width_bits, dtype=torch.int32, device=device)

    def _cells(self, keys: torch.Tensor) -> torch.Tensor:
        mask = (1 << self.bits) - 1
        return torch.stack([((keys * seed) >> (64 - self.bits)) & mask for seed in _SEEDS[: self.depth]])

    def add(self, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Count ``counts`` more sightings of each (unique) key; returns the new estimates."""
        cells = self._cells(keys.to(self.counts.device))
        counts = counts.to(self.counts.device, torch.int32)
        for row in range(self.depth):
            self.counts[row].index_add_(0, cells[row], counts)
        return self.estimate(keys)

    def estimate(self, keys: torch.Tensor) -> torch.Tensor:
        cells = self._cells(keys.to(self.counts.device))
        return torch.stack([self.counts[r][cells[r]] for r in range(self.depth)]).min(dim=0).values
