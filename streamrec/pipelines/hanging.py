"""The embedded runner's sweep for hanging transactions on the job's output topics.

A hanging transaction is one a partition holds open while its coordinator has none open for
that producer: Kafka never ends it (the coordinator's timeout covers only transactions it
knows), and read_committed readers of the partition (the trainer, online features) see
nothing past its first record. The job's Java side (``HangingTransactions.java``) finds and
aborts them, as Kafka's ``kafka-transactions.sh find-hanging`` / ``abort`` would by hand.
Runs on a thread of its own: with the broker away, the admin calls wait their timeout.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("streamrec.pipeline")

SWEEP_INTERVAL_S = 30.0
MIN_AGE_S = 60.0  # a transaction this long without a write, unknown to its coordinator, is hanging
ADMIN_TIMEOUT_S = 10.0


class HangingTransactionSweeper:
    """Every ``SWEEP_INTERVAL_S``, abort the hanging transactions of ``topics``; ``aborted``
    keeps what was aborted (partition, producer, first offset)."""

    def __init__(self, bootstrap: str, topics: list[str], jars: list[str]) -> None:
        """``jars``: the job's jar URLs, loaded before each sweep's call (below)."""
        self.bootstrap, self.topics, self.jars = bootstrap, topics, jars
        self.aborted: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hanging-transactions", daemon=True)

    def start(self) -> "HangingTransactionSweeper":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(SWEEP_INTERVAL_S):
            try:
                self.sweep()
            except Exception as exc:  # noqa: BLE001 - the broker away, a topic not there yet: next sweep
                log.info("hanging-transaction sweep skipped: %s", str(exc).splitlines()[0][:300])

    def sweep(self) -> list[str]:
        """One sweep; returns what it aborted."""
        from py4j.java_collections import ListConverter
        from pyflink.java_gateway import get_gateway
        from pyflink.util.java_utils import add_jars_to_context_class_loader

        # the Java thread serving this call may be a new one: py4j gives a thread whichever pooled
        # connection is free, and the job's classes are on the class loader of the thread that loaded them
        add_jars_to_context_class_loader(self.jars)
        gateway = get_gateway()
        topics = ListConverter().convert(self.topics, gateway._gateway_client)
        started = time.monotonic()
        aborted = list(gateway.jvm.streamrec.flink.HangingTransactions.abortHanging(
            self.bootstrap, topics, int(MIN_AGE_S * 1000), int(ADMIN_TIMEOUT_S * 1000)))
        for line in aborted:
            print(f"warning: aborted a hanging Kafka transaction on {line} (its coordinator no longer had it open; "
                  f"read_committed readers were held behind it)", flush=True)
        if aborted:
            log.info("hanging-transaction sweep took %.1f s", time.monotonic() - started)
        self.aborted += aborted
        return aborted
