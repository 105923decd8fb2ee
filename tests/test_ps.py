"""The embedding store against a plain dict-of-rows reference, across tiers, and the
model store's publish/load/crash/corruption behaviour. Runs the GPU-cache tier too when
CUDA is present (the same tests, on the `cuda` parameter)."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import pause_points
from streamrec.embedding.hash_index import HashIndex, ReservedKeyError
from streamrec.modelstore.store import CorruptVersion, ModelStore
from streamrec.modelstore.writer import VersionWriter
from streamrec.embedding.optimizers import make_optimizer
from streamrec.embedding.collection import EmbeddingCollection
from streamrec.embedding.table import EmbeddingTable, TableConfig

DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)  # on CUDA: the Triton probe and CAS-insert kernels
def test_hash_index_matches_a_dict_under_random_operations(device):
    rng = random.Random(0)
    index, ref = HashIndex(8, device), {}
    for step in range(300):
        batch = {rng.randrange(-(2**62), 2**62) for _ in range(rng.randrange(0, 200))}
        if ref and step % 2:
            batch |= set(rng.sample(sorted(ref), min(30, len(ref))))
        keys = torch.tensor(sorted(batch), dtype=torch.int64)
        absent = keys[index.lookup(keys).cpu() < 0]
        values = torch.arange(step * 1000, step * 1000 + len(absent))
        index.insert(absent, values)
        ref.update(zip(absent.tolist(), values.tolist()))
        if step % 4 == 0 and ref:
            gone = rng.sample(sorted(ref), min(25, len(ref)))
            assert index.remove(torch.tensor(gone)).tolist() == [ref.pop(k) for k in gone]
        probe = torch.tensor(sorted(ref) + [12345678901], dtype=torch.int64)
        assert index.lookup(probe).tolist() == [ref[k] for k in sorted(ref)] + [(ref.get(12345678901, -1))]
    assert len(index) == len(ref) > 5000
    # a crowded index (long probe chains, many tombstones) still answers exactly
    dense = torch.arange(1, 3000, dtype=torch.int64) << 40  # keys that share low bits
    index.insert(dense[index.lookup(dense).cpu() < 0], torch.arange(len(dense)))
    assert (index.lookup(dense) >= 0).all()


def test_reserved_keys_are_refused():
    with pytest.raises(ReservedKeyError, match="reserved"):
        HashIndex().insert(torch.tensor([-(2**63)]), torch.tensor([0]))


def run_reference_workload(table: EmbeddingTable, optimizer: str, steps: int = 60, seed: int = 1, dim: int = 4):
    """Train ``table`` and a dict-of-rows with the same optimizer on the same random batches;
    check every row find_or_insert returns against the reference before each update."""
    opt = make_optimizer(optimizer, lr=0.1)
    ref: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    g = torch.Generator().manual_seed(seed)
    # the fused Adam kernel (fp32 FMA, pow on the device) drifts ~3e-6 from the CPU formula in 60 steps
    atol = 1e-5 if optimizer == "adam" and table.device.type == "cuda" else 1e-6
    for step in range(steps):
        ids = torch.randint(-400, 400, (96,), generator=g) * 1_000_000_007  # sparse, negative too
        pulled = table.find_or_insert(ids, now_ms=step)
        expected = torch.stack([ref.get(k, (torch.zeros(dim), None))[0] for k in pulled.keys.tolist()])
        torch.testing.assert_close(pulled.rows.cpu(), expected, rtol=0, atol=atol)
        grad = torch.randn(len(pulled.keys), dim, generator=g)
        table.apply_gradients(pulled, grad.to(pulled.rows.device))
        for k, gr in zip(pulled.keys.tolist(), grad):
            w, s = ref.get(k, (torch.zeros(dim), opt.init_state(1, dim, torch.device("cpu"))[0]))
            nw, ns = opt.step(w.unsqueeze(0), s.unsqueeze(0), gr.unsqueeze(0))
            ref[k] = (nw[0], ns[0])
    return ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
@pytest.mark.parametrize("dram_rows", [0, 64])
def test_tiers_match_a_dict_of_rows(tmp_path, device, optimizer, dram_rows):
    cfg = TableConfig("t", 4, optimizer=optimizer, lr=0.1, init_std=0.0, dram_rows=dram_rows,
                      gpu_cache_rows=128 if device == "cuda" else 0)
    table = EmbeddingTable(cfg, device, ssd_dir=tmp_path)
    ref = run_reference_workload(table, optimizer)
    keys = torch.tensor(sorted(ref))
    _, values, absent = table.export(keys)
    assert len(absent) == 0 and len(table) == len(ref)
    torch.testing.assert_close(values, torch.stack([ref[k][0] for k in keys.tolist()]), rtol=0, atol=1e-5 if optimizer == "adam" and device == "cuda" else 1e-6)
    if dram_rows:
        assert table.stats["spilled"] > 0 and table.stats["ssd_reads"] > 0 and table.tiers.ssd.count > 0


def test_spilled_rows_keep_optimizer_state(tmp_path):
    table = EmbeddingTable(TableConfig("t", 2, optimizer="adam", lr=0.1, init_std=0.0, dram_rows=2), ssd_dir=tmp_path)
    first = table.find_or_insert(torch.tensor([7]), now_ms=1)
    table.apply_gradients(first, torch.tensor([[1.0, -1.0]]))
    state_before = table.tiers.dram.state[table.tiers.dram.slots_of(torch.tensor([7]))].clone()
    for t, key in enumerate([8, 9, 10], start=2):  # push key 7 out to SSD
        table.apply_gradients(table.find_or_insert(torch.tensor([key]), now_ms=t), torch.zeros(1, 2))
    assert table.tiers.dram.slots_of(torch.tensor([7])).item() == -1 and table.tiers.ssd.count >= 1
    k, _, state, seen = table.tiers.ssd.get(torch.tensor([7]))
    torch.testing.assert_close(state, state_before)
    assert seen.tolist() == [1]
    table.find_or_insert(torch.tensor([7]), now_ms=9)  # comes back up with its state
    torch.testing.assert_close(table.tiers.dram.state[table.tiers.dram.slots_of(torch.tensor([7]))], state_before)


def test_admission_needs_k_sightings_and_serving_never_admits():
    table = EmbeddingTable(TableConfig("t", 3, admit_after=3, init_std=0.1))
    assert not table.find_or_insert(torch.tensor([42, 42]), now_ms=0).admitted.any()  # seen twice
    assert len(table) == 0 and table.stats["not_admitted"] == 1
    served = table.find(torch.tensor([42]), now_ms=1)  # serving does not count
    assert torch.count_nonzero(served) == 0 and len(table) == 0
    third = table.find_or_insert(torch.tensor([42, 5]), now_ms=2)
    order = third.keys.argsort()  # find_or_insert's key order is the table's business: compare by key
    assert third.keys[order].tolist() == [5, 42] and third.admitted[order].tolist() == [False, True]
    table.apply_gradients(third, torch.ones(2, 3))  # the non-admitted row gets no update and no row
    assert len(table) == 1


def test_expiry_removes_unseen_rows_in_every_tier_and_reports_them(tmp_path):
    table = EmbeddingTable(TableConfig("t", 2, ttl_s=10, dram_rows=3), ssd_dir=tmp_path)
    table.apply_gradients(table.find_or_insert(torch.arange(1, 7), now_ms=0), torch.zeros(6, 2))  # 3 spill to SSD
    _take_delta(table)
    table.apply_gradients(table.find_or_insert(torch.tensor([1, 2]), now_ms=15_000), torch.zeros(2, 2))
    assert table.expire(now_ms=15_000) == 4
    assert len(table) == 2
    keys, values, deleted = _take_delta(table)
    assert sorted(keys.tolist()) == [1, 2] and sorted(deleted.tolist()) == [3, 4, 5, 6]


def _publish(collection: EmbeddingCollection, ms: ModelStore, kind: str, dense: dict | None = None, meta: dict | None = None) -> int:
    """A version of the collection as trainer/publisher.py writes one (snapshot, then write)."""
    return collection.write(VersionWriter(ms), kind, collection.snapshot(kind), dense or {}, meta)


def _take_delta(table: EmbeddingTable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, values, deleted keys) changed since the last call, as a delta snapshot reads them."""
    return table.export(table.tracking.begin_delta().cpu())


def _train(collection: EmbeddingCollection, steps: range, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for step in steps:
        for table in collection.tables.values():
            pulled = table.find_or_insert(torch.randint(0, 400, (64,), generator=g), now_ms=step * 1000)
            table.apply_gradients(pulled, torch.randn(len(pulled.keys), table.config.dim, generator=g))


def _rows(table: EmbeddingTable) -> dict[int, np.ndarray]:
    return {k: v for keys, values in table.export_all() for k, v in zip(keys.tolist(), values.numpy())}


def _assert_loaded_equals(loaded, collection):
    for name, table in collection.tables.items():
        keys, values = loaded.tables[name]
        expected = _rows(table)
        assert sorted(keys.tolist()) == sorted(expected)
        for k, v in zip(keys.tolist(), values):
            np.testing.assert_array_equal(v, expected[k])


def test_publish_load_round_trip_of_full_and_many_deltas(tmp_path):
    configs = [TableConfig("user", 8, ttl_s=6, dram_rows=150), TableConfig("item", 4, optimizer="adam", lr=0.01)]
    collection = EmbeddingCollection(configs, work_dir=tmp_path / "work")
    ms = ModelStore(str(tmp_path / "models"), "ctr")
    for step in range(40):
        _train(collection, range(step, step + 1), seed=step)
        if step % 2 == 1:
            collection["user"].expire(step * 1000)
            kind = "full" if step % 10 == 1 else "delta"
            version = _publish(collection, ms, kind, dense={"mlp.w": torch.full((3, 2), float(step))}, meta={"trained_through_ms": step * 1000})
    loaded = ms.load()
    # 20 publishes; fulls at versions 1, 6, 11, 16: the newest loads as full 16 + deltas 17..20
    assert loaded.version == version == 20 and loaded.chain == [16, 17, 18, 19, 20]
    assert ms.manifest(version)["trained_through_ms"] == 39_000
    _assert_loaded_equals(loaded, collection)
    torch.testing.assert_close(loaded.dense["mlp.w"], torch.full((3, 2), 39.0))
    # an older version still loads to what it was (a delta chain in the middle)
    assert ms.load(12).chain[0] == 11
    removed = ms.gc(keep_fulls=1)
    assert removed == list(range(1, 16)) and ms.load().version == 20


def test_background_publish_writes_the_snapshot_not_later_updates(tmp_path):
    collection = EmbeddingCollection([TableConfig("t", 4)])
    ms = ModelStore(str(tmp_path), "m")
    _train(collection, range(5))
    ms_version = _publish(collection, ms, "full")
    _train(collection, range(5, 8))
    expected = _rows(collection["t"])
    snapshot = collection.snapshot("delta")  # what the publisher does: snapshot between steps, write on the writer thread
    future = collection.writer.submit(collection.write, VersionWriter(ms), "delta", snapshot, {}, None)
    _train(collection, range(8, 20))  # keeps training while the delta is written
    assert future.result(timeout=30) == ms_version + 1
    loaded = ms.load()
    assert {k: v.tolist() for k, v in zip(*loaded.tables["t"])} == {k: v.tolist() for k, v in expected.items()}


def test_corrupt_or_incomplete_versions_are_refused(tmp_path):
    collection = EmbeddingCollection([TableConfig("t", 4)])
    ms = ModelStore(str(tmp_path), "m")
    _train(collection, range(3))
    _publish(collection, ms, "full")
    _train(collection, range(3, 5))
    v2 = _publish(collection, ms, "delta")
    sparse = tmp_path / "m" / "versions" / f"{v2:012d}" / "sparse" / "t.arrow"
    data = bytearray(sparse.read_bytes())
    data[len(data) // 2] ^= 0x01
    sparse.write_bytes(bytes(data))
    with pytest.raises(CorruptVersion, match="fails its checksum"):
        ms.load()
    ms.load(1)  # the parent is still good
    sparse.unlink()
    with pytest.raises(CorruptVersion, match="is missing"):
        ms.load(v2)
    (tmp_path / "m" / "versions" / f"{v2:012d}" / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptVersion, match="not valid JSON"):
        ms.load(v2)
    (tmp_path / "m" / "LATEST").write_text("garbage")
    with pytest.raises(CorruptVersion, match="not a version number"):
        ms.latest()
    with pytest.raises(CorruptVersion, match="no manifest"):
        ms.load(99)


# Publishes 16 MB versions in a loop; the test kills it at a pause point (tests/pause_points.py).
CRASH_WRITER = r"""
import sys, torch
import pause_points
pause_points.install()
from streamrec.contracts.delta import SparseDelta
from streamrec.modelstore.store import ModelStore
from streamrec.modelstore.writer import VersionWriter
writer = VersionWriter(ModelStore(sys.argv[1], "m"))
keys = torch.arange(250_000)
n = 0
while True:
    n += 1
    writer.publish("full" if n == 1 else "delta", {"t": SparseDelta(keys, torch.full((len(keys), 16), float(n)))}, {"t": 16},
                   dense={"d": torch.full((4,), float(n))})
"""


def test_killed_publisher_never_leaves_a_readable_torn_version(tmp_path):
    """SIGKILL inside a later version's write, at each pause point: a torn sparse file, a
    complete staged version not yet renamed, a version in place with LATEST not yet moved."""
    root = str(tmp_path / "models")
    base = tmp_path / "models" / "m"
    arm_file = tmp_path / "arm"
    for point in pause_points.POINTS:
        before = ModelStore(root, "m").versions()
        proc = subprocess.Popen([sys.executable, "-c", CRASH_WRITER, root], env=pause_points.child_env(arm_file))
        deadline = time.monotonic() + 60
        while len(ModelStore(root, "m").versions()) < len(before) + 2:  # a full and a delta by this writer first
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        pause_points.arm(arm_file, point)
        paused = pause_points.wait_paused(arm_file, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

        # the kill left the partial state of its window on disk
        ms = ModelStore(root, "m")
        latest = ms.latest()
        assert os.path.getsize(paused["path"]) == (paused["bytes"] // 2 if point == "sparse" else paused["bytes"])
        if point == "latest":
            assert paused["path"].startswith(str(base / ".LATEST.tmp-"))
            assert ms.versions()[-1] == latest + 1 and latest + 1 not in before  # complete, in place, not yet LATEST
        else:
            staged = Path(paused["path"]).parent.parent if point == "sparse" else Path(paused["path"]).parent
            assert staged.parent == base / "versions" and staged.name.startswith(f".tmp-{latest + 1:012d}-"), paused
            assert (staged / "manifest.json").exists() == (point == "manifest")
            assert ms.versions()[-1] == latest  # the torn or unrenamed version is not listed
        for version in ms.versions():  # every listed version is complete and verifies
            loaded = ms.load(version)
            assert loaded.tables["t"][1].shape == (250_000, 16)
            assert float(loaded.dense["d"][0]) == float(loaded.tables["t"][1][0, 0])
        assert ms.load().version == latest


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_restore_resumes_identically(tmp_path, device):
    configs = [TableConfig("u", 4, optimizer="adam", admit_after=2, dram_rows=80,
                           gpu_cache_rows=256 if device == "cuda" else 0)]
    collection = EmbeddingCollection(configs, device, work_dir=tmp_path / "a")
    _train(collection, range(10))
    collection.checkpoint(tmp_path / "ckpt", extra={"offsets": {"0": 123}})
    restored, extra = EmbeddingCollection.restore(tmp_path / "ckpt", device, work_dir=tmp_path / "b")
    assert extra == {"offsets": {"0": 123}}
    _train(collection, range(10, 20), seed=7)
    _train(restored, range(10, 20), seed=7)
    assert _rows(collection["u"]).keys() == _rows(restored["u"]).keys()
    for k, v in _rows(collection["u"]).items():
        np.testing.assert_allclose(_rows(restored["u"])[k], v, rtol=0, atol=1e-6)
    a, b = _take_delta(collection["u"]), _take_delta(restored["u"])
    assert sorted(a[0].tolist()) == sorted(b[0].tolist())


def test_bad_configurations_are_refused(tmp_path):
    with pytest.raises(ValueError, match="ssd_dir is needed"):
        EmbeddingTable(TableConfig("t", 4, dram_rows=10))
    with pytest.raises(ValueError, match="unknown sparse optimizer"):
        EmbeddingTable(TableConfig("t", 4, optimizer="sgd-ish"))
    with pytest.raises(ValueError, match="invalid table name"):
        TableConfig("../x", 4).validate()
    with pytest.raises(ValueError, match="publish a full version first"):
        VersionWriter(ModelStore(str(tmp_path), "m")).publish("delta", {}, {})
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        EmbeddingCollection.restore(tmp_path)


@pytest.mark.parametrize("device", DEVICES)
def test_lookup_equals_the_general_path_and_never_creates_rows(tmp_path, device):
    """On CUDA this covers the fused probe+gather kernel: hits, misses, evicted rows."""
    table = EmbeddingTable(TableConfig("t", 24, init_std=0.1, gpu_cache_rows=300 if device == "cuda" else 0), device)
    g = torch.Generator().manual_seed(3)
    for step in range(20):  # 1000 keys through a 300-row cache: plenty of evictions
        pulled = table.find_or_insert(torch.randint(0, 1000, (128,), generator=g) * 7919, now_ms=step)
        table.apply_gradients(pulled, torch.randn(len(pulled.keys), 24, generator=g).to(pulled.rows.device))
    rows_before = len(table)
    for step in range(20, 30):
        ids = torch.randint(0, 1100, (256,), generator=g) * 7919  # some never seen
        got = table.find(ids, now_ms=step).cpu()
        present, values, _ = table.export(torch.unique(ids))
        found = torch.isin(ids, present)
        expected = torch.zeros(len(ids), 24)
        expected[found] = values[torch.searchsorted(present, ids[found])]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert len(table) == rows_before
    hot = torch.unique(ids[found])[:100]  # all resident now: the fused path answers alone
    before = table.stats["fused_hits"]
    torch.testing.assert_close(table.find(hot, now_ms=31).cpu(), table.export(hot)[1], rtol=0, atol=0)
    if device == "cuda":
        assert table.stats["fused_hits"] == before + len(hot)
    top = table.tiers.top  # the LRU clock of every row read moved to the lookup's time
    assert top.last_seen[top.slots_of(hot.to(top.device))].eq(31).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_rows", [64, 100_000])
def test_collection_find_or_insert_of_many_tables_matches_a_dict_of_rows(tmp_path, device, cache_rows):
    """EmbeddingCollection.find_or_insert_each: one unique over every table, then (on CUDA, while the cache holds
    every row) the find-or-insert kernel, with duplicate ids within and across tables;
    a 64-row cache forces evictions and the general path."""
    dim, opt = 4, make_optimizer("adagrad", lr=0.1)
    configs = [TableConfig(n, dim, lr=0.1, init_std=0.0, gpu_cache_rows=cache_rows if device == "cuda" else 0)
               for n in ("a", "b", "c")]
    collection = EmbeddingCollection(configs, device, work_dir=tmp_path)
    refs: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {n: {} for n in ("a", "b", "c")}
    g = torch.Generator().manual_seed(5)
    for step in range(40):
        shared = torch.randint(-50, 50, (40,), generator=g) * 1_000_003
        ids = {"a": torch.cat([shared, shared]),  # every id twice
               "b": torch.randint(-30, 30, (64,), generator=g) * 7,
               "c": shared[:0] if step % 5 == 0 else shared}  # sometimes empty
        pulled = collection.find_or_insert_each(ids, now_ms=step)
        for name, p in pulled.items():
            ref = refs[name]
            assert torch.equal(p.keys.cpu(), torch.unique(ids[name]))
            expected = torch.stack([ref.get(k, (torch.zeros(dim), None))[0] for k in p.keys.tolist()]) if len(p.keys) \
                else torch.zeros(0, dim)
            torch.testing.assert_close(p.embeddings().cpu(), expected[p.inverse.cpu()], rtol=0, atol=1e-6)
            grad = torch.randn(len(p.keys), dim, generator=g)
            collection[name].apply_gradients(p, grad.to(p.rows.device))
            for k, gr in zip(p.keys.tolist(), grad):
                w, s = ref.get(k, (torch.zeros(dim), opt.init_state(1, dim, torch.device("cpu"))[0]))
                nw, ns = opt.step(w.unsqueeze(0), s.unsqueeze(0), gr.unsqueeze(0))
                ref[k] = (nw[0], ns[0])
    for name, ref in refs.items():
        keys = torch.tensor(sorted(ref))
        _, values, absent = collection[name].export(keys)
        assert len(absent) == 0 and len(collection[name]) == len(ref)
        torch.testing.assert_close(values.cpu(), torch.stack([ref[k][0] for k in keys.tolist()]), rtol=0, atol=1e-6)
    if device == "cuda" and cache_rows > 1000:  # every row was created by the kernel, none evicted
        assert collection["a"].tiers.cache_complete and collection["a"].stats["created"] == len(refs["a"])


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_optimizers_follow_torch_optim_on_a_dense_copy(device):
    """Row-wise semantics, checked against formulas that do not use embedding/optimizers.py:
    - Adam is lazy: a row's moments and step count advance only in batches that contain it,
      i.e. each row behaves as its own torch.optim.Adam stepped only when present;
    - Adagrad keeps one accumulator per row, the running sum of the row's mean squared
      gradient: w -= lr * g / (sqrt(acc) + eps) (FBGEMM's row-wise Adagrad)."""
    rows, dim, steps, lr = 40, 8, 12, 0.05
    g = torch.Generator().manual_seed(11)
    init = torch.randn(rows, dim, generator=g)
    for name in ("adam", "adagrad"):
        table = EmbeddingTable(TableConfig("t", dim, optimizer=name, lr=lr, gpu_cache_rows=1024 if device == "cuda" else 0),
                               device)
        keys = torch.arange(rows, dtype=torch.int64) * 104729
        table.load_rows(keys, init)
        params = [torch.nn.Parameter(init[r].clone()) for r in range(rows)]
        if name == "adam":
            optims = [torch.optim.Adam([p], lr=lr, betas=(0.9, 0.999), eps=1e-8) for p in params]
        acc = [0.0] * rows
        for step in range(steps):
            present = torch.nonzero(torch.rand(rows, generator=g) < 0.6).squeeze(1)
            grad = torch.randn(len(present), dim, generator=g)
            pulled = table.find_or_insert(keys[present], now_ms=step)
            order = torch.searchsorted(keys[present].to(pulled.keys.device), pulled.keys)  # pulled keys are sorted
            table.apply_gradients(pulled, grad[order.cpu()].to(pulled.rows.device))
            for j, r in enumerate(present.tolist()):
                if name == "adam":
                    params[r].grad = grad[j].clone()
                    optims[r].step()
                else:
                    acc[r] += float((grad[j] ** 2).mean())
                    with torch.no_grad():
                        params[r] -= lr * grad[j] / (acc[r] ** 0.5 + 1e-8)
        _, values, absent = table.export(keys)
        assert len(absent) == 0
        # float32 against torch.optim (bias corrections in double): 1e-5 is ~1e-4 of one step
        torch.testing.assert_close(values.cpu(), torch.stack([p.detach() for p in params]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_lookups_stay_exact_while_another_thread_evicts(device):
    """Serving's pattern: fused lookups under the shared side of the lock, the general path
    (which evicts cache rows) under the exclusive side, from several threads at once. The
    cache holds 400 of 3000 rows, so lookups keep evicting (on CPU, with ``cpu_cache``, by
    the host paths; there is no fused path there, so every lookup takes the exclusive side)."""
    import threading

    from streamrec.plumbing.locks import RWLock

    dim, n = 8, 3000
    table = EmbeddingTable(TableConfig("t", dim, gpu_cache_rows=400, cpu_cache=True), device)
    keys = torch.arange(1, n + 1, dtype=torch.int64) * 7919
    values = torch.arange(n * dim, dtype=torch.float32).reshape(n, dim)
    table.load_rows(keys, values)
    guard, errors = RWLock(), []

    def reader(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        try:
            for step in range(60):
                idx = torch.randint(0, n + 200, (256,), generator=g)  # some ids have no row
                ids = torch.where(idx < n, idx + 1, idx + 10**6) * 7919
                with guard.read():
                    started = table.find_start(ids, step)
                    got = started[0] if started is not None and int(started[1].item()) == 0 else None
                if got is None:
                    with guard.write():
                        got = table.find_slow(ids, step)
                expected = torch.where((idx < n).unsqueeze(1), values[idx.clamp(max=n - 1)], torch.zeros(1, dim))
                torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(table) == n
    # the lookups did run through a full cache: rows were evicted and cached rows were hit
    assert len(table.tiers.cache) == 400 and table.stats["evicted"] > 1000 and table.stats["cache_hits"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_unique_per_group_equals_torch_unique_of_each_group(device):
    from streamrec.embedding.unique import unique_per_group

    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        groups = [(torch.randint(-6, 6, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g) * 10**12).to(device)
                  for _ in range(int(torch.randint(1, 6, (1,), generator=g)))]
        for ids, (keys, inverse, counts) in zip(groups, unique_per_group(groups)):
            expected = torch.unique(ids, return_inverse=True, return_counts=True)
            for got, want in zip((keys, inverse, counts), expected):
                assert torch.equal(got, want), (ids, got, want)


def test_ssd_tier_keeps_its_row_count_and_expires_by_clock_alone(tmp_path):
    """The SSD tier opens without counting its keys (the count is stored with every write),
    and expiry reads only the rows older than the cutoff (a time-ordered column family)."""
    from streamrec.embedding.ssd import SsdTier

    ssd = SsdTier(tmp_path / "t", dim=2, state_dim=1)
    keys = torch.arange(1, 1001, dtype=torch.int64) * 7919
    ssd.put(keys, torch.randn(1000, 2), torch.zeros(1000, 1), torch.arange(1000, dtype=torch.int64))
    ssd.put(keys[:100], torch.ones(100, 2), torch.ones(100, 1), torch.full((100,), 5000, dtype=torch.int64))  # overwrite: newer clock
    taken = ssd.take(torch.cat([keys[100:150], torch.tensor([123456789])]))  # 50 present, one absent
    assert len(taken[0]) == 50 and ssd.count == 950
    ssd.close()
    ssd = SsdTier(tmp_path / "t", dim=2, state_dim=1)
    assert ssd.count == 950 == sum(len(chunk[0]) for chunk in ssd.items())
    expired = ssd.expire(cutoff=600)  # clocks 150..599 of the untouched rows; the overwritten 100 are at 5000
    assert sorted(expired.tolist()) == sorted(keys[150:600].tolist())
    assert ssd.count == 500 and ssd.expire(cutoff=600).numel() == 0
    k, w, _, seen = ssd.get(keys[:100])
    assert len(k) == 100 and bool((seen == 5000).all()) and bool((w == 1).all())
    ssd.close()


def test_spill_cost_follows_the_rows_spilled_not_the_dram_size(tmp_path):
    table = EmbeddingTable(TableConfig("t", 4, dram_rows=50_000), ssd_dir=tmp_path)
    keys = torch.arange(1, 50_001, dtype=torch.int64) * 104729
    table.load_rows(keys, torch.randn(50_000, 4), last_seen=torch.arange(50_000, dtype=torch.int64))
    examined = table.placement.spill_clock.examined
    for step in range(10):  # 100 new rows a batch into a full DRAM tier
        table.find_or_insert(torch.arange(100, dtype=torch.int64) + 10**12 + step * 100, now_ms=10**6 + step)
    assert table.stats["spilled"] == 1000 and len(table.tiers.dram) == 50_000 and table.tiers.ssd.count == 1000
    assert table.placement.spill_clock.examined - examined <= 10 * 2 * max(100 * table.placement.spill_clock.sample, table.placement.spill_clock.min_window)
    rows_before = len(table)
    assert rows_before == 51_000  # nothing lost between the tiers


@pytest.mark.parametrize("device", DEVICES)
def test_warming_the_cache_keeps_each_rows_clock(device):
    """Serving warms the cache after loading a version: rows come up with the clocks they
    had (LRU order and expiry stay right), and lookups then hit the cache alone (on CUDA
    the fused path; on CPU, with ``cpu_cache``, the general path, which brings nothing up)."""
    table = EmbeddingTable(TableConfig("t", 4, gpu_cache_rows=1000, cpu_cache=True), device)
    keys = torch.arange(1, 301, dtype=torch.int64) * 7919
    table.load_rows(keys, torch.randn(300, 4), last_seen=torch.arange(1000, 1300, dtype=torch.int64))
    cache = table.tiers.cache
    assert len(cache) == 0 and not table.tiers.cache_complete  # loaded rows live in DRAM alone
    table.placement.warm(keys)
    assert cache.last_seen[cache.slots_of(keys.to(cache.device))].cpu().tolist() == list(range(1000, 1300))
    assert table.tiers.cache_complete and len(cache) == 300
    hits = "fused_hits" if device == "cuda" else "cache_hits"
    before = dict(table.stats)
    torch.testing.assert_close(table.find(keys, now_ms=2000).cpu(), table.export(keys)[1], rtol=0, atol=0)
    assert table.stats[hits] == before[hits] + 300 and table.stats["evicted"] == before["evicted"] == 0


def test_warmed_rows_leave_a_cpu_cache_in_the_order_of_their_clocks():
    """Warming fills the cache with rows at the clocks they had; rows that need room later
    evict the least recently seen by those clocks, and an evicted row takes its value (a
    trained, dirty row's new one) and the clock lookups gave it down to DRAM. (The host
    bring-up and eviction paths of a cache, on CPU.)"""
    g = torch.Generator().manual_seed(5)
    table = EmbeddingTable(TableConfig("t", 4, lr=0.1, gpu_cache_rows=200, cpu_cache=True), "cpu")
    keys = torch.arange(1, 301, dtype=torch.int64) * 7919
    values = torch.randn(300, 4, generator=g)
    clocks = 1000 + torch.randperm(300, generator=g)  # LRU order unrelated to key or slot order
    table.load_rows(keys, values, last_seen=clocks)
    cache, dram = table.tiers.cache, table.tiers.dram

    def rows_of(ks: torch.Tensor) -> torch.Tensor:
        return values[torch.searchsorted(keys, ks)]

    assert table.placement.warm(keys) == 200  # as many as the cache has room for
    warmed, warmed_clocks = keys[:200], clocks[:200]
    assert cache.last_seen[cache.slots_of(warmed)].tolist() == warmed_clocks.tolist()
    assert not table.tiers.cache_complete  # 100 rows are in DRAM alone
    # the 20 coldest warmed rows are trained now (seen at 5000, new values in the cache alone)
    seen = warmed[torch.argsort(warmed_clocks)[:20]]
    pulled = table.find_or_insert(seen, now_ms=5000)
    torch.testing.assert_close(pulled.rows, rows_of(pulled.keys), rtol=0, atol=0)
    table.apply_gradients(pulled, torch.randn(20, 4, generator=g))
    trained = torch.searchsorted(keys, pulled.keys)
    values[trained] = cache.weights[pulled.slots]
    assert not torch.equal(dram.weights[dram.slots_of(pulled.keys)], values[trained])  # DRAM's copy is stale
    # the 100 DRAM-only rows need room: out go the 100 coldest warmed rows by the clocks warming kept
    torch.testing.assert_close(table.find(keys[200:], now_ms=6000), values[200:], rtol=0, atol=0)
    rest = ~torch.isin(warmed, seen)
    coldest = warmed[rest][torch.argsort(warmed_clocks[rest])[:100]]
    assert table.stats["evicted"] == 100 and table.stats["cache_hits"] == 20  # the trained rows hit; these 100 missed
    assert set(cache.keys[cache.live_slots()].tolist()) == set(keys.tolist()) - set(coldest.tolist())
    torch.testing.assert_close(table.export(keys)[1], values, rtol=0, atol=0)  # every row, wherever it is
    # the evicted rows come back on their next lookup, evicting the 80 warmed rows never seen
    # again, then the 20 trained at 5000: their values and clock go down to DRAM with them
    torch.testing.assert_close(table.find(coldest, now_ms=7000), rows_of(coldest), rtol=0, atol=0)
    assert table.stats["evicted"] == 200
    assert set(cache.keys[cache.live_slots()].tolist()) == set(keys[200:].tolist()) | set(coldest.tolist())
    assert dram.last_seen[dram.slots_of(seen)].tolist() == [5000] * 20
    torch.testing.assert_close(dram.weights[dram.slots_of(pulled.keys)], values[trained], rtol=0, atol=0)
    torch.testing.assert_close(table.export(keys)[1], values, rtol=0, atol=0)


def _rows_with_state(table: EmbeddingTable) -> dict[int, tuple[list, list, int]]:
    """key -> (weights, state, last_seen) over every tier (export_all lists each key once)."""
    out = {}
    for keys, w, s, t in table.export_all(with_state=True, chunk=37):  # small chunks: many per tier
        for k, wi, si, ti in zip(keys.tolist(), w.tolist(), s.tolist(), t.tolist()):
            assert k not in out, f"key {k} listed twice"
            out[k] = (wi, si, ti)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_clock_spill_keeps_a_dict_of_rows_exact_with_dram_far_below_the_working_set(tmp_path, device):
    """801 keys through 40 DRAM rows: rows spill every batch, come back from SSD with their
    optimizer state, and weights and state equal a dict-of-rows reference at every find_or_insert."""
    cfg = TableConfig("t", 4, optimizer="adam", lr=0.1, init_std=0.0, dram_rows=40,
                      gpu_cache_rows=128 if device == "cuda" else 0)
    table = EmbeddingTable(cfg, device, ssd_dir=tmp_path)
    index_slots = [tier.index.slots for tier in (table.tiers.dram, table.tiers.cache) if tier is not None]
    ref = run_reference_workload(table, "adam", steps=80)
    assert table.stats["spilled"] > 2000 and table.stats["ssd_reads"] > 1000
    # the budgeted tiers' indexes were rebuilt in place through the churn, never grown
    assert [tier.index.slots for tier in (table.tiers.dram, table.tiers.cache) if tier is not None] == index_slots
    assert len(table) == len(ref) == len(table.tiers.dram) + table.tiers.ssd.count + table.tiers.cache_only()
    rows = _rows_with_state(table)
    assert sorted(rows) == sorted(ref)
    for k, (w, s) in ref.items():
        tol = 1e-5 if device == "cuda" else 1e-6  # the fused Adam kernel rounds differently from torch on CPU
        torch.testing.assert_close(torch.tensor(rows[k][0]), w, rtol=0, atol=tol)
        torch.testing.assert_close(torch.tensor(rows[k][1]), s, rtol=0, atol=tol)
    # each spill read a bounded number of slots per row spilled, never all of DRAM
    clock = table.placement.spill_clock
    assert clock.examined <= table.stats["spilled"] * clock.sample + 80 * 2 * clock.min_window


def test_incremental_expiry_deletes_exactly_the_stale_rows_of_dram_and_ssd(tmp_path):
    table = EmbeddingTable(TableConfig("t", 2, ttl_s=10, dram_rows=100), ssd_dir=tmp_path)
    g = torch.Generator().manual_seed(4)
    seen: dict[int, int] = {}
    for step in range(40):  # 400 keys, 24 per batch, clock 1 s a step: most rows end on SSD
        now = step * 1000
        pulled = table.find_or_insert(torch.randint(0, 400, (24,), generator=g) * 7919 + 1, now_ms=now)
        table.apply_gradients(pulled, torch.randn(len(pulled.keys), 2, generator=g))
        seen.update({k: now for k in pulled.keys.tolist()})
    _take_delta(table)
    assert table.tiers.ssd.count > 200
    now = 48_000  # cutoff 38 s: rows last seen at steps 0..37 expire (DRAM holds the last ~5 steps)
    stale = {k for k, t in seen.items() if t < now - 10_000}
    on_ssd = stale & set(table.tiers.ssd.get(torch.tensor(sorted(stale)))[0].tolist())
    assert on_ssd and stale - on_ssd  # both tiers have rows to expire
    assert table.expire(now) == len(stale)
    assert len(table) == len(seen) - len(stale) == len(table.tiers.dram) + table.tiers.ssd.count
    _, _, absent = table.export(torch.tensor(sorted(seen)))
    assert set(absent.tolist()) == stale
    keys, _, deleted = _take_delta(table)
    assert set(deleted.tolist()) == stale and len(keys) == 0
    assert table.expire(now) == 0  # nothing older is left: the next expiry finds nothing
    assert sorted(table.tiers.ssd.expire(now).tolist()) == []


def test_checkpoint_of_a_table_across_dram_and_ssd_restores_every_row_exactly(tmp_path):
    """The checkpoint streams tier by tier in chunks; restore reads it batch by batch.
    Every row comes back with its weights, optimizer state and clock."""
    import pyarrow.ipc as ipc

    collection = EmbeddingCollection([TableConfig("u", 4, optimizer="adam", dram_rows=50, ttl_s=1000)], work_dir=tmp_path / "a")
    _train(collection, range(30))
    table = collection["u"]
    assert table.tiers.ssd.count > 100 and len(table.tiers.dram) > 0
    expected = _rows_with_state(table)
    collection.checkpoint(tmp_path / "ckpt")
    assert ipc.open_file(str(tmp_path / "ckpt" / "u.arrow")).num_record_batches >= 2  # one per tier at least
    restored, _ = EmbeddingCollection.restore(tmp_path / "ckpt", work_dir=tmp_path / "b")
    assert restored["u"].tiers.ssd.count > 0  # the restored table spans both tiers again
    assert _rows_with_state(restored["u"]) == expected
    collection.close()
    restored.close()


def test_a_reopened_ssd_tier_counts_its_rows_without_a_scan(tmp_path):
    """The count is read from the tier (stored with each write), right after puts of new
    keys, overwrites, takes, expiry and reopening; a table reopened over its SSD directory
    has exactly those rows."""
    from streamrec.embedding.ssd import SsdTier

    table = EmbeddingTable(TableConfig("t", 3, dram_rows=20), ssd_dir=tmp_path)
    table.load_rows(torch.arange(1, 201) * 31, torch.randn(200, 3))
    table.load_rows(torch.arange(1, 51) * 31, torch.ones(50, 3))  # overwrite rows that live on SSD
    table.erase(torch.arange(151, 171) * 31)
    on_ssd = table.tiers.ssd.count
    assert on_ssd == 180 - len(table.tiers.dram)
    table.close()
    reopened = EmbeddingTable(TableConfig("t", 3, dram_rows=20), ssd_dir=tmp_path)
    assert reopened.tiers.ssd.count == len(reopened) == on_ssd
    assert sum(len(chunk[0]) for chunk in reopened.tiers.ssd.items()) == on_ssd
    reopened.close()
    with pytest.raises(ValueError, match="without a time index"):  # the tier of a table without expiry
        SsdTier(tmp_path / "t", dim=3, state_dim=1, by_time=True)


@pytest.mark.parametrize("device", DEVICES)
def test_removing_a_key_twice_in_one_call_frees_its_row_once(tmp_path, device):
    """A slot freed twice would be handed to two new keys: both would then read one row."""
    table = EmbeddingTable(TableConfig("t", 2, dram_rows=100, gpu_cache_rows=64 if device == "cuda" else 0), device, ssd_dir=tmp_path)
    table.find_or_insert(torch.arange(1, 41, device=device), now_ms=1)
    table.erase(torch.tensor([3, 3, 5, 5, 5, 7]))
    assert len(table) == 37
    fresh = torch.arange(1000, 1010, device=device)
    pulled = table.find_or_insert(fresh, now_ms=2)
    table.apply_gradients(pulled, torch.arange(20, dtype=torch.float32).reshape(10, 2).to(device))
    _, rows, absent = table.export(fresh.cpu())
    assert len(absent) == 0 and len({tuple(r) for r in rows.tolist()}) == 10  # ten distinct rows, not shared slots
    assert len(table) == 47


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reserved_keys_are_refused_on_the_device_path():
    from streamrec.embedding.hash_layout import EMPTY, TOMBSTONE

    table = EmbeddingTable(TableConfig("t", 4, gpu_cache_rows=1024), "cuda")
    assert table.tiers.cache_complete
    for key in (EMPTY, TOMBSTONE):
        with pytest.raises(ReservedKeyError):
            table.find_or_insert(torch.tensor([5, key], device="cuda"), now_ms=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_grouped_pull_and_push_follow_a_dict_of_rows(optimizer, monkeypatch):
    """Three tables in one find-or-insert and one optimizer launch (embedding/grouped.py): ids
    repeated within a batch and shared between tables, rows created once per table, hits
    read what the table holds, and the update follows the formula written here (row-wise
    Adagrad: the accumulator adds the mean squared gradient; lazy Adam: per-row step count)."""
    from streamrec.embedding.grouped import find_or_insert_grouped, apply_gradients_grouped

    names, lr, eps = ("a", "b", "c"), 0.1, 1e-8
    monkeypatch.setattr(EmbeddingTable, "apply_gradients", lambda *_: pytest.fail("the grouped apply_gradients went table by table"))
    collection = EmbeddingCollection([TableConfig(n, 16, optimizer=optimizer, lr=lr, gpu_cache_rows=60_000) for n in names], "cuda")
    ref: dict[tuple[str, int], list] = {}  # (table, key) -> [weights, state...]
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        ids = {n: torch.randint(0, 3000 * (i + 1), (4000 + 1500 * i,), generator=g) for i, n in enumerate(names)}
        grouped = find_or_insert_grouped(collection.tables, {n: t.cuda() for n, t in ids.items()}, now_ms=step)
        assert grouped is not None
        embeddings = grouped.rows.index_select(0, grouped.inverse).split(grouped.id_counts)
        for name, emb in zip(names, embeddings):
            pulled = grouped.by_table[name]
            assert torch.equal(pulled.keys.cpu(), torch.unique(ids[name]))
            for key, row in zip(pulled.keys.tolist(), pulled.rows.cpu()):
                if (name, key) in ref:
                    assert torch.allclose(row, ref[(name, key)][0], atol=1e-5, rtol=1e-4), (name, key)  # fp32 pow vs double
                else:
                    assert 0 < float(row.abs().sum()) and float(row.abs().max()) < 0.1  # N(0, 0.01), once
                    ref[(name, key)] = [row.clone(), torch.zeros(1), torch.zeros(16), torch.zeros(16), 0]
            rows_by_key = {k: r for k, r in zip(pulled.keys.tolist(), pulled.rows.cpu())}
            assert all(torch.equal(e, rows_by_key[k]) for k, e in zip(ids[name][:50].tolist(), emb[:50].cpu()))
            assert len(collection.tables[name]) == len({k for t, k in ref if t == name})
        grad = torch.randn(len(grouped.rows), 16, generator=g)
        apply_gradients_grouped(grouped, grad.cuda())
        first = 0
        for name, n in zip(names, grouped.key_counts):
            for key, gr in zip(grouped.by_table[name].keys.tolist(), grad[first:first + n]):
                w, acc, m, v, t = ref[(name, key)]
                if optimizer == "adagrad":
                    acc = acc + gr.pow(2).mean()
                    w = w - lr * gr / (acc.sqrt() + eps)
                else:
                    t += 1
                    m, v = 0.9 * m + 0.1 * gr, 0.999 * v + 0.001 * gr * gr
                    w = w - lr * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.999 ** t)).sqrt() + eps)
                ref[(name, key)] = [w, acc, m, v, t]
            first += n
    for name in names:
        keys = [k for t, k in ref if t == name]
        _, rows, absent = collection.tables[name].export(torch.tensor(keys))
        assert len(absent) == 0
        assert torch.allclose(rows, torch.stack([ref[(name, k)][0] for k in keys]), atol=1e-5, rtol=1e-4)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_collection_find_reads_every_table_in_one_launch_as_each_tables_find_does(monkeypatch):
    """EmbeddingCollection.find's table-batched probe + gather (grouped.find_start_grouped)
    against EmbeddingTable.find on an identical collection: tables of different cache and
    index sizes, some with rows in DRAM below a small cache (those take find_slow), one empty;
    unknown ids (zeros) and repeated ids, in host memory and on the device. The same rows
    read, stats, and rows and clocks after; one launch a read; a table of another row width
    sends the read table by table."""
    from streamrec.embedding import kernels
    from streamrec.embedding.grouped import find_start_grouped

    dim = 8
    tables = {"a": (4096, 1000), "b": (64, 600), "c": (50_000, 20_000), "d": (128, 0), "e": (16, 200)}  # cache rows, rows
    per_read = {"a": 300, "b": 30, "c": 2000, "d": 50, "e": 8}  # ids per read (some unknown, some repeated)

    def build() -> EmbeddingCollection:
        collection = EmbeddingCollection([TableConfig(n, dim, gpu_cache_rows=c) for n, (c, _) in tables.items()], "cuda")
        for i, (name, (_, rows)) in enumerate(tables.items()):
            if rows:
                keys = torch.arange(rows, dtype=torch.int64) * 7919 + i
                collection[name].upsert(keys, torch.randn(rows, dim, generator=torch.Generator().manual_seed(i)), fresh=True)
        return collection

    def rows_of(table: EmbeddingTable) -> dict[int, tuple[list[float], int]]:
        return {k: (w, t) for chunk in table.export_all(with_state=True)
                for k, w, t in zip(chunk[0].tolist(), chunk[1].tolist(), chunk[3].tolist())}

    grouped, reference = build(), build()
    launches = []
    grouped_kernel = kernels.probe_gather_grouped
    monkeypatch.setattr(kernels, "probe_gather_grouped", lambda *a, **k: launches.append(1) or grouped_kernel(*a, **k))
    for table in grouped.tables.values():
        monkeypatch.setattr(table, "find_start", lambda *_: pytest.fail("the grouped find went table by table"))
    assert [t.tiers.cache_complete for t in grouped.tables.values()] == [True, False, True, True, False]
    g = torch.Generator().manual_seed(11)
    for step in range(8):
        ids = {}
        for i, (name, (_, rows)) in enumerate(tables.items()):
            x = torch.randint(0, rows + 40, (per_read[name] // 2,), generator=g) * 7919 + i  # past ``rows``: unknown
            ids[name] = torch.cat([x, x.flip(0)[: per_read[name] - len(x)]])
        if step % 2:
            ids = {name: x.cuda() for name, x in ids.items()}
        got = grouped.find(ids, now_ms=100 + step)
        assert len(launches) == step + 1
        for name, x in ids.items():
            want = reference[name].find(x, now_ms=100 + step)
            assert torch.equal(got[name], want), (step, name)
            assert not bool(want[(x.cpu() >= tables[name][1] * 7919).to(want.device)].any())  # unknown ids read zeros
    for name in tables:
        assert grouped[name].stats == reference[name].stats, name
        assert rows_of(grouped[name]) == rows_of(reference[name]), name
    assert grouped["a"].stats["fused_hits"] > 0 and grouped["b"].stats["lookups"] > 0  # both paths were taken
    mixed = EmbeddingCollection([TableConfig("a", 8, gpu_cache_rows=64), TableConfig("b", 16, gpu_cache_rows=64)], "cuda")
    assert find_start_grouped(mixed.tables, {"a": torch.arange(3), "b": torch.arange(3)}, 1) is None
    for collection in (grouped, reference, mixed):
        collection.close()


def test_a_grouped_launch_gives_each_table_its_own_programs():
    """The layout grouped kernels read: each group's first row, rows and first program, no
    program shared by two groups, an empty group taking none (it shares the next one's start)."""
    from streamrec.embedding.kernels import group_blocks

    assert group_blocks([5, 0, 130, 64], 64) == ([(0, 5, 0), (5, 0, 1), (5, 130, 1), (135, 64, 4)], 5)
    assert group_blocks([], 64) == ([], 0)
