"""The serving engine: everything a serving node does apart from HTTP.

In the spirit of vLLM's ``EngineCore``: the HTTP layer (serving/app.py, the front-end
processes) only routes; the engine owns the served model and its versions (``load``,
``apply``, ``rollback``, ``release``: serving/state.py), turns requests into batches
(``score``, through the request batcher) and runs them (``execute``), and says what it is
doing (``status``, ``metrics``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from streamrec.model.batch import batch_from_columns
from streamrec.model.columns import FeatureColumns
from streamrec.contracts.events import MAX_FUTURE_SKEW_MS
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.serving.batcher import BatchResult, RequestBatcher, Shed
from streamrec.serving.by_ids import ByIdsQuery, answer_json, query_of
from streamrec.serving.errors import ApiError, SpecChanged, no_feature_store, not_loaded, unknown_model
from streamrec.serving.ipc import Outbox
from streamrec.serving.messages import PROTOCOL, Failed, Scored, Welcome
from streamrec.serving.online_features import REPLAY_HORIZON_MS, OnlineFeatures
from streamrec.serving.metrics import ServingMetrics
from streamrec.serving.pauses import GcPauses
from streamrec.serving.request import ByIdsDecoder, InstanceDecoder, invalid_instances, is_by_ids
from streamrec.serving.state import ApplyReport, ServedModel
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

    def json(self, ts: int) -> bytes:
        return answer_json(self.version, self.features_as_of, self.features_stale, ts, self.scores.tolist(), self._features_json())

    def message(self, request_id: int) -> Scored:
        return Scored(request_id, self.version, np.asarray(self.scores, np.float32).tobytes(), by_ids=True,
                      features_as_of=self.features_as_of, features_stale=self.features_stale, features=self._features_json())

    def _features_json(self) -> bytes | None:
        return orjson.dumps(self.features) if self.features is not None else None


class LinkReply:
    """Where a front-end request's outcome goes (the batcher's ``Reply``): its answer message
    into the link's outbox, counted in the metrics; no future or task per request."""

    __slots__ = ("engine", "id", "outbox", "rows", "started", "answered")

    def __init__(self, engine: "ServingEngine", request_id: int, outbox: Outbox, rows: int, started: float) -> None:
        self.engine, self.id, self.outbox, self.rows, self.started = engine, request_id, outbox, rows, started
        self.answered = False

    def done(self) -> bool:
        return self.answered or self.outbox.closed

    def set_result(self, result: BatchResult) -> None:
        self.answered = True
        scores = result.scores
        message = (scores.message(self.id) if isinstance(scores, ByIdsScores)
                   else Scored(self.id, result.version, np.asarray(scores, np.float32).tobytes()))
        self.engine.count_answer(self.started, self.rows, result.queued_s)
        self.outbox.put(message)

    def set_exception(self, exc: BaseException) -> None:
        self.answered = True
        error = self.engine.failure(exc, self.started)
        self.outbox.put(Failed(self.id, error.status, error.message, spec_changed=isinstance(error, SpecChanged)))


class ServingEngine:
    def __init__(self, served: ServedModel, settings: ServingConfig, gc_pauses: GcPauses | None = None,
                 features: OnlineFeatures | None = None) -> None:
        self.served, self.settings, self.gc_pauses, self.features = served, settings, gc_pauses, features
        self.ids_decoder = ByIdsDecoder(settings.max_instances, MAX_FUTURE_SKEW_MS)
        self._started_at = time.monotonic()
        self.model_name = served.model_store.model
        self.metrics = ServingMetrics()
        self.batcher = RequestBatcher(self.execute, settings.max_batch, settings.max_delay_us, settings.batch_workers(served.device.type),
                                      max_queue_instances=settings.max_queue_instances, queue_timeout_s=settings.queue_timeout_ms / 1000)
        self._decoders: dict[FeatureSpec, InstanceDecoder] = {}

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
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise unknown_model(model, self.model_name)

    def decoder(self, spec: FeatureSpec) -> InstanceDecoder:
        """The request decoder of ``spec``."""
        if spec not in self._decoders:  # one per feature spec of the served versions (normally one)
            self._decoders[spec] = InstanceDecoder(spec, self.settings.max_instances)
        return self._decoders[spec]

    async def predict(self, model: str, body: bytes, timeout_s: float | None = None) -> bytes:
        """A predict body (size already checked by the reader) -> the JSON answer: by ids
        (features from the node's online features) or with every feature in ``instances``."""
        self.check_model(model)
        current = self.served.current
        if current is None:
            raise not_loaded()
        self.refuse_if_full()
        if is_by_ids(body):
            self.check_features()
            now = int(time.time() * 1000)
            query = query_of(self.ids_decoder.decode(body, now), now)
            return (await self.score_by_ids(query, timeout_s)).json(query.ts)
        version, scores = await self.score(self.decoder(current.feature_spec).decode(body), timeout_s)
        return orjson.dumps({"model_version": version, "scores": scores.tolist()})

    def check_features(self) -> OnlineFeatures:
        if self.features is None:
            raise no_feature_store()
        return self.features

    async def score_by_ids(self, query: ByIdsQuery, timeout_s: float | None = None) -> ByIdsScores:
        """One by-ids request's scores, its features assembled in its batch (``execute``)."""
        self.check_horizon(query)
        return (await self.score(query, timeout_s))[1]

    def check_horizon(self, query: ByIdsQuery) -> None:
        """A 400 for a ``ts`` further in the past than the online features keep event times."""
        as_of = self.check_features().as_of()
        if as_of is not None and query.ts < as_of - REPLAY_HORIZON_MS:
            raise ApiError(400, f"'ts' {query.ts} is {as_of - query.ts:,} ms before the feature store's state ({as_of}); "
                                f"features are kept for requests at most {REPLAY_HORIZON_MS:,} ms in the past")

    def ready(self, form: str | None = None) -> str | None:
        """Why the node is not ready for ``form`` ("instances", "by_ids"; None: for every form
        it serves), or None. Instances need a loaded model; by ids also needs the online
        features caught up with their topic — at start, for at most
        serving.feature_store_ready_timeout_s; a broker outage later leaves the node ready,
        serving the last state, its answers saying how stale it is."""
        forms = self.readiness()
        if form is not None:
            return forms[form]
        served = forms if self.features is not None else {"instances": forms["instances"]}
        return next((why for why in served.values() if why is not None), None)

    def readiness(self) -> dict[str, str | None]:
        """Per request form: why it is not served now (None: it is)."""
        if self.served.version is None:
            why = "no model version loaded yet"
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

    async def score(self, payload, timeout_s: float | None = None) -> tuple[int, np.ndarray]:
        """One request's (version, scores) through the batcher, counted in the metrics. A
        payload is a request's decoded instances or, from a front-end process, its columns;
        ``timeout_s`` is the client's own queueing deadline, if it sent one."""
        started = time.perf_counter()
        try:
            result = await self.batcher.submit(payload, timeout_s)
        except Exception as exc:
            raise self.failure(exc, started) from None
        self.count_answer(started, len(payload), result.queued_s)
        return result.version, result.scores

    def enqueue(self, payload: FeatureColumns | ByIdsQuery, timeout_s: float | None, request_id: int, outbox: Outbox) -> None:
        """A front-end's request (serving/ipc.py): queued for a batch, its answer put into
        ``outbox`` when the batch is done. Raises ApiError if refused at once."""
        started = time.perf_counter()
        if self.served.current is None:
            raise not_loaded()
        if isinstance(payload, ByIdsQuery):
            self.check_horizon(payload)
        try:
            self.batcher.enqueue(payload, LinkReply(self, request_id, outbox, len(payload), started), timeout_s)
        except Shed as exc:
            raise self.failure(exc, started) from None

    def count_answer(self, started: float, rows: int, queued_s: float) -> None:
        metrics = self.metrics
        metrics.queued.observe(queued_s)
        metrics.instances.inc(rows)
        metrics.requests.labels("ok").inc()
        metrics.latency.observe(time.perf_counter() - started)

    def failure(self, exc: BaseException, started: float) -> ApiError:
        """The ApiError a request gets for ``exc``, counted in the metrics: 429 when the queue
        is full, 503 past its deadline, 500 for the unexpected (logged)."""
        status = "error"
        if isinstance(exc, Shed):
            status = "shed"
            self.metrics.shed.labels(exc.reason).inc()
            error = ApiError(429 if exc.reason == "queue_full" else 503, str(exc))
        elif isinstance(exc, ApiError):
            error = exc
        else:
            log.error("unexpected error scoring a request", exc_info=exc)
            error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
        self.metrics.requests.labels(status).inc()
        self.metrics.latency.observe(time.perf_counter() - started)
        return error

    def execute(self, payloads: list) -> list:
        """Check, convert and score every request of a batch in one pass (a batcher worker).

        A payload is a list of decoded instances (this process's HTTP), a FeatureColumns (a
        front-end's instances) or a ByIdsQuery (features assembled here, for all of them at
        once). Returns per request (version, scores) — for a by-ids query, (version,
        :class:`ByIdsScores`) — or the ApiError it gets: a request with an invalid instance
        gets a 400 naming them; the others are scored."""
        current = self.served.current
        if current is None:
            raise not_loaded()
        decoder = self.decoder(current.feature_spec)
        outcomes: list = [None] * len(payloads)
        width = len(current.feature_spec.counter_columns())
        listed, columns_of, by_ids = [], [], []
        for r, payload in enumerate(payloads):
            if isinstance(payload, ByIdsQuery):
                by_ids.append(r)
            elif isinstance(payload, FeatureColumns):
                if payload.counters.shape[1] == width:
                    columns_of.append(r)
                else:
                    outcomes[r] = SpecChanged("the served model's feature spec changed while this request waited; send it again")
            elif type(payload[0]) is decoder.instance:
                listed.append(r)
            else:
                outcomes[r] = SpecChanged("the served model's feature spec changed while this request waited; send it again")
        parts, order = [], []
        if listed:
            listed = self._instances_part(payloads, listed, decoder, outcomes, parts)
            order.extend(listed)
        order.extend(columns_of)
        parts.extend(payloads[r] for r in columns_of)
        assembled = None
        if by_ids:
            t0 = time.perf_counter()
            try:
                assembled = self.features.assemble_batch([payloads[r] for r in by_ids])
            except Exception as exc:  # noqa: BLE001 -- e.g. the spill unreadable: the by-ids requests fail, the others are scored
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
            batch = batch_from_columns(FeatureColumns.concat(parts), current.feature_spec, current.network.spec.history_len)
            version, scores = self.served.predict(batch, now_ms=int(time.time() * 1000))
        taken = 0
        stale = assembled is not None and self._stale(assembled.as_of)
        for r in order:
            n = len(payloads[r])
            outcomes[r] = (version, scores[taken: taken + n])
            taken += n
        for k, r in enumerate(by_ids):
            outcomes[r] = (version, ByIdsScores(version, outcomes[r][1], assembled.as_of, stale, assembled.features[k]))
        return outcomes

    def _instances_part(self, payloads: list, listed: list[int], decoder: InstanceDecoder, outcomes: list, parts: list) -> list[int]:
        """The columns of the listed instance requests into ``parts``; a request with an invalid
        instance gets its 400 in ``outcomes``. Returns the requests whose rows are in ``parts``."""
        flat = [x for r in listed for x in payloads[r]]
        columns, rejected = decoder.columns(flat)
        if rejected:  # rare: name each bad instance to its request, score the other requests
            where = [(r, j) for r in listed for j in range(len(payloads[r]))]
            bad: dict[int, list[str]] = {}
            for i, reason in rejected:
                r, j = where[i]
                bad.setdefault(r, []).append(f"instance {j}: {reason}")
            for r, reasons in bad.items():
                outcomes[r] = invalid_instances(reasons)
            listed = [r for r in listed if r not in bad]
            columns = decoder.columns([x for r in listed for x in payloads[r]])[0] if listed else None
        if listed:
            parts.append(columns)
        return listed

    def _stale(self, as_of: int | None) -> bool:
        """Whether by-ids answers say their features are stale: none complete yet, or complete
        to a time further back than serving.features_max_lag_s."""
        return as_of is None or time.time() * 1000 - as_of > self.settings.features_max_lag_s * 1000

    def hello(self) -> Welcome:
        """What a front-end process needs to decode requests itself (serving/messages.py)."""
        current = self.served.current
        return Welcome(PROTOCOL, self.model_name, current.feature_spec.to_json() if current is not None else None, MAX_FUTURE_SKEW_MS,
                       self.features is not None)

    # ------------------------------------------------------------------ reporting
    def status(self) -> dict[str, Any]:
        """``GET /v1/models/{model}``: the served version, the versions rollback can reach, freshness."""
        served, current = self.served, self.served.current
        through = current.manifest.get("trained_through_ms") if current else None
        return {
            "model": self.model_name,
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
            "gc": self.gc_pauses.as_json() if self.gc_pauses is not None else None,
            "features": self.features.status() if self.features is not None else None,
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

    def observe_metrics(self) -> ServingMetrics:
        """The metrics, with the gauges read now."""
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
        if self.features is not None:
            self.metrics.observe_features(self.features.status())
        return self.metrics

    # ------------------------------------------------------------------ lifetime
    async def start(self) -> None:
        await self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    def close(self) -> None:
        """Release the served model and the online features (after :meth:`stop`)."""
        self.served.close()
        if self.features is not None:
            self.features.close()
