"""Where the time of the trainer's sparse lookup goes, per table, on first sight of ids
(miss path: rows created) and on a second pass (hit path). A diagnostic for bench_trainer.py.

Usage: python bench/profile_trainer.py --samples RUN_DIR [--batch 4096] [--steps 30] [--device cuda]
"""

import argparse
import time

import pyarrow.parquet as pq
import torch

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.embedding.collection import EmbeddingCollection
from streamrec.plumbing.config import load_config
from streamrec.model.batch import batch_from_table
from streamrec.model.network import table_configs
from streamrec.trainer.sources import sample_files
from streamrec.model.sparse import SparseFeatures


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", required=True)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    table = pq.read_table(sample_files([args.samples])[0])
    batches = [batch_from_table(table.slice(i * args.batch, args.batch), FeatureSpec(), 50).to(device) for i in range(args.steps)]
    warm = EmbeddingCollection(table_configs(load_config(environ={}).model, load_config(environ={}).ps), device)  # Triton compiles happen here
    for b in batches[:3]:
        for name, ids in SparseFeatures.table_ids(b).items():
            warm[name].apply_gradients(warm[name].find_or_insert(ids, 1), torch.zeros(1, 16, device=device).expand(len(torch.unique(ids)), 16).contiguous())
    store = EmbeddingCollection(table_configs(load_config(environ={}).model, load_config(environ={}).ps), device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sparse = SparseFeatures(store)
    for label in ("first pass (misses: rows created)", "second pass (hits)"):
        pull_s = assemble = 0.0
        for b in batches:
            sync()
            t0 = time.perf_counter()
            pulled = store.find_or_insert_each(SparseFeatures.table_ids(b), 1)  # every table: one unique, one sync for creations
            emb = {name: p.embeddings() for name, p in pulled.items()}
            sync()
            pull_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            sparse._assemble(b, emb)
            sync()
            assemble += time.perf_counter() - t0
        n = len(batches)
        print(label, "pull (all tables)", round(1000 * pull_s / n, 2), "assemble", round(1000 * assemble / n, 2), "ms/step",
              "ids/step", {k: len(v) for k, v in SparseFeatures.table_ids(batches[0]).items()})
    # Which ps/ functions the miss path spends its time in (device-synchronised wall time).
    import collections
    import functools

    from streamrec.embedding import kernels
    from streamrec.embedding.hash_index import HashIndex
    from streamrec.embedding.tier_rows import RowStorage
    from streamrec.embedding.placement import Placement
    from streamrec.embedding.table import EmbeddingTable

    spent = collections.Counter()
    calls = collections.Counter()

    def timed(owner, name):
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*a, **k):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                spent[f"{owner.__name__}.{name}"] += time.perf_counter() - t0
                calls[f"{owner.__name__}.{name}"] += 1
        setattr(owner, name, wrapper)

    for owner, names in ((HashIndex, ("insert", "lookup", "_find", "remove")), (RowStorage, ("add", "pop", "coldest_slots")),
                         (Placement, ("bring_up", "_take_from_lower", "make_room", "spill_dram")), (EmbeddingTable, ("apply_gradients",))):
        for name in names:
            timed(owner, name)
    if device.type == "cuda":
        timed(kernels, "probe_gather")
    fresh = EmbeddingCollection(table_configs(load_config(environ={}).model, load_config(environ={}).ps), device)
    for b in batches:
        pulled = fresh["user"].find_or_insert(b.user, 3)
        fresh["user"].apply_gradients(pulled, torch.zeros_like(pulled.rows))
    spent["total"], calls["total"] = sum(spent.values()), 1
    print("user table, fresh store, all batches: ms per call (calls)",
          {k: f"{1000 * v / calls[k]:.2f} ({calls[k]})" for k, v in spent.most_common()}, "stats", fresh["user"].stats)
    if device.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for b in batches[:10]:
                store.find_or_insert_each(SparseFeatures.table_ids(b), 2)
            sync()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        fresh = EmbeddingCollection(table_configs(load_config(environ={}).model, load_config(environ={}).ps), device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for b in batches[:10]:
                fresh.find_or_insert_each(SparseFeatures.table_ids(b), 2)
            sync()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
