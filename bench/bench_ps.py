"""Embedding table throughput: lookup and lookup+update of Zipf-distributed ids.

Ours: "lookup" is ``EmbeddingTable.find`` (serving reads: one embedding per id; on CUDA
a fused Triton probe+gather when all ids hit the GPU cache, else the general path);
"+update" is the training step: ``find_or_insert`` (unique ids, hash-index lookup, tier
management, gather), the per-id gather, and ``apply_gradients`` (fused row-wise Adagrad).

Baseline, same run, same ids: a plain pre-sized ``torch.nn.Embedding`` whose ids were
mapped to 0..N-1 beforehand (no dynamic ids, no tiers): ``index_select`` for lookup, and
the same row-wise Adagrad written with plain index ops for update. That is the physical
limit of a gather on this device; ratios = ours / baseline.

GB/s counts the bytes of the delivered embeddings (ids x dim x 4) per second.
Usage: streamrec bench ps [--rows 1000000] [--dim 64] [--batch 65536] [--device cuda]
Writes var/bench/ps-<device>-<time>.json.

``--ssd``: the SSD tier at scale instead (bench/ps_ssd.py: a table of --rows, default
50,000,000, dim 16, with a DRAM budget of --dram-gib and the rest in RocksDB; baseline
plain RocksDB). Writes var/bench/ps-ssd-<time>.json.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from streamrec.embedding.table import EmbeddingTable, TableConfig

from output import write_result  # bench/ is on sys.path (script dir; `streamrec bench` adds it)


def zipf_ranks(n_rows: int, batch: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """Ranks 0..n_rows-1 with P(rank r) ~ (r+1)^-alpha (inverse-CDF of the continuous law)."""
    u = torch.rand(batch, generator=gen, dtype=torch.float64)
    top = float(n_rows) ** (1 - alpha)
    ranks = ((top - 1) * u + 1) ** (1 / (1 - alpha)) - 1
    return ranks.long().clamp_(0, n_rows - 1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device: torch.device, repeat: int) -> float:
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeat


def bench_one(n_rows: int, dim: int, batch: int, alpha: float, cache_ratio: float, device: torch.device, repeat: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    keys_by_rank = torch.randint(1, 2**62, (n_rows,), generator=gen)  # sparse int64 feature ids
    batches = [zipf_ranks(n_rows, batch, alpha, gen) for _ in range(8)]
    id_batches = [keys_by_rank[r].to(device) for r in batches]
    dense_batches = [r.to(device) for r in batches]

    # ---- baseline: pre-sized nn.Embedding, ids already dense
    emb = torch.nn.Embedding(n_rows, dim, device=device)
    acc = torch.zeros(n_rows, device=device)
    i = [0]

    def base_lookup():
        return emb.weight.index_select(0, dense_batches[i[0] % 8])

    def base_update():
        ids = dense_batches[i[0] % 8]
        i[0] += 1
        out = emb.weight.index_select(0, ids)
        uniq, inv = torch.unique(ids, return_inverse=True)
        grad = torch.zeros(len(uniq), dim, device=device).index_add_(0, inv, torch.ones_like(out) * 1e-3)
        acc[uniq] += grad.pow(2).mean(1)
        with torch.no_grad():
            emb.weight[uniq] -= 0.01 * grad / (acc[uniq].sqrt() + 1e-8).unsqueeze(1)

    # ---- ours
    cache_rows = int(n_rows * cache_ratio) if device.type == "cuda" else 0
    table = EmbeddingTable(TableConfig("bench", dim, gpu_cache_rows=cache_rows), device)
    table.load_rows(keys_by_rank, torch.randn(n_rows, dim, generator=gen) * 0.01)
    clock = [0]

    def ours_lookup():
        clock[0] += 1
        return table.find(id_batches[clock[0] % 8], now_ms=clock[0])

    def ours_update():
        clock[0] += 1
        pulled = table.find_or_insert(id_batches[clock[0] % 8], now_ms=clock[0])
        out = pulled.embeddings()
        grad = torch.zeros_like(pulled.rows).index_add_(0, pulled.inverse, torch.ones_like(out) * 1e-3)
        table.apply_gradients(pulled, grad)

    for _ in range(8):  # one pass over every batch: steady state (and a warm allocator)
        ours_update()
        ours_lookup()
    table.stats.update(lookups=0, cache_hits=0)
    results = {}
    for name, fn in (("baseline_lookup", base_lookup), ("baseline_lookup_update", base_update),
                     ("ours_lookup", ours_lookup), ("ours_lookup_update", ours_update)):
        seconds = timeit(fn, device, repeat)
        results[name] = {"seconds_per_batch": seconds, "ids_per_s": batch / seconds, "gb_per_s": batch * dim * 4 / seconds / 1e9,
                         "table_stats_after": dict(table.stats)}
    unique_share = float(torch.cat([torch.unique(b).float() for b in batches]).numel()) / (8 * batch)
    hit_rate = table.stats["cache_hits"] / max(1, table.stats["lookups"])
    return {
        "rows": n_rows, "dim": dim, "batch": batch, "zipf_alpha": alpha, "cache_ratio": cache_ratio if cache_rows else None,
        "unique_ids_per_batch_share": unique_share, "top_tier_hit_rate": hit_rate,
        "results": results,
        "ratio_lookup": results["ours_lookup"]["ids_per_s"] / results["baseline_lookup"]["ids_per_s"],
        "ratio_lookup_update": results["ours_lookup_update"]["ids_per_s"] / results["baseline_lookup_update"]["ids_per_s"],
    }


def bench_snapshot(n_touched: int, dim: int, device: torch.device) -> dict:
    """How long ``EmbeddingCollection.snapshot("delta")`` (the part of a publish that stalls
    training) takes for ``n_touched`` touched rows. Baseline: copying the same number of
    rows out of a dense tensor with one ``index_select`` (the least any snapshot must do)."""
    from streamrec.embedding.collection import EmbeddingCollection

    gen = torch.Generator().manual_seed(1)
    keys = torch.randint(1, 2**62, (n_touched,), generator=gen)
    cache_rows = n_touched if device.type == "cuda" else 0
    store = EmbeddingCollection([TableConfig("t", dim, gpu_cache_rows=cache_rows)], device)
    table = store["t"]
    for lo in range(0, n_touched, 262144):  # touch every row through the training path
        pulled = table.find_or_insert(keys[lo : lo + 262144].to(device), now_ms=1)
        table.apply_gradients(pulled, torch.zeros_like(pulled.rows))
    sync(device)
    t0 = time.perf_counter()
    snap = store.snapshot("delta")
    sync(device)
    seconds = time.perf_counter() - t0
    dense = torch.randn(n_touched, dim, device=device)
    idx = torch.randperm(n_touched, device=device)
    base = timeit(lambda: dense.index_select(0, idx).cpu(), device, 3)
    assert len(snap["t"].keys) == n_touched
    return {"touched_rows": n_touched, "dim": dim, "snapshot_s": seconds, "baseline_copy_s": base,
            "ms_per_million_rows": seconds * 1e3 / (n_touched / 1e6), "ratio_vs_copy": seconds / base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", help="table sizes (default 100000 1000000; --ssd: 50000000)")
    parser.add_argument("--dim", type=int, help="row width (default 64; --ssd: 16)")
    parser.add_argument("--batch", type=int, default=65536, help="ids per lookup and update (default: %(default)s)")
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--cache-ratios", type=float, nargs="+", default=[1.0, 0.05])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu | cuda[:N] (default: %(default)s, CUDA when present)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = per-core figures)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--snapshot-rows", type=int, default=1_000_000, help="touched rows for the publish-snapshot timing (0: skip)")
    parser.add_argument("--out", default="var/bench", help="directory of the JSON result (default: ./var/bench, under the current directory)")
    parser.add_argument("--ssd", action="store_true", help="benchmark the SSD tier at scale (see above)")
    parser.add_argument("--dram-gib", type=float, default=1.0, help="--ssd: the DRAM budget")
    parser.add_argument("--batches", type=int, default=50, help="--ssd: timed lookup batches")
    parser.add_argument("--chunk", type=int, default=1 << 16, help="--ssd: rows per load_rows call")
    parser.add_argument("--work-dir", default="var/bench/ssd-work", help="--ssd: RocksDB and checkpoint files (deleted after)")
    parser.add_argument("--no-restore", action="store_true", help="--ssd: skip timing the restore of the checkpoint")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.ssd:
        from ps_ssd import bench_ssd, report  # noqa: PLC0415 - bench/ is on sys.path

        rows, dim = (args.rows or [50_000_000])[0], args.dim or 16
        result = bench_ssd(rows, dim, args.dram_gib, args.batch, args.batches, args.alpha, args.chunk, Path(args.work_dir),
                           not args.no_restore, zipf_ranks)
        report(result)
        write_result(args.out, "ps-ssd", {"bench": "ps-ssd", "device": "cpu", "threads": args.threads, "python": platform.python_version(),
                                         "torch": torch.__version__, "machine": platform.platform(), **result})
        return
    args.rows, args.dim = args.rows or [100_000, 1_000_000], args.dim or 64
    device = torch.device(args.device)
    runs = []
    ratios = args.cache_ratios if device.type == "cuda" else [1.0]
    for n_rows in args.rows:
        for ratio in ratios:
            try:
                run = bench_one(n_rows, args.dim, args.batch, args.alpha, ratio, device, args.repeat)
            except RuntimeError as exc:  # e.g. a cache smaller than one batch's unique ids
                print(f"rows={n_rows:>9,} cache={ratio}: skipped ({exc})", flush=True)
                runs.append({"rows": n_rows, "cache_ratio": ratio, "batch": args.batch, "skipped": str(exc)})
                continue
            runs.append(run)
            r = run["results"]
            print(f"rows={n_rows:>9,} cache={ratio if device.type == 'cuda' else '-'}: "
                  f"lookup {r['ours_lookup']['ids_per_s'] / 1e6:7.2f} M ids/s {r['ours_lookup']['gb_per_s']:7.2f} GB/s "
                  f"(baseline {r['baseline_lookup']['gb_per_s']:7.2f} GB/s, {run['ratio_lookup']:.2f}x) | "
                  f"+update {r['ours_lookup_update']['ids_per_s'] / 1e6:7.2f} M ids/s ({run['ratio_lookup_update']:.2f}x) | "
                  f"hit rate {run['top_tier_hit_rate']:.3f} fused {r['ours_lookup']['table_stats_after']['fused_hits']:,}", flush=True)
    snapshot = bench_snapshot(args.snapshot_rows, args.dim, device) if args.snapshot_rows else None
    if snapshot:
        print(f"publish snapshot of {snapshot['touched_rows']:,} touched rows: {snapshot['snapshot_s'] * 1e3:.0f} ms "
              f"({snapshot['ms_per_million_rows']:.0f} ms per million; a bare copy of the same rows: "
              f"{snapshot['baseline_copy_s'] * 1e3:.0f} ms, {snapshot['ratio_vs_copy']:.1f}x)", flush=True)
    info = {"bench": "ps", "device": str(device), "snapshot": snapshot, "threads": args.threads, "python": platform.python_version(),
            "torch": torch.__version__, "machine": platform.platform(),
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "runs": runs}
    write_result(args.out, f"ps-{device.type}", info)


if __name__ == "__main__":
    main()
