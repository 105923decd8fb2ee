"""What grading reads: ``streamrec.samples`` and ``streamrec.predictions``, each to the end it
has when the read starts, from a start time or from the beginning.

Samples are read first, so only the predictions of (user, item) pairs that have a label are
kept in memory: most candidates a model scores are never shown.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.predictions import decode_predictions
from streamrec.contracts.sample_wire import decode_samples
from streamrec.plumbing.bus.clients import make_consumer
from streamrec.analysis.grading import Labels, PredictionRows, pair_keys


@dataclass
class ReadCounts:
    """Records read and skipped, with the first reasons seen."""

    samples: int = 0
    rejected_samples: int = 0
    predictions: int = 0
    corrupt_predictions: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


def read_for_grading(bootstrap: str, samples_topic: str, predictions_topic: str, spec: FeatureSpec, since_s: float,
                     window_s: float, connect_timeout_s: float, read_timeout_s: float) -> tuple[Labels, PredictionRows, ReadCounts]:
    """The labelled samples written in the last ``since_s`` seconds (0: all the topic holds)
    and the predictions written from ``window_s`` before that on, as grading joins them.

    Raises BusUnavailable (no broker), FileNotFoundError (a topic is missing) or
    TimeoutError (a topic could not be read to its end within ``read_timeout_s``).
    """
    now_ms = int(time.time() * 1000)
    counts = ReadCounts()
    columns: dict[str, list[np.ndarray]] = {"user_id": [], "item_id": [], "ts": [], "label": []}

    def on_samples(values: list[bytes]) -> None:
        table, _, rejected = decode_samples(values, spec)
        counts.samples += table.num_rows
        counts.rejected_samples += len(rejected)
        for _, reason in rejected:
            counts.reject(f"sample: {reason}")
        for name, parts in columns.items():
            parts.append(table[name].to_numpy())

    start = now_ms - int(since_s * 1000) if since_s > 0 else None
    _read_to_end(bootstrap, samples_topic, start, on_samples, connect_timeout_s, read_timeout_s, isolation_level="read_committed")
    labels = Labels(*(np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64) for parts in columns.values()))
    rows = PredictionRows(np.unique(pair_keys(labels.user_id, labels.item_id)))

    def on_predictions(values: list[bytes]) -> None:
        good, rejected = decode_predictions(values)
        counts.predictions += len(good)
        counts.corrupt_predictions += len(rejected)
        for _, reason in rejected:
            counts.reject(f"prediction: {reason}")
        rows.add(good)

    start = now_ms - int((since_s + window_s) * 1000) if since_s > 0 else None
    _read_to_end(bootstrap, predictions_topic, start, on_predictions, connect_timeout_s, read_timeout_s)
    return labels, rows, counts


def _read_to_end(bootstrap: str, topic: str, start_ms: int | None, on_values: Callable[[list[bytes]], None],
                 connect_timeout_s: float, read_timeout_s: float, **consumer_settings) -> None:
    """Every record of ``topic`` written at or after ``start_ms`` (None: all) up to the end
    offsets it has now, in blocks, to ``on_values``."""
    from kafka import TopicPartition

    consumer = make_consumer(bootstrap, group_id=None, timeout_s=connect_timeout_s, max_poll_records=10_000,
                             **consumer_settings)
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise FileNotFoundError(f"topic {topic!r} does not exist on {bootstrap} (`streamrec kafka up` creates it)")
        parts = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(parts)
        end = consumer.end_offsets(parts)
        if start_ms is None:
            consumer.seek_to_beginning(*parts)
        else:
            for tp, found in consumer.offsets_for_times({tp: start_ms for tp in parts}).items():
                consumer.seek(tp, found.offset if found is not None else end[tp])  # None: nothing written since
        deadline = time.monotonic() + read_timeout_s
        while any(consumer.position(tp) < end[tp] for tp in parts):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {topic} to its end within {read_timeout_s:g} s")
            for tp, records in consumer.poll(500).items():
                values = [r.value for r in records if r.offset < end[tp]]  # what came after the read started waits for the next report
                if values:
                    on_values(values)
    finally:
        consumer.close()
