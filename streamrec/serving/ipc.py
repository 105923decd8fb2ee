"""The link between HTTP front-end processes (serving/frontend.py) and the engine (the
`streamrec serve` process that owns the model, the batcher and the GPU).

One Unix-socket connection per front-end, multiplexed: frames of a 4-byte big-endian length
and a pickle (protocol 5: numpy arrays travel as raw buffers). Messages:

- front-end -> engine ``("hello",)``; engine -> ``("hello", model name, sample spec as JSON)``
- front-end -> engine ``("predict", id, timeout, rows, history ids, counters, packed columns)``; engine ->
  ``("ok", id, version, float32 scores as bytes)`` or ``("error", id, http status, message)``;
  answers come in completion order, matched by id.
- front-end -> engine ``("predict_body", id, timeout, model, body)`` (predict by ids: the features
  live in the engine's online features); engine -> ``("body", id, JSON answer)`` or an
  ``"error"`` as above.

``timeout`` is the client's queueing deadline in seconds (header ``x-request-timeout-ms``) or None.

A request's feature columns travel as one int64 buffer (:func:`pack_columns`): the engine
rebuilds columns from one buffer faster than it unpickles a dataclass of a dozen numpy
arrays, and that rebuild is a large part of its per-request cost (bench/RESULTS.md,
serving_decode).

Only the engine's own front-ends connect (the socket lives in a private 0700 directory).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import struct
from typing import Any, Awaitable, Callable

import numpy as np

from streamrec.model.columns import FeatureColumns
from streamrec.contracts.feature_spec import INT_COLUMNS
from streamrec.serving.errors import ApiError

log = logging.getLogger("streamrec.serving")
_LENGTH = struct.Struct(">I")
MAX_FRAME = 1 << 30


def frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=5)
    return _LENGTH.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message; IncompleteReadError at end of stream."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME:
        raise ValueError(f"frame of {length:,} bytes: not a streamrec front-end")
    return pickle.loads(await reader.readexactly(length))


def pack_columns(columns: FeatureColumns) -> tuple[int, int, int, bytes]:
    """(rows, history ids, counters, one int64 buffer: ints, counters, device hash, history
    lengths, history items, history categories)."""
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


class EngineLink:
    """Engine side: answers the front-ends' predict messages through ``score(columns)``."""

    def __init__(self, path: str, hello: Callable[[], tuple], score: Callable[[Any], Awaitable[tuple[int, Any]]],
                 predict: Callable[[str, bytes, float | None], Awaitable[bytes]]) -> None:
        self.path, self.hello, self.score, self.predict = path, hello, score, predict
        self.connected = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connected += 1
        try:
            while True:
                message = await read_frame(reader)
                if message[0] == "hello":
                    writer.write(frame(self.hello()))
                elif message[0] in ("predict", "predict_body"):
                    task = asyncio.create_task(self._answer(writer, message[0], message[1], message[2], message[3:]))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front-end went away; its in-flight answers are dropped with it
        except Exception:  # noqa: BLE001 -- a broken front-end must not take the engine down
            log.exception("front-end link failed")
        finally:
            self.connected -= 1
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, kind: str, request_id: int, timeout_s: float | None, packed: tuple) -> None:
        try:
            if kind == "predict_body":
                answer = ("body", request_id, await self.predict(*packed, timeout_s))
            else:
                version, scores = await self.score(unpack_columns(*packed), timeout_s)
                answer = ("ok", request_id, version, np.asarray(scores, np.float32).tobytes())
        except ApiError as exc:
            answer = ("error", request_id, exc.status, exc.message)
        except Exception as exc:  # noqa: BLE001 -- every request gets an answer
            log.exception("unexpected error")
            answer = ("error", request_id, 500, f"internal error: {type(exc).__name__}: {exc}")
        if not writer.is_closing():
            writer.write(frame(answer))
