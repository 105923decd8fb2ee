"""What the 2-rank training step's communication costs its host thread, part by part, on one
host: the agreement over the step channel, and the rows' and gradients' exchange.

- **Agreement**: a row of 17 integers from every rank to every rank, and 1,600 keys from each
  rank to each other rank, ranks arriving in turn ``--late-us`` apart (busy, as a training
  thread is). The trainer's: ``StepChannel.exchange``; baseline: gloo, what the ranks would use
  without it (an ``all_gather`` of the row, an ``all_to_all_single`` of the keys). Reported:
  the host time in the call of the rank that arrives last (the step pays it), and of the first.
- **Exchange** (CUDA): the rows round (``--keys`` rows of ``--dim`` float32 to each rank) and
  the gradients round (the same, with ``--dense`` float32 behind each share, as the trainer
  averages its dense gradients in it). The trainer's: ``dist.all_to_all_single`` over NCCL.
  The alternative measured against it: ``PeerExchange`` below, each share copied straight into
  the peer's symmetric memory, then a device-side signal each way (no NCCL, no host sync).
  Reported: host us per call, and us per iteration (rows round, a little device work,
  gradients round) with a host sync every 16 iterations, as the trainer drains. Results are
  checked equal.

Both variants of each run in the same processes, in alternating blocks.

Usage: python bench/bench_rank_exchange.py [--nproc-per-node 2] [--rounds 3000] [--out var/bench]
(starts itself under torch.distributed.run). Writes var/bench/rank-exchange-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from output import write_result  # noqa: E402

from streamrec.trainer.step_channel import StepChannel  # noqa: E402

BLOCK = 250  # rounds per block; variants alternate block by block
PEER_BLOCK_ELEMS = 1 << 20  # float32 per (slot, sending rank) of PeerExchange's buffer


class PeerExchange:
    """``all_to_all_single`` of contiguous float32 tensors between the GPUs of one host
    through symmetric memory: each share copied into the peer's buffer (block ``(slot, sender)``,
    slot = call parity), a signal to each peer, a wait for each peer's, a copy out. A sender
    writes a slot again only after the receiver's signal of the call in between, which the
    receiver sends after it has copied that slot out."""

    def __init__(self, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.buffer = symm_mem.empty(2 * self.world * PEER_BLOCK_ELEMS, dtype=torch.float32, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, dist.group.WORLD)
        self.views = [self.handle.get_buffer(r, (len(self.buffer),), torch.float32, 0) for r in range(self.world)]
        self.calls = 0

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        row = inp[0].numel() if inp.dim() > 1 else 1
        slot, me, n = self.calls % 2, self.rank, self.world
        self.calls += 1
        flat_in, flat_out = inp.reshape(-1), out.reshape(-1)
        starts_in = [sum(in_splits[:r]) * row for r in range(n)]
        starts_out = [sum(out_splits[:r]) * row for r in range(n)]
        for peer in range(n):
            size = in_splits[peer] * row
            if peer != me and size:
                at = (slot * n + me) * PEER_BLOCK_ELEMS
                self.views[peer][at:at + size].copy_(flat_in[starts_in[peer]:starts_in[peer] + size])
        for peer in (p for p in range(n) if p != me):
            self.handle.put_signal(peer, slot, 0)
        for peer in (p for p in range(n) if p != me):
            self.handle.wait_signal(peer, slot, 0)
        for peer in range(n):
            size = out_splits[peer] * row
            src = flat_in[starts_in[me]:starts_in[me] + size] if peer == me else \
                self.views[me][(slot * n + peer) * PEER_BLOCK_ELEMS:][:size]
            flat_out[starts_out[peer]:starts_out[peer] + size].copy_(src)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def agreement(rank: int, world: int, control, args) -> dict:
    """Host us in the agreement of the rank arriving last and of the first: the step channel
    against gloo collectives of the same row and keys."""
    channel = StepChannel.open(rank, world, control, 60.0)
    row = list(range(17))
    keys = [np.arange(args.keys, dtype=np.int64) for _ in range(world)]
    row_t, keys_t = torch.tensor(row), torch.from_numpy(np.concatenate(keys))
    rows_out = [torch.empty_like(row_t) for _ in range(world)]
    keys_in = torch.empty_like(keys_t)

    def gloo() -> None:
        dist.all_gather(rows_out, row_t, group=control)
        dist.all_to_all_single(keys_in, keys_t, group=control)

    variants = {"channel": lambda: channel.exchange(row, keys), "gloo": gloo}
    times: dict[str, dict[str, list[float]]] = {v: {"last": [], "first": []} for v in variants}
    for block in range(2 * args.rounds // BLOCK):
        name = list(variants)[block % 2]
        for i in range(BLOCK):
            late = i % world  # ranks take turns arriving last
            _busy(args.late_us * 1e-6 if rank == late else 0.0)
            t0 = time.perf_counter()
            variants[name]()
            times[name]["last" if rank == late else "first"].append(1e6 * (time.perf_counter() - t0))
    channel.close()
    return {v: {who: {"median_us": statistics.median(t), "mean_us": statistics.fmean(t)} for who, t in d.items()}
            for v, d in times.items()}


def exchange(rank: int, world: int, device: torch.device, args) -> dict:
    """Host us per call and us per iteration of NCCL's all_to_all against the peer exchange."""
    peer = PeerExchange(device)
    splits = [args.keys] * world
    rows = torch.randn(sum(splits), args.dim, device=device) + rank
    dense = torch.randn(args.dense, device=device)
    work = torch.randn(512, 512, device=device)

    def nccl(out, inp, out_splits, in_splits):
        dist.all_to_all_single(out, inp, out_splits, in_splits)

    variants = {"nccl": nccl, "peer": peer.all_to_all}
    grads_in = torch.cat([torch.cat([share.reshape(-1), dense]) for share in rows.split(splits)])
    grad_splits = [args.keys * args.dim + args.dense] * world
    results = {}
    for name, call in variants.items():  # equal results first
        back = torch.empty_like(rows)
        call(back, rows, splits, splits)
        grads_out = torch.empty_like(grads_in)
        call(grads_out, grads_in, grad_splits, grad_splits)
        results[name] = (back, grads_out)
    torch.cuda.synchronize()
    equal = all(torch.equal(a, b) for a, b in zip(results["nccl"], results["peer"]))
    host: dict[str, list[float]] = {v: [] for v in variants}
    wall: dict[str, float] = dict.fromkeys(variants, 0.0)
    iterations = dict.fromkeys(variants, 0)
    back, grads_out = torch.empty_like(rows), torch.empty_like(grads_in)
    for block in range(2 * args.rounds // BLOCK):
        name = list(variants)[block % 2]
        call = variants[name]
        torch.cuda.synchronize()
        dist.barrier()
        started = time.perf_counter()
        for i in range(BLOCK):
            t0 = time.perf_counter()
            call(back, rows, splits, splits)
            t1 = time.perf_counter()
            work @ work
            t2 = time.perf_counter()
            call(grads_out, grads_in, grad_splits, grad_splits)
            host[name] += [1e6 * (t1 - t0), 1e6 * (time.perf_counter() - t2)]
            if i % 16 == 15:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        wall[name] += time.perf_counter() - started
        iterations[name] += BLOCK
    return {"equal_results": equal,
            **{v: {"host_us_per_call_median": statistics.median(host[v]), "host_us_per_call_mean": statistics.fmean(host[v]),
                   "us_per_iteration": 1e6 * wall[v] / iterations[v]} for v in variants}}


def worker(args) -> None:
    local = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo")
    out = {"rank": rank, "agreement": agreement(rank, world, control, args)}
    out["exchange"] = exchange(rank, world, device, args) if cuda else {"skipped": "no CUDA"}
    every: list = [None] * world
    dist.all_gather_object(every, out, group=control)
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(every))
    dist.barrier(group=control)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3000, help="rounds of each variant")
    parser.add_argument("--keys", type=int, default=1600, help="keys (rows) each rank sends each rank a round")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--dense", type=int, default=136_144, help="dense gradients averaged in the gradients' round")
    parser.add_argument("--late-us", type=float, default=300.0, help="how much later the last rank reaches the agreement")
    parser.add_argument("--out", default="var/bench")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_out:
        worker(args)
        return
    scratch = Path(args.out) / ".rank-exchange-workers.json"
    scratch.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc_per_node}",
               __file__, *sys.argv[1:], "--worker-out", str(scratch)]
    subprocess.run(command, check=True)
    ranks = json.loads(scratch.read_text())
    scratch.unlink()
    summary = {}
    for part, ours, base, key in (("agreement", "channel", "gloo", "last"), ("exchange", "nccl", "peer", None)):
        mine = [r[part] for r in ranks]
        if any("skipped" in m for m in mine):
            continue
        if key:  # the step pays the last rank's wait
            summary[part] = {v: statistics.fmean(m[v][key]["median_us"] for m in mine) for v in (ours, base)}
        else:
            summary[part] = {v: statistics.fmean(m[v]["host_us_per_call_median"] for m in mine) for v in (ours, base)}
            summary[part + "_us_per_iteration"] = {v: statistics.fmean(m[v]["us_per_iteration"] for m in mine) for v in (ours, base)}
        summary[part]["baseline_over_ours"] = summary[part][base] / max(summary[part][ours], 1e-9)
    result = {"bench": "rank_exchange", "args": {k: v for k, v in vars(args).items() if k != "worker_out"},
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "summary": summary, "ranks": ranks}
    print(json.dumps(summary, indent=2))
    write_result(args.out, "rank-exchange", result)


if __name__ == "__main__":
    main()
