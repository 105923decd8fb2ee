"""The hash index's slot layout, shared by the torch index (hash_index.py), the GPU
kernels that probe it themselves (kernels.py) and the byte budgets that pay for it
(budget.py): marker keys, the hash, the load limit and slot count. Free of torch: the
config (and so the serving front-ends) imports the budgets."""

from __future__ import annotations

EMPTY = -(2**63)
TOMBSTONE = -(2**63) + 1
RESERVED_KEYS = (EMPTY, TOMBSTONE)
MULTIPLIER = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (Fibonacci hashing)
MAX_LOAD = 0.5  # live keys + tombstones over slots


def index_bits(keys: int) -> int:
    """log2 of the slots an index needs to hold ``keys`` at a load of at most MAX_LOAD."""
    return max(4, (max(1, int(keys / MAX_LOAD)) - 1).bit_length())

