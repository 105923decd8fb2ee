"""The fast path of the predict route, shared by the serving process and the front-end processes."""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

from streamrec.serving.errors import ApiError
from streamrec.serving.runtime.messages import Call
from streamrec.serving.access.routing import EXPERIMENTS, MODELS, call_of

log = logging.getLogger("streamrec.serving")


PredictBody = Callable[[str, str, bytes, "float | None", Call], Awaitable[bytes]]  # (kind, name, body, timeout_s, call) -> answer


class PredictShortcut:
    """ASGI wrapper that answers ``POST /v1/models/<model>:predict`` and
    ``POST /v1/experiments/<name>:predict`` through ``predict_body`` and hands every other
    request (and the lifespan) to ``app``.

    Why: FastAPI's middleware, routing and parameter handling cost more per request than
    decoding and scoring a request's share of a batch (bench/RESULTS.md, serving), and
    predict is the one route whose throughput matters.
    In the serving process ``predict_body`` is :meth:`ServingNode.predict`, which the FastAPI
    routes call too (same answers, same errors); in a front-end process it sends the request
    to the serving process. ``caller_header``, ``priority_header``: serving.caller_header and
    serving.priority_header (the request's :class:`Call`)."""

    SUFFIX = ":predict"
    PREFIXES = {"/v1/models/": MODELS, "/v1/experiments/": EXPERIMENTS}

    def __init__(self, app: Callable, predict_body: PredictBody, max_body_bytes: int, caller_header: str = "x-api-key",
                 priority_header: str = "x-priority") -> None:
        self.app, self.predict_body, self.max_body_bytes = app, predict_body, max_body_bytes
        self.caller_header, self.priority_header = caller_header.lower().encode("latin-1"), priority_header.lower().encode("latin-1")

    def _target(self, scope) -> tuple[str, str] | None:
        """(kind, name) of a predict request, or None for every other request."""
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] != "POST" or not path.endswith(self.SUFFIX):
            return None
        for prefix, kind in self.PREFIXES.items():
            if path.startswith(prefix):
                return kind, path[len(prefix):-len(self.SUFFIX)]
        return None

    async def __call__(self, scope, receive, send) -> None:
        target = self._target(scope)
        if target is None:
            return await self.app(scope, receive, send)
        status, headers = 200, None
        try:
            timeout_s = request_timeout_s(scope)
            call = call_of(scope["headers"], self.caller_header, self.priority_header)
            answer = await self.predict_body(*target, await read_body(scope, receive, self.max_body_bytes), timeout_s, call)
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
