"""`streamrec bench PART`: a benchmark script from bench/ (a source checkout)."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

from streamrec.cli.common import Commands
from streamrec.plumbing.config import Config

# each benchmark, as `streamrec bench --help` lists it (bench/bench_<part>.py; bench/RESULTS.md has the figures)
DESCRIPTIONS = {
    "generator": "traffic generator events/s, to files and to Kafka",
    "pipeline": "the Flink job's events/s (state backends, sustained) and click -> sample latency, vs plain Python",
    "ps": "embedding tables: lookup and update throughput (CPU, or CUDA when present); --ssd: the SSD tier at scale",
    "trainer": "training samples/s and per-step split vs a static nn.EmbeddingBag baseline; publish pause; "
               "--nproc-per-node: scaling over ranks",
    "serving": "HTTP QPS and p50/p99 latency vs concurrency, with and without request aggregation",
    "serving_swap": "applying a large delta in place and rolling it back, vs a fresh reload",
    "serving_runtime": "the model runtime in process: shape buckets (CUDA graphs, torch.compile) and worker streams, vs eager",
    "serving_decode": "a predict body to model tensors, vs the training path's pyarrow decoder",
    "serving_overload": "twice the capacity: a bounded queue with deadlines vs an unbounded queue",
    "serving_by_ids": "predict by ids over HTTP with many users' feature state loaded, vs per-request assembly",
    "features": "online features: assembly, store memory, the job's cost, event -> visible at the node",
    "feature_state": "online feature state at scale: bytes a user, snapshot load and write, updates applied/s",
}
PARTS = tuple(DESCRIPTIONS)
RESULTS_DIR = "var/bench"  # every benchmark's --out default, under the current directory


def _epilog() -> str:
    """The benchmarks with a line each, and where their flags and results are."""
    width = max(map(len, PARTS)) + 2
    rows = "\n".join(f"  {part:<{width}}{text}" for part, text in DESCRIPTIONS.items())
    return (f"benchmarks:\n{rows}\n\n"
            "`streamrec bench PART --help` shows that benchmark's own flags; every argument after PART is passed to it.\n"
            f"Each writes its results as JSON under ./{RESULTS_DIR}/ (--out DIR for another directory) and needs a source "
            "checkout (bench/).")


def add_parser(commands: Commands) -> None:
    bench = commands.add("bench", "run a benchmark from bench/ (results: JSON under ./var/bench/)", run,
                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_epilog())
    bench.add_argument("part", choices=PARTS, metavar="PART", help="which benchmark (listed below)")
    bench.add_argument("args", nargs=argparse.REMAINDER, metavar="...",
                       help="the benchmark's own flags (`streamrec bench PART --help`)")


def run(args: argparse.Namespace, cfg: Config) -> int:
    script = Path(__file__).resolve().parents[2] / "bench" / f"bench_{args.part}.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: `streamrec bench` runs from a source checkout")
    extra = list(args.args)
    if getattr(args, "bootstrap", None):
        extra = ["--bootstrap", args.bootstrap, *extra]
    sys.path.insert(0, str(script.parent))  # as `python bench/x.py` would: benchmarks import their siblings
    run_as_main(script, [f"streamrec bench {args.part}", *extra])
    return 0


def run_as_main(script: Path, argv: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``argv``, as `python script` would, except that
    ``argv[0]`` stays ours (runpy.run_path sets it to the path): argparse names the
    benchmark's usage line after it, so `--help` shows the command that ran it."""
    module = types.ModuleType("__main__")
    module.__file__ = str(script)
    saved_argv, saved_main = sys.argv, sys.modules["__main__"]
    sys.argv, sys.modules["__main__"] = argv, module
    try:
        exec(compile(script.read_bytes(), str(script), "exec"), module.__dict__)
    finally:
        sys.argv, sys.modules["__main__"] = saved_argv, saved_main
