"""`streamrec pipeline offline | submit | status | cancel`: raw events into labelled samples."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Iterable, Iterator, TypeVar

from streamrec.cli.common import Commands, add_action
from streamrec.plumbing.config import Config, ConfigError

if TYPE_CHECKING:
    from streamrec.pipelines.pipeline_service import Status

T = TypeVar("T")


def add_parser(commands: Commands) -> None:
    pipeline = commands.add("pipeline", "turn raw events into labelled samples", run)
    actions = pipeline.add_subparsers(dest="pipeline_command", metavar="ACTION", required=True)
    _add_offline(actions, commands.defaults)
    _add_submit(actions, commands.defaults)
    for action, text in (("status", "jobs on the cluster (embedded or --jobmanager): state, events in, samples / DLQ / "
                                    "feature records out; once the embedded one has ended, its last job as recorded "
                                    "in var/flink/last-job.json"),
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
    offline.add_argument("--progress-every", type=float, default=5.0, metavar="S",
                         help="not on a terminal: a progress line on stderr every S seconds (default 5; on a terminal: a "
                              "progress bar)")


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

    if args.pipeline_command == "submit":
        return _submit(args, cfg)
    if args.pipeline_command == "cancel":
        cancelled = service.cancel(cfg, args.job_id)
        print(f"cancelled {', '.join(cancelled)}" if cancelled else f"no job named {cfg.flink.job_name!r} left to cancel")
        return 0
    _print_status(service.status(cfg), service.rest_address(cfg), args.json)
    return 0


def _submit(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.pipelines import pipeline_service as service
    from streamrec.pipelines.embedded_state import release_pid_file
    from streamrec.pipelines.flink_runner import RunOptions

    if args.detach:
        if cfg.flink.jobmanager:
            raise ConfigError("--detach is for the embedded mini-cluster; a --jobmanager job runs on the cluster anyway")
        return service.detach(sys.argv[1:], cfg)
    if cfg.flink.jobmanager:
        return service.submit_remote(service.job_spec(cfg, bounded=args.bounded), RunOptions.from_config(cfg, fresh=args.fresh))
    try:
        return service.run_embedded(cfg, service.job_spec(cfg, bounded=args.bounded), RunOptions.from_config(cfg, fresh=args.fresh))
    finally:
        release_pid_file()  # this process may be a `submit --detach`'s, whose pid file it names


def _print_status(status: Status, address: str, as_json: bool) -> None:
    """The jobs, each with its records in and out (the samples, DLQ and feature records the sinks wrote)."""
    if as_json:
        print(json.dumps([{**j.as_dict(), **({"recorded": status.recorded} if status.recorded else {})} for j in status.jobs],
                         indent=2))
        return
    if status.recorded:
        print(f"the embedded mini-cluster is not running; its last job, as recorded in {status.recorded['record']}"
              f" (Flink log: {status.recorded.get('flink_log')}):")
    elif not status.jobs:
        print(f"no jobs on {address}")
    for job in status.jobs:
        print(f"{job.job_id}  {job.name}  {job.state}  {job.duration_s:,.0f}s  {job.records_in:,} events in  {job.outputs()}")
    if status.recorded and status.recorded.get("error"):
        print(f"  it failed: {status.recorded['error']}")
    if any(job.state == "UNKNOWN" for job in status.jobs):
        print("  its process ended without recording how the job ended (killed?)")


def offline(args: argparse.Namespace, cfg: Config) -> int:
    from collections import Counter

    from streamrec.pipelines.samples import SampleBuilder, event_count, read_run, write_samples

    if args.row_group_rows < 1:  # before the build, not after it
        raise ValueError(f"--row-group-rows must be >= 1, got {args.row_group_rows}")
    builder = SampleBuilder(cfg.features)
    with _Progress("reading events", "events", event_count(args.run), args.progress_every) as progress:
        builder.add_all(_counted(read_run(args.run), progress))
    with _Progress("building samples", "samples", len(builder.impressions), args.progress_every) as progress:
        table = builder.build(progress=progress.update)
    samples_path, rejected_path = write_samples(table, builder.rejected, args.out or args.run, args.row_group_rows)
    labels = table.column("label").to_pylist()
    reasons = Counter(r.reason.split(":")[0] for r in builder.rejected)
    print(f"{len(labels):,} samples ({sum(labels):,} positive, {sum(labels) / max(1, len(labels)):.2%}) -> {samples_path}\n"
          f"{len(builder.rejected):,} rejected ({', '.join(f'{k}={v}' for k, v in sorted(reasons.items())) or 'none'}) -> {rejected_path}\n"
          f"{builder.duplicates:,} duplicate events ignored")
    return 0


class _Progress:
    """One phase of a long command: a tqdm bar on a terminal; otherwise (a log, CI) a line on
    stderr every ``every_s`` seconds, so a long phase is never silent. Either way a last line
    says what the phase did and how fast."""

    def __init__(self, what: str, unit: str, total: int | None, every_s: float) -> None:
        from tqdm import tqdm

        self.what, self.unit, self.total, self.every_s = what, unit, total, every_s
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=what, unit=f" {unit}", unit_scale=True, disable=not self.tty, file=sys.stderr)
        self.done, self.started = 0, time.monotonic()
        self.last_line = self.started

    def update(self, done: int) -> None:
        """``done`` so far (a running count, not an increment)."""
        self.bar.update(done - self.done)
        self.done = done
        if not self.tty and time.monotonic() - self.last_line >= self.every_s:
            self.last_line = time.monotonic()
            of = f" of {self.total:,}" if self.total else ""
            print(f"{self.what}: {done:,}{of} {self.unit} ({self._rate():,.0f} {self.unit}/s)", file=sys.stderr, flush=True)

    def _rate(self) -> float:
        return self.done / max(1e-9, time.monotonic() - self.started)

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()
        if exc[0] is None:
            print(f"{self.what}: {self.done:,} {self.unit} in {time.monotonic() - self.started:,.1f} s "
                  f"({self._rate():,.0f} {self.unit}/s)", file=sys.stderr, flush=True)


def _counted(records: Iterable[T], progress: _Progress, every: int = 8192) -> Iterator[T]:
    """``records``, telling ``progress`` how many have passed every ``every`` of them and at the end."""
    n = 0
    for n, record in enumerate(records, 1):
        if n % every == 0:
            progress.update(n)
        yield record
    progress.update(n)
