"""CPU and memory of the demo's processes, read from Linux /proc (no extra dependency).

Why: on a small machine every stage shares the same cores, so "is the job slow or starved?"
needs each process's CPU next to its throughput (a spinning consumer or a broker busy
re-saving its data shows up here; docs/demo.md). ``bench/bench_pipeline.py`` uses the
same readers for the Flink JVM's CPU.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat_fields(pid: int | str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (a CLI process starts the Flink JVM as its child)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes (all their threads) have used so far."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:
            total += int(fields[11]) + int(fields[12])
    return total / _TICKS


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:
            total += int(fields[21]) * _PAGE
    return total


def threads_cpu_seconds(pids: list[int]) -> dict[str, float]:
    """CPU seconds by thread name (Flink names task threads after their operators)."""
    out: dict[str, float] = {}
    for pid in pids:
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                text = stat.read_text()
                name = text[text.index("(") + 1:text.rindex(")")].split("(")[0].split("#")[0].strip()
                fields = text.rsplit(")", 1)[1].split()
                out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _TICKS
            except (OSError, ValueError, IndexError):
                pass
    return out


class ResourceMonitor:
    """Samples each named process tree once a second: CPU seconds used while watched,
    average cores, peak resident memory. ``roots``: a callable giving name -> pid (that
    process and its descendants) or name -> [pids] (exactly those), re-read each tick so
    processes started later are picked up."""

    def __init__(self, roots, interval_s: float = 1.0) -> None:
        self._roots = roots
        self.interval_s = interval_s
        self._first: dict[str, tuple[float, float]] = {}  # name -> (monotonic, cpu) at first sight
        self._last: dict[str, tuple[float, float]] = {}
        self._peak_rss: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resources", daemon=True)

    def start(self) -> ResourceMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def sample(self) -> None:
        now = time.monotonic()
        for name, pid in dict(self._roots()).items():
            tree = list(pid) if isinstance(pid, (list, tuple)) else process_tree(pid)
            cpu = cpu_seconds(tree)
            if not cpu and name not in self._first:
                continue  # not started yet (or already gone)
            self._first.setdefault(name, (now, cpu))
            if cpu >= self._last.get(name, (0.0, 0.0))[1]:  # a tree that is exiting reads low: keep the last
                self._last[name] = (now, cpu)
            self._peak_rss[name] = max(self._peak_rss.get(name, 0), rss_bytes(tree))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def report(self) -> dict[str, dict]:
        out = {}
        for name, (t0, cpu0) in self._first.items():
            t1, cpu1 = self._last[name]
            used = cpu1 - cpu0
            out[name] = {"cpu_s": round(used, 1), "avg_cores": round(used / (t1 - t0), 2) if t1 > t0 else None,
                         "peak_rss_mb": round(self._peak_rss.get(name, 0) / 2**20)}
        return out
