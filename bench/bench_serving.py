"""Serving over HTTP: QPS and latency vs concurrency, with and without request aggregation.

A model is trained on the first 50k samples (`streamrec train`), then two `streamrec serve`
processes serve it on the same device:
- ours: request aggregation (``max_batch`` 1024 instances, ``max_delay_us`` 2000), 2 workers
  (each on its own CUDA stream), shape buckets (``--compile``, default auto: CUDA graphs
  on CUDA, eager on CPU);
- baseline: the same model in eager PyTorch with one request per batch per worker
  (``max_batch`` 1, ``max_delay_us`` 0, 2 workers, ``serving.compile=eager``) — what a
  plain model server does.
Closed-loop clients (threads with keep-alive connections) send requests of
``--instances`` samples each for ``--seconds`` per concurrency level. The server's own
runtime statistics (device time per batch by bucket) are saved next to the end-to-end
numbers, so the share of the HTTP/Python path is visible; bench_serving_runtime.py
measures the runtime without HTTP.

Usage: python bench/bench_serving.py [--samples RUN] [--concurrency 1 8 32] [--instances 16] [--seconds 5] [--device cpu]
Writes bench/out/serving-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq

from bench_trainer import make_samples  # bench/ is on sys.path (script dir; `streamrec bench` adds it)
from output import write_result
from trainer.sources import sample_files

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(store: Path, device: str, max_batch: int, max_delay_us: int, workers: int, compile_mode: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {**os.environ, "STREAMREC_SERVING__MAX_BATCH": str(max_batch), "STREAMREC_SERVING__MAX_DELAY_US": str(max_delay_us),
           "STREAMREC_SERVING__WORKERS": str(workers), "STREAMREC_SERVING__MAX_INSTANCES": "100000",
           "STREAMREC_SERVING__COMPILE": compile_mode, "STREAMREC_SERVING__FOLLOW_UPDATES": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(store), "--port", str(port),
                             "--device", device], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600  # buckets are compiled before the server is ready
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become ready")


def run_clients(client, n: int) -> float:
    """Run ``client(k)`` on ``n`` threads at once; seconds until the last one returns."""
    threads = [threading.Thread(target=client, args=(k,)) for k in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def load(port: int, bodies: list[bytes], concurrency: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        mine, i = [], k
        while time.monotonic() < stop:
            body = bodies[i % len(bodies)]
            i += concurrency
            t0 = time.perf_counter()
            conn.request("POST", "/v1/models/ctr:predict", body=body, headers={"content-type": "application/json"})
            response = conn.getresponse()
            response.read()
            if response.status == 200:
                mine.append(time.perf_counter() - t0)
            else:
                errors[0] += 1
        with lock:
            latencies.extend(mine)

    elapsed = run_clients(client, concurrency)
    lat = np.array(latencies) * 1000
    return {"concurrency": concurrency, "requests": len(lat), "errors": errors[0], "qps": len(lat) / elapsed,
            "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None, "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", help="a `pipeline offline` run dir or samples.parquet (default: generate one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--instances", type=int, default=16, help="instances per request")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--compile", default="auto", help="serving.compile of ours (auto | eager | compile | graph | compile+graph)")
    parser.add_argument("--out", default=str(REPO / "bench" / "out"))
    args = parser.parse_args()
    if args.samples is None:
        args.samples = make_samples(Path(tempfile.mkdtemp(prefix="streamrec-bench-")) / "run")
    table = pq.read_table(sample_files([args.samples])[0]).slice(0, 200 * args.instances).drop(["label", "click_ts"])
    rows = table.to_pylist()
    bodies = [orjson.dumps({"instances": rows[i: i + args.instances]}) for i in range(0, len(rows), args.instances)]
    result = {"bench": "serving", "device": args.device, "instances_per_request": args.instances, "seconds": args.seconds,
              "workers": args.workers, "compile": args.compile, "host": platform.node(), "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with tempfile.TemporaryDirectory() as tmp:
        # A real model trained on the same samples, so requests hit existing rows as in production.
        subprocess.run([sys.executable, "-m", "streamrec.cli", "train", "--samples", args.samples, "--model-store", tmp,
                        "--work-dir", str(Path(tmp) / "work"), "--max-samples", "50000", "--no-frozen", "--device", args.device],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name, (max_batch, delay, mode) in {"ours": (1024, 2000, args.compile), "baseline": (1, 0, "eager")}.items():
            proc, port = start_server(Path(tmp), args.device, max_batch, delay, args.workers, mode)
            try:
                load(port, bodies, 4, 1.0)  # warm-up
                result[name] = [load(port, bodies, c, args.seconds) for c in args.concurrency]
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("GET", "/v1/models/ctr")
                result[f"{name}_runtime"] = orjson.loads(conn.getresponse().read()).get("runtime")
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            for row in result[name]:
                print(f"{name:9s} concurrency {row['concurrency']:3d}: {row['qps']:8.1f} req/s "
                      f"({row['qps'] * args.instances:9.0f} instances/s)  p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms  "
                      f"errors {row['errors']}", flush=True)
    best = {name: max(result[name], key=lambda r: r["qps"]) for name in ("ours", "baseline")}
    result["best_qps_ratio"] = best["ours"]["qps"] / best["baseline"]["qps"]
    print(f"best throughput: ours {best['ours']['qps']:.1f} req/s vs baseline {best['baseline']['qps']:.1f} "
          f"({result['best_qps_ratio']:.2f}x)")
    write_result(args.out, f"serving-{args.device.split(':')[0]}", result)


if __name__ == "__main__":
    main()
