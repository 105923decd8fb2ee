"""``PredictionLog``: every answered predict request, written to ``topics.predictions``
(streamrec/contracts/predictions.py) off the response path, so experiments can be graded.

Two processes. The serving process encodes each prediction (a MessagePack map: microseconds)
and hands it to a sender process over a Unix SEQPACKET socket, never blocking: when the
socket is full the prediction is dropped and counted. The sender process (``python -m
streamrec.serving.access.prediction_log``, started by the log) keeps a bounded queue and a
kafka-python producer, which batches (linger) and retries on its own I/O thread; a broker away
at start is ridden out by reconnecting every ``retry_s``. Why a process of its own: a producer
whose broker stops answering keeps its threads busy, and in the serving process they would take
the GIL from the event loop (bench/RESULTS.md, "Prediction log with its broker stalled").
Whatever the broker does, ``record`` costs the same: one ``send``.
The sender's counters are in a small shared file the serving process reads when asked.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrec.contracts.predictions import Prediction, encode_prediction, prediction_key
from streamrec.plumbing.logs import configure_logging
from streamrec.plumbing.processes import python_env

if TYPE_CHECKING:
    from streamrec.plumbing.config import Config

log = logging.getLogger(__name__)
_COUNTERS = struct.Struct("<7q")  # the sender's: received, sent, dropped, failed, backlog, connected, done
_COUNTER_NAMES = ("received", "sent", "dropped", "failed", "backlog", "connected", "done")
MAX_RECORD = 1 << 20  # bytes of one encoded prediction the socket takes
SOCKET_BYTES = 8 << 20  # what may wait in the socket while the sender is busy (asked for; the kernel may give less)


class PredictionLog:
    """A bounded, non-blocking log of prediction records (the serving side).

    ``record`` is meant for one thread (the serving event loop); it never blocks or raises.
    Counters (:meth:`counters`): ``queued`` (handed to the sender process), ``sent``
    (acknowledged by the broker), ``dropped`` (the socket or the sender's queue full, the
    sender gone, or still queued when ``close`` gave up), ``failed`` (the producer refused it
    or gave up on it), ``pending`` (fate not known yet), ``backlog`` (in the sender's queue
    now) and ``connected`` (1 once the sender has a producer).
    """

    RESPAWN_EVERY_S = 10.0  # a sender that died is started again at most this often

    def __init__(self, bootstrap: str, topic: str, queue_size: int, connect_timeout_s: float = 5.0,
                 retry_s: float = 5.0, linger_ms: int = 50) -> None:
        if queue_size < 1:
            raise ValueError(f"the prediction log's queue must hold at least 1 prediction, got {queue_size}")
        self.args = ["--bootstrap", bootstrap, "--topic", topic, "--queue-size", str(queue_size), "--connect-timeout-s",
                     str(connect_timeout_s), "--retry-s", str(retry_s), "--linger-ms", str(linger_ms)]
        self._queued = self._dropped = 0
        self._closed = False
        self._lost_before = dict.fromkeys(("sent", "dropped", "failed"), 0)  # counts of senders that died
        fd, path = tempfile.mkstemp(prefix="streamrec-prediction-log-")
        os.ftruncate(fd, _COUNTERS.size)
        self._counters_path = Path(path)
        self._shared = mmap.mmap(fd, _COUNTERS.size)
        os.close(fd)
        self._started_at = 0.0
        self._spawn()

    def _spawn(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent.setblocking(False)
        parent.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BYTES)  # the kernel caps it (net.core.wmem_max)
        _COUNTERS.pack_into(self._shared, 0, *([0] * len(_COUNTER_NAMES)))
        self._sock = parent
        self._proc = subprocess.Popen([sys.executable, "-m", "streamrec.serving.access.prediction_log", "--fd", str(child.fileno()),
                                       "--counters", str(self._counters_path), *self.args], pass_fds=(child.fileno(),), env=python_env())
        child.close()
        self._started_at = time.monotonic()

    @classmethod
    def from_config(cls, cfg: "Config") -> "PredictionLog":
        """The log ``serving.prediction_log`` asks for: ``topics.predictions`` on the configured cluster."""
        return cls(cfg.kafka.bootstrap_servers, cfg.topics.predictions, cfg.serving.prediction_log_queue,
                   cfg.kafka.connect_timeout_s)

    def record(self, prediction: Prediction) -> None:
        """Hand one answered request to the sender; never blocks, never raises."""
        if self._closed:
            self._dropped += 1
            return
        try:
            key = prediction_key(prediction.user_id)
            self._sock.send(bytes((len(key),)) + key + encode_prediction(prediction))
        except BlockingIOError:  # the sender is behind: its socket is full
            self._dropped += 1
            return
        except (OSError, ValueError):  # the sender is gone, or a malformed prediction
            self._dropped += 1
            self._respawn_if_dead()
            return
        self._queued += 1

    def _respawn_if_dead(self) -> None:
        if self._proc.poll() is None or time.monotonic() - self._started_at < self.RESPAWN_EVERY_S:
            return
        log.error("prediction log: its sender process exited with %s; starting a new one", self._proc.returncode)
        sender = self._sender()
        for name in self._lost_before:
            self._lost_before[name] += sender[name]
        self._lost_before["dropped"] += sender["backlog"]
        self._sock.close()
        self._spawn()

    def _sender(self) -> dict[str, int]:
        return dict(zip(_COUNTER_NAMES, _COUNTERS.unpack_from(self._shared, 0)))

    def counters(self) -> dict[str, int]:
        sender = self._sender()
        sent, failed = sender["sent"] + self._lost_before["sent"], sender["failed"] + self._lost_before["failed"]
        dropped = self._dropped + sender["dropped"] + self._lost_before["dropped"]
        return {"queued": self._queued, "sent": sent, "dropped": dropped, "failed": failed,
                "pending": max(0, self._queued - sent - failed - dropped + self._dropped), "backlog": sender["backlog"],
                "connected": sender["connected"]}

    def close(self, timeout_s: float = 5.0) -> dict[str, int]:
        """Let the sender send what it holds and wait for the broker's acknowledgements, up to
        ``timeout_s``; what was still queued then is counted as dropped, what the broker had not
        acknowledged stays ``pending``. Returns the final counters."""
        if not self._closed:
            self._closed = True
            try:
                self._sock.shutdown(socket.SHUT_WR)  # the sender reads the end: it flushes and exits
            except OSError:
                pass
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if not self._sender()["done"]:  # it did not finish: what it still held is lost
                self._lost_before["dropped"] += self._sender()["backlog"]
            self._sock.close()
            self._counters_path.unlink(missing_ok=True)
        counters = self.counters()
        if counters["dropped"] or counters["failed"] or counters["pending"]:
            log.warning("prediction log closed: %s", counters)
        return counters


class KafkaSender:
    """The sender process's producer of encoded predictions, behind a bounded queue.

    ``record`` is meant for one thread (the process's reader); it never blocks or raises.
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
        self._queue: deque[tuple[bytes, bytes]] = deque()  # (key, encoded prediction)
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

    def record(self, key: bytes, value: bytes) -> None:
        """Queue one encoded prediction; O(1), never blocks, never raises."""
        if len(self._queue) >= self.queue_size or self._closing.is_set():
            self._dropped += 1
            return
        self._queue.append((key, value))
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
            # acks=all like every producer (docs/kafka.md); at least once, not kafka-python's idempotent
            # producer, whose close() does not finish while the broker is away: a retried batch may be
            # logged twice, which grading's join of the latest prediction does not count twice.
            self._producer = make_producer(
                self.bootstrap, timeout_s=self.connect_timeout_s, enable_idempotence=False, linger_ms=self.linger_ms,
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
            key, value = self._queue.popleft()
            n += 1
            try:
                future = self._producer.send(self.topic, key=key, value=value)
            except (KafkaError, ValueError, TypeError, OverflowError) as exc:  # a full buffer
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


def serve_sender(sock: socket.socket, sender: KafkaSender, shared: mmap.mmap, report_every_s: float = 0.1) -> None:
    """The sender process's loop: encoded predictions from ``sock`` into ``sender`` until the
    serving process closes its end (or goes away); its counters into ``shared`` as it goes."""
    sock.settimeout(report_every_s)
    while True:
        try:
            data = sock.recv(MAX_RECORD)
        except TimeoutError:
            data = None
        except OSError:
            break
        if data == b"":
            break
        if data:
            sender.record(data[1: 1 + data[0]], data[1 + data[0]:])
        _report(shared, sender, done=False)


def _report(shared: mmap.mmap, sender: KafkaSender, done: bool) -> None:
    c = sender.counters()
    _COUNTERS.pack_into(shared, 0, c["queued"], c["sent"], c["dropped"], c["failed"], c["backlog"], c["connected"], int(done))


def main() -> None:
    parser = argparse.ArgumentParser(description="The prediction log's sender process (started by the serving node).")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--counters", required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--queue-size", type=int, required=True)
    parser.add_argument("--connect-timeout-s", type=float, required=True)
    parser.add_argument("--retry-s", type=float, required=True)
    parser.add_argument("--linger-ms", type=int, required=True)
    parser.add_argument("--close-timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    configure_logging(level=logging.WARNING, fmt="%(asctime)s prediction-log %(process)d %(levelname)s %(message)s")
    with open(args.counters, "r+b") as f:
        shared = mmap.mmap(f.fileno(), _COUNTERS.size)
    sender = KafkaSender(args.bootstrap, args.topic, args.queue_size, args.connect_timeout_s, args.retry_s, args.linger_ms)
    serve_sender(socket.socket(fileno=args.fd), sender, shared)
    sender.close(args.close_timeout_s)
    _report(shared, sender, done=True)


if __name__ == "__main__":
    main()
