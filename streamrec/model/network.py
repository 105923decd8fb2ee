"""The CTR model: DIN-style target attention over the behaviour sequence, a DCN-v2 cross
network and a deep MLP over the field embeddings and dense features.

Only the dense part is an ``nn.Module``; sparse rows live in embedding tables and arrive as
tensors (model/sparse.py looks them up). ``CTRModel.forward`` takes plain tensors of
static shape and has no train/eval difference (no batch norm, no dropout: the
online scores and the served scores of the same parameters agree), so serving can capture it in CUDA graphs or compile it per shape bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from streamrec.model.batch import TABLES, dense_feature_names
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.embedding.budget import rows_per_table
from streamrec.embedding.optimizers import make_optimizer
from streamrec.embedding.table import TableConfig

N_FIELDS = 7  # user, item, category, advertiser, device, position, local_hour


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and widths of the dense part; stored with every published version. Built from
    the [model] config section and the feature spec (whose counters make the dense inputs)."""

    embedding_dim: int
    history_len: int
    n_dense: int
    attention_hidden: int
    cross_layers: int
    mlp: tuple[int, ...]

    @classmethod
    def from_config(cls, model_cfg, features: FeatureSpec) -> "ModelSpec":
        return cls(model_cfg.embedding_dim, model_cfg.history_len, len(dense_feature_names(features)),
                   model_cfg.attention_hidden, model_cfg.cross_layers, model_cfg.mlp_widths)

    def to_json(self) -> dict:
        return {**self.__dict__, "mlp": list(self.mlp)}

    @classmethod
    def from_json(cls, data: dict) -> "ModelSpec":
        return cls(**{**data, "mlp": tuple(data["mlp"])})


def table_configs(model_cfg, ps_cfg) -> list[TableConfig]:
    """The embedding tables of the model, from the [model] and [ps] config sections (the
    byte budgets become rows per table, embedding/budget.py)."""
    dim, state_dim = model_cfg.embedding_dim, make_optimizer(model_cfg.sparse_optimizer).state_dim(model_cfg.embedding_dim)
    shapes = {name: (dim, state_dim) for name in TABLES}
    hbm = rows_per_table(ps_cfg.hbm_bytes, shapes, "ps.hbm_bytes")
    dram = rows_per_table(ps_cfg.dram_bytes, shapes, "ps.dram_bytes")
    return [
        TableConfig(name, dim, optimizer=model_cfg.sparse_optimizer, lr=model_cfg.sparse_lr,
                    admit_after=model_cfg.admit_after, ttl_s=model_cfg.ttl_s, dram_rows=dram[name], gpu_cache_rows=hbm[name])
        for name in TABLES
    ]


def inference_cache_rows(model_cfg, ps_cfg) -> int:
    """GPU-cache rows per table of a served version (inference tables keep a one-float
    state) from ``[ps] hbm_bytes``."""
    shapes = {name: (model_cfg.embedding_dim, 1) for name in TABLES}
    return min(rows_per_table(ps_cfg.hbm_bytes, shapes, "ps.hbm_bytes").values())


class TargetAttention(nn.Module):
    """DIN: weight each history entry by an MLP of (candidate, entry, difference, product)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.score = nn.Sequential(nn.Linear(4 * width, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, candidate: torch.Tensor, history: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = candidate.unsqueeze(1).expand_as(history)
        logits = self.score(torch.cat([q, history, q - history, q * history], dim=-1)).squeeze(-1)
        logits = logits.masked_fill(~mask, -1e9)
        # An empty history attends to nothing: the masked softmax is zeroed, not NaN.
        weights = torch.softmax(logits, dim=1) * mask
        return torch.bmm(weights.unsqueeze(1), history).squeeze(1)


class CrossNetwork(nn.Module):
    """DCN-v2: x_{l+1} = x0 * (W_l x_l + b_l) + x_l."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x


class CTRModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        d = spec.embedding_dim
        self.attention = TargetAttention(2 * d, spec.attention_hidden)
        width = N_FIELDS * d + 2 * d + spec.n_dense
        self.cross = CrossNetwork(width, spec.cross_layers)
        deep, prev = [], width
        for w in spec.mlp:
            deep += [nn.Linear(prev, w), nn.ReLU()]
            prev = w
        self.deep = nn.Sequential(*deep)
        self.head = nn.Linear(width + prev, 1)

    def forward(self, fields: torch.Tensor, history: torch.Tensor, history_mask: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """fields [B, 7, D], history [B, L, 2D], history_mask [B, L] bool, dense [B, F] -> logits [B]."""
        candidate = torch.cat([fields[:, 1], fields[:, 2]], dim=1)  # item, category
        interest = self.attention(candidate, history, history_mask)
        x0 = torch.cat([fields.flatten(1), interest, dense], dim=1)
        return self.head(torch.cat([self.cross(x0), self.deep(x0)], dim=1)).squeeze(1)
