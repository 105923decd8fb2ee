"""Each local rank's own share of the host's cores.

Why: the ranks of one host meet at every step (the agreement, the exchange's collectives),
so a step lasts as long as the slower rank's host thread. Left to the scheduler, a rank's
training thread shares cores with the other rank's sample reader and decoding threads and
moves between cores; each such stall or migration becomes both ranks' step. Pinned, rank r
of L on a host runs (with its sample reader, which inherits the mask) on the r-th of L
equal, disjoint slices of the cores the launcher gave this process.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

log = logging.getLogger(__name__)
MIN_CORES_PER_RANK = 2  # the training thread and its sample reader: below this a share would serialize them


def rank_cores(allowed: list[int], local_rank: int, local_world: int) -> list[int]:
    """The ``local_rank``-th of ``local_world`` equal, disjoint, consecutive slices of the
    sorted ``allowed`` cores (cores left over by the division go to nobody: each rank gets
    the same share)."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is not in [0, {local_world})")
    share = len(allowed) // local_world
    cores = sorted(allowed)
    return cores[local_rank * share:(local_rank + 1) * share]


def pin_local_rank(env: Mapping[str, str] = os.environ) -> list[int] | None:
    """Pin this process (its threads, those it starts from now on, and its child processes) to its
    local rank's share of the cores it may run on, under a launcher with several local ranks
    (LOCAL_RANK, LOCAL_WORLD_SIZE); returns the share, or None where nothing was pinned (a lone
    process, one local rank, fewer than ``MIN_CORES_PER_RANK`` cores a rank, or a platform
    without ``sched_setaffinity``). Call it before the sample reader starts."""
    if not hasattr(os, "sched_setaffinity") or "LOCAL_RANK" not in env:
        return None
    local_world = int(env.get("LOCAL_WORLD_SIZE", "1"))
    if local_world < 2:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) // local_world < MIN_CORES_PER_RANK:
        log.info("cpu affinity: %d cores for %d local ranks, too few to give each its own; not pinned", len(allowed), local_world)
        return None
    cores = rank_cores(allowed, int(env["LOCAL_RANK"]), local_world)
    for thread in _threads():  # the syscall pins one thread: every thread started so far
        try:
            os.sched_setaffinity(thread, cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass
    log.info("cpu affinity: local rank %s of %d on cores %d-%d", env["LOCAL_RANK"], local_world, cores[0], cores[-1])
    return cores


def _threads() -> list[int]:
    """This process's thread ids (just the calling thread where /proc is not there)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def cap_arrow_threads() -> None:
    """pyarrow's decoding pool no larger than the cores this process may run on (it sizes
    itself from the whole host's, so a pinned sample reader would run more threads than cores)."""
    import pyarrow as pa

    if hasattr(os, "sched_getaffinity"):
        pa.set_cpu_count(max(1, min(pa.cpu_count(), len(os.sched_getaffinity(0)))))
