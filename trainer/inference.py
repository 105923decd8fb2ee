"""A published version as a runnable model: dense module + inference ps/ store.

Used by the trainer's frozen baseline and by serving; both must score exactly what the
trainer would (same features, same lookups; ids without a row read as zeros).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipelines.samples import SampleSpec
from ps.model_store import ModelStore
from ps.store import EmbeddingStore
from ps.table import TableConfig
from trainer.features import SampleBatch
from trainer.model import CTRModel, ModelSpec
from trainer.sparse import SparseFeatures


@dataclass
class InferenceModel:
    version: int
    manifest: dict
    model: CTRModel
    store: EmbeddingStore
    sample_spec: SampleSpec

    @classmethod
    def load(cls, model_store: ModelStore, version: int | None = None, device: torch.device | str = "cpu",
             gpu_cache_rows: int = 1_000_000) -> "InferenceModel":
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
        model = CTRModel(spec).to(device)
        model.load_state_dict({k: v.to(device) for k, v in loaded.dense.items()})
        model.eval()
        sample_spec = SampleSpec.from_json(manifest["sample_spec"])
        return cls(loaded.version, manifest, model, store, sample_spec)

    @torch.no_grad()
    def predict(self, batch: SampleBatch, now_ms: int | None = None) -> np.ndarray:
        inputs = SparseFeatures(self.store).lookup(batch, now_ms if now_ms is not None else batch.max_ts())
        return torch.sigmoid(self.model(*inputs.as_args())).float().cpu().numpy()

    def close(self) -> None:
        self.store.close()
