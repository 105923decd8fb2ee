"""One loaded version as serving runs it: the model package's :class:`InferenceModel`
wrapped by this package's :class:`ModelRunner` (shape buckets and worker streams)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model.batch import SampleBatch
from model.inference import InferenceModel
from model.network import CTRModel
from pipelines.feature_spec import FeatureSpec
from ps.model_store import ModelStore
from ps.store import EmbeddingStore
from serving.runner import ModelRunner, RuntimeConfig


@dataclass
class ServedVersion:
    model: InferenceModel
    runner: ModelRunner | None  # None: the model runs eagerly, as the trainer runs it

    @classmethod
    def load(cls, model_store: ModelStore, version: int | None, device: torch.device, gpu_cache_rows: int,
             runtime: RuntimeConfig | None) -> "ServedVersion":
        """Load and verify ``version``; with ``runtime`` its buckets are built now, before it serves."""
        model = InferenceModel.load(model_store, version, device, gpu_cache_rows)
        return cls(model, ModelRunner(model.model, runtime, device) if runtime is not None else None)

    # what the version is (changed in place when a delta is applied or undone)
    @property
    def version(self) -> int:
        return self.model.version

    @version.setter
    def version(self, value: int) -> None:
        self.model.version = value

    @property
    def manifest(self) -> dict:
        return self.model.manifest

    @manifest.setter
    def manifest(self, value: dict) -> None:
        self.model.manifest = value

    @property
    def feature_spec(self) -> FeatureSpec:
        return self.model.feature_spec

    @property
    def store(self) -> EmbeddingStore:
        return self.model.store

    @property
    def network(self) -> CTRModel:
        return self.model.model

    @torch.no_grad()
    def predict(self, batch: SampleBatch, now_ms: int | None = None) -> np.ndarray:
        now_ms = now_ms if now_ms is not None else batch.max_ts()
        if self.runner is None:
            return self.model.predict(batch, now_ms)
        with self.runner.worker() as w:  # lookups and forward on the worker's stream
            batch = batch.with_history_len(self.runner.history_bucket(batch.longest_history()))
            inputs = self.model.lookup(batch, now_ms, concurrent=True)
            return self.runner.run(w, inputs).float().cpu().numpy()

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        self.model.close()
