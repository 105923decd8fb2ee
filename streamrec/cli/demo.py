"""`streamrec demo` (the whole loop, measured) and `streamrec report` (a demo run's HTML report)."""

from __future__ import annotations

import argparse
from pathlib import Path

from streamrec.cli.common import Commands
from streamrec.plumbing.config import Config


def add_demo_parser(commands: Commands) -> None:
    demo = commands.add("demo", "the whole loop, measured: broker, Flink job, generator, trainer, serving node, probe; "
                                "prints a summary and writes a report under var/reports/", run_demo)
    demo.add_argument("--duration", type=float, default=180.0, help="seconds of live traffic (default 180)")
    demo.add_argument("--rate", type=float, default=300.0,
                      help="events/s (default 300: what the Flink job with RocksDB keeps up with on a 2-core machine beside the rest)")
    demo.add_argument("--bad-fraction", type=float, default=0.01, help="malformed events to inject (default 0.01)")
    demo.add_argument("--publish-interval", type=float, default=1.0, help="minimum seconds between published versions (default 1)")
    demo.add_argument("--attribution-window", type=float, default=5.0,
                      help="seconds a click may follow its impression (default 5; production configs use minutes)")
    demo.add_argument("--warmup-samples", type=int, default=3000,
                      help="samples before the first (frozen baseline) version (default 3000)")
    demo.add_argument("--drain", type=float, default=20.0,
                      help="seconds to keep running after the traffic so the last clicks get served (default 20)")
    demo.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines")
    demo.add_argument("--report-dir", default="var/reports", help="where the run's report goes (default var/reports)")
    demo.add_argument("--work-dir", default="var/demo", help="model store, checkpoints of the run (default var/demo)")
    demo.add_argument("--keep-broker", action="store_true", help="leave the embedded broker running afterwards")
    demo.add_argument("--keep-topics", action="store_true",
                      help="keep the run's topics afterwards (default: deleted; the report has every figure)")
    demo.add_argument("--data-dir", help="embedded broker data directory (kafka.data_dir)")
    demo.add_argument("--port", type=int, help="embedded broker port (kafka.embedded_port)")


def add_report_parser(commands: Commands) -> None:
    report = commands.add("report", "re-render a demo run's HTML report from its data (run.json)", print_report)
    report.add_argument("run_dir", nargs="?", help="a run directory (default: the newest under var/reports)")


def run_demo(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.demo import run_demo as run

    return run(args, cfg)


def print_report(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.demo.report import latest_run, render

    print(render(Path(args.run_dir) if args.run_dir else latest_run(Path("var/reports")))["html"])
    return 0
