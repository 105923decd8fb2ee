"""Hot-swap and rollback cost of the served model (serving/runtime/state.py).

A model store gets a full version (``--full-rows`` rows in the user table, small other
tables) and then a delta of ``--delta-rows`` user rows (half updates of existing rows,
half new) plus deletions and new dense weights. Ours: ``ServedModel.load(delta)`` applied
in place — split into *prepare* (read, verify, decode; batches keep running) and *locked*
(the time batches are held off) — and ``rollback()`` from the undo record. Baseline, same
run: what a server without in-place deltas does, a fresh ``InferenceModel.load`` of the new
version (full + delta chain). Targets (issue 6, H100): apply a 1M-row delta < 1 s,
rollback < 200 ms.

Usage: streamrec bench serving_swap [--full-rows 2000000] [--delta-rows 1000000] [--device cuda]
Writes var/bench/serving-swap-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.delta import SparseDelta
from streamrec.modelstore.store import ModelStore
from streamrec.modelstore.writer import VersionWriter
from streamrec.serving.runtime.state import ServedModel
from streamrec.plumbing.config import load_config
from streamrec.model.batch import TABLES
from streamrec.model.inference import InferenceModel
from streamrec.model.network import CTRModel, ModelSpec

from output import write_result  # bench/ is on sys.path (script dir; `streamrec bench` adds it)


def build_store(root: Path, full_rows: int, delta_rows: int, dim: int) -> tuple[ModelStore, int, int]:
    cfg = load_config(environ={})
    spec = ModelSpec.from_config(cfg.model, cfg.features)
    meta = {"model_spec": spec.to_json(), "feature_spec": FeatureSpec().to_json()}
    store = ModelStore(str(root), "ctr")
    g = torch.Generator().manual_seed(0)
    user_keys = torch.randperm(4 * full_rows, generator=g)[:full_rows] + 1
    tables = {name: SparseDelta(torch.arange(1, 1001), torch.randn(1000, dim, generator=g)) for name in TABLES}
    tables["user"] = SparseDelta(user_keys, torch.randn(full_rows, dim, generator=g))
    dims = {name: dim for name in TABLES}
    dense = CTRModel(spec).state_dict()
    writer = VersionWriter(store)
    full = writer.publish("full", tables, dims, dense, meta)
    updated = user_keys[: delta_rows // 2]
    new = torch.arange(4 * full_rows + 1, 4 * full_rows + 1 + delta_rows - len(updated))
    keys = torch.cat([updated, new])
    delta_tables = {name: SparseDelta(torch.empty(0, dtype=torch.int64), torch.empty(0, dim)) for name in TABLES}
    delta_tables["user"] = SparseDelta(keys, torch.randn(len(keys), dim, generator=g), deleted=user_keys[-10_000:])
    dense2 = {k: v + 0.01 for k, v in dense.items()}
    delta = writer.publish("delta", delta_tables, dims, dense2, meta)
    return store, full, delta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full-rows", type=int, default=2_000_000)
    parser.add_argument("--delta-rows", type=int, default=1_000_000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu | cuda[:N] (default: %(default)s, CUDA when present)")
    parser.add_argument("--out", default="var/bench", help="directory of the JSON result (default: ./var/bench, under the current directory)")
    args = parser.parse_args()
    dim = load_config(environ={}).model.embedding_dim
    with tempfile.TemporaryDirectory() as tmp:
        print(f"writing a full version ({args.full_rows:,} rows) and a delta ({args.delta_rows:,} rows) ...", flush=True)
        store, full, delta = build_store(Path(tmp), args.full_rows, args.delta_rows, dim)
        cache_rows = args.full_rows + args.delta_rows + 10_000
        served = ServedModel(store, args.device, gpu_cache_rows=cache_rows)
        served.load(full)
        for table in served.current.embeddings.tables.values():  # compile the GPU kernels first (a server does at its first batch)
            table.export(torch.arange(1, 100))
            table.find(torch.arange(1, 100), 0)
        t0 = time.perf_counter()
        report = served.load(delta)
        apply_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = served.rollback()
        rollback_s = time.perf_counter() - t0
        served.close()
        t0 = time.perf_counter()
        fresh = InferenceModel.load(store, delta, args.device, cache_rows)
        reload_s = time.perf_counter() - t0
        fresh.close()
    result = {
        "bench": "serving-swap", "device": args.device, "full_rows": args.full_rows, "delta_rows": args.delta_rows, "dim": dim,
        "host": platform.node(), "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "apply_s": apply_s, "apply_prepare_s": report.prepare_s, "apply_locked_s": report.locked_s, "apply_rows": report.rows,
        "rollback_s": rollback_s, "rollback_locked_s": back.locked_s,
        "baseline_fresh_reload_s": reload_s, "ratio_apply_over_reload": apply_s / reload_s,
    }
    print(json.dumps(result, indent=2))
    write_result(args.out, f"serving-swap-{args.device.split(':')[0]}", result)


if __name__ == "__main__":
    main()
