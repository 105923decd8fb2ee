"""The synthetic ad world: users, items, the hidden click model and its drift.

Everything a CTR model could learn is here, and nothing else: the click probability of
an impression is ``sigmoid(logit)`` of the terms in :meth:`World.logit`, computed from
the world's state *at the impression's time*. That probability is the ground truth
("Bayes-optimal") score; see docs/generator.md for the model and its parameters.

The world advances in ticks of simulated time; every tick it drifts (item factors and
biases mean-revert with noise, popularity wanders, items are born and retire, category
trends rise and fade) and then serves a batch of requests, all vectorised with numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from streamrec.plumbing.config import WorldConfig

DEVICES = ("ios", "android", "web")
DEVICE_SHARE = np.array([0.45, 0.40, 0.15])
DEVICE_BIAS = np.array([0.15, 0.0, -0.35])
# Affinity weight of the user x item latent match, and the spread of item/advertiser/
# category biases (std of the logit terms).
AFFINITY_WEIGHT = 0.55
ITEM_BIAS_STD = 0.5
ADVERTISER_BIAS_STD = 0.3
CATEGORY_BIAS_STD = 0.3
ITEM_FACTOR_NOISE = 0.7
HOUR_AMPLITUDE = 0.3
HOUR_PEAK = 20  # local hour with the highest click propensity
POPULARITY_NOISE_STD = 0.6
NOVELTY_BOOST = 1.5  # exposure boost of a brand-new item, fading with NOVELTY_TIME_S
NOVELTY_TIME_S = 300.0
PERSONALISED_SHARE = 0.5  # share of slots filled from the user's favourite categories
BURN_IN_S = 120.0  # simulated history before start_ms (fills the users' click sequences)
BURN_IN_TICK_S = 2.0
BURN_IN_REQUESTS_PER_S = 400
ID_SPACE = 1 << 40  # external ids are sparse int64s in [1, 2^40]


def sparse_ids(index: np.ndarray, salt: int) -> np.ndarray:
    """Map dense indices to sparse, collision-free int64 ids in [1, 2^40].

    An affine map with an odd multiplier is a bijection modulo 2^40, so ids look random
    (as real user/ad ids do) yet never collide; downstream stores must not assume
    small contiguous ids.
    """
    multiplier = (0x9E3779B97F4A7C15 ^ (salt * 0x632BE59BD9B4E019)) % ID_SPACE | 1
    offset = (salt * 0xD1B54A32D192ED03) % ID_SPACE
    dense = index.astype(np.uint64)
    return ((dense * np.uint64(multiplier) + np.uint64(offset)) % np.uint64(ID_SPACE)).astype(np.int64) + 1


@dataclass
class ItemParams:
    """The per-item and per-category parameters the click model reads (a model could learn them)."""

    factor: np.ndarray  # [items, d]
    bias: np.ndarray  # [items]
    category: np.ndarray  # [items] int
    advertiser: np.ndarray  # [items] int
    category_bias: np.ndarray  # [categories], including the current trend

    def copy(self) -> "ItemParams":
        return ItemParams(*(a.copy() for a in (self.factor, self.bias, self.category, self.advertiser, self.category_bias)))


@dataclass
class Impressions:
    """One tick's impressions, as parallel arrays (dense indices, not external ids)."""

    ts_ms: np.ndarray
    request: np.ndarray  # request index within the world's running request counter
    user: np.ndarray
    item: np.ndarray
    position: np.ndarray  # 1-based
    device: np.ndarray
    local_hour: np.ndarray
    p: np.ndarray
    clicked: np.ndarray  # bool
    click_ts_ms: np.ndarray  # valid where clicked

    def __len__(self) -> int:
        return len(self.ts_ms)


class World:
    """State of the synthetic ad world, advanced tick by tick.

    Deterministic: all randomness comes from the ``rng`` handed in.
    """

    def __init__(self, config: WorldConfig, rng: np.random.Generator, start_ms: int) -> None:
        config.validate()
        self.config = config
        self.rng = rng
        self.now_ms = start_ms
        self.start_ms = start_ms
        d, n_cat = config.latent_dim, config.n_categories

        self.category_center = rng.normal(0.0, 1.0, (n_cat, d))
        self.category_base_bias = rng.normal(0.0, CATEGORY_BIAS_STD, n_cat)
        self.category_weight = _zipf_weights(n_cat, 0.8, rng)
        self.category_trend = np.zeros(n_cat)
        self.trends: list[tuple[int, float, float]] = []  # (category, start_ms, amplitude)
        self.advertiser_bias = rng.normal(0.0, ADVERTISER_BIAS_STD, config.n_advertisers)
        self.advertiser_category = rng.choice(n_cat, config.n_advertisers, p=self.category_weight)

        n_users = config.n_users
        self.user_ids = sparse_ids(np.arange(n_users), salt=1)
        self.user_activity_cdf = np.cumsum(_zipf_weights(n_users, config.user_zipf_exponent, rng))
        self.user_favourites = np.stack(
            [rng.choice(n_cat, n_users, p=self.category_weight) for _ in range(2)], axis=1
        )
        factor = self.category_center[self.user_favourites[:, 0]] + 0.6 * self.category_center[self.user_favourites[:, 1]]
        factor += 0.5 * rng.normal(0.0, 1.0, (n_users, d))
        self.user_factor = factor / np.linalg.norm(factor, axis=1, keepdims=True) * math.sqrt(d)
        self.user_device = rng.choice(len(DEVICES), n_users, p=DEVICE_SHARE)
        self.user_utc_offset_h = rng.integers(-8, 10, n_users)
        # Decayed count of each user's recent clicks per category: the sequence effect.
        self.user_recent_clicks = np.zeros((n_users, n_cat), dtype=np.float32)

        # Items are append-only arrays; retired items stay (alive=False) so ids never repeat.
        self.item_factor = np.empty((0, d))
        self.item_bias = np.empty(0)
        self.item_category = np.empty(0, dtype=np.int64)
        self.item_advertiser = np.empty(0, dtype=np.int64)
        self.item_base_log_pop = np.empty(0)
        self.item_log_pop = np.empty(0)
        self.item_born_ms = np.empty(0, dtype=np.int64)
        self.item_alive = np.empty(0, dtype=bool)
        self._add_items(config.n_items, born_ms=start_ms - int(10 * NOVELTY_TIME_S * 1000))

        self.requests_served = 0
        self.intercept = 0.0
        self._pending_click_user = np.empty(0, dtype=np.int64)
        self._pending_click_cat = np.empty(0, dtype=np.int64)
        self._pending_click_ts = np.empty(0, dtype=np.int64)
        self.intercept = self._calibrate_intercept()
        self._burn_in()
        self.intercept = self._calibrate_intercept()

    # ------------------------------------------------------------------ items
    @property
    def item_ids(self) -> np.ndarray:
        return sparse_ids(np.arange(len(self.item_bias)), salt=2)

    def _add_items(self, n: int, born_ms: int) -> None:
        cfg, rng = self.config, self.rng
        advertiser = rng.integers(0, cfg.n_advertisers, n)
        # Most of an advertiser's ads are in its own category, some elsewhere.
        category = np.where(
            rng.random(n) < 0.8,
            self.advertiser_category[advertiser],
            rng.choice(cfg.n_categories, n, p=self.category_weight),
        )
        factor = self.category_center[category] + ITEM_FACTOR_NOISE * rng.normal(0.0, 1.0, (n, cfg.latent_dim))
        # Zipf popularity: weight ~ r^-s with r uniform, i.e. a rank-frequency law of exponent s.
        base_log_pop = -cfg.zipf_exponent * np.log(np.maximum(rng.random(n), 1e-6))
        self.item_factor = np.concatenate([self.item_factor, factor])
        self.item_bias = np.concatenate([self.item_bias, rng.normal(0.0, ITEM_BIAS_STD, n)])
        self.item_category = np.concatenate([self.item_category, category])
        self.item_advertiser = np.concatenate([self.item_advertiser, advertiser])
        self.item_base_log_pop = np.concatenate([self.item_base_log_pop, base_log_pop])
        self.item_log_pop = np.concatenate([self.item_log_pop, base_log_pop])
        self.item_born_ms = np.concatenate([self.item_born_ms, np.full(n, born_ms, dtype=np.int64)])
        self.item_alive = np.concatenate([self.item_alive, np.ones(n, dtype=bool)])

    def item_params(self) -> ItemParams:
        """A view of what the click model reads about items now (copy it to freeze it)."""
        return ItemParams(
            factor=self.item_factor,
            bias=self.item_bias,
            category=self.item_category,
            advertiser=self.item_advertiser,
            category_bias=self.category_base_bias + self.category_trend,
        )

    # ------------------------------------------------------------------ click model
    def logit(
        self,
        params: ItemParams,
        user: np.ndarray,
        item: np.ndarray,
        position: np.ndarray,
        device: np.ndarray,
        local_hour: np.ndarray,
    ) -> np.ndarray:
        """The hidden click model. ``params`` may be a frozen copy; items it does not know
        (born after it was frozen) are scored as an average item of their category."""
        d = self.config.latent_dim
        known = item < len(params.bias)
        safe_item = np.where(known, item, 0)
        category = self.item_category[item]
        item_factor = np.where(known[:, None], params.factor[safe_item], self.category_center[category])
        item_bias = np.where(known, params.bias[safe_item], 0.0)
        affinity = np.einsum("ij,ij->i", self.user_factor[user], item_factor) / math.sqrt(d)
        # Share of the user's recent clicks that fell in this category: bounded in [0, 1),
        # so the effect does not grow with traffic rate (a count would feed back on itself).
        recent = self.user_recent_clicks[user]
        share = recent[np.arange(len(user)), category] / (1.0 + recent.sum(axis=1))
        return (
            self.intercept
            + AFFINITY_WEIGHT * affinity
            + item_bias
            + self.advertiser_bias[self.item_advertiser[item]]
            + params.category_bias[category]
            - self.config.position_decay * np.log(position)
            + DEVICE_BIAS[device]
            + HOUR_AMPLITUDE * np.cos(2 * math.pi * (local_hour - HOUR_PEAK) / 24.0)
            + self.config.sequence_weight * share
        )

    def _calibrate_intercept(self) -> float:
        """Pick the intercept so the initial world's mean CTR equals ``target_ctr``."""
        probe_rng = np.random.default_rng(self.rng.integers(1 << 62))
        saved_rng, self.rng = self.rng, probe_rng
        try:
            _, user, item, position = self._sample_slots(20000)
        finally:
            self.rng = saved_rng
        hour = np.full(len(user), 14)
        base = self.logit(self.item_params(), user, item, position, self.user_device[user], hour) - self.intercept
        lo, hi = -20.0, 5.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if _sigmoid(base + mid).mean() > self.config.target_ctr:
                hi = mid
            else:
                lo = mid
        return (lo + hi) / 2

    def _burn_in(self) -> None:
        """Run the world before ``start_ms`` so users have a click history and the intercept
        is calibrated at steady state, not on an empty behaviour sequence."""
        self.now_ms -= int(BURN_IN_S * 1000)
        for _ in range(int(BURN_IN_S / BURN_IN_TICK_S)):
            self.advance(BURN_IN_TICK_S)
            self.serve(int(BURN_IN_REQUESTS_PER_S * BURN_IN_TICK_S), self.now_ms, int(BURN_IN_TICK_S * 1000))
        self.requests_served = 0

    # ------------------------------------------------------------------ exposure
    def _exposure_log_weight(self) -> np.ndarray:
        age_s = (self.now_ms - self.item_born_ms) / 1000.0
        novelty = NOVELTY_BOOST * np.exp(-np.maximum(age_s, 0.0) / NOVELTY_TIME_S)
        trend = self.category_trend[self.item_category]
        return np.where(self.item_alive, self.item_log_pop + novelty + trend, -np.inf)

    def _sample_slots(self, n_requests: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Users for ``n_requests`` requests and the ads in their slots, flattened to one
        row per impression: (request row, user, item, position)."""
        rng, cfg = self.rng, self.config
        user = np.searchsorted(self.user_activity_cdf, rng.random(n_requests) * self.user_activity_cdf[-1])
        user = np.minimum(user, cfg.n_users - 1)
        slots = rng.integers(1, cfg.max_slots + 1, n_requests)
        log_w = self._exposure_log_weight()
        weight = np.exp(log_w - log_w[np.isfinite(log_w)].max())
        # Candidates: some slots from a favourite category of the user, the rest global.
        matrix = self._draw_items(weight, user, cfg.max_slots)
        for _ in range(20):  # re-draw slots that repeat an item within a request
            dup = _duplicate_mask(matrix, slots)
            if not dup.any():
                break
            rows, cols = np.nonzero(dup)
            matrix[rows, cols] = self._draw_items(weight, user[rows], 1)[:, 0]
        else:
            dup = _duplicate_mask(matrix, slots)
            slots = np.where(dup.any(axis=1), np.argmax(dup, axis=1), slots)  # truncate at first repeat
        keep = np.arange(cfg.max_slots)[None, :] < slots[:, None]
        position = np.broadcast_to(np.arange(1, cfg.max_slots + 1), matrix.shape)
        request_row = np.broadcast_to(np.arange(n_requests)[:, None], matrix.shape)[keep]
        return request_row, user[request_row], matrix[keep], position[keep]

    def _draw_items(self, weight: np.ndarray, user: np.ndarray, per_user: int) -> np.ndarray:
        rng = self.rng
        n = len(user)
        out = np.empty((n, per_user), dtype=np.int64)
        cdf = np.cumsum(weight)
        out[:] = np.searchsorted(cdf, rng.random((n, per_user)) * cdf[-1])
        personal = rng.random((n, per_user)) < PERSONALISED_SHARE
        fav = self.user_favourites[user[:, None], rng.integers(0, 2, (n, per_user))]
        rows, cols = np.nonzero(personal)
        if len(rows):
            wanted = fav[rows, cols]
            for category in np.unique(wanted):
                members = np.flatnonzero((self.item_category == category) & (weight > 0))
                if len(members) == 0:
                    continue  # nothing alive in that category: keep the global draw
                sel = wanted == category
                member_cdf = np.cumsum(weight[members])
                pick = np.searchsorted(member_cdf, rng.random(sel.sum()) * member_cdf[-1])
                out[rows[sel], cols[sel]] = members[np.minimum(pick, len(members) - 1)]
        return np.minimum(out, len(weight) - 1)

    # ------------------------------------------------------------------ time
    def advance(self, dt_s: float) -> None:
        """Drift the world by ``dt_s`` simulated seconds (before serving that tick)."""
        cfg, rng = self.config, self.rng
        self.now_ms += int(round(dt_s * 1000))
        decay = math.exp(-dt_s * math.log(2) / cfg.sequence_half_life_s)
        self.user_recent_clicks *= np.float32(decay)
        self._apply_due_clicks()
        if cfg.drift_scale == 0:
            return
        # Ornstein-Uhlenbeck steps: mean-reverting with a stationary spread, so the world
        # keeps its statistics (CTR, popularity skew) while every single item moves.
        theta = min(1.0, cfg.drift_scale * dt_s / cfg.drift_time_constant_s)
        kick = math.sqrt(theta * (2 - theta))
        n = len(self.item_bias)
        centre = self.category_center[self.item_category]
        self.item_factor += theta * (centre - self.item_factor) + kick * ITEM_FACTOR_NOISE * rng.normal(size=self.item_factor.shape)
        self.item_bias += -theta * self.item_bias + kick * ITEM_BIAS_STD * rng.normal(size=n)
        self.item_log_pop += theta * (self.item_base_log_pop - self.item_log_pop) + kick * POPULARITY_NOISE_STD * rng.normal(size=n)
        # Births and retirements keep the catalogue size roughly steady.
        alive = np.flatnonzero(self.item_alive)
        retire = alive[rng.random(len(alive)) < cfg.drift_scale * dt_s / cfg.mean_item_lifetime_s]
        if len(alive) - len(retire) >= 2 * cfg.max_slots:
            self.item_alive[retire] = False
        born = rng.poisson(cfg.drift_scale * cfg.new_items_per_s * dt_s)
        if born:
            self._add_items(born, born_ms=self.now_ms)
        self._advance_trends(dt_s)

    def _advance_trends(self, dt_s: float) -> None:
        """Bursts: a category's CTR and exposure rise and fade along a half-sine."""
        cfg, rng = self.config, self.rng
        for _ in range(rng.poisson(cfg.drift_scale * dt_s / cfg.trend_every_s)):
            category = int(rng.choice(cfg.n_categories, p=self.category_weight))
            self.trends.append((category, float(self.now_ms), cfg.trend_strength * rng.uniform(0.5, 1.0)))
        duration_ms = cfg.trend_duration_s * 1000
        self.trends = [t for t in self.trends if self.now_ms - t[1] < duration_ms]
        self.category_trend[:] = 0.0
        for category, start, amplitude in self.trends:
            self.category_trend[category] += amplitude * math.sin(math.pi * (self.now_ms - start) / duration_ms)

    def _apply_due_clicks(self) -> None:
        due = self._pending_click_ts <= self.now_ms
        if due.any():
            np.add.at(self.user_recent_clicks, (self._pending_click_user[due], self._pending_click_cat[due]), 1.0)
            keep = ~due
            self._pending_click_user = self._pending_click_user[keep]
            self._pending_click_cat = self._pending_click_cat[keep]
            self._pending_click_ts = self._pending_click_ts[keep]

    def serve(self, n_requests: int, tick_start_ms: int, tick_ms: int) -> Impressions:
        """Serve ``n_requests`` requests spread over [tick_start, tick_start + tick_ms)."""
        rng = self.rng
        request_ts = np.sort(tick_start_ms + rng.integers(0, max(tick_ms, 1), n_requests))
        request_local, user, item, position = self._sample_slots(n_requests)
        ts = request_ts[request_local]
        device = self.user_device[user]
        local_hour = ((ts // 3_600_000) + self.user_utc_offset_h[user]) % 24
        p = _sigmoid(self.logit(self.item_params(), user, item, position, device, local_hour))
        clicked = rng.random(len(p)) < p
        delay_s = self.config.median_click_delay_s * np.exp(0.8 * rng.normal(size=len(p)))
        click_ts = ts + np.maximum(1, (delay_s * 1000).astype(np.int64))
        self._pending_click_user = np.concatenate([self._pending_click_user, user[clicked]])
        self._pending_click_cat = np.concatenate([self._pending_click_cat, self.item_category[item[clicked]]])
        self._pending_click_ts = np.concatenate([self._pending_click_ts, click_ts[clicked]])
        request = self.requests_served + request_local
        self.requests_served += n_requests
        return Impressions(ts, request, user, item, position, device, local_hour, p, clicked, click_ts)

    def snapshot(self) -> ItemParams:
        """Freeze what a model trained up to now could at best know about items."""
        return self.item_params().copy()


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _zipf_weights(n: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """Zipf weights over a random permutation (rank 1 is not always index 0)."""
    weights = 1.0 / np.arange(1, n + 1) ** exponent
    weights = weights[rng.permutation(n)]
    return weights / weights.sum()


def _duplicate_mask(matrix: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """True where a slot repeats an item already shown earlier in the same request."""
    n, k = matrix.shape
    active = np.arange(k)[None, :] < slots[:, None]
    dup = np.zeros_like(active)
    for j in range(1, k):
        dup[:, j] = active[:, j] & (matrix[:, :j] == matrix[:, j : j + 1]).any(axis=1)
    return dup
