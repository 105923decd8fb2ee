"""`streamrec train`: continuous training, publishing versions to the model store."""

from __future__ import annotations

import argparse
import json
import os

from streamrec.cli.common import Commands
from streamrec.plumbing.config import Config


def add_parser(commands: Commands) -> None:
    t = commands.defaults["trainer"]
    train = commands.add("train", "continuous training from the samples topic (or sample files), publishing versions", run,
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog="Resumes from the newest checkpoint under trainer.work_dir/<model>/checkpoints when one exists.\n"
                                "Stops cleanly on Ctrl-C / SIGTERM: publishes what it trained, checkpoints, commits offsets.")
    train.add_argument("--samples", nargs="+", metavar="PATH",
                       help="train from these sample files or `pipeline offline` run dirs instead of the samples topic")
    train.add_argument("--truth", metavar="PATH|topic",
                       help="score the Bayes-optimal truth alongside: a generator run dir / truth.parquet, or 'topic'")
    train.add_argument("--max-samples", type=int, default=0, metavar="N",
                       help="stop once at least N samples are trained; a step trains a whole batch (--batch-size), "
                            "so 60000 at 1024 trains 61,440")
    train.add_argument("--max-seconds", type=float, default=0.0, help="stop after this many seconds")
    train.add_argument("--idle-exit", type=float, default=0.0, metavar="S", help="stop after S seconds without samples")
    train.add_argument("--fresh", action="store_true", help="start over (earlier checkpoints are moved aside, not deleted)")
    train.add_argument("--loop", action="store_true", help="read the sample files again and again (benchmarks)")
    train.add_argument("--model", help="model name (model.name)")
    train.add_argument("--model-store", help=f"model store root or URI (trainer.model_store: {t['model_store']})")
    train.add_argument("--work-dir", help=f"checkpoints and SSD tier (trainer.work_dir: {t['work_dir']})")
    train.add_argument("--batch-size", type=int, help=f"samples per step (trainer.batch_size: {t['batch_size']})")
    train.add_argument("--publish-interval", type=float, metavar="S",
                       help=f"seconds between versions (trainer.publish_interval_s: {t['publish_interval_s']:g})")
    train.add_argument("--full-every", type=int, help=f"deltas between full versions (trainer.full_every: {t['full_every']})")
    train.add_argument("--compact-every", type=int,
                       help=f"deltas between compactions of the chain, 0 = never (trainer.compact_every: {t['compact_every']})")
    train.add_argument("--checkpoint-interval", type=float, metavar="S",
                       help=f"seconds between checkpoints (trainer.checkpoint_interval_s: {t['checkpoint_interval_s']:g})")
    train.add_argument("--warmup-samples", type=int, help=f"samples before the frozen baseline (trainer.warmup_samples: {t['warmup_samples']})")
    train.add_argument("--device", help=f"auto | cpu | cuda[:N] (trainer.device: {t['device']})")
    train.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (trainer.metrics_port)")
    train.add_argument("--no-frozen", action="store_true", help="don't keep a frozen baseline (trainer.frozen_baseline)")
    announce = train.add_mutually_exclusive_group()
    announce.add_argument("--announce", dest="announce", action="store_const", const=True,
                          help="announce versions on the model-updates topic when training from --samples too (needs Kafka; "
                               "the default when reading the samples topic)")
    announce.add_argument("--no-announce", dest="announce", action="store_const", const=False,
                          help="don't announce versions (the default with --samples: serving nodes find them by polling the store)")
    train.add_argument("--json", action="store_true", help="print the final summary as JSON")
    train.add_argument("--sync-timings", action="store_true",
                       help="wait for the device between the step's phases: exact ms per phase in the summary, slower steps (benchmarks)")
    train.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                       help="train on N local ranks (one per GPU; gloo ranks on CPU) with sharded embeddings, "
                            "through torch's elastic launcher; across nodes use `torchrun ... -m streamrec.cli train`")


def run(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.trainer.distributed import WORKER_ENV, launch
    from streamrec.trainer.driver import TrainOptions, train

    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.nproc_per_node > 1 and "WORLD_SIZE" in os.environ and not os.environ.get(WORKER_ENV):
        # under torchrun already: a launcher of our own would start ranks inside each rank
        raise ValueError(f"this process is already rank {os.environ.get('RANK', '?')} of {os.environ['WORLD_SIZE']} under a launcher "
                         "(torchrun): give --nproc-per-node to torchrun, not to `streamrec train`")
    if args.nproc_per_node > 1 and not os.environ.get(WORKER_ENV):
        return launch(args.nproc_per_node, without_option(args.argv, "--nproc-per-node"))
    opts = TrainOptions(files=args.samples or [], truth=args.truth, max_samples=args.max_samples, max_seconds=args.max_seconds,
                        idle_exit_s=args.idle_exit, fresh=args.fresh, announce=args.announce,
                        loop_files=args.loop, sync_timings=args.sync_timings)
    summary = train(cfg, opts)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # rank 0 reports for all
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    scores = "  ".join(f"{s} AUC {summary[f'auc_{s}']:.4f} logloss {summary[f'logloss_{s}']:.4f}"
                       for s in ("online", "frozen", "bayes") if f"auc_{s}" in summary)
    print(f"trained {summary['samples_this_run']:,} samples in {summary['elapsed_s']:.1f} s "
          f"({summary['samples_per_s']:,.0f}/s on {summary['device']}); {summary['samples']:,} in total\n"
          f"last window: {scores or 'too few samples to score'}\n"
          f"published {len(summary['published'])} versions this run (last: {summary['version']}); "
          f"rejected samples: {summary['rejected'] or 'none'}")
    if "ranks" in summary:
        print("ranks: " + ", ".join(f"{i}: {r['samples']:,} samples, {sum(r['table_rows'].values()):,} rows"
                                    for i, r in enumerate(summary["ranks"])))


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value (``--opt N`` or ``--opt=N``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out
