"""The typed messages between HTTP front-end processes and the serving process
(serving/runtime/ipc.py carries them): msgspec structs, tagged, encoded as MessagePack. A
front-end decodes and checks every predict body itself, so the serving process gets
ready-made requests: feature columns (``PredictColumns``) or ids to assemble in its next
batch (``PredictByIds``). Arrays travel as raw int64/float32 bytes.

front-end -> serving process: :class:`Hello`, :class:`Requests` (of :class:`PredictColumns`,
:class:`PredictByIds`); serving process -> front-end: :class:`Welcome`, :class:`Answers` (of
:class:`Scored`, :class:`Failed`). Answers come in completion order, matched by ``id``. The
serving process also sends a :class:`Welcome` unasked when what a front-end decodes by
changes (an experiment changed at run time).

Requests and answers travel in groups: a side sends, once per turn of its event loop, every
message that turn produced (the serving process: every answer of a finished batch) in one
frame. The serving process's per-request work is then a few list operations, not a frame, a
task and a write each: its event loop shares one GIL with the batch worker, so that work
delays every batch.
"""

from __future__ import annotations

import msgspec

PROTOCOL = 3  # both sides of a link speak the same; a front-end started from other code refuses to run


class Hello(msgspec.Struct, tag="hello"):
    """Ask for the served model and its feature spec (at start, and after a :class:`Failed`
    with ``spec_changed``)."""

    protocol: int = PROTOCOL


class Welcome(msgspec.Struct, tag="welcome"):
    protocol: int
    models: dict[str, dict | None]  # name -> its served version's FeatureSpec.to_json() (None: no version loaded yet)
    max_future_skew_ms: int  # how far ahead of the clock a by-ids 'ts' may be
    by_ids: bool  # the serving process has online features (serving.feature_store)
    experiments: list[dict] = []  # serving/access/experiments.py entries as JSON: front-ends assign variants themselves


class Call(msgspec.Struct, frozen=True):
    """Who sent a request and where it goes besides its model: the caller's headers (quotas
    and priority are the serving process's, which sees every front-end's traffic), the request id of the
    prediction log, and the experiment variant a front-end assigned."""

    request_id: str | None = None  # the client's x-request-id, if any
    api_key: str | None = None
    priority: str | None = None
    experiment: str | None = None
    variant: str | None = None
    shadow_model: str | None = None  # also scored by this model, off the response path
    log: bool = True  # written to the prediction log (serving.prediction_log); the client's x-prediction-log


class PredictColumns(msgspec.Struct, tag="columns"):
    """A request with every feature, as ``ipc.pack_columns`` packs them."""

    id: int
    model: str
    timeout_s: float | None  # the client's queueing deadline (x-request-timeout-ms), if any
    rows: int
    history_ids: int
    counters: int
    packed: bytes
    call: Call = Call()


class PredictByIds(msgspec.Struct, tag="by_ids"):
    """A checked by-ids request (serving/by_ids.py ``ByIdsQuery``)."""

    id: int
    model: str
    timeout_s: float | None
    user_id: int
    ts: int
    device: str
    local_hour: int
    candidates: bytes  # int64 [n, 4]: item_id, category_id, advertiser_id, position
    return_features: bool = False
    models: list[str] | None = None  # fan-out: scored by each of these models (features assembled once)
    call: Call = Call()


class ModelScores(msgspec.Struct):
    """One model's part of a fan-out answer: its scores, or why it has none."""

    model: str
    model_version: int | None = None
    scores: bytes | None = None  # float32 [n]
    status: int = 200
    message: str = ""


class Scored(msgspec.Struct, tag="scored"):
    id: int
    model_version: int
    scores: bytes  # float32 [n]
    by_ids: bool = False  # the fields below are set
    features_as_of: int | None = None
    features_stale: bool = False
    features: bytes | None = None  # JSON: the values used, per candidate (return_features)
    fan_out: list[ModelScores] | None = None  # a fan-out's answers, per model (``scores`` unused)


class Failed(msgspec.Struct, tag="failed"):
    id: int
    status: int
    message: str
    spec_changed: bool = False  # the served feature spec may have changed: send Hello again
    retry_after_s: int | None = None  # a caller over its quota: when its bucket holds a request again


class Requests(msgspec.Struct, tag="requests"):
    items: list[PredictColumns | PredictByIds]


class Answers(msgspec.Struct, tag="answers"):
    items: list[Scored | Failed]


ToServingProcess = Hello | Requests
ToFrontend = Welcome | Answers
