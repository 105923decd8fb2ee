"""Garbage-collector pauses of a serving process: a full (generation 2) collection walks
every object in the heap (torch's, Triton's and the model's Python objects) and stops the
event loop meanwhile, which shows up as p99 latency. The server freezes what it holds after
loading (``gc.freeze``: later collections skip those objects) and counts the pauses that are
left, reported in ``GET /v1/models/<model>`` under ``gc``."""

from __future__ import annotations

import gc
import time


class GcPauses:
    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_s = 0.0
        self._started = 0.0

    def install(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        generation = info.get("generation", 0)
        self.collections[generation] += 1
        self.seconds[generation] += took
        self.longest_s = max(self.longest_s, took)

    def as_json(self) -> dict:
        return {"collections": list(self.collections), "pause_ms": [round(s * 1000, 3) for s in self.seconds],
                "longest_pause_ms": round(self.longest_s * 1000, 3), "frozen_objects": gc.get_freeze_count()}


def freeze_heap() -> None:
    """Collect once, then move every surviving object out of the collector's way."""
    gc.collect()
    gc.freeze()
