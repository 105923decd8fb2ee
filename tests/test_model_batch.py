"""The model's dense features, against values worked out by hand: log1p of each counter, then
each entity's smoothed click-through rate per window, clicks / (impressions + 10)."""

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.model.batch import batch_from_table, dense_feature_names, dense_features

SPEC = FeatureSpec()  # windows 60 s and 600 s; user, item and category counters


def _one_sample(counters: dict[str, int]) -> pa.Table:
    row = {"sample_version": 1, "event_id": "e", "request_id": "r", "ts": 1_700_000_000_000, "user_id": 7, "item_id": 8,
           "position": 2, "device": "ios", "local_hour": 13, "category_id": 9, "advertiser_id": 10,
           "hist_item_ids": [8, 11], "hist_category_ids": [9, 12], **{c: 0 for c in SPEC.counter_columns()}, **counters}
    return pa.Table.from_pylist([row], schema=SPEC.schema(with_label=False))


def test_dense_features_are_log1p_counters_and_smoothed_rates():
    counters = {"user_imps_60s": 5, "user_clicks_60s": 2, "item_imps_600s": 990, "item_clicks_600s": 50,
                "category_imps_60s": 0, "category_clicks_60s": 0}
    dense = batch_from_table(_one_sample(counters), SPEC, 50, with_labels=False).dense[0].tolist()
    got = dict(zip(dense_feature_names(SPEC), dense))
    assert len(got) == len(dense) == len(SPEC.counter_columns()) + 2 * 3
    expected = {
        "log1p_user_imps_60s": math.log(6), "log1p_user_clicks_60s": math.log(3),
        "log1p_item_imps_600s": math.log(991), "log1p_item_clicks_600s": math.log(51),
        "log1p_category_imps_60s": 0.0, "log1p_user_imps_600s": 0.0,
        "ctr_user_60s": 2 / 15, "ctr_item_600s": 50 / 1000, "ctr_category_60s": 0.0, "ctr_item_60s": 0.0,
    }
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


def test_an_empty_batch_has_dense_features_of_the_full_width():
    """A rank can draw an empty batch (distributed trainer): its dense block is [0, F]."""
    empty = _one_sample({}).slice(0, 0)
    assert tuple(batch_from_table(empty, SPEC, 50, with_labels=False).dense.shape) == (0, len(dense_feature_names(SPEC)))
    for counters in (np.zeros((0, 12), np.int64), torch.zeros((0, 12), dtype=torch.int64)):
        assert tuple(dense_features(counters).shape) == (0, len(dense_feature_names(SPEC)))
