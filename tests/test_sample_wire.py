"""The samples' Kafka encoding and the checks every consumer applies."""

import orjson
import pyarrow.parquet as pq
import pytest

from streamrec.contracts.sample_wire import check_samples, decode_samples, encode_samples
from streamrec.contracts.feature_spec import FeatureSpec


@pytest.fixture(scope="module")
def table(sample_run):
    return pq.read_table(sample_run / "samples.parquet").slice(0, 3000)


def test_round_trip_is_exact(table):
    good, index, rejected = decode_samples(encode_samples(table), FeatureSpec())
    assert rejected == []
    assert good.equals(table)
    assert index.tolist() == list(range(table.num_rows))


def _edit(message: bytes, **changes) -> bytes:
    row = orjson.loads(message)
    for key, value in changes.items():
        if value is KeyError:
            del row[key]
        else:
            row[key] = value
    return orjson.dumps(row)


def test_every_bad_message_is_refused_with_its_reason_and_nothing_else_is_lost(table):
    messages = encode_samples(table)
    bad = {
        3: (b"not json", "malformed_json"),
        10: (b"[1, 2]", "wrong_type"),
        11: (_edit(messages[11], user_id=1.5), "wrong_type"),
        12: (_edit(messages[12], item_id="7"), "wrong_type:item_id"),
        13: (_edit(messages[13], sample_version=2), "unknown_sample_version"),
        14: (_edit(messages[14], label=KeyError), "missing_field:label"),
        15: (_edit(messages[15], label=3), "invalid_value:label"),
        16: (_edit(messages[16], item_imps_60s=-1), "invalid_value:item_imps_60s"),
        17: (_edit(messages[17], user_id=-(2**63)), "reserved_id:user_id"),
        18: (_edit(messages[18], hist_item_ids=[1, 2], hist_category_ids=[1]), "invalid_value:hist_category_ids"),
        19: (_edit(messages[19], hist_item_ids=list(range(51)), hist_category_ids=list(range(51))), "invalid_value:hist_item_ids"),
        20: (messages[20] + messages[21], "malformed_json"),  # two objects in one message
        21: (b'{"ts":18446744073709551616,' + _edit(messages[21], ts=KeyError)[1:], "wrong_type"),  # beyond int64
        22: (b"", "malformed_json"),
        23: (_edit(messages[23], hist_item_ids=[5, -(2**63) + 1], hist_category_ids=[1, 2]), "reserved_id:hist_item_ids"),
    }
    for i, (value, _) in bad.items():
        messages[i] = value
    messages[30] = orjson.dumps(orjson.loads(messages[30]), option=orjson.OPT_INDENT_2)  # multi-line but valid
    good, index, rejected = decode_samples(messages, FeatureSpec())
    assert dict(rejected) == {i: reason for i, (_, reason) in bad.items()}
    assert index.tolist() == [i for i in range(table.num_rows) if i not in bad]
    assert good.equals(table.take(index))


def test_files_of_another_spec_are_refused_clearly(table):
    with pytest.raises(ValueError, match="lack columns"):
        check_samples(table.drop(["user_imps_60s"]), FeatureSpec())
