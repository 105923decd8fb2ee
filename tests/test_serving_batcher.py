"""Request aggregation: concurrent requests merge into batches of at most ``max_batch``
instances, a lone request waits no longer than ``max_delay_us``, at most ``workers``
batches run at once, and each request gets its own outcome (scores or error)."""

import asyncio
import threading
import time

import numpy as np
import pytest

from serving.batcher import RequestBatcher


class Recorder:
    def __init__(self, seconds: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.running = self.most_running = 0
        self.seconds = seconds
        self.lock = threading.Lock()

    def __call__(self, payloads):
        with self.lock:
            self.batches.append([len(p) for p in payloads])
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1
        return [ValueError(f"bad {p[0]}") if p[0] < 0 else (7, np.array(p, np.float32) * 2) for p in payloads]


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_merge_up_to_max_batch_and_get_their_own_scores():
    recorder = Recorder()

    async def main():
        batcher = RequestBatcher(recorder, max_batch=8, max_delay_us=200_000, workers=1)
        await batcher.start()
        results = await asyncio.gather(*(batcher.submit([i, i]) for i in range(1, 9)))
        await batcher.stop()
        return results

    results = run(main())
    assert recorder.batches == [[2, 2, 2, 2], [2, 2, 2, 2]]  # full batches close at once, before the 200 ms window
    for i, result in enumerate(results, start=1):
        assert result.version == 7 and result.scores.tolist() == [2 * i, 2 * i] and result.batch_rows == 8


def test_a_lone_request_waits_at_most_the_delay_and_errors_reach_only_their_request():
    recorder = Recorder()

    async def main():
        batcher = RequestBatcher(recorder, max_batch=1024, max_delay_us=50_000, workers=2)
        await batcher.start()
        t0 = time.perf_counter()
        alone = await batcher.submit([3])
        waited = time.perf_counter() - t0
        outcomes = await asyncio.gather(batcher.submit([-1]), batcher.submit([4]), return_exceptions=True)
        await batcher.stop()
        return alone, waited, outcomes

    alone, waited, (bad, good) = run(main())
    assert alone.scores.tolist() == [6] and 0.04 < waited < 1.0
    assert isinstance(bad, ValueError) and "bad -1" in str(bad) and good.scores.tolist() == [8]


def test_no_more_than_workers_batches_run_at_once_and_waiting_batches_grow():
    recorder = Recorder(seconds=0.05)

    async def main():
        batcher = RequestBatcher(recorder, max_batch=4, max_delay_us=0, workers=2)
        await batcher.start()
        first = []
        for _ in range(2):  # each runs alone (no delay) on one of the two workers ...
            first.append(asyncio.ensure_future(batcher.submit([1])))
            await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(batcher.submit([1])) for _ in range(6)]  # ... so these wait and merge
        await asyncio.gather(*first, *rest)
        await batcher.stop()

    run(main())
    assert recorder.most_running == 2
    assert recorder.batches == [[1], [1], [1, 1, 1, 1], [1, 1]]


def test_sparse_requests_do_not_wait_for_the_window():
    recorder = Recorder()

    async def main():
        batcher = RequestBatcher(recorder, max_batch=1024, max_delay_us=30_000, workers=1)
        await batcher.start()
        waits = []
        for i in range(12):  # one request every 80 ms: far apart compared with the 30 ms window
            t0 = time.perf_counter()
            await batcher.submit([i])
            waits.append(time.perf_counter() - t0)
            await asyncio.sleep(0.08)
        await batcher.stop()
        return waits

    waits = run(main())
    assert waits[0] > 0.025  # no history yet: the first request waits out the window
    assert max(waits[-4:]) < 0.02, waits  # once the gaps are known, each is dispatched at once


def test_settings_are_checked():
    with pytest.raises(ValueError, match="max_batch"):
        RequestBatcher(Recorder(), max_batch=0, max_delay_us=0, workers=1)
