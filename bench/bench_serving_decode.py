"""The host side of a predict request, without HTTP: body bytes to model tensors.

- ours: ``serving.runtime.request.InstanceDecoder`` (msgspec typed decode per request, columns and
  cross-field checks per batch) + ``model.batch.batch_from_columns``;
- baseline: the training path applied to requests: parse each body with orjson, re-encode each
  instance, ``contracts.sample_wire.decode_samples`` (pyarrow's JSON reader + the sample checks) and
  ``batch_from_table``, per batch;
- the front-end link: one request's columns as the one int64 buffer of ``serving.runtime.ipc`` vs the
  pickled ``FeatureColumns`` dataclass (encode on the front-end + decode on the serving process).

Usage: streamrec bench serving_decode [--samples RUN] [--instances 16] [--requests 1 8 64]
Writes var/bench/serving-decode-<time>.json.
"""

from __future__ import annotations

import argparse
import pickle
import platform
import tempfile
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq

from bench_trainer import make_samples  # bench/ is on sys.path (script dir; `streamrec bench` adds it)
from output import write_result
from streamrec.contracts.sample_wire import decode_samples
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.model.columns import FeatureColumns
from streamrec.serving.runtime.ipc import TO_SERVING_PROCESS, frame, pack_columns, unpack_columns
from streamrec.serving.runtime.messages import PredictColumns, Requests
from streamrec.serving.runtime.request import InstanceDecoder
from streamrec.model.batch import batch_from_columns, batch_from_table
from streamrec.trainer.sources import sample_files

REPO = Path(__file__).resolve().parent.parent


def per_call_us(fn, seconds: float) -> float:
    fn()
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", help="a `pipeline offline` run dir or samples.parquet (default: generate one)")
    parser.add_argument("--instances", type=int, default=16, help="instances per request")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64], help="requests per batch")
    parser.add_argument("--seconds", type=float, default=1.0, help="per measurement")
    parser.add_argument("--out", default="var/bench", help="directory of the JSON result (default: ./var/bench, under the current directory)")
    args = parser.parse_args()
    if args.samples is None:
        args.samples = make_samples(Path(tempfile.mkdtemp(prefix="streamrec-bench-")) / "run")
    spec = FeatureSpec()
    most = max(args.requests) * args.instances
    rows = pq.read_table(sample_files([args.samples])[0]).slice(0, most).drop(["label", "click_ts"]).to_pylist()
    bodies = [orjson.dumps({"instances": rows[i: i + args.instances]}) for i in range(0, most, args.instances)]
    decoder = InstanceDecoder(spec, max_instances=100_000)

    def ours(batch: list[bytes]) -> None:
        instances = [x for body in batch for x in decoder.decode(body)]
        columns, _ = decoder.columns(instances)
        batch_from_columns(columns, spec, spec.history_len)

    def baseline(batch: list[bytes]) -> None:
        values = [orjson.dumps(x) for body in batch for x in orjson.loads(body)["instances"]]
        table, _, _ = decode_samples(values, spec, instances=True)
        batch_from_table(table, spec, spec.history_len, with_labels=False)

    result = {"bench": "serving_decode", "instances_per_request": args.instances, "host": platform.node(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "batches": []}
    for n in args.requests:
        batch = bodies[:n]
        row = {"requests": n, "ours_us": per_call_us(lambda: ours(batch), args.seconds),
               "baseline_us": per_call_us(lambda: baseline(batch), args.seconds)}
        row["ratio"] = row["baseline_us"] / row["ours_us"]
        result["batches"].append(row)
        print(f"{n:4d} requests x {args.instances} instances: ours {row['ours_us']:9.1f} us, baseline {row['baseline_us']:9.1f} us "
              f"({row['ratio']:.1f}x)", flush=True)

    columns, _ = decoder.columns(decoder.decode(bodies[0]))

    def message() -> bytes:  # what a front-end sends: one request in a Requests frame
        return frame(Requests([PredictColumns(1, "ctr", None, *pack_columns(columns))]))

    def serving_side(data: bytes) -> FeatureColumns:
        request = TO_SERVING_PROCESS.decode(data[4:]).items[0]
        return unpack_columns(request.rows, request.history_ids, request.counters, request.packed)

    sent, pickled = message(), pickle.dumps(("predict", 1, columns), protocol=5)
    link = {"packed_encode_us": per_call_us(message, args.seconds),
            "packed_decode_us": per_call_us(lambda: serving_side(sent), args.seconds),
            "pickled_encode_us": per_call_us(lambda: pickle.dumps(("predict", 1, columns), protocol=5), args.seconds),
            "pickled_decode_us": per_call_us(lambda: pickle.loads(pickled), args.seconds)}
    link["engine_decode_ratio"] = link["pickled_decode_us"] / link["packed_decode_us"]
    result["link"] = link
    print(f"front-end link, one request: packed buffer encode {link['packed_encode_us']:.1f} / decode {link['packed_decode_us']:.1f} us; "
          f"pickled dataclass {link['pickled_encode_us']:.1f} / {link['pickled_decode_us']:.1f} us "
          f"(serving process side {link['engine_decode_ratio']:.1f}x)", flush=True)
    write_result(args.out, "serving-decode", result)


if __name__ == "__main__":
    main()
