"""Predict by ids over HTTP, the form an ad server sends: throughput and latency with the
feature state of many users and items loaded into the node.

The node starts from a feature snapshot (serving/features/feature_snapshot.py) of ``--users`` users
(each with ``--history`` clicks and some impressions in the windows) and ``--items`` items
over ``--categories`` categories (Zipf-hot: the hottest hold thousands of event times), its
broker unreachable (it serves from the snapshot, as after a broker outage). Requests: a
Zipf-drawn user and ``--candidates`` Zipf-drawn items each.

Three servers of the same model, one after the other, same clients:
- **ours**: by ids through ``--frontends`` HTTP front-end processes (they decode and check
  the body; the serving process assembles every request's features for the whole batch at once);
- **per-request** (baseline): by ids, one request per batch, no front-ends: the serving
  process decodes, assembles and scores each request on its own, one at a time;
- **instances** (reference): the same requests with every feature supplied (as the node
  assembled them, ``return_features``), through the same front-ends and batching as ours.

Reported per level: req/s, candidates/s, p50/p99; per server the best candidates/s within
``--p99-target-ms``; ratios of ours to both. The model is trained on generated samples whose
ids mostly differ from the snapshot's: most lookups miss the tables (cold rows), as a
new-user-heavy load would.

Usage: streamrec bench serving_by_ids [--samples RUN] [--model-store S] [--users 1000000] [--items 100000]
       [--candidates 200] [--concurrency 8 32 64] [--seconds 5] [--device cuda] [--frontends 4]
Writes var/bench/serving-by-ids-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa

from bench_serving import best_point, load, model_status, start_server
from bench_trainer import make_samples
from output import write_result
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.feature_state import ENTITIES, Watermarks
from streamrec.plumbing.config import load_config
from streamrec.serving.features.feature_snapshot import SCHEMA, SnapshotHeader, write_snapshot

REPO = Path(__file__).resolve().parent.parent


def _lists(lengths: np.ndarray, values: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int64()))


def _times(rng: np.random.Generator, counts: np.ndarray, now: int, span_ms: int) -> np.ndarray:
    """Per entity ``counts[e]`` ascending event times in the last ``span_ms`` before ``now``, flat."""
    flat = now - 1 - rng.integers(0, span_ms, int(counts.sum()))
    owner = np.repeat(np.arange(len(counts)), counts)
    return flat[np.lexsort((flat, owner))]


def synth_snapshot(path: Path, topic: str, users: int, items: int, categories: int, history: int, spec: FeatureSpec,
                   seed: int = 5) -> dict:
    """A snapshot of ``users`` users, ``items`` items and ``categories`` categories, built in numpy."""
    rng = np.random.default_rng(seed)
    now = int(time.time() * 1000)
    span = max(spec.windows_s) * 1000
    item_category = rng.integers(1, categories + 1, items + 1)
    batches = []

    def add(kind: str, ids: np.ndarray, imps: np.ndarray, clicks: np.ndarray, hist: pa.Array | None) -> None:
        it, ct = _times(rng, imps, now, span), _times(rng, clicks, now, span)
        kinds = pa.DictionaryArray.from_arrays(pa.array(np.full(len(ids), ENTITIES.index(kind), np.int8)), pa.array(list(ENTITIES)))
        batches.append(pa.record_batch([kinds, pa.array(ids), _lists(imps, it), _lists(clicks, ct),
                                        hist if hist is not None else pa.nulls(len(ids), pa.list_(pa.int64()))], schema=SCHEMA))

    for start in range(0, users, 200_000):  # users in chunks: each with a full history
        ids = np.arange(start + 1, min(users, start + 200_000) + 1, dtype=np.int64)
        n = len(ids)
        clicked = rng.zipf(1.3, n * history) % items + 1
        ts = now - 1 - np.sort(rng.integers(0, 86_400_000, (n, history)), axis=1)  # most recent first
        triples = np.stack([clicked.reshape(n, history), item_category[clicked].reshape(n, history), ts], axis=2).reshape(-1)
        imps = rng.poisson(8, n)
        add("user", ids, imps, np.minimum(imps, rng.poisson(1, n)), _lists(np.full(n, 3 * history), triples))
    hot = np.minimum((50_000 / np.arange(1, items + 1) ** 0.9).astype(np.int64), 5_000)  # Zipf-hot items
    add("item", np.arange(1, items + 1, dtype=np.int64), hot, hot // 30, None)
    per_category = np.bincount(item_category[1:], weights=hot, minlength=categories + 1)[1:].astype(np.int64)
    add("category", np.arange(1, categories + 1, dtype=np.int64), np.minimum(per_category, 20_000), np.minimum(per_category, 20_000) // 30, None)
    marks = Watermarks()
    for stage in ENTITIES:
        marks.marks[(0, stage, 0)] = now - 1000
        marks.parallelism[stage] = 1
    size = write_snapshot(path, SnapshotHeader(topic, 1, {0: 0}, marks, {"windows_s": list(spec.windows_s), "history_len": spec.history_len}),
                          batches)
    return {"users": users, "items": items, "categories": categories, "history": history, "bytes": size,
            "event_times": int(sum(b.column(2).values.__len__() + b.column(3).values.__len__() for b in batches)),
            "item_category": item_category}


def by_ids_bodies(rng: np.random.Generator, n: int, users: int, items: int, candidates: int, item_category: np.ndarray) -> list[bytes]:
    out = []
    for _ in range(n):
        chosen = rng.zipf(1.2, candidates) % items + 1
        out.append(orjson.dumps({"user_id": int(rng.zipf(1.1) % users + 1), "context": {"device": "ios", "local_hour": 12},
                                 "candidates": [{"item_id": int(i), "category_id": int(item_category[i]), "advertiser_id": int(i % 5000 + 1),
                                                 "position": p} for p, i in enumerate(chosen)]}))
    return out


def instance_bodies(port: int, bodies: list[bytes]) -> list[bytes]:
    """The same requests with every feature, as the node assembles them (return_features)."""
    conn, out = http.client.HTTPConnection("127.0.0.1", port, timeout=60), []
    for body in bodies:
        request = orjson.loads(body)
        request["return_features"] = True
        conn.request("POST", "/v1/models/ctr:predict", body=orjson.dumps(request), headers={"content-type": "application/json"})
        response = conn.getresponse()
        answer = orjson.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"return_features request failed: {answer}")
        out.append(orjson.dumps({"instances": answer["features"]}))
    return out


def level_batching(before: dict, after: dict, wall_s: float) -> dict:
    """The batcher's figures over one load level (``wall_s`` between its two readings): the
    difference of its cumulative counters; ``busy``: the share of that time a batch ran."""
    batches, requests = after["batches"] - before["batches"], after["requests"] - before["requests"]
    run_s, queued_s = after["run_s"] - before["run_s"], after["queued_s"] - before["queued_s"]
    return {"batches": batches, "requests": requests, "requests_per_batch": round(requests / max(batches, 1), 2),
            "run_ms_per_batch": round(run_s / max(batches, 1) * 1000, 3),
            "queued_ms_per_request": round(queued_s / max(requests, 1) * 1000, 3), "run_s": round(run_s, 3),
            "busy": run_s / wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", help="a `pipeline offline` run dir or samples.parquet to train the model on (default: generate one)")
    parser.add_argument("--model-store", help="serve this store (model 'ctr') instead of training one")
    parser.add_argument("--users", type=int, default=1_000_000)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--categories", type=int, default=1_000)
    parser.add_argument("--history", type=int, default=50)
    parser.add_argument("--candidates", type=int, default=200)
    parser.add_argument("--requests", type=int, default=400, help="distinct request bodies, cycled")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--device", default="cpu", help="cpu | cuda[:N]: where the served model runs (default: %(default)s)")
    parser.add_argument("--frontends", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=4096, help="serving.max_batch of ours and the instances reference")
    parser.add_argument("--max-delay-us", type=int, default=2000)
    parser.add_argument("--batch-buckets", default="1,16,64,256,1024,2048,4096", help="serving.batch_buckets of every server")
    parser.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--p99-target-ms", type=float, default=10.0)
    parser.add_argument("--servers", nargs="+", default=["ours", "per_request", "instances"],
                        help="which to run: ours, ours_1w / ours_2w (ours with 1 / 2 batch worker threads), ours_host_counts (ours "
                             "with serving.candidate_counts = host), per_request, instances")
    parser.add_argument("--workers", type=int, default=0, help="serving.workers of ours, per_request and instances (0: batches "
                                                                 "run on the event loop's thread)")
    parser.add_argument("--out", default="var/bench", help="directory of the JSON result (default: ./var/bench, under the current directory)")
    args = parser.parse_args()
    spec = load_config().features
    result = {"bench": "serving_by_ids", "device": args.device, "candidates": args.candidates, "seconds": args.seconds,
              "frontends": args.frontends, "max_batch": args.max_batch, "max_delay_us": args.max_delay_us, "host": platform.node(),
              "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(args.model_store or Path(tmp) / "models")
        if not (store / "ctr" / "LATEST").exists():
            samples = args.samples or make_samples(Path(tmp) / "run")
            subprocess.run([sys.executable, "-m", "streamrec.cli", "train", "--samples", str(samples), "--model-store", str(store),
                            "--work-dir", str(Path(tmp) / "work"), "--max-samples", "50000", "--no-frozen", "--device", args.device],
                           cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        snapshot = Path(tmp) / "features.arrow"
        t0 = time.monotonic()
        made = synth_snapshot(snapshot, load_config().topics.features, args.users, args.items, args.categories, args.history, spec)
        item_category = made.pop("item_category")
        result["snapshot"] = {**made, "build_s": round(time.monotonic() - t0, 1)}
        print(f"snapshot: {made['users']:,} users, {made['items']:,} items, {made['event_times']:,} event times, "
              f"{made['bytes'] / 2**20:.0f} MiB in {result['snapshot']['build_s']} s", flush=True)
        bodies = by_ids_bodies(np.random.default_rng(1), args.requests, args.users, args.items, args.candidates, item_category)
        features_env = {"STREAMREC_SERVING__FEATURE_STORE": "true", "STREAMREC_SERVING__FEATURE_SNAPSHOT": str(snapshot),
                        "STREAMREC_SERVING__FEATURE_SNAPSHOT_INTERVAL_S": "0", "STREAMREC_SERVING__FEATURE_STORE_MEMORY_MB": "65536",
                        "STREAMREC_SERVING__FEATURE_STORE_DIR": str(Path(tmp) / "spill"), "STREAMREC_SERVING__FEATURES_MAX_LAG_S": "86400",
                        "STREAMREC_KAFKA__BOOTSTRAP": "127.0.0.1:9", "STREAMREC_KAFKA__CONNECT_TIMEOUT_S": "1",
                        "STREAMREC_SERVING__BATCH_BUCKETS": args.batch_buckets}
        on_host = {"STREAMREC_SERVING__CANDIDATE_COUNTS": "host"}
        servers = {"ours": (args.max_batch, args.max_delay_us, "auto", args.frontends, args.workers, {}),
                   "ours_1w": (args.max_batch, args.max_delay_us, "auto", args.frontends, 1, {}),
                   "ours_2w": (args.max_batch, args.max_delay_us, "auto", args.frontends, 2, {}),
                   "ours_host_counts": (args.max_batch, args.max_delay_us, "auto", args.frontends, args.workers, on_host),
                   "per_request": (1, 0, "auto", 0, args.workers, {}),
                   "instances": (args.max_batch, args.max_delay_us, "auto", args.frontends, args.workers, {})}
        instances = None
        for name in args.servers:
            max_batch, delay, mode, frontends, workers, env = servers[name]
            t0 = time.monotonic()
            proc, port = start_server(store, args.device, max_batch, delay, workers, mode, frontends,
                                      extra_env={**features_env, **env, "STREAMREC_SERVING__MAX_INSTANCES": str(max(1000, args.candidates))})
            started = time.monotonic() - t0
            try:
                if name == "instances":
                    instances = instances or instance_bodies(port, bodies[: min(len(bodies), 200)])
                work = instances if name == "instances" else bodies
                load(port, work, 8, 2.0, args.client_processes)  # warm-up
                rows = []
                before, read_at = model_status(port)["batching"], time.monotonic()
                for c in args.concurrency:
                    row = load(port, work, c, args.seconds, args.client_processes)
                    row["candidates_per_s"] = row["qps"] * args.candidates
                    status = model_status(port)
                    level = level_batching(before, status["batching"], time.monotonic() - read_at)
                    before, read_at = status["batching"], time.monotonic()
                    row["server"] = {"batching": status["batching"], "level": level,
                                     "features": {k: status["features"].get(k) for k in ("entities", "memory_bytes", "lag_ms", "counter_cache",
                                                                                             "device_counts")}}
                    rows.append(row)
                    print(f"{name:12s} c={c:4d}: {row['qps']:8.0f} req/s {row['candidates_per_s']:10.0f} candidates/s "
                          f"p50 {row['p50_ms']:6.2f} ms p99 {row['p99_ms']:6.2f} ms errors {row['errors']}  "
                          f"(this level: {level['requests_per_batch']} req/batch, run {level['run_ms_per_batch']} ms/batch, "
                          f"queued {level['queued_ms_per_request']} ms/request, model runtime busy {level['busy']:.0%})", flush=True)
                result[name] = {"ready_after_s": round(started, 1), "workers": workers, "levels": rows}
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    best = {}
    for name in args.servers:
        point = best_point(result[name]["levels"], args.p99_target_ms)
        best[name] = point["candidates_per_s"] if point else 0.0
        result[name]["best_within_p99_target"] = point
        print(f"{name}: best within p99 <= {args.p99_target_ms:g} ms: {best[name]:,.0f} candidates/s")
    if "ours" in best:
        result["ratios"] = {f"ours_vs_{k}": (best["ours"] / v if v else None) for k, v in best.items() if k != "ours"}
        print("ratios:", result["ratios"])
    write_result(args.out, f"serving-by-ids-{args.device.split(':')[0]}", result)


if __name__ == "__main__":
    main()
