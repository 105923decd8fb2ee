"""The served model: in-place deltas equal fresh loads, rollback is exact, corrupt versions
are refused, and every batch sees exactly one version while versions change under load."""

import threading

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import copy_store
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.modelstore.store import CorruptVersion, ModelStore
from streamrec.serving.runtime.state import IncompatibleVersion, ServedModel
from streamrec.model.batch import batch_from_table
from streamrec.model.inference import InferenceModel


@pytest.fixture(scope="module")
def published(published_model):
    return published_model


@pytest.fixture(scope="module")
def batch(sample_run):
    return batch_from_table(pq.read_table(sample_run / "samples.parquet").slice(50_000, 512), FeatureSpec(), 50)


def expected(root, version, batch):
    model = InferenceModel.load(ModelStore(str(root), "ctr"), version)
    try:
        return model.predict(batch)
    finally:
        model.close()


def test_deltas_applied_in_place_equal_a_fresh_load_and_rollback_is_exact(published, batch, tmp_path):
    shared, versions = published
    root = copy_store(shared, tmp_path / "models")  # pins are written into the store
    served = ServedModel(ModelStore(str(root), "ctr"), undo_depth=3)
    assert served.load(versions[0]).mode == "swap"
    scores = {versions[0]: served.predict(batch)[1]}
    for v in versions[1:]:
        report = served.load(v)
        assert report.mode == "delta" and report.version == v and report.rows > 0
        version, scores[v] = served.predict(batch)
        assert version == v
        np.testing.assert_array_equal(scores[v], expected(root, v, batch))
    assert len({s.tobytes() for s in scores.values()}) == len(versions)  # every version scores differently
    # rollback: the previous version exactly (undo data), then a named one; pinned until released
    assert served.rollback(by="test", reason="bad CTR").mode == "rollback"
    assert served.version == versions[-2] and served.pinned
    np.testing.assert_array_equal(served.predict(batch)[1], scores[versions[-2]])
    served.rollback(versions[-4])
    np.testing.assert_array_equal(served.predict(batch)[1], scores[versions[-4]])
    with pytest.raises(LookupError, match="no earlier version"):
        served.rollback()  # the undo records are used up
    assert served.catch_up() == []  # pinned: no automatic apply
    # older than the undo depth: loaded from the store; the pin is in the store, with who and why
    assert served.rollback(versions[0], by="test", reason="older").mode == "swap"
    np.testing.assert_array_equal(served.predict(batch)[1], scores[versions[0]])
    pin = ModelStore(str(root), "ctr").pinned()
    assert (pin.version, pin.by, pin.reason) == (versions[0], "test", "older")
    restarted = ServedModel(ModelStore(str(root), "ctr"))  # a node started later serves the pin, not LATEST
    assert [r.version for r in restarted.catch_up()] == [versions[0]] and restarted.pinned
    np.testing.assert_array_equal(restarted.predict(batch)[1], scores[versions[0]])
    served.release()
    assert ModelStore(str(root), "ctr").pinned() is None
    assert [r.version for r in served.catch_up()] == versions[1:]  # the deltas after the pinned full, in place
    np.testing.assert_array_equal(served.predict(batch)[1], scores[versions[-1]])
    assert [r.version for r in restarted.catch_up()][-1] == versions[-1] and not restarted.pinned  # released everywhere
    restarted.close()
    served.close()


def test_a_corrupt_delta_is_refused_and_the_served_version_stays(published, batch, tmp_path):
    root, versions = published
    copy = copy_store(root, tmp_path / "models")
    target = copy / "ctr" / "versions" / f"{versions[2]:012d}" / "sparse" / "item.arrow"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    served = ServedModel(ModelStore(str(copy), "ctr"))
    served.load(versions[0])
    served.load(versions[1])
    before = served.predict(batch)
    with pytest.raises(CorruptVersion, match="checksum"):
        served.load(versions[2])
    after = served.predict(batch)
    assert after[0] == before[0] == versions[1]
    np.testing.assert_array_equal(after[1], before[1])
    # the watcher's path never raises: the bad version and those built on it are refused, logged, skipped
    assert served.catch_up() == [] and served.version == versions[1]
    assert "checksum" in served.refused[versions[2]] and versions[-1] in served.refused
    served.close()


def test_every_batch_sees_exactly_one_version_while_versions_change(published, batch, tmp_path):
    versions = published[1]
    root = copy_store(published[0], tmp_path / "models")  # rollbacks pin the store
    truth = {v: expected(root, v, batch) for v in versions}
    served = ServedModel(ModelStore(str(root), "ctr"), undo_depth=len(versions))
    served.load(versions[0])
    seen, errors, stop = [], [], threading.Event()

    def predict_forever():
        while not stop.is_set():
            try:
                version, scores = served.predict(batch)
                if not np.array_equal(scores, truth[version]):
                    errors.append(version)
                seen.append(version)
            except Exception as exc:  # any failure is a test failure
                errors.append(repr(exc))

    threads = [threading.Thread(target=predict_forever) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(3):
        for v in versions[1:]:
            served.load(v)
        served.rollback(versions[0])
        served.release()
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert len(set(seen)) >= 3 and len(seen) > 20
    served.close()


def test_a_version_of_another_feature_spec_is_refused_with_the_difference(published):
    root, versions = published
    other = FeatureSpec(windows_s=(60, 600, 3600))
    served = ServedModel(ModelStore(str(root), "ctr"), feature_spec=other)
    assert served.catch_up() == [] and served.version is None
    assert "windows_s (60, 600) vs (60, 600, 3600)" in served.refused[versions[-1]]
    with pytest.raises(IncompatibleVersion, match=r"trained with another feature spec than this node serves \(\[features\]: windows_s"):
        served.load(versions[0])
    same = ServedModel(ModelStore(str(root), "ctr"), feature_spec=FeatureSpec())
    assert same.catch_up()[-1].version == versions[-1] and not same.refused
    same.close()


def test_a_version_with_an_unreadable_feature_spec_is_refused_not_fatal(published, tmp_path):
    import json

    root, versions = published
    copy = copy_store(root, tmp_path / "models")
    manifest_path = copy / "ctr" / "versions" / f"{versions[-1]:012d}" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["feature_spec"] = {"history_len": "fifty", "windows_s": [60, 600], "attribution_window_s": 10}
    manifest_path.write_text(json.dumps(manifest))
    checked = ServedModel(ModelStore(str(copy), "ctr"), feature_spec=FeatureSpec())
    checked.catch_up()  # a first load: LATEST is refused, the newest version that loads is served instead
    assert checked.version == versions[-2] and "unreadable 'feature_spec'" in checked.refused[versions[-1]]
    checked.load(versions[0])
    checked.catch_up()  # the deltas up to the bad one apply; the bad one stays refused
    assert checked.version == versions[-2] and list(checked.refused) == [versions[-1]]
    unchecked = ServedModel(ModelStore(str(copy), "ctr"))  # the first version's spec becomes the node's
    with pytest.raises(CorruptVersion, match=f"version {versions[-1]} of ctr has an unreadable 'feature_spec'"):
        unchecked.load(versions[-1])
    checked.close()
    unchecked.close()


def test_a_garbage_latest_is_logged_once_not_at_every_poll_and_its_end_too(published, tmp_path, caplog):
    shared, versions = published
    root = copy_store(shared, tmp_path / "models")
    served = ServedModel(ModelStore(str(root), "ctr"))
    (root / "ctr" / "LATEST").write_text("garbage\n")
    with caplog.at_level("INFO", logger="streamrec"):
        for _ in range(3):  # three polls of the watcher
            served.catch_up()
        assert served.version == versions[-1]  # the newest version, LATEST aside
        assert len([r for r in caplog.records if r.levelname == "ERROR" and "garbage" in r.getMessage()]) == 1
        (root / "ctr" / "LATEST").write_text(f"{versions[-1]}\n")
        served.catch_up()
        served.catch_up()
    assert served.latest_problem is None
    assert [r.getMessage() for r in caplog.records].count("the store's LATEST and PIN are sound again") == 1
