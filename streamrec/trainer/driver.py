"""The trainer driver: a session (trainer/session.py: locks, lease, ranks, checkpoints, signals)
and its loop (trainer/loop.py: the step, publishing, evaluation, progress), run together.

``train(cfg, opts)`` is what ``streamrec train`` calls. A run that cannot go on (a poisoned
model, publishes that keep failing, a file in the work dir it cannot write: a full disk)
ends with a :class:`TrainingError` that says why and which state is safe (the last good
version, the last checkpoint); whatever way it ends, the session is released.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

from streamrec.embedding.sharded import REPLICATED
from streamrec.plumbing.config import Config
from streamrec.trainer.distributed import RankFailure, gather_to_all
from streamrec.trainer.evaluation import WindowMetrics
from streamrec.trainer.local_files import WriteFailed
from streamrec.trainer.loop import TrainingLoop
from streamrec.trainer.publisher import PoisonedModel, PublishFailed
from streamrec.trainer.session import TrainingError, TrainingSession, TrainOptions

log = logging.getLogger("streamrec.trainer")
__all__ = ["Trainer", "TrainOptions", "TrainingError", "train"]


class Trainer:
    """One training run: the session, and the loop on it."""

    def __init__(self, cfg: Config, opts: TrainOptions) -> None:
        self.session = TrainingSession(cfg, opts)
        try:
            self.loop = TrainingLoop(self.session)
        except WriteFailed as exc:
            self.session.close_after_failure()
            raise TrainingError(f"{exc}. Training did not start; fix the disk (free space) and run again.") from None
        except BaseException:
            self.session.close_after_failure()
            raise

    def run(self) -> dict[str, Any]:
        """Train until a stop; returns the run's summary, or raises TrainingError."""
        failure: RuntimeError | None = None
        try:
            self.loop.run()
        except (PoisonedModel, PublishFailed, WriteFailed) as exc:
            failure = exc
        except RuntimeError as exc:
            if not self.session.ranks.distributed or isinstance(exc, TrainingError):
                self._close_after_failure()
                raise
            failure = exc  # a collective failed: another rank died or hangs
        except BaseException:  # bad input, a bug, an interrupt: release what the trainer holds
            self._close_after_failure()
            raise
        if failure is not None:
            reason = self._why_stopped(failure)
            self._close_after_failure()
            raise TrainingError(reason)
        self.loop.publisher.close()  # a compaction in progress finishes, so the summary lists it
        summary = self.summary()
        self.close()
        return summary

    def _why_stopped(self, failure: RuntimeError) -> str:
        """A failed run in words: what went wrong, and which version and checkpoint are safe."""
        latest = self.session.checkpointer.latest()
        last_version = self.loop.publisher.last_version or "none"
        if isinstance(failure, PoisonedModel):
            return (f"{failure}. Nothing was published or checkpointed after it: the last good version is "
                    f"{last_version}, the last checkpoint is {latest or 'none'}. Lower the learning rates "
                    f"or check the inputs, then run again" + (f": it resumes from {latest.name}." if latest else "."))
        if isinstance(failure, PublishFailed):
            return (f"{failure}. Training stopped: a trainer that cannot publish serves nobody. The last "
                    f"published version is {last_version}, the last checkpoint "
                    f"{latest.name if latest else 'none'}; fix the model store {self.session.model_store.base} "
                    "and run again to resume.")
        if isinstance(failure, WriteFailed):
            return (f"{failure}. Training stopped: the last published version is {last_version}, the last checkpoint "
                    f"{latest.name if latest else 'none'}; fix the disk (free space) and run again: it "
                    + (f"resumes from {latest.name}." if latest else "starts over (no checkpoint yet)."))
        reason = str(failure) if isinstance(failure, RankFailure) else f"rank {self.session.ranks.rank}: a collective failed ({failure})"
        return (f"{reason}. Training stopped on this rank; nothing after the last checkpoint "
                f"({latest.name if latest else 'none'}) is kept, and a restart resumes from it.")

    def summary(self) -> dict[str, Any]:
        """The run's status, throughput, phase times and versions (on several ranks, with
        every rank's share and the metrics over all ranks' windows)."""
        loop, state, ranks = self.loop, self.session.state, self.session.ranks
        elapsed_s, trained = time.monotonic() - loop.started, state["global_samples"] - loop.samples_at_start
        steps = max(1, state["step"])
        out = loop.status()
        out.update({
            "elapsed_s": elapsed_s,
            "samples_this_run": trained,
            "samples_per_s": trained / max(elapsed_s, 1e-9),
            "steady_samples_per_s": loop.steady_samples_per_s(),
            "device": str(self.session.device),
            "ms_per_step": {p: 1000 * t / steps for p, t in loop.times.items()},
            "published": [asdict(r) for r in loop.publisher.records],
            "compactions": loop.publisher.compactions,
            "publish_stall_ms_per_million_rows": loop.publisher.stall_ms_per_million_rows(),
            "frozen_version": state.get("frozen_version"),
            "table_rows": {name: len(t) for name, t in self.session.embeddings.tables.items()},
            "gc": loop.gc_pauses.as_json(),
        })
        if ranks.distributed:
            shares = gather_to_all(ranks, {"samples": state["samples"], "table_rows": out["table_rows"],
                                           "window": loop.evaluation.metrics.rows()})
            out.update(WindowMetrics.merged([share.pop("window") for share in shares]).summary())
            out["ranks"] = shares
            out["world_size"] = ranks.world
            placement = self.session.placement  # a replicated table's rows are the same on every rank: counted once
            out["table_rows"] = {name: shares[0]["table_rows"][name] if placement.get(name) == REPLICATED
                                 else sum(share["table_rows"][name] for share in shares) for name in out["table_rows"]}
        return out

    def close(self) -> None:
        """Close the loop's resources, then release the session's (whatever the loop's close does)."""
        try:
            self.loop.close()
        finally:
            self.session.close()

    def _close_after_failure(self) -> None:
        """``close`` on the way out of a failed run: the failure is what the caller needs to
        see, so a second one while closing is logged, not raised over it."""
        try:
            self.loop.close()
        except Exception:
            log.exception("closing the training loop after a failure also failed")
        self.session.close_after_failure()


def train(cfg: Config, opts: TrainOptions) -> dict[str, Any]:
    """Run a trainer until it stops; SIGINT/SIGTERM stop it cleanly (publish, checkpoint)."""
    trainer = Trainer(cfg, opts)
    with trainer.session.stop_on_signals():
        return trainer.run()
