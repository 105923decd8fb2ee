"""`streamrec pipeline offline | submit | status | cancel`: raw events into labelled samples."""

from __future__ import annotations

import argparse
import json
import sys

from streamrec.cli.common import Commands, add_action
from streamrec.plumbing.config import Config, ConfigError


def add_parser(commands: Commands) -> None:
    pipeline = commands.add("pipeline", "turn raw events into labelled samples", run)
    actions = pipeline.add_subparsers(dest="pipeline_command", metavar="ACTION", required=True)
    _add_offline(actions, commands.defaults)
    _add_submit(actions, commands.defaults)
    for action, text in (("status", "jobs on the cluster (embedded or --jobmanager) with their progress"),
                         ("cancel", "cancel the pipeline job (or JOB_ID); its last checkpoint is kept")):
        p = add_action(actions, action, text)
        p.add_argument("--jobmanager", metavar="HOST:PORT", help="REST endpoint of a Flink cluster (flink.jobmanager)")
        if action == "cancel":
            p.add_argument("job_id", nargs="?", help="a job id (default: every running job named flink.job_name)")
        else:
            p.add_argument("--json", action="store_true", help="machine-readable output")


def _add_offline(actions: argparse._SubParsersAction, defaults: dict) -> None:
    from streamrec.pipelines.samples import SAMPLE_ROW_GROUP_ROWS

    offline = add_action(actions, "offline", "build samples in-process from a `generate --out` run (no Flink)",
                         "Build labelled samples with point-in-time features from a generator run directory, "
                         "exactly (the reference implementation of the sample contract, docs/samples.md). "
                         "Writes samples.parquet and rejected.jsonl into the run directory (or --out).")
    offline.add_argument("run", help="directory written by `streamrec generate --out`")
    offline.add_argument("--out", help="output directory (default: the run directory)")
    feats = defaults["features"]
    offline.add_argument("--attribution-window-s", type=float,
                         help=f"click-to-impression window (features.attribution_window_s: {feats['attribution_window_s']:g})")
    offline.add_argument("--history-len", type=int, help=f"clicked items remembered per user (features.history_len: {feats['history_len']})")
    offline.add_argument("--windows-s", metavar="S,S", help=f"counter windows (features.windows_s: {','.join(map(str, feats['windows_s']))})")
    offline.add_argument("--row-group-rows", type=int, default=SAMPLE_ROW_GROUP_ROWS, metavar="N",
                         help=f"rows per row group of samples.parquet (default {SAMPLE_ROW_GROUP_ROWS}). The ranks of a sharded "
                              "trainer read whole groups each; where N divides the batch per rank, R ranks train exactly the "
                              "steps one rank trains at R times that batch (docs/distributed.md)")


def _add_submit(actions: argparse._SubParsersAction, defaults: dict) -> None:
    f, feats = defaults["flink"], defaults["features"]
    submit = add_action(actions, "submit", "run the Flink job: events topic -> samples topic + DLQ",
                        "Submit the streaming job (docs/pipeline.md) to the embedded Flink mini-cluster (default; runs in "
                        "the foreground until Ctrl-C / SIGTERM, or in the background with --detach) or, with "
                        "--jobmanager, to a Flink cluster. Resumes from the newest checkpoint unless --fresh.")
    submit.add_argument("--jobmanager", metavar="HOST:PORT", help="REST endpoint of a Flink cluster (flink.jobmanager)")
    submit.add_argument("--parallelism", type=int, help=f"operator parallelism (flink.parallelism: {f['parallelism']})")
    submit.add_argument("--state-backend", choices=("rocksdb", "hashmap"), help=f"(flink.state_backend: {f['state_backend']})")
    submit.add_argument("--state-cache-keys", type=int, metavar="N",
                        help=f"rocksdb: key states kept in memory per stage, 0 = off (flink.state_cache_keys: {f['state_cache_keys']})")
    submit.add_argument("--checkpoint-dir", help=f"checkpoint directory (flink.checkpoint_dir: {f['checkpoint_dir']})")
    submit.add_argument("--checkpoint-interval", type=float, metavar="S",
                        help=f"seconds between checkpoints (flink.checkpoint_interval_s: {f['checkpoint_interval_s']:g})")
    submit.add_argument("--delivery", choices=("exactly-once", "at-least-once"), help=f"(flink.delivery: {f['delivery']})")
    submit.add_argument("--attribution-window-s", type=float,
                        help=f"click attribution window (features.attribution_window_s: {feats['attribution_window_s']:g})")
    submit.add_argument("--bounded", action="store_true", help="stop at the events topic's current end (backfills, tests)")
    submit.add_argument("--fresh", action="store_true", help="ignore earlier checkpoints (offsets then come from the consumer group)")
    submit.add_argument("--detach", action="store_true", help="run the embedded job in the background (log in var/flink/)")


def run(args: argparse.Namespace, cfg: Config) -> int:
    if args.pipeline_command == "offline":
        return offline(args, cfg)
    from streamrec.pipelines import pipeline_service as service
    from streamrec.pipelines.flink_runner import RunOptions

    if args.pipeline_command == "submit":
        if args.detach:
            if cfg.flink.jobmanager:
                raise ConfigError("--detach is for the embedded mini-cluster; a --jobmanager job runs on the cluster anyway")
            return service.detach(sys.argv[1:], cfg)
        spec, opts = service.job_spec(cfg, bounded=args.bounded), RunOptions.from_config(cfg, fresh=args.fresh)
        return service.submit_remote(spec, opts) if cfg.flink.jobmanager else service.run_embedded(cfg, spec, opts)
    if args.pipeline_command == "cancel":
        cancelled = service.cancel(cfg, args.job_id)
        print(f"cancelled {', '.join(cancelled)}" if cancelled else f"no job named {cfg.flink.job_name!r} left to cancel")
        return 0
    jobs = service.status(cfg)
    if args.json:
        print(json.dumps([j.as_dict() for j in jobs], indent=2))
    elif not jobs:
        print(f"no jobs on {service.rest_address(cfg)}")
    for job in jobs if not args.json else []:
        print(f"{job.job_id}  {job.name}  {job.state}  {job.duration_s:,.0f}s  {job.records_in:,} events in  "
              f"{job.records_out:,} records out")
    return 0


def offline(args: argparse.Namespace, cfg: Config) -> int:
    from collections import Counter

    from streamrec.pipelines.samples import SampleBuilder, read_run, write_samples

    if args.row_group_rows < 1:  # before the build, not after it
        raise ValueError(f"--row-group-rows must be >= 1, got {args.row_group_rows}")
    spec = cfg.features
    builder = SampleBuilder(spec).add_all(read_run(args.run))
    table = builder.build()
    samples_path, rejected_path = write_samples(table, builder.rejected, args.out or args.run, args.row_group_rows)
    labels = table.column("label").to_pylist()
    reasons = Counter(r.reason.split(":")[0] for r in builder.rejected)
    print(f"{len(labels):,} samples ({sum(labels):,} positive, {sum(labels) / max(1, len(labels)):.2%}) -> {samples_path}\n"
          f"{len(builder.rejected):,} rejected ({', '.join(f'{k}={v}' for k, v in sorted(reasons.items())) or 'none'}) -> {rejected_path}\n"
          f"{builder.duplicates:,} duplicate events ignored")
    return 0
