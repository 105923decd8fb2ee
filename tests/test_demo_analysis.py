"""The demo's experiment figures from the probe's side: which answers a version had already
trained on (by the samples' offsets in its manifest; the frozen model's one version stands
for the online version it copies), and each variant's grade over the rest."""

from __future__ import annotations

import numpy as np

from streamrec.demo.analysis import answers_trained_on, by_variant
from streamrec.demo.probe import AnsweredSample
from streamrec.model.metrics import auc


def _answer(offset: int, variant: str, version: int, score: float, label: int) -> AnsweredSample:
    model = "ctr" if variant == "online" else "ctr-frozen"
    return AnsweredSample(7, 100 + offset, 1_000 + offset, label, 0, offset, variant, model, version, score)


def test_an_answer_is_left_out_when_its_version_had_trained_on_the_sample():
    manifests = {2: {"offsets": {"0": 10}}, 3: {"offsets": {"0": 20}}}
    answers = [_answer(5, "online", 3, 0.9, 1),  # version 3 read partition 0 up to offset 19
               _answer(25, "online", 3, 0.2, 0),  # not yet read by version 3
               _answer(15, "frozen", 1, 0.5, 1),  # the frozen copy's version 1 is online version 2: not read
               _answer(5, "frozen", 1, 0.5, 1),  # read by version 2
               _answer(25, "online", 9, 0.5, 0)]  # version 9's manifest unknown: kept
    trained = answers_trained_on(answers, manifests, "ctr-frozen", 2)
    assert trained.tolist() == [True, False, False, True, False]


def test_each_variant_is_graded_on_its_own_answers_less_those_trained_on():
    rng = np.random.default_rng(0)
    answers = [_answer(i, ("online", "frozen")[i % 2], 1, float(rng.random()), int(rng.random() < 0.3)) for i in range(400)]
    trained = np.arange(400) < 100
    out = by_variant(answers, trained)
    for name in ("online", "frozen"):
        kept = [a for a, t in zip(answers, trained) if a.variant == name and not t]
        scores, labels = np.array([a.score for a in kept]), np.array([a.label for a in kept])
        assert out[name]["samples"] == len(kept) == 150 and out[name]["clicks"] == labels.sum()
        assert out[name]["auc"] == round(float(auc(scores, labels)), 4)
