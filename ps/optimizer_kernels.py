"""Fused sparse optimizer kernels (Triton): one launch per table and step.

Each program takes a block of rows; every row's gradient, weights and optimizer state
are read once and written once, in place, at the row's slot in the tier, and the row is
marked dirty (it now differs from its copy below the GPU cache). The torch path in
ps/optimizers.py (index_select, step, index_copy_) moves every row three times and
launches about ten kernels; bench/bench_ps.py measures the difference.

Row-wise Adagrad keeps one accumulator per row (mean of the row's squared gradient);
Adam keeps m, v and a per-row step count (lazy: only rows in the batch advance).
Used only on CUDA with Triton; the formulas are the ones in ps/optimizers.py.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs simply lack it.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit(do_not_specialize=["n", "lr", "eps"])
    def _rowwise_adagrad(weights_ptr, state_ptr, dirty_ptr, slots_ptr, grad_ptr, n, lr, eps,
                         DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = rows < n
        slot = tl.load(slots_ptr + rows, mask=valid, other=0)
        cols = tl.arange(0, DIM_BLOCK)
        mask = valid[:, None] & (cols < DIM)[None, :]
        g = tl.load(grad_ptr + rows[:, None] * DIM + cols[None, :], mask=mask, other=0.0)
        w = tl.load(weights_ptr + slot[:, None] * DIM + cols[None, :], mask=mask, other=0.0)
        acc = tl.load(state_ptr + slot, mask=valid, other=0.0) + tl.sum(g * g, axis=1) / DIM
        w = w - lr * g / (tl.sqrt(acc) + eps)[:, None]
        tl.store(weights_ptr + slot[:, None] * DIM + cols[None, :], w, mask=mask)
        tl.store(state_ptr + slot, acc, mask=valid)
        tl.store(dirty_ptr + slot, tl.full((BLOCK,), 1, tl.int8), mask=valid)

    @triton.jit(do_not_specialize=["n", "lr", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "eps"])
    def _lazy_adam(weights_ptr, state_ptr, dirty_ptr, slots_ptr, grad_ptr, n, lr, beta1, beta2, one_minus_beta1,
                   one_minus_beta2, eps,
                   DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = rows < n
        slot = tl.load(slots_ptr + rows, mask=valid, other=0)
        cols = tl.arange(0, DIM_BLOCK)
        mask = valid[:, None] & (cols < DIM)[None, :]
        state_row = slot * (2 * DIM + 1)  # m[DIM], v[DIM], step
        g = tl.load(grad_ptr + rows[:, None] * DIM + cols[None, :], mask=mask, other=0.0)
        w = tl.load(weights_ptr + slot[:, None] * DIM + cols[None, :], mask=mask, other=0.0)
        m = tl.load(state_ptr + state_row[:, None] + cols[None, :], mask=mask, other=0.0)
        v = tl.load(state_ptr + state_row[:, None] + DIM + cols[None, :], mask=mask, other=0.0)
        t = tl.load(state_ptr + state_row + 2 * DIM, mask=valid, other=0.0) + 1.0
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        m_hat = m / (1 - libdevice.pow(beta1 + tl.zeros_like(t), t))[:, None]  # per-row step count
        v_hat = v / (1 - libdevice.pow(beta2 + tl.zeros_like(t), t))[:, None]
        w = w - lr * m_hat / (tl.sqrt(v_hat) + eps)
        tl.store(weights_ptr + slot[:, None] * DIM + cols[None, :], w, mask=mask)
        tl.store(state_ptr + state_row[:, None] + cols[None, :], m, mask=mask)
        tl.store(state_ptr + state_row[:, None] + DIM + cols[None, :], v, mask=mask)
        tl.store(state_ptr + state_row + 2 * DIM, t, mask=valid)
        tl.store(dirty_ptr + slot, tl.full((BLOCK,), 1, tl.int8), mask=valid)


def _grid(n: int, dim: int) -> tuple[int, int]:
    block = 64 if dim <= 64 else 16
    return triton.cdiv(n, block), block


def rowwise_adagrad_(weights: torch.Tensor, state: torch.Tensor, dirty: torch.Tensor, slots: torch.Tensor,
                     grad: torch.Tensor, lr: float, eps: float) -> None:
    """In place at ``slots``: weights, the [rows, 1] accumulator, and dirty = 1."""
    n, dim = grad.shape
    if n == 0:
        return
    programs, block = _grid(n, dim)
    _rowwise_adagrad[(programs,)](weights, state, dirty, slots, grad.contiguous(), n, lr, eps,
                                  DIM=dim, DIM_BLOCK=triton.next_power_of_2(dim), BLOCK=block)


def lazy_adam_(weights: torch.Tensor, state: torch.Tensor, dirty: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor,
               lr: float, beta1: float, beta2: float, eps: float) -> None:
    """In place at ``slots``: weights, the [rows, 2*dim+1] (m, v, step) state, and dirty = 1."""
    n, dim = grad.shape
    if n == 0:
        return
    programs, block = _grid(n, dim)
    # 1 - beta in double, rounded once (as torch does with a Python scalar), not 1 - fp32(beta)
    _lazy_adam[(programs,)](weights, state, dirty, slots, grad.contiguous(), n, lr, beta1, beta2, 1 - beta1, 1 - beta2, eps,
                            DIM=dim, DIM_BLOCK=triton.next_power_of_2(dim), BLOCK=block)
