"""The HTTP API of a serving node (docs/serving.md), on FastAPI: routes only; the work is the
engine's (serving/engine.py).

Routes: ``POST /v1/models/{model}:predict``, ``GET /v1/models/{model}``,
``POST /v1/models/{model}:reload`` and ``:rollback`` (admin: bearer token),
``GET /healthz``, ``GET /readyz``, ``GET /metrics``. Every error is JSON
``{"error": {"code": <http status>, "message": "..."}}`` with a message that says what is
wrong; no input can take the server down. The OpenAPI schema is at ``/openapi.json``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from streamrec.modelstore.store import CorruptVersion
from streamrec.serving.engine import ServingEngine
from streamrec.serving.errors import ApiError
from streamrec.serving.frontend import FrontendPlan, FrontendPool
from streamrec.serving.ipc import EngineLink
from streamrec.serving.shortcut import read_body, request_timeout_s
from streamrec.serving.state import PinNotRecorded
from streamrec import __version__

log = logging.getLogger("streamrec.serving")


def _error(exc: ApiError) -> Response:
    return Response(exc.body(), status_code=exc.status, headers={k.decode(): v.decode() for k, v in exc.headers()})


def create_app(engine: ServingEngine, frontends: FrontendPlan | None = None) -> FastAPI:
    """The engine's API; with ``frontends`` it also starts those processes and answers the
    predict requests they send over the Unix socket (serving/frontend.py)."""
    settings = engine.settings
    link = EngineLink(frontends.socket_path, engine.hello, engine.score, engine.predict) if frontends else None

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await engine.start()
        pool = None
        if link is not None:
            await link.start()
            pool = FrontendPool(frontends).start()
        yield
        if pool is not None:  # front-ends drain their in-flight requests through the engine first
            await asyncio.get_running_loop().run_in_executor(None, pool.stop)
            await link.stop()
        await engine.stop()

    app = FastAPI(title="streamrec serving", version=__version__, lifespan=lifespan,
                  description="Online CTR predictions from a continuously updated model.")
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return _error(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        return _error(ApiError(400, f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error")
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    def check_admin(request: Request) -> None:
        if not settings.admin_token:
            raise ApiError(403, "admin routes are disabled: set serving.admin_token (or STREAMREC_SERVING__ADMIN_TOKEN)")
        header = request.headers.get("authorization", "")
        if not header.startswith("Bearer ") or not hmac.compare_digest(header[7:].encode(), settings.admin_token.encode()):
            raise ApiError(401, "admin route: send 'Authorization: Bearer <serving.admin_token>'")

    async def admin_args(request: Request) -> tuple[int | None, dict[str, str]]:
        """The optional ``{"version": N, "reason": "..."}`` of an admin call, and who asked
        (recorded with a pin)."""
        body = await read_body(request.scope, request.receive, settings.max_body_bytes)
        try:
            data = orjson.loads(body) if body.strip() else {}
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 1):
            raise ApiError(400, f"'version' must be a positive integer, got {version!r}")
        reason = data.get("reason", "")
        if not isinstance(reason, str) or len(reason) > 1000:
            raise ApiError(400, "'reason' must be a string of at most 1000 characters")
        client = request.client.host if request.client else "unknown"
        return version, {"by": f":{request.url.path.rsplit(':', 1)[-1]} on {socket.gethostname()} from {client}", "reason": reason}

    async def admin_call(fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        except (LookupError, CorruptVersion) as exc:
            raise ApiError(409 if isinstance(exc, LookupError) else 422, str(exc)) from None
        except PinNotRecorded as exc:
            raise ApiError(503, str(exc)) from None
        except OSError as exc:
            raise ApiError(503, f"the model store cannot be reached: {exc}") from None

    @app.post("/v1/models/{model}:predict")
    async def predict(model: str, request: Request) -> Response:
        """Scores for ``{"user_id", "context", "candidates"}`` (features from the online feature
        store) or ``{"instances": [sample without label, ...]}``. (`streamrec serve` answers
        this route through :class:`PredictShortcut`, with the same code and errors.)"""
        timeout_s = request_timeout_s(request.scope)
        body = await read_body(request.scope, request.receive, settings.max_body_bytes)
        return Response(await engine.predict(model, body, timeout_s), media_type="application/json")

    @app.get("/v1/models/{model}")
    async def model_status(model: str) -> dict[str, Any]:
        """The served version, the versions rollback can reach, freshness."""
        engine.check_model(model)
        return engine.status()

    @app.post("/v1/models/{model}:reload")
    async def reload(model: str, request: Request) -> dict[str, Any]:
        """``{"version": N}``: serve N and pin it in the store (every node stays on it);
        ``{}``: release the store's pin and catch up to LATEST."""
        engine.check_model(model)
        check_admin(request)
        version, who = await admin_args(request)
        if version:
            reports = [await admin_call(engine.load, version, True, who["by"], who["reason"])]
        else:
            await admin_call(engine.release)
            reports = await admin_call(engine.apply)
        return {"model_version": engine.served.version, "applied": [r.__dict__ for r in reports], "pinned": engine.served.pinned}

    @app.post("/v1/models/{model}:rollback")
    async def rollback(model: str, request: Request) -> dict[str, Any]:
        """Back to ``{"version": N}`` or the previous version; pins it in the store (every
        node, a restarted one too, serves it) until :reload."""
        engine.check_model(model)
        check_admin(request)
        version, who = await admin_args(request)
        report = await admin_call(engine.rollback, version, who["by"], who["reason"])
        return {"model_version": engine.served.version, "previous": report.previous, "seconds": report.locked_s,
                "pinned": engine.served.pinned}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        why = engine.ready()
        if why is not None:
            return _error(ApiError(503, why))
        if link is not None and link.connected < frontends.count:
            return _error(ApiError(503, f"{link.connected} of {frontends.count} HTTP front-ends connected"))
        return JSONResponse({"status": "ready", "model_version": engine.served.version})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(engine.observe_metrics().registry), media_type=CONTENT_TYPE_LATEST)

    return app
