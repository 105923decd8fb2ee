"""Where the time of a training step goes when the GPU cache holds a quarter of the rows
(a diagnostic for bench_ps.py's miss-heavy case): cProfile over find_or_insert +
apply_gradients, or over serving-style ``find``s with ``lookup`` as the second argument.

Usage: python bench/profile_miss.py [THREADS] [update|lookup]"""

import cProfile
import pstats
import sys
import time

import torch

from bench_ps import zipf_ranks  # bench/ is on sys.path (script dir)
from streamrec.embedding.table import EmbeddingTable, TableConfig

N, B, DIM = 4_000_000, 1_048_576, 64
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
mode = sys.argv[2] if len(sys.argv) > 2 else "update"
torch.set_num_threads(threads)
g = torch.Generator().manual_seed(0)
keys = torch.randint(1, 2**62, (N,), generator=g)
table = EmbeddingTable(TableConfig("b", DIM, gpu_cache_rows=N // 4), "cuda")
table.load_rows(keys, torch.randn(N, DIM, generator=g) * 0.01)
batches = [keys[zipf_ranks(N, B, 1.05, g)].cuda() for _ in range(16)]  # their union exceeds the cache


def step(i: int) -> None:
    if mode == "lookup":
        table.find(batches[i % 16], now_ms=i)
        return
    pulled = table.find_or_insert(batches[i % 16], now_ms=i)
    table.apply_gradients(pulled, torch.ones_like(pulled.rows) * 1e-3)


for i in range(16):
    step(i)
torch.cuda.synchronize()
start = time.perf_counter()
for i in range(16, 24):
    step(i)
torch.cuda.synchronize()
per_step = (time.perf_counter() - start) / 8
prof = cProfile.Profile()
prof.enable()
for i in range(24, 32):
    step(i)
torch.cuda.synchronize()
prof.disable()
print(f"threads={threads} mode={mode}: {per_step * 1e3:.2f} ms a step unprofiled ({B / per_step / 1e6:.1f} M ids/s); {table.stats}")
pstats.Stats(prof).sort_stats("tottime").print_stats(30)
