"""The demo's child processes: each in its own session, logging to its own file, and
stopped as a group (SIGTERM, then SIGKILL after a grace period) so nothing outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class ManagedProcess:
    """``python -m streamrec.cli <argv>`` with its own environment and log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path, cwd: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.stopped = False
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", *argv], cwd=cwd, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def check_alive(self) -> None:
        """Raise with the end of its log when it exited on its own."""
        if not self.alive():
            raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}; end of {self.log_path}:\n{self.tail()}")

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the leader (it shuts its own children down: the pipeline cancels its Flink
        job through the JVM, so the JVM must outlive that), wait, then SIGKILL whatever is
        left of the group and wait until it is gone (idempotent)."""
        if self.stopped:
            return self.proc.returncode
        self.stopped = True
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.pid, signal.SIGKILL)  # children the leader left behind (the Flink JVM, say)
        if self.alive():
            self.proc.wait(10)
        deadline = time.monotonic() + 10
        while group_members(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # killed children are reaped by init shortly
        self._log.close()
        return self.proc.returncode


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list[int]:
    """PIDs still in process group ``pgid`` (Linux /proc); empty once a group is gone."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != b"Z":  # zombies are gone, just not reaped yet
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def wait_until(predicate, timeout_s: float, what: str, processes: list[ManagedProcess] = ()) -> None:
    """Poll ``predicate`` until true; fail early when one of ``processes`` died."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for p in processes:
            p.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.5)
