"""A published version as a runnable model: dense module + its embedding tables.

Used by the trainer's frozen baseline and by serving; both must score exactly what the
trainer would (same features, same lookups; ids without a row read as zeros).
:meth:`InferenceModel.predict` runs eagerly; serving wraps the model in its own runner
(shape buckets, worker streams: serving/runtime/runner.py) and calls :meth:`InferenceModel.lookup`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from streamrec.model.batch import SampleBatch
from streamrec.model.network import CTRModel, ModelSpec
from streamrec.model.sparse import ModelInputs, SparseFeatures
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.plumbing.locks import RWLock
from streamrec.modelstore.store import CorruptVersion, ModelStore
from streamrec.embedding.collection import EmbeddingCollection
from streamrec.embedding.table import TableConfig


def manifest_spec(manifest: dict, key: str, where: str) -> ModelSpec | FeatureSpec:
    """The ``model_spec`` or ``feature_spec`` a version's manifest records; CorruptVersion when
    it is missing or unreadable (``where`` names the version in the message)."""
    if key not in manifest:
        raise CorruptVersion(f"{where} lacks '{key}': not written by streamrec train")
    try:
        return (ModelSpec if key == "model_spec" else FeatureSpec).from_json(manifest[key])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptVersion(f"{where} has an unreadable '{key}': {exc!r}") from None


@dataclass
class InferenceModel:
    version: int
    manifest: dict
    model: CTRModel
    embeddings: EmbeddingCollection  # the version's tables, read with ``find``
    feature_spec: FeatureSpec
    lookup_guard: RWLock = field(default_factory=RWLock)  # concurrent lookups vs. GPU-cache changes

    @classmethod
    def load(cls, model_store: ModelStore, version: int | None = None, device: torch.device | str = "cpu",
             gpu_cache_rows: int = 1_000_000) -> "InferenceModel":
        """``gpu_cache_rows``: rows per table kept in the GPU cache (CUDA only; 0 = none)."""
        loaded = model_store.load(version)
        manifest = loaded.manifest
        where = f"version {loaded.version} of {model_store.model}"
        spec, feature_spec = manifest_spec(manifest, "model_spec", where), manifest_spec(manifest, "feature_spec", where)
        device = torch.device(device)
        configs = [TableConfig(name, info["dim"], gpu_cache_rows=gpu_cache_rows if device.type == "cuda" else 0)
                   for name, info in manifest["tables"].items()]
        embeddings = EmbeddingCollection(configs, device)
        for name, (keys, values) in loaded.tables.items():
            # into DRAM, and up into the GPU cache as far as it fits
            embeddings[name].upsert(torch.from_numpy(keys), torch.from_numpy(values), fresh=True)
        model = CTRModel(spec).to(device)
        model.load_state_dict({k: v.to(device) for k, v in loaded.dense.items()})
        model.eval()
        return cls(loaded.version, manifest, model, embeddings, feature_spec)

    def lookup(self, batch: SampleBatch, now_ms: int, concurrent: bool = False) -> ModelInputs:
        """The model's inputs for ``batch`` (``concurrent``: other threads look up at the same time)."""
        return SparseFeatures(self.embeddings).lookup(batch, now_ms, self.lookup_guard if concurrent else None)

    @torch.no_grad()
    def predict(self, batch: SampleBatch, now_ms: int | None = None) -> np.ndarray:
        """Eager scores of one batch (the trainer's frozen baseline, the demo's probe)."""
        inputs = self.lookup(batch, now_ms if now_ms is not None else batch.max_ts())
        return torch.sigmoid(self.model(*inputs.as_args())).float().cpu().numpy()

    def close(self) -> None:
        self.embeddings.close()
