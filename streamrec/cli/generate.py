"""`streamrec generate`: synthetic ad traffic, to Kafka or files.

Exit codes: 0 when every event was delivered, 2 for a configuration or connection error
at start, 3 when events were not delivered (the producer gave up on a record).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from streamrec.cli.common import Commands
from streamrec.plumbing.config import Config, ConfigError

log = logging.getLogger("streamrec")

EXIT_NOT_DELIVERED = 3  # like train's and pipeline's runtime failures


def add_parser(commands: Commands) -> None:
    g = commands.defaults["generator"]
    gen = commands.add("generate", "synthetic ad traffic with a known click model, to Kafka or files", run)
    gen.add_argument("--seed", type=int, help=f"random seed; same seed + start = same stream (generator.seed: {g['seed']})")
    gen.add_argument("--rate", type=float, help=f"events/s, impressions + clicks (generator.rate: {g['rate']:g})")
    gen.add_argument("--duration", type=float, help=f"simulated seconds of traffic (generator.duration_s: {g['duration_s']:g})")
    gen.add_argument("--bad-fraction", type=float,
                     help=f"extra malformed events per good impression (generator.bad_fraction: {g['bad_fraction']:g})")
    gen.add_argument("--max-disorder-ms", type=int,
                     help=f"bounded arrival disorder in ms (generator.max_disorder_ms: {g['max_disorder_ms']})")
    gen.add_argument("--out", metavar="DIR", help="write files to this new directory instead of Kafka")
    gen.add_argument("--format", choices=("parquet", "jsonl"), default="parquet", help="file format with --out (default: parquet)")
    gen.add_argument("--start-ms", type=int, help="event time of the first tick (default: now)")
    gen.add_argument("--fast", action="store_true", help="don't pace to wall-clock time (default with --out)")
    gen.add_argument("--no-truth", action="store_true", help="don't write the ground truth (topics.truth)")
    gen.add_argument("--atomic", action="store_true",
                     help="write the whole run in one Kafka transaction: read_committed consumers (the pipeline job) "
                          "see all of it at once, or none of it if the run fails (a backfill)")
    gen.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.generator.traffic import Traffic, TrafficConfig

    g = cfg.generator
    traffic_cfg = TrafficConfig(
        seed=g.seed if args.seed is None else args.seed,
        rate=g.rate if args.rate is None else args.rate,
        bad_fraction=g.bad_fraction if args.bad_fraction is None else args.bad_fraction,
        max_disorder_ms=g.max_disorder_ms if args.max_disorder_ms is None else args.max_disorder_ms,
        world=g.world,
    )
    duration = g.duration_s if args.duration is None else args.duration
    if duration <= 0:
        raise ConfigError(f"--duration must be > 0 seconds, got {duration}")
    start_ms = args.start_ms if args.start_ms is not None else int(time.time() * 1000)
    traffic = Traffic(traffic_cfg, start_ms)
    if args.atomic and args.out:
        raise ConfigError("--atomic is a Kafka transaction: it cannot be used with --out")
    transaction_timeout_ms = _transaction_timeout_ms(duration, pace=not args.fast) if args.atomic else None
    sink, pace, where = _sink(args, cfg, traffic, transaction_timeout_ms)
    from streamrec.generator.sinks import SinkError

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        summary = run_with_progress(traffic, sink, duration, pace, f"generate -> {where}", stop)
    except SinkError as exc:
        print(f"streamrec: error: {exc}", file=sys.stderr)
        return EXIT_NOT_DELIVERED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.json:
        print(json.dumps(summary.as_dict(), indent=2))
    else:
        print_generate_summary(summary)
    return 0


MAX_TRANSACTION_S = 900  # a broker's default transaction.max.timeout.ms


def _transaction_timeout_ms(duration_s: float, pace: bool) -> int:
    """An --atomic run is one transaction, which the broker aborts once it is older than this:
    a live run's duration and a minute for start-up and the last acknowledgements (a fast run's
    wall time is unknown: the broker's maximum)."""
    if pace and duration_s + 60 > MAX_TRANSACTION_S:
        raise ConfigError(f"--atomic is one Kafka transaction, which brokers end after {MAX_TRANSACTION_S // 60} minutes "
                          f"by default: a live --atomic run lasts at most {MAX_TRANSACTION_S - 60} s, got --duration {duration_s:g}")
    return int(min(MAX_TRANSACTION_S, duration_s + 60 if pace else MAX_TRANSACTION_S) * 1000)


def _sink(args: argparse.Namespace, cfg: Config, traffic, transaction_timeout_ms: int | None) -> tuple:
    """Where the events go (files with --out, else the events topic), whether to pace them to
    the wall clock, and a description for the progress bar."""
    from streamrec.generator.sinks import FileSink, KafkaSink

    if args.out:
        return FileSink(args.out, args.format), False, f"{args.out} ({args.format})"
    from streamrec.plumbing.bus.clients import make_producer
    from streamrec.plumbing.bus.topics import ensure_topics

    k = cfg.kafka
    ensure_topics(k.bootstrap_servers, [cfg.topics.events, cfg.topics.truth], k.partitions, k.replication_factor, k.connect_timeout_s)
    # At least once outside a transaction (consumers drop duplicate event ids): kafka-python's
    # idempotent producer, when the broker stays away, cannot be closed and prints the error
    # at exit (docs/kafka.md). One request in flight per broker keeps a partition's retried
    # batch ahead of the ones after it: reordered by a leader change, its events would fall
    # behind the job's watermark and go to the DLQ as late.
    delivery = ({"transactional_id": f"streamrec-generate-{traffic.run}-{os.getpid()}",
                 "transaction_timeout_ms": transaction_timeout_ms} if args.atomic
                else {"enable_idempotence": False, "max_in_flight_requests_per_connection": 1})
    producer = make_producer(k.bootstrap_servers, k.connect_timeout_s, **delivery)
    sink = KafkaSink(producer, cfg.topics.events, None if args.no_truth else cfg.topics.truth, atomic=args.atomic)
    return sink, not args.fast, f"Kafka {k.bootstrap_servers} topic {cfg.topics.events}"


PROGRESS_EVERY_S = 10.0  # a progress line this often when stderr is not a terminal


def run_with_progress(traffic, sink, duration: float, pace: bool, label: str, stop: threading.Event | None = None):
    """Run the generator with a progress bar on a terminal (a log line per PROGRESS_EVERY_S
    otherwise, and at once when the sink gives up on events). Rates count delivered events only.
    ``stop`` set (SIGTERM, Ctrl-C): the run ends after its current tick, complete."""
    from tqdm import tqdm

    from streamrec.generator.runner import generate

    rate = traffic.config.rate
    log.info("%s: %s s of traffic at %s events/s (about %s events), %s", label, f"{duration:,g}", f"{rate:,g}",
             f"{round(duration * rate):,}", "paced to the clock" if pace else "as fast as it goes")
    interactive = sys.stderr.isatty()
    bar = tqdm(total=round(duration), unit="sim-s", desc=label, disable=not interactive, file=sys.stderr)
    last_log = [time.monotonic()]

    def on_tick(batch, summary) -> None:
        bar.update(round((batch.end_ms - batch.start_ms) / 1000))
        bar.set_postfix(sent=summary.events, delivered=summary.delivered, failed=summary.failed,
                        ev_s=f"{summary.delivered_per_s:,.0f}")
        if not interactive and (summary.failed or time.monotonic() - last_log[0] >= PROGRESS_EVERY_S):
            last_log[0] = time.monotonic()
            log.log(logging.ERROR if summary.failed else logging.INFO, "%s: %s", label, progress_line(summary, duration))

    try:
        return generate(traffic, sink, duration, pace, on_tick, stop)
    finally:
        bar.close()


def progress_line(summary, duration: float) -> str:
    """How far a run got, in words: simulated seconds done, events, rate, time left."""
    done = (summary.end_ms - summary.start_ms) / 1000
    left_s = summary.wall_s * (duration - done) / done if done > 0 else float("nan")
    left = f", about {_duration(left_s)} left" if done < duration and left_s == left_s else ""
    return (f"{done:,.0f} of {duration:,.0f} s ({done / duration:.0%}), {summary.events:,} events sent, "
            f"{summary.delivered:,} delivered ({summary.delivered_per_s:,.0f} events/s), {summary.failed:,} failed{left}")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def print_generate_summary(s) -> None:
    bad = ", ".join(f"{k}={v}" for k, v in s.bad_events.items()) or "none"
    stopped = f" (stopped early: {(s.end_ms - s.start_ms) / 1000:,.0f} s of traffic)" if s.stopped_early else ""
    print(
        f"run {s.run} seed {s.seed}: {s.events:,} events in {s.wall_s:.1f}s ({s.events_per_s:,.0f} events/s){stopped}\n"
        f"  impressions {s.impressions:,}, clicks {s.clicks:,} (CTR {s.ctr:.2%}), injected bad events: {bad}\n"
        f"  catalogue: {s.items_alive_end:,} live items, {s.items_created:,} created so far\n"
        f"  Bayes-optimal on this stream: AUC {s.bayes_auc:.4f}, logloss {s.bayes_logloss:.4f}"
    )
