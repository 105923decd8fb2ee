"""Answered requests on their way up to the node (its prediction log and shadow scoring).

A model runtime's replies put each answer here and the node's task takes them, in order, so
nothing below the node calls back into it. Everything runs on the event loop's thread: the
batcher settles its replies there.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from streamrec.model.columns import FeatureColumns
from streamrec.serving.by_ids import ByIdsQuery
from streamrec.serving.runtime.batcher import BatchResult
from streamrec.serving.runtime.messages import Call


@dataclass(frozen=True)
class Answer:
    """One request's outcome for the node: the model's ``result``, or for a shadow request
    the ``error`` it failed with."""

    model: str
    payload: FeatureColumns | ByIdsQuery
    call: Call
    result: BatchResult | None
    shadow: bool = False
    error: BaseException | None = None


class Answers:
    """A queue of :class:`Answer`: ``put`` by the replies, ``take`` by the node's one reader."""

    def __init__(self) -> None:
        self._queue: deque[Answer] = deque()
        self._ready: asyncio.Event | None = None

    def put(self, answer: Answer) -> None:
        self._queue.append(answer)
        if self._ready is not None:
            self._ready.set()

    async def take(self) -> list[Answer]:
        """Every answer queued, oldest first; waits for one when there is none."""
        if self._ready is None:
            self._ready = asyncio.Event()
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        taken = list(self._queue)
        self._queue.clear()
        return taken

    def __len__(self) -> int:
        return len(self._queue)


class ShadowReply:
    """A shadow request's outcome (the batcher's ``Reply``): answered to nobody, queued for the
    node to count and log."""

    __slots__ = ("answers", "model", "payload", "call")

    def __init__(self, answers: Answers, model: str, payload: FeatureColumns | ByIdsQuery, call: Call) -> None:
        self.answers, self.model, self.payload, self.call = answers, model, payload, call

    def done(self) -> bool:
        return False

    def set_result(self, result: BatchResult) -> None:
        self.answers.put(Answer(self.model, self.payload, self.call, result, shadow=True))

    def set_exception(self, exc: BaseException) -> None:
        self.answers.put(Answer(self.model, self.payload, self.call, None, shadow=True, error=exc))
