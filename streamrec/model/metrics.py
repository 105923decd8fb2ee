"""Scores of click predictions against outcomes: AUC and log loss.

Used for the Bayes-optimal reference (the world's own probabilities scored on its own
clicks) and by every later evaluation that is compared with it.
"""

from __future__ import annotations

import numpy as np


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); NaN if one class."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    n_pos = int(labels.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores))
    # average rank over runs of equal scores
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.r_[0, boundaries]
    ends = np.r_[boundaries, len(scores)]
    avg = (starts + ends + 1) / 2.0  # 1-based ranks
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(p: np.ndarray, labels: np.ndarray, eps: float = 1e-7) -> float:
    p = np.clip(np.asarray(p, dtype=np.float64), eps, 1 - eps)
    y = np.asarray(labels).astype(np.float64)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())
