"""The sharded exchange's layout of a step's ids (``embedding.sharded.layout_on_host``, run by
each rank's sample reader): its host time per batch, the keys and bytes that then cross
ranks each step, and how evenly the owners are loaded.

Ours: each table's distinct ids (a hash de-duplication per table), each key sent once to
its owner; the requester gives every input id its key's row back. Baseline, same run, same
batches: every id sent to its owner as it is (one stable sort by (owner, table), the plain
way), the owner de-duplicating. Consecutive batches of the file stand for the ranks' batches
of one step (weak scaling, ``--batch`` samples per rank).

Bytes per step and rank are what leaves the rank for the others: int64 ids out, then the
float32 rows back and their gradients out (``--dim`` wide), one per key (ours) or per id
(baseline). Imbalance: the keys the busiest owner receives in a step over the mean, averaged
over steps.

Usage: python bench/bench_exchange_layout.py [--samples RUN_DIR|samples.parquet] [--world 2 4 8] [--steps 40]
Writes var/bench/exchange-layout-<time>.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from output import write_result  # noqa: E402

from streamrec.embedding.sharded import layout_on_host, owner_of  # noqa: E402
from streamrec.model.batch import batch_from_table  # noqa: E402
from streamrec.model.sparse import SparseFeatures  # noqa: E402
from streamrec.plumbing.config import load_config  # noqa: E402
from streamrec.trainer.sources import sample_files  # noqa: E402


def every_id_layout(ids: dict[str, torch.Tensor], world: int) -> tuple[np.ndarray, list[int]]:
    """The baseline: every id in (owner, table) order, with the counts per (owner, table)."""
    flat = [ids[n].reshape(-1).numpy() for n in ids]
    keys = np.concatenate(flat)
    code = owner_of(keys, world) * len(flat) + np.repeat(np.arange(len(flat)), [len(f) for f in flat])
    order = np.argsort(code.astype(np.uint8 if world * len(flat) <= 256 else np.int32), kind="stable")
    return keys[order], np.bincount(code, minlength=world * len(flat)).tolist()


def measure(batches: list[dict[str, torch.Tensor]], world: int, dim: int, layout) -> dict:
    """Host ms per batch of ``layout`` (ids, world -> counts per (owner, table)), and per step
    the keys sent, the bytes leaving a rank and the owners' imbalance."""
    for ids in batches[:3]:
        layout(ids, world)
    started = time.perf_counter()
    counts = [layout(ids, world) for ids in batches]
    ms = 1e3 * (time.perf_counter() - started) / len(batches)
    tables = len(batches[0])
    sent, off_rank, imbalance = [], [], []
    for step in range(len(batches) // world):
        per_owner = np.zeros(world)
        for rank in range(world):
            by_owner = np.asarray(counts[step * world + rank]).reshape(world, tables).sum(1)
            per_owner += by_owner
            sent.append(by_owner.sum())
            off_rank.append(by_owner.sum() - by_owner[rank])
        imbalance.append(per_owner.max() / per_owner.mean())
    keys_off = float(np.mean(off_rank))
    return {"host_ms_per_batch": ms, "keys_sent_per_step": float(np.mean(sent)),
            "bytes_out_per_step": {"ids": 8 * keys_off, "rows": 4 * dim * keys_off, "grads": 4 * dim * keys_off},
            "owner_imbalance": float(np.mean(imbalance))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", help="a `pipeline offline` run dir or sample file (default: 60 s of generated traffic)")
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batch", type=int, default=4096, help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="var/bench")
    args = parser.parse_args()
    cfg = load_config()
    spec, dim = cfg.features, cfg.model.embedding_dim
    with tempfile.TemporaryDirectory() as tmp:
        if args.samples is None:
            from bench_trainer import make_samples

            args.samples = make_samples(Path(tmp) / "run")
        table = pq.read_table([str(f) for f in sample_files([args.samples])][0])
    n = min(args.steps * max(args.world), table.num_rows // args.batch)
    batches = [SparseFeatures.table_ids(batch_from_table(table.slice(i * args.batch, args.batch), spec, cfg.model.history_len))
               for i in range(n)]
    result = {"bench": "exchange-layout", "batch": args.batch, "dim": dim, "samples": args.samples,
              "ids_per_batch": float(np.mean([sum(len(t) for t in b.values()) for b in batches])), "worlds": []}
    print(f"{len(batches)} batches of {args.batch} samples, {result['ids_per_batch']:,.0f} ids each, rows of {dim} floats")
    for world in args.world:
        if len(batches) < world:
            continue
        ours = measure(batches, world, dim, lambda ids, w: layout_on_host(ids, w).send_counts)
        base = measure(batches, world, dim, lambda ids, w: every_id_layout(ids, w)[1])
        bytes_ours, bytes_base = (sum(r["bytes_out_per_step"].values()) for r in (ours, base))
        row = {"world": world, "ours": ours, "baseline": base, "bytes_base_over_ours": bytes_base / bytes_ours,
               "host_ms_base_over_ours": base["host_ms_per_batch"] / ours["host_ms_per_batch"]}
        result["worlds"].append(row)
        print(f"world {world}: keys sent per rank-step {ours['keys_sent_per_step']:,.0f} (every id: {base['keys_sent_per_step']:,.0f}); "
              f"KiB out per rank-step {bytes_ours / 1024:,.0f} (every id: {bytes_base / 1024:,.0f}, {row['bytes_base_over_ours']:.1f}x); "
              f"owner imbalance {ours['owner_imbalance']:.3f} ({base['owner_imbalance']:.3f}); host ms per batch "
              f"{ours['host_ms_per_batch']:.2f} ({base['host_ms_per_batch']:.2f}, {row['host_ms_base_over_ours']:.2f}x)", flush=True)
    write_result(args.out, "exchange-layout", result)


if __name__ == "__main__":
    main()
