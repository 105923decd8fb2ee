"""A published version as a runnable model: dense module + inference ps/ store.

Used by the trainer's frozen baseline and by serving; both must score exactly what the
trainer would (same features, same lookups; ids without a row read as zeros). Serving
passes a ``RuntimeConfig``: the dense model then runs through a ``serving.runner.ModelRunner``
(shape buckets compiled at load, one stream per worker); without one it runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipelines.samples import SampleSpec
from ps.locks import RWLock
from ps.model_store import ModelStore
from ps.store import EmbeddingStore
from ps.table import TableConfig
from trainer.features import SampleBatch
from trainer.model import CTRModel, ModelSpec
from trainer.sparse import SparseFeatures

if TYPE_CHECKING:
    from serving.runner import ModelRunner, RuntimeConfig


@dataclass
class InferenceModel:
    version: int
    manifest: dict
    model: CTRModel
    store: EmbeddingStore
    sample_spec: SampleSpec
    runner: "ModelRunner | None" = None
    lookup_guard: RWLock = field(default_factory=RWLock)  # concurrent lookups vs. GPU-cache changes

    @classmethod
    def load(cls, model_store: ModelStore, version: int | None = None, device: torch.device | str = "cpu",
             gpu_cache_rows: int = 1_000_000, runtime: "RuntimeConfig | None" = None) -> "InferenceModel":
        loaded = model_store.load(version)
        manifest = loaded.manifest
        for key in ("model_spec", "sample_spec"):
            if key not in manifest:
                raise ValueError(f"version {loaded.version} of {model_store.model} lacks '{key}': not written by streamrec train")
        spec = ModelSpec.from_json(manifest["model_spec"])
        device = torch.device(device)
        configs = [TableConfig(name, info["dim"], gpu_cache_rows=gpu_cache_rows if device.type == "cuda" else 0)
                   for name, info in manifest["tables"].items()]
        store = EmbeddingStore(configs, device)
        for name, (keys, values) in loaded.tables.items():
            if len(keys):
                store[name].load_rows(torch.from_numpy(keys), torch.from_numpy(values))
                store[name].warm(torch.from_numpy(keys))  # into the GPU cache as far as it fits
        model = CTRModel(spec).to(device)
        model.load_state_dict({k: v.to(device) for k, v in loaded.dense.items()})
        model.eval()
        sample_spec = SampleSpec.from_json(manifest["sample_spec"])
        runner = None
        if runtime is not None:
            from serving.runner import ModelRunner  # serving depends on trainer, not the other way round

            runner = ModelRunner(model, runtime, device)  # builds every bucket now, before serving
        return cls(loaded.version, manifest, model, store, sample_spec, runner)

    @torch.no_grad()
    def predict(self, batch: SampleBatch, now_ms: int | None = None) -> np.ndarray:
        now_ms = now_ms if now_ms is not None else batch.max_ts()
        if self.runner is None:
            inputs = SparseFeatures(self.store).lookup(batch, now_ms)
            return torch.sigmoid(self.model(*inputs.as_args())).float().cpu().numpy()
        with self.runner.worker() as w:  # lookups and forward on the worker's stream
            batch = batch.with_history_len(self.runner.history_bucket(batch.longest_history()))
            inputs = SparseFeatures(self.store).lookup(batch, now_ms, self.lookup_guard)
            return self.runner.run(w, inputs).float().cpu().numpy()

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        self.store.close()
