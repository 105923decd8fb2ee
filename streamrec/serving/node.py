"""A serving node: every model it serves (one :class:`ModelRuntime` each) and what they
share — the decoding of predict bodies, the online features, experiments, callers' quotas
and priorities, shadow scoring and the prediction log.

Requests come from the node's own HTTP (:meth:`predict`) or from its front-end processes
(:meth:`take`, one typed message each); either way a request is decoded once, routed
(serving/access/routing.py), admitted (serving/access/quotas.py) and queued on its model's batcher.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import orjson

from streamrec.contracts.events import MAX_FUTURE_SKEW_MS
from streamrec.serving.by_ids import ByIdsQuery, fan_out_json
from streamrec.serving.runtime.answers import Answer, Answers
from streamrec.serving.runtime.model_runtime import ByIdsScores, LinkReply, ModelRuntime, stale_features
from streamrec.serving.errors import ApiError
from streamrec.serving.access.answer_log import AnswerLog
from streamrec.serving.access.experiments import entry_to_json
from streamrec.serving.runtime.ipc import Outbox, failed, payload_of
from streamrec.serving.runtime.messages import PROTOCOL, Call, ModelScores, PredictByIds, PredictColumns, Scored, Welcome
from streamrec.serving.runtime.metrics import ServingMetrics
from streamrec.serving.features.online_features import OnlineFeatures
from streamrec.plumbing.gc_pauses import GcPauses
from streamrec.serving.runtime.request import InstanceDecoder
from streamrec.serving.access.routing import MODELS, RequestRouter
from streamrec.plumbing.config import ServingConfig

if TYPE_CHECKING:
    from streamrec.serving.access.experiments import Experiments
    from streamrec.serving.access.prediction_log import PredictionLog
    from streamrec.serving.access.quotas import Callers

log = logging.getLogger("streamrec.serving")


class ServingNode:
    def __init__(self, runtimes: list[ModelRuntime], settings: ServingConfig, metrics: ServingMetrics, features: OnlineFeatures | None = None,
                 gc_pauses: GcPauses | None = None, experiments: "Experiments | None" = None, callers: "Callers | None" = None,
                 prediction_log: "PredictionLog | None" = None) -> None:
        self.runtimes = {runtime.name: runtime for runtime in runtimes}
        self.settings, self.metrics, self.features, self.gc_pauses = settings, metrics, features, gc_pauses
        self.experiments, self.callers, self.prediction_log = experiments, callers, prediction_log
        self.router = RequestRouter(self.decoder_of, self.runtime, features is not None, settings.max_instances, MAX_FUTURE_SKEW_MS,
                                    experiments)
        self.welcome_listeners: list[Callable[[Welcome], None]] = []  # front-end links: told when experiments change
        self._caller_header, self._priority_header = (h.lower().encode("latin-1") for h in (settings.caller_header, settings.priority_header))
        self.answers = Answers()  # answered requests, for the log and the shadows (when _keep_answers)
        self.answer_log = AnswerLog(self.runtimes, metrics, prediction_log, self.answers)
        self._keep_answers = False
        self._refresh: asyncio.Task | None = None
        self._handle_answers: asyncio.Task | None = None
        self._follow_answers()

    # ------------------------------------------------------------------ models
    def runtime(self, model: str) -> ModelRuntime:
        runtime = self.runtimes.get(model)
        if runtime is None:
            raise ApiError(404, f"unknown model {model!r}; this node serves {sorted(self.runtimes)}")
        return runtime

    def decoder_of(self, model: str) -> InstanceDecoder:
        return self.runtime(model).decoder()

    # ------------------------------------------------------------------ requests
    async def predict(self, kind: str, name: str, body: bytes, timeout_s: float | None = None, call: Call = Call()) -> bytes:
        """A predict body of ``/v1/{kind}/{name}:predict`` (size already checked) -> its JSON answer."""
        self.admit(call)
        if kind == MODELS:
            self.runtime(name).refuse_if_full()  # before decoding: a full queue costs the refused nothing
        routed = self.router.route(kind, name, body, call)
        if routed.fan_out:
            return await self._fan_out_json(routed.fan_out, routed.payload, timeout_s, routed.call)
        runtime = self.runtime(routed.model)
        result = await runtime.score(routed.payload, timeout_s)
        if self._keep_answers:
            self.answer_log.handle(Answer(runtime.name, routed.payload, routed.call, result))
        if isinstance(result.scores, ByIdsScores):
            return result.scores.json(routed.ts, routed.extra)
        return orjson.dumps({"model_version": result.version, "scores": result.scores.tolist(), **routed.extra})

    def take(self, message: PredictColumns | PredictByIds, outbox: Outbox) -> None:
        """A front-end's request: queued on its model's batcher, its answer later put into
        ``outbox``; a refusal is answered at once."""
        started = time.perf_counter()
        try:
            self.admit(message.call)
            payload = payload_of(message)
            if isinstance(message, PredictByIds) and message.models:
                asyncio.ensure_future(self._fan_out_link(message, payload, outbox))
                return
            runtime = self.runtime(message.model)
            reply = LinkReply(runtime.name, runtime.metrics, self.answers if self._keep_answers else None, message.id, outbox, payload,
                              message.call, started)
            runtime.enqueue(payload, message.timeout_s, reply)
        except ApiError as exc:
            outbox.put(failed(message.id, exc))

    def admit(self, call: Call) -> None:
        """429 for a caller over its quota, or of a priority shed at the node's queue fill."""
        if self.callers is None:
            return
        fill = max(r.batcher.queued_instances for r in self.runtimes.values()) / self.settings.max_queue_instances
        headers = [(name, value.encode("latin-1")) for name, value in ((self._caller_header, call.api_key),
                                                                         (self._priority_header, call.priority)) if value is not None]
        self.callers.admit(headers, fill)

    # ------------------------------------------------------------------ fan-out, shadow, log
    async def _fan_out(self, models: list[str], query: ByIdsQuery, timeout_s: float | None, call: Call) -> tuple[Any, list[ModelScores]]:
        """One by-ids request scored by several models: its features assembled once, then
        queued on every model's batcher as columns, every answer logged. A model that cannot
        answer says why in its part."""
        runtimes = [self.runtime(m) for m in models]
        runtimes[0].check_horizon(query)
        try:
            assembled = self.features.assemble_batch([query])
        except Exception as exc:  # noqa: BLE001 -- as in a batch: the request fails with a 503, the node goes on
            log.exception("online feature assembly of a fan-out failed")
            raise ApiError(503, f"the online features could not be assembled: {type(exc).__name__}: {exc}; retry") from None
        self.metrics.fan_out.inc()
        outcomes = await asyncio.gather(*(r.score(assembled.columns, timeout_s) for r in runtimes), return_exceptions=True)
        parts = []
        for runtime, outcome in zip(runtimes, outcomes):
            if isinstance(outcome, ApiError):
                parts.append(ModelScores(runtime.name, status=outcome.status, message=outcome.message))
            elif isinstance(outcome, BaseException):
                log.error("fan-out: model %s failed", runtime.name, exc_info=outcome)
                parts.append(ModelScores(runtime.name, status=500, message=f"internal error: {type(outcome).__name__}: {outcome}"))
            else:
                parts.append(ModelScores(runtime.name, outcome.version, np.asarray(outcome.scores, np.float32).tobytes()))
        try:
            self.answer_log.log_fan_out(query, assembled.as_of, parts, call)
        except Exception:  # noqa: BLE001 -- the answer goes out whatever the log does
            log.exception("prediction log of a fan-out failed")
        return assembled, parts

    async def _fan_out_json(self, models: list[str], query: ByIdsQuery, timeout_s: float | None, call: Call) -> bytes:
        assembled, parts = await self._fan_out(models, query, timeout_s, call)
        features = assembled.features[0]
        return fan_out_json(query.ts, assembled.as_of, stale_features(assembled.as_of, self.settings),
                            orjson.dumps(features) if features is not None else None, parts)

    async def _fan_out_link(self, message: PredictByIds, query: ByIdsQuery, outbox: Outbox) -> None:
        try:
            assembled, parts = await self._fan_out(message.models, query, message.timeout_s, message.call)
        except Exception as exc:  # noqa: BLE001 -- every request gets an answer
            if not isinstance(exc, ApiError):
                log.exception("fan-out failed")
            outbox.put(failed(message.id, exc))
            return
        features = orjson.dumps(assembled.features[0]) if assembled.features[0] is not None else None
        outbox.put(Scored(message.id, 0, b"", by_ids=True, features_as_of=assembled.as_of,
                          features_stale=stale_features(assembled.as_of, self.settings), features=features, fan_out=parts))

    # ------------------------------------------------------------------ front-ends
    def hello(self) -> Welcome:
        """What a front-end process needs to decode and route requests itself."""
        return Welcome(PROTOCOL, {name: r.feature_spec_json() for name, r in self.runtimes.items()}, MAX_FUTURE_SKEW_MS,
                       self.features is not None, self.experiments_json())

    def experiments_json(self) -> list[dict]:
        """The experiments in force, as front-ends rebuild them (serving/access/experiments.py ``entry_from_json``)."""
        if self.experiments is None:
            return []
        return [entry_to_json(entry) for entry in self.experiments.entries()]

    def _follow_answers(self) -> None:
        """Answers are kept only where something needs them: the prediction log, or a shadow model."""
        shadows = self.experiments is not None and any(e.shadow_model for e in self.experiments.entries())
        self._keep_answers = self.prediction_log is not None or shadows

    def experiments_changed(self) -> None:
        """Tell every front-end the experiments now in force."""
        self._follow_answers()
        welcome = self.hello()
        for listener in self.welcome_listeners:
            listener(welcome)

    async def _follow_experiments(self) -> None:
        """Every serving.poll_interval_s: experiments changed at run time by another node."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.settings.poll_interval_s)
            before = self.experiments_json()
            try:
                await loop.run_in_executor(None, self.experiments.refresh)
            except (OSError, ValueError) as exc:
                log.warning("experiments: the model store cannot be read (%s); keeping the ones in force", exc)
            except Exception:  # noqa: BLE001 -- the node keeps following the store whatever one refresh does
                log.exception("experiments: refresh failed; keeping the ones in force")
            if self.experiments_json() != before:
                self.experiments_changed()

    # ------------------------------------------------------------------ reporting
    def readiness(self) -> dict[str, str | None]:
        """Per request form: why the node does not serve it now (None: it does, for every model)."""
        forms: dict[str, str | None] = {"instances": None, "by_ids": None}
        for runtime in self.runtimes.values():
            for form, why in runtime.readiness().items():
                forms[form] = forms[form] or why
        return forms

    def ready(self, form: str | None = None, model: str | None = None) -> str | None:
        """Why the node (or ``model``) is not ready for ``form`` (None: every form it serves), or None."""
        forms = self.runtime(model).readiness() if model is not None else self.readiness()
        if form is not None:
            return forms[form]
        served = forms if self.features is not None else {"instances": forms["instances"]}
        return next((why for why in served.values() if why is not None), None)

    def model_status(self, model: str) -> dict[str, Any]:
        """``GET /v1/models/{model}``: the model runtime's status and what the node shares."""
        return {**self.runtime(model).status(), "gc": self.gc_pauses.as_json() if self.gc_pauses is not None else None,
                "features": self.features.status() if self.features is not None else None}

    def models(self) -> list[dict[str, Any]]:
        """``GET /v1/models``."""
        return [{"model": name, "model_version": r.served.version, "pinned": r.served.pinned,
                 "ready": {form: why or "ready" for form, why in r.readiness().items()}} for name, r in self.runtimes.items()]

    def observe_metrics(self) -> ServingMetrics:
        """The metrics, with the gauges read now."""
        for runtime in self.runtimes.values():
            runtime.observe_metrics()
        if self.features is not None:
            self.metrics.observe_features(self.features.status())
        if self.prediction_log is not None:
            counts = self.prediction_log.counters()
            for outcome in ("queued", "sent", "dropped", "failed"):
                self.metrics.prediction_log.labels(outcome).set(counts[outcome])
        return self.metrics

    # ------------------------------------------------------------------ lifetime
    async def start(self) -> None:
        for runtime in self.runtimes.values():
            await runtime.start()
        if self.experiments is not None and self.experiments.store is not None:
            self._refresh = asyncio.create_task(self._follow_experiments(), name="experiments")
        self._handle_answers = asyncio.create_task(self._answer_loop(), name="answers")

    async def _answer_loop(self) -> None:
        """The front-end requests' answers (and shadow outcomes), in order, to the answer log."""
        while True:
            for answer in await self.answers.take():
                self.answer_log.handle(answer)

    async def stop(self) -> None:
        for task in (self._refresh, self._handle_answers):
            if task is not None:
                task.cancel()
        for runtime in self.runtimes.values():
            await runtime.stop()

    def close(self) -> None:
        """Release the models, the online features and the prediction log (after :meth:`stop`)."""
        for runtime in self.runtimes.values():
            runtime.close()
        if self.features is not None:
            self.features.close()
        if self.prediction_log is not None:
            self.prediction_log.close()

