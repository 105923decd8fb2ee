"""The model store on S3-compatible storage, against a real S3 API server (moto's, over HTTP).

Object stores cannot rename a directory, so versions are written in place with the
manifest last; this checks that publish, LATEST, loading, listing, a torn write and
retention all work there, through the same pyarrow.fs URI a deployment would use.
"""

from __future__ import annotations

import pytest
import torch

from streamrec.modelstore.store import CorruptVersion, ModelStore, SparseDelta
from tests.conftest import S3_BUCKET as BUCKET


def _uri(endpoint: str, prefix: str) -> str:
    return f"s3://{BUCKET}/{prefix}?endpoint_override={endpoint}&scheme=http&region=us-east-1"


def _publish(ms: ModelStore, n: int, kind: str) -> int:
    keys = torch.arange(n * 10, n * 10 + 20)
    return ms.publish(kind, {"t": SparseDelta(keys, torch.full((len(keys), 4), float(n)))}, {"t": 4},
                      dense={"w": torch.full((3,), float(n))}, meta={"trained_through_ms": n})


def test_publish_load_and_gc_on_s3(s3_endpoint):
    ms = ModelStore(_uri(s3_endpoint, "a"), "ctr")
    assert not ms.renames_dirs and ms.latest() is None
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
    torn = f"{ms.versions_dir}/{2:012d}"
    ms.fs.create_dir(f"{torn}/sparse", recursive=True)
    with ms.fs.open_output_stream(f"{torn}/sparse/t.arrow") as out:
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
    assert ms.compact(4) == len(want.tables["t"][0]) and ms.images() == [4]
    got = ms.load(4)
    assert got.chain == [4] and got.tables["t"][0].tolist() == want.tables["t"][0].tolist()
    torch.testing.assert_close(torch.from_numpy(got.tables["t"][1]), torch.from_numpy(want.tables["t"][1]))
    assert ms.gc(keep_fulls=1) == [1, 2, 3] and ms.load(4).chain == [4]
