"""Serving over HTTP: QPS and latency vs concurrency, with and without request aggregation.

A model is trained on the first 50k samples (`streamrec train`), then two `streamrec serve`
processes serve it on the same device:
- ours: request aggregation (``--max-batch`` 1024 instances, ``--max-delay-us`` 2000), 2 workers
  (each on its own CUDA stream), shape buckets (``--compile``, default auto: CUDA graphs
  on CUDA, eager on CPU);
- baseline: the same model in eager PyTorch with one request per batch per worker
  (``max_batch`` 1, ``max_delay_us`` 0, 2 workers, ``serving.compile=eager``) — what a
  plain model server does.
Closed-loop clients (threads with keep-alive connections, spread over
``--client-processes`` load-generator processes so the client's GIL is not the limit) send
requests of ``--instances`` samples each for ``--seconds`` per concurrency level. Reported:
QPS and p50/p99 per level, the best throughput of each server, and ours' best throughput
among the levels whose p99 stays within ``--p99-target-ms`` (issue 6: 10 ms). The server's own
runtime statistics (device time per batch by bucket) are saved next to the end-to-end
numbers, so the share of the HTTP/Python path is visible; bench_serving_runtime.py
measures the runtime without HTTP.

Usage: streamrec bench serving [--samples RUN] [--concurrency 1 8 32] [--instances 16] [--seconds 5] [--device cpu]
Writes var/bench/serving-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
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

from bench_trainer import make_samples  # bench/ is on sys.path (script dir; `streamrec bench` adds it)
from output import write_result
from streamrec.plumbing.bus.broker import free_port
from streamrec.trainer.sources import sample_files

REPO = Path(__file__).resolve().parent.parent


def start_server(store: Path, device: str, max_batch: int, max_delay_us: int, workers: int, compile_mode: str,
                 frontends: int = 0, switch_interval_us: int = 500, poll_interval_s: float = 1.0,
                 extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {**os.environ, "STREAMREC_SERVING__MAX_BATCH": str(max_batch), "STREAMREC_SERVING__MAX_DELAY_US": str(max_delay_us),
           "STREAMREC_SERVING__WORKERS": str(workers), "STREAMREC_SERVING__MAX_INSTANCES": "100000",
           "STREAMREC_SERVING__MAX_QUEUE_INSTANCES": "1000000",  # a closed loop: the queue never bounds it
           "STREAMREC_SERVING__FRONTENDS": str(frontends),
           "STREAMREC_SERVING__COMPILE": compile_mode, "STREAMREC_SERVING__FOLLOW_UPDATES": "false", "STREAMREC_SERVING__FEATURE_STORE": "false",
           "STREAMREC_SERVING__POLL_INTERVAL_S": str(poll_interval_s), "STREAMREC_SERVING__ADMIN_TOKEN": ADMIN_TOKEN, "STREAMREC_SERVING__SWITCH_INTERVAL_US": str(switch_interval_us),
           **(extra_env or {})}
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(store), "--port", str(port),
                             "--device", device], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600  # buckets are compiled before the server is ready
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read().decode(errors='replace')[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become ready")


def _client_process(port: int, bodies: list[bytes], slots: list[int], concurrency: int, start_at: float, stop_at: float, out) -> None:
    """One load-generator process: a keep-alive connection and a closed loop per slot (thread)."""
    results = {k: ([], 0) for k in slots}

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        mine, errors, i = [], 0, k
        while time.time() < start_at:
            time.sleep(0.001)
        while time.time() < stop_at:
            body = bodies[i % len(bodies)]
            i += concurrency
            t0 = time.perf_counter()
            conn.request("POST", "/v1/models/ctr:predict", body=body, headers={"content-type": "application/json"})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                errors += 1
            elif time.time() <= stop_at:  # throughput counts what completed inside the window
                mine.append(time.perf_counter() - t0)
        results[k] = (mine, errors)

    threads = [threading.Thread(target=client, args=(k,)) for k in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.send([(lat, err) for lat, err in results.values()])
    out.close()


def load(port: int, bodies: list[bytes], concurrency: int, seconds: float, processes: int) -> dict:
    """``concurrency`` closed-loop clients spread over up to ``processes`` load-generator
    processes (one Python process cannot drive a fast server: its GIL would be the limit)."""
    ctx = mp.get_context("fork")
    n = min(processes, concurrency)
    start_at = time.time() + 0.5  # every process connected and waiting before the clock starts
    stop_at = start_at + seconds
    pipes, procs = [], []
    for p in range(n):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client_process, args=(port, bodies, list(range(p, concurrency, n)), concurrency, start_at, stop_at, send))
        proc.start()
        pipes.append(receive)
        procs.append(proc)
    latencies, errors = [], 0
    for receive, proc in zip(pipes, procs):
        for lat, err in receive.recv():
            latencies.extend(lat)
            errors += err
        proc.join()
    lat = np.array(latencies) * 1000
    return {"concurrency": concurrency, "client_processes": n, "requests": len(lat), "errors": errors, "qps": len(lat) / seconds,
            "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None, "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None}


def profile_server(pid: int, out: Path, seconds: float) -> subprocess.Popen | None:
    """py-spy sampling the server (all threads, native frames off) while a level runs."""
    import shutil

    if shutil.which("py-spy") is None:
        print("--profile: py-spy is not installed; skipped", flush=True)
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(["py-spy", "record", "-p", str(pid), "-d", str(int(seconds + 1)), "-r", "250", "-f", "raw", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _noop_app(scope, receive, send) -> None:
    """A server that does nothing: what the host, uvicorn and the load generator cost alone."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"model_version":1,"scores":[0.5]}'})


def noise_floor(bodies: list[bytes], seconds: float, processes: int) -> dict:
    """p50/p99 of a no-op uvicorn server (own process) at concurrency 1 with the same client."""
    import uvicorn

    port = free_port()
    proc = mp.get_context("fork").Process(target=uvicorn.run, args=(_noop_app,), kwargs={"host": "127.0.0.1", "port": port, "log_level": "warning"},
                                          daemon=True)
    proc.start()
    try:
        time.sleep(1.5)
        row = load(port, bodies, 1, seconds, processes)
    finally:
        proc.terminate()
        proc.join(timeout=10)
    print(f"noise floor (no-op server, concurrency 1): {row['qps']:.0f} req/s  p50 {row['p50_ms']:.2f} ms  p99 {row['p99_ms']:.2f} ms",
          flush=True)
    return row


def set_latest(latest: Path, version: int) -> None:
    """Move LATEST as a trainer does (write aside, rename)."""
    tmp = latest.with_name(".LATEST.bench")
    tmp.write_text(f"{version}\n")
    tmp.replace(latest)


def measure_swaps(port: int, bodies: list[bytes], args, latest: Path, versions: list[int]) -> dict:
    """p50/p99 at ``--swap-concurrency`` without swaps, then while LATEST moves through the
    store's versions (one every 0.5 s; the server polls LATEST every ``--poll-interval``)."""
    c = args.swap_concurrency
    steady = load(port, bodies, c, args.seconds, args.client_processes)
    stop = threading.Event()
    start_version = model_status(port)["model_version"]

    def publish() -> None:
        for v in versions[1:]:
            if stop.wait(0.5):
                return
            set_latest(latest, v)

    mover = threading.Thread(target=publish)
    mover.start()
    swapping = load(port, bodies, c, min(args.seconds * 2, 0.5 * len(versions)), args.client_processes)
    stop.set()
    mover.join()
    after = model_status(port)
    applied = after["model_version"]
    print(f"hot-swap at concurrency {c}: steady p50 {steady['p50_ms']:.2f} / p99 {steady['p99_ms']:.2f} ms, "
          f"while swapping v{start_version} -> v{applied}: p50 {swapping['p50_ms']:.2f} / p99 {swapping['p99_ms']:.2f} ms, "
          f"errors {swapping['errors']}", flush=True)
    return {"concurrency": c, "steady": steady, "swapping": swapping, "from_version": start_version, "to_version": applied,
            "versions_in_store": len(versions), "p99_ratio": swapping["p99_ms"] / steady["p99_ms"],
            "applies": [a for a in after.get("applies", []) if a["version"] > start_version]}


ADMIN_TOKEN = "bench-admin"


def admin(port: int, route: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", f"/v1/models/ctr:{route}", orjson.dumps(body),
                 {"authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/json"})
    response = conn.getresponse()
    answer = orjson.loads(response.read())
    if response.status != 200:
        raise RuntimeError(f":{route} answered {response.status}: {answer}")
    return answer


def measure_swaps_live(port: int, bodies: list[bytes], args, store: Path, work: Path) -> dict:
    """p50/p99 at ``--swap-concurrency`` while a real trainer trains on the samples and
    publishes every ``--swap-trainer-interval`` s into the served store: first with the node
    pinned to its version (the trainer's CPU load, no applies), then following every version.
    The one difference between the two windows is applying versions."""
    c = args.swap_concurrency
    trainer = subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "train", "--samples", args.samples, "--model-store", str(store), "--work-dir", str(work),
         "--loop", "--no-frozen", "--device", args.device, "--publish-interval", str(args.swap_trainer_interval), "--full-every", "100000"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first = model_status(port)["model_version"]
        deadline = time.monotonic() + 300
        while model_status(port)["model_version"] == first:  # the trainer's first version (a full one) is served
            if trainer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the live trainer published nothing the server applied")
            time.sleep(0.5)
        time.sleep(args.swap_trainer_interval)
        pinned_at = model_status(port)["model_version"]
        admin(port, "reload", {"version": pinned_at})  # pins: the node stays while the trainer goes on
        steady = load(port, bodies, c, args.seconds * 2, args.client_processes)
        admin(port, "reload", {})  # released: follow LATEST again (catches up at its next look)
        time.sleep(args.poll_interval * 2 + 0.5)
        start_version = model_status(port)["model_version"]
        swapping = load(port, bodies, c, args.seconds * 2, args.client_processes)
        after = model_status(port)
        applied = after["model_version"]
    finally:
        trainer.terminate()
        trainer.wait(timeout=60)
    result = {"concurrency": c, "trainer_publish_interval_s": args.swap_trainer_interval, "steady_pinned": steady,
              "swapping": swapping, "from_version": start_version, "to_version": applied,
              "p99_ratio": swapping["p99_ms"] / steady["p99_ms"],
              "applies": [a for a in after.get("applies", []) if a["version"] > start_version]}
    print(f"live trainer publishing every {args.swap_trainer_interval:g} s, concurrency {c}: pinned p50 {steady['p50_ms']:.2f} / "
          f"p99 {steady['p99_ms']:.2f} ms; following v{start_version} -> v{applied}: p50 {swapping['p50_ms']:.2f} / "
          f"p99 {swapping['p99_ms']:.2f} ms ({result['p99_ratio']:.2f}x), errors {swapping['errors']}", flush=True)
    return result


def model_status(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models/ctr")
    return orjson.loads(conn.getresponse().read())


def batching_delta(before: dict, after: dict) -> dict:
    """The server's batching figures for one level: requests per batch, time waiting for a
    batch per request, a batch's run time (decode + lookups + model + copy back)."""
    batches, requests = after["batches"] - before["batches"], after["requests"] - before["requests"]
    return {"batches": batches, "requests_per_batch": requests / max(batches, 1),
            "rows_per_batch": (after["rows"] - before["rows"]) / max(batches, 1),
            "queued_ms_per_request": (after["queued_s"] - before["queued_s"]) / max(requests, 1) * 1000,
            "run_ms_per_batch": (after["run_s"] - before["run_s"]) / max(batches, 1) * 1000}


def best_point(rows: list[dict], p99_limit_ms: float | None = None) -> dict | None:
    """The highest-throughput level (within ``p99_limit_ms`` when given)."""
    fits = [r for r in rows if r["requests"] and (p99_limit_ms is None or r["p99_ms"] <= p99_limit_ms)]
    return max(fits, key=lambda r: r["qps"]) if fits else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", help="a `pipeline offline` run dir or samples.parquet (default: generate one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--instances", type=int, default=16, help="instances per request")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--device", default="cpu", help="cpu | cuda[:N]: where the served model runs (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--compile", default="auto", help="serving.compile of ours (auto | eager | compile | graph | compile+graph)")
    parser.add_argument("--max-batch", type=int, default=1024, help="serving.max_batch of ours (instances)")
    parser.add_argument("--max-delay-us", type=int, default=2000, help="serving.max_delay_us of ours")
    parser.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                        help="load-generator processes (default: half the cores, at most 8)")
    parser.add_argument("--frontends", type=int, default=0, help="serving.frontends of ours: HTTP front-end processes")
    parser.add_argument("--baseline-frontends", type=int, default=0, help="serving.frontends of the baseline")
    parser.add_argument("--switch-interval-us", type=int, default=500, help="serving.switch_interval_us of both servers")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="serving.poll_interval_s (LATEST checks) of both servers")
    parser.add_argument("--noise-floor", action="store_true", help="first measure a no-op HTTP server with the same client")
    parser.add_argument("--swap-concurrency", type=int, default=0,
                        help="also measure ours at this concurrency twice: steady, then while new versions are applied (hot-swap)")
    parser.add_argument("--swap-trainer-interval", type=float, default=0,
                        help="with --swap-concurrency: a live trainer publishes every this many seconds (pinned vs following)")
    parser.add_argument("--model-store", help="serve this store (a version of model 'ctr') instead of training one")
    parser.add_argument("--no-baseline", action="store_true", help="measure ours only (parameter sweeps)")
    parser.add_argument("--profile", action="store_true",
                        help="sample each server with py-spy during the highest concurrency level (raw stacks next to the JSON)")
    parser.add_argument("--p99-target-ms", type=float, default=10.0, help="report the best throughput within this p99")
    parser.add_argument("--out", default="var/bench", help="directory of the JSON result (default: ./var/bench, under the current directory)")
    args = parser.parse_args()
    if args.samples is None:
        args.samples = make_samples(Path(tempfile.mkdtemp(prefix="streamrec-bench-")) / "run")
    table = pq.read_table(sample_files([args.samples])[0]).slice(0, 200 * args.instances).drop(["label", "click_ts"])
    rows = table.to_pylist()
    bodies = [orjson.dumps({"instances": rows[i: i + args.instances]}) for i in range(0, len(rows), args.instances)]
    result = {"bench": "serving", "device": args.device, "instances_per_request": args.instances, "seconds": args.seconds,
              "workers": args.workers, "compile": args.compile, "frontends": args.frontends, "baseline_frontends": args.baseline_frontends,
              "max_batch": args.max_batch, "max_delay_us": args.max_delay_us, "switch_interval_us": args.switch_interval_us, "client_processes": args.client_processes, "host": platform.node(), "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if args.noise_floor:
        result["noise_floor"] = noise_floor(bodies, args.seconds, args.client_processes)
    servers = {"ours": (args.max_batch, args.max_delay_us, args.compile, args.frontends),
               "baseline": (1, 0, "eager", args.baseline_frontends)}
    if args.no_baseline:
        del servers["baseline"]
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(args.model_store or tmp)
        if not args.model_store or not (store / "ctr" / "LATEST").exists():
            # A real model trained on the same samples, so requests hit existing rows as in production.
            # a delta every 0.2 s: versions to hot-swap through (--swap-concurrency)
            subprocess.run([sys.executable, "-m", "streamrec.cli", "train", "--samples", args.samples, "--model-store", str(store),
                            "--work-dir", str(Path(tmp) / "work"), "--max-samples", "50000", "--no-frozen", "--device", args.device,
                            "--publish-interval", "0.2", "--full-every", "1000"],
                           cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        versions = sorted(int(p.name) for p in (store / "ctr" / "versions").iterdir() if p.name.isdigit())
        latest = store / "ctr" / "LATEST"
        for name, (max_batch, delay, mode, frontends) in servers.items():
            if args.swap_concurrency and name == "ours":
                set_latest(latest, versions[0])  # the server starts on the first version; the swap level moves it on
            proc, port = start_server(store, args.device, max_batch, delay, args.workers, mode, frontends, args.switch_interval_us,
                                      args.poll_interval)
            try:
                load(port, bodies, 4, 1.0, args.client_processes)  # warm-up
                result[name] = []
                for c in args.concurrency:
                    spy = profile_server(proc.pid, Path(args.out) / f"serving-profile-{name}-c{c}.txt", args.seconds) \
                        if args.profile and c == max(args.concurrency) else None
                    before = model_status(port)
                    row = load(port, bodies, c, args.seconds, args.client_processes)
                    after = model_status(port)
                    row["server"] = batching_delta(before["batching"], after["batching"])
                    row["server"]["gc"] = after.get("gc")
                    row["server"]["recent"] = after["batching"].get("recent")  # the last batches: this level's
                    result[name].append(row)
                    if spy is not None:
                        spy.wait(timeout=60)
                if args.swap_concurrency and name == "ours":
                    result["swap"] = measure_swaps(port, bodies, args, latest, versions)
                    if args.swap_trainer_interval:
                        result["swap_live"] = measure_swaps_live(port, bodies, args, store, Path(tmp) / "live-trainer")
                result[f"{name}_runtime"] = model_status(port).get("runtime")
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            for row in result[name]:
                srv = row["server"]
                print(f"{name:9s} concurrency {row['concurrency']:3d}: {row['qps']:8.1f} req/s "
                      f"({row['qps'] * args.instances:9.0f} instances/s)  p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms  "
                      f"errors {row['errors']}  | server: {srv['requests_per_batch']:.1f} req/batch, queued "
                      f"{srv['queued_ms_per_request']:.2f} ms/req (p99 {srv['recent']['queued_ms_p99']}), run {srv['run_ms_per_batch']:.2f} "
                      f"ms/batch (p99 {srv['recent']['run_ms_p99']})"
                      + (f", serving process gc collections {srv['gc']['collections']} longest {srv['gc']['longest_pause_ms']:.1f} ms" if srv.get("gc") else ""),
                      flush=True)
    if args.no_baseline:
        write_result(args.out, f"serving-{args.device.split(':')[0]}", result)
        return
    best = {name: best_point(result[name]) for name in ("ours", "baseline")}
    result["best_qps_ratio"] = best["ours"]["qps"] / best["baseline"]["qps"]
    print(f"best throughput: ours {best['ours']['qps']:.1f} req/s (p99 {best['ours']['p99_ms']:.1f} ms) vs baseline "
          f"{best['baseline']['qps']:.1f} (p99 {best['baseline']['p99_ms']:.1f} ms): {result['best_qps_ratio']:.2f}x")
    within = best_point(result["ours"], args.p99_target_ms)
    result["p99_target_ms"] = args.p99_target_ms
    result["best_within_p99_target"] = within
    if within is not None:
        result["within_target_qps_ratio"] = within["qps"] / best["baseline"]["qps"]
        print(f"best throughput with p99 <= {args.p99_target_ms:g} ms: ours {within['qps']:.1f} req/s at concurrency "
              f"{within['concurrency']} (p99 {within['p99_ms']:.1f} ms) = {result['within_target_qps_ratio']:.2f}x the baseline's best")
    else:
        print(f"no level of ours kept p99 <= {args.p99_target_ms:g} ms")
    write_result(args.out, f"serving-{args.device.split(':')[0]}", result)


if __name__ == "__main__":
    main()
