"""The online feature state of a serving node at scale: resident memory per user, snapshot
load (a fresh node's start) and write, by-ids assembly, and the rate updates apply at.

For each ``--users`` count, one snapshot of that many users (a full ``--history``-click
history each, a day's span, and some impressions and clicks in the windows) and
``--items`` Zipf-hot items over ``--categories`` categories (bench_serving_by_ids.py's
``synth_snapshot``), then, in a fresh process per count (clean resident memory):

- load: ``OnlineFeatures.load_snapshot`` wall time, the snapshot's pages dropped from the
  page cache first (``cold``: a fresh node) or read once (``warm``), and the process's
  anonymous resident growth (RssAnon: not the page cache) per user once loaded;
- write: ``save_snapshot`` of the loaded state, wall time;
- assembly: ``assemble_batch`` of 10 requests of 200 candidates, p50 over repeats;
- apply: history and counter-bucket messages (the job's, for ``--apply-users`` new users)
  through the topic reader's path, messages per second;
- compaction: the columnar store's users' impression-time arena squeezed once: the time to
  build the new arena (requests go on meanwhile) and the lock held to switch to it.

Usage: streamrec bench feature_state [--users 1000000 10000000] [--items 1000] [--cache cold warm] [--label new]
       [--out var/bench]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from bench_serving_by_ids import _lists, _times  # noqa: E402
from output import write_result  # noqa: E402

import pyarrow as pa  # noqa: E402

from streamrec.contracts.feature_spec import FeatureSpec  # noqa: E402
from streamrec.contracts.feature_state import ENTITIES, Watermarks  # noqa: E402
from streamrec.serving.features.feature_snapshot import SCHEMA, SnapshotHeader, write_snapshot  # noqa: E402
from streamrec.serving.by_ids import ByIdsQuery  # noqa: E402
from streamrec.serving.features.online_features import OnlineFeatures  # noqa: E402

SPEC = FeatureSpec()
TOPIC = "bench.features"


def synth_snapshot(path: Path, users: int, items: int, categories: int, history: int, seed: int = 5) -> int:
    """bench_serving_by_ids.synth_snapshot's state (the same draws, in the same order: the
    same file), its batches made while they are written: 10M users' never all in memory."""
    rng = np.random.default_rng(seed)
    now = int(time.time() * 1000)
    span = max(SPEC.windows_s) * 1000
    item_category = rng.integers(1, categories + 1, items + 1)

    def batch(kind: str, ids: np.ndarray, imps: np.ndarray, clicks: np.ndarray, hist: pa.Array | None) -> pa.RecordBatch:
        it, ct = _times(rng, imps, now, span), _times(rng, clicks, now, span)
        kinds = pa.DictionaryArray.from_arrays(pa.array(np.full(len(ids), ENTITIES.index(kind), np.int8)), pa.array(list(ENTITIES)))
        return pa.record_batch([kinds, pa.array(ids), _lists(imps, it), _lists(clicks, ct),
                                hist if hist is not None else pa.nulls(len(ids), pa.list_(pa.int64()))], schema=SCHEMA)

    def batches():
        for start in range(0, users, 200_000):
            ids = np.arange(start + 1, min(users, start + 200_000) + 1, dtype=np.int64)
            n = len(ids)
            clicked = rng.zipf(1.3, n * history) % items + 1
            ts = now - 1 - np.sort(rng.integers(0, 86_400_000, (n, history)), axis=1)
            triples = np.stack([clicked.reshape(n, history), item_category[clicked].reshape(n, history), ts], axis=2).reshape(-1)
            imps = rng.poisson(8, n)
            yield batch("user", ids, imps, np.minimum(imps, rng.poisson(1, n)), _lists(np.full(n, 3 * history), triples))
        hot = np.minimum((50_000 / np.arange(1, items + 1) ** 0.9).astype(np.int64), 5_000)
        yield batch("item", np.arange(1, items + 1, dtype=np.int64), hot, hot // 30, None)
        per_category = np.minimum(np.bincount(item_category[1:], weights=hot, minlength=categories + 1)[1:].astype(np.int64), 20_000)
        yield batch("category", np.arange(1, categories + 1, dtype=np.int64), per_category, per_category // 30, None)

    marks = Watermarks()
    for stage in ENTITIES:
        marks.marks[(0, stage, 0)] = now - 1000
        marks.parallelism[stage] = 1
    spec = {"windows_s": list(SPEC.windows_s), "history_len": SPEC.history_len}
    return write_snapshot(path, SnapshotHeader(TOPIC, 1, {0: 0}, marks, spec), batches())


def _rss_anon_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _apply_messages(users: int, first_id: int, now: int) -> list[SimpleNamespace]:
    rng = np.random.default_rng(3)
    out = []
    for u in range(first_id, first_id + users):
        entries = [[1000 + k, k % 40, now - 1000 * (k + 1)] for k in range(SPEC.history_len)]
        out.append(SimpleNamespace(key=f"h/user/{u}".encode(), value=orjson.dumps({"h": entries}), partition=0, offset=0))
        start = now // 10_000 * 10_000
        imps = sorted(int(x) for x in rng.integers(0, now - start + 1, 3))
        out.append(SimpleNamespace(key=f"c/user/{u}/{start}".encode(), value=orjson.dumps({"i": imps, "c": imps[:1]}),
                                   partition=0, offset=0))
    return out


def _page_cache(path: Path, cache: str) -> None:
    """``cold``: the file's pages dropped from the page cache (a node whose snapshot is on
    disk only); ``warm``: the file read once (it was just written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if cache == "cold":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        else:
            while os.read(fd, 1 << 24):
                pass
    finally:
        os.close(fd)


def measure(snapshot: Path, users: int, items: int, apply_users: int, repeat: int, cache: str) -> dict:
    """One process's measurements (run by :func:`main` in a child: clean resident memory)."""
    _page_cache(snapshot, cache)
    gc.collect()
    before = _rss_anon_mb()
    features = OnlineFeatures("127.0.0.1:9", TOPIC, SPEC, 1 << 20, Path(tempfile.mkdtemp(prefix="bench-fs-")) / "spill")
    t0 = time.perf_counter()
    features.load_snapshot(snapshot)
    load_s = time.perf_counter() - t0
    gc.collect()
    grown = _rss_anon_mb() - before
    status = features.status()
    out = {"users": users, "snapshot_page_cache": cache, "load_s": round(load_s, 2), "rss_anon_growth_mb": round(grown, 1),
           "resident_bytes_per_user": round(grown * 2**20 / users), "memory_bytes_reported": status["memory_bytes"],
           "entities": status["entities"]}
    rng, now = np.random.default_rng(1), features.as_of() or int(time.time() * 1000)
    queries = []
    for _ in range(400):
        chosen = rng.zipf(1.2, 200) % items + 1
        ids = np.stack([chosen, chosen % 100 + 1, chosen % 5000 + 1, np.arange(200)], axis=1).astype(np.int64)
        queries.append(ByIdsQuery(int(rng.zipf(1.1) % users + 1), now, "ios", 12, ids, False))
    features.assemble_batch(queries)  # every item's counts cached once: a warm node
    times = []
    for r in range(repeat):
        group = [queries[(r * 10 + j) % len(queries)] for j in range(10)]
        t0 = time.perf_counter()
        features.assemble_batch(group)
        times.append(time.perf_counter() - t0)
    out["assemble_10x200_p50_ms"] = round(float(np.median(times)) * 1e3, 3)
    path = snapshot.with_name(snapshot.name + ".rewritten")
    t0 = time.perf_counter()
    size = features.save_snapshot(path)
    out["write_s"], out["written_bytes"] = round(time.perf_counter() - t0, 2), size
    path.unlink()
    messages = _apply_messages(apply_users, users + 1, now)
    t0 = time.perf_counter()
    for k in range(0, len(messages), 500):
        features._apply_records(messages[k: k + 500])
    out["apply_messages_per_s"] = round(len(messages) / (time.perf_counter() - t0))
    store = getattr(features, "store", None)
    if store is not None:  # the columnar store: an arena's compaction, built outside the lock, switched under it
        imps = store.kinds["user"].imps
        out["user_impression_times"] = int(imps.live)
        t0 = time.perf_counter()
        compacted = imps.compacted(store.kinds["user"].index.n)
        t1 = time.perf_counter()
        imps.install(compacted)
        out["compact_user_impressions_s"] = round(t1 - t0, 2)
        out["compact_lock_held_ms"] = round((time.perf_counter() - t1) * 1000, 3)
    features.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--categories", type=int, default=100)
    parser.add_argument("--history", type=int, default=SPEC.history_len)
    parser.add_argument("--apply-users", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--dir", default="/tmp/bench-feature-state", help="where the snapshots are made (kept between runs)")
    parser.add_argument("--label", default="new", help="names the implementation measured, in the JSON")
    parser.add_argument("--out", default="var/bench", help="directory of the JSON result (default: ./var/bench, under the current directory)")
    parser.add_argument("--cache", nargs="+", default=["cold", "warm"], choices=["cold", "warm"],
                        help="the snapshot's pages out of the page cache before the load, or in it; one run each")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(Path(args.child), args.users[0], args.items, args.apply_users, args.repeat, args.cache[0])))
        return
    result = {"machine": f"{os.cpu_count()} cores", "implementation": args.label, "items": args.items,
              "categories": args.categories, "history": args.history, "runs": []}
    for users in args.users:
        snapshot = Path(args.dir) / f"users-{users}-items-{args.items}-h{args.history}.arrow"
        if not snapshot.exists():
            t0 = time.perf_counter()
            size = synth_snapshot(snapshot, users, args.items, args.categories, args.history)
            print(f"made {snapshot} ({size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s", flush=True)
        for cache in args.cache:
            child = subprocess.run([sys.executable, __file__, "--child", str(snapshot), "--users", str(users), "--items", str(args.items),
                                    "--apply-users", str(args.apply_users), "--repeat", str(args.repeat), "--cache", cache],
                                   capture_output=True, text=True)
            if child.returncode != 0:
                print(child.stderr[-3000:], flush=True)
                result["runs"].append({"users": users, "snapshot_page_cache": cache, "failed": child.stderr[-1000:]})
                continue
            run = json.loads(child.stdout.strip().splitlines()[-1])
            run["snapshot_bytes"] = snapshot.stat().st_size
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
    write_result(args.out, f"feature-state-{args.label}", result)


if __name__ == "__main__":
    main()
