"""Serving at twice its capacity: a bounded queue with deadlines against an unbounded one.

A model is trained on the first 50k samples, then one `streamrec serve` configuration at a time:
- baseline: the same server with shedding off (``max_queue_instances`` and
  ``queue_timeout_ms`` effectively infinite): a FIFO queue that grows without bound, what a
  server without admission control does;
- ours: ``serving.queue_timeout_ms`` = ``--queue-ms`` and ``serving.max_queue_instances`` = the
  measured capacity (instances/s) x ``--queue-ms`` (at least one full batch): a queue that
  drains within the budget.

For each: the unloaded p99 (one closed-loop client), the capacity (the baseline only:
closed-loop clients at ``--capacity-concurrency``, requests/s), then an open-loop load at ``--overload`` x
that capacity for ``--seconds`` (Poisson arrivals on a fixed schedule; a request's latency counts
from its scheduled send time, so a client that falls behind does not hide the backlog).
Reported: p50/p99 of the accepted requests, the ratio of that p99 to the unloaded p99 (target:
at most 2), the share shed (429/503), and goodput (accepted requests/s). Both servers get the same
warm-up, the same front-end processes and the same load generator. The capacity used for both
overload runs is the baseline's, measured first.

With ``--mix`` (head-of-line blocking, issue 36) it measures mixed request sizes instead:
``--big-clients`` closed-loop clients send requests of ``--instances`` instances while
``--small-clients`` send requests of ``--small-instances``, all over the same ``--seconds``,
shedding off; the small requests' p50/p99 are reported apart from the big ones', next to their
p50/p99 alone (one client, nothing else). Ours: the batcher's fair order (small requests in the
next batch, streamrec/serving/runtime/batcher.py). Baseline: the same server with
``RequestBatcher.fair`` off (batches in arrival order only), set in its process by a
``sitecustomize`` module on its PYTHONPATH.

Usage: streamrec bench serving_overload [--samples RUN] [--instances 64] [--seconds 10] [--overload 2] [--device cpu]
       streamrec bench serving_overload --mix [--instances 200] [--big-clients 64] [--small-instances 4] [--small-clients 4]
Writes var/bench/serving-overload-<device>-<time>.json (``--mix``: serving-overload-mix-<device>-<time>.json).
"""

from __future__ import annotations

import argparse
import math
import http.client
import multiprocessing as mp
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

from bench_serving import _client_process, load, model_status, start_server  # bench/ is on sys.path
from bench_trainer import make_samples
from output import write_result
from streamrec.trainer.sources import sample_files

REPO = Path(__file__).resolve().parent.parent
UNBOUNDED = {"STREAMREC_SERVING__MAX_QUEUE_INSTANCES": str(10**12), "STREAMREC_SERVING__QUEUE_TIMEOUT_MS": str(10**9)}


def _open_loop_process(port: int, bodies: list[bytes], schedule: np.ndarray, threads: int, out) -> None:
    """Send one request at each scheduled time (seconds since the epoch) from a pool of
    keep-alive connections; report (scheduled time, status, seconds from schedule to answer,
    seconds from schedule to send: the generator's own lateness)."""
    results: list[tuple[float, int, float, float]] = []
    lock = threading.Lock()
    nxt = iter(range(len(schedule)))

    def sender() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                break
            wait = schedule[i] - time.time()
            if wait > 0:
                time.sleep(wait)
            sent = time.time()
            try:
                conn.request("POST", "/v1/models/ctr:predict", body=bodies[i % len(bodies)], headers={"content-type": "application/json"})
                response = conn.getresponse()
                response.read()
                status = response.status
            except OSError:
                status = 0
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            with lock:
                results.append((float(schedule[i]), status, time.time() - schedule[i], sent - schedule[i]))

    pool = [threading.Thread(target=sender) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    out.send(results)
    out.close()


def open_loop(port: int, bodies: list[bytes], rate: float, seconds: float, processes: int, threads: int) -> dict:
    """Poisson arrivals at ``rate`` requests/s for ``seconds``, split over ``processes``."""
    rng = np.random.default_rng(7)
    start = time.time() + 1.0
    times = start + np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 1.2)))
    times = times[times < start + seconds]
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for p in range(processes):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_open_loop_process, args=(port, bodies, times[p::processes], threads, send))
        proc.start()
        pipes.append(receive)
        procs.append(proc)
    rows = []
    for receive, proc in zip(pipes, procs):
        rows.extend(receive.recv())
        proc.join()
    status = np.array([r[1] for r in rows])
    latency_ms = np.array([r[2] for r in rows]) * 1000
    ok = latency_ms[status == 200]
    shed = int(np.isin(status, (429, 503)).sum())
    # over the time the answers took: a server that falls behind answers past the offered window
    span = max(max(r[0] + r[2] for r in rows) - start, seconds)
    return {"offered_rps": rate, "sent": len(rows), "accepted": int(len(ok)), "shed": shed, "errors": int(len(rows) - len(ok) - shed),
            "shed_share": shed / max(len(rows), 1), "answered_within_s": span, "goodput_rps": len(ok) / span,
            "send_lateness_p99_ms": float(np.percentile([r[3] * 1000 for r in rows], 99)),
            "by_status": {str(s): int((status == s).sum()) for s in np.unique(status)},
            "accepted_p50_ms": float(np.percentile(ok, 50)) if len(ok) else None,
            "accepted_p99_ms": float(np.percentile(ok, 99)) if len(ok) else None,
            "shed_p99_ms": float(np.percentile(latency_ms[np.isin(status, (429, 503))], 99)) if shed else None}


def measure(name: str, store: Path, args, bodies: list[bytes], extra_env: dict, capacity_rps: float | None) -> dict:
    """One server: warm-up, unloaded p99, capacity, then the open-loop overload."""
    proc, port = start_server(store, args.device, args.max_batch, args.max_delay_us, args.workers, args.compile, args.frontends,
                              extra_env={"STREAMREC_SERVING__MAX_INSTANCES": str(args.instances), **extra_env})
    try:
        load(port, bodies, 4, 2.0, args.client_processes)  # warm-up
        unloaded = load(port, bodies, 1, args.seconds, 1)
        capacity = load(port, bodies, args.capacity_concurrency, args.seconds, args.client_processes) if capacity_rps is None else None
        rate = args.overload * (capacity_rps or capacity["qps"])
        before = model_status(port)["batching"]
        overload = open_loop(port, bodies, rate, args.seconds, args.client_processes, args.threads)
        after = model_status(port)["batching"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    row = {"unloaded": unloaded, "capacity": capacity, "overload": overload,
           "server_shed": {k: after["shed"][k] - before["shed"][k] for k in after["shed"]},
           "p99_over_unloaded": (overload["accepted_p99_ms"] / unloaded["p99_ms"]) if overload["accepted_p99_ms"] else None}
    print(f"{name:8s} unloaded p99 {unloaded['p99_ms']:7.2f} ms | capacity {rate / args.overload:7.1f} req/s | at {rate:7.1f} req/s offered: "
          f"accepted {overload['accepted']} ({overload['goodput_rps']:.1f}/s) p50 {overload['accepted_p50_ms']:.1f} / p99 "
          f"{overload['accepted_p99_ms']:.1f} ms = {row['p99_over_unloaded']:.2f}x unloaded p99 (generator's own lateness p99 "
          f"{overload['send_lateness_p99_ms']:.1f} ms), shed {overload['shed_share']:.0%} "
          f"{row['server_shed']}, errors {overload['errors']}", flush=True)
    return row


def _latency(latencies: list[float], seconds: float) -> dict:
    """Requests/s and p50/p99 (ms) of one group's latencies (seconds)."""
    ms = np.array(latencies) * 1000
    return {"requests": len(ms), "qps": len(ms) / seconds, "p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
            "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None}


def mixed_load(port: int, groups: dict[str, tuple[list[bytes], int]], seconds: float, processes: int) -> dict:
    """Closed-loop clients of every group (bodies, clients) over the same window, each group's
    latencies apart (each group in load-generator processes of its own)."""
    ctx = mp.get_context("fork")
    start_at = time.time() + 0.5
    running = []
    for name, (bodies, clients) in groups.items():
        n = min(processes, clients)
        for p in range(n):
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_client_process, args=(port, bodies, list(range(p, clients, n)), clients, start_at, start_at + seconds, send))
            proc.start()
            running.append((name, receive, proc))
    latencies: dict[str, list[float]] = {name: [] for name in groups}
    errors = dict.fromkeys(groups, 0)
    for name, receive, proc in running:
        for lat, err in receive.recv():
            latencies[name].extend(lat)
            errors[name] += err
        proc.join()
    return {name: {"clients": groups[name][1], **_latency(latencies[name], seconds), "errors": errors[name]} for name in groups}


def measure_mix(name: str, store: Path, args, big: list[bytes], small: list[bytes], fifo_path: str | None) -> dict:
    """One server (``fifo_path``: a sitecustomize that turns the fair order off in it): warm-up,
    the small requests alone, then the mixed load."""
    env = {**UNBOUNDED, "STREAMREC_SERVING__MAX_INSTANCES": str(max(args.instances, args.small_instances))}
    if fifo_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [fifo_path, os.environ.get("PYTHONPATH")]))
    proc, port = start_server(store, args.device, args.max_batch, args.max_delay_us, args.workers, args.compile, args.frontends, extra_env=env)
    try:
        load(port, big, 4, 2.0, args.client_processes)  # warm-up
        load(port, small, 4, 2.0, args.client_processes)
        alone = load(port, small, 1, args.seconds, 1)
        before = model_status(port)["batching"]
        mixed = mixed_load(port, {"big": (big, args.big_clients), "small": (small, args.small_clients)}, args.seconds, args.client_processes)
        after = model_status(port)["batching"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    batches = after["batches"] - before["batches"]
    row = {"small_alone": alone, **mixed, "batches": batches, "rows_per_batch": (after["rows"] - before["rows"]) / max(batches, 1),
           "server_shed": {k: after["shed"][k] - before["shed"][k] for k in after["shed"]},
           "small_p50_over_alone": mixed["small"]["p50_ms"] / alone["p50_ms"]}
    print(f"{name:8s} small alone p50 {alone['p50_ms']:6.1f} / p99 {alone['p99_ms']:6.1f} ms | mixed: small p50 "
          f"{mixed['small']['p50_ms']:7.1f} / p99 {mixed['small']['p99_ms']:7.1f} ms ({mixed['small']['qps']:.1f} req/s), big p50 "
          f"{mixed['big']['p50_ms']:7.1f} / p99 {mixed['big']['p99_ms']:7.1f} ms ({mixed['big']['qps']:.1f} req/s), "
          f"{row['rows_per_batch']:.0f} instances per batch, errors {mixed['small']['errors'] + mixed['big']['errors']}", flush=True)
    return row


def run_mix(args, rows: list[dict], store: Path, result: dict) -> None:
    """``--mix``: the same mixed load against the arrival-order baseline, then ours."""
    big = [orjson.dumps({"instances": rows[i: i + args.instances]}) for i in range(0, len(rows) - args.instances + 1, args.instances)]
    small = [orjson.dumps({"instances": rows[i: i + args.small_instances]}) for i in range(0, 100 * args.small_instances, args.small_instances)]
    result.update({"mix": True, "max_batch": args.max_batch, "max_delay_us": args.max_delay_us, "big_clients": args.big_clients,
                   "small_clients": args.small_clients, "small_instances_per_request": args.small_instances})
    with tempfile.TemporaryDirectory() as fifo:
        Path(fifo, "sitecustomize.py").write_text("from streamrec.serving.runtime.batcher import RequestBatcher\n\n"
                                                  "RequestBatcher.fair = False\n")
        result["baseline"] = measure_mix("baseline", store, args, big, small, fifo)
    result["ours"] = measure_mix("ours", store, args, big, small, None)
    ours, base = result["ours"], result["baseline"]
    result["small_p50_ratio_vs_baseline"] = ours["small"]["p50_ms"] / base["small"]["p50_ms"]
    result["small_p99_ratio_vs_baseline"] = ours["small"]["p99_ms"] / base["small"]["p99_ms"]
    result["big_qps_ratio_vs_baseline"] = ours["big"]["qps"] / max(base["big"]["qps"], 1e-9)
    print(f"small requests among {args.big_clients} big clients: p50 {ours['small']['p50_ms']:.1f} ms (ours) vs "
          f"{base['small']['p50_ms']:.1f} ms (baseline), p99 {ours['small']['p99_ms']:.1f} vs {base['small']['p99_ms']:.1f} ms; "
          f"big requests' throughput {result['big_qps_ratio_vs_baseline']:.2f}x the baseline's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", help="a `pipeline offline` run dir or samples.parquet (default: generate one)")
    parser.add_argument("--instances", type=int, default=64, help="instances per request")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each measurement")
    parser.add_argument("--overload", type=float, default=2.0, help="offered load as a multiple of the measured capacity")
    parser.add_argument("--queue-ms", type=float, default=None,
                        help="ours' serving.queue_timeout_ms (default: the baseline's unloaded p99, at least max_delay_us + 1 ms); "
                             "the queue bound is capacity x this")
    parser.add_argument("--capacity-concurrency", type=int, default=64,
                        help="closed-loop clients that measure capacity (enough to keep a full batch queued while one runs)")
    parser.add_argument("--threads", type=int, default=64, help="connections per load-generator process in the open-loop run")
    parser.add_argument("--device", default="cpu", help="cpu | cuda[:N]: where the served model runs (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--frontends", type=int, default=0)
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--max-batch", type=int, default=1024)
    parser.add_argument("--max-delay-us", type=int, default=2000)
    parser.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--mix", action="store_true",
                        help="mixed request sizes (big and small closed-loop clients), arrival order vs fair order; see above")
    parser.add_argument("--big-clients", type=int, default=64, help="--mix: clients sending requests of --instances")
    parser.add_argument("--small-clients", type=int, default=4, help="--mix: clients sending requests of --small-instances")
    parser.add_argument("--small-instances", type=int, default=4, help="--mix: instances per small request")
    parser.add_argument("--out", default="var/bench", help="directory of the JSON result (default: ./var/bench, under the current directory)")
    args = parser.parse_args()
    if args.samples is None:
        args.samples = make_samples(Path(tempfile.mkdtemp(prefix="streamrec-bench-")) / "run")
    table = pq.read_table(sample_files([args.samples])[0]).slice(0, 100 * max(args.instances, args.small_instances)).drop(["label", "click_ts"])
    rows = table.to_pylist()
    bodies = [orjson.dumps({"instances": rows[i: i + args.instances]}) for i in range(0, len(rows), args.instances)]
    result = {"bench": "serving_overload", "device": args.device, "instances_per_request": args.instances, "seconds": args.seconds,
              "overload": args.overload, "workers": args.workers, "frontends": args.frontends, "client_processes": args.client_processes,
              "threads": args.threads, "host": platform.node(), "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "models"
        print("training a model on 50k samples ...", flush=True)
        subprocess.run([sys.executable, "-m", "streamrec.cli", "train", "--samples", args.samples, "--model-store", str(store),
                        "--work-dir", str(Path(tmp) / "work"), "--max-samples", "50000", "--no-frozen", "--device", args.device],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if args.mix:
            run_mix(args, rows, store, result)
            write_result(args.out, f"serving-overload-mix-{args.device.split(':')[0]}", result)
            return
        result["baseline"] = measure("baseline", store, args, bodies, UNBOUNDED, None)
        capacity = result["baseline"]["capacity"]["qps"]
        # serving.queue_timeout_ms must exceed the batching window (max_delay_us)
        queue_ms = math.ceil(max(args.queue_ms or result["baseline"]["unloaded"]["p99_ms"], args.max_delay_us / 1000 + 1))
        # room for one full batch to form while one runs, at least
        bound = max(args.max_batch, int(capacity * args.instances * queue_ms / 1000))
        result["ours_settings"] = {"queue_timeout_ms": queue_ms, "max_queue_instances": bound}
        print(f"ours: serving.queue_timeout_ms {queue_ms}, serving.max_queue_instances {bound:,}", flush=True)
        result["ours"] = measure("ours", store, args, bodies, {"STREAMREC_SERVING__QUEUE_TIMEOUT_MS": str(queue_ms),
                                                               "STREAMREC_SERVING__MAX_QUEUE_INSTANCES": str(bound)}, capacity)
    ours, base = result["ours"], result["baseline"]
    result["accepted_p99_ratio_vs_baseline"] = ours["overload"]["accepted_p99_ms"] / base["overload"]["accepted_p99_ms"]
    result["goodput_ratio_vs_baseline"] = ours["overload"]["goodput_rps"] / max(base["overload"]["goodput_rps"], 1e-9)
    print(f"at {args.overload:g}x capacity: accepted p99 {ours['overload']['accepted_p99_ms']:.1f} ms (ours) vs "
          f"{base['overload']['accepted_p99_ms']:.1f} ms (baseline) = {result['accepted_p99_ratio_vs_baseline']:.3f}x; "
          f"ours' p99 is {ours['p99_over_unloaded']:.2f}x its unloaded p99 (target <= 2); goodput "
          f"{result['goodput_ratio_vs_baseline']:.2f}x the baseline's")
    write_result(args.out, f"serving-overload-{args.device.split(':')[0]}", result)


if __name__ == "__main__":
    main()
