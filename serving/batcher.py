"""Request aggregation: concurrent predict requests become one batch (TensorBatch).

Requests wait in a queue; a batch closes when it holds ``max_batch`` instances or its
first request has waited ``max_delay_us``. Up to ``workers`` batches run at once on a
thread pool (the model runs outside the event loop, so the server keeps accepting
requests); each request gets its own slice of the scores back, plus how long it queued.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa


@dataclass
class _Request:
    table: pa.Table
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class BatchResult:
    version: int
    scores: np.ndarray
    queued_s: float  # waiting for the batch to close and for a worker
    batch_rows: int  # instances in the batch this request rode in


class RequestBatcher:
    def __init__(self, run_batch: Callable[[pa.Table], tuple[int, np.ndarray]], max_batch: int, max_delay_us: int,
                 workers: int) -> None:
        if max_batch < 1 or max_delay_us < 0 or workers < 1:
            raise ValueError("serving.max_batch and serving.workers must be >= 1, serving.max_delay_us >= 0")
        self.run_batch = run_batch
        self.max_batch, self.max_delay_s, self.workers = max_batch, max_delay_us / 1e6, workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="serving-batch")
        self._queue: asyncio.Queue[_Request] | None = None
        self._slots: asyncio.Semaphore | None = None
        self._task: asyncio.Task | None = None
        self.batches = 0

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._slots = asyncio.Semaphore(self.workers)
        self._task = asyncio.create_task(self._loop(), name="request-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    async def submit(self, table: pa.Table) -> BatchResult:
        request = _Request(table, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(request)
        return await request.future

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            rows = batch[0].table.num_rows
            deadline = loop.time() + self.max_delay_s
            while rows < self.max_batch:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    request = await asyncio.wait_for(self._queue.get(), timeout)
                except asyncio.TimeoutError:
                    break
                batch.append(request)
                rows += request.table.num_rows
            await self._slots.acquire()
            asyncio.create_task(self._run(batch, rows))

    async def _run(self, batch: list[_Request], rows: int) -> None:
        started = time.perf_counter()
        try:
            table = pa.concat_tables([r.table for r in batch]) if len(batch) > 1 else batch[0].table
            version, scores = await asyncio.get_running_loop().run_in_executor(self._executor, self.run_batch, table)
            self.batches += 1
            offset = 0
            for r in batch:
                n = r.table.num_rows
                if not r.future.done():
                    r.future.set_result(BatchResult(version, scores[offset: offset + n], started - r.enqueued, rows))
                offset += n
        except Exception as exc:  # every request of the batch learns why
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(exc)
        finally:
            self._slots.release()
