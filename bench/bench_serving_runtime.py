"""The serving runtime in process: shape buckets (CUDA graphs / torch.compile) and worker streams.

No HTTP here (bench_serving.py measures that), so the model runtime's own cost is
visible. For every mode (``serving.compile``) the same version of a trained model scores
the same pre-built batches (decoding excluded) and is compared with the **baseline**:
``InferenceModel`` without a runtime, i.e. the trainer's eager PyTorch path (one table
lookup host sync per table, eager forward).

Per mode it reports: build time and memory of the buckets at load; the largest score
difference from the baseline over every batch size (the exactness of padding); the
latency of one batch end to end (lookups + forward + copy to host) and the device time of
the forward alone (CUDA events around the graph replay), so the Python/launch overhead
is visible; and an out-of-bucket batch: answered eagerly at once, then from the bucket
built for it in the background.

Multi-stream: W threads each send batches continuously to one runner with W workers
(streams) — small mixed-size batches, where one stream leaves the GPU idle between
launches, and large batches, where one stream already fills it.

Usage: streamrec bench serving_runtime --model-store STORE [--samples RUN] [--device cuda]
       [--modes eager graph compile compile+graph] [--seconds 2]
Writes var/bench/serving-runtime-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from bench_trainer import make_samples  # bench/ is on sys.path (script dir; `streamrec bench` adds it)
from output import write_result
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.modelstore.store import ModelStore
from streamrec.serving.runtime.runner import RuntimeConfig
from streamrec.serving.runtime.version import ServedVersion
from streamrec.plumbing.config import load_config
from streamrec.model.batch import SampleBatch, batch_from_table
from streamrec.model.inference import InferenceModel
from streamrec.trainer.sources import sample_files

REPO = Path(__file__).resolve().parent.parent
BATCH_SIZES = (1, 16, 64, 256, 1024)
OUT_OF_BUCKET = 1500


def batches(table, sizes, start: int = 0) -> dict[int, SampleBatch]:
    out, offset = {}, start
    for n in sizes:
        out[n] = batch_from_table(table.slice(offset, n), FeatureSpec(), 50, with_labels=False)
        offset += n
    return out


def run_clients(client, n: int) -> float:
    """Run ``client(k)`` on ``n`` threads at once; seconds until the last one returns."""
    threads = [threading.Thread(target=client, args=(k,)) for k in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def timed(fn, seconds: float, min_runs: int = 5) -> np.ndarray:
    times, stop = [], time.perf_counter() + seconds
    while time.perf_counter() < stop or len(times) < min_runs:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return np.array(times) * 1000


def served(store: ModelStore, mode: str | None, device: str, workers: int) -> ServedVersion:
    """The latest version as a serving node runs it: ``mode`` (None: eager, no runner), the
    other runner settings from the defaults."""
    runtime = None if mode is None else replace(RuntimeConfig.from_serving(load_config(environ={}).serving), mode=mode, workers=workers)
    return ServedVersion.load(store, None, torch.device(device), 1_000_000, runtime)


def device_ms(model: ServedVersion, before: dict) -> dict:
    """Mean forward device time per batch since ``before`` ({bucket: (batches, device_s)}), by bucket."""
    out = {}
    for bucket, s in model.runner.stats.buckets.items():
        batches, device_s = before.get(bucket, (0, 0.0))
        if s.batches > batches:
            out[str(bucket)] = round(1000 * (s.device_s - device_s) / (s.batches - batches), 4)
    return out


def bucket_counters(model: ServedVersion) -> dict:
    return {b: (s.batches, s.device_s) for b, s in model.runner.stats.buckets.items()} if model.runner is not None else {}


def measure_mode(store: ModelStore, mode: str | None, device: str, data: dict[int, SampleBatch], reference: dict[int, np.ndarray],
                 seconds: float, workers: int) -> dict:
    t0 = time.perf_counter()
    model = served(store, mode, device, workers)
    load_s = time.perf_counter() - t0
    row: dict = {"mode": mode or "baseline (eager, no runtime)", "load_s": round(load_s, 3)}
    if model.runner is not None:
        stats = model.runner.stats.as_json()
        row.update(buckets=stats["compiled_buckets"], build_s=stats["build_s"], memory_mb=round(stats["memory_bytes"] / 2**20, 1))
    # (the out-of-bucket batch last: its background build would slow the other measurements)
    row["max_abs_diff"] = float(max(np.abs(model.predict(b, 1) - reference[n]).max() for n, b in data.items() if n != OUT_OF_BUCKET))
    row["latency"] = {}
    for n, b in data.items():
        if n == OUT_OF_BUCKET:
            continue
        before = bucket_counters(model)
        ms = timed(lambda: model.predict(b, 1), seconds)
        entry = {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
                 "instances_per_s": round(n / (float(np.mean(ms)) / 1000))}
        if model.runner is not None:
            entry["device_ms"] = device_ms(model, before)
        row["latency"][n] = entry
    if model.runner is not None and model.runner.mode != "eager":
        # out of every bucket: eager now, its own bucket from the background builder
        big = data[OUT_OF_BUCKET]
        t_first = timed(lambda: model.predict(big, 1), 0, 1)[0]
        deadline = time.monotonic() + 300
        while model.runner.stats.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        built = {k: v for k, v in model.runner.stats.as_json()["buckets"].items() if v["origin"] == "async"}
        ms = timed(lambda: model.predict(big, 1), seconds)
        row["out_of_bucket"] = {"rows": OUT_OF_BUCKET, "first_ms (eager)": round(float(t_first), 3), "built": built,
                                "then_p50_ms": round(float(np.percentile(ms, 50)), 3),
                                "max_abs_diff": float(np.abs(model.predict(big, 1) - reference[OUT_OF_BUCKET]).max())}
    model.close()
    return row


def measure_streams(store: ModelStore, mode: str, device: str, table, seconds: float, workers: int, sizes: tuple[int, ...]) -> dict:
    model = served(store, mode, device, workers)
    data = [batches(table, sizes, start=k * 5000) for k in range(workers)]
    counts = [0] * workers
    stop = time.perf_counter() + seconds

    def client(k: int) -> None:
        i = 0
        while time.perf_counter() < stop:
            n = sizes[i % len(sizes)]
            model.predict(data[k][n], 1)
            counts[k] += n
            i += 1

    for k in range(workers):  # warm-up
        for b in data[k].values():
            model.predict(b, 1)
    elapsed = run_clients(client, workers)
    model.close()
    return {"workers": workers, "batch_sizes": list(sizes), "instances_per_s": round(sum(counts) / elapsed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-store", help="a model store with a trained ctr model (default: train one on --samples)")
    parser.add_argument("--samples", help="a `pipeline offline` run dir or samples.parquet (default: generate one)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda[:N]: where the served model runs (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", help="serving.compile modes (default: eager graph compile compile+graph on CUDA, eager compile on CPU)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="worker counts for the multi-stream part")
    parser.add_argument("--out", default="var/bench", help="directory of the JSON result (default: ./var/bench, under the current directory)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    modes = args.modes or (["eager", "graph", "compile", "compile+graph"] if cuda else ["eager", "compile"])
    if args.samples is None:
        args.samples = make_samples(Path(tempfile.mkdtemp(prefix="streamrec-bench-")) / "run")
    sample_path = sample_files([args.samples])[0]
    if args.model_store is None:
        args.model_store = tempfile.mkdtemp(prefix="streamrec-bench-store-")
        print(f"training a model on 50k samples into {args.model_store} ...", flush=True)
        subprocess.run([sys.executable, "-m", "streamrec.cli", "train", "--samples", str(sample_path), "--model-store", args.model_store,
                        "--work-dir", str(Path(args.model_store) / "work"), "--max-samples", "50000", "--no-frozen", "--device", "cpu"],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    store = ModelStore(args.model_store, "ctr")
    table = pq.read_table(sample_path).slice(60_000, 40_000).drop(["label", "click_ts"])
    data = batches(table, BATCH_SIZES + (OUT_OF_BUCKET,))
    result = {"bench": "serving-runtime", "device": args.device, "gpu": torch.cuda.get_device_name() if cuda else None,
              "torch": torch.__version__, "host": platform.node(), "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "seconds": args.seconds, "modes": []}
    baseline_model = InferenceModel.load(store, None, args.device)
    reference = {n: baseline_model.predict(b, 1) for n, b in data.items()}
    baseline_model.close()
    for mode in [None, *modes]:
        row = measure_mode(store, mode, args.device, data, reference, args.seconds, workers=1)
        result["modes"].append(row)
        lat = "  ".join(f"b{n}: {e['p50_ms']:.2f}/{e['p99_ms']:.2f} ms" + (f" (dev {sum(e['device_ms'].values()):.3f})" if e.get("device_ms") else "")
                        for n, e in row["latency"].items())
        print(f"{row['mode']:28s} load {row['load_s']:6.2f} s  diff {row['max_abs_diff']:.1e}  {lat}", flush=True)
        if "out_of_bucket" in row:
            o = row["out_of_bucket"]
            print(f"{'':28s} out-of-bucket {o['rows']} rows: first {o['first_ms (eager)']:.1f} ms (eager), then {o['then_p50_ms']:.2f} ms "
                  f"from {list(o['built'])}", flush=True)
    base = result["modes"][0]["latency"]
    for row in result["modes"][1:]:
        row["speedup_p50"] = {n: round(base[n]["p50_ms"] / e["p50_ms"], 2) for n, e in row["latency"].items()}
    stream_mode = "graph" if cuda else "compile"
    result["streams"] = []
    for sizes in ((4, 16, 8, 32, 1, 64), (1024,)):
        for w in args.workers:
            row = measure_streams(store, stream_mode, args.device, table, args.seconds, w, sizes)
            result["streams"].append(row)
            print(f"streams ({stream_mode}) workers {w} batches {sizes}: {row['instances_per_s']:,} instances/s", flush=True)
    write_result(args.out, f"serving-runtime-{args.device.split(':')[0]}", result)


if __name__ == "__main__":
    main()
