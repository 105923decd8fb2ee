"""``streamrec``: the one command-line entry point.

Every subcommand reads the same configuration (packaged defaults < ``--config`` file <
``STREAMREC_*`` environment < flags) and takes ``--bootstrap`` to use an external Kafka
cluster instead of the embedded broker.

One module per command group adds its sub-command and holds its handler: kafka, setup
(and config), generate, pipeline, train, serve, store, demo (and report), bench, experiments. A handler
imports what it needs when it runs, so that the command line starts fast.
"""

from __future__ import annotations

import argparse
import sys
import tomllib

from streamrec import __version__
from streamrec.cli import bench, demo, experiments, generate, kafka, pipeline, serve, setup, store, train
from streamrec.cli.common import Commands, add_common_flags, config_from
from streamrec.plumbing.config import ConfigError, default_config_text
from streamrec.plumbing.logs import configure_logging

EPILOG = """\
configuration: packaged defaults < --config FILE (or $STREAMREC_CONFIG, or ./streamrec.toml)
< environment (STREAMREC_<SECTION>__<KEY>, e.g. STREAMREC_KAFKA__BOOTSTRAP) < flags.
`streamrec config` prints the effective configuration.
"""

# in the order `streamrec --help` lists them
COMMANDS = (kafka.add_parser, setup.add_setup_parser, generate.add_parser, pipeline.add_parser, train.add_parser,
            serve.add_parser, experiments.add_parser, store.add_parser, setup.add_config_parser, demo.add_demo_parser,
            demo.add_report_parser, bench.add_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrec",
        description="Streaming online learning for large sparse recommendation models.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"streamrec {__version__}")
    add_common_flags(parser)
    commands = Commands(parser.add_subparsers(dest="command", metavar="COMMAND", required=True),
                        tomllib.loads(default_config_text()))  # the defaults are shown in the flags' help
    for add in COMMANDS:
        add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # `train --nproc-per-node` starts its ranks with the same arguments
    configure_logging(verbose=getattr(args, "verbose", False))
    from streamrec.modelstore.store import CorruptVersion
    from streamrec.plumbing.bus.broker import BrokerError
    from streamrec.plumbing.bus.clients import BusUnavailable
    from streamrec.plumbing.bus.kafka_dist import KafkaJarsError

    try:
        return args.handler(args, config_from(args))
    except (ConfigError, BrokerError, BusUnavailable, KafkaJarsError, FileExistsError, FileNotFoundError, ValueError,
            ConnectionError, TimeoutError, CorruptVersion) as exc:
        print(f"streamrec: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from streamrec.pipelines.job_jar import JobJarError
        from streamrec.pipelines.pipeline_service import PipelineError
        from streamrec.trainer.driver import TrainingError

        if not isinstance(exc, (TrainingError, PipelineError, JobJarError)):
            raise
        print(f"streamrec: error: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("streamrec: interrupted", file=sys.stderr)
        return 130
