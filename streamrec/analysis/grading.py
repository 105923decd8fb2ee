"""Grading logged predictions against the labels that came later: each labelled sample is
joined to the latest prediction for its (user, item) made at or before the sample's time,
within a window, and every group of predictions (an experiment's variant, a shadow model,
a model asked directly) gets a count, AUC, log loss and calibration, per minute and in total.

Served and shadow predictions are joined separately: the served one the user saw is the
latest served prediction of any experiment or model (a sample matched to another
experiment's prediction is not this one's to grade), and a shadow model is graded on the
same impressions as if it had answered.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy as np

from streamrec.contracts.predictions import Prediction
from streamrec.model.metrics import auc, logloss

MINUTE_MS = 60_000
_MIX = np.uint64(0x9E3779B97F4A7C15)  # spreads user ids before an item id is added (pair_keys)


@dataclass(frozen=True)
class Track:
    """A group of predictions graded together."""

    experiment: str | None
    variant: str | None
    model: str
    shadow: bool

    @property
    def name(self) -> str:
        """The variant (or the model, outside experiments), "(shadow)" for a shadow model."""
        return (self.variant or self.model) + (" (shadow)" if self.shadow else "")


@dataclass(frozen=True)
class Labels:
    """Labelled samples' join columns: user_id, item_id, ts (ms), label (0/1)."""

    user_id: np.ndarray
    item_id: np.ndarray
    ts: np.ndarray
    label: np.ndarray


def pair_keys(user_id: np.ndarray, item_id: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each (user, item): to drop prediction rows no sample can join
    (a collision keeps a row the exact join then ignores)."""
    return user_id.astype(np.uint64) * _MIX + item_id.astype(np.uint64)


class PredictionRows:
    """Logged predictions flattened to one row per candidate, with their track."""

    def __init__(self, only_pairs: np.ndarray | None = None) -> None:
        """``only_pairs``: sorted :func:`pair_keys` of the samples; other rows are not kept."""
        self.only_pairs = only_pairs
        self.tracks: list[Track] = []
        self.requests: list[int] = []  # predictions read per track, kept rows or not
        self._track_index: dict[Track, int] = {}
        self._parts: list[tuple[np.ndarray, ...]] = []

    def add(self, predictions: Iterable[Prediction]) -> None:
        users, items, ts, scores, tracks, sizes = [], [], [], [], [], []
        for p in predictions:
            t = self._track(Track(p.experiment, p.variant, p.model, p.shadow))
            self.requests[t] += 1
            users.append(p.user_id), ts.append(p.ts), tracks.append(t), sizes.append(len(p.item_ids))
            items.append(p.item_ids), scores.append(p.scores)
        if not users:
            return
        sizes_a = np.asarray(sizes)
        part = (np.repeat(np.asarray(users, np.int64), sizes_a), np.concatenate(items).astype(np.int64),
                np.repeat(np.asarray(ts, np.int64), sizes_a), np.concatenate(scores).astype(np.float64),
                np.repeat(np.asarray(tracks, np.int32), sizes_a))
        if self.only_pairs is not None:
            keys = pair_keys(part[0], part[1])
            at = np.minimum(np.searchsorted(self.only_pairs, keys), max(len(self.only_pairs) - 1, 0))
            keep = self.only_pairs[at] == keys if len(self.only_pairs) else np.zeros(len(keys), bool)
            part = tuple(column[keep] for column in part)
        self._parts.append(part)

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(user_id, item_id, ts, score, track index), one entry per kept candidate."""
        if not self._parts:
            return (np.empty(0, np.int64),) * 3 + (np.empty(0, np.float64), np.empty(0, np.int32))
        return tuple(np.concatenate(c) for c in zip(*self._parts))

    def _track(self, track: Track) -> int:
        i = self._track_index.get(track)
        if i is None:
            i = self._track_index[track] = len(self.tracks)
            self.tracks.append(track)
            self.requests.append(0)
        return i


def join_latest(sample_user: np.ndarray, sample_item: np.ndarray, sample_ts: np.ndarray, pred_user: np.ndarray,
                pred_item: np.ndarray, pred_ts: np.ndarray, window_ms: int) -> np.ndarray:
    """For each sample, the index of the latest prediction row for the same (user, item) with
    ``sample_ts - window_ms <= ts <= sample_ts``; -1 where there is none. Of rows equal in
    (user, item, ts) the last given wins."""
    n_pred = len(pred_user)
    if n_pred == 0 or len(sample_user) == 0:
        return np.full(len(sample_user), -1, np.int64)
    pairs = np.stack([np.concatenate([pred_user, sample_user]), np.concatenate([pred_item, sample_item])], axis=1)
    _, pair = np.unique(pairs, axis=0, return_inverse=True)
    _, when = np.unique(np.concatenate([pred_ts, sample_ts]), return_inverse=True)
    pair, when = pair.reshape(-1).astype(np.int64), when.reshape(-1).astype(np.int64)
    key = pair * (int(when.max()) + 1) + when  # (pair, time) in one sortable int: both are dense ranks
    order = np.argsort(key[:n_pred], kind="stable")
    at = np.searchsorted(key[:n_pred][order], key[n_pred:], side="right") - 1
    found = order[np.maximum(at, 0)]
    ok = (at >= 0) & (pair[:n_pred][found] == pair[n_pred:]) & (sample_ts - pred_ts[found] <= window_ms)
    return np.where(ok, found, -1)


@dataclass(frozen=True)
class Grade:
    """How one group's scores did on its samples; None where undefined (no clicks, one class)."""

    count: int
    clicks: int
    ctr: float | None
    mean_score: float | None
    auc: float | None
    logloss: float | None
    calibration: float | None  # mean score / observed CTR: 1 is calibrated, above 1 over-predicts

    @classmethod
    def of(cls, scores: np.ndarray, labels: np.ndarray) -> "Grade":
        n, clicks = len(labels), int(labels.sum())
        if n == 0:
            return cls(0, 0, None, None, None, None, None)
        ctr, mean = clicks / n, float(scores.mean())
        return cls(n, clicks, ctr, mean, _defined(auc(scores, labels)), logloss(scores, labels),
                   mean / ctr if clicks else None)


@dataclass(frozen=True)
class TrackGrade:
    track: Track
    requests: int  # prediction records of this track read (one per answered request)
    total: Grade
    minutes: list[tuple[int, Grade]]  # (minute start, ms; its grade), by the samples' time


@dataclass
class GradingReport:
    window_s: float
    samples: int  # labelled samples read
    unmatched: int  # samples without any served prediction in the window
    other: int  # samples whose served prediction is outside the selection (another experiment or model)
    tracks: list[TrackGrade] = field(default_factory=list)

    def to_json(self) -> dict:
        out = asdict(self)
        for t, tg in zip(out["tracks"], self.tracks):
            t["track"]["name"] = tg.track.name
            t["minutes"] = [{"minute_ms": m, **g} for m, g in t["minutes"]]
        return out


def grade(labels: Labels, rows: PredictionRows, window_s: float, select: Callable[[Track], bool]) -> GradingReport:
    """Join every labelled sample to the predictions and grade the selected tracks."""
    user, item, ts, score, track = rows.columns()
    selected = np.array([select(t) for t in rows.tracks], dtype=bool)
    shadow = np.array([t.shadow for t in rows.tracks], dtype=bool)
    window_ms = int(round(window_s * 1000))
    report = GradingReport(window_s, len(labels.label), 0, 0)
    by_track: dict[int, np.ndarray] = {}
    for is_shadow in (False, True):
        rows_here = np.flatnonzero(shadow[track] == is_shadow) if len(track) else np.empty(0, np.int64)
        found = join_latest(labels.user_id, labels.item_id, labels.ts, user[rows_here], item[rows_here], ts[rows_here], window_ms)
        hit = found >= 0
        matched = rows_here[found[hit]]
        samples = np.flatnonzero(hit)
        if not is_shadow:
            report.unmatched = int((~hit).sum())
            report.other = int((~selected[track[matched]]).sum())
        for t in np.unique(track[matched]):
            if selected[t]:
                mine = track[matched] == t
                by_track[int(t)] = np.stack([samples[mine], matched[mine]])
    for t in sorted(by_track, key=lambda i: (rows.tracks[i].shadow, rows.tracks[i].name)):
        sample_idx, row_idx = by_track[t]
        s, y, when = score[row_idx], labels.label[sample_idx].astype(np.int64), labels.ts[sample_idx]
        minute = when // MINUTE_MS * MINUTE_MS
        minutes = [(int(m), Grade.of(s[minute == m], y[minute == m])) for m in np.unique(minute)]
        report.tracks.append(TrackGrade(rows.tracks[t], rows.requests[t], Grade.of(s, y), minutes))
    for t in np.flatnonzero(selected):  # selected tracks that no sample could grade are still listed
        if int(t) not in by_track:
            report.tracks.append(TrackGrade(rows.tracks[t], rows.requests[t], Grade.of(np.empty(0), np.empty(0)), []))
    return report


def _defined(x: float) -> float | None:
    return None if math.isnan(x) else x
