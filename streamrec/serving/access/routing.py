"""Which model scores a predict request, and in which columnar form: one decision for the
serving process's own HTTP and the front-end processes, so both answer alike.

``POST /v1/models/{model}:predict`` goes to that model (a by-ids body may name several in
``"models"``: a fan-out); ``POST /v1/experiments/{name}:predict`` goes to the model of the
user's variant (serving/access/experiments.py), which the answer names.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import msgspec

from streamrec.model.columns import FeatureColumns
from streamrec.serving.by_ids import ByIdsQuery
from streamrec.serving.errors import ApiError, no_feature_store
from streamrec.serving.runtime.messages import Call
from streamrec.serving.runtime.request import ByIdsDecoder, InstanceDecoder, instances_user, invalid_instances, is_by_ids

if TYPE_CHECKING:
    from streamrec.serving.access.experiments import Experiments

MODELS, EXPERIMENTS = "models", "experiments"  # the two predict routes: /v1/{kind}/{name}:predict


@dataclass(slots=True)
class Routed:
    """A decoded predict request and where it goes."""

    model: str  # the model that answers (a fan-out's first)
    payload: FeatureColumns | ByIdsQuery
    call: Call
    fan_out: list[str] | None = None  # by ids: every model that scores it, features assembled once
    extra: dict = field(default_factory=dict)  # added to the answer: experiment, variant, model

    @property
    def ts(self) -> int | None:
        return self.payload.ts if isinstance(self.payload, ByIdsQuery) else None


class RequestRouter:
    """Decodes and checks predict bodies, and picks their model.

    ``decoder_of(model)``: the instance decoder of a served model's feature spec (404 for a
    model the node does not serve, 503 before it has a version); ``served(model)``: 404 unless
    served; ``by_ids``: the node has online features; ``experiments``: the node's, or None."""

    def __init__(self, decoder_of: Callable[[str], InstanceDecoder], served: Callable[[str], None], by_ids: bool, max_instances: int,
                 max_future_skew_ms: int, experiments: "Experiments | None" = None) -> None:
        self.decoder_of, self.served, self.by_ids, self.experiments = decoder_of, served, by_ids, experiments
        self.ids_decoder = ByIdsDecoder(max_instances, max_future_skew_ms)
        self._keys = itertools.count()

    def route(self, kind: str, name: str, body: bytes, call: Call) -> Routed:
        now = int(time.time() * 1000)
        request, query = self._decode_ids(body, now) if is_by_ids(body) else (None, None)
        extra: dict = {}
        if kind == EXPERIMENTS:
            if request is not None and request.models:
                raise ApiError(400, "'models' (a fan-out) is for /v1/models/{model}:predict; an experiment picks the model")
            user = request.user_id if request is not None else instances_user(body)
            assignment = self._assign(name, user, call)
            call = msgspec.structs.replace(call, experiment=name, variant=assignment.variant, shadow_model=assignment.shadow_model)
            model = assignment.model
            extra = {"experiment": name, "variant": assignment.variant, "model": model}
        else:
            model = name
            self.served(model)
        if request is None:
            decoder = self.decoder_of(model)
            columns, rejected = decoder.columns(decoder.decode(body))
            if rejected:
                raise invalid_instances([f"instance {i}: {reason}" for i, reason in rejected])
            return Routed(model, columns, call, extra=extra)
        fan_out = None
        if request.models:  # (models only: an experiment's request with "models" was refused above)
            fan_out = list(dict.fromkeys(request.models))
            for m in fan_out:
                self.served(m)
            model = fan_out[0]
        return Routed(model, query, call, fan_out, extra)

    def _decode_ids(self, body: bytes, now_ms: int):
        if not self.by_ids:
            raise no_feature_store()
        return self.ids_decoder.decode(body, now_ms)

    def _assign(self, name: str, user: int, call: Call):
        if self.experiments is None:
            raise ApiError(404, f"unknown experiment {name!r}; this node runs none (serving.experiments)")
        try:
            return self.experiments.assign(name, user, call.request_id or str(next(self._keys)))
        except KeyError:
            raise ApiError(404, f"unknown experiment {name!r}; this node runs {self.experiments.names()}") from None


def call_of(headers: list[tuple[bytes, bytes]], caller_header: bytes, priority_header: bytes) -> Call:
    """The :class:`Call` of a request's raw ASGI headers (lower-case names)."""
    request_id = api_key = priority = None
    log = True
    for key, value in headers:
        if key == b"x-request-id":
            request_id = value[:200].decode("latin-1")
        elif key == caller_header:
            if api_key is not None:
                raise ApiError(400, f"more than one {caller_header.decode('latin-1')} header: send exactly one")
            api_key = value[:500].decode("latin-1")
        elif key == priority_header:
            if priority is not None:
                raise ApiError(400, f"more than one {priority_header.decode('latin-1')} header: send exactly one")
            priority = value[:20].decode("latin-1")
        elif key == LOG_HEADER:
            if value.strip().lower() not in (b"on", b"off", b"true", b"false", b"1", b"0"):
                raise ApiError(400, f"header x-prediction-log must be on or off, got {value[:20].decode('latin-1')!r}")
            log = value.strip().lower() in (b"on", b"true", b"1")
    return Call(request_id, api_key, priority, log=log)


LOG_HEADER = b"x-prediction-log"  # "off": this request's answer is not written to the prediction log (probes, replays)
