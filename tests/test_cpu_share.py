"""Each local rank's share of the node's CPUs (trainer/cpu_share.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamrec.trainer.cpu_share import keep_to_share, physical_cores, share_of


def _topology(tmp_path: Path, siblings: dict[int, str]) -> Path:
    for cpu, listed in siblings.items():
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(listed + "\n")
    return tmp_path


def test_hyper_threads_of_one_core_stay_in_one_share(tmp_path):
    # 4 cores, 8 CPUs: CPU c and c + 4 are one core's two threads
    sysfs = _topology(tmp_path, {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
    cores = physical_cores(range(8), sysfs)
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [share_of(cores, r, 2) for r in range(2)] == [[0, 4, 1, 5], [2, 6, 3, 7]]


def test_shares_are_disjoint_and_cover_every_core():
    cores = [[c] for c in range(10)]
    shares = [share_of(cores, r, 3) for r in range(3)]
    assert sorted(c for s in shares for c in s) == list(range(10))
    assert [len(s) for s in shares] == [3, 3, 4]


def test_without_topology_each_cpu_is_its_own_core(tmp_path):
    assert physical_cores([3, 1, 2], tmp_path) == [[1], [2], [3]]


def test_one_local_rank_keeps_every_cpu():
    before = os.sched_getaffinity(0)
    assert keep_to_share({"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}) is None
    assert os.sched_getaffinity(0) == before


PINNED = """
import json, os, threading, time
from streamrec.trainer.cpu_share import keep_to_share
started = threading.Event()
before = threading.Thread(target=lambda: (started.set(), time.sleep(5)), daemon=True)
before.start(); started.wait()
share = keep_to_share({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"})
after = threading.Thread(target=lambda: time.sleep(5), daemon=True)
after.start()
print(json.dumps([sorted(share), sorted(os.sched_getaffinity(before.native_id)), sorted(os.sched_getaffinity(after.native_id))]))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 4, reason="needs 4 CPUs: 2 ranks of 2")
def test_every_thread_of_a_rank_keeps_to_its_share_those_started_before_too():
    out = subprocess.run([sys.executable, "-c", PINNED], capture_output=True, text=True, check=True, timeout=60).stdout
    share, before, after = json.loads(out)
    assert share and set(share) < os.sched_getaffinity(0)
    assert before == share and after == share
