"""Garbage-collector pauses: a full (generation 2) collection walks every object in the
heap (torch's, Triton's and the model's Python objects) and stops the process's threads
meanwhile. In a server that is p99 latency; in a trainer on several ranks it is a step that
every other rank waits for. Both freeze what they hold once set up (``gc.freeze``: later
collections skip those objects) and count the pauses that are left: serving in
``GET /v1/models/<model>`` under ``gc``, the trainer in its summary."""

from __future__ import annotations

import gc
import time


class GcPauses:
    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_s = 0.0
        self.frozen_objects = 0  # frozen when counting began
        self._started = 0.0

    def install(self) -> "GcPauses":
        """Count from now on (after ``freeze_heap``)."""
        self.frozen_objects = gc.get_freeze_count()
        gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

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
                "longest_pause_ms": round(self.longest_s * 1000, 3), "frozen_objects": self.frozen_objects}


def freeze_heap() -> None:
    """Collect once, then move every surviving object out of the collector's way."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Hand the frozen objects back to the collector: for a process that goes on after the
    run that froze them (a test, a notebook)."""
    gc.unfreeze()
