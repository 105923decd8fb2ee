"""Request aggregation: concurrent predict requests become one batch (TensorBatch).

Requests wait in a queue; a batch closes when it holds ``max_batch`` instances or its
oldest request has waited ``max_delay_us`` (and a worker is free). Up to ``workers``
batches run at once on a thread pool (decoding and the model run outside the event loop, so the server keeps
accepting requests meanwhile); ``workers = 0`` runs each batch on the event loop's own thread,
so no second Python thread takes the GIL from it mid-batch (requests that arrive meanwhile
wait in their sockets, and are read together after it). ``run_batch`` gets every request's payload at once — so the batch
is decoded, checked and scored in one pass, whatever the number of requests — and
returns one outcome per request: its scores, or the exception that request gets.

Overload is shed, not queued: past ``max_queue_instances`` waiting instances a request is
refused at once, and one that waits past its deadline (``queue_timeout_s``, or less if its
client asked) without reaching a batch is dropped (never run) — both with :class:`Shed`. A
queue that only grows makes every answer late.

Background work (a shadow model's copy of a request, which nobody waits for) has a lane of
its own: it runs in batches of its own (up to ``max_batch`` instances: a batch's fixed cost is
most of a small one's), only when no batcher of its :class:`BatcherGroup` (a node's) has a
request waiting, and is dropped when its lane holds more than ``max_queue_instances // 4``
instances: a request someone waits for never queues behind more than the background batch in
progress and one more.

Which requests a batch takes: a request of at most ``max_batch // 16`` instances is *small*
and waits in a lane of its own. A batch takes (1) the oldest request, whatever its size, (2)
small requests, oldest first, up to half the batch, (3) the rest in arrival order while it
fits. In arrival order alone a small request queued behind many big ones waits for every batch
they fill (head-of-line blocking), though it adds almost nothing to a batch; so small ones ride
in the next batch, and they never take more than half a batch ahead of their turn. Rule (1) is
the progress and no-starvation guarantee: every batch takes the oldest request, so a request
is in one of the next k + 1 batches when k requests were queued before it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np


class Shed(Exception):
    """A request the batcher refused (``reason`` "queue_full") or dropped unrun ("deadline")."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Reply(Protocol):
    """Where a request's outcome goes: an asyncio.Future, or anything with the same three
    methods (the front-end link answers without a future or task per request)."""

    def done(self) -> bool: ...  # True: answered, or its caller is gone (it is not run)

    def set_result(self, result: "BatchResult") -> None: ...

    def set_exception(self, exc: BaseException) -> None: ...


@dataclass
class _Request:
    payload: list  # one item per instance
    reply: Reply
    timeout_s: float  # dropped unrun once it has waited this long
    asked: bool  # the timeout is the client's own (shorter than serving.queue_timeout_ms)
    enqueued: float = field(default_factory=time.perf_counter)
    out: bool = False  # taken into a batch or dropped: its queue entries are stale

    @property
    def deadline(self) -> float:
        return self.enqueued + self.timeout_s


@dataclass
class BatchResult:
    version: int
    scores: np.ndarray
    queued_s: float  # waiting for the batch to close and for a worker
    batch_rows: int  # instances in the batch this request rode in


@dataclass
class BatchingStats:
    """Cumulative figures of the batcher, so where a request's time goes is visible from
    outside (``GET /v1/models/<model>``): waiting for its batch vs the batch's run."""

    recent_runs: deque = field(default_factory=lambda: deque(maxlen=4096))  # seconds, the last batches
    recent_waits: deque = field(default_factory=lambda: deque(maxlen=16384))  # seconds, the last requests
    batches: int = 0
    requests: int = 0
    rows: int = 0
    queued_s: float = 0.0  # summed over requests
    run_s: float = 0.0  # summed over batches: decode, lookups, model, copy back (worker thread)
    longest_run_s: float = 0.0
    shed: dict[str, int] = field(default_factory=lambda: {"queue_full": 0, "deadline": 0})

    def add(self, batch: list[_Request], rows: int, started: float, ended: float) -> None:
        self.batches += 1
        self.requests += len(batch)
        self.rows += rows
        waits = [started - r.enqueued for r in batch]
        self.queued_s += sum(waits)
        self.recent_waits.extend(waits)
        self.recent_runs.append(ended - started)
        self.run_s += ended - started
        self.longest_run_s = max(self.longest_run_s, ended - started)

    def as_json(self) -> dict:
        b = max(self.batches, 1)
        return {"batches": self.batches, "requests": self.requests, "rows": self.rows,
                "queued_s": round(self.queued_s, 6), "run_s": round(self.run_s, 6),
                "requests_per_batch": round(self.requests / b, 2), "rows_per_batch": round(self.rows / b, 1),
                "queued_ms_per_request": round(self.queued_s / max(self.requests, 1) * 1000, 3),
                "run_ms_per_batch": round(self.run_s / b * 1000, 3), "longest_run_ms": round(self.longest_run_s * 1000, 3),
                "shed": dict(self.shed),
                "recent": {"batches": len(self.recent_runs), "run_ms_p50": _percentile_ms(self.recent_runs, 50),
                           "run_ms_p99": _percentile_ms(self.recent_runs, 99), "queued_ms_p99": _percentile_ms(self.recent_waits, 99)}}


def _percentile_ms(values: deque, q: float) -> float | None:
    return round(float(np.percentile(np.fromiter(values, float), q)) * 1000, 3) if values else None


class BatcherGroup:
    """The batchers of one serving node (one per model): background work runs only while none
    of them has a request someone waits for."""

    def __init__(self) -> None:
        self.members: list[RequestBatcher] = []

    def idle(self) -> bool:
        return not any(batcher.has_foreground for batcher in self.members)


class RequestBatcher:
    fair: bool = True  # False: batches in arrival order only (the overload bench's baseline)

    def __init__(self, run_batch: Callable[[list[list]], list[tuple[int, np.ndarray] | Exception]], max_batch: int, max_delay_us: int,
                 workers: int, *, max_queue_instances: int, queue_timeout_s: float, group: BatcherGroup | None = None) -> None:
        """``group``: the node's batchers, joined here (default: a group of this one alone)."""
        if max_batch < 1 or max_delay_us < 0 or workers < 0 or max_queue_instances < 1 or queue_timeout_s <= 0:
            raise ValueError("serving.max_batch and serving.max_queue_instances must be >= 1, serving.workers and "
                             "serving.max_delay_us >= 0, serving.queue_timeout_ms > 0")
        self.run_batch = run_batch
        self.max_batch, self.max_delay_s, self.workers = max_batch, max_delay_us / 1e6, workers
        self.max_queue_instances, self.queue_timeout_s = max_queue_instances, queue_timeout_s
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="serving-batch") if workers else None
        self.small_rows = max(1, max_batch // 16)  # a request of at most this many instances is small
        self._big: deque[_Request] = deque()  # arrival order; entries with ``out`` set are skipped
        self._small: deque[_Request] = deque()  # the same, small requests
        self._deadlines: list[tuple[float, int, _Request]] = []  # heap: the next request to expire
        self._sequence = itertools.count()
        self._pending_rows = 0
        self._last_arrival = 0.0
        self._gap_s = 0.0  # moving average of the time between requests
        self._waiting: asyncio.Event | None = None  # a request is pending
        self._full: asyncio.Event | None = None  # max_batch instances are pending
        self._free = max(workers, 1)  # workers not running a batch
        self._arrivals = 0  # requests queued so far
        self._backlog = False  # what is queued arrived while a batch ran on the loop: it has waited already
        self._wake: asyncio.Event | None = None  # a worker freed, or a request came with a sooner deadline
        self._waiting_until = float("inf")  # the deadline the loop sleeps towards while every worker is busy
        self._task: asyncio.Task | None = None
        self.stats = BatchingStats()
        self._background: deque[_Request] = deque()
        self._background_rows = 0
        self.group = group if group is not None else BatcherGroup()
        self.group.members.append(self)

    async def start(self) -> None:
        self._waiting, self._full = asyncio.Event(), asyncio.Event()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="request-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    @property
    def queued_instances(self) -> int:
        return self._pending_rows

    def check_room(self, rows: int = 1) -> None:
        """:class:`Shed` ("queue_full") if ``rows`` more instances would pass the queue's bound:
        callers ask before decoding a request, so a full queue costs the refused nothing."""
        if self._pending_rows + rows > self.max_queue_instances:
            self.stats.shed["queue_full"] += 1
            raise Shed("queue_full", f"overloaded: {self._pending_rows:,} instances are waiting for a batch and this request's "
                                     f"{rows:,} would pass serving.max_queue_instances ({self.max_queue_instances:,}); "
                                     "retry shortly or elsewhere")

    async def submit(self, payload: list, timeout_s: float | None = None) -> BatchResult:
        """Queue one request and wait for its outcome (see :meth:`enqueue`)."""
        future = asyncio.get_running_loop().create_future()
        self.enqueue(payload, future, timeout_s)
        return await future

    def enqueue(self, payload: list, reply: Reply, timeout_s: float | None = None) -> None:
        """Queue one request (cheap: no task or timer per request); its outcome goes to
        ``reply``. :class:`Shed` at once when the queue is full; a request that waits past its
        deadline, ``timeout_s`` (the client's) if shorter than ``queue_timeout_s``, gets
        :class:`Shed` through ``reply``. Called on the event loop's thread."""
        self.check_room(len(payload))
        asked = timeout_s is not None and timeout_s < self.queue_timeout_s
        request = _Request(payload, reply, timeout_s if asked else self.queue_timeout_s, asked)
        heapq.heappush(self._deadlines, (request.deadline, next(self._sequence), request))
        if self._last_arrival:
            self._gap_s += 0.2 * (request.enqueued - self._last_arrival - self._gap_s)
        self._last_arrival = request.enqueued
        self._arrivals += 1
        (self._small if len(payload) <= self.small_rows else self._big).append(request)
        self._pending_rows += len(payload)
        self._waiting.set()
        if self._pending_rows >= self.max_batch:
            self._full.set()
        if request.deadline < self._waiting_until:
            self._wake.set()

    @property
    def has_foreground(self) -> bool:
        """A request someone waits for is queued here."""
        return self._pending_rows > 0

    def enqueue_background(self, payload: list, reply: Reply) -> bool:
        """Queue work nobody waits for (see the module docstring); False, and not queued, when
        the background lane is full."""
        if self._background_rows + len(payload) > self.max_queue_instances // 4:
            return False
        self._background.append(_Request(payload, reply, self.queue_timeout_s, False))
        self._background_rows += len(payload)
        self._waiting.set()
        return True

    async def _loop(self) -> None:
        """Close a batch when a worker is free and the oldest pending request has waited
        ``max_delay_us`` or ``max_batch`` instances are pending; while every worker is busy
        the next batch keeps growing. When requests come further apart than ``max_delay_us``
        on average, waiting would only add latency (the next one is not expected within the
        window): the batch closes as soon as a worker is free."""
        while True:
            await self._waiting.wait()
            if not self.has_foreground:  # only background work is queued
                if self._free:
                    await self._run_background()
                else:
                    self._wake.clear()
                    await self._wake.wait()
                continue
            if self._free == 0:  # every worker busy: sleep until one frees or the earliest deadline passes
                self._wake.clear()
                self._waiting_until = self._next_deadline()
                try:
                    await asyncio.wait_for(self._wake.wait(), self._waiting_until - time.perf_counter())
                except asyncio.TimeoutError:
                    pass
                self._waiting_until = float("inf")
                self._drop_expired(time.perf_counter())
                continue
            self._free -= 1
            free_at = time.perf_counter()
            # the batching window: never past a queued request's deadline (the window is our choice, not overload)
            left = min(self._oldest()[0].enqueued + self.max_delay_s, self._next_deadline()) - free_at
            if left > 0 and self._pending_rows < self.max_batch and self._gap_s < self.max_delay_s and not self._backlog:
                try:
                    await asyncio.wait_for(self._full.wait(), left)
                except asyncio.TimeoutError:
                    pass
            self._drop_expired(free_at)  # only what expired before a worker was free for it
            batch, rows = self._take()
            if not batch:
                self._free += 1
                continue
            if self._executor is None:
                self._run_here(batch, rows)
                self._backlog = await self._read_backlog()
            else:
                asyncio.create_task(self._run(batch, rows))

    async def _run_background(self) -> None:
        """One background batch, once the node is idle (otherwise wait a moment and look again)."""
        if not self._background:
            self._settle()
            return
        if not self.group.idle():
            await asyncio.sleep(0.0005)
            return
        now, batch, rows = time.perf_counter(), [], 0
        while self._background and (not batch or rows + len(self._background[0].payload) <= self.max_batch):
            request = self._background.popleft()
            self._background_rows -= len(request.payload)
            if now > request.deadline:
                request.reply.set_exception(Shed("deadline", "background work waited past serving.queue_timeout_ms"))
            else:
                batch.append(request)
                rows += len(request.payload)
        self._settle()
        if not batch:
            return
        self._free -= 1
        if self._executor is None:
            self._run_here(batch, rows)
            self._backlog = await self._read_backlog()  # what came meanwhile has waited this batch: no window for it
        else:
            asyncio.create_task(self._run(batch, rows))

    def _next_deadline(self) -> float:
        """The earliest deadline of a request still queued (stale heap entries are dropped)."""
        while self._deadlines[0][2].out:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0]

    def _drop_expired(self, now: float) -> None:
        """Answer the queued requests whose deadline passed by ``now`` with :class:`Shed`; they
        are never run."""
        while self._deadlines and (self._deadlines[0][2].out or self._deadlines[0][0] <= now):
            request = heapq.heappop(self._deadlines)[2]
            if request.out:
                continue
            request.out = True
            self._pending_rows -= len(request.payload)
            if not request.reply.done():  # (one whose caller is gone is not counted)
                self.stats.shed["deadline"] += 1
                limit = (f"its x-request-timeout-ms ({request.timeout_s * 1000:,.0f})" if request.asked
                         else f"serving.queue_timeout_ms ({self.queue_timeout_s * 1000:,.0f})")
                request.reply.set_exception(Shed("deadline", f"overloaded: this request waited {(now - request.enqueued) * 1000:,.0f} ms "
                                                              f"for a batch, past {limit}; it was not run, retry shortly"))
        self._settle()

    def _settle(self) -> None:
        """Drop stale entries at the heads of the lanes and reset the events to what is queued."""
        for lane in (self._big, self._small):
            while lane and lane[0].out:
                lane.popleft()
        if len(self._deadlines) > 2 * (len(self._big) + len(self._small)) + 64:  # answered requests wait in the heap for their deadline
            self._deadlines = [entry for entry in self._deadlines if not entry[2].out]
            heapq.heapify(self._deadlines)
        if not self._big and not self._small and not self._background:
            self._waiting.clear()
        if self._pending_rows < self.max_batch:
            self._full.clear()

    @staticmethod
    def _head(lane: deque[_Request]) -> _Request | None:
        """The lane's oldest request still queued (stale entries are dropped)."""
        while lane and lane[0].out:
            lane.popleft()
        return lane[0] if lane else None

    def _oldest(self) -> deque[_Request]:
        """The lane whose head is the oldest request still queued (an empty lane when none is)."""
        big, small = self._head(self._big), self._head(self._small)
        return self._small if small is not None and (big is None or small.enqueued < big.enqueued) else self._big

    def _take(self) -> tuple[list[_Request], int]:
        """The next batch, up to ``max_batch`` instances, in the order of the module docstring
        (at least one request unless every queued caller is gone)."""
        batch: list[_Request] = []
        rows = small_rows = 0

        def add(lane: deque[_Request]) -> int:
            nonlocal rows
            request = lane.popleft()
            request.out = True
            self._pending_rows -= len(request.payload)
            if request.reply.done():  # its caller is gone (cancelled): nothing to run it for
                return 0
            batch.append(request)
            rows += len(request.payload)
            return len(request.payload)

        while not batch and (lane := self._oldest()):
            add(lane)
        while self.fair and (request := self._head(self._small)) is not None \
                and small_rows + len(request.payload) <= self.max_batch // 2 and rows + len(request.payload) <= self.max_batch:
            small_rows += add(self._small)
        while (lane := self._oldest()) and rows + len(lane[0].payload) <= self.max_batch:
            add(lane)
        self._settle()
        return batch, rows

    async def _run(self, batch: list[_Request], rows: int) -> None:
        started = time.perf_counter()
        try:
            outcomes = await asyncio.get_running_loop().run_in_executor(self._executor, self.run_batch, [r.payload for r in batch])
        except Exception as exc:  # every request of the batch learns why
            outcomes = exc
        self._answer(batch, rows, started, outcomes)

    def _run_here(self, batch: list[_Request], rows: int) -> None:
        """Run a batch on the event loop's thread (``workers = 0``)."""
        started = time.perf_counter()
        try:
            outcomes = self.run_batch([r.payload for r in batch])
        except Exception as exc:  # noqa: BLE001 -- every request of the batch learns why
            outcomes = exc
        self._answer(batch, rows, started, outcomes)

    async def _read_backlog(self, turns: int = 3, most_s: float = 0.001) -> bool:
        """After a batch ran on the loop (``workers = 0``): let the loop read the requests that
        arrived meanwhile, until ``turns`` turns bring no new one (a request's bytes take two
        turns to become a queued request) or ``most_s`` passes. Whether any are queued: they
        have waited a whole batch already, so the next one closes without a window."""
        ends = time.perf_counter() + most_s
        while time.perf_counter() < ends and self._pending_rows < self.max_batch:
            seen = self._arrivals
            for _ in range(turns):
                await asyncio.sleep(0)
            if self._arrivals == seen:
                break
        return self._pending_rows > 0

    def _answer(self, batch: list[_Request], rows: int, started: float, outcomes: list | Exception) -> None:
        """Each request's outcome (or the batch's exception) to its reply; the worker is free again."""
        try:
            if isinstance(outcomes, Exception):
                for r in batch:
                    if not r.reply.done():
                        r.reply.set_exception(outcomes)
                return
            self.stats.add(batch, rows, started, time.perf_counter())
            for r, outcome in zip(batch, outcomes):
                if r.reply.done():
                    continue
                if isinstance(outcome, Exception):
                    r.reply.set_exception(outcome)
                else:
                    r.reply.set_result(BatchResult(outcome[0], outcome[1], started - r.enqueued, rows))
        finally:
            self._free += 1
            self._wake.set()
