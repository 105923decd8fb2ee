"""``PredictionLog``: every answered predict request, written to ``topics.predictions``
(streamrec/contracts/predictions.py) off the response path, so experiments can be graded.

The serving thread only appends to a bounded deque (atomic under the GIL, no lock a stalled
thread could hold): when the deque is full the prediction is dropped and counted, never
waited for. A daemon thread encodes what is queued and hands it to a kafka-python producer,
which batches (linger) and retries on its own I/O thread. The broker being away at start
is ridden out by reconnecting every ``retry_s``; once connected, kafka-python reconnects by
itself. Whatever the broker does, ``record`` costs the same: the queue fills, then drops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from streamrec.contracts.predictions import Prediction, encode_prediction, prediction_key

if TYPE_CHECKING:
    from streamrec.plumbing.config import Config

log = logging.getLogger(__name__)


class PredictionLog:
    """A bounded, non-blocking producer of prediction records.

    ``record`` is meant for one thread (the serving event loop); it never blocks or raises.
    Counters (:meth:`counters`): ``queued`` (taken into the queue), ``sent`` (acknowledged
    by the broker), ``dropped`` (queue full, or still queued when ``close`` gave up),
    ``failed`` (the producer refused it or gave up on it), ``pending`` (queued, fate not
    known yet: ``queued - sent - failed`` less those dropped at close), ``backlog`` (in the
    queue now) and ``connected`` (1 once a producer exists).
    """

    IDLE_S = 0.02  # how long the sender thread sleeps when the queue is empty
    DRAIN_AT_ONCE = 1024  # predictions handed to the producer between checks for close and losses
    WARN_EVERY_S = 30.0  # one warning about drops and failures per this long, at most

    def __init__(self, bootstrap: str, topic: str, queue_size: int, connect_timeout_s: float = 5.0,
                 retry_s: float = 5.0, linger_ms: int = 50) -> None:
        if queue_size < 1:
            raise ValueError(f"the prediction log's queue must hold at least 1 prediction, got {queue_size}")
        self.bootstrap, self.topic = bootstrap, topic
        self.queue_size, self.connect_timeout_s, self.retry_s, self.linger_ms = queue_size, connect_timeout_s, retry_s, linger_ms
        self._queue: deque[Prediction] = deque()
        self._producer: Any = None
        # Each counter has one writer: record() (queued, dropped), the sender thread (refused),
        # close() (abandoned), kafka-python's I/O thread (sent, undelivered).
        self._queued = self._dropped = 0
        self._refused = self._abandoned = 0
        self._sent = self._undelivered = 0
        self._last_error = ""
        self._warned_at = 0.0
        self._warned_losses = 0
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prediction-log", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg: "Config") -> "PredictionLog":
        """The log ``serving.prediction_log`` asks for: ``topics.predictions`` on the configured cluster."""
        return cls(cfg.kafka.bootstrap_servers, cfg.topics.predictions, cfg.serving.prediction_log_queue,
                   cfg.kafka.connect_timeout_s)

    # ------------------------------------------------------------------ the serving side
    def record(self, prediction: Prediction) -> None:
        """Queue one answered request for the log; O(1), never blocks, never raises."""
        if len(self._queue) >= self.queue_size or self._closing.is_set():
            self._dropped += 1
            return
        self._queue.append(prediction)
        self._queued += 1

    def counters(self) -> dict[str, int]:
        failed = self._refused + self._undelivered
        return {"queued": self._queued, "sent": self._sent, "dropped": self._dropped + self._abandoned, "failed": failed,
                "pending": self._queued - self._sent - failed - self._abandoned, "backlog": len(self._queue),
                "connected": int(self._producer is not None)}

    def close(self, timeout_s: float = 5.0) -> dict[str, int]:
        """Send what is queued and wait for the broker's acknowledgements, up to ``timeout_s``;
        what was still queued then is counted as dropped, what the broker had not acknowledged
        stays ``pending``. Returns the final counters."""
        deadline = time.monotonic() + timeout_s
        self._closing.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        while self._queue:  # one at a time: a sender thread that outlived the join may still be taking some
            try:
                self._queue.popleft()
            except IndexError:
                break
            self._abandoned += 1
        producer = self._producer
        if producer is not None:
            try:
                producer.close(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 -- kafka-python's close raises when its flush runs out of time
                self._note_error(exc)
        counters = self.counters()
        if counters["dropped"] or counters["failed"] or counters["pending"]:
            log.warning("prediction log closed: %s%s", counters, f"; last error: {self._last_error}" if self._last_error else "")
        return counters

    # ------------------------------------------------------------------ the sender thread
    def _run(self) -> None:
        while True:
            if self._producer is None and not self._connect():
                if self._closing.wait(self.retry_s):
                    return
                continue
            sent_any = self._drain()
            if self._closing.is_set():
                if not self._queue:
                    return
            elif not sent_any:
                self._closing.wait(self.IDLE_S)
            self._warn_if_losing()

    def _connect(self) -> bool:
        from streamrec.plumbing.bus.clients import BusUnavailable, make_producer

        try:
            self._producer = make_producer(
                self.bootstrap, timeout_s=self.connect_timeout_s, acks=1, linger_ms=self.linger_ms,
                max_block_ms=1000)  # a full producer buffer fails one send after 1 s, it never holds up close()
        except BusUnavailable as exc:
            self._note_error(exc)
            self._warn_if_losing(force=not self._warned_at)
            return False
        _warn_if_slow_checksums()
        log.info("prediction log: writing to %s on %s", self.topic, self.bootstrap)
        return True

    def _drain(self) -> bool:
        """Hand up to DRAIN_AT_ONCE queued predictions to the producer; False if there were none."""
        from kafka.errors import KafkaError

        n = 0
        while self._queue and n < self.DRAIN_AT_ONCE:
            prediction = self._queue.popleft()
            n += 1
            try:
                future = self._producer.send(self.topic, key=prediction_key(prediction.user_id),
                                             value=encode_prediction(prediction))
            except (KafkaError, ValueError, TypeError, OverflowError) as exc:  # a full buffer, or a malformed prediction
                self._refused += 1
                self._note_error(exc)
                continue
            future.add_callback(self._delivered).add_errback(self._failed)
        return n > 0

    def _delivered(self, _metadata) -> None:
        self._sent += 1

    def _failed(self, exc: BaseException) -> None:
        self._undelivered += 1
        self._note_error(exc)

    def _note_error(self, exc: BaseException) -> None:
        self._last_error = f"{type(exc).__name__}: {exc}"

    def _warn_if_losing(self, force: bool = False) -> None:
        """A warning when predictions were lost since the last one, at most every WARN_EVERY_S."""
        now = time.monotonic()
        c = self.counters()
        lost = c["dropped"] + c["failed"]
        if not force and (lost == self._warned_losses or now - self._warned_at < self.WARN_EVERY_S):
            return
        self._warned_at, self._warned_losses = now, lost
        log.warning("prediction log to %s on %s: %d predictions dropped (queue of %d full), %d failed, %d sent%s",
                    self.topic, self.bootstrap, c["dropped"], self.queue_size, c["failed"], c["sent"],
                    f"; last error: {self._last_error}" if self._last_error else "")


def _warn_if_slow_checksums() -> None:
    """kafka-python checksums every record batch (CRC32C) in pure Python unless the crc32c
    package is installed; that work shares the GIL with serving."""
    from kafka.record import util

    if getattr(util, "crc32c_c", None) is None:
        log.warning("prediction log: kafka-python checksums batches in pure Python (the crc32c package is not "
                    "installed); its CPU time grows with every byte logged and is taken from serving")
