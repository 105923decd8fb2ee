"""``GET /healthz`` (the process answers), ``GET /readyz`` (every model has a version, the
online features have caught up, every front-end is connected) and ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from streamrec.serving.node import ServingNode
from streamrec.serving.errors import ApiError
from streamrec.serving.runtime.ipc import FrontendLink
from streamrec.serving.http.routes.errors import error_response


def add_health_routes(app: FastAPI, node: ServingNode, link: FrontendLink | None = None, frontends: int = 0) -> None:
    """Liveness, readiness and metrics; with a front-end ``link``, readiness also waits for
    ``frontends`` front-end processes to connect."""

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(form: Literal["instances", "by_ids"] | None = None, model: str | None = None) -> Response:
        """Ready for every form the node serves, or for one (``?form=instances``: a load
        balancer pool that sends only full-feature requests need not wait for the features);
        for every model, or for one (``?model=ctr``)."""
        why = node.ready(form, model)
        if why is not None:
            return error_response(ApiError(503, why))
        if link is not None and link.connected < frontends:
            return error_response(ApiError(503, f"{link.connected} of {frontends} HTTP front-ends connected"))
        # ready while it serves a version, even one behind a LATEST it cannot load: it says so
        runtimes = [node.runtime(model)] if model is not None else list(node.runtimes.values())
        return JSONResponse({"status": "ready", "forms": {name: why or "ready" for name, why in node.readiness().items()},
                             "models": {r.name: {"model_version": r.served.version, "latest_problem": r.served.latest_problem}
                                        for r in runtimes}})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(node.observe_metrics().registry), media_type=CONTENT_TYPE_LATEST)

