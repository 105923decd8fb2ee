"""Where the time of one GPU lookup batch goes (a diagnostic for bench_ps.py)."""

import time

import torch

from bench.bench_ps import zipf_ranks
from streamrec.embedding import kernels
from streamrec.embedding.table import EmbeddingTable, TableConfig

N, B = 1_000_000, 65536
g = torch.Generator().manual_seed(0)
keys = torch.randint(1, 2**62, (N,), generator=g)
table = EmbeddingTable(TableConfig("b", 64, gpu_cache_rows=N), "cuda")
table.load_rows(keys, torch.randn(N, 64))
ids = keys[zipf_ranks(N, B, 1.05, g)].cuda()
table.find(ids, 1)
table.find(ids, 2)


def t(name, fn, r=50):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(r):
        fn()
    torch.cuda.synchronize()
    print(f"{name:28s} {(time.perf_counter() - t0) / r * 1e6:9.1f} us")


idx = table.tiers.cache.index
print("fused hits so far", table.stats["fused_hits"], "cache rows", len(table.tiers.cache), "index slots", idx.slots)
t("lookup()", lambda: table.find(ids, 3))
for clock in (False, True):
    for count in (False, True):
        t(f"kernel clock={clock:d} count={count:d}",
          lambda: kernels.probe_gather(ids, idx, table.tiers.cache.weights, table.tiers.cache.last_seen, 4, clock, count))
slots_only = kernels.probe_gather(ids, idx, table.tiers.cache.weights, table.tiers.cache.last_seen, 4, False, False)[1]
t("kernel + index_fill_ clock", lambda: (kernels.probe_gather(ids, idx, table.tiers.cache.weights, table.tiers.cache.last_seen, 4, False, True),
                                         table.tiers.cache.last_seen.index_fill_(0, slots_only, 4)))
t("kernel + misses.item()", lambda: kernels.probe_gather(ids, idx, table.tiers.cache.weights, table.tiers.cache.last_seen, 4, False, True)[2].item())
_, slots, _ = kernels.probe_gather(ids, idx, table.tiers.cache.weights, table.tiers.cache.last_seen, 4)
print("slots<0:", int((slots < 0).sum()), "slots==-2:", int((slots == -2).sum()))
t("index_select same slots", lambda: table.tiers.cache.weights.index_select(0, slots.clamp(min=0)))
t("torch hash lookup", lambda: idx.lookup(ids))
t("unique", lambda: torch.unique(ids, return_inverse=True, return_counts=True))

# The benchmark's situation: rows loaded into DRAM, then lookups of 8 different batches.
table2 = EmbeddingTable(TableConfig("b2", 64, gpu_cache_rows=N), "cuda")
table2.load_rows(keys, torch.randn(N, 64))
batches = [keys[zipf_ranks(N, B, 1.05, g)].cuda() for _ in range(8)]
for rnd in range(3):
    for i, b in enumerate(batches):
        before = table2.stats["fused_hits"]
        table2.find(b, rnd * 8 + i)
        _, sl, _ = kernels.probe_gather(b, table2.tiers.cache.index, table2.tiers.cache.weights, table2.tiers.cache.last_seen, rnd * 8 + i)
        print(f"round {rnd} batch {i}: fused={table2.stats['fused_hits'] > before} missing_after={int((sl < 0).sum())} cache_rows={len(table2.tiers.cache)}")
