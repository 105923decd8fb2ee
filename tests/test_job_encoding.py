"""The job's hand-written sample encoder (pipelines/java/.../SampleJson) writes JSON that the
trainer's strict decoder reads back field for field, strings with quotes, backslashes,
control characters and non-ASCII included (run in PyFlink's JVM)."""

from dataclasses import replace

import orjson
import pytest

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.pipelines.flink_runner import RunOptions, job_jars
from streamrec.contracts.sample_wire import decode_samples
from streamrec.plumbing.config import load_config


@pytest.mark.slow
def test_sample_json_round_trips_through_the_strict_decoder(tmp_path):
    from py4j.java_gateway import set_field
    from pyflink.java_gateway import get_gateway
    from pyflink.util.java_utils import add_jars_to_context_class_loader

    add_jars_to_context_class_loader(job_jars(replace(RunOptions.from_config(load_config()), checkpoint_dir=tmp_path)))
    gw = get_gateway()
    spec = FeatureSpec()
    e = gw.jvm.streamrec.flink.Event()

    def longs(values):
        arr = gw.new_array(gw.jvm.long, len(values))
        for i, v in enumerate(values):
            arr[i] = v
        return arr

    def ints(values):
        arr = gw.new_array(gw.jvm.int, len(values))
        for i, v in enumerate(values):
            arr[i] = v
        return arr

    fields = {"eventId": 'ev"1\\x', "requestId": "req\u00e9\u2603\n\t", "device": "ios", "ts": 1_700_000_000_123,
              "userId": 2**62, "itemId": 42, "categoryId": -7, "advertiserId": 9, "position": 3, "localHour": 23,
              "histItems": longs([5, -(2**63) + 2, 0]), "histCategories": longs([1, 2, 3]),
              "userCounts": ints([1, 2, 3, 4]), "itemCounts": ints([5, 6, 7, 8])}
    edges = [0, 7, 9, 10, 99, 100, 101, 12345, 10**18 - 1, 10**18, 2**63 - 1, -1, -10, -99, -100, -(2**62)]
    fields["histItems"] = longs([5, -(2**63) + 2, 0, *edges])
    fields["histCategories"] = longs([1, 2, 3, *range(len(edges))])
    for name, value in fields.items():
        set_field(e, name, value)
    props = spec.job_properties()
    encoder = gw.jvm.streamrec.flink.SampleJson(1, props["sample_fields"], props["counter_columns"], len(spec.windows_s))
    body = bytes(encoder.unlabelled(e, ints([9, 10, 11, 12]))) + b',"label":1,"click_ts":1700000000999}'
    row = orjson.loads(body)
    assert row["event_id"] == 'ev"1\\x' and row["request_id"] == "req\u00e9\u2603\n\t"
    assert row["user_id"] == 2**62 and row["category_id"] == -7 and row["hist_item_ids"] == [5, -(2**63) + 2, 0, *edges]
    assert [row[c] for c in spec.counter_columns()] == [1, 2, 5, 6, 9, 10, 3, 4, 7, 8, 11, 12]
    table, _, rejected = decode_samples([body], spec)
    assert not rejected and table.num_rows == 1 and table.column("click_ts")[0].as_py() == 1_700_000_000_999
    assert list(row) == spec.schema().names  # the spec's fields, in its order


@pytest.mark.slow
def test_the_job_refuses_a_field_table_it_cannot_write(tmp_path):
    from py4j.protocol import Py4JJavaError
    from pyflink.java_gateway import get_gateway
    from pyflink.util.java_utils import add_jars_to_context_class_loader

    add_jars_to_context_class_loader(job_jars(replace(RunOptions.from_config(load_config()), checkpoint_dir=tmp_path)))
    props = FeatureSpec().job_properties()
    with pytest.raises(Py4JJavaError, match="sample field 'user_age' this job cannot produce"):
        get_gateway().jvm.streamrec.flink.SampleJson(1, props["sample_fields"] + ",user_age", props["counter_columns"], 2)
    with pytest.raises(Py4JJavaError, match="12 counter columns for 3 windows"):
        get_gateway().jvm.streamrec.flink.SampleJson(1, props["sample_fields"], props["counter_columns"], 3)
