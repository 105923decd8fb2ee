"""Tier budgets in bytes -> rows per table.

Operators size memory in bytes ("4GiB of HBM for embeddings"), not in rows whose cost
depends on the dim and the optimizer. A row in a tier (ps/storage.py RowStorage) costs:

    weights dim*4 + optimizer state state_dim*4 + last_seen 8 + key 8 + below 8
    + live 1 + dirty 1 + hash index 32 (two int64 slots of key and value per row at
    load <= 0.5, ps/hash_index.py)

A budget is split into equal byte shares, one per table: simple to predict, and a table
never starves another. A share a small table cannot fill is left unused.
"""

from __future__ import annotations

import re

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
INDEX_BYTES_PER_ROW = 32
MIN_ROWS = 1024  # a tier smaller than this per table is a configuration mistake


class BudgetError(ValueError):
    """A size that does not parse, or a budget too small for the tables."""


def parse_bytes(value: int | str, name: str) -> int:
    """``4294967296``, ``"4GiB"``, ``"512 MiB"``, ``"1.5GB"`` -> bytes (GiB/MiB/KiB binary,
    GB/MB/KB decimal)."""
    if isinstance(value, bool):
        raise BudgetError(f"{name} must be a size in bytes, got {value!r}")
    if isinstance(value, int):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in UNITS:
            raise BudgetError(f"{name} must be a size like 512MiB, 4GiB, 1.5GB or a number of bytes, got {value!r}")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise BudgetError(f"{name} must be >= 0, got {value!r}")
    return int(number * UNITS[unit])


def row_bytes(dim: int, state_dim: int) -> int:
    """What one row costs in a tier, index included (see the module docstring)."""
    return dim * 4 + state_dim * 4 + 8 + 8 + 8 + 1 + 1 + INDEX_BYTES_PER_ROW


def rows_per_table(budget_bytes: int, tables: dict[str, tuple[int, int]], name: str) -> dict[str, int]:
    """Rows each table gets from ``budget_bytes`` (tables: name -> (dim, state_dim)),
    equal byte shares; 0 stays 0 (the tier's "none/unlimited")."""
    if budget_bytes == 0:
        return {t: 0 for t in tables}
    share = budget_bytes // max(1, len(tables))
    rows = {t: share // row_bytes(dim, state_dim) for t, (dim, state_dim) in tables.items()}
    small = [t for t, r in rows.items() if r < MIN_ROWS]
    if small:
        raise BudgetError(f"{name} = {budget_bytes:,} bytes gives table(s) {', '.join(small)} fewer than {MIN_ROWS} rows "
                          f"({share:,} bytes each across {len(tables)} tables); raise it")
    return rows


def tier_usage(table) -> dict[str, dict[str, int]]:
    """What each tier of an ``EmbeddingTable`` holds against its budget, in rows and bytes
    (SSD: rows only; its bytes are RocksDB's). A cached row also has a DRAM copy once it
    has been evicted or was brought up, so GPU and DRAM rows may overlap."""
    per_row = row_bytes(table.config.dim, table.state_dim)
    out = {}
    if table.cache is not None:
        out["gpu_cache"] = {"rows": len(table.cache), "bytes": len(table.cache) * per_row,
                            "budget_rows": table.cache.capacity, "budget_bytes": table.cache.capacity * per_row}
    dram_budget = table.config.dram_rows
    out["dram"] = {"rows": len(table.dram), "bytes": len(table.dram) * per_row,
                   "budget_rows": dram_budget, "budget_bytes": dram_budget * per_row}  # 0: unlimited
    if table.ssd is not None:
        out["ssd"] = {"rows": table.ssd.count}
    return out
