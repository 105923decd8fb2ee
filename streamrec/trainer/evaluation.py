"""Evaluation while learning: progressive validation over sliding windows.

Every batch is scored *before* the model trains on it (the training forward pass does
exactly that), so each score is an honest out-of-sample prediction. Three scorers run on
the same impressions: the online model, a frozen copy of it taken after warm-up, and,
when the generator's ground truth is available, the Bayes-optimal probability. The gap
online-vs-frozen is the value of online learning; online-vs-Bayes is what is left to win.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from streamrec.model.batch import SampleBatch
from streamrec.model.inference import InferenceModel
from streamrec.model.metrics import auc, logloss
from streamrec.modelstore.store import ModelStore

log = logging.getLogger(__name__)
SCORERS = ("online", "frozen", "bayes")


class WindowMetrics:
    """The last ``window`` (label, score per scorer) rows; NaN scores mean "not scored"."""

    def __init__(self, window: int) -> None:
        self.window = max(1, window)
        self.labels = np.zeros(self.window, np.float32)
        self.scores = {s: np.full(self.window, np.nan, np.float64) for s in SCORERS}
        self.n = 0  # rows ever added

    def add(self, labels: np.ndarray, **scores: np.ndarray | None) -> None:
        k = len(labels)
        if k == 0:
            return
        if k > self.window:
            labels = labels[-self.window:]
            scores = {s: (v[-self.window:] if v is not None else None) for s, v in scores.items()}
            k = self.window
        idx = (self.n + np.arange(k)) % self.window
        self.labels[idx] = labels
        for s in SCORERS:
            v = scores.get(s)
            self.scores[s][idx] = np.nan if v is None else v
        self.n += k

    def rows(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The window's filled rows: (labels, scores per scorer)."""
        filled = min(self.n, self.window)
        return self.labels[:filled].copy(), {s: v[:filled].copy() for s, v in self.scores.items()}

    @classmethod
    def merged(cls, parts: list[tuple[np.ndarray, dict[str, np.ndarray]]]) -> "WindowMetrics":
        """One window holding the ``rows()`` of several (the ranks' windows of one step range)."""
        out = cls(sum(len(labels) for labels, _ in parts))
        for labels, scores in parts:
            out.add(labels, **scores)
        return out

    def summary(self) -> dict[str, float]:
        """AUC and logloss per scorer over the rows that scorer scored."""
        filled = min(self.n, self.window)
        out: dict[str, float] = {"window_rows": filled}
        for s in SCORERS:
            v = self.scores[s][:filled]
            ok = ~np.isnan(v)
            if ok.sum() >= 100:
                out[f"auc_{s}"] = auc(v[ok], self.labels[:filled][ok])
                out[f"logloss_{s}"] = logloss(v[ok], self.labels[:filled][ok])
        return out


class TruthLookup:
    """Bayes-optimal click probabilities by impression event_id, from a generator run's
    truth file or, live, from the truth topic (a background consumer; bounded memory)."""

    def __init__(self, capacity: int = 4_000_000) -> None:
        self.capacity = capacity
        self._p: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._consumer = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @classmethod
    def from_file(cls, path: str | Path) -> "TruthLookup":
        path = Path(path)
        if path.is_dir():
            path = path / "truth.parquet"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no truth file (generator runs written with --format parquet have truth.parquet)")
        table = pq.read_table(path, columns=["event_id", "p"])
        out = cls(capacity=max(table.num_rows, 1))
        out._p.update(zip(table["event_id"].to_pylist(), table["p"].to_numpy().tolist()))
        return out

    @classmethod
    def from_topic(cls, bootstrap: str, topic: str, timeout_s: float = 20.0) -> "TruthLookup":
        from streamrec.plumbing.bus.clients import make_consumer

        out = cls()
        out._consumer = make_consumer(bootstrap, topic, group_id=None, timeout_s=timeout_s, auto_offset_reset="earliest")
        out._thread = threading.Thread(target=out._follow, name="truth-follower", daemon=True)
        out._thread.start()
        return out

    def _follow(self) -> None:
        import orjson

        while not self._stop.is_set():
            try:
                polled = self._consumer.poll(200)
            except Exception as exc:  # the truth is optional: report and keep training
                log.warning("truth topic: %s", exc)
                self._stop.wait(1.0)
                continue
            for records in polled.values():
                for record in records:
                    try:  # columnar chunks: see pipelines.generator.sinks.truth_chunks
                        message = orjson.loads(record.value)
                        if message.get("kind") != "impressions":
                            continue
                        pairs = list(zip(message["event_id"], message["p"]))
                    except (ValueError, KeyError, TypeError, AttributeError):
                        continue
                    with self._lock:
                        self._p.update(pairs)
                        while len(self._p) > self.capacity:
                            self._p.popitem(last=False)

    def get(self, event_ids: list[str]) -> np.ndarray:
        with self._lock:
            return np.array([self._p.get(e, np.nan) for e in event_ids], dtype=np.float64)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._consumer is not None:
            self._consumer.close()


def open_truth(truth: str | None, bootstrap: str, topic: str, timeout_s: float) -> TruthLookup | None:
    """The Bayes scorer's source: ``truth`` is a generator run (or its truth file), "topic"
    (the truth topic on ``bootstrap``), or None for none."""
    if not truth:
        return None
    if truth == "topic":
        return TruthLookup.from_topic(bootstrap, topic, timeout_s)
    return TruthLookup.from_file(truth)


@dataclass(slots=True)
class PendingStep:
    """A training step's outputs still on the device, scored once brought to the host."""

    step: int
    loss: torch.Tensor  # the step's mean loss (0-d)
    scores: torch.Tensor  # [n] the online model's click probabilities
    labels: torch.Tensor  # [n]
    event_ids: pa.Array  # [n] the impressions' ids (for the Bayes scorer)
    frozen: np.ndarray | None  # [n] the frozen baseline's probabilities; None without a baseline


class OnlineEvaluation:
    """Progressive validation of a training run over one window: the online model's scores,
    the frozen baseline's (a full version of the same run, loaded after warm-up) and, with
    ``truth``, the Bayes-optimal probabilities."""

    def __init__(self, window: int, truth: TruthLookup | None, model_store: ModelStore, device: torch.device,
                 cache_rows: int) -> None:
        self.metrics = WindowMetrics(window)
        self.truth = truth
        self.frozen: InferenceModel | None = None
        self._model_store, self._device, self._cache_rows = model_store, device, cache_rows  # where a baseline loads

    def load_frozen(self, version: int) -> bool:
        """Make ``version`` the frozen baseline; False (and no baseline) if it cannot be loaded."""
        try:
            self.frozen = InferenceModel.load(self._model_store, version, self._device, self._cache_rows)
        except Exception as exc:
            log.warning("frozen baseline version %d cannot be loaded (%s); comparing without it", version, exc)
            self.frozen = None
            return False
        log.info("frozen baseline: version %d", version)
        return True

    def frozen_scores(self, batch: SampleBatch, now_ms: int) -> np.ndarray | None:
        return self.frozen.predict(batch, now_ms) if self.frozen is not None else None

    def add(self, pending: list[PendingStep]) -> None:
        """Score the steps' impressions (one host transfer for all of them)."""
        online = torch.cat([p.scores for p in pending]).float().cpu().numpy()
        labels = torch.cat([p.labels for p in pending]).cpu().numpy()
        frozen = np.concatenate([p.frozen for p in pending]) if all(p.frozen is not None for p in pending) else None
        if self.truth is not None:
            bayes = self.truth.get([e for p in pending for e in p.event_ids.to_pylist()])
            known = ~np.isnan(bayes)  # compare all scorers on the same impressions
            self.metrics.add(labels[known], online=online[known], frozen=None if frozen is None else frozen[known], bayes=bayes[known])
        else:
            self.metrics.add(labels, online=online, frozen=frozen)

    def close(self) -> None:
        if self.truth is not None:
            self.truth.close()
        if self.frozen is not None:
            self.frozen.close()
