"""Training on several ranks with torch.distributed: who this process is, how the ranks
agree on each step, and how one version is written by all of them.

One process per GPU (or per CPU share), started by torch's elastic launcher
(``streamrec train --nproc-per-node N``, or ``torchrun ... -m streamrec.cli train``
across nodes). Three process groups:

- ``group`` (NCCL on GPUs, gloo on CPU): the embedding exchange (embedding/sharded.py) and the
  dense gradients' all-reduce (:class:`DenseGradients`);
- ``control`` (gloo): the training thread's collectives of Python objects (the run's
  figures, checkpoint agreement);
- ``publish`` (gloo): the version writer threads (a group per thread, so their
  collectives never interleave with the training thread's).

The per-step agreement goes over a channel of its own (``steps``: trainer/step_channel.py,
one TCP connection per pair of ranks), cheaper than a gloo collective. Every collective
and the channel have the ``[trainer] collective_timeout_s`` timeout, so a rank that dies or
hangs makes the others fail with an error instead of waiting forever.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from streamrec.contracts.delta import SparseDelta
from streamrec.modelstore.writer import VersionWriter
from streamrec.embedding.collection import EmbeddingCollection
from streamrec.embedding.sharded import REPLICATED
from streamrec.modelstore.lease import LeaseLost
from streamrec.trainer.publisher import PoisonedModel
from streamrec.trainer.step_channel import PeerLost, StepChannel

log = logging.getLogger(__name__)
WORKER_ENV = "STREAMREC_TRAIN_WORKER"  # set for the processes the launcher starts
GRAD_ALIGN = 16  # elements: where each dense gradient starts in DenseGradients' buffer



class DenseGradients:
    """The dense model's gradients averaged over the ranks: one reduction of all of them after
    backward (the sparse gradients' all_to_all carries it where it can,
    ``ShardedCollection.can_average``; else ``all_reduce``). In place of DDP so that each rank's forward and backward can replay as
    CUDA graphs (trainer/dense_graph.py: DDP's gradient hooks cannot be captured); the dense
    model is small, so the reduction not overlapping the backward costs little. Every
    parameter's gradient is a view of one flat buffer, so backward accumulates into it in
    place and the reduction reads and writes it whole: no per-parameter copy or launch on
    the host, whose thread bounds the step. The ranks start from rank 0's parameters and buffers
    (broadcast when this is made)."""

    def __init__(self, model: torch.nn.Module, group: Any) -> None:
        self.group = group
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0, group=group)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"the dense model's gradients are reduced as one buffer: its parameters need one dtype, got {dtypes}")
        # each gradient starts 64 bytes aligned, so the fused optimizer reads it vectorized
        starts = [0]
        for p in self.params:
            starts.append(starts[-1] + -(-p.numel() // GRAD_ALIGN) * GRAD_ALIGN)
        self.flat = torch.zeros(starts[-1], dtype=dtypes.pop(), device=self.params[0].device)
        self.views = [self.flat[at:at + p.numel()].view_as(p) for at, p in zip(starts, self.params)]
        self.bytes = self.flat.numel() * self.flat.element_size()  # one all_reduce's payload
        self._nccl = self.flat.is_cuda and dist.get_backend(group) == "nccl"
        self.zero()

    def zero(self) -> None:
        """Before backward (in place of the optimizer's ``zero_grad``): every gradient zero, a
        view of the buffer again (re-attached where something replaced it)."""
        self.flat.zero_()
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                p.grad = view

    def all_reduce(self, world: int) -> None:
        """Average every parameter's gradient over ``world`` ranks (a rank whose batch was
        empty adds zeros): one reduction of the buffer, averaging itself on NCCL."""
        dist.all_reduce(self.flat, op=dist.ReduceOp.AVG if self._nccl else dist.ReduceOp.SUM, group=self.group)
        if not self._nccl:
            self.flat /= world


class RankFailure(RuntimeError):
    """Another rank died or stopped answering: this one stops too."""


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    group: Any = None
    control: Any = None
    publish: Any = None
    steps: StepChannel | None = None

    @property
    def distributed(self) -> bool:
        """Two ranks or more: the tables are sharded and the collectives run."""
        return self.group is not None

    def close(self) -> None:
        if self.steps is not None:
            self.steps.close()
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def join(device: torch.device, timeout_s: float) -> Ranks:
    """This process's place among the ranks, from the launcher's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); a lone process without a launcher when
    WORLD_SIZE is unset, and when it is 1: one rank has nobody to exchange rows or gradients
    with, so it trains exactly as a lone process does, with no process group."""
    if "WORLD_SIZE" not in os.environ:
        return Ranks()
    world = int(os.environ["WORLD_SIZE"])
    if world == 1:
        log.info("one rank: training as a lone process (no collectives)")
        return Ranks()
    if timeout_s <= 0:
        raise ValueError("trainer.collective_timeout_s must be > 0 when training on several ranks")
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=timeout, **kwargs)
    rank = dist.get_rank()
    control = dist.new_group(backend="gloo", timeout=timeout)
    ranks = Ranks(rank, world, dist.group.WORLD, control, dist.new_group(backend="gloo", timeout=timeout),
                  StepChannel.open(rank, world, control, timeout_s))
    log.info("rank %d of %d (%s, collective timeout %.0f s)", rank, world, backend, timeout_s)
    return ranks


def rank_device(device: torch.device, ranks_env: Mapping[str, str] = os.environ) -> torch.device:
    """One GPU per rank: ``cuda`` becomes ``cuda:<LOCAL_RANK>`` under the launcher."""
    if device.type != "cuda" or "WORLD_SIZE" not in ranks_env or device.index not in (None, 0):
        return device
    local = int(ranks_env.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise ValueError(f"local rank {local} has no GPU: this node has {torch.cuda.device_count()}; "
                         "start at most one rank per GPU (--nproc-per-node)")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


class Publish(IntEnum):
    """Rank 0's word on publishing after a step (sent to the other ranks as its number)."""

    NO = 0
    DUE = 1  # the version the publish interval asks for
    FULL_FOR_BASELINE = 2  # a full version, loaded as the frozen baseline once written


@dataclass
class Agreed:
    """What every rank decided together for one step."""

    samples: int  # samples in this step across ranks (0: nobody had a batch)
    ended: bool  # every rank's source is exhausted
    stop: bool  # some rank was asked to stop (signal, limit, idle)
    now_ms: int  # the step's clock: the newest sample time across ranks
    publish: Publish  # rank 0's word
    checkpoint: bool  # rank 0's word
    counts: list[list[int]] = field(default_factory=list)  # each rank's ``counts``, rank by rank
    keys_from: list[np.ndarray] | None = None  # what each rank sent this one (``to_each``), rank by rank; None unless every rank sent


HEADER = 7  # the agreement's fields before a rank's counts


def agree(ranks: Ranks, samples: int, ended: bool, stop: bool, now_ms: int, publish: Publish = Publish.NO,
          checkpoint: bool = False, counts: Sequence[int] = (), to_each: Sequence[np.ndarray] | None = None) -> Agreed:
    """One small all_gather over the ranks' step channel: every rank learns the others' state
    and rank 0's decisions, so all take the same branch (and call the same collectives).
    ``counts`` (as many on every rank): the step's keys per (owner, table)
    (``ShardedCollection.plan``), carried here so that the exchange needs no collective of
    its own for its split sizes. ``to_each`` (int64 host arrays, one per rank): the step's
    keys for each owner (``ShardedCollection.keys_out``), carried too, so that they need no
    collective either; ``keys_from`` holds what came, where every rank sent them (the same
    answer on every rank: all ranks then take the same route)."""
    mine = [samples, int(ended), int(stop), now_ms, int(publish), int(checkpoint), int(to_each is not None), *counts]
    if not ranks.distributed:
        rows, received = [mine], list(to_each or [])
    else:
        try:
            rows, received = ranks.steps.exchange(mine, to_each)
        except PeerLost as exc:
            raise RankFailure(f"rank {ranks.rank}: another rank stopped answering ({exc})") from exc
    keys_from = received if all(r[6] for r in rows) else None
    return Agreed(sum(r[0] for r in rows), all(r[1] for r in rows), any(r[2] for r in rows), max(r[3] for r in rows),
                  Publish(rows[0][4]), bool(rows[0][5]), [r[HEADER:] for r in rows], keys_from)


def gather_to_all(ranks: Ranks, value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (picklable), on every rank."""
    if not ranks.distributed:
        return [value]
    out: list[Any] = [None] * ranks.world
    try:
        dist.all_gather_object(out, value, group=group if group is not None else ranks.control)
    except RuntimeError as exc:
        raise RankFailure(f"rank {ranks.rank}: another rank stopped answering ({exc})") from exc
    return out


class ShardedVersionWriter:
    """Writes one version from every rank's shard (called on each rank's publish thread):
    rank 0 fixes the version and its staging directory, every rank writes its shard's
    sparse files there, rank 0 writes the dense file and the one manifest listing every
    shard's files, then renames the version into place and moves LATEST. A rank that
    refuses (non-finite values) or fails makes the version abort on every rank. A table
    replicated on every rank (``placement``) is written by rank 0 alone (every rank holds the
    same rows), so readers still find each key once; the manifest records the placement."""

    def __init__(self, ranks: Ranks, embeddings: EmbeddingCollection, placement: Mapping[str, str] | None = None) -> None:
        self.ranks, self.embeddings = ranks, embeddings
        self.placement = dict(placement or {})
        self.replicated = {name for name, where in self.placement.items() if where == REPLICATED}

    def __call__(self, writer: VersionWriter, kind: str, parent: int | None, tables: Mapping[str, SparseDelta],
                 dense: Mapping[str, torch.Tensor] | None, meta: Mapping[str, Any] | None, refusal: str | None) -> int:
        ranks, group = self.ranks, self.ranks.publish
        staged: list[Any] = [None]
        if ranks.rank == 0:
            try:
                staged = [writer.begin(kind, parent)]
            except Exception as exc:  # every rank learns it and fails this version alike
                staged = [f"rank 0 could not start the version: {exc}"]
        dist.broadcast_object_list(staged, src=0, group=group)
        if isinstance(staged[0], str):
            raise RuntimeError(staged[0])
        files, problem = {}, refusal
        if problem is None:
            try:
                dims = {name: t.config.dim for name, t in self.embeddings.tables.items()}
                mine = {name: delta for name, delta in tables.items() if ranks.rank == 0 or name not in self.replicated}
                files = writer.write_shard(staged[0], mine, dims, ranks.rank, ranks.world)
            except Exception as exc:  # reported to rank 0, which aborts the version for all
                problem = f"rank {ranks.rank} could not write its shard: {exc}"
        shards = gather_to_all(ranks, (files, problem, dict((meta or {}).get("offsets", {}))), group)
        problems = [p for _, p, _ in shards if p]
        outcome: list[Any] = [None]
        if ranks.rank == 0:
            if problems:
                writer.abort(staged[0])
                outcome = [("refused" if refusal or any("non-finite" in p for p in problems) else "failed", "; ".join(problems))]
            else:
                try:
                    merged = {rel: info for shard_files, _, _ in shards for rel, info in shard_files.items()}
                    offsets = [o for _, _, o in shards]
                    meta = {**dict(meta or {}), "shards": ranks.world, "offsets_by_rank": offsets}
                    if self.placement:
                        meta["placement"] = self.placement
                    if len({p for o in offsets for p in o}) == sum(map(len, offsets)):
                        # Kafka partitions are disjoint across ranks: one map covers them all
                        meta["offsets"] = {p: o for rank_offsets in offsets for p, o in rank_offsets.items()}
                    outcome = [("ok", writer.commit(staged[0], merged, dense, meta))]
                except LeaseLost as exc:
                    outcome = [("lease", str(exc))]
                except Exception as exc:
                    outcome = [("failed", f"rank 0 could not commit version {staged[0].version}: {exc}")]
        dist.broadcast_object_list(outcome, src=0, group=group)
        status, detail = outcome[0]
        if status == "ok":
            return detail
        raise {"refused": PoisonedModel, "lease": LeaseLost}.get(status, RuntimeError)(detail)


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``streamrec <argv>`` as ``nproc`` local ranks under torch's elastic launcher
    (the same machinery as ``torchrun --standalone``). Returns the launcher's exit code;
    when a rank fails, the launcher stops the others and says which rank failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", "--module",
                                         "streamrec.cli", *argv])
    os.environ[WORKER_ENV] = "1"
    try:
        run(args)
    except ChildFailedError as exc:
        failures = "; ".join(f"rank {f.local_rank} ({_why(f)})" for f in exc.failures.values())
        print(f"streamrec train: {failures}. The other ranks were stopped. Nothing after the last checkpoint is lost: "
              "run the same command again to resume from it.", file=sys.stderr)
        return 1
    return 0


def _why(failure: Any) -> str:
    """A rank's failure in words: a signal, or its error message."""
    if failure.exitcode is not None and failure.exitcode < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            return f"killed by signal {-failure.exitcode}"
    message = failure.message if isinstance(failure.message, str) else (failure.message or {}).get("message", "")
    return f"exit code {failure.exitcode}" + (f": {message.strip().splitlines()[-1]}" if message else "")

