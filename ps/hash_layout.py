"""The hash index's slot layout, shared by the torch index (ps/hash_index.py) and the GPU
kernels that probe it themselves (ps/kernels.py): marker keys, the hash, and what a kernel
reads of an index."""

from __future__ import annotations

from typing import Protocol

import torch

EMPTY = -(2**63)
TOMBSTONE = -(2**63) + 1
RESERVED_KEYS = (EMPTY, TOMBSTONE)
MULTIPLIER = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (Fibonacci hashing)


class SlotTables(Protocol):
    """An index as a kernel sees it: 2**bits slots of (key, value), linear probing from
    ``(key * MULTIPLIER) >> (64 - bits)``."""

    @property
    def bits(self) -> int: ...

    def raw_tables(self) -> tuple[torch.Tensor, torch.Tensor]: ...
