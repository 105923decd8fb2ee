"""Where generated traffic goes: Kafka topics, or files for offline runs and GPU machines.

Kafka: events (good and injected bad) to the events topic keyed by user id; truth rows
(columnar chunks) and bad-event records to a separate truth topic; a final ``end``
record tells consumers where the stream ends. Every record's acknowledgement is counted,
and a record the producer gives up on ends the run with an error. Files: a directory with
``events.*``, ``truth.*``, ``bad_events.jsonl`` and ``manifest.json``, written under a
temporary name and renamed when complete, so a reader never sees a half-written run.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from kafka.errors import KafkaError

from streamrec.generator.traffic import TickBatch, Truth

log = logging.getLogger(__name__)

EVENTS_SCHEMA = pa.schema([("emit_ms", pa.int64()), ("key", pa.binary()), ("value", pa.binary())])
TRUTH_SCHEMA = pa.schema(
    [
        ("event_id", pa.string()),
        ("request_id", pa.string()),
        ("user_id", pa.int64()),
        ("item_id", pa.int64()),
        ("ts", pa.int64()),
        ("position", pa.int32()),
        ("p", pa.float64()),
        ("clicked", pa.bool_()),
        ("click_ts", pa.int64()),  # null when never clicked
    ]
)
FORMATS = ("jsonl", "parquet")
TRUTH_ROWS_PER_MESSAGE = 2000
FLUSH_MARGIN_S = 5.0  # waited past the producer's delivery timeout before unconfirmed records count as lost


@dataclass(frozen=True)
class Delivery:
    """What a sink's destination has confirmed so far: events written and acknowledged
    (``delivered``), events and truth messages it gave up on (``failed``, ``failed_truth``)."""

    delivered: int
    failed: int = 0
    failed_truth: int = 0

    @property
    def lost(self) -> bool:
        return bool(self.failed or self.failed_truth)


class Sink(Protocol):
    def write_events(self, events: list[tuple[int, bytes, bytes]]) -> None: ...
    def write_truth(self, batch: TickBatch) -> None: ...
    def delivery(self) -> Delivery: ...
    def close(self, manifest: dict) -> None: ...
    def abort(self) -> None: ...


class SinkError(RuntimeError):
    """Events could not be delivered; the message says how many and why."""


def bad_record(kind: str, emit_ms: int, raw: bytes) -> dict:
    return {"kind": "bad", "reason": kind, "emit_ms": emit_ms, "raw": raw.decode("utf-8", "replace")}


class _Tally:
    """Records of one topic: handed to the producer, acknowledged, given up on (with the first error).

    ``acked`` is counted on the producer's I/O thread only; ``fail`` may also run on the
    thread that closes the producer, hence the lock.
    """

    def __init__(self) -> None:
        self.sent = self.acked = self.failed = 0
        self.first_error: BaseException | None = None
        self._lock = threading.Lock()

    def ack(self, _metadata) -> None:
        self.acked += 1

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            self.failed += 1
            self.first_error = self.first_error or exc

    @property
    def lost(self) -> int:
        """Given up on, or still unconfirmed when the run stops waiting."""
        return self.sent - self.acked


class KafkaSink:
    """Produces to Kafka; counts every record Kafka acknowledged and every one the producer
    gave up on (its retries and delivery timeout spent, or an error retries cannot fix).

    A record given up on is a gap in the topic: the runner stops at the first one
    (:meth:`delivery` reports it) and :meth:`abort` raises :class:`SinkError` saying how many
    events were lost, so a run never ends quietly with events missing.
    ``atomic``: the whole run is one transaction (the producer needs a transactional_id),
    committed at close only if every message was acknowledged, aborted otherwise.
    """

    def __init__(self, producer, events_topic: str, truth_topic: str | None, atomic: bool = False) -> None:
        self.producer = producer
        self.atomic = atomic
        if atomic:
            producer.init_transactions()
            producer.begin_transaction()
        self.events_topic = events_topic
        self.truth_topic = truth_topic
        self._events, self._truth = _Tally(), _Tally()
        self._finished = False

    def _send(self, tally: _Tally, topic: str, key: bytes, value: bytes) -> None:
        try:
            future = self.producer.send(topic, key=key, value=value)
        except KafkaError as exc:  # its buffer stayed full for max_block_ms: Kafka takes nothing
            raise SinkError(f"Kafka did not accept more events ({_describe(exc)})") from exc
        tally.sent += 1
        future.add_callback(tally.ack).add_errback(tally.fail)

    def write_events(self, events: list[tuple[int, bytes, bytes]]) -> None:
        for _, key, value in events:
            self._send(self._events, self.events_topic, key, value)

    def write_truth(self, batch: TickBatch) -> None:
        if not self.truth_topic:
            return
        for chunk in truth_chunks(batch.truth):
            self._send(self._truth, self.truth_topic, b"impressions", chunk)
        for bad in batch.bad:
            self._send(self._truth, self.truth_topic, b"bad", orjson.dumps(bad_record(bad.kind, bad.emit_ms, bad.raw)))

    def delivery(self) -> Delivery:
        return Delivery(self._events.acked, self._events.failed, self._truth.failed)

    def close(self, manifest: dict) -> None:
        """Send the end record, wait for every acknowledgement, commit an atomic run;
        SinkError when anything was not delivered."""
        if self.truth_topic:
            self._send(self._truth, self.truth_topic, b"end", orjson.dumps({"kind": "end", **manifest}))
        self._finish(commit=True)

    def abort(self) -> None:
        """Stop after an error: wait for what is in flight (at most the producer's delivery
        timeout), roll back an atomic run; SinkError when events were lost, whatever stopped the run."""
        self._finish(commit=False)

    def _finish(self, commit: bool) -> None:
        if self._finished:
            return
        self._finished = True
        try:
            self.producer.flush(timeout=self.producer.config["delivery_timeout_ms"] / 1000 + FLUSH_MARGIN_S)
        except KafkaError:
            pass  # whatever is still unconfirmed counts as lost below
        lost = self._events.lost + self._truth.lost
        try:
            if self.atomic and commit and not lost:
                self.producer.commit_transaction()
            elif self.atomic:
                self._abort_transaction()
        except KafkaError as exc:
            raise SinkError(f"the run's Kafka transaction was not committed ({_describe(exc)}); "
                            "read_committed consumers see none of it") from exc
        finally:
            self._close_producer()
        if lost:
            raise SinkError(self._lost_message())

    def _abort_transaction(self) -> None:
        """Roll the run back, waiting at most the request timeout: kafka-python's abort waits
        for the broker for ever, and one that stays down would hang the run instead of ending
        it with exit 3. The broker aborts an open transaction itself after its timeout."""
        failed: list[KafkaError] = []

        def abort() -> None:
            try:
                self.producer.abort_transaction()
            except KafkaError as exc:
                failed.append(exc)

        waited_s = self.producer.config["request_timeout_ms"] / 1000
        aborting = threading.Thread(target=abort, name="abort-transaction", daemon=True)
        aborting.start()
        aborting.join(waited_s)
        if aborting.is_alive() or failed:
            why = _describe(failed[0]) if failed else f"no answer from Kafka within {waited_s:.0f} s"
            log.warning("aborting the run's Kafka transaction failed (%s); the broker aborts it after its transaction "
                        "timeout (%.0f s), and read_committed consumers never see it", why,
                        self.producer.config["transaction_timeout_ms"] / 1000)

    def _close_producer(self) -> None:
        try:
            self.producer.close(timeout=FLUSH_MARGIN_S)
        except KafkaError:
            pass  # records still pending are abandoned (counted as lost); the I/O thread is a daemon

    def _lost_message(self) -> str:
        events, truth = self._events, self._truth
        where = ("the run's transaction was not committed: read_committed consumers see none of its events" if self.atomic
                 else f"they are missing from {self.events_topic}")
        extra = f" and {truth.lost:,} truth messages" if truth.lost else ""
        error = events.first_error or truth.first_error
        cause = f"; first error: {_describe(error)}" if error else ""
        return (f"{events.lost:,} of {events.sent:,} events{extra} were not delivered to Kafka: the producer gave up "
                f"on them after its retries ({where}){cause}")


def _describe(exc: BaseException) -> str:
    """``Type: message`` (kafka-python's errors already print their type)."""
    text, name = str(exc), type(exc).__name__
    return text if text.startswith(name) else f"{name}: {text}"


class FileSink:
    """Writes a run directory atomically: everything goes to ``<out>.tmp-<pid>`` first."""

    def __init__(self, out_dir: str | os.PathLike, fmt: str = "parquet") -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        self.out_dir = Path(out_dir)
        if self.out_dir.exists():
            raise FileExistsError(f"{self.out_dir} already exists; choose a new --out directory or remove it")
        self.fmt = fmt
        self._written = 0
        self.tmp_dir = self.out_dir.with_name(f"{self.out_dir.name}.tmp-{os.getpid()}")
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir(parents=True)
        self._bad = open(self.tmp_dir / "bad_events.jsonl", "wb")
        if fmt == "jsonl":
            self._events = open(self.tmp_dir / "events.jsonl", "wb")
            self._truth = open(self.tmp_dir / "truth.jsonl", "wb")
        else:
            self._events = pq.ParquetWriter(self.tmp_dir / "events.parquet", EVENTS_SCHEMA, compression="zstd")
            self._truth = pq.ParquetWriter(self.tmp_dir / "truth.parquet", TRUTH_SCHEMA, compression="zstd")

    def write_events(self, events: list[tuple[int, bytes, bytes]]) -> None:
        if not events:
            return
        if self.fmt == "jsonl":
            self._events.write(b"\n".join(value for _, _, value in events) + b"\n")
        else:
            emit, key, value = zip(*events)
            self._events.write_table(pa.table([list(emit), list(key), list(value)], schema=EVENTS_SCHEMA))
        self._written += len(events)

    def write_truth(self, batch: TickBatch) -> None:
        for bad in batch.bad:
            self._bad.write(orjson.dumps(bad_record(bad.kind, bad.emit_ms, bad.raw)) + b"\n")
        if not len(batch.truth):
            return
        if self.fmt == "jsonl":
            self._truth.write(b"".join(orjson.dumps(row) + b"\n" for row in batch.truth.rows()))
        else:
            self._truth.write_table(truth_table(batch.truth))

    def delivery(self) -> Delivery:
        return Delivery(self._written)

    def close(self, manifest: dict) -> None:
        for fh in (self._events, self._truth, self._bad):
            fh.close()
        (self.tmp_dir / "manifest.json").write_bytes(orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
        self.tmp_dir.rename(self.out_dir)

    def abort(self) -> None:
        for fh in (self._events, self._truth, self._bad):
            try:
                fh.close()
            except Exception:  # noqa: BLE001 - best effort while discarding a failed run
                pass
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


def truth_chunks(truth: Truth, rows_per_message: int = TRUTH_ROWS_PER_MESSAGE) -> list[bytes]:
    """Truth rows as columnar JSON messages: ``{"kind": "impressions", "event_id": [...], ...}``.

    One message per ~2000 impressions instead of one per row: kafka-python's per-message
    cost dominates here, and this halves the generator's messages (see bench/RESULTS.md).
    Decode with :func:`decode_truth_message`.
    """
    out = []
    for lo in range(0, len(truth), rows_per_message):
        hi = lo + rows_per_message
        message = {"kind": "impressions", **{name: _column(truth, name)[lo:hi] for name in TRUTH_SCHEMA.names}}
        out.append(orjson.dumps(message, option=orjson.OPT_SERIALIZE_NUMPY))
    return out


def _column(truth: Truth, name: str):
    if name == "click_ts":  # JSON null for never-clicked, like the Parquet column
        return [int(t) if c else None for t, c in zip(truth.click_ts.tolist(), truth.clicked.tolist())]
    return getattr(truth, name)


def decode_truth_message(value: bytes) -> list[dict]:
    """Rows of one truth-topic message: impression rows, or the single bad/end record."""
    message = orjson.loads(value)
    if message.get("kind") != "impressions":
        return [message]
    names = TRUTH_SCHEMA.names
    return [{"kind": "impression", **dict(zip(names, values))} for values in zip(*(message[n] for n in names))]


def truth_table(truth: Truth) -> pa.Table:
    click_ts = pa.array(truth.click_ts, mask=~truth.clicked.astype(bool), type=pa.int64())
    return pa.table(
        [
            pa.array(truth.event_id, pa.string()),
            pa.array(truth.request_id, pa.string()),
            pa.array(truth.user_id, pa.int64()),
            pa.array(truth.item_id, pa.int64()),
            pa.array(truth.ts, pa.int64()),
            pa.array(truth.position, pa.int32()),
            pa.array(truth.p, pa.float64()),
            pa.array(truth.clicked, pa.bool_()),
            click_ts,
        ],
        schema=TRUTH_SCHEMA,
    )
