"""Predict bodies decoded by serving/runtime/request.py give the same features as the training path
(contracts.sample_wire + model.batch.batch_from_table) and refuse exactly the instances
the sample checks refuse, each with its reason."""

import msgspec
import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
import torch

from streamrec.contracts.sample_wire import MAX_DEVICE_CHARS, MAX_ID_CHARS, RESERVED_IDS, RESERVED_MAX, decode_samples
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.serving.errors import ApiError
from streamrec.serving.runtime.request import ByIdsDecoder, InstanceDecoder, is_by_ids
from streamrec.model.batch import batch_from_columns, batch_from_table

SPEC = FeatureSpec()


@pytest.fixture(scope="module")
def rows(sample_run):
    return pq.read_table(sample_run / "samples.parquet").slice(0, 700).drop(["label", "click_ts"]).to_pylist()


@pytest.mark.parametrize("history_len", [50, 8])
def test_features_equal_the_training_path(rows, history_len):
    decoder = InstanceDecoder(SPEC, max_instances=1000)
    instances = decoder.decode(orjson.dumps({"instances": rows}))
    columns, rejected = decoder.columns(instances)
    assert rejected == []
    ours = batch_from_columns(columns, SPEC, history_len)
    table, _, refused = decode_samples([orjson.dumps(r) for r in rows], SPEC, instances=True)
    assert refused == []
    reference = batch_from_table(table, SPEC, history_len, with_labels=False)
    for name in reference._tensors():
        want, got = getattr(reference, name), getattr(ours, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name


BAD = [  # (change to one instance, the reason both paths give)
    ({"user_id": "u-1"}, "wrong_type:user_id"),
    ({"item_id": 1.5}, "wrong_type:item_id"),
    ({"device": 3}, "wrong_type:device"),
    ({"hist_item_ids": [1, "x"], "hist_category_ids": [1, 2]}, "wrong_type:hist_item_ids"),
    ({"item_id": None}, "missing_field:item_id"),
    ({"ts": KeyError}, "missing_field:ts"),
    ({"user_imps_60s": -1}, "invalid_value:user_imps_60s"),
    ({"sample_version": 2}, "unknown_sample_version"),
    ({"user_id": -(2**63)}, "reserved_id:user_id"),
    ({"hist_item_ids": [1, -(2**63) + 1], "hist_category_ids": [1, 2]}, "reserved_id:hist_item_ids"),
    ({"hist_item_ids": [1, 2], "hist_category_ids": [3]}, "invalid_value:hist_category_ids"),
    ({"hist_item_ids": list(range(51)), "hist_category_ids": list(range(51))}, "invalid_value:hist_item_ids"),
    ({"device": "d" * 257}, "invalid_value:device"),  # the bounds of what a client controls
    ({"event_id": "e" * 257}, "invalid_value:event_id"),
    ({"request_id": "r" * 257}, "invalid_value:request_id"),
    ({"local_hour": 24}, "invalid_value:local_hour"),
    ({"local_hour": -1}, "invalid_value:local_hour"),
    ({"position": -1}, "invalid_value:position"),
]


def _edited(row: dict, change: dict) -> dict:
    row = dict(row)
    for key, value in change.items():
        if value is KeyError:
            del row[key]
        else:
            row[key] = value
    return row


@pytest.mark.parametrize("change, reason", BAD)
def test_each_bad_instance_gets_the_sample_checks_reason(rows, change, reason):
    decoder = InstanceDecoder(SPEC, max_instances=1000)
    batch = [rows[0], _edited(rows[1], change), rows[2]]
    _, _, refused = decode_samples([orjson.dumps(r) for r in batch], SPEC, instances=True)
    # the training path's verdict (pyarrow cannot always name the field of a type error) ...
    assert [i for i, _ in refused] == [1] and refused[0][1] in (reason, reason.split(":")[0])
    try:  # ... and ours: type errors at decode, cross-field checks over the batch
        instances = decoder.decode(orjson.dumps({"instances": batch}))
    except ApiError as exc:
        assert exc.status == 400 and f"1 invalid instance(s): instance 1: {reason} " in exc.message, exc.message
        return
    assert decoder.columns(instances)[1] == [(1, reason)]


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (b'{"rows": []}', 400, "needs 'instances'"),
    (b'{"instances": []}', 400, "needs 'instances'"),
    (b'{"instances": [1, {}]}', 400, "instances [0] are not JSON objects"),
    (b'{"instances": [' + b",".join([b"{}"] * 11) + b"]}", 413, "serving.max_instances (10)"),
])
def test_bad_bodies_get_clear_messages(body, status, message):
    with pytest.raises(ApiError) as info:
        InstanceDecoder(SPEC, max_instances=10).decode(body)
    assert info.value.status == status and message in info.value.message, info.value.message


def test_an_instance_of_another_feature_spec_is_refused_naming_the_nodes_spec(rows):
    wider = FeatureSpec(windows_s=(60, 600, 3600))
    row = {**rows[0], **{name: 1 for name in wider.counter_columns()}}  # built for a node with a 3600 s window
    with pytest.raises(ApiError) as info:
        InstanceDecoder(SPEC, max_instances=10).decode(orjson.dumps({"instances": [rows[1], row]}))
    message = info.value.message
    assert info.value.status == 400 and "instance 1: unknown_field:user_imps_3600s" in message, message
    assert "this node serves feature spec windows_s [60, 600], history_len 50" in message
    with pytest.raises(ApiError, match="instance 0: missing_field:user_imps_3600s"):  # and the other way round
        InstanceDecoder(wider, max_instances=10).decode(orjson.dumps({"instances": [rows[1]]}))


def test_strings_at_their_bound_are_served(rows):
    """The bounds refuse only what is past them: the longest device and ids, the last hour."""
    row = {**rows[0], "device": "d" * MAX_DEVICE_CHARS, "event_id": "e" * MAX_ID_CHARS, "request_id": "r" * MAX_ID_CHARS,
           "local_hour": 23, "position": 0}
    decoder = InstanceDecoder(SPEC, max_instances=10)
    assert decoder.columns(decoder.decode(orjson.dumps({"instances": [row]})))[1] == []
    assert decode_samples([orjson.dumps(row)], SPEC, instances=True)[2] == []


def test_a_replayed_sample_with_its_label_is_an_instance(sample_run):
    sample = pq.read_table(sample_run / "samples.parquet").slice(0, 3).to_pylist()
    decoder = InstanceDecoder(SPEC, max_instances=10)
    columns, rejected = decoder.columns(decoder.decode(orjson.dumps({"instances": sample})))
    assert rejected == [] and len(columns) == 3


@pytest.mark.parametrize("change, message", [
    ({"context": {"device": "x" * 257, "local_hour": 3}}, "length <= 256"),
    ({"context": {"device": "ios", "local_hour": 24}}, "<= 23"),
    ({"context": {"device": "ios", "local_hour": -1}}, ">= 0"),
    ({"candidates": [{"item_id": 1, "category_id": 2, "advertiser_id": 3, "position": -7}]}, ">= 0"),
])
def test_by_ids_bounds_what_a_client_controls(change, message):
    """A device string as long as a client likes would be kept by the node's caches; an hour
    or a position out of range has no meaning: each is a 400 naming the field."""
    good = {"user_id": 1, "context": {"device": "ios", "local_hour": 23},
            "candidates": [{"item_id": 1, "category_id": 2, "advertiser_id": 3, "position": 0}]}
    decoder = ByIdsDecoder(max_candidates=100, max_future_skew_ms=60_000)
    assert decoder.decode(orjson.dumps(good), 0)[0].context.local_hour == 23
    with pytest.raises(ApiError) as caught:
        decoder.decode(orjson.dumps({**good, **change}), 0)
    assert caught.value.status == 400 and message in caught.value.message, caught.value.message


def test_the_reserved_ids_are_exactly_the_lowest_int64s():
    """The decoders find a reserved id with one comparison, ``id <= RESERVED_MAX``."""
    assert sorted(RESERVED_IDS) == list(range(np.iinfo(np.int64).min, RESERVED_MAX + 1))


def test_by_ids_refuses_the_reserved_ids_and_says_where():
    candidate = {"item_id": 1, "category_id": 2, "advertiser_id": 3, "position": 0}
    body = {"user_id": -(2**63), "context": {"device": "ios", "local_hour": 1},
            "candidates": [candidate, {**candidate, "category_id": -(2**63) + 1}, {**candidate, "item_id": -(2**63)}]}
    decoder = ByIdsDecoder(max_candidates=100, max_future_skew_ms=60_000)
    with pytest.raises(ApiError) as caught:
        decoder.decode(orjson.dumps(body), 0)
    assert caught.value.status == 400
    assert caught.value.message.endswith(f"user_id {-(2**63)}; candidates[1].category_id {-(2**63) + 1}; candidates[2].item_id {-(2**63)}")
    request, query = decoder.decode(orjson.dumps({**body, "user_id": 7, "candidates": [candidate] * 2}), 1_000)
    assert request.user_id == query.user_id == 7 and query.ts == 1_000 and query.candidates.tolist() == [[1, 2, 3, 0]] * 2


def test_the_form_comes_from_the_top_level_keys():
    assert is_by_ids(b'{"user_id": 1, "context": {"device": "instances", "local_hour": 1}, "candidates": []}')
    assert not is_by_ids(b'{"instances": [{"user_id": 1}]}')
    assert not is_by_ids(b'{"model": "ctr", "instances": [{"user_id": 1, "candidates": 2}]}')
    assert not is_by_ids(b'[{"user_id": 1}]')


def _valid_instance() -> dict:
    """A hand-built instance of SPEC that the decoder serves (no sample run needed)."""
    return {"ts": 1_700_000_000_000, "user_id": 11, "item_id": 12, "position": 1, "device": "ios", "local_hour": 9,
            "category_id": 13, "advertiser_id": 14, "hist_item_ids": [15, 16], "hist_category_ids": [13, 17],
            **{name: 1 for name in SPEC.counter_columns()}}


def _refusal(decoder: InstanceDecoder, instances: list[dict]) -> str:
    with pytest.raises(ApiError) as caught:
        decoder.decode(orjson.dumps({"instances": instances}))
    assert caught.value.status == 400
    return caught.value.message


def test_every_missing_or_bad_field_of_an_instance_is_named_in_one_answer():
    """A newcomer's first body misses most fields: one 400 names each of them (and each
    wrong, out-of-range or unknown field of the next instance), not only the first."""
    decoder = InstanceDecoder(SPEC, max_instances=10)
    assert decoder.columns(decoder.decode(orjson.dumps({"instances": [_valid_instance()]})))[1] == []
    bad = {**_valid_instance(), "user_id": "u-1", "local_hour": 24, "item_id": None, "colour": "red"}
    del bad["hist_category_ids"]
    message = _refusal(decoder, [{"user_id": 1, "item_id": 2}, bad])
    assert message.startswith("2 invalid instance(s): instance 0: "), message
    first, second = message.removeprefix("2 invalid instance(s): instance 0: ").split(" (schema")[0].split("; instance 1: ")
    required = [f.name for f in msgspec.structs.fields(decoder.instance) if f.required]
    assert len(required) == 22  # the sample's fields but the optional meta ones and the label
    assert first.split(", ") == [f"missing_field:{name}" for name in required if name not in ("user_id", "item_id")]
    assert second.split(", ") == ["wrong_type:user_id", "missing_field:item_id", "invalid_value:local_hour",
                                  "missing_field:hist_category_ids", "unknown_field:colour"]


def test_every_cross_field_problem_of_an_instance_is_named():
    decoder = InstanceDecoder(SPEC, max_instances=10)
    bad = {**_valid_instance(), "user_id": RESERVED_MAX, "item_id": RESERVED_MAX, "hist_category_ids": [13]}
    assert decoder.columns(decoder.decode(orjson.dumps({"instances": [_valid_instance(), bad]})))[1] == [
        (1, "reserved_id:user_id, reserved_id:item_id, invalid_value:hist_category_ids")]


def test_the_answer_lists_the_first_ten_bad_instances_and_says_so():
    message = _refusal(InstanceDecoder(SPEC, max_instances=20), [{"user_id": 1}] * 12)
    assert message.startswith("12 invalid instance(s), the first 10: instance 0: missing_field:ts, "), message
    assert "instance 9: missing_field:ts" in message and "instance 10:" not in message


def test_unknown_fields_are_listed_up_to_a_bound():
    """The spec bounds an instance's missing and bad fields; a body may carry any number of
    unknown ones, so the answer names ten and counts the rest."""
    extra = {f"x{k}": 1 for k in range(12)}
    message = _refusal(InstanceDecoder(SPEC, max_instances=10), [{**_valid_instance(), **extra}])
    assert ", ".join(f"unknown_field:x{k}" for k in range(10)) + ", 2 more unknown fields (schema" in message, message


def test_a_by_ids_400_names_every_bad_field_at_once():
    decoder = ByIdsDecoder(max_candidates=100, max_future_skew_ms=60_000)
    body = {"user_id": "7", "context": {"device": "ios", "local_hour": 24},
            "candidates": [{"item_id": 1, "category_id": 2, "advertiser_id": 3, "position": 0},
                           {"item_id": 1.5, "category_id": 2, "position": -1, "colour": "red"}],
            "return_features": "yes"}
    with pytest.raises(ApiError) as caught:
        decoder.decode(orjson.dumps(body), 0)
    message = caught.value.message
    assert caught.value.status == 400
    for words in ("user_id: Expected `int`, got `str`", "context.local_hour: Expected `int` <= 23",
                  "candidates[1].item_id: Expected `int`, got `float`", "candidates[1].advertiser_id: missing",
                  "candidates[1].position: Expected `int` >= 0", "candidates[1].colour: unknown field",
                  "return_features: Expected `bool`, got `str`"):
        assert words in message, message
    assert "candidates[0]" not in message
