"""The training session: what a trainer process holds from start to exit, apart from the step.

The session takes the model's trainer lock (one trainer per model and rank), joins the
ranks, plans each table's placement on them (sharded by key or replicated on every rank),
takes the model store's writer lease (rank 0 commits every version), restores the
newest checkpoint every rank holds or starts fresh, saves checkpoints, turns SIGINT and
SIGTERM into a stop request, and releases all of it when the run ends, failed or not. The
step itself is the loop's (trainer/loop.py).
"""

from __future__ import annotations

import contextlib
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
from typing import IO, Any, Iterator

import torch

from streamrec.embedding.collection import EmbeddingCollection
from streamrec.embedding.sharded import REPLICATED, SHARDED, plan_placement
from streamrec.model.device import pick_device
from streamrec.model.network import CTRModel, ModelSpec, table_configs
from streamrec.modelstore.lease import LeaseHeld, WriterLease
from streamrec.modelstore.store import ModelStore
from streamrec.modelstore.writer import VersionWriter
from streamrec.plumbing.config import Config
from streamrec.trainer.checkpoint import Checkpointer
from streamrec.trainer.distributed import gather_to_all, join, rank_device
from streamrec.trainer.publisher import ChainPosition
from streamrec.trainer.sources import sample_files

log = logging.getLogger("streamrec.trainer")
DENSE_INIT_SEED = 0  # training is a function of the data alone: a run and its resumed twin end equal


@dataclass
class TrainOptions:
    """What one `streamrec train` run does (the rest comes from Config)."""

    files: list[str] = field(default_factory=list)  # sample files/dirs; empty = the samples topic
    truth: str | None = None  # generator run dir / truth file, "topic", or None
    max_samples: int = 0  # stop once this many are trained, in whole batches (0 = no limit)
    max_seconds: float = 0.0
    idle_exit_s: float = 0.0  # stop after this long without samples (0 = wait forever)
    fresh: bool = False  # ignore existing checkpoints (moved aside, never deleted)
    announce: bool | None = None  # announce versions on the topic; None = when reading the topic, not files
    loop_files: bool = False  # benchmarks: read the files again and again
    sync_timings: bool = False  # synchronize the device between phases (exact phase times; slower)
    progress: bool = True


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what state is safe."""


def fuse_adam_on(optimizer: torch.optim.Adam, device: torch.device) -> None:
    """A restored Adam's settings come from the checkpoint: make it fused on CUDA (and not on
    CPU) whatever run wrote it, with the step counters where that implementation wants them."""
    fused = device.type == "cuda"
    for group in optimizer.param_groups:
        group["fused"] = fused
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and "step" in state:
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(param.device if fused else "cpu")


class TrainingSession:
    """Locks, lease, ranks, checkpoints and signals of one training run, and the state they
    protect: the dense model and its optimizer, the embedding collection, and ``state``
    (the counters and positions a checkpoint's state.json holds)."""

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
        if self.ranks.rank:  # rank 0 reports versions for all
            logging.getLogger("streamrec.trainer.publisher").setLevel(logging.WARNING)
        self._lock_fh = self._take_lock()
        self.lease: WriterLease | None = None
        try:
            self._set_up()
        except BaseException:
            if hasattr(self, "embeddings"):  # set up as far as the collection: its SSD tier and scratch files too
                self.embeddings.close()
            if hasattr(self, "tiers_dir"):
                shutil.rmtree(self.tiers_dir, ignore_errors=True)
            self._release()
            raise

    def _take_lock(self) -> IO[str]:
        """This rank's trainer lock for the model (held until close): one trainer per model and rank."""
        rank = self.ranks.rank
        lock = self.home / ("trainer.lock" if rank == 0 else f"trainer.rank-{rank}.lock")
        lock_fh = open(lock, "w")
        try:
            fcntl.flock(lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_fh.close()
            self.ranks.close()
            raise TrainingError(f"another trainer is running for model {self.cfg.model.name!r} (lock {lock})") from None
        return lock_fh

    def _set_up(self) -> None:
        ranks, opts = self.ranks, self.opts
        for stale in self.home.glob(f"tiers-r{ranks.rank}-*"):  # this rank's SSD tiers of earlier runs: rebuilt from checkpoints
            shutil.rmtree(stale, ignore_errors=True)
        self.tiers_dir = self.home / f"tiers-r{ranks.rank}-{int(time.time())}"
        checkpoints = self.home / "checkpoints"
        self.checkpointer = Checkpointer(checkpoints if ranks.world == 1 else
                                         checkpoints / f"rank-{ranks.rank:05d}-of-{ranks.world:05d}")
        self.model_store = ModelStore(self.cfg.trainer.model_store, self.cfg.model.name)
        if ranks.rank == 0:  # rank 0 commits every version: it holds the store's writer lease
            self._take_lease()
        self.writer = VersionWriter(self.model_store, self.lease)
        self.source_name = f"files:{','.join(str(Path(f).resolve()) for f in opts.files)}" if opts.files else f"kafka:{self.cfg.topics.samples}"
        self.stop_requested = threading.Event()
        self.rejected: Counter = Counter()  # samples refused by the checks, by reason (kept across resumes)
        self._restore_or_init()

    def _take_lease(self) -> None:
        try:
            self.lease = WriterLease(self.model_store, str(self.home), self.cfg.trainer.lease_s).acquire()
        except LeaseHeld as exc:
            raise TrainingError(str(exc)) from None
        except OSError as exc:
            raise TrainingError(f"cannot take the writer lease in the model store {self.model_store.base}: {exc}") from None

    # ------------------------------------------------------------------ restore
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
        self.placement = self._plan_placement()
        with torch.random.fork_rng(devices=[]):  # the same initial dense weights on every run (and rank)
            torch.manual_seed(DENSE_INIT_SEED)
            self.model = CTRModel(self.spec).to(self.device)
        # fused on CUDA: one kernel over every parameter instead of a dozen launches per step
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.cfg.model.dense_lr, fused=self.device.type == "cuda")
        if latest is None:
            self.embeddings = EmbeddingCollection(table_configs(self.cfg.model, self.cfg.ps), self.device, self.tiers_dir, seed=1000 * ranks.rank)
            self.state: dict[str, Any] = {"step": 0, "samples": 0, "global_samples": 0, "positions": {}, "trained_through_ms": 0,
                                          "source": self.source_name}
            return
        self.embeddings, dense, self.state = self.checkpointer.load(latest, self.device, self.tiers_dir)
        self._check_resumable(latest)
        self._check_placement(latest)
        self.state.setdefault("global_samples", self.state["samples"])
        self.model.load_state_dict(dense["model"])
        self.optimizer.load_state_dict(dense["optimizer"])
        fuse_adam_on(self.optimizer, self.device)
        self.rejected.update(self.state.get("rejected", {}))
        log.info("resumed from %s: step %d, %d samples, positions %s", latest.name, self.state["step"], self.state["samples"],
                 self.state["positions"])

    def _plan_placement(self) -> dict[str, str]:
        """Each table's placement on these ranks (sharded by key, or replicated on every rank:
        ``sharded.plan_placement``), from the estimated rows, ``[ps] hbm_bytes`` and the
        overrides of ``[trainer]``. All sharded on one rank."""
        tcfg = self.cfg.trainer
        try:
            return plan_placement(table_configs(self.cfg.model, self.cfg.ps), self.ranks.world, tcfg.estimated_rows,
                                  tcfg.replicate_below_rows, tcfg.placement_overrides, self.device.type == "cuda")
        except ValueError as exc:
            raise TrainingError(str(exc)) from None

    @property
    def replicated(self) -> list[str]:
        """The tables every rank holds whole."""
        return [name for name, where in self.placement.items() if where == REPLICATED]

    def _check_placement(self, latest: Path) -> None:
        """A checkpoint holds each rank's rows as its placement left them: resuming needs the same placement."""
        written = self.state.get("placement") or dict.fromkeys(self.placement, SHARDED)
        if written != self.placement:
            raise TrainingError(f"checkpoint {latest} was trained with table placement {written}, this run's is "
                                f"{self.placement} (trainer.replicate_below_rows, table_rows, placement): resume with that "
                                "placement, or start over with --fresh")

    def _check_resumable(self, latest: Path) -> None:
        """The checkpoint was trained from this run's source, with this run's model spec."""
        if self.state.get("source") != self.source_name:
            raise TrainingError(f"checkpoint {latest} was trained from {self.state.get('source')}, not {self.source_name}; "
                                "use --fresh to start over (old checkpoints are kept aside)")
        if ModelSpec.from_json(self.state["model_spec"]) != self.spec:
            raise TrainingError(f"checkpoint {latest} has model spec {self.state['model_spec']}, the config says {self.spec.to_json()}; "
                                "use --fresh to start over")

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

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, positions: dict[int, int], chain: ChainPosition) -> Path:
        """Save this rank's checkpoint of the current step (call only between steps, with no
        publish in flight), then wait until every rank holds the same step."""
        self.state.update({
            "positions": {str(p): o for p, o in sorted(positions.items())},
            **asdict(chain),
            "model_spec": self.spec.to_json(),
            "rejected": dict(self.rejected),
            "source": self.source_name,
            "world_size": self.ranks.world,
            "placement": self.placement,
        })
        path = self.checkpointer.save(self.state["step"], self.embeddings,
                                      {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, self.state)
        gather_to_all(self.ranks, self.state["step"])  # every rank holds this step before any commits offsets
        return path

    # ------------------------------------------------------------------ signals
    def request_stop(self, *_: Any) -> None:
        self.stop_requested.set()

    @contextlib.contextmanager
    def stop_on_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM request a clean stop while inside (main thread only; elsewhere
        the handlers cannot be installed and the caller stops the run itself)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self.request_stop)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Release the collection, its scratch tiers, the lease, the lock and the ranks (those
        last three whatever closing the collection does)."""
        try:
            self.embeddings.close()
            shutil.rmtree(self.tiers_dir, ignore_errors=True)
        finally:
            self._release()

    def close_after_failure(self) -> None:
        """``close`` on the way out of a failed run: the failure is what the caller needs to
        see, so a second one while closing is logged, not raised over it."""
        try:
            self.close()
        except Exception:
            log.exception("closing the training session after a failure also failed")

    def _release(self) -> None:
        if self.lease is not None:
            self.lease.release()
        self._lock_fh.close()
        self.ranks.close()
