"""Which DRAM rows spill to SSD: an approximate LRU whose cost follows the rows spilled.

An exact LRU spill (top-k over every row's clock) costs O(DRAM rows) per spill however
few rows go, and spills happen every batch once DRAM is full. Instead a clock hand walks
the slots in order: a spill of ``n`` rows reads the slots past the hand until it holds
``sample * n`` candidates (live, not held) and spills the ``n`` least recently seen of
them (Redis evicts the oldest of a few sampled keys the same way). A victim is thus among
the oldest of its sample, not necessarily the oldest row; in exchange a spill reads
O(sample * n) slots, whatever the size of DRAM. Freed slots are refilled by new rows
right behind the hand, so a row that just arrived waits a full turn before it is
considered (as in CLOCK).
"""

from __future__ import annotations

from typing import Callable

import torch

from streamrec.embedding.tier_rows import RowStorage


class SpillClock:
    def __init__(self, sample: int = 8, min_window: int = 256) -> None:
        self.sample, self.min_window = sample, min_window
        self.hand = 0
        self.examined = 0  # slots read by all spills so far (tests check it follows rows spilled)

    def victims(self, tier: RowStorage, n: int, held: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Slots of up to ``n`` live rows of ``tier`` to spill, never one that ``held``
        (slots -> bool mask) marks. Fewer than ``n`` only when a full turn of the hand finds
        fewer candidates."""
        end = tier.high_water
        want = max(n * self.sample, self.min_window)
        pool, found, read = [], 0, 0
        while found < want and read < end:
            lo = self.hand if self.hand < end else 0
            hi = min(end, lo + max(want - found, self.min_window), lo + end - read)
            slots = torch.arange(lo, hi)[tier.live[lo:hi]]
            if len(slots):
                slots = slots[~held(slots)]
            pool.append(slots)
            found += len(slots)
            read += hi - lo
            self.hand = hi
        self.examined += read
        pool = torch.cat(pool) if pool else torch.empty(0, dtype=torch.int64)
        if len(pool) <= n:
            return pool
        return pool[torch.topk(tier.last_seen.index_select(0, pool), n, largest=False).indices]
