"""What the demo measures at the serving node, as a client would see it.

:class:`ServingProbe` follows the samples topic (read_committed, like the trainer) and sends
every new sample, label removed by the server's decoder, to the serving node's
``:predict``: the **online** score and the version that gave it. The same samples are
scored by the **frozen** model (the first version published, i.e. the model after
warm-up, loaded here once) and joined with the generator's **Bayes** click probability
from the truth topic. Each positive sample also carries what freshness needs: the click's
event time, when the sample became visible, and its (partition, offset) in the topic.
Every sample is also sent through the node's live experiment (streamrec/demo/experiment.py):
once per ad request, so that each user sees one variant and the node logs its answer.

:class:`VersionTimeline` polls the server's model status and the model store: when each
version was snapshotted and published (manifest) and applied (server).
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import orjson

from streamrec.model.batch import batch_from_table
from streamrec.model.inference import InferenceModel
from streamrec.generator.sinks import decode_truth_message
from streamrec.contracts.sample_wire import decode_samples
from streamrec.modelstore.store import ModelStore
from streamrec.demo.experiment import LiveExperiment, publish_copy
from streamrec.plumbing.bus.clients import make_consumer
from streamrec.serving.errors import NOT_LOADED

log = logging.getLogger("streamrec.demo")
CHUNK = 256  # instances per predict request


class ServingClient:
    """A keep-alive HTTP/JSON client of one serving node. Its requests are sent with
    ``x-prediction-log: off`` (answered, not logged) unless ``logged``: only the live
    experiment's answers may reach the prediction log, since grading joins each sample to
    the latest logged prediction of its (user, item), and the probes' other requests for
    the same impressions (direct scores, by-ids scores, replays) come later."""

    def __init__(self, address: str, model: str, admin_token: str = "") -> None:
        host, port = address.rsplit(":", 1)
        self._conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self.model, self.token = model, admin_token
        self._lock = threading.Lock()

    def call(self, method: str, path: str, body: bytes | None = None, admin: bool = False,
             request_id: str | None = None, logged: bool = False) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", "x-prediction-log": "on" if logged else "off"}
        if request_id is not None:
            headers["x-request-id"] = request_id
        if admin:
            headers["Authorization"] = f"Bearer {self.token}"
        with self._lock:
            for attempt in (1, 2):  # the server may have closed an idle keep-alive connection
                try:
                    self._conn.request(method, path, body=body, headers=headers)
                    response = self._conn.getresponse()
                    status, data = response.status, response.read()
                    break
                except (OSError, http.client.HTTPException):
                    self._conn.close()
                    if attempt == 2:
                        raise
        return status, orjson.loads(data) if data else {}

    def predict(self, instances: list[bytes]) -> tuple[int, dict]:
        return self.call("POST", f"/v1/models/{self.model}:predict", b'{"instances":[' + b",".join(instances) + b"]}")

    def predict_experiment(self, experiment: str, instances: list[bytes], request_id: str) -> tuple[int, dict]:
        """One user's instances through the experiment's route: the user's variant scores them,
        and the node logs the answer (the only requests of the demo it logs)."""
        return self.call("POST", f"/v1/experiments/{experiment}:predict", b'{"instances":[' + b",".join(instances) + b"]}",
                         request_id=request_id, logged=True)

    def status(self) -> dict:
        return self.call("GET", f"/v1/models/{self.model}")[1]

    def rollback(self, version: int | None = None) -> tuple[int, dict]:
        return self.call("POST", f"/v1/models/{self.model}:rollback", orjson.dumps({"version": version} if version else {}), admin=True)

    def reload(self) -> tuple[int, dict]:
        return self.call("POST", f"/v1/models/{self.model}:reload", b"{}", admin=True)


class AnsweredSample(NamedTuple):
    """A sample the experiment answered: (user_id, item_id, ts) as grading joins it, its label,
    its (partition, offset) in the samples topic, and the variant, model, version and score
    that answered it (what the node logged)."""

    user_id: int
    item_id: int
    ts: int
    label: int
    partition: int
    offset: int
    variant: str
    model: str
    version: int
    score: float


@dataclass
class ExperimentRecords:
    """What the probe's experiment requests got back."""

    requests: int = 0
    failed_requests: int = 0
    unscored: int = 0  # samples answered 503 before both variants had answered: a model not loaded yet
    skipped: set[tuple[int, int, int]] = field(default_factory=set)  # (user, item, ts) not sent: already trained on
    # one entry per sample a variant answered: its grading key, where it lies in the samples
    # topic and the answering version (to leave out what that version had trained on)
    answers: list[AnsweredSample] = field(default_factory=list)


@dataclass
class ProbeRecords:
    """One entry per scored sample (columns grow together)."""

    ts: list[int] = field(default_factory=list)
    label: list[int] = field(default_factory=list)
    online: list[float] = field(default_factory=list)
    version: list[int] = field(default_factory=list)
    frozen: list[float] = field(default_factory=list)
    event_id: list[str] = field(default_factory=list)
    user_id: list[int] = field(default_factory=list)
    sample_partition: list[int] = field(default_factory=list)
    sample_offset: list[int] = field(default_factory=list)
    # positives only, noted by a consumer that does nothing else: the freshness trail of the click
    click_ts: list[int] = field(default_factory=list)
    visible_ms: list[float] = field(default_factory=list)
    partition: list[int] = field(default_factory=list)
    offset: list[int] = field(default_factory=list)
    failed_requests: int = 0
    answered: bool = False  # the node has answered a predict: from then on a 503 is a failure
    unscored: int = 0  # samples that arrived before the server had a model
    skipped_trained: int = 0  # samples not scored: the served version had trained on them before the probe read them
    experiment: ExperimentRecords = field(default_factory=ExperimentRecords)


class BackgroundProbe:
    """A probe's threads, started and stopped together; the first error any of them raises
    is kept in ``error`` for the demo's main loop to report."""

    def __init__(self, *threads: tuple[str, Callable[[], None]]) -> None:
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._guarded(fn), name=name, daemon=True) for name, fn in threads]

    def _guarded(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by the demo's main loop
                self.error = exc
        return run

    def start(self):
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


class ServingProbe(BackgroundProbe):
    def __init__(self, bootstrap: str, samples_topic: str, truth_topic: str, client: ServingClient,
                 model_store: ModelStore, warmup_samples: int, live: LiveExperiment) -> None:
        self.warmup_samples = warmup_samples
        self.bootstrap, self.samples_topic, self.truth_topic = bootstrap, samples_topic, truth_topic
        self.client, self.model_store, self.live = client, model_store, live
        self.frozen_version: int | None = None
        self._trained_through: tuple[int, dict[int, int]] = (0, {})  # the last answering version, its samples offsets
        # chunks in order, off the samples thread (whose online scores must not wait); each over every connection
        self._chunks = ThreadPoolExecutor(1, thread_name_prefix="probe-experiment")
        self._pool = ThreadPoolExecutor(len(live.clients), thread_name_prefix="probe-experiment-request")
        self.records = ProbeRecords()
        self.bayes: dict[str, float] = {}
        self.frozen: InferenceModel | None = None
        super().__init__(("probe-samples", self._follow_samples), ("probe-visibility", self._note_visibility),
                         ("probe-truth", self._follow_truth))

    def stop(self) -> None:
        super().stop()
        self._chunks.shutdown(cancel_futures=True)
        self._pool.shutdown()
        if self.frozen is not None:  # stop() runs twice on the error path: close once
            self.frozen.close()
            self.frozen = None

    # ------------------------------------------------------------------ threads
    def _follow_samples(self) -> None:
        consumer = make_consumer(self.bootstrap, self.samples_topic, group_id=None, isolation_level="read_committed",
                                 auto_offset_reset="earliest", max_poll_records=2000)
        try:
            while not self._stop.is_set():
                for records in consumer.poll(200).values():
                    seen = time.time() * 1000
                    for i in range(0, len(records), CHUNK):
                        chunk = records[i:i + CHUNK]
                        fresh = self._not_yet_trained(chunk)
                        if len(fresh) < len(chunk):
                            self._skip(_others(chunk, fresh))
                        if fresh:
                            self._score(fresh, seen)
        finally:
            consumer.close()

    def _note_visibility(self) -> None:
        """When each positive sample became readable (read_committed), unaffected by scoring."""
        consumer = make_consumer(self.bootstrap, self.samples_topic, group_id=None, isolation_level="read_committed",
                                 auto_offset_reset="earliest")
        try:
            rec = self.records
            while not self._stop.is_set():
                for records in consumer.poll(100).values():
                    seen = time.time() * 1000
                    for r in records:
                        sample = orjson.loads(r.value)
                        if sample.get("label") == 1:
                            with self._lock:
                                rec.click_ts.append(sample["click_ts"])
                                rec.visible_ms.append(seen)
                                rec.partition.append(r.partition)
                                rec.offset.append(r.offset)
        finally:
            consumer.close()

    def _follow_truth(self) -> None:
        consumer = make_consumer(self.bootstrap, self.truth_topic, group_id=None, auto_offset_reset="earliest")
        try:
            while not self._stop.is_set():
                for records in consumer.poll(500).values():
                    rows = [row for r in records for row in decode_truth_message(r.value) if row["kind"] == "impression"]
                    with self._lock:
                        self.bayes.update((row["event_id"], row["p"]) for row in rows)
        finally:
            consumer.close()

    def _frozen_model(self) -> InferenceModel | None:
        """The first version trained on ``warmup_samples``: the model after warm-up, never updated.
        Published once as the frozen model's only version, for the experiment's frozen variant."""
        if self.frozen is None:
            for version in self.model_store.versions():
                if self.model_store.manifest(version).get("samples_trained", 0) >= self.warmup_samples:
                    self.frozen = InferenceModel.load(self.model_store, version)
                    publish_copy(self.model_store, version, self.live.frozen_store)
                    self.frozen_version = version
                    log.info("frozen baseline: version %d, published as %s", version, self.live.frozen_store.model)
                    break
        return self.frozen

    def _not_yet_trained(self, records: list) -> list:
        """``records`` less those the last answering version had trained on: a score it gives
        them says what it memorised (the analysis would leave it out), and scoring them would
        only put the probe further behind. Skipping them lets a probe that fell behind (a
        loaded box) catch up with the samples it can still score in time."""
        offsets = self._trained_through[1]
        return [r for r in records if r.offset >= offsets.get(r.partition, 0)]

    def _skip(self, records: list, experiment_only: bool = False) -> None:
        """Count ``records`` as skipped (trained on before they could be scored) and keep their
        grading keys, which the experiment's grade leaves out as it leaves out answers given
        by a version that had trained on them."""
        keys = []
        for r in records:
            sample = orjson.loads(r.value)
            keys.append((sample["user_id"], sample["item_id"], sample["ts"]))
        with self._lock:
            if not experiment_only:
                self.records.skipped_trained += len(records)
            self.records.experiment.skipped.update(keys)

    def _note_version(self, version: int) -> None:
        """The samples offsets of ``version`` (its manifest), once per version answered."""
        if version > self._trained_through[0]:
            try:
                offsets = self.model_store.manifest(version).get("offsets") or {}
            except (OSError, ValueError):  # garbage-collected or unreadable: keep the last one known
                return
            self._trained_through = (version, {int(p): int(o) for p, o in offsets.items()})

    def _score(self, records: list, seen_ms: float) -> None:
        """Score at the server (online) and here (frozen). The analysis drops samples the
        answering version had already trained on (possible while the probe catches up)."""
        values = [r.value for r in records]
        status, body = self.client.predict(values)
        if status == 503 and not self.records.answered:  # no version loaded yet: expected at the start only
            self.records.unscored += len(values)
            return
        if status != 200:  # a 503 once the node has answered counts: a node shedding most requests must fail the run
            self.records.failed_requests += 1
            log.warning("predict failed (%d): %s", status, body)
            return
        self.records.answered = True
        self._note_version(body["model_version"])
        self._chunks.submit(self._guarded(lambda: self._score_in_experiment(records)))
        frozen = self._frozen_model()
        if frozen is None:
            self.records.unscored += len(values)
            return
        table, index, rejected = decode_samples(values, frozen.feature_spec)
        if rejected or len(index) != len(values):
            raise RuntimeError(f"the samples topic holds samples the trainer's decoder rejects: {rejected[:3]}")
        batch = batch_from_table(table, frozen.feature_spec, frozen.model.spec.history_len)
        frozen_scores = frozen.predict(batch, now_ms=int(seen_ms))
        rec = self.records
        with self._lock:
            rec.ts.extend(table["ts"].to_pylist())
            rec.label.extend(table["label"].to_pylist())
            rec.online.extend(body["scores"])
            rec.version.extend([body["model_version"]] * len(values))
            rec.frozen.extend(frozen_scores.tolist())
            rec.event_id.extend(table["event_id"].to_pylist())
            rec.user_id.extend(table["user_id"].to_pylist())
            rec.sample_partition.extend(r.partition for r in records)
            rec.sample_offset.extend(r.offset for r in records)

    def _score_in_experiment(self, records: list) -> None:
        """Send the samples through the experiment, one request per (user, ts): an ad request.
        A request's logged time is its instances' latest ts and a sample is graded by the
        latest prediction at or before its own ts, so one user's earlier slates go apart.
        The requests go out over several connections at once: one at a time, the probe would
        fall behind the samples and the answering versions would have trained on them.
        A 503 because the user's variant has no version yet (the frozen model is published after
        warm-up) is start-up, not a failure."""
        requests: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (user, ts) -> [(record, item, label)]
        fresh = self._not_yet_trained(records)  # the experiment's requests run behind the direct ones
        if len(fresh) < len(records):
            self._skip(_others(records, fresh), experiment_only=True)
        for r in fresh:
            sample = orjson.loads(r.value)
            requests[(sample["user_id"], sample["ts"])].append((r, sample["item_id"], sample.get("label", 0)))
        groups = list(requests.items())
        clients = self.live.clients
        answers = self._pool.map(self._send_to_experiment, clients, [groups[i::len(clients)] for i in range(len(clients))])
        exp = self.records.experiment
        for (user, ts), group, (status, body) in [a for part in answers for a in part]:
            exp.requests += 1
            if status == 200:
                with self._lock:
                    exp.answers.extend(AnsweredSample(user, item, ts, label, r.partition, r.offset, body["variant"],
                                                      body["model"], body["model_version"], score)
                                       for (r, item, label), score in zip(group, body["scores"]))
            elif status == 503 and isinstance(body, dict) and str(body.get("error", {}).get("message", "")).startswith(NOT_LOADED):
                exp.unscored += len(group)  # the user's variant has no version yet: the frozen copy comes after warm-up
            else:
                exp.failed_requests += 1
                log.warning("experiment predict failed (%d): %s", status, body)

    def _send_to_experiment(self, client: ServingClient, groups: list) -> list:
        """Each (key, records) of ``groups`` with the node's answer, over ``client``'s connection."""
        return [(key, group, client.predict_experiment(self.live.name, [r.value for r, _, _ in group],
                                                        f"probe-{group[0][0].partition}-{group[0][0].offset}"))
                for key, group in groups]

    # ------------------------------------------------------------------ results
    def scores_by_event(self) -> dict[str, float]:
        """Impression event_id -> the server's score of its sample (every feature supplied)."""
        with self._lock:
            return dict(zip(self.records.event_id, self.records.online))

    def snapshot(self) -> dict:
        """Columns of everything scored so far, with the Bayes probability joined (NaN if unknown)."""
        with self._lock:
            rec = self.records
            n = len(rec.ts)
            out = {name: np.array(getattr(rec, name)[:n]) for name in ("ts", "label", "online", "version", "frozen",
                                                                       "user_id", "sample_partition", "sample_offset")}
            out["bayes"] = np.array([self.bayes.get(e, np.nan) for e in rec.event_id[:n]], dtype=np.float64)
            m = len(rec.click_ts)
            out["positives"] = {name: np.array(getattr(rec, name)[:m]) for name in ("click_ts", "visible_ms", "partition", "offset")}
            out["failed_requests"], out["unscored"], out["skipped_trained"] = rec.failed_requests, rec.unscored, rec.skipped_trained
            exp = rec.experiment
            out["experiment"] = {"requests": exp.requests, "failed_requests": exp.failed_requests, "unscored": exp.unscored,
                                 "skipped": set(exp.skipped), "answers": list(exp.answers)}
        return out


def _others(records: list, kept: list) -> list:
    """The records of ``records`` not in ``kept`` (a subset of them, in order)."""
    ids = set(map(id, kept))
    return [r for r in records if id(r) not in ids]


class VersionTimeline:
    """When each version was snapshotted, published (manifest) and applied (the server)."""

    def __init__(self, client: ServingClient, model_store: ModelStore, poll_s: float = 0.25) -> None:
        self.client, self.model_store, self.poll_s = client, model_store, poll_s
        self.manifests: dict[int, dict] = {}
        self.applied: dict[int, float] = {}  # version -> applied_at (server clock = ours)
        self.status: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="version-timeline", daemon=True)

    def start(self) -> "VersionTimeline":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.status = self.client.status()
                v, at = self.status.get("model_version"), self.status.get("applied_at")
                if v is not None and at is not None and v not in self.applied:
                    self.applied[v] = at
                for version in self.model_store.versions():
                    if version not in self.manifests:
                        m = self.model_store.manifest(version)
                        self.manifests[version] = {k: m.get(k) for k in ("kind", "created_at", "snapshot_at", "offsets",
                                                                          "trained_through_ms", "samples_trained")}
            except Exception as exc:  # noqa: BLE001 - a server restart or a version being GC'd: poll again
                log.debug("version poll: %s", exc)
