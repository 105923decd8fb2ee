"""Growing the online feature store's numpy columns without copying them.

A column grows in place (``ndarray.resize``: a realloc, which moves a large block by
remapping its pages), so a store of gigabytes takes a new entity without a copy of
everything, a pause under the lock, or a moment of twice the memory. Large columns grow by
a sixteenth (numpy zeroes what is added: that much becomes resident), small ones double.
Whoever grows a column must hold no view of it across the call: the old memory is gone.

Columns are allocated without numpy's huge-page advice (:func:`no_huge_page_advice`): where
the kernel compacts memory for advised regions only (``defrag = madvise``), the advice makes
every first touch of a fresh gigabyte wait on compaction, several times slower (RESULTS.md).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import numpy as np

_set_advice = getattr(getattr(np, "_core", np).multiarray, "_set_madvise_hugepage", None)
_advice_lock = threading.RLock()  # reentrant: a load grows columns inside it


@contextlib.contextmanager
def no_huge_page_advice() -> Iterator[None]:
    """Numpy allocations made meanwhile (in any thread) go without MADV_HUGEPAGE."""
    if _set_advice is None:
        yield
        return
    with _advice_lock:
        before = _set_advice(False)
        try:
            yield
        finally:
            _set_advice(before)

_SMALL = 64 * 2**20  # bytes below which a column doubles


def grown(values: np.ndarray, need: int) -> np.ndarray:
    """``values`` with room for at least ``need`` rows (the same array object, grown); the
    added rows are zero."""
    rows = len(values)
    if need <= rows:
        return values
    step = rows if values.nbytes < _SMALL else rows // 16
    return resized(values, max(need, rows + step))


def resized(values: np.ndarray, rows: int) -> np.ndarray:
    """``values`` with exactly ``rows`` rows, in place where it owns its memory."""
    with no_huge_page_advice():
        if values.base is not None or not values.flags.c_contiguous:
            out = np.zeros((rows, *values.shape[1:]), values.dtype)
            out[: min(rows, len(values))] = values[:rows]
            return out
        values.resize((rows, *values.shape[1:]), refcheck=False)
        return values
