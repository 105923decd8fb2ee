"""The training loop: one thread that pulls batches, trains, evaluates and publishes.

Per step (the embedding tables are single-writer)::

    batch  <- the sample reader (decoded, batched, laid out by a process of its own: reader.py)
    the ranks agree on the step (several ranks)        -- "agree"
    find_or_insert sparse rows (unique ids per table)  -- "lookup"
    forward + backward                                 -- "forward_backward"
    dense gradients averaged over ranks                -- "all_reduce"
    dense optimizer step + fused sparse updates        -- "update"
    keep loss and scores on the device; every DRAIN_EVERY steps check the losses are
    finite (else stop, never publish) and score them   -- "evaluate"
    publish slice (bounded) / checkpoint when due      -- "publish"

Stopping (SIGINT/SIGTERM, ``max_samples``, ``max_seconds``, idle timeout, end of files)
finishes the step, publishes what was trained since the last version, checkpoints, and
commits the source positions.

On several ranks (trainer/distributed.py) the loop is the same on every rank: before each
step the ranks agree (one small all_gather) on how many samples the step has, the step's
clock, whether to stop, rank 0's word on publishing and checkpointing, and the embedding
exchange's split sizes (``ShardedCollection.plan``), so every rank calls the same
collectives in the same order. A rank without a batch steps with an empty one. Embeddings
are sharded by key (embedding/sharded.py), or, for the tables the session's placement
replicates, held whole by every rank; dense parameters replicated (their gradients averaged
after backward: distributed.DenseGradients). Each rank's phase times
and exchange figures (``ShardedCollection.stats``) are gathered when the run ends, into the
summary's ``step_by_rank``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from streamrec.embedding.budget import tier_usage
from streamrec.embedding.collection import training_collection
from streamrec.embedding.sharded import ShardedCollection
from streamrec.model.batch import SampleBatch, batch_from_table, dense_feature_names
from streamrec.model.network import inference_cache_rows
from streamrec.model.sparse import SparseFeatures
from streamrec.plumbing.config import Config
from streamrec.plumbing.gc_pauses import GcPauses, freeze_heap, thaw_heap
from streamrec.trainer.dense_graph import GraphedDense
from streamrec.trainer.distributed import Agreed, DenseGradients, Publish, ShardedVersionWriter, agree, gather_to_all
from streamrec.trainer.evaluation import OnlineEvaluation, PendingStep, open_truth
from streamrec.trainer.prefetch import END, Skipped
from streamrec.trainer.reader import SampleReader
from streamrec.trainer.reader_process import ReaderSettings, SourceSpec
from streamrec.trainer.progress import ProgressReporter, TrainerMetrics
from streamrec.trainer.publisher import ChainPosition, PoisonedModel, PublishFailed, Publisher, PublishSettings, TopicAnnouncer
from streamrec.trainer.session import TrainingSession, TrainOptions

log = logging.getLogger("streamrec.trainer")
PHASES = ("input", "agree", "lookup", "forward_backward", "all_reduce", "update", "evaluate", "publish")
DRAIN_EVERY = 16  # steps between host syncs of losses and scores
EXPIRE_EVERY = 100  # steps between expiries of unseen rows (model.ttl_s)
# the first steps of a run pay one-time costs (kernel compilation, the collectives' first
# connections, the tables' first growth, the first full version): the steady throughput
# (``steady_samples_per_s``) counts from the end of this step of the run on
WARM_UP_STEPS = 200


@dataclass
class Turn:
    """A step as the ranks agreed it: this rank's batch (None: it has none this step), the
    agreement, whether this rank's source has ended, and how long it has had no samples."""

    batch: SampleBatch | None
    agreed: Agreed
    ended: bool
    idle_s: float


def _dense_forward(session: TrainingSession) -> Callable[..., torch.Tensor]:
    """The dense model as the step calls it: as CUDA graphs on a GPU (captured here, so
    before any other thread uses the device), else eager. On several ranks the same, its
    gradients averaged after backward (``DenseGradients``, made before this)."""
    model, device, tcfg = session.model, session.device, session.cfg.trainer
    if device.type == "cuda" and tcfg.cuda_graphs:
        return GraphedDense(model, tcfg.batch_size, device)
    return model


def _source_spec(session: TrainingSession) -> SourceSpec:
    """This rank's share of the samples (files or the topic), from the session's positions."""
    cfg, opts, ranks = session.cfg, session.opts, session.ranks
    positions = {int(p): int(o) for p, o in session.state.get("positions", {}).items()}
    shard = (ranks.rank, ranks.world)
    if opts.files:
        return SourceSpec(files=list(opts.files), loop=opts.loop_files, shard=shard, positions=positions)
    kept = session.home / "rejected" / f"rank-{ranks.rank:05d}.jsonl"
    return SourceSpec(shard=shard, positions=positions, bootstrap=cfg.kafka.bootstrap_servers, topic=cfg.topics.samples,
                      group=cfg.trainer.group, timeout_s=cfg.kafka.connect_timeout_s, rejected_path=str(kept),
                      rejected_keep_bytes=cfg.trainer.rejected_keep_mb << 20)


def _empty_batch(session: TrainingSession) -> SampleBatch:
    """What a rank without samples steps with, so it still joins the step's collectives."""
    return batch_from_table(session.feature_spec.schema().empty_table(), session.feature_spec, session.spec.history_len)


def _version_meta(session: TrainingSession, positions: dict[int, int]) -> dict[str, Any]:
    """What a version's manifest says of the training that made it."""
    state = session.state
    return {
        "trained_through_ms": state["trained_through_ms"],
        "snapshot_at": time.time(),  # the moment the published state was fixed (freshness breakdown)
        "source": session.source_name,
        "offsets": {str(p): o for p, o in sorted(positions.items())},
        "samples_trained": state["global_samples"],
        "step": state["step"],
        "model_spec": session.spec.to_json(),
        "feature_spec": session.feature_spec.to_json(),
    }


class TrainingLoop:
    """The step and what runs between steps, on the session's model, optimizer, collection
    and state (also held here, for short access on the step's path)."""

    def __init__(self, session: TrainingSession) -> None:
        self.session = session
        cfg, opts, ranks = session.cfg, session.opts, session.ranks
        tcfg = cfg.trainer
        self.cfg, self.opts, self.ranks, self.device = cfg, opts, ranks, session.device
        self.feature_spec, self.spec, self.state = session.feature_spec, session.spec, session.state
        self.model, self.optimizer, self.embeddings = session.model, session.optimizer, session.embeddings
        self.rejected = session.rejected
        self.times = {p: 0.0 for p in PHASES}  # seconds spent in each phase of the step
        self.gc_pauses = GcPauses()
        self.warmed: tuple[float, int] | None = None  # (time, samples of all ranks) when the warm-up steps ended
        self.last_step: tuple[float, int] | None = None  # the same when the last step ended
        self.started = time.monotonic()  # these four are set again when run starts
        self.samples_at_start, self.steps_at_start, self.rank_samples_at_start = self._counts()
        self._pending: list[PendingStep] = []  # steps whose loss and scores are not yet on the host
        collection = training_collection(self.embeddings, ranks.distributed, ranks.group, session.replicated)
        self.exchange = collection if isinstance(collection, ShardedCollection) else None
        if self.exchange is not None:
            self.exchange.sync_timings = opts.sync_timings
        self.pipelined = self.exchange is not None and tcfg.pipeline_exchange  # _look_ahead
        self.sparse = SparseFeatures(collection)
        self.by_rank: list[dict[str, Any]] | None = None  # every rank's step figures, once the run has ended
        self.dense_gradients = DenseGradients(session.model, ranks.group) if ranks.distributed else None  # ranks start equal
        self.forward = _dense_forward(session)  # before any other thread starts
        self.prom = TrainerMetrics(tcfg.metrics_port + ranks.rank if tcfg.metrics_port else 0, tcfg.metrics_host)
        truth = open_truth(opts.truth, cfg.kafka.bootstrap_servers, cfg.topics.truth, cfg.kafka.connect_timeout_s)
        self.evaluation = OnlineEvaluation(tcfg.eval_window, truth, session.model_store, self.device,
                                           inference_cache_rows(cfg.model, cfg.ps))
        self.announcer = _announcer(cfg, opts) if ranks.rank == 0 else None
        self.publisher = Publisher(self.embeddings, session.writer, PublishSettings.from_config(tcfg, collect_garbage=ranks.rank == 0),
                                   ChainPosition.from_state(self.state), self.announcer,
                                   ShardedVersionWriter(ranks, self.embeddings, session.placement) if ranks.distributed else None)
        self._frozen_pending = False  # a full version for the frozen baseline is being published
        if tcfg.frozen_baseline and self.state.get("frozen_version") is not None:
            self._load_frozen(self.state["frozen_version"])
        self.reporter = ProgressReporter(tcfg.progress_interval_s, session.home / "eval.jsonl") if opts.progress and ranks.rank == 0 else None

    def _counts(self) -> tuple[int, int, int]:
        """Samples of all ranks, steps and this rank's samples so far (a run's figures count from them)."""
        return self.state["global_samples"], self.state["step"], self.state["samples"]

    def _load_frozen(self, version: int) -> None:
        if self.evaluation.load_frozen(version):
            self.state["frozen_version"] = version

    # ------------------------------------------------------------------ running
    def run(self) -> None:
        """Train until the source ends or a stop is due, then publish what the store lacks,
        checkpoint and commit the positions. Failures propagate to the caller."""
        tcfg = self.cfg.trainer
        laid_out = self.exchange is not None and not self.exchange.replicated  # the reader lays out the exchange's ids
        settings = ReaderSettings(tcfg.batch_size, self.spec.history_len, tcfg.prefetch_batches,
                                  None if self.opts.files else tcfg.max_batch_delay_ms / 1000,
                                  self.ranks.world if laid_out else None,
                                  tuple(self.exchange.every_sighting) if laid_out else ())
        reader = SampleReader(_source_spec(self.session), self.feature_spec, settings, self.device,
                              len(dense_feature_names(self.feature_spec))).start()
        # what the run holds from here on (modules, tables, the reader) is never garbage: full
        # collections skip it, so no rank pauses a step for one that the others then wait for
        freeze_heap()
        self.gc_pauses.install()
        self.started = time.monotonic()
        self._last_data = time.monotonic()
        self._last_checkpoint = time.monotonic()
        self.samples_at_start, self.steps_at_start, self.rank_samples_at_start = self._counts()
        self._positions = {int(p): int(o) for p, o in self.state.get("positions", {}).items()}
        try:
            self._train(reader)
            self._finish(reader)
        finally:
            reader.stop()
            self.gc_pauses.uninstall()
            thaw_heap()

    def _train(self, reader: SampleReader) -> None:
        opts, ended, ahead = self.opts, False, None
        while True:
            turn = ahead if ahead is not None else self._next(reader, ended)
            ended, agreed, ahead = turn.ended, turn.agreed, None
            if agreed.samples:
                self._last_data = time.monotonic()
                ahead = self._step(turn.batch if turn.batch is not None else _empty_batch(self.session), agreed,
                                   lambda: self._look_ahead(reader, turn.ended, agreed))
            if agreed.ended:
                return
            if agreed.stop:
                if opts.idle_exit_s and turn.idle_s > opts.idle_exit_s:
                    log.info("no samples for %.0f s: stopping", opts.idle_exit_s)
                return
            self._between_steps(reader, agreed)

    def _next(self, reader: SampleReader, ended: bool, ahead: bool = False) -> Turn:
        """The next step as every rank agrees it: this rank's batch, whether to stop, rank
        0's word on publishing and checkpointing after it (``ended``: this rank's source is
        done). On several ranks the batch goes to the device here and its keys and their counts
        per owner travel in the agreement (``ShardedCollection.plan``); a rank without samples
        plans an empty batch. ``ahead``: during the step before (``_look_ahead``)."""
        opts = self.opts
        t0 = time.perf_counter()
        # files never idle: wait for the batch, so a slow decode never turns into an
        # empty step (steps then hold the same samples run after run). Idle on the topic,
        # look again soon while a version is due or on its way (its publish waits on this loop)
        idle_wait = 0.05 if self.publisher.busy or self._dirty() else 0.5
        item = END if ended else reader.get(timeout=None if opts.files else idle_wait)
        self.times["input"] += time.perf_counter() - t0
        batch = item if isinstance(item, SampleBatch) else None
        ended = ended or item is END
        if isinstance(item, Skipped):
            self._advance(item.positions, item.rejected)
        trained = self.state["global_samples"] - self.samples_at_start
        idle_s = time.monotonic() - self._last_data
        stop = self.session.stop_requested.is_set() or bool(opts.max_samples and trained >= opts.max_samples) or \
            bool(opts.max_seconds and time.monotonic() - self.started >= opts.max_seconds) or \
            bool(opts.idle_exit_s and idle_s > opts.idle_exit_s)
        publish, checkpoint = self._decide() if self.ranks.rank == 0 else (Publish.NO, False)
        counts: list[int] = []
        newest = batch.max_ts() if batch is not None else 0  # on the host, before the batch goes to the device
        if self.exchange is not None:  # the exchange's split sizes go in the agreement
            batch = batch if batch is not None else _empty_batch(self.session)
            t0 = time.perf_counter()
            with self.exchange.ahead_stream() if ahead else nullcontext():
                batch.to(self.device, non_blocking=True)
                # laid out by the reader; an empty batch, or one of replicated tables, on the device
                counts = self.exchange.plan(None if batch.plan is not None else SparseFeatures.table_ids(batch), host=batch.plan)
            self.times["lookup"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        keys_out = self.exchange.keys_out() if self.exchange is not None else None
        t2 = time.perf_counter()
        agreed = agree(self.ranks, len(batch) if batch is not None else 0, ended, stop, newest, publish, checkpoint, counts,
                       keys_out)
        t3 = time.perf_counter()
        if self.exchange is not None:
            self.exchange.agreed(agreed.counts, agreed.keys_from)
        self.times["agree"] += t3 - t2  # the channel alone: the exchange's own work around it is the lookup's
        self.times["lookup"] += (t2 - t1) + (time.perf_counter() - t3)
        return Turn(batch, agreed, ended, idle_s)

    def _look_ahead(self, reader: SampleReader, ended: bool, agreed: Agreed) -> Turn | None:
        """During a step (``agreed``), after its backward is queued: the next step's turn, and
        its ids sent to their owners, with the owners' find_or_insert where it can run ahead
        (``ShardedCollection.prefetch``), while this step's dense work runs. Only where
        nothing between the two steps reads or changes the tables: no publish, checkpoint or
        stop after this step, and no expiry at its end. The same on every rank."""
        expires = bool(self.cfg.model.ttl_s) and (self.state["step"] + 1) % EXPIRE_EVERY == 0
        if not self.pipelined or agreed.publish or agreed.checkpoint or agreed.stop or agreed.ended or expires:
            return None
        turn = self._next(reader, ended, ahead=True)
        if turn.agreed.samples:
            t0 = time.perf_counter()
            with self.exchange.ahead_stream():
                self.exchange.prefetch(SparseFeatures.table_ids(turn.batch), turn.agreed.now_ms)
            self.times["lookup"] += time.perf_counter() - t0
        return turn

    def _finish(self, source: SampleReader) -> None:
        self.publisher.flush()
        if self._dirty():
            self._begin_publish()
            self.publisher.flush()
        self.checkpoint(source)
        self.by_rank = gather_to_all(self.ranks, self.step_figures())
        if self.publisher.failures:  # what was trained last is not in the store: not a clean stop
            raise PublishFailed(f"the last publish failed ({self.publisher.last_error}); the checkpoint holds what "
                                "was trained, and the next run publishes it as a full version")

    def _decide(self) -> tuple[Publish, bool]:
        """Rank 0's word (every rank's, alone) on what follows this step: whether to
        publish (and what), and whether to checkpoint."""
        tcfg = self.cfg.trainer
        publish = Publish.NO
        if not self.publisher.busy and self.state["global_samples"] > 0 and not self.publisher.poisoned:
            want_frozen = tcfg.frozen_baseline and self.evaluation.frozen is None and not self._frozen_pending and \
                self.state.get("frozen_version") is None and self.state["global_samples"] >= tcfg.warmup_samples
            if want_frozen:
                publish = Publish.FULL_FOR_BASELINE
            elif self.publisher.due() and self._dirty():
                publish = Publish.DUE
        checkpoint = bool(tcfg.checkpoint_interval_s) and time.monotonic() - self._last_checkpoint >= tcfg.checkpoint_interval_s \
            and not self.publisher.busy and not publish
        return publish, checkpoint

    def _dirty(self) -> bool:
        """Something the store lacks: samples since the last publish, a failed publish, or
        versions in the store this trainer's state does not match (a full version is due)."""
        return self.state["global_samples"] > self.state.get("published_samples", -1) or self.publisher.force_full

    def _step(self, batch: SampleBatch, agreed: Agreed, look_ahead: Callable[[], Turn | None] | None = None) -> Turn | None:
        """One step of ``batch``; returns the next step's turn where ``look_ahead`` (called
        once backward is queued) began it."""
        sync = self.opts.sync_timings and self.device.type == "cuda"
        t0 = time.perf_counter()
        batch = batch.to(self.device, non_blocking=True)
        now_ms = agreed.now_ms
        n = len(batch)
        # counted now: a turn looked ahead during this step decides whether to stop after it
        self.state["samples"] += n
        self.state["global_samples"] += agreed.samples
        self.state["trained_through_ms"] = max(self.state["trained_through_ms"], now_ms)
        inputs, rows = self.sparse.training_inputs(batch, now_ms)
        if sync:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        logits = self.forward(*inputs.as_args())
        if self.ranks.distributed and n * self.ranks.world != agreed.samples:
            # the mean over the step's samples on all ranks: the dense gradients are averaged
            # over ranks, so each rank's share is scaled by world / total (empty batches add 0);
            # where every rank's batch is as large, that is this rank's own mean
            summed = F.binary_cross_entropy_with_logits(logits, batch.label, reduction="sum")
            loss = summed * (self.ranks.world / agreed.samples)
            reported = summed.detach() / max(1, n)
        else:
            loss = F.binary_cross_entropy_with_logits(logits, batch.label)
            reported = loss.detach()
        if self.dense_gradients is not None:
            self.dense_gradients.zero()  # the gradients stay views of the buffer the ranks reduce
        else:
            self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if sync:
            torch.cuda.synchronize()
        t_backward = time.perf_counter()
        ahead = look_ahead() if look_ahead is not None else None
        t_reduce = time.perf_counter()
        dense = self.dense_gradients.flat if self.dense_gradients is not None else None
        # the dense gradients averaged in the sparse gradients' all_to_all where it can carry them
        folded = dense is not None and self.exchange is not None and self.exchange.can_average(dense)
        if dense is not None and not folded:
            self.dense_gradients.all_reduce(self.ranks.world)
        if sync:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if folded:
            self.exchange.apply_gradients(rows, average=dense)
            self.optimizer.step()
        else:
            self.optimizer.step()
            self.sparse.apply_gradients(rows)
        if sync:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        if n:
            frozen = self.evaluation.frozen_scores(batch, now_ms)
            # the label cloned: on a GPU it views the batch's one copy, which it would keep whole until drained
            self._pending.append(PendingStep(self.state["step"], reported, torch.sigmoid(logits.detach()), batch.label.clone(),
                                             batch.event_ids, frozen))
        if len(self._pending) >= DRAIN_EVERY:
            self._drain()
        t4 = time.perf_counter()
        self.times["lookup"] += t1 - t0
        self.times["forward_backward"] += t_backward - t1
        self.times["all_reduce"] += t2 - t_reduce
        self.times["update"] += t3 - t2
        self.times["evaluate"] += t4 - t3
        self.state["step"] += 1
        self.last_step = (time.monotonic(), self.state["global_samples"])
        if self.state["step"] - self.steps_at_start == WARM_UP_STEPS:
            self.warmed = self.last_step
        self._advance(batch.positions, batch.rejected)
        self.prom.samples.inc(n)
        if self.cfg.model.ttl_s and self.state["step"] % EXPIRE_EVERY == 0:
            for table in self.embeddings.tables.values():
                table.expire(now_ms)
        return ahead

    def _drain(self) -> None:
        """Bring the last steps' losses and scores to the host in one transfer: refuse a
        non-finite loss (PoisonedModel), feed progressive validation. Runs every
        DRAIN_EVERY steps and before anything is published, checkpointed or reported, so
        no per-step host sync stalls the device queue."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        losses = torch.stack([p.loss for p in pending]).float().cpu()
        finite = torch.isfinite(losses)
        if not bool(finite.all()):
            first = int(torch.nonzero(~finite)[0, 0])
            self.publisher.abandon(f"loss is {float(losses[first])} at step {pending[first].step}")
            raise PoisonedModel(f"the training loss became {float(losses[first])} at step {pending[first].step}")
        self.state["loss"] = float(losses[-1])
        self.prom.loss.set(self.state["loss"])
        self.evaluation.add(pending)

    def _advance(self, positions: dict[int, int], rejected: Counter) -> None:
        for p, o in positions.items():
            self._positions[p] = max(self._positions.get(p, 0), o)
        self.rejected.update(rejected)

    def _between_steps(self, source: SampleReader, agreed: Agreed) -> None:
        t0 = time.perf_counter()
        record = self.publisher.pump()
        if record is not None:
            self.prom.version.set(record.version)
            if self._frozen_pending and record.kind == "full":
                self._frozen_pending = False
                self._load_frozen(record.version)
        if agreed.publish:
            self.publisher.flush()  # a rank whose last version is still being written finishes it first
            full_for_baseline = agreed.publish is Publish.FULL_FOR_BASELINE
            if full_for_baseline:
                self._frozen_pending = True
            self._begin_publish(kind="full" if full_for_baseline else None)
        self.times["publish"] += time.perf_counter() - t0
        if agreed.checkpoint:
            self.checkpoint(source)
            self._last_checkpoint = time.monotonic()
        if self.reporter is not None and self.reporter.due():
            self._drain()
            self.reporter.report(self.status(source))

    def _begin_publish(self, kind: str | None = None) -> None:
        self._drain()  # never begin a version after an unchecked loss
        self.publisher.begin(self.model.state_dict(), _version_meta(self.session, self._positions), kind)
        self.state["published_samples"] = self.state["global_samples"]

    def checkpoint(self, source: SampleReader) -> Path:
        """Consistent checkpoint (only between steps, never during a publish); then commit
        offsets. On several ranks every rank saves the same step (of its own shard and
        positions), and offsets are committed once all have."""
        self._drain()
        self.publisher.flush()
        path = self.session.save_checkpoint(self._positions, self.publisher.chain())
        try:
            source.commit(self._positions)
        except Exception as exc:  # the checkpoint holds the positions; the group commit is for lag tools
            log.warning("committing offsets failed: %s", exc)
        return path

    # ------------------------------------------------------------------ reporting
    def steady_samples_per_s(self) -> float | None:
        """Samples of all ranks per second from the end of the warm-up steps to the end of the
        last step (None: the run had no more than WARM_UP_STEPS steps)."""
        if self.warmed is None or self.last_step is None or self.last_step[0] <= self.warmed[0]:
            return None
        return (self.last_step[1] - self.warmed[1]) / (self.last_step[0] - self.warmed[0])

    def step_figures(self) -> dict[str, Any]:
        """This rank's average step of this run: ms per phase, and on several ranks what its
        exchange sent and received and the dense all_reduce's payload (host-side counts)."""
        steps = self.state["step"] - self.steps_at_start
        out: dict[str, Any] = {"rank": self.ranks.rank, "steps": steps, "samples": self.state["samples"] - self.rank_samples_at_start,
                               "sync_timings": self.opts.sync_timings,
                               "ms_per_step": {p: 1000 * t / max(1, steps) for p, t in self.times.items()},
                               "gc": self.gc_pauses.as_json()}
        if self.exchange is not None:
            out["exchange"] = self.exchange.stats.per_step()
        if self.dense_gradients is not None:
            out["all_reduce_bytes"] = self.dense_gradients.bytes
        return out

    def status(self, source: SampleReader | None = None) -> dict[str, Any]:
        """This rank's view (on several ranks: the metrics of its own samples)."""
        out = {
            "samples": self.state["global_samples"],
            "step": self.state["step"],
            "loss": self.state.get("loss"),
            "trained_through_ms": self.state["trained_through_ms"],
            "version": self.publisher.last_version,
            "rejected": dict(self.rejected),
            "lag": source.lag() if source is not None else None,
            "announcements_lost": self.announcer.failed if self.announcer is not None else 0,
            **self.evaluation.metrics.summary(),
        }
        out["tiers"] = {name: tier_usage(table) for name, table in self.embeddings.tables.items()}
        if self.by_rank is not None:
            out["step_by_rank"] = self.by_rank
        self.prom.observe(out, {name: len(table) for name, table in self.embeddings.tables.items()})
        return out

    def close(self) -> None:
        """Finish the publisher's background work and close what the loop opened."""
        self.publisher.close()
        if self.reporter is not None:
            self.reporter.close()
        self.evaluation.close()
        if self.announcer is not None:
            self.announcer.close()


def _announcer(cfg: Config, opts: TrainOptions) -> TopicAnnouncer | None:
    """The model-updates announcer: on when reading the topic, off from sample files (which
    need no Kafka at all) unless ``--announce``; serving nodes find every version by polling
    LATEST either way, an announcement only saves them the wait."""
    if opts.announce is False:
        return None
    if opts.announce is None and opts.files:
        log.info("training from files: versions are not announced on %s (serving nodes find them by polling the store's "
                 "LATEST); --announce announces them", cfg.topics.model_updates)
        return None
    return TopicAnnouncer(cfg.kafka.bootstrap_servers, cfg.topics.model_updates, cfg.model.name, cfg.kafka.connect_timeout_s)
