"""Turn the world's impressions into the raw event stream and its separate ground truth.

One :class:`Traffic` produces :class:`TickBatch` es in simulated time: the impressions
served in the tick, the clicks that fall due in it (clicked impressions schedule a click
event after a random delay), a bounded random arrival disorder, optionally injected
malformed events, and the truth rows (true click probability per impression) that must
never travel in the event stream.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import orjson

from streamrec.contracts.events import encode_click, encode_impressions
from streamrec.generator.bad_events import BadEvent, BadEventInjector
from streamrec.generator.world import DEVICES, World, WorldConfig


@dataclass(frozen=True)
class TrafficConfig:
    seed: int
    rate: float  # events/s, impressions + clicks (approximately; bad events come on top)
    bad_fraction: float
    max_disorder_ms: int
    world: WorldConfig
    tick_s: float = 1.0

    def validate(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 events/s, got {self.rate}")
        if not 0.0 <= self.bad_fraction < 1.0:
            raise ValueError(f"bad_fraction must be in [0, 1), got {self.bad_fraction}")
        if self.max_disorder_ms < 0:
            raise ValueError(f"max_disorder_ms must be >= 0, got {self.max_disorder_ms}")
        if not self.tick_s > 0:
            raise ValueError(f"tick_s must be > 0, got {self.tick_s}")


@dataclass
class Truth:
    """Ground truth of one tick's impressions, columnar (one row per impression)."""

    event_id: list[str]
    request_id: list[str]
    user_id: np.ndarray
    item_id: np.ndarray
    ts: np.ndarray
    position: np.ndarray
    p: np.ndarray
    clicked: np.ndarray
    click_ts: np.ndarray  # -1 where the impression is never clicked

    def __len__(self) -> int:
        return len(self.event_id)

    def rows(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield {
                "kind": "impression",
                "event_id": self.event_id[i],
                "request_id": self.request_id[i],
                "user_id": int(self.user_id[i]),
                "item_id": int(self.item_id[i]),
                "ts": int(self.ts[i]),
                "position": int(self.position[i]),
                "p": float(self.p[i]),
                "clicked": bool(self.clicked[i]),
                "click_ts": int(self.click_ts[i]) if self.clicked[i] else None,
            }


@dataclass
class TickBatch:
    """What one tick emits. ``events`` are (emit_ms, key, value) sorted by emit time."""

    start_ms: int
    end_ms: int
    events: list[tuple[int, bytes, bytes]]
    truth: Truth
    bad: list[BadEvent] = field(default_factory=list)
    n_impressions: int = 0
    n_clicks: int = 0


def run_id(seed: int, start_ms: int) -> str:
    """Short id that makes event/request ids unique across runs (same seed, other start)."""
    return hashlib.blake2b(f"{seed}:{start_ms}".encode(), digest_size=4).hexdigest()


class Traffic:
    """Deterministic event stream: same config and ``start_ms`` give the same bytes."""

    def __init__(self, config: TrafficConfig, start_ms: int) -> None:
        config.validate()
        self.config = config
        self.start_ms = start_ms
        self.rng = np.random.default_rng(config.seed)
        self.world = World(config.world, np.random.default_rng(self.rng.integers(1 << 62)), start_ms)
        self.run = run_id(config.seed, start_ms)
        self.item_ids = self.world.item_ids
        self.now_ms = start_ms
        self._impressions = 0
        self._clicks = 0
        self._pending: list[tuple[int, int, bytes, bytes]] = []  # clicks not yet due: (ts, seq, key, value) heap
        self._arriving_later: list[tuple[int, bytes, bytes]] = []  # emitted, arriving after this tick
        self._injector = BadEventInjector(config.bad_fraction, np.random.default_rng(self.rng.integers(1 << 62)), self.run)
        mean_slots = (1 + config.world.max_slots) / 2
        self.requests_per_s = config.rate / (mean_slots * (1 + config.world.target_ctr))

    def next_tick(self, final: bool = False) -> TickBatch:
        """Advance one tick. Events arriving after the tick's end (disorder) are held for the
        next batch so the emitted sequence is ordered by arrival; ``final`` flushes them."""
        cfg, world = self.config, self.world
        tick_ms = int(round(cfg.tick_s * 1000))
        start, end = self.now_ms, self.now_ms + tick_ms
        n_requests = int(self.rng.poisson(self.requests_per_s * cfg.tick_s))
        imp = world.serve(n_requests, start, tick_ms)
        if len(world.item_bias) > len(self.item_ids):
            self.item_ids = world.item_ids
        user_ids = world.user_ids[imp.user]
        item_ids = self.item_ids[imp.item]
        request_ids = [f"{self.run}-r{r:x}" for r in imp.request.tolist()]
        event_ids = [f"{self.run}-i{n:x}" for n in range(self._impressions, self._impressions + len(imp))]
        self._impressions += len(imp)
        category = world.item_category[imp.item] + 1
        advertiser = world.item_advertiser[imp.item] + 1

        uid_list, iid_list = user_ids.tolist(), item_ids.tolist()
        keys = [b"%d" % uid for uid in uid_list]
        values = encode_impressions(
            (event_ids, imp.ts_ms.tolist(), uid_list, iid_list, request_ids, imp.position.tolist(),
             [DEVICES[d] for d in imp.device.tolist()], imp.local_hour.tolist(), category.tolist(), advertiser.tolist())
        )
        emit_ms = (imp.ts_ms + self.rng.integers(0, cfg.max_disorder_ms + 1, len(imp))).tolist()
        events: list[tuple[int, bytes, bytes]] = list(zip(emit_ms, keys, values))
        click_ts = imp.click_ts_ms.tolist()
        for i in np.flatnonzero(imp.clicked).tolist():
            click = encode_click(f"{self.run}-c{self._clicks:x}", click_ts[i], uid_list[i], iid_list[i], request_ids[i])
            self._clicks += 1
            heapq.heappush(self._pending, (click_ts[i], self._clicks, keys[i], click))

        due = []
        while self._pending and self._pending[0][0] < end:
            due.append(heapq.heappop(self._pending))
        click_disorder = self.rng.integers(0, cfg.max_disorder_ms + 1, len(due)).tolist()
        events.extend((ts + d, key, value) for (ts, _, key, value), d in zip(due, click_disorder))
        n_clicks = len(due)

        bad = self._injector.inject(lambda i: orjson.loads(values[i]), len(values))
        events.extend((b.emit_ms, b.key, b.raw) for b in bad)
        events.extend(self._arriving_later)
        events.sort(key=lambda e: e[0])
        if final:
            self._arriving_later = []
        else:
            cut = bisect.bisect_left(events, end, key=lambda e: e[0])
            events, self._arriving_later = events[:cut], events[cut:]
        truth = Truth(
            event_id=event_ids,
            request_id=request_ids,
            user_id=user_ids,
            item_id=item_ids,
            ts=imp.ts_ms,
            position=imp.position,
            p=imp.p,
            clicked=imp.clicked,
            click_ts=np.where(imp.clicked, imp.click_ts_ms, -1),
        )
        world.advance(cfg.tick_s)
        self.now_ms = end
        return TickBatch(start, end, events, truth, bad, n_impressions=len(imp), n_clicks=n_clicks)

    def ticks(self, duration_s: float) -> Iterator[TickBatch]:
        n = math.ceil(duration_s / self.config.tick_s - 1e-9)
        for i in range(n):
            yield self.next_tick(final=i == n - 1)
