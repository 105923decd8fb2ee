"""What a node does with each answer after it went out: a record in the prediction log
(serving.prediction_log) and, for a request whose experiment names a shadow model, the same
request queued on that model's background lane. Both are best effort: the answer went out.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket

import msgspec
import numpy as np

from streamrec.contracts.predictions import Prediction
from streamrec.model.columns import FeatureColumns
from streamrec.serving.access.prediction_log import PredictionLog
from streamrec.serving.by_ids import ByIdsQuery
from streamrec.serving.runtime.answers import Answer, Answers, ShadowReply
from streamrec.serving.runtime.batcher import Shed
from streamrec.serving.runtime.messages import Call, ModelScores
from streamrec.serving.runtime.metrics import ServingMetrics
from streamrec.serving.runtime.model_runtime import ByIdsScores, ModelRuntime

log = logging.getLogger("streamrec.serving")


class AnswerLog:
    """The prediction log's records and the shadow requests of a node's answers."""

    def __init__(self, runtimes: dict[str, ModelRuntime], metrics: ServingMetrics, prediction_log: PredictionLog | None,
                 answers: Answers) -> None:
        """``answers``: where the shadow requests' outcomes go (the node reads them back here)."""
        self.runtimes, self.metrics, self.prediction_log, self.answers = runtimes, metrics, prediction_log, answers
        self._request_prefix, self._request_ids = f"{socket.gethostname()}-{os.getpid()}-", itertools.count()
        self._shadow_failure_logged: set[str] = set()

    def handle(self, answer: Answer) -> None:
        """One answer (or a shadow request's outcome). Never raises: the answer went out."""
        try:
            if answer.shadow:
                self._shadow_outcome(answer)
            else:
                self._log_and_shadow(answer)
        except Exception:  # noqa: BLE001 -- the log and the shadow are best effort
            log.exception("prediction log / shadow of an answered request failed")

    def _log_and_shadow(self, answer: Answer) -> None:
        call = answer.call
        if self.prediction_log is not None:
            call = self._with_request_id(call)  # the primary's and its shadow's records share it
            self._record_result(answer.model, answer.payload, answer.result, call, shadow=False)
        if call.shadow_model:
            shadow = self.runtimes.get(call.shadow_model)
            if shadow is None or shadow.served.current is None:
                self.metrics.shadow.labels(call.shadow_model, "unavailable").inc()
                return
            if not shadow.batcher.enqueue_background(answer.payload, ShadowReply(self.answers, shadow.name, answer.payload, call)):
                self.metrics.shadow.labels(shadow.name, "shed").inc()  # its lane is full: dropped, the primary was answered

    def _shadow_outcome(self, answer: Answer) -> None:
        if answer.error is None:
            self.metrics.shadow.labels(answer.model, "scored").inc()
            if self.prediction_log is not None:
                self._record_result(answer.model, answer.payload, answer.result, answer.call, shadow=True)
        elif isinstance(answer.error, Shed):  # waited past serving.queue_timeout_ms in the background lane
            self.metrics.shadow.labels(answer.model, "shed").inc()
        else:
            self.metrics.shadow.labels(answer.model, "failed").inc()
            if answer.model not in self._shadow_failure_logged:
                self._shadow_failure_logged.add(answer.model)
                log.error("shadow model %s failed a request (logged once): %s", answer.model, answer.error)

    def log_fan_out(self, query: ByIdsQuery, as_of: int | None, parts: list[ModelScores], call: Call) -> None:
        """A fan-out's answers, one record per model that answered, all under one request id."""
        if self.prediction_log is not None and call.log:
            call = self._with_request_id(call)
            for part in parts:
                if part.scores is not None:
                    self._record(call, part.model, part.model_version, query, np.frombuffer(part.scores, np.float32), as_of, False)

    def _record_result(self, model: str, payload: FeatureColumns | ByIdsQuery, result, call: Call, shadow: bool) -> None:
        scores = result.scores.scores if isinstance(result.scores, ByIdsScores) else result.scores
        as_of = result.scores.features_as_of if isinstance(result.scores, ByIdsScores) else None
        self._record(call, model, result.version, payload, scores, as_of, shadow)

    def _with_request_id(self, call: Call) -> Call:
        """``call`` with the id its prediction-log records share: the client's x-request-id, else one made up here."""
        if call.request_id is not None or not call.log:
            return call
        return msgspec.structs.replace(call, request_id=f"{self._request_prefix}{next(self._request_ids)}")

    def _record(self, call: Call, model: str, version: int, payload: FeatureColumns | ByIdsQuery, scores: np.ndarray,
                as_of: int | None, shadow: bool) -> None:
        """An answer into the prediction log (one encode and a non-blocking send a record):
        one record per user, at the request's event time (an instances request: per user,
        their instances' latest ``ts``). A request sent with ``x-prediction-log: off`` is not logged."""
        if not call.log:
            return
        request_id = self._with_request_id(call).request_id
        if isinstance(payload, ByIdsQuery):
            parts = [(payload.ts, payload.user_id, payload.candidates[:, 0], scores)]
        else:
            users, ts, items = payload.ints["user_id"], payload.ints["ts"], payload.ints["item_id"]
            if (users == users[0]).all():
                parts = [(int(ts.max()), int(users[0]), items, scores)]
            else:  # several users in one request: a record each, so every candidate joins its own user's labels
                order = np.argsort(users, kind="stable")
                starts = np.flatnonzero(np.r_[True, users[order][1:] != users[order][:-1]])
                parts = [(int(ts[rows].max()), int(users[rows[0]]), items[rows], scores[rows]) for rows in np.split(order, starts[1:])]
        for ts_ms, user, item_ids, user_scores in parts:
            self.prediction_log.record(Prediction(request_id, ts_ms, user, item_ids, user_scores, model, version, call.experiment,
                                                  call.variant, as_of, shadow))
