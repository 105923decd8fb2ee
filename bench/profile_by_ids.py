"""Where a by-ids batch's time goes in the model runtime (a diagnostic for bench_serving_by_ids.py):
decode, feature assembly, tensors, the model run, for batches of 1 to 20 requests, in process.

Usage: python bench/profile_by_ids.py --model-store S [--users 1000000] [--items 100000] [--candidates 200] [--device cuda]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_serving_by_ids import by_ids_bodies, synth_snapshot
from streamrec.contracts.events import MAX_FUTURE_SKEW_MS
from streamrec.model.batch import batch_from_columns
from streamrec.model.device import pick_device
from streamrec.model.network import inference_cache_rows
from streamrec.modelstore.store import ModelStore
from streamrec.plumbing.config import load_config
from streamrec.serving.features.online_features import OnlineFeatures
from streamrec.serving.runtime.request import ByIdsDecoder
from streamrec.serving.runtime.runner import RuntimeConfig
from streamrec.serving.runtime.state import ServedModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-store", required=True)
    parser.add_argument("--users", type=int, default=1_000_000)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--candidates", type=int, default=200)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    cfg = load_config()
    s = cfg.serving
    device = pick_device(args.device, "device")
    served = ServedModel(ModelStore(args.model_store, cfg.model.name), device, inference_cache_rows(cfg.model, cfg.ps), s.undo_depth,
                         RuntimeConfig.from_serving(s), cfg.features)
    served.catch_up()
    current = served.current
    with tempfile.TemporaryDirectory() as tmp:
        made = synth_snapshot(Path(tmp) / "f.arrow", cfg.topics.features, args.users, args.items, 1000, 50, cfg.features)
        features = OnlineFeatures("127.0.0.1:9", cfg.topics.features, cfg.features, 65536, Path(tmp) / "spill")
        t0 = time.perf_counter()
        features.load_snapshot(Path(tmp) / "f.arrow")
        print(f"snapshot load: {time.perf_counter() - t0:.1f} s", flush=True)
        bodies = by_ids_bodies(np.random.default_rng(1), 400, args.users, args.items, args.candidates, made["item_category"])
    decoder = ByIdsDecoder(100_000, MAX_FUTURE_SKEW_MS)
    now = int(time.time() * 1000)
    t0 = time.perf_counter()
    queries = [decoder.decode(b, now)[1] for b in bodies]
    print(f"decode + query: {(time.perf_counter() - t0) / len(bodies) * 1e3:.3f} ms per request", flush=True)
    features.assemble_batch(queries)  # every entity's counts cached once: the steady state of a warm node
    for k in (1, 5, 10, 20):
        phases = {"assemble": [], "tensors": [], "predict": []}
        for r in range(args.repeat):
            group = [queries[(r * k + j) % len(queries)] for j in range(k)]
            t0 = time.perf_counter()
            assembled = features.assemble_batch(group)
            t1 = time.perf_counter()
            batch = batch_from_columns(assembled.columns, current.feature_spec, current.network.spec.history_len)
            t2 = time.perf_counter()
            served.predict(batch, now_ms=now)
            t3 = time.perf_counter()
            if r >= 3:
                phases["assemble"].append(t1 - t0)
                phases["tensors"].append(t2 - t1)
                phases["predict"].append(t3 - t2)
        print(f"{k:3d} requests ({k * args.candidates} rows): " + ", ".join(
            f"{name} p50 {np.median(v) * 1e3:.2f} ms" for name, v in phases.items()), flush=True)
    group = queries[:10]
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(20):
        batch = batch_from_columns(features.assemble_batch(group).columns, current.feature_spec, current.network.spec.history_len)
        served.predict(batch, now_ms=now)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(40)
    print(out.getvalue()[:16000])


if __name__ == "__main__":
    main()
