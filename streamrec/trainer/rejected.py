"""Samples the trainer refuses are kept, not only counted: the raw message, where it came
from and why, appended as JSON lines under ``<work_dir>/<model>/rejected/`` so an
operator can see what the pipeline sent and replay what a fix makes acceptable.

Bounded: a file that reaches ``max_bytes`` is renamed ``.1`` (replacing the previous one),
so at most twice the budget stays on disk. A rejected message read again after a resume
is written again (the log is at-least-once, like the re-training it mirrors). Lines are
written whole at each ``flush``; a write that fails (a full disk) leaves none half written
and ends the run (:class:`~streamrec.trainer.local_files.WriteFailed`).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from pathlib import Path

from streamrec.trainer.local_files import JsonLinesFile, WriteFailed

log = logging.getLogger(__name__)


class RejectedLog:
    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path, self.max_bytes = Path(path), max_bytes
        self._out = JsonLinesFile(self.path)
        self._pending: list[bytes] = []  # lines added since the last flush
        self._pending_bytes = 0
        self.written = 0

    def add(self, topic: str, partition: int, offset: int, reason: str, value: bytes | None) -> None:
        """One refused message (a tombstone's value is None); on disk at the next ``flush``."""
        try:
            text, encoding = (value.decode(), "utf-8") if value is not None else (None, None)
        except UnicodeDecodeError:
            text, encoding = base64.b64encode(value).decode(), "base64"
        line = json.dumps({"at": time.time(), "topic": topic, "partition": partition, "offset": offset, "reason": reason,
                           "encoding": encoding, "value": text}).encode() + b"\n"
        held = self._out.size + self._pending_bytes
        if held + len(line) > self.max_bytes and held > 0:
            self.flush()
            self._rotate()
        self._pending.append(line)
        self._pending_bytes += len(line)
        self.written += 1

    def flush(self) -> None:
        """Write the lines added since the last flush, in one write."""
        if self._pending:
            lines = b"".join(self._pending)
            self._pending, self._pending_bytes = [], 0
            self._out.append(lines)

    def _rotate(self) -> None:
        """The full file becomes ``.1`` (replacing the previous one); a new one starts."""
        try:
            self.path.replace(self.path.with_name(self.path.name + ".1"))
        except OSError as exc:
            raise WriteFailed(self.path, exc) from None
        self._out.close()
        self._out = JsonLinesFile(self.path)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._out.close()
