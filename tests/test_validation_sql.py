"""The job's validator (the ParseEvent Java function driven by the spec generated from
pipelines/events.py) agrees with the Python contract on every event kind the generator can
produce and on hand-made edge cases, run on a real PyFlink mini-cluster."""

import pyarrow.parquet as pq
import pytest

from pipelines import events as ev
from pipelines.udf_jar import ensure_udf_jar
from pipelines.validation_sql import parse_call, reason_key
from streamrec.config import load_config
from tests.conftest import run_cli

EDGE_CASES = [
    b"not json", b"[1, 2]", b'"just a string"', b'{"type": "view"}', b'{"type": 5}', b'{"type": ["click"]}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": true, "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": "42", "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 1.5, "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": [1], "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": null, "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": "", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": 7, "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 0, "request_id": "r"}',
    b'{"type": "click", "event_id": "e", "ts": -5, "user_id": 1, "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": "e", "ts": 99999999999999, "user_id": 1, "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r"}',
    b'{"type": "impression", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "position": 1,'
    b' "context": {"device": "ios", "local_hour": 24}, "item": {"category_id": 1, "advertiser_id": 1}}',
    b'{"type": "impression", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "position": 1,'
    b' "context": {"device": "ios", "local_hour": 2}, "item": {"category_id": "x", "advertiser_id": 1}}',
    b'{"type": "impression", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "position": 1,'
    b' "context": "ios", "item": {"category_id": 1, "advertiser_id": 1}}',
    b'{"type": "impression", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "position": 0,'
    b' "context": {"device": "ios", "local_hour": 2}, "item": {"category_id": 1, "advertiser_id": 1}}',
    b'{"type": "impression", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "position": 1,'
    b' "context": {"device": "ios", "local_hour": 2}, "item": {"category_id": 1, "advertiser_id": 1}}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r"} trailing',
    b'{"type": "click", "event_id": "e", "ts": 5.0, "user_id": 1, "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": "e", "ts": NaN, "user_id": 1, "item_id": 1, "request_id": "r"}',
    b'', b'null', b'\xff\xfe', b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "x": {}}',
]


def python_key(raw: bytes, arrival_ms: int) -> str | None:
    try:
        ev.validate_event(raw, now_ms=arrival_ms)
        return None
    except ev.InvalidEvent as exc:
        return reason_key(exc.reason)


@pytest.mark.slow
def test_sql_and_python_validators_agree(tmp_path):
    from pyflink.table import DataTypes, EnvironmentSettings, TableEnvironment

    run = tmp_path / "run"
    assert run_cli("generate", "--out", str(run), "--duration", "2", "--rate", "1500", "--bad-fraction", "0.3",
                   "--start-ms", "1700000000000").returncode == 0
    table = pq.read_table(run / "events.parquet")
    rows = list(zip(table.column("value").to_pylist(), table.column("emit_ms").to_pylist()))
    rows += [(raw, 1000) for raw in EDGE_CASES]
    expected = [python_key(raw, arrival) for raw, arrival in rows]
    assert sum(e is not None for e in expected) > 200  # the bad events are really there

    env = TableEnvironment.create(EnvironmentSettings.in_batch_mode())
    env.get_config().set("parallelism.default", "1")
    env.get_config().set("pipeline.jars", ensure_udf_jar(load_config().flink.resolved_jars_dir()).as_uri())
    env.execute_sql("CREATE TEMPORARY SYSTEM FUNCTION ParseEvent AS 'streamrec.flink.ParseEvent' LANGUAGE JAVA")
    schema = DataTypes.ROW([DataTypes.FIELD("n", DataTypes.BIGINT()), DataTypes.FIELD("payload", DataTypes.BYTES()),
                            DataTypes.FIELD("arrival_ms", DataTypes.BIGINT())])
    source = env.from_elements([(i, bytearray(raw), arrival) for i, (raw, arrival) in enumerate(rows)], schema)
    env.create_temporary_view("raw_events", source)
    result = env.execute_sql(f"SELECT n, {parse_call()}.reason AS reason FROM raw_events")
    with result.collect() as it:
        got = {row[0]: row[1] for row in it}
    mismatches = [(rows[n][0][:120], expected[n], got[n]) for n in range(len(rows)) if got[n] != expected[n]]
    assert not mismatches, mismatches[:10]
