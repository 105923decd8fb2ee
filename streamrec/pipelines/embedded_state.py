"""What an embedded pipeline leaves under ``var/flink/`` (relative to the working directory):
the Flink log, the pid file of a ``--detach`` run and the record of the last job.

The mini-cluster lives only as long as its ``pipeline submit`` process, and with it Flink's
REST API: the record lets `pipeline status` say how the last job ended (CANCELED, FINISHED,
FAILED) once nothing answers any more. A live cluster's answer always wins over it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import fields
from pathlib import Path

from streamrec.pipelines.flink_rest import JobInfo
from streamrec.plumbing.processes import process_alive

STATE_DIR = Path("var/flink")
LOG_DIR = STATE_DIR / "log"  # the Flink log of the mini-cluster and the PyFlink gateway (FLINK_LOG_DIR)
PID_FILE = STATE_DIR / "pipeline.pid"  # the process of a `submit --detach`, while it runs
SUBMIT_LOG = STATE_DIR / "pipeline.log"  # that process's output
RECORD_FILE = STATE_DIR / "last-job.json"
ENDED = {"FINISHED", "CANCELED", "FAILED"}
UNKNOWN = "UNKNOWN"  # the record says running, but its process is gone (killed before it could say how the job ended)


def write_pid(pid: int) -> None:
    PID_FILE.parent.mkdir(parents=True, exist_ok=True)
    PID_FILE.write_text(f"{pid}\n")


def _pid_in_file() -> int | None:
    try:
        return int(PID_FILE.read_text().strip())
    except (OSError, ValueError):
        return None


def release_pid_file(pid: int | None = None) -> None:
    """Remove the pid file if it names ``pid`` (default: this process): a job process ends."""
    if _pid_in_file() == (os.getpid() if pid is None else pid):
        PID_FILE.unlink(missing_ok=True)


def remove_stale_pid_file() -> int | None:
    """Remove the pid file of a process that is gone (killed before it could remove it); its pid."""
    pid = _pid_in_file()
    if pid is not None and not process_alive(pid):
        PID_FILE.unlink(missing_ok=True)
        return pid
    return None


def record_job(job: JobInfo, flink_log: str | None, error: str | None = None) -> None:
    """Write the record of this process's job (via temp + rename: a reader never sees half)."""
    RECORD_FILE.parent.mkdir(parents=True, exist_ok=True)
    body = {**job.as_dict(), "pid": os.getpid(), "flink_log": flink_log, "error": error,
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = RECORD_FILE.with_name(f"{RECORD_FILE.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    tmp.replace(RECORD_FILE)


def recorded_job() -> tuple[JobInfo, dict] | None:
    """The last job's record: (the job as last seen, the rest of the record), or None. A job
    recorded as running whose process is gone is UNKNOWN."""
    try:
        body = json.loads(RECORD_FILE.read_text())
    except (OSError, ValueError):
        return None
    names = {f.name for f in fields(JobInfo)}
    job = JobInfo(**{k: v for k, v in body.items() if k in names})
    if job.state not in ENDED and not process_alive(int(body.get("pid") or 0)):
        job = JobInfo(**{**job.as_dict(), "state": UNKNOWN})
    return job, {k: v for k, v in body.items() if k not in names}
