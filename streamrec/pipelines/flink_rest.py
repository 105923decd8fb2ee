"""Flink's REST API: job status and cancel, the same for the embedded mini-cluster and a
real cluster (both serve it; the embedded one on 127.0.0.1:<flink.rest_port>)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


class FlinkUnreachable(ConnectionError):
    """No Flink REST endpoint answers, or it answers that it is not ready yet (a starting
    JobManager says 503): either way, ask again later."""


# the job's sinks by the name of their vertex (pipelines/java/.../SampleJob.java) -> JobInfo field
SINK_FIELDS = {"samples topic": "samples_out", "DLQ topic": "dlq_out", "features topic": "features_out"}


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    name: str
    state: str
    duration_s: float
    records_in: int  # records read by the sources (Kafka events)
    records_out: int  # records written by all sinks: samples_out + dlq_out + features_out for the pipeline job
    tasks_running: bool = False  # every task deployed and initialised (state restored, sinks ready)
    samples_out: int = 0  # samples written to the samples topic
    dlq_out: int = 0  # rejected events written to the DLQ
    features_out: int = 0  # feature-state records written to the features topic

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def outputs(self) -> str:
        """What "records out" is made of, each sink of the pipeline job by name (another job's: the sum)."""
        if self.records_out and not (self.samples_out or self.dlq_out or self.features_out):
            return f"{self.records_out:,} records out"
        return f"{self.samples_out:,} samples, {self.dlq_out:,} DLQ, {self.features_out:,} feature records out"


def _sink_counts(vertices: list[dict]) -> dict[str, int]:
    """Records each sink wrote (a Kafka sink's Writer vertex: the records it read), by JobInfo
    field; ``records_out`` is their sum, with the Writers of any other job."""
    counts = {"records_out": 0}
    for vertex in vertices:
        if "Writer" not in vertex["name"]:
            continue
        written = vertex.get("metrics", {}).get("read-records", 0)
        counts["records_out"] += written
        field = next((f for sink, f in SINK_FIELDS.items() if f"{sink}: Writer" in vertex["name"]), None)
        if field:
            counts[field] = counts.get(field, 0) + written
    return counts


class FlinkRest:
    def __init__(self, address: str, timeout_s: float = 5.0) -> None:
        self.base = f"http://{address}"
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str):
        request = urllib.request.Request(self.base + path, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 503:  # the JobManager is up but still starting its services
                raise FlinkUnreachable(f"the Flink REST endpoint at {self.base} is not ready yet (HTTP 503 on {path})") from exc
            raise RuntimeError(f"Flink REST {method} {path}: HTTP {exc.code} {exc.read()[:300]!r}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise FlinkUnreachable(f"no Flink REST endpoint answers at {self.base} ({exc})") from exc
        return json.loads(body) if body else {}

    def jobs(self) -> list[JobInfo]:
        return [self._job(job) for job in self._call("GET", "/jobs/overview").get("jobs", [])]

    def _job(self, job: dict) -> JobInfo:
        """One job of the overview, with its records in and out from the job's detail."""
        records_in, counts, tasks_running = 0, {"records_out": 0}, False
        try:
            vertices = self._call("GET", f"/jobs/{job['jid']}").get("vertices", [])
            tasks_running = bool(vertices) and all(v.get("status") == "RUNNING" for v in vertices)
            records_in = sum(v.get("metrics", {}).get("write-records", 0) for v in vertices if v["name"].startswith("Source"))
            counts = _sink_counts(vertices)
        except RuntimeError:
            pass  # the job just went away; report what the overview says
        return JobInfo(job["jid"], job["name"], job["state"], job.get("duration", 0) / 1000, records_in,
                       tasks_running=tasks_running, **counts)

    def overview(self) -> dict:
        """The cluster's summary: ``slots-total``, ``slots-available``, ``taskmanagers``, job counts."""
        return self._call("GET", "/overview")

    def cancel(self, job_id: str) -> None:
        self._call("PATCH", f"/jobs/{job_id}?mode=cancel")

    def wait_running(self, name: str, timeout_s: float, all_tasks: bool = False) -> JobInfo:
        """Wait until a job called ``name`` runs (an embedded cluster takes seconds to start);
        ``all_tasks``: until every task runs too (the job is RUNNING while its tasks still
        initialise state and the transactional Kafka sinks)."""
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                for job in self.jobs():
                    if job.name == name and job.state == "RUNNING" and (job.tasks_running or not all_tasks):
                        return job
            except FlinkUnreachable as exc:
                last_error = exc
            time.sleep(0.5)
        raise TimeoutError(f"job {name!r} was not running after {timeout_s:.0f} s ({last_error or 'not listed'})")
