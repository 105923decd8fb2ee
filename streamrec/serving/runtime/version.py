"""One loaded version as serving runs it: the model package's :class:`InferenceModel`
wrapped by this package's :class:`ModelRunner` (shape buckets and worker streams)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from streamrec.model.batch import SampleBatch
from streamrec.model.inference import InferenceModel
from streamrec.model.network import CTRModel
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.modelstore.store import ModelStore
from streamrec.embedding.collection import EmbeddingCollection
from streamrec.serving.runtime.runner import ModelRunner, RuntimeConfig

DenseOnDevice = Callable[[], torch.Tensor]  # a batch's dense features, computed on the device the model runs on


@dataclass
class ServedVersion:
    inference: InferenceModel  # its version and manifest change in place when a delta is applied or undone
    runner: ModelRunner | None  # None: the model runs eagerly, as the trainer runs it

    @classmethod
    def load(cls, model_store: ModelStore, version: int | None, device: torch.device, gpu_cache_rows: int,
             runtime: RuntimeConfig | None) -> "ServedVersion":
        """Load and verify ``version``; with ``runtime`` its buckets are built now, before it serves."""
        inference = InferenceModel.load(model_store, version, device, gpu_cache_rows)
        return cls(inference, ModelRunner(inference.model, runtime, device) if runtime is not None else None)

    @property
    def version(self) -> int:
        return self.inference.version

    @property
    def manifest(self) -> dict:
        return self.inference.manifest

    @property
    def feature_spec(self) -> FeatureSpec:
        return self.inference.feature_spec

    @property
    def embeddings(self) -> EmbeddingCollection:
        return self.inference.embeddings

    @property
    def network(self) -> CTRModel:
        return self.inference.model

    @torch.no_grad()
    def predict(self, batch: SampleBatch, now_ms: int | None = None, dense: DenseOnDevice | None = None) -> np.ndarray:
        """Scores of one batch; ``dense()``: its dense features, when the batch came without
        them, called on the stream the model runs on."""
        now_ms = now_ms if now_ms is not None else batch.max_ts()
        if self.runner is None:
            if dense is not None:
                batch.dense = dense()
            return self.inference.predict(batch, now_ms)
        with self.runner.worker() as w:  # lookups and forward on the worker's stream
            if dense is not None:
                batch.dense = dense()
            batch = batch.with_history_len(self.runner.history_bucket(batch.longest_history()))
            inputs = self.inference.lookup(batch, now_ms, concurrent=True)
            return self.runner.run(w, inputs).float().cpu().numpy()

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        self.inference.close()
