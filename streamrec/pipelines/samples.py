"""The labelled samples (``streamrec.samples``) and their reference builder.

One sample per impression: the impression's ids and context, point-in-time features
computed only from events *strictly before* the impression's event time, and the label
(1 if a click for the same (request_id, item_id) has event time within the attribution
window, else 0). The fields are declared in ``contracts/feature_spec.py``; docs/samples.md
documents each one.

:class:`SampleBuilder` is the executable spec: an exact, in-process implementation in
event-time order. It is how samples are made from generator files (offline runs, the GPU
machine, the trainer before the Flink job exists) and the oracle the Flink job is
tested against. It is not the streaming job: it sees the whole input at once.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from streamrec.contracts import events as ev
from streamrec.contracts.feature_spec import COUNTED_EVENTS, SAMPLE_VERSION, FeatureSpec

IMPS, CLICKS = COUNTED_EVENTS
# rows per row group of a sample file: small enough that each rank of a sharded trainer reads
# whole groups of its own (trainer/sources.py) and decodes no other rank's rows; large enough
# to compress and decode well (smaller groups make the file larger and slower to read)
SAMPLE_ROW_GROUP_ROWS = 8192


@dataclass
class Rejected:
    reason: str
    raw: bytes


@dataclass
class _Counter:
    """Event times of one key's events, for counts over (ts - w, ts)."""

    times: list[int] = field(default_factory=list)  # ascending (events are fed in ts order)

    def add(self, ts: int) -> None:
        self.times.append(ts)

    def count_before(self, ts: int, window_ms: int) -> int:
        hi = bisect.bisect_left(self.times, ts)  # strictly before ts
        lo = bisect.bisect_right(self.times, ts - window_ms)  # strictly after ts - w
        return hi - lo


class SampleBuilder:
    """Exact reference: feed raw events (in any order), then :meth:`build`."""

    def __init__(self, spec: FeatureSpec) -> None:
        spec.validate()
        self.spec = spec
        self.impressions: dict[str, dict] = {}  # event_id -> first copy seen
        self.clicks: dict[str, dict] = {}
        self.rejected: list[Rejected] = []
        self.duplicates = 0

    def add(self, raw: bytes, arrival_ms: int) -> None:
        """One raw event; ``arrival_ms`` (e.g. the Kafka timestamp) bounds future timestamps."""
        try:
            event = ev.validate_event(raw, now_ms=arrival_ms)
        except ev.InvalidEvent as exc:
            self.rejected.append(Rejected(exc.reason, bytes(raw)))
            return
        target = self.impressions if event["type"] == "impression" else self.clicks
        if event["event_id"] in target:
            self.duplicates += 1  # at-least-once upstream: the same event again
            return
        target[event["event_id"]] = event

    def add_all(self, records: Iterable[tuple[bytes, int]]) -> "SampleBuilder":
        for raw, arrival_ms in records:
            self.add(raw, arrival_ms)
        return self

    def build(self, progress: Callable[[int], None] | None = None, every: int = 8192) -> pa.Table:
        """All samples, ordered by (ts, event_id); orphan clicks are added to ``rejected``.
        ``progress(n)``: called with the samples built so far every ``every`` samples and at the end."""
        spec = self.spec
        window_ms = int(spec.attribution_window_s * 1000)
        # Label join: first click (by event time) within [ts, ts + window] of its impression.
        clicks_by_key: dict[tuple[str, int], list[dict]] = defaultdict(list)
        for click in self.clicks.values():
            clicks_by_key[(click["request_id"], click["item_id"])].append(click)
        matched_clicks: set[str] = set()
        label_of: dict[str, dict | None] = {}
        for imp in self.impressions.values():
            candidates = sorted(
                (c for c in clicks_by_key.get((imp["request_id"], imp["item_id"]), ()) if imp["ts"] <= c["ts"] <= imp["ts"] + window_ms),
                key=lambda c: (c["ts"], c["event_id"]),
            )
            label_of[imp["event_id"]] = candidates[0] if candidates else None
            matched_clicks.update(c["event_id"] for c in candidates)
        for click in sorted(self.clicks.values(), key=lambda c: (c["ts"], c["event_id"])):
            if click["event_id"] not in matched_clicks:
                self.rejected.append(Rejected(f"{ev.ORPHAN_CLICK}: no impression of ({click['request_id']}, {click['item_id']}) within the window",
                                              _json(click)))

        # Point-in-time features: walk events in event-time order; an impression reads the
        # state built from events with strictly smaller ts (equal ts are applied after).
        impression_category = {(i["request_id"], i["item_id"]): i["item"]["category_id"] for i in self.impressions.values()}
        timeline = sorted(
            [(i["ts"], 0, i["event_id"], i) for i in self.impressions.values()]
            + [(c["ts"], 1, c["event_id"], c) for c in self.clicks.values() if c["event_id"] in matched_clicks],
            key=lambda t: (t[0], t[1], t[2]),
        )
        counters: dict[tuple[str, str, int], _Counter] = defaultdict(_Counter)
        history: dict[int, deque] = defaultdict(lambda: deque(maxlen=spec.history_len))
        counter_columns = [(spec.counter_name(entity, what, w), entity, what, int(w * 1000))
                           for w in spec.windows_s for entity in ("user", "item", "category") for what in COUNTED_EVENTS]
        columns: dict[str, list] = {name: [] for name in spec.schema().names}
        pending: list[tuple[int, dict]] = []  # events at the current ts, applied after it

        def apply(kind: int, e: dict) -> None:
            if kind == 0:
                for entity, key in (("user", e["user_id"]), ("item", e["item_id"]), ("category", e["item"]["category_id"])):
                    counters[(entity, IMPS, key)].add(e["ts"])
            else:
                category = impression_category[(e["request_id"], e["item_id"])]
                for entity, key in (("user", e["user_id"]), ("item", e["item_id"]), ("category", category)):
                    counters[(entity, CLICKS, key)].add(e["ts"])
                history[e["user_id"]].appendleft((e["item_id"], category))

        current_ts, built = None, 0
        for ts, kind, _, e in timeline:
            if ts != current_ts:
                for p_kind, p_e in pending:
                    apply(p_kind, p_e)
                pending, current_ts = [], ts
            pending.append((kind, e))
            if kind != 0:
                continue
            hist = history[e["user_id"]]
            click = label_of[e["event_id"]]
            row = {
                "sample_version": SAMPLE_VERSION,
                "event_id": e["event_id"], "request_id": e["request_id"], "ts": ts,
                "user_id": e["user_id"], "item_id": e["item_id"], "position": e["position"],
                "device": e["context"]["device"], "local_hour": e["context"]["local_hour"],
                "category_id": e["item"]["category_id"], "advertiser_id": e["item"]["advertiser_id"],
                "hist_item_ids": [h[0] for h in hist], "hist_category_ids": [h[1] for h in hist],
                "label": 1 if click else 0, "click_ts": click["ts"] if click else None,
            }
            keys = {"user": e["user_id"], "item": e["item_id"], "category": e["item"]["category_id"]}
            for name, entity, what, w_ms in counter_columns:
                counter = counters.get((entity, what, keys[entity]))
                row[name] = counter.count_before(ts, w_ms) if counter else 0
            for name in columns:
                columns[name].append(row[name])
            built += 1
            if progress is not None and built % every == 0:
                progress(built)
        if progress is not None:
            progress(built)
        return pa.table(columns, schema=spec.schema())


def _json(event: dict) -> bytes:
    return orjson.dumps(event)


def read_run(run_dir: str | Path) -> Iterator[tuple[bytes, int]]:
    """(raw event, arrival ms) from a `streamrec generate --out` directory.

    Parquet runs carry each event's arrival time (``emit_ms``); JSONL runs do not, so the
    run's end time stands in (no event of the run can legitimately be later than that).
    """
    run = Path(run_dir)
    manifest_path = run / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{run} is not a complete generator run (no manifest.json)")
    end_ms = int(orjson.loads(manifest_path.read_bytes())["end_ms"])
    if (run / "events.parquet").is_file():
        for batch in pq.ParquetFile(run / "events.parquet").iter_batches(columns=["emit_ms", "value"]):
            yield from zip(batch.column("value").to_pylist(), batch.column("emit_ms").to_pylist())
    elif (run / "events.jsonl").is_file():
        with open(run / "events.jsonl", "rb") as fh:
            for line in fh:
                yield line.rstrip(b"\n"), end_ms
    else:
        raise FileNotFoundError(f"{run} has neither events.parquet nor events.jsonl")


def event_count(run_dir: str | Path) -> int | None:
    """How many events :func:`read_run` yields from a Parquet run (its metadata says); None for JSONL."""
    path = Path(run_dir) / "events.parquet"
    return pq.ParquetFile(path).metadata.num_rows if path.is_file() else None


def write_samples(table: pa.Table, rejected: list[Rejected], out_dir: str | Path,
                  row_group_rows: int = SAMPLE_ROW_GROUP_ROWS) -> tuple[Path, Path]:
    """``samples.parquet`` (in row groups of ``row_group_rows``) and ``rejected.jsonl`` in
    ``out_dir``, each via temp + rename."""
    if row_group_rows < 1:
        raise ValueError(f"row groups need at least one row, got {row_group_rows}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    samples_path, rejected_path = out / "samples.parquet", out / "rejected.jsonl"
    tmp = samples_path.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp, compression="zstd", row_group_size=row_group_rows)
    tmp.replace(samples_path)
    tmp = rejected_path.with_suffix(".jsonl.tmp")
    tmp.write_bytes(b"".join(orjson.dumps({"reason": r.reason, "raw": r.raw.decode("utf-8", "replace")}) + b"\n" for r in rejected))
    tmp.replace(rejected_path)
    return samples_path, rejected_path
