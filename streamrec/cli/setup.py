"""`streamrec setup kafka|flink-job|all` (one-time set-up, into the user cache) and
`streamrec config` (the effective configuration)."""

from __future__ import annotations

import argparse
import json

from streamrec.cli.common import Commands, add_action
from streamrec.plumbing.config import Config


def add_setup_parser(commands: Commands) -> None:
    setup = commands.add("setup", "one-time set-up steps (idempotent)", run_setup)
    steps = setup.add_subparsers(dest="setup_command", metavar="STEP", required=True)
    add_action(steps, "kafka", "resolve Apache Kafka's broker jars with Maven and verify them",
               "Resolve the embedded broker's pinned jars from Maven Central into the user cache "
               "(nothing is fetched when they verify) and print the directory.")
    job = add_action(steps, "flink-job", "build the Flink job's jar with Maven",
                     "Build the streaming job (streamrec/pipelines/java/) with Maven into the cache dir, "
                     "with the Kafka connector inside; nothing is built when the jar of the current sources is there.")
    job.add_argument("--jars-dir", help="cache directory (flink.jars_dir)")
    job.add_argument("--verify", action="store_true", help="only check that the jar is built; exit 3 if not")
    everything = add_action(steps, "all", "every step: kafka, then flink-job (what `make setup` runs)")
    everything.add_argument("--jars-dir", help="the Flink job's cache directory (flink.jars_dir)")


def add_config_parser(commands: Commands) -> None:
    commands.add("config", "print the effective configuration as JSON", print_config)


def run_setup(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.pipelines.job_jar import ensure_job_jar, verify_job_jar
    from streamrec.plumbing.bus.kafka_dist import KAFKA_VERSION, ensure_kafka_jars

    if args.setup_command in ("kafka", "all"):
        print(f"{ensure_kafka_jars()} (Apache Kafka {KAFKA_VERSION}'s jars, verified)", flush=True)
    if args.setup_command in ("flink-job", "all"):
        jars_dir = cfg.flink.resolved_jars_dir()
        jar = verify_job_jar(jars_dir) if getattr(args, "verify", False) else ensure_job_jar(jars_dir)
        print(f"{jar} (the pipeline job, built from streamrec/pipelines/java/)")
    return 0


def print_config(args: argparse.Namespace, cfg: Config) -> int:
    import dataclasses

    print(json.dumps(dataclasses.asdict(cfg), indent=2))
    return 0
