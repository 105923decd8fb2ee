"""Request aggregation: concurrent requests merge into batches of at most ``max_batch``
instances, a lone request waits no longer than ``max_delay_us``, at most ``workers``
batches run at once, small requests are not queued behind big ones (nor big ones starved),
and each request gets its own outcome (scores or error).

Asserted by the order and make-up of batches, not by wall-clock windows: the CI box is busy.
A ``Recorder`` with a gate holds every batch until the test has queued what it needs."""

import asyncio
import threading
import time

import numpy as np
import pytest

from streamrec.serving.runtime.batcher import BatcherGroup, RequestBatcher, Shed


class Recorder:
    """A fake ``run_batch``: records each batch's request sizes, scores an instance x as 2x, and
    answers a request whose first instance is negative with an error; ``gate``: every batch
    waits for it (closed: the worker stays busy)."""

    def __init__(self, seconds: float = 0.0, gate: threading.Event | None = None) -> None:
        self.batches: list[list[int]] = []
        self.running = self.most_running = 0
        self.seconds, self.gate = seconds, gate
        self.lock = threading.Lock()

    def __call__(self, payloads):
        with self.lock:
            self.batches.append([len(p) for p in payloads])
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        time.sleep(self.seconds)
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        with self.lock:
            self.running -= 1
        return [ValueError(f"bad {p[0]}") if p[0] < 0 else (7, np.array(p, np.float32) * 2) for p in payloads]


ROOMY = {"max_queue_instances": 10_000, "queue_timeout_s": 60.0}  # never sheds in these tests


def run(coro):
    return asyncio.run(coro)


async def until(condition, what: str) -> None:
    """Yield to the event loop (and the worker threads) until ``condition()`` holds."""
    for _ in range(30_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never: {what}")


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
    """The first request waits out the window (a second one sent well inside it joins its batch);
    a request alone is then run once the window ends, with nothing else arriving."""
    recorder = Recorder()

    async def main():
        batcher = RequestBatcher(recorder, max_batch=1024, max_delay_us=500_000, workers=2, **ROOMY)
        await batcher.start()
        first = asyncio.ensure_future(batcher.submit([3]))
        await asyncio.sleep(0.05)
        joined = await batcher.submit([5])
        alone = await asyncio.wait_for(batcher.submit([9]), 30)  # would hang if a lone request waited for company
        outcomes = await asyncio.gather(batcher.submit([-1]), batcher.submit([4]), return_exceptions=True)
        await batcher.stop()
        return await first, joined, alone, outcomes

    first, joined, alone, (bad, good) = run(main())
    assert recorder.batches[:2] == [[1, 1], [1]]
    assert first.scores.tolist() == [6] and joined.scores.tolist() == [10] and alone.scores.tolist() == [18]
    assert isinstance(bad, ValueError) and "bad -1" in str(bad) and good.scores.tolist() == [8]


def test_no_more_than_workers_batches_run_at_once_and_waiting_batches_grow():
    gate = threading.Event()
    recorder = Recorder(gate=gate)

    async def main():
        batcher = RequestBatcher(recorder, max_batch=4, max_delay_us=0, workers=2, **ROOMY)
        await batcher.start()
        first = []
        for n in (1, 2):  # each runs alone (no delay) on one of the two workers ...
            first.append(asyncio.ensure_future(batcher.submit([1])))
            await until(lambda: len(recorder.batches) == n, f"batch {n} running")
        rest = [asyncio.ensure_future(batcher.submit([1])) for _ in range(6)]  # ... so these wait and merge
        await until(lambda: batcher.queued_instances == 6, "6 requests queued")
        gate.set()
        await asyncio.gather(*first, *rest)
        await batcher.stop()

    run(main())
    assert recorder.most_running == 2
    assert recorder.batches == [[1], [1], [1, 1, 1, 1], [1, 1]]


def test_sparse_requests_do_not_wait_for_the_window():
    """By who shares a batch: with no history the first request waits out the 400 ms window and
    one sent 100 ms later joins it; once requests are known to come 1 s apart, one is run at
    once, so the next, 200 ms later, runs alone."""
    recorder = Recorder()

    async def main():
        batcher = RequestBatcher(recorder, max_batch=1024, max_delay_us=400_000, workers=1, **ROOMY)
        await batcher.start()
        first = asyncio.ensure_future(batcher.submit([0]))
        await asyncio.sleep(0.1)
        await asyncio.gather(first, batcher.submit([1]))
        for i in range(2, 6):  # one request every second: far apart compared with the window
            await asyncio.sleep(1.0)
            await batcher.submit([i])
        await asyncio.sleep(0.2)
        await batcher.submit([6])
        await batcher.stop()

    run(main())
    assert recorder.batches == [[1, 1], [1], [1], [1], [1], [1]]


def test_settings_are_checked():
    with pytest.raises(ValueError, match="max_batch"):
        RequestBatcher(Recorder(), max_batch=0, max_delay_us=0, workers=1, **ROOMY)


def test_a_full_queue_sheds_at_once_and_counts_it():
    gate = threading.Event()
    recorder = Recorder(gate=gate)

    async def main():
        batcher = RequestBatcher(recorder, max_batch=4, max_delay_us=0, workers=1, max_queue_instances=6, queue_timeout_s=60.0)
        await batcher.start()
        running = asyncio.ensure_future(batcher.submit([1, 1, 1, 1]))
        await until(lambda: len(recorder.batches) == 1, "the first batch running")  # the worker is busy with it: the next requests queue
        queued = [asyncio.ensure_future(batcher.submit([2, 2, 2])) for _ in range(2)]
        await until(lambda: batcher.queued_instances == 6, "6 instances queued")
        with pytest.raises(Shed, match="max_queue_instances") as refused:
            await batcher.submit([3])  # 6 instances wait: one more passes the bound
        at_once = not running.done()  # answered while the batch still runs, not after it
        gate.set()
        results = await asyncio.gather(running, *queued)
        await batcher.stop()
        return refused.value, at_once, results, batcher.stats.as_json()["shed"]

    refused, at_once, results, shed = run(main())
    assert refused.reason == "queue_full" and at_once
    assert [r.scores.tolist() for r in results] == [[2, 2, 2, 2], [4, 4, 4], [4, 4, 4]]
    assert shed == {"queue_full": 1, "deadline": 0}
    assert recorder.batches == [[4], [3], [3]]  # the refused request never ran


def test_a_request_past_its_deadline_in_the_queue_is_dropped_and_never_run():
    gate = threading.Event()
    recorder = Recorder(gate=gate)

    async def main():
        batcher = RequestBatcher(recorder, max_batch=4, max_delay_us=0, workers=1, max_queue_instances=100, queue_timeout_s=0.1)
        await batcher.start()
        running = asyncio.ensure_future(batcher.submit([1]))
        await until(lambda: len(recorder.batches) == 1, "the first batch running")  # the only worker stays busy
        t0 = time.perf_counter()
        with pytest.raises(Shed, match="queue_timeout_ms") as dropped:
            await batcher.submit([-5])  # would be an error if it ran; it must not run at all
        dropped_after = time.perf_counter() - t0
        at_deadline = not running.done()  # at its deadline, not when the worker frees
        gate.set()
        first = await running
        after = await batcher.submit([7])  # the batcher goes on serving
        await batcher.stop()
        return dropped.value, dropped_after, at_deadline, first, after, batcher.stats.as_json()["shed"]

    dropped, dropped_after, at_deadline, first, after, shed = run(main())
    assert dropped.reason == "deadline" and dropped_after >= 0.1 and at_deadline  # (a clock never runs early)
    assert first.scores.tolist() == [2] and after.scores.tolist() == [14]
    assert recorder.batches == [[1], [1]]  # the expired request never reached run_batch
    assert shed == {"queue_full": 0, "deadline": 1}


def test_a_client_deadline_shorter_than_the_queues_drops_that_request_first():
    """Deadlines out of arrival order: a later request with its own 0.1 s timeout expires while
    the earlier one (serving's 10 s) still waits, then runs; a longer client timeout is capped."""
    gate = threading.Event()
    recorder = Recorder(gate=gate)

    async def main():
        batcher = RequestBatcher(recorder, max_batch=1, max_delay_us=0, workers=1, max_queue_instances=100, queue_timeout_s=10.0)
        await batcher.start()
        running = asyncio.ensure_future(batcher.submit([1]))
        await until(lambda: len(recorder.batches) == 1, "the first batch running")
        patient = asyncio.ensure_future(batcher.submit([2]))
        capped = asyncio.ensure_future(batcher.submit([3], timeout_s=3600.0))
        await until(lambda: batcher.queued_instances == 2, "2 requests queued")
        await asyncio.sleep(0.02)  # the batcher now sleeps towards the earliest deadline it knows (10 s)
        t0 = time.perf_counter()
        with pytest.raises(Shed, match="x-request-timeout-ms") as dropped:
            await batcher.submit([-5], timeout_s=0.1)
        dropped_after = time.perf_counter() - t0
        before_free = not running.done()  # the short deadline woke the batcher: it did not wait for the worker
        gate.set()
        results = await asyncio.gather(running, patient, capped)
        await batcher.stop()
        return dropped.value, dropped_after, before_free, results, batcher.stats.as_json()["shed"]

    dropped, dropped_after, before_free, results, shed = run(main())
    assert dropped.reason == "deadline" and dropped_after >= 0.1 and before_free
    assert [r.scores.tolist() for r in results] == [[2], [4], [6]]
    assert recorder.batches == [[1], [1], [1]] and shed == {"queue_full": 0, "deadline": 1}


def test_a_client_deadline_inside_the_batching_window_runs_when_a_worker_is_free():
    """The window (max_delay_us) is the batcher's choice, not overload: it closes early for a
    request whose deadline falls inside it, which then runs instead of being shed."""
    recorder = Recorder()

    async def main():
        batcher = RequestBatcher(recorder, max_batch=64, max_delay_us=600_000_000, workers=1, max_queue_instances=1000, queue_timeout_s=900.0)
        await batcher.start()
        results = []
        for i in range(20):
            results.append(asyncio.ensure_future(batcher.submit([i], timeout_s=0.5)))
            await asyncio.sleep(0.001)  # gaps well inside the window: it would wait the full 10 minutes
        results = await asyncio.wait_for(asyncio.gather(*results), 60)  # closed at the first deadline, not at the window's end
        await batcher.stop()
        return results, batcher.stats.as_json()["shed"]

    results, shed = run(main())
    assert [r.scores.tolist() for r in results] == [[2 * i] for i in range(20)]
    assert shed == {"queue_full": 0, "deadline": 0}


async def queue_behind_a_running_batch(batcher: RequestBatcher, recorder: Recorder, gate: threading.Event,
                                       sizes: list[int]) -> list[asyncio.Future]:
    """Start ``batcher``, occupy its only worker with one request, queue requests of ``sizes``
    instances (request j's instances are all j + 1) behind it, then let the batches run."""
    await batcher.start()
    futures = [asyncio.ensure_future(batcher.submit([0]))]
    await until(lambda: len(recorder.batches) == 1, "the first batch running")
    futures += [asyncio.ensure_future(batcher.submit([j + 1] * n)) for j, n in enumerate(sizes)]
    await until(lambda: batcher.queued_instances == sum(sizes), "every request queued")
    gate.set()
    await asyncio.gather(*futures)
    await batcher.stop()
    return futures


@pytest.mark.parametrize("fair", [True, False])
def test_small_requests_ride_in_the_next_batch_not_behind_every_big_one(fair):
    """Issue 36: 64 requests of 200 instances queue, then 4 of 4 instances. The small ones ride
    in the first batch that closes after they arrive (fair), where arrival order alone
    (``fair = False``, the overload bench's baseline) leaves them for the last batch; big ones
    keep their order, and every request gets its own scores."""
    gate = threading.Event()
    recorder = Recorder(gate=gate)
    sizes = [200] * 64 + [4] * 4

    async def main():
        batcher = RequestBatcher(recorder, max_batch=1024, max_delay_us=0, workers=1, max_queue_instances=20_000, queue_timeout_s=60.0)
        batcher.fair = fair
        return await queue_behind_a_running_batch(batcher, recorder, gate, sizes)

    futures = run(main())
    batches = recorder.batches[1:]
    small_in = [b for b, sizes_ in enumerate(batches) if 4 in sizes_]
    assert small_in == ([0] if fair else [len(batches) - 1])
    if fair:
        assert batches[0] == [200, 4, 4, 4, 4, 200, 200, 200, 200]  # the oldest request first, then the small ones
    else:
        assert batches[-1] == [200, 200, 200, 200, 4, 4, 4, 4]
    assert len(batches) == 13 and all(sum(b) <= 1024 for b in batches)
    assert sorted(n for b in batches for n in b) == sorted(sizes)
    for j, future in enumerate(futures[1:]):
        assert future.result().scores.tolist() == [2 * (j + 1)] * sizes[j]


def test_big_requests_are_not_starved_by_a_stream_of_small_ones():
    """More small requests than batches can hold keep the small lane full, yet every batch takes
    the oldest request: each big one rides as soon as it is the oldest, even one that fills a
    whole batch. Without that rule, small requests (8 per batch) would leave a 12-instance
    request no room in a 16-instance batch until every small one had run."""
    gate = threading.Event()
    recorder = Recorder(gate=gate)
    sizes = [12] * 5 + [16] + [1] * 100

    async def main():
        batcher = RequestBatcher(recorder, max_batch=16, max_delay_us=0, workers=1, **ROOMY)
        assert batcher.small_rows == 1
        return await queue_behind_a_running_batch(batcher, recorder, gate, sizes)

    futures = run(main())
    batches = recorder.batches[1:]
    assert batches[:6] == [[12, 1, 1, 1, 1]] * 5 + [[16]]  # the share of small ones shrinks to the room left
    assert batches[6:] == [[1] * 16] * 5
    for j, future in enumerate(futures[1:]):
        assert future.result().scores.tolist() == [2 * (j + 1)] * sizes[j]


def test_cancelled_callers_are_skipped_in_both_lanes():
    """A caller gone while its request waits: never run, its instances leave the queue's count."""
    gate = threading.Event()
    recorder = Recorder(gate=gate)

    async def main():
        batcher = RequestBatcher(recorder, max_batch=16, max_delay_us=0, workers=1, **ROOMY)
        await batcher.start()
        running = asyncio.ensure_future(batcher.submit([1]))
        await until(lambda: len(recorder.batches) == 1, "the first batch running")
        small, big, kept = (asyncio.ensure_future(batcher.submit(p)) for p in ([2], [3] * 8, [4] * 8))
        await until(lambda: batcher.queued_instances == 17, "17 instances queued")
        small.cancel()
        big.cancel()
        gate.set()
        result = await kept
        await running
        await batcher.stop()
        return result, batcher.queued_instances

    result, queued = run(main())
    assert recorder.batches == [[1], [8]] and result.scores.tolist() == [8] * 8 and queued == 0


class SendsDuringFirstBatch(Recorder):
    """A Recorder for a batcher with ``workers = 0``: its first batch, on the event loop's
    thread, has ``payloads`` submitted from that thread while it runs (the loop is busy: they
    are read after it). ``sent``: (when, future) of each; ``threads``: each batch's thread."""

    def __init__(self, payloads: list[list[int]]) -> None:
        super().__init__()
        self.payloads, self.sent, self.threads = payloads, [], []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.batcher: RequestBatcher | None = None

    def __call__(self, payloads):
        self.threads.append(threading.get_ident())
        if len(self.batches) == 0:
            for p in self.payloads:
                self.loop.call_soon_threadsafe(lambda p=p: self.sent.append((time.perf_counter(), asyncio.ensure_future(self.batcher.submit(p)))))
            time.sleep(0.2)
        return super().__call__(payloads)

    async def start(self, **kwargs) -> RequestBatcher:
        """A started batcher over this recorder, on the running loop, batches on its thread."""
        self.loop = asyncio.get_running_loop()
        self.batcher = RequestBatcher(self, max_batch=64, workers=0, **ROOMY, **kwargs)
        await self.batcher.start()
        return self.batcher


def test_with_no_workers_batches_run_on_the_event_loop_and_what_came_meanwhile_is_one_batch():
    """``workers = 0``: each batch runs on the event loop's thread; requests sent while it runs
    (from another thread: the loop is busy) are read after it and ride together in the next."""
    recorder = SendsDuringFirstBatch([[-1] if i == 2 else [10 + i] for i in range(5)])

    async def main():
        batcher = await recorder.start(max_delay_us=0)
        first = await batcher.submit([1, 2])
        await until(lambda: len(recorder.sent) == 5, "the requests sent during the first batch")
        outcomes = await asyncio.gather(*(future for _, future in recorder.sent), return_exceptions=True)
        await batcher.stop()
        return threading.get_ident(), first, outcomes

    loop_thread, first, outcomes = run(main())
    assert recorder.threads == [loop_thread, loop_thread]
    assert recorder.batches == [[2], [1, 1, 1, 1, 1]]
    assert first.scores.tolist() == [2, 4]
    assert [o.scores.tolist() for k, o in enumerate(outcomes) if k != 2] == [[20], [22], [26], [28]]
    assert isinstance(outcomes[2], ValueError) and "bad -1" in str(outcomes[2])


class BackgroundReply:
    def __init__(self) -> None:
        self.result = self.error = None

    def done(self) -> bool:
        return False

    def set_result(self, result) -> None:
        self.result = result

    def set_exception(self, exc) -> None:
        self.error = exc


def test_background_work_runs_in_batches_of_its_own_only_while_the_node_is_idle():
    recorder = Recorder(gate=threading.Event())
    other_model = Recorder(gate=threading.Event())  # another batcher of the node, with a request waiting

    async def scenario():
        group = BatcherGroup()
        batcher = RequestBatcher(recorder, 64, 0, 1, max_queue_instances=400, queue_timeout_s=60.0, group=group)
        elsewhere = RequestBatcher(other_model, 64, 0, 1, max_queue_instances=400, queue_timeout_s=60.0, group=group)
        await batcher.start()
        await elsewhere.start()
        running_elsewhere = asyncio.ensure_future(elsewhere.submit([7]))  # holds its one worker at the gate
        await until(lambda: other_model.batches, "the other model's first request in a batch")
        waiting_elsewhere = asyncio.ensure_future(elsewhere.submit([8]))  # queued behind it
        await asyncio.sleep(0.01)
        assert elsewhere.has_foreground
        replies = [BackgroundReply() for _ in range(6)]
        assert all(batcher.enqueue_background([1] * 8, r) for r in replies)
        assert not batcher.enqueue_background([1] * 60, BackgroundReply())  # the lane holds at most 400 // 4
        first = asyncio.ensure_future(batcher.submit([5, 5]))
        recorder.gate.set()
        assert (await first).scores.tolist() == [10, 10]
        await asyncio.sleep(0.05)
        assert recorder.batches == [[2]]  # the foreground request ran; the background waits for the node
        other_model.gate.set()
        assert (await running_elsewhere).scores.tolist() == [14] and (await waiting_elsewhere).scores.tolist() == [16]
        await until(lambda: all(r.result is not None for r in replies), "background work ran once the node was idle")
        await batcher.stop()
        await elsewhere.stop()
        return replies

    replies = run(scenario())
    assert recorder.batches[0] == [2]
    assert recorder.batches[1:] == [[8] * 6]  # one batch of its own, never mixed with foreground requests
    assert all(r.result.scores.tolist() == [2] * 8 for r in replies)


def test_a_request_that_came_during_a_background_batch_on_the_loop_closes_its_batch_at_once():
    """``workers = 0``: a request that arrived while a background batch ran on the loop has
    waited that batch already; its own batch closes without the batching window."""
    window_s = 2.0
    recorder = SendsDuringFirstBatch([[3]])

    async def main():
        batcher = await recorder.start(max_delay_us=int(window_s * 1e6))
        reply = BackgroundReply()
        assert batcher.enqueue_background([1] * 4, reply)
        await until(lambda: recorder.sent, "the request sent during the background batch")
        sent_at, future = recorder.sent[0]
        outcome = await future
        answered = time.perf_counter() - sent_at
        await batcher.stop()
        return reply, outcome, answered

    reply, outcome, answered = run(main())
    assert recorder.batches == [[4], [1]] and reply.result.scores.tolist() == [2] * 4 and outcome.scores.tolist() == [6]
    assert answered < window_s / 2, f"the request waited {answered:.2f} s: a batching window after the background batch"
