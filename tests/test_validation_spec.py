"""The job's validator (the EventParser Java class its source readers run, driven by the spec
generated from contracts/events.py) agrees with the Python contract on every event kind the
generator can produce and on hand-made edge cases, run in PyFlink's JVM."""

from dataclasses import replace

import pyarrow.parquet as pq
import pytest

from streamrec.contracts import events as ev
from streamrec.pipelines.flink_runner import RunOptions, job_jars
from streamrec.contracts.validation_spec import reason_key, validation_spec
from streamrec.plumbing.config import load_config
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
    # a nested group's name is not an event type; a repeated field keeps its last value
    b'{"type": "context", "device": "ios", "local_hour": 3}', b'{"type": "item", "category_id": 1, "advertiser_id": 1}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": -1, "user_id": 1, "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "type": "impression", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r"}',
    b'{"type": "impression", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "position": 1,'
    b' "context": {"device": "ios", "local_hour": 99}, "item": {"category_id": 1, "advertiser_id": 1},'
    b' "context": {"device": "ios", "local_hour": 2}}',
    b'{"type": "impression", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "position": 1,'
    b' "context": {"device": "ios", "local_hour": 2}, "item": {"category_id": 1, "advertiser_id": 1}, "context": [1]}',
    b'{"type": "impression", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "position": 1,'
    b' "context": {"device": "ios", "local_hour": 2, "local_hour": null}, "item": {"category_id": 1, "advertiser_id": 1}}',
    # syntax errors inside fields nobody reads are still errors
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "x": [1, 2,, 3]}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "x": "\\q"}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "x": {"a": }}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r"} {}',
    b'{"type": "click", "event_id": "e\\u00e9", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "x": true}',
    # ids are int64: 2**63 - 1 fits, 2**63 (which orjson still parses as an int) and 2**64 do not
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 9223372036854775807, "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 9223372036854775808, "item_id": 1, "request_id": "r"}',
    b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 18446744073709551616, "request_id": "r"}',
    b'', b'null', b'\xff\xfe', b'{"type": "click", "event_id": "e", "ts": 5, "user_id": 1, "item_id": 1, "request_id": "r", "x": {}}',
]


def python_key(raw: bytes, arrival_ms: int) -> str | None:
    try:
        ev.validate_event(raw, now_ms=arrival_ms)
        return None
    except ev.InvalidEvent as exc:
        return reason_key(exc.reason)


@pytest.mark.slow
def test_job_and_python_validators_agree(tmp_path):
    from pyflink.java_gateway import get_gateway
    from pyflink.util.java_utils import add_jars_to_context_class_loader

    run = tmp_path / "run"
    assert run_cli("generate", "--out", str(run), "--duration", "2", "--rate", "1500", "--bad-fraction", "0.3",
                   "--start-ms", "1700000000000").returncode == 0
    table = pq.read_table(run / "events.parquet")
    rows = list(zip(table.column("value").to_pylist(), table.column("emit_ms").to_pylist()))
    rows += [(raw, 1000) for raw in EDGE_CASES]
    expected = [python_key(raw, arrival) for raw, arrival in rows]
    assert sum(e is not None for e in expected) > 200  # the bad events are really there

    add_jars_to_context_class_loader(job_jars(replace(RunOptions.from_config(load_config()), checkpoint_dir=tmp_path)))
    parser = get_gateway().jvm.streamrec.flink.EventParser(validation_spec(), ev.MAX_FUTURE_SKEW_MS)
    got = [parser.check(bytearray(raw), arrival) for raw, arrival in rows]
    mismatches = [(rows[n][0][:120], expected[n], got[n]) for n in range(len(rows)) if got[n] != expected[n]]
    assert not mismatches, mismatches[:10]
