"""The serving engine: everything a serving node does apart from HTTP.

In the spirit of vLLM's ``EngineCore``: the HTTP layer (serving/app.py, the front-end
processes) only routes; the engine owns the served model and its versions (``load``,
``apply``, ``rollback``, ``release``: serving/state.py), turns requests into batches
(``score``, through the request batcher) and runs them (``execute``), and says what it is
doing (``status``, ``metrics``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import orjson

from streamrec.model.batch import batch_from_columns
from streamrec.model.columns import FeatureColumns
from streamrec.contracts.events import MAX_FUTURE_SKEW_MS
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.serving.batcher import RequestBatcher, Shed
from streamrec.serving.errors import ApiError, not_loaded, unknown_model
from streamrec.serving.online_features import REPLAY_HORIZON_MS, OnlineFeatures
from streamrec.serving.metrics import ServingMetrics
from streamrec.serving.pauses import GcPauses
from streamrec.serving.request import ByIdsDecoder, InstanceDecoder, invalid_instances, is_by_ids
from streamrec.serving.state import ApplyReport, ServedModel
from streamrec.plumbing.config import ServingConfig


class ServingEngine:
    def __init__(self, served: ServedModel, settings: ServingConfig, gc_pauses: GcPauses | None = None,
                 features: OnlineFeatures | None = None) -> None:
        self.served, self.settings, self.gc_pauses, self.features = served, settings, gc_pauses, features
        self.ids_decoder = ByIdsDecoder(settings.max_instances, MAX_FUTURE_SKEW_MS)
        self._started_at = time.monotonic()
        self.model_name = served.model_store.model
        self.metrics = ServingMetrics()
        self.batcher = RequestBatcher(self.execute, settings.max_batch, settings.max_delay_us, settings.workers,
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
            return await self.predict_by_ids(body, timeout_s)
        version, scores = await self.score(self.decoder(current.feature_spec).decode(body), timeout_s)
        return orjson.dumps({"model_version": version, "scores": scores.tolist()})

    async def predict_by_ids(self, body: bytes, timeout_s: float | None = None) -> bytes:
        """``{"user_id", "context", "candidates", "ts"?}`` -> scores in candidate order, with
        the time the features are complete to (``features_as_of``)."""
        features = self.features
        if features is None:
            raise ApiError(400, "this node has no online feature store (serving.feature_store = false): "
                                'send {"instances": [...]} with every feature')
        now = int(time.time() * 1000)
        request = self.ids_decoder.decode(body, now)
        ts = now if request.ts is None else request.ts
        as_of = features.as_of()
        if as_of is not None and ts < as_of - REPLAY_HORIZON_MS:
            raise ApiError(400, f"'ts' {ts} is {as_of - ts:,} ms before the feature store's state ({as_of}); "
                                f"features are kept for requests at most {REPLAY_HORIZON_MS:,} ms in the past")
        t0 = time.perf_counter()
        assembled = features.assemble(request.user_id, ts, request.context.device, request.context.local_hour,
                                      request.candidates, request.return_features)
        self.metrics.assembly.observe(time.perf_counter() - t0)
        version, scores = await self.score(assembled.columns, timeout_s)
        answer = {"model_version": version, "features_as_of": assembled.as_of, "ts": ts, "scores": scores.tolist()}
        if assembled.features is not None:
            answer["features"] = assembled.features
        return orjson.dumps(answer)

    def ready(self) -> str | None:
        """Why the node is not ready (None: ready): no model yet, or the online features are
        still catching up with their topic (for at most serving.feature_store_ready_timeout_s)."""
        if self.served.version is None:
            return "no model version loaded yet"
        features = self.features
        if features is not None and not features.caught_up.is_set():
            if time.monotonic() - self._started_at < self.settings.feature_store_ready_timeout_s:
                return f"the online feature store is catching up with {features.topic} ({features.lag_records():,} records behind)"
        return None

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
        t0 = time.perf_counter()
        status = "error"
        try:
            result = await self.batcher.submit(payload, timeout_s)
            self.metrics.queued.observe(result.queued_s)
            self.metrics.instances.inc(len(payload))
            status = "ok"
            return result.version, result.scores
        except Shed as exc:
            status = "shed"
            self.metrics.shed.labels(exc.reason).inc()
            raise ApiError(429 if exc.reason == "queue_full" else 503, str(exc)) from None
        finally:
            self.metrics.requests.labels(status).inc()
            self.metrics.latency.observe(time.perf_counter() - t0)

    def execute(self, payloads: list) -> list:
        """Check, convert and score every request of a batch in one pass (a batcher worker).

        Returns per request (version, scores) or the ApiError it gets: a request with an
        invalid instance gets a 400 naming them; the others are scored."""
        current = self.served.current
        if current is None:
            raise not_loaded()
        decoder = self.decoder(current.feature_spec)
        outcomes: list = [None] * len(payloads)
        width = len(current.feature_spec.counter_columns())
        for r, payload in enumerate(payloads):
            mine = payload.counters.shape[1] == width if isinstance(payload, FeatureColumns) else type(payload[0]) is decoder.instance
            if not mine:
                outcomes[r] = ApiError(503, "the served model's feature spec changed while this request waited; send it again")
        listed = [r for r, p in enumerate(payloads) if outcomes[r] is None and not isinstance(p, FeatureColumns)]
        parts, order = [], []
        if listed:
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
                order.extend(listed)
        for r, payload in enumerate(payloads):
            if outcomes[r] is None and isinstance(payload, FeatureColumns):
                parts.append(payload)
                order.append(r)
        version, scores = current.version, np.empty(0, np.float32)
        if parts:
            batch = batch_from_columns(FeatureColumns.concat(parts), current.feature_spec, current.network.spec.history_len)
            version, scores = self.served.predict(batch, now_ms=int(time.time() * 1000))
        taken = 0
        for r in order:
            n = len(payloads[r])
            outcomes[r] = (version, scores[taken: taken + n])
            taken += n
        return outcomes

    def hello(self) -> tuple:
        """What a front-end process needs to decode requests itself (serving/ipc.py)."""
        current = self.served.current
        return ("hello", self.model_name, current.feature_spec.to_json() if current is not None else None)

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
