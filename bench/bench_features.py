"""Online features: assembly speed, memory, the job's cost of publishing its state,
and event -> feature visible at the serving node.

1. Assembly (in process, no Kafka): the serving node's :class:`OnlineFeatures` holding a
   user with a full history, 100 items and 40 categories with a realistic 600 s of event
   times (hot categories ~50 events/s), fed the very messages the job writes; the time of
   ``assemble`` for that user and 100 candidates, p50/p99. Baseline, same state: plain
   Python counting each entity's times with a loop (what a first version of such code does).
2. Memory: the online features' resident growth for ``--users`` users with a typical state (a few
   impressions and clicks in the window, a full history), per million users.
3. Job throughput: the Flink job (embedded mini-cluster, ``--bounded``) over one backlog,
   with and without the feature output (``flink.feature_state``), round-robin
   ``--repeat`` times; medians and the ratio (bench_pipeline.py's measurement).
4. Freshness: the live job at ``--live-rate`` events/s and :class:`OnlineFeatures` in this process
   reading its features topic (the serving node's code). An event at time ts is visible when
   their ``features_as_of`` passes ts (every message before a stage's watermark precedes
   it in each partition); latency = that wall time - ts, over every 100 ms of the run's
   event time after its first 5 s. Repeated with ``--checkpoint-intervals`` (exactly-once:
   the state becomes readable at each checkpoint).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_pipeline import _cli, _embedded_broker, _env, _medians, flink_backlog  # noqa: E402
from output import write_result  # noqa: E402

from streamrec.contracts.feature_spec import FeatureSpec  # noqa: E402
from streamrec.contracts.feature_state import Candidate  # noqa: E402
from streamrec.pipelines.flink_rest import FlinkRest  # noqa: E402
from streamrec.serving.features.online_features import OnlineFeatures  # noqa: E402
from streamrec.plumbing.bus.topics import delete_topics, list_topics  # noqa: E402

SPEC = FeatureSpec()
BUCKET_MS = 10_000


def _bucket_messages(entity: str, entity_id: int, times: list[int]) -> list[SimpleNamespace]:
    """The job's counter-bucket messages for sorted event times (impressions; every 30th a click)."""
    by_bucket: dict[int, tuple[list, list]] = {}
    for k, t in enumerate(times):
        start = t // BUCKET_MS * BUCKET_MS
        i, c = by_bucket.setdefault(start, ([], []))
        (c if k % 30 == 29 else i).append(t - start)
    return [SimpleNamespace(key=f"c/{entity}/{entity_id}/{s}".encode(), value=orjson.dumps({"i": i, "c": c}), partition=0, offset=0)
            for s, (i, c) in by_bucket.items()]


def _history_message(user: int, now: int, n: int) -> SimpleNamespace:
    entries = [[1000 + k, k % 40, now - 1000 * (k + 1)] for k in range(n)]
    return SimpleNamespace(key=f"h/user/{user}".encode(), value=orjson.dumps({"h": entries}), partition=0, offset=0)


def _times(now: int, rate: float, rng: random.Random, window_ms: int = 600_000) -> list[int]:
    n = int(rate * window_ms / 1000)
    return sorted(now - rng.randrange(1, window_ms) for _ in range(n))


def assembly(reps: int) -> dict:
    rng, now = random.Random(1), int(time.time() * 1000)
    features = OnlineFeatures("unused:0", "unused", SPEC, 4096, f"/tmp/bench-features-{uuid.uuid4().hex[:6]}")
    raw: dict[str, list[int]] = {}
    messages = [_history_message(1, now, SPEC.history_len)]
    raw["user/1"] = _times(now, 0.2, rng)
    messages += _bucket_messages("user", 1, raw["user/1"])
    for item in range(100):
        raw[f"item/{item}"] = _times(now, 50 / (item + 1), rng)  # Zipf-like: the hottest 50 events/s
        messages += _bucket_messages("item", item, raw[f"item/{item}"])
    for cat in range(40):
        raw[f"category/{cat}"] = _times(now, 50 / (cat + 1) ** 0.5, rng)
        messages += _bucket_messages("category", cat, raw[f"category/{cat}"])
    features._apply_records(messages)
    candidates = [Candidate(item, item % 40, 7, 1 + item % 4) for item in range(100)]
    ours = []
    for _ in range(reps):
        t0 = time.perf_counter()
        features.assemble(1, now, "ios", 3, candidates)
        ours.append(time.perf_counter() - t0)
    windows = [w * 1000 for w in SPEC.windows_s]

    def naive() -> list:
        rows = []
        for c in candidates:
            row = []
            for key in ("user/1", f"item/{c.item_id}", f"category/{c.category_id}"):
                times = raw[key]
                row.extend(sum(1 for t in times if now - w < t < now) for w in windows)
            rows.append(row)
        return rows

    base = []
    for _ in range(max(5, reps // 50)):
        t0 = time.perf_counter()
        naive()
        base.append(time.perf_counter() - t0)
    features.close()
    ours_ms, base_ms = np.array(ours) * 1000, np.array(base) * 1000
    out = {"candidates": 100, "history": SPEC.history_len, "reps": reps,
           "event_times_held": sum(len(t) for t in raw.values()),
           "ours_ms": {"p50": round(float(np.percentile(ours_ms, 50)), 4), "p99": round(float(np.percentile(ours_ms, 99)), 4)},
           "plain_python_loop_ms": {"p50": round(float(np.percentile(base_ms, 50)), 3), "p99": round(float(np.percentile(base_ms, 99)), 3)}}
    out["speedup_p50"] = round(out["plain_python_loop_ms"]["p50"] / out["ours_ms"]["p50"], 1)
    return out


def memory(users: int) -> dict:
    """Memory the online features hold for ``users`` users with ~20 impressions and a click in the window
    and a full 50-click history each: live Python allocations (tracemalloc: what they
    keep) and the process's resident growth (also the allocator's arenas that the transient
    message objects left behind)."""
    import tracemalloc

    rng, now = random.Random(2), int(time.time() * 1000)
    features = OnlineFeatures("unused:0", "unused", SPEC, 1 << 20, f"/tmp/bench-features-{uuid.uuid4().hex[:6]}")
    gc.collect()
    before = _rss_mb()
    tracemalloc.start()
    for start in range(0, users, 2_000):
        messages = []
        for u in range(start, min(users, start + 2_000)):
            messages.append(_history_message(u, now, SPEC.history_len))
            messages += _bucket_messages("user", u, _times(now, 20 / 600, rng))
        features._apply_records(messages)
        del messages
    gc.collect()
    live = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    grown = _rss_mb() - before
    estimate = features.status()["memory_bytes"] / 2**20
    features.close()
    return {"users": users, "live_mb": round(live, 1), "rss_growth_mb": round(grown, 1), "store_estimate_mb": round(estimate, 1),
            "mb_per_million_users": round(live * 1e6 / users), "rss_mb_per_million_users": round(grown * 1e6 / users),
            "note": "20 event times and a 50-click history per user"}


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def throughput(args, tmp: Path) -> dict:
    name = f"{args.name}-tp"
    env = {**_env(args, name, tmp, "rocksdb"), "STREAMREC_TOPICS__FEATURES": f"{name}.features"}
    gen = subprocess.run([sys.executable, "-m", "streamrec.cli", "generate", "--duration", str(args.seconds), "--rate",
                          str(args.rate), "--fast", "--no-truth", "--json"], cwd=REPO, env=env, capture_output=True, text=True)
    if gen.returncode != 0:
        raise SystemExit(gen.stderr)
    events = orjson.loads(gen.stdout)["events"]
    runs = []
    for i, feature_state in enumerate(v for _ in range(args.repeat) for v in ("true", "false")):
        run = flink_backlog(args, {**env, "STREAMREC_FLINK__FEATURE_STATE": feature_state}, "rocksdb", tmp, events, i)
        run.pop("progress", None)
        run["backend"] = "with features" if feature_state == "true" else "without features"
        runs.append(run)
        print(f"  job {run['backend']}: {run['events_per_s']:,} events/s, {run['events_per_flink_cpu_s'] or 0:,} per Flink CPU-s",
              flush=True)
    med = _medians(runs)
    with_f, without = med["with features"], med["without features"]
    return {"events": events, "runs": runs, "median": med,
            "ratio_events_per_s": round(with_f["events_per_s"] / without["events_per_s"], 3),
            "ratio_events_per_flink_cpu_s": round(with_f["events_per_flink_cpu_s"] / max(1, without["events_per_flink_cpu_s"]), 3)}


def freshness(args, tmp: Path, checkpoint_s: float) -> dict:
    name = f"{args.name}-live-{str(checkpoint_s).replace('.', '')}"
    env = {**_env(args, name, tmp, "rocksdb"), "STREAMREC_TOPICS__FEATURES": f"{name}.features",
           "STREAMREC_FLINK__CHECKPOINT_INTERVAL_S": str(checkpoint_s)}
    job = _cli(env, "pipeline", "submit", "--fresh", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    features = None
    try:
        FlinkRest(f"127.0.0.1:{env['STREAMREC_FLINK__REST_PORT']}").wait_running(name, 180, all_tasks=True)
        features = OnlineFeatures(args.bootstrap, f"{name}.features", SPEC, 1024, tmp / f"{name}-features").start()
        readings: list[tuple[float, int]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.01):
                as_of = features.as_of()
                if as_of is not None:
                    readings.append((time.time() * 1000, as_of))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        start_ms = int(time.time() * 1000)
        gen = _cli(env, "generate", "--duration", str(args.live_seconds), "--rate", str(args.live_rate), "--no-truth",
                   "--start-ms", str(start_ms), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        gen.wait()
        time.sleep(args.drain_seconds)
        stop.set()
        watcher.join(5)
        status = features.status()
    finally:
        if features is not None:
            features.close()
        os.killpg(job.pid, 15)
        job.wait(60)
    walls = np.array([w for w, _ in readings])
    as_ofs = np.maximum.accumulate(np.array([a for _, a in readings])) if readings else np.zeros(0)
    end_ms = start_ms + int(args.live_seconds * 1000)
    latencies = []
    for ts in range(start_ms + 5000, end_ms, 100):
        i = int(np.searchsorted(as_ofs, ts, side="right"))  # the first reading with as_of > ts
        if i < len(as_ofs):
            latencies.append(walls[i] - ts)
    lat = np.array(latencies)
    return {"checkpoint_interval_s": checkpoint_s, "rate": args.live_rate, "seconds": args.live_seconds,
            "points": len(lat), "never_visible": len(range(start_ms + 5000, end_ms, 100)) - len(lat),
            "event_to_visible_ms": {"p50": round(float(np.percentile(lat, 50))), "p99": round(float(np.percentile(lat, 99))),
                                    "max": round(float(lat.max()))} if len(lat) else {},
            "store": {k: status[k] for k in ("messages", "entities", "memory_bytes", "corrupt")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--reps", type=int, default=3000, help="assembly: timed requests")
    parser.add_argument("--users", type=int, default=200_000, help="memory: users in the online features")
    parser.add_argument("--seconds", type=float, default=60, help="throughput: simulated seconds of backlog")
    parser.add_argument("--rate", type=float, default=2000, help="throughput: events/s of the backlog")
    parser.add_argument("--repeat", type=int, default=2, help="throughput: runs with and without, round-robin (0: skip)")
    parser.add_argument("--live-rate", type=float, default=1000)
    parser.add_argument("--live-seconds", type=float, default=40, help="freshness: 0 skips it")
    parser.add_argument("--checkpoint-intervals", default="2,0.5", help="freshness: flink.checkpoint_interval_s values")
    parser.add_argument("--drain-seconds", type=float, default=10)
    parser.add_argument("--out", default="var/bench", help="directory of the JSON result (default: ./var/bench, under the current directory)")
    args = parser.parse_args()
    args.name = f"bench-{uuid.uuid4().hex[:6]}"
    tmp = REPO / "var" / "bench-features"
    result = {"machine": f"{os.cpu_count()} cores"}
    result["assembly"] = a = assembly(args.reps)
    print(f"assembly, 100 candidates, full history: p50 {a['ours_ms']['p50']} ms, p99 {a['ours_ms']['p99']} ms "
          f"(plain Python loop: p50 {a['plain_python_loop_ms']['p50']} ms, {a['speedup_p50']}x)", flush=True)
    result["memory"] = m = memory(args.users)
    print(f"memory: {m['mb_per_million_users']:,} MB per million users held by the online features ({m['users']:,} users: "
          f"{m['live_mb']} MB live, {m['rss_growth_mb']} MB resident growth)", flush=True)
    broker = _embedded_broker()
    args.broker_pids = broker.status().pids if broker else []
    try:
        if args.repeat:
            result["throughput"] = t = throughput(args, tmp)
            print(f"job throughput with/without the feature output: {t['ratio_events_per_s']}x events/s, "
                  f"{t['ratio_events_per_flink_cpu_s']}x per Flink CPU-second", flush=True)
        if args.live_seconds > 0:
            result["freshness"] = []
            for interval in (float(x) for x in args.checkpoint_intervals.split(",")):
                f = freshness(args, tmp, interval)
                result["freshness"].append(f)
                print(f"event -> feature visible, checkpoint every {interval:g} s: {f['event_to_visible_ms']}", flush=True)
    finally:
        deleted = delete_topics(args.bootstrap, [t for t in list_topics(args.bootstrap) if t.startswith(args.name)])
        print(f"deleted the bench's {len(deleted)} topics", flush=True)
    write_result(args.out, "features", result)


if __name__ == "__main__":
    main()
