"""The trainer's sample reader process (the child of trainer/reader.py's SampleReader): the
source (files or the topic) and the Prefetcher, each batch's arrays written into a free slot
of the shared file mapping, and a small message per batch over the socket.

Nothing here loads torch: the batches are numpy arrays (model/host_batch.py) and the exchange's
layout is numpy's (embedding/host_layout.py), so the process starts in about a second, and no
torch thread pool of its own spins on the cores the training threads need. The parent makes
the slots' bytes tensors.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import numpy as np

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.embedding.host_layout import lay_out
from streamrec.model.host_batch import HostBatch, table_ids
from streamrec.plumbing.logs import configure_logging
from streamrec.trainer.prefetch import END, Prefetcher, Skipped

ALIGN = 64  # bytes: each array's place in a slot


@dataclass
class SourceSpec:
    """How the child opens the trainer's source (trainer/sources.py), picklable."""

    files: list[str] | None = None  # sample files; else the topic below
    loop: bool = False
    shard: tuple[int, int] = (0, 1)
    positions: dict[int, int] | None = None
    bootstrap: str = ""
    topic: str = ""
    group: str = ""
    timeout_s: float = 20.0
    rejected_path: str | None = None  # the topic's refused messages are kept there
    rejected_keep_bytes: int = 0

    def open(self, spec: FeatureSpec) -> Any:
        from streamrec.trainer.rejected import RejectedLog
        from streamrec.trainer.sources import FileSampleSource, KafkaSampleSource

        if self.files:
            return FileSampleSource(self.files, spec, self.positions, loop=self.loop, shard=self.shard)
        kept = RejectedLog(Path(self.rejected_path), self.rejected_keep_bytes) if self.rejected_path else None
        return KafkaSampleSource(self.bootstrap, self.topic, self.group, spec, self.positions, timeout_s=self.timeout_s,
                                 shard=self.shard, rejected_log=kept)


@dataclass
class ReaderSettings:
    """What the child's Prefetcher does (trainer/prefetch.py), and ``layout_world``: the
    ranks to lay each batch's ids out for (``embedding.sharded.layout_on_host``), or None;
    ``every_sighting``: the tables that send every id, not each key once."""

    batch_size: int
    history_len: int
    depth: int
    max_delay_s: float | None
    layout_world: int | None = None
    every_sighting: tuple[str, ...] = ()


def slot_bytes(batch_size: int, history_len: int, dense_width: int, laid_out: bool) -> int:
    """Room for one batch of ``batch_size`` samples with full histories (SampleBatch's tensors
    and, ``laid_out``, the exchange's keys and each id's place among them), each tensor 64-byte aligned."""
    b, ids = batch_size, batch_size * (7 + 2 * history_len)  # every table's ids (SparseFeatures.table_ids)
    tensors = 8 * b * 5 + 4 * b + 4 * b * dense_width + 8 * 3 * b + 8 * 3 * b * history_len + 8 * b
    return tensors + (16 * ids if laid_out else 0) + 16 * ALIGN


def _child_main(conn: Connection, slots_fd: int) -> None:
    """The child: open the source, run the Prefetcher, write batches into free slots. Ctrl-C
    and SIGTERM reach the trainer's whole process group: the trainer stops cleanly and then
    stops this process, which exits by itself if the trainer is gone (its socket closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    size, slots, source_spec, spec, settings = conn.recv()
    source = prefetcher = None
    try:
        mapping = mmap.mmap(slots_fd, size * slots)
        os.close(slots_fd)
        source = source_spec.open(spec)
        layout = _laying_out(settings.layout_world, settings.every_sighting) if settings.layout_world is not None else None
        prefetcher = Prefetcher(source, spec, settings.batch_size, settings.history_len, max(1, settings.depth),
                                max_delay_s=settings.max_delay_s, prepare=layout).start()
        conn.send(("ready", source.lag()))
        _serve(conn, prefetcher, source, mapping, size, list(range(slots)))
    except _Stop:
        pass
    except BaseException as exc:
        try:
            conn.send(("error", _portable(exc)))
        except (BrokenPipeError, OSError):
            pass
    finally:
        if prefetcher is not None:
            prefetcher.stop()
        if source is not None:
            source.close()


def _laying_out(world: int, every_sighting: tuple[str, ...]) -> Callable[[HostBatch], None]:
    """The exchange's layout of each batch's ids over ``world`` ranks (embedding/host_layout.py)."""

    def laid_out(batch: HostBatch) -> None:
        batch.plan = lay_out(table_ids(batch), world, every_sighting)

    return laid_out


class _Stop(Exception):
    """The parent asked the child to stop."""


def _serve(conn: Any, prefetcher: Prefetcher, source: Any, mapping: mmap.mmap, size: int, free: list[int]) -> None:
    pending = None
    while True:
        waiting = pending is not None and not free  # a batch is ready and no slot: wait for the parent
        while conn.poll(0.05 if waiting else 0):
            message = conn.recv()
            if message[0] == "free":
                free.append(message[1])
            elif message[0] == "commit":
                source.commit(message[1])
            else:
                raise _Stop
            waiting = False
        if pending is None:
            pending = prefetcher.poll(timeout=0.05)
            if pending is None:
                continue
        if isinstance(pending, BaseException):
            raise pending
        if isinstance(pending, HostBatch):
            if not free:
                continue
            conn.send(_batch_message(pending, mapping, size, free, source.lag()))
        elif isinstance(pending, Skipped):
            conn.send(("skipped", pending.positions, pending.rejected, source.lag()))
        else:
            conn.send(("end" if pending is END else "idle", source.lag()))
        if pending is END:
            _wait_for_stop(conn, source)
            return
        pending = None


def _wait_for_stop(conn: Any, source: Any) -> None:
    """After the last batch: apply the parent's commits until it says stop."""
    while True:
        message = conn.recv()
        if message[0] == "commit":
            source.commit(message[1])
        elif message[0] != "free":
            return


def _batch_message(batch: HostBatch, mapping: mmap.mmap, size: int, free: list[int], lag: int | None) -> tuple:
    """The batch written into a free slot, and the message that places it (or the whole
    batch in the message, where it does not fit a slot)."""
    arrays = {name: np.ascontiguousarray(getattr(batch, name)) for name in batch.arrays()}
    plan = batch.plan
    if plan is not None:
        arrays["plan.routed"] = np.ascontiguousarray(plan.routed)
    places, offset, used = [], 0, 0
    for name, a in arrays.items():  # the exchange's ids last: the batch's own arrays are one span
        places.append((name, a.dtype.name, a.shape, offset, a.nbytes))
        used = offset + a.nbytes if name != "plan.routed" else used
        offset += -(-a.nbytes // ALIGN) * ALIGN
    fields = {name: getattr(batch, name) for name in ("history_len", "history_groups", "event_ids", "positions", "rejected")}
    if batch.hist_group is None:
        fields["hist_group"] = None
    if plan is not None:
        fields["plan"] = (plan.names, plan.sizes, plan.send_counts)
    if offset > size:
        return ("inline", arrays, fields, lag)
    slot = free.pop()
    target = np.frombuffer(mapping, dtype=np.uint8, count=size, offset=slot * size)
    for (_, _, _, at, nbytes), a in zip(places, arrays.values()):
        target[at: at + nbytes] = a.reshape(-1).view(np.uint8)
    return ("batch", slot, places, used, fields, lag)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError with its message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")



def main(argv: list[str] | None = None) -> None:
    """``python -m streamrec.trainer.reader_process --fd N``: the child, on its end of the parent's socket."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="this end of the trainer's socket")
    parser.add_argument("--slots-fd", type=int, required=True, help="the shared file of the batch slots")
    args = parser.parse_args(argv)
    configure_logging()
    _child_main(Connection(args.fd), args.slots_fd)


if __name__ == "__main__":
    main()
