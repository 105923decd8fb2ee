"""Trainer throughput and per-step time split, against a plain-PyTorch static-table baseline.

Ours: the real trainer (trainer.driver.Trainer) reading a sample file in a loop: the sample
reader process (decode + batch, trainer/reader.py), ps/ dynamic tables (hash index, unique ids, fused row-wise
Adagrad), the CTR model with Adam, progressive validation, and publishing a version every
``--publish-interval`` seconds into a temporary model store. Two passes: one with a device
sync between phases (exact split: input / lookup / forward_backward / update / evaluate /
publish), one without (throughput).

Baseline, same run, same batches, same dense model: ``nn.EmbeddingBag`` tables pre-sized to
the ids of the data (ids remapped to 0..N-1 beforehand: no dynamic ids, no tiers, no
publishing), sparse gradients and ``torch.optim.Adagrad``; batches pre-built on the device
(input time 0). A second baseline run gets our front end instead: the trainer's sample reader
over the same file (the same decoding process, page-locked slots, one copy per step) and ids
mapped to rows on the device. Ours runs once more with every batch decoded before its first
step (PredecodedReader), the device-resident baseline's terms. ratio = our step time /
baseline step time, on equal terms twice (pre-decoded over device-resident; live front end
over the same front end) and once across (our live run over the device-resident baseline).
On CUDA both run the dense model's full batches as CUDA graphs (trainer/dense_graph.py;
``--eager`` runs both eagerly).

Publish stall: a separate measurement of what publishing costs the training thread per
million touched rows (begin + every snapshot slice), and the longest single pause, against
a bare device-to-host copy of the same rows.

Scaling (``--nproc-per-node N``): the same command, ``streamrec train`` on the sample file
in a loop, at 1 rank (a lone process), at 1 rank under the launcher (which trains as a lone
process does: what the launcher itself costs), and at N ranks under the launcher, each
rank with ``--batch`` samples per step (weak scaling). Reported: samples/s per rank and
in total, and scaling efficiency = total at N / (N x the lone process's). ``--reps R`` runs
the configurations in turn R times and reports each one's best run (every run's figure is
in the JSON), and each rep's speed-up over the lone process of the same rep with their
median: on some hosts the speed drifts over minutes, and a rep's runs are back to back
while its best runs may be minutes apart. Every run records the host's busy and stolen CPU
shares over it (Linux's /proc/stat: a virtual machine's stolen time is time its cores ran
for other guests). ``--variant LABEL:NAME=VALUE`` adds the N-rank runs again with settings of
their own (e.g. a trainer option off), in turn with the others, for an A/B in one run.
``--side-by-side`` adds N lone processes at once, each on its own GPU (or its share of the
cores on CPU) and its own copy of the run, with nothing exchanged: their summed samples/s is
the ceiling N ranks could reach on this host (the host's cores, memory and clocks shared as
the ranks share them), so the ranks' shortfall splits into what sharing the host costs and
what the exchange and the agreement cost. A short warm-up
run first fills the on-disk kernel caches, so no measured run compiles more than another;
every run still creates its rows from nothing, as a fresh stream would. samples/s are timed
by the trainer itself (from its first step), so the launcher's start is not counted; the
steady figure (``steady_samples_per_s``) counts from the end of the trainer's warm-up steps
(trainer/loop.py ``WARM_UP_STEPS``: kernel compilation, the collectives' first connections,
the tables' first growth, the first full version), the same for every configuration, and
is what a trainer that runs for hours sustains (``--steps`` must exceed the warm-up). CPU ranks get
``cores // N`` threads each, the lone process all cores' worth of them as 1 rank would.
Per rank of each run (the trainer's summary, ``step_by_rank``): ms per phase of the step
(input, agree, lookup, forward_backward, all_reduce, update, evaluate, publish) and of the
exchange inside lookup and update (ids out, the owner's find_or_insert, rows back, gradients
out, the owner's update), the bytes the exchange sent to other ranks per step, the ids each
owner received per step, and their imbalance (max / mean over the ranks). Unless
``--no-split``, each configuration runs a second time with ``streamrec train --sync-timings``
(the device drained at every phase boundary): those are the per-rank phase times printed,
exact but from slower steps; the throughput figures come from the unsynced run, whose own
per-rank host times are in the JSON too. The ranks pipeline their exchange as configured
(``trainer.pipeline_exchange``; ``STREAMREC_TRAINER__PIPELINE_EXCHANGE=false`` for the
unpipelined step), and the JSON says which.

Usage: streamrec bench trainer [--samples RUN_DIR|samples.parquet] [--batch 4096] [--steps 200] [--device cuda]
       streamrec bench trainer --nproc-per-node 1 2 4 [--samples ...] [--batch 4096] [--steps 600] [--device cuda] [--no-split]
(without --samples: 60 s of generated traffic, made into samples by the reference pipeline)
Writes var/bench/trainer-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from unittest import mock

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from torch import nn

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.modelstore.store import ModelStore
from streamrec.modelstore.writer import VersionWriter
from streamrec.embedding.collection import EmbeddingCollection
from streamrec.embedding.table import TableConfig
from streamrec.plumbing.config import load_config
from streamrec.trainer.dense_graph import GraphedDense
from streamrec.trainer.driver import Trainer, TrainOptions
from streamrec.model.batch import TABLES, SampleBatch, batch_from_table, dense_feature_names
from streamrec.model.network import CTRModel, ModelSpec
from streamrec.trainer.publisher import Publisher, PublishSettings
import streamrec.trainer.loop as trainer_loop
from streamrec.trainer.prefetch import END
from streamrec.trainer.reader import SampleReader
from streamrec.trainer.reader_process import ReaderSettings, SourceSpec
from streamrec.trainer.sources import sample_files
from streamrec.model.sparse import ModelInputs, SparseFeatures

from output import write_result  # bench/ is on sys.path (script dir; `streamrec bench` adds it)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class PredecodedReader(SampleReader):
    """The trainer's sample reader with the run's batches decoded (copied out of its slots, and
    pinned on CUDA) before the first step: ``start`` returns once ``batches`` of them are
    ready, ``get`` hands them out in order, then END. Ours then runs on the device-resident
    baseline's terms (its batches are built before timing too); the trainer's clock starts
    after ``start``."""

    def __init__(self, *args, batches: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches = batches
        self.ready: deque = deque()

    def start(self) -> "PredecodedReader":
        super().start()
        while len(self.ready) < self.batches:
            item = super().get()
            if isinstance(item, SampleBatch):
                item = replace(item, **{name: getattr(item, name).clone() for name in item._tensors()})
                item = item.pin_memory() if self.device.type == "cuda" else item
            self.ready.append(item)
            if item is END:
                break
        super().stop()
        return self

    def get(self, timeout: float | None = None):
        return self.ready.popleft() if self.ready else END


def run_ours(samples: str, batch: int, steps: int, device: str, publish_interval: float, sync_timings: bool, work: Path,
             name: str, graphs: bool = True, predecoded: bool = False) -> dict:
    """One trainer run from a fresh store (the first pass over the data creates rows as a stream does).
    ``predecoded``: its front end decodes every batch before the first step (PredecodedReader)."""
    cfg = load_config(overrides={
        "trainer.model_store": str(work / f"models-{name}"), "trainer.work_dir": str(work / f"work-{name}"),
        "trainer.batch_size": batch, "trainer.device": device, "trainer.publish_interval_s": publish_interval,
        "trainer.checkpoint_interval_s": 0.0, "trainer.frozen_baseline": False, "trainer.progress_interval_s": 3600.0,
        "trainer.prefetch_batches": 8, "trainer.cuda_graphs": graphs,
    }, environ={})
    trainer = Trainer(cfg, TrainOptions(files=[samples], loop_files=True, max_samples=batch * steps, sync_timings=sync_timings,
                                        fresh=True, progress=False))
    front_end = partial(PredecodedReader, batches=steps + 2) if predecoded else SampleReader
    with mock.patch.object(trainer_loop, "SampleReader", front_end):
        summary = trainer.run()
    return {k: summary[k] for k in ("samples_this_run", "elapsed_s", "samples_per_s", "ms_per_step", "auc_online",
                                    "publish_stall_ms_per_million_rows", "table_rows")} | {"versions": len(summary["published"])}


class StaticSparse(nn.Module):
    """The baseline's sparse side: one pre-sized nn.EmbeddingBag per table (sparse grads)."""

    def __init__(self, sizes: dict[str, int], dim: int) -> None:
        super().__init__()
        self.bags = nn.ModuleDict({name: nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for name, n in sizes.items()})
        for bag in self.bags.values():
            nn.init.normal_(bag.weight, std=0.01)

    def forward(self, batch: SampleBatch, ids: dict[str, torch.Tensor]) -> ModelInputs:
        emb = {}
        for name, x in ids.items():
            emb[name] = self.bags[name](x, torch.arange(len(x), device=x.device))  # one id per bag
        return SparseFeatures._assemble(batch, emb)


def run_baseline(table, spec: FeatureSpec, model_spec: ModelSpec, batch: int, steps: int, device: torch.device, n_batches: int,
                 graphs: bool = True, samples: str | None = None) -> dict:
    """The static-table baseline. Its batches: built on the device before timing (input time
    0), or, with ``samples``, from the same front end as ours: the trainer's sample reader over
    the same file in a loop (decoding in a process of its own, page-locked slots, one copy to
    the device per step), with ids mapped to table rows on the device (searchsorted
    over the sorted vocabulary: a static table's id map, done per step)."""
    batches = [batch_from_table(table.slice(i * batch, batch), spec, model_spec.history_len) for i in range(n_batches)]
    # Pre-size every table and remap ids to 0..N-1 (the static world the baseline needs).
    raw = {name: [SparseFeatures.table_ids(b)[name] for b in batches] for name in TABLES}
    if samples is not None:  # the front end reads the whole file, round after round
        raw = {name: [ids] for name, ids in SparseFeatures.table_ids(batch_from_table(table, spec, model_spec.history_len)).items()}
    sizes, remapped, vocabs = {}, {name: [] for name in TABLES}, {}
    for name, parts in raw.items():
        vocab = torch.unique(torch.cat(parts))
        sizes[name], vocabs[name] = len(vocab), vocab.to(device)
        for p in parts:
            remapped[name].append(torch.searchsorted(vocab, p).to(device))
    batches = [b.to(device) for b in batches]
    sparse = StaticSparse(sizes, model_spec.embedding_dim).to(device)
    model = CTRModel(model_spec).to(device)
    dense_opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=device.type == "cuda")  # as ours
    # the dense side as ours runs it (CUDA graphs for full batches on CUDA), so the ratio is the sparse side's
    forward = GraphedDense(model, batch, device) if device.type == "cuda" and graphs else model
    sparse_opt = torch.optim.Adagrad(sparse.parameters(), lr=0.05)
    times = {"input": 0.0, "lookup": 0.0, "forward_backward": 0.0, "update": 0.0}
    prefetch = None
    if samples is not None:
        settings = ReaderSettings(batch, model_spec.history_len, 8, None)
        prefetch = SampleReader(SourceSpec(files=[samples], loop=True), spec, settings, device, len(dense_feature_names(spec))).start()

    def next_batch(i: int) -> tuple[SampleBatch, dict[str, torch.Tensor]]:
        if prefetch is None:
            return batches[i % n_batches], {name: remapped[name][i % n_batches] for name in TABLES}
        b = prefetch.get()
        while not isinstance(b, SampleBatch):  # a chunk of rejected rows only
            b = prefetch.get()
        b = b.to(device, non_blocking=True)
        return b, {name: torch.searchsorted(vocabs[name], ids) for name, ids in SparseFeatures.table_ids(b).items()}

    def step(i: int, timed: bool) -> None:
        t_in = time.perf_counter()
        b, ids = next_batch(i)
        t0 = time.perf_counter()
        inputs = sparse(b, ids)
        if timed:
            sync(device)
        t1 = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(forward(*inputs.as_args()), b.label)
        dense_opt.zero_grad(set_to_none=True)
        sparse_opt.zero_grad(set_to_none=True)
        loss.backward()
        float(loss.detach())  # the same one host sync per step as ours
        t2 = time.perf_counter()
        dense_opt.step()
        sparse_opt.step()
        if timed:
            sync(device)
        t3 = time.perf_counter()
        times["input"] += t0 - t_in
        times["lookup"] += t1 - t0
        times["forward_backward"] += t2 - t1
        times["update"] += t3 - t2

    try:
        for i in range(5):
            step(i, False)
        sync(device)
        for i in range(steps):
            step(i, True)
        split = {k: 1000 * v / steps for k, v in times.items()}
        sync(device)
        t0 = time.perf_counter()
        for i in range(steps):
            step(i, False)
        sync(device)
        elapsed = time.perf_counter() - t0
    finally:
        if prefetch is not None:
            prefetch.stop()
    return {"samples_per_s": steps * batch / elapsed, "ms_per_step": 1000 * elapsed / steps, "ms_per_step_split": split,
            "table_rows": sizes, "front_end": "sample reader" if prefetch is not None else "device-resident batches"}


def publish_stall(rows: int, dim: int, device: torch.device, rows_per_step: int, work: Path) -> dict:
    """Training-thread pause to publish ``rows`` touched rows, vs a bare device->host copy."""
    configs = [TableConfig("t", dim, gpu_cache_rows=rows + 1024 if device.type == "cuda" else 0)]
    store = EmbeddingCollection(configs, device)
    table = store["t"]
    keys = torch.randperm(rows * 4)[:rows] + 1
    for lo in range(0, rows, 262144):
        pulled = table.find_or_insert(keys[lo: lo + 262144].to(device), now_ms=1)
        table.apply_gradients(pulled, torch.ones_like(pulled.rows))
    sync(device)
    pub = Publisher(store, VersionWriter(ModelStore(str(work / "stall"), "m")),
                    PublishSettings(interval_s=1.0, full_every=10, rows_per_step=rows_per_step))
    pauses = []
    t0 = time.perf_counter()
    pub.begin({"w": torch.zeros(10)}, {}, kind="full")  # every row: the touched-rows case at its largest
    pauses.append(time.perf_counter() - t0)
    while pub._task is not None:
        t0 = time.perf_counter()
        pub.pump()
        sync(device)
        pauses.append(time.perf_counter() - t0)
    pub.flush()
    weights = table.tiers.top.weights
    sync(device)
    t0 = time.perf_counter()
    weights[:rows].to("cpu", copy=True)
    bare = time.perf_counter() - t0
    store.close()
    total = sum(pauses)
    return {"rows": rows, "dim": dim, "rows_per_step": rows_per_step, "pause_ms_total": 1000 * total,
            "pause_ms_per_million_rows": 1000 * total / rows * 1e6, "max_single_pause_ms": 1000 * max(pauses),
            "slices": len(pauses), "bare_copy_ms": 1000 * bare, "ratio_to_bare_copy": total / bare}


@dataclass(frozen=True)
class Variant:
    """The N-rank runs again with settings of their own (``--variant``), compared in the same bench."""

    label: str
    settings: tuple[tuple[str, str], ...]

    @property
    def env(self) -> dict[str, str]:
        return dict(self.settings)

    @staticmethod
    def parse(text: str) -> "Variant":
        label, sep, rest = text.partition(":")
        pairs = [item.partition("=") for item in rest.split(",") if item]
        if not sep or not label or not pairs or any(not name or not eq for name, eq, _ in pairs):
            raise argparse.ArgumentTypeError(f"--variant {text!r}: expected LABEL:NAME=VALUE[,NAME=VALUE]")
        return Variant(label, tuple((name, value) for name, _, value in pairs))


def train_argv(samples: str, max_samples: int, batch: int, device: str, run_dir: Path) -> list[str]:
    """``streamrec train``'s arguments for one measured process: the sample file in a loop
    until ``max_samples``, into a store and work directory of its own under ``run_dir``."""
    return ["train", "--samples", samples, "--loop", "--max-samples", str(max_samples), "--batch-size", str(batch),
            "--device", device, "--no-frozen", "--no-announce", "--json", "--fresh", "--publish-interval", "5",
            "--model-store", str(run_dir / "models"), "--work-dir", str(run_dir / "work")]


def train_env(nproc: int) -> dict[str, str]:
    """The environment of each of ``nproc`` processes that share the host: its share of the cores."""
    return {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
            "STREAMREC_TRAINER__PROGRESS_INTERVAL_S": "3600"}


def run_ranks(nproc: int, launcher: bool, samples: str, batch: int, steps: int, device: str, work: Path,
              sync_timings: bool = False, variant: "Variant | None" = None) -> dict:
    """``streamrec train`` on ``nproc`` ranks (``launcher``: under torch's elastic launcher;
    ``variant``: with its settings in the environment); its summary's throughput and every
    rank's step figures (``sync_timings``: the device drained between phases)."""
    name = f"{nproc}-{'launched' if launcher else 'lone'}{'-synced' if sync_timings else ''}{f'-{variant.label}' if variant else ''}"
    argv = [*train_argv(samples, nproc * batch * steps, batch, device, work / name), *(["--sync-timings"] if sync_timings else [])]
    env = {**train_env(nproc), **(variant.env if variant else {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "streamrec.cli", *argv] \
        if launcher else [sys.executable, "-m", "streamrec.cli", *argv]
    if launcher:
        env["STREAMREC_TRAIN_WORKER"] = "1"  # the ranks run the training themselves
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: exit {done.returncode}: {done.stderr[-3000:]}")
    summary = json.loads(done.stdout)
    by_rank = summary["step_by_rank"]
    return {"ranks": nproc, "launcher": launcher, "variant": variant.label if variant else None, "env": variant.env if variant else {},
            "samples": summary["samples_this_run"], "elapsed_s": summary["elapsed_s"],
            "samples_per_s": summary["samples_per_s"], "samples_per_s_per_rank": summary["samples_per_s"] / nproc,
            "steady_samples_per_s": summary["steady_samples_per_s"],
            "ms_per_step": summary["ms_per_step"], "auc_online": summary.get("auc_online"), "by_rank": by_rank,
            "ids_received_imbalance": imbalance(by_rank)}


def run_side_by_side(nproc: int, samples: str, batch: int, steps: int, device: str, work: Path) -> dict:
    """``nproc`` lone ``streamrec train`` processes at once, each on its own GPU (its share of
    the cores on CPU), each with its own store: no collectives, no agreement. Their samples/s
    (each timed by its own trainer) summed, and each one's."""
    procs = []
    for i in range(nproc):
        argv = train_argv(samples, batch * steps, batch, device, work / f"{nproc}-side-by-side-{i}")
        env = train_env(nproc)
        if torch.device(device).type == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        procs.append(subprocess.Popen([sys.executable, "-m", "streamrec.cli", *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    summaries = []
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"side-by-side process {i}: exit {proc.returncode}: {err[-3000:]}")
        summaries.append(json.loads(out))
    steady = [s["steady_samples_per_s"] for s in summaries]
    each = [s["samples_per_s"] for s in summaries]
    return {"ranks": nproc, "launcher": False, "side_by_side": True, "variant": None, "env": {},
            "samples": sum(s["samples_this_run"] for s in summaries), "elapsed_s": max(s["elapsed_s"] for s in summaries),
            "samples_per_s": sum(each), "samples_per_s_per_rank": sum(each) / nproc, "samples_per_s_each": each,
            "steady_samples_per_s": sum(steady) if all(steady) else None,
            "ms_per_step": summaries[0]["ms_per_step"], "auc_online": None,
            "by_rank": [{**s["step_by_rank"][0], "rank": i} for i, s in enumerate(summaries)], "ids_received_imbalance": None}


def host_cpu_ticks() -> list[int] | None:
    """The host's CPU time so far, in ticks by kind (/proc/stat's first line: user, nice,
    system, idle, iowait, irq, softirq, steal), or None off Linux."""
    try:
        with open("/proc/stat") as stat:
            return [int(x) for x in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def host_cpu_shares(before: list[int] | None, after: list[int] | None) -> dict | None:
    """Of the host's CPU time between two ``host_cpu_ticks``: the busy share and the stolen
    share (a virtual machine's cores run by its hypervisor for others: a run that lost some
    is slower for reasons outside this trainer)."""
    if not before or not after:
        return None
    spent = [b - a for a, b in zip(before, after)]
    total = sum(spent) or 1
    return {"busy": (total - spent[3] - spent[4] - spent[7]) / total, "steal": spent[7] / total}


def describe_cpu(shares: dict) -> str:
    """``host_cpu_shares`` as the progress line prints it."""
    return f"host cores busy {shares['busy']:.0%}, stolen {shares['steal']:.1%}"


def paired_speedups(tries: list[dict], lone_tries: list[dict]) -> list[float]:
    """Each rep's samples/s over the lone process's of the same rep: the two ran back to back,
    so a host whose speed drifts over minutes changes both alike."""
    return [run["samples_per_s"] / lone["samples_per_s"] for run, lone in zip(tries, lone_tries)]


def imbalance(by_rank: list[dict]) -> float | None:
    """max / mean over the ranks of the ids each owner received per step (None on a lone process)."""
    received = [r["exchange"]["ids_received"] for r in by_rank if "exchange" in r]
    return max(received) / (sum(received) / len(received)) if received and sum(received) else None


SHOWN_PHASES = (("input", "input"), ("agree", "agree"), ("lookup", "lookup"), ("fwd_bwd", "forward_backward"),
                ("reduce", "all_reduce"), ("update", "update"), ("eval", "evaluate"), ("publish", "publish"))
SHOWN_EXCHANGE = (("x.ids", "ids"), ("x.find", "owner_find_or_insert"), ("x.rows", "rows"), ("x.grads", "grads"),
                  ("x.apply", "owner_update"))


def rank_table(run: dict) -> str:
    """One line per rank: ms/step per phase and per part of the exchange (x.*), KiB the
    exchange sent to other ranks per step (ids, rows back, gradients), per step the ids of its
    batch, the keys it sent (each table's distinct ids) and the keys it received as owner."""
    head = [name for name, _ in SHOWN_PHASES + SHOWN_EXCHANGE] + ["KiB.ids", "KiB.row", "KiB.grd", "ids", "keys", "keys.in"]
    lines = ["  rank " + " ".join(f"{h:>7}" for h in head)]
    for r in run["by_rank"]:
        cells = [f"{r['ms_per_step'][key]:7.2f}" for _, key in SHOWN_PHASES]
        x = r.get("exchange")
        if x:
            cells += [f"{x['ms'][key]:7.2f}" for _, key in SHOWN_EXCHANGE]
            cells += [f"{x['bytes_out'][k] / 1024:7.1f}" for k in ("ids", "rows", "grads")]
            cells += [f"{x[k]:7.0f}" for k in ("ids_asked", "ids_sent", "ids_received")]
        else:
            cells += [f"{'-':>7}"] * (len(SHOWN_EXCHANGE) + 6)
        lines.append(f"  {r['rank']:>4} " + " ".join(cells))
    if run["ids_received_imbalance"] is not None:
        first = run["by_rank"][0]
        lines.append(f"  keys received as owner, max / mean over ranks: {run['ids_received_imbalance']:.3f}; steps whose exchange went ahead: "
                     f"{first['exchange']['ahead']} of {first['steps']} (the owner's find_or_insert too: {first['exchange']['found_ahead']})")
    return "\n".join(lines)


def scaling(args: argparse.Namespace) -> None:
    device = args.device
    result = {"bench": "trainer_scaling", "device": device, "batch_per_rank": args.batch, "steps": args.steps,
              "samples_file": args.samples, "host": platform.node(), "torch": torch.__version__,
              "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "pipeline_exchange": load_config().trainer.pipeline_exchange}  # the ranks' config: this environment's
    with tempfile.TemporaryDirectory() as tmp:
        print("warm-up run (fills the Triton and inductor caches that every later process reads) ...", flush=True)
        run_ranks(1, False, args.samples, args.batch, 20, device, Path(tmp) / "warmup")
        several = [n for n in args.nproc_per_node if n > 1]
        # (ranks, under the launcher, variant, lone processes side by side)
        runs: list[tuple[int, bool, Variant | None, bool]] = [
            (1, False, None, False), (1, True, None, False), *((n, True, None, False) for n in several),
            *((n, True, v, False) for v in args.variant for n in several), *((n, False, None, True) for n in several if args.side_by_side)]
        result["runs"], result["reps"] = [], args.reps
        tries: dict[tuple[int, bool, Variant | None, bool], list[dict]] = {key: [] for key in runs}
        for rep in range(args.reps):  # configurations in turn, rep after rep: drifts of the host hit all alike
            for nproc, launcher, variant, side in runs:
                what = " lone processes side by side" if side else f" rank(s){' under the launcher' if launcher else ', lone process'}"
                print(f"{nproc}{what}{f' [{variant.label}]' if variant else ''}: "
                      f"{args.steps} steps of {args.batch} per rank{f' (rep {rep + 1} of {args.reps})' if args.reps > 1 else ''} ...",
                      flush=True)
                ticks = host_cpu_ticks()
                run = run_side_by_side(nproc, args.samples, args.batch, args.steps, device, Path(tmp)) if side else \
                    run_ranks(nproc, launcher, args.samples, args.batch, args.steps, device, Path(tmp), variant=variant)
                run["host_cpu"] = cpu = host_cpu_shares(ticks, host_cpu_ticks())
                tries[(nproc, launcher, variant, side)].append(run)
                steady = run["steady_samples_per_s"]
                print(f"  {run['samples_per_s']:,.0f} samples/s in total, {run['samples_per_s_per_rank']:,.0f} per rank; "
                      f"steady {f'{steady:,.0f}' if steady else 'n/a (no more steps than the warm-up)'}"
                      f"{'; ' + describe_cpu(cpu) if cpu else ''}",
                      flush=True)
        for nproc, launcher, variant, side in runs:
            key = (nproc, launcher, variant, side)
            run = max(tries[key], key=lambda r: r["samples_per_s"])  # the best rep, and every rep's figure
            run["samples_per_s_every_rep"] = [r["samples_per_s"] for r in tries[key]]
            run["steady_samples_per_s_every_rep"] = [r["steady_samples_per_s"] for r in tries[key]]
            run["host_cpu_every_rep"] = [r["host_cpu"] for r in tries[key]]
            run["speedup_over_lone_every_rep"] = paired_speedups(tries[key], tries[runs[0]])
            result["runs"].append(run)
            if args.split and not side:
                print(f"{nproc} rank(s){' under the launcher' if launcher else ''}{f' [{variant.label}]' if variant else ''}, again "
                      "with the device drained between phases (per-rank split) ...", flush=True)
                synced = run_ranks(nproc, launcher, args.samples, args.batch, args.steps, device, Path(tmp), sync_timings=True,
                                   variant=variant)
                run["split"] = {k: synced[k] for k in ("samples_per_s", "by_rank", "ids_received_imbalance")}
            shown = run.get("split", run)
            print(f"  best of {args.reps}: {run['samples_per_s']:,.0f} samples/s; per rank, ms/step"
                  f"{' (device drained between phases)' if 'split' in run else ''}, "
                  "exchange KiB sent to other ranks per step, ids received per step:", flush=True)
            print(rank_table(shown), flush=True)
    lone, lone_steady = result["runs"][0]["samples_per_s"], result["runs"][0]["steady_samples_per_s"]
    for run in result["runs"]:
        run["speedup_over_lone"] = run["samples_per_s"] / lone
        run["scaling_efficiency"] = run["samples_per_s"] / (run["ranks"] * lone)
        steady = run["steady_samples_per_s"]
        run["steady_speedup_over_lone"] = steady / lone_steady if steady and lone_steady else None
    names = [f"{r['ranks']}{'L' if r['launcher'] else ''}{' side by side' if r.get('side_by_side') else ''}" +
             (f" [{r['variant']}]" if r["variant"] else "") for r in result["runs"]]
    print("speed-up over the lone process, whole run (steady): " + ", ".join(
        f"{name}: {r['speedup_over_lone']:.2f}x ({f'{x:.2f}x' if (x := r['steady_speedup_over_lone']) else 'n/a'})"
        for name, r in zip(names, result["runs"])), flush=True)
    if args.reps > 1:
        print("the same, each rep over the lone process of its rep (median; every rep): " + ", ".join(
            f"{name}: {statistics.median(r['speedup_over_lone_every_rep']):.2f}x "
            f"({' '.join(f'{x:.2f}' for x in r['speedup_over_lone_every_rep'])})" for name, r in zip(names, result["runs"])), flush=True)
    write_result(args.out, f"trainer-scaling-{torch.device(device).type}", result)


def make_samples(run: Path) -> str:
    """60 s of generated traffic turned into samples (the reference pipeline), for a self-contained run."""
    print(f"generating samples into {run} ...", flush=True)
    for args in (["generate", "--out", str(run), "--duration", "60", "--rate", "3000", "--start-ms", "1700000000000"],
                 ["pipeline", "offline", str(run)]):
        subprocess.run([sys.executable, "-m", "streamrec.cli", *args], check=True, stdout=subprocess.DEVNULL)
    return str(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", help="a `pipeline offline` run dir or samples.parquet (default: generate 60 s of traffic)")
    parser.add_argument("--batch", type=int, default=1024, help="samples per training step (per rank with --nproc-per-node; default: %(default)s)")
    parser.add_argument("--steps", type=int, default=60, help="timed training steps of each run (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu | cuda[:N] (default: %(default)s, CUDA when present)")
    parser.add_argument("--publish-interval", type=float, default=5.0)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs for the dense model, ours and the baseline's")
    parser.add_argument("--per-table", action="store_true",
                        help="ours pulls and pushes table by table, not table-batched (ps/grouped.py): the A/B of that")
    parser.add_argument("--stall-rows", type=int, default=1_000_000)
    parser.add_argument("--stall-rows-per-step", type=int, default=262144)
    parser.add_argument("--out", default="var/bench", help="directory of the JSON result (default: ./var/bench, under the current directory)")
    parser.add_argument("--nproc-per-node", type=int, nargs="+", default=[], metavar="N",
                        help="scaling: 1 rank, then N ranks of `streamrec train` (see above)")
    parser.add_argument("--reps", type=int, default=1,
                        help="scaling: run every configuration this many times, in turn; report the best (and every rep's)")
    parser.add_argument("--variant", type=Variant.parse, action="append", default=[], metavar="LABEL:NAME=VALUE[,NAME=VALUE]",
                        help="scaling: also run the N-rank configurations with these environment settings (e.g. "
                             "pipelined:STREAMREC_TRAINER__PIPELINE_EXCHANGE=true), in turn with the others; repeatable")
    parser.add_argument("--side-by-side", action="store_true",
                        help="scaling: also run N lone processes at once, one per GPU, nothing exchanged: the ceiling of N ranks here")
    parser.add_argument("--no-split", dest="split", action="store_false",
                        help="scaling: skip the second run of each configuration with the device drained between phases")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.per_table and args.nproc_per_node:
        parser.error("--per-table applies to the in-process run, not to --nproc-per-node's ranks")
    if args.per_table:
        EmbeddingCollection.table_batched = False  # every step then takes the per-table path
    if args.samples is None:
        args.samples = make_samples(Path(tempfile.mkdtemp(prefix="streamrec-bench-")) / "run")
    if args.nproc_per_node:
        args.samples = str(sample_files([args.samples])[0])
        return scaling(args)
    path = str(sample_files([args.samples])[0])
    table = pq.read_table(path)
    spec = FeatureSpec()
    cfg = load_config(environ={})
    model_spec = ModelSpec.from_config(cfg.model, spec)
    n_batches = max(1, min(args.steps, table.num_rows // args.batch))
    result = {"bench": "trainer", "device": str(device), "batch": args.batch, "steps": args.steps, "samples_file": path,
              "host": platform.node(), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "table_batched": not args.per_table}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"baseline: nn.EmbeddingBag static tables, {args.steps} steps of {args.batch} on {device} ...", flush=True)
        graphs = not args.eager
        result["dense_cuda_graphs"] = device.type == "cuda" and graphs
        result["baseline"] = run_baseline(table, spec, model_spec, args.batch, args.steps, device, n_batches, graphs)
        print(f"  {result['baseline']['samples_per_s']:,.0f} samples/s  split {result['baseline']['ms_per_step_split']}", flush=True)
        print("baseline behind our front end (the trainer's Prefetcher over the same file) ...", flush=True)
        result["baseline_same_front_end"] = run_baseline(table, spec, model_spec, args.batch, args.steps, device, n_batches,
                                                         graphs, samples=path)
        print(f"  {result['baseline_same_front_end']['samples_per_s']:,.0f} samples/s  "
              f"split {result['baseline_same_front_end']['ms_per_step_split']}", flush=True)
        print("ours: warm-up (Triton compiles, allocator) ...", flush=True)
        run_ours(path, args.batch, 20, args.device, args.publish_interval, False, work, "warmup", graphs)
        print("ours, with phase sync ...", flush=True)
        result["ours_split"] = run_ours(path, args.batch, args.steps, args.device, args.publish_interval, True, work, "split", graphs)
        print(f"  split ms/step {json.dumps({k: round(v, 2) for k, v in result['ours_split']['ms_per_step'].items()})}", flush=True)
        print("ours, throughput ...", flush=True)
        result["ours"] = run_ours(path, args.batch, args.steps, args.device, args.publish_interval, False, work, "throughput", graphs)
        print(f"  {result['ours']['samples_per_s']:,.0f} samples/s", flush=True)
        print("ours, batches decoded before the first step (the device-resident baseline's terms) ...", flush=True)
        result["ours_predecoded"] = run_ours(path, args.batch, args.steps, args.device, args.publish_interval, False, work,
                                             "predecoded", graphs, predecoded=True)
        print(f"  {result['ours_predecoded']['samples_per_s']:,.0f} samples/s", flush=True)
        ours_ms = 1000 * args.batch / result["ours"]["samples_per_s"]
        predecoded_ms = 1000 * args.batch / result["ours_predecoded"]["samples_per_s"]
        result["ratio_step_time_ours_predecoded_over_baseline"] = predecoded_ms / result["baseline"]["ms_per_step"]
        result["ratio_step_time_ours_over_baseline_same_front_end"] = ours_ms / result["baseline_same_front_end"]["ms_per_step"]
        result["ratio_step_time_ours_over_baseline"] = ours_ms / result["baseline"]["ms_per_step"]
        print(f"  step time, ours over the baseline on equal terms: {result['ratio_step_time_ours_predecoded_over_baseline']:.2f}x "
              f"with batches decoded beforehand, {result['ratio_step_time_ours_over_baseline_same_front_end']:.2f}x behind the "
              f"same front end; ours live over the device-resident baseline: {result['ratio_step_time_ours_over_baseline']:.2f}x",
              flush=True)
        print(f"publish stall for {args.stall_rows:,} touched rows ...", flush=True)
        result["publish_stall"] = publish_stall(args.stall_rows, cfg.model.embedding_dim, device, args.stall_rows_per_step, work)
        print(f"  {json.dumps(result['publish_stall'])}", flush=True)
    write_result(args.out, f"trainer-{device.type}", result)


if __name__ == "__main__":
    main()
