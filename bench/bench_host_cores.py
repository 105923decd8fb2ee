"""Which of this host's cores slow each other down: hidden siblings of a virtual machine.

A virtual machine may show every vCPU as a core of its own ("Thread(s) per core: 1") while
the hypervisor runs pairs of them on one physical core's two hardware threads. Two busy
threads on such a pair each run 20-40% slower, and two ranks of a trainer whose main
threads land on one are slower than two lone processes that happen not to.

The probe: one process pinned to core ``a`` runs a fixed loop of Python integer work alone,
then again while a second one, pinned to core ``b``, runs the same loop. The slowdown of
``a`` beside ``b`` (its time beside ``b`` over its time alone) is about 1.0 for independent
cores and well above it for siblings. Pairs: core 0 (and ``--also`` cores) against every
other core. Baseline: the same loop alone on core ``a``, in the same run.

Usage: python bench/bench_host_cores.py [--loops 2000000] [--also 1 5] [--out var/bench]
Writes var/bench/host-cores-<time>.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

from output import write_result  # bench/ is on sys.path (script dir; `streamrec bench` adds it)


def spin(core: int, loops: int, start: "mp.synchronize.Event", out: "mp.Queue") -> None:
    """``loops`` additions on ``core``, timed after ``start``."""
    os.sched_setaffinity(0, {core})
    start.wait()
    t0 = time.perf_counter()
    total = 0
    for i in range(loops):
        total += i
    out.put((core, time.perf_counter() - t0))


def timed(cores: list[int], loops: int) -> dict[int, float]:
    """Each core's loop time, all of them started together."""
    start, out = mp.Event(), mp.Queue()
    procs = [mp.Process(target=spin, args=(c, loops, start, out)) for c in cores]
    for p in procs:
        p.start()
    time.sleep(0.2)  # every process pinned and waiting
    start.set()
    times = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loops", type=int, default=2_000_000)
    parser.add_argument("--also", type=int, nargs="*", default=[], help="more cores to pair with every other one")
    parser.add_argument("--out", default="var/bench")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    result = {"bench": "host_cores", "cores": cores, "loops": args.loops, "pairs": []}
    for a in [cores[0], *args.also]:
        alone = min(timed([a], args.loops)[a] for _ in range(3))
        slow = []
        for b in cores:
            if b == a:
                continue
            beside = min(timed([a, b], args.loops)[a] for _ in range(2))
            result["pairs"].append({"a": a, "b": b, "alone_s": alone, "beside_s": beside, "slowdown": beside / alone})
            slow.append((beside / alone, b))
        worst = sorted(slow, reverse=True)[:4]
        print(f"core {a}: alone {alone * 1e3:.1f} ms; beside another, slowdown median "
              f"{sorted(s for s, _ in slow)[len(slow) // 2]:.2f}; worst: " + ", ".join(f"core {b} {s:.2f}x" for s, b in worst),
              flush=True)
    write_result(args.out, "host-cores", result)


if __name__ == "__main__":
    main()
