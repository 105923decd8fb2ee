"""A feature snapshot is checked whole before any of it is used: a damaged copy, one bit or
more, is refused naming the file, and the node goes on as if it had none (empty, replaying
the topic), never serving damaged counters as fresh."""

import logging
import random
import time
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.serving.features.feature_snapshot import CorruptSnapshot, read_snapshot
from streamrec.serving.features.online_features import OnlineFeatures


def record(key: str, value) -> SimpleNamespace:
    return SimpleNamespace(key=key.encode(), value=orjson.dumps(value), partition=0, offset=0)


def _features(tmp_path: Path, name: str, **kwargs) -> OnlineFeatures:
    return OnlineFeatures("unused:0", "t", FeatureSpec(), 64, tmp_path / f"spill-{name}", **kwargs)


def _snapshot(tmp_path: Path) -> Path:
    """A real snapshot of a few entities of each kind, with watermarks and a history."""
    store = _features(tmp_path, "source")
    records = [record(f"w/{stage}/0/0", {"wm": 5_000 + k, "n": 1}) for k, stage in enumerate(("user", "item", "category"))]
    for k in range(1, 7):
        kind = ("user", "item", "category")[k % 3]
        records.append(record(f"c/{kind}/{k}/0", {"i": [1_000 + k, 2_000 + k], "c": [2_000 + k]}))
    records.append(record("h/user/3", {"h": [[9, 4, 1_003], [8, 3, 900]]}))
    store._apply_records(records)
    store.partitions, store._positions = 1, {0: len(records)}
    path = tmp_path / "features.arrow"
    store.save_snapshot(path, chunk=2)
    store.close()
    return path


def _flips(size: int) -> list[tuple[int, int]]:
    """(byte, bit) to flip: every bit of a fixed sample of the file's bytes and of its last 64."""
    positions = set(random.Random(55).sample(range(size), min(size, 300))) | set(range(max(0, size - 64), size))
    return [(at, bit) for at in sorted(positions) for bit in range(8)]


def test_every_single_bit_flip_of_a_snapshot_is_refused_naming_the_file(tmp_path):
    good = _snapshot(tmp_path)
    data = good.read_bytes()
    target = _features(tmp_path, "target")
    target.load_snapshot(good)  # the undamaged file loads
    assert target.started_from_snapshot and target.store.keys()
    target = _features(tmp_path, "damaged")
    loaded = []
    for at, bit in _flips(len(data)):
        copy = bytearray(data)
        copy[at] ^= 1 << bit
        damaged = tmp_path / f"damaged-{at}-{bit}.arrow"  # a file of its own: none is rewritten while mapped
        damaged.write_bytes(bytes(copy))
        try:
            target.load_snapshot(damaged)
            loaded.append((at, bit))
            target._forget()
            target.started_from_snapshot = False
        except CorruptSnapshot as exc:
            assert str(damaged) in str(exc), exc
        assert target.store.keys() == [] and target._positions == {} and target.as_of() is None
    assert not loaded, f"{len(loaded)} damaged copies loaded, e.g. bit flips at {loaded[:5]}"
    assert not target.started_from_snapshot


def test_a_snapshot_without_a_checksum_is_refused_saying_what_to_do(tmp_path):
    """A file of the format without a checksum (only the Arrow file): refused, not trusted."""
    from streamrec.serving.features.feature_snapshot import TRAILER

    good = _snapshot(tmp_path)
    old = tmp_path / "old.arrow"
    old.write_bytes(good.read_bytes()[:-TRAILER])
    with pytest.raises(CorruptSnapshot, match="no checksum.*older version") as refused:
        read_snapshot(old)
    assert str(old) in str(refused.value) and "rebuilds" in str(refused.value)


def test_a_node_given_a_damaged_snapshot_starts_empty_and_says_so(tmp_path, caplog):
    """Started with a damaged snapshot and no broker: empty, not ready by ids, the refusal in
    its log and status; the features served are cold-start, not the damaged counters."""
    good = _snapshot(tmp_path)
    data = bytearray(good.read_bytes())
    data[len(data) // 3] ^= 0x10
    good.write_bytes(bytes(data))
    node = _features(tmp_path, "node", connect_timeout_s=0.5, snapshot=good)
    with caplog.at_level(logging.WARNING, logger="streamrec.serving.features"):
        node.start()
        deadline = time.monotonic() + 30
        while node.error is None and time.monotonic() < deadline:
            node._stop.wait(0.1)
        assert node.error is not None, "the broker-less node never tried to connect"
        status = node.status()
        assert not node.started_from_snapshot and not node.serves_by_ids() and not status["ready"]
        assert status["in_memory"] == 0 and status["features_as_of"] is None and status["started_from_snapshot_as_of"] is None
        assert str(good) in (status["snapshot_refused"] or "")
        node._stop.set()
        node._thread.join(10)
    assert any(str(good) in r.getMessage() and "replaying" in r.getMessage() for r in caplog.records)


def test_a_failed_write_leaves_the_previous_snapshot_whole(tmp_path):
    """Atomic: a write that fails halfway leaves the last good snapshot readable and no temporary."""
    good = _snapshot(tmp_path)
    before = good.read_bytes()
    store = _features(tmp_path, "writer")
    store._apply_records([record(f"c/user/{k}/0", {"i": [1], "c": []}) for k in range(1, 50)])
    store.partitions = 1

    def failing_export(*args, **kwargs):
        raise OSError("disk full")

    store.store.export = failing_export
    with pytest.raises(OSError, match="disk full"):
        store.save_snapshot(good, chunk=10)
    assert good.read_bytes() == before and read_snapshot(good)[0].topic == "t"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".features.arrow.")]
