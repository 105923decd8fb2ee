"""``GET /v1/models`` (the served models), ``GET /v1/models/{model}`` (status) and the admin
calls ``POST /v1/models/{model}:reload`` and ``:rollback``, which need
``Authorization: Bearer <serving.admin_token>``."""

from __future__ import annotations

import asyncio
import hmac
import socket
from typing import Any, Callable

import orjson
from fastapi import FastAPI, Request

from streamrec.modelstore.store import CorruptVersion
from streamrec.plumbing.config import ServingConfig
from streamrec.serving.node import ServingNode
from streamrec.serving.errors import ApiError, bearer_token, one_authorization
from streamrec.serving.http.shortcut import read_body
from streamrec.serving.runtime.state import PinNotRecorded


ADMIN_KEYS = {"version", "reason"}


def check_admin(request: Request, admin_token: str) -> None:
    """403 while the admin routes are off (no token configured), 401 without the right token."""
    if not admin_token:
        raise ApiError(403, "admin routes are disabled: set serving.admin_token (or STREAMREC_SERVING__ADMIN_TOKEN)")
    one_authorization(request.scope["headers"])
    token = bearer_token(request.headers.get("authorization", ""))
    if token is None or not hmac.compare_digest(token.encode(), admin_token.encode()):
        raise ApiError(401, "admin route: send 'Authorization: Bearer <serving.admin_token>'")


async def admin_args(request: Request, settings: ServingConfig) -> tuple[int | None, dict[str, str]]:
    """The optional ``{"version": N, "reason": "..."}`` of an admin call, and who asked
    (recorded with a pin)."""
    body = await read_body(request.scope, request.receive, settings.max_body_bytes)
    try:
        data = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - ADMIN_KEYS)
    if unknown:  # a typo ({"versoin": 3}) must not read as {} and release the pin
        raise ApiError(400, f"unknown key(s) {', '.join(map(repr, unknown))} in the request body; it takes {sorted(ADMIN_KEYS)}")
    version = data.get("version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 1):
        raise ApiError(400, f"'version' must be a positive integer, got {version!r}")
    reason = data.get("reason", "")
    if not isinstance(reason, str) or len(reason) > 1000:
        raise ApiError(400, "'reason' must be a string of at most 1000 characters")
    client = request.client.host if request.client else "unknown"
    return version, {"by": f":{request.url.path.rsplit(':', 1)[-1]} on {socket.gethostname()} from {client}", "reason": reason}


async def admin_call(fn: Callable, *args):
    """``fn(*args)`` off the event loop, its failures as the HTTP errors they mean: 409 no such
    version, 422 a corrupt one, 503 the model store cannot be reached or the pin not recorded."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    except (LookupError, CorruptVersion) as exc:
        raise ApiError(409 if isinstance(exc, LookupError) else 422, str(exc)) from None
    except PinNotRecorded as exc:
        raise ApiError(503, str(exc)) from None
    except OSError as exc:
        raise ApiError(503, f"the model store cannot be reached: {exc}") from None


def add_model_routes(app: FastAPI, node: ServingNode) -> None:
    """The models' status and their admin calls, which move a model's served version."""
    settings = node.settings

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """Every model this node serves: its version, pin and readiness per request form."""
        return {"models": node.models()}

    @app.get("/v1/models/{model}")
    async def model_status(model: str) -> dict[str, Any]:
        """The served version, the versions rollback can reach, freshness."""
        return node.model_status(model)

    @app.post("/v1/models/{model}:reload")
    async def reload(model: str, request: Request) -> dict[str, Any]:
        """``{"version": N}``: serve N and pin it in the store (every node stays on it);
        ``{}``: release the store's pin and catch up to LATEST."""
        runtime = node.runtime(model)
        check_admin(request, settings.admin_token)
        version, who = await admin_args(request, settings)
        if version:
            reports = [await admin_call(runtime.load, version, True, who["by"], who["reason"])]
        else:
            await admin_call(runtime.release)
            reports = await admin_call(runtime.apply)
        return {"model_version": runtime.served.version, "applied": [r.__dict__ for r in reports], "pinned": runtime.served.pinned}

    @app.post("/v1/models/{model}:rollback")
    async def rollback(model: str, request: Request) -> dict[str, Any]:
        """Back to ``{"version": N}`` or the previous version; pins it in the store (every
        node, a restarted one too, serves it) until :reload."""
        runtime = node.runtime(model)
        check_admin(request, settings.admin_token)
        version, who = await admin_args(request, settings)
        report = await admin_call(runtime.rollback, version, who["by"], who["reason"])
        return {"model_version": runtime.served.version, "previous": report.previous, "seconds": report.locked_s,
                "pinned": runtime.served.pinned}
