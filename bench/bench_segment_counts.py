"""Windowed counts of a serving batch's expired candidates: ``counts_until_many`` (the
serving process's recompute, serving/features/segment_counts.py) against a plain-numpy baseline (one
``np.searchsorted`` per entity and list, the way a per-entity loop does it).

The arena is shaped like the by-ids bench's items (bench_serving_by_ids.py): Zipf-hot
entities with up to 5,000 event times each, all within the longest window, and queries at
"now" for Zipf-drawn entities (most of a batch's expired candidates are rarely asked for,
so recomputed at every ask). Both give the same counts (checked); the figure is ms per batch.

Usage: python bench/bench_segment_counts.py [--entities 100000] [--queries 3200] [--out var/bench]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from output import write_result  # noqa: E402

from streamrec.plumbing.config import load_config  # noqa: E402
from streamrec.serving.features.segment_counts import counts_until_many  # noqa: E402
from streamrec.serving.features.time_lists import TimeLists  # noqa: E402


def arena(entities: int, span_ms: int, now: int, rng: np.random.Generator) -> tuple[TimeLists, TimeLists]:
    """Impressions and clicks of ``entities`` Zipf-hot entities, every time within ``span_ms`` before ``now``."""
    imps, clicks = TimeLists(entities, 1 << 20), TimeLists(entities, 1 << 16)
    imps.ensure_slots(entities)
    clicks.ensure_slots(entities)
    counts = np.minimum((50_000 / np.arange(1, entities + 1) ** 0.9).astype(np.int64), 5_000)
    for slot, n in enumerate(counts.tolist()):
        times = np.sort(now - 1 - rng.integers(0, span_ms, n))
        imps.replace_range(slot, times)
        clicks.replace_range(slot, times[:: 30].copy())
    return imps, clicks


def plain(lists: tuple[TimeLists, TimeLists], slots: np.ndarray, ts: np.ndarray, windows: tuple[int, ...]) -> np.ndarray:
    """The baseline: per query and list, one ``np.searchsorted`` of ts and every window's start."""
    out = np.empty((len(slots), 2 * len(windows)), np.int64)
    for i, (slot, at) in enumerate(zip(slots.tolist(), ts.tolist())):
        for k, times in enumerate(lists):
            held = times.get(slot)
            found = held.searchsorted([at] + [at - w + 1 for w in windows], "left")
            out[i, k::2] = found[0] - found[1:]
    return out


def timed(fn, reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=3_200, help="expired candidates recomputed in one batch")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default="var/bench")
    args = parser.parse_args()
    windows = tuple(w * 1000 for w in load_config().features.windows_s)
    rng = np.random.default_rng(3)
    now = 1_800_000_000_000
    lists = arena(args.entities, max(windows), now, rng)
    slots = (rng.zipf(1.2, args.queries) % args.entities).astype(np.int64)
    ts = now + rng.integers(0, 50, args.queries)  # the batch's requests, a few ms apart
    ours, _ = counts_until_many(lists, slots, ts, windows)
    assert np.array_equal(ours, plain(lists, slots, ts, windows)), "counts differ from the baseline"
    ours_ms = timed(lambda: counts_until_many(lists, slots, ts, windows), args.reps)
    plain_ms = timed(lambda: plain(lists, slots, ts, windows), max(3, args.reps // 10))
    result = {"bench": "segment_counts", "entities": args.entities, "queries": args.queries, "windows_ms": list(windows),
              "event_times": int(lists[0].used), "ours_ms_per_batch": round(ours_ms, 3), "plain_ms_per_batch": round(plain_ms, 3),
              "speedup": round(plain_ms / ours_ms, 2)}
    print(f"{args.queries} (entity, ts) counts over {args.entities:,} entities ({result['event_times']:,} times): "
          f"ours {ours_ms:.2f} ms, plain numpy per entity {plain_ms:.2f} ms ({result['speedup']}x)")
    write_result(args.out, "segment-counts", result)


if __name__ == "__main__":
    main()
