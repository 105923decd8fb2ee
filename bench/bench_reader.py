"""The trainer's sample reader: what a batch costs the training thread, and how fast the
reader hands batches over, for one rank's share of a sample file and for a share of several
ranks (every N-th stripe, each batch's ids laid out for the exchange), against the same
work done in the training thread.

Ours: ``trainer.reader.SampleReader``, the process the trainer reads through (the chunks
read and checked by one thread, batched and laid out by another, handed over in shared
slots). The consumer takes a batch (and, with ``--device cuda``, queues its copy to the GPU,
as a step does), then keeps its core busy for ``--step-ms`` as a training step would, then
takes the next: the take's time is what a batch costs the training thread at that step
time (waiting included, where the reader falls behind). ``--step-ms 0`` measures the
reader's full rate instead. Baseline, same run: the same stages (decode, the rank's
stripes, checks, ``batch_from_table``, the layout) one after another in the consumer's own
thread, as a trainer without a reader process runs them, with one torch thread:
all of it is the training thread's. Both loop over the file; the first ``--warmup`` batches are left out.

A reader slower than a rank's step makes that rank wait, and every other rank with it
(bench/RESULTS.md, "Trainer scaling"). The reader process needs cores beside the training
thread's: on a box with two, the two compete.

Usage: python bench/bench_reader.py [--samples RUN_DIR|samples.parquet] [--ranks 1 2] [--step-ms 0 8] [--batches 300] [--device cpu]
Writes var/bench/reader-<time>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from output import write_result  # noqa: E402

from streamrec.embedding.sharded import layout_on_host  # noqa: E402
from streamrec.model.batch import SampleBatch, batch_from_table, dense_feature_names  # noqa: E402
from streamrec.model.sparse import SparseFeatures  # noqa: E402
from streamrec.plumbing.config import load_config  # noqa: E402
from streamrec.trainer.reader import SampleReader  # noqa: E402
from streamrec.trainer.reader_process import ReaderSettings, SourceSpec  # noqa: E402

# the baseline's few torch operations (a batch's tensors wrapped, its ids concatenated) get one
# thread: the reader process runs none, and more would only spin on the training thread's cores
BASELINE_TORCH_THREADS = 1
from streamrec.trainer.sources import FileSampleSource, sample_files  # noqa: E402


def ours(files: list[str], spec, ranks: int, batch: int, batches: int, warmup: int, device: torch.device, step_ms: float) -> dict:
    """The reader process, a batch taken every ``step_ms`` of busy work (0: as fast as they
    come): ms per batch, and what each take cost the consumer."""
    settings = ReaderSettings(batch, spec.history_len, 4, None, ranks if ranks > 1 else None)
    reader = SampleReader(SourceSpec(files=files, loop=True, shard=(0, ranks)), spec, settings, device,
                          len(dense_feature_names(spec))).start()
    waits, taken, started = [], 0, 0.0
    try:
        while taken < warmup + batches:
            t0 = time.perf_counter()
            item = reader.get(timeout=None)
            if not isinstance(item, SampleBatch):
                continue
            item.to(device, non_blocking=True)
            waits.append(time.perf_counter() - t0)
            taken += 1
            until = time.perf_counter() + step_ms / 1e3
            while time.perf_counter() < until:  # the step: this core stays busy
                pass
            if taken == warmup:
                started = time.perf_counter()
        elapsed = time.perf_counter() - started
    finally:
        reader.stop()
    waits = sorted(waits[warmup:])
    return {"step_ms": step_ms, "ms_per_batch": 1e3 * elapsed / batches, "take_ms_mean": 1e3 * statistics.fmean(waits),
            "take_ms_p50": 1e3 * statistics.median(waits), "take_ms_p90": 1e3 * waits[int(0.9 * len(waits))]}


def in_thread(files: list[str], spec, ranks: int, batch: int, batches: int, warmup: int) -> dict:
    """The same stages in this thread, one after another (``BASELINE_TORCH_THREADS``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(BASELINE_TORCH_THREADS)
    try:
        return _in_thread(files, spec, ranks, batch, batches, warmup)
    finally:
        torch.set_num_threads(threads)


def _in_thread(files: list[str], spec, ranks: int, batch: int, batches: int, warmup: int) -> dict:
    chunks = FileSampleSource(files, spec, None, loop=True, shard=(0, ranks)).chunks()
    buffered: list[pa.Table] = []
    rows = made = 0
    started = 0.0
    while made < warmup + batches:
        chunk = next(chunks)
        buffered.append(chunk.table)
        rows += chunk.table.num_rows
        while rows >= batch and made < warmup + batches:
            table = pa.concat_tables(buffered)
            sample_batch = batch_from_table(table.slice(0, batch), spec, spec.history_len)
            if ranks > 1:
                layout_on_host(SparseFeatures.table_ids(sample_batch), ranks)
            buffered, rows, made = [table.slice(batch)], rows - batch, made + 1
            if made == warmup:
                started = time.perf_counter()
    return {"ms_per_batch": 1e3 * (time.perf_counter() - started) / batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", help="a `pipeline offline` run dir or sample file (default: 60 s of generated traffic)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="the share of rank 0 of this many ranks")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 8.0],
                        help="busy ms between takes (0: full rate); 8 is about a 2-rank step on the GPUs measured")
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="var/bench")
    args = parser.parse_args()
    spec = load_config().features
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        if args.samples is None:
            from bench_trainer import make_samples

            args.samples = make_samples(Path(tmp) / "run")
        files = [str(f) for f in sample_files([args.samples])]
        result = {"bench": "reader", "batch": args.batch, "batches": args.batches, "warmup": args.warmup, "device": str(device),
                  "samples": args.samples, "shares": []}
        for ranks in args.ranks:
            print(f"rank 0 of {ranks}: the same work in this thread, then the reader process ...", flush=True)
            share = {"ranks": ranks, "in_thread": in_thread(files, spec, ranks, args.batch, args.batches, args.warmup), "ours": []}
            base = share["in_thread"]["ms_per_batch"]
            print(f"  in the training thread: {base:.2f} ms of its time per batch", flush=True)
            for step_ms in args.step_ms:
                o = ours(files, spec, ranks, args.batch, args.batches, args.warmup, device, step_ms)
                o["in_thread_over_take"] = base / o["take_ms_mean"]
                share["ours"].append(o)
                print(f"  reader process, {'full rate' if not step_ms else f'a batch every {step_ms:g} ms step'}: "
                      f"{o['ms_per_batch']:.2f} ms/batch; a take costs the training thread {o['take_ms_mean']:.2f} ms "
                      f"(p50 {o['take_ms_p50']:.2f}, p90 {o['take_ms_p90']:.2f}); the work in the thread / a take: "
                      f"{o['in_thread_over_take']:.2f}x", flush=True)
            result["shares"].append(share)
    write_result(args.out, "reader", result)


if __name__ == "__main__":
    main()
