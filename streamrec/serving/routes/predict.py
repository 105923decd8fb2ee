"""``POST /v1/models/{model}:predict``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from streamrec.serving.engine import ServingEngine
from streamrec.serving.shortcut import read_body, request_timeout_s


def add_predict_routes(app: FastAPI, engine: ServingEngine) -> None:
    """The predict route, answered by :meth:`ServingEngine.predict`."""
    max_body_bytes = engine.settings.max_body_bytes

    @app.post("/v1/models/{model}:predict")
    async def predict(model: str, request: Request) -> Response:
        """Scores for ``{"user_id", "context", "candidates"}`` (features from the node's online
        features) or ``{"instances": [sample without label, ...]}``. (`streamrec serve` answers
        this route through :class:`PredictShortcut`, with the same code and errors.)"""
        timeout_s = request_timeout_s(request.scope)
        body = await read_body(request.scope, request.receive, max_body_bytes)
        return Response(await engine.predict(model, body, timeout_s), media_type="application/json")

