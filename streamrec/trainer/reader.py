"""The trainer's samples read, checked, batched and laid out in a process of their own.

Why a process: the step's thread releases the GIL at every torch call, and a decoding
thread in the same process takes it each time and holds it through its own Python work,
so the step waits on the decoder hundreds of times a step (bench/RESULTS.md, "Trainer
scaling": the same batches decoded beforehand train far faster). In a process of its own
the decoder never competes for the step's GIL.

The child (trainer/reader_process.py, torch-free) runs the source (files or the topic) and
the ``Prefetcher``, and writes each batch's arrays into a free slot of a shared file mapping
(one per ``depth + 2`` batches in flight). It sends a small message per batch (the slot, each
array's place, the batch's other fields) over a socket. The parent (``SampleReader``) makes
the batch's tensors views of that slot: on CUDA the mapping is page-locked once
(``cudaHostRegister``), so the step's copy to the device is one asynchronous transfer, and
the slot goes back to the child once the device has copied it (a CUDA event recorded at the
next ``get``, when the step has queued every copy of it). On CPU the batch is copied out at
once. A batch larger than a slot travels in its message instead.

The source's ``commit`` and ``lag`` pass through the same socket: commits go to the child's
source between batches, lag comes with every message. A failure in the child (a missing
topic, a corrupt file) is raised by the next ``get`` (or ``start``) with its own type and
message; a child that dies says so.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.model.batch import SampleBatch
from streamrec.plumbing.processes import python_env
from streamrec.trainer.prefetch import END, IDLE, Skipped
from streamrec.trainer.reader_process import ALIGN, ReaderSettings, SourceSpec, slot_bytes

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0  # the child's imports; the source's connection timeout comes on top


class SampleReader:
    """The parent's side: ``get`` as ``Prefetcher.get`` (a SampleBatch, IDLE, END or Skipped),
    the source's ``lag`` and ``commit``, and ``stop`` (the source closes with the child).
    ``device``: where the batches go (CUDA: the shared slots are page-locked for asynchronous
    copies)."""

    def __init__(self, source: SourceSpec, spec: FeatureSpec, settings: ReaderSettings, device: torch.device,
                 dense_width: int) -> None:
        self.source, self.spec, self.settings, self.device = source, spec, settings, device
        self.slots = settings.depth + 2
        self.slot_size = -(-slot_bytes(settings.batch_size, settings.history_len, dense_width,
                                       settings.layout_world is not None) // ALIGN) * ALIGN
        self._lag: int | None = None
        self._handed: int | None = None  # the slot of the batch handed out last (CUDA: freed once copied)
        self._copying: list[tuple[torch.cuda.Event, int]] = []
        self._registered = False
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._mapping: mmap.mmap | None = None
        self._view: torch.Tensor | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "SampleReader":
        """Start the child and wait until its source is open (raising its failure if not)."""
        size = self.slots * self.slot_size
        fd = _slots_file(size)
        theirs = None
        try:
            self._mapping = mmap.mmap(fd, size)
            self._view = torch.frombuffer(self._mapping, dtype=torch.uint8)  # keeps the mapping while any view lives
            if self.device.type == "cuda":
                self._registered = torch.cuda.cudart().cudaHostRegister(self._view.data_ptr(), size, 0) == 0
                if not self._registered:
                    log.warning("could not page-lock the batch slots: each batch's copy to the device will wait for it")
            ours, theirs = socket.socketpair()
            self._conn = Connection(ours.detach())
            # python -m, not multiprocessing's spawn: that would import the caller's main script again
            self._process = subprocess.Popen([sys.executable, "-m", "streamrec.trainer.reader_process", "--fd", str(theirs.fileno()),
                                              "--slots-fd", str(fd)], pass_fds=(theirs.fileno(), fd), env=python_env())
            self._conn.send((self.slot_size, self.slots, self.source, self.spec, self.settings))
            timeout_s = START_TIMEOUT_S + 2 * self.source.timeout_s  # imports, then the source's connection
            if not self._conn.poll(timeout_s):
                raise TimeoutError(f"the sample reader did not start within {timeout_s:.0f} s")
            self._receive()  # "ready", or the source's failure raised
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(fd)
            if theirs is not None:
                theirs.close()
        return self

    def stop(self) -> None:
        """Stop the child (its source commits what it was last asked to, then closes). The
        shared mapping stays until the last batch viewing it is gone."""
        if self._process is not None:
            try:
                self._conn.send(("stop",))
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and self._process.poll() is None:  # read what it still sends, so it can stop
                    if self._conn.poll(0.1):
                        message = self._conn.recv()
                        if message[0] == "error":
                            log.warning("the sample reader failed while stopping: %s", message[1])
            except (BrokenPipeError, EOFError, OSError):
                pass
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("the sample reader did not stop within 35 s: killing it (offsets it was asked to commit "
                            "may not reach the group; the checkpoint holds them)")
                self._process.kill()
                self._process.wait(timeout=5)
            self._process = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._registered:
            self._registered = False
            try:
                torch.cuda.synchronize(self.device)  # no copy from a slot still in flight
                torch.cuda.cudart().cudaHostUnregister(self._view.data_ptr())
            except Exception as exc:  # a failed device: what failed first is what the caller sees
                log.warning("could not release the batch slots' page lock: %s", exc)
        self._view = self._mapping = None  # the batches still viewing it keep the mapping

    # ------------------------------------------------------------------ Prefetcher's verb
    def get(self, timeout: float | None = None) -> Any:
        """The next SampleBatch, IDLE (nothing within ``timeout``), END or Skipped; raises the
        child's failure."""
        self._free_copied()
        if len(self._copying) == self.slots and not self._conn.poll(0):
            self._copying[0][0].synchronize()  # every slot is still on its way to the device: the reader waits for one
            self._free_copied()
        if not self._conn.poll(timeout):
            return IDLE
        return self._receive()

    def _receive(self) -> Any:
        try:
            message = self._conn.recv()
        except (EOFError, OSError):  # a closed or reset socket: the reader is gone
            raise self._died() from None
        kind = message[0]
        if kind == "error":
            raise message[1]
        self._lag = message[-1]
        if kind == "batch":
            return self._batch(*message[1:-1])
        if kind == "inline":  # arrays by value (torch would share its tensors by file descriptors)
            return self._assemble({name: torch.from_numpy(a) for name, a in message[1].items()}, message[2])
        if kind == "skipped":
            return Skipped(message[1], message[2])
        return {"idle": IDLE, "end": END, "ready": None}[kind]

    def _batch(self, slot: int, places: list[tuple[str, str, tuple[int, ...], int, int]], used: int,
               fields: dict[str, Any]) -> SampleBatch:
        """The batch in ``slot`` (its tensors in the slot's first ``used`` bytes, the exchange's
        ids after them): its tensors views of the slot (CUDA), or copies (CPU)."""
        base = slot * self.slot_size
        tensors: dict[str, torch.Tensor] = {}
        for name, dtype, shape, offset, nbytes in places:
            tensors[name] = self._view[base + offset: base + offset + nbytes].view(getattr(torch, dtype)).view(shape)
        if self.device.type != "cuda":
            tensors = {name: t.clone() for name, t in tensors.items()}
            self._free(slot)
        else:
            self._handed = slot
        batch = self._assemble(tensors, fields)
        if self.device.type == "cuda":  # one copy of the batch's tensors (the exchange's ids go on their own)
            mine = [(name, offset) for name, _, _, offset, _ in places if name != "plan.routed"]
            batch._pinned = (self._view[base: base + max(used, 1)], [n for n, _ in mine], [o for _, o in mine])
        return batch

    @staticmethod
    def _assemble(tensors: dict[str, torch.Tensor], fields: dict[str, Any]) -> SampleBatch:
        """A SampleBatch of its tensors and other fields, with the exchange's layout."""
        plan = fields.pop("plan", None)
        routed = tensors.pop("plan.routed", None)
        batch = SampleBatch(**tensors, **fields)
        if plan is not None:
            from streamrec.embedding.sharded import HostPlan

            batch.plan = HostPlan(plan[0], plan[1], routed, plan[2])
        return batch

    def _died(self) -> RuntimeError:
        """The error for a reader whose socket closed: with its exit code, once it has one."""
        try:
            code = self._process.wait(timeout=5) if self._process is not None else None
        except subprocess.TimeoutExpired:
            code = "none yet"
        return RuntimeError(f"the sample reader process died (exit code {code}); see its log above")

    def _free(self, slot: int) -> None:
        """Give ``slot`` back to the reader."""
        try:
            self._conn.send(("free", slot))
        except OSError:
            raise self._died() from None

    def _free_copied(self) -> None:
        """Slots whose batch the device has copied go back to the child. The batch handed out
        last has had every copy queued by now (the step copies a batch before it asks for the
        next): an event on the current stream marks them."""
        if self._handed is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._copying.append((event, self._handed))
            self._handed = None
        while self._copying and self._copying[0][0].query():
            self._free(self._copying.pop(0)[1])

    # ------------------------------------------------------------------ the source's verbs
    def lag(self) -> int | None:
        return self._lag

    def commit(self, positions: dict[int, int]) -> None:
        try:
            self._conn.send(("commit", dict(positions)))
        except (BrokenPipeError, OSError) as exc:  # the group's copy is for lag tools; checkpoints hold positions
            log.warning("could not hand the offsets to the sample reader: %s", exc)


def _slots_file(size: int) -> int:
    """An open, already unlinked file of ``size`` bytes for the batch slots: in memory
    (/dev/shm) where it has room, else in the temp directory (the page cache; a warning).
    The room is taken now: on tmpfs a write past its limit would be a SIGBUS later."""
    tried = []
    for directory in [d for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)]:
        fd, path = tempfile.mkstemp(prefix="streamrec-batches-", dir=directory)
        os.unlink(path)  # the descriptor and the mappings keep it: nothing is left behind whatever happens
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            tried.append(f"{directory}: {exc.strerror}")
            continue
        if tried:
            log.warning("no room for the batch slots (%d MiB) in %s: using %s", size >> 20, "; ".join(tried), directory)
        return fd
    raise OSError(f"no room for the trainer's batch slots ({size >> 20} MiB): {'; '.join(tried)}. Give /dev/shm more "
                  "(a container's --shm-size) or lower trainer.prefetch_batches or trainer.batch_size")


