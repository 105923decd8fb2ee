"""The dense model's forward and backward as replayed CUDA graphs, for full batches.

Why: at batch 4096 the dense model's eager forward + backward costs the training thread
about as much time in Python, autograd and kernel launches as the GPU spends running it,
and the same thread also pulls the sparse rows: the step is bound by the host. ``torch.cuda.make_graphed_callables`` captures the forward and the
backward once (parameters included) and replays each with one launch; autograd still
sees one function, so the loss, the sparse rows' gradients and the optimizer work as
before and give the same numbers.

A graph holds one shape: that of a full batch (``batch_size`` samples), captured when
the object is made, before the trainer starts the threads that use the device (a capture
fails if another thread touches the device meanwhile). Other shapes (a partial batch released by
``max_batch_delay_ms``, the last batch of a file) run eagerly. Used on CUDA, on one rank or
several (their gradients are averaged after the replay: trainer/distributed.py
``DenseGradients``), for a model without dropout or batch norm (the graph is the
training-mode forward; CTRModel has neither).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from streamrec.model.network import N_FIELDS, CTRModel

log = logging.getLogger(__name__)


class _Forward(nn.Module):
    """The model as the one module make_graphed_callables captures (the model itself stays
    eager for every other caller)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(*args)


class GraphedDense:
    def __init__(self, model: CTRModel, batch_size: int, device: torch.device) -> None:
        """Captures the graphs for batches of ``batch_size`` (synchronises the device)."""
        self.model = model
        spec = model.spec
        d, length = spec.embedding_dim, spec.history_len
        examples = (torch.zeros(batch_size, N_FIELDS, d, device=device, requires_grad=True),  # rows receive gradients
                    torch.zeros(batch_size, length, 2 * d, device=device, requires_grad=True),
                    torch.ones(batch_size, length, dtype=torch.bool, device=device),
                    torch.zeros(batch_size, spec.n_dense, device=device))
        self._shapes = self._signature(examples)
        self._warned = False
        torch.cuda.synchronize(device)
        self._graphed = torch.cuda.make_graphed_callables(_Forward(model), examples)
        log.info("dense forward/backward captured as CUDA graphs for batches of %d", batch_size)

    @staticmethod
    def _signature(args: tuple[torch.Tensor, ...]) -> tuple:
        return tuple((a.shape, a.dtype, a.requires_grad) for a in args)

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if self._signature(args) == self._shapes:
            return self._graphed(*args)
        if len(args[0]) == self._shapes[0][0][0] and not self._warned:  # a full batch that should have replayed
            self._warned = True
            log.warning("a full batch runs the dense model eagerly: its inputs %s differ from the captured %s",
                        self._signature(args), self._shapes)
        return self.model(*args)
