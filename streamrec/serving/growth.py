"""Growing the online feature store's numpy columns without copying them.

A column grows in place (``ndarray.resize``: a realloc, which moves a large block by
remapping its pages), so a store of gigabytes takes a new entity without a copy of
everything, a pause under the lock, or a moment of twice the memory. Large columns grow by
a sixteenth (numpy zeroes what is added: that much becomes resident), small ones double.
Whoever grows a column must hold no view of it across the call: the old memory is gone.
"""

from __future__ import annotations

import numpy as np

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
    if values.base is not None or not values.flags.c_contiguous:
        out = np.zeros((rows, *values.shape[1:]), values.dtype)
        out[: min(rows, len(values))] = values[:rows]
        return out
    values.resize((rows, *values.shape[1:]), refcheck=False)
    return values
