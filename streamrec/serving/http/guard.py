"""What keeps serving answering under hostile or excessive traffic, in the serving process
and the front-end processes alike: connection limits and read timeouts in uvicorn's HTTP
protocol, a file-descriptor limit that fits them, and a throttle on repeated tracebacks.

uvicorn alone closes a connection only when it has been idle ``timeout_keep_alive`` after a
response: a connection that never sends a request, or sends it a byte at a time, stays open
forever, and its ``limit_concurrency`` answers 503 to health checks too, once idle
connections fill it. :class:`GuardedHttpProtocol` closes both kinds of stall, evicts idle
connections rather than run out of descriptors, keeps /healthz and /readyz answerable, and
answers a request its HTTP parser refuses with the JSON error body of every other 4xx.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from streamrec.serving.errors import ApiError
from streamrec.serving.http.shortcut import send_answer
from streamrec.plumbing.config import ServingConfig

log = logging.getLogger("streamrec.serving")
HEALTH_PATHS = (b"/healthz", b"/readyz")
TRACEBACK_INTERVAL_S = 60.0
FD_HEADROOM = 512  # descriptors beyond the connections: model files, RocksDB, sockets to the serving process and Kafka


@dataclass(frozen=True)
class HttpLimits:
    """``serving.keep_alive_s``, ``read_timeout_s``, ``max_connections`` (docs/serving.md)."""

    keep_alive_s: float
    read_timeout_s: float
    max_connections: int

    @classmethod
    def from_serving(cls, s: ServingConfig) -> "HttpLimits":
        return cls(s.keep_alive_s, s.read_timeout_s, s.max_connections)

    def args(self) -> list[str]:
        """As command-line options of ``python -m streamrec.serving.http.frontend``."""
        return ["--keep-alive-s", str(self.keep_alive_s), "--read-timeout-s", str(self.read_timeout_s),
                "--max-connections", str(self.max_connections)]

    def uvicorn_options(self) -> dict[str, Any]:
        """Keyword arguments of ``uvicorn.Config`` that apply these limits (this process's
        open-file limit is raised to fit them first). No WebSocket: no route needs one."""
        raise_fd_limit(self.max_connections)
        return {"http": functools.partial(GuardedHttpProtocol, limits=self), "timeout_keep_alive": self.keep_alive_s, "ws": "none"}


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with:

    - a read timeout: a connection's first request must begin within ``read_timeout_s`` of
      its opening, and every request's head and body must arrive within ``read_timeout_s``
      of its first byte, or the connection is closed (connections that never send anything,
      slowloris, stalled uploads);
    - at most ``max_connections`` requests in progress: one more is answered 503 at once,
      except /healthz and /readyz (a load balancer must not take a busy node for a dead one);
    - past ``max_connections`` open connections, a new one closes the connection idle the
      longest (no request in progress), so that idle connections cannot take every file
      descriptor and starve new ones, health checks included;
    - a request the parser refuses (a bad Content-Length, Content-Length with chunked, a
      garbage request line) answered with :class:`ApiError`'s JSON 400, not uvicorn's text."""

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits, self.app_in_limits = limits, self.app
        self.idle_since = 0.0
        self.read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.idle_since = self.loop.time()
        self._arm_read_timer()
        if len(self.connections) > self.limits.max_connections:
            idle = [c for c in self.connections if c is not self and c.idle()]
            if idle:
                min(idle, key=lambda c: c.idle_since).transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def idle(self) -> bool:
        """No request in progress (reading a request's head counts as idle)."""
        return not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete) and not self.pipeline

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_read_timer()

    def on_headers_complete(self) -> None:
        busy = len(self.tasks) >= self.limits.max_connections and self.url.partition(b"?")[0] not in HEALTH_PATHS
        self.app = self._too_busy if busy else self.app_in_limits  # uvicorn starts the request with self.app
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._cancel_read_timer()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self.idle_since = self.loop.time()
        super().on_response_complete()

    def _arm_read_timer(self) -> None:
        self._cancel_read_timer()
        self.read_timer = self.loop.call_later(self.limits.read_timeout_s, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    def _read_timed_out(self) -> None:
        self.read_timer = None
        if not self.transport.is_closing():
            self.transport.close()  # a request waiting for its body sees http.disconnect

    def send_400_response(self, msg: str) -> None:
        """The JSON 400 that says what was wrong, then close. uvicorn calls this while it
        handles the parser's exception, whose message names the fault (its own ``msg`` is
        the same text for every fault)."""
        fault = sys.exc_info()[1]
        error = ApiError(400, f"invalid HTTP request: {fault}" if fault is not None else msg)
        body = error.body()
        head = [STATUS_LINE[400], *(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers),
                *(name + b": " + value + b"\r\n" for name, value in error.headers()),
                b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)]
        self.transport.write(b"".join(head) + body)
        self.transport.close()

    async def _too_busy(self, scope: Any, receive: Any, send: Any) -> None:
        error = ApiError(503, f"too many requests in progress (serving.max_connections = {self.limits.max_connections:,}); retry shortly")
        await send_answer(send, error.status, error.body(), error.headers())


def raise_fd_limit(max_connections: int) -> None:
    """Raise this process's soft limit on open files to fit ``max_connections`` (up to the hard
    limit): beyond it, accept() fails and nothing is answered, health checks included."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(hard, want)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if soft < want:
            log.warning("open-file limit %d is below serving.max_connections + %d (%d): lower max_connections or raise "
                        "`ulimit -n`", soft, FD_HEADROOM, want)


class LogThrottle(logging.Filter):
    """Lets a record through at most once per ``interval_s`` per kind (logger, message and, with
    a traceback, the exception type and the line that raised it), and says how many were left
    out; with ``tracebacks_only``, records without a traceback always pass. Why: a client that
    finds an input some check misses (or sends garbage for uvicorn to warn about) must not be
    able to flood the log, while a real bug is still logged: the first time, then once a minute."""

    def __init__(self, interval_s: float = TRACEBACK_INTERVAL_S, tracebacks_only: bool = True) -> None:
        super().__init__()
        self.interval_s, self.tracebacks_only = interval_s, tracebacks_only
        self._seen: dict[tuple, tuple[float, int]] = {}  # kind -> (last shown, left out since)

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None and self.tracebacks_only:
            return True
        tb = error.__traceback__ if error is not None else None
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        kind = (record.name, record.msg, type(error), tb.tb_frame.f_code.co_filename if tb else None, tb.tb_lineno if tb else None)
        now = time.monotonic()
        shown, left_out = self._seen.get(kind, (-self.interval_s, 0))
        if now - shown < self.interval_s:
            self._seen[kind] = (shown, left_out + 1)
            return False
        self._seen[kind] = (now, 0)
        if left_out:
            record.msg = f"{record.msg} ({left_out:,} more like it in the last {now - shown:.0f} s, not shown)"
        return True


def throttle_logs() -> None:
    """Throttle the tracebacks of request failures (ours and uvicorn's "Exception in ASGI
    application") and uvicorn's per-connection warnings ("Invalid HTTP request received.")."""
    logging.getLogger("streamrec.serving").addFilter(LogThrottle())
    logging.getLogger("uvicorn.error").addFilter(LogThrottle(tracebacks_only=False))
