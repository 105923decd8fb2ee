"""Per-step traces of ``streamrec train`` on one rank or several: where each step's time
goes, and where ranks wait for each other.

``record`` runs ``streamrec train`` (a lone process, or ``--nproc-per-node N`` ranks under
torch's launcher) with every rank's step loop instrumented: for each step, the host ms of
each phase (the trainer's own ``input``, ``agree``, ``lookup``, ``forward_backward``,
``all_reduce``, ``update``, ``evaluate``, ``publish`` timers) and the step's start and end
on the host's monotonic clock (one clock for every process of the host), and every garbage
collection's pause. Each rank writes ``trace-<rank>.jsonl`` (``trace-lone.jsonl``) into
``--out`` when it exits.

``record --torch-profile N`` also runs torch.profiler (host and, on CUDA, device activity)
over N steps after ``--skip`` on every rank, and writes each rank's chrome trace
(``profile-<rank>.json.gz``, for Perfetto or chrome://tracing) and its operators by host time
(``profile-<rank>.txt``): what a phase's host time is spent in, waits included.

``analyze`` reads such directories and reports, for the steps after ``--skip`` (the
warm-up): the mean and median cycle (one step start to the next) and phase times per
rank; the input tail (mean minus median of ``input``: steps that waited for the sample
reader); and, on several ranks, the skew at the agreement (how far apart the ranks reach
it, and what the rank that arrives last still spends in it: the agreement's own cost).
It writes them as JSON (``--json``). Compare two builds by recording each with its own
``PYTHONPATH``, in turn on one machine.

Usage:
  python bench/trace_trainer_steps.py record --out DIR [--nproc-per-node N] [--torch-profile 20 --skip 300] -- train --samples RUN --loop ...
  python bench/trace_trainer_steps.py analyze DIR [DIR ...] [--skip 200] [--json OUT.json]
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
from typing import Any

INSTRUMENTED = ("_step", "_next", "_between_steps")  # TrainingLoop methods whose phase times a step's record sums


def _instrument(out_dir: Path, profile_steps: int = 0, profile_from: int = 0) -> None:
    """Patch this process's TrainingLoop so that every step is recorded (written at exit);
    with ``profile_steps``, steps ``profile_from`` on run under torch.profiler."""
    import atexit
    import gc

    from streamrec.trainer import loop

    if profile_steps:
        _profile_steps(loop.TrainingLoop, out_dir, profile_steps, profile_from)

    records: list[dict[str, Any]] = []
    gc_started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            records.append({"k": "gc", "t0": gc_started[0], "ms": (time.perf_counter() - gc_started[0]) * 1e3,
                            "gen": info.get("generation")})

    gc.callbacks.append(on_gc)
    for name in INSTRUMENTED:
        original = getattr(loop.TrainingLoop, name)

        def traced(self, *args, __original=original, __name=name, **kwargs):
            before, t0 = dict(self.times), time.perf_counter()
            result = __original(self, *args, **kwargs)
            records.append({"k": __name, "t0": t0, "t1": time.perf_counter(), "step": self.state["step"],
                            "ph": {p: (self.times[p] - before[p]) * 1e3 for p in self.times if self.times[p] != before[p]}})
            return result

        setattr(loop.TrainingLoop, name, traced)

    def write() -> None:
        path = out_dir / f"trace-{os.environ.get('RANK', 'lone')}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))

    atexit.register(write)


def _profile_steps(training_loop: type, out_dir: Path, steps: int, first: int) -> None:
    """torch.profiler over ``steps`` steps of ``training_loop`` from step ``first``: each rank's
    chrome trace and its operators by host time, written when the last of them ends."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    original, running = training_loop._step, []

    def profiled(self, *args, **kwargs):
        step = self.state["step"]
        if step == first and not running:
            running.append(profile(activities=activities))
            running[0].start()
        try:
            return original(self, *args, **kwargs)
        finally:
            if running and step == first + steps - 1:
                prof = running.pop()
                prof.stop()
                rank = os.environ.get("RANK", "lone")
                prof.export_chrome_trace(str(out_dir / f"profile-{rank}.json.gz"))  # gzip: a few MB a step
                table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=60)
                (out_dir / f"profile-{rank}.txt").write_text(f"steps {first} to {first + steps - 1}\n{table}\n")

    training_loop._step = profiled


def record(args: argparse.Namespace, train_args: list[str]) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profiling = ["--torch-profile", str(args.torch_profile), "--skip", str(args.skip)] if args.torch_profile else []
    entry = [str(Path(__file__).resolve()), "rank", "--out", str(out), *profiling, "--", *train_args]
    if args.nproc_per_node > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc_per_node}", *entry]
        env = {**os.environ, "STREAMREC_TRAIN_WORKER": "1"}  # the ranks run the training themselves
    else:
        cmd, env = [sys.executable, *entry], dict(os.environ)
    done = subprocess.run(cmd, env=env)
    print(f"traces in {out}", file=sys.stderr)
    return done.returncode


def run_rank(args: argparse.Namespace, train_args: list[str]) -> None:
    _instrument(Path(args.out), args.torch_profile, args.skip)
    from streamrec.cli import main

    sys.argv = ["streamrec", *train_args]
    main()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _steps(path: Path, skip: int) -> tuple[list[dict[str, Any]], dict[int, list[float]] | None]:
    """One record per step after ``skip`` (its phases summed over the instrumented methods,
    its cycle: ms to the next step's start, and when this rank reached the agreement), and
    the GC pauses within those steps: per generation, [collections, ms] (None: no steps)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by_kind = {k: [r for r in rows if r["k"] == k] for k in INSTRUMENTED}
    nexts, steps, betweens = by_kind["_next"], by_kind["_step"], by_kind["_between_steps"]
    out = []
    for i in range(skip, min(len(nexts) - 1, len(steps), len(betweens))):
        phases: dict[str, float] = {}
        for part in (nexts[i], steps[i], betweens[i]):
            for p, ms in part["ph"].items():
                phases[p] = phases.get(p, 0.0) + ms
        out.append({"phases": phases, "cycle": (nexts[i + 1]["t0"] - nexts[i]["t0"]) * 1e3,
                    "agree_reached": nexts[i]["t1"] - phases.get("agree", 0.0) / 1e3, "agree_ms": phases.get("agree", 0.0)})
    if not out:
        return out, None
    begin, end = nexts[skip]["t0"], nexts[skip + len(out)]["t0"]
    pauses = [r for r in rows if r["k"] == "gc" and begin <= r["t0"] <= end]
    return out, {g: [sum(1 for r in pauses if r["gen"] == g), sum(r["ms"] for r in pauses if r["gen"] == g)] for g in (0, 1, 2)}


def analyze_dir(directory: Path, skip: int) -> dict[str, Any]:
    traces = sorted(directory.glob("trace-*.jsonl"))
    if not traces:
        raise FileNotFoundError(f"no trace-*.jsonl in {directory}")
    traced = {t.stem.removeprefix("trace-"): _steps(t, skip) for t in traces}
    ranks = {rank: steps for rank, (steps, _) in traced.items()}
    result: dict[str, Any] = {"dir": str(directory), "skip": skip, "ranks": {}}
    for rank, steps in ranks.items():
        phases = sorted({p for s in steps for p in s["phases"]})
        cycles = [s["cycle"] for s in steps]
        inputs = [s["phases"].get("input", 0.0) for s in steps]
        result["ranks"][rank] = {
            "steps": len(steps), "cycle_ms_mean": statistics.fmean(cycles), "cycle_ms_median": _median(cycles),
            "phase_ms_mean": {p: statistics.fmean(s["phases"].get(p, 0.0) for s in steps) for p in phases},
            "phase_ms_median": {p: _median([s["phases"].get(p, 0.0) for s in steps]) for p in phases},
            "input_tail_ms": statistics.fmean(inputs) - _median(inputs),
            "gc_in_window": traced[rank][1]}
    if len(ranks) > 1 and "lone" not in ranks:
        every = [ranks[r] for r in sorted(ranks, key=int)]
        n = min(map(len, every))
        skews, last_cost = [], []
        for i in range(n):
            reached = [steps[i]["agree_reached"] for steps in every]
            skews.append((max(reached) - min(reached)) * 1e3)
            last_cost.append(every[reached.index(max(reached))][i]["agree_ms"])
        result["agreement"] = {"skew_ms_mean": statistics.fmean(skews), "skew_ms_median": _median(skews),
                               "last_rank_agree_ms_mean": statistics.fmean(last_cost), "last_rank_agree_ms_median": _median(last_cost)}
    return result


def analyze(args: argparse.Namespace) -> None:
    results = [analyze_dir(Path(d), args.skip) for d in args.dirs]
    for r in results:
        print(f"{r['dir']} (steps after {r['skip']}):")
        for rank, x in r["ranks"].items():
            means = " ".join(f"{p}={ms:.2f}" for p, ms in x["phase_ms_mean"].items())
            print(f"  rank {rank}: cycle mean {x['cycle_ms_mean']:.2f} ms, median {x['cycle_ms_median']:.2f}; "
                  f"input tail {x['input_tail_ms']:.2f}; mean ms: {means}")
        if "agreement" in r:
            a = r["agreement"]
            print(f"  agreement: skew mean {a['skew_ms_mean']:.2f} ms, median {a['skew_ms_median']:.2f}; the last rank's "
                  f"agree {a['last_rank_agree_ms_mean']:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": "trainer_step_traces", "results": results}, indent=2))
        print(f"wrote {args.json}")


def main() -> None:
    argv = sys.argv[1:]
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run streamrec train with every step traced (train's arguments after --)")
    rec.add_argument("--out", required=True)
    rec.add_argument("--nproc-per-node", type=int, default=1)
    rank = sub.add_parser("rank", help="(internal) one traced rank")
    rank.add_argument("--out", required=True)
    for parser_ in (rec, rank):
        parser_.add_argument("--torch-profile", type=int, default=0, metavar="N",
                             help="also run torch.profiler over N steps after --skip, on every rank")
        parser_.add_argument("--skip", type=int, default=200, help="the warm-up steps before the profiled ones")
    an = sub.add_parser("analyze", help="steady per-phase times, input tail and agreement skew of recorded traces")
    an.add_argument("dirs", nargs="+")
    an.add_argument("--skip", type=int, default=200, help="warm-up steps left out (the trainer's WARM_UP_STEPS)")
    an.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.command in ("record", "rank") and not train_args:
        parser.error(f"{args.command}: give streamrec train's arguments after --")
    if args.command == "record":
        sys.exit(record(args, train_args))
    if args.command == "rank":
        run_rank(args, train_args)
    else:
        analyze(args)


if __name__ == "__main__":
    main()
