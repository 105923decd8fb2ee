"""Follows the model store: applies every new version as it appears (LATEST polling).

Polling LATEST is the source of truth (announcements on the model-updates topic can be
missed; the store cannot). Applying happens in this thread; predictions keep running and
see the new version from their next batch. A rollback pins the served version and this
watcher then leaves it alone until ``:reload``.
"""

from __future__ import annotations

import logging
import threading

from serving.state import ServedModel

log = logging.getLogger("streamrec.serving")


class VersionWatcher:
    def __init__(self, served: ServedModel, poll_interval_s: float) -> None:
        self.served = served
        self.poll_interval_s = poll_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="version-watcher", daemon=True)

    def start(self) -> "VersionWatcher":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                for report in self.served.catch_up():
                    log.info("serving version %d (%s over %d, %d rows; prepare %.0f ms, batches held %.1f ms)", report.version,
                             report.mode, report.previous, report.rows, 1000 * report.prepare_s, 1000 * report.locked_s)
            except Exception as exc:  # storage hiccups: keep serving, try again next poll
                log.warning("checking for new versions failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
