"""What every `streamrec` command shares: the common flags, the way a command group adds its
sub-command, and the configuration the flags override."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from streamrec.plumbing.config import Config, load_config

Handler = Callable[[argparse.Namespace, Config], int]


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a flag given before the subcommand is not reset by the subparser's default.
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="TOML config file")
    parser.add_argument(
        "--bootstrap", metavar="HOST:PORT", default=argparse.SUPPRESS,
        help="external Kafka cluster (comma-separated brokers); default: the embedded broker",
    )
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")


class Commands:
    """The sub-commands of `streamrec`; ``defaults`` are the packaged settings, shown in the
    flags' help."""

    def __init__(self, subparsers: argparse._SubParsersAction, defaults: dict[str, Any]) -> None:
        self.subparsers, self.defaults = subparsers, defaults

    def add(self, name: str, help_text: str, handler: Handler, **kw) -> argparse.ArgumentParser:
        """A sub-command whose ``handler(args, cfg)`` returns the exit code."""
        parser = self.subparsers.add_parser(name, help=help_text, description=help_text, **kw)
        add_common_flags(parser)
        parser.set_defaults(handler=handler)
        return parser


def add_action(actions: argparse._SubParsersAction, name: str, help_text: str, description: str | None = None) -> argparse.ArgumentParser:
    """An action of a command group (``kafka up``, ``store ls``), with the common flags."""
    parser = actions.add_parser(name, help=help_text, description=help_text if description is None else description)
    add_common_flags(parser)
    return parser


def config_from(args: argparse.Namespace) -> Config:
    """The effective configuration: packaged defaults < ``--config`` file < environment < the flags."""
    overrides = {
        "kafka.bootstrap": getattr(args, "bootstrap", None),
        "kafka.partitions": getattr(args, "partitions", None),
        "kafka.embedded_port": getattr(args, "port", None) if getattr(args, "command", None) != "serve" else None,
        "kafka.data_dir": getattr(args, "data_dir", None),
        "kafka.embedded_brokers": getattr(args, "brokers", None),
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
