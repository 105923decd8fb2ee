"""The trainer's input pipeline in a child process: reading, checking, decoding and
batching run there, and batches come back through shared memory.

Why: on CUDA the training step is bound by its host thread (Python and the dispatcher
launch a few hundred kernels a step). A decoding thread in the same process holds the GIL
for milliseconds per batch, and each time the training thread lets go of it (a host sync, a
blocking call) it waits to get it back. On an H100 the trainer ran 1.5x faster when its
batches needed no decoding (bench/RESULTS.md); this process gives it that, with a real
front end.

How: the child runs the same Prefetcher loop (trainer/prefetch.py: same batches, same
positions, same rejects) over its own source, opened from a SourceRecipe. Each batch's
tensors are packed into one slot of a ring of shared memory (a memfd: no /dev/shm, whose
size containers limit), and a small header (slot, layout, positions, rejects, event ids)
goes through a queue. A receiving thread here copies the slot into a pinned buffer (CUDA)
or a private one, hands the slot back, and queues the batch for ``get``. ``commit`` goes
to the child's source; ``lag`` is the child's latest figure.

Failures: an error in the child (a bad file, an unreachable broker) is raised by ``start``
or ``get`` with its own type (its traceback in a note) when it can be pickled; a child that
dies is reported with its exit code. The child ignores SIGINT (the trainer finishes its step,
then stops it) and stops when its parent is gone.
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from multiprocessing.reduction import DupFd

import torch

from model.batch import SampleBatch, dense_feature_names
from trainer.prefetch import END, IDLE, Prefetcher
from trainer.sources import SourceRecipe

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0  # spawning imports torch; opening a Kafka source waits up to its own timeout
STOP_TIMEOUT_S = 30.0  # the child's last commit to the consumer group included


class DecodeProcess:
    """A Prefetcher (``start``, ``get``, ``stop``) and the source behind it (``commit``,
    ``lag``, ``close``), both living in a child process."""

    def __init__(self, recipe: SourceRecipe, batch_size: int, history_len: int, depth: int = 4, pin_memory: bool = False,
                 max_delay_s: float | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.recipe, self.batch_size, self.history_len = recipe, batch_size, history_len
        self.pin_memory, self.max_delay_s = pin_memory, max_delay_s
        self.slots = max(2, depth)
        bound = SampleBatch.packed_bytes_bound(batch_size, history_len, len(dense_feature_names(recipe.spec)))
        self.slot_bytes = -(-bound // 4096) * 4096  # every slot page-aligned, so every view in it is aligned
        self._ctx = mp.get_context("spawn")  # CUDA and threads live here: never fork them
        self._free, self._full, self._control = self._ctx.Queue(), self._ctx.Queue(), self._ctx.Queue()
        self._lag = self._ctx.Value("q", -1, lock=False)
        self._ready: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stopping = threading.Event()
        self._process: mp.process.BaseProcess | None = None
        self._receiver = threading.Thread(target=self._receive, name="trainer-decode-receiver", daemon=True)
        self._ring: torch.Tensor | None = None
        self._stopped = False

    # ------------------------------------------------------------------ Prefetcher side
    def start(self) -> "DecodeProcess":
        """Spawn the child and wait until its source is open (its error, if not)."""
        size = self.slots * self.slot_bytes
        fd = os.memfd_create("streamrec-batches")
        try:
            os.ftruncate(fd, size)
            self._ring = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
            for slot in range(self.slots):
                self._free.put(slot)
            self._process = self._ctx.Process(
                target=_child_main, name="streamrec-decode", daemon=True,
                args=(self.recipe, self.batch_size, self.history_len, self.max_delay_s, DupFd(fd), self.slot_bytes,
                      self.slots, self._free, self._full, self._control, self._lag))
            self._process.start()
        finally:
            os.close(fd)  # the mapping and the child's copy keep the memory
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                kind, payload = self._full.get(timeout=0.5)
            except queue.Empty:
                if not self._process.is_alive() or time.monotonic() > deadline:
                    code = self._process.exitcode
                    self.stop()
                    raise RuntimeError(f"the decode process did not start (exit code {code}); "
                                       "set trainer.decode_process = \"thread\" to decode in the trainer's process")
                continue
            if kind == "ready":
                break
            self.stop()
            raise payload
        self._receiver.start()
        return self

    def get(self, timeout: float | None = None):
        """The next SampleBatch, Skipped, IDLE or END; re-raises a failure of the child."""
        try:
            item = self._ready.get(timeout=timeout)
        except queue.Empty:
            return IDLE
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """Stop the child (it commits what ``commit`` last asked and closes its source)."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._receiver.is_alive():
            self._receiver.join()
        if self._process is None:
            return
        self._control.put(("stop", None))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self._process.is_alive() and time.monotonic() < deadline:
            try:  # keep its queue flowing, or its exit waits on a full pipe
                kind, payload = self._full.get(timeout=0.1)
                if kind == "batch":
                    self._free.put(payload[0])
            except queue.Empty:
                pass
        if self._process.is_alive():
            log.warning("the decode process did not stop in %.0f s: terminating it", STOP_TIMEOUT_S)
            self._process.terminate()
            self._process.join(5)
        for q in (self._free, self._full, self._control):
            q.cancel_join_thread()
            q.close()

    # ------------------------------------------------------------------ source side
    def commit(self, positions: dict[int, int]) -> None:
        if not self._stopped:
            self._control.put(("commit", dict(positions)))

    def lag(self) -> int | None:
        value = self._lag.value
        return None if value < 0 else int(value)

    def close(self) -> None:
        self.stop()

    # ------------------------------------------------------------------ receiving thread
    def _receive(self) -> None:
        while not self._stopping.is_set():
            try:
                kind, payload = self._full.get(timeout=0.2)
            except queue.Empty:
                if not self._process.is_alive():
                    self._deliver(RuntimeError(f"the decode process died (exit code {self._process.exitcode}); "
                                               "the trainer's last checkpoint holds its position"))
                    return
                continue
            except (EOFError, OSError) as exc:
                self._deliver(RuntimeError(f"the decode process's queue broke: {exc}"))
                return
            if kind == "batch":
                item = self._batch(*payload)
            elif isinstance(payload, str):  # END or IDLE: the markers themselves (callers test with `is`)
                item = END if payload == END else IDLE
            else:
                item = payload
            if not self._deliver(item) or kind == "error" or item is END:
                return  # the child stops after these

    def _batch(self, slot: int, layout, fields: dict) -> SampleBatch:
        """The slot's batch in memory of its own (pinned on CUDA); the slot goes back."""
        size = SampleBatch.packed_bytes(layout)
        own = torch.empty(max(size, 64), dtype=torch.uint8, pin_memory=self.pin_memory)
        own[:size].copy_(self._ring[slot * self.slot_bytes: slot * self.slot_bytes + size])
        self._free.put(slot)
        return SampleBatch(**SampleBatch.views(own, layout), **fields)

    def _deliver(self, item) -> bool:
        while not self._stopping.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


class _SlotQueue:
    """The child's Prefetcher output: batches into ring slots, everything else as is."""

    def __init__(self, ring: torch.Tensor, slot_bytes: int, free, full, source, lag) -> None:
        self.ring, self.slot_bytes, self.free, self.full, self.source, self.lag = ring, slot_bytes, free, full, source, lag

    def put(self, item, timeout: float | None = None) -> None:
        if isinstance(item, SampleBatch):
            layout = item.layout()
            try:
                slot = self.free.get(timeout=timeout)
            except queue.Empty:
                raise queue.Full from None
            item.pack_into(self.ring[slot * self.slot_bytes: (slot + 1) * self.slot_bytes], layout)
            fields = {"history_len": item.history_len, "event_ids": item.event_ids, "positions": item.positions,
                      "rejected": item.rejected}
            message = ("batch", (slot, layout, fields))
        elif isinstance(item, BaseException):
            message = ("error", _portable(item))
        else:
            message = ("item", item)
        lag = self.source.lag()
        self.lag.value = -1 if lag is None else int(lag)
        self.full.put(message)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` with the child's traceback as a note, or a RuntimeError saying what it was
    where it cannot be pickled."""
    where = "".join(traceback.format_exception(exc))
    try:
        exc.add_note(f"(raised in the trainer's decode process)\n{where}")
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"the decode process failed: {type(exc).__name__}: {exc}\n{where}")


def _child_main(recipe: SourceRecipe, batch_size: int, history_len: int, max_delay_s: float | None, fd: DupFd,
                slot_bytes: int, slots: int, free, full, control, lag) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle: it stops us after its step
    torch.set_num_threads(1)
    ring = torch.frombuffer(mmap.mmap(fd.detach(), slot_bytes * slots), dtype=torch.uint8)
    try:
        source = recipe.open()
    except BaseException as exc:
        full.put(("error", _portable(exc)))
        return
    full.put(("ready", None))
    prefetcher = Prefetcher(source, recipe.spec, batch_size, history_len, max_delay_s=max_delay_s,
                            out=_SlotQueue(ring, slot_bytes, free, full, source, lag))
    threading.Thread(target=_follow_control, args=(control, source, prefetcher), name="decode-control", daemon=True).start()
    try:
        prefetcher.run()
    finally:
        source.close()  # Kafka: the last commit the trainer asked for


def _follow_control(control, source, prefetcher: Prefetcher) -> None:
    """Commits and the stop from the trainer; a stop as well when the trainer is gone."""
    parent = mp.parent_process()
    while True:
        try:
            kind, payload = control.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                prefetcher.request_stop()
                return
            continue
        except (EOFError, OSError):
            prefetcher.request_stop()
            return
        if kind == "commit":
            source.commit(payload)
        elif kind == "stop":
            prefetcher.request_stop()
            return
