"""Where the time of a training step goes when the GPU cache holds a quarter of the rows
(a diagnostic for bench_ps.py's miss-heavy case): cProfile over pull + push."""

import cProfile
import pstats
import sys

import torch

from bench_ps import zipf_ranks  # bench/ is on sys.path (script dir)
from ps.table import EmbeddingTable, TableConfig

N, B, DIM = 4_000_000, 1_048_576, 64
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.set_num_threads(threads)
g = torch.Generator().manual_seed(0)
keys = torch.randint(1, 2**62, (N,), generator=g)
table = EmbeddingTable(TableConfig("b", DIM, gpu_cache_rows=N // 4), "cuda")
table.load_rows(keys, torch.randn(N, DIM, generator=g) * 0.01)
batches = [keys[zipf_ranks(N, B, 1.05, g)].cuda() for _ in range(16)]  # their union exceeds the cache


def step(i: int) -> None:
    pulled = table.pull(batches[i % 16], now_ms=i)
    table.push(pulled, torch.ones_like(pulled.rows) * 1e-3)


for i in range(16):
    step(i)
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for i in range(16, 24):
    step(i)
torch.cuda.synchronize()
prof.disable()
print(f"threads={threads}: {table.stats}")
pstats.Stats(prof).sort_stats("tottime").print_stats(30)
