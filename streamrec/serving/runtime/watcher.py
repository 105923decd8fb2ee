"""Follows the model store: applies every new version as it appears.

Two signals, one source of truth. The trainer announces each version on the
model-updates topic right after it moves ``LATEST``; an ``UpdateListener`` wakes the
watcher on such a message, so a version is applied within milliseconds of its
announcement instead of up to one polling interval later. Announcements can be missed
(broker down, server started late), the store cannot: the watcher also checks ``LATEST``
every ``poll_interval_s``, and what it applies always comes from the store. A rollback
pins the served version; the watcher then leaves it alone until ``:reload``.
"""

from __future__ import annotations

import logging
import threading
import time

import orjson

from streamrec.serving.runtime.state import ServedModel

log = logging.getLogger("streamrec.serving")


class UpdateListener:
    """Blocks until a model-updates message for ``model`` arrives (or a timeout).

    Reads from the topic's end (only announcements made after it started matter: the
    watcher's first catch-up covers the rest), in no consumer group. Connecting happens
    on a thread of its own, so an unreachable broker never delays the LATEST polling; it
    says so once and retries every ``retry_s``.
    """

    def __init__(self, bootstrap: str, topic: str, model: str, connect_timeout_s: float = 5.0, retry_s: float = 30.0) -> None:
        self.bootstrap, self.topic, self.model = bootstrap, topic, model
        self.connect_timeout_s, self.retry_s = connect_timeout_s, retry_s
        self._consumer = None
        self._retry_at = 0.0
        self._warned = False
        self._closed = threading.Event()
        self.announcements = 0
        threading.Thread(target=self._connect_loop, name="model-updates-connect", daemon=True).start()

    @property
    def connected(self) -> bool:
        return self._consumer is not None

    def wait(self, timeout_s: float) -> bool:
        """True when an announcement for our model arrived within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            consumer = self._consumer
            if consumer is None:
                return False
            try:
                records = consumer.poll(max(0, int((deadline - time.monotonic()) * 1000)))
            except Exception as exc:  # broker gone: fall back to polling, reconnect later
                log.warning("model-updates topic %s: %s; polling LATEST only until it is back", self.topic, exc)
                self._drop()
                return False
            hits = 0
            for batch in records.values():
                for record in batch:
                    try:
                        if orjson.loads(record.value).get("model") == self.model:
                            hits += 1
                    except (orjson.JSONDecodeError, AttributeError):
                        log.warning("ignoring a malformed message on %s at offset %d", self.topic, record.offset)
            self.announcements += hits
            if hits:
                return True
            if time.monotonic() >= deadline:
                return False

    def _connect_loop(self) -> None:
        from streamrec.plumbing.bus.clients import BusUnavailable, make_consumer

        while not self._closed.wait(0.5):
            if self._consumer is not None or time.monotonic() < self._retry_at:
                continue
            try:
                consumer = self._open(make_consumer)
            except (BusUnavailable, LookupError) as exc:
                if not self._warned:
                    log.warning("%s; new versions are found by polling LATEST (retrying every %.0f s)", exc, self.retry_s)
                    self._warned = True
                self._retry_at = time.monotonic() + self.retry_s
                continue
            if self._closed.is_set():
                consumer.close()
                return
            self._consumer = consumer
            log.info("following announcements on %s", self.topic)

    def _open(self, make_consumer):
        """A consumer positioned at the end of every partition *now* (a lazily resolved
        "latest" would skip an announcement made before the first poll)."""
        from kafka import TopicPartition

        consumer = make_consumer(self.bootstrap, group_id=None, timeout_s=self.connect_timeout_s)
        partitions = consumer.partitions_for_topic(self.topic)
        if not partitions:
            consumer.close()
            raise LookupError(f"topic {self.topic} does not exist on {self.bootstrap} (yet)")
        assigned = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        consumer.assign(assigned)
        consumer.seek_to_end()
        for tp in assigned:
            consumer.position(tp)
        return consumer

    def _drop(self) -> None:
        consumer, self._consumer = self._consumer, None
        self._retry_at = time.monotonic() + self.retry_s
        if consumer is not None:
            try:
                consumer.close()
            except Exception:
                pass

    def close(self) -> None:
        self._closed.set()
        self._drop()


class VersionWatcher:
    def __init__(self, served: ServedModel, poll_interval_s: float, listener: UpdateListener | None = None) -> None:
        self.served = served
        self.poll_interval_s = poll_interval_s
        self.listener = listener
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="version-watcher", daemon=True)

    def start(self) -> "VersionWatcher":
        self._thread.start()
        return self

    def _wait(self) -> None:
        """Until an announcement arrives or the polling interval passes."""
        if self.listener is None:
            self._stop.wait(self.poll_interval_s)
            return
        deadline = time.monotonic() + self.poll_interval_s
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            if self.listener.wait(min(left, 0.5)):  # short slices: stop() is noticed quickly
                return
            if not self.listener.connected:  # not (yet) connected: look again in a second
                self._stop.wait(min(1.0, max(0.0, deadline - time.monotonic())))

    def _run(self) -> None:
        while True:
            self._wait()
            if self._stop.is_set():
                break
            try:
                for report in self.served.catch_up():
                    log.info("serving version %d (%s over %d, %d rows; prepare %.0f ms, batches held %.1f ms)", report.version,
                             report.mode, report.previous, report.rows, 1000 * report.prepare_s, 1000 * report.locked_s)
            except Exception as exc:  # storage hiccups: keep serving, try again next poll
                log.warning("checking for new versions failed: %s", exc)
        if self.listener is not None:
            self.listener.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
