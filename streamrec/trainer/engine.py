"""The training engine: one loop that pulls batches, trains, evaluates, publishes and
checkpoints.

Per step (all on one thread; the ps/ tables are single-writer)::

    batch  <- prefetch queue (decoded, batched, pinned by a background thread)
    pull   sparse rows (unique ids per table)          -- "lookup"
    forward + backward                                 -- "forward_backward"
    check the loss is finite (else stop, never publish)
    dense optimizer step + fused sparse updates        -- "update"
    score -> progressive validation (+ frozen, + Bayes)
    publish slice (bounded) / checkpoint when due      -- "publish"

Stopping (SIGINT/SIGTERM, ``max_samples``, ``max_seconds``, idle timeout, end of files)
finishes the step, publishes what was trained since the last version, checkpoints, and
commits the source positions.

On several ranks (trainer/distributed.py) the loop is the same on every rank: before each
step the ranks agree (one small all_gather) on how many samples the step has, the step's
clock, whether to stop, and rank 0's word on publishing and checkpointing, so every rank
calls the same collectives in the same order. A rank without a batch steps with an empty
one. Embeddings are sharded by key (ps/sharded.py), dense parameters replicated (DDP).
"""

from __future__ import annotations

import fcntl
import logging
import re
import shutil
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from streamrec.model.batch import SampleBatch, batch_from_table
from streamrec.model.device import pick_device
from streamrec.model.inference import InferenceModel
from streamrec.model.network import CTRModel, ModelSpec, inference_cache_rows, table_configs
from streamrec.model.sparse import SparseFeatures
from streamrec.embedding.budget import tier_usage
from streamrec.modelstore.store import ModelStore
from streamrec.embedding.sharded import ShardedEmbeddings
from streamrec.embedding.collection import EmbeddingStore
from streamrec.modelstore.lease import LeaseHeld, WriterLease
from streamrec.plumbing.config import Config
from streamrec.trainer.checkpoint import Checkpointer
from streamrec.trainer.dense_graph import GraphedDense
from streamrec.trainer.distributed import Agreed, RankFailure, ShardedVersionWriter, agree, gather_to_all, join, rank_device
from streamrec.trainer.evaluation import TruthLookup, WindowMetrics
from streamrec.trainer.prefetch import END, Prefetcher, Skipped
from streamrec.trainer.progress import ProgressReporter, TrainerMetrics
from streamrec.trainer.publisher import PoisonedModel, PublishFailed, Publisher
from streamrec.trainer.rejected import RejectedLog
from streamrec.trainer.sources import FileSampleSource, KafkaSampleSource, SampleSource, sample_files

log = logging.getLogger("streamrec.trainer")
PHASES = ("input", "lookup", "forward_backward", "update", "evaluate", "publish")
DRAIN_EVERY = 16  # steps between host syncs of losses and scores
DENSE_INIT_SEED = 0  # training is a function of the data alone: a run and its resumed twin end equal


@dataclass
class TrainOptions:
    """What one `streamrec train` run does (the rest comes from Config)."""

    files: list[str] = field(default_factory=list)  # sample files/dirs; empty = the samples topic
    truth: str | None = None  # generator run dir / truth file, "topic", or None
    max_samples: int = 0  # stop after this many samples (0 = no limit)
    max_seconds: float = 0.0
    idle_exit_s: float = 0.0  # stop after this long without samples (0 = wait forever)
    fresh: bool = False  # ignore existing checkpoints (moved aside, never deleted)
    announce: bool | None = None  # announce versions on the topic; None = when reading Kafka
    loop_files: bool = False  # benchmarks: read the files again and again
    sync_timings: bool = False  # synchronize the device between phases (exact phase times; slower)
    progress: bool = True


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what state is safe."""



def _fuse_on(optimizer: torch.optim.Adam, device: torch.device) -> None:
    """A restored Adam's settings come from the checkpoint: make it fused on CUDA (and not on
    CPU) whatever run wrote it, with the step counters where that implementation wants them."""
    fused = device.type == "cuda"
    for group in optimizer.param_groups:
        group["fused"] = fused
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and "step" in state:
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(param.device if fused else "cpu")


class Trainer:
    def __init__(self, cfg: Config, opts: TrainOptions) -> None:
        self.cfg, self.opts = cfg, opts
        tcfg, mcfg = cfg.trainer, cfg.model
        self.device = rank_device(pick_device(tcfg.device, "trainer.device"))
        self.feature_spec = cfg.features
        self.spec = ModelSpec.from_config(mcfg, self.feature_spec)
        if opts.files:
            sample_files(opts.files)  # fail fast on a wrong path
        self.home = Path(tcfg.work_dir) / mcfg.name
        self.home.mkdir(parents=True, exist_ok=True)
        self.ranks = join(self.device, tcfg.collective_timeout_s)
        rank = self.ranks.rank
        if rank:  # rank 0 reports versions for all
            logging.getLogger("trainer.publisher").setLevel(logging.WARNING)
        lock = self.home / ("trainer.lock" if rank == 0 else f"trainer.rank-{rank}.lock")
        self._lock_fh = open(lock, "w")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_fh.close()
            self.ranks.close()
            raise TrainingError(f"another trainer is running for model {mcfg.name!r} (lock {lock})") from None
        try:
            self._set_up()
        except BaseException:
            if getattr(self, "lease", None) is not None:
                self.lease.release()
            self._lock_fh.close()
            self.ranks.close()
            raise

    def _set_up(self) -> None:
        cfg, opts, tcfg, mcfg = self.cfg, self.opts, self.cfg.trainer, self.cfg.model
        ranks = self.ranks
        for stale in self.home.glob(f"tiers-r{ranks.rank}-*"):  # this rank's SSD tiers of earlier runs: rebuilt from checkpoints
            shutil.rmtree(stale, ignore_errors=True)
        self.tiers_dir = self.home / f"tiers-r{ranks.rank}-{int(time.time())}"
        checkpoints = self.home / "checkpoints"
        self.checkpointer = Checkpointer(checkpoints if ranks.world == 1 else
                                         checkpoints / f"rank-{ranks.rank:05d}-of-{ranks.world:05d}")
        self.model_store = ModelStore(tcfg.model_store, mcfg.name)
        self.lease = None
        if ranks.rank == 0:  # rank 0 commits every version: it holds the store's writer lease
            try:
                self.lease = WriterLease(self.model_store, str(self.home), tcfg.lease_s).acquire()
            except LeaseHeld as exc:
                raise TrainingError(str(exc)) from None
            except OSError as exc:
                raise TrainingError(f"cannot take the writer lease in the model store {self.model_store.base}: {exc}") from None
        self.source_name = f"files:{','.join(str(Path(f).resolve()) for f in opts.files)}" if opts.files else f"kafka:{cfg.topics.samples}"
        self._stop = threading.Event()
        self.times = {p: 0.0 for p in PHASES}
        self.rejected: Counter = Counter()
        self._pending: list[tuple] = []  # (step, loss, scores, labels, event ids, frozen scores) not yet on the host
        self._restore_or_init()
        self.sparse = SparseFeatures(self.store, ShardedEmbeddings(self.store, ranks.group) if ranks.distributed else None)
        self.forward = self.model
        if ranks.distributed:  # dense parameters: replicated, gradients all-reduced
            self.forward = DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        elif self.device.type == "cuda" and tcfg.cuda_graphs:
            self.forward = GraphedDense(self.model, tcfg.batch_size, self.device)  # before any other thread starts
        self.metrics = WindowMetrics(tcfg.eval_window)
        self.prom = TrainerMetrics(tcfg.metrics_port + ranks.rank if tcfg.metrics_port else 0, tcfg.metrics_host)
        self.truth = self._open_truth()
        self.producer = None
        announce = (opts.announce if opts.announce is not None else not opts.files) and ranks.rank == 0
        if announce:
            from streamrec.plumbing.bus.clients import make_producer

            self.producer = make_producer(cfg.kafka.bootstrap_servers, timeout_s=cfg.kafka.connect_timeout_s)
        self.publisher = Publisher(self.store, self.model_store, tcfg.publish_interval_s, tcfg.full_every, tcfg.publish_rows_per_step,
                                   tcfg.keep_fulls, self._announce if announce else None,
                                   self.state.get("last_version"), self.state.get("deltas_since_full", 0),
                                   ShardedVersionWriter(ranks, self.store) if ranks.distributed else None, collect_garbage=ranks.rank == 0,
                                   max_failures=tcfg.max_publish_failures, force_full=self.state.get("force_full", False),
                                   compact_every=tcfg.compact_every)
        self.frozen: InferenceModel | None = None
        self._frozen_pending = False
        if tcfg.frozen_baseline and self.state.get("frozen_version") is not None:
            self._load_frozen(self.state["frozen_version"])
        self.reporter = ProgressReporter(tcfg.progress_interval_s, self.home / "eval.jsonl") if opts.progress and ranks.rank == 0 else None

    # ------------------------------------------------------------------ set-up
    def _restore_or_init(self) -> None:
        ranks = self.ranks
        if self.opts.fresh:
            self._move_checkpoints_aside()
        else:
            self._check_checkpoint_ranks()
        # the newest step every rank has a complete checkpoint of (ranks may have died between saves)
        held = gather_to_all(ranks, [] if self.opts.fresh else self.checkpointer.steps())
        common = set.intersection(*map(set, held))
        if any(held) and not common:
            raise TrainingError(f"the ranks' checkpoints have no step in common ({held}): start over with --fresh")
        latest = self.checkpointer.at(max(common)) if common else None
        with torch.random.fork_rng(devices=[]):  # the same initial dense weights on every run (and rank)
            torch.manual_seed(DENSE_INIT_SEED)
            self.model = CTRModel(self.spec).to(self.device)
        # fused on CUDA: one kernel over every parameter instead of a dozen launches per step
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.cfg.model.dense_lr, fused=self.device.type == "cuda")
        if latest is None:
            self.store = EmbeddingStore(table_configs(self.cfg.model, self.cfg.ps), self.device, self.tiers_dir, seed=1000 * ranks.rank)
            self.state: dict[str, Any] = {"step": 0, "samples": 0, "global_samples": 0, "positions": {}, "trained_through_ms": 0,
                                          "source": self.source_name}
            return
        self.store, dense, self.state = self.checkpointer.load(latest, self.device, self.tiers_dir)
        if self.state.get("source") != self.source_name:
            raise TrainingError(f"checkpoint {latest} was trained from {self.state.get('source')}, not {self.source_name}; "
                                "use --fresh to start over (old checkpoints are kept aside)")
        if ModelSpec.from_json(self.state["model_spec"]) != self.spec:
            raise TrainingError(f"checkpoint {latest} has model spec {self.state['model_spec']}, the config says {self.spec.to_json()}; "
                                "use --fresh to start over")
        self.state.setdefault("global_samples", self.state["samples"])
        self.model.load_state_dict(dense["model"])
        self.optimizer.load_state_dict(dense["optimizer"])
        _fuse_on(self.optimizer, self.device)
        self.rejected.update(self.state.get("rejected", {}))
        log.info("resumed from %s: step %d, %d samples, positions %s", latest.name, self.state["step"], self.state["samples"],
                 self.state["positions"])

    def _move_checkpoints_aside(self) -> None:
        """--fresh: rank 0 moves the checkpoints directory aside (never deletes it); a rank
        whose checkpoints are still there after that (a node-local work dir) moves its own."""
        root, stamp = self.home / "checkpoints", int(time.time())
        if self.ranks.rank == 0 and root.exists():
            root.rename(self.home / f"checkpoints.old-{stamp}")
            log.info("--fresh: earlier checkpoints moved to %s", self.home / f"checkpoints.old-{stamp}")
        gather_to_all(self.ranks, None)  # rank 0 has moved them before any rank looks
        if self.ranks.world > 1 and self.checkpointer.dir.exists():
            self.checkpointer.dir.rename(self.checkpointer.dir.with_name(f"{self.checkpointer.dir.name}.old-{stamp}"))

    def _check_checkpoint_ranks(self) -> None:
        """Checkpoints are per rank: resuming needs the number of ranks that wrote them."""
        root = self.home / "checkpoints"
        if not root.is_dir():
            return
        written = {int(m.group(2)) for p in root.iterdir()
                   if (m := re.fullmatch(r"rank-(\d+)-of-(\d+)", p.name)) and (p / "LATEST").is_file()}
        if (root / "LATEST").is_file():
            written.add(1)
        other = sorted(written - {self.ranks.world})
        if other:
            raise TrainingError(f"the checkpoints under {root} were written by {other[0]} rank(s), and this run has "
                                f"{self.ranks.world}: resume with --nproc-per-node {other[0]} (as many ranks as wrote them), "
                                "or start over with --fresh (they are moved aside, not deleted)")

    def _open_truth(self) -> TruthLookup | None:
        if not self.opts.truth:
            return None
        if self.opts.truth == "topic":
            return TruthLookup.from_topic(self.cfg.kafka.bootstrap_servers, self.cfg.topics.truth, self.cfg.kafka.connect_timeout_s)
        return TruthLookup.from_file(self.opts.truth)

    def _source(self) -> SampleSource:
        positions = {int(p): int(o) for p, o in self.state.get("positions", {}).items()}
        shard = (self.ranks.rank, self.ranks.world)
        if self.opts.files:
            return FileSampleSource(self.opts.files, self.feature_spec, positions, loop=self.opts.loop_files, shard=shard)
        kept = self.home / "rejected" / f"rank-{self.ranks.rank:05d}.jsonl"
        return KafkaSampleSource(self.cfg.kafka.bootstrap_servers, self.cfg.topics.samples, self.cfg.trainer.group, self.feature_spec,
                                 positions, timeout_s=self.cfg.kafka.connect_timeout_s, shard=shard,
                                 rejected_log=RejectedLog(kept, self.cfg.trainer.rejected_keep_mb << 20))

    def _announce(self, message: dict) -> None:
        import orjson

        self.producer.send(self.cfg.topics.model_updates, key=self.cfg.model.name.encode(), value=orjson.dumps(message))
        self.producer.flush(timeout=10)

    def _load_frozen(self, version: int) -> None:
        try:
            self.frozen = InferenceModel.load(self.model_store, version, self.device,
                                              inference_cache_rows(self.cfg.model, self.cfg.ps))
            self.state["frozen_version"] = version
            log.info("frozen baseline: version %d", version)
        except Exception as exc:
            log.warning("frozen baseline version %d cannot be loaded (%s); comparing without it", version, exc)
            self.frozen = None

    # ------------------------------------------------------------------ running
    def request_stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self) -> dict[str, Any]:
        tcfg = self.cfg.trainer
        source = self._source()
        prefetch = Prefetcher(source, self.feature_spec, tcfg.batch_size, self.spec.history_len, tcfg.prefetch_batches,
                              pin_memory=self.device.type == "cuda",
                              max_delay_s=None if self.opts.files else tcfg.max_batch_delay_ms / 1000).start()
        started = time.monotonic()
        self._last_data = time.monotonic()
        self._last_checkpoint = time.monotonic()
        samples_at_start = self.state["global_samples"]
        self._positions = {int(p): int(o) for p, o in self.state.get("positions", {}).items()}
        poisoned = failed = unpublished = None
        ended = False
        try:
            while True:
                t0 = time.perf_counter()
                # files never idle: wait for the batch, so a slow decode never turns into an
                # empty step (steps then hold the same samples run after run). Idle on the topic,
                # look again soon while a version is due or on its way (its publish waits on this loop)
                idle_wait = 0.05 if self.publisher.busy or self._dirty() else 0.5
                item = END if ended else prefetch.get(timeout=None if self.opts.files else idle_wait)
                self.times["input"] += time.perf_counter() - t0
                batch = item if isinstance(item, SampleBatch) else None
                ended = ended or item is END
                if isinstance(item, Skipped):
                    self._advance(item.positions, item.rejected)
                trained = self.state["global_samples"] - samples_at_start
                idle_s = time.monotonic() - self._last_data
                stop = self._stop.is_set() or bool(self.opts.max_samples and trained >= self.opts.max_samples) or \
                    bool(self.opts.max_seconds and time.monotonic() - started >= self.opts.max_seconds) or \
                    bool(self.opts.idle_exit_s and idle_s > self.opts.idle_exit_s)
                publish, checkpoint = self._decide() if self.ranks.rank == 0 else (0, False)
                agreed = agree(self.ranks, len(batch) if batch is not None else 0, ended, stop,
                               batch.max_ts() if batch is not None else 0, publish, checkpoint)
                if agreed.samples:
                    self._last_data = time.monotonic()
                    self._step(batch if batch is not None else self._empty_batch(), agreed)
                if agreed.ended:
                    break
                if agreed.stop:
                    if self.opts.idle_exit_s and idle_s > self.opts.idle_exit_s:
                        log.info("no samples for %.0f s: stopping", self.opts.idle_exit_s)
                    break
                self._between_steps(source, agreed)
            self.publisher.flush()
            if self._dirty():
                self._begin_publish()
                self.publisher.flush()
            self.checkpoint(source)
            if self.publisher.failures:  # what was trained last is not in the store: not a clean stop
                raise PublishFailed(f"the last publish failed ({self.publisher.last_error}); the checkpoint holds what "
                                    "was trained, and the next run publishes it as a full version")
        except PoisonedModel as exc:
            poisoned = str(exc)
        except PublishFailed as exc:
            unpublished = str(exc)
        except RuntimeError as exc:
            if not self.ranks.distributed or isinstance(exc, TrainingError):
                self._close_after_failure()
                raise
            failed = exc  # a collective failed: another rank died or hangs
        except BaseException:  # bad input, a bug, an interrupt: release what the trainer holds
            self._close_after_failure()
            raise
        finally:
            prefetch.stop()
            source.close()
        if poisoned:
            self._close()
            latest = self.checkpointer.latest()
            raise TrainingError(
                f"{poisoned}. Nothing was published or checkpointed after it: the last good version is "
                f"{self.publisher.last_version or 'none'}, the last checkpoint is {latest or 'none'}. Lower the learning rates "
                f"or check the inputs, then run again" + (f": it resumes from {latest.name}." if latest else "."))
        if unpublished is not None:
            latest = self.checkpointer.latest()
            self._close()
            raise TrainingError(f"{unpublished}. Training stopped: a trainer that cannot publish serves nobody. The last "
                                f"published version is {self.publisher.last_version or 'none'}, the last checkpoint "
                                f"{latest.name if latest else 'none'}; fix the model store and run again to resume.")
        if failed is not None:
            latest = self.checkpointer.latest()
            self._close()
            reason = str(failed) if isinstance(failed, RankFailure) else f"rank {self.ranks.rank}: a collective failed ({failed})"
            raise TrainingError(f"{reason}. Training stopped on this rank; nothing after the last checkpoint "
                                f"({latest.name if latest else 'none'}) is kept, and a restart resumes from it.")
        self.publisher.close()  # a compaction in progress finishes, so the summary lists it
        summary = self.summary(time.monotonic() - started, self.state["global_samples"] - samples_at_start)
        self._close()
        return summary

    def _decide(self) -> tuple[int, bool]:
        """Rank 0's word (every rank's, alone) on what follows this step: publish (0 no,
        1 the due version, 2 a full one for the frozen baseline) and checkpoint."""
        tcfg = self.cfg.trainer
        publish = 0
        if not self.publisher.busy and self.state["global_samples"] > 0 and not self.publisher.poisoned:
            want_frozen = tcfg.frozen_baseline and self.frozen is None and not self._frozen_pending and \
                self.state.get("frozen_version") is None and self.state["global_samples"] >= tcfg.warmup_samples
            if want_frozen:
                publish = 2
            elif self.publisher.due() and self._dirty():
                publish = 1
        checkpoint = bool(tcfg.checkpoint_interval_s) and time.monotonic() - self._last_checkpoint >= tcfg.checkpoint_interval_s \
            and not self.publisher.busy and not publish
        return publish, checkpoint

    def _empty_batch(self) -> SampleBatch:
        """What a rank without samples steps with, so it still joins the step's collectives."""
        return batch_from_table(self.feature_spec.schema().empty_table(), self.feature_spec, self.spec.history_len)

    def _dirty(self) -> bool:
        """Something the store lacks: samples since the last publish, a failed publish, or
        versions in the store this trainer's state does not match (a full version is due)."""
        return self.state["global_samples"] > self.state.get("published_samples", -1) or self.publisher.force_full

    def _step(self, batch: SampleBatch, agreed: Agreed) -> None:
        sync = self.opts.sync_timings and self.device.type == "cuda"
        t0 = time.perf_counter()
        batch = batch.to(self.device, non_blocking=True)
        now_ms = agreed.now_ms
        inputs, handles = self.sparse.pull(batch, now_ms)
        if sync:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        logits = self.forward(*inputs.as_args())
        n = len(batch)
        if self.ranks.distributed:
            # the mean over the step's samples on all ranks: DDP averages gradients over
            # ranks, so each rank's share is scaled by world / total (empty batches add 0)
            summed = F.binary_cross_entropy_with_logits(logits, batch.label, reduction="sum")
            loss = summed * (self.ranks.world / agreed.samples)
            reported = summed.detach() / max(1, n)
        else:
            loss = F.binary_cross_entropy_with_logits(logits, batch.label)
            reported = loss.detach()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if sync:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        self.optimizer.step()
        self.sparse.push(handles)
        if sync:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        if n:
            frozen = self.frozen.predict(batch, now_ms) if self.frozen is not None else None
            self._pending.append((self.state["step"], reported, torch.sigmoid(logits.detach()), batch.label, batch.event_ids, frozen))
        if len(self._pending) >= DRAIN_EVERY:
            self._drain()
        t4 = time.perf_counter()
        self.times["lookup"] += t1 - t0
        self.times["forward_backward"] += t2 - t1
        self.times["update"] += t3 - t2
        self.times["evaluate"] += t4 - t3
        self.state["step"] += 1
        self.state["samples"] += n
        self.state["global_samples"] += agreed.samples
        self.state["trained_through_ms"] = max(self.state["trained_through_ms"], now_ms)
        self._advance(batch.positions, batch.rejected)
        self.prom.samples.inc(n)
        if self.cfg.model.ttl_s and self.state["step"] % 100 == 0:
            for table in self.store.tables.values():
                table.expire(now_ms)

    def _drain(self) -> None:
        """Bring the last steps' losses and scores to the host in one transfer: refuse a
        non-finite loss (PoisonedModel), feed progressive validation. Runs every
        DRAIN_EVERY steps and before anything is published, checkpointed or reported, so
        no per-step host sync stalls the device queue."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        losses = torch.stack([p[1] for p in pending]).float().cpu()
        finite = torch.isfinite(losses)
        if not bool(finite.all()):
            first = int(torch.nonzero(~finite)[0, 0])
            self.publisher.abandon(f"loss is {float(losses[first])} at step {pending[first][0]}")
            raise PoisonedModel(f"the training loss became {float(losses[first])} at step {pending[first][0]}")
        self.state["loss"] = float(losses[-1])
        self.prom.loss.set(self.state["loss"])
        online = torch.cat([p[2] for p in pending]).float().cpu().numpy()
        labels = torch.cat([p[3] for p in pending]).cpu().numpy()
        frozen = np.concatenate([p[5] for p in pending]) if pending[0][5] is not None and all(p[5] is not None for p in pending) else None
        if self.truth is not None:
            bayes = self.truth.get([e for p in pending for e in p[4].to_pylist()])
            known = ~np.isnan(bayes)  # compare all scorers on the same impressions
            self.metrics.add(labels[known], online=online[known], frozen=None if frozen is None else frozen[known], bayes=bayes[known])
        else:
            self.metrics.add(labels, online=online, frozen=frozen)

    def _advance(self, positions: dict[int, int], rejected: Counter) -> None:
        for p, o in positions.items():
            self._positions[p] = max(self._positions.get(p, 0), o)
        self.rejected.update(rejected)

    def _between_steps(self, source: SampleSource, agreed: Agreed) -> None:
        t0 = time.perf_counter()
        record = self.publisher.pump()
        if record is not None:
            self.prom.version.set(record.version)
            if self._frozen_pending and record.kind == "full":
                self._frozen_pending = False
                self._load_frozen(record.version)
        if agreed.publish:
            self.publisher.flush()  # a rank whose last version is still being written finishes it first
            if agreed.publish == 2:
                self._frozen_pending = True
            self._begin_publish(kind="full" if agreed.publish == 2 else None)
        self.times["publish"] += time.perf_counter() - t0
        if agreed.checkpoint:
            self.checkpoint(source)
            self._last_checkpoint = time.monotonic()
        if self.reporter is not None and self.reporter.due():
            self._drain()
            self.reporter.report(self.status(source))

    def _begin_publish(self, kind: str | None = None) -> None:
        self._drain()  # never begin a version after an unchecked loss
        meta = {
            "trained_through_ms": self.state["trained_through_ms"],
            "snapshot_at": time.time(),  # the moment the published state was fixed (freshness breakdown)
            "source": self.source_name,
            "offsets": {str(p): o for p, o in sorted(self._positions.items())},
            "samples_trained": self.state["global_samples"],
            "step": self.state["step"],
            "model_spec": self.spec.to_json(),
            "feature_spec": self.feature_spec.to_json(),
        }
        self.publisher.begin(self.model.state_dict(), meta, kind)
        self.state["published_samples"] = self.state["global_samples"]

    def checkpoint(self, source: SampleSource) -> Path:
        """Consistent checkpoint (only between steps, never during a publish); then commit
        offsets. On several ranks every rank saves the same step (of its own shard and
        positions), and offsets are committed once all have."""
        self._drain()
        self.publisher.flush()
        self.state.update({
            "positions": {str(p): o for p, o in sorted(self._positions.items())},
            "last_version": self.publisher.last_version,
            "deltas_since_full": self.publisher.deltas_since_full,
            "force_full": self.publisher.force_full,
            "model_spec": self.spec.to_json(),
            "rejected": dict(self.rejected),
            "source": self.source_name,
            "world_size": self.ranks.world,
        })
        path = self.checkpointer.save(self.state["step"], self.store,
                                      {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, self.state)
        gather_to_all(self.ranks, self.state["step"])  # every rank holds this step before any commits offsets
        try:
            source.commit(self._positions)
        except Exception as exc:  # the checkpoint holds the positions; the group commit is for lag tools
            log.warning("committing offsets failed: %s", exc)
        return path

    # ------------------------------------------------------------------ reporting
    def status(self, source: SampleSource | None = None) -> dict[str, Any]:
        """This rank's view (on several ranks: the metrics of its own samples)."""
        out = {
            "samples": self.state["global_samples"],
            "step": self.state["step"],
            "loss": self.state.get("loss"),
            "trained_through_ms": self.state["trained_through_ms"],
            "version": self.publisher.last_version,
            "rejected": dict(self.rejected),
            "lag": source.lag() if source is not None else None,
            **self.metrics.summary(),
        }
        for scorer in ("online", "frozen", "bayes"):
            if f"auc_{scorer}" in out:
                self.prom.auc.labels(scorer).set(out[f"auc_{scorer}"])
                self.prom.logloss.labels(scorer).set(out[f"logloss_{scorer}"])
        if out["lag"] is not None:
            self.prom.lag.set(out["lag"])
        self.prom.trained_through.set(out["trained_through_ms"])
        out["tiers"] = {name: tier_usage(table) for name, table in self.store.tables.items()}
        for name, table in self.store.tables.items():
            self.prom.rows.labels(name).set(len(table))
            for tier, held in out["tiers"][name].items():
                self.prom.tier_rows.labels(name, tier).set(held["rows"])
        return out

    def summary(self, elapsed_s: float, trained: int) -> dict[str, Any]:
        steps = max(1, self.state["step"])
        out = self.status()
        out.update({
            "elapsed_s": elapsed_s,
            "samples_this_run": trained,
            "samples_per_s": trained / max(elapsed_s, 1e-9),
            "device": str(self.device),
            "ms_per_step": {p: 1000 * t / steps for p, t in self.times.items()},
            "published": [asdict(r) for r in self.publisher.records],
            "compactions": self.publisher.compactions,
            "publish_stall_ms_per_million_rows": self.publisher.stall_ms_per_million_rows(),
            "frozen_version": self.state.get("frozen_version"),
            "table_rows": {name: len(t) for name, t in self.store.tables.items()},
        })
        if self.ranks.distributed:  # every rank's share, and the metrics over all ranks' windows
            shares = gather_to_all(self.ranks, {"samples": self.state["samples"], "table_rows": out["table_rows"],
                                                "window": self.metrics.rows()})
            out.update(WindowMetrics.merged([share.pop("window") for share in shares]).summary())
            out["ranks"] = shares
            out["world_size"] = self.ranks.world
            out["table_rows"] = {name: sum(share["table_rows"][name] for share in shares) for name in out["table_rows"]}
        return out

    def _close_after_failure(self) -> None:
        """``_close`` on the way out of a failed run: the failure is what the caller needs to
        see, so a second one while closing is logged, not raised over it."""
        try:
            self._close()
        except Exception:
            log.exception("closing the trainer after a failure also failed")

    def _close(self) -> None:
        self.publisher.close()
        if self.reporter is not None:
            self.reporter.close()
        if self.truth is not None:
            self.truth.close()
        if self.frozen is not None:
            self.frozen.close()
        if self.producer is not None:
            self.producer.close(timeout=5)
        self.store.close()
        shutil.rmtree(self.tiers_dir, ignore_errors=True)
        if self.lease is not None:
            self.lease.release()
        self._lock_fh.close()
        self.ranks.close()


def train(cfg: Config, opts: TrainOptions) -> dict[str, Any]:
    """Run a trainer until it stops; SIGINT/SIGTERM stop it cleanly (publish, checkpoint)."""
    trainer = Trainer(cfg, opts)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, trainer.request_stop)
    try:
        return trainer.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
