"""The model store on S3-compatible storage, against a real S3 API server (moto's, over HTTP).

Object stores cannot rename a directory, so versions are written in place with the
manifest last; this checks that publish, LATEST, loading, listing, a torn write and
retention all work there, through the same pyarrow.fs URI a deployment would use, and that
what serving and the trainer build on the store (the version watcher, pins, the writer
lease) works there too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.model.batch import TABLES, dense_feature_names
from streamrec.model.network import CTRModel, ModelSpec
from streamrec.modelstore.lease import LeaseHeld, LeaseLost, WriterLease
from streamrec.contracts.delta import SparseDelta
from streamrec.modelstore.store import CorruptVersion, ModelStore
from streamrec.modelstore.writer import VersionWriter
from streamrec.serving.runtime.state import ServedModel
from streamrec.serving.runtime.watcher import VersionWatcher
from tests.conftest import S3_BUCKET as BUCKET


def _uri(endpoint: str, prefix: str) -> str:
    return f"s3://{BUCKET}/{prefix}?endpoint_override={endpoint}&scheme=http&region=us-east-1"


def _publish(ms: ModelStore, n: int, kind: str) -> int:
    keys = torch.arange(n * 10, n * 10 + 20)
    return VersionWriter(ms).publish(kind, {"t": SparseDelta(keys, torch.full((len(keys), 4), float(n)))}, {"t": 4},
                                     dense={"w": torch.full((3,), float(n))}, meta={"trained_through_ms": n})


def test_publish_load_and_gc_on_s3(s3_endpoint):
    ms = ModelStore(_uri(s3_endpoint, "a"), "ctr")
    assert not ms.files.renames_dirs and ms.latest() is None
    for n in range(1, 7):
        version = _publish(ms, n, "full" if n in (1, 4) else "delta")
        assert ms.latest() == version == n
    loaded = ms.load()
    assert loaded.chain == [4, 5, 6] and loaded.manifest["trained_through_ms"] == 6
    keys, values = loaded.tables["t"]
    # full 4 holds keys 40..59, deltas 5 and 6 add 50..69 and 60..79: last write wins
    rows = dict(zip(keys.tolist(), values[:, 0].tolist()))
    assert rows[40] == 4.0 and rows[55] == 5.0 and rows[65] == 6.0 and len(rows) == 40
    torch.testing.assert_close(loaded.dense["w"], torch.full((3,), 6.0))
    assert ms.gc(keep_fulls=1) == [1, 2, 3] and ms.versions() == [4, 5, 6] and ms.load().version == 6


def test_a_torn_version_on_s3_is_never_listed_or_loaded(s3_endpoint):
    ms = ModelStore(_uri(s3_endpoint, "b"), "ctr")
    _publish(ms, 1, "full")
    # a writer that died before its manifest: files in place, no manifest, LATEST unmoved
    torn = ms.files.version_dir(2)
    ms.files.fs.create_dir(f"{torn}/sparse", recursive=True)
    with ms.files.fs.open_output_stream(f"{torn}/sparse/t.arrow") as out:
        out.write(b"half a file")
    assert ms.versions() == [1] and ms.latest() == 1 and ms.load().version == 1
    with pytest.raises(CorruptVersion, match="no manifest"):
        ms.load(2)
    assert _publish(ms, 2, "delta") == 2 and ms.load().chain == [1, 2]  # the next writer reuses the number


def test_compaction_on_s3_writes_the_image_in_place_manifest_last(s3_endpoint):
    ms = ModelStore(_uri(s3_endpoint, "c"), "ctr")
    for n in range(1, 5):
        _publish(ms, n, "full" if n == 1 else "delta")
    want = ms.load(4)
    assert VersionWriter(ms).compact(4) == len(want.tables["t"][0]) and ms.images() == [4]
    got = ms.load(4)
    assert got.chain == [4] and got.tables["t"][0].tolist() == want.tables["t"][0].tolist()
    torch.testing.assert_close(torch.from_numpy(got.tables["t"][1]), torch.from_numpy(want.tables["t"][1]))
    assert ms.gc(keep_fulls=1) == [1, 2, 3] and ms.load(4).chain == [4]


FEATURES = FeatureSpec()
MODEL = ModelSpec(embedding_dim=4, history_len=FEATURES.history_len, n_dense=len(dense_feature_names(FEATURES)),
                  attention_hidden=4, cross_layers=1, mlp=(8,))


def _publish_model(writer: VersionWriter, kind: str) -> int:
    """A version serving can load (a small random model with its specs), as the trainer writes one."""
    tables = {name: SparseDelta(torch.arange(1, 21), torch.randn(20, MODEL.embedding_dim)) for name in TABLES}
    return writer.publish(kind, tables, {name: MODEL.embedding_dim for name in TABLES}, CTRModel(MODEL).state_dict(),
                          {"model_spec": MODEL.to_json(), "feature_spec": FEATURES.to_json()})


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_watcher_pin_and_writer_lease_on_s3(s3_endpoint: str, tmp_path: Path):
    """A serving node's watcher applies a new version as a delta, follows a pin written by
    another client of the store (`store pin`, another node's :rollback) and its release; a
    second writer is refused while the first's lease is live, and a writer whose lease was
    taken over fails its check and commits nothing more. Each client has its own connection."""
    uri = _uri(s3_endpoint, "d")
    store = ModelStore(uri, "ctr")
    lease = WriterLease(store, str(tmp_path / "work-a"), ttl_s=30).acquire()
    writer = VersionWriter(store, lease)
    with pytest.raises(LeaseHeld, match="being written by another trainer .*work-a"):
        WriterLease(ModelStore(uri, "ctr"), str(tmp_path / "work-b"), ttl_s=30).acquire()
    first = _publish_model(writer, "full")
    served = ServedModel(ModelStore(uri, "ctr"), feature_spec=FEATURES)
    watcher = VersionWatcher(served, poll_interval_s=0.2).start()
    try:
        _wait(lambda: served.version == first, "the node to load the first version")
        second = _publish_model(writer, "delta")
        _wait(lambda: served.version == second, "the node to apply the delta")
        assert served.recent_applies[-1].mode == "delta"
        ModelStore(uri, "ctr").pin(first, by="test", reason="rollback on s3")
        # the watcher's thread applies the pinned version, then records the pin
        _wait(lambda: served.version == first and served.pin is not None, "the node to follow the pin")
        assert served.pin.reason == "rollback on s3"
        third = _publish_model(writer, "delta")
        assert served.catch_up() == [] and served.version == first  # pinned: LATEST is not followed
        ModelStore(uri, "ctr").unpin()
        _wait(lambda: served.version == third and not served.pinned, "the node to follow LATEST again")
    finally:
        watcher.stop()
        served.close()
    # a restart in the same work dir takes the lease over at once: the old holder is fenced
    successor = WriterLease(ModelStore(uri, "ctr"), str(tmp_path / "work-a"), ttl_s=30).acquire()
    assert successor.record.token == lease.record.token + 1
    with pytest.raises(LeaseLost, match="taken over"):
        lease.check()
    with pytest.raises(LeaseLost):
        _publish_model(writer, "delta")
    assert ModelStore(uri, "ctr").latest() == third
    successor.release()
    lease.release()
