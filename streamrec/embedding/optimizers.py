"""Sparse optimizers over the unique rows of a batch, updated in place in their tier.

Gradients of duplicate keys are summed before they get here (``find_or_insert`` hands out
unique rows, so autograd's index backward sums them). State lives next to each row in the
tier that holds it, so it moves with the row between GPU, DRAM and SSD.

``update_`` is what tables call: on CUDA one fused Triton launch per table
(optimizer_kernels.py), elsewhere the vectorised torch ``step`` (the formula).
Both mark the updated rows dirty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrec.embedding import optimizer_kernels


@dataclass(frozen=True)
class RowwiseAdagrad:
    """Adagrad with one accumulator per row (mean of squared gradients), as in DLRM/FBGEMM."""

    lr: float = 0.05
    eps: float = 1e-8
    initial_accumulator: float = 0.0

    def state_dim(self, dim: int) -> int:
        return 1

    def init_state(self, n: int, dim: int, device: torch.device) -> torch.Tensor:
        return torch.full((n, 1), self.initial_accumulator, device=device)

    def step(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acc = state[:, 0] + grad.pow(2).mean(dim=1)
        new_w = weights - self.lr * grad / (acc.sqrt() + self.eps).unsqueeze(1)
        return new_w, acc.unsqueeze(1)

    def update_(self, weights: torch.Tensor, state: torch.Tensor, dirty: torch.Tensor, slots: torch.Tensor,
                grad: torch.Tensor) -> None:
        if optimizer_kernels.available(weights.device):
            optimizer_kernels.rowwise_adagrad_(weights, state, dirty, slots, grad.float(), self.lr, self.eps)
        else:
            _update_with_step(self, weights, state, dirty, slots, grad)

    def update_grouped_(self, groups: optimizer_kernels.OptimizerGroups, slots: torch.Tensor, grad: torch.Tensor) -> None:
        """``update_`` of several tiers in one launch (CUDA only; see OptimizerGroups)."""
        optimizer_kernels.rowwise_adagrad_(None, None, None, slots, grad.float(), self.lr, self.eps, groups=groups)


@dataclass(frozen=True)
class LazyAdam:
    """Adam that updates only the rows present in the batch, with a per-row step count
    for bias correction (rows seen rarely are not over-corrected)."""

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def state_dim(self, dim: int) -> int:
        return 2 * dim + 1  # m, v, step

    def init_state(self, n: int, dim: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(n, 2 * dim + 1, device=device)

    def step(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dim = weights.shape[1]
        m = self.beta1 * state[:, :dim] + (1 - self.beta1) * grad
        v = self.beta2 * state[:, dim : 2 * dim] + (1 - self.beta2) * grad.pow(2)
        t = state[:, 2 * dim] + 1
        m_hat = m / (1 - self.beta1 ** t).unsqueeze(1)
        v_hat = v / (1 - self.beta2 ** t).unsqueeze(1)
        new_w = weights - self.lr * m_hat / (v_hat.sqrt() + self.eps)
        return new_w, torch.cat([m, v, t.unsqueeze(1)], dim=1)

    def update_(self, weights: torch.Tensor, state: torch.Tensor, dirty: torch.Tensor, slots: torch.Tensor,
                grad: torch.Tensor) -> None:
        if optimizer_kernels.available(weights.device):
            optimizer_kernels.lazy_adam_(weights, state, dirty, slots, grad.float(), self.lr, self.beta1, self.beta2, self.eps)
        else:
            _update_with_step(self, weights, state, dirty, slots, grad)

    def update_grouped_(self, groups: optimizer_kernels.OptimizerGroups, slots: torch.Tensor, grad: torch.Tensor) -> None:
        """``update_`` of several tiers in one launch (CUDA only; see OptimizerGroups)."""
        optimizer_kernels.lazy_adam_(None, None, None, slots, grad.float(), self.lr, self.beta1, self.beta2, self.eps,
                                     groups=groups)


def _update_with_step(optimizer, weights: torch.Tensor, state: torch.Tensor, dirty: torch.Tensor, slots: torch.Tensor,
                      grad: torch.Tensor) -> None:
    """The torch path of ``update_``: gather the rows, step, scatter them back."""
    new_w, new_s = optimizer.step(weights.index_select(0, slots), state.index_select(0, slots), grad.float())
    weights.index_copy_(0, slots, new_w)
    state.index_copy_(0, slots, new_s)
    dirty.index_fill_(0, slots, 1)


OPTIMIZERS = {"adagrad": RowwiseAdagrad, "adam": LazyAdam}


def make_optimizer(name: str, **kwargs):
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown sparse optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](**kwargs)
