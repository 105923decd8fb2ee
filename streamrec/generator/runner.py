"""Drive a :class:`Traffic` into a sink, paced to wall-clock time or as fast as possible."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from streamrec.model.metrics import auc, logloss
from streamrec.generator.sinks import Delivery, Sink, SinkError
from streamrec.generator.traffic import TickBatch, Traffic

PACE_SLICE_MS = 20  # pacing granularity: events are sent in slices of this much event time
MAX_CATCH_UP_S = 60.0  # a live start at most this far in the past is caught up (generate())


@dataclass
class GenerateSummary:
    seed: int
    run: str
    start_ms: int
    end_ms: int
    impressions: int = 0
    clicks: int = 0
    bad_events: dict[str, int] = field(default_factory=dict)
    events: int = 0
    delivered: int = 0  # events the sink's destination acknowledged
    failed: int = 0  # events it gave up on (the run stops at the first)
    wall_s: float = 0.0
    ctr: float = 0.0
    mean_p: float = 0.0
    bayes_auc: float = float("nan")
    bayes_logloss: float = float("nan")
    items_alive_end: int = 0
    items_created: int = 0
    stopped_early: bool = False  # told to stop (SIGTERM, Ctrl-C) before duration_s: a shorter, complete run

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def delivered_per_s(self) -> float:
        return self.delivered / self.wall_s if self.wall_s > 0 else float("nan")

    def as_dict(self) -> dict:
        return {**asdict(self), "events_per_s": self.events_per_s}


def generate(
    traffic: Traffic,
    sink: Sink,
    duration_s: float,
    pace: bool,
    on_tick: Callable[[TickBatch, GenerateSummary], None] | None = None,
    stop: threading.Event | None = None,
) -> GenerateSummary:
    """Run ``duration_s`` simulated seconds of traffic into ``sink``.

    ``pace``: send each event when the wall clock reaches its emit time (live mode). A
    start up to ``MAX_CATCH_UP_S`` in the past (the time this process took to start, build
    the world and connect) is caught up at once, so that event time is real time: a stream
    that ran behind the clock would look late to every consumer that also sees the clock
    (Kafka timestamps, freshness measurements). Without ``pace``: as fast as possible. The
    sink is closed with a manifest on success and aborted on error. After each tick the
    summary holds what the sink has delivered; the run stops with :class:`SinkError` after
    the tick in which the sink gave up on an event or a truth message. ``stop`` set: the run
    ends after the current tick like a shorter one (everything sent is confirmed, the sink
    closed, the manifest's duration the simulated time covered).
    """
    summary = GenerateSummary(traffic.config.seed, traffic.run, traffic.start_ms, traffic.start_ms)
    wall_start = time.monotonic()
    behind_s = time.time() - traffic.start_ms / 1000.0
    pace_origin = wall_start - behind_s if 0 < behind_s <= MAX_CATCH_UP_S else wall_start  # monotonic time of start_ms
    p_parts: list[np.ndarray] = []
    y_parts: list[np.ndarray] = []
    bad = Counter()
    try:
        for batch in traffic.ticks(duration_s):
            if pace:
                _paced_write(sink, batch.events, traffic.start_ms, pace_origin)
            else:
                sink.write_events(batch.events)
            sink.write_truth(batch)
            summary.impressions += batch.n_impressions
            summary.clicks += batch.n_clicks
            summary.events += len(batch.events)
            summary.end_ms = batch.end_ms
            bad.update(b.kind for b in batch.bad)
            p_parts.append(batch.truth.p)
            y_parts.append(batch.truth.clicked)
            summary.wall_s = time.monotonic() - wall_start
            delivery = _record_delivery(sink, summary)
            if on_tick:
                on_tick(batch, summary)
            if delivery.lost:  # the sink's abort says how much was lost in all
                raise SinkError(f"{delivery.failed:,} events and {delivery.failed_truth:,} truth messages were not delivered")
            if stop is not None and stop.is_set():
                summary.stopped_early = True
                duration_s = (summary.end_ms - summary.start_ms) / 1000
                break
        p = np.concatenate(p_parts) if p_parts else np.empty(0)
        y = np.concatenate(y_parts) if y_parts else np.empty(0, dtype=bool)
        summary.bad_events = dict(sorted(bad.items()))
        summary.ctr = summary.clicks / summary.impressions if summary.impressions else 0.0
        summary.mean_p = float(p.mean()) if len(p) else 0.0
        if len(p):
            summary.bayes_auc = auc(p, y)
            summary.bayes_logloss = logloss(p, y)
        summary.items_alive_end = int(traffic.world.item_alive.sum())
        summary.items_created = len(traffic.world.item_bias)
        sink.close(_manifest(traffic, summary, duration_s))
        summary.wall_s = time.monotonic() - wall_start
        _record_delivery(sink, summary)
        return summary
    except BaseException:
        sink.abort()  # raises SinkError instead when events were lost: the error that matters
        raise


def _record_delivery(sink: Sink, summary: GenerateSummary) -> Delivery:
    delivery = sink.delivery()
    summary.delivered, summary.failed = delivery.delivered, delivery.failed
    return delivery


def _paced_write(sink: Sink, events: list[tuple[int, bytes, bytes]], start_ms: int, origin: float) -> None:
    i = 0
    while i < len(events):
        slice_end = events[i][0] + PACE_SLICE_MS
        j = i
        while j < len(events) and events[j][0] < slice_end:
            j += 1
        wait = origin + (events[i][0] - start_ms) / 1000.0 - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        sink.write_events(events[i:j])
        i = j


def _manifest(traffic: Traffic, summary: GenerateSummary, duration_s: float) -> dict:
    cfg = traffic.config
    return {
        "generator": "streamrec",
        "run": traffic.run,
        "seed": cfg.seed,
        "start_ms": summary.start_ms,
        # A click whose click_ts >= end_ms happened after the stream ended: it is in the
        # truth (clicked, click_ts) but not in the event stream.
        "end_ms": summary.end_ms,
        "duration_s": duration_s,
        "rate": cfg.rate,
        "bad_fraction": cfg.bad_fraction,
        "max_disorder_ms": cfg.max_disorder_ms,
        "world": asdict(cfg.world),
        "counts": {
            "impressions": summary.impressions,
            "clicks": summary.clicks,
            "events": summary.events,
            "bad_events": dict(summary.bad_events),
        },
        "bayes_auc": summary.bayes_auc,
        "bayes_logloss": summary.bayes_logloss,
    }
