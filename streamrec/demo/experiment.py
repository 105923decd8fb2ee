"""The demo's live experiment: the online model against the same model frozen after warm-up,
50/50 by user, through the serving node's experiment route, graded from its prediction log.

The probe's main figures score every sample with both models; the experiment is the
production path instead: each user sees one variant, every answer is logged to
``topics.predictions``, and the variants are graded by joining that log with the labelled
samples (streamrec/analysis/grading.py, as ``streamrec experiments report`` does).
"""

from __future__ import annotations

import os
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from streamrec.contracts.delta import SparseDelta
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.modelstore.store import ModelStore
from streamrec.modelstore.writer import VersionWriter
from streamrec.plumbing.config import CONFIG_ENV, LOCAL_CONFIG, Config, ConfigError
from streamrec.analysis.grading import Labels, Track, grade
from streamrec.analysis.grading_input import read_for_grading

if TYPE_CHECKING:
    from streamrec.demo.probe import ServingClient

EXPERIMENT = "online-vs-frozen"
VARIANTS = ("online", "frozen")
GRADING_WINDOW_S = 300.0  # `streamrec experiments report`'s default join window
GRADING_READ_TIMEOUT_S = 120.0
CONNECTIONS = 8  # the probe's concurrent experiment requests
_STRUCTURE = {"format_version", "model", "version", "kind", "parent", "created_at", "files", "tables"}


@dataclass(frozen=True)
class LiveExperiment:
    """What the probe needs to run the experiment: where the frozen version goes and the
    connections its requests use."""

    name: str
    frozen_store: ModelStore
    clients: list["ServingClient"]


def frozen_model_name(model: str) -> str:
    """The name the frozen copy is served under, beside ``model``."""
    return f"{model}-frozen"


def serving_config(path: Path, base: Path | None, model: str) -> Path:
    """Write the serving node's config: ``base`` (the user's file, if any) with the two models
    and the experiment appended. Tables of TOML lists cannot come from environment variables."""
    text = base.read_text() if base is not None else ""
    frozen = frozen_model_name(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""{text}

# added by `streamrec demo`: the online model and its frozen copy, 50/50 by user
[[serving.models]]
name = "{model}"

[[serving.models]]
name = "{frozen}"

[[serving.experiments]]
name = "{EXPERIMENT}"
variants = [{{name = "online", model = "{model}", share = 0.5}}, {{name = "frozen", model = "{frozen}", share = 0.5}}]
""")
    return path


def user_config_file(explicit: str | None) -> Path | None:
    """The config file the demo's processes read (as load_config chooses it): the node's
    config must keep its settings."""
    chosen = explicit or os.environ.get(CONFIG_ENV) or (LOCAL_CONFIG if LOCAL_CONFIG.exists() else None)
    return Path(chosen).resolve() if chosen else None


def check_config(cfg: Config) -> None:
    """The demo's node serves its own models and experiment: a config that sets others would clash."""
    if cfg.serving.models or cfg.serving.experiments:
        raise ConfigError("the demo's serving node serves its own models and experiment: run it with a config "
                         "without [[serving.models]] and [[serving.experiments]]")


def publish_copy(source: ModelStore, version: int, target: ModelStore) -> int:
    """Publish ``version`` of ``source`` (its whole state, chain merged) as a full version of
    ``target``, with its metadata; returns the new version's number."""
    loaded = source.load(version)
    dims = {name: loaded.manifest["tables"][name]["dim"] for name in loaded.tables}
    tables = {name: SparseDelta(torch.from_numpy(keys), torch.from_numpy(values)) for name, (keys, values) in loaded.tables.items()}
    meta = {k: v for k, v in loaded.manifest.items() if k not in _STRUCTURE}
    meta["copy_of"] = {"model": source.model, "version": version}
    return VersionWriter(target).publish("full", tables, dims, loaded.dense, meta)


def prediction_log_counts(address: str) -> dict[str, int]:
    """The node's prediction log counters by outcome (queued, sent, dropped, failed), from /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r'^streamrec_serving_prediction_log_records\{outcome="(\w+)"\} (\S+)$', text, re.MULTILINE)
    return {outcome: int(float(value)) for outcome, value in found}


def grade_experiment(bootstrap: str, samples_topic: str, predictions_topic: str, spec: FeatureSpec,
                     connect_timeout_s: float, trained_on: set[tuple[int, int, int]]) -> dict:
    """Each variant's count, AUC, log loss and calibration: the samples joined with the logged
    predictions by the code ``streamrec experiments report`` runs.

    ``trained_on``: the (user_id, item_id, ts) of samples whose answer came from a version that
    had already trained on them (or that were not sent: the served version had), left out. The probe sends samples after they were written, so
    on a loaded machine a version may have learnt a sample before answering it; a live ad
    request is answered before its sample exists."""
    labels, rows, counts = read_for_grading(bootstrap, samples_topic, predictions_topic, spec, 0.0, GRADING_WINDOW_S,
                                            connect_timeout_s, GRADING_READ_TIMEOUT_S)
    keep = np.array([key not in trained_on for key in zip(labels.user_id.tolist(), labels.item_id.tolist(),
                                                          labels.ts.tolist())], bool)
    labels = Labels(*(column[keep] for column in (labels.user_id, labels.item_id, labels.ts, labels.label)))

    def selected(t: Track) -> bool:
        return t.experiment == EXPERIMENT and not t.shadow

    report = grade(labels, rows, GRADING_WINDOW_S, selected)
    variants = {t.track.variant: {"model": t.track.model, "requests": t.requests, "count": t.total.count,
                                  "clicks": t.total.clicks, "auc": _round(t.total.auc), "logloss": _round(t.total.logloss),
                                  "calibration": _round(t.total.calibration)} for t in report.tracks}
    return {"window_s": GRADING_WINDOW_S, "samples": report.samples, "left_out_trained_on": int((~keep).sum()),
            "predictions_read": counts.predictions,
            "unmatched": report.unmatched, "other": report.other, "variants": variants}


def experiment_line(experiment: dict) -> str:
    """The summary's line: each variant's AUC as graded from the log, and the AUC of the same
    answers as the probe received them (what the log's grade must reproduce)."""
    graded, answered = experiment["graded"], experiment["answered"]
    parts, probe = [], []
    for name in VARIANTS:
        g = graded["variants"].get(name)
        parts.append(f"{name} not graded" if g is None else f"{name} AUC {g['auc']} (n={g['count']:,})")
        a = answered.get(name) or {}
        probe.append(f"{a.get('auc')} (n={a.get('samples', 0):,})")
    ungraded, learnt = graded["unmatched"] + graded["other"], graded["left_out_trained_on"]
    return (f"live experiment {EXPERIMENT}, graded from the prediction log: " + ", ".join(parts)
            + f"; as the probe received the answers: {' / '.join(probe)}"
            + (f"; {ungraded:,} samples ungraded" if ungraded else "")
            + (f"; {learnt:,} left out, answered (or not sent) after a version had trained on them" if learnt else ""))


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 4)
