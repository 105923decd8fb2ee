"""``POST /v1/models/{model}:predict`` and ``POST /v1/experiments/{name}:predict``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from streamrec.serving.node import ServingNode
from streamrec.serving.access.routing import EXPERIMENTS, MODELS, call_of
from streamrec.serving.http.shortcut import read_body, request_timeout_s


def add_predict_routes(app: FastAPI, node: ServingNode) -> None:
    """The predict routes, answered by :meth:`ServingNode.predict`. (`streamrec serve` answers
    them through :class:`PredictShortcut`, with the same code and errors.)"""
    settings = node.settings
    caller, priority = settings.caller_header.lower().encode("latin-1"), settings.priority_header.lower().encode("latin-1")

    async def answer(kind: str, name: str, request: Request) -> Response:
        timeout_s = request_timeout_s(request.scope)
        call = call_of(request.scope["headers"], caller, priority)
        body = await read_body(request.scope, request.receive, settings.max_body_bytes)
        return Response(await node.predict(kind, name, body, timeout_s, call), media_type="application/json")

    @app.post("/v1/models/{model}:predict")
    async def predict(model: str, request: Request) -> Response:
        """Scores for ``{"user_id", "context", "candidates"}`` (features from the node's online
        features; ``"models": [...]`` scores them with each model) or
        ``{"instances": [sample without label, ...]}``."""
        return await answer(MODELS, model, request)

    @app.post("/v1/experiments/{name}:predict")
    async def predict_experiment(name: str, request: Request) -> Response:
        """The same bodies, scored by the model of the user's variant; the answer adds
        ``experiment``, ``variant`` and ``model``."""
        return await answer(EXPERIMENTS, name, request)
