"""Fused sparse optimizer kernels (Triton): one launch per table and step.

Each program takes a block of rows; every row's gradient, weights and optimizer state
are read once and written once, in place, at the row's slot in the tier, and the row is
marked dirty (it now differs from its copy below the GPU cache). The torch path in
optimizers.py (index_select, step, index_copy_) moves every row three times and
launches about ten kernels; bench/bench_ps.py measures the difference.

Row-wise Adagrad keeps one accumulator per row (mean of the row's squared gradient);
Adam keeps m, v and a per-row step count (lazy: only rows in the batch advance).
Used only on CUDA with Triton; the formulas are the ones in optimizers.py.
"""

from __future__ import annotations

import torch

from streamrec.embedding.kernels import group_blocks, to_device_async

try:  # Triton ships with CUDA builds of torch; CPU-only installs simply lack it.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _adagrad_rows(weights_ptr, state_ptr, dirty_ptr, slot, g, valid, mask, cols, lr, eps, DIM: tl.constexpr,
                      BLOCK: tl.constexpr):
        w = tl.load(weights_ptr + slot[:, None] * DIM + cols[None, :], mask=mask, other=0.0)
        acc = tl.load(state_ptr + slot, mask=valid, other=0.0) + tl.sum(g * g, axis=1) / DIM
        w = w - lr * g / (tl.sqrt(acc) + eps)[:, None]
        tl.store(weights_ptr + slot[:, None] * DIM + cols[None, :], w, mask=mask)
        tl.store(state_ptr + slot, acc, mask=valid)
        tl.store(dirty_ptr + slot, tl.full((BLOCK,), 1, tl.int8), mask=valid)

    @triton.jit
    def _adam_rows(weights_ptr, state_ptr, dirty_ptr, slot, g, valid, mask, cols, lr, beta1, beta2, one_minus_beta1,
                   one_minus_beta2, eps, DIM: tl.constexpr, BLOCK: tl.constexpr):
        state_row = slot * (2 * DIM + 1)  # m[DIM], v[DIM], step
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

    @triton.jit
    def _rows_of_program(groups_ptr, slots_ptr, grad_ptr, n, GROUPED: tl.constexpr, GROUPS: tl.constexpr,
                         FIELDS: tl.constexpr, DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
        """This program's rows: (group, slot, grad, valid, mask, cols); a grouped launch finds
        its group as the last whose first block is at or before the program (UPDATE_FIELDS rows)."""
        pid = tl.program_id(0)
        g = pid * 0
        if GROUPED:
            for j in tl.static_range(1, GROUPS):
                g += (pid >= tl.load(groups_ptr + j * FIELDS + 2)).to(tl.int32)
            row = groups_ptr + g * FIELDS
            local = (pid - tl.load(row + 2)) * BLOCK + tl.arange(0, BLOCK)
            valid = local < tl.load(row + 1)
            rows = tl.load(row) + local
        else:
            rows = pid * BLOCK + tl.arange(0, BLOCK)
            valid = rows < n
        slot = tl.load(slots_ptr + rows, mask=valid, other=0)
        cols = tl.arange(0, DIM_BLOCK)
        mask = valid[:, None] & (cols < DIM)[None, :]
        grad = tl.load(grad_ptr + rows[:, None] * DIM + cols[None, :], mask=mask, other=0.0)
        return g, slot, grad, valid, mask, cols

    @triton.jit(do_not_specialize=["n", "lr", "eps"])
    def _rowwise_adagrad(weights_ptr, state_ptr, dirty_ptr, slots_ptr, grad_ptr, groups_ptr, n, lr, eps,
                         GROUPED: tl.constexpr, GROUPS: tl.constexpr, FIELDS: tl.constexpr, DIM: tl.constexpr,
                         DIM_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
        g, slot, grad, valid, mask, cols = _rows_of_program(groups_ptr, slots_ptr, grad_ptr, n, GROUPED, GROUPS, FIELDS,
                                                            DIM, DIM_BLOCK, BLOCK)
        if GROUPED:
            row = groups_ptr + g * FIELDS
            weights_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
            state_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
            dirty_ptr = tl.load(row + 5).to(tl.pointer_type(tl.int8))
        _adagrad_rows(weights_ptr, state_ptr, dirty_ptr, slot, grad, valid, mask, cols, lr, eps, DIM, BLOCK)

    @triton.jit(do_not_specialize=["n", "lr", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "eps"])
    def _lazy_adam(weights_ptr, state_ptr, dirty_ptr, slots_ptr, grad_ptr, groups_ptr, n, lr, beta1, beta2, one_minus_beta1,
                   one_minus_beta2, eps, GROUPED: tl.constexpr, GROUPS: tl.constexpr, FIELDS: tl.constexpr,
                   DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
        g, slot, grad, valid, mask, cols = _rows_of_program(groups_ptr, slots_ptr, grad_ptr, n, GROUPED, GROUPS, FIELDS,
                                                            DIM, DIM_BLOCK, BLOCK)
        if GROUPED:
            row = groups_ptr + g * FIELDS
            weights_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
            state_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
            dirty_ptr = tl.load(row + 5).to(tl.pointer_type(tl.int8))
        _adam_rows(weights_ptr, state_ptr, dirty_ptr, slot, grad, valid, mask, cols, lr, beta1, beta2, one_minus_beta1,
                   one_minus_beta2, eps, DIM, BLOCK)


# a grouped update's row per table: row start, row count, first block, then the tier's
# weights, state and dirty pointers
UPDATE_FIELDS = 6


def _block(dim: int) -> int:
    return 64 if dim <= 64 else 16


def _launch(n: int, dim: int, groups: "OptimizerGroups | None") -> tuple[tuple[int], torch.Tensor | None, dict]:
    """Grid, the groups table (None: one tier) and the shape constants of an update launch."""
    block = _block(dim)
    programs = groups.blocks if groups is not None else triton.cdiv(n, block)
    meta = dict(GROUPED=groups is not None, GROUPS=groups.count if groups is not None else 1, FIELDS=UPDATE_FIELDS, DIM=dim,
                DIM_BLOCK=triton.next_power_of_2(dim), BLOCK=block)
    return (programs,), groups.table if groups is not None else None, meta


class OptimizerGroups:
    """Several tiers updated by one launch (table-batched): ``grad`` and ``slots`` hold each
    tier's rows one group after another (``counts[g]`` of them)."""

    def __init__(self, tiers: list, counts: list[int], dim: int, device: torch.device) -> None:
        layout, blocks = group_blocks(counts, _block(dim))
        rows = [[*placed, tier.weights.data_ptr(), tier.state.data_ptr(), tier.dirty.data_ptr()]
                for placed, tier in zip(layout, tiers)]
        self.count, self.blocks, self.table = len(tiers), blocks, to_device_async(rows, device)


def rowwise_adagrad_(weights: torch.Tensor | None, state: torch.Tensor | None, dirty: torch.Tensor | None, slots: torch.Tensor,
                     grad: torch.Tensor, lr: float, eps: float, groups: OptimizerGroups | None = None) -> None:
    """In place at ``slots``: weights, the [rows, 1] accumulator, and dirty = 1 (of one tier,
    or of each tier in ``groups``, whose pointers replace the first three arguments)."""
    n, dim = grad.shape
    if n == 0:
        return
    grid, table, meta = _launch(n, dim, groups)
    w, st, d = (weights, state, dirty) if groups is None else (table, table, table)
    _rowwise_adagrad[grid](w, st, d, slots, grad.contiguous(), table if table is not None else slots, n, lr, eps, **meta)


def lazy_adam_(weights: torch.Tensor | None, state: torch.Tensor | None, dirty: torch.Tensor | None, slots: torch.Tensor,
               grad: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
               groups: OptimizerGroups | None = None) -> None:
    """In place at ``slots``: weights, the [rows, 2*dim+1] (m, v, step) state, and dirty = 1
    (of one tier, or of each tier in ``groups``, as ``rowwise_adagrad_``)."""
    n, dim = grad.shape
    if n == 0:
        return
    grid, table, meta = _launch(n, dim, groups)
    w, st, d = (weights, state, dirty) if groups is None else (table, table, table)
    # 1 - beta in double, rounded once (as torch does with a Python scalar), not 1 - fp32(beta)
    _lazy_adam[grid](w, st, d, slots, grad.contiguous(), table if table is not None else slots, n, lr, beta1, beta2,
                     1 - beta1, 1 - beta2, eps, **meta)
