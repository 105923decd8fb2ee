"""`streamrec bench PART`: a benchmark script from bench/ (a source checkout)."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from streamrec.cli.common import Commands
from streamrec.plumbing.config import Config

PARTS = ("generator", "pipeline", "ps", "trainer", "serving", "serving_swap", "serving_runtime", "serving_decode", "serving_overload", "serving_by_ids",
         "features", "feature_state")


def add_parser(commands: Commands) -> None:
    bench = commands.add("bench", "run a benchmark from bench/ (writes JSON under bench/out/)", run)
    bench.add_argument("part", choices=PARTS, help="what to benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark script")


def run(args: argparse.Namespace, cfg: Config) -> int:
    script = Path(__file__).resolve().parents[2] / "bench" / f"bench_{args.part}.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: `streamrec bench` runs from a source checkout")
    extra = list(args.args)
    if getattr(args, "bootstrap", None):
        extra = ["--bootstrap", args.bootstrap, *extra]
    sys.argv = [str(script), *extra]
    sys.path.insert(0, str(script.parent))  # as `python bench/x.py` would: benchmarks import their siblings
    runpy.run_path(str(script), run_name="__main__")
    return 0
