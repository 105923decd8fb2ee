"""What keeps a model store safe to operate: a garbage or dangling LATEST and non-finite
values never reach a served model, one trainer writes a store at a time (a lease with a
fencing token), a resumed trainer makes the store equal its state, a trainer that cannot
publish fails loudly, pins keep their chains through garbage collection, and
`streamrec store ls|verify|pin|unpin` shows and changes all of it."""

import logging
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO, copy_store
from streamrec.model.batch import batch_from_table
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.delta import SparseDelta
from streamrec.modelstore.store import CorruptVersion, ModelStore
from streamrec.modelstore.writer import VersionWriter
from streamrec.modelstore.lease import LeaseHeld, LeaseLost, WriterLease
from streamrec.serving.runtime.state import ServedModel
from streamrec.plumbing.config import load_config
from streamrec.trainer.driver import Trainer, TrainOptions


def cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "streamrec.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def tiny_store(root, versions=3) -> ModelStore:
    """A full version and deltas of one 4-wide table and one dense tensor."""
    store = ModelStore(str(root), "ctr")
    writer = VersionWriter(store)
    keys = torch.arange(10)
    for n in range(versions):
        writer.publish("full" if n == 0 else "delta", {"t": SparseDelta(keys[: 10 - 3 * n], torch.full((10 - 3 * n, 4), float(n)))},
                       {"t": 4}, {"w": torch.full((3,), float(n))})
    return store


@pytest.fixture
def store_copy(published_model, tmp_path):
    root, versions = published_model
    shutil.copytree(root, tmp_path / "models")
    return tmp_path / "models", versions


@pytest.fixture(scope="module")
def batch(sample_run):
    return batch_from_table(pq.read_table(sample_run / "samples.parquet").slice(50_000, 256), FeatureSpec(), 50)


# ---------------------------------------------------------------- LATEST and values
@pytest.mark.parametrize("latest", ["abc", "999999\n"])
def test_a_garbage_or_dangling_latest_falls_back_to_the_newest_version(store_copy, latest):
    root, versions = store_copy
    (root / "ctr" / "LATEST").write_text(latest)
    served = ServedModel(ModelStore(str(root), "ctr"))
    served.catch_up()  # a fresh node: never raises, never stays empty
    assert served.version == versions[-1]
    assert ("'abc'" if latest == "abc" else "999999, which does not exist") in served.latest_problem
    served.close()


def test_a_fresh_node_whose_latest_is_corrupt_serves_the_newest_version_that_verifies(store_copy, batch):
    root, versions = store_copy
    target = root / "ctr" / "versions" / f"{versions[-1]:012d}" / "dense.arrow"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    served = ServedModel(ModelStore(str(root), "ctr"))
    served.catch_up()
    assert served.version == versions[-2] and "checksum" in served.refused[versions[-1]]
    assert served.predict(batch)[0] == versions[-2]
    served.close()


@pytest.mark.parametrize("where", ["dense", "sparse"])
def test_a_version_with_valid_checksums_but_non_finite_values_is_refused(store_copy, batch, where):
    root, versions = store_copy
    store = ModelStore(str(root), "ctr")
    manifest, sparse, dense = store.read_version(versions[-1])
    name = sorted(dense)[0]
    poisoned = {name: torch.full_like(dense[name], float("nan"))} if where == "dense" else {}
    table = sorted(manifest["tables"])[0]
    dim = manifest["tables"][table]["dim"]
    rows = {table: SparseDelta(torch.tensor([1, 2]), torch.tensor([[float("inf")] * dim, [0.0] * dim]))} if where == "sparse" else {}
    meta = {k: manifest[k] for k in ("feature_spec", "model_spec") if k in manifest}
    bad = VersionWriter(store).publish("delta", rows, {table: dim}, poisoned, meta)
    with pytest.raises(CorruptVersion, match="non-finite"):
        store.read_version(bad)
    served = ServedModel(store)
    served.load(versions[-1])
    before = served.predict(batch)
    assert served.catch_up() == [] and "non-finite" in served.refused[bad]
    after = served.predict(batch)
    assert after[0] == versions[-1] and np.isfinite(after[1]).all()
    np.testing.assert_array_equal(after[1], before[1])
    served.close()


# ---------------------------------------------------------------- writer lease
def test_one_writer_per_store_and_a_fenced_writer_cannot_move_latest(tmp_path):
    root = tmp_path / "models"
    first_store = tiny_store(root, 1)
    first = WriterLease(first_store, str(tmp_path / "work-a"), ttl_s=30).acquire()
    first_writer = VersionWriter(first_store, first)
    with pytest.raises(LeaseHeld, match="being written by another trainer .*work-a"):
        WriterLease(ModelStore(str(root), "ctr"), str(tmp_path / "work-b"), ttl_s=30).acquire()
    # the same work dir (a restart after a crash: its lock file proves the old process is gone) takes over at once
    second_store = ModelStore(str(root), "ctr")
    second = WriterLease(second_store, str(tmp_path / "work-a"), ttl_s=30).acquire()
    second_writer = VersionWriter(second_store, second)
    assert second.record.token == first.record.token + 1
    with pytest.raises(LeaseLost, match="taken over"):
        first_writer.publish("delta", {"t": SparseDelta(torch.tensor([1]), torch.ones(1, 4))}, {"t": 4})
    assert first_store.latest() == 1  # the fenced writer moved nothing
    assert second_writer.publish("delta", {"t": SparseDelta(torch.tensor([1]), torch.ones(1, 4))}, {"t": 4}) == 2
    second.release()  # released: another writer need not wait for expiry
    with pytest.raises(LeaseLost, match="holds no lease"):  # nor does this one commit any more
        second_writer.publish("delta", {"t": SparseDelta(torch.tensor([1]), torch.ones(1, 4))}, {"t": 4})
    third = WriterLease(ModelStore(str(root), "ctr"), str(tmp_path / "work-c"), ttl_s=0.3).acquire()
    third._stop.set()  # stop renewing: the lease expires as a hung or dead writer's would
    time.sleep(0.5)
    fourth = WriterLease(ModelStore(str(root), "ctr"), str(tmp_path / "work-d"), ttl_s=30).acquire()
    with pytest.raises(LeaseLost):
        third.check()
    fourth.release()
    first.release()  # a fenced writer's release changes nothing
    assert len(list((root / "ctr" / "leases").glob("*.json"))) <= 3


def _trainer_config(tmp_path, store_root, work="work", **extra):
    return load_config(overrides={"trainer.model_store": str(store_root), "trainer.work_dir": str(tmp_path / work),
                                  "trainer.publish_interval_s": 0.5, "trainer.warmup_samples": 10**9, "trainer.device": "cpu",
                                  "trainer.progress_interval_s": 3600.0, "trainer.checkpoint_interval_s": 0.0, **extra}, environ={})


def test_a_second_trainer_on_a_leased_store_is_refused(sample_run, tmp_path):
    store = tiny_store(tmp_path / "models", 1)
    lease = WriterLease(store, str(tmp_path / "elsewhere"), ttl_s=60).acquire()
    try:
        result = cli("train", "--samples", str(sample_run), "--model-store", str(tmp_path / "models"), "--work-dir",
                     str(tmp_path / "work"), "--max-samples", "2000", "--device", "cpu", "--no-announce", "--no-frozen")
    finally:
        lease.release()
    assert result.returncode == 3, result.stderr[-2000:]
    assert "being written by another trainer" in result.stderr and "elsewhere" in result.stderr
    assert store.versions() == [1]


def test_a_trainer_that_cannot_reach_its_store_fails_at_start(sample_run, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the model store's directory should be")
    result = cli("train", "--samples", str(sample_run), "--model-store", str(blocker / "models"), "--work-dir",
                 str(tmp_path / "work"), "--max-samples", "3000", "--device", "cpu", "--no-announce", "--no-frozen")
    assert result.returncode == 3, result.stderr[-2000:]
    assert "cannot take the writer lease" in result.stderr and "Traceback" not in result.stderr


def test_a_trainer_whose_publishes_keep_failing_stops_with_an_error(sample_run, tmp_path):
    from streamrec.trainer.driver import TrainingError

    cfg = _trainer_config(tmp_path, tmp_path / "models", **{"trainer.publish_interval_s": 0.05, "trainer.max_publish_failures": 2})
    trainer = Trainer(cfg, TrainOptions(files=[str(sample_run)], max_samples=60000, progress=False))
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    trainer.session.model_store.files.versions_dir = str(blocker / "versions")  # the store's disk fails under the running trainer
    # the counter ends the run (max_publish_failures = 2), not the shutdown's last publish, which
    # also fails: a counter that never reaches its limit would end the run the other way
    with pytest.raises(TrainingError, match="2 publishes in a row failed.*a trainer that cannot publish"):
        trainer.run()
    assert ModelStore(str(tmp_path / "models"), "ctr").versions() == []


def test_a_resumed_trainer_makes_the_store_equal_its_state_with_its_first_publish(sample_run, tmp_path, caplog):
    """Versions published after the checkpoint (by a run that then crashed) are not the
    resumed trainer's state: its first version is a full one, not a delta on top of them."""
    store_root = tmp_path / "models"
    cfg = _trainer_config(tmp_path, store_root)
    Trainer(cfg, TrainOptions(files=[str(sample_run)], max_samples=4000, progress=False)).run()
    store = ModelStore(str(store_root), "ctr")
    checkpointed = store.latest()
    manifest, sparse, _ = store.read_version(checkpointed)
    table = sorted(manifest["tables"])[0]
    dim = manifest["tables"][table]["dim"]
    keys = torch.from_numpy(sparse[table]["key"].to_numpy()[:50].copy())
    meta = {k: manifest[k] for k in ("feature_spec", "model_spec") if k in manifest}
    rogue = VersionWriter(store).publish("delta", {table: SparseDelta(keys, torch.full((len(keys), dim), 7.0))}, {table: dim},
                                         meta=meta)  # the crashed run's
    caplog.set_level(logging.INFO)
    summary = Trainer(cfg, TrainOptions(files=[str(sample_run)], max_samples=4000, progress=False)).run()
    first = summary["published"][0]
    assert first["kind"] == "full" and first["version"] > rogue
    assert "publishing failed" not in caplog.text  # decided at start, not learnt from a refused delta
    loaded = store.load()
    assert rogue not in loaded.chain
    values = dict(zip(loaded.tables[table][0].tolist(), loaded.tables[table][1]))
    assert set(keys.tolist()) <= values.keys()  # the rogue's rows are there, with the resumed trainer's values
    assert all(not np.all(values[k] == 7.0) for k in keys.tolist())


def test_a_garbage_latest_is_repaired_by_the_trainers_next_version(sample_run, tmp_path):
    store_root = tmp_path / "models"
    cfg = _trainer_config(tmp_path, store_root)
    Trainer(cfg, TrainOptions(files=[str(sample_run)], max_samples=3000, progress=False)).run()
    (store_root / "ctr" / "LATEST").write_text("garbage")
    summary = Trainer(cfg, TrainOptions(files=[str(sample_run)], max_samples=3000, progress=False)).run()
    store = ModelStore(str(store_root), "ctr")
    assert store.latest() == summary["published"][-1]["version"] == store.versions()[-1]
    assert store.load().version == store.latest()


# ---------------------------------------------------------------- pins, gc, CLI
def test_gc_keeps_the_pinned_version_and_the_chain_it_needs(tmp_path):
    store = tiny_store(tmp_path / "models", 3)  # 1 full, 2, 3 deltas
    store.pin(2, "test", "keep me")
    keys = torch.arange(4)
    for _ in range(2):
        VersionWriter(store).publish("full", {"t": SparseDelta(keys, torch.ones(4, 4))}, {"t": 4})
    store.gc(keep_fulls=1)
    assert store.versions() == [1, 2, 5]  # 3 and 4 go; 1 and 2 stay for the pin
    store.unpin()
    store.gc(keep_fulls=1)
    assert store.versions() == [5]


def test_store_cli_lists_verifies_pins_and_unpins(tmp_path):
    root = tmp_path / "models"
    tiny_store(root, 3)
    listed = cli("store", "ls", "--model-store", str(root))
    assert listed.returncode == 0 and "LATEST" in listed.stdout and "delta" in listed.stdout, listed.stderr
    assert cli("store", "verify", "--model-store", str(root)).returncode == 0
    target = root / "ctr" / "versions" / f"{2:012d}" / "sparse" / "t.arrow"
    target.write_bytes(target.read_bytes()[:-8])
    verified = cli("store", "verify", "--model-store", str(root))
    assert verified.returncode == 1
    assert "2: version 2: sparse/t.arrow fails its checksum" in verified.stdout and "3: needs version 2" in verified.stdout
    pinned = cli("store", "pin", "1", "--reason", "CTR dropped", "--model-store", str(root))
    assert pinned.returncode == 0, pinned.stderr
    assert ModelStore(str(root), "ctr").pinned().reason == "CTR dropped"
    assert "pinned to 1" in cli("store", "ls", "--model-store", str(root)).stdout
    missing = cli("store", "pin", "42", "--model-store", str(root))
    assert missing.returncode == 2 and "version 42 of ctr has no manifest" in missing.stderr
    assert cli("store", "unpin", "--model-store", str(root)).returncode == 0
    assert ModelStore(str(root), "ctr").pinned() is None


# ---------------------------------------------------------------- serving nodes over HTTP
TOKEN = "store-safety-token"


def start_node(store_root, port):
    return subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(store_root), "--port", str(port), "--device", "cpu",
         "--poll-interval", "0.2", "--compile", "eager"],
        cwd=REPO, env={**os.environ, "STREAMREC_SERVING__ADMIN_TOKEN": TOKEN, "STREAMREC_SERVING__FEATURE_STORE": "false",
                       "STREAMREC_SERVING__FOLLOW_UPDATES": "false"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def http(base, method, path, body=None, token=None):
    import urllib.error
    import urllib.request

    import orjson

    request = urllib.request.Request(base + path, data=orjson.dumps(body) if body is not None else None, method=method,
                                     headers={"content-type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, orjson.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())


def wait_until(check, what, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_rollback_pins_every_node_survives_a_kill_and_reload_releases_it(store_copy):
    from conftest import free_port

    root, versions = store_copy
    ports = [free_port(), free_port()]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    nodes = [start_node(root, p) for p in ports]
    try:
        for base, node in zip(bases, nodes):
            wait_until(lambda: node.poll() is None and http(base, "GET", "/readyz")[0] == 200, f"{base} ready")
            assert http(base, "GET", "/v1/models/ctr")[1]["model_version"] == versions[-1]
        status, answer = http(bases[0], "POST", "/v1/models/ctr:rollback", {"version": versions[1], "reason": "CTR dropped"}, TOKEN)
        assert status == 200 and answer["model_version"] == versions[1] and answer["pinned"], answer
        # the other node follows the pin from the store
        wait_until(lambda: http(bases[1], "GET", "/v1/models/ctr")[1]["model_version"] == versions[1], "node 2 to follow the pin", 30)
        nodes[0].kill()  # kill -9, then a restart: the pin, not LATEST, is what it serves
        nodes[0].wait()
        nodes[0] = start_node(root, ports[0])
        wait_until(lambda: http(bases[0], "GET", "/readyz")[0] == 200, "the restarted node")
        status = http(bases[0], "GET", "/v1/models/ctr")[1]
        assert status["model_version"] == versions[1] and status["pinned"]
        assert status["pin"]["reason"] == "CTR dropped" and ":rollback on" in status["pin"]["by"]
        assert status["latest_in_store"] == versions[-1] and status["latest_ahead_by"] == versions[-1] - versions[1]
        # :reload on any node releases the pin for all
        status, answer = http(bases[1], "POST", "/v1/models/ctr:reload", {}, TOKEN)
        assert status == 200 and answer["model_version"] == versions[-1] and not answer["pinned"]
        wait_until(lambda: http(bases[0], "GET", "/v1/models/ctr")[1]["model_version"] == versions[-1], "node 1 released", 30)
        # a garbage LATEST: every route still answers, the status says why; a restarted node starts and serves
        (root / "ctr" / "LATEST").write_text("abc")
        wait_until(lambda: http(bases[0], "GET", "/v1/models/ctr")[1]["latest_problem"] is not None, "the problem reported", 30)
        nodes[1].terminate()
        nodes[1].wait(timeout=30)
        nodes[1] = start_node(root, ports[1])
        wait_until(lambda: nodes[1].poll() is None and http(bases[1], "GET", "/readyz")[0] == 200, "a node started on garbage LATEST")
        status = http(bases[1], "GET", "/v1/models/ctr")[1]
        assert status["model_version"] == versions[-1] and "'abc'" in status["latest_problem"]
        metrics = __import__("urllib.request").request.urlopen(bases[1] + "/metrics").read().decode()
        assert 'streamrec_serving_latest_unusable{model="ctr"} 1.0' in metrics and 'streamrec_serving_pinned_version{model="ctr"} 0.0' in metrics
    finally:
        for node in nodes:
            node.kill()
            node.wait()


def test_compaction_merges_a_chain_into_an_image_that_loads_equal_and_bounds_the_store(tmp_path):
    """compacted/<v> holds v's whole state; loading v or a later version starts there; gc
    counts images as starting points. The expected rows are kept here, independently."""
    ms = ModelStore(str(tmp_path), "ctr")
    writer = VersionWriter(ms)
    g = torch.Generator().manual_seed(0)
    expected: dict[int, torch.Tensor] = {}

    def publish(n: int) -> int:
        keys = torch.randint(0, 60, (25,), generator=g).unique()
        values = torch.randn(len(keys), 4, generator=g)
        gone = torch.tensor([k for k in list(expected)[:3] if k not in keys.tolist()], dtype=torch.int64) if n > 1 else None
        delta = SparseDelta(keys, values) if gone is None else SparseDelta(keys, values, deleted=gone)
        for k in (gone.tolist() if gone is not None else []):
            del expected[k]
        expected.update({int(k): v for k, v in zip(keys, values)})
        return writer.publish("full" if n == 1 else "delta", {"t": delta}, {"t": 4}, dense={"w": torch.full((2,), float(n))},
                              meta={"trained_through_ms": n})

    def assert_loads_expected(version: int, chain: list[int]) -> None:
        loaded = ms.load(version)
        keys, values = loaded.tables["t"]
        assert loaded.chain == chain and loaded.manifest["trained_through_ms"] == version
        assert dict(zip(keys.tolist(), map(tuple, values.tolist()))) == {k: tuple(v.tolist()) for k, v in expected.items()}
        assert loaded.dense["w"].tolist() == [float(version)] * 2

    for n in range(1, 7):
        publish(n)
    assert writer.compact(6) == len(expected) and ms.images() == [6]
    assert ms.manifest(6, image=True)["compacted_chain"] == [1, 2, 3, 4, 5, 6]
    assert_loads_expected(6, [6])
    for n in range(7, 13):
        publish(n)
    assert_loads_expected(12, [6, 7, 8, 9, 10, 11, 12])  # from the image, then the deltas after it
    writer.compact(12)  # incremental: image 6 plus six deltas
    assert ms.manifest(12, image=True)["compacted_chain"] == [6, 7, 8, 9, 10, 11, 12]
    assert_loads_expected(12, [12])
    assert ms.gc(keep_fulls=1) == list(range(1, 12)) and ms.versions() == [12] and ms.images() == [12]
    publish(13)
    assert_loads_expected(13, [12, 13])  # version 12 itself is a delta; its image is the start
    # an image without its manifest (a compactor that died) is not one
    (tmp_path / "ctr" / "compacted" / f"{13:012d}" / "sparse").mkdir(parents=True)
    assert ms.images() == [12] and ms.load(13).chain == [12, 13]


def test_a_missing_delta_strands_no_node_past_the_next_version(published_model, sample_run, tmp_path, batch):
    """A delta deleted from the middle of the chain: a node behind the break keeps serving
    and says why (``latest_problem``), `store verify` names the break, and a trainer that
    resumes on that store publishes a full version first, which the node then serves. The
    chain and the trainer's last checkpoint are copies of the session's (conftest's
    ``published_model``, whose trainer left its work dir next to the store)."""
    shared, versions = published_model
    models = copy_store(shared, tmp_path / "models")
    work = shutil.copytree(shared.parent / "work", tmp_path / "work")
    train = ("train", "--samples", str(sample_run), "--model-store", str(models), "--work-dir", str(work),
             "--publish-interval", "0.2", "--device", "cpu", "--no-announce", "--no-frozen")
    store = ModelStore(str(models), "ctr")
    assert store.versions() == versions and len(versions) >= 4
    assert [store.manifest(v)["kind"] for v in versions[:4]] == ["full", "delta", "delta", "delta"]
    node = ServedModel(ModelStore(str(models), "ctr"))
    node.load(versions[0])
    shutil.rmtree(models / "ctr" / "versions" / f"{versions[2]:012d}")

    node.catch_up()
    assert node.version == versions[1] and node.predict(batch)[0] == versions[1]  # still serving, the newest it can
    assert node.latest_problem and f"LATEST (version {versions[-1]}) cannot be served" in node.latest_problem, node.latest_problem
    verify = cli("store", "verify", "--model-store", str(models))
    assert verify.returncode != 0 and f"version {versions[2]}" in verify.stdout, verify.stdout

    second = cli(*train, "--max-samples", "3000")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "the next version is a full one" in second.stderr
    newer = [v for v in store.versions() if v > versions[-1]]
    assert newer and store.manifest(newer[0])["kind"] == "full", [(v, store.manifest(v)["kind"]) for v in newer]
    node.catch_up()
    assert node.version == store.latest() and node.latest_problem is None
    node.close()


def test_a_trainer_whose_lease_is_taken_over_stops_with_exit_3_and_publishes_nothing_more(sample_run, tmp_path):
    """A trainer frozen past its lease (a long GC pause, a stopped VM) in the middle of a commit
    finds on waking that another writer holds the store: the version it had staged never goes
    into place, it stops with exit 3 and commits nothing more. The freeze lands inside the commit
    every time: the trainer pauses at the staged manifest (tests/pause_points.py), is stopped
    there, and is released once the other writer holds the lease."""
    import signal

    import pause_points

    models, arm_file = tmp_path / "models", tmp_path / "arm"
    proc = subprocess.Popen(pause_points.streamrec_argv(
        "train", "--samples", str(sample_run), "--loop", "--model-store", str(models), "--work-dir", str(tmp_path / "work"),
        "--publish-interval", "0.3", "--device", "cpu", "--no-announce", "--no-frozen"),
        cwd=REPO, env=pause_points.child_env(arm_file, {"STREAMREC_TRAINER__LEASE_S": "2"}),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = ModelStore(str(models), "ctr")
    try:
        deadline = time.monotonic() + 120
        while len(store.versions()) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no versions within 120 s"
            time.sleep(0.1)
        pause_points.arm(arm_file, "manifest")
        staged = pause_points.wait_paused(arm_file, proc)["path"].rsplit("/", 1)[0]
        proc.send_signal(signal.SIGSTOP)  # its lease renewer stops too
        published = store.versions()
        time.sleep(3)  # past its 2 s lease
        usurper = WriterLease(store, str(tmp_path / "usurper"), ttl_s=60).acquire()
        proc.send_signal(signal.SIGCONT)
        pause_points.release(arm_file)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, err[-3000:]
    assert "taken over" in err and "Traceback" not in err, err[-3000:]
    assert store.versions() == published  # the staged version never went into place, nor anything after it
    assert os.path.isdir(staged), "the pause was not inside the commit"
    usurper.release()
