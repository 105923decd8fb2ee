"""The ranks' step channel (trainer/step_channel.py): every rank's row on every rank, in rank
order, round after round; a rank that is gone or silent makes the others fail with a clear
error instead of waiting forever. Ranks are threads joined by socket pairs here; the
trainer's ranks use the channel through ``join`` (tests/test_distributed.py, real processes)."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time

import numpy as np
import pytest

from streamrec.trainer.step_channel import PeerLost, StepChannel


def _channels(world: int, timeout_s: float = 10.0) -> list[StepChannel]:
    peers: list[dict[int, socket.socket]] = [{} for _ in range(world)]
    for a in range(world):
        for b in range(a + 1, world):
            sa, sb = socket.socketpair()
            for s in (sa, sb):
                s.settimeout(timeout_s)
            peers[a][b], peers[b][a] = sa, sb
    return [StepChannel(r, world, peers[r], timeout_s) for r in range(world)]


def _on_every_rank(channels: list[StepChannel], work) -> list:
    results: list = [None] * len(channels)

    def run(r: int) -> None:
        try:
            results[r] = work(r, channels[r])
        except BaseException as exc:  # handed to the test
            results[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(channels))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_every_rank_gets_every_row_in_rank_order_round_after_round():
    channels = _channels(3)

    def rounds(r: int, channel: StepChannel) -> list:
        return [channel.all_gather([r, step, -(2**62) + r, 2**62 - step]) for step in range(200)]

    results = _on_every_rank(channels, rounds)
    expected = [[[r, step, -(2**62) + r, 2**62 - step] for r in range(3)] for step in range(200)]
    assert results == [expected] * 3


def test_a_rank_that_is_gone_fails_the_others_at_once():
    channels = _channels(2, timeout_s=30)
    channels[1].close()
    started = time.monotonic()
    with pytest.raises(PeerLost, match="rank 1"):
        channels[0].all_gather([1, 2])
    assert time.monotonic() - started < 5  # not the 30 s timeout


def test_a_silent_rank_fails_the_others_after_the_timeout():
    channels = _channels(2, timeout_s=0.5)
    with pytest.raises(PeerLost, match="rank 1 did not answer within"):
        channels[0].all_gather([1, 2])


def test_rows_of_different_lengths_are_refused_at_once():
    channels = _channels(2, timeout_s=30)
    started = time.monotonic()
    results = _on_every_rank(channels, lambda r, c: c.all_gather([7] * (2 + r)))
    assert all(isinstance(x, ValueError) and "do not run the same step" in str(x) for x in results), results
    assert time.monotonic() - started < 5  # both see it in the other's header, not after the 30 s timeout


def test_sockets_numbered_past_select_limit_work():
    """``select`` refuses descriptors from 1024 on; a trainer with many files open has them."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft <= 2100:
        pytest.skip(f"needs more than 2100 open files allowed, the limit is {soft}")
    pairs = socket.socketpair()
    high = [socket.socket(fileno=os.dup2(s.fileno(), 2000 + i)) for i, s in enumerate(pairs)]
    for s in pairs:
        s.close()
    for s in high:
        s.settimeout(10)
    channels = [StepChannel(0, 2, {1: high[0]}, 10), StepChannel(1, 2, {0: high[1]}, 10)]
    results = _on_every_rank(channels, lambda r, c: c.exchange([r], [np.array([r]), np.array([10 + r])]))
    assert [rows for rows, _ in results] == [[[0], [1]]] * 2
    assert [[a.tolist() for a in got] for _, got in results] == [[[0], [1]], [[10], [11]]]
    for c in channels:
        c.close()


def test_every_rank_gets_what_each_rank_sent_it_of_any_size_beside_the_rows():
    """Arrays far larger than a socket's buffers (both ranks write before they read) and
    empty ones, round after round, each to its own rank."""
    channels = _channels(3)
    sizes = [0, 1, 3, 700_000]  # 700,000 int64: 5.6 MB, beyond any default socket buffer

    def rounds(r: int, channel: StepChannel) -> list:
        out = []
        for step, size in enumerate(sizes):
            to_each = [np.arange(size, dtype=np.int64) * 10 + 100 * r + peer for peer in range(3)]
            rows, got = channel.exchange([r, step], to_each)
            out.append((rows, [g.tolist() for g in got]))
        return out

    results = _on_every_rank(channels, rounds)
    for me in range(3):
        assert not isinstance(results[me], BaseException), results[me]
        for step, size in enumerate(sizes):
            rows, got = results[me][step]
            assert rows == [[r, step] for r in range(3)]
            assert got == [(np.arange(size) * 10 + 100 * r + me).tolist() for r in range(3)]


def test_all_gather_and_exchange_mix_round_after_round():
    channels = _channels(2)

    def rounds(r: int, channel: StepChannel) -> list:
        return [channel.all_gather([r]), channel.exchange([r], [np.array([r, 1 - r])] * 2)[1][1 - r].tolist(), channel.all_gather([r + 5])]

    assert _on_every_rank(channels, rounds) == [[[[0], [1]], [1, 0], [[5], [6]]], [[[0], [1]], [0, 1], [[5], [6]]]]
