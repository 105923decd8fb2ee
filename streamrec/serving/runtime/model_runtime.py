"""A model runtime: one served model's part of a serving node (serving/node.py has the
parts every model shares: HTTP decoding, online features, experiments, callers, the log).

In the spirit of vLLM's ``EngineCore``: the HTTP layer (serving/http/app.py, the front-end
processes) only routes; the model runtime owns one model and its versions (``load``, ``apply``,
``rollback``, ``release``: serving/runtime/state.py), turns requests into batches (``enqueue``,
``score``, through the request batcher) and runs them (``execute``), and says what it is
doing (``status``, ``metrics``). Every request reaches it in one of two columnar forms:
:class:`FeatureColumns` (every feature given) or :class:`ByIdsQuery` (ids, assembled per batch).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from streamrec.embedding.kernels import available as device_kernels
from streamrec.model.batch import batch_from_columns
from streamrec.model.columns import FeatureColumns
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.serving.runtime.answers import Answer, Answers
from streamrec.serving.runtime.batcher import BatcherGroup, BatchResult, Reply, RequestBatcher, Shed
from streamrec.serving.by_ids import ByIdsQuery, answer_json
from streamrec.serving.features.device_counts import DeviceCounts
from streamrec.serving.errors import BEYOND_HORIZON, ApiError, SpecChanged, no_feature_store, not_loaded
from streamrec.serving.runtime.ipc import Outbox, failed
from streamrec.serving.runtime.messages import Call, Scored
from streamrec.serving.features.online_features import REPLAY_HORIZON_MS, OnlineFeatures
from streamrec.serving.runtime.metrics import ModelMetrics
from streamrec.serving.runtime.request import InstanceDecoder
from streamrec.serving.runtime.state import ApplyReport, ServedModel
from streamrec.plumbing.config import ServingConfig

log = logging.getLogger("streamrec.serving")


@dataclass
class ByIdsScores:
    """A by-ids request's answer: its scores and how complete its features were."""

    version: int
    scores: np.ndarray
    features_as_of: int | None
    features_stale: bool
    features: list[dict[str, Any]] | None

    def json(self, ts: int, extra: dict | None = None) -> bytes:
        """The HTTP answer; ``extra``: keys added to it (an experiment's variant)."""
        return answer_json(self.version, self.features_as_of, self.features_stale, ts, self.scores.tolist(), self._features_json(), extra)

    def message(self, request_id: int) -> Scored:
        return Scored(request_id, self.version, np.asarray(self.scores, np.float32).tobytes(), by_ids=True,
                      features_as_of=self.features_as_of, features_stale=self.features_stale, features=self._features_json())

    def _features_json(self) -> bytes | None:
        return orjson.dumps(self.features) if self.features is not None else None


class LinkReply:
    """Where a front-end request's outcome goes (the batcher's ``Reply``): its answer message
    into the link's outbox, counted in the model's metrics, and into ``answers`` when the node
    keeps them (prediction log, shadow models); no future or task per request."""

    __slots__ = ("model", "metrics", "answers", "id", "outbox", "payload", "call", "started", "answered")

    def __init__(self, model: str, metrics: ModelMetrics, answers: Answers | None, request_id: int, outbox: Outbox,
                 payload: FeatureColumns | ByIdsQuery, call: Call, started: float) -> None:
        self.model, self.metrics, self.answers = model, metrics, answers
        self.id, self.outbox, self.payload, self.call, self.started = request_id, outbox, payload, call, started
        self.answered = False

    def done(self) -> bool:
        return self.answered or self.outbox.closed

    def set_result(self, result: BatchResult) -> None:
        self.answered = True
        scores = result.scores
        message = (scores.message(self.id) if isinstance(scores, ByIdsScores)
                   else Scored(self.id, result.version, np.asarray(scores, np.float32).tobytes()))
        count_answer(self.metrics, self.started, len(self.payload), result.queued_s)
        self.outbox.put(message)
        if self.answers is not None:
            self.answers.put(Answer(self.model, self.payload, self.call, result))

    def set_exception(self, exc: BaseException) -> None:
        self.answered = True
        self.outbox.put(failed(self.id, request_failure(self.metrics, exc, self.started)))


def count_answer(metrics: ModelMetrics, started: float, rows: int, queued_s: float) -> None:
    """An answered request in its model's metrics."""
    metrics.queued.observe(queued_s)
    metrics.instances.inc(rows)
    metrics.answered.inc()
    metrics.latency.observe(time.perf_counter() - started)


def request_failure(metrics: ModelMetrics, exc: BaseException, started: float) -> ApiError:
    """The ApiError a request gets for ``exc``, counted in its model's metrics: 429 when the
    queue is full, 503 past its deadline, 500 for the unexpected (logged)."""
    status = "error"
    if isinstance(exc, Shed):
        status = "shed"
        metrics.shed.labels(exc.reason).inc()
        error = ApiError(429 if exc.reason == "queue_full" else 503, str(exc))
    elif isinstance(exc, ApiError):
        error = exc
    else:
        log.error("unexpected error scoring a request", exc_info=exc)
        error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
    metrics.requests.labels(status).inc()
    metrics.latency.observe(time.perf_counter() - started)
    return error


class ModelRuntime:
    def __init__(self, served: ServedModel, settings: ServingConfig, metrics: ModelMetrics, features: OnlineFeatures | None = None,
                 batchers: BatcherGroup | None = None) -> None:
        """``batchers``: the node's batchers, which this model's joins (background work waits for all)."""
        self.served, self.settings, self.metrics, self.features = served, settings, metrics, features
        self.name = served.model_store.model
        self._started_at = time.monotonic()
        self.batcher = RequestBatcher(self.execute, settings.max_batch, settings.max_delay_us, settings.batch_workers(served.device.type),
                                      max_queue_instances=settings.max_queue_instances, queue_timeout_s=settings.queue_timeout_ms / 1000,
                                      group=batchers)
        self._decoders: dict[FeatureSpec, InstanceDecoder] = {}
        self.counts_on_host_because: str | None = None  # why the device path could not start, if it could not
        self._on_device = self._counts_on_device() if features is not None else None  # made (its kernel compiled) at start

    # ------------------------------------------------------------------ versions
    def load(self, version: int | None = None, pin: bool = False, by: str = "", reason: str = "") -> ApplyReport:
        """Serve ``version`` (default: LATEST); ``pin``: and make every node stay on it until released."""
        return self.served.load(version, pin, by, reason)

    def apply(self) -> list[ApplyReport]:
        """Apply every published version after the served one (deltas in place); never raises
        for a bad version: it is recorded as refused."""
        return self.served.catch_up()

    def rollback(self, version: int | None = None, by: str = "", reason: str = "") -> ApplyReport:
        """Back to ``version`` (default: the previous one), pinned in the store for every node."""
        return self.served.rollback(version, by, reason)

    def release(self) -> None:
        """Remove the store's pin: every node follows LATEST again."""
        self.served.release()

    # ------------------------------------------------------------------ requests
    def decoder(self) -> InstanceDecoder:
        """The request decoder of the served version's feature spec (404-free: a 503 before one is loaded)."""
        current = self.served.current
        if current is None:
            raise not_loaded()
        spec = current.feature_spec
        if spec not in self._decoders:  # one per feature spec of the served versions (normally one)
            self._decoders[spec] = InstanceDecoder(spec, self.settings.max_instances)
        return self._decoders[spec]

    def feature_spec_json(self) -> dict | None:
        current = self.served.current
        return current.feature_spec.to_json() if current is not None else None

    def check_features(self) -> OnlineFeatures:
        if self.features is None:
            raise no_feature_store()
        return self.features

    def check_horizon(self, query: ByIdsQuery) -> None:
        """A 400 for a ``ts`` further in the past than the online features keep event times."""
        as_of = self.check_features().as_of()
        if as_of is not None and query.ts < as_of - REPLAY_HORIZON_MS:
            raise ApiError(400, f"'ts' {query.ts} is {as_of - query.ts:,} ms before the feature store's state ({as_of}); "
                                f"{BEYOND_HORIZON} {REPLAY_HORIZON_MS:,} ms in the past")

    def readiness(self) -> dict[str, str | None]:
        """Per request form ("instances", "by_ids"): why this model does not serve it now (None:
        it does). Instances need a loaded version; by ids also needs the online features caught
        up with their topic — at start, for at most serving.feature_store_ready_timeout_s; a
        broker outage later leaves it ready, serving the last state, its answers saying how stale."""
        if self.served.version is None:
            why = f"model {self.name!r}: no version loaded yet"
            return {"instances": why, "by_ids": why}
        features = self.features
        if features is None:
            return {"instances": None, "by_ids": "this node has no online feature store (serving.feature_store = false)"}
        if features.serves_by_ids() or time.monotonic() - self._started_at >= self.settings.feature_store_ready_timeout_s:
            return {"instances": None, "by_ids": None}
        return {"instances": None, "by_ids": features.not_ready_reason()}

    def refuse_if_full(self) -> None:
        """429 before a request is decoded when the queue has no room even for one instance."""
        try:
            self.batcher.check_room()
        except Shed as exc:
            self.metrics.shed.labels(exc.reason).inc()
            self.metrics.requests.labels("shed").inc()
            raise ApiError(429, str(exc)) from None

    async def score(self, payload: FeatureColumns | ByIdsQuery, timeout_s: float | None = None) -> BatchResult:
        """One request's outcome through the batcher, counted in the metrics; ``timeout_s`` is
        the client's own queueing deadline, if it sent one."""
        started = time.perf_counter()
        self.check_payload(payload)
        try:
            result = await self.batcher.submit(payload, timeout_s)
        except Exception as exc:
            raise request_failure(self.metrics, exc, started) from None
        count_answer(self.metrics, started, len(payload), result.queued_s)
        return result

    def enqueue(self, payload: FeatureColumns | ByIdsQuery, timeout_s: float | None, reply: Reply) -> None:
        """Queue a request for a batch, its outcome to ``reply`` (a :class:`LinkReply`: no
        future or task per request). Raises ApiError if refused at once."""
        started = time.perf_counter()
        self.check_payload(payload)
        try:
            self.batcher.enqueue(payload, reply, timeout_s)
        except Shed as exc:
            raise request_failure(self.metrics, exc, started) from None

    def check_payload(self, payload: FeatureColumns | ByIdsQuery) -> None:
        if self.served.current is None:
            raise not_loaded()
        if isinstance(payload, ByIdsQuery):
            self.check_horizon(payload)

    def execute(self, payloads: list) -> list:
        """Check and score every request of a batch in one pass (a batcher worker).

        A payload is a FeatureColumns (every feature given) or a ByIdsQuery (features
        assembled here, for all of them at once). Returns per request (version, scores) — for
        a by-ids query, (version, :class:`ByIdsScores`) — or the ApiError it gets."""
        current = self.served.current
        if current is None:
            raise not_loaded()
        outcomes: list = [None] * len(payloads)
        width = len(current.feature_spec.counter_columns())
        parts, order, by_ids = [], [], []
        for r, payload in enumerate(payloads):
            if isinstance(payload, ByIdsQuery):
                by_ids.append(r)
            elif payload.counters.shape[1] == width:
                order.append(r)
                parts.append(payload)
            else:
                outcomes[r] = SpecChanged("the served model's feature spec changed while this request waited; send it again")
        assembled, first_by_ids_row = None, sum(len(p) for p in parts)
        if by_ids:
            t0 = time.perf_counter()
            try:
                assembled = self.features.assemble_batch([payloads[r] for r in by_ids], self._on_device)
            except Exception as exc:  # noqa: BLE001 -- the by-ids requests fail, the others are scored
                log.exception("online feature assembly failed")
                for r in by_ids:
                    outcomes[r] = ApiError(503, f"the online features could not be assembled: {type(exc).__name__}: {exc}; retry")
                by_ids = []
            else:
                self.metrics.assembly.observe(time.perf_counter() - t0)
                parts.append(assembled.columns)
                order.extend(by_ids)
        version, scores = current.version, np.empty(0, np.float32)
        if parts:
            columns, spec = FeatureColumns.concat(parts), current.feature_spec
            candidates = assembled.candidate_slots if assembled is not None else None
            batch = batch_from_columns(columns, spec, current.network.spec.history_len, with_dense=candidates is None)
            dense = (functools.partial(self._on_device.dense, columns.counters, first_by_ids_row, candidates)
                     if candidates is not None else None)
            version, scores = self.served.predict(batch, now_ms=int(time.time() * 1000), dense=dense)
        taken = 0
        stale = assembled is not None and stale_features(assembled.as_of, self.settings)
        for r in order:
            n = len(payloads[r])
            outcomes[r] = (version, scores[taken: taken + n])
            taken += n
        for k, r in enumerate(by_ids):
            outcomes[r] = (version, ByIdsScores(version, outcomes[r][1], assembled.as_of, stale, assembled.features[k]))
        return outcomes

    def _counts_on_device(self) -> DeviceCounts | None:
        """Where a batch's candidates are counted (``serving.candidate_counts``): on the device
        the model runs on, or None: on the host (serving/features/device_counts.py). A device path that
        cannot start (its kernel does not compile here, say) leaves the node counting on the
        host, said once in the log and in the status, rather than failing requests."""
        device = self.served.device
        if self.settings.candidate_counts == "host" or (self.settings.candidate_counts == "auto" and not device_kernels(device)):
            return None
        try:
            return self.features.counts_on(device)
        except Exception as exc:  # noqa: BLE001 -- the host path serves the same features
            self.counts_on_host_because = f"{type(exc).__name__}: {exc}"
            log.error("the candidates' counts cannot run on %s (%s): they are counted on the host", device, self.counts_on_host_because,
                      exc_info=exc)
            return None

    # ------------------------------------------------------------------ reporting
    def status(self) -> dict[str, Any]:
        """``GET /v1/models/{model}``: the served version, the versions rollback can reach, freshness."""
        served, current = self.served, self.served.current
        through = current.manifest.get("trained_through_ms") if current else None
        return {
            "model": self.name,
            "model_version": served.version,
            "kind": current.manifest.get("kind") if current else None,
            "feature_spec": current.feature_spec.to_json() if current else None,
            "trained_through_ms": through,
            "freshness_s": (time.time() * 1000 - through) / 1000 if through else None,
            "applied_at": served.applied_at.get(served.version) if served.version else None,
            "rollback_to": sorted({u.version_before for u in served.undo}),
            "applies": served.applies(),
            "pinned": served.pinned,
            "pin": served.pin.__dict__ if served.pin is not None else None,
            "refused": {str(v): why for v, why in served.refused.items()},
            **self._latest_in_store(),
            "runtime": current.runner.stats.as_json() if current is not None and current.runner is not None else None,
            "batching": {**self.batcher.stats.as_json(), "queued_instances": self.batcher.queued_instances},
            "candidate_counts_on_host_because": self.counts_on_host_because,
        }

    def _latest_in_store(self) -> dict[str, Any]:
        """LATEST as the store has it now, how far it is ahead of what is served, and why it
        is not followed (garbage, dangling) if so."""
        try:
            latest, problem = self.served.model_store.resolve_latest()
        except OSError as exc:
            latest, problem = None, f"the model store cannot be read: {exc}"
        served = self.served.version
        return {"latest_in_store": latest, "latest_ahead_by": latest - served if latest is not None and served is not None else None,
                "latest_problem": problem or self.served.latest_problem}

    def observe_metrics(self) -> None:
        """Read this model's gauges into the metrics now."""
        current = self.served.current
        if current is not None:
            self.metrics.version.set(current.version)
            through = current.manifest.get("trained_through_ms")
            if through:
                self.metrics.freshness.set(through)
            if current.runner is not None:
                self.metrics.observe_runtime(current.runner.stats.as_json())
        served = self.served
        self.metrics.pinned.set(served.pin.version if served.pin is not None else 0)
        self.metrics.latest_unusable.set(1 if served.latest_problem else 0)
        self.metrics.refused.set(len(served.refused))

    # ------------------------------------------------------------------ lifetime
    async def start(self) -> None:
        await self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    def close(self) -> None:
        """Release the served model (after :meth:`stop`)."""
        self.served.close()


def stale_features(as_of: int | None, settings: ServingConfig) -> bool:
    """Whether by-ids answers say their features are stale: none complete yet, or complete
    to a time further back than serving.features_max_lag_s."""
    return as_of is None or time.time() * 1000 - as_of > settings.features_max_lag_s * 1000
