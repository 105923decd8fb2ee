"""Runs the SQL job (pipelines/job_sql.py) on the embedded mini-cluster or a Flink cluster.

The job is pure SQL plus a Java function jar, so the client compiles it here and a real
cluster needs no Python at all: ``--jobmanager host:port`` ships the same JobGraph with
the connector and function jars. The embedded mini-cluster lives in this process's
PyFlink JVM and serves Flink's REST API on ``127.0.0.1:<rest_port>``, so `status` and
`cancel` talk to both the same way (pipelines/flink_rest.py).

Recovery: checkpoints (RocksDB, incremental) go to ``checkpoint_dir/<job id>/chk-N`` and
are kept on cancel and on failure; a new submission resumes from the newest complete one
unless told to start fresh.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pipelines.flink_jars import jar_urls, verify_jars
from pipelines.job_sql import JobSpec, statements
from pipelines.udf_jar import ensure_udf_jar

log = logging.getLogger("streamrec.pipeline")


@dataclass(frozen=True)
class RunOptions:
    jars_dir: Path
    checkpoint_dir: Path
    job_name: str = "streamrec-pipeline"
    parallelism: int = 1
    checkpoint_interval_ms: int = 2000
    state_backend: str = "rocksdb"
    jobmanager: str = ""  # host:port of a Flink cluster's REST endpoint; empty = embedded
    rest_port: int = 8081  # the embedded mini-cluster's REST port
    resume: bool = True
    watermark_interval_ms: int = 200


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The newest complete checkpoint (a ``chk-N`` dir with its ``_metadata``) of any job."""
    done = [meta.parent for meta in Path(checkpoint_dir).glob("*/chk-*/_metadata")]
    return max(done, key=lambda d: (d.stat().st_mtime, int(d.name.split("-")[1])), default=None)


def flink_config(opts: RunOptions, restore_from: Path | None) -> dict[str, str]:
    if opts.state_backend not in ("rocksdb", "hashmap"):
        raise ValueError(f"state backend must be rocksdb or hashmap, got {opts.state_backend!r}")
    if opts.parallelism < 1:
        raise ValueError(f"parallelism must be >= 1, got {opts.parallelism}")
    verify_jars(opts.jars_dir)
    jars = [*jar_urls(opts.jars_dir), ensure_udf_jar(opts.jars_dir).resolve().as_uri()]
    conf = {
        "execution.runtime-mode": "streaming",
        "pipeline.name": opts.job_name,
        "pipeline.jars": ";".join(jars),
        "parallelism.default": str(opts.parallelism),
        "table.local-time-zone": "UTC",
        "pipeline.auto-watermark-interval": f"{opts.watermark_interval_ms} ms",
        "pipeline.object-reuse": "true",
        "state.backend.type": opts.state_backend,
        "state.backend.incremental": "true",
        # timers on the heap (they are checkpointed all the same): the OVER and interval-join
        # operators register one per key and timestamp, and RocksDB timers cost a write each
        "state.backend.rocksdb.timer-service.factory": "HEAP",
        "state.backend.rocksdb.predefined-options": "FLASH_SSD_OPTIMIZED",
        "taskmanager.memory.managed.size": "512m",
        "execution.checkpointing.interval": f"{opts.checkpoint_interval_ms} ms",
        "execution.checkpointing.mode": "EXACTLY_ONCE",
        "execution.checkpointing.dir": Path(opts.checkpoint_dir).resolve().as_uri(),
        "execution.checkpointing.externalized-checkpoint-retention": "RETAIN_ON_CANCELLATION",
        "execution.checkpointing.min-pause": f"{max(100, opts.checkpoint_interval_ms // 4)} ms",
    }
    if opts.jobmanager:
        host, _, port = opts.jobmanager.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--jobmanager must be host:port of the cluster's REST endpoint, got {opts.jobmanager!r}")
        conf.update({"execution.target": "remote", "rest.address": host, "rest.port": port})
    else:
        conf.update({"rest.bind-address": "127.0.0.1", "rest.address": "127.0.0.1", "rest.port": str(opts.rest_port)})
    if restore_from is not None:
        conf["execution.state-recovery.path"] = Path(restore_from).resolve().as_uri()
    return conf


def submit(spec: JobSpec, opts: RunOptions):
    """Submit the job; returns (TableResult, the checkpoint it resumed from or None).

    On the embedded mini-cluster the job runs inside this process: keep it alive (wait on
    the result) for as long as the job should run.
    """
    from pyflink.table import EnvironmentSettings, TableEnvironment

    restore = latest_checkpoint(opts.checkpoint_dir) if opts.resume else None
    Path(opts.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    settings = EnvironmentSettings.in_streaming_mode()
    env = TableEnvironment.create(settings)
    config = env.get_config()
    for key, value in flink_config(opts, restore).items():
        config.set(key, value)
    setup, inserts = statements(spec)
    for statement in setup:
        env.execute_sql(statement)
    statement_set = env.create_statement_set()
    for statement in inserts:
        statement_set.add_insert_sql(statement)
    log.info("submitting %s (parallelism %d, %s state, resume from %s)", opts.job_name, opts.parallelism,
             opts.state_backend, restore or "nothing")
    return statement_set.execute(), restore
