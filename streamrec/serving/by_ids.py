"""A predict-by-ids request as the model runtime batches it: ids only, features assembled later,
for the whole batch at once (``OnlineFeatures.assemble_batch``).

Built from a decoded body (serving/runtime/request.py ``ByIdsRequest``) by whichever process
decoded it (the serving process, or a front-end, which sends it over
serving/runtime/messages.py); its length is its candidate count, which is what the batcher
counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np
import orjson

CANDIDATE_FIELDS = ("item_id", "category_id", "advertiser_id", "position")
_candidate = attrgetter(*CANDIDATE_FIELDS)


@dataclass(slots=True)
class ByIdsQuery:
    user_id: int
    ts: int  # the request's event time (ms): the client's, or the decoding process's clock
    device: str  # at most request.MAX_DEVICE_CHARS
    local_hour: int
    candidates: np.ndarray  # [n, 4] int64: CANDIDATE_FIELDS per candidate
    return_features: bool = False

    def __len__(self) -> int:
        return len(self.candidates)


def answer_json(version: int, features_as_of: int | None, features_stale: bool, ts: int, scores: list[float],
                features_json: bytes | None, extra: dict | None = None) -> bytes:
    """The JSON answer of a by-ids request (``features_json``: its features, already JSON;
    ``extra``: keys added, such as an experiment's variant)."""
    answer = {"model_version": version, "features_as_of": features_as_of, "features_stale": features_stale, "ts": ts, "scores": scores,
              **(extra or {})}
    if features_json is not None:
        answer["features"] = orjson.Fragment(features_json)
    return orjson.dumps(answer)


def fan_out_json(ts: int, features_as_of: int | None, features_stale: bool, features_json: bytes | None, parts: list) -> bytes:
    """A fan-out's answer: per model (``parts``: messages.ModelScores) its version and scores, or its error."""
    models = {}
    for part in parts:
        if part.scores is None:
            models[part.model] = {"error": {"code": part.status, "message": part.message}}
        else:
            models[part.model] = {"model_version": part.model_version, "scores": np.frombuffer(part.scores, np.float32).tolist()}
    answer = {"features_as_of": features_as_of, "features_stale": features_stale, "ts": ts, "models": models}
    if features_json is not None:
        answer["features"] = orjson.Fragment(features_json)
    return orjson.dumps(answer)


def query_of(request, now_ms: int) -> ByIdsQuery:
    """The query of a decoded ``ByIdsRequest``; its ``ts`` defaults to ``now_ms``."""
    n = len(request.candidates)
    flat = np.fromiter(chain.from_iterable(map(_candidate, request.candidates)), np.int64, 4 * n)
    return ByIdsQuery(request.user_id, now_ms if request.ts is None else request.ts, request.context.device,
                      request.context.local_hour, flat.reshape(n, 4), request.return_features)
