"""The link between HTTP front-end processes (serving/http/frontend.py) and the serving process
(the `streamrec serve` process that owns the models, the batchers and the GPU).

One Unix-socket connection per front-end, multiplexed: frames of a 4-byte big-endian length
and one typed message (serving/runtime/messages.py, MessagePack). A request's feature columns travel
as one int64 buffer (:func:`pack_columns`): the serving process rebuilds columns from one buffer
faster than it decodes a dozen arrays, and that rebuild is a large part of its per-request
cost (bench/RESULTS.md, serving_decode).

Only the serving process's own front-ends connect (the socket lives in a private 0700 directory).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Callable

import msgspec
import numpy as np

from streamrec.model.columns import FeatureColumns
from streamrec.contracts.feature_spec import INT_COLUMNS
from streamrec.serving.by_ids import ByIdsQuery
from streamrec.serving.errors import ApiError, SpecChanged
from streamrec.serving.runtime.messages import (Answers, Failed, Hello, PredictByIds, PredictColumns, Requests, Scored,
                                                ToFrontend, ToServingProcess, Welcome)

log = logging.getLogger("streamrec.serving")
_LENGTH = struct.Struct(">I")
MAX_FRAME = 1 << 30


_ENCODER = msgspec.msgpack.Encoder()
TO_SERVING_PROCESS = msgspec.msgpack.Decoder(ToServingProcess)
TO_FRONTEND = msgspec.msgpack.Decoder(ToFrontend)


def frame(message: msgspec.Struct) -> bytes:
    data = _ENCODER.encode(message)
    return _LENGTH.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader, decoder: msgspec.msgpack.Decoder):
    """The next message; IncompleteReadError at end of stream."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME:
        raise ValueError(f"frame of {length:,} bytes: not a streamrec front-end")
    return decoder.decode(await reader.readexactly(length))


def pack_columns(columns: FeatureColumns) -> tuple[int, int, int, bytes]:
    """(rows, history ids, counters, one int64 buffer: ints, counters, device hash, history
    lengths, history items, history categories)."""
    if columns.hist_group is not None:
        raise ValueError("columns whose rows share histories (hist_group) do not travel packed")
    n, m, k = len(columns), len(columns.hist_items), columns.counters.shape[1]
    ints = np.stack([columns.ints[name] for name in INT_COLUMNS], axis=1) if n else np.zeros((0, len(INT_COLUMNS)), np.int64)
    parts = [ints.astype(np.int64, copy=False).ravel(), columns.counters.astype(np.int64, copy=False).ravel(), columns.device_hash,
             columns.hist_lengths, columns.hist_items, columns.hist_categories]
    return n, m, k, np.concatenate([np.asarray(p, np.int64) for p in parts]).tobytes()


def unpack_columns(n: int, m: int, k: int, data: bytes) -> FeatureColumns:
    flat = np.frombuffer(data, np.int64)
    c = len(INT_COLUMNS)
    if len(flat) != n * (c + k + 2) + 2 * m:
        raise ValueError(f"packed columns of {len(flat)} values do not hold {n} rows, {k} counters and {m} history ids")
    ints, at = flat[: n * c].reshape(n, c), n * c
    counters, at = flat[at: at + n * k].reshape(n, k), at + n * k
    device_hash, lengths, at = flat[at: at + n], flat[at + n: at + 2 * n], at + 2 * n
    return FeatureColumns(ints={name: ints[:, j] for j, name in enumerate(INT_COLUMNS)}, counters=counters, device_hash=device_hash,
                          hist_items=flat[at: at + m], hist_categories=flat[at + m: at + 2 * m], hist_lengths=lengths)


class Outbox:
    """One side of a link's messages not sent yet, written as one ``group`` frame
    (:class:`Requests` from a front-end, :class:`Answers` from the serving process) at the end of the
    event loop's turn: a front-end's requests decoded in one turn, a finished batch's answers
    to one front-end. Used on the event loop's thread only."""

    __slots__ = ("writer", "group", "items", "scheduled")

    def __init__(self, writer: asyncio.StreamWriter, group: type[Requests] | type[Answers]) -> None:
        self.writer, self.group = writer, group
        self.items: list = []
        self.scheduled = False

    @property
    def closed(self) -> bool:
        """The other side went away: what is queued for it need not run."""
        return self.writer.is_closing()

    def put(self, message: PredictColumns | PredictByIds | Scored | Failed) -> None:
        self.items.append(message)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        items, self.items, self.scheduled = self.items, [], False
        if items and not self.writer.is_closing():
            self.writer.write(frame(self.group(items)))


def payload_of(message: PredictColumns | PredictByIds) -> FeatureColumns | ByIdsQuery:
    """The serving process's form of a front-end's request."""
    if isinstance(message, PredictByIds):
        candidates = np.frombuffer(message.candidates, np.int64).reshape(-1, 4)
        return ByIdsQuery(message.user_id, message.ts, message.device, message.local_hour, candidates, message.return_features)
    return unpack_columns(message.rows, message.history_ids, message.counters, message.packed)


Take = Callable[[PredictColumns | PredictByIds, Outbox], None]


class FrontendLink:
    """The serving process's side of the front-ends' links: hands each request message to ``take(message,
    outbox)`` (serving/node.py), which queues it for a batch and later puts its
    :class:`Scored` or :class:`Failed` into the outbox (or answers a refusal at once)."""

    def __init__(self, path: str, hello: Callable[[], Welcome], take: Take) -> None:
        self.path, self.hello, self.take = path, hello, take
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None

    @property
    def connected(self) -> int:
        return len(self._writers)

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def broadcast(self, welcome: Welcome) -> None:
        """A :class:`Welcome` to every connected front-end, unasked (what they route by changed)."""
        data = frame(welcome)
        for writer in self._writers:
            if not writer.is_closing():
                writer.write(data)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        outbox = Outbox(writer, Answers)
        try:
            while True:
                message = await read_frame(reader, TO_SERVING_PROCESS)
                if isinstance(message, Hello):
                    writer.write(frame(self.hello()))
                    continue
                for request in message.items:
                    self._take(request, outbox)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front-end went away; its in-flight answers are dropped with it
        except Exception:  # noqa: BLE001 -- a broken front-end must not take the serving process down
            log.exception("front-end link failed")
        finally:
            self._writers.discard(writer)
            writer.close()

    def _take(self, message: PredictColumns | PredictByIds, outbox: Outbox) -> None:
        try:
            self.take(message, outbox)
        except Exception as exc:  # noqa: BLE001 -- every request gets an answer
            if not isinstance(exc, ApiError):
                log.exception("unexpected error")
            outbox.put(failed(message.id, exc))


def failed(request_id: int, exc: BaseException) -> Failed:
    """The link's answer for a request that failed with ``exc``: an ApiError as it says (a quota's
    Retry-After with it), anything else a 500."""
    if not isinstance(exc, ApiError):
        return Failed(request_id, 500, f"internal error: {type(exc).__name__}: {exc}")
    return Failed(request_id, exc.status, exc.message, spec_changed=isinstance(exc, SpecChanged),
                  retry_after_s=getattr(exc, "retry_after_s", None))
