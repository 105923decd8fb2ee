"""Every error of the HTTP API as JSON ``{"error": {"code": <http status>, "message": "..."}}``:
the routes' own :class:`ApiError`, FastAPI's and Starlette's errors (unknown route, wrong
method, invalid parameters), and anything unexpected, so that no input takes the server down."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from streamrec.serving.errors import ApiError

log = logging.getLogger("streamrec.serving")


def error_response(exc: ApiError) -> Response:
    return Response(exc.body(), status_code=exc.status, headers={k.decode(): v.decode() for k, v in exc.headers()})


def install_error_handlers(app: FastAPI) -> None:
    """Answer every exception a route raises as the JSON error above."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        return error_response(ApiError(400, f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error")
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))
