"""The SSD tier at scale (``bench/bench_ps.py --ssd``): a table far bigger than its DRAM budget.

Ours: an ``EmbeddingTable`` (dim 16, row-wise Adagrad) with a DRAM budget of ``--dram-gib``
and the rest in RocksDB, inside an ``EmbeddingCollection`` (for the checkpoint). Measured:
- load: ``load_rows(new=True)`` (the restore path) of every row in chunks of ``--chunk``,
  coldest ranks first (each chunk a later clock), so the hottest rows end in DRAM and the
  rest spill to SSD as they come;
- lookups: ``EmbeddingTable.find`` of Zipf ids (``zipf_ranks``), the serving read:
  DRAM hits, SSD misses brought up, DRAM spilling to make room;
- restart: reopening the table over its SSD directory (the row count is read, not
  counted), and the full restart path: checkpoint (streamed tier by tier) + restore;
- peak RSS (``VmHWM``) of all of it, against the DRAM budget.

The budget in rows comes from ``streamrec.embedding.budget.rows_for_bytes`` (what ``[ps] dram_bytes`` uses):
the most rows whose row arrays (94 bytes a row at dim 16 with row-wise Adagrad) and hash
index (a power of two of 16-byte slots, sized once for the budget) fit in it: 7.46 M rows
per GiB. RocksDB's memtables, block cache and the Python objects of a batch come on top;
the peak RSS shows the sum.

Baseline, same run, same rows and ids: plain RocksDB (rocksdict, raw mode, default
options), every row under its key with the same record layout, no DRAM tier — rows
written with one WriteBatch per chunk, a lookup batch read with one multi-get of its
unique keys (decoded to a tensor), a restart as close + reopen + counting the keys (what
a store without a stored row count has to do). It runs after ours, with the
peak RSS counter reset, so each side's peak is its own.
"""

from __future__ import annotations

import gc
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from rocksdict import Options, Rdict, WriteBatch

from streamrec.embedding.budget import rows_for_bytes, tier_bytes
from streamrec.embedding.collection import EmbeddingCollection
from streamrec.embedding.table import EmbeddingTable, TableConfig

KEY_MULTIPLIER = -2950933219127396973  # 0xD70A3B1E9C2F8A93: odd, so rank -> key is one-to-one


def keys_of(ranks: torch.Tensor) -> torch.Tensor:
    """Sparse int64 feature ids for ranks, computed (not stored: 50 M keys are 400 MB)."""
    return (ranks + 1) * KEY_MULTIPLIER


def memory_kb() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)


def bench_ssd(rows: int, dim: int, dram_gib: float, batch: int, batches: int, alpha: float, chunk: int, work: Path,
              restore: bool, zipf_ranks: Callable[[int, int, float, torch.Generator], torch.Tensor]) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    lookups = [keys_of(zipf_ranks(rows, batch, alpha, gen)) for _ in range(batches)]
    warmup = [keys_of(zipf_ranks(rows, batch, alpha, gen)) for _ in range(3)]
    state_dim = 1  # row-wise Adagrad
    budget_rows = rows_for_bytes(int(dram_gib * 2**30), dim, state_dim)
    cfg = TableConfig("emb", dim, dram_rows=budget_rows, gpu_cache_rows=0)
    gc.collect()
    reset_peak()
    start = memory_kb()
    out: dict = {"rows": rows, "dim": dim, "dram_budget_gib": dram_gib, "dram_budget_rows": budget_rows,
                 "dram_tier_bytes_at_budget": tier_bytes(budget_rows, dim, state_dim), "batch": batch, "batches": batches, "zipf_alpha": alpha,
                 "rss_at_start_mb": start["VmRSS"] / 1024}

    # ---- ours: load
    store = EmbeddingCollection([cfg], "cpu", work_dir=work / "a")
    table = store["emb"]
    init = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    for i, hi in enumerate(range(rows, 0, -chunk)):  # coldest ranks first, each chunk one clock tick later
        ranks = torch.arange(max(0, hi - chunk), hi)
        table.load_rows(keys_of(ranks), torch.randn(len(ranks), dim, generator=init) * 0.01,
                        last_seen=torch.full((len(ranks),), i, dtype=torch.int64), new=True)
    load_s = time.perf_counter() - t0
    phases = {"load": memory_kb()}
    assert len(table) == rows, (len(table), rows)
    out["ours"] = {"load_s": load_s, "load_rows_per_s": rows / load_s, "dram_rows": len(table.tiers.dram), "ssd_rows": table.tiers.ssd.count,
                   "spilled": table.stats["spilled"]}

    # ---- ours: lookups (serving reads; misses come up from SSD, DRAM spills)
    clock = rows // chunk + 10
    for ids in warmup:
        clock += 1
        table.find(ids, now_ms=clock)
    before = dict(table.stats)
    t0 = time.perf_counter()
    for ids in lookups:
        clock += 1
        table.find(ids, now_ms=clock)
    lookup_s = time.perf_counter() - t0
    phases["lookup"] = memory_kb()
    ssd_reads = table.stats["ssd_reads"] - before["ssd_reads"]
    unique = table.stats["lookups"] - before["lookups"]
    out["ours"].update(lookup_s=lookup_s, lookup_ids_per_s=batch * batches / lookup_s, unique_ids_per_batch=unique / batches,
                       ssd_reads_per_batch=ssd_reads / batches, dram_hit_rate=1 - ssd_reads / max(1, unique),
                       spill_slots_examined_per_row=table.placement.spill_clock.examined / max(1, table.stats["spilled"]))

    # ---- ours: restart: checkpoint; reopen a table over the SSD directory; restore
    ssd_rows = table.tiers.ssd.count
    t0 = time.perf_counter()
    store.checkpoint(work / "ckpt")
    out["ours"]["checkpoint_s"] = time.perf_counter() - t0
    phases["checkpoint"] = memory_kb()
    out["ours"]["checkpoint_bytes"] = sum(f.stat().st_size for f in (work / "ckpt").iterdir())
    t0 = time.perf_counter()
    store.close()
    del store, table
    gc.collect()
    reopened = EmbeddingTable(cfg, "cpu", ssd_dir=work / "a" / "ssd")  # its SSD rows, counted without a scan
    out["ours"]["reopen_ssd_s"] = time.perf_counter() - t0
    assert len(reopened) == reopened.tiers.ssd.count == ssd_rows
    reopened.close()
    del reopened
    if restore:
        t0 = time.perf_counter()
        store, _ = EmbeddingCollection.restore(work / "ckpt", "cpu", work_dir=work / "b")
        out["ours"]["restore_s"] = time.perf_counter() - t0
        phases["restore"] = memory_kb()
        assert len(store["emb"]) == rows
        store.close()
        del store
        gc.collect()
    peak = memory_kb()["VmHWM"]
    out["ours"]["rss_mb_after"] = {phase: {"rss": m["VmRSS"] / 1024, "peak_so_far": m["VmHWM"] / 1024} for phase, m in phases.items()}
    out["ours"]["peak_rss_mb"] = peak / 1024
    out["ours"]["peak_rss_over_budget"] = peak * 1024 / (dram_gib * 2**30)
    out["ours"]["peak_rss_above_start_over_budget"] = (peak - start["VmHWM"]) * 1024 / (dram_gib * 2**30)
    shutil.rmtree(work / "a", ignore_errors=True)
    shutil.rmtree(work / "b", ignore_errors=True)
    shutil.rmtree(work / "ckpt", ignore_errors=True)

    # ---- baseline: plain RocksDB
    reset_peak()
    out["baseline"] = baseline(rows, dim, state_dim, chunk, lookups, work / "base")
    out["baseline"]["peak_rss_mb"] = memory_kb()["VmHWM"] / 1024
    shutil.rmtree(work, ignore_errors=True)
    o, b = out["ours"], out["baseline"]
    out["ratio_load"] = o["load_rows_per_s"] / b["load_rows_per_s"]
    out["ratio_lookup"] = o["lookup_ids_per_s"] / b["lookup_ids_per_s"]
    out["ratio_reopen"] = o["reopen_ssd_s"] / b["reopen_count_s"]
    return out


def baseline(rows: int, dim: int, state_dim: int, chunk: int, lookups: list[torch.Tensor], path: Path) -> dict:
    floats = dim + state_dim
    db = Rdict(str(path), options=Options(raw_mode=True))
    init = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    for i, hi in enumerate(range(rows, 0, -chunk)):
        ranks = torch.arange(max(0, hi - chunk), hi)
        n = len(ranks)
        rec = np.empty((n, floats * 4 + 8), dtype=np.uint8)
        rec[:, : dim * 4] = (torch.randn(n, dim, generator=init) * 0.01).numpy().view(np.uint8)
        rec[:, dim * 4 : floats * 4] = np.zeros((n, state_dim), dtype=np.float32).view(np.uint8)
        rec[:, floats * 4 :] = np.full((n, 1), i, dtype=np.int64).view(np.uint8)
        raw_keys, raw_rec = keys_of(ranks).numpy().astype(">i8").tobytes(), rec.tobytes()
        size = rec.shape[1]
        wb = WriteBatch(raw_mode=True)
        for j in range(n):
            wb.put(raw_keys[j * 8 : j * 8 + 8], raw_rec[j * size : (j + 1) * size])
        db.write(wb)
    load_s = time.perf_counter() - t0

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        keys, inverse = torch.unique(ids, return_inverse=True)
        raw = keys.numpy().astype(">i8").tobytes()
        values = db.get([raw[j : j + 8] for j in range(0, len(raw), 8)])
        buf = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), floats * 4 + 8)
        rows_ = torch.from_numpy(buf[:, : dim * 4].copy().view(np.float32))
        return rows_.index_select(0, inverse)

    lookup(lookups[0])
    t0 = time.perf_counter()
    for ids in lookups:
        lookup(ids)
    lookup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    db.close()
    db = Rdict(str(path), options=Options(raw_mode=True))
    count = sum(1 for _ in db.keys())
    reopen_s = time.perf_counter() - t0
    assert count == rows
    db.close()
    batch = len(lookups[0])
    return {"load_s": load_s, "load_rows_per_s": rows / load_s, "lookup_s": lookup_s,
            "lookup_ids_per_s": batch * len(lookups) / lookup_s, "reopen_count_s": reopen_s}


def report(r: dict) -> None:
    o, b = r["ours"], r["baseline"]
    print(f"SSD tier: {r['rows']:,} rows dim {r['dim']}, DRAM budget {r['dram_budget_gib']:g} GiB = {r['dram_budget_rows']:,} rows "
          f"({o['dram_rows']:,} in DRAM, {o['ssd_rows']:,} on SSD after load)", flush=True)
    print(f"  load    ours {o['load_s']:8.1f} s ({o['load_rows_per_s'] / 1e3:7.1f} k rows/s) | plain RocksDB {b['load_s']:8.1f} s "
          f"| {r['ratio_load']:.2f}x", flush=True)
    print(f"  lookup  ours {o['lookup_ids_per_s'] / 1e3:8.1f} k ids/s (DRAM hit rate {o['dram_hit_rate']:.3f}, "
          f"{o['ssd_reads_per_batch']:,.0f} SSD reads per batch) | plain RocksDB {b['lookup_ids_per_s'] / 1e3:8.1f} k ids/s "
          f"| {r['ratio_lookup']:.2f}x", flush=True)
    restore = f", restore {o['restore_s']:.1f} s" if "restore_s" in o else ""
    print(f"  restart ours: close + reopen over the SSD dir {o['reopen_ssd_s'] * 1e3:.0f} ms (plain RocksDB reopen + key count "
          f"{b['reopen_count_s']:.2f} s); checkpoint {o['checkpoint_s']:.1f} s{restore}", flush=True)
    print(f"  peak RSS ours {o['peak_rss_mb']:,.0f} MB = {o['peak_rss_over_budget']:.2f}x the DRAM budget "
          f"({o['peak_rss_above_start_over_budget']:.2f}x above the process's start); plain RocksDB {b['peak_rss_mb']:,.0f} MB",
          flush=True)
