"""Tier budgets in bytes -> rows per table.

Operators size memory in bytes ("4GiB of HBM for embeddings"), not in rows whose cost
depends on the dim and the optimizer. A tier of ``rows`` rows (tier_rows.py RowStorage)
costs its row arrays plus its hash index:

    rows x (weights dim*4 + optimizer state state_dim*4 + last_seen 8 + key 8 + below 8
            + live 1 + dirty 1)
    + index slots x 16 (an int64 key and an int64 value per slot)

The index is a power of two of slots, sized once for the most keys the tier holds between
spills (``tier_keys``: the rows, one eighth more for the batch that arrives before the
spill, and 1024) at a load of at most 1/2 (hash_layout.py), and never grown past that
(hash_index.py ``fixed``). Its share per row is thus 32 to 64 bytes, depending on where
the rows fall between two powers of two; the rows a budget buys are counted with the real
size.

A budget is split into equal byte shares, one per table: simple to predict, and a table
never starves another. A share a small table cannot fill is left unused.
"""

from __future__ import annotations

from streamrec.embedding.hash_layout import MAX_LOAD, index_bits

SLOT_BYTES = 16
MIN_ROWS = 1024  # a tier smaller than this per table is a configuration mistake


class BudgetError(ValueError):
    """A budget too small for the tables."""


def array_bytes(dim: int, state_dim: int) -> int:
    """What one row costs in a tier's row arrays (the index comes on top: ``tier_bytes``)."""
    return dim * 4 + state_dim * 4 + 8 + 8 + 8 + 1 + 1


def tier_keys(rows: int) -> int:
    """The most keys a tier of ``rows`` rows indexes: a batch's rows arrive before the spill."""
    return rows + rows // 8 + 1024


def tier_bytes(rows: int, dim: int, state_dim: int) -> int:
    """Memory of a full tier of ``rows`` rows: its row arrays and its index."""
    return rows * array_bytes(dim, state_dim) + (1 << index_bits(tier_keys(rows))) * SLOT_BYTES


def rows_for_bytes(budget_bytes: int, dim: int, state_dim: int) -> int:
    """The most rows whose tier fits in ``budget_bytes`` (index included)."""
    per_row, best, bits = array_bytes(dim, state_dim), 0, 4
    while (1 << bits) * SLOT_BYTES <= budget_bytes:
        slots = 1 << bits
        by_bytes = (budget_bytes - slots * SLOT_BYTES) // per_row
        by_index = max(0, (int(slots * MAX_LOAD) - 1024) * 8 // 9)  # fits: r + r // 8 <= 9r / 8
        while tier_keys(by_index + 1) <= slots * MAX_LOAD:  # tier_keys floors rows / 8: step up to the exact bound
            by_index += 1
        best = max(best, min(by_bytes, by_index))
        bits += 1
    return best


def rows_per_table(budget_bytes: int, tables: dict[str, tuple[int, int]], name: str) -> dict[str, int]:
    """Rows each table gets from ``budget_bytes`` (tables: name -> (dim, state_dim)),
    equal byte shares; 0 stays 0 (the tier's "none/unlimited")."""
    if budget_bytes == 0:
        return {t: 0 for t in tables}
    share = budget_bytes // max(1, len(tables))
    rows = {t: rows_for_bytes(share, dim, state_dim) for t, (dim, state_dim) in tables.items()}
    small = [t for t, r in rows.items() if r < MIN_ROWS]
    if small:
        raise BudgetError(f"{name} = {budget_bytes:,} bytes gives table(s) {', '.join(small)} fewer than {MIN_ROWS} rows "
                          f"({share:,} bytes each across {len(tables)} tables); raise it")
    return rows


def tier_usage(table) -> dict[str, dict[str, int]]:
    """What each tier of an ``EmbeddingTable`` holds against its budget, in rows and bytes
    (row arrays of the rows held, plus the index as allocated; SSD: rows only, its bytes
    are RocksDB's). A cached row also has a DRAM copy once it has been evicted or was
    brought up, so GPU and DRAM rows may overlap."""
    shape, tiers = (table.config.dim, table.state_dim), table.tiers
    out = {}
    if tiers.cache is not None:
        out["gpu_cache"] = _usage(tiers.cache, tiers.cache.capacity, *shape)
    out["dram"] = _usage(tiers.dram, table.config.dram_rows, *shape)  # budget 0: unlimited
    if tiers.ssd is not None:
        out["ssd"] = {"rows": tiers.ssd.count}
    return out


def _usage(tier, budget_rows: int, dim: int, state_dim: int) -> dict[str, int]:
    index = tier.index.slots * SLOT_BYTES
    return {"rows": len(tier), "bytes": len(tier) * array_bytes(dim, state_dim) + index, "index_bytes": index,
            "budget_rows": budget_rows, "budget_bytes": tier_bytes(budget_rows, dim, state_dim) if budget_rows else 0}
