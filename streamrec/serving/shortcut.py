"""The fast path of the predict route, shared by the engine and the front-end processes."""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

from streamrec.serving.errors import ApiError

log = logging.getLogger("streamrec.serving")


class PredictShortcut:
    """ASGI wrapper that answers ``POST /v1/models/<model>:predict`` through ``predict_body``
    and hands every other request (and the lifespan) to ``app``.

    Why: FastAPI's middleware, routing and parameter handling cost more per request than
    decoding and scoring a request's share of a batch (bench/RESULTS.md, serving), and
    predict is the one route whose throughput matters.
    In the engine process ``predict_body`` is :meth:`ServingEngine.predict`, which the FastAPI
    route calls too (same answers, same errors); in a front-end process it sends the request
    to the engine."""

    PREFIX, SUFFIX = "/v1/models/", ":predict"

    def __init__(self, app: Callable, predict_body: Callable[[str, bytes, float | None], Awaitable[bytes]], max_body_bytes: int) -> None:
        self.app, self.predict_body, self.max_body_bytes = app, predict_body, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] != "POST" or not path.startswith(self.PREFIX) or not path.endswith(self.SUFFIX):
            return await self.app(scope, receive, send)
        status, headers = 200, None
        try:
            timeout_s = request_timeout_s(scope)
            answer = await self.predict_body(path[len(self.PREFIX):-len(self.SUFFIX)], await read_body(scope, receive, self.max_body_bytes),
                                             timeout_s)
        except ApiError as exc:
            status, answer, headers = exc.status, exc.body(), exc.headers()
        except Exception as exc:  # noqa: BLE001 -- every failure is answered, as the FastAPI handler does
            log.exception("unexpected error")
            status, answer = 500, ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body()
        await send_answer(send, status, answer, headers)


TIMEOUT_HEADER = b"x-request-timeout-ms"


def request_timeout_s(scope) -> float | None:
    """The client's own queueing deadline (header ``x-request-timeout-ms``, a positive number of
    milliseconds), or None; the batcher caps it at serving.queue_timeout_ms."""
    for name, value in scope["headers"]:
        if name == TIMEOUT_HEADER:
            try:
                ms = float(value)
            except ValueError:
                ms = float("nan")
            if not 0 < ms < float("inf"):
                raise ApiError(400, f"header x-request-timeout-ms must be a positive number of milliseconds, got "
                                    f"{value.decode('latin-1')[:40]!r}")
            return ms / 1000
    return None


async def read_body(scope, receive, max_bytes: int) -> bytes:
    """A request's body; 413 before reading when the announced length is over ``max_bytes``."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > max_bytes:
            raise ApiError(413, f"request body of {int(value):,} bytes exceeds serving.max_body_bytes ({max_bytes:,})")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(499, "client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"request body exceeds serving.max_body_bytes ({max_bytes:,})")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_answer(send, status: int, body: bytes, headers: list | None = None) -> None:
    """A complete response (JSON unless ``headers`` say otherwise)."""
    headers = headers if headers is not None else [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
