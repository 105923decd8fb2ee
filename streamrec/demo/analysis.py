"""Turn what the probe recorded into the demo's figures: serving-side AUC/logloss over
time for the online, frozen and Bayes scorers, and the event-to-servable latency of
every click, split by stage."""

from __future__ import annotations

import numpy as np

from streamrec.model.metrics import auc, logloss

STAGES = ("event_to_sample", "sample_to_trained", "trained_to_published", "published_to_applied")


def _pct(values: np.ndarray) -> dict:
    if not len(values):
        return {"n": 0}
    return {"n": int(len(values)), "p50": round(float(np.percentile(values, 50)), 1),
            "p99": round(float(np.percentile(values, 99)), 1), "max": round(float(values.max()), 1)}


def trained_on(snapshot: dict, manifests: dict[int, dict]) -> np.ndarray:
    """Mask of scored samples that the answering version had already trained on."""
    return np.array([had_trained_on(v, p, o, manifests) for v, p, o in zip(
        snapshot["version"].tolist(), snapshot["sample_partition"].tolist(), snapshot["sample_offset"].tolist())], bool)


def had_trained_on(version: int, partition: int, offset: int, manifests: dict[int, dict]) -> bool:
    """Whether ``version`` had trained on the sample at (partition, offset) of the samples topic
    (its manifest's offsets pass it): a score it gave that sample says what it memorised."""
    offsets = (manifests.get(version) or {}).get("offsets") or {}
    return int(offsets.get(str(partition), 0)) > offset


def quality(snapshot: dict, start_ms: int, manifests: dict[int, dict], bin_s: float = 10.0, window_s: float = 30.0,
            steady_from_ms: int | None = None) -> dict:
    """AUC/logloss of each scorer on the same samples: overall, over sliding ``window_s``
    windows of event time (one point per ``bin_s``) and, with ``steady_from_ms``, over the
    samples from then on (``steady``: the second half of a run, when the online model has
    had versions to learn the drift; the frozen one is as at warm-up throughout). Samples
    the answering version had already trained on are left out (no leakage in the online figures)."""
    leaked = trained_on(snapshot, manifests)
    snapshot = {k: (v[~leaked] if isinstance(v, np.ndarray) and len(v) == len(leaked) else v) for k, v in snapshot.items()}
    ts, label = snapshot["ts"], snapshot["label"]
    scorers = {"online": snapshot["online"], "frozen": snapshot["frozen"], "bayes": snapshot["bayes"]}
    known = ~np.isnan(scorers["bayes"]) if len(ts) else np.zeros(0, bool)
    out = {"samples": int(len(ts)), "positives": int(label.sum()) if len(ts) else 0, "with_bayes": int(known.sum()),
           "left_out_trained_on": int(leaked.sum()), "overall": {}, "series": []}
    if not len(ts):
        return out
    for name, s in scorers.items():
        use = known if name == "bayes" else np.ones(len(ts), bool)
        out["overall"][name] = {"auc": _round(auc(s[use], label[use])), "logloss": _round(logloss(s[use], label[use]))}
    if steady_from_ms is not None:
        late = ts >= steady_from_ms
        steady = out["steady"] = {"from_ms": int(steady_from_ms), "samples": int(late.sum()), "positives": int(label[late].sum()),
                                  "overall": {}}
        if 0 < steady["positives"] < steady["samples"]:
            for name, s in scorers.items():
                use = late & known if name == "bayes" else late
                steady["overall"][name] = {"auc": _round(auc(s[use], label[use])), "logloss": _round(logloss(s[use], label[use]))}
    end_s = (ts.max() - start_ms) / 1000
    t = bin_s
    while t <= end_s + bin_s:
        sel = (ts >= start_ms + (t - window_s) * 1000) & (ts < start_ms + t * 1000)
        if sel.sum() >= 50 and 0 < label[sel].sum() < sel.sum():
            point = {"t_s": round(t, 1), "samples": int(sel.sum())}
            for name, s in scorers.items():
                use = sel & known if name == "bayes" else sel
                point[name] = _round(auc(s[use], label[use])) if use.any() else None
            out["series"].append(point)
        t += bin_s
    return out


def answers_trained_on(answers: list, manifests: dict[int, dict], frozen_model: str, frozen_version: int | None) -> np.ndarray:
    """Mask of the experiment's answers (AnsweredSample) whose answering version had already
    trained on the sample; the frozen model's one version is a copy of ``frozen_version``."""
    return np.array([had_trained_on(frozen_version if a.model == frozen_model else a.version, a.partition, a.offset,
                                    manifests) for a in answers], bool)


def by_variant(answers: list, trained: np.ndarray) -> dict:
    """Each variant's AUC and log loss over the scores the probe received for its experiment
    answers, less those ``trained`` on: what grading the node's prediction log must reproduce."""
    variant = np.array([a.variant for a in answers], dtype=object)
    score = np.array([a.score for a in answers], np.float64)
    label = np.array([a.label for a in answers], np.int64)
    out = {}
    for name in sorted(set(variant.tolist())):
        use = ~trained & (variant == name)
        s, y = score[use], label[use]
        out[name] = {"samples": int(use.sum()), "clicks": int(y.sum()), "auc": _round(auc(s, y)),
                     "logloss": _round(logloss(s, y)) if len(y) else None}
    return out


def _round(x: float) -> float | None:
    return None if x is None or np.isnan(x) else round(float(x), 4)


def freshness(positives: dict, manifests: dict[int, dict], applied: dict[int, float], steady_from_ms: int | None = None) -> dict:
    """Event-to-servable latency of each click (ms), and its split by stage.

    A click's sample is *trained* into the first version whose manifest offsets pass the
    sample's offset, and *servable* when the server applied that version or a later one.
    ``steady``: the same for clicks from ``steady_from_ms`` on (after the JVM warm-up and
    the start-up backlog).
    """
    versions = sorted(v for v, m in manifests.items() if m.get("offsets") is not None)
    applied_versions = sorted(applied)
    stages: dict[str, list[float]] = {s: [] for s in STAGES}
    total: list[float] = []
    steady: list[float] = []
    pending = 0
    for click_ts, visible, part, offset in zip(positives["click_ts"], positives["visible_ms"], positives["partition"],
                                               positives["offset"]):
        v = next((v for v in versions if int(manifests[v]["offsets"].get(str(part), 0)) > offset), None)
        serving = [applied[w] for w in applied_versions if v is not None and w >= v]
        if v is None or not serving:
            pending += 1  # not in a published, applied version before the demo stopped
            continue
        m = manifests[v]
        snapshot_ms = (m.get("snapshot_at") or m["created_at"]) * 1000
        published_ms, applied_ms = m["created_at"] * 1000, min(serving) * 1000
        stages["event_to_sample"].append(visible - click_ts)
        stages["sample_to_trained"].append(snapshot_ms - visible)
        stages["trained_to_published"].append(published_ms - snapshot_ms)
        stages["published_to_applied"].append(applied_ms - published_ms)
        total.append(applied_ms - click_ts)
        if steady_from_ms is not None and click_ts >= steady_from_ms:
            steady.append(applied_ms - click_ts)
    return {"clicks": int(len(positives["click_ts"])), "not_yet_servable": pending,
            "event_to_servable_ms": _pct(np.array(total)), "steady_event_to_servable_ms": _pct(np.array(steady)),
            "stages_ms": {s: _pct(np.array(v)) for s, v in stages.items()}}
