"""Host arrays the GPU reads and writes in place: page-locked and mapped into the device's
address space (CUDA unified virtual addressing), so a Triton kernel takes them as pointer
arguments like device tensors.

Why: the DRAM tier under a GPU cache. A cache miss then costs one kernel that probes the
DRAM index and copies the rows over PCIe, instead of a host round trip (keys to the host,
a torch probe of the index on the CPU, gathers into a staging buffer, a copy up).

Rules for callers: pass kernels the tensor this module returns (a view of it is not
registered once that tensor is freed), and let every kernel that touches the arrays finish
before host code changes or replaces them (placement.py waits after each such launch).

Why not ``torch.empty(..., pin_memory=True)``: torch's pinned allocator rounds every
allocation up to a power of two, so a 5 GiB tier would lock 8 GiB. These arrays are plain
host allocations registered with ``cudaHostRegister`` over exactly the pages they own, and
unregistered when the tensor is freed.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

log = logging.getLogger(__name__)

PAGE = 4096


@functools.cache
def mappable() -> bool:
    """Whether host memory can be mapped for the GPU here (tried once, on one page). Where
    not (a platform or container that refuses it), the DRAM tier stays a plain host tier:
    slower misses, same results."""
    try:
        mapped_empty(PAGE, torch.uint8)
        return True
    except RuntimeError as exc:
        log.warning("the DRAM tier stays unmapped (cache misses go through the host): %s", exc)
        return False


def mapped_empty(shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor that CUDA kernels may access (its pages are locked for
    as long as the tensor lives). Needs CUDA."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = max(1, torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    span = -(-nbytes // PAGE) * PAGE
    raw = torch.empty(span + PAGE, dtype=torch.uint8)  # room to start on a page boundary
    start = -raw.data_ptr() % PAGE
    # registered pages lie wholly inside this allocation: no other registration can overlap them
    view = raw[start : start + span]
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(view.data_ptr(), span, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {span} bytes failed ({err}): host memory for the DRAM tier cannot be "
                           "mapped for the GPU (is the memlock limit too low? see `ulimit -l`)")
    out = view[:nbytes].view(dtype)[: torch.Size(shape).numel()].view(shape)
    weakref.finalize(out, cudart.cudaHostUnregister, view.data_ptr())
    return out


def mapped_full(shape: tuple[int, ...] | int, value, dtype: torch.dtype) -> torch.Tensor:
    return mapped_empty(shape, dtype).fill_(value)
