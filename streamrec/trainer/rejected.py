"""Samples the trainer refuses are kept, not only counted: the raw message, where it came
from and why, appended as JSON lines under ``<work_dir>/<model>/rejected/`` so an
operator can see what the pipeline sent and replay what a fix makes acceptable.

Bounded: a file that reaches ``max_bytes`` is renamed ``.1`` (replacing the previous one),
so at most twice the budget stays on disk. A rejected message read again after a resume
is written again (the log is at-least-once, like the re-training it mirrors).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


class RejectedLog:
    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path, self.max_bytes = Path(path), max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(self.path, "ab")
        self.written = 0

    def add(self, topic: str, partition: int, offset: int, reason: str, value: bytes | None) -> None:
        """One refused message (a tombstone's value is None)."""
        try:
            text, encoding = (value.decode(), "utf-8") if value is not None else (None, None)
        except UnicodeDecodeError:
            text, encoding = base64.b64encode(value).decode(), "base64"
        line = json.dumps({"at": time.time(), "topic": topic, "partition": partition, "offset": offset, "reason": reason,
                           "encoding": encoding, "value": text}).encode() + b"\n"
        if self._out.tell() + len(line) > self.max_bytes and self._out.tell() > 0:
            self._out.close()
            self.path.replace(self.path.with_name(self.path.name + ".1"))
            self._out = open(self.path, "ab")
        self._out.write(line)
        self.written += 1

    def flush(self) -> None:
        self._out.flush()

    def close(self) -> None:
        self._out.close()
