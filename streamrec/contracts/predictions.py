"""Predictions on the wire: the record of ``streamrec.predictions``, one per answered predict
request, so that a model's answers can be graded later against the labels the job emits.

Encoding (record version 1): one MessagePack map per Kafka message (msgspec), the candidates'
``item_ids`` as raw little-endian int64 bytes and their ``scores`` as raw little-endian
float32 bytes, in the same order. Why MessagePack and raw arrays, not JSON like the other
topics: the record is encoded inside the serving process, on a thread that shares the GIL
with the event loop, for every request and all of its candidates; copying two arrays is
cheap where formatting hundreds of floats as text is not, the record is smaller, and
scores come back bit for bit. The maps keep their field names, so a reader
ignores fields added later. Key: the user id as decimal text, so one user's predictions
stay in order on one partition (as their events do on ``streamrec.events``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import msgspec
import numpy as np

PREDICTION_VERSION = 1
_INT64, _FLOAT32 = np.dtype("<i8"), np.dtype("<f4")


class CorruptPrediction(ValueError):
    """A message of the predictions topic that does not follow the format (counted, skipped)."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """One answered predict request as the log keeps it. The log holds the arrays until it
    has encoded them: a caller must not write into them afterwards."""

    request_id: str
    ts: int  # the request's event time, ms (the by-ids ``ts``, else its instances' latest ``ts``)
    user_id: int
    item_ids: np.ndarray  # int64 [n]: the candidates, in request order
    scores: np.ndarray  # float32 [n]: the model's click probability of each candidate
    model: str
    model_version: int
    experiment: str | None = None  # None: the model was asked directly
    variant: str | None = None
    features_as_of: int | None = None  # the online features' watermark, ms (by ids only)
    shadow: bool = False  # scored off the response path by the experiment's shadow model


class _Record(msgspec.Struct, kw_only=True):
    """The message's fields, as encoded."""

    v: int
    request_id: str
    ts: int
    user_id: int
    item_ids: bytes
    scores: bytes
    model: str
    model_version: int
    experiment: str | None = None
    variant: str | None = None
    features_as_of: int | None = None
    shadow: bool = False


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Record)


def prediction_key(user_id: int) -> bytes:
    return b"%d" % user_id


def encode_prediction(p: Prediction) -> bytes:
    """The message of one prediction; ValueError if its arrays disagree in length (a record
    no reader could use)."""
    if len(p.item_ids) != len(p.scores):
        raise ValueError(f"a prediction of {len(p.item_ids)} item_ids has {len(p.scores)} scores")
    return _encoder.encode(_Record(
        v=PREDICTION_VERSION, request_id=p.request_id, ts=int(p.ts), user_id=int(p.user_id),
        item_ids=np.ascontiguousarray(p.item_ids, dtype=_INT64).tobytes(),
        scores=np.ascontiguousarray(p.scores, dtype=_FLOAT32).tobytes(),
        model=p.model, model_version=int(p.model_version), experiment=p.experiment, variant=p.variant,
        features_as_of=None if p.features_as_of is None else int(p.features_as_of), shadow=bool(p.shadow)))


def decode_prediction(value: bytes | None) -> Prediction:
    """One message back as a :class:`Prediction`; :class:`CorruptPrediction` says what is wrong."""
    if not value:
        raise CorruptPrediction("empty message")
    try:
        r = _decoder.decode(value)
    except msgspec.DecodeError as exc:
        raise CorruptPrediction(f"not a prediction record: {exc}") from None
    if r.v != PREDICTION_VERSION:
        raise CorruptPrediction(f"prediction record version {r.v}; this build reads {PREDICTION_VERSION}")
    if len(r.item_ids) % _INT64.itemsize or len(r.scores) % _FLOAT32.itemsize:
        raise CorruptPrediction("item_ids or scores is not a whole number of int64 / float32 values")
    item_ids, scores = np.frombuffer(r.item_ids, _INT64), np.frombuffer(r.scores, _FLOAT32)
    if len(item_ids) != len(scores):
        raise CorruptPrediction(f"{len(item_ids)} item_ids but {len(scores)} scores")
    if not np.all((scores >= 0) & (scores <= 1)):  # NaN fails too
        raise CorruptPrediction("a score outside [0, 1]")
    return Prediction(r.request_id, r.ts, r.user_id, item_ids, scores, r.model, r.model_version,
                      r.experiment, r.variant, r.features_as_of, r.shadow)


def decode_predictions(values: Sequence[bytes | None]) -> tuple[list[Prediction], list[tuple[int, str]]]:
    """Decode a block of messages: (the good ones in order, [(input index, reason)] of the others)."""
    good: list[Prediction] = []
    rejected: list[tuple[int, str]] = []
    for i, value in enumerate(values):
        try:
            good.append(decode_prediction(value))
        except CorruptPrediction as exc:
            rejected.append((i, str(exc)))
    return good, rejected
