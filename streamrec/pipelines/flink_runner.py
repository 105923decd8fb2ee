"""Runs the streaming job (pipelines/java/, settings from pipelines/job.py) on the embedded
mini-cluster or a Flink cluster.

The job is Java: the client builds its graph here through PyFlink's gateway and a real
cluster needs no Python at all: ``--jobmanager host:port`` ships the same JobGraph with
the job's jar (pipelines/job_jar.py; the Kafka connector is inside it). The embedded
mini-cluster lives in this process's PyFlink JVM and serves Flink's REST API on
``127.0.0.1:<rest_port>``, so `status` and `cancel` talk to both the same way
(pipelines/flink_rest.py).

Recovery: checkpoints (RocksDB, incremental) go to ``checkpoint_dir/<job id>/chk-N`` and
are kept on cancel and on failure; a new submission resumes from the newest complete one
unless told to start fresh. A failing job restarts from its last checkpoint without end
(exponential delay, capped at ``restart_max_backoff_s``), and on the embedded mini-cluster
:class:`TaskManagerKeeper` replaces a TaskManager that a fatal task error stopped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from streamrec.pipelines.checkpoints import checkpoint_uri, latest_checkpoint
from streamrec.pipelines.checkpoints import prepare as prepare_checkpoints
from streamrec.pipelines.embedded_state import LOG_DIR
from streamrec.pipelines.job import JobSpec
from streamrec.pipelines.job_jar import ensure_job_jar

log = logging.getLogger("streamrec.pipeline")


@dataclass(frozen=True)
class RunOptions:
    """How the job runs; from the [flink] config section (:meth:`from_config`)."""

    jars_dir: Path
    checkpoint_dir: str | Path  # a local path or a URI the cluster writes (pipelines/checkpoints.py)
    job_name: str
    parallelism: int
    checkpoint_interval_ms: int
    state_backend: str
    jobmanager: str  # host:port of a Flink cluster's REST endpoint; empty = embedded
    rest_port: int  # the embedded mini-cluster's REST port
    jvm_options: str  # the embedded mini-cluster's JVM (PyFlink's gateway), e.g. "-XX:+UseParallelGC"
    resume: bool = True  # from the newest complete checkpoint (`submit --fresh`: False)
    watermark_interval_ms: int = 200
    buffer_timeout_ms: int = 100
    restart_max_backoff_s: float = 10.0  # the longest wait between two restarts of a failing job
    log_dir: Path = LOG_DIR  # the PyFlink JVM's Flink log (and the embedded mini-cluster's), unless FLINK_LOG_DIR is set

    @classmethod
    def from_config(cls, cfg, fresh: bool = False) -> "RunOptions":
        f = cfg.flink
        return cls(jars_dir=f.resolved_jars_dir(), checkpoint_dir=f.checkpoint_dir, job_name=f.job_name,
                   parallelism=f.parallelism, checkpoint_interval_ms=int(f.checkpoint_interval_s * 1000),
                   state_backend=f.state_backend, jobmanager=f.jobmanager, rest_port=f.rest_port,
                   jvm_options=f.jvm_options, resume=not fresh, watermark_interval_ms=f.watermark_interval_ms,
                   buffer_timeout_ms=f.buffer_timeout_ms, restart_max_backoff_s=f.restart_max_backoff_s)


def flink_config(opts: RunOptions, restore_from: str | None) -> dict[str, str]:
    if opts.state_backend not in ("rocksdb", "hashmap"):
        raise ValueError(f"state backend must be rocksdb or hashmap, got {opts.state_backend!r}")
    if opts.parallelism < 1:
        raise ValueError(f"parallelism must be >= 1, got {opts.parallelism}")
    if opts.watermark_interval_ms < 1 or opts.buffer_timeout_ms < 1:
        raise ValueError(f"flink.watermark_interval_ms and flink.buffer_timeout_ms must be >= 1 (0 flushes every record), "
                         f"got {opts.watermark_interval_ms} and {opts.buffer_timeout_ms}")
    if opts.restart_max_backoff_s < 1:
        raise ValueError(f"flink.restart_max_backoff_s must be >= 1, got {opts.restart_max_backoff_s}")
    conf = {
        "execution.runtime-mode": "streaming",
        "pipeline.name": opts.job_name,
        "pipeline.jars": ";".join(job_jars(opts)),
        "parallelism.default": str(opts.parallelism),
        "pipeline.auto-watermark-interval": f"{opts.watermark_interval_ms} ms",
        "execution.buffer-timeout.interval": f"{opts.buffer_timeout_ms} ms",
        "pipeline.object-reuse": "true",
        "state.backend.type": opts.state_backend,
        "state.backend.incremental": "true",
        # no operator uses Flink timers (each stage keeps its deadlines in memory and
        # checkpoints them as raw keyed state, which heap timers on RocksDB would claim)
        "state.backend.rocksdb.timer-service.factory": "ROCKSDB",
        "state.backend.rocksdb.predefined-options": "FLASH_SSD_OPTIMIZED",
        "taskmanager.memory.managed.size": "512m",
        "execution.checkpointing.interval": f"{opts.checkpoint_interval_ms} ms",
        "execution.checkpointing.mode": "EXACTLY_ONCE",
        "execution.checkpointing.dir": checkpoint_uri(opts.checkpoint_dir, for_flink=True),
        "execution.checkpointing.externalized-checkpoint-retention": "RETAIN_ON_CANCELLATION",
        "execution.checkpointing.min-pause": f"{max(100, opts.checkpoint_interval_ms // 4)} ms",
        # a broker outage fails the job's Kafka clients: restart from the last checkpoint for as
        # long as it lasts, and at most restart_max_backoff_s after the broker is back
        "restart-strategy.type": "exponential-delay",
        "restart-strategy.exponential-delay.initial-backoff": "1 s",
        "restart-strategy.exponential-delay.max-backoff": f"{int(opts.restart_max_backoff_s * 1000)} ms",
        "restart-strategy.exponential-delay.attempts-before-reset-backoff": str(2**31 - 1),
    }
    if opts.jobmanager:
        host, _, port = opts.jobmanager.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--jobmanager must be host:port of the cluster's REST endpoint, got {opts.jobmanager!r}")
        conf.update({"execution.target": "remote", "rest.address": host, "rest.port": port})
    else:
        conf.update({"rest.bind-address": "127.0.0.1", "rest.address": "127.0.0.1", "rest.port": str(opts.rest_port)})
    if restore_from is not None:
        conf["execution.state-recovery.path"] = restore_from
    return conf


def _execution_environment(conf, remote: bool):
    """The environment the job is built in: the embedded mini-cluster, or a cluster's REST endpoint.

    Why not ``get_execution_environment(conf)`` for both: outside ``flink run`` (no context
    environment) it builds a *local* environment, which overrides ``execution.target`` and
    ran a ``--jobmanager`` job on a private mini-cluster inside this process. The public
    constructor picks the executor that ``execution.target`` (``remote``) names.
    """
    from pyflink.datastream import StreamExecutionEnvironment
    from pyflink.java_gateway import get_gateway

    if not remote:
        return StreamExecutionEnvironment.get_execution_environment(conf)
    jvm = get_gateway().jvm
    return StreamExecutionEnvironment(jvm.org.apache.flink.streaming.api.environment.StreamExecutionEnvironment(conf._j_configuration))


def _set_gateway_jvm_options(options: str) -> None:
    """Add ``options`` to the PyFlink gateway JVM this process is about to start, which
    hosts the embedded mini-cluster: through JVM_ARGS, which PyFlink's launcher puts in
    front of Flink's own JVM options (FLINK_ENV_JAVA_OPTS would replace those, and with
    them the --add-opens flags Flink needs on Java 17)."""
    import os

    from pyflink import java_gateway

    if not options:
        return
    if getattr(java_gateway, "_gateway", None) is not None:
        log.warning("the PyFlink JVM is running already: flink.jvm_options (%s) not applied", options)
        return
    current = os.environ.get("JVM_ARGS", "")
    if options not in current:
        os.environ["JVM_ARGS"] = f"{current} {options}".strip()


def _quiet_pyflink_imports() -> None:
    """Importing PyFlink logs Apache Beam's INFO lines (BigQuery extras missing, type hints),
    which say nothing about this job: shown with -v only."""
    if not log.isEnabledFor(logging.DEBUG):
        for name in ("apache_beam", "pyflink"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _set_gateway_log_dir(log_dir: Path) -> None:
    """Point the Flink log of the PyFlink JVM this process is about to start at ``log_dir``.
    PyFlink's launcher otherwise writes it (and RocksDB's LOG files, which follow it) into
    ``pyflink/log/`` inside the installed package. A FLINK_LOG_DIR already set is kept."""
    import os

    from pyflink import java_gateway

    if "FLINK_LOG_DIR" in os.environ:
        return
    if getattr(java_gateway, "_gateway", None) is not None:
        log.warning("the PyFlink JVM is running already: its Flink log stays where it is (%s)", flink_log_file())
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ["FLINK_LOG_DIR"] = str(log_dir.resolve())


def flink_log_file() -> str | None:
    """The Flink log file of this process's PyFlink JVM, as the JVM itself was told (``log.file``)."""
    from pyflink.java_gateway import get_gateway

    return get_gateway().jvm.java.lang.System.getProperty("log.file")


def job_jars(opts: RunOptions) -> list[str]:
    """The URL of the job's jar (built here if its sources changed), for ``pipeline.jars``."""
    return [ensure_job_jar(opts.jars_dir).resolve().as_uri()]


def submit(spec: JobSpec, opts: RunOptions):
    """Submit the job; returns (PyFlink JobClient, the checkpoint it resumed from or None).

    On the embedded mini-cluster the job runs inside this process: keep it alive (wait on
    the client's execution result) for as long as the job should run.
    """
    _quiet_pyflink_imports()
    from pyflink.common import Configuration
    from pyflink.java_gateway import get_gateway
    from pyflink.util.java_utils import add_jars_to_context_class_loader

    restore = latest_checkpoint(opts.checkpoint_dir) if opts.resume else None
    prepare_checkpoints(opts.checkpoint_dir)
    settings = spec.properties(restored=restore is not None)  # validates the spec before the JVM starts
    _set_gateway_log_dir(opts.log_dir)
    if not opts.jobmanager:
        _set_gateway_jvm_options(opts.jvm_options)
    conf = Configuration()
    for key, value in flink_config(opts, restore).items():
        conf.set_string(key, value)
    env = _execution_environment(conf, remote=bool(opts.jobmanager))
    add_jars_to_context_class_loader(job_jars(opts))  # the job's classes, for the gateway
    get_gateway().jvm.streamrec.flink.SampleJob.build(env._j_stream_execution_environment, settings)
    log.info("submitting %s (parallelism %d, %s state, resume from %s)", opts.job_name, opts.parallelism,
             opts.state_backend, restore or "nothing")
    return env.execute_async(opts.job_name), restore


class TaskManagerKeeper:
    """Starts a new TaskManager in the embedded mini-cluster for each one that stopped.

    Flink takes an exception thrown while a failed task closes its operators as fatal to the
    TaskManager, and the Kafka sink's writer may rethrow a failed send there (after a broker
    outage longer than its producers' timeouts). A cluster's TaskManager process exits and its
    supervisor starts a new one; the mini-cluster only stops it, and the job then restarts
    forever without a slot (NoResourceAvailableException).
    The mini-cluster is reached through the job client's private field (no public accessor).
    """

    def __init__(self, client) -> None:
        """``client``: the PyFlink JobClient of a job on the embedded mini-cluster."""
        self._cluster = _private_field(client._j_job_client, "miniCluster")
        self._task_managers = _private_field(self._cluster, "taskManagers")  # stopped ones stay listed
        self._wanted = self._running()

    def _running(self) -> int:
        return sum(not tm.getTerminationFuture().isDone() for tm in self._task_managers)

    def replace_stopped(self) -> int:
        """Start as many TaskManagers as have stopped since the job started; returns that number."""
        missing = self._wanted - self._running()
        # asked second: a cluster that closes (the job ended) says so before its TaskManagers stop
        if missing <= 0 or not self._cluster.isRunning():
            return 0
        for _ in range(missing):
            self._cluster.startTaskManager()
        return missing


def _private_field(obj, name: str):
    """The value of a private field of a Java object, through PyFlink's gateway."""
    field = obj.getClass().getDeclaredField(name)
    field.setAccessible(True)
    return field.get(obj)
