"""Request aggregation: concurrent requests merge into batches of at most ``max_batch``
instances, a lone request waits no longer than ``max_delay_us``, at most ``workers``
batches run at once, and each request gets its own outcome (scores or error)."""

import asyncio
import threading
import time

import numpy as np
import pytest

from streamrec.serving.batcher import RequestBatcher, Shed


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


ROOMY = {"max_queue_instances": 10_000, "queue_timeout_s": 60.0}  # never sheds in these tests


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_merge_up_to_max_batch_and_get_their_own_scores():
    recorder = Recorder()

    async def main():
        batcher = RequestBatcher(recorder, max_batch=8, max_delay_us=200_000, workers=1, **ROOMY)
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
        batcher = RequestBatcher(recorder, max_batch=1024, max_delay_us=50_000, workers=2, **ROOMY)
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
        batcher = RequestBatcher(recorder, max_batch=4, max_delay_us=0, workers=2, **ROOMY)
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
        batcher = RequestBatcher(recorder, max_batch=1024, max_delay_us=200_000, workers=1, **ROOMY)
        await batcher.start()
        waits = []
        for i in range(8):  # one request every 500 ms: far apart compared with the 200 ms window
            t0 = time.perf_counter()
            await batcher.submit([i])
            waits.append(time.perf_counter() - t0)
            await asyncio.sleep(0.5)
        await batcher.stop()
        return waits

    waits = run(main())
    # wide margins, so a busy machine cannot blur the two cases: the first request waits out
    # the window (no history yet); once the gaps are known, each is dispatched at once
    assert waits[0] > 0.15 and max(waits[-3:]) < 0.1, waits
    assert recorder.batches == [[1]] * 8  # each alone: nothing to wait for


def test_settings_are_checked():
    with pytest.raises(ValueError, match="max_batch"):
        RequestBatcher(Recorder(), max_batch=0, max_delay_us=0, workers=1, **ROOMY)


def test_a_full_queue_sheds_at_once_and_counts_it():
    recorder = Recorder(seconds=0.3)

    async def main():
        batcher = RequestBatcher(recorder, max_batch=4, max_delay_us=0, workers=1, max_queue_instances=6, queue_timeout_s=60.0)
        await batcher.start()
        running = asyncio.ensure_future(batcher.submit([1, 1, 1, 1]))
        await asyncio.sleep(0.05)  # the worker is busy with it: the next requests queue
        queued = [asyncio.ensure_future(batcher.submit([2, 2, 2])) for _ in range(2)]
        await asyncio.sleep(0)
        t0 = time.perf_counter()
        with pytest.raises(Shed, match="max_queue_instances") as refused:
            await batcher.submit([3])  # 6 instances wait: one more passes the bound
        refused_after = time.perf_counter() - t0
        results = await asyncio.gather(running, *queued)
        await batcher.stop()
        return refused.value, refused_after, results, batcher.stats.as_json()["shed"]

    refused, refused_after, results, shed = run(main())
    assert refused.reason == "queue_full" and refused_after < 0.1  # answered at once, not after the running batch
    assert [r.scores.tolist() for r in results] == [[2, 2, 2, 2], [4, 4, 4], [4, 4, 4]]
    assert shed == {"queue_full": 1, "deadline": 0}
    assert recorder.batches == [[4], [3], [3]]  # the refused request never ran


def test_a_request_past_its_deadline_in_the_queue_is_dropped_and_never_run():
    recorder = Recorder(seconds=0.5)

    async def main():
        batcher = RequestBatcher(recorder, max_batch=4, max_delay_us=0, workers=1, max_queue_instances=100, queue_timeout_s=0.1)
        await batcher.start()
        running = asyncio.ensure_future(batcher.submit([1]))
        await asyncio.sleep(0.05)  # the only worker is busy for 0.5 s: the next request's 0.1 s deadline passes in the queue
        t0 = time.perf_counter()
        with pytest.raises(Shed, match="queue_timeout_ms") as dropped:
            await batcher.submit([-5])  # would be an error if it ran; it must not run at all
        dropped_after = time.perf_counter() - t0
        first = await running
        after = await batcher.submit([7])  # the batcher goes on serving
        await batcher.stop()
        return dropped.value, dropped_after, first, after, batcher.stats.as_json()["shed"]

    dropped, dropped_after, first, after, shed = run(main())
    assert dropped.reason == "deadline" and 0.09 < dropped_after < 0.4  # at its deadline, not when the worker frees
    assert first.scores.tolist() == [2] and after.scores.tolist() == [14]
    assert recorder.batches == [[1], [1]]  # the expired request never reached run_batch
    assert shed == {"queue_full": 0, "deadline": 1}


def test_a_client_deadline_shorter_than_the_queues_drops_that_request_first():
    """Deadlines out of arrival order: a later request with its own 0.1 s timeout expires while
    the earlier one (serving's 10 s) still waits, then runs; a longer client timeout is capped."""
    recorder = Recorder(seconds=0.4)

    async def main():
        batcher = RequestBatcher(recorder, max_batch=1, max_delay_us=0, workers=1, max_queue_instances=100, queue_timeout_s=10.0)
        await batcher.start()
        running = asyncio.ensure_future(batcher.submit([1]))
        await asyncio.sleep(0.05)
        patient = asyncio.ensure_future(batcher.submit([2]))
        capped = asyncio.ensure_future(batcher.submit([3], timeout_s=3600.0))
        await asyncio.sleep(0.02)  # the batcher now sleeps towards the earliest deadline it knows (10 s)
        t0 = time.perf_counter()
        with pytest.raises(Shed, match="x-request-timeout-ms") as dropped:
            await batcher.submit([-5], timeout_s=0.1)
        dropped_after = time.perf_counter() - t0
        results = await asyncio.gather(running, patient, capped)
        await batcher.stop()
        return dropped.value, dropped_after, results, batcher.stats.as_json()["shed"]

    dropped, dropped_after, results, shed = run(main())
    assert dropped.reason == "deadline" and 0.09 < dropped_after < 0.3  # before the worker frees (0.35 s)
    assert [r.scores.tolist() for r in results] == [[2], [4], [6]]
    assert recorder.batches == [[1], [1], [1]] and shed == {"queue_full": 0, "deadline": 1}


def test_a_client_deadline_inside_the_batching_window_runs_when_a_worker_is_free():
    """The window (max_delay_us) is the batcher's choice, not overload: it closes early for a
    request whose deadline falls inside it, which then runs instead of being shed."""
    recorder = Recorder()

    async def main():
        batcher = RequestBatcher(recorder, max_batch=64, max_delay_us=5_000_000, workers=1, max_queue_instances=1000, queue_timeout_s=10.0)
        await batcher.start()
        results = []
        for i in range(20):
            results.append(asyncio.ensure_future(batcher.submit([i], timeout_s=0.5)))
            await asyncio.sleep(0.001)  # gaps well inside the window: it would wait the full 5 s
        results = await asyncio.gather(*results)
        await batcher.stop()
        return results, batcher.stats.as_json()["shed"]

    t0 = time.perf_counter()
    results, shed = run(main())
    assert [r.scores.tolist() for r in results] == [[2 * i] for i in range(20)]
    assert shed == {"queue_full": 0, "deadline": 0}
    assert time.perf_counter() - t0 < 4.0  # closed at the first deadline, not at the end of the window
