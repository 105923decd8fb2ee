"""Decoding sample files in a child process instead of a thread of the trainer.

Why: the prefetch thread (Parquet chunks -> checked Arrow -> numpy -> tensors) holds the
GIL for much of its time, and every torch call of the training thread gives the GIL up
and must take it back. On an H100 the engine trained 408k samples/s with the thread and
477k with the same batches decoded before the run (bench/RESULTS.md, "Trainer"). Here a
child process runs the same :class:`~trainer.prefetch.Prefetcher` over the same
:class:`~trainer.sources.FileSampleSource`; batches come back through a
``torch.multiprocessing`` queue (tensors in shared memory), with the positions and
rejected counts the thread would have given, so checkpoints and resumes are unchanged.

Sample files only: the Kafka source commits offsets and keeps refused messages from this
process, so it keeps the thread.
"""

from __future__ import annotations

import logging
import queue
import traceback

import torch
import torch.multiprocessing as mp

from model.batch import SampleBatch
from pipelines.feature_spec import FeatureSpec
from trainer.prefetch import END, IDLE, Prefetcher
from trainer.sources import FileSampleSource

log = logging.getLogger(__name__)
POLL_S = 0.2  # how often a blocked side looks whether the other has stopped


class DecodeFailed(RuntimeError):
    """The decoding process failed (its traceback is in the message) or died."""


class DecodeProcess:
    """``Prefetcher``'s interface (start / get / stop), decoding in a child process."""

    def __init__(self, source: FileSampleSource, spec: FeatureSpec, batch_size: int, history_len: int, depth: int = 4,
                 pin_memory: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA state and threads
        self.source, self.pin_memory = source, pin_memory
        self._queue = ctx.Queue(maxsize=max(1, depth))
        self._stop = ctx.Event()
        self._process = ctx.Process(target=_decode, name="trainer-decode", daemon=True,
                                    args=(source, spec, batch_size, history_len, depth, self._queue, self._stop))

    def start(self) -> "DecodeProcess":
        self._process.start()
        return self

    def get(self, timeout: float | None = None):
        """The next SampleBatch, Skipped, IDLE (nothing within ``timeout``) or END; raises
        DecodeFailed if the child failed or died."""
        waited = 0.0
        while True:
            wait = POLL_S if timeout is None else min(POLL_S, max(0.0, timeout - waited))
            try:
                kind, item, left = self._queue.get(timeout=wait)
                break
            except queue.Empty:
                waited += wait
                if not self._process.is_alive():
                    raise DecodeFailed(
                        f"the decoding process exited with code {self._process.exitcode} before the end of the sample "
                        "files. A script that trains must start training under `if __name__ == \"__main__\":` (the "
                        "process is spawned and imports the script); or set trainer.decode_process = \"off\"") from None
                if timeout is not None and waited >= timeout:
                    return IDLE
        self.source.set_left(left)
        if kind == "failed":  # item: (the error, the child's traceback)
            raise DecodeFailed(f"decoding the sample files failed: {item[0]}\n(in the decoding process:)\n{item[1]}")
        if kind == "end":
            return END  # this module's END (the engine compares by identity)
        if self.pin_memory and isinstance(item, SampleBatch):
            item.pin_memory()
        return item

    def stop(self) -> None:
        self._stop.set()
        while self._process.is_alive():
            try:
                self._queue.get(timeout=POLL_S)  # unblock a put
            except queue.Empty:
                pass
            except (EOFError, OSError):
                break
            self._process.join(timeout=0.05)
        self._process.join(timeout=5)
        if self._process.is_alive():
            log.warning("the decoding process did not stop; terminating it")
            self._process.terminate()
        self._queue.close()
        self._queue.join_thread()


def _decode(source: FileSampleSource, spec: FeatureSpec, batch_size: int, history_len: int, depth: int,
            out, stop) -> None:
    """The child: a Prefetcher over ``source``; each item goes to ``out`` as (kind, item, rows left)."""
    torch.set_num_threads(1)  # the trainer's cores are for training
    prefetch = Prefetcher(source, spec, batch_size, history_len, depth).start()

    def send(kind: str, item) -> bool:
        while not stop.is_set():
            try:
                out.put((kind, item, source.lag()), timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    try:
        while not stop.is_set():
            try:
                item = prefetch.get(timeout=POLL_S)
            except BaseException as exc:  # the reading thread's failure: what it was, then where
                send("failed", (f"{type(exc).__name__}: {exc}", traceback.format_exc()))
                break
            if item is IDLE:
                continue
            if item is END:
                send("end", None)
                break
            if not send("item", item):
                break
        # stay until the trainer stops us: the tensors of batches still in the queue are shared
        # through this process (torch.multiprocessing), so it must outlive their reception
        stop.wait()
    finally:
        out.cancel_join_thread()  # stopped: batches nobody will read must not hold the exit
        prefetch.stop()
