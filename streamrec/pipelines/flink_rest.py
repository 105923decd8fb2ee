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


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    name: str
    state: str
    duration_s: float
    records_in: int  # records read by the sources (Kafka events)
    records_out: int  # records written by the sinks (samples + DLQ)
    tasks_running: bool = False  # every task deployed and initialised (state restored, sinks ready)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


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
        out = []
        for job in self._call("GET", "/jobs/overview").get("jobs", []):
            records_in = records_out = 0
            tasks_running = False
            try:
                detail = self._call("GET", f"/jobs/{job['jid']}")
                vertices = detail.get("vertices", [])
                tasks_running = bool(vertices) and all(v.get("status") == "RUNNING" for v in vertices)
                for vertex in vertices:
                    metrics = vertex.get("metrics", {})
                    if vertex["name"].startswith("Source"):
                        records_in += metrics.get("write-records", 0)
                    if "Writer" in vertex["name"]:
                        records_out += metrics.get("read-records", 0)
            except RuntimeError:
                pass  # the job just went away; report what the overview says
            out.append(JobInfo(job["jid"], job["name"], job["state"], job.get("duration", 0) / 1000, records_in, records_out,
                               tasks_running))
        return out

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
