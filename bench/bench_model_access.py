"""Model access over HTTP: what an experiment route and a shadow model cost the caller.

One `streamrec serve` node (no broker: ``serving.feature_store``, ``follow_updates`` and
``prediction_log`` off) serves two models, ``ctr`` and ``cvr`` (a copy of ``ctr``: same
weights, its own model runtime, batches and versions), and three experiments:
- ``ab``: 50/50 between ``ctr`` and ``cvr``;
- ``solo``: every user on ``ctr`` (the experiment route's own cost, batches as direct);
- ``shadowed``: ``solo`` plus ``shadow_model = "cvr"``, ``shadow_share = 1.0``.
Requests are instances bodies of ``--instances`` real sample rows (as bench_serving.py takes
them), every instance of a request given one user id (an experiment scores one user's
candidates), the users differing between requests so both variants of ``ab`` are hit; every
route gets the very same bodies.

Measured on that one node with the same client (bench_serving.py's closed loop and
bench_serving_overload.py's open loop, pointed at another route):
1. routing: closed-loop levels (``--concurrency``) on ``POST /v1/models/ctr:predict`` (direct),
   ``/v1/experiments/ab:predict`` and ``/v1/experiments/solo:predict``, the routes alternated
   within each level and their order rotated each repetition (``--reps``); the best
   throughput whose p99 is within ``--p99-target-ms`` per route; then p50/p99 at one fixed
   open-loop offered load (Poisson, the same schedule for every route: ``--rate``, default
   ``--load-share`` x direct's best throughput within the target, else at its lowest level);
2. shadow: ``shadowed`` vs ``solo`` at that fixed offered load (the primary's p50/p99).
Targets (issue: model access): experiment route within 5% of direct, shadow p99 within 5%.
The server's per-model request counts are taken around every window, so the JSON shows which
model answered (and that the shadow copies were scored).

``--stalled-log`` (CPU/CI box: it needs the embedded broker) measures instead the issue target
"Prediction log: no response waits for Kafka (p99 unchanged, drops counted)". A private
embedded broker (free port, its own data dir, ``streamrec kafka up``) and two nodes of the same
store and settings: "plain" (``serving.prediction_log = false``) and "logged" (true, writing
``topics.predictions`` to that broker through a queue of ``--log-queue``). At one fixed
open-loop offered load (``--rate``, default ``--load-share`` x plain's closed-loop throughput
at concurrency 4), the direct route's p50/p99 on both nodes, windows alternated, in two phases:
1. broker healthy; 2. broker stalled (SIGSTOP to its process group: connections stay open,
nothing answers; SIGCONT at the end, always). The logged node's
``streamrec_serving_prediction_log_records{outcome}`` are read around each phase (and while
it catches up after SIGCONT). ``--log-connect-timeout-s`` (kafka.connect_timeout_s of the
logged node, default 2: request timeout 5 s, delivery timeout 12 s) lets a short stall reach
kafka-python's timeouts and give-ups; the default 20 s would ride it out in its buffer.
The routing and shadow parts are skipped.

``--quotas`` measures instead "a caller over its quota is held to it while the others keep
their p99": one node with a caller "metered" (``--quota-rate`` requests/s, burst the same);
the others (no key) at one fixed open-loop load, alone and beside the metered caller flooding
on ``--flood-threads`` connections, windows alternated. Reported: the metered caller's
admitted rate after its burst vs its quota, and the others' p50/p99 beside vs alone.

Usage: python bench/bench_model_access.py [--quick] [--device cpu|cuda] [--frontends N] [--instances 200]
           [--samples RUN | --model-store STORE] [--stalled-log | --quotas] [--out FILE]
Writes bench/results/model_access_<device>.json (with --stalled-log,
model_access_stalled_log_<device>.json; with --quotas, model_access_quotas_<device>.json)
unless --out names another file.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq

from bench_serving import best_point, load, start_server  # bench/ is on sys.path (script dir)
from bench_serving_overload import open_loop
from bench_trainer import make_samples
from streamrec.plumbing.bus.broker import free_port
from streamrec.trainer.sources import sample_files

REPO = Path(__file__).resolve().parent.parent
DIRECT = "/v1/models/ctr:predict"  # the path bench_serving's and bench_serving_overload's clients send
ROUTES = {"direct": DIRECT, "ab": "/v1/experiments/ab:predict", "solo": "/v1/experiments/solo:predict",
          "shadowed": "/v1/experiments/shadowed:predict"}
CONFIG = """
[[serving.models]]
name = "ctr"
[[serving.models]]
name = "cvr"

[[serving.experiments]]
name = "ab"
variants = [{name = "a", model = "ctr", share = 0.5}, {name = "b", model = "cvr", share = 0.5}]

[[serving.experiments]]
name = "solo"
variants = [{name = "only", model = "ctr", share = 1.0}]

[[serving.experiments]]
name = "shadowed"
variants = [{name = "only", model = "ctr", share = 1.0}]
shadow_model = "cvr"
shadow_share = 1.0
"""


class _RoutedConnection(http.client.HTTPConnection):
    """bench_serving's clients post to the direct route; this sends their predicts to
    ``target`` instead (set before the load processes fork), so both routes are driven by the
    same client code."""

    target = DIRECT
    api_key: str | None = None  # sent with each predict that names none (--quotas: the other callers')

    def request(self, method, url, body=None, headers={}, **kwargs):  # noqa: B006 -- http.client's signature
        if type(self).api_key and method == "POST" and "x-api-key" not in headers:
            headers = {**headers, "x-api-key": type(self).api_key}
        return super().request(method, type(self).target if url == DIRECT else url, body, headers, **kwargs)


http.client.HTTPConnection = _RoutedConnection  # type: ignore[misc] -- looked up at call time by the imported clients


def get(port: int, path: str) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    return orjson.loads(conn.getresponse().read())


def post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body=body, headers={"content-type": "application/json"})
    response = conn.getresponse()
    return response.status, orjson.loads(response.read())


def model_requests(port: int) -> dict[str, int]:
    return {m: get(port, f"/v1/models/{m}")["batching"]["requests"] for m in ("ctr", "cvr")}


def window(port: int, route: str, run) -> dict:
    """One measurement window on ``route``, with the requests each model's batcher took meanwhile."""
    _RoutedConnection.target = ROUTES[route]
    before = model_requests(port)
    row = run()
    after = model_requests(port)
    _RoutedConnection.target = DIRECT
    row["route"] = route
    row["model_requests"] = {m: after[m] - before[m] for m in after}
    return row


def median_row(rows: list[dict], keys: tuple[str, ...]) -> dict:
    return {k: float(np.median([r[k] for r in rows])) if all(r[k] is not None for r in rows) else None for k in keys}


def machine(device: str) -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "device": device}
    if device.startswith("cuda"):
        import torch

        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def make_bodies(samples: str, instances: int, count: int) -> tuple[list[bytes], int]:
    """``count`` requests of ``instances`` sample rows each, every row of a request given the
    user id of its first row (requests of different users)."""
    table = pq.read_table(sample_files([samples])[0]).slice(0, count * instances).drop(["label", "click_ts"])
    rows = table.to_pylist()
    bodies, users = [], set()
    for i in range(0, len(rows) - instances + 1, instances):
        chunk = rows[i: i + instances]
        user = chunk[0]["user_id"]
        users.add(user)
        bodies.append(orjson.dumps({"instances": [{**r, "user_id": user} for r in chunk]}))
    return bodies, len(users)


def build_store(args, tmp: Path) -> Path:
    """The served store: ``--model-store``'s (copied) or one trained as bench_serving.py does,
    with ``ctr`` copied to ``cvr``."""
    root = tmp / "models"
    if args.model_store:
        shutil.copytree(args.model_store, root)
    else:
        subprocess.run([sys.executable, "-m", "streamrec.cli", "train", "--samples", args.samples, "--model-store", str(root),
                        "--work-dir", str(tmp / "work"), "--max-samples", str(args.train_samples), "--no-frozen", "--device", args.device],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shutil.rmtree(root / "cvr", ignore_errors=True)
    shutil.copytree(root / "ctr", root / "cvr")
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI: levels 1-8, 3 s windows (~3 min on 2 cores)")
    parser.add_argument("--samples", help="a `pipeline offline` run dir or samples.parquet (default: generate one)")
    parser.add_argument("--model-store", help="serve this store's model 'ctr' (copied; cvr = a copy of ctr) instead of training one")
    parser.add_argument("--train-samples", type=int, default=50000, help="samples the model is trained on (without --model-store)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--instances", type=int, default=200, help="instances per request")
    parser.add_argument("--requests", type=int, default=200, help="distinct request bodies (one user each)")
    parser.add_argument("--concurrency", type=int, nargs="+", help="closed-loop levels (default 1 2 4 8 16 32; --quick 1 2 4 8)")
    parser.add_argument("--seconds", type=float, help="per window (default 5; --quick 3)")
    parser.add_argument("--reps", type=int, help="windows per route and level, routes alternated (default 2)")
    parser.add_argument("--fixed-reps", type=int, help="open-loop windows per route at the fixed load (default 3; --quick 2)")
    parser.add_argument("--rate", type=float, help="the fixed offered load, requests/s (default: --load-share x direct's best within the target)")
    parser.add_argument("--load-share", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=16, help="connections per load-generator process in the open loop")
    parser.add_argument("--workers", default="auto", help="serving.workers (auto: 0 on CUDA, 1 on CPU)")
    parser.add_argument("--compile", default="auto", help="serving.compile (auto: CUDA graphs on CUDA, eager on CPU)")
    parser.add_argument("--max-batch", type=int, default=1024, help="serving.max_batch (instances)")
    parser.add_argument("--max-delay-us", type=int, default=2000, help="serving.max_delay_us")
    parser.add_argument("--frontends", type=int, default=0, help="serving.frontends: HTTP front-end processes")
    parser.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                        help="load-generator processes (default: half the cores, at most 8)")
    parser.add_argument("--p99-target-ms", type=float, default=10.0)
    parser.add_argument("--stalled-log", action="store_true",
                        help="instead: prediction log on vs off, broker healthy then SIGSTOPped (needs the embedded broker)")
    parser.add_argument("--log-queue", type=int, default=10000, help="--stalled-log: serving.prediction_log_queue of the logged node")
    parser.add_argument("--log-connect-timeout-s", type=float, default=2.0,
                        help="--stalled-log: kafka.connect_timeout_s of the logged node (its producer's request timeout: max(this, 5) s)")
    parser.add_argument("--stall-reps", type=int, default=3, help="--stalled-log: windows per node and phase, nodes alternated")
    parser.add_argument("--quotas", action="store_true",
                        help="instead: a caller flooding past its quota vs the others' latency (serving.callers)")
    parser.add_argument("--quota-rate", type=float, default=20.0, help="--quotas: the metered caller's rate_per_s (burst: the same)")
    parser.add_argument("--flood-threads", type=int, default=4, help="--quotas: the metered caller's closed-loop connections")
    parser.add_argument("--out", help="the JSON file (default bench/results/model_access_<device>.json)")
    args = parser.parse_args()
    args.concurrency = args.concurrency or ([1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16, 32])
    args.seconds = args.seconds or (3.0 if args.quick else 5.0)
    args.reps = args.reps or 2
    args.fixed_reps = args.fixed_reps or (2 if args.quick else 3)
    kind = "model_access_stalled_log" if args.stalled_log else "model_access_quotas" if args.quotas else "model_access"
    out = Path(args.out or REPO / "bench" / "results" / f"{kind}_{args.device.split(':')[0]}.json")
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="streamrec-bench-access-"))
    try:
        if args.samples is None and args.model_store is None:
            args.samples = make_samples(tmp / "run")
        if args.samples is None:
            parser.error("--model-store needs --samples (the request rows)")
        bodies, users = make_bodies(args.samples, args.instances, args.requests)
        root = build_store(args, tmp)
        config = tmp / "streamrec.toml"
        config.write_text(CONFIG)
        result = {"bench": "model_access", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(args.device),
                  "config": {**{k: v for k, v in vars(args).items() if k not in ("out",)}, "request_bodies": len(bodies), "users": users,
                             "serving_toml": CONFIG, "feature_store": False, "follow_updates": False, "prediction_log": False}}
        if args.stalled_log:
            result["bench"] = "model_access_stalled_log"
            result["config"].update(serving_toml=None, prediction_log="plain: false, logged: true")
            stalled_log(root, bodies, args, result, tmp)
        elif args.quotas:
            result["bench"] = "model_access_quotas"
            callers = QUOTAS.format(rate=args.quota_rate)
            _RoutedConnection.api_key = "others-key"  # callers configured: a request without a key is refused
            config.write_text(CONFIG + callers)
            result["config"]["serving_toml"] = CONFIG + callers
            on_one_node(root, config, args, lambda port: quotas(port, bodies, args, result))
        else:
            on_one_node(root, config, args, lambda port: measure(port, bodies, args, result))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["wall_s"] = time.monotonic() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} ({result['wall_s']:.0f} s)")


def on_one_node(root: Path, config: Path, args, run) -> None:
    """``run(port)`` against one node of ``config`` (no prediction log), stopped afterwards."""
    proc, port = start_server(root, args.device, args.max_batch, args.max_delay_us, args.workers, args.compile, args.frontends,
                              extra_env={"STREAMREC_CONFIG": str(config), "STREAMREC_SERVING__PREDICTION_LOG": "false"})
    try:
        run(port)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def measure(port: int, bodies: list[bytes], args, result: dict) -> None:
    # The routes answer what they should, and the users split over both variants.
    variants = {}
    for body in bodies[:40]:
        status, answer = post(port, ROUTES["ab"], body)
        assert status == 200 and len(answer["scores"]) == args.instances, (status, answer)
        variants[answer["variant"]] = variants.get(answer["variant"], 0) + 1
    assert set(variants) == {"a", "b"}, f"the request users hit only {variants}"
    result["ab_variants_of_first_40_requests"] = variants
    sweep_routes = ["direct", "ab", "solo"]
    for route in ROUTES:  # the same warm-up on every route (and both model runtimes)
        window(port, route, lambda: load(port, bodies, 4, max(1.0, args.seconds / 2), args.client_processes))

    # 1. Closed-loop levels, routes alternated within a level, their order rotated per repetition.
    windows: dict[str, dict[int, list[dict]]] = {r: {c: [] for c in args.concurrency} for r in sweep_routes}
    turn = 0
    for c in args.concurrency:
        for _ in range(args.reps):
            order = sweep_routes[turn % 3:] + sweep_routes[:turn % 3]
            turn += 1
            for route in order:
                row = window(port, route, lambda: load(port, bodies, c, args.seconds, args.client_processes))
                windows[route][c].append(row)
                print(f"  {route:8s} c={c:3d}: {row['qps']:8.1f} req/s  p50 {row['p50_ms']:7.2f}  p99 {row['p99_ms']:7.2f} ms  "
                      f"errors {row['errors']}  by model {row['model_requests']}", flush=True)
    levels = {r: [{"concurrency": c, "requests": sum(w["requests"] for w in windows[r][c]), "errors": sum(w["errors"] for w in windows[r][c]),
                   **median_row(windows[r][c], ("qps", "p50_ms", "p99_ms")), "windows": windows[r][c]} for c in args.concurrency]
              for r in sweep_routes}
    best = {r: best_point(levels[r], args.p99_target_ms) for r in sweep_routes}
    result["closed_loop"] = levels
    result["best_within_p99_target"] = {r: (None if b is None else {k: b[k] for k in ("concurrency", "qps", "p50_ms", "p99_ms")})
                                        for r, b in best.items()}

    # 2. One fixed offered load (open loop, the same Poisson schedule), all four routes alternated.
    # No level within the target (a slow CPU): the lowest level's throughput stands in.
    basis = best["direct"] or levels["direct"][0]
    rate = args.rate or args.load_share * basis["qps"]
    result["fixed_load_basis"] = {"direct_qps": basis["qps"], "concurrency": basis["concurrency"], "within_target": best["direct"] is not None}
    fixed: dict[str, list[dict]] = {r: [] for r in ROUTES}
    names = list(ROUTES)
    for rep in range(args.fixed_reps):
        order = names[rep % 4:] + names[:rep % 4]
        for route in order:
            row = window(port, route, lambda: open_loop(port, bodies, rate, args.seconds, args.client_processes, args.threads))
            fixed[route].append(row)
            print(f"  {route:8s} {rate:7.1f} req/s offered: p50 {row['accepted_p50_ms']:7.2f}  p99 {row['accepted_p99_ms']:7.2f} ms  "
                  f"accepted {row['accepted']}/{row['sent']}  by model {row['model_requests']}", flush=True)
    result["fixed_load"] = {"offered_rps": rate, "routes": {
        r: {**median_row(rows, ("goodput_rps", "accepted_p50_ms", "accepted_p99_ms", "send_lateness_p99_ms")),
            "errors": sum(w["errors"] + w["shed"] for w in rows), "windows": rows} for r, rows in fixed.items()}}
    fl = result["fixed_load"]["routes"]

    def ratio(a, b):
        return a / b if a is not None and b else None

    result["ratios"] = {
        "ab_vs_direct_best_qps_within_target": ratio(*(best[r]["qps"] if best[r] else None for r in ("ab", "direct"))),
        "solo_vs_direct_best_qps_within_target": ratio(*(best[r]["qps"] if best[r] else None for r in ("solo", "direct"))),
        "ab_vs_direct_fixed_p50": ratio(fl["ab"]["accepted_p50_ms"], fl["direct"]["accepted_p50_ms"]),
        "ab_vs_direct_fixed_p99": ratio(fl["ab"]["accepted_p99_ms"], fl["direct"]["accepted_p99_ms"]),
        "solo_vs_direct_fixed_p99": ratio(fl["solo"]["accepted_p99_ms"], fl["direct"]["accepted_p99_ms"]),
        "shadowed_vs_solo_fixed_p50": ratio(fl["shadowed"]["accepted_p50_ms"], fl["solo"]["accepted_p50_ms"]),
        "shadowed_vs_solo_fixed_p99": ratio(fl["shadowed"]["accepted_p99_ms"], fl["solo"]["accepted_p99_ms"]),
    }
    result["qps_ratio_by_level"] = {r: {row["concurrency"]: ratio(row["qps"], d["qps"]) for row, d in zip(levels[r], levels["direct"])}
                                    for r in ("ab", "solo")}
    result["shadow_scored_share"] = ratio(sum(w["model_requests"]["cvr"] for w in fixed["shadowed"]),
                                          sum(w["model_requests"]["ctr"] for w in fixed["shadowed"]))
    print_table(result, args)


def print_table(result: dict, args) -> None:
    print(f"\nclosed loop, {args.instances} instances/request ({result['machine']['cpu']}, {result['machine']['cores']} cores"
          + (f", {result['machine']['gpu']}" if "gpu" in result["machine"] else "") + f", device {args.device}, frontends {args.frontends})")
    print(f"{'route':9s} {'conc':>4s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for route, rows in result["closed_loop"].items():
        for row in rows:
            print(f"{route:9s} {row['concurrency']:4d} {row['qps']:8.1f} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f}")
    print(f"best within p99 <= {args.p99_target_ms:g} ms: "
          + ", ".join(f"{r} {b['qps']:.1f} req/s (c={b['concurrency']})" if b else f"{r} none"
                      for r, b in result["best_within_p99_target"].items()))
    fixed = result["fixed_load"]
    print(f"\nfixed offered load {fixed['offered_rps']:.1f} req/s (open loop, median of {args.fixed_reps} windows)")
    print(f"{'route':9s} {'p50 ms':>8s} {'p99 ms':>8s} {'goodput':>8s}")
    for route, row in fixed["routes"].items():
        print(f"{route:9s} {row['accepted_p50_ms']:8.2f} {row['accepted_p99_ms']:8.2f} {row['goodput_rps']:8.1f}")
    for r, by_level in result["qps_ratio_by_level"].items():
        print(f"{r} / direct req/s by concurrency: " + ", ".join(f"c={c} {v:.3f}" for c, v in by_level.items()))
    print("\nratios (1.00 = no cost; target within 5%):")
    for k, v in result["ratios"].items():
        print(f"  {k:40s} {v:.3f}" if v is not None else f"  {k:40s} -")
    print(f"  shadow copies scored per primary request: {result['shadow_scored_share']}")


# ---------------------------------------------------------------------------- --stalled-log
LOG_OUTCOMES = ("queued", "sent", "dropped", "failed")
PREDICTIONS_TOPIC = "streamrec.predictions"


def log_counts(port: int) -> dict[str, int]:
    """The node's prediction log counters by outcome, from /metrics (pending = queued - sent - failed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    found = dict(re.findall(r'^streamrec_serving_prediction_log_records\{outcome="(\w+)"\} (\S+)$', text, re.MULTILINE))
    counts = {k: int(float(found.get(k, 0))) for k in LOG_OUTCOMES}
    counts["pending"] = counts["queued"] - counts["sent"] - counts["failed"]
    return counts


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


class PrivateBroker:
    """An embedded broker of this run only (free port, its own data dir), through the CLI."""

    def __init__(self, data_dir: Path) -> None:
        self.port, self.data_dir, self.pid, self.stopped = free_port(), data_dir, None, False
        self.env = {**os.environ, "STREAMREC_KAFKA__BOOTSTRAP": "", "STREAMREC_KAFKA__EMBEDDED_PORT": str(self.port),
                    "STREAMREC_KAFKA__DATA_DIR": str(data_dir), "STREAMREC_TOPICS__PREDICTIONS": PREDICTIONS_TOPIC}
        self.env.pop("STREAMREC_CONFIG", None)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cli(self, action: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "streamrec.cli", "kafka", action, "--port", str(self.port),
                               "--data-dir", str(self.data_dir), *extra], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=120)

    def up(self) -> None:
        done = self.cli("up", "--partitions", "1")
        try:  # the pid first: a broker that started but whose topics failed is still stopped in down()
            self.pid = json.loads((self.data_dir / "node-1" / "broker.pid").read_text())["pid"]
        except (OSError, ValueError):
            pass
        if done.returncode != 0:
            raise RuntimeError(f"kafka up failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        assert f"topic {PREDICTIONS_TOPIC}:" in done.stdout, done.stdout

    def signal(self, sig: int) -> None:
        """``sig`` to the broker's process group (it runs in a session of its own: pgid = pid)."""
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return
        self.stopped = sig == signal.SIGSTOP

    def down(self) -> None:
        """SIGCONT (a stopped broker would not act on SIGTERM), `kafka down`, then SIGKILL if it is still there."""
        self.signal(signal.SIGCONT)
        try:
            done = self.cli("down")
            if done.returncode != 0:
                print(f"kafka down failed ({done.returncode}): {done.stderr.strip()}", file=sys.stderr)
        except subprocess.TimeoutExpired:
            print("kafka down timed out", file=sys.stderr)
        self.signal(signal.SIGKILL)  # nothing left to kill after a clean down


def stalled_log(root: Path, bodies: list[bytes], args, result: dict, tmp: Path) -> None:
    broker = PrivateBroker(tmp / "kafka")
    nodes: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        broker.up()
        print(f"private broker {broker.bootstrap} (pid {broker.pid})", flush=True)
        common = {"STREAMREC_KAFKA__BOOTSTRAP": broker.bootstrap, "STREAMREC_TOPICS__PREDICTIONS": PREDICTIONS_TOPIC}
        for name, env in (("plain", {"STREAMREC_SERVING__PREDICTION_LOG": "false"}),
                          ("logged", {"STREAMREC_SERVING__PREDICTION_LOG": "true",
                                      "STREAMREC_SERVING__PREDICTION_LOG_QUEUE": str(args.log_queue),
                                      "STREAMREC_KAFKA__CONNECT_TIMEOUT_S": str(args.log_connect_timeout_s)})):
            nodes[name] = start_server(root, args.device, args.max_batch, args.max_delay_us, args.workers, args.compile, args.frontends,
                                       extra_env={**common, **env})
        ports = {name: port for name, (_, port) in nodes.items()}
        stalled_measure(ports, broker, bodies, args, result)
    finally:
        broker.down()  # SIGCONT first: the broker never stays stopped
        for proc, _ in nodes.values():
            proc.terminate()
        for proc, _ in nodes.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def stalled_measure(ports: dict[str, int], broker: PrivateBroker, bodies: list[bytes], args, result: dict) -> None:
    seconds = max(args.seconds, 4.0)
    for name, port in ports.items():  # the same warm-up on both
        load(port, bodies, 4, 2.0, args.client_processes)
    deadline = time.monotonic() + 30  # the logged node's producer has connected and written the warm-up
    while log_counts(ports["logged"])["sent"] == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    warm = log_counts(ports["logged"])
    assert warm["sent"] > 0, f"the logged node wrote nothing to {broker.bootstrap}: {warm}"
    if args.rate:
        rate, basis = args.rate, None
    else:
        basis = load(ports["plain"], bodies, 4, seconds, args.client_processes)
        rate = args.load_share * basis["qps"]
    print(f"fixed offered load {rate:.1f} req/s (plain closed loop c=4: {basis and round(basis['qps'], 1)} req/s); "
          f"warm-up log counters {warm}", flush=True)
    phases: dict[str, dict] = {}
    for phase in ("healthy", "stalled"):
        rows: dict[str, list[dict]] = {"plain": [], "logged": []}
        before = log_counts(ports["logged"])
        t0 = time.monotonic()
        if phase == "stalled":
            broker.signal(signal.SIGSTOP)
        try:
            for rep in range(args.stall_reps):
                for name in (("plain", "logged") if rep % 2 == 0 else ("logged", "plain")):
                    c0 = log_counts(ports["logged"])
                    row = open_loop(ports[name], bodies, rate, seconds, args.client_processes, args.threads)
                    row["node"], row["log_counts"] = name, delta(log_counts(ports["logged"]), c0)
                    rows[name].append(row)
                    print(f"  {phase:7s} {name:6s} {rate:7.1f} req/s offered: p50 {row['accepted_p50_ms']:7.2f}  "
                          f"p99 {row['accepted_p99_ms']:7.2f} ms  accepted {row['accepted']}/{row['sent']}  "
                          f"log meanwhile {row['log_counts']}", flush=True)
            after = log_counts(ports["logged"])
            stall_s = time.monotonic() - t0
        finally:
            if phase == "stalled":
                broker.signal(signal.SIGCONT)
        entry = {"seconds": stall_s, "log_before": before, "log_after": after, "log_delta": delta(after, before),
                 "nodes": {name: {**median_row(rs, ("goodput_rps", "accepted_p50_ms", "accepted_p99_ms", "send_lateness_p99_ms")),
                                  "errors": sum(w["errors"] + w["shed"] for w in rs), "windows": rs} for name, rs in rows.items()}}
        if phase == "stalled":  # the backlog after SIGCONT: sent or failed, or still pending
            resumed, deadline = time.monotonic(), time.monotonic() + 20
            while (now := log_counts(ports["logged"]))["pending"] > 0 and time.monotonic() < deadline:
                time.sleep(0.25)
            entry["after_resume"] = {"waited_s": time.monotonic() - resumed, "log": now, "log_delta_since_phase_end": delta(now, after)}
        phases[phase] = entry

    def ratio(a, b):
        return a / b if a is not None and b else None

    result["stalled_log"] = {
        "offered_rps": rate, "basis_plain_closed_loop_c4": basis, "window_s": seconds, "windows_per_node_and_phase": args.stall_reps,
        "broker": broker.bootstrap, "topic": PREDICTIONS_TOPIC, "log_queue": args.log_queue,
        "log_connect_timeout_s": args.log_connect_timeout_s, "warm_up_log": warm, "phases": phases,
        "ratios": {phase: {f"logged_vs_plain_{q}": ratio(e["nodes"]["logged"][f"accepted_{q}_ms"], e["nodes"]["plain"][f"accepted_{q}_ms"])
                           for q in ("p50", "p99")} for phase, e in phases.items()},
        "stalled_vs_healthy_logged_p99": ratio(phases["stalled"]["nodes"]["logged"]["accepted_p99_ms"],
                                               phases["healthy"]["nodes"]["logged"]["accepted_p99_ms"]),
    }
    print_stalled(result, args)


def print_stalled(result: dict, args) -> None:
    r = result["stalled_log"]
    print(f"\nprediction log on vs off, {args.instances} instances/request, {r['offered_rps']:.1f} req/s offered (open loop), "
          f"median of {r['windows_per_node_and_phase']} windows of {r['window_s']:g} s ({result['machine']['cpu']}, "
          f"{result['machine']['cores']} cores, device {args.device}, frontends {args.frontends}, queue {r['log_queue']})")
    print(f"{'phase':8s} {'node':7s} {'p50 ms':>8s} {'p99 ms':>8s} {'goodput':>8s} {'errors':>6s}")
    for phase, e in r["phases"].items():
        for name, row in e["nodes"].items():
            print(f"{phase:8s} {name:7s} {row['accepted_p50_ms']:8.2f} {row['accepted_p99_ms']:8.2f} {row['goodput_rps']:8.1f} {row['errors']:6d}")
    print(f"\n{'phase':8s} {'p50 log/plain':>14s} {'p99 log/plain':>14s}   log records during the phase (logged node)")
    for phase, e in r["phases"].items():
        q = r["ratios"][phase]
        d = e["log_delta"]
        print(f"{phase:8s} {q['logged_vs_plain_p50']:14.3f} {q['logged_vs_plain_p99']:14.3f}   "
              + ", ".join(f"{k} {d[k]}" for k in (*LOG_OUTCOMES, "pending")) + f" (over {e['seconds']:.0f} s)")
    resume = r["phases"]["stalled"]["after_resume"]
    print(f"after SIGCONT ({resume['waited_s']:.1f} s): " + ", ".join(f"{k} {v}" for k, v in resume["log_delta_since_phase_end"].items())
          + f"; totals {resume['log']}")


QUOTAS = """
[[serving.callers]]
name = "metered"
key = "metered-key"
rate_per_s = {rate}
burst = {rate:.0f}

[[serving.callers]]
name = "others"
key = "others-key"
rate_per_s = 0
"""


def flood(port: int, body: bytes, key: str, seconds: float, threads: int) -> dict:
    """A caller sending as fast as its ``threads`` connections allow, for ``seconds``."""
    import threading

    statuses: list[int] = []
    stop = time.monotonic() + seconds

    def send() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while time.monotonic() < stop:
            conn.request("POST", DIRECT, body=body, headers={"content-type": "application/json", "x-api-key": key})
            response = conn.getresponse()
            response.read()
            statuses.append(response.status)

    started = time.monotonic()
    workers = [threading.Thread(target=send) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - started
    return {"seconds": elapsed, "sent": len(statuses), "admitted": statuses.count(200), "over_quota": statuses.count(429),
            "admitted_per_s": statuses.count(200) / elapsed, "other": len(statuses) - statuses.count(200) - statuses.count(429)}


def quotas(port: int, bodies: list[bytes], args, result: dict) -> None:
    """The other callers' latency at a fixed open-loop load, alone and beside a metered caller
    flooding past its quota (windows alternated); the metered caller's admitted rate vs its quota."""
    import threading

    seconds = max(args.seconds, 4.0)
    load(port, bodies, 4, 2.0, args.client_processes)  # warm-up
    basis = load(port, bodies, 4, seconds, args.client_processes)
    rate = args.rate or args.load_share * basis["qps"]
    print(f"others: {rate:.1f} req/s offered (open loop); metered caller: quota {args.quota_rate:g}/s, "
          f"{args.flood_threads} connections flooding", flush=True)
    alone, beside, floods = [], [], []
    for rep in range(args.fixed_reps):
        for phase in (("alone", "beside") if rep % 2 == 0 else ("beside", "alone")):
            if phase == "alone":
                alone.append(open_loop(port, bodies, rate, seconds, args.client_processes, args.threads))
                continue
            time.sleep(1.0 + 1.0)  # the metered bucket refills (burst = one second's worth): each flood starts from a full one
            got: dict = {}
            flooder = threading.Thread(target=lambda: got.update(flood(port, bodies[0], "metered-key", seconds + 1.0, args.flood_threads)))
            flooder.start()
            beside.append(open_loop(port, bodies, rate, seconds, args.client_processes, args.threads))
            flooder.join()
            floods.append(got)
            print(f"  metered: {got['admitted_per_s']:.1f} admitted/s of {got['sent'] / got['seconds']:.0f} sent/s "
                  f"(quota {args.quota_rate:g}/s); others p50 {beside[-1]['accepted_p50_ms']:.2f} p99 {beside[-1]['accepted_p99_ms']:.2f} ms "
                  f"vs alone p50 {alone[-1]['accepted_p50_ms'] if alone else float('nan'):.2f} p99 "
                  f"{alone[-1]['accepted_p99_ms'] if alone else float('nan'):.2f} ms", flush=True)
    keys = ("goodput_rps", "accepted_p50_ms", "accepted_p99_ms")
    a, b = median_row(alone, keys), median_row(beside, keys)
    # the bucket's burst is admitted once at the start of each flood: the sustained rate is the rest
    held = [(f["admitted"] - args.quota_rate) / f["seconds"] for f in floods]
    result["quotas"] = {"others_offered_rps": rate, "window_s": seconds, "quota_rate_per_s": args.quota_rate,
                        "others_alone": {**a, "windows": alone}, "others_beside_flood": {**b, "windows": beside}, "floods": floods,
                        "metered_sustained_per_s": held, "metered_vs_quota": [h / args.quota_rate for h in held],
                        "others_p50_ratio": b["accepted_p50_ms"] / a["accepted_p50_ms"],
                        "others_p99_ratio": b["accepted_p99_ms"] / a["accepted_p99_ms"]}
    q = result["quotas"]
    print(f"metered caller held to {', '.join(f'{r:.3f}' for r in q['metered_vs_quota'])} x its quota (burst excluded); "
          f"others beside the flood: p50 {q['others_p50_ratio']:.2f}x, p99 {q['others_p99_ratio']:.2f}x alone", flush=True)


if __name__ == "__main__":
    main()
