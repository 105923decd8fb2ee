"""`streamrec pipeline submit|status|cancel`: the job's lifecycle on either kind of cluster.

Embedded (default): the mini-cluster runs inside the submitting process, which stays in
the foreground printing progress until the job ends, Ctrl-C or SIGTERM (the job is then
cancelled; its last checkpoint is kept and the next submit resumes from it). ``--detach``
starts that process in the background with its log and PID under ``var/flink/``, where the
Flink log and the record of the last job go too (pipelines/embedded_state.py).
Remote (``--jobmanager``): the job graph is submitted to the cluster and the command
returns; the job runs there.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from streamrec.pipelines.checkpoints import checkpoint_uri, is_local
from streamrec.pipelines.embedded_state import (ENDED, PID_FILE, RECORD_FILE, SUBMIT_LOG, UNKNOWN, record_job, recorded_job,
                                                release_pid_file, remove_stale_pid_file, write_pid)
from streamrec.pipelines.flink_rest import FlinkRest, FlinkUnreachable, JobInfo
from streamrec.pipelines.flink_runner import RunOptions, TaskManagerKeeper, flink_log_file, job_jars, submit
from streamrec.pipelines.hanging import HangingTransactionSweeper
from streamrec.pipelines.job import JobSpec

log = logging.getLogger("streamrec.pipeline")

LOOK_INTERVAL_S = 2.0  # how often a running embedded job's counts are read (its record keeps the last)


class PipelineError(RuntimeError):
    """The job failed or could not start (the message says why and where the log is)."""


def rest_address(cfg) -> str:
    return cfg.flink.jobmanager or f"127.0.0.1:{cfg.flink.rest_port}"


def job_spec(cfg, bounded: bool = False) -> JobSpec:
    """The job for this config; creates its topics if missing (the features topic compacted;
    one reader per events partition)."""
    from streamrec.plumbing.bus.topics import COMPACTED, describe_topics, ensure_topics

    k, t = cfg.kafka, cfg.topics
    ensure_topics(k.bootstrap_servers, [t.events, t.samples, t.dlq, t.features], k.partitions, k.replication_factor,
                  k.connect_timeout_s, configs={t.features: COMPACTED})
    partitions = {info.name: info.partitions for info in describe_topics(k.bootstrap_servers, [t.events, t.features], k.connect_timeout_s)}
    return JobSpec.from_config(cfg, source_parallelism=partitions.get(t.events, 1), bounded=bounded,
                               features_partitions=partitions.get(t.features))


def _progress(job: JobInfo, started: float) -> str:
    return (f"job {job.job_id[:8]} {job.state}: {job.records_in:,} events in, {job.outputs()} "
            f"({job.records_in / max(1e-9, time.monotonic() - started):,.0f} events/s)")


def _warn_if_bounded_restore(spec: JobSpec, restored: str | None) -> None:
    """Kafka splits restored from a checkpoint keep the stopping offsets of the run that took it."""
    if spec.bounded and restored:
        print(f"warning: --bounded does not apply to partitions restored from {restored}: they keep the end "
              "offsets of the run that took the checkpoint (none, if it was unbounded). Use --fresh for a "
              "bounded run over the whole topic.", file=sys.stderr, flush=True)


def run_embedded(cfg, spec: JobSpec, opts: RunOptions, interval_s: float = 10.0) -> int:
    """Run on the in-process mini-cluster until the job ends or we are told to stop. A cancel,
    ours (Ctrl-C, SIGTERM) or through the REST API (`pipeline cancel`), is a clean end: 0."""
    if _embedded_alive(cfg):
        raise PipelineError(f"a Flink REST endpoint already answers at {rest_address(cfg)}: is a pipeline running? "
                           "(`streamrec pipeline status`, `streamrec pipeline cancel`)")
    client, restored = submit(spec, opts)
    keeper = TaskManagerKeeper(client)
    _warn_if_bounded_restore(spec, restored)
    job = _EmbeddedJob(cfg, client)
    print(f"pipeline job {job.job_id} submitted to the embedded mini-cluster "
          f"(REST http://{rest_address(cfg)}; {'resumed from ' + str(restored) if restored else 'fresh start'}; "
          f"Flink log {job.flink_log})", flush=True)
    stop, done, outcome = threading.Event(), threading.Event(), {}

    def wait_for_job() -> None:
        try:
            client.get_job_execution_result().result()  # returns when the job finished, raises when it failed or was cancelled
        except Exception as exc:  # noqa: BLE001 - reported below, with the job's own message
            outcome["error"] = exc
        finally:
            done.set()

    def on_signal(signum, frame) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    threading.Thread(target=wait_for_job, name="flink-job", daemon=True).start()
    sweeper = (HangingTransactionSweeper(spec.bootstrap, [spec.samples_topic, spec.dlq_topic, spec.features_topic],
                                         job_jars(opts)).start() if spec.exactly_once else None)
    last_look = last_print = time.monotonic()
    try:
        while not done.wait(0.5):
            if stop.is_set():
                print("stopping: cancelling the job (its last checkpoint is kept for the next submit)", flush=True)
                job.look()
                client.cancel().result()
                done.wait(60)
                break
            if keeper.replace_stopped():
                print("a TaskManager of the mini-cluster stopped on a fatal task error (the Flink log says which): "
                      "started a new one; the job restarts from its last checkpoint", flush=True)
            if time.monotonic() - last_look >= min(interval_s, LOOK_INTERVAL_S):  # counts for the record, too
                last_look = time.monotonic()
                if job.look() and time.monotonic() - last_print >= interval_s:
                    last_print = time.monotonic()
                    print(_progress(job.seen, job.started), flush=True)
    finally:
        if sweeper is not None:
            sweeper.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return job.end(stop.is_set(), outcome.get("error"), spec)


class _EmbeddedJob:
    """The job on this process's mini-cluster: what the REST API last said of it, and the record
    (pipelines/embedded_state.py) that outlives the mini-cluster."""

    def __init__(self, cfg, client) -> None:
        self.job_id, self.name = str(client.get_job_id()), cfg.flink.job_name
        self.rest, self.started = FlinkRest(rest_address(cfg)), time.monotonic()
        self.flink_log = flink_log_file()
        self.seen = JobInfo(self.job_id, self.name, "RUNNING", 0.0, 0, 0)
        record_job(self.seen, self.flink_log)

    def look(self) -> bool:
        """Ask the REST API about the job (its counts, for progress and the record); whether it answered."""
        try:
            self.seen = next(j for j in self.rest.jobs() if j.job_id == self.job_id)
            return True
        except (FlinkUnreachable, StopIteration, RuntimeError):
            return False

    def _record(self, state: str, error: str | None = None) -> None:
        duration = time.monotonic() - self.started
        record_job(JobInfo(**{**self.seen.as_dict(), "state": state, "duration_s": duration, "tasks_running": False}),
                   self.flink_log, error)

    def end(self, stopped: bool, error: Exception | None, spec: JobSpec) -> int:
        """Say (and record) how the job ended; raise PipelineError if it failed."""
        if stopped or (error is not None and _cancelled(error)):
            self._record("CANCELED")
            print(f"pipeline job {self.job_id} cancelled{'' if stopped else ' (through the REST API)'}; "
                  "its last checkpoint is kept for the next submit", flush=True)
            return 0
        if error is not None:
            message = next((line for line in str(error).splitlines() if "Exception" in line), str(error)[:500])
            self._record("FAILED", message)
            raise PipelineError(f"the pipeline job failed: {message} (the full trace is in the Flink log: {self.flink_log})")
        self._record("FINISHED")
        print(f"pipeline job {self.job_id} finished", flush=True)
        if spec.bounded:
            _wait_output_committed(spec)
        return 0


def _cancelled(error: Exception) -> bool:
    """Whether the job's execution result failed because the job was cancelled (not a failure)."""
    return "JobCancellationException" in str(error)


def _wait_output_committed(spec: JobSpec, timeout_s: float = 60.0) -> None:
    """A bounded job ends when its last transactions are committed, but the broker writes their
    commit markers just after: wait until read_committed readers see everything the job wrote,
    so a script reading its output next misses nothing."""
    from streamrec.plumbing.bus.topics import open_transactions

    topics = [spec.samples_topic, spec.dlq_topic, spec.features_topic]
    deadline = time.monotonic() + timeout_s
    while open_ := open_transactions(spec.bootstrap, topics):
        if time.monotonic() > deadline:
            print(f"warning: {', '.join(open_)} still hold(s) an open transaction {timeout_s:.0f} s after the job "
                  "finished (another transactional writer?): read_committed readers do not see past it yet",
                  file=sys.stderr, flush=True)
            return
        time.sleep(0.2)


def _embedded_alive(cfg) -> bool:
    try:
        FlinkRest(rest_address(cfg), timeout_s=1.0).jobs()
        return True
    except FlinkUnreachable:
        return False


def detach(argv: list[str], cfg, timeout_s: float = 120.0) -> int:
    """Start ``streamrec pipeline submit`` (without --detach) in the background; wait until it
    runs. Its output goes to var/flink/pipeline.log, its pid to var/flink/pipeline.pid (which
    it removes when it ends)."""
    remove_stale_pid_file()
    if PID_FILE.exists():
        raise PipelineError(f"a pipeline runs in the background already (pid {PID_FILE.read_text().strip()}, {PID_FILE}): "
                            "`streamrec pipeline status`, `streamrec pipeline cancel`")
    SUBMIT_LOG.parent.mkdir(parents=True, exist_ok=True)
    args = [a for a in argv if a != "--detach"]
    with open(SUBMIT_LOG, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", *args], stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    write_pid(proc.pid)
    rest = FlinkRest(rest_address(cfg))
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise PipelineError(f"the pipeline process exited with {proc.returncode} before its job ran; see {SUBMIT_LOG}")
            try:
                job = rest.wait_running(cfg.flink.job_name, timeout_s=2.0)
                print(f"pipeline job {job.job_id} running in the background (pid {proc.pid}, log {SUBMIT_LOG}, "
                      f"REST http://{rest_address(cfg)})")
                return 0
            except TimeoutError:
                continue
        os.killpg(proc.pid, signal.SIGTERM)
        raise TimeoutError(f"the pipeline job did not start within {timeout_s:.0f} s; see {SUBMIT_LOG}")
    except BaseException:
        if proc.poll() is not None:
            release_pid_file(proc.pid)
        raise


def _check_cluster(spec: JobSpec, opts: RunOptions) -> None:
    """Fail before the JVM starts when the cluster does not answer; warn about what would
    leave the job waiting (too few free slots) or unable to resume (node-local checkpoints)."""
    try:
        overview = FlinkRest(opts.jobmanager).overview()
    except FlinkUnreachable as exc:
        raise FlinkUnreachable(f"the cluster at {opts.jobmanager} does not answer: {exc}") from exc
    needed = max(spec.source_parallelism, opts.parallelism)
    free = overview.get("slots-available", 0)
    if free < needed:
        print(f"warning: the job needs {needed} task slots (a source reader per partition of "
              f"{spec.events_topic}: {spec.source_parallelism}; parallelism {opts.parallelism}) and the cluster at "
              f"{opts.jobmanager} has {free} free of {overview.get('slots-total', 0)}: its tasks wait for slots "
              "(and the job fails after Flink's slot.request.timeout)", file=sys.stderr, flush=True)
    host = opts.jobmanager.rpartition(":")[0]
    if is_local(opts.checkpoint_dir) and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: checkpoints go to {checkpoint_uri(opts.checkpoint_dir)} on each TaskManager's own disk, "
              "and the next submit looks for them on this machine: set flink.checkpoint_dir to storage all of "
              "them share (s3://, hdfs://, a shared mount)", file=sys.stderr, flush=True)


def submit_remote(spec: JobSpec, opts: RunOptions) -> int:
    _check_cluster(spec, opts)
    client, restored = submit(spec, opts)
    _warn_if_bounded_restore(spec, restored)
    job_id = client.get_job_id()
    print(f"pipeline job {job_id} submitted to {opts.jobmanager}"
          f"{' (resumed from ' + str(restored) + ')' if restored else ''}")
    return 0


@dataclass(frozen=True)
class Status:
    """Jobs as the cluster's REST API lists them or, when the embedded mini-cluster is gone,
    the last one as recorded (``recorded``: the record's path and what else it holds)."""

    jobs: list[JobInfo]
    recorded: dict | None = None


def status(cfg) -> Status:
    """The cluster's answer; for the embedded mini-cluster, once it is gone, the record of its last job."""
    try:
        return Status(FlinkRest(rest_address(cfg)).jobs())
    except FlinkUnreachable as exc:
        if cfg.flink.jobmanager:
            raise FlinkUnreachable(f"the cluster at {cfg.flink.jobmanager} does not answer: {exc}") from exc
        remove_stale_pid_file()
        last = recorded_job()
        if last is None:
            raise FlinkUnreachable("the embedded mini-cluster is not running (start it with `streamrec pipeline submit`) "
                                   f"and no job of it is recorded in {RECORD_FILE}: {exc}") from exc
        job, more = last
        if job.state not in ENDED | {UNKNOWN}:
            raise FlinkUnreachable(f"job {job.job_id} runs in process {more.get('pid')}, but its mini-cluster does not "
                                   f"answer (still starting? the Flink log: {more.get('flink_log')}): {exc}") from exc
        return Status([job], {"record": str(RECORD_FILE), **more})


# Flink job states with nothing left to cancel (ended, or a cancel already under way)
NOT_CANCELLABLE = {"FINISHED", "CANCELED", "FAILED", "CANCELLING", "SUSPENDED"}


def cancel(cfg, job_id: str | None) -> list[str]:
    """Cancel the given job, or every job with the configured name that has not ended: a
    job RESTARTING after a broker outage, say, as well as a RUNNING one."""
    rest = FlinkRest(rest_address(cfg))
    jobs = status(cfg).jobs
    targets = [j.job_id for j in jobs
               if (j.job_id == job_id if job_id else j.name == cfg.flink.job_name and j.state not in NOT_CANCELLABLE)]
    if job_id and not targets:
        raise ValueError(f"no job {job_id} on {rest_address(cfg)} (jobs: {', '.join(j.job_id for j in jobs) or 'none'})")
    for target in targets:
        rest.cancel(target)
    return targets
