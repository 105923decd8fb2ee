"""The files a trainer writes in its work dir (``eval.jsonl``, ``rejected/``, checkpoints):
a write that fails, a full disk above all, becomes a :class:`WriteFailed` naming the file
and the cause, which ends the run with exit code 3 (driver.py); and JSON-lines logs are
written whole lines at a time, so a reader never finds half a line at their end."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
_TAIL_READ = 1 << 16  # bytes read at a time while looking for the last complete line


class WriteFailed(RuntimeError):
    """A file of the run could not be written; the message names it and says why
    ("cannot write <path>: no space left on device")."""

    def __init__(self, path: Path | str, cause: OSError) -> None:
        super().__init__(f"cannot write {path}: {reason(cause)}")
        self.path, self.errno = Path(path), cause.errno


def reason(exc: OSError) -> str:
    """An OSError's cause in words, to end a sentence with: "no space left on device"."""
    if not exc.errno:
        return str(exc)
    text = os.strerror(exc.errno)
    return text[:1].lower() + text[1:]


class JsonLinesFile:
    """An append-only file of JSON lines, written one whole line (or group of lines) per
    ``append``. A write that fails part way is cut back to where it began, and a file that
    ends with half a line (a process killed mid-write) is cut back to its last complete
    line when opened: every line a reader finds is whole."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise WriteFailed(self.path, exc) from None
        try:
            self.size = self._cut_torn_tail()
        except OSError as exc:
            os.close(self._fd)
            raise WriteFailed(self.path, exc) from None

    def append(self, lines: bytes) -> None:
        """Append ``lines`` (each ending with a newline) whole, or raise WriteFailed and
        leave the file as it was."""
        start, rest = self.size, memoryview(lines)
        try:
            while rest:
                rest = rest[os.write(self._fd, rest):]
        except OSError as exc:
            # freeing space cannot fail on a full disk; if it does, the next open cuts the tail
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise WriteFailed(self.path, exc) from None
        self.size = start + len(lines)

    def close(self) -> None:
        """Close the file (again: nothing)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _cut_torn_tail(self) -> int:
        """Cut the file back to its last newline; returns its length then."""
        end = os.fstat(self._fd).st_size
        complete, pos = 0, end
        while pos > 0:
            start = max(0, pos - _TAIL_READ)
            newline = os.pread(self._fd, pos - start, start).rfind(b"\n")
            if newline >= 0:
                complete = start + newline + 1
                break
            pos = start
        if complete < end:
            os.ftruncate(self._fd, complete)
            log.warning("%s ended with half a line (%d bytes, from a write cut short): removed", self.path, end - complete)
        return complete
