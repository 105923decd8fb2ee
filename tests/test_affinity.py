"""Each local rank on its own share of the cores (trainer/affinity.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from streamrec.trainer.affinity import pin_local_rank, rank_cores

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity on this platform")


def test_rank_cores_are_equal_disjoint_slices():
    allowed = [7, 3, 5, 1, 0, 2, 4, 6]
    shares = [rank_cores(allowed, r, 2) for r in range(2)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6, 7]]
    odd = [rank_cores(list(range(7)), r, 3) for r in range(3)]
    assert odd == [[0, 1], [2, 3], [4, 5]]  # the leftover core goes to nobody: equal shares
    with pytest.raises(ValueError, match="local rank 2"):
        rank_cores(allowed, 2, 2)


def test_nothing_is_pinned_without_several_local_ranks():
    assert pin_local_rank({}) is None
    assert pin_local_rank({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) is None
    too_many = str(len(os.sched_getaffinity(0)) + 1) if hasattr(os, "sched_getaffinity") else "2"
    assert pin_local_rank({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": too_many}) is None  # under 2 cores a rank


PINNED = """
import json, os, subprocess, sys, threading
from streamrec.trainer import affinity
affinity.MIN_CORES_PER_RANK = 1  # so that a 2-core machine has a share to give
started = threading.Event(); stop = threading.Event(); seen = {}
def before():  # a thread that was running before the pinning
    started.set(); stop.wait(); seen["thread"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=before); t.start(); started.wait()
cores = affinity.pin_local_rank({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
stop.set(); t.join()
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], capture_output=True, text=True)
print(json.dumps({"cores": cores, "main": sorted(os.sched_getaffinity(0)), "thread": seen["thread"],
                  "child": json.loads(child.stdout)}))
"""


@needs_affinity
def test_a_rank_its_threads_and_children_run_on_its_share():
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one core: no share to give two ranks")
    done = subprocess.run([sys.executable, "-c", PINNED], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    share = rank_cores(allowed, 1, 2)
    assert got["cores"] == share and share and not set(share) & set(rank_cores(allowed, 0, 2))
    assert got["main"] == got["thread"] == got["child"] == share
