"""Each local rank keeps to its own share of the node's CPUs.

Why: every rank's step is bound by its training thread, and its sample reader process
needs cores beside it. Left to the scheduler, the ranks' threads (training, sample reader,
NCCL, gloo) move over all the cores and now and then share one, which slows that rank's
step, and with it every rank's (each step waits for the slowest). With a share each, a
rank's threads never compete with another rank's (bench/RESULTS.md, "Trainer scaling").

A share is whole physical cores (hyper-threads of one core stay together), cut from the
CPUs this process may use (its cgroup's or taskset's), contiguous by CPU number, so that on
a host of several sockets a share stays on one where it can. ``[trainer] pin_cpus`` turns it
off.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping, Sequence

log = logging.getLogger(__name__)


def physical_cores(cpus: Sequence[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> list[list[int]]:
    """``cpus`` grouped by physical core (hyper-threads together), ordered by their lowest CPU."""
    cores: dict[str, list[int]] = {}
    for cpu in sorted(cpus):
        try:
            siblings = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
        except OSError:  # no topology (some containers): each CPU its own core
            siblings = str(cpu)
        cores.setdefault(siblings, []).append(cpu)
    return sorted(cores.values())


def share_of(cores: list[list[int]], local_rank: int, local_world: int) -> list[int]:
    """The CPUs of local rank ``local_rank``'s contiguous share of ``cores``."""
    lo, hi = local_rank * len(cores) // local_world, (local_rank + 1) * len(cores) // local_world
    return [cpu for core in cores[lo:hi] for cpu in core]


def keep_to_share(env: Mapping[str, str] = os.environ) -> list[int] | None:
    """Pin every thread of this process, and what it starts from now on, to this local
    rank's share (``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE``, set by the launcher). None where
    there is nothing to share out: one local rank, or fewer cores than two per rank."""
    local_world, local_rank = int(env.get("LOCAL_WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0"))
    cores = physical_cores(sorted(os.sched_getaffinity(0)))
    if local_world < 2 or len(cores) < 2 * local_world:
        return None
    share = share_of(cores, local_rank, local_world)
    for task in Path("/proc/self/task").iterdir():  # threads started before (CUDA's, torch's) as well
        try:
            os.sched_setaffinity(int(task.name), share)
        except (ProcessLookupError, PermissionError):  # a thread that has ended, or one we may not move
            pass
    log.info("local rank %d of %d keeps to CPUs %s", local_rank, local_world, _ranges(share))
    return share


def _ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    out, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            out.append(f"{start}-{cpu}" if cpu != start else str(cpu))
            start = None
    return ",".join(out)
